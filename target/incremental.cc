#include "target/incremental.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"
#include "target/model_impl.h"

namespace dflash::target {
namespace {

// One full-attention layer over the step's tokens: their keys and values appended at `begin`,
// each query attending to every cached key up to its own position.
at::Tensor attention_step(const ModelConfig& c, const Attention& p, const at::Tensor& x, const at::Tensor& cos,
                          const at::Tensor& sin, at::Tensor& keys, at::Tensor& values, int64_t begin) {
  const int64_t n = x.size(0), d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  const auto [q, k, v, gate] = project_attention(c, p, x, cos, sin);
  const int64_t total = begin + n;
  keys = with_rows(keys, begin, total, {hkv, d}, k.options());
  values = with_rows(values, begin, total, {hkv, d}, v.options());
  keys.narrow(0, begin, n).copy_(k);
  values.narrow(0, begin, n).copy_(v);
  auto heads_first = [](const at::Tensor& t) { return t.transpose(0, 1).unsqueeze(0); };
  const auto long_options = at::TensorOptions().dtype(at::kLong).device(x.device());
  const at::Tensor visible = at::arange(total, long_options).unsqueeze(0) <= (at::arange(n, long_options) + begin).unsqueeze(1);
  const at::Tensor o = at::scaled_dot_product_attention(
      heads_first(q), heads_first(keys.narrow(0, 0, total)), heads_first(values.narrow(0, 0, total)), visible, 0.0,
      /*is_causal=*/false, 1.0 / std::sqrt(static_cast<double>(d)), /*enable_gqa=*/true);
  at::Tensor out = o.squeeze(0).transpose(0, 1).reshape({n, hq * d});
  if (c.gated_attention) out = sigmoid_gate(out, gate);
  return p.o(out);
}

// The causal depthwise conv + SiLU over `window` ([K - 1 + n, C]: the K - 1 inputs before the
// step, then the step's), in fp32 as causal_conv1d_silu_reference, returned in `dtype`.
at::Tensor conv_over_window(const at::Tensor& window, const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t kernel = weight.size(1);
  const at::Tensor taps = window.to(at::kFloat).unfold(0, kernel, 1);  // [n, C, K]: inputs t .. t + K - 1
  return at::silu((taps * weight.to(at::kFloat).unsqueeze(0)).sum(-1)).to(dtype);
}

// The rule over n tokens from `state`: token by token for short steps, chunked for long ones.
at::Tensor run_rule(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                    const at::Tensor& beta, at::Tensor* state, int64_t recurrent_step_tokens) {
  if (q.size(0) <= recurrent_step_tokens) {
    GdnSteps steps = recurrent_gated_delta_rule_steps(q, k, v, g, beta, *state);
    *state = steps.states[q.size(0) - 1];
    return steps.o;
  }
  return chunk_gated_delta_rule_reference(q, k, v, g, beta, 64, state);
}

// One GatedDeltaNet layer over the step's tokens, from the cached conv inputs and state; keeps
// what crop() needs in `last`.
at::Tensor gdn_step(const ModelConfig& c, const GatedDeltaNet& p, const at::Tensor& x, at::Tensor& conv,
                    at::Tensor& state, DecodeCache::LastStep::Gdn& last, int64_t recurrent_step_tokens) {
  const int64_t n = x.size(0), hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kernel = p.conv.size(1);
  auto [mixed, z, b, a] = project_gdn(c, p, x);
  if (!conv.defined()) conv = at::zeros({kernel - 1, mixed.size(1)}, mixed.options());
  if (!state.defined()) state = at::zeros({hv, dk, dv}, x.options().dtype(at::kFloat));
  last.window = at::cat({conv, mixed}, 0);
  const at::Tensor convolved = conv_over_window(last.window, p.conv, x.scalar_type());
  const auto [g, beta] = gdn_gates_reference(a, b, p.a_log, p.dt_bias);
  last.q = convolved.narrow(-1, 0, hk * dk).view({n, hk, dk});
  last.k = convolved.narrow(-1, hk * dk, hk * dk).view({n, hk, dk});
  last.v = convolved.narrow(-1, 2 * hk * dk, hv * dv).view({n, hv, dv});
  last.g = g;
  last.beta = beta;
  last.state_before = state;
  const at::Tensor o = run_rule(last.q, last.k, last.v, g, beta, &state, recurrent_step_tokens);
  conv = last.window.narrow(0, n, kernel - 1).clone();
  return gdn_output(c, p, o, z, x.scalar_type());
}

}  // namespace

IncrementalTarget::IncrementalTarget(const TargetModel& model, int64_t recurrent_step_tokens)
    : model_(model), recurrent_step_tokens_(recurrent_step_tokens) {
  if (model.last_layer() != model.config().num_layers - 1) {
    throw std::invalid_argument(model.config().source + ": decoding needs every layer of the target (built to layer " +
                                std::to_string(model.last_layer()) + " of " +
                                std::to_string(model.config().num_layers) + ")");
  }
}

DecodeCache IncrementalTarget::new_cache() const {
  DecodeCache cache;
  const size_t layers = model_.impl_->layers.size();
  cache.keys.resize(layers);
  cache.values.resize(layers);
  cache.conv.resize(layers);
  cache.state.resize(layers);
  cache.last.gdn.resize(layers);
  return cache;
}

DecodeOutput IncrementalTarget::step(DecodeCache& cache, const at::Tensor& input_ids, const std::vector<int64_t>& tap) const {
  c10::InferenceMode inference;
  const TargetModel::Impl& m = *model_.impl_;
  const ModelConfig& c = model_.config();
  const at::Device device = model_.options().device;
  const at::Tensor ids = input_ids.to(device, at::kLong).reshape({-1});
  const int64_t n = ids.size(0), begin = cache.length;
  if (n == 0) throw std::invalid_argument("decode step: no tokens");
  if (cache.keys.size() != m.layers.size()) throw std::invalid_argument("decode step: the cache is not this model's");
  const at::Tensor positions = at::arange(begin, begin + n, at::TensorOptions().dtype(at::kLong).device(device));
  const auto [cos, sin] = rope_tables(m.inv_freq, positions, model_.options().dtype);
  cache.last.begin = begin;
  cache.last.count = n;

  ResidualStream stream(at::embedding(m.embed, ids), c);
  std::vector<at::Tensor> tapped;
  size_t next = 0;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const Layer& layer = m.layers[i];
    const at::Tensor normed = stream.add_and_norm(layer.input_norm);
    stream.push(layer.kind == LayerKind::full_attention
                    ? attention_step(c, layer.attention, normed, cos, sin, cache.keys[i], cache.values[i], begin)
                    : gdn_step(c, layer.gdn, normed, cache.conv[i], cache.state[i], cache.last.gdn[i],
                               recurrent_step_tokens_));
    stream.push(mlp_forward(c, layer.mlp, stream.add_and_norm(layer.post_attention_norm), model_.grouped_moe_));
    if (next < tap.size() && tap[next] == static_cast<int64_t>(i)) {
      tapped.push_back(stream.output());
      ++next;
    }
  }
  if (next != tap.size()) throw std::invalid_argument("decode step: tapped layers must ascend within the model's layers");
  cache.length = begin + n;
  DecodeOutput out;
  const at::Tensor normed = stream.add_and_norm(m.final_norm);
  out.logits = at::matmul(normed, m.head.t()).to(at::kFloat);
  if (!tapped.empty()) out.features = at::cat(tapped, -1);
  return out;
}

