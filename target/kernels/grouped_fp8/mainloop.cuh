// mainloop.cuh: the FP8 grouped GEMM's pipeline (grouped_fp8.cu). One producer thread streams,
// for each tile the CTA takes (schedule.h) and each of its k-blocks, the tile's 128 rows of x and
// its rows of W_g (128 e4m3 columns each) by TMA into one stage of a ring (common/smem_ring.cuh).
// Two consumer warpgroups, 64 rows of x each, multiply the stage on wgmma into a k-block's fp32
// sums, hand the stage back, and add those sums times the row's factor and the block's factor
// into their accumulators: the tensor cores' own sums never run longer than one 128-wide k-block
// (the promotion DeepGEMM made known), and each k-block gets its own factors, as the block-scaled
// arithmetic says. The factors are read from memory (L2) before the stage's wait, so that the
// wait hides their latency.
//
// A stage is [x's 128 rows | W's tile rows], each 128 bytes a row in the 128-byte swizzle that
// TMA writes and wgmma reads (wgmma.cuh's K-major layout: a k-step of 32 e4m3 columns is 32 bytes
// of the row, as a bf16 k-step is). The grouped kernel's tiles are 128 rows of W (one factor
// block); the dense kernel's are kDenseCols (schedule.h), loaded half by each CTA of a cluster
// of two into both (produce_pairs), so that a stage is released to both CTAs' producers; the
// SwiGLU kernel's are 64 rows of gate and 64 of up, and there x is loaded half by each CTA into
// both (produce_swiglu).
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/mma_tile.cuh"
#include "common/smem_ring.cuh"
#include "common/tma.cuh"
#include "common/wgmma.cuh"
#include "target/kernels/grouped_fp8.h"
#include "target/kernels/grouped_fp8/schedule.h"

