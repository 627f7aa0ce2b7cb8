// swiglu_epilogue.cuh: the SwiGLU kernel's tile leaves as down_proj's FP8 input (grouped_fp8.cu):
// h = silu(gate) * up for the CTA's 64 columns of h, quantised per 1x128 group of each row with
// the peer CTA's 64 (schedule.h's SwigluTiles). Two placements, measured against each other:
// - store_swiglu_tile: the consumer warpgroups themselves, between one tile's mainloop and the
//   next (the tensor cores wait meanwhile);
// - drain_swiglu_tiles: the consumers only hand their sums over in bf16 (epilogue.cuh's
//   hand_over_tile) and go on with the next tile; the producer warpgroup's three idle warps form
//   h, exchange and store while the next tile's mainloop runs.
//
// The values are those of the path it replaces, bit for bit where the products' fp32 sums are the
// same: gate and up rounded to bf16 (the GEMM's output), silu(gate) * up as the SiLU-mul kernel
// forms it (bf16x8::silu_times) rounded to bf16, then fp8_group's factor and division. A row's
// largest |h| over its 128 columns is this CTA's 64 and the peer's, swapped through each other's
// shared memory (barriers::RowSwap, one swap per tile).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "common/mma_tile.cuh"
#include "target/kernels/fp8_group.cuh"
#include "target/kernels/grouped_fp8.h"
#include "target/kernels/grouped_fp8/epilogue.cuh"
#include "target/kernels/grouped_fp8/mainloop.cuh"

namespace dflash::grouped_fp8 {

namespace group = target::kernels::fp8_group;

// The peer CTA's peer_amax and peer_arrived, as this CTA addresses them.
struct SwigluPeer {
  uint32_t amax = 0;
  uint32_t arrived = 0;
};

// h from gate's and up's fp32 sums: the bf16 value the SiLU-mul kernel computes from the bf16
// product.
__device__ __forceinline__ float swiglu_of(float gate, float up) {
  using bf16x8::round_bf16;
  return round_bf16(bf16x8::silu_times(round_bf16(gate), round_bf16(up)));
}

// The row maxima's swap of tile number `done` (the tiles this CTA stored before it) in a CTA whose
// shared memory is `s` (SwigluShared or SwigluWarpShared): the peer's maxima are then
// s.peer_amax[swap.buffer][row].
template <typename SharedT>
__device__ __forceinline__ barriers::RowSwap amax_swap(SharedT& s, const SwigluPeer& peer, int done) {
  return barriers::RowSwap::of(mma_tile::shared_address(&s.peer_arrived[0]), peer.amax, peer.arrived, kTileRows, done);
}

// ---- in the consumers -----------------------------------------------------------------------
// A tile's h into out (rows below the tile's end; rank 0 writes the rows' factors). Thread `ct` of
// the consumers: its rows' 64 columns lie in the 4 lanes of its quad (two shuffles for the CTA's
// largest |h|); the bytes leave through shared memory as 16-byte stores.
__device__ __forceinline__ void store_swiglu_tile(const Accumulators<128>& acc, SwigluShared& s, const Tile& tile,
                                                  const SwigluOutput& out, int64_t inner, int rank, int done,
                                                  const SwigluPeer& peer, int ct) {
  const barriers::NamedBarrier consumers{1, kConsumerThreads};
  const int lane = ct % 32, quad = lane % 4;
  const int row_a = 16 * (ct / 32) + lane / 4, row_b = row_a + 8;  // warp w of 8: rows 16 w..
  // Tile columns 8 j + 2 quad + (0, 1) of gate (chunks j < 8) and of up (j + 8): h's column 8 j +
  // 2 quad + (0, 1) of the CTA's 64; h[j][0..1] on row_a, h[j][2..3] on row_b.
  float h[8][4];
  float amax_a = 0.f, amax_b = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) h[j][e] = swiglu_of(acc.c[j][e], acc.c[j + 8][e]);
    amax_a = fmaxf(amax_a, fmaxf(fabsf(h[j][0]), fabsf(h[j][1])));
    amax_b = fmaxf(amax_b, fmaxf(fabsf(h[j][2]), fabsf(h[j][3])));
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    amax_a = fmaxf(amax_a, __shfl_xor_sync(0xffffffffu, amax_a, off));
    amax_b = fmaxf(amax_b, __shfl_xor_sync(0xffffffffu, amax_b, off));
  }
  const barriers::RowSwap swap = amax_swap(s, peer, done);
  if (ct == 0) swap.announce();
  if (quad == 0) swap.send(row_a, amax_a), swap.send(row_b, amax_b);
  swap.wait();
  const float* peer_amax = s.peer_amax[swap.buffer];
  const group::Divider divide_a = group::divider_of(group::factor_of(fmaxf(amax_a, peer_amax[row_a])));
  const group::Divider divide_b = group::divider_of(group::factor_of(fmaxf(amax_b, peer_amax[row_b])));
  consumers.sync();  // the previous tile's stores have read the staging
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    *reinterpret_cast<uint16_t*>(&s.out[row_a][8 * j + 2 * quad]) =
        static_cast<uint16_t>(group::e4m3x2(divide_a, h[j][0], h[j][1]));
    *reinterpret_cast<uint16_t*>(&s.out[row_b][8 * j + 2 * quad]) =
        static_cast<uint16_t>(group::e4m3x2(divide_b, h[j][2], h[j][3]));
  }
  const int rows = tile.row_end - tile.row_begin;
  if (rank == 0 && quad == 0) {
    float* factors = out.factors + tile.n_tile * out.factor_stride + tile.row_begin;
    if (row_a < rows) factors[row_a] = divide_a.factor;
    if (row_b < rows) factors[row_b] = divide_b.factor;
  }
  consumers.sync();
  constexpr int kChunks = kSwigluHalf / 16;  // 16-byte chunks of a row
  unsigned char* first = static_cast<unsigned char*>(out.q) + tile.row_begin * inner + swiglu_column(tile, rank);
  for (int i = ct; i < rows * kChunks; i += kConsumerThreads) {
    const int row = i / kChunks, chunk = i % kChunks;
    *reinterpret_cast<uint4*>(first + row * inner + chunk * 16) =
        *reinterpret_cast<const uint4*>(&s.out[row][chunk * 16]);
  }
}

