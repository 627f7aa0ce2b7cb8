// Stage 2: prepare (gates, (I + A)^-1, W, U, P per chunk).
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// ---- 2. prepare: per (chunk, key head), for each of its value heads: gamma, A, T = (I + A)^-1, W, U, P
// K K^T and Q K^T depend on the key head only (warps 0-3 and 4-7, 16 rows each); each value head
// applies its own decay to them in registers (A to shared memory for the solve, P straight to
// global memory in fragment order). On Hopper they are wgmma products (one per warpgroup),
// formed again for each value head (cheaper than holding them in registers through the solve),
// and W and U are one wgmma each (warpgroup 0 W, warpgroup 1 U, T's scaled rows as register A
// operands); elsewhere mma.sync, the products formed once per CTA.
// The gates' scales are folded into T's columns when T becomes the A operand of W and U
// (W = (T diag(beta e^gamma)) K, U = (T diag(beta)) V), so K stays shared and V is not
// rewritten. W and U go out through shared memory as whole rows (16-byte coalesced stores).
// Bound by latency and shared-memory traffic, not DRAM; wgmma, per-warpgroup staging and barriers
// took the whole core from 0.214 to 0.205 ms at 4096 tokens (bench/RESULTS.md: what was measured
// and tried).
constexpr int kPrepareThreads = 256;
constexpr int kMaxGroup = kGdnMaxGroup;
constexpr int kSolveLd = 40;  // row stride of the solve's 32 x 32 intermediate (B-operand reads conflict-free)

struct __align__(16) PrepareShared {
  mma_tile::Tile q;     // Q; after Q K^T, the staging of W
  mma_tile::Tile k;
  mma_tile::Tile v[2];  // V of this value head and the next; then the staging of U
  float a[C * LDA];     // A
  float t[C * LDA];     // T
  __align__(16) float scratch[32 * kSolveLd];  // the inner products of solve_unit_lower
  float gamma[kMaxGroup][C];
  float beta[kMaxGroup][C];
  float k_scale[kMaxGroup][C];  // beta e^gamma
};

// fp32 products on the tensor cores (mma.m16n8k8, TF32 operands rounded to nearest, fp32
// accumulation): TF32 keeps 10 mantissa bits, more than the bf16 that T is rounded to for W and U.
__device__ __forceinline__ uint32_t tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

