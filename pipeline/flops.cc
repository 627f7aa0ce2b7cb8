#include "pipeline/flops.h"

#include <algorithm>

namespace dflash::pipeline {

double target_flops(const target::ModelConfig& c, int64_t last_layer, int64_t tokens) {
  const double h = static_cast<double>(c.hidden_size), n = static_cast<double>(tokens);
  double per_token = 0, cores = 0;
  for (int64_t i = 0; i <= last_layer; ++i) {
    double params = 0;
    if (c.layer_types[i] == target::LayerKind::full_attention) {
      const double q = c.num_attention_heads * c.head_dim * (c.gated_attention ? 2.0 : 1.0);
      params += h * (q + 2.0 * c.num_key_value_heads * c.head_dim) + c.num_attention_heads * c.head_dim * h;
      cores += 2.0 * 2.0 * c.num_attention_heads * c.head_dim * n * (n + 1) / 2;  // causal QK^T and PV
    } else {
      const double key = c.linear_num_key_heads * c.linear_key_head_dim, value = c.linear_num_value_heads * c.linear_value_head_dim;
      params += h * (2 * key + 2 * value + 2.0 * c.linear_num_value_heads) + value * h;
      // Chunked recurrence, chunk 64: about 11.5 MFLOP per 64-token chunk-head at d = 128 (docs/targets.md),
      // i.e. ~ 2 * 64 * d * 7 per token and value head.
      cores += n * c.linear_num_value_heads * 2.0 * 64 * c.linear_key_head_dim * 7;
    }
    if (c.layer_is_moe(i)) {
      params += h * c.num_experts + 3.0 * h * c.moe_intermediate_size * c.num_experts_per_tok +
                3.0 * h * c.shared_expert_intermediate_size;
    } else {
      params += 3.0 * h * c.intermediate_size;
    }
    per_token += params;
  }
  return 2.0 * per_token * n + cores;
}

double drafter_attention_pairs(const std::vector<int64_t>& anchors, int64_t block_size, int64_t window) {
  double pairs = 0;
  for (const int64_t a : anchors) {
    if (window <= 0) {
      pairs += static_cast<double>(block_size) * static_cast<double>(a + block_size);
      continue;
    }
    for (int64_t i = 0; i < block_size; ++i) {  // context keys max(0, a + i - window + 1) .. a - 1, block keys 0..i
      pairs += static_cast<double>(std::max<int64_t>(0, std::min(a, window - 1 - i)) + i + 1);
    }
  }
  return pairs;
}

double drafter_flops(const drafter::DrafterShape& s, int64_t context, const std::vector<int64_t>& anchors) {
  const double h = static_cast<double>(s.hidden_size), d = static_cast<double>(s.head_dim);
  const double hq = static_cast<double>(s.num_attention_heads), hkv = static_cast<double>(s.num_key_value_heads);
  const double r = static_cast<double>(anchors.size()) * static_cast<double>(s.block_size);
  const double n = static_cast<double>(context);
  const double layer_params = h * (hq * d * 2 + hkv * d * 2) + 3.0 * h * s.intermediate_size;
  const double kv_context = 2.0 * h * hkv * d * 2;  // k_proj and v_proj over context tokens
  double layers = 0;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const double attention_core = 2.0 * 2.0 * hq * d * drafter_attention_pairs(anchors, s.block_size, s.window_of(i));
    layers += 2.0 * layer_params * r + kv_context * n + attention_core;
  }
  const double fc = 2.0 * s.num_features() * h * h * n;
  const double head = 2.0 * 2.0 * r * h * static_cast<double>(s.vocab_size);
  return 3.0 * (layers + fc) + head;
}

}  // namespace dflash::pipeline
