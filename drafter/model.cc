#include "drafter/model.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/InferenceMode.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <map>
#include <optional>
#include <stdexcept>

#include "common/flash_attention.h"
#include "common/safetensors.h"
#include "common/tensor_math.h"
#include "drafter/layer_ops.h"
#include "drafter/tensor_io.h"

namespace dflash::drafter {
namespace {

// The rotary embedding's cos and sin at `positions` ([tokens] int64), [tokens, 1, d] in dtype:
// computed once per forward and shared by every layer's q, block k and context k.
struct RopeTables {
  at::Tensor cos, sin;
};
RopeTables rope_tables(const at::Tensor& positions, int64_t d, double theta, at::ScalarType dtype, at::Device device) {
  const at::Tensor inv_freq =
      1.0 / at::pow(theta, at::arange(0, d, 2, at::TensorOptions().dtype(at::kLong)).to(at::kFloat) / static_cast<double>(d))
                .to(device);
  const at::Tensor freqs = to_device_async(positions, device).to(at::kFloat).unsqueeze(1) * inv_freq.unsqueeze(0);
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  return {emb.cos().to(dtype).unsqueeze(1), emb.sin().to(dtype).unsqueeze(1)};
}

// x [tokens, heads, d].
at::Tensor apply_rope(const at::Tensor& x, const RopeTables& t) { return trained_rope(x, t.cos, t.sin); }

std::string layer_key(int64_t i, const char* rest) { return "layers." + std::to_string(i) + "." + rest; }

}  // namespace

at::Tensor block_token_ids(const at::Tensor& sequence_ids, const at::Tensor& anchors, int64_t block_size,
                           int64_t mask_token_id) {
  const int64_t blocks = anchors.size(0);
  at::Tensor ids = at::full({blocks, block_size}, mask_token_id, sequence_ids.options());
  if (blocks > 0) ids.select(1, 0).copy_(sequence_ids.index_select(0, anchors.to(sequence_ids.device())));
  return ids.reshape({-1});
}

at::Tensor block_positions(const at::Tensor& anchors, int64_t block_size) {
  return (anchors.unsqueeze(1) + at::arange(block_size, anchors.options()).unsqueeze(0)).reshape({-1});
}

Drafter::Drafter(DrafterShape shape, at::TensorOptions options) : shape_(std::move(shape)), options_(options) {
  const DrafterShape& s = shape_;
  const int64_t h = s.hidden_size, d = s.head_dim;
  // Each parameter under its export name (docs/recipe.md), in a fixed order.
  auto add = [&](const std::string& name, std::vector<int64_t> dims) -> at::Tensor {
    parameters_.emplace_back(name, at::empty(dims, options).requires_grad_(true));
    return parameters_.back().second;
  };
  fc_ = add("fc.weight", {h, s.num_features() * h});
  hidden_norm_ = add("hidden_norm.weight", {h});
  for (int64_t i = 0; i < s.num_layers; ++i) {
    Layer l;
    l.input_norm = add(layer_key(i, "input_layernorm.weight"), {h});
    l.post_attention_norm = add(layer_key(i, "post_attention_layernorm.weight"), {h});
    l.q_proj = add(layer_key(i, "self_attn.q_proj.weight"), {s.num_attention_heads * d, h});
    l.k_proj = add(layer_key(i, "self_attn.k_proj.weight"), {s.num_key_value_heads * d, h});
    l.v_proj = add(layer_key(i, "self_attn.v_proj.weight"), {s.num_key_value_heads * d, h});
    l.o_proj = add(layer_key(i, "self_attn.o_proj.weight"), {h, s.num_attention_heads * d});
    l.q_norm = add(layer_key(i, "self_attn.q_norm.weight"), {d});
    l.k_norm = add(layer_key(i, "self_attn.k_norm.weight"), {d});
    l.gate_proj = add(layer_key(i, "mlp.gate_proj.weight"), {s.intermediate_size, h});
    l.up_proj = add(layer_key(i, "mlp.up_proj.weight"), {s.intermediate_size, h});
    l.down_proj = add(layer_key(i, "mlp.down_proj.weight"), {h, s.intermediate_size});
    layers_.push_back(std::move(l));
  }
  norm_ = add("norm.weight", {h});
}

void Drafter::init_random(uint64_t seed) {
  c10::NoGradGuard no_grad;
  at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  for (auto& [name, t] : parameters_) {
    if (t.dim() == 1) {
      t.fill_(1.0);
    } else {
      t.copy_(at::empty(t.sizes(), at::TensorOptions().dtype(at::kFloat)).normal_(0, 0.02, generator));
    }
  }
}

void Drafter::load_tensors(const std::vector<std::pair<std::string, at::Tensor>>& tensors, const std::string& source) {
  c10::NoGradGuard no_grad;
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name[n] = &t;
  for (auto& [name, p] : parameters_) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw std::runtime_error(source + ": missing drafter tensor '" + name + "'");
    if (it->second->sizes() != p.sizes()) {
      throw std::runtime_error(source + ": drafter tensor '" + name + "' has shape " +
                               c10::str(it->second->sizes()) + ", expected " + c10::str(p.sizes()));
    }
    p.copy_(*it->second);
  }
}

