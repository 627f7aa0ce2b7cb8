#include "pipeline/memory_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <set>

#include "common/log.h"
#include "target/decode_plan.h"
#include "target/stage_plan.h"

namespace dflash::pipeline {
namespace {


// The bytes of the target's layers first..last (every expert of an MoE layer is resident): the
// attention, GatedDeltaNet and dense MLP projections and the MoE experts at one byte each plus a
// factor per 128x128 block under target.dtype: float8 (target/fp8.h), everything else at the
// model dtype's size.
int64_t target_layer_bytes(const target::ModelConfig& c, int64_t first, int64_t last, config::ModelDtype dtype) {
  const int64_t h = c.hidden_size;
  int64_t projections = 0, other = 0;
  for (int64_t i = first; i <= last && i < c.num_layers; ++i) {
    if (c.layer_types[i] == target::LayerKind::full_attention) {
      const int64_t q = c.num_attention_heads * c.head_dim * (c.gated_attention ? 2 : 1);
      projections += h * (q + 2 * c.num_key_value_heads * c.head_dim) + c.num_attention_heads * c.head_dim * h;
    } else {
      const int64_t key = c.linear_num_key_heads * c.linear_key_head_dim;
      const int64_t value = c.linear_num_value_heads * c.linear_value_head_dim;
      projections += h * (2 * key + 2 * value + 2 * c.linear_num_value_heads) + value * h;
      other += (2 * key + value) * c.linear_conv_kernel_dim;
    }
    if (c.layer_is_moe(i)) {
      projections += 3 * h * c.moe_intermediate_size * c.num_experts;
      other += h * c.num_experts + 3 * h * c.shared_expert_intermediate_size + h;
    } else {
      projections += 3 * h * c.intermediate_size;
    }
    other += 2 * h;  // the layer's norms
  }
  const int64_t bytes = config::bytes_of(dtype);
  if (dtype != config::ModelDtype::float8) return (projections + other) * bytes;
  return projections + projections / (128 * 128) * 4 + other * bytes;
}

// The widest intermediate a target layer makes per token (elements).
int64_t target_widest_per_token(const target::ModelConfig& c) {
  int64_t widest = 2 * c.intermediate_size;  // gate and up
  widest = std::max(widest, c.num_attention_heads * c.head_dim * 2 + 2 * c.num_key_value_heads * c.head_dim);
  widest = std::max(widest, 2 * c.linear_num_key_heads * c.linear_key_head_dim +
                                2 * c.linear_num_value_heads * c.linear_value_head_dim);
  // MoE: each token's top-k experts' gate and up rows, plus the shared expert's.
  widest = std::max(widest, 2 * c.moe_intermediate_size * c.num_experts_per_tok + 2 * c.shared_expert_intermediate_size);
  return widest;
}

// The drafter's activations in a step (hidden size h, vocabulary v).
int64_t drafter_activation_bytes(const config::Config& config, const drafter::DrafterShape& shape, int64_t h, int64_t v) {
  const int64_t bytes = config::bytes_of(config.target.dtype), tokens = config.data.max_length;
  const int64_t rows = static_cast<int64_t>(config.train.anchors_per_sequence) * shape.block_size *
                       config.train.sequences_per_step;
  const int64_t q_width = shape.num_attention_heads * shape.head_dim;
  const int64_t kv_width = 2 * shape.num_key_value_heads * shape.head_dim;
  // Saved for backward per layer: the layer input, norms, q / k / v, attention output and
  // statistics, o_proj input, MLP gate / up / product; the context's keys and values.
  const int64_t per_layer = rows * (4 * h + 2 * q_width + kv_width + 3 * shape.intermediate_size) * bytes +
                            tokens * kv_width * bytes;
  const int64_t chunk_rows = std::min<int64_t>(rows, static_cast<int64_t>(config.train.lm_head_chunk_blocks) * shape.block_size);
  // Checkpointed layers keep their input rows; backward holds one layer's activations at a time.
  const int64_t layers_kept = config.train.activation_checkpointing ? rows * h * bytes * shape.num_layers + per_layer
                                                                    : shape.num_layers * per_layer;
  return layers_kept + tokens * h * bytes * 2 + 2 * chunk_rows * v * 4;
}

// Evaluation (the eval section) decodes with target replica 0 (every layer), a verify step of a
// block at a time: each of its stages' GPUs holds the decoding caches of its layers, the last
// one the drafter's copy too (and, for a replica over several GPUs, the embedding's: the drafter
// reads it there). By GPU; none without the eval section.
std::map<int, int64_t> evaluation_bytes(const config::Config& config, const target::ModelConfig& target,
                                        const drafter::DrafterShape& shape) {
  std::map<int, int64_t> on;
  if (config.eval.every_steps <= 0 || config.gpus.target_replicas.empty()) return on;
  const std::vector<int>& ids = config.gpus.target_replicas[0];
  const int64_t bytes = config::bytes_of(config.target.dtype);
  const std::vector<target::LayerRange> ranges =
      target::plan_target_stages(target, target.num_layers - 1, std::min<size_t>(ids.size(), target.num_layers),
                                 config.data.max_length);
  on = target::decoding_bytes_by_gpu(target, ranges, ids, config.data.max_length + config.eval.max_new_tokens,
                                     shape.block_size, bytes, config::bytes_of(config.target.decode_state_dtype));
  for (auto& [gpu, each] : on) each *= config.eval.max_batch;
  on[ids[ranges.size() - 1]] += shape.parameter_count() * bytes +
                                (ranges.size() > 1 ? target.vocab_size * target.hidden_size * bytes : 0);
  return on;
}

std::string gb(int64_t bytes) { return log::fixed(static_cast<double>(bytes) / 1e9, 1); }

}  // namespace

std::vector<GpuMemoryPlan> plan_memory(const config::Config& config, const target::ModelConfig& target,
                                       const drafter::DrafterShape& shape, const std::vector<int64_t>& capacities,
                                       const std::vector<bool>& grouped_fp8) {
  const int64_t bytes = config::bytes_of(config.target.dtype);
  const int64_t h = target.hidden_size, v = target.vocab_size, tokens = config.data.max_length;
  const int64_t head_and_embedding = (target.tie_word_embeddings ? 1 : 2) * v * h * bytes;
  const int64_t last_layer = config.eval.every_steps > 0            ? target.num_layers - 1
                             : shape.target_layer_ids.empty() ? 0
                                                              : shape.target_layer_ids.back();

  // Per GPU: the layers of the stages it holds (a replica on one GPU is one stage of every layer),
  // the embedding with a replica's first stage, the LM head with its last.
  std::map<int, int64_t> weights_on;
  std::map<int, std::string> layers_on;
  const int64_t embedding = v * h * bytes;
  for (const std::vector<int>& ids : config.gpus.target_replicas) {
    const std::vector<target::LayerRange> ranges = target::plan_target_stages(
        target, last_layer, std::min<size_t>(ids.size(), static_cast<size_t>(last_layer + 1)), tokens);
    for (size_t s = 0; s < ranges.size(); ++s) {
      int64_t w = target_layer_bytes(target, ranges[s].first, ranges[s].last, config.target.dtype);
      if (ranges[s].first == 0) w += embedding;
      if (ranges[s].head) w += head_and_embedding - (ranges[s].first == 0 && target.tie_word_embeddings ? embedding : 0);
      weights_on[ids[s]] += w;
      if (ids.size() > 1) {
        layers_on[ids[s]] += (layers_on[ids[s]].empty() ? " L" : ",L") + std::to_string(ranges[s].first) + "-" +
                             std::to_string(ranges[s].last);
      }
    }
  }
  // FP8 experts are dequantized to bf16 one layer at a time where the FP8 grouped GEMM does not
  // run (a GPU other than sm_90a; at Qwen3.5-35B-A3B's shapes 1.6 GB, at 397B-A17B's 12.9).
  const int64_t dequantized_experts = config.target.dtype == config::ModelDtype::float8
                                          ? 3 * h * target.moe_intermediate_size * target.num_experts * bytes
                                          : 0;
  const auto runs_grouped_fp8 = [&](int id) {
    return id >= 0 && id < static_cast<int>(grouped_fp8.size()) && grouped_fp8[static_cast<size_t>(id)];
  };
  const int64_t target_activations =
      tokens * (3 * std::max(target_widest_per_token(target), 4 * h) + shape.num_features() * h) * bytes;

  const int64_t p = shape.parameter_count();
  const int64_t drafter_state = p * (2 * bytes + (bytes == 4 ? 0 : 4) + 8);
  const int64_t item = tokens * shape.num_features() * h * bytes;
  const int64_t queued = (config.queues.features + config.train.sequences_per_step) * item;
  const int64_t drafter_activations = drafter_activation_bytes(config, shape, h, v);

  std::map<int, int64_t> eval_decoding = evaluation_bytes(config, target, shape);

  std::set<int> ids(config.gpus.target.begin(), config.gpus.target.end());
  ids.insert(config.gpus.drafter.begin(), config.gpus.drafter.end());
  std::vector<GpuMemoryPlan> plan;
  for (int id : ids) {
    GpuMemoryPlan g;
    g.gpu = id;
    g.target = std::count(config.gpus.target.begin(), config.gpus.target.end(), id) > 0;
    g.drafter = std::count(config.gpus.drafter.begin(), config.gpus.drafter.end(), id) > 0;
    if (g.target) {
      g.target_weights = weights_on[id];
      g.target_activations = target_activations + (runs_grouped_fp8(id) ? 0 : dequantized_experts);
      g.target_layers = layers_on[id];
      g.eval_decoding = eval_decoding[id];
    }
    if (g.drafter) {
      g.drafter_state = drafter_state + (g.target ? 0 : head_and_embedding);
      g.queued_features = queued;
      g.drafter_activations = drafter_activations;
      g.activations_checkpointed = config.train.activation_checkpointing;
    }
    if (config.gpus.device == config::Device::cuda && id >= 0 && id < static_cast<int>(capacities.size())) g.capacity = capacities[id];
    plan.push_back(g);
  }
  return plan;
}

std::string format_memory_plan(const std::vector<GpuMemoryPlan>& plan) {
  std::string out = "memory plan (GB, estimated): gpu  roles           target weights  target act.  drafter state  "
                    "features  drafter act.  eval decoding  total / capacity\n";
  for (const GpuMemoryPlan& g : plan) {
    char line[256];
    const std::string roles = g.target && g.drafter ? "target" + g.target_layers + "+drafter"
                              : g.target            ? "target" + g.target_layers
                                                    : "drafter";
    std::snprintf(line, sizeof(line), "%33d  %-14s  %14s  %11s  %13s  %8s  %12s  %13s  %s / %s\n", g.gpu, roles.c_str(),
                  gb(g.target_weights).c_str(), gb(g.target_activations).c_str(), gb(g.drafter_state).c_str(),
                  gb(g.queued_features).c_str(), gb(g.drafter_activations).c_str(), gb(g.eval_decoding).c_str(),
                  gb(g.total()).c_str(), g.capacity > 0 ? gb(g.capacity).c_str() : "?");
    out += line;
  }
  if (!out.empty()) out.pop_back();
  return out;
}

std::vector<std::string> memory_plan_problems(const std::vector<GpuMemoryPlan>& plan) {
  std::vector<std::string> problems;
  for (const GpuMemoryPlan& g : plan) {
    if (g.capacity <= 0 || g.total() <= static_cast<int64_t>(kHeadroom * static_cast<double>(g.capacity))) continue;
    std::string advice;
    if (g.target && g.drafter) advice = "give the target and the drafter separate GPUs (gpus.target, gpus.drafter), ";
    if (g.drafter && !g.activations_checkpointed) advice += "set train.activation_checkpointing: true, ";
    if (g.eval_decoding > 0) advice += "lower eval.max_batch or set target.decode_state_dtype: bfloat16, ";
    problems.push_back("GPU " + std::to_string(g.gpu) + ": the run needs about " + gb(g.total()) + " GB (target weights " +
                       gb(g.target_weights) + ", target activations " + gb(g.target_activations) + ", drafter state " +
                       gb(g.drafter_state) + ", queued features " + gb(g.queued_features) + ", drafter activations " +
                       gb(g.drafter_activations) + ", evaluation's drafter and decoding caches " + gb(g.eval_decoding) +
                       ") but " + gb(static_cast<int64_t>(kHeadroom * g.capacity)) + " GB of its " + gb(g.capacity) +
                       " GB are usable; " + advice +
                       "lower data.max_length, queues.features or train.anchors_per_sequence");
  }
  return problems;
}

}  // namespace dflash::pipeline
