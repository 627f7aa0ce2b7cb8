#include "target/model.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <tuple>

#include "common/log.h"
#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"
#include "target/gdn_cuda.h"
#include "target/layers.h"
#include "target/model_impl.h"
#include "target/moe.h"

namespace dflash::target {

namespace {

at::Tensor attention_forward(const ModelConfig& c, const Attention& p, const GemmInput& x, const at::Tensor& cos,
                             const at::Tensor& sin, const std::vector<int64_t>& cu_seqlens) {
  const int64_t d = c.head_dim, hq = c.num_attention_heads;
  const auto [q, k, v, gate] = project_attention(c, p, x, cos, sin);
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
  return attention_output(p, out, gate);
}

// plan: the chunk table when the layer runs the CUDA kernels, null for the reference path.
at::Tensor gdn_forward(const ModelConfig& c, const GatedDeltaNet& p, const GemmInput& x, const at::Tensor& positions,
                       const std::vector<int64_t>& cu_seqlens, const GdnChunkPlan* plan) {
  const int64_t tokens = x.rows();
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  auto [mixed, z, b, a] = project_gdn(c, p, x);
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
  return gdn_output(c, p, o, z, z.scalar_type());
}

// The first layer of range for which `is`, or -1.
template <typename Predicate>
int64_t first_matching(const LayerRange& range, Predicate is) {
  for (int64_t i = range.first; i <= range.last; ++i) {
    if (is(i)) return i;
  }
  return -1;
}

// The MoE layers: grouped GEMMs with device routing where _grouped_mm runs them on the device,
// the reference host loop elsewhere (kernel_path.h's rule); `grouped` forces them (tests).
bool use_grouped_moe(const ModelConfig& c, const LayerRange& range, const TargetOptions& options) {
  using Path = TargetOptions::MoePath;
  const int64_t first = first_matching(range, [&](int64_t i) { return c.layer_is_moe(i); });
  if (first < 0 || options.moe_path == Path::grouped) return options.moe_path == Path::grouped;
  return fast_path_chosen({"target layer " + std::to_string(first) + " (MoE) on " + options.device.str(),
                           options.moe_path == Path::reference ? PathRequest::slow : PathRequest::automatic,
                           moe_grouped_unavailable(options.device, options.dtype), !options.device.is_cpu(),
                           options.allow_slow_path, "the grouped GEMMs",
                           "a slow path (a host loop over the experts with a device-to-host copy per layer)",
                           "about 5x slower than the grouped GEMMs",
                           "Set target.allow_slow_path: true to accept the slow path knowingly."});
}

// The FP8 projections: the block-scaled GEMM where it runs, the emulation elsewhere (the CPU;
// a GPU only when the slow path is allowed).
bool use_fp8_gemms(const TargetOptions& options) {
  if (!options.fp8_weights) return false;
  return fast_path_chosen({"the target's FP8 projections on " + options.device.str(), PathRequest::automatic,
                           fp8_gemm_unavailable(options.device), !options.device.is_cpu(), options.allow_slow_path,
                           "the block-scaled FP8 GEMMs", "an emulation (every weight dequantized per GEMM)",
                           "many times slower than bf16",
                           "Set target.dtype: bfloat16, or target.allow_slow_path: true to accept the emulation."});
}

// The GatedDeltaNet layers: the CUDA kernels where they can run, the reference path elsewhere
// (kernel_path.h's rule).
bool use_gdn_kernels(const ModelConfig& c, const LayerRange& range, const TargetOptions& options) {
  using Path = TargetOptions::GdnPath;
  const int64_t first = first_matching(range, [&](int64_t i) { return c.layer_types[i] == LayerKind::linear_attention; });
  if (first < 0) return false;
  const PathRequest request = options.gdn_path == Path::kernels     ? PathRequest::fast
                              : options.gdn_path == Path::reference ? PathRequest::slow
                                                                    : PathRequest::automatic;
  return fast_path_chosen({"target layer " + std::to_string(first) + " (linear_attention, GatedDeltaNet) on " +
                               options.device.str(),
                           request, gdn_kernels_unavailable(c, options.device, options.dtype), !options.device.is_cpu(),
                           options.allow_slow_path, "the CUDA kernels", "the reference path (libtorch ops)",
                           "about 10x slower than the CUDA kernels",
                           "Set target.allow_slow_path: true to accept the slow path knowingly."});
}

}  // namespace

AttentionQkv project_attention(const ModelConfig& c, const Attention& p, const GemmInput& x, const at::Tensor& cos,
                               const at::Tensor& sin) {
  const int64_t tokens = x.rows(), d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
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
  at::Tensor v = projected.narrow(1, q_out + hkv * d, hkv * d).view({tokens, hkv, d});
  if (c.qk_norm) {
    std::tie(q, k) = qk_norm_rope(q, p.q_norm, k, p.k_norm, cos, sin, c.rms_norm_eps, c.zero_centred_norm);
  } else {
    q = apply_rope(q, cos, sin);
    k = apply_rope(k, cos, sin);
  }
  return {q, k, v, gate};
}

GdnProjections project_gdn(const ModelConfig& c, const GatedDeltaNet& p, const GemmInput& x) {
  const int64_t tokens = x.rows();
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
  return {mixed, z, b, a};
}

at::Tensor attention_output(const Attention& p, const at::Tensor& out, const at::Tensor& gate) {
  if (!gate.defined()) return p.o(out);
  if (p.o.reads_fp8()) return p.o(sigmoid_gate_fp8(out, gate));
  return p.o(sigmoid_gate(out, gate));
}

at::Tensor gdn_output(const ModelConfig& c, const GatedDeltaNet& p, const at::Tensor& o, const at::Tensor& z,
                      at::ScalarType dtype) {
  return p.out(gated_rms_norm(o, z, p.norm, c.rms_norm_eps, dtype));
}

at::Tensor mlp_forward(const ModelConfig& c, const Mlp& p, const GemmInput& x, bool grouped_moe) {
  if (!p.moe) {
    return p.down.reads_fp8() ? p.down(p.gate_up.silu_mul_fp8_of(x)) : p.down(p.gate_up.silu_mul_of(x));
  }
  const MoeShape shape{c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.norm_topk_prob,
                       c.shared_expert_intermediate_size};
  return grouped_moe ? moe_grouped(shape, p.experts, x.x) : moe_reference(shape, p.experts, x.x);
}

std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions,
                                              at::ScalarType dtype) {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype), emb.sin().to(dtype)};
}

