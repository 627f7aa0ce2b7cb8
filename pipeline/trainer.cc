#include "pipeline/trainer.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <future>
#include <optional>
#include <thread>

#include "common/log.h"
#include "pipeline/trainer_impl.h"

namespace dflash::pipeline {

std::map<std::string, double> Trainer::Impl::stage_totals(const std::vector<std::unique_ptr<StageClock>> &clocks,
                                                          int64_t *iterations) {
  std::map<std::string, double> sum;
  *iterations = 0;
  for (const auto &c : clocks) {
    for (const auto &[stage, seconds] : c->totals()) sum[stage] += seconds;
    *iterations += c->iterations();
  }
  return sum;
}

void Trainer::Impl::fail(const std::string &reason) {
  {
    std::lock_guard lock(failure_mutex);
    if (failure_reason.empty()) failure_reason = reason;
  }
  log::error("{}", reason);
  failed.store(true);
  stop_requested.store(true);
  health->set_unhealthy("pipeline", reason);
  collective->abort();
  sample_queue->close();
  for (auto &q : feature_queues) q->close();
}

// No exception ever leaves a worker thread (that would terminate the process):
// what escapes the units run under the failure policy (a collective aborted by
// another worker's failure, a bug) ends the run with a reason.
void Trainer::Impl::contained(Worker &w, const std::function<void()> &loop) {
  try {
    loop();
  } catch (const std::exception &e) {
    if (!failed.load()) fail(w.name + ": " + e.what());
  }
}

// The final or failure checkpoint of the last complete step, waited for.
void Trainer::Impl::checkpoint_now(int64_t step) {
  checkpoints->maybe_checkpoint(step, /*force=*/true, *models->drafters[0], *models->optimizers[0]);
}

void Trainer::Impl::export_to(const std::string &dir) { models->drafters[0]->save_export(dir); }

// Some worker threads did not leave after a failure. Replica 0's weights are
// those of the last complete step once its thread left (its optimizer runs
// after every collective of a step): then the checkpoint is written, bounded in
// time (a GPU shared with a stuck worker can block the copies; the COMMIT
// protocol keeps a cut-off write harmless). The stuck threads are detached: the
// caller ends the process without destroying what they use
// (Trainer::abandoned).
void Trainer::Impl::abandon(int64_t step, std::chrono::duration<double> grace) {
  abandoned.store(true);
  const int stuck = workers->running();
  log::error(
      "{} worker thread(s) did not stop within {} s of the failure "
      "(stuck in a CUDA or NCCL call?)",
      stuck, log::fixed(grace.count(), 0));
  if (drafter0_exited.load()) {
    auto written = std::make_shared<std::promise<void>>();
    std::future<void> done = written->get_future();
    std::thread([this, step, written] {
      checkpoint_now(step);
      written->set_value();
    }).detach();
    if (done.wait_for(grace) != std::future_status::ready) {
      log::error(
          "the final checkpoint (step {}) did not finish within {} s; "
          "the newest complete one stays",
          step, log::fixed(grace.count(), 0));
    }
  } else {
    log::error(
        "no final checkpoint: drafter-0 is stuck mid-step; the newest "
        "complete checkpoint stays");
  }
  workers->detach();
}

Trainer::Trainer(const config::Config &config, prometheus::Registry &registry, std::shared_ptr<Health> health,
                 TestHooks hooks)
    : impl_(std::make_unique<Impl>()) {
  Impl &s = *impl_;
  s.config = config;
  s.hooks = std::move(hooks);
  s.health = std::move(health);
  s.registry = &registry;
  s.metrics = std::make_unique<RunMetrics>(config, registry);
  s.workers = std::make_unique<WorkerPool>(*s.metrics, *s.health);
  if (config.train.deterministic) {
    // Bit-identical reruns and resumes: deterministic kernels only (CPU math is
    // deterministic at a fixed thread count already).
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  s.load_models();
  s.open_data();
  s.resume();
  s.prepare_eval();
  s.connect();
}

Trainer::~Trainer() {
  if (impl_->workers && impl_->workers->started()) {
    request_stop();
    wait();
  }
}

void Trainer::start() {
  Impl &s = *impl_;
  s.health->set_healthy("pipeline");
  if (s.start_step >= s.plan.total_steps) {
    log::info("the plan is already complete (step {} of {})", s.start_step, s.plan.total_steps);
    s.finished.store(true);
    return;
  }
  Worker &reader = s.workers->add("reader");
  s.workers->spawn([&s, &reader] {
    s.contained(reader, [&] { s.reader_loop(reader); });
    s.sample_queue->close();  // no more samples: target workers drain and exit
  });
  std::vector<Worker *> target_workers;
  for (size_t t = 0; t < s.models->targets.size(); ++t)
    target_workers.push_back(&s.workers->add("target-" + std::to_string(t)));
  auto targets_left = std::make_shared<std::atomic<int>>(static_cast<int>(s.models->targets.size()));
  for (size_t t = 0; t < s.models->targets.size(); ++t) {
    s.workers->spawn([&s, w = target_workers[t], t, targets_left] {
      s.contained(*w, [&] { s.target_loop(*w, t); });
      if (targets_left->fetch_sub(1) == 1) {
        for (auto &q : s.feature_queues) q->close();
      }
    });
  }
  s.drafters_running.store(static_cast<int>(s.models->drafters.size()));
  for (size_t r = 0; r < s.models->drafters.size(); ++r) {
    Worker &w = s.workers->add("drafter-" + std::to_string(r));
    s.workers->spawn([&s, &w, r] {
      s.contained(w, [&] { s.drafter_loop(w, static_cast<int>(r)); });
      if (r == 0) s.drafter0_exited.store(true);
      if (s.drafters_running.fetch_sub(1) == 1) {
        // All drafters are done: stop the producers.
        s.stop_requested.store(true);
        s.sample_queue->close();
        for (auto &q : s.feature_queues) q->close();
        s.finished.store(true);
      }
    });
  }
}

void Trainer::supervise() {
  Impl &s = *impl_;
  const double now = unix_seconds();
  // A worker stuck in a CUDA or NCCL call cannot be restarted: the run stops
  // (wait() writes the last complete step's checkpoint where it can, and gives
  // up on stuck threads).
  for (const std::string &stall : s.workers->check_heartbeats(now, s.config.workers.stall_seconds)) {
    if (!s.failed.load()) {
      s.fail(stall + " (workers.stall_seconds: " + log::fixed(s.config.workers.stall_seconds, 0) + "); stopping the run");
    }
  }
  RunMetrics::Observation o;
  o.queues.push_back({"samples", s.sample_queue->depth(), s.sample_queue->capacity(),
                      s.sample_queue->producer_blocked_seconds(), s.sample_queue->consumer_starved_seconds()});
  for (size_t r = 0; r < s.feature_queues.size(); ++r) {
    const auto &q = *s.feature_queues[r];
    o.queues.push_back({"features-" + std::to_string(r), q.depth(), q.capacity(), q.producer_blocked_seconds(),
                        q.consumer_starved_seconds()});
  }
  o.target.stage_seconds = Impl::stage_totals(s.models->target_clocks, &o.target.iterations);
  o.target.replicas = s.models->target_clocks.size();
  o.drafter.stage_seconds = Impl::stage_totals(s.models->drafter_clocks, &o.drafter.iterations);
  o.drafter.replicas = s.models->drafter_clocks.size();
  o.completed_steps = s.completed_step.load();
  o.total_steps = s.plan.total_steps;
  o.tokens_per_step = s.plan.samples_per_epoch > 0 ? static_cast<double>(s.data->tokens_per_epoch()) /
                                                         static_cast<double>(s.plan.steps_per_epoch)
                                                   : 0;
  s.metrics->observe(o);
}

void Trainer::request_stop() {
  Impl &s = *impl_;
  if (!s.stop_requested.exchange(true)) log::info("stop requested: finishing the step in flight");
}

bool Trainer::done() const { return impl_->finished.load() || impl_->failed.load(); }

bool Trainer::abandoned() const { return impl_->abandoned.load(); }

Outcome Trainer::wait() {
  Impl &s = *impl_;
  // After a failure the workers have been told to leave (queues closed,
  // collectives aborted); one stuck in a CUDA or NCCL call never does: give
  // them a bounded time.
  const auto grace = std::chrono::duration<double>(std::min(60.0, s.config.workers.stall_seconds));
  const bool all_left = s.workers->wait_for_exit(s.failed.load() ? std::optional(grace) : std::nullopt);
  const int64_t step = s.completed_step.load();
  if (!all_left) {
    s.abandon(step, grace);
    return Outcome::failed;
  }
  s.workers->join();
  if (s.failed.load()) {
    s.checkpoint_now(step);  // weights are those of the last completed step
    return Outcome::failed;
  }
  s.checkpoint_now(step);
  if (s.evaluator) s.evaluator->finish();  // the evaluation in flight may still write export/best
  if (step >= s.plan.total_steps) {
    if (s.evaluator) s.evaluator->evaluate_final(step, *s.models->drafters[0]);
    s.export_to(s.config.run.output_dir + "/export/final");
    log::info(
        "run complete: {} steps; drafter exported to {}/export/final "
        "(best by {}: {}/export/best)",
        step, s.config.run.output_dir, s.evaluator ? "eval acceptance" : "training tau", s.config.run.output_dir);
    return Outcome::finished;
  }
  return Outcome::stopped;
}

std::string Trainer::failure() const {
  std::lock_guard lock(impl_->failure_mutex);
  return impl_->failure_reason;
}

std::string Trainer::status() const {
  const Impl &s = *impl_;
  return "training: step " + std::to_string(s.completed_step.load()) + "/" + std::to_string(s.plan.total_steps);
}

int64_t Trainer::step() const { return impl_->completed_step.load(); }

}  // namespace dflash::pipeline
