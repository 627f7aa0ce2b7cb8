// Stages 3 + 4 on Hopper: the state pass with the output fused in (wgmma, warp-specialised).
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// ---- 3+4 on Hopper: the state pass with the output fused in, warp-specialised -----------------
// One CTA per (sequence, value head, 64 value columns), the two CTAs of a head a cluster. Three
// warpgroups: the chain (warpgroup 0) carries the state from chunk to chunk; two output groups
// (warpgroups 1 and 2) take the chunks in turn and turn each chunk's state into its output, so
// only the state's own work is on the sequential path and each output group has two chunks' time
// for one. Warp w of every warpgroup owns the value columns [16 w, 16 w + 16).
//   chain, per chunk: S^T's bf16 fragments (S^T in fp32 registers over all 128 key dims) to the
//     hand-off tile (stmatrix) and the A operand of (W S)^T (wgmma); V'^T = U^T - (W S)^T, in bf16
//     to the hand-off; the update S^T = e^gamma_last S^T + (V' e^(gamma_last - gamma))^T K (wgmma,
//     K as MN-major).
//   output, per chunk: (Q S)^T = S^T Q^T (wgmma from the hand-off tile), O^T = (Q S)^T
//     diag(scale e^gamma) + V'^T P^T (mma.sync: P's A fragments are P^T's B fragments), the gated
//     RMSNorm over the head's 128 columns (the two CTAs' per-token sums of squares sent to each
//     other by st.async onto an mbarrier) in place of z in shared memory, stored as whole rows.
// Each output group has its own hand-off slot between named barriers (full: chain -> group;
// empty: group -> chain) and its own buffers; each warpgroup loads its own operands (cp.async)
// and synchronises on its own named barrier. No per-chunk states or V' in global memory.
// Two output groups per chain: 0.240 -> 0.216 ms at 4096 tokens (with the gated norm 0.509 ->
// 0.280) against one warpgroup doing both (bench/RESULTS.md: the variants measured and tried).
constexpr int kOutputGroups = 2;
constexpr int kFusedThreads = 128 * (1 + kOutputGroups);
constexpr int kChainStages = 2;
constexpr int kHandoffs = kOutputGroups;
// Named barriers (0 is __syncthreads): the chain's, each output group's, then full and empty per slot.
constexpr int kChainBarrier = 1, kOutputBarrier = 2, kFullBarrier = 2 + kOutputGroups,
              kEmptyBarrier = 2 + kOutputGroups + kHandoffs;
// A warpgroup's own barrier; a hand-off slot's full (chain -> output group) and empty (output
// group -> chain) barriers, between the chain's warpgroup and one output group.
__device__ __forceinline__ barriers::NamedBarrier warpgroup_barrier(int id) { return {id, 128}; }
__device__ __forceinline__ barriers::NamedBarrier slot_full(int slot) { return {kFullBarrier + slot, 256}; }
__device__ __forceinline__ barriers::NamedBarrier slot_empty(int slot) { return {kEmptyBarrier + slot, 256}; }

// What the output groups write (one kernel per format, chosen at launch): GdnForward::out_raw,
// out_plain, or out (the gated RMSNorm with z).
enum class OutputFormat { fp32, bf16, gated_norm };

struct FusedShared {
  static constexpr int BV = 64, LDU = BV + 8;
  // Tiles first (1024-byte aligned: wgmma's swizzled operands).
  mma_tile::Tile w[kChainStages];
  mma_tile::Tile k[kChainStages];
  mma_tile::Tile q[kOutputGroups];
  mma_tile::Tile state[kHandoffs];  // S^T in bf16 (64 value columns x 128 key dims)
  __align__(16) bf16 u[kChainStages][C * LDU];  // U's 64 columns of this CTA, [token][column]
  __align__(16) bf16 z[kOutputGroups][C * LDU];
  uint4 p[kOutputGroups][16 * 32];  // P in A-fragment order (GdnForward::qk)
  uint4 v[kHandoffs][4 * 4 * 32];    // V'^T in bf16, A-fragment order: [warp][token step][lane]
  __align__(16) float chain_gamma[kChainStages][C];
  __align__(16) float output_gamma[kOutputGroups][C];
  // Per output group: the sums of squares per warp (its 16 columns) and token, the peer CTA's 64
  // columns per token (written by the peer; by the parity of the group's chunk count), rstd, and
  // the mbarriers on which the peer's partial sums of parity 0 / 1 arrive.
  float squares[kOutputGroups][4][C];
  float peer_partial[kOutputGroups][2][C];
  float rstd[kOutputGroups][C];
  uint64_t peer_written[kOutputGroups][2];
};

