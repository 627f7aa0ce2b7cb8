// test_hooks.h: points where tests make the pipeline's workers fail, hang or run slowly.
//
// The shipped binary installs none and reads nothing from the environment for them: only the
// test build of the daemon (tests/faulty_daemon_hooks.cc, linked into `dflashd_faulty`) fills
// them in, and unit tests pass them to the Trainer directly. Each hook runs on the worker's own
// thread, inside that worker's stage clock (time it spends counts as that role's work), inside
// the worker's failure policy (an exception it throws is handled like one from the model).
#pragma once

#include <cstdint>
#include <functional>

namespace dflash::pipeline {

struct TestHooks {
  // Target worker, before the forward of sample number `sample` (counting across epochs).
  std::function<void(int64_t sample)> target_forward;
  // Drafter worker of replica `replica` in plan step `step`, once the step's loss denominator
  // is agreed and before its forward (the other replicas then wait in the gradient sum).
  std::function<void(int replica, int64_t step)> drafter_step;
};

// The hooks of this build of the daemon: none in `dflashd`; the test build's are read from
// its environment (tests/faulty_daemon_hooks.cc says which variables).
TestHooks test_hooks_of_this_build();

}  // namespace dflash::pipeline
