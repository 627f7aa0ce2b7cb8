#include "pipeline/checkpointer.h"

#include <nlohmann/json.hpp>

#include <map>
#include <stdexcept>

#include "common/log.h"
#include "pipeline/run_settings.h"

namespace dflash::pipeline {

using Clock = std::chrono::steady_clock;

Checkpointer::Checkpointer(const config::Config& config, const StepPlan& plan, std::string data_digest,
                           std::string settings_json, RunMetrics& metrics, Health& health,
                           FailedSamples& failed_samples)
    : config_(config),
      plan_(plan),
      data_digest_(std::move(data_digest)),
      settings_json_(std::move(settings_json)),
      metrics_(metrics),
      health_(health),
      failed_samples_(failed_samples),
      writer_([this](const drafter::CheckpointSnapshot& snapshot) { write(snapshot); }) {}

std::string Checkpointer::trainer_state_json(int64_t step) {
  const RunMetrics::Totals totals = metrics_.totals();
  // FailedSamples' counts as {"data index": failures} (JSON keys are strings).
  nlohmann::json failures = nlohmann::json::object();
  for (const auto& [index, count] : failed_samples_.counts()) failures[std::to_string(index)] = count;
  std::lock_guard lock(mutex_);
  const nlohmann::json j = {{"step", step},
                            {"tokens_consumed", totals.tokens},
                            {"samples_consumed", totals.samples},
                            {"best_tau", best_tau_},
                            {"sample_failures", failures},
                            {"data", {{"next_sample", step < plan_.total_steps ? plan_.first_sample(step) : -1},
                                      {"samples_per_epoch", plan_.samples_per_epoch},
                                      {"digest", data_digest_},
                                      {"global_batch", plan_.global_batch()}}},
                            {"settings", nlohmann::json::parse(settings_json_)}};
  return j.dump();
}

void Checkpointer::maybe_checkpoint(int64_t step, bool force, const drafter::Drafter& drafter,
                                    const drafter::AdamW& optimizer) {
  const auto& c = config_.checkpoint;
  const bool by_steps = c.every_steps > 0 && step % c.every_steps == 0;
  const bool by_time = c.every_minutes > 0 &&
                       std::chrono::duration<double>(Clock::now() - last_time_).count() >= c.every_minutes * 60;
  if (!force && !by_steps && !by_time) return;
  const auto started = Clock::now();
  drafter::CheckpointSnapshot& snapshot = writer_.acquire();
  try {
    snapshot.take(step, drafter, optimizer, trainer_state_json(step));
  } catch (const std::exception& e) {
    health_.set_unhealthy("checkpoint", e.what());
    log::error("checkpoint at step {}: taking the snapshot failed: {}", step, e.what());
    return;
  }
  metrics_.snapshot_seconds->Set(std::chrono::duration<double>(Clock::now() - started).count());
  last_time_ = Clock::now();
  {
    const double tau = metrics_.totals().tau;
    std::lock_guard lock(mutex_);
    snapshot_tau_ = tau;
  }
  writer_.submit();
  if (force) writer_.wait_idle();
}

void Checkpointer::write(const drafter::CheckpointSnapshot& snapshot) {
  const auto started = Clock::now();
  try {
    const std::string dir = drafter::write_checkpoint(config_.checkpoint_dir(), snapshot);
    drafter::prune_checkpoints(config_.checkpoint_dir(), config_.checkpoint.keep_last);
    const double seconds = std::chrono::duration<double>(Clock::now() - started).count();
    metrics_.checkpoint_time->Set(unix_seconds());
    metrics_.checkpoint_duration->Set(seconds);
    health_.set_healthy("checkpoint");
    log::info("checkpoint {} written in {} s", dir, log::fixed(seconds, 2));
    bool best = false;
    {
      std::lock_guard lock(mutex_);
      best = snapshot_tau_ > best_tau_;
      if (best) best_tau_ = snapshot_tau_;
    }
    // With the eval section configured, export/best follows real acceptance (evaluator.h).
    if (best && config_.eval.every_steps == 0) {
      drafter::write_export(config_.run.output_dir + "/export/best", snapshot.shape, snapshot.model);
    }
  } catch (const std::exception& e) {
    // A failed checkpoint leaves the previous ones intact (atomic protocol); the run goes on.
    health_.set_unhealthy("checkpoint", e.what());
    log::error("checkpoint at step {} failed: {}", snapshot.step, e.what());
  }
}

int64_t Checkpointer::resume(const std::vector<std::unique_ptr<drafter::Drafter>>& drafters,
                             const std::vector<std::unique_ptr<drafter::AdamW>>& optimizers) {
  if (config_.checkpoint.resume == "auto") {
    const auto found = drafter::list_checkpoints(config_.checkpoint_dir());
    if (!found.empty()) resumed_from_ = found.back();
  } else if (config_.checkpoint.resume != "never") {
    resumed_from_ = config_.checkpoint.resume;
  }
  if (resumed_from_.empty()) return 0;
  int64_t step = 0;
  nlohmann::json state;
  for (size_t r = 0; r < drafters.size(); ++r) {
    const auto loaded = drafter::read_checkpoint(resumed_from_, drafters[r].get(), optimizers[r].get());
    step = loaded.step;
    state = nlohmann::json::parse(loaded.trainer_state_json);
  }
  const auto data_state = state.value("data", nlohmann::json::object());
  if (data_state.value("samples_per_epoch", plan_.samples_per_epoch) != plan_.samples_per_epoch ||
      data_state.value("global_batch", plan_.global_batch()) != plan_.global_batch()) {
    throw std::runtime_error(resumed_from_ + ": the data or batch shape changed since this checkpoint (" +
                             std::to_string(data_state.value("samples_per_epoch", int64_t{0})) +
                             " samples per epoch then, " + std::to_string(plan_.samples_per_epoch) +
                             " now); resuming would not be exact. Use checkpoint.resume: never to start over");
  }
  // A checkpoint written before the digest was recorded has none: its size check above is all there is.
  if (const std::string then = data_state.value("digest", data_digest_); then != data_digest_) {
    throw std::runtime_error(resumed_from_ + ": the training data changed since this checkpoint (data digest " + then +
                             " then, " + data_digest_ + " now: other samples, loss masks, held-out samples or order "
                             "with as many samples); resuming would not be exact. Restore that data, or use "
                             "checkpoint.resume: never to start over");
  }
  if (state.contains("settings")) {
    const std::string changed = setting_differences({state["settings"].dump(), settings_json_}, {"then", "now"});
    if (!changed.empty()) {
      log::warn("resuming {} with other settings than the run that wrote it: {}", resumed_from_, changed);
    }
  }
  metrics_.restore(state.value("tokens_consumed", int64_t{0}), state.value("samples_consumed", int64_t{0}));
  {
    std::lock_guard lock(mutex_);
    best_tau_ = state.value("best_tau", 0.0);
  }
  std::map<int64_t, int> failures;
  const nlohmann::json failures_state = state.value("sample_failures", nlohmann::json::object());
  for (const auto& [index, count] : failures_state.items()) failures[std::stoll(index)] = count.get<int>();
  failed_samples_.restore(std::move(failures));
  log::info("resuming from {} at step {} of {}", resumed_from_, step, plan_.total_steps);
  if (const int64_t skipped = failed_samples_.skipped_count(); skipped > 0) {
    metrics_.skipped_failed_total->Increment(static_cast<double>(skipped));
    log::warn("{} sample(s) failed workers.skip_sample_after_failures times in earlier runs and are skipped", skipped);
  }
  return step;
}

}  // namespace dflash::pipeline