// A warpgroup's software pipeline: wait_stage waits (cp.async) for the loads of iteration i (the
// only ones in flight) and publishes them to the warpgroup (and the async proxy). The chain then
// issues the loads of iteration i + 1 into the other of its two buffers (every thread of the
// warpgroup is past iteration i - 1, which used it); an output group, with one buffer, issues its
// next loads once the whole group is done with it (issue_after).
__device__ __forceinline__ void wait_stage(barriers::NamedBarrier group) {
  __pipeline_wait_prior(0);
  mma_tile::async_proxy_fence();
  group.sync();
}
template <typename Load>
__device__ __forceinline__ void issue_after(int i, int count, barriers::NamedBarrier group, Load load) {
  group.sync();
  if (i + 1 < count) load(i + 1);
  __pipeline_commit();
}

// Each warpgroup requests its first chunk's inputs from the layer's input (K; Q and z) before
// waiting for prepare (wait_for_prerequisite), and what prepare wrote (W, U, P, gamma) after
// (-0.001 ms at 4096 tokens). The layer's input is complete by then: prepare, the kernel this
// one depends on programmatically, was launched in stream order after the kernels that wrote it.
enum Parts { kInputs = 1, kPrepared = 2, kAll = 3 };

// The work of one CTA: a sequence's chunks, one value head, 64 value columns.
struct FusedTile {
  int seq, head, v0, key_head;
  int first, count;        // the sequence's chunks in the plan
  int seq_start, seq_end;  // its tokens
  int64_t tile_step;       // (chunk, head) tiles per chunk

  __device__ __forceinline__ static FusedTile of(const GdnForward& a) {
    FusedTile t;
    t.seq = blockIdx.x, t.head = blockIdx.y, t.v0 = blockIdx.z * FusedShared::BV;
    t.first = a.chunks.seq_chunks[t.seq], t.count = a.chunks.seq_chunks[t.seq + 1] - t.first;
    // A sequence's chunks are consecutive 64-token pieces (make_gdn_chunk_plan): chunk i starts at
    // seq_start + 64 i, so the loops need no per-chunk table reads.
    t.seq_start = t.count > 0 ? a.chunks.start[t.first] : 0;
    t.seq_end = t.count > 0 ? a.chunks.start[t.first + t.count - 1] + a.chunks.length[t.first + t.count - 1] : 0;
    t.key_head = t.head / (a.value_heads / a.key_heads);
    t.tile_step = static_cast<int64_t>(a.value_heads);
    return t;
  }
  __device__ __forceinline__ int start(int i) const { return seq_start + i * C; }
  __device__ __forceinline__ int length(int i) const { return min(C, seq_end - start(i)); }
  __device__ __forceinline__ int64_t tile(int i) const { return (first + i) * tile_step + head; }
};

