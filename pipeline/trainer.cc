#include "pipeline/trainer.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "common/log.h"
#include "drafter/checkpoint.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"
#include "pipeline/bounded_queue.h"
#include "pipeline/checkpointer.h"
#include "pipeline/collective.h"
#include "pipeline/dataset.h"
#include "pipeline/drafter_step.h"
#include "pipeline/failed_samples.h"
#include "pipeline/gpu_memory.h"
#include "pipeline/memory_plan.h"
#include "pipeline/nccl_gradients.h"
#include "pipeline/nodes.h"
#include "pipeline/replicas.h"
#include "pipeline/run_check.h"
#include "pipeline/run_metrics.h"
#include "pipeline/streams.h"
#include "pipeline/workers.h"
#include "target/model.h"

namespace dflash::pipeline {
namespace {

using Clock = std::chrono::steady_clock;

struct SampleItem {
  int64_t q = 0;  // sample number across epochs
  TokenSample sample;
};

struct FeatureItem {
  int64_t q = 0;
  at::Tensor features;   // [tokens, K*H] on the drafter replica's device
  at::Tensor input_ids;  // [tokens] int64, same device
  std::vector<uint8_t> loss_mask;
  std::shared_ptr<ReadyEvent> ready;  // the target's work on them is done (GPU)
  bool skipped() const { return !features.defined(); }  // the sample failed too often (FailedSamples)
};

}  // namespace

struct Trainer::Impl {
  // ---- Constant after construction ---------------------------------------------------------
  config::Config config;
  TestHooks hooks;  // tests only (test_hooks.h)
  std::shared_ptr<Health> health;
  target::ModelConfig target_config;
  drafter::DrafterShape shape;
  std::shared_ptr<Dataset> data;
  StepPlan plan;
  StepSettings step_settings;
  int node_rank = 0;
  int64_t local_replicas = 1;  // drafter replicas of this node
  int nodes_in_run = 1;        // processes of the run (distributed.nodes)
  int64_t start_step = 0;      // the resumed checkpoint's step, or 0

  // ---- Components, thread-safe as their headers say (declared in the order they are built;
  // destroyed in reverse, so each outlives those that use it) ----------------------------------
  std::unique_ptr<RunMetrics> metrics;            // registration, step records, observations
  std::unique_ptr<WorkerPool> workers;            // the worker threads and their heartbeats
  std::unique_ptr<Replicas> models;               // each replica used by its own worker's thread
  std::unique_ptr<FailedSamples> failed_samples;  // counts restored from the checkpoint
  std::unique_ptr<FailurePolicy> failure_policy;  // retries, skips, stops (workers.*)
  std::unique_ptr<NodeGroup> nodes;               // multi-node runs: the other processes
  std::unique_ptr<Collective> collective;         // the drafter replicas' sums
  std::unique_ptr<BoundedQueue<SampleItem>> sample_queue;                 // reader -> target workers
  std::vector<std::unique_ptr<BoundedQueue<FeatureItem>>> feature_queues;  // -> drafter replica r

  // ---- Run state every thread reads and writes (atomics) -------------------------------------
  std::atomic<int64_t> completed_step{0};    // the highest step every local replica finished
  std::atomic<bool> stop_requested{false};   // SIGTERM, a failure, or the drafters are done
  std::atomic<bool> failed{false};
  std::atomic<int> drafters_running{0};
  std::atomic<bool> finished{false};         // every drafter left its loop
  std::atomic<bool> drafter0_exited{false};  // replica 0's weights are no longer being changed
  std::atomic<bool> abandoned{false};        // wait() left stuck threads behind

  // ---- Guarded by failure_mutex ---------------------------------------------------------------
  mutable std::mutex failure_mutex;
  std::string failure_reason;  // the first failure's

  // The constructor's steps, in order.
  void load_models();
  void open_data();
  void resume();
  void connect();

  int64_t data_index(int64_t q) const { return data->sample_at(q / plan.samples_per_epoch, q % plan.samples_per_epoch); }

  // Seconds per stage summed over the replicas of a role.
  static std::map<std::string, double> stage_totals(const std::vector<std::unique_ptr<StageClock>>& clocks,
                                                    int64_t* iterations) {
    std::map<std::string, double> sum;
    *iterations = 0;
    for (const auto& c : clocks) {
      for (const auto& [stage, seconds] : c->totals()) sum[stage] += seconds;
      *iterations += c->iterations();
    }
    return sum;
  }

