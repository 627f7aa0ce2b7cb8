// epilogue.cuh: the FP8 grouped GEMM's tiles leave the consumers' registers (grouped_fp8.cu):
// the consumers round them to bf16 into shared memory (stage_tile) and go on with the next tile;
// the producer warpgroup's three idle warps copy each of the tile's rows (only those of its group,
// and only its columns below n) to y as 16-byte stores (copy_tile) while the next tile's mainloop
// runs. Written by the consumers themselves between tiles, the tensor cores waited meanwhile: the
// MoE block at 35B-A3B shapes took 1-4 % longer (bench/RESULTS.md, session 33).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "target/kernels/grouped_fp8/mainloop.cuh"

namespace dflash::grouped_fp8 {

// The tile's sums rounded to bf16 into `out` by consumer thread `ct`: rows 16 w + lane / 4 (+ 8),
// columns 8 j + 2 (lane % 4) (+ 1), as the accumulators hold them.
__device__ __forceinline__ void stage_tile(const Accumulators& acc, Staging& out, int ct) {
  const int lane = ct % 32;
  const int row0 = 16 * (ct / 32) + lane / 4, column0 = 2 * (lane % 4);  // warp w of 8: rows 16 w..
#pragma unroll
  for (int j = 0; j < kTileCols / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<__nv_bfloat162*>(&out[row0 + 8 * half][8 * j + column0]) =
          __floats2bfloat162_rn(acc.c[j][2 * half], acc.c[j][2 * half + 1]);
    }
  }
}

// The staged tile's rows to y (bf16 [.., n]), 16 bytes a thread at a time, by `threads` threads of
// which this is `thread`.
__device__ __forceinline__ void copy_tile(const Staging& out, const Tile& tile, __nv_bfloat16* y, int64_t n, int thread,
                                          int threads) {
  constexpr int kChunks = kTileCols / 8;  // 16-byte chunks of a row
  const int rows = tile.row_end - tile.row_begin;
  const int64_t first_column = static_cast<int64_t>(tile.n_tile) * kTileCols;
  const int chunks = n - first_column < kTileCols ? static_cast<int>(n - first_column) / 8 : kChunks;
  __nv_bfloat16* first = y + static_cast<int64_t>(tile.row_begin) * n + first_column;
  for (int i = thread; i < rows * kChunks; i += threads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (chunk >= chunks) continue;
    *reinterpret_cast<uint4*>(first + row * n + chunk * 8) = *reinterpret_cast<const uint4*>(&out[row][chunk * 8]);
  }
}

// ---- the hand-over to the epilogue warps ----------------------------------------------------------
inline constexpr int kEpilogueWarps = 3;  // warps 1-3: the producer warpgroup's, beside its producer thread
inline constexpr int kEpilogueThreads = 32 * kEpilogueWarps;

// Staged (barrier 1): the consumers (arrive) to the epilogue warps (sync) that a tile is in the
// staging; drained (barrier 2): the epilogue warps (arrive) to the consumers (sync, before they
// stage the next tile) that they have read it.
__device__ __forceinline__ barriers::NamedBarrier staged_barrier() {
  return {1, kConsumerThreads + kEpilogueThreads};
}
__device__ __forceinline__ barriers::NamedBarrier drained_barrier() {
  return {2, kConsumerThreads + kEpilogueThreads};
}

// A consumer thread's part of the CTA's `done`-th tile: once the epilogue warps have read the
// previous tile (done > 0), its sums into the staging, and on.
__device__ __forceinline__ void hand_over_tile(const Accumulators& acc, Staging& out, int done, int ct) {
  if (done > 0) drained_barrier().sync();
  stage_tile(acc, out, ct);
  staged_barrier().arrive();
}

// An epilogue warp's: wait for the next staged tile (take_tile); after reading it, hand the
// staging back unless it was the CTA's last tile (release_tile: the consumers wait for no more).
__device__ __forceinline__ void take_tile() { staged_barrier().sync(); }
__device__ __forceinline__ void release_tile(bool last) {
  if (last) return;
  __syncwarp();
  drained_barrier().arrive();
}

// The epilogue warps' whole part: the CTA's tiles (walk: blockIdx.x, + gridDim.x, ...) copied out
// of the staging to y (bf16 [.., n]) as each is handed over.
__device__ __forceinline__ void drain_tiles(const Staging& out, const Walk& walk, __nv_bfloat16* y, int64_t n) {
  for (int64_t t = blockIdx.x; t < walk.tiles; t += gridDim.x) {
    take_tile();
    copy_tile(out, walk.at(t), y, n, static_cast<int>(threadIdx.x) - 32, kEpilogueThreads);
    release_tile(t + gridDim.x >= walk.tiles);
  }
}

}  // namespace dflash::grouped_fp8