namespace dflash::grouped_fp8 {

inline constexpr int kConsumerWarps = 8;  // two warpgroups
inline constexpr int kConsumerThreads = kConsumerWarps * 32;
inline constexpr int kOperandBytes = kTileRows * kBlockK;  // one operand's half of a stage, 16 KB
inline constexpr int kStages = 5;

// The output tile staged for coalesced stores ([row][column], rows padded by 8 columns so that
// the consumers' writes spread over the banks).
template <int kCols>
using Staging = __nv_bfloat16[kTileRows][kCols + 8];

using Ring = smem_ring::Ring<2 * kOperandBytes, kStages, kConsumerWarps>;

// The ring, the staged output, and the groups' ends and m-tile counts.
struct Shared {
  Ring ring;
  alignas(16) Staging<kTileCols> out;
  int32_t ends[kMaxGroups];
  int m_tiles_before[kMaxGroups + 1];
};

// The dense kernel's: stages of x's 128 rows and W's kDenseCols (4 of 40 KB), each released by
// the consumer warps of both CTAs of the cluster.
inline constexpr int kDenseStages = 4;
inline constexpr int kDenseWBytes = kDenseCols * kBlockK;
using DenseRing = smem_ring::Ring<kOperandBytes + kDenseWBytes, kDenseStages, 2 * kConsumerWarps>;
struct DenseShared {
  DenseRing ring;
  alignas(16) Staging<kDenseCols> out;
};

// The SwiGLU kernel's, by where its epilogue runs (grouped_fp8/swiglu_epilogue.cuh). Both: stages
// of x's 128 rows and W's 64 gate + 64 up rows (32 KB each), each released by the consumer warps
// of both CTAs of the cluster; each row's largest |h| from the peer CTA, two tiles' worth (the
// exchange alternates buffers by the tile's parity).
// - In the consumers (SwigluShared): 6 stages, and the output tile's e4m3 bytes.
// - In the epilogue warps (SwigluWarpShared): 5 stages, the tile's gate and up sums in bf16 as the
//   consumers hand them over (h replaces gate there), and each row's own largest |h|.
inline constexpr int kSwigluRowBytes = kSwigluHalf + 16;  // padded: a warp's stores hit distinct banks
struct SwigluShared {
  using RingT = smem_ring::Ring<2 * kOperandBytes, 6, 2 * kConsumerWarps>;
  RingT ring;
  alignas(16) unsigned char out[kTileRows][kSwigluRowBytes];
  float peer_amax[2][kTileRows];
  alignas(8) uint64_t peer_arrived[2];
};
struct SwigluWarpShared {
  using RingT = smem_ring::Ring<2 * kOperandBytes, 5, 2 * kConsumerWarps>;
  RingT ring;
  alignas(16) Staging<kTileCols> staged;  // a row: gate's 64 sums, then up's
  float own_amax[kTileRows];
  float peer_amax[2][kTileRows];
  alignas(8) uint64_t peer_arrived[2];
};

// The tiles as every role of the CTA walks them: blockIdx.x, + gridDim.x, ... below `tiles`.
struct Walk {
  const int32_t* ends;
  const int* m_tiles_before;
  int groups = 0, n_tiles = 0;
  int64_t tiles = 0;
  __device__ __forceinline__ Tile at(int64_t t) const { return locate(t, m_tiles_before, ends, groups, n_tiles); }
};

// Every thread of the CTA: the groups' ends into shared memory (one group of every row without
// them), then warp 0 counts each group's m-tiles and their running sum.
__device__ __forceinline__ Walk count_tiles(Shared& s, const Problem& p) {
  for (int g = static_cast<int>(threadIdx.x); g < p.groups; g += static_cast<int>(blockDim.x)) {
    s.ends[g] = p.ends != nullptr ? p.ends[g] : static_cast<int32_t>(p.m);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    const int lane = static_cast<int>(threadIdx.x), per_lane = (p.groups + 31) / 32;
    const int first = lane * per_lane, last = first + per_lane < p.groups ? first + per_lane : p.groups;
    int own = 0;
    for (int g = first; g < last; ++g) own += m_tiles_of(s.ends, g);
    int through = own;  // the m-tiles of lanes 0..lane
#pragma unroll
    for (int offset = 1; offset < 32; offset *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, through, offset);
      if (lane >= offset) through += v;
    }
    int before = through - own;
    for (int g = first; g < last; ++g) {
      s.m_tiles_before[g] = before;
      before += m_tiles_of(s.ends, g);
    }
    if (lane == 31) s.m_tiles_before[p.groups] = through;
  }
  __syncthreads();
  Walk walk{s.ends, s.m_tiles_before, p.groups, n_tiles_of(p.n), 0};
  walk.tiles = static_cast<int64_t>(s.m_tiles_before[p.groups]) * walk.n_tiles;
  return walk;
}

// x's tensor map in boxes of 16, 32, 64 and 128 rows: a tile loads the smallest box that holds
// its rows (a decoding step's experts hold a few rows each: a 128-row box would read as many
// bytes of x as of W). The stage's rows past the box keep what an earlier tile left there; they
// only reach output rows past the tile's, which are never stored.
inline constexpr int kXBoxes = 4;
struct XMaps {
  CUtensorMap box[kXBoxes];  // box[i]: 16 << i rows
};
__host__ __device__ constexpr int x_box_rows(int box) { return 16 << box; }
static_assert(x_box_rows(kXBoxes - 1) == kTileRows, "the largest box is a whole tile");