// ---- mainloop: the chain (warpgroup 0) carries S^T from chunk to chunk ------------------------
__device__ __forceinline__ void chain_mainloop(const GdnForward& a, FusedShared& s, const FusedTile& t) {
  constexpr int BV = FusedShared::BV, LDU = FusedShared::LDU;
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31, vw = warp * 16;
  const bf16* qkv = static_cast<const bf16*>(a.qkv);
  auto load = [&](int index, int buffer, int parts = kAll) {
    const int start = t.start(index), length = t.length(index);
    const int64_t tile = t.tile(index);
    if (parts & kInputs) {
      mma_tile::load_tile<128>(s.k[buffer], qkv + static_cast<int64_t>(start) * a.qkv_stride + (a.key_heads + t.key_head) * D,
                               a.qkv_stride, length, tid);
    }
    if (!(parts & kPrepared)) return;
    mma_tile::load_tile<128>(s.w[buffer], static_cast<const bf16*>(a.w) + tile * C * D, D, C, tid);
    const bf16* u = static_cast<const bf16*>(a.u) + tile * C * D + t.v0;
#pragma unroll
    for (int j = 0; j < C * BV / 8 / 128; ++j) {
      const int i = tid + j * 128, r = i >> 3, c = (i & 7) * 8;
      mma_tile::copy16(&s.u[buffer][r * LDU + c], u + r * D + c);
    }
    if (tid < C / 4) mma_tile::copy16(&s.chain_gamma[buffer][4 * tid], a.gamma + tile * C + 4 * tid);
  };
  // S^T: rows v0 + vw + g (c[0], c[1]) and + 8 (c[2], c[3]); key dims 8n + 2t4 (+1).
  float st[16][4];
#pragma unroll
  for (int n = 0; n < 16; ++n) st[n][0] = st[n][1] = st[n][2] = st[n][3] = 0.f;
  carry_state<Carry::load>(st, a, t.seq, t.head, t.v0 + vw, 0);
  static_assert(kChainStages == 2, "the chain loads one chunk ahead");
  const barriers::NamedBarrier chain = warpgroup_barrier(kChainBarrier);
  if (t.count > 0) load(0, 0, kInputs);
  barriers::wait_for_prerequisite();
  if (t.count > 0) load(0, 0, kPrepared);
  __pipeline_commit();
  for (int i = 0; i < t.count; ++i) {
    wait_stage(chain);
    if (i + kChainStages - 1 < t.count) load(i + kChainStages - 1, (i + kChainStages - 1) % kChainStages);
    __pipeline_commit();
    const int buffer = i % kChainStages, slot = i % kHandoffs;
    uint32_t sa[8][4];
    mma_tile::to_a(sa, st);
    float vt[8][4];
    wgmma::issue_product(vt, sa, s.w[buffer]);  // (W S)^T: this warp's 16 columns x 64 tokens
    if (i >= kHandoffs) slot_empty(slot).sync();  // the output is done with the slot
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) mma_tile::store_a(s.state[slot], sa[kk], vw, 16 * kk);
    wgmma::wait<0>(vt);
    const float* gamma = s.chain_gamma[buffer];
    const float gamma_last = gamma[C - 1];
    subtract_from_u(vt, s.u[buffer], LDU, vw);  // V'^T = U^T - (W S)^T
    uint32_t vb[4][4];
    mma_tile::to_a(vb, vt);
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) s.v[slot][(warp * 4 + kk) * 32 + lane] = make_uint4(vb[kk][0], vb[kk][1], vb[kk][2], vb[kk][3]);
    mma_tile::async_proxy_fence();  // the state tile is read by the output's wgmma
    slot_full(slot).arrive();
    decay_to_chunk_end(vt, gamma, gamma_last);
    uint32_t va[4][4];
    mma_tile::to_a(va, vt);
    const float decay = exp_approx(gamma_last);
#pragma unroll
    for (int n = 0; n < 16; ++n) st[n][0] *= decay, st[n][1] *= decay, st[n][2] *= decay, st[n][3] *= decay;
    wgmma::issue_accumulate(st, va, s.k[buffer]);
    wgmma::wait<0>(st, va);
  }
  carry_state<Carry::store>(st, a, t.seq, t.head, t.v0 + vw, 0);
}

// ---- epilogue: an output group turns each of its chunks' states into the output ---------------

// O^T = (Q S)^T diag(scale e^gamma) + V'^T P^T for the warp's 16 columns x the chunk's 64 tokens:
// (Q S)^T by wgmma from the hand-off tile, the second on mma.sync (P's stored A fragment of (row
// block rb, token step kk) holds P^T's B fragments of the n8 tiles 2 rb, 2 rb + 1). Frees the
// hand-off slot for the chain's chunk i + kHandoffs as soon as it is read.
__device__ __forceinline__ void output_products(float (&ot)[8][4], const GdnForward& a, FusedShared& s, int i, int count,
                                                int buffer, int slot) {
  const int warp = (threadIdx.x & 127) >> 5, lane = threadIdx.x & 31, t4 = lane & 3;
  slot_full(slot).sync();  // S^T and V'^T of chunk i
  wgmma::issue_product(ot, s.state[slot], s.q[buffer]);  // (Q S)^T
  uint32_t vb[4][4];
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
    const uint4 x = s.v[slot][(warp * 4 + kk) * 32 + lane];
    vb[kk][0] = x.x, vb[kk][1] = x.y, vb[kk][2] = x.z, vb[kk][3] = x.w;
  }
  wgmma::wait<0>(ot);
  if (i + kHandoffs < count) slot_empty(slot).arrive();
  const float* gamma = s.output_gamma[buffer];
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int token = 8 * j + 2 * t4;
    const float q0 = a.scale * exp_approx(gamma[token]), q1 = a.scale * exp_approx(gamma[token + 1]);
    ot[j][0] *= q0, ot[j][1] *= q1, ot[j][2] *= q0, ot[j][3] *= q1;
  }
