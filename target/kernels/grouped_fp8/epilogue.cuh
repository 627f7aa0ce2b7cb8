// epilogue.cuh: the FP8 grouped GEMM's tile leaves the consumers' registers (grouped_fp8.cu):
// rounded to bf16 into shared memory, then each of the tile's rows (only those of its group, and
// only its columns below n) to y as 16-byte stores.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "target/kernels/grouped_fp8/mainloop.cuh"

namespace dflash::grouped_fp8 {

template <int kCols>
__device__ __forceinline__ void store_tile(const Accumulators<kCols>& acc, Staging<kCols>& out, const Tile& tile,
                                           __nv_bfloat16* y, int64_t n, int ct) {
  const barriers::NamedBarrier consumers{1, kConsumerThreads};
  const int lane = ct % 32;
  const int row0 = 16 * (ct / 32) + lane / 4, column0 = 2 * (lane % 4);  // warp w of 8: rows 16 w..
  consumers.sync();  // the previous tile's stores have read the staging
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      *reinterpret_cast<__nv_bfloat162*>(&out[row0 + 8 * half][8 * j + column0]) =
          __floats2bfloat162_rn(acc.c[j][2 * half], acc.c[j][2 * half + 1]);
    }
  }
  consumers.sync();
  constexpr int kChunks = kCols / 8;  // 16-byte chunks of a row
  const int rows = tile.row_end - tile.row_begin;
  const int64_t first_column = static_cast<int64_t>(tile.n_tile) * kCols;
  const int chunks = n - first_column < kCols ? static_cast<int>(n - first_column) / 8 : kChunks;
  __nv_bfloat16* first = y + static_cast<int64_t>(tile.row_begin) * n + first_column;
  for (int i = ct; i < rows * kChunks; i += kConsumerThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    if (chunk >= chunks) continue;
    *reinterpret_cast<uint4*>(first + row * n + chunk * 8) = *reinterpret_cast<const uint4*>(&out[row][chunk * 8]);
  }
}

}  // namespace dflash::grouped_fp8
