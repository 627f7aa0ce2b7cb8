// run_metrics.h: a training run's Prometheus metrics and its log lines, in one component that
// owns their cadence: registration, what one completed step records (drafter replica 0), and what
// the supervisor observes every few hundred milliseconds (queues, GPU memory, stage clocks):
// throughput, ETA and MFU over metrics.throughput_window_seconds, the role balance
// (role_balance.h), and every metrics.log_every_seconds the stage breakdown and the headline line.
//
// Thread-safety: the Prometheus objects are thread-safe and the workers update the counters
// they own directly; record_step() (replica 0's thread) and observe() (the supervisor's thread)
// share the step state under `mutex`; totals() may be called from any thread.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "config/config.h"
#include "pipeline/role_balance.h"

namespace dflash::pipeline {

// Unix time in seconds (heartbeats, timestamps in metrics).
double unix_seconds();

class RunMetrics {
 public:
  RunMetrics(const config::Config& config, prometheus::Registry& registry);

  // ---- counters and gauges that other components update directly ------------------------
  prometheus::Counter *nonfinite_total, *empty_steps_total, *skipped_short_total, *skipped_no_anchor_total,
      *skipped_failed_total, *skipped_malformed_total, *worker_failures_total;
  prometheus::Gauge *checkpoint_time, *checkpoint_duration, *snapshot_seconds;
  prometheus::Family<prometheus::Gauge>* kernel_path_family;
  prometheus::Family<prometheus::Gauge>* worker_heartbeat_family;
  prometheus::Family<prometheus::Gauge>* worker_stalled_family;
  prometheus::Family<prometheus::Counter>* worker_restarts_family;

  // A queue's capacity (its depth and waits follow in observe()).
  void add_queue(const std::string& name, int64_t capacity);

  // ---- one completed plan step (drafter replica 0) ---------------------------------------
  struct Step {
    int64_t step = 0;  // 0-based; step + 1 steps are done
    double loss = 0, tau = 1, learning_rate = 0, grad_norm = 0;
    std::vector<double> accuracy;  // per block position
    int64_t tokens = 0, samples = 0;
    double flops = 0;
  };
  void record_step(const Step& step);
  // Totals a resumed run starts from (the checkpoint's trainer state).
  void restore(int64_t tokens, int64_t samples);
  struct Totals {
    int64_t tokens = 0, samples = 0;
    double tau = 1;  // of the last step
  };
  Totals totals() const;

  // ---- the supervisor ------------------------------------------------------------------------
  struct Queue {
    std::string name;
    int64_t depth = 0, capacity = 0;
    double blocked_seconds = 0, starved_seconds = 0;  // cumulative
  };
  struct Role {
    std::map<std::string, double> stage_seconds;  // cumulative, summed over the role's replicas
    int64_t iterations = 0;
    size_t replicas = 1;
  };
  struct Observation {
    std::vector<Queue> queues;  // the sample queue first, then the feature queues
    Role target, drafter;
    int64_t completed_steps = 0, total_steps = 0;
    double tokens_per_step = 0;  // of the plan, for the ETA
  };
  void observe(const Observation& o);

 private:
  // Cumulative totals kept elsewhere (queue waits, stage seconds, allocator retries) followed by
  // counter increments; returns the increment.
  double advance(prometheus::Family<prometheus::Counter>* family, const prometheus::Labels& labels, double total);
  void log_lines(const Observation& o, double rate, double eta_seconds);

  const config::Config config_;
  const std::vector<int> gpu_ids_;  // the distinct GPUs of both groups (CUDA runs): a shared GPU once
  RoleBalance balance_;             // the supervisor's

  prometheus::Counter *tokens_total_, *samples_total_, *steps_total_;
  prometheus::Gauge *tokens_per_second_, *eta_seconds_, *mfu_, *loss_, *tau_, *learning_rate_, *grad_norm_,
      *bottleneck_target_, *bottleneck_drafter_, *suggested_target_gpus_, *progress_, *busy_ratio_target_,
      *busy_ratio_drafter_;
  prometheus::Family<prometheus::Gauge>* accuracy_family_;
  prometheus::Family<prometheus::Gauge>* queue_depth_family_;
  prometheus::Family<prometheus::Gauge>* queue_capacity_family_;
  prometheus::Family<prometheus::Counter>* queue_blocked_family_;
  prometheus::Family<prometheus::Counter>* queue_starved_family_;
  prometheus::Family<prometheus::Gauge>* memory_family_;
  prometheus::Family<prometheus::Counter>* allocator_retries_family_;
  prometheus::Family<prometheus::Counter>* stage_seconds_family_;

  // The supervisor's own state (its thread only).
  std::map<std::string, double> counted_;  // what each cumulative counter already holds
  std::chrono::steady_clock::time_point last_log_time_ = std::chrono::steady_clock::now();
  Role logged_target_, logged_drafter_;    // stage totals at the last log line: it reports the interval since
  const double start_time_;

  // The step state: written by record_step(), read by observe() and totals(); guarded by mutex_.
  mutable std::mutex mutex_;
  struct Progress {
    double time;
    int64_t tokens;  // consumed so far
    double flops;    // model FLOPs done so far
  };
  std::deque<Progress> window_;
  int64_t tokens_consumed_ = 0, samples_consumed_ = 0;
  double flops_done_ = 0;
  Step last_;
};

}  // namespace dflash::pipeline
