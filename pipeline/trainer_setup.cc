// The constructor's steps (trainer_impl.h): models, data, resume, connections.
#include <ATen/ATen.h>

#include <algorithm>
#include <nlohmann/json.hpp>

#include "common/log.h"
#include "drafter/optimizer.h"
#include "pipeline/gpu_memory.h"
#include "pipeline/memory_plan.h"
#include "pipeline/nccl_gradients.h"
#include "pipeline/run_check.h"
#include "pipeline/run_settings.h"
#include "decode/eval.h"
#include "pipeline/trainer_impl.h"
#include "target/model.h"

namespace dflash::pipeline {

// The target config, the drafter shape, the memory plan (refused before
// anything is loaded when it does not fit), the replicas on their devices and
// their kernel paths.
void Trainer::Impl::load_models() {
  Impl &s = *this;
  const config::Config &config = s.config;
  s.target_config = target_model_config(config.target);
  s.shape = drafter::shape_for_target(s.target_config, config.drafter);
  if (const std::string p = context_problem(config, s.target_config); !p.empty()) throw std::runtime_error(p);
  {
    // The memory plan per GPU (what `dflashd validate` prints), refused before
    // anything is loaded when it does not fit.
    const bool cuda = config.gpus.device == config::Device::cuda;
    const std::vector<GpuMemoryPlan> memory =
        plan_memory(config, s.target_config, s.shape, cuda ? gpu_capacities() : std::vector<int64_t>{},
                    cuda ? grouped_fp8_gpus(s.target_config) : std::vector<bool>{});
    log::info("{}", format_memory_plan(memory));
    const std::vector<std::string> problems = memory_plan_problems(memory);
    if (!problems.empty()) {
      std::string text;
      for (const std::string &p : problems) text += (text.empty() ? "" : "; ") + p;
      throw std::runtime_error("the memory plan does not fit: " + text);
    }
  }
  s.models = build_replicas(config, s.target_config, s.shape);
  // Every implementation choice in one shape (kernel_path.h): the log line and the metric.
  std::vector<KernelPath> paths;
  for (size_t stage = 0; stage < s.models->targets[0]->size(); ++stage) {
    for (const auto& [component, path] : s.models->targets[0]->stage(stage).kernel_paths()) {
      if (std::none_of(paths.begin(), paths.end(), [&](const KernelPath& p) { return p.component == component; })) {
        paths.push_back(path);
      }
    }
  }
  paths.push_back(s.models->attention);
  paths.push_back(activations_path(config.train));
  for (const KernelPath& p : paths) s.metrics->kernel_path_family->Add({{"component", p.component}, {"path", p.path}}).Set(1);
  log::info("kernel path: {}", s.models->attention.str());
  log::info("kernel path: {}", paths.back().str());
}

// The data, the plan of steps, the nodes, the failure policy, the optimizers.
void Trainer::Impl::open_data() {
  Impl &s = *this;
  const config::Config &config = s.config;
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
  s.settings_json = training_settings_json(config, s.shape, replicas);
  if (node_info.nodes > 1) {
    s.nodes = std::make_unique<NodeGroup>(node_info);
    // Every node reads its own copy of the data (the step plan assigns samples by position) and
    // its own config: its replicas' gradients are summed with the others' and its steps must be
    // theirs.
    s.nodes->require_same(nlohmann::json{{"samples", s.data->size()}, {"data digest", s.data->digest()}}.dump(),
                          "read different training data",
                          "give every node the same data.paths contents and data settings");
    s.nodes->require_same(s.settings_json, "would train differently",
                          "give every node the same drafter and train sections, target dtype and number of drafter "
                          "GPUs");
  }
  s.plan = StepPlan::make(s.data->size(), replicas * node_info.nodes, config.train.sequences_per_step,
                          config.train.grad_accumulation_steps, config.train.epochs, config.train.max_steps);
  s.failure_policy = std::make_unique<FailurePolicy>(
      FailurePolicy::Context{s.config.workers, *s.metrics, *s.health, *s.failed_samples,
                             [&s](int64_t index) { return s.data->describe(index); }, s.plan.replicas == 1,
                             [&s](const std::string &reason) { s.fail(reason); },
                             [&s] { return s.stop_requested.load() && s.failed.load(); }});
  add_optimizers(*s.models, config.train, s.plan.total_steps);
  s.step_settings = {s.shape,
                     s.target_config,
                     config.loss_gamma(),
                     static_cast<uint64_t>(config.train.seed),
                     config.train.anchors_per_sequence,
                     config.train.sequences_per_step,
                     static_cast<int64_t>(config.train.lm_head_chunk_blocks) * s.shape.block_size};
}

// The newest complete checkpoint (checkpoint.resume), which every node must
// agree on.
void Trainer::Impl::resume() {
  Impl &s = *this;
  const config::Config &config = s.config;
  s.checkpoints =
      std::make_unique<Checkpointer>(s.config, s.plan, s.data->digest(), s.settings_json, *s.metrics, *s.health,
                                     *s.failed_samples);
  s.start_step = s.checkpoints->resume(s.models->drafters, s.models->optimizers);
  if (s.nodes) {
    // Every node must resume from the same step (each reads its own output_dir).
    s.nodes->require_same("step " + std::to_string(s.start_step), "would resume from different steps",
                          "give every node the same checkpoints or checkpoint.resume: never");
  }
  if (config.drafter.init != "random") {
    log::info(s.checkpoints->resumed_from().empty() ? "drafter initialised from {} (drafter.init)"
                                                    : "drafter.init ({}) applies to a fresh run only: the "
                                                      "resumed checkpoint's weights are used",
              config.drafter.init);
  }
}

// The eval section: its prompts (eval.prompts, or data.eval_fraction's held-out samples, each up to
// its first supervised token) and the evaluation thread over the first target replica.
void Trainer::Impl::prepare_eval() {
  const config::EvalConfig& e = config.eval;
  if (e.every_steps <= 0) return;
  std::vector<decode::EvalPrompt> prompts;
  if (!e.prompts.empty()) {
    prompts = decode::read_eval_prompts(e.prompts, e.max_prompts);
  } else {
    for (int64_t i = 0; i < data->held_out_size() && static_cast<int64_t>(prompts.size()) < e.max_prompts; ++i) {
      std::vector<int64_t> prompt = decode::prompt_of(data->load_held_out(i));
      if (prompt.empty()) continue;  // supervised from its first token
      prompts.push_back({std::move(prompt), data->describe_held_out(i)});
    }
    if (prompts.empty()) {
      throw std::runtime_error("data.eval_fraction: " + std::to_string(data->held_out_size()) +
                               " held-out samples, none with a prompt (tokens before the first supervised one)");
    }
  }
  check_stop_tokens("eval.stop_token_ids", {e.stop_token_ids.begin(), e.stop_token_ids.end()},
                    target_config.vocab_size);
  evaluator = std::make_unique<Evaluator>(config, models->targets[0]->models(), shape, std::move(prompts), *registry);
}

// The collectives and the queues between the threads (the feature queue within
// its budget).
void Trainer::Impl::connect() {
  Impl &s = *this;
  const config::Config &config = s.config;
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
  // Feature memory: capacity x (longest sample x K x H x dtype) must fit the
  // budget.
  const int64_t item_bytes = static_cast<int64_t>(config.data.max_length) * s.shape.num_features() *
                             s.shape.hidden_size *
                             static_cast<int64_t>(c10::elementSize(model_dtype(config.target.dtype)));
  if (item_bytes * config.queues.features > config.queues.feature_memory_budget_bytes) {
    throw std::runtime_error("queues.features: " + std::to_string(config.queues.features) + " items of up to " +
                             std::to_string(item_bytes) + " bytes exceed queues.feature_memory_budget_bytes (" +
                             std::to_string(config.queues.feature_memory_budget_bytes) + ")");
  }
  log::info(
      "data: {} samples ({} tokens) per epoch, {} held out for eval (data.eval_fraction); skipped: {} with too few "
      "supervised tokens, {} without two adjacent supervised tokens (no anchor), {} malformed; digest {}",
      s.data->size(), s.data->tokens_per_epoch(), s.data->held_out_size(), s.data->skipped_short(),
      s.data->skipped_no_anchor(), s.data->skipped_malformed(), s.data->digest());
  log::info(
      "plan: {} steps ({} per epoch), global batch {} sequences on {} "
      "drafter replica(s); drafter {} layers, {} parameters",
      s.plan.total_steps, s.plan.steps_per_epoch, s.plan.global_batch(), replicas, s.shape.num_layers,
      s.shape.parameter_count());
}

}  // namespace dflash::pipeline