#pragma unroll
  for (int rb = 0; rb < 4; ++rb) {
#pragma unroll
    for (int kk = 0; kk <= rb; ++kk) {  // P is causal: blocks above the diagonal are zero
      const uint4 pf = s.p[buffer][(rb * 4 + kk) * 32 + lane];
      mma_tile::mma(ot[2 * rb], vb[kk], pf.x, pf.z);
      mma_tile::mma(ot[2 * rb + 1], vb[kk], pf.y, pf.w);
    }
  }
}

// fp32 o straight from the fragments: tokens 8j + 2t4 (+1) of columns v0 + vw + g, + 8.
__device__ __forceinline__ void store_fp32(const GdnForward& a, const FusedTile& t, const float (&ot)[8][4], int start,
                                           int length) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3, vw = ((threadIdx.x & 127) >> 5) * 16;
  const int64_t row = static_cast<int64_t>(a.value_heads) * D;  // between tokens of the output
  float* out = a.out_raw + (static_cast<int64_t>(start) + 2 * t4) * row + t.head * D + t.v0 + vw + g;
#pragma unroll
  for (int j = 0; j < 8; ++j, out += 8 * row) {
    const int token = 8 * j + 2 * t4;
    if (token < length) out[0] = ot[j][0], out[8] = ot[j][2];
    if (token + 1 < length) out[row] = ot[j][1], out[row + 8] = ot[j][3];
  }
}

// The chunk's 64 tokens x 64 columns of bf16 o (plain or normed) are staged in z's place and go
// out as whole 128-byte rows (16-byte stores; scattered 2-byte stores left every 32-byte sector
// half written). The staging ([token][column]) holds O, the fragments O^T: they go in and out as
// transposed 8x8 matrices (ldmatrix / stmatrix .trans), four per instruction: token blocks j and
// j + 1, columns vw and vw + 8 (lane l addresses row l % 8 of matrix l / 8).
__device__ __forceinline__ uint32_t staged_rows(FusedShared& s, int buffer, int j) {
  const int lane = threadIdx.x & 31, m = lane >> 3, vw = ((threadIdx.x & 127) >> 5) * 16;
  return mma_tile::shared_address(s.z[buffer] + (8 * (j + (m >> 1)) + (lane & 7)) * FusedShared::LDU + vw + 8 * (m & 1));
}

__device__ __forceinline__ void stage_plain(FusedShared& s, int buffer, const float (&ot)[8][4]) {
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    const uint32_t o[4] = {mma_tile::pack(ot[j][0], ot[j][1]), mma_tile::pack(ot[j][2], ot[j][3]),
                           mma_tile::pack(ot[j + 1][0], ot[j + 1][1]), mma_tile::pack(ot[j + 1][2], ot[j + 1][3])};
    mma_tile::stsm_x4_trans(staged_rows(s, buffer, j), o);
  }
}

// The gated RMSNorm's exchange with the other CTA of the cluster (the head's other 64 columns):
// this CTA writes its per-token partial sums of squares into the peer's peer_partial of the
// chunk's parity and counts them on the peer's barrier of that parity.
struct PeerExchange {
  uint32_t partial;  // the peer's peer_partial[group], as this CTA addresses it
  uint32_t written;  // the peer's peer_written[group]
};