TargetModel::TargetModel(ModelConfig config, WeightSource& w, int64_t last_layer, TargetOptions options)
    : TargetModel(std::move(config), w, LayerRange{0, last_layer, true}, options) {}

TargetModel::TargetModel(ModelConfig config, WeightSource& w, LayerRange range, TargetOptions options)
    : config_(std::move(config)), options_(options), first_layer_(range.first), impl_(std::make_unique<Impl>()) {
  const DeviceScope scope(options.device);  // a checkpoint's FP8 blocks dequantized at load run our kernel there
  const ModelConfig& c = config_;
  if (range.last < 0 || range.last >= c.num_layers || range.first < 0 || range.first > range.last) {
    throw std::invalid_argument(c.source + ": layers " + std::to_string(range.first) + ".." +
                                std::to_string(range.last) + " requested but the model has " +
                                std::to_string(c.num_layers) + " layers (0.." + std::to_string(c.num_layers - 1) + ")");
  }
  const auto opts = at::TensorOptions().device(options.device).dtype(options.dtype);
  const int64_t h = c.hidden_size;
  const Init norm_init = c.zero_centred_norm ? Init::zeros : Init::ones;
  if (range.first == 0 || (range.head && c.tie_word_embeddings)) {
    impl_->embed = w.get("embed_tokens.weight", {c.vocab_size, h}, opts);
  }
  if (range.head) {
    impl_->head = c.tie_word_embeddings ? impl_->embed : w.get("lm_head.weight", {c.vocab_size, h}, opts);
    impl_->final_norm = w.get("norm.weight", {h}, opts, norm_init);
  }
  impl_->inv_freq = compute_inv_freq(c).to(options.device);
  if (options.fp8_weights && options.dtype != at::kBFloat16) {
    throw std::invalid_argument("target: FP8 weights run with bf16 activations, not " +
                                std::string(c10::toString(options.dtype)));
  }
  fp8_gemms_ = use_fp8_gemms(options);
  for (int64_t i = range.first; i <= range.last; ++i) {
    impl_->layers.push_back(load_layer(c, w, i, opts, options.fp8_weights));
  }
  grouped_moe_ = use_grouped_moe(c, range, options);
  gdn_kernels_ = use_gdn_kernels(c, range, options);
  log::info("target layers {}..{} on {}: {} GB of weights ({})", range.first, range.last, options.device.str(),
            log::fixed(static_cast<double>(weight_bytes()) / 1e9, 1),
            options.fp8_weights ? "projections and experts FP8, the rest " + std::string(c10::toString(options.dtype))
                                : std::string(c10::toString(options.dtype)));
  for (const auto& [component, path] : kernel_paths()) log::info("kernel path: {}", path.str());
}

