// rms_norm.h: the drafter's RMSNorm, differentiable: common/tensor_math.h's rms_norm (the
// published trainers' Qwen3RMSNorm) computed by the CUDA kernels of drafter/kernels/rms_norm.h
// where they apply (bf16 on a GPU, rows of a multiple of 8 elements), the composite ATen
// expression under autograd otherwise (CPU, fp32: the parity tests' path).
#pragma once

#include <ATen/core/Tensor.h>

namespace dflash::drafter {

// Over the last dimension of x; weight [x.size(-1)].
at::Tensor trained_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

}  // namespace dflash::drafter