// rstd per token of chunk n of the group, from this CTA's sums of squares and the peer's.
__device__ __forceinline__ void exchange_squares(const GdnForward& a, FusedShared& s, const float (&ot)[8][4], int group,
                                                 int n, const PeerExchange& peer, barriers::NamedBarrier bar) {
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    float q0 = ot[j][0] * ot[j][0] + ot[j][2] * ot[j][2], q1 = ot[j][1] * ot[j][1] + ot[j][3] * ot[j][3];
#pragma unroll
    for (int off = 4; off < 32; off <<= 1) {
      q0 += __shfl_xor_sync(0xffffffffu, q0, off);
      q1 += __shfl_xor_sync(0xffffffffu, q1, off);
    }
    if (g == 0) s.squares[group][warp][8 * j + 2 * t4] = q0, s.squares[group][warp][8 * j + 2 * t4 + 1] = q1;
  }
  bar.sync();
  if (tid < C) {
    // The peer's buffer of this parity is free: it read it two of the group's chunks ago, before
    // it sent the partial sums of the group's chunk in between, which this CTA has received.
    const int parity = n & 1;
    const barriers::TransactionBarrier arrived{mma_tile::shared_address(&s.peer_written[group][parity])};
    if (tid == 0) arrived.expect_bytes(C * 4);
    const float own = s.squares[group][0][tid] + s.squares[group][1][tid] + s.squares[group][2][tid] + s.squares[group][3][tid];
    barriers::store_to_peer(peer.partial + (parity * C + tid) * 4, own, peer.written + parity * 8);
    arrived.wait((n >> 1) & 1);  // the peer's partial sums of this chunk: the (n / 2)-th phase of this parity
    s.rstd[group][tid] = rsqrtf((own + s.peer_partial[group][parity][tid]) / D + a.eps);
  }
  bar.sync();
}

// The gated norm in place of z: w * rmsnorm(o) (rounded as HF does) * silu(z) in fp32.
__device__ __forceinline__ void stage_gated_norm(FusedShared& s, int buffer, int group, const float (&ot)[8][4],
                                                 float weight0, float weight1) {
  const int t4 = (threadIdx.x & 31) & 3;
#pragma unroll
  for (int j = 0; j < 8; j += 2) {
    uint32_t zr[4], o[4];
    mma_tile::ldsm_x4_trans(zr, staged_rows(s, buffer, j));
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float* acc = ot[j + (i >> 1)] + 2 * (i & 1);  // columns vw + g (+ 8 for odd i)
      const int token = 8 * (j + (i >> 1)) + 2 * t4;
      const float weight = i & 1 ? weight1 : weight0;
      const float2 gate = mma_tile::unpack(zr[i]);
      const float w0 = weighted_norm(acc[0] * s.rstd[group][token], weight, false);
      const float w1 = weighted_norm(acc[1] * s.rstd[group][token + 1], weight, false);
      o[i] = mma_tile::pack(w0 * gate.x * sigmoid_approx(gate.x), w1 * gate.y * sigmoid_approx(gate.y));
    }
    mma_tile::stsm_x4_trans(staged_rows(s, buffer, j), o);
  }
}

// The staged rows to the output (16-byte stores of whole rows).
__device__ __forceinline__ void store_staged_rows(const GdnForward& a, const FusedTile& t, FusedShared& s, int buffer,
                                                  int start, int length) {
  constexpr int BV = FusedShared::BV, LDU = FusedShared::LDU;
  const int tid = threadIdx.x & 127;
  const int64_t row = static_cast<int64_t>(a.value_heads) * D;
  bf16* out = static_cast<bf16*>(a.out != nullptr ? a.out : a.out_plain) + static_cast<int64_t>(start) * row +
              t.head * D + t.v0;
#pragma unroll
  for (int j = 0; j < C * BV / 8 / 128; ++j) {
    const int c = tid + j * 128, r = c >> 3, k = (c & 7) * 8;
    if (r < length) *reinterpret_cast<uint4*>(out + r * row + k) = *reinterpret_cast<const uint4*>(&s.z[buffer][r * LDU + k]);
  }
}

// Output group `group` (warpgroups 1, 2): its chunks i = group + n * kOutputGroups.
template <OutputFormat kFormat>
__device__ __forceinline__ void output_epilogue(const GdnForward& a, FusedShared& s, const FusedTile& t, int group,
                                                const PeerExchange& peer) {
  constexpr int BV = FusedShared::BV, LDU = FusedShared::LDU;
  constexpr bool kNorm = kFormat == OutputFormat::gated_norm;
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31, g = lane >> 2, vw = warp * 16;
  const bf16* qkv = static_cast<const bf16*>(a.qkv);
  const int chunks = t.count > group ? (t.count - group + kOutputGroups - 1) / kOutputGroups : 0;
  const barriers::NamedBarrier bar = warpgroup_barrier(kOutputBarrier + group);
  const int buffer = group;
  auto load = [&](int n, int parts = kAll) {
    const int index = group + n * kOutputGroups;
    const int start = t.start(index), length = t.length(index);
    const int64_t tile = t.tile(index);
    if (parts & kInputs) {
      mma_tile::load_tile<128>(s.q[buffer], qkv + static_cast<int64_t>(start) * a.qkv_stride + t.key_head * D, a.qkv_stride,
                               length, tid);
    }
    if (kNorm && (parts & kInputs)) {
      const bf16* z = static_cast<const bf16*>(a.z) + static_cast<int64_t>(start) * a.z_stride + t.head * D + t.v0;
#pragma unroll
      for (int j = 0; j < C * BV / 8 / 128; ++j) {
        const int i = tid + j * 128, r = i >> 3, c = (i & 7) * 8;
        mma_tile::copy16(&s.z[buffer][r * LDU + c], z + r * a.z_stride + c, r < length);
      }
    }
    if (!(parts & kPrepared)) return;
    const uint4* p = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.qk) + tile * C * C);
