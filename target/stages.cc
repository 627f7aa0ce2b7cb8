#include "target/stages.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <stdexcept>

#include "common/log.h"
#include "target/weights.h"

namespace dflash::target {

StagedTarget::StagedTarget(const ModelConfig& config, WeightSource& weights, int64_t last_layer,
                           const std::vector<TargetOptions>& stages, int64_t plan_tokens) {
  if (last_layer < 0 || last_layer >= config.num_layers) {
    throw std::invalid_argument(config.source + ": layer " + std::to_string(last_layer) + " requested but the model has " +
                                std::to_string(config.num_layers) + " layers");
  }
  std::vector<double> costs = layer_costs(config, plan_tokens);
  costs.resize(static_cast<size_t>(last_layer + 1));
  ranges_ = plan_stages(costs, stages.size());
  double total = 0;
  for (double c : costs) total += c;
  for (size_t s = 0; s < stages.size(); ++s) {
    double share = 0;
    for (int64_t i = ranges_[s].first; i <= ranges_[s].last; ++i) share += costs[static_cast<size_t>(i)];
    shares_.push_back(share / total);
    stages_.push_back(std::make_unique<TargetModel>(config, weights, ranges_[s], stages[s]));
    log::info("target stage {}: layers {}..{} on {} ({} % of the forward)", s, ranges_[s].first, ranges_[s].last,
              stages[s].device.str(), static_cast<int>(100 * shares_.back() + 0.5));
  }
}

std::vector<at::Tensor> StagedTarget::forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                              const std::vector<int64_t>& layers) const {
  const int64_t last = stages_.back()->last_layer();
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] > last || (i > 0 && layers[i] <= layers[i - 1])) {
      throw std::invalid_argument("target forward: tapped layers must ascend within 0.." + std::to_string(last) +
                                  ", got " + std::to_string(layers[i]));
    }
  }
  std::vector<at::Tensor> tapped;
  StreamState stream;
  for (const auto& stage : stages_) {
    if (!layers.empty() && stage->first_layer() > layers.back()) break;  // nothing left to tap
    stream = stage->forward_stage(input_ids, cu_seqlens, stream, layers, &tapped);
  }
  const at::Device to = stages_.back()->options().device;
  for (at::Tensor& t : tapped) t = t.to(to);
  return tapped;
}

std::unique_ptr<StagedTarget> load_staged_target(const std::string& model_dir, int64_t last_layer,
                                                 const std::vector<TargetOptions>& stages) {
  CheckpointWeights weights(model_dir);
  log_quantization(weights, stages.front().dtype);
  return std::make_unique<StagedTarget>(load_model_config(model_dir), weights, last_layer, stages);
}

std::unique_ptr<StagedTarget> random_staged_target(const ModelConfig& config, int64_t last_layer,
                                                   const std::vector<TargetOptions>& stages, uint64_t seed) {
  RandomWeights weights(seed);
  return std::make_unique<StagedTarget>(config, weights, last_layer, stages);
}

}  // namespace dflash::target
