// failed_samples.h: how often each sample made a worker fail, so that a sample which fails
// every time cannot stop the run for ever (under workers.on_failure: restart, or systemd's
// Restart=on-failure, the same sample came back after every restart).
//
// Samples are counted by their data index (Dataset order, the same in every epoch), and the
// counts travel in the checkpoint's trainer state: a process restarted after a failure knows
// how often each sample failed before. A sample that reached workers.skip_sample_after_failures
// is skipped from then on (the caller logs it, naming the file and line, and counts it).
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <vector>

namespace dflash::pipeline {

class FailedSamples {
 public:
  // skip_after: failures after which a sample is skipped; 0 never skips.
  explicit FailedSamples(int skip_after) : skip_after_(skip_after) {}

  // Counts one failure of each of `samples`; returns those that reached the limit with it.
  std::vector<int64_t> record(const std::vector<int64_t>& samples) {
    std::lock_guard lock(mutex_);
    std::vector<int64_t> now_skipped;
    for (int64_t sample : samples) {
      if (++counts_[sample] == skip_after_) now_skipped.push_back(sample);
    }
    return now_skipped;
  }
  bool skipped(int64_t sample) const {
    std::lock_guard lock(mutex_);
    const auto it = counts_.find(sample);
    return skip_after_ > 0 && it != counts_.end() && it->second >= skip_after_;
  }
  int failures(int64_t sample) const {
    std::lock_guard lock(mutex_);
    const auto it = counts_.find(sample);
    return it == counts_.end() ? 0 : it->second;
  }
  // Every sample that failed at least once -> its failures (for the checkpoint).
  std::map<int64_t, int> counts() const {
    std::lock_guard lock(mutex_);
    return counts_;
  }
  void restore(std::map<int64_t, int> counts) {
    std::lock_guard lock(mutex_);
    counts_ = std::move(counts);
  }
  int64_t skipped_count() const {
    std::lock_guard lock(mutex_);
    int64_t n = 0;
    for (const auto& [sample, failures] : counts_) n += skip_after_ > 0 && failures >= skip_after_;
    return n;
  }

 private:
  const int skip_after_;
  mutable std::mutex mutex_;
  std::map<int64_t, int> counts_;  // guarded by mutex_
};

}  // namespace dflash::pipeline