#pragma unroll
    for (int j = 0; j < 16 * 32 / 128; ++j) mma_tile::copy16(&s.p[buffer][tid + j * 128], p + tid + j * 128);
    if (tid < C / 4) mma_tile::copy16(&s.output_gamma[buffer][4 * tid], a.gamma + tile * C + 4 * tid);
  };
  // The gated norm's weights of this thread's columns v0 + vw + g and + 8.
  float weight0 = 0.f, weight1 = 0.f;
  if (kNorm) {
    const bf16* w = static_cast<const bf16*>(a.norm_weight) + t.v0 + vw + g;
    weight0 = __bfloat162float(w[0]);
    weight1 = __bfloat162float(w[8]);
  }
  if (chunks > 0) load(0, kInputs);
  barriers::wait_for_prerequisite();
  if (chunks > 0) load(0, kPrepared);
  __pipeline_commit();
  for (int n = 0; n < chunks; ++n) {
    wait_stage(bar);
    const int i = group + n * kOutputGroups, slot = i % kHandoffs;
    const int start = t.start(i), length = t.length(i);
    float ot[8][4];
    output_products(ot, a, s, i, t.count, buffer, slot);
    if constexpr (kFormat == OutputFormat::fp32) {
      store_fp32(a, t, ot, start, length);
    } else {
      if constexpr (kNorm) {
        exchange_squares(a, s, ot, group, n, peer, bar);
        stage_gated_norm(s, buffer, group, ot, weight0, weight1);
      } else {
        stage_plain(s, buffer, ot);
      }
      bar.sync();
      store_staged_rows(a, t, s, buffer, start, length);
    }
    issue_after(n, chunks, bar, load);
  }
}

// One CTA per (sequence, value head, 64 value columns), the two CTAs of a head a cluster: the
// chain's warpgroup runs the mainloop, the output groups the epilogue.
template <OutputFormat kFormat>
__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(kFusedThreads, 1) state_output_kernel(GdnForward a) {
  extern __shared__ __align__(16) unsigned char raw[];
  FusedShared& s = mma_tile::aligned_shared<FusedShared>(raw);
  const FusedTile t = FusedTile::of(a);
  const int group = max(static_cast<int>(threadIdx.x >> 7) - 1, 0);  // output warpgroups: 0 .. kOutputGroups - 1
  PeerExchange peer{};
  if constexpr (kFormat == OutputFormat::gated_norm) {
    const uint32_t rank = barriers::cluster_rank();
    peer.partial = barriers::peer_address(mma_tile::shared_address(&s.peer_partial[group][0][0]), rank ^ 1);
    peer.written = barriers::peer_address(mma_tile::shared_address(&s.peer_written[group][0]), rank ^ 1);
    if (threadIdx.x == 0) {
      for (int p = 0; p < 2 * kOutputGroups; ++p) {
        barriers::TransactionBarrier{mma_tile::shared_address(&s.peer_written[p / 2][p % 2])}.init(1);
      }
      barriers::TransactionBarrier::fence_init();
    }
    barriers::cluster_sync();  // the peer's barriers exist before anyone arrives on them
  }
  if (threadIdx.x < 128) {
    chain_mainloop(a, s, t);
  } else {
    output_epilogue<kFormat>(a, s, t, group, peer);
  }
  // Neither CTA leaves while its peer may still write into its shared memory.
  if constexpr (kFormat == OutputFormat::gated_norm) barriers::cluster_sync();
}

}  // namespace dflash::target::kernels::gdn
