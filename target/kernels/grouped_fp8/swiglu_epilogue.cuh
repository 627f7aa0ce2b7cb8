// swiglu_epilogue.cuh: the SwiGLU kernel's tile leaves the consumers' registers (grouped_fp8.cu)
// as down_proj's FP8 input: h = silu(gate) * up for the CTA's 64 columns of h, quantised per
// 1x128 group of each row with the peer CTA's 64 (schedule.h's SwigluTiles).
//
// The values are those of the path it replaces, bit for bit where the products' fp32 sums are the
// same: gate and up rounded to bf16 (the GEMM's output), silu(gate) * up as the SiLU-mul kernel
// forms it (bf16x8::silu_times) rounded to bf16, then fp8_group's factor and division. A row's
// largest |h| over its 128 columns is this CTA's 64 (two lane shuffles: a row's 64 columns lie in
// the 4 lanes of a quad) and the peer's, sent into each other's shared memory (store_to_peer) and
// counted on a transaction barrier, one per parity of the tile: the peer writes a buffer again two
// tiles later, after it has received this CTA's largest values of the tile in between, which this
// CTA sends only after it has read the buffer.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "common/mma_tile.cuh"
#include "target/kernels/fp8_group.cuh"
#include "target/kernels/grouped_fp8.h"
#include "target/kernels/grouped_fp8/mainloop.cuh"

namespace dflash::grouped_fp8 {

// The peer CTA's peer_amax and peer_arrived, as this CTA addresses them.
struct SwigluPeer {
  uint32_t amax = 0;
  uint32_t arrived = 0;
};

// A tile's h into out (rows below the tile's end; rank 0 writes the rows' factors). `done`: the
// tiles this CTA has stored before (the exchange buffer's parity and its barrier's phase).
__device__ __forceinline__ void store_swiglu_tile(const Accumulators<128>& acc, SwigluShared& s, const Tile& tile,
                                                  const SwigluOutput& out, int64_t inner, int rank, int done,
                                                  const SwigluPeer& peer, int ct) {
  namespace group = target::kernels::fp8_group;
  using bf16x8::round_bf16;
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
    for (int e = 0; e < 4; ++e) {
      h[j][e] = round_bf16(bf16x8::silu_times(round_bf16(acc.c[j][e]), round_bf16(acc.c[j + 8][e])));
    }
    amax_a = fmaxf(amax_a, fmaxf(fabsf(h[j][0]), fabsf(h[j][1])));
    amax_b = fmaxf(amax_b, fmaxf(fabsf(h[j][2]), fabsf(h[j][3])));
  }
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    amax_a = fmaxf(amax_a, __shfl_xor_sync(0xffffffffu, amax_a, off));
    amax_b = fmaxf(amax_b, __shfl_xor_sync(0xffffffffu, amax_b, off));
  }
  const int buffer = done & 1;
  const barriers::TransactionBarrier arrived{mma_tile::shared_address(&s.peer_arrived[buffer])};
  if (ct == 0) arrived.expect_bytes(kTileRows * 4);
  if (quad == 0) {
    const uint32_t values = peer.amax + buffer * kTileRows * 4, barrier = peer.arrived + buffer * 8;
    barriers::store_to_peer(values + row_a * 4, amax_a, barrier);
    barriers::store_to_peer(values + row_b * 4, amax_b, barrier);
  }
  arrived.wait((done >> 1) & 1);  // the peer's values of this tile: the (done / 2)-th phase of this parity
  const group::Divider divide_a = group::divider_of(group::factor_of(fmaxf(amax_a, s.peer_amax[buffer][row_a])));
  const group::Divider divide_b = group::divider_of(group::factor_of(fmaxf(amax_b, s.peer_amax[buffer][row_b])));
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
    *reinterpret_cast<uint4*>(first + row * inner + chunk * 16) = *reinterpret_cast<const uint4*>(&s.out[row][chunk * 16]);
  }
}

}  // namespace dflash::grouped_fp8
