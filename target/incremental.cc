#include "target/incremental.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "target/kernels/decode_attention.h"
#include "target/kernels/gated_delta_net.h"
#endif

#include <algorithm>
#include <cmath>
#include <functional>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/flash_attention.h"
#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"
#include "target/gdn_cuda.h"
#include "target/kernels/gdn_log.h"
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

// Where a group's members' rows lie in the batch tensors they share (a GatedDeltaNet layer's
// StageCache state and conv, or last_gdn for a crop; an attention layer's keys and values): runs of
// members reading one batch tensor, each run a slice of consecutive rows or an index on the
// device. The same for every layer of a kind (a step or a crop updates all of a cache's layers
// together): built once per step from one layer, so a step of the same sequences as the last
// reads each layer's batch as it is, and one after a sequence left slices it, with no op per
// sequence.
class RowGather {
 public:
  RowGather() = default;
  // sources[j]: member j's batch tensor in one layer, slots[j] its row there.
  RowGather(const std::vector<const at::Tensor*>& sources, const std::vector<int64_t>& slots, at::Device device) {
    for (size_t j = 0; j < sources.size();) {
      Run r;
      r.begin = j;
      std::vector<int64_t> rows;
      for (; j < sources.size() && sources[j]->unsafeGetTensorImpl() == sources[r.begin]->unsafeGetTensorImpl(); ++j) {
        rows.push_back(slots[j]);
      }
      r.end = j;
      r.first = rows[0];
      for (size_t i = 1; i < rows.size(); ++i) r.consecutive = r.consecutive && rows[i] == rows[0] + static_cast<int64_t>(i);
      if (!r.consecutive) r.index = values_on(rows, at::kLong, device);
      runs_.push_back(std::move(r));
    }
    whole_ = runs_.size() == 1 && runs_[0].consecutive && runs_[0].first == 0 &&
             sources[0]->size(0) == static_cast<int64_t>(sources.size());
  }

  // Whether the members are their batch's rows, in order (the sequences of the last step).
  bool whole() const { return whole_; }
  // Whether gather returns a view of one batch tensor (consecutive rows of it), not a copy.
  bool views() const { return runs_.size() == 1 && runs_[0].consecutive; }

  // The members' rows [G, ...] of one layer's batch tensors (laid out as the plan's layer), each
  // batch first seen through `view` when given (a crop's kept tokens: batches of steps of
  // different lengths then agree).
  using View = std::function<at::Tensor(const at::Tensor&)>;
  at::Tensor gather(const std::vector<const at::Tensor*>& sources, const View& view = nullptr) const {
    expect_planned_layout(sources);
    if (whole_) return view ? view(*sources[0]) : *sources[0];
    std::vector<at::Tensor> parts;
    for (const Run& r : runs_) parts.push_back(rows_of(r, view ? view(*sources[r.begin]) : *sources[r.begin]));
    return parts.size() == 1 ? parts[0] : at::cat(parts);
  }

  // Copies the members' rows of `sources` into `dst` ([G, ...]: member j at row j), each run's
  // rows cut to `length` along dimension 1 (an attention batch's held positions).
  void copy_into(const at::Tensor& dst, const std::vector<const at::Tensor*>& sources, int64_t length) const {
    expect_planned_layout(sources);
    for (const Run& r : runs_) {
      const int64_t l = std::min(length, sources[r.begin]->size(1));
      dst.narrow(0, static_cast<int64_t>(r.begin), static_cast<int64_t>(r.end - r.begin))
          .narrow(1, 0, l)
          .copy_(rows_of(r, sources[r.begin]->narrow(1, 0, l)));
    }
  }

 private:
  struct Run {
    size_t begin = 0, end = 0;  // members [begin, end) read one batch tensor
    int64_t first = 0;          // their rows first .. first + (end - begin) - 1 when consecutive
    bool consecutive = true;
    at::Tensor index;           // else their rows, int64 on the device
  };

  at::Tensor rows_of(const Run& r, const at::Tensor& t) const {
    return r.consecutive ? t.narrow(0, r.first, static_cast<int64_t>(r.end - r.begin)) : t.index_select(0, r.index);
  }
  // Every layer of a cache moves together (a step or a crop updates all of them), so each layer's
  // batches lie as the plan's layer's; anything else is a bug in this file.
  void expect_planned_layout(const std::vector<const at::Tensor*>& sources) const {
    for (const Run& r : runs_) {
      for (size_t j = r.begin + 1; j < r.end; ++j) {
        if (sources[j]->unsafeGetTensorImpl() != sources[r.begin]->unsafeGetTensorImpl()) {
          throw std::logic_error("decoding caches: a layer's batches are not laid out as the step's plan");
        }
      }
    }
  }

  std::vector<Run> runs_;
  bool whole_ = false;  // the members are the batch, in order
};

// A group's rows of a step's token-wise tensor t [tokens, ...]: t itself when the group holds
// every row (the step's only group: its rows are all rows, in order), else gathered; and the
// reverse, the group's rows written into out (for the only group, out becomes its rows when they
// are dense and of out's dtype: no copy).
bool holds_every_row(const RowGroup& group, const at::Tensor& t) {
  return static_cast<int64_t>(group.members.size()) * group.count == t.size(0);
}
at::Tensor group_rows(const RowGroup& group, const at::Tensor& t) {
  return holds_every_row(group, t) ? t : t.index_select(0, group.rows);
}
void put_group_rows(const RowGroup& group, at::Tensor& out, const at::Tensor& rows) {
  if (holds_every_row(group, out)) {
    const bool as_they_are =
        rows.scalar_type() == out.scalar_type() && rows.is_contiguous() && rows.numel() == out.numel();
    out = as_they_are ? rows.view(out.sizes()) : out.copy_(rows.reshape(out.sizes()));
  } else {
    out.index_copy_(0, group.rows, rows);
  }
}

// A group's step in the attention layers, the same in each: where its members' keys and values
// lie (`rows`, from the first attention layer), how many positions they hold and will hold, where
// the step's keys go (positions `begin` .. of every row when the members start alike, else
// (row, position) pairs on the device), and which keys each query sees. All built once per step:
// building the mask per layer made the host wait for the GPU at each of them (a copy from host
// memory).
struct KvStep {
  RowGather rows;
  int64_t held = 0, longest = 0;  // the longest member before and after the step
  bool same_begin = true;
  int64_t begin = 0;
  at::Tensor append_rows, append_positions;  // int64 [G * n] when !same_begin
  // Without flash: [G, 1, n, longest] bool, key positions up to the query's own, in its own
  // sequence; the rest is another member's length or the batch's unused capacity.
  at::Tensor visible;
  // With flash: int32 on the device, member j's queries start at cu_q[j] = j * n ([G + 1]), and
  // it holds used_k[j] keys after the step ([G]); each query sees its own sequence's keys up to
  // its position (causal, aligned to the last key).
  bool flash = false;
  at::Tensor cu_q, used_k;
  // In place (flash, a step that keeps nothing for a crop, members not the last step's batch in
  // order): the members' keys and values stay in the batch most of them share, each in its row
  // (in_place_rows[j]; a sequence that left leaves its row unused), and a joining member's are
  // copied into a row no live cache holds (joins: member, its row in its own batch, its
  // positions). Nothing else moves: regathering every cache into a new batch cost more than the
  // step itself.
  struct Join {
    size_t member;
    int64_t own_row, held;
  };
  bool in_place = false;
  size_t shared_member = 0;  // a member whose batch is the shared one
  std::vector<int64_t> in_place_rows;
  std::vector<Join> joins;
  at::Tensor key_rows;  // int32 [G + 1] on the device: rows, then one past the largest
};