// One thread: every k-block of every tile of the CTA, in order, into the ring. W streams (read
// once: evict first); x's rows are read by the n-tiles' CTAs of one wave (kept). A partial last
// n-tile's box reads the next group's first rows (or zeros past the last group): their columns
// are never stored.
__device__ __forceinline__ void produce(Ring& ring, const XMaps& x_maps, const void* w_map, const Walk& walk, int n,
                                        int k_blocks) {
  const uint64_t streamed = tma::evict_first(), shared = tma::evict_last();
  smem_ring::Position at;
  for (int64_t t = blockIdx.x; t < walk.tiles; t += gridDim.x) {
    const Tile tile = walk.at(t);
    const int w_row = tile.group * n + tile.n_tile * kTileCols;
    int box = 0;
    while (x_box_rows(box) < tile.row_end - tile.row_begin) ++box;
    const void* x_map = &x_maps.box[box];
    for (int kb = 0; kb < k_blocks; ++kb) {
      ring.empty_at(at.stage).wait(at.phase ^ 1);
      const barriers::TransactionBarrier full = ring.full_at(at.stage);
      full.expect_bytes(x_box_rows(box) * kBlockK + kOperandBytes);
      tma::load_2d(ring.address(at.stage), x_map, kb * kBlockK, tile.row_begin, full.address, shared);
      tma::load_2d(ring.address(at.stage) + kOperandBytes, w_map, kb * kBlockK, w_row, full.address, streamed);
      at.advance<kStages>();
    }
  }
}

// One thread of the dense kernel (CTA `rank` of its cluster of two): for each pair of m-tiles
// the cluster takes (cluster, + clusters, ...) and each k-block, its own m-tile's 128 rows of x
// into its stage, and its half of the pair's W tile into the same stage of both CTAs (multicast).
// The stage's barrier in each CTA counts x's bytes and both halves of W; a stage is refilled once
// both CTAs' consumers have released it (the ring's 16 readers).
__device__ __forceinline__ void produce_pairs(DenseRing& ring, const void* x_map, const void* w_map,
                                              const DensePairs& pairs, int64_t cluster, int64_t clusters,
                                              int k_blocks, int rank) {
  constexpr int kHalfRows = kDenseCols / 2;
  // A tile of W is read by the cluster of every m-pair of the wave, close together (pairs are
  // numbered m-pairs fastest), so it is not streamed out first as the grouped kernel's W is (the
  // multicast keeps L2's normal priority); x's rows are read by every n-tile of every wave, kept.
  const uint64_t shared = tma::evict_last();
  smem_ring::Position at;
  for (int64_t pair = cluster; pair < pairs.count(); pair += clusters) {
    const Tile tile = pairs.at(pair, rank);
    const int w_row = tile.n_tile * kDenseCols + rank * kHalfRows;
    const uint32_t w_half = kOperandBytes + rank * kHalfRows * kBlockK;
    for (int kb = 0; kb < k_blocks; ++kb) {
      ring.empty_at(at.stage).wait(at.phase ^ 1);
      const barriers::TransactionBarrier full = ring.full_at(at.stage);
      full.expect_bytes(kOperandBytes + kDenseWBytes);
      tma::load_2d(ring.address(at.stage), x_map, kb * kBlockK, tile.row_begin, full.address, shared);
      tma::load_2d_multicast(ring.address(at.stage) + w_half, w_map, kb * kBlockK, w_row, full.address, 0b11);
      at.advance<kDenseStages>();
    }
  }
}

// One thread of the SwiGLU kernel (CTA `rank` of its cluster of two): for each tile the cluster
// takes (cluster, + clusters, ...) and each k-block, its half of x's 128 rows into the same stage
// of both CTAs (multicast), and its own 64 rows of gate and 64 of up (schedule.h's swiglu_column)
// into its stage after x: the stage reads as the grouped kernel's [x's 128 rows | W's 128 rows].
// x is read by the tiles of every block of h (L2's normal priority); each tile of W by the
// clusters of one wave's m-tiles, then never again (evict first). A stage is refilled once both
// CTAs' consumers have released it (the ring's 16 readers).
template <typename RingT>
__device__ __forceinline__ void produce_swiglu(RingT& ring, const void* x_map, const void* w_map,
                                               const SwigluTiles& tiles, int64_t cluster, int64_t clusters,
                                               int k_blocks, int rank, int inner) {
  constexpr int kHalfBytes = kSwigluHalf * kBlockK;  // 64 rows of a k-block, 8 KB
  const uint64_t streamed = tma::evict_first();
  smem_ring::Position at;
  for (int64_t index = cluster; index < tiles.count(); index += clusters) {
    const Tile tile = tiles.at(index);
    const int gate_row = swiglu_column(tile, rank);
    for (int kb = 0; kb < k_blocks; ++kb) {
      ring.empty_at(at.stage).wait(at.phase ^ 1);
      const barriers::TransactionBarrier full = ring.full_at(at.stage);
      const uint32_t stage = ring.address(at.stage);
      full.expect_bytes(2 * kOperandBytes);
      tma::load_2d_multicast(stage + rank * kHalfBytes, x_map, kb * kBlockK, tile.row_begin + rank * kSwigluHalf,
                             full.address, 0b11);
      tma::load_2d(stage + kOperandBytes, w_map, kb * kBlockK, gate_row, full.address, streamed);
      tma::load_2d(stage + kOperandBytes + kHalfBytes, w_map, kb * kBlockK, inner + gate_row, full.address, streamed);
      at.advance<RingT::kDepth>();
    }
  }
}