// ---- in the epilogue warps (the consumers hand their sums over: epilogue.cuh's hand_over_tile) ----
// The epilogue warps (warp 1..3 of the CTA: `warp` 0..2), every tile the cluster takes: rows warp,
// warp + 3, ... of the staged tile, lane l holding h's columns 2 l and 2 l + 1 of the CTA's 64. A
// first pass forms h (written over gate's sums) and each row's largest |h| (own_amax, and sent to
// the peer); once the peer's have come, a second pass quantises and stores each row within the
// tile as 64 contiguous bytes (rank 0 also its factor).
__device__ __forceinline__ void drain_swiglu_tiles(SwigluWarpShared& s, const SwigluTiles& tiles, int64_t cluster,
                                                   int64_t clusters, const SwigluOutput& out, int64_t inner,
                                                   int rank, const SwigluPeer& peer, int warp) {
  const int lane = static_cast<int>(threadIdx.x % 32);
  int done = 0;
  for (int64_t index = cluster; index < tiles.count(); index += clusters, ++done) {
    const Tile tile = tiles.at(index);
    const barriers::RowSwap swap = amax_swap(s, peer, done);
    take_tile();
    if (warp == 0 && lane == 0) swap.announce();
    for (int row = warp; row < kTileRows; row += kEpilogueWarps) {
      const float2 gate = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.staged[row][2 * lane]));
      const float2 up =
          __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.staged[row][kSwigluHalf + 2 * lane]));
      const float h0 = swiglu_of(gate.x, up.x), h1 = swiglu_of(gate.y, up.y);
      *reinterpret_cast<__nv_bfloat162*>(&s.staged[row][2 * lane]) = __floats2bfloat162_rn(h0, h1);  // exact
      float amax = fmaxf(fabsf(h0), fabsf(h1));
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
      if (lane == 0) s.own_amax[row] = amax, swap.send(row, amax);
    }
    __syncwarp();
    swap.wait();
    const int rows = tile.row_end - tile.row_begin;
    unsigned char* first = static_cast<unsigned char*>(out.q) + tile.row_begin * inner + swiglu_column(tile, rank);
    for (int row = warp; row < rows; row += kEpilogueWarps) {
      const float amax = fmaxf(s.own_amax[row], s.peer_amax[swap.buffer][row]);
      const group::Divider divide = group::divider_of(group::factor_of(amax));
      const float2 h = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&s.staged[row][2 * lane]));
      *reinterpret_cast<uint16_t*>(first + row * inner + 2 * lane) =
          static_cast<uint16_t>(group::e4m3x2(divide, h.x, h.y));
      if (rank == 0 && lane == 0) out.factors[tile.n_tile * out.factor_stride + tile.row_begin + row] = divide.factor;
    }
    release_tile(index + clusters >= tiles.count());  // the consumers stage the next tile over this one
  }
}

}  // namespace dflash::grouped_fp8
