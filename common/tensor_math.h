// tensor_math.h: the small tensor helpers the target and the drafter share (header-only, for
// translation units that already use ATen; the dflash_common library itself stays torch-free).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>

#include <algorithm>
#include <optional>
#include <vector>

namespace dflash {

// Makes a GPU `device` this thread's current device while it lives (nothing for the CPU). Our
// kernels launch on the current device's current stream: a model on cuda:1 run from a thread
// whose current device is cuda:0 (a decoder thread, a pipeline stage after another) would launch
// them on cuda:0's stream with cuda:1's memory.
class DeviceScope {
 public:
  explicit DeviceScope(const at::Device& device)
      : guard_(device.is_cuda() ? std::optional<at::Device>(device) : std::nullopt) {}

 private:
  c10::OptionalDeviceGuard guard_;
};

// RMSNorm in fp32. Zero-centred (Qwen3.5/Next): (x_hat * (1 + w)) cast back. Plain (Qwen3,
// Llama, the DFlash drafter): w * x_hat cast back first, as HF does it (the order matters in bf16).
inline at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred = false) {
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor normed = xf * at::rsqrt(xf.pow(2).mean(-1, true) + eps);
  if (zero_centred) return (normed * (weight.to(at::kFloat) + 1.0)).to(x.scalar_type());
  return weight * normed.to(x.scalar_type());
}

// Rotary embedding's rotate-half: [x1, x2] -> [-x2, x1] over the last dimension.
inline at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

// dst[i].copy_(src[i]) for every i in as few launches as the shapes allow (one multi-tensor
// kernel when every pair is dense and alike; batched decoding appends and gathers per sequence).
inline void copy_all(const std::vector<at::Tensor>& dst, const std::vector<at::Tensor>& src) {
  if (dst.empty()) return;
  if (dst.size() == 1) {
    dst[0].copy_(src[0]);
    return;
  }
  at::_foreach_copy_(dst, src);
}

// `t` ([capacity, row_shape...], undefined at first) with room for `needed` rows, its first `used`
// rows kept: decoding caches grow by doubling (at least 256 rows).
inline at::Tensor with_rows(const at::Tensor& t, int64_t used, int64_t needed, at::IntArrayRef row_shape,
                            const at::TensorOptions& options) {
  if (t.defined() && t.size(0) >= needed) return t;
  const int64_t capacity = std::max<int64_t>(needed, t.defined() ? 2 * t.size(0) : 256);
  std::vector<int64_t> shape{capacity};
  shape.insert(shape.end(), row_shape.begin(), row_shape.end());
  at::Tensor grown = at::empty(shape, options);
  if (t.defined() && used > 0) grown.narrow(0, 0, used).copy_(t.narrow(0, 0, used));
  return grown;
}

// A host tensor on `device` without waiting for the device: a GPU copy goes through pinned
// memory, asynchronously (a copy from pageable memory first drains the stream, so a decoding
// step's plan could not be built while the last step runs). The pinned block is not reused
// before the copy is done (the caching host allocator records the copy on the stream).
inline at::Tensor to_device_async(const at::Tensor& host, const at::Device& device) {
  if (!device.is_cuda() || !host.is_cpu()) return host.to(device);
  return host.pin_memory().to(device, /*non_blocking=*/true);
}

// Host values as a tensor of `dtype` on `device` (to_device_async).
template <typename T>
at::Tensor values_on(const std::vector<T>& values, at::ScalarType dtype, const at::Device& device) {
  return to_device_async(at::tensor(values, at::TensorOptions().dtype(dtype)), device);
}

// Batched decoding (the target's step_batch, the drafter's block_hiddens): sequences whose rows
// lie one after another, grouped by their row count so that each group's attention runs as one
// batch. Groups come in order of first appearance; members ascend.
struct RowGroup {
  int64_t count = 0;             // rows per member
  std::vector<size_t> members;   // indices of the sequences
  std::vector<int64_t> first;    // per member: its first row among all sequences' rows
  at::Tensor rows;               // int64 [members * count] on the device, member-major
};
inline std::vector<RowGroup> group_rows_by_count(const std::vector<int64_t>& counts, const at::Device& device) {
  std::vector<RowGroup> groups;
  int64_t row = 0;
  for (size_t s = 0; s < counts.size(); ++s) {
    auto it = std::find_if(groups.begin(), groups.end(), [&](const RowGroup& g) { return g.count == counts[s]; });
    if (it == groups.end()) it = groups.insert(groups.end(), RowGroup{counts[s], {}, {}, {}});
    it->members.push_back(s);
    it->first.push_back(row);
    row += counts[s];
  }
  for (RowGroup& g : groups) {
    std::vector<int64_t> rows;
    for (int64_t first : g.first) {
      for (int64_t r = 0; r < g.count; ++r) rows.push_back(first + r);
    }
    g.rows = values_on(rows, at::kLong, device);
  }
  return groups;
}

// G members' keys or values ([length_j, H, d] each) as one batch [G, H, longest, d], heads first:
// a view for one member, else zero-padded to the longest (the caller masks the padding).
inline at::Tensor padded_heads_first(const std::vector<at::Tensor>& parts, int64_t longest) {
  if (parts.size() == 1) return parts[0].transpose(0, 1).unsqueeze(0);
  const int64_t size = static_cast<int64_t>(parts.size());
  at::Tensor all = at::zeros({size, longest, parts[0].size(1), parts[0].size(2)}, parts[0].options());
  std::vector<at::Tensor> rows;
  for (int64_t j = 0; j < size; ++j) rows.push_back(all[j].narrow(0, 0, parts[j].size(0)));
  copy_all(rows, parts);
  return all.transpose(1, 2);
}

}  // namespace dflash
