#include "pipeline/evaluator.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/log.h"
#include "common/safetensors.h"
#include "pipeline/run_metrics.h"
#include "pipeline/streams.h"

namespace dflash::pipeline {
namespace {

// The best acceptance length recorded with export/best (0 without one).
double recorded_best(const std::string& dir) {
  std::ifstream in(dir + "/eval.json");
  if (!in) return 0;
  try {
    std::stringstream text;
    text << in.rdbuf();
    return nlohmann::json::parse(text.str()).value("acceptance_length", 0.0);
  } catch (const std::exception& e) {
    log::warn("{}/eval.json: {}; the best acceptance starts from 0", dir, e.what());
    return 0;
  }
}

}  // namespace

Evaluator::Evaluator(const config::Config& config, std::vector<const target::TargetModel*> target,
                     const drafter::DrafterShape& shape,
                     std::vector<decode::EvalPrompt> prompts, prometheus::Registry& registry)
    : settings_(config.eval),
      best_dir_(config.run.output_dir + "/export/best"),
      target_(std::move(target)),
      prompts_(std::move(prompts)),
      drafter_(shape, at::TensorOptions().device(target_.device()).dtype(target_.options().dtype)) {
  generate_.max_new_tokens = settings_.max_new_tokens;
  generate_.stop_token_ids.assign(settings_.stop_token_ids.begin(), settings_.stop_token_ids.end());
  generate_.sampling = {settings_.temperature, settings_.top_p, settings_.top_k};
  generate_.seed = static_cast<uint64_t>(config.train.seed);
  acceptance_length_ = &prometheus::BuildGauge()
                            .Name("dflashd_eval_acceptance_length")
                            .Help("Real acceptance length of the last evaluation: tokens committed per target verify step")
                            .Register(registry)
                            .Add({});
  acceptance_at_ = &prometheus::BuildGauge()
                        .Name("dflashd_eval_acceptance_at_position")
                        .Help("Share of verify steps in which draft position k was accepted (last evaluation)")
                        .Register(registry);
  tokens_per_second_ = &prometheus::BuildGauge()
                            .Name("dflashd_eval_tokens_per_second")
                            .Help("Decode tokens/s of the eval prompts: speculative decoding (last evaluation) and plain decoding")
                            .Register(registry);
  speedup_ = &prometheus::BuildGauge()
                  .Name("dflashd_eval_speedup")
                  .Help("Speculative over plain decoding tokens/s, same target, same prompts")
                  .Register(registry)
                  .Add({});
  last_step_ = &prometheus::BuildGauge().Name("dflashd_eval_step").Help("Step of the last evaluation").Register(registry).Add({});
  seconds_ = &prometheus::BuildGauge().Name("dflashd_eval_seconds").Help("Wall time of the last evaluation").Register(registry).Add({});
  evaluations_ = &prometheus::BuildCounter().Name("dflashd_evaluations_total").Help("Evaluations run").Register(registry).Add({});
  skipped_ = &prometheus::BuildCounter()
                  .Name("dflashd_evaluations_skipped_total")
                  .Help("Evaluations due while the previous one was still running (skipped)")
                  .Register(registry)
                  .Add({});
  best_ = recorded_best(best_dir_);
  log::info("eval: every {} steps, {} prompts, {} new tokens each, {}, {} at once, on {} ({} GatedDeltaNet states); "
            "export/best follows the eval acceptance{}",
            settings_.every_steps, prompts_.size(), settings_.max_new_tokens, decode::describe(generate_),
            settings_.max_batch, target_.places(), target::decode_state_dtype_name(target_.options()),
            best_ > 0 ? " (best so far " + std::to_string(best_) + ")" : "");
  thread_ = std::thread([this] { run(); });
}

Evaluator::~Evaluator() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void Evaluator::maybe_start(int64_t step, const drafter::Drafter& current) {
  if (settings_.every_steps <= 0 || step % settings_.every_steps != 0) return;
  {
    std::lock_guard lock(mutex_);
    if (busy_ || stop_) {
      if (busy_) skipped_->Increment();
      return;
    }
    busy_ = true;
  }
  hand_over(step, current);
}

// The replica's weights between its optimizer steps (the caller's thread: the replica's, or the
// owner's at the end), copied to the eval's device on the caller's stream, then the step to the
// evaluation thread with an event that its stream waits for.
void Evaluator::hand_over(int64_t step, const drafter::Drafter& current) {
  drafter_.load_tensors(current.parameters(), "drafter replica 0 at step " + std::to_string(step));
  std::shared_ptr<ReadyEvent> ready = mark_ready(target_.device());
  {
    std::lock_guard lock(mutex_);
    pending_step_ = step;
    weights_ready_ = std::move(ready);
  }
  wake_.notify_all();
}

void Evaluator::finish() {
  std::unique_lock lock(mutex_);
  wake_.wait(lock, [&] { return !busy_; });
}

void Evaluator::evaluate_final(int64_t step, const drafter::Drafter& current) {
  finish();
  if (evaluated_step_ == step) return;  // the evaluation thread's writes are visible after finish()
  {
    std::lock_guard lock(mutex_);
    if (stop_) return;
    busy_ = true;
  }
  hand_over(step, current);
  finish();
}

void Evaluator::run() {
  std::unique_ptr<WorkerStream> stream;
  while (true) {
    int64_t step = -1;
    std::shared_ptr<ReadyEvent> ready;
    {
      std::unique_lock lock(mutex_);
      wake_.wait(lock, [&] { return stop_ || pending_step_ >= 0; });
      if (pending_step_ < 0) return;  // stopping with nothing handed over
      step = pending_step_;
      pending_step_ = -1;
      ready = std::move(weights_ready_);
    }
    if (!stream) stream = std::make_unique<WorkerStream>(target_.device());
    wait_ready(ready, {});  // the copy of the weights, queued on the handing thread's stream
    try {
      evaluate(step);
    } catch (const std::exception& e) {
      log::error("eval at step {} failed: {} (the run goes on)", step, e.what());
    }
    {
      std::lock_guard lock(mutex_);
      busy_ = false;
    }
    wake_.notify_all();
  }
}

void Evaluator::evaluate(int64_t step) {
  c10::InferenceMode inference;
  const auto start = std::chrono::steady_clock::now();
  // Built once, on this thread's stream: over a replica split across GPUs it copies the embedding
  // to the last stage's GPU (memory_plan.cc counts that copy).
  if (!spec_) spec_ = std::make_unique<decode::SpeculativeDecoder>(target_, drafter_);
  const bool baseline = plain_tokens_per_second_ == 0;
  // One decoder, even over a split replica: eval.max_batch is what the memory plan gives it
  // beside training (a decoder per stage would need a batch's caches per stage more).
  decode::EvalReport report = decode::evaluate({spec_.get()}, prompts_, generate_, baseline, settings_.max_batch);
  if (baseline) plain_tokens_per_second_ = report.plain_tokens_per_second;
  const double speedup = plain_tokens_per_second_ > 0 ? report.spec_tokens_per_second / plain_tokens_per_second_ : 0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  evaluated_step_ = step;
  acceptance_length_->Set(report.acceptance_length);
  for (size_t k = 0; k < report.acceptance_at.size(); ++k) {
    acceptance_at_->Add({{"position", std::to_string(k + 1)}}).Set(report.acceptance_at[k]);
  }
  tokens_per_second_->Add({{"decoding", "speculative"}}).Set(report.spec_tokens_per_second);
  tokens_per_second_->Add({{"decoding", "plain"}}).Set(plain_tokens_per_second_);
  speedup_->Set(speedup);
  last_step_->Set(static_cast<double>(step));
  seconds_->Set(seconds);
  evaluations_->Increment();
  std::string positions;
  for (double a : report.acceptance_at) positions += (positions.empty() ? "" : " ") + log::fixed(a, 2);
  log::info("eval at step {}: acceptance length {} ({} prompts, {} new tokens; accepted per position {}); speculative {} "
            "tok/s, plain {} tok/s, speedup {}x; {} s",
            step, log::fixed(report.acceptance_length, 3), report.prompts, report.new_tokens, positions, log::fixed(report.spec_tokens_per_second, 1),
            log::fixed(plain_tokens_per_second_, 1), log::fixed(speedup, 2), log::fixed(seconds, 1));
  if (report.mismatches > 0) {
    log::warn("eval at step {}: {} prompt(s) decoded differently from plain greedy decoding (low-precision numerics)",
              step, report.mismatches);
  }
  if (report.acceptance_length > best_) {
    best_ = report.acceptance_length;
    drafter_.save_export(best_dir_);
    report.baseline = true;
    report.plain_tokens_per_second = plain_tokens_per_second_;
    report.speedup = speedup;
    nlohmann::json j = nlohmann::json::parse(report.to_json());
    j["step"] = step;
    write_file_atomically(best_dir_ + "/eval.json", j.dump(2) + "\n");  // fsynced: never half a report
    log::info("export/best: step {} (eval acceptance length {})", step, log::fixed(best_, 3));
  }
}

}  // namespace dflash::pipeline