// Plans a step's keys and values in place (KvStep::in_place) when the batch most members share
// has room for every member's positions in every attention layer and, if members join, rows
// that no live cache holds (its holders are exactly its members: its use count says so). Leaves
// `step` as it was otherwise.
void plan_in_place(const RowGroup& group, const std::vector<StageCache*>& caches, const std::vector<int64_t>& lengths,
                   const std::vector<size_t>& attention_layers, const std::vector<int64_t>& slots, KvStep& step) {
  const size_t size = group.members.size();
  auto keys_of = [&](size_t j, size_t layer) -> const at::Tensor& { return caches[group.members[j]]->keys[layer]; };
  const size_t first = attention_layers[0];
  std::map<const c10::TensorImpl*, size_t> holders;
  for (size_t j = 0; j < size; ++j) ++holders[keys_of(j, first).unsafeGetTensorImpl()];
  const auto most = std::max_element(holders.begin(), holders.end(),
                                     [](const auto& a, const auto& b) { return a.second < b.second; });
  size_t shared = 0;
  while (keys_of(shared, first).unsafeGetTensorImpl() != most->first) ++shared;
  const int64_t batch_rows = keys_of(shared, first).size(0);
  std::vector<int64_t> rows(size, -1);
  std::vector<bool> taken(static_cast<size_t>(batch_rows), false);
  for (size_t j = 0; j < size; ++j) {
    if (keys_of(j, first).unsafeGetTensorImpl() != most->first) continue;
    rows[j] = slots[j];
    taken[static_cast<size_t>(slots[j])] = true;
  }
  const bool joining = most->second < size;
  for (size_t layer : attention_layers) {
    const StageCache& holder = *caches[group.members[shared]];
    for (const at::Tensor* t : {&holder.keys[layer], &holder.values[layer]}) {
      if (t->size(1) < step.longest) return;  // no room for the step's positions
      if (joining && static_cast<size_t>(t->use_count()) != most->second) return;  // a row may belong to a live cache
    }
  }
  std::vector<KvStep::Join> joins;
  size_t free_row = 0;
  for (size_t j = 0; j < size; ++j) {
    if (rows[j] >= 0) continue;
    while (free_row < taken.size() && taken[free_row]) ++free_row;
    if (free_row == taken.size()) return;  // more joining than unused rows
    taken[free_row] = true;
    rows[j] = static_cast<int64_t>(free_row);
    joins.push_back({j, slots[j], lengths[group.members[j]]});
  }
  step.in_place = true;
  step.shared_member = shared;
  step.in_place_rows = std::move(rows);
  step.joins = std::move(joins);
}

KvStep plan_kv_step(const RowGroup& group, const std::vector<StageCache*>& caches, const std::vector<int64_t>& lengths,
                    const std::vector<size_t>& attention_layers, at::Device device, bool flash, bool croppable) {
  const size_t first_attention = attention_layers[0];
  std::vector<const at::Tensor*> sources;
  std::vector<int64_t> slots, begins, rows, positions;
  KvStep step;
  for (size_t j = 0; j < group.members.size(); ++j) {
    const StageCache& cache = *caches[group.members[j]];
    const int64_t length = lengths[group.members[j]];
    sources.push_back(&cache.keys[first_attention]);
    slots.push_back(cache.step_slot);
    begins.push_back(length);
    step.held = std::max(step.held, length);
    step.longest = std::max(step.longest, length + group.count);
    step.same_begin = step.same_begin && length == lengths[group.members[0]];
    for (int64_t t = 0; t < group.count; ++t) {
      rows.push_back(static_cast<int64_t>(j));
      positions.push_back(length + t);
    }
  }
  step.rows = RowGather(sources, slots, device);
  step.begin = begins[0];
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  if (flash && !croppable && !step.rows.whole()) plan_in_place(group, caches, lengths, attention_layers, slots, step);
  if (step.in_place) {  // the step's keys go to each member's row of the shared batch
    step.same_begin = false;
    for (int64_t& row : rows) row = step.in_place_rows[static_cast<size_t>(row)];
  }
  if (!step.same_begin) {
    std::vector<int64_t> both = rows;
    both.insert(both.end(), positions.begin(), positions.end());
    const at::Tensor on_device = values_on(both, at::kLong, device).view({2, static_cast<int64_t>(rows.size())});
    step.append_rows = on_device[0], step.append_positions = on_device[1];
  }
  step.flash = flash;
  if (flash) {  // cu_q then used_k, one copy
    const int64_t size = static_cast<int64_t>(group.members.size());
    std::vector<int32_t> both;
    for (int64_t j = 0; j <= size; ++j) both.push_back(static_cast<int32_t>(j * group.count));
    for (int64_t begin : begins) both.push_back(static_cast<int32_t>(begin + group.count));
    if (step.in_place) {  // then the members' rows of the shared batch, and one past the largest
      for (int64_t row : step.in_place_rows) both.push_back(static_cast<int32_t>(row));
      both.push_back(static_cast<int32_t>(*std::max_element(step.in_place_rows.begin(), step.in_place_rows.end()) + 1));
    }
    const at::Tensor on_device = values_on(both, at::kInt, device);
    step.cu_q = on_device.narrow(0, 0, size + 1);
    step.used_k = on_device.narrow(0, size + 1, size);
    if (step.in_place) step.key_rows = on_device.narrow(0, 2 * size + 1, size + 1);
    return step;
  }
  const at::Tensor last_visible =  // [G, n]: the last key position each query sees
      at::tensor(begins, long_options).unsqueeze(1) + at::arange(group.count, long_options).unsqueeze(0);
  step.visible = to_device_async(
      (at::arange(step.longest, long_options).view({1, 1, step.longest}) <= last_visible.unsqueeze(2)).unsqueeze(1),
      device);
  return step;
}

// One attention layer's keys or values of a group: the members' batch [G, capacity, Hkv, d] as
// it is when they are its rows in order and it has room, or the shared batch in place
// (KvStep::in_place), else a new one (capacity doubled, at least 256 positions; zeros past each
// member's positions, which the mask hides: garbage there could be NaN, and 0 x NaN is NaN;
// FlashAttention reads only used_k keys, so no zeros there) with their rows copied in; then the
// step's rows written (unless the attention kernel writes them: !append).
at::Tensor kv_batch(const KvStep& step, const std::vector<const at::Tensor*>& sources, const at::Tensor& step_rows,
                    int64_t n, bool append) {
  if (step.in_place) {  // the shared batch, joining members' positions copied into their rows
    at::Tensor batch = *sources[step.shared_member];
    for (const KvStep::Join& join : step.joins) {
      batch[step.in_place_rows[join.member]].narrow(0, 0, join.held).copy_(
          (*sources[join.member])[join.own_row].narrow(0, 0, join.held));
    }
    if (append) batch.index_put_({step.append_rows, step.append_positions}, step_rows);
    return batch;
  }
  at::Tensor batch = *sources[0];
  if (!step.rows.whole() || batch.size(1) < step.longest) {
    int64_t capacity = std::max<int64_t>(256, step.rows.whole() ? 2 * batch.size(1) : 0);
    while (capacity < step.longest) capacity *= 2;
    const std::vector<int64_t> shape{static_cast<int64_t>(sources.size()), capacity, step_rows.size(1),
                                     step_rows.size(2)};
    batch = step.flash ? at::empty(shape, step_rows.options()) : at::zeros(shape, step_rows.options());
    step.rows.copy_into(batch, sources, step.held);
  }
  if (!append) return batch;
  if (step.same_begin) {
    batch.narrow(1, step.begin, n).copy_(step_rows.view({batch.size(0), n, step_rows.size(1), step_rows.size(2)}));
  } else {
    batch.index_put_({step.append_rows, step.append_positions}, step_rows);
  }
  return batch;
}

// Whether a group's step takes the decoding attention kernel (kernels/decode_attention.h): one
// token per member, bf16 on a GPU (the flash plan), d 128 or 256, at most 16 query heads per kv
// head, q's heads and the step's keys and values dense in rows 16-byte aligned.
bool one_token_attention_applies(const ModelConfig& c, const KvStep& step, int64_t n, const at::Tensor& q,
                                 const at::Tensor& k, const at::Tensor& v) {
#ifdef DFLASHD_WITH_CUDA
  const int64_t d = c.head_dim, heads = c.num_attention_heads, kv_heads = c.num_key_value_heads;
  auto rows = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kBFloat16 && t.dim() == 3 && t.stride(2) == 1 && t.stride(1) == d &&
           t.stride(0) % 8 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
  };
  return step.flash && n == 1 && !kernels::decode_attention_off.load() &&
         kernels::decode_attention_head_dim(static_cast<int>(d)) && heads % kv_heads == 0 &&
         heads / kv_heads <= kernels::kDecodeAttentionMaxGroup && rows(q) && rows(k) && rows(v);
