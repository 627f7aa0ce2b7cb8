#include "pipeline/replicas.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#include "common/log.h"
#include "drafter/block_attention.h"

namespace dflash::pipeline {
namespace {

at::Device device_for(const config::GpuConfig& gpus, int id) {
  return gpus.device == config::Device::cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(id)) : at::Device(at::kCPU);
}

// drafter.attention, decided once per drafter GPU. `auto` takes the fused kernels on a GPU and
// refuses to fall back from them there (the split paths are 2-3x slower: bench/RESULTS.md) with
// the reason and the fixes; on the CPU it is the portable split path.
drafter::BlockAttentionPathInfo attention_path_for(const config::Config& config, const drafter::DrafterShape& shape,
                                                   at::Device device, at::ScalarType dtype) {
  using drafter::BlockAttentionPath;
  const std::string& asked = config.drafter.attention;
  const BlockAttentionPath path = asked == "kernels"     ? BlockAttentionPath::kernels
                                  : asked == "efficient" ? BlockAttentionPath::efficient
                                  : asked == "math"      ? BlockAttentionPath::math
                                                         : BlockAttentionPath::automatic;
  const at::Tensor like =
      at::empty({1, shape.num_attention_heads, shape.head_dim}, at::TensorOptions().device(device).dtype(dtype));
  drafter::BlockAttentionPathInfo info;
  try {
    info = drafter::describe_block_attention_path(like, shape.block_size, path);
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("drafter.attention: kernels: " + std::string(e.what()));
  }
  if (path == BlockAttentionPath::automatic && device.is_cuda() && info.path != BlockAttentionPath::kernels) {
    throw std::runtime_error(
        "drafter.attention: the fused block-attention kernels cannot run on GPU " + std::to_string(device.index()) +
        " (" + info.description + "); the fallback is 2-3x slower. Give the drafter heads of 128 in bf16 "
        "(drafter.num_attention_heads / num_key_value_heads / head_dim, target.dtype: bfloat16), or set "
        "drafter.attention: efficient to accept the slower split path");
  }
  return info;
}

}  // namespace

at::ScalarType model_dtype(const std::string& name) {
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  if (name == "float32") return at::kFloat;
  throw std::invalid_argument("target.dtype: '" + name + "' is not bfloat16, float16 or float32");
}

std::mutex* Replicas::turn_of(at::Device device) const {
  const auto it = device.is_cuda() ? gpu_turns.find(device.index()) : gpu_turns.end();
  return it == gpu_turns.end() ? nullptr : it->second.get();
}

std::unique_ptr<Replicas> build_replicas(const config::Config& config, const target::ModelConfig& target_config,
                                         const drafter::DrafterShape& shape) {
  auto r = std::make_unique<Replicas>();
  const at::ScalarType dtype = model_dtype(config.target.dtype);
  const int64_t last_layer = shape.target_layer_ids.back();
  for (int id : config.gpus.target) {
    target::TargetOptions options{device_for(config.gpus, id), dtype, config.target.allow_slow_path};
    if (config.target.weights == "random" || !config.target.preset.empty()) {
      r->targets.push_back(target::random_target(target_config, last_layer, options, 0x7a11 ^ config.train.seed));
    } else {
      r->targets.push_back(target::load_target(config.target.path, last_layer, options));
    }
    r->target_clocks.push_back(std::make_unique<StageClock>(options.device));
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
    const drafter::BlockAttentionPathInfo attention = attention_path_for(config, shape, device, dtype);
    d.set_attention_path(attention.path);
    r->attention_name = attention.name;
    r->attention_description = attention.description;
  }
  return r;
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