void Drafter::load_export(const std::string& dir) {
  check_drafter_init(dir, shape_);
  NamedTensors tensors = read_named_tensors(dir + "/model.safetensors");
  for (auto& [name, t] : tensors) t = t.to(options_.device(), options_.dtype().toScalarType());
  load_tensors(tensors, dir + "/model.safetensors");
}

void write_export(const std::string& dir, const DrafterShape& shape,
                  const std::vector<std::pair<std::string, at::Tensor>>& weights) {
  make_directories(dir);
  write_named_tensors(dir + "/model.safetensors", weights, at::kBFloat16, {{"format", "pt"}});
  write_file_atomically(dir + "/config.json", export_config_json(shape));
}

void Drafter::save_export(const std::string& dir) const { write_export(dir, shape_, parameters_); }

struct Drafter::LayerInputs {
  RopeTables block_rope, context_rope;
  std::vector<int64_t> cu_seqlens, block_rows;  // the batch's sequences in tokens, in block rows
  std::vector<at::Tensor> anchors;              // per sequence
  BlockAttentionShape attention;
};

at::Tensor Drafter::layer_forward(int64_t i, const at::Tensor& x_in, const at::Tensor& context,
                                  const LayerInputs& in) const {
  const DrafterShape& s = shape_;
  const int64_t hq = s.num_attention_heads, hkv = s.num_key_value_heads, d = s.head_dim;
  const Layer& l = layers_[i];
  const at::Tensor h = trained_rms_norm(x_in, l.input_norm, s.rms_norm_eps);
  const int64_t rows = h.size(0), tokens = context.size(0);
  const at::Tensor q =
      apply_rope(trained_rms_norm(at::linear(h, l.q_proj).view({rows, hq, d}), l.q_norm, s.rms_norm_eps), in.block_rope);
  const at::Tensor k_block =
      apply_rope(trained_rms_norm(at::linear(h, l.k_proj).view({rows, hkv, d}), l.k_norm, s.rms_norm_eps), in.block_rope);
  const at::Tensor v_block = at::linear(h, l.v_proj).view({rows, hkv, d});
  const at::Tensor k_context = apply_rope(
      trained_rms_norm(at::linear(context, l.k_proj).view({tokens, hkv, d}), l.k_norm, s.rms_norm_eps), in.context_rope);
  const at::Tensor v_context = at::linear(context, l.v_proj).view({tokens, hkv, d});
  std::vector<at::Tensor> attended;
  for (size_t q_index = 0; q_index + 1 < in.cu_seqlens.size(); ++q_index) {
    const int64_t begin = in.cu_seqlens[q_index], length = in.cu_seqlens[q_index + 1] - begin;
    const int64_t row0 = in.block_rows[q_index], nrows = in.block_rows[q_index + 1] - row0;
    if (nrows == 0) continue;
    attended.push_back(block_attention(q.narrow(0, row0, nrows), k_context.narrow(0, begin, length),
                                       v_context.narrow(0, begin, length), k_block.narrow(0, row0, nrows),
                                       v_block.narrow(0, row0, nrows), in.anchors[q_index], in.attention));
  }
  const at::Tensor attention = at::cat(attended).reshape({rows, hq * d});
  const at::Tensor x = x_in + at::linear(attention, l.o_proj);
  const at::Tensor m = trained_rms_norm(x, l.post_attention_norm, s.rms_norm_eps);
  return x + at::linear(trained_silu_mul(at::linear(m, l.gate_proj), at::linear(m, l.up_proj)), l.down_proj);
}