  void fail(const std::string& reason) {
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
    for (auto& q : feature_queues) q->close();
  }

  // No exception ever leaves a worker thread (that would terminate the process): what escapes
  // the units run under the failure policy (a collective aborted by another worker's failure, a
  // bug) ends the run with a reason.
  void contained(Worker& w, const std::function<void()>& loop) {
    try {
      loop();
    } catch (const std::exception& e) {
      if (!failed.load()) fail(w.name + ": " + e.what());
    }
  }

  // ---- reader ----------------------------------------------------------------------------
  void reader_loop(Worker& w) {
    const int64_t first = plan.first_sample(start_step);
    const int64_t end = plan.end_sample(plan.total_steps - 1);
    for (int64_t q = first; q < end && !stop_requested.load(); ++q) {
      w.beat();
      if (plan.replica_of(q) / local_replicas != node_rank) continue;  // another node's sample
      SampleItem item;
      item.q = q;
      if (!failure_policy->run(w, "sample " + std::to_string(q), [&] {
            item.sample = data->load(data_index(q));
          })) {
        return;
      }
      if (!sample_queue->push(std::move(item), [&] { w.beat(); })) return;
    }
  }

  // ---- target worker -----------------------------------------------------------------------
  void target_loop(Worker& w, size_t replica) {
    c10::InferenceMode inference;
    const target::TargetModel& model = *models->targets[replica];
    const WorkerStream stream(model.options().device);
    StageClock& clock = *models->target_clocks[replica];
    const std::vector<int64_t> layers(shape.target_layer_ids.begin(), shape.target_layer_ids.end());
    while (auto item = sample_queue->pop([&] { w.beat(); })) {
      w.beat();
      std::optional<GpuTurn> turn;  // released before the push: a full queue must not hold the GPU
      turn.emplace(models->turn_of(model.options().device), model.options().device);
      clock.start();
      const int64_t drafter_replica = plan.replica_of(item->q) - node_rank * local_replicas;  // local index
      FeatureItem out;
      out.q = item->q;
      const int64_t index = data_index(item->q);
      bool skipped = failed_samples->skipped(index);  // then `out` goes on without features
      const bool ok = skipped || failure_policy->run(w, "sample " + std::to_string(item->q), [&] {
        if (hooks.target_forward) hooks.target_forward(item->q);
        const at::Tensor ids = at::tensor(item->sample.input_ids, at::TensorOptions().dtype(at::kLong));
        const int64_t tokens = ids.size(0);
        auto tapped = model.forward(ids, {0, tokens}, layers);
        clock.lap("target_forward");
        // fc input: the tapped layers concatenated in ascending id order (docs/recipe.md).
        const at::Device to = models->drafter_devices[drafter_replica];
        out.features = at::cat(tapped, -1).to(to, /*non_blocking=*/false, /*copy=*/false);
        out.input_ids = ids.to(to);
        out.loss_mask = item->sample.loss_mask;
        out.ready = mark_ready(to);
        clock.lap("feature_handoff");
      }, {index}, &skipped);
      if (skipped) {
        out = FeatureItem{};  // no features: the drafter leaves the sample out
        out.q = item->q;
      }
      if (!ok) return;
      turn.reset();
      if (!feature_queues[drafter_replica]->push(std::move(out), [&] { w.beat(); })) return;
    }
  }

