// grouped_fp8.h: a block-scaled FP8 GEMM over groups of rows, each group with its own weight: y
// [m, n] rows of group g = x's rows of group g . W_g^T, the MoE experts' gate/up and down products
// with FP8 experts (target.dtype: float8 or a *-FP8 checkpoint). Kernel in grouped_fp8.cu, pieces
// in grouped_fp8/ (schedule, TMA + wgmma mainloop with the factors applied per k-block, epilogue).
// No torch headers here.
//
// The arithmetic is the block-scaled GEMM's (target/fp8.h): x in e4m3 with an fp32 factor per
// 1x128 group of each row, W_g in e4m3 with one per 128x128 block; each 128-wide k-block's e4m3
// products are summed in fp32 by the tensor cores, multiplied by the row's and the block's
// factors and added in fp32; y rounded to bf16 once.
//
// Why: ATen's FP8 grouped GEMM takes per-tensor or row-wise factors only on Hopper, not the
// checkpoints' 128x128 blocks, and cuBLASLt has no grouped block-scaled product; without this
// kernel each forward dequantized a layer's experts to bf16 first (bench/RESULTS.md, session 18:
// the 35B-A3B FP8 forward slower than bf16). The dense projections stay on cuBLASLt: kernels of
// ours for them, built from these pieces, ran at 0.74-0.84x its speed (bench/RESULTS.md, session
// 33).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

namespace dflash::grouped_fp8 {

inline constexpr int kMaxGroups = 1024;  // the MoE block's largest expert count (kernels/moe.h)

// A benchmark hook (the daemon never sets it): FP8 experts are dequantized per layer for ATen's
// bf16 grouped GEMM instead (the path before this kernel), to compare the two in one process.
inline std::atomic<bool> off{false};

struct Problem {
  const void* x = nullptr;             // e4m3 [m, k], rows x_stride bytes apart, sorted by group
  int64_t x_stride = 0;                // a multiple of 16, >= k
  const float* x_factors = nullptr;    // row r's factor of k-group j at x_factors[j * factor_stride + r]
  int64_t factor_stride = 0;           // >= m (fp8.h's column-major layout, padding rows allowed)
  const void* w = nullptr;             // e4m3 [groups, n, k] contiguous
  const float* w_factors = nullptr;    // fp32 [groups, ceil(n / 128), k / 128] contiguous
  const int32_t* ends = nullptr;       // on the device, [groups]: group g's rows are [ends[g - 1],
                                       // ends[g]) (ends[-1] = 0), non-decreasing, ends[groups - 1]
                                       // <= m; nullptr: one group of every row (groups must be 1)
  void* y = nullptr;                   // bf16 [m, n] contiguous; rows past ends[groups - 1] are
                                       // not written
  int64_t m = 0, n = 0, k = 0;
  int groups = 1;
};

// Whether this build carries the kernel for `device` (sm_90a: compute capability 9.0).
bool built_for(int device);

// Whether the kernel was built for this GPU (built_for), `off` is down, and it takes weights of
// `groups` x [n, k] at w: n a multiple of 8 (y's rows 16-byte aligned) and k
// of 128, groups * n below 2^31, groups 1..kMaxGroups, w 16-byte aligned.
bool weights_apply(int64_t groups, int64_t n, int64_t k, const void* w, int device);

// weights_apply, and the rest of the problem fits: m below 2^31, x and y 16-byte aligned, x's
// rows at least k and a multiple of 16 bytes apart, factor_stride >= m, ends given unless there
// is one group.
bool applies(const Problem& p, int device);

// Runs the product on `stream` (one persistent CTA per SM; no host synchronisation: the group
// sizes are read on the device). Throws naming the shape where applies() is false.
void run(const Problem& p, int device, cudaStream_t stream);

}  // namespace dflash::grouped_fp8