// One drafter layer under activation checkpointing: forward runs it without recording anything
// and keeps its inputs; backward runs it again with autograd and backpropagates the output's
// gradient through it (into the layer's parameters' .grad, and out as the gradients of x and the
// context). The layer's other inputs (rotary tables, packing, attention shape) are kept beside,
// as tensors and integers; the drafter outlives the step's backward.
class CheckpointedLayer : public torch::autograd::Function<CheckpointedLayer> {
 public:
  using AutogradContext = torch::autograd::AutogradContext;
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& context, const Drafter* drafter,
                            int64_t layer, const Drafter::LayerInputs& in) {
    ctx->save_for_backward({x, context});
    auto& data = ctx->saved_data;
    data["drafter"] = static_cast<int64_t>(reinterpret_cast<intptr_t>(drafter));
    data["layer"] = layer;
    data["rope"] = std::vector<at::Tensor>{in.block_rope.cos, in.block_rope.sin, in.context_rope.cos, in.context_rope.sin};
    data["cu_seqlens"] = in.cu_seqlens;
    data["block_rows"] = in.block_rows;
    data["anchors"] = in.anchors;
    data["attention"] = std::vector<int64_t>{in.attention.block_size, in.attention.group_blocks,
                                             static_cast<int64_t>(in.attention.path), in.attention.sliding_window};
    data["scale"] = in.attention.scale;
    return drafter->layer_forward(layer, x, context, in);
  }

  static torch::autograd::variable_list backward(AutogradContext* ctx, torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    auto& data = ctx->saved_data;
    const auto* drafter = reinterpret_cast<const Drafter*>(static_cast<intptr_t>(data["drafter"].toInt()));
    Drafter::LayerInputs in;
    const std::vector<at::Tensor> rope = data["rope"].toTensorVector();
    in.block_rope = {rope[0], rope[1]};
    in.context_rope = {rope[2], rope[3]};
    in.cu_seqlens = data["cu_seqlens"].toIntVector();
    in.block_rows = data["block_rows"].toIntVector();
    in.anchors = data["anchors"].toTensorVector();
    const std::vector<int64_t> attention = data["attention"].toIntVector();
    in.attention = BlockAttentionShape{attention[0], attention[1], data["scale"].toDouble(),
                                       static_cast<BlockAttentionPath>(attention[2]), attention[3]};
    const at::Tensor x = saved[0].detach().requires_grad_(ctx->needs_input_grad(0));
    const at::Tensor context = saved[1].detach().requires_grad_(ctx->needs_input_grad(1));
    {
      const c10::AutoGradMode recording(true);
      const at::Tensor out = drafter->layer_forward(data["layer"].toInt(), x, context, in);
      torch::autograd::backward({out}, {grads[0]});
    }
    return {x.requires_grad() ? x.grad() : at::Tensor(), context.requires_grad() ? context.grad() : at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor Drafter::forward(const DrafterBatch& batch, const at::Tensor& embed, int64_t group_blocks) const {
  const DrafterShape& s = shape_;
  const int64_t d = s.head_dim;
  const int64_t sequences = static_cast<int64_t>(batch.cu_seqlens.size()) - 1;
  const at::Device device = batch.input_ids.device();
  // Per sequence: block ids, block positions, context positions; all sequences packed.
  std::vector<at::Tensor> ids, block_pos, context_pos;
  std::vector<int64_t> block_rows{0};
  for (int64_t q = 0; q < sequences; ++q) {
    const int64_t begin = batch.cu_seqlens[q], length = batch.cu_seqlens[q + 1] - begin;
    const at::Tensor& anchors = batch.anchors[q];
    ids.push_back(block_token_ids(batch.input_ids.narrow(0, begin, length), anchors, s.block_size, s.mask_token_id));
    block_pos.push_back(block_positions(anchors, s.block_size));
    context_pos.push_back(at::arange(length, at::TensorOptions().dtype(at::kLong)));
    block_rows.push_back(block_rows.back() + anchors.size(0) * s.block_size);
  }
  if (block_rows.back() == 0) return at::zeros({0, s.hidden_size}, options_);
  const at::Tensor all_block_pos = at::cat(block_pos).to(device);
  const at::Tensor all_context_pos = at::cat(context_pos).to(device);

  // Fused target context, once per sequence: hidden_norm(fc(concat(h_ids ascending))).
  const at::Tensor context =
      trained_rms_norm(at::linear(batch.features.to(options_.dtype()), fc_), hidden_norm_, s.rms_norm_eps);
  at::Tensor x;
  {
    c10::NoGradGuard frozen;  // the target's embedding is frozen
    x = at::embedding(embed, at::cat(ids)).to(options_.dtype());
  }
  LayerInputs in;
  in.attention = BlockAttentionShape{s.block_size, group_blocks, 0, attention_path_};
  const at::ScalarType dtype = options_.dtype().toScalarType();
  in.block_rope = rope_tables(all_block_pos, d, s.rope_theta, dtype, device);
  in.context_rope = rope_tables(all_context_pos, d, s.rope_theta, dtype, device);
  in.cu_seqlens = batch.cu_seqlens;
  in.block_rows = block_rows;
  in.anchors = batch.anchors;
  const bool checkpoint = checkpoint_layers_ && at::GradMode::is_enabled();
  for (int64_t i = 0; i < s.num_layers; ++i) {
    in.attention.sliding_window = s.window_of(i);
    x = checkpoint ? CheckpointedLayer::apply(x, context, this, i, in) : layer_forward(i, x, context, in);
  }
  return trained_rms_norm(x, norm_, s.rms_norm_eps);
}

void Drafter::extend_context(DrafterContextCache& cache, const at::Tensor& features) const {
  extend_contexts({&cache}, {features});
}

void Drafter::extend_contexts(const std::vector<DrafterContextCache*>& caches,
                              const std::vector<at::Tensor>& features) const {
  c10::InferenceMode inference;
  const DrafterShape& s = shape_;
  const int64_t hkv = s.num_key_value_heads, d = s.head_dim;
  const at::Device device = options_.device();
  if (caches.size() != features.size()) throw std::invalid_argument("drafter context: one feature block per cache");
  std::vector<at::Tensor> parts, positions;
  for (size_t j = 0; j < caches.size(); ++j) {
    caches[j]->keys.resize(static_cast<size_t>(s.num_layers));
    caches[j]->values.resize(static_cast<size_t>(s.num_layers));
    if (features[j].size(0) == 0) continue;
    parts.push_back(features[j].to(device, options_.dtype().toScalarType()));
    positions.push_back(at::arange(caches[j]->length, caches[j]->length + features[j].size(0),
                                   at::TensorOptions().dtype(at::kLong)));
  }
  if (parts.empty()) return;
  const at::Tensor context = trained_rms_norm(at::linear(at::cat(parts), fc_), hidden_norm_, s.rms_norm_eps);
  const int64_t n = context.size(0);
  const RopeTables rope = rope_tables(at::cat(positions), d, s.rope_theta, options_.dtype().toScalarType(), device);
  // Every layer's rows go into every cache in one multi-tensor copy (copy_all): a copy per cache
  // and layer was two launches per sequence and layer.
  std::vector<at::Tensor> into, from;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const Layer& l = layers_[i];
    const at::Tensor k = apply_rope(trained_rms_norm(at::linear(context, l.k_proj).view({n, hkv, d}), l.k_norm, s.rms_norm_eps), rope);
    const at::Tensor v = at::linear(context, l.v_proj).view({n, hkv, d});
    int64_t row = 0;
    for (size_t j = 0; j < caches.size(); ++j) {
      DrafterContextCache& cache = *caches[j];
      const int64_t count = features[j].size(0), begin = cache.length;
      if (count == 0) continue;
      cache.keys[i] = with_rows(cache.keys[i], begin, begin + count, {hkv, d}, k.options());
      cache.values[i] = with_rows(cache.values[i], begin, begin + count, {hkv, d}, v.options());
      into.push_back(cache.keys[i].narrow(0, begin, count)), from.push_back(k.narrow(0, row, count));
      into.push_back(cache.values[i].narrow(0, begin, count)), from.push_back(v.narrow(0, row, count));
      row += count;
    }
  }
  copy_all(into, from);
  for (size_t j = 0; j < caches.size(); ++j) caches[j]->length += features[j].size(0);
}

at::Tensor Drafter::block_hidden(const DrafterContextCache& cache, const at::Tensor& block_ids, const at::Tensor& embed) const {
  return block_hiddens({&cache}, {block_ids}, embed)[0];
}

namespace {

// Whether block_hiddens' attention runs FlashAttention's variable-length kernel: where it runs
// (common/flash_attention.h), unless the math path was asked for (then the padded, masked SDPA of
// block_attention_group: the portable reference). The kernel reads each sequence's keys packed
// one after another, with no mask to build and no padding, in one launch per layer.
bool flash_blocks_apply(const at::TensorOptions& options, int64_t head_dim, BlockAttentionPath path) {
  return path != BlockAttentionPath::math && flash_attention_runs(options, head_dim);
}

// Where FlashAttention finds a block_hiddens call's rows: sequence j's queries are rows
// cu_q[j] .. cu_q[j + 1] - 1 (its block), its keys rows cu_k[j] .. (its cached context, then its
// block), one packed tensor per layer. Built once per call (int32 on the device).
struct PackedBlocks {
  at::Tensor cu_q, cu_k;
  int64_t max_q = 0, max_k = 0;
};
PackedBlocks packed_blocks(const std::vector<const DrafterContextCache*>& caches, const std::vector<int64_t>& counts,
                           const at::Device& device) {
  PackedBlocks p;
  std::vector<int32_t> cu_q{0}, cu_k{0};
  for (size_t j = 0; j < caches.size(); ++j) {
    const int64_t keys = caches[j]->length + counts[j];
    cu_q.push_back(cu_q.back() + static_cast<int32_t>(counts[j]));
    cu_k.push_back(cu_k.back() + static_cast<int32_t>(keys));
    p.max_q = std::max(p.max_q, counts[j]);
    p.max_k = std::max(p.max_k, keys);
  }
  std::vector<int32_t> both = cu_q;
  both.insert(both.end(), cu_k.begin(), cu_k.end());
  const at::Tensor on_device = values_on(both, at::kInt, device);
  p.cu_q = on_device.narrow(0, 0, static_cast<int64_t>(cu_q.size()));
  p.cu_k = on_device.narrow(0, static_cast<int64_t>(cu_q.size()), static_cast<int64_t>(cu_k.size()));
  return p;
}

// Attention of every block in layer `layer` ([total, Hq, d], the blocks' rows in order) on
// FlashAttention's kernel, with the semantics of block_attention_group: a full layer's rows see
// the whole cached context and the whole block (not causal); a sliding layer's row r (position
// p = context + r) sees keys > p - window up to its own (causal, aligned to the last key, with a
// window of window - 1 keys before the query's own; its block's rows 0..r all lie inside it
// when the window holds the block, which block_hiddens checks).
at::Tensor flash_block_attention(const DrafterShape& s, const std::vector<const DrafterContextCache*>& caches,
                                 const std::vector<int64_t>& counts, const PackedBlocks& p, int64_t layer,
                                 const at::Tensor& q, const at::Tensor& k_block, const at::Tensor& v_block) {
  std::vector<at::Tensor> keys, values;
  for (int64_t j = 0, row = 0; j < static_cast<int64_t>(caches.size()); row += counts[j], ++j) {
    const DrafterContextCache& cache = *caches[j];
    if (cache.length > 0) {
      keys.push_back(cache.keys[layer].narrow(0, 0, cache.length));
      values.push_back(cache.values[layer].narrow(0, 0, cache.length));
    }
    keys.push_back(k_block.narrow(0, row, counts[j]));
    values.push_back(v_block.narrow(0, row, counts[j]));
  }
  const int64_t window = s.window_of(layer);
  const std::optional<int64_t> left = window > 0 ? std::optional<int64_t>(window - 1) : std::nullopt;
  const std::optional<int64_t> right = window > 0 ? std::optional<int64_t>(0) : std::nullopt;
  return std::get<0>(at::_flash_attention_forward(
      q.contiguous(), at::cat(keys), at::cat(values), p.cu_q, p.cu_k, p.max_q, p.max_k, 0.0, /*is_causal=*/window > 0,
      /*return_debug_mask=*/false, 1.0 / std::sqrt(static_cast<double>(s.head_dim)), left, right));
}

// Attention of a group's blocks in layer `layer` ([members * rows, Hq, d], member-major): every
// row of a block sees its sequence's cached context and its whole block (no mask within); in a
// sliding layer (window > 0) row r at position p sees context positions > p - window and block
// rows 0..r, as training does. With several members the keys are padded to the longest and the
// padding masked.
at::Tensor block_attention_group(const DrafterShape& s, const std::vector<const DrafterContextCache*>& caches,
                                 const RowGroup& g, int64_t layer, const at::Tensor& q, const at::Tensor& k_block,
                                 const at::Tensor& v_block) {
  const int64_t window = s.window_of(layer);
  const int64_t hq = s.num_attention_heads, d = s.head_dim, rows = g.count;
  const int64_t size = static_cast<int64_t>(g.members.size());
  std::vector<at::Tensor> keys, values;
  int64_t longest = 0;
  for (size_t m = 0; m < g.members.size(); ++m) {
    const DrafterContextCache& cache = *caches[g.members[m]];
    at::Tensor k = k_block.narrow(0, g.first[m], rows), v = v_block.narrow(0, g.first[m], rows);
    if (cache.length > 0) {
      k = at::cat({cache.keys[layer].narrow(0, 0, cache.length), k});
      v = at::cat({cache.values[layer].narrow(0, 0, cache.length), v});
    }
    keys.push_back(k);
    values.push_back(v);
    longest = std::max(longest, k.size(0));
  }
  at::Tensor mask;
  if (size > 1 || window > 0) {
    // Per member [rows, longest]: key index c < context (a context position) or a block row.
    std::vector<int64_t> contexts;
    for (size_t j : g.members) contexts.push_back(caches[j]->length);
    const auto long_options = at::TensorOptions().dtype(at::kLong);
    const at::Tensor context = at::tensor(contexts, long_options).view({size, 1, 1});
    const at::Tensor key = at::arange(longest, long_options).view({1, 1, longest});
    const at::Tensor row = at::arange(rows, long_options).view({1, rows, 1});
    at::Tensor visible = key < context + rows;  // the member's keys, not the padding
    if (window > 0) {
      const at::Tensor in_block = key >= context;
      visible = visible & at::where(in_block, key - context <= row, key > context + row - window);
    }
    mask = to_device_async(visible.unsqueeze(1), q.device());  // [G, 1, rows, longest]
  }
  const at::Tensor o = at::scaled_dot_product_attention(
      q.index_select(0, g.rows).view({size, rows, hq, d}).transpose(1, 2), padded_heads_first(keys, longest),
      padded_heads_first(values, longest),
      mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt, 0.0,
      false, 1.0 / std::sqrt(static_cast<double>(d)), /*enable_gqa=*/true);
  return o.transpose(1, 2).reshape({size * rows, hq, d});
}

}  // namespace

std::vector<at::Tensor> Drafter::block_hiddens(const std::vector<const DrafterContextCache*>& caches,
                                               const std::vector<at::Tensor>& block_ids, const at::Tensor& embed) const {
  c10::InferenceMode inference;
  const DrafterShape& s = shape_;
  const int64_t hq = s.num_attention_heads, hkv = s.num_key_value_heads, d = s.head_dim;
  const at::Device device = options_.device();
  const at::ScalarType dtype = options_.dtype().toScalarType();
  if (caches.empty() || caches.size() != block_ids.size()) throw std::invalid_argument("drafter block: one block per cache");
  std::vector<at::Tensor> ids, positions;
  std::vector<int64_t> counts;
  int64_t total = 0;
  bool on_host = true;
  for (size_t j = 0; j < caches.size(); ++j) {
    ids.push_back(block_ids[j].to(at::kLong).reshape({-1}));
    on_host = on_host && ids.back().is_cpu();
    const int64_t rows = ids.back().size(0), begin = caches[j]->length;
    positions.push_back(at::arange(begin, begin + rows, at::TensorOptions().dtype(at::kLong)));
    counts.push_back(rows);
    total += rows;
  }
  // The ids in one copy that does not wait for the device (one per block made the host wait at each).
  if (!on_host) {
    for (at::Tensor& t : ids) t = t.to(device);
  }
  const at::Tensor all_ids = on_host ? to_device_async(at::cat(ids), device) : at::cat(ids);
  // A sliding window shorter than a block (a config.json from elsewhere may say so; ours refuses
  // it) would hide a block's first rows from its last on FlashAttention's window, where they see
  // the whole block up to themselves: such a drafter keeps the padded path's mask.
  const int64_t longest_block = *std::max_element(counts.begin(), counts.end());
  bool windows_hold_blocks = true;
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const int64_t window = s.window_of(i);
    windows_hold_blocks = windows_hold_blocks && (window == 0 || window >= longest_block);
  }
  const bool flash = windows_hold_blocks && flash_blocks_apply(options_, d, attention_path_);
  const PackedBlocks packed = flash ? packed_blocks(caches, counts, device) : PackedBlocks{};
  const std::vector<RowGroup> groups = flash ? std::vector<RowGroup>{} : group_rows_by_count(counts, device);
  const RopeTables rope = rope_tables(at::cat(positions), d, s.rope_theta, dtype, device);
  at::Tensor x = at::embedding(embed, all_ids).to(dtype);
  for (int64_t i = 0; i < s.num_layers; ++i) {
    const Layer& l = layers_[i];
    const at::Tensor h = trained_rms_norm(x, l.input_norm, s.rms_norm_eps);
    const at::Tensor q = apply_rope(trained_rms_norm(at::linear(h, l.q_proj).view({total, hq, d}), l.q_norm, s.rms_norm_eps), rope);
    const at::Tensor k_block =
        apply_rope(trained_rms_norm(at::linear(h, l.k_proj).view({total, hkv, d}), l.k_norm, s.rms_norm_eps), rope);
    const at::Tensor v_block = at::linear(h, l.v_proj).view({total, hkv, d});
    at::Tensor attention;
    if (flash) {
      attention = flash_block_attention(s, caches, counts, packed, i, q, k_block, v_block);
    } else {
      attention = at::empty({total, hq, d}, q.options());
      for (const RowGroup& g : groups) {
        attention.index_copy_(0, g.rows, block_attention_group(s, caches, g, i, q, k_block, v_block));
      }
    }
    x = x + at::linear(attention.view({total, hq * d}), l.o_proj);
    const at::Tensor m = trained_rms_norm(x, l.post_attention_norm, s.rms_norm_eps);
    x = x + at::linear(trained_silu_mul(at::linear(m, l.gate_proj), at::linear(m, l.up_proj)), l.down_proj);
  }
  const at::Tensor hidden = trained_rms_norm(x, norm_, s.rms_norm_eps);
  std::vector<at::Tensor> out;
  for (int64_t j = 0, row = 0; j < static_cast<int64_t>(caches.size()); row += counts[j], ++j) {
    out.push_back(hidden.narrow(0, row, counts[j]));
  }
  return out;
}

}  // namespace dflash::drafter