// A consumer warpgroup's 64 rows of the tile by its kCols columns, in mma_tile's m16n8 layout per
// warp (wgmma.cuh): c[j][r] is row 16 w + lane / 4 + 8 (r / 2), column 8 j + 2 (lane % 4) + r % 2.
template <int kCols>
struct Accumulators {
  float c[kCols / 8][4];
};

// The k-block in the stage at `x_stage` / `w_stage`: part = this warpgroup's 64 rows of x . W^T.
template <int kCols>
__device__ __forceinline__ void multiply_stage(Accumulators<kCols>& part, uint32_t x_stage, uint32_t w_stage) {
  wgmma::arrive();
#pragma unroll
  for (int step = 0; step < kBlockK / 32; ++step) {
    const uint64_t a = wgmma::descriptor(x_stage + step * 32, 16, 1024);
    const uint64_t b = wgmma::descriptor(w_stage + step * 32, 16, 1024);
    wgmma::mma_e4m3(part.c, a, b, step > 0);
  }
  wgmma::commit();
  wgmma::wait<0>(part.c);
}

// acc += part times each row's factor (a: the thread's rows 16 w + lane / 4, b: 8 below) and each
// column's block's. A tile of 128 columns lies in one block of W's factors (a0 / b0); one of 192
// begins at a multiple of 64 (schedule.h's tile_blocks), so its chunks 0..7 lie in the first
// block, 16..23 in the second, and 8..15 in the first exactly when the tile begins on a block
// (a_mid / b_mid, chosen once a k-block).
template <int kCols>
__device__ __forceinline__ void promote(Accumulators<kCols>& acc, const Accumulators<kCols>& part, float a0, float b0,
                                        float a_mid, float b_mid, float a1, float b1) {
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
    const float a = j < 8 ? a0 : (j < 16 ? a_mid : a1), b = j < 8 ? b0 : (j < 16 ? b_mid : b1);
    acc.c[j][0] += part.c[j][0] * a;
    acc.c[j][1] += part.c[j][1] * a;
    acc.c[j][2] += part.c[j][2] * b;
    acc.c[j][3] += part.c[j][3] * b;
  }
}

// W's factors for a tile's columns: a row of k_blocks factors per 128-row block of W. The tile's
// 8-column chunks 0..7 read `first`'s block, 16.. `second`'s, and 8..15 `first`'s when
// mid_in_first, else `second`'s (promote).
struct ColumnFactors {
  const float* first = nullptr;
  const float* second = nullptr;
  bool mid_in_first = true;
};

// The grouped kernel's tile of 128 columns: one block of its group's W.
__device__ __forceinline__ ColumnFactors one_block(const Problem& p, const Tile& tile, int k_blocks) {
  const float* f = p.w_factors + (static_cast<int64_t>(tile.group) * n_tiles_of(p.n) + tile.n_tile) * k_blocks;
  return {f, f, true};
}