// c (16 x 8) = X (16 x kK, row stride ldx) . Y (kK x 8, row stride ldy), fp32 in shared memory.
template <int kK>
__device__ __forceinline__ void product_tf32(float (&c)[4], const float* x, int ldx, const float* y, int ldy) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  c[0] = c[1] = c[2] = c[3] = 0.f;
#pragma unroll
  for (int k = 0; k < kK; k += 8) {
    const uint32_t a0 = tf32(x[g * ldx + k + t4]), a1 = tf32(x[(g + 8) * ldx + k + t4]);
    const uint32_t a2 = tf32(x[g * ldx + k + t4 + 4]), a3 = tf32(x[(g + 8) * ldx + k + t4 + 4]);
    const uint32_t b0 = tf32(y[(k + t4) * ldy + g]), b1 = tf32(y[(k + t4 + 4) * ldy + g]);
    asm volatile(
        "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// c (a 16 x 8 accumulator) times `sign` into rows of stride ld.
__device__ __forceinline__ void store_tf32_result(float* out, int ld, const float (&c)[4], float sign) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  *reinterpret_cast<float2*>(out + g * ld + 2 * t4) = make_float2(sign * c[0], sign * c[1]);
  *reinterpret_cast<float2*>(out + (g + 8) * ld + 2 * t4) = make_float2(sign * c[2], sign * c[3]);
}

// T = (I + A)^-1 for strictly lower A (64x64, fp32, in s.a) into s.t, whose blocks above the
// diagonal blocks the caller has zeroed (they are never written here). The four 16x16 diagonal
// blocks by forward substitution (threads 0-63: one column each, kept in registers; rows of A
// read as broadcasts); then the off-diagonal blocks by merging on the tensor cores: T_10 =
// -T_11 (A_10 T_00) and T_32 = -T_33 (A_32 T_22) by warps 0-3 (8 columns each), then the
// lower-left 32x32 block, -T_hi (A_hi,lo T_lo), by all 8 warps (16 x 8 each).
__device__ void solve_unit_lower(PrepareShared& s) {
  if (threadIdx.x < C) {
    const int base = (threadIdx.x >> 4) * 16, j = threadIdx.x & 15;
    float column[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      float sum = 0;
#pragma unroll
      for (int m = 0; m < i; ++m) sum += s.a[(base + i) * LDA + base + m] * column[m];
      column[i] = i == j ? 1.0f : (i < j ? 0.0f : -sum);
    }
#pragma unroll
    for (int i = 0; i < 16; ++i) s.t[(base + i) * LDA + base + j] = column[i];
  }
  __syncthreads();
  const int warp = threadIdx.x >> 5;
  float c[4];
  if (warp < 4) {  // block (r, r - 1) for r = 1 (warps 0, 1) and r = 3 (warps 2, 3)
    const int r0 = 16 + 32 * (warp >> 1), c0 = r0 - 16, half = 8 * (warp & 1);
    float* x = s.scratch + warp * 16 * 8;  // this warp's 16 x 8 of A_r,r-1 T_r-1,r-1
    product_tf32<16>(c, s.a + r0 * LDA + c0, LDA, s.t + c0 * LDA + c0 + half, LDA);
    store_tf32_result(x, 8, c, 1.f);
    __syncwarp();
    product_tf32<16>(c, s.t + r0 * LDA + r0, LDA, x, 8);
    store_tf32_result(s.t + r0 * LDA + c0 + half, LDA, c, -1.f);
  }
  __syncthreads();
  const int rows = 16 * (warp >> 2), cols = 8 * (warp & 3);  // of the 32 x 32 block
  product_tf32<32>(c, s.a + (32 + rows) * LDA, LDA, s.t + cols, LDA);  // A_hi,lo T_lo
  store_tf32_result(s.scratch + rows * kSolveLd + cols, kSolveLd, c, 1.f);
  __syncthreads();
  product_tf32<32>(c, s.t + (32 + rows) * LDA + 32, LDA, s.scratch + cols, kSolveLd);
  store_tf32_result(s.t + (32 + rows) * LDA + cols, LDA, c, -1.f);
  __syncthreads();
}

// The gates of value head `head` at chunk token t (0 past the chunk's length).
__device__ __forceinline__ void gates_at(const GdnForward& a, int head, int start, int t, int length, float& g, float& beta) {
  g = 0.0f, beta = 0.0f;
  if (t >= length) return;
  const int64_t token = start + t;
  if (a.gate_a != nullptr) {
    g = gdn_decay_gate(__bfloat162float(static_cast<const bf16*>(a.gate_a)[token * a.a_stride + head]),
                       a.a_log[head], a.dt_bias[head]);
    beta = gdn_beta_gate(__bfloat162float(static_cast<const bf16*>(a.gate_b)[token * a.b_stride + head]));
  } else {
    g = a.g[token * a.value_heads + head];
    beta = a.beta[token * a.value_heads + head];
  }
}

// A operand fragments (4 k-steps) of rows [row0, row0 + 16) of T diag(scale), from fp32 T.
// kSkipUpper: T's blocks above the diagonal are not read but taken as zero (warp-uniform).
template <bool kSkipUpper>
__device__ __forceinline__ void scaled_t_fragments(uint32_t (&x)[4][4], const float* t, const float* scale, int row0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int kk = 0; kk < 4; ++kk)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (kSkipUpper && 16 * kk > row0) {
        x[kk][i] = 0u;
        continue;
      }
      const int row = row0 + g + 8 * (i & 1), col = 16 * kk + 2 * t4 + 8 * (i >> 1);
      const float2 v = *reinterpret_cast<const float2*>(t + row * LDA + col);
      const float2 f = *reinterpret_cast<const float2*>(scale + col);
      x[kk][i] = mma_tile::pack(v.x * f.x, v.y * f.y);
    }
}

// Accumulators of rows [row0, +16) x columns [col0, +64) into a tile (bf16), for the row copy-out.
__device__ __forceinline__ void stage_rows(mma_tile::Tile& tile, const float (&acc)[8][4], int row0, int col0) {
  const int lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const int col = col0 + 8 * j + 2 * t4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      *reinterpret_cast<uint32_t*>(tile.v + mma_tile::swizzled(row0 + g + 8 * h, col >> 3) + (col & 7)) =
          mma_tile::pack(acc[j][2 * h], acc[j][2 * h + 1]);
    }
  }
}

// A warp's 16 rows [row0, row0 + 16) x 128 columns of accumulators into a tile (bf16), as the
// A operands they are (stmatrix through store_a).
__device__ __forceinline__ void stage_rows(mma_tile::Tile& tile, const float (&acc)[16][4], int row0) {
  uint32_t rows[8][4];
  mma_tile::to_a(rows, acc);
#pragma unroll
  for (int kk = 0; kk < 8; ++kk) mma_tile::store_a(tile, rows[kk], row0, 16 * kk);
}

// The whole tile to rows of D bf16 in global memory (16-byte stores), by `threads` threads.
__device__ __forceinline__ void store_rows(bf16* out, const mma_tile::Tile& tile, int thread = threadIdx.x, int threads = kPrepareThreads) {
  for (int i = thread; i < C * 16; i += threads) {
    *reinterpret_cast<uint4*>(out + (i >> 4) * D + (i & 15) * 8) =
        *reinterpret_cast<const uint4*>(tile.v + mma_tile::swizzled(i >> 4, i & 15));
  }
}

