#include "target/stages.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>
#include <stdexcept>

#include "common/log.h"
#include "target/weights.h"

namespace dflash::target {

std::vector<double> layer_costs(const ModelConfig& c, int64_t tokens) {
  const double h = static_cast<double>(c.hidden_size), t = static_cast<double>(tokens);
  std::vector<double> costs;
  for (int64_t i = 0; i < c.num_layers; ++i) {
    double weights = 0, extra = 0;
    if (c.layer_types[static_cast<size_t>(i)] == LayerKind::full_attention) {
      const double q = static_cast<double>(c.num_attention_heads * c.head_dim);
      const double kv = static_cast<double>(c.num_key_value_heads * c.head_dim);
      weights = h * q * (c.gated_attention ? 2 : 1) + 2 * h * kv + q * h;
      extra = 2 * q * t;  // q k^T and p v over a causal context of t / 2 on average
    } else {
      const double qk = static_cast<double>(c.linear_num_key_heads * c.linear_key_head_dim);
      const double v = static_cast<double>(c.linear_num_value_heads * c.linear_value_head_dim);
      const double hv = static_cast<double>(c.linear_num_value_heads);
      weights = h * (2 * qk + 2 * v + 2 * hv) + v * h;
      extra = 4 * hv * static_cast<double>(c.linear_key_head_dim * c.linear_value_head_dim);  // state update and read
    }
    if (c.layer_is_moe(i)) {
      weights += 3 * h * static_cast<double>(c.moe_intermediate_size * c.num_experts_per_tok) +
                 3 * h * static_cast<double>(c.shared_expert_intermediate_size) + h * static_cast<double>(c.num_experts);
    } else {
      weights += 3 * h * static_cast<double>(c.intermediate_size);
    }
    costs.push_back(2 * weights + 2 * extra);
  }
  return costs;
}

std::vector<LayerRange> plan_stages(const std::vector<double>& costs, size_t stages) {
  const size_t n = costs.size();
  if (stages < 1 || stages > n) {
    throw std::invalid_argument("target stages: " + std::to_string(stages) + " stages for " + std::to_string(n) +
                                " layers (each stage needs at least one)");
  }
  std::vector<double> prefix(n + 1, 0);
  for (size_t i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + costs[i];
  // best[s][i]: the smallest largest-stage cost of the first i layers in s stages; cut[s][i] where
  // the last of those stages starts.
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<std::vector<double>> best(stages + 1, std::vector<double>(n + 1, inf));
  std::vector<std::vector<size_t>> cut(stages + 1, std::vector<size_t>(n + 1, 0));
  best[0][0] = 0;
  for (size_t s = 1; s <= stages; ++s) {
    for (size_t i = s; i <= n; ++i) {
      for (size_t j = s - 1; j < i; ++j) {
        const double worst = std::max(best[s - 1][j], prefix[i] - prefix[j]);
        if (worst < best[s][i]) best[s][i] = worst, cut[s][i] = j;
      }
    }
  }
  std::vector<LayerRange> ranges(stages);
  for (size_t s = stages, end = n; s > 0; --s) {
    const size_t begin = cut[s][end];
    ranges[s - 1] = {static_cast<int64_t>(begin), static_cast<int64_t>(end) - 1, s == stages};
    end = begin;
  }
  return ranges;
}

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
  return std::make_unique<StagedTarget>(load_model_config(model_dir), weights, last_layer, stages);
}

std::unique_ptr<StagedTarget> random_staged_target(const ModelConfig& config, int64_t last_layer,
                                                   const std::vector<TargetOptions>& stages, uint64_t seed) {
  RandomWeights weights(seed);
  return std::make_unique<StagedTarget>(config, weights, last_layer, stages);
}

}  // namespace dflash::target