#else
  (void)c, (void)step, (void)n, (void)q, (void)k, (void)v;
  return false;
#endif
}

// The group's one-token step on the decoding attention kernel (one_token_attention_applies): the
// keys and values of the caches read where kv_batch left them, the step's own written into them
// by the kernel, the rows written into `out` (directly when the group holds every row, and then
// gated too when the layer is: returns whether it was).
bool one_token_attention(const ModelConfig& c, const AttentionQkv& qkv, const RowGroup& group, const KvStep& step,
                         const at::Tensor& k, const at::Tensor& v, double scale, at::Tensor& out) {
#ifdef DFLASHD_WITH_CUDA
  if (!k.is_contiguous() || !v.is_contiguous() || k.sizes() != v.sizes()) {
    throw std::logic_error("decoding attention: the key and value batches are not dense alike");
  }
  const c10::cuda::CUDAGuard guard(k.device());  // the stream and properties of the caches' GPU
  const int64_t d = c.head_dim, heads = c.num_attention_heads;
  const int64_t size = static_cast<int64_t>(group.members.size());
  const bool direct = holds_every_row(group, out) && out.is_contiguous();
  const bool gated = direct && c.gated_attention;
  const at::Tensor q = group_rows(group, qkv.q), new_k = group_rows(group, qkv.k), new_v = group_rows(group, qkv.v);
  at::Tensor rows = direct ? out : at::empty({size, heads, d}, q.options());
  kernels::DecodeAttention a;
  a.q = q.data_ptr(), a.q_stride = q.stride(0);
  a.k = k.data_ptr(), a.v = v.data_ptr(), a.capacity = k.size(1);
  a.rows = step.in_place ? step.key_rows.data_ptr<int32_t>() : nullptr;
  a.lengths = step.used_k.data_ptr<int32_t>();
  a.new_k = new_k.data_ptr(), a.new_k_stride = new_k.stride(0);
  a.new_v = new_v.data_ptr(), a.new_v_stride = new_v.stride(0);
  a.out = rows.data_ptr(), a.out_stride = heads * d;
  if (gated) a.gate = qkv.gate.data_ptr(), a.gate_stride = qkv.gate.stride(0), a.gate_head_stride = qkv.gate.stride(1);
  a.sequences = static_cast<int>(size), a.heads = static_cast<int>(heads);
  a.kv_heads = static_cast<int>(c.num_key_value_heads), a.d = static_cast<int>(d);
  a.longest = static_cast<int>(step.longest), a.scale = static_cast<float>(scale);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const size_t bytes = kernels::decode_attention_workspace(a, sms);
  const at::Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, q.options().dtype(at::kByte));
  a.workspace = bytes > 0 ? workspace.data_ptr() : nullptr;
  kernels::decode_attention(a, sms, at::cuda::getCurrentCUDAStream().stream());
  if (!direct) put_group_rows(group, out, rows);
  return gated;
#else
  (void)c, (void)qkv, (void)group, (void)step, (void)k, (void)v, (void)scale, (void)out;
  throw std::logic_error("decoding attention: this build has no CUDA kernels");
#endif
}

// One full-attention layer for a group: its members' keys and values written into the batch
// they share (kv_batch), each query attending to its own sequence's keys up to its position
// (step.visible hides the rest). Writes the attention rows into `out` [tokens, Hq, d]; returns
// whether they were gated too (one_token_attention).
bool attention_group(const ModelConfig& c, const AttentionQkv& a, const RowGroup& group, const KvStep& step,
                     const std::vector<StageCache*>& caches, size_t layer, at::Tensor& out) {
  const int64_t n = group.count, size = static_cast<int64_t>(group.members.size());
  const int64_t d = c.head_dim, hq = c.num_attention_heads;
  std::vector<const at::Tensor*> keys, values;
  for (size_t member : group.members) {
    keys.push_back(&caches[member]->keys[layer]);
    values.push_back(&caches[member]->values[layer]);
  }
  const bool own_kernel = one_token_attention_applies(c, step, n, a.q, a.k, a.v);
  const at::Tensor k = kv_batch(step, keys, group_rows(group, a.k), n, !own_kernel);
  const at::Tensor v = kv_batch(step, values, group_rows(group, a.v), n, !own_kernel);
  for (size_t member : group.members) caches[member]->keys[layer] = k, caches[member]->values[layer] = v;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  if (own_kernel) return one_token_attention(c, a, group, step, k, v, scale, out);
  if (step.flash) {  // member j's keys: rows j * capacity .. + used_k[j] - 1 of the flattened batch
    const int64_t capacity = k.size(1), hkv = k.size(2);
    // In place, member j's keys start at in_place_rows[j] * capacity.
    const at::Tensor cu_k = step.in_place ? step.key_rows * static_cast<int32_t>(capacity)
                                          : at::arange(0, (size + 1) * capacity, capacity, step.used_k.options());
    const at::Tensor o = std::get<0>(at::_flash_attention_forward(
        group_rows(group, a.q), k.view({k.size(0) * capacity, hkv, d}), v.view({v.size(0) * capacity, hkv, d}),
        step.cu_q, cu_k, n, step.longest, 0.0, /*is_causal=*/true, /*return_debug_mask=*/false, scale, std::nullopt,
        std::nullopt, step.used_k));
    put_group_rows(group, out, o);
    return false;
  }
  const at::Tensor q = group_rows(group, a.q).view({size, n, hq, d}).transpose(1, 2);
  const at::Tensor o = at::scaled_dot_product_attention(
      q, k.narrow(1, 0, step.longest).transpose(1, 2), v.narrow(1, 0, step.longest).transpose(1, 2), step.visible, 0.0,
      /*is_causal=*/false, scale, /*enable_gqa=*/true);
  put_group_rows(group, out, o.transpose(1, 2).reshape({size * n, hq, d}));
  return false;
}

// One full-attention layer over every sequence's tokens.
at::Tensor attention_layer(const ModelConfig& c, const Attention& p, const GemmInput& x, const at::Tensor& cos,
                           const at::Tensor& sin, const std::vector<RowGroup>& groups, const std::vector<KvStep>& steps,
                           const std::vector<StageCache*>& caches, size_t layer) {
  const AttentionQkv a = project_attention(c, p, x, cos, sin);
  at::Tensor out = at::empty({x.rows(), c.num_attention_heads, c.head_dim}, a.q.options());
  bool gated = false;  // only a group that holds every row gates them itself
  for (size_t i = 0; i < groups.size(); ++i) gated = attention_group(c, a, groups[i], steps[i], caches, layer, out);
  out = out.view({x.rows(), c.num_attention_heads * c.head_dim});
  return attention_output(p, out, gated ? at::Tensor() : a.gate);
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

// The rule for a group of sequences from `states` [G, Hv, dk, dv] (replaced by the states after
// the tokens): q, k [G, n, Hk, dk], v [G, n, Hv, dv], g, beta [G, n, Hv]. Returns o [G, n, Hv, dv].
// `kernel` (the model's GatedDeltaNet layers run the CUDA kernels): every step and crop runs the
// decode-step kernel (same math, the state read and written once, each CTA walking its
// sequence's tokens in order; prefills take the chunked kernels before this, GdnStep::chunks);
// otherwise token by token or chunked (recurrent_step_tokens). `norm` (the kernel only): returns
// the layer's gated RMSNorm of o instead (gated_delta_rule_decode_step_cuda).
at::Tensor run_rule_group(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& g,
                          const at::Tensor& beta, at::Tensor* states, int64_t recurrent_step_tokens, bool kernel,
                          const GdnOutputNorm* norm) {
  const int64_t size = q.size(0), n = q.size(1), hv = v.size(2);
  if (kernel) {
    GdnDecodeResult r = gated_delta_rule_decode_step_cuda(q, k, v, g, beta, *states, norm);
    *states = r.state;
    return r.o;
  }
  // In fp32 whatever the states are kept in; a bf16 state is rounded once, after the tokens, as
  // the decode-step kernel does.
  at::Tensor state = states->to(at::kFloat).reshape({size * hv, states->size(2), states->size(3)});
  const at::Tensor o = run_rule(heads_side_by_side(q), heads_side_by_side(k), heads_side_by_side(v),
                                heads_side_by_side(g.unsqueeze(-1)).squeeze(-1),
                                heads_side_by_side(beta.unsqueeze(-1)).squeeze(-1), &state, recurrent_step_tokens);
  *states = state.view(states->sizes()).to(states->scalar_type());
  return o.view({n, size, hv, v.size(3)}).transpose(0, 1);
}

// The first GatedDeltaNet layer (-1: none): its batches' layout is that of every GatedDeltaNet
// layer.
int64_t first_gdn_layer(const std::vector<Layer>& layers) {
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].kind != LayerKind::full_attention) return static_cast<int64_t>(i);
  }
  return -1;
}