// The dense kernel's tile of kCols columns (schedule.h's tile_blocks): the first block it reaches
// and the next (the same block for a partial last tile that reaches no further one: its columns
// past n are never stored).
template <int kCols>
__device__ __forceinline__ ColumnFactors spanned_blocks(const Problem& p, const Tile& tile, int k_blocks) {
  const TileBlocks blocks = tile_blocks(static_cast<int64_t>(tile.n_tile) * kCols, kCols);
  const float* first = p.w_factors + static_cast<int64_t>(blocks.first) * k_blocks;
  return {first, blocks.first + 1 < n_tiles_of(p.n) ? first + k_blocks : first, blocks.chunks_in_first == 16};
}

// The SwiGLU kernel's tile: chunks 0..7 are gate's rows (block n_tile of W's factors), 8..15 up's
// (`h_blocks` blocks further: up's rows begin `inner` rows after gate's).
__device__ __forceinline__ ColumnFactors gate_and_up_blocks(const Problem& p, const Tile& tile, int h_blocks,
                                                            int k_blocks) {
  const float* gate = p.w_factors + static_cast<int64_t>(tile.n_tile) * k_blocks;
  return {gate, gate + static_cast<int64_t>(h_blocks) * k_blocks, false};
}

// A consumer warpgroup's whole tile into `acc` (overwritten). Thread `ct` of the consumers
// (0..255); the warpgroup's rows start 64 warpgroup rows into the tile. A warpgroup whose rows are
// all past the tile's still waits for and hands back every stage: to its own CTA's producer, and
// with kCluster 2 to the peer's (CTA `peer` of the cluster), whose multicast also fills it.
// kTwoBlocks: the tile's columns read two blocks of W's factors (w.second); else only w.first.
template <int kCols, int kCluster, bool kTwoBlocks, typename RingT>
__device__ __forceinline__ void consume_tile(RingT& ring, Accumulators<kCols>& acc, smem_ring::Position& at,
                                             const Tile& tile, const ColumnFactors& w, const Problem& p,
                                             int k_blocks, int ct, uint32_t peer = 0) {
  static_assert(kCols == 128 || kCols == 192, "tiles of 128 or 192 columns (promote's factor blocks)");
  const int warpgroup = ct / 128, warp = (ct / 32) % 4, lane = ct % 32;
  const int first_row = tile.row_begin + 64 * warpgroup;
  const bool multiplies = first_row < tile.row_end;
  const int row_a = first_row + 16 * warp + lane / 4, row_b = row_a + 8;
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) acc.c[j][0] = acc.c[j][1] = acc.c[j][2] = acc.c[j][3] = 0.f;
  Accumulators<kCols> part;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const float w_factor = __ldg(w.first + kb);
    const float* x_factors = p.x_factors + static_cast<int64_t>(kb) * p.factor_stride;
    const float x_a = row_a < p.m ? __ldg(x_factors + row_a) : 0.f;
    const float x_b = row_b < p.m ? __ldg(x_factors + row_b) : 0.f;
    const float a_factor = x_a * w_factor, b_factor = x_b * w_factor;
    float a1 = a_factor, b1 = b_factor;
    if constexpr (kTwoBlocks) {
      const float second_factor = __ldg(w.second + kb);
      a1 = x_a * second_factor, b1 = x_b * second_factor;
    }
    ring.full_at(at.stage).wait(at.phase);
    if (multiplies) {
      const uint32_t stage = ring.address(at.stage);
      multiply_stage(part, stage + warpgroup * 64 * 128, stage + kOperandBytes);
    }
    if (lane == 0) {
      ring.empty_at(at.stage).arrive();
      if constexpr (kCluster > 1) ring.empty_at(at.stage).arrive_at(peer);
    }
    if (multiplies) {
      const bool mid_first = w.mid_in_first;
      promote(acc, part, a_factor, b_factor, mid_first ? a_factor : a1, mid_first ? b_factor : b1, a1, b1);
    }
    at.advance<RingT::kDepth>();
  }
}

}  // namespace dflash::grouped_fp8
