// skinny_gemm.h: the target's bf16 projections at a decoding step's few rows (no torch in this
// interface; target/layers.cc calls it through skinny_gemm_unavailable / skinny_gemm_bf16).
//
// At 16-128 rows a projection is bound by reading its weights (a 27B forward reads about 50 GB
// of them), but cuBLAS(Lt) reads them at about 3.2 TB/s there (bench/RESULTS.md, session 17).
// This kernel streams the weights once through shared memory with the rows held beside them:
//   - a CTA is one warpgroup computing 64 output features x all rows, y^T = W . x^T on wgmma
//     (W's 64 x 128 tile is the A operand, the rows' tiles the B operand: no transposes);
//   - the reduction (k) is cut into `splits` ranges, each a CTA, so that every SM streams: the
//     fp32 partial sums go to a buffer (L2-resident at these sizes) and one pass adds them in
//     split order and rounds to bf16: the result does not depend on scheduling;
//   - four stages of cp.async loads keep about 50 KB of weights in flight per SM.
// Hopper only (wgmma, built for sm_90a).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::target::kernels {

constexpr int64_t kSkinnyMaxRows = 128;

// The k-ranges the kernel cuts a [n, k] weight into on a GPU of `sms` multiprocessors (1: no
// partial sums).
int skinny_gemm_splits(int64_t n, int64_t k, int sms);

// Whether this build and the current device run the kernel (sm_90a built, compute capability 9.0).
bool skinny_gemm_built_for_current_device();

// y [m, n] bf16 contiguous = x [m, k] . W^T, W [n, k] bf16 contiguous, x rows at x + r * x_stride
// (16-byte aligned); m <= kSkinnyMaxRows, k a multiple of 128. partials: fp32 room for splits x m x
// n values when splits > 1 (skinny_gemm_splits), else unused.
void skinny_gemm_bf16(const void* x, int64_t x_stride, const void* w, int64_t m, int64_t n, int64_t k, void* y,
                      float* partials, int splits, cudaStream_t stream);

}  // namespace dflash::target::kernels
