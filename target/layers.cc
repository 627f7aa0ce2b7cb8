#include "target/layers.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "target/fused_ops.h"
#ifdef DFLASHD_WITH_CUDA
#include "target/lt_gemm.h"
#endif

namespace dflash::target {
namespace {

std::string layer_name(int64_t i, const std::string& rest) { return "layers." + std::to_string(i) + "." + rest; }

// Reads weights of one layer by name, in the model's dtype and on its device.
struct LayerReader {
  const ModelConfig& c;
  WeightSource& w;
  at::TensorOptions opts;
  Init norm_init;
  bool fp8;  // projections kept block-scaled FP8

  // One GEMM over the projections `parts` (name, rows) of `in` features, stacked by rows.
  Linear stacked(const std::vector<std::pair<std::string, int64_t>>& parts, int64_t in, bool bias = false) const {
    Linear l;
    std::vector<WeightRows> rows;
    std::vector<at::Tensor> weights, biases;
    int64_t out = 0;
    for (const auto& [name, n] : parts) {
      if (fp8) {
        rows.push_back(w.get_rows(name + ".weight", {n, in}, opts.device()));
      } else {
        weights.push_back(w.get(name + ".weight", {n, in}, opts));
      }
      if (bias) biases.push_back(w.get(name + ".bias", {n}, opts, Init::zeros));
      out += n;
    }
    if (fp8) {
      if (const auto why = fp8_shape_unsupported(out, in)) {
        throw WeightsError(w.describe() + ": " + parts.front().first + (parts.size() > 1 ? " (with the projections stacked on it)" : "") +
                           " cannot be kept FP8 (target.dtype: float8): " + *why);
      }
      l.fp8 = stack_fp8(rows);
    } else {
      l.weight = weights.size() == 1 ? weights[0] : at::cat(weights, 0);
    }
    if (bias) l.bias = biases.size() == 1 ? biases[0] : at::cat(biases, 0);
    return l;
  }
  Linear linear(const std::string& name, int64_t out, int64_t in, bool bias = false) const {
    return stacked({{name, out}}, in, bias);
  }
  // A projection kept in the model dtype whatever the target's (router and shared expert inputs).
  at::Tensor plain(const std::string& name, int64_t out, int64_t in) const {
    return w.get(name + ".weight", {out, in}, opts);
  }

  Attention attention(const std::string& p) const {
    const int64_t h = c.hidden_size, d = c.head_dim;
    Attention a;
    const int64_t q_out = c.num_attention_heads * d * (c.gated_attention ? 2 : 1);
    const int64_t kv_out = c.num_key_value_heads * d;
    a.qkv = stacked({{p + "q_proj", q_out}, {p + "k_proj", kv_out}, {p + "v_proj", kv_out}}, h, c.attention_bias);
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
    GatedDeltaNet g;
    g.in_proj = c.fused_gdn_projections
                    ? stacked({{p + "in_proj_qkvz", 2 * key_channels + 2 * value_channels}, {p + "in_proj_ba", 2 * hv}}, h)
                    : stacked({{p + "in_proj_qkv", conv_channels},
                               {p + "in_proj_z", value_channels},
                               {p + "in_proj_b", hv},
                               {p + "in_proj_a", hv}},
                              h);
    g.conv = w.get(p + "conv1d.weight", {conv_channels, 1, c.linear_conv_kernel_dim}, opts).squeeze(1);
    g.a_log = w.get(p + "A_log", {hv}, fp32, Init::a_log);
    g.dt_bias = w.get(p + "dt_bias", {hv}, fp32, Init::dt_bias);
    g.norm = w.get(p + "norm.weight", {c.linear_value_head_dim}, opts, Init::ones);
    g.out = linear(p + "out_proj", h, value_channels);
    return g;
  }