template <bool kWgmma>
__global__ void __launch_bounds__(kPrepareThreads, 2) prepare_kernel(GdnForward a) {
  barriers::dependents_may_launch();
  extern __shared__ __align__(16) unsigned char raw[];
  // (wgmma's swizzled operands need 1024-byte aligned tiles; mma.sync's do not)
  PrepareShared& s = kWgmma ? mma_tile::aligned_shared<PrepareShared>(raw) : *reinterpret_cast<PrepareShared*>(raw);
  const int chunk = blockIdx.x, key_head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
  const int group = a.value_heads / a.key_heads, head0 = key_head * group;
  const bf16* qkv = static_cast<const bf16*>(a.qkv) + static_cast<int64_t>(start) * a.qkv_stride;
  // V: on wgmma only warpgroup 1 reads it (U), so only it loads it and waits for it.
  auto load_v = [&](int h) {
    const bf16* v = qkv + (2 * a.key_heads + head0 + h) * D;
    if (!kWgmma) {
      mma_tile::load_tile<kPrepareThreads>(s.v[h & 1], v, a.qkv_stride, length);
    } else if (warp >= 4) {
      mma_tile::load_tile<128>(s.v[h & 1], v, a.qkv_stride, length, threadIdx.x - 128);
    }
  };
  mma_tile::load_tile<kPrepareThreads>(s.q, qkv + key_head * D, a.qkv_stride, length);
  mma_tile::load_tile<kPrepareThreads>(s.k, qkv + (a.key_heads + key_head) * D, a.qkv_stride, length);
  load_v(0);
  __pipeline_commit();
  // T's blocks above the diagonal blocks stay zero (solve_unit_lower never writes them); on
  // wgmma only (0, 1) and (2, 3), which the solve reads as parts of its 32 x 32 blocks (the others
  // are never read: scaled_t_fragments<true>).
  if (kWgmma) {
    for (int i = threadIdx.x; i < 2 * 16 * 16; i += kPrepareThreads) {
      const int block = 32 * (i >> 8), r = (i >> 4) & 15, c = i & 15;
      s.t[(block + r) * LDA + block + 16 + c] = 0.0f;
    }
  } else {
    for (int i = threadIdx.x; i < C * LDA; i += kPrepareThreads) s.t[i] = 0.0f;
  }

  // gamma: inclusive cumsum of g over the chunk (g = 0 past the end, so gamma stays at its last
  // value), two warps per value head; then beta e^gamma.
  for (int i = threadIdx.x; i < group * C; i += kPrepareThreads) {  // whole warps (C = 64)
    const int h = i / C, t = i % C;
    float gate, beta;
    gates_at(a, head0 + h, start, t, length, gate, beta);
    s.beta[h][t] = beta;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float other = __shfl_up_sync(0xffffffffu, gate, offset);
      if (lane >= offset) gate += other;
    }
    s.gamma[h][t] = gate;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < group * C; i += kPrepareThreads) {
    const int h = i / C, t = i % C;
    const float gamma = t < 32 ? s.gamma[h][t] : s.gamma[h][t] + s.gamma[h][31];
    s.k_scale[h][t] = s.beta[h][t] * exp_approx(gamma);
    a.gamma[(static_cast<int64_t>(chunk) * a.value_heads + head0 + h) * C + t] = gamma;
    if (t >= 32) s.gamma[h][t] = gamma;  // (t < 32 reads only its own entry above)
  }
  __pipeline_wait_prior(0);
  if (kWgmma) mma_tile::async_proxy_fence();
  __syncthreads();

  // Warps 0-3 (warpgroup 0): K K^T, warps 4-7: Q K^T, rows [16 (warp % 4), +16), all 64 columns:
  // once per CTA on mma.sync; on wgmma once per value head (so they are not held in registers
  // through the solve and W and U, and Q stays: W is staged in A's place instead).
  const int row0 = (warp & 3) * 16;
  float product[8][4];
  if constexpr (!kWgmma) mma_tile::product_16x64(product, warp < 4 ? s.k : s.q, row0, s.k);

  for (int h = 0; h < group; ++h) {
    const int head = head0 + h;
    const int64_t tile = static_cast<int64_t>(chunk) * a.value_heads + head;
    const float* gamma = s.gamma[h];
    if constexpr (kWgmma) {
      wgmma::issue_product(product, warp < 4 ? s.k : s.q, s.k);
      wgmma::wait<0>(product);
    }
    // The decay exp(gamma_r - gamma_c) on the products: A = strict_lower(diag(beta) K K^T o decay)
    // into shared memory; P = causal(scale Q K^T o decay) to global memory in fragment order
    // (see GdnForward::qk).
    float decayed[8][4];
    const float gamma_row[2] = {gamma[row0 + g], gamma[row0 + g + 8]};
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      decayed[j][0] = decayed[j][1] = decayed[j][2] = decayed[j][3] = 0.0f;
      if (8 * j > row0 + 15) continue;  // above the diagonal for all 16 rows (warp-uniform)
      const float2 gamma_col = *reinterpret_cast<const float2*>(gamma + 8 * j + 2 * t4);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = row0 + g + 8 * (e >> 1), c = 8 * j + 2 * t4 + (e & 1);
        const bool keep = warp < 4 ? r > c : r >= c;
        if (keep) decayed[j][e] = product[j][e] * exp_approx(gamma_row[e >> 1] - ((e & 1) ? gamma_col.y : gamma_col.x));
      }
    }
    if (kWgmma && h > 0 && warp < 4) barriers::NamedBarrier{1, 128}.sync();  // the previous head's W (staged in A's place) is copied out
    if (warp < 4) {
      const float beta0 = s.beta[h][row0 + g], beta1 = s.beta[h][row0 + g + 8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int c = 8 * j + 2 * t4;
        *reinterpret_cast<float2*>(s.a + (row0 + g) * LDA + c) = make_float2(beta0 * decayed[j][0], beta0 * decayed[j][1]);
        *reinterpret_cast<float2*>(s.a + (row0 + g + 8) * LDA + c) = make_float2(beta1 * decayed[j][2], beta1 * decayed[j][3]);
      }
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) decayed[j][e] *= a.scale;
      uint32_t p[4][4];
      mma_tile::to_a(p, decayed);
      uint4* out = reinterpret_cast<uint4*>(static_cast<bf16*>(a.qk) + tile * C * C) + (warp - 4) * 4 * 32 + lane;
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) out[kk * 32] = make_uint4(p[kk][0], p[kk][1], p[kk][2], p[kk][3]);
    }
    __syncthreads();
    if (h + 1 < group) load_v(h + 1);  // its buffer's last reader (head h - 1's copy-out) is done
    __pipeline_commit();
    solve_unit_lower(s);
    if constexpr (kWgmma) {
      if (warp >= 4) {  // (T is complete: the solve ends with a barrier)
        __pipeline_wait_prior(1);
        mma_tile::async_proxy_fence();
        barriers::NamedBarrier{2, 128}.sync();
      }
    } else {
      __pipeline_wait_prior(1);
      __syncthreads();
    }

    // W = (T diag(beta e^gamma)) K staged in the Q tile (on wgmma in A's place: the next value
    // head's product reads Q again), U = (T diag(beta)) V in V's own tile once its readers are
    // done. On wgmma: warpgroup 0 W, warpgroup 1 U, 16 rows x 128 columns per warp, each
    // warpgroup staging and copying out its own; on mma.sync: warp w rows 16 (w % 4), columns
    // 64 (w / 4) + [0, 64) of both.
    mma_tile::Tile& v = s.v[h & 1];
    uint32_t x[4][4];
    if constexpr (kWgmma) {
      const bool w_group = warp < 4;
      float acc[16][4];
#pragma unroll
      for (int j = 0; j < 16; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      scaled_t_fragments<true>(x, s.t, w_group ? s.k_scale[h] : s.beta[h], row0);
      wgmma::issue_accumulate(acc, x, w_group ? s.k : v);
      wgmma::wait<0>(acc, x);
      // Each warpgroup stages and copies out its own: W in A's place (dead since the solve), U in
      // V's (read only by this warpgroup's product), between barriers of the warpgroup.
      const barriers::NamedBarrier warpgroup{1 + (warp >> 2), 128};
      mma_tile::Tile& staged = w_group ? *reinterpret_cast<mma_tile::Tile*>(s.a) : v;
      warpgroup.sync();
      stage_rows(staged, acc, row0);
      warpgroup.sync();
      store_rows(static_cast<bf16*>(w_group ? a.w : a.u) + tile * C * D, staged, threadIdx.x & 127, 128);
    } else {
      const int col0 = (warp >> 2) * 64;
      float acc[8][4];
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      scaled_t_fragments<false>(x, s.t, s.k_scale[h], row0);
      mma_tile::accumulate_16xn<4>(acc, x, s.k, col0);
      stage_rows(s.q, acc, row0, col0);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
      scaled_t_fragments<false>(x, s.t, s.beta[h], row0);
      mma_tile::accumulate_16xn<4>(acc, x, v, col0);
      __syncthreads();
      stage_rows(v, acc, row0, col0);
      __syncthreads();
      store_rows(static_cast<bf16*>(a.w) + tile * C * D, s.q);
      store_rows(static_cast<bf16*>(a.u) + tile * C * D, v);
    }
  }
}

}  // namespace dflash::target::kernels::gdn
