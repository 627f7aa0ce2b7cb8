// tensor_math.h: the small tensor helpers the target and the drafter share (header-only, for
// translation units that already use ATen; the dflash_common library itself stays torch-free).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <vector>

namespace dflash {

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

}  // namespace dflash
