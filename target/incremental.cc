#include "target/incremental.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <stdexcept>
#include <string>

#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"
#include "target/gdn_cuda.h"
#include "target/model_impl.h"

namespace dflash::target {
namespace {

// The tensors of G sequences [G, n, H, d] as one sequence with the heads side by side [n, G*H, d]
// (the rule treats heads independently; value head h of member j reads key head h / (Hv/Hk) of
// member j, as before).
at::Tensor heads_side_by_side(const at::Tensor& t) {
  if (t.size(0) == 1) return t.squeeze(0);
  std::vector<int64_t> shape{t.size(1), t.size(0) * t.size(2)};
  for (int64_t i = 3; i < t.dim(); ++i) shape.push_back(t.size(i));
  return t.transpose(0, 1).reshape(shape);
}

// Which cached keys each query of a group sees ([G, 1, n, longest] bool on `device`: key
// positions up to the query's own, in its own sequence; the rest is the padding to the group's
// longest). The same for every attention layer of a step: built once per step (building it per
// layer made the host wait for the GPU at each of them, a copy from host memory).
at::Tensor visible_keys(const RowGroup& group, const std::vector<DecodeCache*>& caches, at::Device device) {
  std::vector<int64_t> begins;  // per member: the position of its first token (its cache length)
  int64_t longest = 0;
  for (size_t member : group.members) {
    begins.push_back(caches[member]->length);
    longest = std::max(longest, begins.back() + group.count);
  }
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  const at::Tensor last_visible =  // [G, n]: the last key position each query sees
      at::tensor(begins, long_options).unsqueeze(1) + at::arange(group.count, long_options).unsqueeze(0);
  return (at::arange(longest, long_options).view({1, 1, longest}) <= last_visible.unsqueeze(2)).unsqueeze(1).to(device);
}

// One full-attention layer for a group: its members' keys and values appended to their caches
// (layer `layer`), each query attending to its own sequence's keys up to its position (keys
// padded to the group's longest and masked by `visible`, visible_keys). Writes the attention rows
// into `out` [tokens, Hq, d].
void attention_group(const ModelConfig& c, const AttentionQkv& a, const RowGroup& group, const at::Tensor& visible,
                     const std::vector<DecodeCache*>& caches, size_t layer, at::Tensor& out) {
  const int64_t n = group.count, size = static_cast<int64_t>(group.members.size());
  const int64_t d = c.head_dim, hq = c.num_attention_heads, hkv = c.num_key_value_heads;
  int64_t longest = 0;
  std::vector<at::Tensor> keys, values, new_keys, new_values;
  // The group's new keys and values, member-major and dense: their appends are one copy_all each.
  const at::Tensor k_rows = a.k.index_select(0, group.rows), v_rows = a.v.index_select(0, group.rows);
  for (int64_t j = 0; j < size; ++j) {
    DecodeCache& cache = *caches[group.members[j]];
    const int64_t begin = cache.length, total = begin + n;
    at::Tensor& k = cache.keys[layer];
    at::Tensor& v = cache.values[layer];
    k = with_rows(k, begin, total, {hkv, d}, a.k.options());
    v = with_rows(v, begin, total, {hkv, d}, a.v.options());
    new_keys.push_back(k.narrow(0, begin, n));
    new_values.push_back(v.narrow(0, begin, n));
    keys.push_back(k.narrow(0, 0, total));
    values.push_back(v.narrow(0, 0, total));
    longest = std::max(longest, total);
  }
  copy_all(new_keys, k_rows.split(n));
  copy_all(new_values, v_rows.split(n));
  const at::Tensor q = a.q.index_select(0, group.rows).view({size, n, hq, d}).transpose(1, 2);
  const at::Tensor o = at::scaled_dot_product_attention(q, padded_heads_first(keys, longest),
                                                        padded_heads_first(values, longest), visible, 0.0,
                                                        /*is_causal=*/false, 1.0 / std::sqrt(static_cast<double>(d)),
                                                        /*enable_gqa=*/true);
  out.index_copy_(0, group.rows, o.transpose(1, 2).reshape({size * n, hq, d}));
}

// One full-attention layer over every sequence's tokens.
at::Tensor attention_layer(const ModelConfig& c, const Attention& p, const at::Tensor& x, const at::Tensor& cos,
                           const at::Tensor& sin, const std::vector<RowGroup>& groups,
                           const std::vector<at::Tensor>& visible, const std::vector<DecodeCache*>& caches,
                           size_t layer) {
  const AttentionQkv a = project_attention(c, p, x, cos, sin);
  at::Tensor out = at::empty({x.size(0), c.num_attention_heads, c.head_dim}, a.q.options());
  for (size_t i = 0; i < groups.size(); ++i) attention_group(c, a, groups[i], visible[i], caches, layer, out);
  out = out.view({x.size(0), c.num_attention_heads * c.head_dim});
  if (c.gated_attention) out = sigmoid_gate(out, a.gate);
  return p.o(out);
}

// The causal depthwise conv + SiLU over `window` ([G, K - 1 + n, C]: the K - 1 inputs before the
// step, then the step's), in fp32 as causal_conv1d_silu_reference, returned in `dtype`.
at::Tensor conv_over_window(const at::Tensor& window, const at::Tensor& weight, at::ScalarType dtype) {
  const int64_t kernel = weight.size(1);
  const at::Tensor taps = window.to(at::kFloat).unfold(-2, kernel, 1);  // [G, n, C, K]: inputs t .. t + K - 1
  return at::silu((taps * weight.to(at::kFloat)).sum(-1)).to(dtype);
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

// Steps and crops of at most this many tokens per sequence run the decode-step kernel on the GPU.
constexpr int64_t kKernelStepTokens = 64;

// The rule for a group of sequences from `states` [G, Hv, dk, dv] (replaced by the states after
// the tokens): q, k [G, n, Hk, dk], v [G, n, Hv, dv], g, beta [G, n, Hv]. Returns o [G, n, Hv, dv].
// `kernel`: steps and crops of up to kKernelStepTokens tokens run the decode-step kernel (the
// model's GatedDeltaNet layers run the CUDA kernels; same math, the state read and written once;
// longer ones, prefills, the chunked rule).
at::Tensor run_rule_group(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor* states, int64_t recurrent_step_tokens, bool kernel) {
  const int64_t size = q.size(0), n = q.size(1), hv = v.size(2);
  if (kernel && n <= kKernelStepTokens) {
    GdnDecodeResult r = gated_delta_rule_decode_step_cuda(q, k, v, g, beta, *states);
    *states = r.state;
    return r.o;
  }
  at::Tensor state = states->reshape({size * hv, states->size(2), states->size(3)});
  const at::Tensor o = run_rule(heads_side_by_side(q), heads_side_by_side(k), heads_side_by_side(v),
                                heads_side_by_side(g.unsqueeze(-1)).squeeze(-1),
                                heads_side_by_side(beta.unsqueeze(-1)).squeeze(-1), &state, recurrent_step_tokens);
  *states = state.view(states->sizes());
  return o.view({n, size, hv, v.size(3)}).transpose(0, 1);
}

// One GatedDeltaNet layer for a group, from its members' cached conv inputs and states; keeps
// what crop() needs in each member's last step when the step is croppable (per member six views
// and layer: a few thousand host-side ops per step at 64 sequences, skipped for plain decoding). Writes the rule's o rows into `o_out` [tokens,
// Hv, dv] (fp32).
void gdn_group(const ModelConfig& c, const GatedDeltaNet& p, const GdnProjections& proj, const GdnGateValues& gates,
               const RowGroup& group, const std::vector<DecodeCache*>& caches, size_t layer, at::Tensor& o_out,
               int64_t recurrent_step_tokens, bool decode_kernel, bool croppable) {
  const int64_t n = group.count, size = static_cast<int64_t>(group.members.size());
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim, kernel = p.conv.size(1);
  // Per member only views: the windows [G, K - 1 + n, C] are built by one gather and one cat.
  std::vector<at::Tensor> convs, states_before;
  for (int64_t j = 0; j < size; ++j) {
    DecodeCache& cache = *caches[group.members[j]];
    at::Tensor& conv = cache.conv[layer];
    if (!conv.defined()) conv = at::zeros({kernel - 1, proj.mixed.size(1)}, proj.mixed.options());
    if (!cache.state[layer].defined()) cache.state[layer] = at::zeros({hv, dk, dv}, o_out.options());
    convs.push_back(conv);
    states_before.push_back(cache.state[layer]);
  }
  const at::Tensor window =
      at::cat({restacked(convs), proj.mixed.index_select(0, group.rows).view({size, n, proj.mixed.size(1)})}, 1);
  const at::Tensor convolved = conv_over_window(window, p.conv, proj.mixed.scalar_type());
  const at::Tensor q = convolved.narrow(-1, 0, hk * dk).view({size, n, hk, dk});
  const at::Tensor k = convolved.narrow(-1, hk * dk, hk * dk).view({size, n, hk, dk});
  const at::Tensor v = convolved.narrow(-1, 2 * hk * dk, hv * dv).view({size, n, hv, dv});
  const at::Tensor g = gates.g.index_select(0, group.rows).view({size, n, hv});
  const at::Tensor beta = gates.beta.index_select(0, group.rows).view({size, n, hv});
  at::Tensor states = restacked(states_before);
  const at::Tensor o = run_rule_group(q, k, v, g, beta, &states, recurrent_step_tokens, decode_kernel);
  o_out.index_copy_(0, group.rows, o.reshape({size * n, hv, dv}));
  // The members' last K - 1 conv inputs, compact, in one copy (a view of the window would keep the
  // whole step's window alive: 10 MB per layer and sequence after a 512-token prefill at 27B).
  // clone, not contiguous(): with one member the narrowed window counts as contiguous, no copy.
  const at::Tensor tails = window.narrow(1, n, kernel - 1).clone(at::MemoryFormat::Contiguous);
  for (int64_t j = 0; j < size; ++j) {
    DecodeCache& cache = *caches[group.members[j]];
    if (croppable) cache.last.gdn[layer] = {states_before[j], q[j], k[j], v[j], g[j], beta[j], window[j]};
    cache.state[layer] = states[j];
    cache.conv[layer] = tails[j];
  }
}

// One GatedDeltaNet layer over every sequence's tokens.
at::Tensor gdn_layer(const ModelConfig& c, const GatedDeltaNet& p, const at::Tensor& x, const std::vector<RowGroup>& groups,
                     const std::vector<DecodeCache*>& caches, size_t layer, int64_t recurrent_step_tokens,
                     bool kernel, bool croppable) {
  const GdnProjections proj = project_gdn(c, p, x);
  const GdnGateValues gates = gdn_gates_reference(proj.a, proj.b, p.a_log, p.dt_bias);
  at::Tensor o = at::empty({x.size(0), c.linear_num_value_heads, c.linear_value_head_dim},
                           x.options().dtype(at::kFloat));
  for (const RowGroup& group : groups) gdn_group(c, p, proj, gates, group, caches, layer, o, recurrent_step_tokens, kernel, croppable);
  return gdn_output(c, p, o, proj.z, x.scalar_type());
}

}  // namespace

IncrementalTarget::IncrementalTarget(const TargetModel& model, int64_t recurrent_step_tokens)
    : model_(model), recurrent_step_tokens_(recurrent_step_tokens) {
  if (model.first_layer() != 0 || model.last_layer() != model.config().num_layers - 1) {
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

DecodeOutput IncrementalTarget::step(DecodeCache& cache, const at::Tensor& ids, const std::vector<int64_t>& tap) const {
  return std::move(step_batch({&cache}, {ids}, tap)[0]);
}

std::vector<DecodeOutput> IncrementalTarget::step_batch(const std::vector<DecodeCache*>& caches,
                                                        const std::vector<at::Tensor>& input_ids,
                                                        const std::vector<int64_t>& tap, bool croppable) const {
  c10::InferenceMode inference;
  const TargetModel::Impl& m = *model_.impl_;
  const ModelConfig& c = model_.config();
  const at::Device device = model_.options().device;
  if (caches.empty() || caches.size() != input_ids.size()) {
    throw std::invalid_argument("decode step: " + std::to_string(caches.size()) + " caches for " +
                                std::to_string(input_ids.size()) + " token lists");
  }
  // The tokens and their positions of all sequences, each in one copy to the device (a copy per
  // sequence waited for the stream each time).
  std::vector<at::Tensor> ids;
  std::vector<int64_t> counts, begins, positions;
  for (size_t s = 0; s < caches.size(); ++s) {
    DecodeCache& cache = *caches[s];
    if (cache.keys.size() != m.layers.size()) throw std::invalid_argument("decode step: the cache is not this model's");
    if (std::find(caches.begin(), caches.begin() + s, caches[s]) != caches.begin() + s) {
      throw std::invalid_argument("decode step: a cache appears twice in one step");
    }
    ids.push_back(input_ids[s].to(input_ids[0].device(), at::kLong).reshape({-1}));
    counts.push_back(ids.back().size(0));
    if (counts.back() == 0) throw std::invalid_argument("decode step: no tokens");
    begins.push_back(cache.length);
    for (int64_t p = cache.length; p < cache.length + counts.back(); ++p) positions.push_back(p);
  }
  const std::vector<RowGroup> groups = group_rows_by_count(counts, device);
  std::vector<at::Tensor> visible;
  for (const RowGroup& group : groups) visible.push_back(visible_keys(group, caches, device));
  const at::Tensor position_ids = at::tensor(positions, at::TensorOptions().dtype(at::kLong)).to(device);
  const auto [cos, sin] = rope_tables(m.inv_freq, position_ids, model_.options().dtype);

  ResidualStream stream(at::embedding(m.embed, at::cat(ids).to(device)), c);
  std::vector<at::Tensor> tapped;
  size_t next = 0;
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const Layer& layer = m.layers[i];
    const at::Tensor normed = stream.add_and_norm(layer.input_norm);
    stream.push(layer.kind == LayerKind::full_attention
                    ? attention_layer(c, layer.attention, normed, cos, sin, groups, visible, caches, i)
                    : gdn_layer(c, layer.gdn, normed, groups, caches, i, recurrent_step_tokens_, model_.gdn_kernels_,
                                croppable));
    stream.push(mlp_forward(c, layer.mlp, stream.add_and_norm(layer.post_attention_norm), model_.grouped_moe_));
    if (next < tap.size() && tap[next] == static_cast<int64_t>(i)) {
      tapped.push_back(stream.output());
      ++next;
    }
  }
  if (next != tap.size()) throw std::invalid_argument("decode step: tapped layers must ascend within the model's layers");
  const at::Tensor logits = at::matmul(stream.add_and_norm(m.final_norm), m.head.t()).to(at::kFloat);
  const at::Tensor features = tapped.empty() ? at::Tensor() : at::cat(tapped, -1);
  std::vector<DecodeOutput> out(caches.size());
  int64_t row = 0;
  for (size_t s = 0; s < caches.size(); ++s) {
    caches[s]->length = begins[s] + counts[s];
    caches[s]->last.begin = croppable ? begins[s] : caches[s]->length;
    caches[s]->last.count = croppable ? counts[s] : 0;
    if (!croppable) {
      for (DecodeCache::LastStep::Gdn& g : caches[s]->last.gdn) g = {};
    }
    out[s].logits = logits.narrow(0, row, counts[s]);
    if (features.defined()) out[s].features = features.narrow(0, row, counts[s]);
    row += counts[s];
  }
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
    last = std::move(step_batch({&cache}, {ids.narrow(0, begin, std::min(chunk, ids.size(0) - begin))}, tap,
                                /*croppable=*/false)[0]);
    if (last.features.defined()) features.push_back(last.features);
  }
  DecodeOutput out;
  out.logits = last.logits.narrow(0, last.logits.size(0) - 1, 1);
  if (!features.empty()) out.features = features.size() == 1 ? features[0] : at::cat(features, 0);
  return out;
}

void IncrementalTarget::crop(DecodeCache& cache, int64_t length) const { crop_batch({&cache}, {length}); }

void IncrementalTarget::crop_batch(const std::vector<DecodeCache*>& caches, const std::vector<int64_t>& lengths) const {
  c10::InferenceMode inference;
  if (caches.size() != lengths.size()) throw std::invalid_argument("decode crop: one length per cache");
  // Caches that keep fewer tokens than their last step ran, grouped by the tokens they keep.
  std::map<int64_t, std::vector<size_t>> by_kept;
  for (size_t s = 0; s < caches.size(); ++s) {
    const DecodeCache::LastStep& last = caches[s]->last;
    if (lengths[s] < last.begin || lengths[s] > last.begin + last.count) {
      throw std::invalid_argument("decode crop: length " + std::to_string(lengths[s]) + " is outside the last step [" +
                                  std::to_string(last.begin) + ", " + std::to_string(last.begin + last.count) + "]");
    }
    if (lengths[s] - last.begin < last.count) by_kept[lengths[s] - last.begin].push_back(s);
  }
  for (const auto& [keep, members] : by_kept) {
    for (size_t i = 0; i < model_.impl_->layers.size(); ++i) {
      if (!caches[members[0]]->last.gdn[i].window.defined()) continue;  // full attention: rows past `length` are ignored
      std::vector<at::Tensor> states, q, k, v, g, beta;
      for (size_t s : members) {
        DecodeCache& cache = *caches[s];
        DecodeCache::LastStep::Gdn& last = cache.last.gdn[i];
        const int64_t kernel_minus_1 = last.window.size(0) - cache.last.count;
        cache.conv[i] = last.window.narrow(0, keep, kernel_minus_1);  // a view: the group's window stays alive
        last.window = last.window.narrow(0, 0, kernel_minus_1 + keep);
        last.q = last.q.narrow(0, 0, keep), last.k = last.k.narrow(0, 0, keep), last.v = last.v.narrow(0, 0, keep);
        last.g = last.g.narrow(0, 0, keep), last.beta = last.beta.narrow(0, 0, keep);
        states.push_back(last.state_before);
        q.push_back(last.q), k.push_back(last.k), v.push_back(last.v), g.push_back(last.g), beta.push_back(last.beta);
      }
      at::Tensor kept = restacked(states);
      if (keep > 0) {
        run_rule_group(restacked(q), restacked(k), restacked(v), restacked(g), restacked(beta), &kept, recurrent_step_tokens_,
                       model_.gdn_kernels_);
      }
      for (size_t j = 0; j < members.size(); ++j) caches[members[j]]->state[i] = kept[static_cast<int64_t>(j)];
    }
  }
  for (size_t s = 0; s < caches.size(); ++s) {
    caches[s]->last.count = lengths[s] - caches[s]->last.begin;
    caches[s]->length = lengths[s];
  }
}

}  // namespace dflash::target
