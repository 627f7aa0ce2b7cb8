// trainer.h: the training pipeline (docs/architecture.md "Data flow"):
//
//   reader thread -> [sample queue] -> target workers (one per target replica)
//                 -> [feature queue per drafter replica] -> drafter workers (one per replica,
//                    data parallel: loss denominator and gradients summed across replicas)
//
// Which samples an optimizer step consumes is a pure function of the step (StepPlan), anchors
// are drawn from a generator seeded by (train.seed, sample number), and checkpoints hold the
// fp32 master weights and optimizer state: a run resumed from its newest checkpoint continues
// exactly where the uninterrupted run would be (bit-identical on CPU).
//
// Threads and ordering: samples and features cross threads only through the bounded queues
// (push happens-before pop). Features computed on a target GPU are copied to the drafter
// replica's device on the target worker's stream and marked with a CUDA event; the drafter's
// stream waits for that event before its kernels read them (streams.h).
//
// The pieces, one concern each: replicas.h (the models on their devices), drafter_step.h (one
// optimizer step), collective.h (the replicas' sums), run_metrics.h (metrics and log lines),
// checkpointer.h (cadence, state, resume), workers.h (threads, heartbeats), failed_samples.h.
// The Trainer itself: trainer_impl.h (its state), trainer_setup.cc, trainer_stages.cc, trainer.cc.
//
// Failures: an exception in a worker (including CUDA out-of-memory) is logged with the worker
// and the sample or step, counted, shown on /healthz, and handled by workers.on_failure:
// "restart" retries the same unit of work up to workers.max_restarts times, "stop" (or running
// out of restarts) stops the run with a checkpoint of the last completed step. A worker whose
// heartbeat is older than workers.stall_seconds is stalled: the run stops as after a failure
// (NCCL communicators aborted, the last complete step checkpointed where possible, exit 1, see
// wait()). A sample that failed workers.skip_sample_after_failures times (counted across
// restarts, in the checkpoint) is skipped and counted. Non-finite gradients skip
// the step (counted) or stop the run (train.on_nonfinite).
//
// Lifecycle: start() spawns the threads; the owner calls supervise() periodically from its own
// loop (stall detection, metrics, the headline log line) and request_stop() on SIGTERM (the
// in-flight step finishes, a checkpoint is written); wait() joins and says how it ended.
#pragma once

#include <prometheus/registry.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>

#include "common/health.h"
#include "config/config.h"
#include "pipeline/test_hooks.h"

namespace dflash::pipeline {

enum class Outcome { finished, stopped, failed };

class Trainer {
 public:
  // Loads the target, builds the drafter replicas, opens the data, resumes from a checkpoint
  // (checkpoint.resume). Throws std::runtime_error with a clear message on bad input.
  // `hooks`: test hooks (none in the shipped daemon).
  Trainer(const config::Config& config, prometheus::Registry& registry, std::shared_ptr<Health> health,
          TestHooks hooks = {});
  ~Trainer();

  void start();
  // Call every few hundred milliseconds from the owner's thread.
  void supervise();
  void request_stop();
  // True once the run finished or failed: then call wait().
  bool done() const;
  // Joins the workers and writes the final checkpoint. After a failure, workers that do not
  // leave within min(workers.stall_seconds, 60 s) (stuck in a CUDA or NCCL call) are given up:
  // the checkpoint is written if replica 0 left, and abandoned() turns true.
  Outcome wait();
  // wait() left stuck worker threads running: the owner must end the process (std::_Exit)
  // without destroying the Trainer, which they still use.
  bool abandoned() const;
  std::string failure() const;   // why the run failed ("" otherwise)
  std::string status() const;    // a one-line summary (for systemd STATUS=)
  int64_t step() const;          // completed plan steps

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::pipeline