// Step rows per sequence up to which a plain step's conv runs conv_step_cuda (one thread walks a
// sequence's rows in order); longer steps (prefills) run the conv kernel over the window.
constexpr int64_t kConvStepTokens = 16;

// A group's step in the GatedDeltaNet layers, the same in each: where its members' conv inputs and
// states lie (`rows`, from the first GatedDeltaNet layer) and how the conv runs where the layers
// run the CUDA kernels:
// - one_pass: a plain step (nothing kept for a crop) of up to kConvStepTokens rows per member,
//   conv_step_cuda over each member's cached inputs and step rows;
// - otherwise window_positions, the positions of each member's window rows for the conv kernel
//   (int64 [G * (K - 1 + n)] on the device, 0 .. K - 2 + n per member: the kernel then convolves
//   each step token over the K - 1 inputs before it, in one launch instead of the reference's
//   seven fp32 ops).
// Neither on the reference path. A longer step that keeps nothing for a crop (a prefill) runs the
// rule as the training forward does, chunked (`chunks`: each member's n rows one sequence of the
// plan; GdnCarriedStates starts them from their states and returns the states after), where the
// decode-step kernel walks each sequence's tokens in order (a 512-token prompt: 512 dependent
// steps per CTA).
struct GdnStep {
  RowGather rows;        // the conv inputs'
  RowGather state_rows;  // the states' (where deferred steps left them: StageCache::state_slot)
  bool one_pass = false;
  at::Tensor window_positions;
  std::optional<GdnChunkPlan> chunks;
  // A prefill whose members start here (no conv inputs before the step: new caches): the conv runs
  // over the step rows alone, the taps before a sequence's start skipped (window_positions then
  // the rows' positions 0 .. n - 1 per member): no window is concatenated.
  bool fresh = false;
  // When the decode-step kernel reads the states where they lie (a one-pass step whose members
  // are not their batch's rows in order: gathering them first moved every state, 9 GB at 128
  // sequences with bf16 states): int64 [layers, G] on the device, member j's state in layer i at
  // state_addresses[i][j] (GatedDeltaNet layers only).
  at::Tensor state_addresses;
  // A plain step with deferred stores (StageCache::unstored): the states updated in place at
  // state_addresses, member j's log in layer i at log_addresses[i][j], its unstored tokens pending[j].
  bool deferred = false;
  at::Tensor log_addresses, pending;
};

// A cache's state in GatedDeltaNet layer `layer`: the address of its row of the batch it lies in,
// or null where that row is not a dense row of a dense batch.
const char* state_row(const StageCache& cache, size_t layer) {
  const at::Tensor& batch = cache.state[layer];
  if (!batch.is_contiguous() || cache.state_slot >= batch.size(0)) return nullptr;
  return static_cast<const char*>(batch.data_ptr()) + cache.state_slot * batch.stride(0) * batch.element_size();
}

// Every GatedDeltaNet layer's state address of each member (its row of the batch its cache holds),
// one table for the step, or undefined where a state is not a dense row of a dense batch.
at::Tensor state_addresses(const std::vector<Layer>& layers, const std::vector<StageCache*>& members,
                           at::Device device) {
  const int64_t size = static_cast<int64_t>(members.size());
  std::vector<int64_t> table(layers.size() * static_cast<size_t>(size), 0);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].kind == LayerKind::full_attention) continue;
    for (int64_t j = 0; j < size; ++j) {
      const char* row = state_row(*members[static_cast<size_t>(j)], i);
      if (row == nullptr) return {};
      table[i * static_cast<size_t>(size) + static_cast<size_t>(j)] = reinterpret_cast<int64_t>(row);
    }
  }
  return values_on(table, at::kLong, device).view({static_cast<int64_t>(layers.size()), size});
}

// Deferred stores' tables besides the state addresses: member j's log in GatedDeltaNet layer i at
// [0][i][j] (its cache's log, allocated at its first deferred step) and its unstored tokens at [1][0][j],
// int64 [2, layers, G] in one copy to the device.
at::Tensor log_tables(const std::vector<Layer>& layers, const ModelConfig& c, const std::vector<StageCache*>& members,
                      at::Device device) {
  const int64_t size = static_cast<int64_t>(members.size()), count = static_cast<int64_t>(layers.size());
  const kernels::GdnDecodeLog layout{static_cast<int>(c.linear_num_key_heads),
                                     static_cast<int>(c.linear_num_value_heads)};
  const int64_t bytes = layout.bytes();
  std::vector<int64_t> table(static_cast<size_t>(2 * count * size), 0);
  for (int64_t j = 0; j < size; ++j) {
    StageCache& cache = *members[static_cast<size_t>(j)];
    if (!cache.log.defined()) {
      cache.log = at::empty({count, bytes}, at::TensorOptions().dtype(at::kByte).device(device));
    }
    table[static_cast<size_t>(count * size + j)] = cache.unstored;
    for (int64_t i = 0; i < count; ++i) {
      table[static_cast<size_t>(i * size + j)] =
          reinterpret_cast<int64_t>(static_cast<char*>(cache.log.data_ptr()) + i * bytes);
    }
  }
  return values_on(table, at::kLong, device).view({2, count, size});
}

// Whether a stage's part of a step defers its GatedDeltaNet stores (StageCache::unstored): a plain
// step (nothing kept for a crop, one token a sequence) on bf16 states where the layers run the
// kernels, its members' states dense rows (state_row, every layer: the kernel reads them where
// they lie) of batches holding at most 1 row in 8 beyond them. A deferred step moves no state, and
// a batch lives while any cache holds it, so the rows of sequences that finished would stay
// allocated; a step that does not defer gathers its members' states into a batch of their own
// (under continuous batching, once finished sequences hold more than an eighth of the rows).
bool defers_stores(bool gdn_kernels, at::ScalarType state_dtype, const std::vector<Layer>& layers,
                   const std::vector<RowGroup>& groups, const std::vector<StageCache*>& caches, bool croppable) {
  const int64_t first = first_gdn_layer(layers);
  if (first < 0 || croppable || !gdn_kernels || state_dtype != at::kBFloat16 || groups.size() != 1 ||
      groups[0].count != 1) {
    return false;
  }
#ifdef DFLASHD_WITH_CUDA
  if (kernels::deferred_stores_off.load()) return false;
#endif
  std::vector<const at::TensorImpl*> batches;
  int64_t rows = 0;
  for (size_t member : groups[0].members) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i].kind != LayerKind::full_attention && state_row(*caches[member], i) == nullptr) return false;
    }
    const at::Tensor& batch = caches[member]->state[static_cast<size_t>(first)];
    if (std::find(batches.begin(), batches.end(), batch.unsafeGetTensorImpl()) != batches.end()) continue;
    batches.push_back(batch.unsafeGetTensorImpl());
    rows += batch.size(0);
  }
  return rows * 8 <= static_cast<int64_t>(groups[0].members.size()) * 9;
}