  // ---- drafter worker ----------------------------------------------------------------------
  void drafter_loop(Worker& w, int replica) {
    BoundedQueue<FeatureItem>& queue = *feature_queues[replica];
    const WorkerStream stream(models->drafter_devices[replica]);
    std::map<int64_t, FeatureItem> waiting;  // reorder buffer: items arrive in any order
    for (int64_t step = start_step; step < plan.total_steps; ++step) {
      w.beat();
      // Every replica agrees to stop at the same step boundary.
      if (collective->sum(replica, stop_requested.load() ? 1.0 : 0.0) > 0) return;
      const std::vector<int64_t> wanted = plan.samples_for(step, node_rank * local_replicas + replica);
      for (int64_t q : wanted) {
        while (!waiting.count(q)) {
          auto item = queue.pop([&] { w.beat(); });
          if (!item) return;  // closed: the run is stopping or failed
          wait_ready(item->ready, {item->features, item->input_ids});
          waiting.emplace(item->q, std::move(*item));
        }
      }
      StepOutput out;
      std::vector<int64_t> indices;  // the step's samples in data order, for FailedSamples
      for (int64_t q : wanted) indices.push_back(data_index(q));
      const bool ok = failure_policy->run(w, "step " + std::to_string(step), [&] {
        // A retried step starts from clean gradients. With several replicas a retry would put this
        // replica out of step with the others' collectives, so failures stop the run instead.
        if (w.restarts.load() > 0 && plan.replicas > 1) {
          throw std::runtime_error("a drafter step cannot be retried with several data-parallel replicas");
        }
        std::vector<StepSample> samples;
        for (int64_t q : wanted) {
          const FeatureItem& item = waiting.at(q);
          if (item.skipped() || failed_samples->skipped(data_index(q))) continue;
          samples.push_back({q, item.features, item.input_ids, &item.loss_mask});
        }
        out = drafter_step(models->drafter[replica], step_settings, samples, *collective, [&] {
          if (hooks.drafter_step) hooks.drafter_step(replica, step);
        });
      }, indices);
      if (!ok) return;
      for (int64_t q : wanted) waiting.erase(q);
      if (!out.result.applied) {
        metrics->nonfinite_total->Increment();
        const std::string message = "non-finite gradient (norm " + std::to_string(out.result.grad_norm) + ") at step " +
                                    std::to_string(step);
        if (config.train.on_nonfinite == config::OnNonfinite::stop) {
          if (replica == 0) fail(message + "; stopping (train.on_nonfinite: stop)");
          return;
        }
        log::warn("{}: step skipped", message);
      }
      if (out.empty && replica == 0) {
        metrics->empty_steps_total->Increment();
        log::warn("step {}: none of its samples has a block to train (every one was skipped or has no anchor): "
                  "no update", step);
      }
      completed_step.store(step + 1);
      if (replica != 0) continue;
      metrics->record_step({step, out.stats.weight_sum > 0 ? out.stats.loss_sum / out.stats.weight_sum : 0, out.stats.tau(),
                            out.result.learning_rate, out.result.grad_norm, out.stats.accuracy(), out.tokens,
                            static_cast<int64_t>(wanted.size()) * plan.replicas, out.flops});
      checkpoints->maybe_checkpoint(step + 1, false, *models->drafters[0], *models->optimizers[0]);
    }
  }

  // The final or failure checkpoint of the last complete step, waited for.
  void checkpoint_now(int64_t step) {
    checkpoints->maybe_checkpoint(step, /*force=*/true, *models->drafters[0], *models->optimizers[0]);
  }

  void export_to(const std::string& dir) { models->drafters[0]->save_export(dir); }

  // Some worker threads did not leave after a failure. Replica 0's weights are those of the
  // last complete step once its thread left (its optimizer runs after every collective of a
  // step): then the checkpoint is written, bounded in time (a GPU shared with a stuck worker can
  // block the copies; the COMMIT protocol keeps a cut-off write harmless). The stuck threads are
  // detached: the caller ends the process without destroying what they use (Trainer::abandoned).
  void abandon(int64_t step, std::chrono::duration<double> grace) {
    abandoned.store(true);
    const int stuck = workers->running();
    log::error("{} worker thread(s) did not stop within {} s of the failure (stuck in a CUDA or NCCL call?)", stuck,
               fixed(grace.count(), 0));
    if (drafter0_exited.load()) {
      auto written = std::make_shared<std::promise<void>>();
      std::future<void> done = written->get_future();
      std::thread([this, step, written] {
        checkpoint_now(step);
        written->set_value();
      }).detach();
      if (done.wait_for(grace) != std::future_status::ready) {
        log::error("the final checkpoint (step {}) did not finish within {} s; the newest complete one stays", step,
                   fixed(grace.count(), 0));
      }
    } else {
      log::error("no final checkpoint: drafter-0 is stuck mid-step; the newest complete checkpoint stays");
    }
    workers->detach();
  }

