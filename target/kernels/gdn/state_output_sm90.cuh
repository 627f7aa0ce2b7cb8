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

__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}

// A warpgroup's software pipeline: wait_stage waits (cp.async) for the loads of iteration i (the
// only ones in flight) and publishes them to the warpgroup (and the async proxy). The chain then
// issues the loads of iteration i + 1 into the other of its two buffers (every thread of the
// warpgroup is past iteration i - 1, which used it); an output group, with one buffer, issues its
// next loads once the whole group is done with it (issue_after).
__device__ __forceinline__ void wait_stage(int barrier) {
  __pipeline_wait_prior(0);
  mma_tile::async_proxy_fence();
  named_sync(barrier, 128);
}
template <typename Load>
__device__ __forceinline__ void issue_after(int i, int count, int barrier, Load load) {
  named_sync(barrier, 128);
  if (i + 1 < count) load(i + 1);
  __pipeline_commit();
}

__global__ void __cluster_dims__(1, 1, 2) __launch_bounds__(kFusedThreads, 1) state_output_kernel(GdnForward a) {
  using Shared = FusedShared;
  constexpr int BV = Shared::BV, LDU = Shared::LDU;
  extern __shared__ __align__(16) unsigned char raw[];
  Shared& s = mma_tile::aligned_shared<Shared>(raw);
  const int seq = blockIdx.x, head = blockIdx.y, v0 = blockIdx.z * BV;
  const int tid = threadIdx.x & 127, warp = tid >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const int vw = warp * 16;
  const int first = a.chunks.seq_chunks[seq], count = a.chunks.seq_chunks[seq + 1] - first;
  // A sequence's chunks are consecutive 64-token pieces (make_gdn_chunk_plan): chunk i starts at
  // seq_start + 64 i, so the loop needs no per-chunk table reads.
  const int seq_start = count > 0 ? a.chunks.start[first] : 0;
  const int seq_end = count > 0 ? a.chunks.start[first + count - 1] + a.chunks.length[first + count - 1] : 0;
  const int key_head = head / (a.value_heads / a.key_heads);
  const bf16* qkv = static_cast<const bf16*>(a.qkv);
  const bool norm = a.out != nullptr, fp32_out = a.out_raw != nullptr;
  bf16* const out_rows = static_cast<bf16*>(norm ? a.out : a.out_plain);  // bf16 o, normed or plain
  const int64_t tile_step = static_cast<int64_t>(a.value_heads);  // (chunk, head) tiles per chunk

  // The norm's exchange: this CTA writes its per-token partial sums into the peer's peer_partial
  // and arrives on the peer's mbarrier of that parity.
  uint32_t rank, peer_partial, peer_written;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  const int group = max(static_cast<int>(threadIdx.x >> 7) - 1, 0);  // output warpgroups: 0 .. kOutputGroups - 1
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(peer_partial) : "r"(mma_tile::shared_address(&s.peer_partial[group][0][0])), "r"(rank ^ 1));
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(peer_written) : "r"(mma_tile::shared_address(&s.peer_written[group][0])), "r"(rank ^ 1));
  if (threadIdx.x == 0) {
    for (int p = 0; p < 2 * kOutputGroups; ++p) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(mma_tile::shared_address(&s.peer_written[p / 2][p % 2])));
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  cluster_sync();  // the peer's mbarriers exist before anyone arrives on them
  // Each warpgroup requests its first chunk's inputs from the layer's input (K; Q and z) before
  // waiting for prepare (wait_for_prerequisite), and what prepare wrote (W, U, P, gamma) after
  // (-0.001 ms at 4096 tokens). The layer's input is complete
  // by then: prepare, the kernel this one depends on programmatically, was launched in stream
  // order after the kernels that wrote it.
  enum Parts { kInputs = 1, kPrepared = 2, kAll = 3 };

  if (threadIdx.x < 128) {
    // ---- the chain ----
    auto load = [&](int index, int buffer, int parts = kAll) {
      const int start = seq_start + index * C, length = min(C, seq_end - start);
      const int64_t tile = (first + index) * tile_step + head;
      if (parts & kInputs) {
        mma_tile::load_tile<128>(s.k[buffer], qkv + static_cast<int64_t>(start) * a.qkv_stride + (a.key_heads + key_head) * D,
                                 a.qkv_stride, length, tid);
      }
      if (!(parts & kPrepared)) return;
      mma_tile::load_tile<128>(s.w[buffer], static_cast<const bf16*>(a.w) + tile * C * D, D, C, tid);
      const bf16* u = static_cast<const bf16*>(a.u) + tile * C * D + v0;
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
    static_assert(kChainStages == 2, "the chain loads one chunk ahead");
    if (count > 0) load(0, 0, kInputs);
    wait_for_prerequisite();
    if (count > 0) load(0, 0, kPrepared);
    __pipeline_commit();
    for (int i = 0; i < count; ++i) {
      wait_stage(kChainBarrier);
      if (i + kChainStages - 1 < count) load(i + kChainStages - 1, (i + kChainStages - 1) % kChainStages);
      __pipeline_commit();
      const int buffer = i % kChainStages, slot = i % kHandoffs;
      uint32_t sa[8][4];
      mma_tile::to_a(sa, st);
      float vt[8][4];
      wgmma::issue_product(vt, sa, s.w[buffer]);  // (W S)^T: this warp's 16 columns x 64 tokens
      if (i >= kHandoffs) named_sync(kEmptyBarrier + slot, 256);  // the output is done with the slot
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
      named_arrive(kFullBarrier + slot, 256);
      decay_to_chunk_end(vt, gamma, gamma_last);
      uint32_t va[4][4];
      mma_tile::to_a(va, vt);
      const float decay = exp_approx(gamma_last);
#pragma unroll
      for (int n = 0; n < 16; ++n) st[n][0] *= decay, st[n][1] *= decay, st[n][2] *= decay, st[n][3] *= decay;
      wgmma::issue_accumulate(st, va, s.k[buffer]);
      wgmma::wait<0>(st, va);
    }
  } else {
    // ---- the output: this group's chunks i = group + n * kOutputGroups ----
    const int chunks = count > group ? (count - group + kOutputGroups - 1) / kOutputGroups : 0;
    const int bar = kOutputBarrier + group;
    auto load = [&](int n, int parts = kAll) {
      const int index = group + n * kOutputGroups, buffer = group;
      const int start = seq_start + index * C, length = min(C, seq_end - start);
      const int64_t tile = (first + index) * tile_step + head;
      if (parts & kInputs) {
        mma_tile::load_tile<128>(s.q[buffer], qkv + static_cast<int64_t>(start) * a.qkv_stride + key_head * D, a.qkv_stride,
                                 length, tid);
      }
      if (norm && (parts & kInputs)) {
        const bf16* z = static_cast<const bf16*>(a.z) + static_cast<int64_t>(start) * a.z_stride + head * D + v0;
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
    if (norm) {
      const bf16* w = static_cast<const bf16*>(a.norm_weight) + v0 + vw + g;
      weight0 = __bfloat162float(w[0]);
      weight1 = __bfloat162float(w[8]);
    }
    const int64_t row = static_cast<int64_t>(a.value_heads) * D;  // between tokens of the output
    if (chunks > 0) load(0, kInputs);
    wait_for_prerequisite();
    if (chunks > 0) load(0, kPrepared);
    __pipeline_commit();
    for (int n = 0; n < chunks; ++n) {
      wait_stage(bar);
      const int i = group + n * kOutputGroups, buffer = group, slot = i % kHandoffs;
      const int start = seq_start + i * C, length = min(C, seq_end - start);
      named_sync(kFullBarrier + slot, 256);  // S^T and V'^T of chunk i
      float ot[8][4];
      wgmma::issue_product(ot, s.state[slot], s.q[buffer]);  // (Q S)^T
      uint32_t vb[4][4];
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        const uint4 x = s.v[slot][(warp * 4 + kk) * 32 + lane];
        vb[kk][0] = x.x, vb[kk][1] = x.y, vb[kk][2] = x.z, vb[kk][3] = x.w;
      }
      wgmma::wait<0>(ot);
      if (i + kHandoffs < count) named_arrive(kEmptyBarrier + slot, 256);
      // O^T = (Q S)^T diag(scale e^gamma) + V'^T P^T, the second on mma.sync: P's stored A fragment
      // of (row block rb, token step kk) holds P^T's B fragments of the n8 tiles 2 rb, 2 rb + 1.
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
      // Epilogue: tokens 8j + 2t4 (+1) of columns v0 + vw + g, + 8.
      if (fp32_out) {
        float* out = a.out_raw + (static_cast<int64_t>(start) + 2 * t4) * row + head * D + v0 + vw + g;
#pragma unroll
        for (int j = 0; j < 8; ++j, out += 8 * row) {
          const int token = 8 * j + 2 * t4;
          if (token < length) out[0] = ot[j][0], out[8] = ot[j][2];
          if (token + 1 < length) out[row] = ot[j][1], out[row + 8] = ot[j][3];
        }
        issue_after(n, chunks, bar, load);
        continue;
      }
      // The chunk's 64 tokens x 64 columns of bf16 o (plain or normed) are staged in z's place and
      // go out as whole 128-byte rows (16-byte stores; scattered 2-byte stores left every 32-byte
      // sector half written). The staging ([token][column]) holds O, the fragments O^T: they go
      // in and out as transposed 8x8 matrices (ldmatrix / stmatrix .trans), four per instruction:
      // token blocks j and j + 1, columns vw and vw + 8 (lane l addresses row l % 8 of matrix l / 8).
      auto staged_rows = [&](int j) {
        const int m = lane >> 3;
        return mma_tile::shared_address(s.z[buffer] + (8 * (j + (m >> 1)) + (lane & 7)) * LDU + vw + 8 * (m & 1));
      };
      if (!norm) {
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          const uint32_t o[4] = {mma_tile::pack(ot[j][0], ot[j][1]), mma_tile::pack(ot[j][2], ot[j][3]),
                                 mma_tile::pack(ot[j + 1][0], ot[j + 1][1]), mma_tile::pack(ot[j + 1][2], ot[j + 1][3])};
          mma_tile::stsm_x4_trans(staged_rows(j), o);
        }
      } else {
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
        named_sync(bar, 128);
        if (tid < C) {
          // To the peer: st.async lands the value in its shared memory and counts its 4 bytes on the
          // peer's mbarrier of this parity (no memory fence: a release at cluster scope would wait
          // for this thread's output stores to reach global memory). The peer's buffer of this
          // parity is free: it read it two of the group's chunks ago, before it sent the partial sums
          // of the group's chunk in between, which this CTA has received.
          const int parity = n & 1;
          const uint32_t arrived = mma_tile::shared_address(&s.peer_written[group][parity]);
          if (tid == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(arrived), "r"(C * 4) : "memory");
          const float own = s.squares[group][0][tid] + s.squares[group][1][tid] + s.squares[group][2][tid] + s.squares[group][3][tid];
          asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(
                           peer_partial + (parity * C + tid) * 4),
                       "f"(own), "r"(peer_written + parity * 8)
                       : "memory");
          // The peer's partial sums of this chunk: the (n / 2)-th phase of this parity's mbarrier.
          const uint32_t phase = (n >> 1) & 1;
          uint32_t done = 0;
          while (!done) {
            asm volatile(
                "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
                : "=r"(done)
                : "r"(arrived), "r"(phase)
                : "memory");
          }
          s.rstd[group][tid] = rsqrtf((own + s.peer_partial[group][parity][tid]) / D + a.eps);
        }
        named_sync(bar, 128);
        // The gated norm in place of z.
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          uint32_t zr[4], o[4];
          mma_tile::ldsm_x4_trans(zr, staged_rows(j));
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float* acc = ot[j + (i >> 1)] + 2 * (i & 1);  // columns vw + g (+ 8 for odd i)
            const int token = 8 * (j + (i >> 1)) + 2 * t4;
            const float weight = i & 1 ? weight1 : weight0;
            const float2 gate = mma_tile::unpack(zr[i]);
            // As the reference: the weighted rmsnorm(o) rounded as HF does, then times silu(z) in fp32.
            const float w0 = weighted_norm(acc[0] * s.rstd[group][token], weight, false);
            const float w1 = weighted_norm(acc[1] * s.rstd[group][token + 1], weight, false);
            o[i] = mma_tile::pack(w0 * gate.x * sigmoid_approx(gate.x), w1 * gate.y * sigmoid_approx(gate.y));
          }
          mma_tile::stsm_x4_trans(staged_rows(j), o);
        }
      }
      named_sync(bar, 128);
      bf16* out = out_rows + static_cast<int64_t>(start) * row + head * D + v0;
#pragma unroll
      for (int j = 0; j < C * BV / 8 / 128; ++j) {
        const int c = tid + j * 128, r = c >> 3, k = (c & 7) * 8;
        if (r < length) *reinterpret_cast<uint4*>(out + r * row + k) = *reinterpret_cast<const uint4*>(&s.z[buffer][r * LDU + k]);
      }
      issue_after(n, chunks, bar, load);
    }
  }
  // Neither CTA leaves while its peer may still write into its shared memory.
  cluster_sync();
}

}  // namespace dflash::target::kernels::gdn