// Before a step that does not defer its stores: the caches' unstored tokens stored, every head's
// state then complete where it lies.
void store_unstored(const std::vector<Layer>& layers, const ModelConfig& c, const std::vector<StageCache*>& caches,
                    at::Device device) {
  std::vector<StageCache*> behind;
  for (StageCache* cache : caches) {
    if (cache->unstored > 0) behind.push_back(cache);
  }
  if (behind.empty()) return;
  const at::Tensor states = state_addresses(layers, behind, device), logs = log_tables(layers, c, behind, device);
  if (!states.defined()) throw std::logic_error("decode step: a state with unstored tokens is not a dense row");
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].kind == LayerKind::full_attention) continue;
    const int64_t l = static_cast<int64_t>(i);
    gated_delta_rule_store_deferred_cuda(states[l], {logs[0][l], logs[1][0]}, c.linear_num_key_heads,
                                         c.linear_num_value_heads);
  }
  for (StageCache* cache : behind) cache->unstored = 0;
}

// The causal depthwise conv + SiLU of a group's step tokens over their window ([G, K - 1 + n, C],
// the K - 1 inputs before the step, then the step's): [G, n, C] in `dtype`.
// `qk_channels`: the leading channels (q and k) the kernel also L2-normalises per 128-channel head
// (for the chunked rule; the decode-step kernel normalises them itself).
at::Tensor conv_window(const GdnStep& step, const at::Tensor& window, const at::Tensor& weight, at::ScalarType dtype,
                       int64_t qk_channels = 0) {
  if (!step.window_positions.defined()) return conv_over_window(window, weight, dtype);
  const int64_t size = window.size(0), rows = window.size(1), n = rows - (weight.size(1) - 1);
  const at::Tensor all = conv1d_silu_l2norm_cuda(window.view({size * rows, window.size(2)}), weight,
                                                 step.window_positions, qk_channels);
  return all.view(window.sizes()).narrow(1, rows - n, n);
}

// A group's conv in a GatedDeltaNet layer: in one pass (GdnStep::one_pass), or over the window
// (inputs + step rows), which a croppable step keeps and whose last K - 1 rows become the cached
// inputs (`tails`); the step's gates formed by the conv step where `conv_gates` asks.
struct GroupConv {
  at::Tensor window, convolved, tails;
  GdnGateValues gates;
};
GroupConv convolve_group(const ModelConfig& c, const GatedDeltaNet& p, const GdnProjections& proj,
                         const GdnGateValues& gates, const ConvStepGates* conv_gates, const RowGroup& group,
                         const GdnStep& step, const std::vector<const at::Tensor*>& convs) {
  const RowGather& rows = step.rows;
  const int64_t n = group.count, size = static_cast<int64_t>(group.members.size()), kernel = p.conv.size(1);
  const int64_t qk_channels = 2 * c.linear_num_key_heads * c.linear_key_head_dim, channels = proj.mixed.size(1);
  GroupConv r;
  r.gates = gates;
  if (step.one_pass) {
    // The cached inputs, viewed in place, were written by an earlier step, whose kernels finished
    // before this step's first (ATen) kernel ran: settled.
    ConvStepResult one =
        conv_step_cuda(rows.gather(convs), group_rows(group, proj.mixed), p.conv, conv_gates, rows.views());
    r.convolved = one.y.view({size, n, channels});
    r.tails = std::move(one.tails);
    if (conv_gates != nullptr) r.gates = {one.g, one.beta};
  } else if (step.fresh) {  // q and k normalised here for the chunked rule; the last K - 1 rows cached
    const at::Tensor x = group_rows(group, proj.mixed);
    r.convolved = conv1d_silu_l2norm_cuda(x, p.conv, step.window_positions, qk_channels).view({size, n, channels});
    r.tails = x.view({size, n, channels}).narrow(1, n - (kernel - 1), kernel - 1).clone(at::MemoryFormat::Contiguous);
  } else {
    r.window = at::cat({rows.gather(convs), group_rows(group, proj.mixed).view({size, n, channels})}, 1);
    r.convolved = conv_window(step, r.window, p.conv, proj.mixed.scalar_type(), step.chunks ? qk_channels : 0);
    // The members' last K - 1 conv inputs, compact, in one copy (a view would keep the whole
    // step's window alive: 10 MB per layer and sequence after a 512-token prefill at 27B shapes).
    // clone, not contiguous(): with one member the narrowed window counts as contiguous.
    r.tails = r.window.narrow(1, n, kernel - 1).clone(at::MemoryFormat::Contiguous);
  }
  return r;
}

// One GatedDeltaNet layer for a group, from its members' conv inputs and states (rows of the
// batch tensors they share, read through `step.rows` and `step.state_rows`): the group's new conv
// inputs and states become their batch (member j its row j; a deferred step's states stay where
// they lie); keeps what crop() needs, as the group's batch tensors, when the step is croppable.
// Writes the rule's o rows into `o_out` [tokens, Hv, dv] (fp32), or with `norm` (a group holding
// every row, stepped by the decode kernel) sets o_out to the layer's gated RMSNorm of them (bf16
// [tokens, Hv * dv]).
void gdn_group(const ModelConfig& c, const GatedDeltaNet& p, const GdnProjections& proj, const GdnGateValues& gates,
               const ConvStepGates* conv_gates, const RowGroup& group, const GdnStep& step,
               const std::vector<StageCache*>& caches, size_t layer, at::Tensor& o_out, int64_t recurrent_step_tokens,
               bool decode_kernel, bool croppable, const GdnOutputNorm* norm) {
  const int64_t n = group.count, size = static_cast<int64_t>(group.members.size());
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  const int64_t dk = c.linear_key_head_dim, dv = c.linear_value_head_dim;
  std::vector<const at::Tensor*> convs, states;
  for (size_t member : group.members) {
    convs.push_back(&caches[member]->conv[layer]);
    states.push_back(&caches[member]->state[layer]);
  }
  const GroupConv conv = convolve_group(c, p, proj, gates, conv_gates, group, step, convs);
  const at::Tensor& convolved = conv.convolved;
  const GdnGateValues& step_gates = conv.gates;
  const at::Tensor q = convolved.narrow(-1, 0, hk * dk).view({size, n, hk, dk});
  const at::Tensor k = convolved.narrow(-1, hk * dk, hk * dk).view({size, n, hk, dk});
  const at::Tensor v = convolved.narrow(-1, 2 * hk * dk, hv * dv).view({size, n, hv, dv});
  const at::Tensor g = group_rows(group, step_gates.g).view({size, n, hv});
  const at::Tensor beta = group_rows(group, step_gates.beta).view({size, n, hv});
  at::Tensor before, after, o;
  if (step.chunks) {  // a prefill: the chunked kernels from the members' states (not croppable)
    GdnCarriedStates carried;  // new caches start from zero states: nothing to read
    if (step.fresh) {
      carried.dtype = states[0]->scalar_type();
    } else {
      carried.before = step.state_rows.gather(states);
    }
    o = gated_delta_rule_cuda(convolved.reshape({size * n, proj.mixed.size(1)}), hk, hv,
                              GdnGates::precomputed(g.reshape({size * n, hv}), beta.reshape({size * n, hv})),
                              *step.chunks, {}, {}, c.rms_norm_eps, 64, nullptr, at::kFloat, &carried);
    after = std::move(carried.after);
  } else if (step.deferred) {  // the states updated in place as their stores fall due (`after` undefined)
    const int64_t l = static_cast<int64_t>(layer);
    GdnDecodeResult r = gated_delta_rule_decode_step_deferred_cuda(
        q, k, v, g, beta, step.state_addresses[l], {step.log_addresses[l], step.pending}, norm);
    o = std::move(r.o);
  } else if (step.state_addresses.defined()) {  // each state read where it lies (no `before`: not croppable)
    const at::Tensor addresses = step.state_addresses[static_cast<int64_t>(layer)];
    GdnDecodeResult r =
        gated_delta_rule_decode_step_cuda(q, k, v, g, beta, addresses, states[0]->scalar_type(), norm);
    after = std::move(r.state);
    o = std::move(r.o);
  } else {
    before = step.state_rows.gather(states);
    after = before;
    o = run_rule_group(q, k, v, g, beta, &after, recurrent_step_tokens, decode_kernel, norm);
  }
  if (norm != nullptr) {
    o_out = o;
  } else {
    put_group_rows(group, o_out, o.reshape({size * n, hv, dv}));
  }
  for (size_t member : group.members) {
    StageCache& cache = *caches[member];
    if (croppable) cache.last_gdn[layer] = {before, q, k, v, g, beta, conv.window};
    if (after.defined()) cache.state[layer] = after;
    cache.conv[layer] = conv.tails;
  }
}