DecodeOutput IncrementalTarget::prefill(DecodeCache& cache, const at::Tensor& ids_in, const std::vector<int64_t>& tap,
                                       int64_t chunk) const {
  c10::InferenceMode inference;
  const at::Tensor ids = ids_in.reshape({-1});
  if (chunk < 1) throw std::invalid_argument("decode prefill: chunk must be >= 1");
  std::vector<at::Tensor> features;
  DecodeOutput last;
  for (int64_t begin = 0; begin < ids.size(0); begin += chunk) {
    last = step(cache, ids.narrow(0, begin, std::min(chunk, ids.size(0) - begin)), tap);
    if (last.features.defined()) features.push_back(last.features);
  }
  DecodeOutput out;
  out.logits = last.logits.narrow(0, last.logits.size(0) - 1, 1);
  if (!features.empty()) out.features = features.size() == 1 ? features[0] : at::cat(features, 0);
  return out;
}

void IncrementalTarget::crop(DecodeCache& cache, int64_t length) const {
  c10::InferenceMode inference;
  DecodeCache::LastStep& last = cache.last;
  if (length < last.begin || length > last.begin + last.count) {
    throw std::invalid_argument("decode crop: length " + std::to_string(length) + " is outside the last step [" +
                                std::to_string(last.begin) + ", " + std::to_string(last.begin + last.count) + "]");
  }
  const int64_t keep = length - last.begin;
  if (keep < last.count) {
    for (size_t i = 0; i < last.gdn.size(); ++i) {
      DecodeCache::LastStep::Gdn& g = last.gdn[i];
      if (!g.window.defined()) continue;  // a full-attention layer: its rows past `length` are ignored
      const int64_t kernel_minus_1 = g.window.size(0) - last.count;
      cache.conv[i] = g.window.narrow(0, keep, kernel_minus_1).clone();
      at::Tensor state = g.state_before;
      if (keep > 0) {
        run_rule(g.q.narrow(0, 0, keep), g.k.narrow(0, 0, keep), g.v.narrow(0, 0, keep), g.g.narrow(0, 0, keep),
                 g.beta.narrow(0, 0, keep), &state, recurrent_step_tokens_);
      }
      cache.state[i] = state;
      g.window = g.window.narrow(0, 0, kernel_minus_1 + keep);
      g.q = g.q.narrow(0, 0, keep), g.k = g.k.narrow(0, 0, keep), g.v = g.v.narrow(0, 0, keep);
      g.g = g.g.narrow(0, 0, keep), g.beta = g.beta.narrow(0, 0, keep);
    }
  }
  last.count = keep;
  cache.length = length;
}

}  // namespace dflash::target
