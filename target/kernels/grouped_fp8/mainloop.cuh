// mainloop.cuh: the FP8 grouped GEMM's pipeline (grouped_fp8.cu). One producer thread streams,
// for each tile the CTA takes (schedule.h) and each of its k-blocks, the tile's 128 rows of x and
// its 128 rows of W_g (128 e4m3 columns each) by TMA into one stage of a ring
// (common/smem_ring.cuh). Two consumer warpgroups, 64 rows of x each, multiply the stage on wgmma
// into a k-block's fp32 sums, hand the stage back, and add those sums times the row's factor and
// the block's factor into their accumulators: the tensor cores' own sums never run longer than
// one 128-wide k-block (the promotion DeepGEMM made known), and each k-block gets its own factors,
// as the block-scaled arithmetic says. The factors are read from memory (L2) before the stage's
// wait, so that the wait hides their latency.
//
// A stage is [x's 128 rows | W's 128 rows], each 128 bytes a row in the 128-byte swizzle that
// TMA writes and wgmma reads (wgmma.cuh's K-major layout: a k-step of 32 e4m3 columns is 32 bytes
// of the row, as a bf16 k-step is).
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
using Staging = __nv_bfloat16[kTileRows][kTileCols + 8];

using Ring = smem_ring::Ring<2 * kOperandBytes, kStages, kConsumerWarps>;

// The ring, the staged output, and the groups' ends and m-tile counts.
struct Shared {
  Ring ring;
  alignas(16) Staging out;
  int32_t ends[kMaxGroups];
  int m_tiles_before[kMaxGroups + 1];
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

// A consumer warpgroup's 64 rows of the tile by its 128 columns, in mma_tile's m16n8 layout per
// warp (wgmma.cuh): c[j][r] is row 16 w + lane / 4 + 8 (r / 2), column 8 j + 2 (lane % 4) + r % 2.
struct Accumulators {
  float c[kTileCols / 8][4];
};

// The k-block in the stage at `x_stage` / `w_stage`: part = this warpgroup's 64 rows of x . W^T.
__device__ __forceinline__ void multiply_stage(Accumulators& part, uint32_t x_stage, uint32_t w_stage) {
  wgmma::arrive();
#pragma unroll
  for (int step = 0; step < kBlockK / 32; ++step) {
    const uint64_t a = wgmma::descriptor(x_stage + step * 32, 16, 1024);
    const uint64_t b = wgmma::descriptor(w_stage + step * 32, 16, 1024);
    wgmma::mma_64x128_e4m3(part.c, a, b, step > 0);
  }
  wgmma::commit();
  wgmma::wait<0>(part.c);
}

// A consumer warpgroup's whole tile into `acc` (overwritten): each k-block's sums times the row's
// factor (a: the thread's rows 16 w + lane / 4, b: 8 below) and the tile's block of W's factors
// (the tile's 128 columns are one block of its group's W). Thread `ct` of the consumers (0..255);
// the warpgroup's rows start 64 warpgroup rows into the tile. A warpgroup whose rows are all past
// the tile's still waits for and hands back every stage.
__device__ __forceinline__ void consume_tile(Ring& ring, Accumulators& acc, smem_ring::Position& at, const Tile& tile,
                                             const Problem& p, int k_blocks, int ct) {
  const int warpgroup = ct / 128, warp = (ct / 32) % 4, lane = ct % 32;
  const int first_row = tile.row_begin + 64 * warpgroup;
  const bool multiplies = first_row < tile.row_end;
  const int row_a = first_row + 16 * warp + lane / 4, row_b = row_a + 8;
  const float* w_factors =
      p.w_factors + (static_cast<int64_t>(tile.group) * n_tiles_of(p.n) + tile.n_tile) * k_blocks;
#pragma unroll
  for (int j = 0; j < kTileCols / 8; ++j) acc.c[j][0] = acc.c[j][1] = acc.c[j][2] = acc.c[j][3] = 0.f;
  Accumulators part;
  for (int kb = 0; kb < k_blocks; ++kb) {
    const float w_factor = __ldg(w_factors + kb);
    const float* x_factors = p.x_factors + static_cast<int64_t>(kb) * p.factor_stride;
    const float a_factor = row_a < p.m ? __ldg(x_factors + row_a) * w_factor : 0.f;
    const float b_factor = row_b < p.m ? __ldg(x_factors + row_b) * w_factor : 0.f;
    ring.full_at(at.stage).wait(at.phase);
    if (multiplies) {
      const uint32_t stage = ring.address(at.stage);
      multiply_stage(part, stage + warpgroup * 64 * 128, stage + kOperandBytes);
    }
    if (lane == 0) ring.empty_at(at.stage).arrive();
    if (multiplies) {
#pragma unroll
      for (int j = 0; j < kTileCols / 8; ++j) {
        acc.c[j][0] += part.c[j][0] * a_factor;
        acc.c[j][1] += part.c[j][1] * a_factor;
        acc.c[j][2] += part.c[j][2] * b_factor;
        acc.c[j][3] += part.c[j][3] * b_factor;
      }
    }
    at.advance<kStages>();
  }
}

}  // namespace dflash::grouped_fp8
