// The weight-streaming GEMM of a decoding step's projections: see skinny_gemm.h.
#include "target/kernels/skinny_gemm.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/mma_tile.cuh"
#include "common/wgmma.cuh"

namespace dflash::target::kernels {
namespace {

using mma_tile::aligned_shared;
using mma_tile::D;
using mma_tile::kSharedAlignment;
using mma_tile::load_tile;
using mma_tile::R;
using mma_tile::Tile;
using bf16 = __nv_bfloat16;

constexpr int kThreads = 128;  // one warpgroup
constexpr int kStages = 4;

// One stage: a 64-feature x 128-k tile of W and the rows' tiles over the same k.
template <int kRowTiles>
struct Stage {
  Tile w;
  Tile x[kRowTiles];
};
template <int kRowTiles>
struct Shared {
  Stage<kRowTiles> stage[kStages];
};

struct Problem {
  const bf16* x;
  int64_t x_stride;
  const bf16* w;
  int m, n, k;
  bf16* y;          // splits == 1
  float* partials;  // splits > 1: [splits, m, n]
  int splits;
};

// Mainloop: chunk c's loads were issued kStages - 1 chunks ahead; its products run while the
// next chunks load, and a stage is reloaded only after the products that read it finished.
template <int kRowTiles>
__global__ void __launch_bounds__(kThreads) skinny_gemm_kernel(Problem p) {
  extern __shared__ unsigned char raw[];
  Shared<kRowTiles>& sh = aligned_shared<Shared<kRowTiles>>(raw);
  const int n0 = blockIdx.x * R, split = blockIdx.y;
  const int chunks = p.k / D, per = (chunks + p.splits - 1) / p.splits;
  const int c0 = split * per, c1 = min(chunks, c0 + per);
  const int features = min(R, p.n - n0);

  auto load = [&](int chunk, int slot) {
    Stage<kRowTiles>& st = sh.stage[slot];
    load_tile<kThreads>(st.w, p.w + static_cast<int64_t>(n0) * p.k + chunk * D, p.k, features);
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) {
      load_tile<kThreads>(st.x[t], p.x + t * R * p.x_stride + chunk * D, p.x_stride, min(R, p.m - t * R));
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (c0 + s < c1) load(c0 + s, s);
    __pipeline_commit();
  }
  float acc[kRowTiles][8][4] = {};
  for (int c = c0; c < c1; ++c) {
    const int i = c - c0;
    __pipeline_wait_prior(kStages - 2);  // chunk c landed (this thread's copies)
    __syncthreads();                     // ... and every thread's
    const Stage<kRowTiles>& st = sh.stage[i % kStages];
#pragma unroll
    for (int t = 0; t < kRowTiles; ++t) wgmma::issue_accumulate_product(acc[t], st.w, st.x[t]);
    // Chunk c - 1's products are done once at most this chunk's groups are pending: its stage
    // (the one chunk c + kStages - 1 loads into) is free for every warp after the barrier.
    wgmma::wait<kRowTiles>();
    __syncthreads();
    if (c + kStages - 1 < c1) load(c + kStages - 1, (i + kStages - 1) % kStages);
    __pipeline_commit();
  }
  wgmma::wait<0>();
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) wgmma::fence_operands(acc[t]);

  // Epilogue: warp w holds features [16 w, 16 w + 16), lane (g, q) features g and g + 8 of them
  // and rows 8 j + 2 q, + 1 of each row tile.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, q = lane % 4;
#pragma unroll
  for (int t = 0; t < kRowTiles; ++t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int feature = n0 + 16 * warp + g + (e >= 2 ? 8 : 0), row = t * R + 8 * j + 2 * q + (e & 1);
        if (feature >= p.n || row >= p.m) continue;
        const int64_t at = static_cast<int64_t>(row) * p.n + feature;
        if (p.splits == 1) {
          p.y[at] = __float2bfloat16(acc[t][j][e]);
        } else {
          p.partials[static_cast<int64_t>(split) * p.m * p.n + at] = acc[t][j][e];
        }
      }
    }
  }
}

// y = bf16(sum over splits of the partial sums), in split order.
__global__ void sum_splits_kernel(const float* __restrict__ partials, int64_t count, int splits, bf16* __restrict__ y) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float sum = partials[i];
    for (int s = 1; s < splits; ++s) sum += partials[s * count + i];
    y[i] = __float2bfloat16(sum);
  }
}

template <int kRowTiles>
void launch(const Problem& p, cudaStream_t stream) {
  const std::size_t shared = sizeof(Shared<kRowTiles>) + kSharedAlignment;
  allow_shared_memory(skinny_gemm_kernel<kRowTiles>, shared, "skinny_gemm_bf16");
  const dim3 grid(static_cast<unsigned>((p.n + R - 1) / R), static_cast<unsigned>(p.splits));
  skinny_gemm_kernel<kRowTiles><<<grid, kThreads, shared, stream>>>(p);
  check_cuda_launch("skinny_gemm_bf16");
}

}  // namespace

int skinny_gemm_splits(int64_t n, int64_t k, int sms) {
  // About two waves of one CTA per SM, each split at least 8 chunks of 128 long.
  const int64_t tiles = (n + R - 1) / R, chunks = k / D;
  const int64_t wanted = (2 * static_cast<int64_t>(sms) + tiles - 1) / tiles;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, chunks / 8)));
}

bool skinny_gemm_built_for_current_device() {
#ifdef DFLASHD_CUDA_SM90A
  int device = 0, major = 0, minor = 0;
  check_cuda(cudaGetDevice(&device), "current device");
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "compute capability");
  return major == 9 && minor == 0;
#else
  return false;
#endif
}

void skinny_gemm_bf16(const void* x, int64_t x_stride, const void* w, int64_t m, int64_t n, int64_t k, void* y,
                      float* partials, int splits, cudaStream_t stream) {
  if (m > kSkinnyMaxRows || k % D != 0 || x_stride % 8 != 0 || splits < 1 || (splits > 1 && partials == nullptr)) {
    throw std::invalid_argument("skinny_gemm_bf16: " + std::to_string(m) + " rows (at most 128), k " +
                                std::to_string(k) + " (a multiple of 128), " + std::to_string(splits) + " splits");
  }
  if (m == 0 || n == 0) return;
  const Problem p{static_cast<const bf16*>(x), x_stride, static_cast<const bf16*>(w), static_cast<int>(m),
                  static_cast<int>(n), static_cast<int>(k), static_cast<bf16*>(y), partials, splits};
  m <= R ? launch<1>(p, stream) : launch<2>(p, stream);
  if (splits > 1) {
    const int64_t count = m * n;
    sum_splits_kernel<<<grid_stride_blocks(count, 256), 256, 0, stream>>>(partials, count, splits,
                                                                          static_cast<bf16*>(y));
    check_cuda_launch("skinny_gemm_bf16 (sum of the splits)");
  }
}

}  // namespace dflash::target::kernels
