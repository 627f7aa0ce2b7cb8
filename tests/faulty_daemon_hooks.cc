// The test build of the daemon (`dflashd_faulty`): the same program as `dflashd`, with the
// pipeline's test hooks (pipeline/test_hooks.h) read from its environment. Tests start it as a
// process to see the whole daemon's answer to a failure: exit code, log, checkpoint, /healthz.
//
//   DFLASHD_TEST_FAULT=target:Q[:always]        the target worker throws on sample number Q
//                                                (once per process, or every time)
//   DFLASHD_TEST_FAULT=drafter:R:S[:always]     drafter replica R throws at plan step S
//   DFLASHD_TEST_HANG=drafter:R:S               drafter replica R blocks at step S for ever
//                                                (no heartbeat), as a worker stuck in a
//                                                CUDA or NCCL call does
//   DFLASHD_TEST_SLOW=ROLE:MS[,ROLE:MS]          every target forward / drafter step of that
//                                                role takes MS milliseconds longer
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "pipeline/test_hooks.h"

namespace dflash::pipeline {
namespace {

std::vector<std::string> split(const std::string& text, char separator) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  for (std::string part; std::getline(in, part, separator);) parts.push_back(part);
  return parts;
}

std::string env(const char* name) {
  const char* value = std::getenv(name);
  return value ? value : "";
}

void sleep_ms(int64_t ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

TestHooks test_hooks_of_this_build() {
  TestHooks hooks;
  int64_t target_slow_ms = 0, drafter_slow_ms = 0;
  for (const std::string& item : split(env("DFLASHD_TEST_SLOW"), ',')) {
    const auto p = split(item, ':');
    if (p.size() != 2) throw std::invalid_argument("DFLASHD_TEST_SLOW: expected ROLE:MS, got " + item);
    (p[0] == "target" ? target_slow_ms : drafter_slow_ms) = std::stoll(p[1]);
  }
  const auto fault = split(env("DFLASHD_TEST_FAULT"), ':');
  const auto hang = split(env("DFLASHD_TEST_HANG"), ':');
  const bool always = !fault.empty() && fault.back() == "always";
  auto fired = std::make_shared<std::atomic<bool>>(false);
  auto once = [always, fired] { return always || !fired->exchange(true); };

  const int64_t target_fault = fault.size() >= 2 && fault[0] == "target" ? std::stoll(fault[1]) : -1;
  hooks.target_forward = [=](int64_t sample) {
    if (target_slow_ms > 0) sleep_ms(target_slow_ms);
    if (sample == target_fault && once()) throw std::runtime_error("injected fault (DFLASHD_TEST_FAULT)");
  };
  const int drafter_fault_replica = fault.size() >= 3 && fault[0] == "drafter" ? std::stoi(fault[1]) : -1;
  const int64_t drafter_fault_step = drafter_fault_replica >= 0 ? std::stoll(fault[2]) : -1;
  const int hang_replica = hang.size() == 3 && hang[0] == "drafter" ? std::stoi(hang[1]) : -1;
  const int64_t hang_step = hang_replica >= 0 ? std::stoll(hang[2]) : -1;
  hooks.drafter_step = [=](int replica, int64_t step) {
    if (drafter_slow_ms > 0) sleep_ms(drafter_slow_ms);
    if (replica == drafter_fault_replica && step == drafter_fault_step && once()) {
      throw std::runtime_error("injected fault (DFLASHD_TEST_FAULT)");
    }
    if (replica == hang_replica && step == hang_step) {
      while (true) sleep_ms(1000);  // stuck, beating no heartbeat
    }
  };
  return hooks;
}

}  // namespace dflash::pipeline
