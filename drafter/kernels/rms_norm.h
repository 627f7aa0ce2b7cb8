// rms_norm.h: the drafter's RMSNorm forward and backward as CUDA kernels over bf16 rows (no
// torch in this interface; drafter/rms_norm.cc wraps them in an autograd function). The
// composite version (common/tensor_math.h rms_norm under autograd) makes about seven fp32
// passes forward and a dozen backward per norm and keeps fp32 copies of its input for the
// backward; these read and write each row a few times in bf16 and keep one fp32 per row.
// Same roundings as the composite: y = bf16(w * bf16(x * r)), r = rsqrt(mean(x^2) + eps).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::drafter::kernels {

// Rows of n bf16 (n a multiple of 8; n / 8 at least 32 or a power of two), all contiguous and
// 16-byte aligned. Writes y and r per row (fp32).
void rms_norm_forward(const void* x, const void* weight, void* y, float* rstd, int64_t rows, int n, float eps,
                      cudaStream_t stream);

// dx = bf16(r g - x r^3 (sum_j g_j x_j) / n) with g = bf16(dy * w): the composite's gradient.
void rms_norm_backward_input(const void* x, const void* weight, const void* dy, const float* rstd, void* dx,
                             int64_t rows, int n, cudaStream_t stream);

// The weight's gradient in fixed-order partial sums: partial[p][j] = sum over the rows of part p
// of dy[r][j] * bf16(x[r][j] r); the caller adds the parts (rms_norm_weight_parts of them).
int64_t rms_norm_weight_parts(int64_t rows, int n);
void rms_norm_backward_weight(const void* x, const void* dy, const float* rstd, float* partial, int64_t rows, int n,
                              cudaStream_t stream);

}  // namespace dflash::drafter::kernels