  // The experts block-scaled FP8 in the grouped layout [E, 2I, H] / [E, H, I]: each expert's own
  // 128x128 blocks kept where the checkpoint stores them so (the released per-expert layout),
  // anything else quantised here.
  std::pair<Fp8Weight, Fp8Weight> fp8_experts(const std::string& p, int64_t e, int64_t inner, int64_t h) const {
    // No FP8 GEMM reads them (they are dequantized per layer): whole 128-wide blocks suffice.
    for (const int64_t in : {h, inner}) {
      if (in % kFp8Block != 0) {
        throw WeightsError(w.describe() + ": " + p + "experts cannot be kept FP8 (target.dtype: float8): " +
                           std::to_string(in) + " input features are not whole blocks of 128");
      }
    }
    const bool fused = w.contains(p + "experts.gate_up_proj");
    const auto fp32 = opts.dtype(at::kFloat);
    const at::Tensor fused_gate_up = fused ? w.get(p + "experts.gate_up_proj", {e, 2 * inner, h}, fp32) : at::Tensor();
    const at::Tensor fused_down = fused ? w.get(p + "experts.down_proj", {e, h, inner}, fp32) : at::Tensor();
    std::vector<at::Tensor> gate_up_data, gate_up_scale, down_data, down_scale;
    for (int64_t x = 0; x < e; ++x) {
      const std::string ep = p + "experts." + std::to_string(x) + ".";
      const Fp8Weight gu = fused ? quantize_blocks(fused_gate_up[x])
                                 : stack_fp8({w.get_rows(ep + "gate_proj.weight", {inner, h}, opts.device()),
                                              w.get_rows(ep + "up_proj.weight", {inner, h}, opts.device())});
      const Fp8Weight d = fused ? quantize_blocks(fused_down[x])
                                : stack_fp8({w.get_rows(ep + "down_proj.weight", {h, inner}, opts.device())});
      gate_up_data.push_back(gu.data), gate_up_scale.push_back(gu.scale);
      down_data.push_back(d.data), down_scale.push_back(d.scale);
    }
    return {{at::stack(gate_up_data), at::stack(gate_up_scale)}, {at::stack(down_data), at::stack(down_scale)}};
  }

  // Router, experts in the grouped layout [E, 2I, H] / [E, H, I], shared expert.
  MoeWeights moe(const std::string& p) const {
    const int64_t h = c.hidden_size, e = c.num_experts, inner = c.moe_intermediate_size;
    const at::Tensor router = plain(p + "gate", e, h);
    at::Tensor gate_up, down;
    std::pair<Fp8Weight, Fp8Weight> fp8_weights;
    if (fp8) {
      fp8_weights = fp8_experts(p, e, inner, h);
    } else if (w.contains(p + "experts.gate_up_proj")) {  // transformers 5 fused layout: already grouped
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
      shared_gate = plain(p + "shared_expert.gate_proj", s, h);
      shared_up = plain(p + "shared_expert.up_proj", s, h);
      shared_down = plain(p + "shared_expert.down_proj", h, s);
      shared_expert_gate = plain(p + "shared_expert_gate", 1, h);
    }
    MoeWeights m = MoeWeights::make(router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate);
    m.fp8_gate_up = std::move(fp8_weights.first);
    m.fp8_down = std::move(fp8_weights.second);
    return m;
  }

