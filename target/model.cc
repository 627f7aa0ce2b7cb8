#include "target/model.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cmath>

#include "common/log.h"
#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"
#include "target/gdn_cuda.h"
#include "target/moe.h"

namespace dflash::target {
namespace {

std::string layer_name(int64_t i, const std::string& rest) { return "layers." + std::to_string(i) + "." + rest; }

struct Linear {
  at::Tensor weight;  // [out, in]
  at::Tensor bias;    // undefined when absent
  at::Tensor operator()(const at::Tensor& x) const { return at::linear(x, weight, bias); }
};

struct Attention {
  Linear qkv, o;  // q_proj, k_proj, v_proj concatenated at load (one GEMM)
  at::Tensor q_norm, k_norm;  // [head_dim], undefined without qk norm
};

struct GatedDeltaNet {
  // The input projections concatenated at load, one GEMM: [qkv | z | b | a] (qwen3_5 layout) or
  // [qkvz | ba] (qwen3_next layout, grouped per key head); the forward takes column slices.
  Linear in_proj;
  at::Tensor conv;  // [channels, kernel]
  at::Tensor a_log, dt_bias, norm;
  Linear out;
};

struct Mlp {
  Linear gate_up, down;  // dense SwiGLU: gate_proj and up_proj concatenated at load (one GEMM)
  MoeWeights experts;    // MoE layers (moe.h): router, experts in the grouped layout, shared expert
  bool moe = false;
};

struct Layer {
  LayerKind kind;
  at::Tensor input_norm, post_attention_norm;
  Attention attention;
  GatedDeltaNet gdn;
  Mlp mlp;
};

}  // namespace

struct TargetModel::Impl {
  at::Tensor embed, head, final_norm;
  at::Tensor inv_freq;  // [rotary_dim / 2] fp32
  std::vector<Layer> layers;
};

namespace {

at::Tensor compute_inv_freq(const ModelConfig& c) {
  const int64_t rotary_dim = static_cast<int64_t>(c.head_dim * c.rope.partial_rotary_factor);
  at::Tensor inv_freq =
      1.0 / at::pow(c.rope.theta, at::arange(0, rotary_dim, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) /
                                      static_cast<double>(rotary_dim));
  if (c.rope.llama3_factor > 0) {
    // Llama 3.1 frequency scaling: long wavelengths divided by factor, a smooth blend between.
    const double factor = c.rope.llama3_factor, low = c.rope.llama3_low_freq_factor, high = c.rope.llama3_high_freq_factor;
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

at::Tensor attention_forward(const ModelConfig& c, const Attention& p, const at::Tensor& x, const at::Tensor& cos,
                             const at::Tensor& sin, const std::vector<int64_t>& cu_seqlens) {
  const int64_t tokens = x.size(0), d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  const int64_t q_out = hq * d * (c.gated_attention ? 2 : 1);
  const at::Tensor projected = p.qkv(x);
  at::Tensor q, gate;
  if (c.gated_attention) {
    // q_proj yields per head [query | gate].
    const at::Tensor both = projected.narrow(1, 0, q_out).view({tokens, hq, 2 * d});
    q = both.narrow(-1, 0, d);
    gate = both.narrow(-1, d, d);
  } else {
    q = projected.narrow(1, 0, q_out).view({tokens, hq, d});
  }
  at::Tensor k = projected.narrow(1, q_out, hkv * d).view({tokens, hkv, d});
  const at::Tensor v = projected.narrow(1, q_out + hkv * d, hkv * d).view({tokens, hkv, d});
  if (c.qk_norm) {
    q = qk_norm_rope(q, p.q_norm, cos, sin, c.rms_norm_eps, c.zero_centred_norm);
    k = qk_norm_rope(k, p.k_norm, cos, sin, c.rms_norm_eps, c.zero_centred_norm);
  } else {
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
  }
  // Causal attention within each sequence. (GPU path: one varlen call; issue: pipeline.)
  std::vector<at::Tensor> outputs;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t begin = cu_seqlens[s], length = cu_seqlens[s + 1] - begin;
    if (length == 0) continue;
    auto heads_first = [&](const at::Tensor& t) { return t.narrow(0, begin, length).transpose(0, 1).unsqueeze(0); };
    const at::Tensor o = at::scaled_dot_product_attention(heads_first(q), heads_first(k), heads_first(v), {}, 0.0,
                                                          /*is_causal=*/true, 1.0 / std::sqrt(static_cast<double>(d)),
                                                          /*enable_gqa=*/true);
    outputs.push_back(o.squeeze(0).transpose(0, 1).reshape({length, hq * d}));
  }
  at::Tensor out = outputs.size() == 1 ? outputs[0] : at::cat(outputs, 0);
  if (c.gated_attention) out = sigmoid_gate(out, gate);
  return p.o(out);
}

// plan: the chunk table when the layer runs the CUDA kernels, null for the reference path.
at::Tensor gdn_forward(const ModelConfig& c, const GatedDeltaNet& p, const at::Tensor& x, const at::Tensor& positions,
                       const std::vector<int64_t>& cu_seqlens, const GdnChunkPlan* plan) {
  const int64_t tokens = x.size(0);
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, group = hv / hk;
  const int64_t key_channels = hk * dk, value_channels = hv * dv, conv_channels = 2 * key_channels + value_channels;
  const at::Tensor projected = p.in_proj(x);
  auto columns = [&](int64_t begin, int64_t count) { return projected.narrow(1, begin, count); };
  at::Tensor mixed, z, b, a;
  if (c.fused_gdn_projections) {
    // Qwen3-Next: per key head [q (dk) | k (dk) | v (group*dv) | z (group*dv)], and [b (group) | a (group)].
    const int64_t qkvz_channels = 2 * key_channels + 2 * value_channels;
    const at::Tensor qkvz = columns(0, qkvz_channels).view({tokens, hk, 2 * dk + 2 * group * dv});
    const at::Tensor ba = columns(qkvz_channels, 2 * hv).view({tokens, hk, 2 * group});
    const at::Tensor q = qkvz.narrow(-1, 0, dk).reshape({tokens, hk * dk});
    const at::Tensor k = qkvz.narrow(-1, dk, dk).reshape({tokens, hk * dk});
    const at::Tensor v = qkvz.narrow(-1, 2 * dk, group * dv).reshape({tokens, hv * dv});
    z = qkvz.narrow(-1, 2 * dk + group * dv, group * dv).reshape({tokens, hv, dv});
    b = ba.narrow(-1, 0, group).reshape({tokens, hv});
    a = ba.narrow(-1, group, group).reshape({tokens, hv});
    mixed = at::cat({q, k, v}, -1);  // the conv runs over [all q | all k | all v] channels
  } else {
    mixed = columns(0, conv_channels);  // strided views of one GEMM's output
    z = columns(conv_channels, value_channels).view({tokens, hv, dv});
    b = columns(conv_channels + value_channels, hv);
    a = columns(conv_channels + value_channels + hv, hv);
  }
  if (plan != nullptr) {  // the gates are formed inside the kernels
    mixed = conv1d_silu_l2norm_cuda(mixed, p.conv, positions, 2 * hk * dk);
    const GdnGates gates = GdnGates::projections(a, b, p.a_log, p.dt_bias);
    const at::Tensor gated = gated_delta_rule_cuda(mixed, hk, hv, gates, *plan, z, p.norm, c.rms_norm_eps);
    return p.out(gated);
  }
  const auto [g, beta] = gdn_gates_reference(a, b, p.a_log, p.dt_bias);  // fp32 [N, Hv]
  mixed = causal_conv1d_silu_reference(mixed, p.conv, positions);
  const at::Tensor q = mixed.narrow(-1, 0, hk * dk).view({tokens, hk, dk});
  const at::Tensor k = mixed.narrow(-1, hk * dk, hk * dk).view({tokens, hk, dk});
  const at::Tensor v = mixed.narrow(-1, 2 * hk * dk, hv * dv).view({tokens, hv, dv});
  const at::Tensor o = chunk_gated_delta_rule_packed_reference(q, k, v, g, beta, cu_seqlens);       // fp32 [N, Hv, dv]
  // Gated RMSNorm per value head: w * rmsnorm(o) (cast to the model dtype first, as HF) * silu(z).
  const at::Tensor normed = (o * at::rsqrt(o.pow(2).mean(-1, true) + c.rms_norm_eps)).to(x.scalar_type());
  const at::Tensor gated = ((p.norm * normed).to(at::kFloat) * at::silu(z.to(at::kFloat))).to(x.scalar_type());
  return p.out(gated.reshape({tokens, hv * dv}));
}

at::Tensor mlp_forward(const ModelConfig& c, const Mlp& p, const at::Tensor& x, bool grouped_moe) {
  if (!p.moe) {
    const at::Tensor gate_up = p.gate_up(x);
    const int64_t inner = gate_up.size(-1) / 2;
    return p.down(silu_mul(gate_up.narrow(-1, 0, inner), gate_up.narrow(-1, inner, inner)));
  }
  const MoeShape shape{c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                       c.shared_expert_intermediate_size};
  return grouped_moe ? moe_grouped(shape, p.experts, x) : moe_reference(shape, p.experts, x);
}

}  // namespace

TargetModel::TargetModel(ModelConfig config, WeightSource& w, int64_t last_layer, TargetOptions options)
    : config_(std::move(config)), options_(options), impl_(std::make_unique<Impl>()) {
  const ModelConfig& c = config_;
  if (last_layer < 0 || last_layer >= c.num_layers) {
    throw std::invalid_argument(c.source + ": layer " + std::to_string(last_layer) + " requested but the model has " +
                                std::to_string(c.num_layers) + " layers (0.." + std::to_string(c.num_layers - 1) + ")");
  }
  const auto opts = at::TensorOptions().device(options.device).dtype(options.dtype);
  const auto fp32 = opts.dtype(at::kFloat);
  const int64_t h = c.hidden_size, d = c.head_dim;
  const Init norm_init = c.zero_centred_norm ? Init::zeros : Init::ones;
  auto linear = [&](const std::string& name, int64_t out, int64_t in, bool bias = false) {
    Linear l;
    l.weight = w.get(name + ".weight", {out, in}, opts);
    if (bias) l.bias = w.get(name + ".bias", {out}, opts, Init::zeros);
    return l;
  };
  impl_->embed = w.get("embed_tokens.weight", {c.vocab_size, h}, opts);
  impl_->head = c.tie_word_embeddings ? impl_->embed : w.get("lm_head.weight", {c.vocab_size, h}, opts);
  impl_->final_norm = w.get("norm.weight", {h}, opts, norm_init);
  impl_->inv_freq = compute_inv_freq(c).to(options.device);

  for (int64_t i = 0; i <= last_layer; ++i) {
    Layer layer;
    layer.kind = c.layer_types[i];
    layer.input_norm = w.get(layer_name(i, "input_layernorm.weight"), {h}, opts, norm_init);
    layer.post_attention_norm = w.get(layer_name(i, "post_attention_layernorm.weight"), {h}, opts, norm_init);
    if (layer.kind == LayerKind::full_attention) {
      Attention& a = layer.attention;
      const std::string p = layer_name(i, "self_attn.");
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
    } else {
      GatedDeltaNet& g = layer.gdn;
      const std::string p = layer_name(i, "linear_attn.");
      const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
      const int64_t key_channels = hk * c.linear_key_head_dim, value_channels = hv * c.linear_value_head_dim;
      const int64_t conv_channels = 2 * key_channels + value_channels;
      auto concatenated = [&](std::initializer_list<std::pair<const char*, int64_t>> parts) {
        std::vector<at::Tensor> weights;
        for (const auto& [name, out] : parts) weights.push_back(linear(p + name, out, h).weight);
        return Linear{at::cat(weights, 0), {}};
      };
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
    }
    Mlp& m = layer.mlp;
    const std::string p = layer_name(i, "mlp.");
    if (c.layer_is_moe(i)) {
      m.moe = true;
      const int64_t e = c.num_experts, inner = c.moe_intermediate_size;
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
      m.experts = MoeWeights::make(router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate);
    } else {
      m.gate_up.weight = at::cat({linear(p + "gate_proj", c.intermediate_size, h).weight,
                                  linear(p + "up_proj", c.intermediate_size, h).weight}, 0);
      m.down = linear(p + "down_proj", h, c.intermediate_size);
    }
    impl_->layers.push_back(std::move(layer));
  }

  // The MoE layers: grouped on a GPU; the reference host loop on the GPU only when allowed.
  int64_t first_moe = -1;
  for (int64_t i = 0; i <= last_layer && first_moe < 0; ++i) {
    if (c.layer_is_moe(i)) first_moe = i;
  }
  if (first_moe >= 0) {
    using Path = TargetOptions::MoePath;
    const std::optional<std::string> why = options.moe_path == Path::reference
                                               ? std::optional<std::string>("the reference path was asked for")
                                               : moe_grouped_unavailable(options.device, options.dtype);
    grouped_moe_ = options.moe_path == Path::grouped || (options.moe_path == Path::automatic && options.device.is_cuda());
    if (why && !options.device.is_cpu() && !options.allow_slow_path) {
      throw SlowPathRefused("target layer " + std::to_string(first_moe) + " (MoE) on " + options.device.str() +
                            " would run a slow path (a host loop over the experts with a device-to-host copy per layer, "
                            "about 5x slower than the grouped GEMMs): " + *why +
                            ". Set target.allow_slow_path: true to accept the slow path knowingly.");
    }
  }

  // No silent slow path: the GatedDeltaNet layers run the CUDA kernels where they can; the
  // reference path on a GPU (or wherever the kernels were demanded) is refused unless allowed.
  int64_t first_gdn = -1;
  for (int64_t i = 0; i <= last_layer && first_gdn < 0; ++i) {
    if (c.layer_types[i] == LayerKind::linear_attention) first_gdn = i;
  }
  if (first_gdn >= 0) {
    using Path = TargetOptions::GdnPath;
    std::optional<std::string> why = options.gdn_path == Path::reference
                                         ? std::optional<std::string>("the reference path was asked for")
                                         : gdn_kernels_unavailable(c, options.device, options.dtype);
    gdn_kernels_ = !why.has_value();
    const bool refuse = options.gdn_path == Path::kernels || (!options.device.is_cpu() && !options.allow_slow_path);
    if (why && refuse) {
      throw SlowPathRefused("target layer " + std::to_string(first_gdn) + " (linear_attention, GatedDeltaNet) on " +
                            options.device.str() +
                            " would run the reference path (libtorch ops, about 10x slower than the CUDA kernels): " +
                            *why + ". " +
                            (options.gdn_path == Path::kernels
                                 ? std::string("The kernels were required.")
                                 : std::string("Set target.allow_slow_path: true to accept the slow path knowingly.")));
    }
  }
  for (const auto& [kind, path] : kernel_paths()) log::info("target {}: {} layers run {}", family_name(c.family), kind, path);
}

TargetModel::~TargetModel() = default;

int64_t TargetModel::last_layer() const { return static_cast<int64_t>(impl_->layers.size()) - 1; }
const at::Tensor& TargetModel::embed_tokens() const { return impl_->embed; }
const at::Tensor& TargetModel::lm_head() const { return impl_->head; }
const at::Tensor& TargetModel::final_norm_weight() const { return impl_->final_norm; }

std::map<std::string, std::string> TargetModel::kernel_paths() const {
  std::map<std::string, std::string> paths;
  for (const Layer& l : impl_->layers) {
    if (l.kind == LayerKind::full_attention) paths["full_attention"] = "sdpa";
    else paths["linear_attention"] = gdn_kernels_ ? kGdnKernelPath : "reference (libtorch ops, chunked)";
    if (l.mlp.moe) paths["moe"] = grouped_moe_ ? kMoeGroupedPath : kMoeReferencePath;
  }
  return paths;
}

std::vector<at::Tensor> TargetModel::forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                             const std::vector<int64_t>& layers) const {
  c10::InferenceMode inference;
  const ModelConfig& c = config_;
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 || cu_seqlens.back() != input_ids.size(0)) {
    throw std::invalid_argument("target forward: cu_seqlens must run from 0 to the token count " +
                                std::to_string(input_ids.size(0)));
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] > last_layer() || (i > 0 && layers[i] <= layers[i - 1])) {
      throw std::invalid_argument("target forward: tapped layers must ascend within 0.." + std::to_string(last_layer()) +
                                  ", got " + std::to_string(layers[i]));
    }
  }
  const at::Device device = options_.device;
  const at::Tensor ids = input_ids.to(device, at::kLong);
  // Position of each token within its own sequence.
  std::vector<int64_t> position_values(static_cast<size_t>(input_ids.size(0)));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) position_values[t] = t - cu_seqlens[s];
  }
  const at::Tensor positions =
      at::tensor(position_values, at::TensorOptions().dtype(at::kLong)).to(device);
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * impl_->inv_freq.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const at::Tensor cos = emb.cos().to(options_.dtype), sin = emb.sin().to(options_.dtype);

  std::optional<GdnChunkPlan> plan;
  if (gdn_kernels_) plan = make_gdn_chunk_plan(cu_seqlens, device);

  // The residual stream: x plus `pending`, the last sub-layer's output not yet added; each add
  // is fused with the RMSNorm that reads its result (fused_ops.h).
  at::Tensor x = at::embedding(impl_->embed, ids), pending;
  auto add_and_norm = [&](const at::Tensor& weight) {
    if (!pending.defined()) return rms_norm_rows(x, weight, c.rms_norm_eps, c.zero_centred_norm);
    auto [sum, normed] = add_rms_norm(x, pending, weight, c.rms_norm_eps, c.zero_centred_norm);
    x = std::move(sum);
    pending = at::Tensor();
    return normed;
  };
  std::vector<at::Tensor> tapped;
  size_t next = 0;
  for (int64_t i = 0; i <= layers.back(); ++i) {
    const Layer& layer = impl_->layers[i];
    const at::Tensor normed = add_and_norm(layer.input_norm);
    pending = layer.kind == LayerKind::full_attention
                  ? attention_forward(c, layer.attention, normed, cos, sin, cu_seqlens)
                  : gdn_forward(c, layer.gdn, normed, positions, cu_seqlens, plan ? &*plan : nullptr);
    pending = mlp_forward(c, layer.mlp, add_and_norm(layer.post_attention_norm), grouped_moe_);
    if (next < layers.size() && layers[next] == i) {
      x = x + pending;
      pending = at::Tensor();
      tapped.push_back(x);
      ++next;
    }
  }
  return tapped;
}

std::unique_ptr<TargetModel> load_target(const std::string& model_dir, int64_t last_layer, TargetOptions options) {
  ModelConfig config = load_model_config(model_dir);
  CheckpointWeights weights(model_dir);
  return std::make_unique<TargetModel>(std::move(config), weights, last_layer, options);
}

std::unique_ptr<TargetModel> random_target(const ModelConfig& config, int64_t last_layer, TargetOptions options,
                                           uint64_t seed) {
  RandomWeights weights(seed);
  return std::make_unique<TargetModel>(config, weights, last_layer, options);
}

}  // namespace dflash::target
