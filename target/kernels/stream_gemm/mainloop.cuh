// mainloop.cuh: the stream-K GEMM's pipeline (stream_gemm.cu). Two producer threads stream the
// k-blocks of a CTA's range by TMA, W's into one ring of shared-memory stages and x's into
// another (common/smem_ring.cuh); two consumer warpgroups multiply each k-block on wgmma as both
// land and hand its stages back.
//
// The product is taken transposed, y^T = W . x^T: a tile's 128 rows of W are the wgmma's M (each
// consumer warpgroup owns 64 of them, one m64 product) and x's rows (the tokens, at most kTokens)
// are its N, so that a decoding step's few tokens fill the tensor cores' wide side and the
// weights, read once, are the operand that streams. (Tiles of 256 rows, two m64 products per
// warpgroup, streamed slower and doubled the sums handed between CTAs: bench/RESULTS.md.)
//
// Why two rings: W comes from memory and only bytes in flight hide its latency, x (every CTA
// reads the same rows) from L2. One ring of W + x stages spent half its room on x; W's ring is
// now as deep as shared memory allows, x's only as deep as L2's latency needs.
//
// A W stage holds the tile's rows x 64 columns, an x stage kTokens rows x 64 columns, both in
// the 128-byte swizzle that TMA writes and wgmma reads (wgmma.cuh's K-major layout: 128 bytes a
// row, 8-row groups 1024 bytes apart).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/mma_tile.cuh"
#include "common/smem_ring.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "target/kernels/stream_gemm/schedule.h"

namespace dflash::stream_gemm {

inline constexpr int kConsumerWarps = 8;  // two warpgroups
inline constexpr int kOutStride = kRowsPerTile + 8;  // the staged output's row (bf16), padded

// kStages buffers of kBytes, each read by the 8 consumer warps.
template <int kBytes, int kStages>
using Ring = smem_ring::Ring<kBytes, kStages, kConsumerWarps>;
using RingPosition = smem_ring::Position;

// W's and x's rings, and the output tile staged for coalesced stores ([token][row], rows padded
// by 8 so that the consumers' column-wise writes spread over the banks).
template <int kTokens, int kWStages, int kXStages>
struct Shared {
  Ring<kRowsPerTile * kBlockK * 2, kWStages> w;
  Ring<kTokens * kBlockK * 2, kXStages> x;
  alignas(16) __nv_bfloat16 out[kTokens][kOutStride];
};

// Where a unit's box starts in its tensor: x's at row 0 for every tile (per_tile 0); W's at the
// tile's first row (per_tile 128), or for a SwiGLU's stacked [gate; up] (up_rows >= 0) two boxes
// of 64 rows, the tile's gate rows and the same rows of up, the second landing 64 rows into the
// stage (so that warpgroup 0 multiplies the gate, warpgroup 1 the up rows).
struct BoxRows {
  int per_tile = 0;
  int64_t up_rows = -1;
};

// One thread: the k-blocks of every unit of the CTA's range [u, end), in order, into `ring`;
// `bytes` per stage (the tensor map's box: x's box has only the rows the product has, rounded up
// to 8).
template <typename R>
__device__ __forceinline__ void produce(R& ring, const void* map, const Schedule& schedule, int64_t u, int64_t end,
                                        BoxRows rows, uint32_t bytes, uint64_t policy) {
  RingPosition at;
  for (; u < end; ++u) {
    const int tile = static_cast<int>(u / schedule.k_blocks);
    const int column = static_cast<int>(u - static_cast<int64_t>(tile) * schedule.k_blocks) * kBlockK;
    ring.empty_at(at.stage).wait(at.phase ^ 1);
    const barriers::TransactionBarrier full = ring.full_at(at.stage);
    full.expect_bytes(bytes);
    if (rows.up_rows < 0) {
      tma::load_2d(ring.address(at.stage), map, column, tile * rows.per_tile, full.address, policy);
    } else {
      const int gate = tile * (kRowsPerTile / 2), up = static_cast<int>(rows.up_rows) + gate;
      tma::load_2d(ring.address(at.stage), map, column, gate, full.address, policy);
      tma::load_2d(ring.address(at.stage) + kRowsPerTile / 2 * 128, map, column, up, full.address, policy);
    }
    at.advance<R::kDepth>();
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

// Where a consumer warpgroup stands in both rings.
struct ConsumerPosition {
  RingPosition w, x;
};

// A consumer warpgroup's `k_blocks` k-blocks of one tile into `acc` (overwritten), each k-block's
// stages handed back once the products that read them have finished.
template <int kTokens, int kWStages, int kXStages>
__device__ __forceinline__ void consume_segment(Shared<kTokens, kWStages, kXStages>& shared,
                                                Accumulators<kTokens>& acc, ConsumerPosition& at, int k_blocks,
                                                int warpgroup) {
  const bool signals = (threadIdx.x & 31) == 0;
  ConsumerPosition previous{{-1, 0}, {-1, 0}};
  const auto release = [&](const ConsumerPosition& p) {
    if (p.w.stage >= 0 && signals) {
      shared.w.empty_at(p.w.stage).arrive();
      shared.x.empty_at(p.x.stage).arrive();
    }
  };
  for (int i = 0; i < k_blocks; ++i) {
    shared.w.full_at(at.w.stage).wait(at.w.phase);
    shared.x.full_at(at.x.stage).wait(at.x.phase);
    multiply_stage(acc, shared.w.address(at.w.stage), shared.x.address(at.x.stage), warpgroup, i == 0);
    wgmma::wait<1>(acc.c);
    release(previous);
    previous = at;
    at.w.advance<kWStages>();
    at.x.advance<kXStages>();
  }
  wgmma::wait<0>(acc.c);
  release(previous);
}

}  // namespace dflash::stream_gemm