TargetModel::~TargetModel() = default;

int64_t TargetModel::last_layer() const { return first_layer_ + static_cast<int64_t>(impl_->layers.size()) - 1; }

namespace {
const at::Tensor& held(const at::Tensor& t, const char* what, const TargetModel& m) {
  if (!t.defined()) {
    throw std::logic_error(std::string("the target stage of layers ") + std::to_string(m.first_layer()) + ".." +
                           std::to_string(m.last_layer()) + " holds no " + what);
  }
  return t;
}
}  // namespace

const at::Tensor& TargetModel::embed_tokens() const { return held(impl_->embed, "embedding", *this); }
const at::Tensor& TargetModel::lm_head() const { return held(impl_->head, "LM head", *this); }
const at::Tensor& TargetModel::final_norm_weight() const { return held(impl_->final_norm, "final norm", *this); }

std::map<std::string, KernelPath> TargetModel::kernel_paths() const {
  std::map<std::string, KernelPath> paths;
  const auto moe_fp8_detail = [&](const MoeWeights& experts) -> std::string {
    if (!experts.fp8_gate_up.defined()) return "";
    if (grouped_moe_ && fp8_experts_grouped(experts, options_.device, options_.dtype)) {
      return std::string("; ") + kFp8GroupedPath;
    }
    return "; FP8 experts dequantized to bf16 per layer";
  };
  auto add = [&](const char* component, const char* path, const std::string& detail) {
    paths[component] = {component, path, detail};
  };
  const std::string slow_reason = options_.allow_slow_path ? "target.allow_slow_path" : "as configured";
  for (const Layer& l : impl_->layers) {
    if (l.kind == LayerKind::full_attention) {
      add("target.full_attention", "sdpa", "ATen scaled_dot_product_attention");
    } else if (gdn_kernels_) {
      add("target.linear_attention", "kernels", kGdnKernelPath);
    } else {
      const auto why = gdn_kernels_unavailable(config_, options_.device, options_.dtype);
      add("target.linear_attention", "reference", "libtorch ops, chunked" + (why ? "; the kernels do not run: " + *why : ""));
    }
    if (l.mlp.moe) {
      add("target.moe", grouped_moe_ ? "grouped" : "reference",
          std::string(grouped_moe_ ? kMoeGroupedPath : kMoeReferencePath) + moe_fp8_detail(l.mlp.experts));
    }
  }
  if (!options_.fp8_weights) {
    add("target.projections", c10::toString(options_.dtype),
        options_.device.is_cuda() && options_.dtype == at::kBFloat16
            ? "cuBLASLt with 32 MB of workspace up to " + std::to_string(kCublasLtRows) +
                  " rows (decoding steps), ATen GEMMs above"
            : "ATen GEMMs");
  } else if (fp8_gemms_) {
    add("target.projections", "fp8", kFp8GemmPath);
  } else {
    add("target.projections", "fp8_emulated",
        std::string(kFp8EmulatedPath) + ": " + fp8_gemm_unavailable(options_.device).value_or(""));
  }
  return paths;
}

int64_t TargetModel::weight_bytes() const {
  int64_t n = 0;
  for (const at::Tensor* t : {&impl_->embed, &impl_->final_norm}) {
    if (t->defined()) n += t->numel() * t->element_size();
  }
  if (impl_->head.defined() && !impl_->head.is_same(impl_->embed)) n += impl_->head.numel() * impl_->head.element_size();
  for (const Layer& l : impl_->layers) n += layer_bytes(l);
  return n;
}

void log_quantization(const CheckpointWeights& weights, const TargetOptions& options) {
  if (weights.fp8_block().empty()) return;
  const int64_t rows = weights.fp8_block()[0], columns = weights.fp8_block()[1];
  if (!options.fp8_weights) {
    log::info("target weights: {}: block-scaled FP8 (e4m3, blocks of {}x{}), dequantized to {} at load "
              "(target.dtype: float8 keeps them FP8)",
              weights.describe(), rows, columns, c10::toString(options.dtype));
  } else if (rows == kFp8Block && columns == kFp8Block) {
    log::info("target weights: {}: block-scaled FP8 (e4m3, blocks of 128x128), kept FP8 as stored (a router or "
              "shared expert stored FP8 is dequantized to {})",
              weights.describe(), c10::toString(options.dtype));
  } else {
    log::info("target weights: {}: block-scaled FP8 in blocks of {}x{}, requantized to the GEMMs' 128x128 blocks at load",
              weights.describe(), rows, columns);
  }
}

