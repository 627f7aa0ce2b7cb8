#include "target/layers.h"

#include <cmath>

namespace dflash::target {
namespace {

std::string layer_name(int64_t i, const std::string& rest) { return "layers." + std::to_string(i) + "." + rest; }

// Reads weights of one layer by name, in the model's dtype and on its device.
struct LayerReader {
  const ModelConfig& c;
  WeightSource& w;
  at::TensorOptions opts;
  Init norm_init;

  Linear linear(const std::string& name, int64_t out, int64_t in, bool bias = false) const {
    Linear l;
    l.weight = w.get(name + ".weight", {out, in}, opts);
    if (bias) l.bias = w.get(name + ".bias", {out}, opts, Init::zeros);
    return l;
  }

  Attention attention(const std::string& p) const {
    const int64_t h = c.hidden_size, d = c.head_dim;
    Attention a;
    const int64_t q_out = c.num_attention_heads * d * (c.gated_attention ? 2 : 1);
    const Linear q = linear(p + "q_proj", q_out, h, c.attention_bias);
    const Linear k = linear(p + "k_proj", c.num_key_value_heads * d, h, c.attention_bias);
    const Linear v = linear(p + "v_proj", c.num_key_value_heads * d, h, c.attention_bias);
    a.qkv.weight = at::cat({q.weight, k.weight, v.weight}, 0);
    if (c.attention_bias) a.qkv.bias = at::cat({q.bias, k.bias, v.bias}, 0);
    a.o = linear(p + "o_proj", h, c.num_attention_heads * d, c.attention_bias && c.family == Family::llama);
    if (c.qk_norm) {
      a.q_norm = w.get(p + "q_norm.weight", {d}, opts, norm_init);
      a.k_norm = w.get(p + "k_norm.weight", {d}, opts, norm_init);
    }
    return a;
  }

  GatedDeltaNet gdn(const std::string& p) const {
    const int64_t h = c.hidden_size, hv = c.linear_num_value_heads;
    const int64_t key_channels = c.linear_num_key_heads * c.linear_key_head_dim;
    const int64_t value_channels = hv * c.linear_value_head_dim;
    const int64_t conv_channels = 2 * key_channels + value_channels;
    const auto fp32 = opts.dtype(at::kFloat);
    auto concatenated = [&](std::initializer_list<std::pair<const char*, int64_t>> parts) {
      std::vector<at::Tensor> weights;
      for (const auto& [name, out] : parts) weights.push_back(linear(p + name, out, h).weight);
      return Linear{at::cat(weights, 0), {}};
    };
    GatedDeltaNet g;
    g.in_proj = c.fused_gdn_projections
                    ? concatenated({{"in_proj_qkvz", 2 * key_channels + 2 * value_channels}, {"in_proj_ba", 2 * hv}})
                    : concatenated({{"in_proj_qkv", conv_channels},
                                    {"in_proj_z", value_channels},
                                    {"in_proj_b", hv},
                                    {"in_proj_a", hv}});
    g.conv = w.get(p + "conv1d.weight", {conv_channels, 1, c.linear_conv_kernel_dim}, opts).squeeze(1);
    g.a_log = w.get(p + "A_log", {hv}, fp32, Init::a_log);
    g.dt_bias = w.get(p + "dt_bias", {hv}, fp32, Init::dt_bias);
    g.norm = w.get(p + "norm.weight", {c.linear_value_head_dim}, opts, Init::ones);
    g.out = linear(p + "out_proj", h, value_channels);
    return g;
  }

