#include "pipeline/replicas.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "common/log.h"
#include "drafter/block_attention.h"

namespace dflash::pipeline {

at::Device device_for(const config::GpuConfig& gpus, int id) {
  return gpus.device == config::Device::cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(id)) : at::Device(at::kCPU);
}

namespace {

// drafter.attention, decided once per drafter GPU by kernel_path.h's rule: `auto` takes the fused
// kernels where they run and refuses to fall back from them on a GPU (the split paths are 2-3x
// slower: bench/RESULTS.md) with the reason and the fixes; on the CPU it is the portable split
// path; `efficient` and `math` are the user's acceptance of a split path.
KernelPath attention_path_for(const config::Config& config, const drafter::DrafterShape& shape, at::Device device,
                              at::ScalarType dtype, drafter::BlockAttentionPath* chosen) {
  using drafter::BlockAttentionPath;
  BlockAttentionPath asked = BlockAttentionPath::automatic;
  PathRequest request = PathRequest::automatic;
  switch (config.drafter.attention) {
    case config::AttentionChoice::automatic: break;
    case config::AttentionChoice::kernels: asked = BlockAttentionPath::kernels, request = PathRequest::fast; break;
    case config::AttentionChoice::efficient: asked = BlockAttentionPath::efficient, request = PathRequest::slow; break;
    case config::AttentionChoice::math: asked = BlockAttentionPath::math, request = PathRequest::slow; break;
  }
  const at::Tensor like =
      at::empty({1, shape.num_attention_heads, shape.head_dim}, at::TensorOptions().device(device).dtype(dtype));
  // One path for every layer (sliding-window layers included: the kernels take the window).
  const bool kernels = fast_path_chosen(
      {"drafter.attention on GPU " + std::to_string(device.index()), request,
       drafter::block_attention_kernels_unavailable(like, shape.block_size), device.is_cuda(),
       request == PathRequest::slow, "the fused block-attention kernels", "the split path",
       "2-3x slower than the fused kernels",
       "Give the drafter heads of 128 in bf16 (drafter.num_attention_heads / num_key_value_heads / "
       "head_dim, target.dtype: bfloat16), or set drafter.attention: efficient to accept the slower "
       "split path"});
  const drafter::BlockAttentionPathInfo info =
      drafter::describe_block_attention_path(like, shape.block_size, kernels ? BlockAttentionPath::kernels : asked);
  *chosen = info.path;
  return {"drafter.attention", info.name, info.description};
}

}  // namespace

at::ScalarType model_dtype(config::ModelDtype dtype) {
  switch (dtype) {
    case config::ModelDtype::bfloat16: return at::kBFloat16;
    case config::ModelDtype::float16: return at::kHalf;
    case config::ModelDtype::float32: return at::kFloat;
    case config::ModelDtype::float8: return at::kBFloat16;  // the activations; the projections are FP8
  }
  throw std::invalid_argument("target.dtype: not a model dtype");
}

std::mutex* Replicas::turn_of(at::Device device) const {
  const auto it = device.is_cuda() ? gpu_turns.find(device.index()) : gpu_turns.end();
  return it == gpu_turns.end() ? nullptr : it->second.get();
}

std::unique_ptr<Replicas> build_replicas(const config::Config& config, const target::ModelConfig& target_config,
                                         const drafter::DrafterShape& shape) {
  auto r = std::make_unique<Replicas>();
  const at::ScalarType dtype = model_dtype(config.target.dtype);
  // Every layer when the eval section decodes with the target; else up to the last tapped one.
  const int64_t last_layer = config.eval.every_steps > 0 ? target_config.num_layers - 1 : shape.target_layer_ids.back();
  for (const std::vector<int>& ids : config.gpus.target_replicas) {
    std::vector<target::TargetOptions> stages;
    for (int id : ids) {
      target::TargetOptions o{device_for(config.gpus, id), dtype, config.target.allow_slow_path};
      o.fp8_weights = config.target.dtype == config::ModelDtype::float8;
      o.decode_state_dtype = model_dtype(config.target.decode_state_dtype);
      stages.push_back(o);
    }
    if (config.target.weights == config::TargetWeights::random || !config.target.preset.empty()) {
      r->targets.push_back(
          target::random_staged_target(target_config, last_layer, stages, target::run_target_seed(config.train.seed),
                                       config.data.max_length));
    } else {
      r->targets.push_back(target::load_staged_target(config.target.path, last_layer, stages, config.data.max_length));
    }
    r->target_clocks.push_back(std::make_unique<StageClock>(stages.back().device));
  }
  for (size_t i = 0; i < config.gpus.drafter.size(); ++i) {
    const int id = config.gpus.drafter[i];
    const at::Device device = device_for(config.gpus, id);
    r->drafter_devices.push_back(device);
    r->drafters.push_back(std::make_unique<drafter::Drafter>(shape, at::TensorOptions().device(device).dtype(dtype)));
    r->drafter_clocks.push_back(std::make_unique<StageClock>(device));
    if (device.is_cuda() && config.gpus.shared_gpu == config::SharedGpu::turns &&
        std::count(config.gpus.target.begin(), config.gpus.target.end(), id) > 0) {
      r->gpu_turns.emplace(id, std::make_unique<std::mutex>());
    }
    drafter::Drafter& d = *r->drafters.back();
    d.init_random(static_cast<uint64_t>(config.train.seed));
    // drafter.init: an exported drafter or a checkpoint directory (both hold config.json and
    // model.safetensors in the export names); a resumed checkpoint replaces these weights again.
    if (config.drafter.init != "random") d.load_export(config.drafter.init);
    drafter::BlockAttentionPath path = drafter::BlockAttentionPath::automatic;
    r->attention = attention_path_for(config, shape, device, dtype, &path);
    d.set_attention_path(path);
    d.set_activation_checkpointing(config.train.activation_checkpointing);
  }
  return r;
}

KernelPath activations_path(const config::TrainConfig& train) {
  if (train.activation_checkpointing) {
    return {"drafter.activations", "checkpointed",
            "each layer keeps its input and runs again in backward: train.activation_checkpointing"};
  }
  return {"drafter.activations", "kept", "every layer's activations kept for backward"};
}

void add_optimizers(Replicas& r, const config::TrainConfig& train, int64_t total_steps) {
  drafter::OptimizerSettings settings;
  settings.learning_rate = train.learning_rate;
  settings.min_learning_rate = train.min_learning_rate;
  settings.total_steps = total_steps;
  settings.warmup_steps = static_cast<int64_t>(std::ceil(train.warmup_ratio * static_cast<double>(total_steps)));
  settings.beta1 = train.adam_beta1;
  settings.beta2 = train.adam_beta2;
  settings.epsilon = train.adam_epsilon;
  settings.weight_decay = train.weight_decay;
  settings.grad_clip_norm = train.grad_clip_norm;
  for (size_t i = 0; i < r.drafters.size(); ++i) {
    drafter::Drafter& d = *r.drafters[i];
    r.optimizers.push_back(std::make_unique<drafter::AdamW>(d.parameters(), settings));
    const at::Device device = r.drafter_devices[i];
    r.drafter.push_back({static_cast<int>(i), &d, r.optimizers.back().get(), r.targets[0]->embed_tokens().to(device),
                         r.targets[0]->lm_head().to(device), device, r.drafter_clocks[i].get(), r.turn_of(device)});
  }
}

}  // namespace dflash::pipeline