  // Last member, so destroyed first: its writer thread finishes the write in flight while
  // everything it uses still exists.
  std::unique_ptr<Checkpointer> checkpoints;
};

// The target config, the drafter shape, the memory plan (refused before anything is loaded when
// it does not fit), the replicas on their devices and their kernel paths.
void Trainer::Impl::load_models() {
  Impl& s = *this;
  const config::Config& config = s.config;
  s.target_config = target_model_config(config.target);
  s.shape = drafter::shape_for_target(s.target_config, config.drafter);
  {
    // The memory plan per GPU (what `dflashd validate` prints), refused before anything is
    // loaded when it does not fit.
    const std::vector<GpuMemoryPlan> memory =
        plan_memory(config, s.target_config, s.shape, config.gpus.device == config::Device::cuda ? gpu_capacities() : std::vector<int64_t>{});
    log::info("{}", format_memory_plan(memory));
    const std::vector<std::string> problems = memory_plan_problems(memory);
    if (!problems.empty()) {
      std::string text;
      for (const std::string& p : problems) text += (text.empty() ? "" : "; ") + p;
      throw std::runtime_error("the memory plan does not fit: " + text);
    }
  }
  s.models = build_replicas(config, s.target_config, s.shape);
  for (const auto& [kind, path] : s.models->targets[0]->kernel_paths()) {
    s.metrics->kernel_path_family->Add({{"layer_type", kind}, {"path", path}}).Set(1);
  }
  log::info("drafter attention: {}", s.models->attention_description);
  s.metrics->attention_path_family->Add({{"path", s.models->attention_name}}).Set(1);

}

// The data, the plan of steps, the nodes, the failure policy, the optimizers.
void Trainer::Impl::open_data() {
  Impl& s = *this;
  const config::Config& config = s.config;
  s.data = Dataset::open(config.data, s.target_config.vocab_size);
  s.failed_samples = std::make_unique<FailedSamples>(config.workers.skip_sample_after_failures);

  s.metrics->skipped_short_total->Increment(static_cast<double>(s.data->skipped_short()));
  s.metrics->skipped_no_anchor_total->Increment(static_cast<double>(s.data->skipped_no_anchor()));
  s.metrics->skipped_malformed_total->Increment(static_cast<double>(s.data->skipped_malformed()));
  const int64_t replicas = static_cast<int64_t>(config.gpus.drafter.size());
  const NodeInfo node_info = resolve_nodes(config.distributed);
  s.nodes_in_run = node_info.nodes;
  s.node_rank = node_info.rank;
  s.local_replicas = replicas;
  if (node_info.nodes > 1) s.nodes = std::make_unique<NodeGroup>(node_info);
  s.plan = StepPlan::make(s.data->size(), replicas * node_info.nodes, config.train.sequences_per_step,
                          config.train.grad_accumulation_steps, config.train.epochs, config.train.max_steps);
  s.failure_policy = std::make_unique<FailurePolicy>(FailurePolicy::Context{
      s.config.workers, *s.metrics, *s.health, *s.failed_samples,
      [&s](int64_t index) { return s.data->describe(index); }, s.plan.replicas == 1,
      [&s](const std::string& reason) { s.fail(reason); }, [&s] { return s.stop_requested.load() && s.failed.load(); }});
  add_optimizers(*s.models, config.train, s.plan.total_steps);
  s.step_settings = {s.shape,
                     s.target_config,
                     config.loss_gamma(),
                     static_cast<uint64_t>(config.train.seed),
                     config.train.anchors_per_sequence,
                     config.train.sequences_per_step,
                     static_cast<int64_t>(config.train.lm_head_chunk_blocks) * s.shape.block_size};

}

// The newest complete checkpoint (checkpoint.resume), which every node must agree on.
void Trainer::Impl::resume() {
  Impl& s = *this;
  const config::Config& config = s.config;
  s.checkpoints = std::make_unique<Checkpointer>(s.config, s.plan, *s.metrics, *s.health, *s.failed_samples);
  s.start_step = s.checkpoints->resume(s.models->drafters, s.models->optimizers);
  if (s.nodes) {
    // Every node must resume from the same step (each reads its own output_dir).
    const std::vector<double> agreed = s.nodes->sum({static_cast<double>(s.start_step),
                                                     static_cast<double>(s.start_step) * static_cast<double>(s.start_step)});
    const double n = s.nodes_in_run, mean = agreed[0] / n;
    if (agreed[1] / n - mean * mean > 0.25) {
      throw std::runtime_error("distributed: the nodes would resume from different steps (this node: " +
                               std::to_string(s.start_step) + ", mean over nodes: " + std::to_string(mean) +
                               "); give every node the same checkpoints or checkpoint.resume: never");
    }
  }
  if (config.drafter.init != "random") {
    log::info(s.checkpoints->resumed_from().empty() ? "drafter initialised from {} (drafter.init)"
                                  : "drafter.init ({}) applies to a fresh run only: the resumed checkpoint's weights are used",
              config.drafter.init);
  }
}

// The collectives and the queues between the threads (the feature queue within its budget).
void Trainer::Impl::connect() {
  Impl& s = *this;
  const config::Config& config = s.config;
  s.completed_step.store(s.start_step);
  const int64_t replicas = s.local_replicas;
  std::unique_ptr<NcclGradients> nccl;
  if (config.gpus.device == config::Device::cuda && replicas * s.nodes_in_run > 1) {
    nccl = std::make_unique<NcclGradients>(config.gpus.drafter, s.nodes.get());
    log::info("data-parallel gradients: NCCL all-reduce over {} GPUs on {} node(s)", replicas * s.nodes_in_run,
              s.nodes_in_run);
  }
  s.collective = std::make_unique<Collective>(static_cast<int>(replicas), s.nodes.get(), std::move(nccl));
  s.sample_queue = std::make_unique<BoundedQueue<SampleItem>>(config.queues.samples);
  s.metrics->add_queue("samples", config.queues.samples);
  for (int64_t r = 0; r < replicas; ++r) {
    s.feature_queues.push_back(std::make_unique<BoundedQueue<FeatureItem>>(config.queues.features));
    const std::string name = "features-" + std::to_string(r);
    s.metrics->add_queue(name, config.queues.features);
  }
  // Feature memory: capacity x (longest sample x K x H x dtype) must fit the budget.
  const int64_t item_bytes = static_cast<int64_t>(config.data.max_length) * s.shape.num_features() * s.shape.hidden_size *
                             static_cast<int64_t>(c10::elementSize(model_dtype(config.target.dtype)));
  if (item_bytes * config.queues.features > config.queues.feature_memory_budget_bytes) {
    throw std::runtime_error("queues.features: " + std::to_string(config.queues.features) + " items of up to " +
                             std::to_string(item_bytes) + " bytes exceed queues.feature_memory_budget_bytes (" +
                             std::to_string(config.queues.feature_memory_budget_bytes) + ")");
  }
  log::info("data: {} samples ({} tokens) per epoch; skipped: {} with too few supervised tokens, {} without two adjacent "
            "supervised tokens (no anchor), {} malformed",
            s.data->size(), s.data->tokens_per_epoch(), s.data->skipped_short(), s.data->skipped_no_anchor(),
            s.data->skipped_malformed());
  log::info("plan: {} steps ({} per epoch), global batch {} sequences on {} drafter replica(s); drafter {} layers, {} parameters",
            s.plan.total_steps, s.plan.steps_per_epoch, s.plan.global_batch(), replicas, s.shape.num_layers,
            s.shape.parameter_count());}

Trainer::Trainer(const config::Config& config, prometheus::Registry& registry, std::shared_ptr<Health> health,
                 TestHooks hooks)
    : impl_(std::make_unique<Impl>()) {
  Impl& s = *impl_;
  s.config = config;
  s.hooks = std::move(hooks);
  s.health = std::move(health);
  s.metrics = std::make_unique<RunMetrics>(config, registry);
  s.workers = std::make_unique<WorkerPool>(*s.metrics, *s.health);
  if (config.train.deterministic) {
    // Bit-identical reruns and resumes: deterministic kernels only (CPU math is deterministic
    // at a fixed thread count already).
    at::globalContext().setDeterministicAlgorithms(true, /*warn_only=*/false);
  }
  s.load_models();
  s.open_data();
  s.resume();
  s.connect();
}


Trainer::~Trainer() {
  if (impl_->workers && impl_->workers->started()) {
    request_stop();
    wait();
  }
}

void Trainer::start() {
  Impl& s = *impl_;
  s.health->set_healthy("pipeline");
  if (s.start_step >= s.plan.total_steps) {
    log::info("the plan is already complete (step {} of {})", s.start_step, s.plan.total_steps);
    s.finished.store(true);
    return;
  }
  Worker& reader = s.workers->add("reader");
  s.workers->spawn([&s, &reader] {
    s.contained(reader, [&] { s.reader_loop(reader); });
    s.sample_queue->close();  // no more samples: target workers drain and exit
  });
  std::vector<Worker*> target_workers;
  for (size_t t = 0; t < s.models->targets.size(); ++t) target_workers.push_back(&s.workers->add("target-" + std::to_string(t)));
  auto targets_left = std::make_shared<std::atomic<int>>(static_cast<int>(s.models->targets.size()));
  for (size_t t = 0; t < s.models->targets.size(); ++t) {
    s.workers->spawn([&s, w = target_workers[t], t, targets_left] {
      s.contained(*w, [&] { s.target_loop(*w, t); });
      if (targets_left->fetch_sub(1) == 1) {
        for (auto& q : s.feature_queues) q->close();
      }
    });
  }
  s.drafters_running.store(static_cast<int>(s.models->drafters.size()));
  for (size_t r = 0; r < s.models->drafters.size(); ++r) {
    Worker& w = s.workers->add("drafter-" + std::to_string(r));
    s.workers->spawn([&s, &w, r] {
      s.contained(w, [&] { s.drafter_loop(w, static_cast<int>(r)); });
      if (r == 0) s.drafter0_exited.store(true);
      if (s.drafters_running.fetch_sub(1) == 1) {
        // All drafters are done: stop the producers.
        s.stop_requested.store(true);
        s.sample_queue->close();
        for (auto& q : s.feature_queues) q->close();
        s.finished.store(true);
      }
    });
  }
}

void Trainer::supervise() {
  Impl& s = *impl_;
  const double now = unix_seconds();
  // A worker stuck in a CUDA or NCCL call cannot be restarted: the run stops (wait() writes the
  // last complete step's checkpoint where it can, and gives up on stuck threads).
  for (const std::string& stall : s.workers->check_heartbeats(now, s.config.workers.stall_seconds)) {
    if (!s.failed.load()) {
      s.fail(stall + " (workers.stall_seconds: " + fixed(s.config.workers.stall_seconds, 0) + "); stopping the run");
    }
  }
  RunMetrics::Observation o;
  o.queues.push_back({"samples", s.sample_queue->depth(), s.sample_queue->capacity(),
                      s.sample_queue->producer_blocked_seconds(), s.sample_queue->consumer_starved_seconds()});
  for (size_t r = 0; r < s.feature_queues.size(); ++r) {
    const auto& q = *s.feature_queues[r];
    o.queues.push_back({"features-" + std::to_string(r), q.depth(), q.capacity(), q.producer_blocked_seconds(),
                        q.consumer_starved_seconds()});
  }
  o.target.stage_seconds = Impl::stage_totals(s.models->target_clocks, &o.target.iterations);
  o.target.replicas = s.models->target_clocks.size();
  o.drafter.stage_seconds = Impl::stage_totals(s.models->drafter_clocks, &o.drafter.iterations);
  o.drafter.replicas = s.models->drafter_clocks.size();
  o.completed_steps = s.completed_step.load();
  o.total_steps = s.plan.total_steps;
  o.tokens_per_step = s.plan.samples_per_epoch > 0
                          ? static_cast<double>(s.data->tokens_per_epoch()) / static_cast<double>(s.plan.steps_per_epoch)
                          : 0;
  s.metrics->observe(o);
}

void Trainer::request_stop() {
  Impl& s = *impl_;
  if (!s.stop_requested.exchange(true)) log::info("stop requested: finishing the step in flight");
}

bool Trainer::done() const { return impl_->finished.load() || impl_->failed.load(); }

bool Trainer::abandoned() const { return impl_->abandoned.load(); }

Outcome Trainer::wait() {
  Impl& s = *impl_;
  // After a failure the workers have been told to leave (queues closed, collectives aborted); one
  // stuck in a CUDA or NCCL call never does: give them a bounded time.
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
  if (step >= s.plan.total_steps) {
    s.export_to(s.config.run.output_dir + "/export/final");
    log::info("run complete: {} steps; drafter exported to {}/export/final (best by training tau: {}/export/best)",
              step, s.config.run.output_dir, s.config.run.output_dir);
    return Outcome::finished;
  }
  return Outcome::stopped;
}

std::string Trainer::failure() const {
  std::lock_guard lock(impl_->failure_mutex);
  return impl_->failure_reason;
}

std::string Trainer::status() const {
  const Impl& s = *impl_;
  return "training: step " + std::to_string(s.completed_step.load()) + "/" + std::to_string(s.plan.total_steps);
}

int64_t Trainer::step() const { return impl_->completed_step.load(); }

}  // namespace dflash::pipeline