  // Router, experts in the grouped layout [E, 2I, H] / [E, H, I], shared expert.
  MoeWeights moe(const std::string& p) const {
    const int64_t h = c.hidden_size, e = c.num_experts, inner = c.moe_intermediate_size;
    const at::Tensor router = w.get(p + "gate.weight", {e, h}, opts);
    at::Tensor gate_up, down;
    if (w.contains(p + "experts.gate_up_proj")) {  // transformers 5 fused layout: already grouped
      gate_up = w.get(p + "experts.gate_up_proj", {e, 2 * inner, h}, opts);
      down = w.get(p + "experts.down_proj", {e, h, inner}, opts);
    } else {  // the released checkpoints: one module per expert, copied into the grouped layout
      gate_up = at::empty({e, 2 * inner, h}, opts);
      down = at::empty({e, h, inner}, opts);
      for (int64_t x = 0; x < e; ++x) {
        const std::string ep = p + "experts." + std::to_string(x) + ".";
        gate_up[x].narrow(0, 0, inner).copy_(w.get(ep + "gate_proj.weight", {inner, h}, opts));
        gate_up[x].narrow(0, inner, inner).copy_(w.get(ep + "up_proj.weight", {inner, h}, opts));
        down[x].copy_(w.get(ep + "down_proj.weight", {h, inner}, opts));
      }
    }
    at::Tensor shared_gate, shared_up, shared_down, shared_expert_gate;
    if (c.shared_expert_intermediate_size > 0) {
      const int64_t s = c.shared_expert_intermediate_size;
      shared_gate = linear(p + "shared_expert.gate_proj", s, h).weight;
      shared_up = linear(p + "shared_expert.up_proj", s, h).weight;
      shared_down = linear(p + "shared_expert.down_proj", h, s).weight;
      shared_expert_gate = linear(p + "shared_expert_gate", 1, h).weight;
    }
    return MoeWeights::make(router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate);
  }

  Mlp mlp(const std::string& p, bool is_moe) const {
    Mlp m;
    if (is_moe) {
      m.moe = true;
      m.experts = moe(p);
    } else {
      const int64_t h = c.hidden_size;
      m.gate_up.weight = at::cat({linear(p + "gate_proj", c.intermediate_size, h).weight,
                                  linear(p + "up_proj", c.intermediate_size, h).weight},
                                 0);
      m.down = linear(p + "down_proj", h, c.intermediate_size);
    }
    return m;
  }
};

}  // namespace

Layer load_layer(const ModelConfig& c, WeightSource& w, int64_t i, const at::TensorOptions& opts) {
  const LayerReader r{c, w, opts, c.zero_centred_norm ? Init::zeros : Init::ones};
  Layer layer;
  layer.kind = c.layer_types[i];
  layer.input_norm = w.get(layer_name(i, "input_layernorm.weight"), {c.hidden_size}, opts, r.norm_init);
  layer.post_attention_norm =
      w.get(layer_name(i, "post_attention_layernorm.weight"), {c.hidden_size}, opts, r.norm_init);
  if (layer.kind == LayerKind::full_attention) {
    layer.attention = r.attention(layer_name(i, "self_attn."));
  } else {
    layer.gdn = r.gdn(layer_name(i, "linear_attn."));
  }
  layer.mlp = r.mlp(layer_name(i, "mlp."), c.layer_is_moe(i));
  return layer;
}

at::Tensor compute_inv_freq(const ModelConfig& c) {
  const int64_t rotary_dim = static_cast<int64_t>(c.head_dim * c.rope.partial_rotary_factor);
  at::Tensor inv_freq =
      1.0 / at::pow(c.rope.theta, at::arange(0, rotary_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                                      static_cast<double>(rotary_dim));
  if (c.rope.llama3_factor > 0) {
    // Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth blend between.
    const double factor = c.rope.llama3_factor, low = c.rope.llama3_low_freq_factor,
                 high = c.rope.llama3_high_freq_factor;
    const double old_context = static_cast<double>(c.rope.llama3_original_max_position);
    const double low_wavelen = old_context / low, high_wavelen = old_context / high;
    const at::Tensor wavelen = 2 * M_PI / inv_freq;
    at::Tensor scaled = at::where(wavelen > low_wavelen, inv_freq / factor, inv_freq);
    const at::Tensor smooth = (old_context / wavelen - low) / (high - low);
    const at::Tensor smoothed = (1 - smooth) * scaled / factor + smooth * scaled;
    const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
    inv_freq = at::where(medium, smoothed, scaled);
  }
  return inv_freq;
}

}  // namespace dflash::target
