// The target forward's fused element-wise kernels: see elementwise.h.
#include "target/kernels/elementwise.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"

namespace dflash::target::kernels {
namespace {

using bf16 = __nv_bfloat16;
constexpr int kNormThreads = 256;

__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// One CTA per row: pass 1 forms the (rounded) sum and its sum of squares, pass 2 rereads it
// (from L1/L2: a row is a few KB) and writes the normalised row.
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const bf16* __restrict__ x,
                                                                    const bf16* __restrict__ delta,
                                                                    const bf16* __restrict__ weight,
                                                                    bf16* __restrict__ sum_out,
                                                                    bf16* __restrict__ normed_out, int n, float eps,
                                                                    bool zero_centred) {
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  const bf16* src = delta != nullptr ? sum_out + base : x + base;
  float squares = 0.f;
  for (int c = threadIdx.x * 8; c < n; c += kNormThreads * 8) {
    uint4 raw = *reinterpret_cast<const uint4*>(x + base + c);
    bf16* v = reinterpret_cast<bf16*>(&raw);
    if (delta != nullptr) {
      const uint4 draw = *reinterpret_cast<const uint4*>(delta + base + c);
      const bf16* d = reinterpret_cast<const bf16*>(&draw);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = __float2bfloat16(__bfloat162float(v[j]) + __bfloat162float(d[j]));
      *reinterpret_cast<uint4*>(sum_out + base + c) = raw;
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float f = __bfloat162float(v[j]);
      squares += f * f;
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, off);
  __shared__ float warps[kNormThreads / 32];
  __shared__ float scale;
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = squares;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
    for (int w = 0; w < kNormThreads / 32; ++w) total += warps[w];
    scale = rsqrtf(total / static_cast<float>(n) + eps);
  }
  __syncthreads();
  const float r = scale;
  for (int c = threadIdx.x * 8; c < n; c += kNormThreads * 8) {
    uint4 raw = *reinterpret_cast<const uint4*>(src + c);
    const uint4 wraw = *reinterpret_cast<const uint4*>(weight + c);
    bf16* v = reinterpret_cast<bf16*>(&raw);
    const bf16* w = reinterpret_cast<const bf16*>(&wraw);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float normed = __bfloat162float(v[j]) * r;
      const float wf = __bfloat162float(w[j]);
      v[j] = __float2bfloat16(zero_centred ? normed * (wf + 1.f) : wf * round_bf16(normed));
    }
    *reinterpret_cast<uint4*>(normed_out + base + c) = raw;
  }
}

__global__ void silu_mul_kernel(const bf16* __restrict__ gate, const bf16* __restrict__ up, bf16* __restrict__ out,
                                int64_t chunks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint4 graw = reinterpret_cast<const uint4*>(gate)[i];
    const uint4 uraw = reinterpret_cast<const uint4*>(up)[i];
    const bf16* g = reinterpret_cast<const bf16*>(&graw);
    const bf16* u = reinterpret_cast<const bf16*>(&uraw);
    uint4 oraw;
    bf16* o = reinterpret_cast<bf16*>(&oraw);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float x = __bfloat162float(g[j]);
      const float silu = round_bf16(x / (1.f + __expf(-x)));
      o[j] = __float2bfloat16(silu * __bfloat162float(u[j]));
    }
    reinterpret_cast<uint4*>(out)[i] = oraw;
  }
}

}  // namespace

void add_rms_norm(const void* x, const void* delta, const void* weight, void* sum_out, void* normed_out, int rows, int n,
                  float eps, bool zero_centred, cudaStream_t stream) {
  if (rows == 0) return;
  add_rms_norm_kernel<<<rows, kNormThreads, 0, stream>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(delta), static_cast<const bf16*>(weight),
      static_cast<bf16*>(sum_out), static_cast<bf16*>(normed_out), n, eps, zero_centred);
  check_cuda_launch("target kernel add_rms_norm");
}

void silu_mul(const void* gate, const void* up, void* out, int64_t elements, cudaStream_t stream) {
  const int64_t chunks = elements / 8;
  if (chunks == 0) return;
  const int threads = 256;
  const int64_t blocks = std::min<int64_t>((chunks + threads - 1) / threads, 132 * 16);
  silu_mul_kernel<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(static_cast<const bf16*>(gate),
                                                                        static_cast<const bf16*>(up),
                                                                        static_cast<bf16*>(out), chunks);
  check_cuda_launch("target kernel silu_mul");
}

}  // namespace dflash::target::kernels
