// fused_ops.h: the target forward's residual add + RMSNorm and SiLU-mul, as one CUDA kernel
// each where they can run (bf16 on a GPU, contiguous rows, sizes multiple of 8), as the
// composite ATen expression otherwise (CPU, other dtypes). Same roundings either way
// (target/kernels/elementwise.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <utility>

namespace dflash::target {

// rms_norm(x) (common/tensor_math.h) over the last dimension of a 2-D x.
at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred);

// {x + delta, rms_norm(x + delta)}: the residual stream and the next sub-layer's input.
std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps, bool zero_centred);

// silu(gate) * up, as HF's MLP rounds it.
at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up);

}  // namespace dflash::target