// One GatedDeltaNet layer over every sequence's tokens.
at::Tensor gdn_layer(const ModelConfig& c, const GatedDeltaNet& p, const GemmInput& x, const std::vector<RowGroup>& groups,
                     const std::vector<GdnStep>& steps, const std::vector<StageCache*>& caches, size_t layer,
                     int64_t recurrent_step_tokens, bool kernel, bool croppable) {
  const GdnProjections proj = project_gdn(c, p, x);
  // A step whose only group convolves in one pass forms the gates in the conv step's launch.
  const ConvStepGates conv_gates{proj.a, proj.b, p.a_log, p.dt_bias};
  const bool gates_in_conv =
      groups.size() == 1 && steps[0].one_pass && gdn_gates_kernel_applies(proj.a, proj.b, p.a_log, p.dt_bias);
  GdnGateValues gates;
  if (!gates_in_conv) {
    auto [g, beta] = gdn_gates(proj.a, proj.b, p.a_log, p.dt_bias);
    gates = {std::move(g), std::move(beta)};
  }
  // A step whose only group the decode kernel steps has its gated norm formed there (for one token
  // on bf16 states inside the step's kernel: no separate launch, o never written).
  const GdnOutputNorm norm{proj.z, p.norm, c.rms_norm_eps};
  const bool norm_in_step = groups.size() == 1 && kernel && !steps[0].chunks && holds_every_row(groups[0], proj.z) &&
                            proj.z.scalar_type() == at::kBFloat16;
  at::Tensor o;
  if (!norm_in_step) {
    o = at::empty({x.rows(), c.linear_num_value_heads, c.linear_value_head_dim}, proj.z.options().dtype(at::kFloat));
  }
  for (size_t i = 0; i < groups.size(); ++i) {
    gdn_group(c, p, proj, gates, gates_in_conv ? &conv_gates : nullptr, groups[i], steps[i], caches, layer, o,
              recurrent_step_tokens, kernel, croppable, norm_in_step ? &norm : nullptr);
  }
  return norm_in_step ? p.out(o) : gdn_output(c, p, o, proj.z, proj.z.scalar_type());
}

// A cache's first step in a stage: its attention layers start from empty batches, its
// GatedDeltaNet layers from zero conv inputs and states (`activations`: the stage's dtype and
// device; the states in `state_dtype`).
void start_caches(const std::vector<Layer>& layers, const ModelConfig& c, const std::vector<StageCache*>& caches,
                  const at::TensorOptions& activations, at::ScalarType state_dtype) {
  for (StageCache* cache : caches) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (layers[i].kind == LayerKind::full_attention) {
        if (cache->keys[i].defined()) continue;
        cache->keys[i] = at::zeros({1, 0, c.num_key_value_heads, c.head_dim}, activations);
        cache->values[i] = cache->keys[i];
        cache->step_slot = 0;
      } else {
        if (cache->state[i].defined()) continue;
        const at::Tensor& conv = layers[i].gdn.conv;  // [channels, K]
        cache->conv[i] = at::zeros({1, conv.size(1) - 1, conv.size(0)}, activations);
        cache->state[i] = at::zeros({1, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim},
                                    activations.dtype(state_dtype));
        cache->slot = cache->state_slot = 0;
      }
    }
  }
}

// The attention layers' plan of a step, per group (none without attention layers); `lengths`:
// each sequence's tokens before the step.
std::vector<KvStep> plan_kv_steps(const std::vector<Layer>& layers, const std::vector<RowGroup>& groups,
                                  const std::vector<StageCache*>& caches, const std::vector<int64_t>& lengths,
                                  const at::TensorOptions& activations, int64_t head_dim, bool croppable) {
  std::vector<KvStep> steps;
  std::vector<size_t> attention;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].kind == LayerKind::full_attention) attention.push_back(i);
  }
  // The attention layers run FlashAttention's variable-length kernel where it runs
  // (common/flash_attention.h) rather than SDPA with a mask. The kernel reads each member's keys
  // as the first used_k[j] rows of its row of the batch (no mask to build, grouped-query heads
  // read as they are) and costs the host one launch: cuDNN's masked SDPA, which ATen picks
  // otherwise, spent 2.6 ms of host time per call at 128 sequences (bench/RESULTS.md, session
  // 16). Same math; CPU runs keep the mask.
  const bool flash = !attention.empty() && flash_attention_runs(activations, head_dim);
  for (const RowGroup& group : groups) {
    if (attention.empty()) break;
    steps.push_back(plan_kv_step(group, caches, lengths, attention, activations.device(), flash, croppable));
  }
  return steps;
}

// The GatedDeltaNet layers' plan of a step, per group (none without GatedDeltaNet layers); `kernels`:
// the layers run the CUDA kernels; `croppable`: the step keeps what a crop needs.
std::vector<GdnStep> plan_gdn_steps(const std::vector<Layer>& layers, const ModelConfig& c,
                                    const std::vector<RowGroup>& groups, const std::vector<StageCache*>& caches,
                                    const std::vector<int64_t>& lengths, at::Device device, bool kernels,
                                    bool croppable, bool deferred) {
  std::vector<GdnStep> steps;
  const int64_t first = first_gdn_layer(layers);
  for (const RowGroup& group : groups) {
    if (first < 0) break;
    std::vector<const at::Tensor*> convs, states;
    std::vector<int64_t> slots, state_slots;
    std::vector<StageCache*> members;
    for (size_t member : group.members) {
      convs.push_back(&caches[member]->conv[first]);
      states.push_back(&caches[member]->state[first]);
      slots.push_back(caches[member]->slot);
      state_slots.push_back(caches[member]->state_slot);
      members.push_back(caches[member]);
    }
    GdnStep step;
    step.rows = RowGather(convs, slots, device);
    step.state_rows = RowGather(states, state_slots, device);
    step.one_pass = kernels && !croppable && group.count <= kConvStepTokens;
    if (deferred || (step.one_pass && !step.state_rows.whole())) {
      step.state_addresses = state_addresses(layers, members, device);
    }
    if (deferred) {
      if (!step.state_addresses.defined()) throw std::logic_error("decode step: deferred stores need dense state rows");
      const at::Tensor logs = log_tables(layers, c, members, device);
      step.deferred = true;
      step.log_addresses = logs[0];
      step.pending = logs[1][0];
    }
    if (kernels && !step.one_pass && !croppable) {
      std::vector<int64_t> cu_seqlens{0};
      for (size_t j = 0; j < group.members.size(); ++j) cu_seqlens.push_back(cu_seqlens.back() + group.count);
      step.chunks = make_gdn_chunk_plan(cu_seqlens, device);
      step.fresh = std::all_of(group.members.begin(), group.members.end(),
                               [&](size_t member) { return lengths[member] == 0; });
    }
    if (kernels && !step.one_pass) {
      const int64_t held = step.fresh ? 0 : layers[static_cast<size_t>(first)].gdn.conv.size(1) - 1;
      step.window_positions = at::arange(held + group.count, at::TensorOptions().dtype(at::kLong).device(device))
                                  .repeat({static_cast<int64_t>(group.members.size())});
    }
    steps.push_back(std::move(step));
  }
  return steps;
}

