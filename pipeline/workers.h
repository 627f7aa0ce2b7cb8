// workers.h: the pipeline's worker threads and their health. Each worker has a name, a
// heartbeat (dflashd_worker_last_heartbeat_timestamp_seconds), a restart count and a stall flag
// (dflashd_worker_stalled, /healthz). The pool starts the threads, knows which are still inside
// their loops, and after a failure waits a bounded time for them: a thread stuck in a CUDA or NCCL
// call is detached, never joined (the process then ends without destroying what it uses).
//
// Threads: add() and spawn() from the owner before the run starts; Worker::beat() from the
// worker's own thread; check_heartbeats() from the supervisor; wait_for_exit(), join() and
// detach() from the owner.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "common/health.h"
#include "config/config.h"
#include "pipeline/failed_samples.h"
#include "pipeline/run_metrics.h"

namespace dflash::pipeline {

struct Worker {
  std::string name;
  std::atomic<double> heartbeat{0};  // Unix seconds
  std::atomic<int> restarts{0};
  std::atomic<bool> stalled{false};
  prometheus::Gauge* heartbeat_gauge = nullptr;
  prometheus::Counter* restarts_counter = nullptr;
  void beat() { heartbeat.store(unix_seconds()); }
};

class WorkerPool {
 public:
  WorkerPool(RunMetrics& metrics, Health& health) : metrics_(metrics), health_(health) {}

  // A worker named `name` (healthy, beating now); the reference stays valid.
  Worker& add(const std::string& name);
  // Runs `body` on a thread of its own, counted as running until it returns.
  void spawn(std::function<void()> body);
  bool started() const { return !threads_.empty(); }

  // Every worker's heartbeat against `stall_seconds`: the metrics, /healthz, and for each worker
  // newly stalled the reason ("reader stalled: no heartbeat for 601 s").
  std::vector<std::string> check_heartbeats(double now, double stall_seconds);

  // Waits until every thread returned, at most `limit` (nullopt: without limit); true when all did.
  bool wait_for_exit(std::optional<std::chrono::duration<double>> limit);
  int running() const;
  void join();    // every thread returned
  void detach();  // some are stuck: the owner ends the process next

 private:
  RunMetrics& metrics_;
  Health& health_;
  std::vector<std::unique_ptr<Worker>> workers_;  // the owner's thread adds; others read
  std::vector<std::thread> threads_;              // the owner's thread only
  mutable std::mutex mutex_;                      // guards running_
  std::condition_variable exited_;
  int running_ = 0;
};

// What a worker does when its unit of work throws (workers.on_failure, max_restarts,
// skip_sample_after_failures): count it, retry it, skip the sample that keeps failing, or stop
// the run. Shared by every worker thread (its state lives in the Worker and FailedSamples).
class FailurePolicy {
 public:
  struct Context {
    const config::WorkerConfig& config;
    RunMetrics& metrics;
    Health& health;
    FailedSamples& failed_samples;
    std::function<std::string(int64_t)> describe_sample;  // "FILE:LINE" of a data index
    bool single_replica = true;                            // a drafter step may be retried alone
    std::function<void(const std::string&)> stop_run;      // fails the run with a reason
    std::function<bool()> run_failed;                      // another worker already failed it
  };
  explicit FailurePolicy(Context context) : c_(std::move(context)) {}

  // Runs `work` under the policy. Returns false when the run must stop. `samples`: the data
  // indices the work processes; each failure counts against them. When one of them reaches
  // workers.skip_sample_after_failures it is skipped: with `skipped` given (the unit of work is
  // that one sample) run() returns true and sets *skipped; otherwise the work runs again, which
  // leaves skipped samples out (only with one drafter replica: the others would be out of step in
  // the collectives).
  bool run(Worker& w, const std::string& what, const std::function<void()>& work,
           const std::vector<int64_t>& samples = {}, bool* skipped = nullptr) const;

 private:
  Context c_;
};

}  // namespace dflash::pipeline
