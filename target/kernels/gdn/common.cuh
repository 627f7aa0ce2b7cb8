// The GatedDeltaNet kernels' shared pieces: tile sizes and the state chain's per-chunk math
// (barriers and the grid dependency: common/barriers.cuh).
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include <cuda_bf16.h>
#include <cuda_pipeline.h>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "common/fast_math.cuh"
#include "common/mma_tile.cuh"
#include "common/wgmma.cuh"
#include "target/kernels/gated_delta_net.h"
#include "target/kernels/gdn_gates.cuh"

namespace dflash::target::kernels::gdn {

using bf16 = __nv_bfloat16;
using bf16x8::load8;
using bf16x8::weighted_norm;

constexpr int C = kGdnChunk;    // 64 tokens per chunk
constexpr int D = kGdnHeadDim;  // 128
constexpr int LDA = C + 8;      // fp32 row stride of 64x64 matrices (float2 fragment accesses conflict-free)

// ---- the state a sequence starts from and ends with (GdnForward::state_before / state_after) ----
// A warp's S^T accumulator fragments st[n][c]: value column col0 + g (+ 8 for c >= 2), key dim
// k0 + 8 n + 2 t4 (+ 1 for odd c), of sequence `seq`'s state [value_heads, 128 key, 128 value] in
// the layout decoding keeps (element (i, j) at i * 128 + j). Loaded once before the chain and
// stored once after it: a few KB per warp, not worth coalescing.
enum class Carry { load, store };
template <Carry kCarry, int N>
__device__ __forceinline__ void carry_state(float (&st)[N][4], const GdnForward& a, int seq, int head, int col0,
                                            int k0) {
  const void* state = kCarry == Carry::load ? a.state_before : a.state_after;
  if (state == nullptr) return;
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int64_t base = (static_cast<int64_t>(seq) * a.value_heads + head) * D * D;
#pragma unroll
  for (int n = 0; n < N; ++n) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int key = k0 + 8 * n + 2 * t4 + (c & 1), column = col0 + g + (c >= 2 ? 8 : 0);
      const int64_t at = base + static_cast<int64_t>(key) * D + column;
      if (kCarry == Carry::load) {
        st[n][c] = a.carried_bf16 ? __bfloat162float(static_cast<const bf16*>(a.state_before)[at])
                                  : static_cast<const float*>(a.state_before)[at];
      } else if (a.carried_bf16) {
        static_cast<bf16*>(a.state_after)[at] = __float2bfloat16_rn(st[n][c]);
      } else {
        static_cast<float*>(a.state_after)[at] = st[n][c];
      }
    }
  }
}

// ---- the state chain's per-chunk math, shared by the mma.sync and the wgmma state passes ----
// vt = U^T - vt for the warp's 16 value columns [col0, col0 + 16) x the chunk's 64 tokens
// (accumulator fragments: vt[j] the tokens 8j ..), U in shared memory as [token][column] with row
// stride ld: U^T's fragments by ldmatrix.trans (matrix m of k-step kk holds tokens
// 16 kk + 8 (m >> 1) .., columns col0 + 8 (m & 1) ..; it is vt[2 kk + (m >> 1)][2 (m & 1) ..]).
__device__ __forceinline__ void subtract_from_u(float (&vt)[8][4], const bf16* u, int ld, int col0) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const int token = 16 * kk + 8 * (m >> 1) + (lane & 7);
    uint32_t x[4];
    mma_tile::ldsm_x4_trans(x, mma_tile::shared_address(u + token * ld + col0 + 8 * (m & 1)));
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 f = mma_tile::unpack(x[e]);
      float* c = vt[2 * kk + (e >> 1)] + 2 * (e & 1);
      c[0] = f.x - c[0];
      c[1] = f.y - c[1];
    }
  }
}

// V'^T's token columns times e^(gamma_last - gamma) (accumulator fragments: vt[j] the tokens
// 8j + 2t4, + 1): V' decayed to the chunk's end, the A operand of the state update.
__device__ __forceinline__ void decay_to_chunk_end(float (&vt)[8][4], const float* gamma, float gamma_last) {
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int token = 8 * j + 2 * t4;
    const float e0 = exp_approx(gamma_last - gamma[token]), e1 = exp_approx(gamma_last - gamma[token + 1]);
    vt[j][0] *= e0, vt[j][1] *= e1, vt[j][2] *= e0, vt[j][3] *= e1;
  }
}

}  // namespace dflash::target::kernels::gdn