// After a stage's part of a step: member j of a group is row j of the group's batches (its keys
// and values row in_place_rows[j] of the shared batch when they stayed in place); a step that is
// not croppable keeps nothing for crop().
void record_stage(const std::vector<RowGroup>& groups, const std::vector<KvStep>& kv_steps, bool croppable,
                  bool deferred, const std::vector<StageCache*>& caches) {
  for (size_t g = 0; g < groups.size(); ++g) {
    const RowGroup& group = groups[g];
    const bool in_place = g < kv_steps.size() && kv_steps[g].in_place;
    for (size_t j = 0; j < group.members.size(); ++j) {
      StageCache& cache = *caches[group.members[j]];
      cache.slot = static_cast<int64_t>(j);
      cache.step_slot = in_place ? kv_steps[g].in_place_rows[j] : static_cast<int64_t>(j);
      if (deferred) {
        ++cache.unstored;  // the states stay where they lie
      } else {
        cache.state_slot = cache.slot;
      }
    }
  }
  if (croppable) return;
  for (StageCache* cache : caches) {
    for (StageCache::LastGdn& g : cache->last_gdn) g = {};
  }
}

// Every cache's part in stage `stage`.
std::vector<StageCache*> stage_parts(const std::vector<DecodeCache*>& caches, size_t stage) {
  std::vector<StageCache*> parts;
  parts.reserve(caches.size());
  for (DecodeCache* cache : caches) parts.push_back(&cache->stages[stage]);
  return parts;
}

}  // namespace

// A step's tokens: every sequence's ids in one tensor (copied to the device once: a copy per
// sequence waited for the stream each time), their counts, the sequences' first positions, and
// every token's position.
struct IncrementalTarget::StepTokens {
  at::Tensor ids;
  std::vector<int64_t> counts, begins, positions;
};

IncrementalTarget::IncrementalTarget(const TargetModel& model, int64_t recurrent_step_tokens)
    : IncrementalTarget(std::vector<const TargetModel*>{&model}, recurrent_step_tokens) {}

IncrementalTarget::IncrementalTarget(std::vector<const TargetModel*> stages, int64_t recurrent_step_tokens)
    : stages_(std::move(stages)), recurrent_step_tokens_(recurrent_step_tokens) {
  if (stages_.empty()) throw std::invalid_argument("decoding needs a target (no stages given)");
  const TargetModel& first = *stages_.front();
  const ModelConfig& c = first.config();
  int64_t next = 0;  // the layer the next stage must start at
  for (size_t s = 0; s < stages_.size(); ++s) {
    const TargetModel& stage = *stages_[s];
    const std::string which = stages_.size() > 1 ? " (stage " + std::to_string(s) + ")" : "";
    if (stage.first_layer() != next) {
      throw std::invalid_argument(c.source + ": decoding needs every layer of the target, in order; stage " +
                                  std::to_string(s) + " starts at layer " + std::to_string(stage.first_layer()) +
                                  ", not " + std::to_string(next));
    }
    if (stage.options().dtype != first.options().dtype ||
        stage.options().decode_state_dtype != first.options().decode_state_dtype) {
      throw std::invalid_argument(c.source + ": decoding stages must share their dtype and decode_state_dtype" + which);
    }
    next = stage.last_layer() + 1;
  }
  if (next != c.num_layers || !stages_.back()->impl_->head.defined()) {
    throw std::invalid_argument(c.source + ": decoding needs every layer of the target and its LM head (built to " +
                                "layer " + std::to_string(next - 1) + " of " + std::to_string(c.num_layers) + ")");
  }
  const at::ScalarType state = first.options().decode_state_dtype;
  if (state != at::kFloat && state != at::kBFloat16) {
    throw std::invalid_argument(std::string("decoding keeps GatedDeltaNet states in float32 or bfloat16, not ") +
                                c10::toString(state));
  }
}

std::string IncrementalTarget::places() const {
  std::string out;
  for (const TargetModel* stage : stages_) out += (out.empty() ? "" : " + ") + stage->options().device.str();
  return out;
}

DecodeCache IncrementalTarget::new_cache() const {
  DecodeCache cache;
  cache.stages.resize(stages_.size());
  for (size_t s = 0; s < stages_.size(); ++s) {
    StageCache& part = cache.stages[s];
    const size_t layers = stages_[s]->impl_->layers.size();
    part.keys.resize(layers);
    part.values.resize(layers);
    part.conv.resize(layers);
    part.state.resize(layers);
    part.last_gdn.resize(layers);
  }
  return cache;
}

DecodeOutput IncrementalTarget::step(DecodeCache& cache, const at::Tensor& ids, const std::vector<int64_t>& tap) const {
  return std::move(step_batch({&cache}, {ids}, tap)[0]);
}

std::vector<DecodeOutput> IncrementalTarget::step_batch(const std::vector<DecodeCache*>& caches,
                                                        const std::vector<at::Tensor>& input_ids,
                                                        const std::vector<int64_t>& tap, bool croppable) const {
  return run_step(caches, input_ids, tap, croppable, /*last_logits_only=*/false);
}

std::vector<DecodeOutput> IncrementalTarget::prefill_batch(const std::vector<DecodeCache*>& caches,
                                                           const std::vector<at::Tensor>& ids,
                                                           const std::vector<int64_t>& tap) const {
  int64_t tokens = 0;
  for (const at::Tensor& t : ids) tokens += t.numel();
  if (tokens > kPrefillBatchTokens) {
    throw std::invalid_argument("decode prefill_batch: " + std::to_string(tokens) + " tokens; one batch takes at most " +
                                std::to_string(kPrefillBatchTokens));
  }
  return run_step(caches, ids, tap, /*croppable=*/false, /*last_logits_only=*/true);
}

IncrementalTarget::StepTokens IncrementalTarget::step_tokens(const std::vector<DecodeCache*>& caches,
                                                             const std::vector<at::Tensor>& input_ids,
                                                             const std::vector<int64_t>& tap) const {
  if (caches.empty() || caches.size() != input_ids.size()) {
    throw std::invalid_argument("decode step: " + std::to_string(caches.size()) + " caches for " +
                                std::to_string(input_ids.size()) + " token lists");
  }
  for (size_t i = 0; i < tap.size(); ++i) {
    if (tap[i] < 0 || tap[i] >= config().num_layers || (i > 0 && tap[i] <= tap[i - 1])) {
      throw std::invalid_argument("decode step: tapped layers must ascend within the model's layers");
    }
  }
  const at::Device device = stages_.front()->options().device;
  StepTokens t;
  std::vector<at::Tensor> ids;
  // Ids on one device are joined there (one copy later if on the host); ids on several (the
  // tokens a step in flight chose, beside a joining prompt's first token on the host) each go to
  // the first stage's device first. No id is read here: a step's ids may not have been computed yet.
  bool one_device = true;
  for (const at::Tensor& id : input_ids) one_device = one_device && id.device() == input_ids[0].device();
  for (size_t s = 0; s < caches.size(); ++s) {
    const DecodeCache& cache = *caches[s];
    bool ours = cache.stages.size() == stages_.size();
    for (size_t i = 0; ours && i < stages_.size(); ++i) {
      ours = cache.stages[i].keys.size() == stages_[i]->impl_->layers.size();
    }
    if (!ours) throw std::invalid_argument("decode step: the cache is not this model's");
    if (std::find(caches.begin(), caches.begin() + s, caches[s]) != caches.begin() + s) {
      throw std::invalid_argument("decode step: a cache appears twice in one step");
    }
    ids.push_back((one_device ? input_ids[s] : to_device_async(input_ids[s], device)).to(at::kLong).reshape({-1}));
    t.counts.push_back(ids.back().size(0));
    if (t.counts.back() == 0) throw std::invalid_argument("decode step: no tokens");
    t.begins.push_back(cache.length);
    for (int64_t p = cache.length; p < cache.length + t.counts.back(); ++p) t.positions.push_back(p);
  }
  t.ids = at::cat(ids);
  return t;
}

