// layer_ops.h: the drafter layers' element-wise work, differentiable: computed by the CUDA
// kernels of drafter/kernels/layer_ops.h where they apply (bf16 on a GPU, sizes a multiple of 8),
// the composite ATen expression under autograd otherwise (CPU, fp32: the parity tests' path),
// with the composite's roundings either way.
#pragma once

#include <ATen/core/Tensor.h>

namespace dflash::drafter {

// common/tensor_math.h's rms_norm (the published trainers' Qwen3RMSNorm) over the last
// dimension of x; weight [x.size(-1)].
at::Tensor trained_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

// silu(gate) * up (the SwiGLU MLP's product); gate and up of one shape.
at::Tensor trained_silu_mul(const at::Tensor& gate, const at::Tensor& up);

// The rotary embedding x cos + rotate_half(x) sin (common/tensor_math.h) of x [rows, heads, d] by
// tables cos, sin [rows, 1, d] (no gradient taken for them).
at::Tensor trained_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace dflash::drafter
