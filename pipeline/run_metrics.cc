#include "pipeline/run_metrics.h"

#include <algorithm>
#include <cstdio>
#include <set>
#include <tuple>

#include "common/log.h"
#include "pipeline/gpu_memory.h"

namespace dflash::pipeline {
namespace {

std::vector<int> distinct_gpus(const config::GpuConfig& gpus) {
  if (gpus.device != config::Device::cuda) return {};
  std::set<int> ids(gpus.target.begin(), gpus.target.end());
  ids.insert(gpus.drafter.begin(), gpus.drafter.end());
  return {ids.begin(), ids.end()};
}

}  // namespace

double unix_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

RunMetrics::RunMetrics(const config::Config& config, prometheus::Registry& registry)
    : config_(config),
      gpu_ids_(distinct_gpus(config.gpus)),
      balance_(static_cast<int>(config.gpus.target.size()), static_cast<int>(config.gpus.drafter.size()),
               config.metrics.throughput_window_seconds),
      start_time_(unix_seconds()) {
  auto counter = [&](const char* name, const char* help) -> prometheus::Counter& {
    return prometheus::BuildCounter().Name(name).Help(help).Register(registry).Add({});
  };
  auto gauge = [&](const char* name, const char* help) -> prometheus::Gauge& {
    return prometheus::BuildGauge().Name(name).Help(help).Register(registry).Add({});
  };
  tokens_total_ = &counter("dflashd_tokens_total", "Training tokens consumed (target forward + drafter step)");
  samples_total_ = &counter("dflashd_samples_total", "Training sequences consumed");
  steps_total_ = &counter("dflashd_optimizer_steps_total", "Optimizer steps completed (plan steps, skipped included)");
  empty_steps_total = &counter("dflashd_steps_without_blocks_total",
                               "Steps none of whose samples had a block to train (no update)");
  nonfinite_total = &counter("dflashd_nonfinite_steps_total", "Steps whose gradient was not finite");
  auto& skipped = prometheus::BuildCounter()
                      .Name("dflashd_samples_skipped_total")
                      .Help("Samples skipped, by reason: too_few_supervised (data.min_supervised_tokens), no_anchor "
                            "(no two adjacent supervised tokens), failed (failed workers.skip_sample_after_failures times)")
                      .Register(registry);
  skipped_short_total = &skipped.Add({{"reason", "too_few_supervised"}});
  skipped_no_anchor_total = &skipped.Add({{"reason", "no_anchor"}});
  skipped_failed_total = &skipped.Add({{"reason", "failed"}});
  skipped_malformed_total = &counter("dflashd_samples_malformed_total", "Malformed samples skipped (data.on_malformed: skip)");
  worker_failures_total = &counter("dflashd_worker_failures_total", "Exceptions raised in pipeline workers");
  tokens_per_second_ = &gauge("dflashd_tokens_per_second", "Training tokens per second over the throughput window");
  eta_seconds_ = &gauge("dflashd_eta_seconds", "Estimated seconds until the run's last step");
  mfu_ = &gauge("dflashd_mfu_ratio", "Model FLOPs utilisation: model FLOPs per second / (GPUs x peak)");
  loss_ = &gauge("dflashd_loss", "Training loss of the last step (decay-weighted cross entropy)");
  tau_ = &gauge("dflashd_expected_acceptance_length", "Expected acceptance length tau of the last step");
  learning_rate_ = &gauge("dflashd_learning_rate", "Learning rate of the last step");
  grad_norm_ = &gauge("dflashd_grad_norm", "Gradient norm of the last step, before clipping");
  checkpoint_time = &gauge("dflashd_checkpoint_last_success_timestamp_seconds", "Unix time of the last checkpoint");
  checkpoint_duration = &gauge("dflashd_checkpoint_duration_seconds", "Duration of the last checkpoint");
  snapshot_seconds = &gauge("dflashd_checkpoint_snapshot_seconds",
                            "Time the drafter's replica 0 spent copying the last checkpoint off the GPU (the "
                            "write itself runs on a thread of its own)");
  progress_ = &gauge("dflashd_progress_ratio", "Completed steps / planned steps");
  auto& bottleneck = prometheus::BuildGauge()
                         .Name("dflashd_bottleneck")
                         .Help("1 for the stage that limits throughput (the other one waits for it)")
                         .Register(registry);
  bottleneck_target_ = &bottleneck.Add({{"stage", "target"}});
  bottleneck_drafter_ = &bottleneck.Add({{"stage", "drafter"}});
  auto& busy_ratio = prometheus::BuildGauge()
                         .Name("dflashd_busy_ratio")
                         .Help("Share of its GPUs' time a role worked over metrics.throughput_window_seconds "
                               "(device seconds summed over its replicas / (window x its GPUs))")
                         .Register(registry);
  busy_ratio_target_ = &busy_ratio.Add({{"role", "target"}});
  busy_ratio_drafter_ = &busy_ratio.Add({{"role", "drafter"}});
  suggested_target_gpus_ = &gauge("dflashd_suggested_target_gpus",
                                  "Target GPUs of the current total that would balance the measured stage times");
  accuracy_family_ = &prometheus::BuildGauge().Name("dflashd_position_accuracy").Help("Accuracy per block position k of the last step").Register(registry);
  queue_depth_family_ = &prometheus::BuildGauge().Name("dflashd_queue_depth").Help("Items waiting in a queue").Register(registry);
  queue_capacity_family_ = &prometheus::BuildGauge().Name("dflashd_queue_capacity").Help("Capacity of a queue in items").Register(registry);
  queue_blocked_family_ = &prometheus::BuildCounter().Name("dflashd_queue_producer_blocked_seconds_total").Help("Seconds producers waited on a full queue").Register(registry);
  queue_starved_family_ = &prometheus::BuildCounter().Name("dflashd_queue_consumer_starved_seconds_total").Help("Seconds consumers waited on an empty queue").Register(registry);
  memory_family_ = &prometheus::BuildGauge().Name("dflashd_gpu_memory_bytes").Help("GPU memory of the caching allocator (kind: allocated, reserved)").Register(registry);
  allocator_retries_family_ = &prometheus::BuildCounter().Name("dflashd_gpu_allocator_retries_total").Help("Times the CUDA caching allocator emptied its cache and retried an allocation (memory near the limit; each one stalls the GPU)").Register(registry);
  kernel_path_family = &prometheus::BuildGauge()
                            .Name("dflashd_kernel_path")
                            .Help("1 for the implementation each component runs (target.linear_attention, target.moe, "
                                  "target.full_attention, drafter.attention; kernel_path.h)")
                            .Register(registry);
  worker_heartbeat_family = &prometheus::BuildGauge().Name("dflashd_worker_last_heartbeat_timestamp_seconds").Help("Unix time of a worker's last heartbeat").Register(registry);
  worker_stalled_family = &prometheus::BuildGauge().Name("dflashd_worker_stalled").Help("1 while a worker's heartbeat is older than workers.stall_seconds").Register(registry);
  worker_restarts_family = &prometheus::BuildCounter().Name("dflashd_worker_restarts_total").Help("Restarts of a worker after a failure").Register(registry);
  stage_seconds_family_ = &prometheus::BuildCounter().Name("dflashd_stage_seconds_total").Help("Device seconds per stage of the workers' loops (CUDA events on a GPU, wall clock on the CPU), summed over a role's replicas").Register(registry);
  for (const char* stage : {"target_forward", "feature_handoff"}) stage_seconds_family_->Add({{"role", "target"}, {"stage", stage}});
  for (const char* stage : {"drafter_forward", "lm_head_loss", "backward", "gradient_allreduce", "metrics_exchange", "optimizer"}) {
    stage_seconds_family_->Add({{"role", "drafter"}, {"stage", stage}});
  }
}

void RunMetrics::add_queue(const std::string& name, int64_t capacity) {
  queue_capacity_family_->Add({{"queue", name}}).Set(static_cast<double>(capacity));
  queue_blocked_family_->Add({{"queue", name}});
  queue_starved_family_->Add({{"queue", name}});
}

void RunMetrics::record_step(const Step& step) {
  std::lock_guard lock(mutex_);
  tokens_consumed_ += step.tokens;
  samples_consumed_ += step.samples;
  flops_done_ += step.flops;
  last_ = step;
  tokens_total_->Increment(static_cast<double>(step.tokens));
  samples_total_->Increment(static_cast<double>(step.samples));
  steps_total_->Increment();
  loss_->Set(step.loss);
  tau_->Set(step.tau);
  learning_rate_->Set(step.learning_rate);
  grad_norm_->Set(step.grad_norm);
  for (size_t k = 1; k < step.accuracy.size(); ++k) {
    accuracy_family_->Add({{"position", std::to_string(k)}}).Set(step.accuracy[k]);
  }
  window_.push_back({unix_seconds(), tokens_consumed_, flops_done_});
}

void RunMetrics::restore(int64_t tokens, int64_t samples) {
  std::lock_guard lock(mutex_);
  tokens_consumed_ = tokens;
  samples_consumed_ = samples;
  tokens_total_->Increment(static_cast<double>(tokens));
  samples_total_->Increment(static_cast<double>(samples));
}

RunMetrics::Totals RunMetrics::totals() const {
  std::lock_guard lock(mutex_);
  return {tokens_consumed_, samples_consumed_, last_.tau};
}

double RunMetrics::advance(prometheus::Family<prometheus::Counter>* family, const prometheus::Labels& labels,
                           double total) {
  std::string key = family->GetName();
  for (const auto& [name, value] : labels) key += "/" + name + "=" + value;
  double& held = counted_[key];
  const double increment = total > held ? total - held : 0.0;
  auto& counter = family->Add(labels);
  if (increment > 0) counter.Increment(increment);
  held = std::max(held, total);
  return increment;
}

void RunMetrics::observe(const Observation& o) {
  const double now = unix_seconds();
  for (const Queue& q : o.queues) {
    queue_depth_family_->Add({{"queue", q.name}}).Set(static_cast<double>(q.depth));
    advance(queue_blocked_family_, {{"queue", q.name}}, q.blocked_seconds);
    advance(queue_starved_family_, {{"queue", q.name}}, q.starved_seconds);
  }
  for (const GpuMemory& m : gpu_memory(gpu_ids_)) {
    memory_family_->Add({{"gpu", std::to_string(m.device)}, {"kind", "allocated"}}).Set(static_cast<double>(m.allocated_bytes));
    memory_family_->Add({{"gpu", std::to_string(m.device)}, {"kind", "reserved"}}).Set(static_cast<double>(m.reserved_bytes));
    const double retries =
        advance(allocator_retries_family_, {{"gpu", std::to_string(m.device)}}, static_cast<double>(m.alloc_retries));
    if (retries > 0) {
      log::warn("GPU {}: the CUDA caching allocator emptied its cache and retried {} time(s) since the last check "
                "({} GB reserved): memory is near the limit and every retry stalls the GPU; lower "
                "queues.features or data.max_length, or give the target and the drafter separate GPUs",
                m.device, static_cast<int64_t>(retries), m.reserved_bytes / 1000000000);
    }
  }
  // Throughput, ETA and MFU over the window (the steps since startup would hide a recent change).
  double rate = 0, flops_rate = 0, flops_done = 0;
  size_t samples_in_window = 0;
  {
    std::lock_guard lock(mutex_);
    while (window_.size() > 1 && now - window_.front().time > config_.metrics.throughput_window_seconds) window_.pop_front();
    samples_in_window = window_.size();
    if (window_.size() > 1) {
      const double span = window_.back().time - window_.front().time;
      if (span > 0) {
        rate = (window_.back().tokens - window_.front().tokens) / span;
        flops_rate = (window_.back().flops - window_.front().flops) / span;
      }
    }
    flops_done = flops_done_;
  }
  tokens_per_second_->Set(rate);
  const int64_t steps_left = o.total_steps - o.completed_steps;
  const double eta = rate > 0 ? steps_left * o.tokens_per_step / rate : 0;
  eta_seconds_->Set(eta);
  progress_->Set(static_cast<double>(o.completed_steps) / static_cast<double>(std::max<int64_t>(1, o.total_steps)));
  const double gpus = gpu_ids_.empty() ? 1.0 : static_cast<double>(gpu_ids_.size());
  const double elapsed = now - start_time_;
  if (samples_in_window > 1) {
    mfu_->Set(flops_rate / (gpus * config_.metrics.peak_flops_per_gpu));
  } else if (elapsed > 0) {
    mfu_->Set(flops_done / elapsed / (gpus * config_.metrics.peak_flops_per_gpu));
  }
  double busy[2] = {0, 0};  // target, drafter: device seconds summed over replicas
  for (const auto& [role, r, total] : {std::tuple{"target", &o.target, &busy[0]}, std::tuple{"drafter", &o.drafter, &busy[1]}}) {
    for (const auto& [stage, seconds] : r->stage_seconds) {
      advance(stage_seconds_family_, {{"role", role}, {"stage", stage}}, seconds);
      *total += seconds;
    }
  }
  balance_.observe(now, busy[0], busy[1]);
  if (const RoleBalance::Advice advice = balance_.advice(); advice.known) {
    busy_ratio_target_->Set(advice.target_busy_ratio);
    busy_ratio_drafter_->Set(advice.drafter_busy_ratio);
    bottleneck_target_->Set(advice.bottleneck == "target" ? 1 : 0);
    bottleneck_drafter_->Set(advice.bottleneck == "drafter" ? 1 : 0);
    suggested_target_gpus_->Set(advice.suggested_target_gpus);
  }
  log_lines(o, rate, eta);
}

// Every metrics.log_every_seconds: per role over the interval, device ms per iteration by stage
// and the share of the interval its GPUs spent on them (the rest: waiting for the other role, a
// queue, the GPU); then the headline.
void RunMetrics::log_lines(const Observation& o, double rate, double eta_seconds) {
  const double since_log = std::chrono::duration<double>(std::chrono::steady_clock::now() - last_log_time_).count();
  if (since_log < config_.metrics.log_every_seconds) return;
  last_log_time_ = std::chrono::steady_clock::now();
  std::string breakdown;
  for (const auto& [name, role, mark] : {std::tuple{"target", &o.target, &logged_target_},
                                         std::tuple{"drafter", &o.drafter, &logged_drafter_}}) {
    const int64_t n = role->iterations - mark->iterations;
    if (n <= 0) continue;
    std::string part;
    double busy = 0;
    for (const auto& [stage, seconds] : role->stage_seconds) {
      const double delta = seconds - mark->stage_seconds[stage];
      busy += delta;
      part += " " + stage + " " + log::fixed(1e3 * delta / static_cast<double>(n), 1);
    }
    breakdown += (breakdown.empty() ? "" : " | ") + std::string(name) + " (busy " +
                 log::fixed(100.0 * busy / (since_log * static_cast<double>(std::max<size_t>(1, role->replicas))), 0) + " %)" + part;
    *mark = *role;
  }
  if (!breakdown.empty()) log::info("ms per sequence (target) and per step (drafter), by stage: {}", breakdown);
  Step last;
  {
    std::lock_guard lock(mutex_);
    last = last_;
  }
  const Queue& samples = o.queues.at(0);
  const Queue& features = o.queues.at(1);
  log::info("step {}/{}  loss {}  tau {}  lr {}  tok/s {}  ETA {} s  queues samples {}/{} features {}/{}", o.completed_steps,
            o.total_steps, log::fixed(last.loss, 4), log::fixed(last.tau, 3), log::fixed(last.learning_rate, 6), log::fixed(rate, 1),
            static_cast<int64_t>(eta_seconds), samples.depth, samples.capacity, features.depth, features.capacity);
}

}  // namespace dflash::pipeline
