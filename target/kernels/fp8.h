// fp8.h: the activation side of the target's block-scaled FP8 GEMMs (target/fp8.h wraps it; no
// torch in this interface).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::target::kernels {

// Quantises rows of bf16 x [rows, k] (k a multiple of 128, row r at x + r * stride, 16-byte
// aligned) in groups of 1x128: factor = max|group| / 448 (1 for an all-zero group), q = e4m3(x / factor) with
// round-to-nearest-even and saturation to +-448. q is written contiguous [rows, k]; the factors
// column-major, factor of (row r, group g) at factors[g * factor_stride + r] (factor_stride >=
// rows: the layout cuBLASLt's 1x128 block scaling reads, with padding rows). With `gather`, row r
// of q is x's row gather[r] / gather_divisor (the MoE block's token of each pair in expert order),
// read in place.
void quantize_groups_e4m3(const void* x, int64_t stride, int64_t rows, int64_t k, void* q, float* factors,
                          int64_t factor_stride, cudaStream_t stream, const int64_t* gather = nullptr,
                          int64_t gather_divisor = 1);

// out = bf16(float(q) x factor) for `batches` block-scaled e4m3 matrices q [rows, cols] (cols a
// multiple of 8, contiguous) with factors fp32 [batches, ceil(rows / 128), ceil(cols / 128)];
// out bf16, contiguous, the same shape as q (the rounding of dequantising at load).
void dequantize_blocks_bf16(const void* q, const float* factors, int64_t batches, int64_t rows, int64_t cols, void* out,
                            cudaStream_t stream);

}  // namespace dflash::target::kernels
