#include "target/fused_ops.h"

#include <ATen/ATen.h>

#include "common/tensor_math.h"

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "target/kernels/elementwise.h"
#endif

namespace dflash::target {
namespace {

bool kernels_apply(std::initializer_list<const at::Tensor*> tensors) {
#ifdef DFLASHD_WITH_CUDA
  for (const at::Tensor* t : tensors) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->size(-1) % 8 != 0) return false;
  }
  return true;
#else
  (void)tensors;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
                                            double eps, bool zero_centred) {
  const bool fused = delta ? kernels_apply({&x, delta, &weight}) : kernels_apply({&x, &weight});
  if (!fused || x.dim() != 2) {
    const at::Tensor sum = delta ? x + *delta : x;
    return {sum, rms_norm(sum, weight, eps, zero_centred)};
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor sum = delta ? at::empty_like(x) : x;
  at::Tensor normed = at::empty_like(x);
  kernels::add_rms_norm(x.data_ptr(), delta ? delta->data_ptr() : nullptr, weight.data_ptr(), sum.data_ptr(),
                        normed.data_ptr(), static_cast<int>(x.size(0)), static_cast<int>(x.size(1)),
                        static_cast<float>(eps), zero_centred, at::cuda::getCurrentCUDAStream().stream());
  return {sum, normed};
#else
  return {};
#endif
}

}  // namespace

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred) {
  return norm_rows(x, nullptr, weight, eps, zero_centred).second;
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps, bool zero_centred) {
  return norm_rows(x, &delta, weight, eps, zero_centred);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  if (!kernels_apply({&gate, &up}) || gate.sizes() != up.sizes()) return at::silu(gate) * up;
#ifdef DFLASHD_WITH_CUDA
  at::Tensor out = at::empty_like(gate);
  kernels::silu_mul(gate.data_ptr(), up.data_ptr(), out.data_ptr(), gate.numel(), at::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  return {};
#endif
}

}  // namespace dflash::target
