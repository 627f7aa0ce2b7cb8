// fp8.h: the activation side of the target's block-scaled FP8 GEMMs (target/fp8.h wraps it; no
// torch in this interface).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::target::kernels {

// Quantises rows of bf16 x [rows, k] (k a multiple of 128, row r at x + r * stride, 8-byte
// aligned) in groups of 1x128: factor = max|group| / 448 (1 for an all-zero group), q = e4m3(x / factor) with
// round-to-nearest-even and saturation to +-448. q is written contiguous [rows, k]; the factors
// column-major, factor of (row r, group g) at factors[g * rows + r] (the layout cuBLASLt's
// 1x128 block scaling reads).
void quantize_groups_e4m3(const void* x, int64_t stride, int64_t rows, int64_t k, void* q, float* factors,
                          cudaStream_t stream);

}  // namespace dflash::target::kernels
