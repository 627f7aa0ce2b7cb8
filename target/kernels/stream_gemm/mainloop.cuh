// mainloop.cuh: the stream-K GEMM's pipeline (stream_gemm.cu). One producer thread streams the
// k-blocks of a CTA's range into a ring of shared-memory stages by TMA; two consumer warpgroups
// multiply each stage on wgmma as it lands and hand it back.
//
// The product is taken transposed, y^T = W . x^T: a tile's 128 rows of W are the wgmma's M (each
// consumer warpgroup owns 64 of them, one m64 product) and x's rows (the tokens, at most kTokens)
// are its N, so that a decoding step's few tokens fill the tensor cores' wide side and the
// weights, read once, are the operand that streams. (Tiles of 256 rows, two m64 products per
// warpgroup, streamed slower and doubled the sums handed between CTAs: bench/RESULTS.md.)
//
// Stage s holds W's tile rows x 64 columns and x's kTokens rows x 64 columns, both in the
// 128-byte swizzle that TMA writes and wgmma reads (wgmma.cuh's K-major layout: 128 bytes a row,
// 8-row groups 1024 bytes apart). full[s] completes when the producer's bytes have landed;
// empty[s] when each of the 8 consumer warps has finished reading it.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/mma_tile.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "target/kernels/stream_gemm/schedule.h"

namespace dflash::stream_gemm {

inline constexpr int kConsumerWarps = 8;  // two warpgroups
inline constexpr int kOutStride = kRowsPerTile + 8;  // the staged output's row (bf16), padded

// The ring, and the output tile staged for coalesced stores ([token][row], rows padded by 8 so
// that the consumers' column-wise writes spread over the banks).
template <int kTokens, int kStages>
struct Shared {
  static constexpr int kWBytes = kRowsPerTile * kBlockK * 2;
  static constexpr int kXBytes = kTokens * kBlockK * 2;
  alignas(1024) unsigned char w[kStages][kWBytes];
  alignas(1024) unsigned char x[kStages][kXBytes];
  alignas(16) __nv_bfloat16 out[kTokens][kOutStride];
  uint64_t full[kStages];
  uint64_t empty[kStages];
};

// A position in the ring: the stage and the parity of its current use.
struct RingPosition {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

template <typename S>
__device__ __forceinline__ barriers::TransactionBarrier full_barrier(S& shared, int stage) {
  return {mma_tile::shared_address(&shared.full[stage])};
}
template <typename S>
__device__ __forceinline__ barriers::TransactionBarrier empty_barrier(S& shared, int stage) {
  return {mma_tile::shared_address(&shared.empty[stage])};
}

// One thread: every unit of the CTA's range [u, end), in order, one stage each. The kernel is a
// programmatic dependent of the stream's previous kernel (launch.h), which may still be writing
// x: W, which no kernel writes, starts streaming into the first stages before the wait for that
// kernel, x after it.
template <int kTokens, int kStages>
__device__ __forceinline__ void produce(Shared<kTokens, kStages>& shared, const void* w_map, const void* x_map,
                                        const Schedule& schedule, int64_t u, int64_t end) {
  using S = Shared<kTokens, kStages>;
  const uint64_t stream = tma::evict_first(), keep = tma::evict_last();
  const auto column_of = [&](int64_t unit, int& tile) {
    tile = static_cast<int>(unit / schedule.k_blocks);
    return static_cast<int>(unit - static_cast<int64_t>(tile) * schedule.k_blocks) * kBlockK;
  };
  const int64_t primed = end - u < kStages ? end - u : kStages;
  for (int s = 0; s < primed; ++s) {  // the first stages are free: no wait
    int tile = 0;
    const int column = column_of(u + s, tile);
    const barriers::TransactionBarrier full = full_barrier(shared, s);
    full.expect_bytes(S::kWBytes + S::kXBytes);
    tma::load_2d(mma_tile::shared_address(shared.w[s]), w_map, column, tile * kRowsPerTile, full.address, stream);
  }
  barriers::wait_for_prerequisite();
  for (int s = 0; s < primed; ++s) {
    int tile = 0;
    const int column = column_of(u + s, tile);
    tma::load_2d(mma_tile::shared_address(shared.x[s]), x_map, column, 0, full_barrier(shared, s).address, keep);
  }
  RingPosition at;
  for (int s = 0; s < primed; ++s) at.advance<kStages>();
  for (u += primed; u < end; ++u) {
    int tile = 0;
    const int column = column_of(u, tile);
    empty_barrier(shared, at.stage).wait(at.phase ^ 1);
    const barriers::TransactionBarrier full = full_barrier(shared, at.stage);
    full.expect_bytes(S::kWBytes + S::kXBytes);
    tma::load_2d(mma_tile::shared_address(shared.w[at.stage]), w_map, column, tile * kRowsPerTile, full.address,
                 stream);
    tma::load_2d(mma_tile::shared_address(shared.x[at.stage]), x_map, column, 0, full.address, keep);
    at.advance<kStages>();
  }
}

// The consumer warpgroup's accumulators: its 64 rows of the tile by the tokens (columns), in
// mma_tile's m16n8 layout per warp (wgmma.cuh).
template <int kTokens>
struct Accumulators {
  float c[kTokens / 8][4];
};

template <int kTokens>
__device__ __forceinline__ void multiply_stage(Accumulators<kTokens>& acc, uint32_t w_stage, uint32_t x_stage,
                                               int warpgroup, bool first) {
  wgmma::arrive();
#pragma unroll
  for (int step = 0; step < kBlockK / 16; ++step) {
    const uint64_t a = wgmma::descriptor(w_stage + warpgroup * 64 * 128 + step * 32, 16, 1024);
    const uint64_t b = wgmma::descriptor(x_stage + step * 32, 16, 1024);
    const int accumulate = !(first && step == 0);
    if constexpr (kTokens == 128) {
      wgmma::mma_64x128(acc.c, a, b, accumulate);
    } else {
      wgmma::mma_64x64(acc.c, a, b, accumulate);
    }
  }
  wgmma::commit();
}

// A consumer warpgroup's k-blocks [k_begin, k_end) of one tile into `acc` (overwritten), each
// stage handed back once the products that read it have finished.
template <int kTokens, int kStages>
__device__ __forceinline__ void consume_segment(Shared<kTokens, kStages>& shared, Accumulators<kTokens>& acc,
                                                RingPosition& at, int k_blocks, int warpgroup) {
  const bool signals = (threadIdx.x & 31) == 0;
  int previous = -1;
  for (int i = 0; i < k_blocks; ++i) {
    full_barrier(shared, at.stage).wait(at.phase);
    multiply_stage(acc, mma_tile::shared_address(shared.w[at.stage]), mma_tile::shared_address(shared.x[at.stage]),
                   warpgroup, i == 0);
    wgmma::wait<1>(acc.c);
    if (previous >= 0 && signals) empty_barrier(shared, previous).arrive();
    previous = at.stage;
    at.advance<kStages>();
  }
  wgmma::wait<0>(acc.c);
  if (previous >= 0 && signals) empty_barrier(shared, previous).arrive();
}

}  // namespace dflash::stream_gemm