namespace {

void check_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t tokens) {
  if (cu_seqlens.size() < 2 || cu_seqlens.front() != 0 || cu_seqlens.back() != tokens) {
    throw std::invalid_argument("target forward: cu_seqlens must run from 0 to the token count " + std::to_string(tokens));
  }
}

}  // namespace

std::vector<at::Tensor> TargetModel::forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                             const std::vector<int64_t>& layers) const {
  if (first_layer_ != 0) {
    throw std::logic_error("target forward: this is the stage of layers " + std::to_string(first_layer_) + ".." +
                           std::to_string(last_layer()) + "; run it with forward_stage");
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] > last_layer() || (i > 0 && layers[i] <= layers[i - 1])) {
      throw std::invalid_argument("target forward: tapped layers must ascend within 0.." + std::to_string(last_layer()) +
                                  ", got " + std::to_string(layers[i]));
    }
  }
  std::vector<at::Tensor> tapped;
  run_layers(input_ids, cu_seqlens, StreamState{}, layers.empty() ? last_layer() : layers.back(), layers, &tapped);
  return tapped;
}

StreamState TargetModel::forward_stage(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                       const StreamState& in, const std::vector<int64_t>& layers,
                                       std::vector<at::Tensor>* tapped) const {
  if ((first_layer_ == 0) == in.x.defined()) {
    throw std::invalid_argument(first_layer_ == 0 ? "target stage 0 starts from the token ids, not a stream"
                                                  : "target stage from layer " + std::to_string(first_layer_) +
                                                        " needs the previous stage's stream");
  }
  return run_layers(input_ids, cu_seqlens, in, last_layer(), layers, tapped);
}

StreamState TargetModel::run_layers(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                    const StreamState& in, int64_t through, const std::vector<int64_t>& layers,
                                    std::vector<at::Tensor>* tapped) const {
  c10::InferenceMode inference;
  const ModelConfig& c = config_;
  check_cu_seqlens(cu_seqlens, input_ids.size(0));
  const at::Device device = options_.device;
  const DeviceScope scope(device);
  // Position of each token within its own sequence.
  std::vector<int64_t> position_values(static_cast<size_t>(input_ids.size(0)));
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; ++t) position_values[t] = t - cu_seqlens[s];
  }
  const at::Tensor positions =
      at::tensor(position_values, at::TensorOptions().dtype(at::kLong)).to(device);
  const auto [cos, sin] = rope_tables(impl_->inv_freq, positions, options_.dtype);

  std::optional<GdnChunkPlan> plan;
  if (gdn_kernels_) plan = make_gdn_chunk_plan(cu_seqlens, device);

  auto on_device = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  ResidualStream stream = in.x.defined() ? ResidualStream(on_device(in.x), on_device(in.pending), c)
                                         : ResidualStream(at::embedding(impl_->embed, input_ids.to(device, at::kLong)), c);
  auto next = std::lower_bound(layers.begin(), layers.end(), first_layer_);
  for (int64_t i = first_layer_; i <= through; ++i) {
    const Layer& layer = impl_->layers[static_cast<size_t>(i - first_layer_)];
    const GemmInput normed = stream.add_and_norm(layer.input_norm, layer.mixer_reads_fp8());
    stream.push(layer.kind == LayerKind::full_attention
                    ? attention_forward(c, layer.attention, normed, cos, sin, cu_seqlens)
                    : gdn_forward(c, layer.gdn, normed, positions, cu_seqlens, plan ? &*plan : nullptr));
    stream.push(mlp_forward(c, layer.mlp, stream.add_and_norm(layer.post_attention_norm, layer.mlp_reads_fp8()),
                            grouped_moe_));
    if (next != layers.end() && *next == i) {
      tapped->push_back(stream.output());
      ++next;
    }
  }
  return stream.state();
}

std::unique_ptr<TargetModel> load_target(const std::string& model_dir, int64_t last_layer, TargetOptions options) {
  ModelConfig config = load_model_config(model_dir);
  CheckpointWeights weights(model_dir);
  log_quantization(weights, options);
  return std::make_unique<TargetModel>(std::move(config), weights, last_layer, options);
}

std::unique_ptr<TargetModel> random_target(const ModelConfig& config, int64_t last_layer, TargetOptions options,
                                           uint64_t seed) {
  RandomWeights weights(seed);
  return std::make_unique<TargetModel>(config, weights, last_layer, options);
}

}  // namespace dflash::target
