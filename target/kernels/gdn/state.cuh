// Stage 3 (mma.sync): the sequential state pass.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// ---- 3. state: the sequential pass over the chunks of one sequence ---------------------------
// The state is kept transposed, S^T (value columns x key dims), as mma accumulators in registers,
// so that S^T in bf16 is directly the A operand of (W S)^T = S^T W^T and the decayed V'^T (an
// accumulator of that product) the A operand of the update S^T += V'^T K: no shared-memory round
// trips of S. A pair of warps owns 16 value columns; each warp of the pair holds half of the key
// dims, computes its half of (W S)^T's sum (the two halves are added through shared memory: a+b
// in one warp, b+a in the other, the same bits) and its half of the update. The pass is
// latency-bound (one chain per value-column block). Loads run kStateStages - 1 chunks ahead
// (3 stages: bench/RESULTS.md has the pair split and the stage counts measured).
constexpr int kStateStages = 3;

template <int kPairs>
struct StateShared {
  static constexpr int BV = 16 * kPairs;  // value columns per CTA
  static constexpr int LDU = BV + 8;
  mma_tile::Tile w[kStateStages];
  mma_tile::Tile k[kStateStages];
  __align__(16) bf16 u[kStateStages][C * LDU];
  __align__(16) float gamma[kStateStages][C];
  float4 exchange[2 * kPairs][8 * 32];  // per warp: its half of (W S)^T, [n8 tile][lane]
};

// The two warps of a pair (named barrier 1 + pair).
__device__ __forceinline__ void pair_barrier(int pair) { barriers::NamedBarrier{1 + pair, 64}.sync(); }

template <int kPairs>
__global__ void __launch_bounds__(64 * kPairs) state_kernel(GdnForward a) {
  using Shared = StateShared<kPairs>;
  constexpr int BV = Shared::BV, LDU = Shared::LDU, kThreads = 64 * kPairs;
  extern __shared__ __align__(128) unsigned char smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int seq = blockIdx.x, head = blockIdx.y, v0 = blockIdx.z * BV;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int pair = warp >> 1, half = warp & 1, vw = pair * 16, d0 = half * 64;
  const int first = a.chunks.seq_chunks[seq], count = a.chunks.seq_chunks[seq + 1] - first;
  const int key_head = head / (a.value_heads / a.key_heads);
  const bf16* qkv = static_cast<const bf16*>(a.qkv);

  auto load = [&](int index, int buffer) {
    const int chunk = first + index, start = a.chunks.start[chunk], length = a.chunks.length[chunk];
    const int64_t tile = static_cast<int64_t>(chunk) * a.value_heads + head;
    const bf16* w = static_cast<const bf16*>(a.w) + tile * C * D;
    const bf16* k = qkv + static_cast<int64_t>(start) * a.qkv_stride + (a.key_heads + key_head) * D;
    mma_tile::load_tile<kThreads>(s.w[buffer], w, D, C);
    mma_tile::load_tile<kThreads>(s.k[buffer], k, a.qkv_stride, length);
    const bf16* u = static_cast<const bf16*>(a.u) + tile * C * D + v0;
    for (int i = threadIdx.x; i < C * BV / 8; i += kThreads) {
      const int r = i / (BV / 8), c = (i % (BV / 8)) * 8;
      mma_tile::copy16(&s.u[buffer][r * LDU + c], u + r * D + c);
    }
    if (threadIdx.x < C / 4) mma_tile::copy16(&s.gamma[buffer][4 * threadIdx.x], a.gamma + tile * C + 4 * threadIdx.x);
  };

  // S^T: rows v0 + vw + g (c[0], c[1]) and + 8 (c[2], c[3]); key dims d0 + 8n + 2t4 (+1).
  float st[8][4];
#pragma unroll
  for (int n = 0; n < 8; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.f;
  carry_state<Carry::load>(st, a, seq, head, v0 + vw, d0);
  for (int i = 0; i + 1 < kStateStages; ++i) {
    if (i < count) load(i, i);
    __pipeline_commit();
  }
  float4* mine = s.exchange[warp];
  const float4* other = s.exchange[warp ^ 1];
  for (int i = 0; i < count; ++i) {
    mma_tile::pipeline_stage<kStateStages>(i, count, load);
    const int buffer = i % kStateStages;
    const int64_t tile = static_cast<int64_t>(first + i) * a.value_heads + head;
    // This warp's half of S^T in bf16: the A operand below, and the state the output kernel
    // reads, stored in fragment order (16-byte coalesced stores; see GdnForward::states).
    uint32_t sa[4][4];
    mma_tile::to_a(sa, st);
    uint4* states = reinterpret_cast<uint4*>(static_cast<bf16*>(a.states) + tile * D * D) +
                    ((blockIdx.z * kPairs + pair) * 8 + 4 * half) * 32 + lane;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) states[kk * 32] = make_uint4(sa[kk][0], sa[kk][2], sa[kk][1], sa[kk][3]);
    // (W S)^T over this warp's key dims, plus the partner's half.
    float vt[8][4];
#pragma unroll
    for (int j = 0; j < 8; ++j) vt[j][0] = vt[j][1] = vt[j][2] = vt[j][3] = 0.f;
    mma_tile::product_16x64_add<4>(vt, sa, s.w[buffer], d0);
#pragma unroll
    for (int j = 0; j < 8; ++j) mine[j * 32 + lane] = make_float4(vt[j][0], vt[j][1], vt[j][2], vt[j][3]);
    pair_barrier(pair);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float4 x = other[j * 32 + lane];
      vt[j][0] += x.x, vt[j][1] += x.y, vt[j][2] += x.z, vt[j][3] += x.w;
    }
    // V'^T = U^T - (W S)^T: stored in fragment order for the output kernel (each warp of the pair
    // half of the tokens); its decayed copy V'^T e^(gamma_last - gamma) is the A operand of the update.
    const float* gamma = s.gamma[buffer];
    const float gamma_last = gamma[C - 1];
    subtract_from_u(vt, s.u[buffer], LDU, vw);
    uint4* v_new = reinterpret_cast<uint4*>(static_cast<bf16*>(a.v_new) + tile * C * D) +
                   ((blockIdx.z * kPairs + pair) * 4 + 2 * half) * 32 + lane;
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {  // (static register indices: a runtime one would spill vt)
      if ((kk >> 1) != half) continue;
      const int j = 2 * kk;
      v_new[(kk & 1) * 32] = make_uint4(mma_tile::pack(vt[j][0], vt[j][1]), mma_tile::pack(vt[j + 1][0], vt[j + 1][1]),
                                        mma_tile::pack(vt[j][2], vt[j][3]), mma_tile::pack(vt[j + 1][2], vt[j + 1][3]));
    }
    decay_to_chunk_end(vt, gamma, gamma_last);
    uint32_t va[4][4];
    mma_tile::to_a(va, vt);
    // S = e^gamma_last S + K^T (V' e^(gamma_last - gamma)), transposed, this warp's key dims.
    const float decay = exp_approx(gamma_last);
#pragma unroll
    for (int n = 0; n < 8; ++n) st[n][0] *= decay, st[n][1] *= decay, st[n][2] *= decay, st[n][3] *= decay;
    mma_tile::accumulate_16xn<4>(st, va, s.k[buffer], d0);
    __syncthreads();  // this chunk's buffers and exchange slots are refilled next
  }
  carry_state<Carry::store>(st, a, seq, head, v0 + vw, d0);
}

}  // namespace dflash::target::kernels::gdn