StreamState IncrementalTarget::run_stage(size_t s, const std::vector<DecodeCache*>& caches, const StepTokens& tokens,
                                         const StreamState& in, const std::vector<int64_t>& tap, bool croppable,
                                         std::vector<at::Tensor>* tapped) const {
  const TargetModel& model = *stages_[s];
  const TargetModel::Impl& m = *model.impl_;
  const ModelConfig& c = model.config();
  const at::Device device = model.options().device;
  const DeviceScope scope(device);
  const at::TensorOptions activations = at::TensorOptions().dtype(model.options().dtype).device(device);
  const std::vector<StageCache*> parts = stage_parts(caches, s);
  const std::vector<RowGroup> groups = group_rows_by_count(tokens.counts, device);
  start_caches(m.layers, c, parts, activations, model.options().decode_state_dtype);
  const std::vector<KvStep> kv_steps = plan_kv_steps(m.layers, groups, parts, tokens.begins, activations, c.head_dim,
                                                     croppable);
  // Plain steps on bf16 states defer the GatedDeltaNet layers' stores; any other step first stores
  // what earlier ones left unstored.
  const bool deferred = defers_stores(model.gdn_kernels_, model.options().decode_state_dtype, m.layers, groups, parts,
                                      croppable);
  if (!deferred) store_unstored(m.layers, c, parts, device);
  const std::vector<GdnStep> gdn_steps =
      plan_gdn_steps(m.layers, c, groups, parts, tokens.begins, device, model.gdn_kernels_, croppable, deferred);
  const at::Tensor position_ids = values_on(tokens.positions, at::kLong, device);
  const auto [cos, sin] = rope_tables(m.inv_freq, position_ids, model.options().dtype);

  // The first stage embeds the ids; a later one continues the stream on its device.
  auto here = [&](const at::Tensor& t) { return t.defined() ? t.to(device) : t; };
  ResidualStream stream = s == 0 ? ResidualStream(at::embedding(m.embed, to_device_async(tokens.ids, device)), c)
                                 : ResidualStream(here(in.x), here(in.pending), c);
  auto next = std::lower_bound(tap.begin(), tap.end(), model.first_layer());
  for (size_t i = 0; i < m.layers.size(); ++i) {
    const Layer& layer = m.layers[i];
    const GemmInput normed = stream.add_and_norm(layer.input_norm, layer.mixer_reads_fp8());
    stream.push(layer.kind == LayerKind::full_attention
                    ? attention_layer(c, layer.attention, normed, cos, sin, groups, kv_steps, parts, i)
                    : gdn_layer(c, layer.gdn, normed, groups, gdn_steps, parts, i, recurrent_step_tokens_,
                                model.gdn_kernels_, croppable));
    stream.push(mlp_forward(c, layer.mlp, stream.add_and_norm(layer.post_attention_norm, layer.mlp_reads_fp8()),
                            model.grouped_moe_));
    if (next != tap.end() && *next == model.first_layer() + static_cast<int64_t>(i)) {
      tapped->push_back(stream.output());
      ++next;
    }
  }
  record_stage(groups, kv_steps, croppable, deferred, parts);
  return stream.state();
}

std::vector<DecodeOutput> IncrementalTarget::run_step(const std::vector<DecodeCache*>& caches,
                                                      const std::vector<at::Tensor>& input_ids,
                                                      const std::vector<int64_t>& tap, bool croppable,
                                                      bool last_logits_only) const {
  c10::InferenceMode inference;
  const StepTokens tokens = step_tokens(caches, input_ids, tap);
  std::vector<at::Tensor> tapped;
  StreamState stream;
  for (size_t s = 0; s < stages_.size(); ++s) stream = run_stage(s, caches, tokens, stream, tap, croppable, &tapped);

  // The last stage's head, on its device, where the tapped features join the logits.
  const TargetModel::Impl& m = *stages_.back()->impl_;
  const at::Device device = this->device();
  const DeviceScope scope(device);
  ResidualStream last(stream.x, stream.pending, config());
  at::Tensor normed = last.add_and_norm(m.final_norm);
  if (last_logits_only) {  // each sequence's last token
    std::vector<int64_t> last_rows;
    int64_t row = 0;
    for (const int64_t count : tokens.counts) last_rows.push_back((row += count) - 1);
    normed = normed.index_select(0, values_on(last_rows, at::kLong, device));
  }
  const at::Tensor logits = at::matmul(normed, m.head.t());
  for (at::Tensor& t : tapped) t = t.to(device);  // a GPU-to-GPU copy does not block the host
  const at::Tensor features = tapped.empty() ? at::Tensor() : at::cat(tapped, -1);
  std::vector<DecodeOutput> out(caches.size());
  for (size_t s = 0, row = 0; s < caches.size(); row += static_cast<size_t>(tokens.counts[s]), ++s) {
    DecodeCache& cache = *caches[s];
    cache.length = tokens.begins[s] + tokens.counts[s];
    cache.last.begin = croppable ? tokens.begins[s] : cache.length;
    cache.last.count = croppable ? tokens.counts[s] : 0;
    out[s].logits = last_logits_only ? logits.narrow(0, static_cast<int64_t>(s), 1)
                                     : logits.narrow(0, static_cast<int64_t>(row), tokens.counts[s]);
    if (features.defined()) out[s].features = features.narrow(0, static_cast<int64_t>(row), tokens.counts[s]);
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
    last = std::move(run_step({&cache}, {ids.narrow(0, begin, std::min(chunk, ids.size(0) - begin))}, tap,
                              /*croppable=*/false, /*last_logits_only=*/true)[0]);
    if (last.features.defined()) features.push_back(last.features);
  }
  DecodeOutput out;
  out.logits = last.logits;  // the last token's: [1, vocab]
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
    for (size_t stage = 0; stage < stages_.size(); ++stage) crop_stage(stage, caches, members, keep);
  }
  for (size_t s = 0; s < caches.size(); ++s) {
    caches[s]->last.count = lengths[s] - caches[s]->last.begin;
    caches[s]->length = lengths[s];
  }
}

void IncrementalTarget::crop_stage(size_t stage, const std::vector<DecodeCache*>& caches,
                                   const std::vector<size_t>& members, int64_t keep) const {
  const TargetModel& model = *stages_[stage];
  const std::vector<Layer>& layers = model.impl_->layers;
  const int64_t first_gdn = first_gdn_layer(layers);
  if (first_gdn < 0) return;  // full attention only: rows past the kept length are ignored
  const DeviceScope scope(model.options().device);
  // Where the members' rows lie in their last steps' batches: the same in every layer.
  std::vector<int64_t> slots;
  std::vector<const at::Tensor*> sources;
  for (size_t s : members) {
    slots.push_back(caches[s]->stages[stage].step_slot);
    sources.push_back(&caches[s]->stages[stage].last_gdn[first_gdn].state_before);
  }
  const RowGather rows(sources, slots, model.options().device);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i].kind == LayerKind::full_attention) continue;
    // The members' last steps may have run different numbers of tokens: each batch is cut to
    // the kept tokens before its rows are gathered.
    using Gdn = StageCache::LastGdn;
    auto gather = [&](at::Tensor Gdn::*field, const RowGather::View& view) {
      for (size_t j = 0; j < members.size(); ++j) sources[j] = &(caches[members[j]]->stages[stage].last_gdn[i].*field);
      return rows.gather(sources, view);
    };
    const auto kept_tokens = [&](const at::Tensor& t) { return t.narrow(1, 0, keep); };
    const int64_t kernel_minus_1 = layers[i].gdn.conv.size(1) - 1;
    // The conv inputs before the first token not kept: rows keep .. keep + K - 2 of the window.
    const at::Tensor conv = gather(&Gdn::window, [&](const at::Tensor& w) { return w.narrow(1, keep, kernel_minus_1); })
                                .clone(at::MemoryFormat::Contiguous);
    at::Tensor state = gather(&Gdn::state_before, nullptr);
    if (keep > 0) {
      run_rule_group(gather(&Gdn::q, kept_tokens), gather(&Gdn::k, kept_tokens), gather(&Gdn::v, kept_tokens),
                     gather(&Gdn::g, kept_tokens), gather(&Gdn::beta, kept_tokens), &state, recurrent_step_tokens_,
                     model.gdn_kernels_, nullptr);
    }
    for (size_t s : members) caches[s]->stages[stage].state[i] = state, caches[s]->stages[stage].conv[i] = conv;
  }
  for (size_t j = 0; j < members.size(); ++j) {
    StageCache& cache = caches[members[j]]->stages[stage];
    cache.slot = cache.state_slot = static_cast<int64_t>(j);
  }
}

}  // namespace dflash::target
