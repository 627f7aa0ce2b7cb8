// layer_ops.h: the drafter layers' element-wise work with gradients, as CUDA kernels over bf16
// (no torch in this interface; drafter/layer_ops.cc wraps them in autograd functions).
//
// RMSNorm forward and backward over rows. The
// composite version (common/tensor_math.h rms_norm under autograd) makes about seven fp32
// passes forward and a dozen backward per norm and keeps fp32 copies of its input for the
// backward; these read and write each row a few times in bf16 and keep one fp32 per row.
// Same roundings as the composite: y = bf16(w * bf16(x * r)), r = rsqrt(mean(x^2) + eps).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::drafter::kernels {

// Whether the kernels take rows of n elements: n a multiple of 8 (up to 2^30) with n / 8 at
// least 32 or a power of two (lanes of a warp share a row).
bool rms_norm_supports(int64_t n);

// Rows of n bf16 (rms_norm_supports(n)), all contiguous and 16-byte aligned. Writes y and r per
// row (fp32).
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

// SwiGLU's product y = bf16(bf16(silu(gate)) * up) and its gradients as autograd forms them
// from the composite expression: d_up = bf16(dy * bf16(silu(gate))), d_gate =
// bf16(bf16(dy * up) * s (1 + gate (1 - s))) with s = sigmoid(gate). Contiguous, 16-byte aligned,
// `elements` a multiple of 8. One pass each instead of two forward and four backward.
void silu_mul_forward(const void* gate, const void* up, void* y, int64_t elements, cudaStream_t stream);
void silu_mul_backward(const void* gate, const void* up, const void* dy, void* d_gate, void* d_up, int64_t elements,
                       cudaStream_t stream);

// The rotary embedding y = bf16(bf16(x cos) + bf16(rotate_half(x) sin)), rotate_half(x) = [-x2,
// x1], over `rows` tokens of `heads` rows of d (a multiple of 16: rope_supports) with one cos /
// sin row of d per token, and its gradient as autograd forms it from that expression: dx =
// bf16(bf16(dy cos) + bf16(dy2 sin2)) on the first half, bf16(bf16(dy cos) - bf16(dy1 sin1)) on the
// second. Contiguous, 16-byte aligned. One pass each instead of five kernels forward and about
// seven backward.
bool rope_supports(int64_t d);
void rope_forward(const void* x, const void* cos, const void* sin, void* y, int64_t rows, int heads, int d,
                  cudaStream_t stream);
void rope_backward(const void* dy, const void* cos, const void* sin, void* dx, int64_t rows, int heads, int d,
                   cudaStream_t stream);

}  // namespace dflash::drafter::kernels
