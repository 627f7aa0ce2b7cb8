// role_balance.h: which role limits a run's throughput, and the split of its GPUs between the
// roles that would balance them (dflashd_bottleneck, dflashd_busy_ratio,
// dflashd_suggested_target_gpus).
//
// Input: each role's busy device-seconds summed over all of its replicas (the workers' stage
// clocks), sampled by the supervisor. Everything is computed over the last
// metrics.throughput_window_seconds, not since the start: a run whose balance changed (warm-up,
// longer samples) is judged by what it does now.
// - busy ratio of a role: its busy seconds in the window / (window x its GPUs): how much of its
//   GPUs' time the role works (the rest it waits for the other role, a queue or the GPU);
// - the bottleneck: the role with the higher busy ratio (the other one waits for it);
// - the suggested split: work that takes t target GPU-seconds and d drafter GPU-seconds per
//   unit of progress is balanced by target GPUs / drafter GPUs = t / d, so of N = target GPUs
//   + drafter GPUs the target should get N t / (t + d), rounded, at least 1 and leaving the
//   drafter at least 1.
// A GPU listed in both groups counts in both (each role uses it part of the time).
//
// Thread-safety: none; the supervisor's thread owns it.
#pragma once

#include <algorithm>
#include <cmath>
#include <deque>
#include <string>

namespace dflash::pipeline {

class RoleBalance {
 public:
  RoleBalance(int target_gpus, int drafter_gpus, double window_seconds)
      : target_gpus_(target_gpus), drafter_gpus_(drafter_gpus), window_seconds_(window_seconds) {}

  // Cumulative busy seconds of each role (summed over its replicas) at time `now` (seconds).
  void observe(double now, double target_busy_seconds, double drafter_busy_seconds) {
    samples_.push_back({now, target_busy_seconds, drafter_busy_seconds});
    while (samples_.size() > 2 && now - samples_[1].time >= window_seconds_) samples_.pop_front();
  }

  struct Advice {
    bool known = false;  // false until the window holds some work of both roles
    double target_busy_ratio = 0, drafter_busy_ratio = 0;
    std::string bottleneck;  // "target" or "drafter"
    int suggested_target_gpus = 0;
  };

  Advice advice() const {
    Advice a;
    if (samples_.size() < 2) return a;
    const Sample &first = samples_.front(), &last = samples_.back();
    const double span = last.time - first.time;
    const double t = last.target - first.target, d = last.drafter - first.drafter;
    if (span <= 0 || t <= 0 || d <= 0) return a;
    a.known = true;
    a.target_busy_ratio = t / (span * target_gpus_);
    a.drafter_busy_ratio = d / (span * drafter_gpus_);
    a.bottleneck = a.target_busy_ratio >= a.drafter_busy_ratio ? "target" : "drafter";
    const int total = target_gpus_ + drafter_gpus_;
    const int balanced = static_cast<int>(std::lround(total * t / (t + d)));
    a.suggested_target_gpus = total < 2 ? 1 : std::clamp(balanced, 1, total - 1);
    return a;
  }

 private:
  struct Sample {
    double time, target, drafter;
  };
  const int target_gpus_, drafter_gpus_;
  const double window_seconds_;
  std::deque<Sample> samples_;  // oldest first; the first one at or just before the window's start
};

}  // namespace dflash::pipeline