  Mlp mlp(const std::string& p, bool is_moe) const {
    Mlp m;
    if (is_moe) {
      m.moe = true;
      m.experts = moe(p);
    } else {
      const int64_t h = c.hidden_size;
      m.gate_up = stacked({{p + "gate_proj", c.intermediate_size}, {p + "up_proj", c.intermediate_size}}, h);
      m.down = linear(p + "down_proj", h, c.intermediate_size);
    }
    return m;
  }
};

}  // namespace

namespace {

#ifdef DFLASHD_WITH_CUDA
// x's rows as the [rows, in] view our GEMMs take (lt_gemm.h: bf16 on a GPU, no bias, at most
// kCublasLtRows rows, rows at a stride of a multiple of 8, 16-byte aligned); undefined otherwise.
at::Tensor gemm_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  if (bias.defined() || !x.is_cuda() || x.scalar_type() != at::kBFloat16 || weight.scalar_type() != at::kBFloat16 ||
      !weight.is_contiguous() || weight.size(1) % 8 != 0) {
    return {};
  }
  at::Tensor rows = x.reshape({-1, x.size(-1)});
  const bool aligned = rows.stride(1) == 1 && rows.stride(0) % 8 == 0 && rows.stride(0) >= rows.size(1) &&
                       reinterpret_cast<uintptr_t>(rows.data_ptr()) % 16 == 0;
  return rows.size(0) <= kCublasLtRows && aligned ? rows : at::Tensor();
}

// x's shape with its last dimension `last`.
std::vector<int64_t> with_last(const at::Tensor& x, int64_t last) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = last;
  return shape;
}
#endif

// x [..., in] @ weight^T (+ bias) in the model dtype.
at::Tensor dense_linear(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
#ifdef DFLASHD_WITH_CUDA
  const at::Tensor rows = gemm_rows(x, weight, bias);
  if (rows.defined()) return projection_bf16(rows, weight).view(with_last(x, weight.size(0)));
#endif
  return at::linear(x, weight, bias);
}

}  // namespace

at::Tensor Linear::operator()(const at::Tensor& x) const {
  return fp8.defined() ? fp8_linear(x, fp8, bias) : dense_linear(x, weight, bias);
}

at::Tensor Linear::silu_mul_of(const GemmInput& in) const {
#ifdef DFLASHD_WITH_CUDA
  const at::Tensor rows = fp8.defined() || !in.x.defined() ? at::Tensor() : gemm_rows(in.x, weight, bias);
  if (rows.defined()) {
    const at::Tensor fused = projection_silu_mul_bf16(rows, weight);
    if (fused.defined()) return fused.view(with_last(in.x, weight.size(0) / 2));
  }
#endif
  const at::Tensor both = (*this)(in);
  const int64_t inner = both.size(-1) / 2;
  return silu_mul(both.narrow(-1, 0, inner), both.narrow(-1, inner, inner));
}

Fp8Activations Linear::silu_mul_fp8_of(const GemmInput& in) const {
  const at::Tensor both = (*this)(in);
  const int64_t inner = both.size(-1) / 2;
  return silu_mul_fp8(both.narrow(-1, 0, inner), both.narrow(-1, inner, inner));
}

int64_t Linear::bytes() const {
  int64_t n = fp8.defined() ? fp8.bytes() : weight.defined() ? weight.numel() * weight.element_size() : 0;
  return n + (bias.defined() ? bias.numel() * bias.element_size() : 0);
}

int64_t layer_bytes(const Layer& l) {
  int64_t n = 0;
  for (const at::Tensor* t : {&l.input_norm, &l.post_attention_norm, &l.attention.q_norm, &l.attention.k_norm,
                              &l.gdn.conv, &l.gdn.a_log, &l.gdn.dt_bias, &l.gdn.norm, &l.mlp.experts.input_proj,
                              &l.mlp.experts.experts_gate_up, &l.mlp.experts.experts_down, &l.mlp.experts.shared_down}) {
    if (t->defined()) n += t->numel() * t->element_size();
  }
  for (const Linear* p : {&l.attention.qkv, &l.attention.o, &l.gdn.in_proj, &l.gdn.out, &l.mlp.gate_up, &l.mlp.down}) {
    n += p->bytes();
  }
  for (const Fp8Weight* f : {&l.mlp.experts.fp8_gate_up, &l.mlp.experts.fp8_down}) n += f->defined() ? f->bytes() : 0;
  return n;
}

Layer load_layer(const ModelConfig& c, WeightSource& w, int64_t i, const at::TensorOptions& opts, bool fp8) {
  const LayerReader r{c, w, opts, c.zero_centred_norm ? Init::zeros : Init::ones, fp8};
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
