#include "target/stage_plan.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <string>

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

std::vector<LayerRange> plan_target_stages(const ModelConfig& c, int64_t last_layer, size_t stages, int64_t tokens,
                                           std::vector<double>* shares) {
  std::vector<double> costs = layer_costs(c, tokens);
  costs.resize(static_cast<size_t>(last_layer + 1));
  const std::vector<LayerRange> ranges = plan_stages(costs, stages);
  if (shares) {
    double total = 0;
    for (double cost : costs) total += cost;
    shares->clear();
    for (const LayerRange& r : ranges) {
      double share = 0;
      for (int64_t i = r.first; i <= r.last; ++i) share += costs[static_cast<size_t>(i)];
      shares->push_back(share / total);
    }
  }
  return ranges;
}

}  // namespace dflash::target
