// The LM-head loss kernels: see cross_entropy.h.
#include "drafter/kernels/cross_entropy.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <stdexcept>
#include <string>

#include "common/bf16x8.cuh"
#include "common/cuda_check.h"

namespace dflash::drafter::kernels {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kStatsThreads = 512;
constexpr int kGradThreads = 256;

// Running (max, sum of exp(x - max), first index of the max).
struct Stats {
  float m;
  float s;
  int i;
};

__device__ __forceinline__ Stats merge(Stats a, Stats b) {
  if (b.m > a.m || (b.m == a.m && b.i < a.i)) {
    const Stats t = a;
    a = b;
    b = t;
  }
  // a holds the larger maximum (ties: the smaller index).
  const float s = a.s + (b.s == 0.f ? 0.f : b.s * __expf(b.m - a.m));
  return {a.m, s, a.i};
}

__global__ void __launch_bounds__(kStatsThreads) row_stats_kernel(const bf16* __restrict__ logits, int vocab, int64_t ld,
                                                                  const int64_t* __restrict__ labels,
                                                                  float* __restrict__ lse, float* __restrict__ picked,
                                                                  int64_t* __restrict__ argmax) {
  const int r = blockIdx.x;
  const bf16* row = logits + static_cast<int64_t>(r) * ld;
  Stats st{-INFINITY, 0.f, 0x7fffffff};
  for (int v = threadIdx.x * 8; v < vocab; v += kStatsThreads * 8) {
    float f[8], m = -INFINITY;
    bf16x8::load8(f, row + v);
    int at = 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (f[j] > m) {
        m = f[j];
        at = j;
      }
    }
    float s = 0.f;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += __expf(f[j] - m);
    st = merge(st, Stats{m, s, v + at});
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const Stats o{__shfl_xor_sync(0xffffffffu, st.m, off), __shfl_xor_sync(0xffffffffu, st.s, off),
                  __shfl_xor_sync(0xffffffffu, st.i, off)};
    st = merge(st, o);
  }
  __shared__ Stats warps[kStatsThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = st;
  __syncthreads();
  if (threadIdx.x == 0) {
    Stats all = warps[0];
    for (int w = 1; w < kStatsThreads / 32; ++w) all = merge(all, warps[w]);
    lse[r] = all.m + logf(all.s);
    argmax[r] = all.i;
    picked[r] = __bfloat162float(row[labels[r]]);
  }
}

__global__ void __launch_bounds__(kGradThreads) gradient_kernel(bf16* __restrict__ logits, int vocab, int64_t ld,
                                                                const int64_t* __restrict__ labels,
                                                                const float* __restrict__ lse,
                                                                const float* __restrict__ scale) {
  const int r = blockIdx.y;
  const int v = (blockIdx.x * kGradThreads + threadIdx.x) * 8;
  if (v >= vocab) return;
  const float l = lse[r], k = scale[r];
  const int64_t label = labels[r];
  bf16* p = logits + static_cast<int64_t>(r) * ld + v;
  float x[8];
  bf16x8::load8(x, p);
#pragma unroll
  for (int j = 0; j < 8; ++j) x[j] = (__expf(x[j] - l) - (v + j == label ? 1.f : 0.f)) * k;
  bf16x8::store8(p, x);
}

}  // namespace

void logit_row_stats(const void* logits, int rows, int vocab, int64_t ld, const int64_t* labels, float* lse,
                     float* picked, int64_t* argmax, cudaStream_t stream) {
  if (rows == 0) return;
  row_stats_kernel<<<rows, kStatsThreads, 0, stream>>>(static_cast<const bf16*>(logits), vocab, ld, labels, lse, picked,
                                                       argmax);
  check_cuda_launch("LM-head loss kernel row stats");
}

void logit_gradient(void* logits, int rows, int vocab, int64_t ld, const int64_t* labels, const float* lse,
                    const float* scale, cudaStream_t stream) {
  for (int first = 0; first < rows; first += 65535) {  // grid.y limit
    const int n = rows - first < 65535 ? rows - first : 65535;
    const dim3 grid((vocab / 8 + kGradThreads - 1) / kGradThreads, n);
    gradient_kernel<<<grid, kGradThreads, 0, stream>>>(static_cast<bf16*>(logits) + first * ld, vocab, ld, labels + first,
                                                       lse + first, scale + first);
    check_cuda_launch("LM-head loss kernel gradient");
  }
}

}  // namespace dflash::drafter::kernels
