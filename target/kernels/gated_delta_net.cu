// The GatedDeltaNet CUDA kernels: see gated_delta_net.h for the math and the data layout.
#include "target/kernels/gated_delta_net.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/bf16x8.cuh"
#include "common/cuda_check.h"
#include "common/fast_math.cuh"
#include "common/mma_tile.cuh"
#include "common/wgmma.cuh"

namespace dflash::target::kernels {
namespace {

using bf16 = __nv_bfloat16;

constexpr int C = kGdnChunk;    // 64 tokens per chunk
constexpr int D = kGdnHeadDim;  // 128
constexpr int LDA = C + 8;      // fp32 row stride of 64x64 matrices (float2 fragment accesses conflict-free)

// ---- 1. causal conv1d + SiLU + L2 norm of the q/k heads ---------------------------------------
// A thread owns 8 adjacent channels (16-byte loads and stores) over kConvTokens tokens, keeping
// the last three inputs in registers, so every input row is read once; a head's 128 channels are
// 16 lanes of one warp, whose sum of squares is a 4-step shuffle.
constexpr int kConvTokens = 32;
constexpr int kConvThreads = 128;  // 1024 channels per CTA

using bf16x8::load8;
using bf16x8::weighted_norm;

__global__ void __launch_bounds__(kConvThreads) conv1d_silu_l2norm_kernel(const bf16* __restrict__ x, int64_t x_stride,
                                                                          const bf16* __restrict__ weight, int kernel,
                                                                          const int64_t* __restrict__ positions,
                                                                          bf16* __restrict__ y, int tokens, int channels,
                                                                          int qk_channels) {
  const int c0 = (blockIdx.y * kConvThreads + threadIdx.x) * 8;
  const bool active = c0 < channels;       // channels % 128 == 0: whole 16-lane heads agree
  const bool normalise = c0 < qk_channels;  // likewise
  // w[s][e]: the tap applied to x[t - s] of channel c0 + e (zero past the kernel width).
  float w[4][8] = {};
  if (active) {
    for (int s = 0; s < kernel; ++s)
#pragma unroll
      for (int e = 0; e < 8; ++e) w[s][e] = __bfloat162float(weight[static_cast<int64_t>(c0 + e) * kernel + kernel - 1 - s]);
  }
  const int t0 = blockIdx.x * kConvTokens, t1 = min(t0 + kConvTokens, tokens);
  float history[3][8] = {}, current[8] = {};  // x[t - 1 - i], x[t]
  if (active) {
    for (int i = 0; i < 3; ++i)
      if (i + 1 < kernel && t0 - 1 - i >= 0) load8(history[i], x + (t0 - 1 - i) * x_stride + c0);
    load8(current, x + t0 * x_stride + c0);
  }
  for (int t = t0; t < t1; ++t) {
    float next[8] = {};
    if (active && t + 1 < t1) load8(next, x + (t + 1) * x_stride + c0);
    const int64_t position = positions[t];  // taps before the sequence's first token are skipped
    float out[8], squares = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = w[0][e] * current[e];
#pragma unroll
      for (int s = 1; s < 4; ++s) {
        if (s <= position) acc += w[s][e] * history[s - 1][e];
      }
      out[e] = acc / (1.0f + __expf(-acc));
      squares += out[e] * out[e];
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float factor = normalise ? rsqrtf(squares + 1e-6f) : 1.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] *= factor;
    if (active) bf16x8::store8(y + static_cast<int64_t>(t) * channels + c0, out);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      history[2][e] = history[1][e];
      history[1][e] = history[0][e];
      history[0][e] = current[e];
      current[e] = next[e];
    }
  }
}

// Programmatic dependent launch (sm_90 and newer; no-ops elsewhere and when the launch did not ask
// for it): a kernel that says dependents_may_launch lets the next kernel in the stream, launched
// with launch_dependent, be scheduled onto SMs as its own CTAs leave (once every CTA of it has
// said so); that kernel calls wait_for_prerequisite before it reads anything its predecessor
// writes, which returns when the predecessor has finished and its writes are visible.
__device__ __forceinline__ void dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

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
    const float x = __bfloat162float(static_cast<const bf16*>(a.gate_a)[token * a.a_stride + head]) + a.dt_bias[head];
    g = -expf(a.a_log[head]) * (x > 20.0f ? x : log1pf(expf(x)));  // softplus with torch's threshold
    beta = 1.0f / (1.0f + expf(-__bfloat162float(static_cast<const bf16*>(a.gate_b)[token * a.b_stride + head])));
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
  dependents_may_launch();
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
    if (kWgmma && h > 0 && warp < 4) named_sync(1, 128);  // the previous head's W (staged in A's place) is copied out
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
        named_sync(2, 128);
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
      const int barrier = 1 + (warp >> 2);
      mma_tile::Tile& staged = w_group ? *reinterpret_cast<mma_tile::Tile*>(s.a) : v;
      named_sync(barrier, 128);
      stage_rows(staged, acc, row0);
      named_sync(barrier, 128);
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

__device__ __forceinline__ void pair_barrier(int pair) {
  asm volatile("bar.sync %0, 64;\n" ::"r"(1 + pair) : "memory");
}

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
}

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

// ---- 4. output: O = diag(scale e^gamma) Q S + P V', then the gated norm -----------------------
// 4 warps, each 16 tokens x all 128 value columns (so the norm over a row stays in the warp's
// quads): Q as a swizzled tile, P in A-fragment order, S^T and V'^T in the fragment order the
// state pass wrote them (the B fragments of two n8 tiles of S or V' as one 16-byte shared load per
// lane, pairs in adjacent registers); products by mma.sync, the row scale applied to the
// accumulators.
constexpr int kOutputThreads = 128;

struct OutputShared {  // 74 KB: three CTAs per SM
  mma_tile::Tile q;
  uint4 state[64 * 32];        // S^T in fragment order: the B operands of Q S
  uint4 v[32 * 32];            // V'^T in fragment order: the B operands of P V'
  uint4 p[16 * 32];             // P in fragment order: the A operands of P V'
  float q_scale[C];             // scale e^gamma per row
};

__global__ void __launch_bounds__(kOutputThreads) output_kernel(GdnForward a) {
  extern __shared__ __align__(128) unsigned char smem[];
  OutputShared& s = *reinterpret_cast<OutputShared*>(smem);
  const int chunk = blockIdx.x, head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3, row0 = warp * 16;
  const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
  const int key_head = head / (a.value_heads / a.key_heads);
  const int64_t tile = static_cast<int64_t>(chunk) * a.value_heads + head;
  const bf16* q = static_cast<const bf16*>(a.qkv) + static_cast<int64_t>(start) * a.qkv_stride + key_head * D;
  const uint4* state = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.states) + tile * D * D);
  const uint4* v_new = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.v_new) + tile * C * D);
  mma_tile::load_tile<kOutputThreads>(s.q, q, a.qkv_stride, length);
  for (int i = threadIdx.x; i < 64 * 32; i += kOutputThreads) mma_tile::copy16(&s.state[i], state + i);
  for (int i = threadIdx.x; i < 32 * 32; i += kOutputThreads) mma_tile::copy16(&s.v[i], v_new + i);
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.qk) + tile * C * C);
  for (int i = threadIdx.x; i < 16 * 32; i += kOutputThreads) mma_tile::copy16(&s.p[i], p + i);
  if (threadIdx.x < C) s.q_scale[threadIdx.x] = a.scale * exp_approx(a.gamma[tile * C + threadIdx.x]);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  float acc[16][4] = {};  // O rows row0 + g (c[0], c[1]) and + 8 (c[2], c[3]); value columns 8n + 2t4
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // Q S over the key dims
    uint32_t x[4];
    mma_tile::load_a(x, s.q, row0, ks * 16);
#pragma unroll
    for (int np = 0; np < 8; ++np) {  // value columns [16 np, +16): one fragment-ordered block
      const uint4 y = s.state[(np * 8 + ks) * 32 + lane];
      mma_tile::mma(acc[2 * np], x, y.x, y.y);
      mma_tile::mma(acc[2 * np + 1], x, y.z, y.w);
    }
  }
  const float scale0 = s.q_scale[row0 + g], scale1 = s.q_scale[row0 + g + 8];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] *= scale0, acc[n][1] *= scale0, acc[n][2] *= scale1, acc[n][3] *= scale1;
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {  // + P V' over the chunk's tokens
    const uint4 pf = s.p[(warp * 4 + kk) * 32 + lane];
    const uint32_t x[4] = {pf.x, pf.y, pf.z, pf.w};
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      const uint4 y = s.v[(np * 4 + kk) * 32 + lane];
      mma_tile::mma(acc[2 * np], x, y.x, y.y);
      mma_tile::mma(acc[2 * np + 1], x, y.z, y.w);
    }
  }

  // Epilogue: rows row0 + g and row0 + g + 8; a row's 128 values are spread over one quad.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    const int64_t token = start + r;
    float squares = 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) squares += acc[n][2 * half] * acc[n][2 * half] + acc[n][2 * half + 1] * acc[n][2 * half + 1];
    squares += __shfl_xor_sync(0xffffffffu, squares, 1);
    squares += __shfl_xor_sync(0xffffffffu, squares, 2);
    if (r >= length) continue;
    if (a.out_raw != nullptr) {
      float* out = a.out_raw + (token * a.value_heads + head) * D;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(out + 8 * n + 2 * t4) = make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
      }
      continue;
    }
    if (a.out_plain != nullptr) {
      bf16* out = static_cast<bf16*>(a.out_plain) + (token * a.value_heads + head) * D;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * n + 2 * t4) = __floats2bfloat162_rn(acc[n][2 * half], acc[n][2 * half + 1]);
      }
      continue;
    }
    const float rstd = rsqrtf(squares / D + a.eps);
    const bf16* z = static_cast<const bf16*>(a.z) + token * a.z_stride + head * D;
    const bf16* w = static_cast<const bf16*>(a.norm_weight);
    bf16* out = static_cast<bf16*>(a.out) + (token * a.value_heads + head) * D;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const int col = 8 * n + 2 * t4;
      const float2 gate = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(z + col));
      const float2 weight = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(w + col));
      // As the reference: the weighted rmsnorm(o) rounded as HF does, then times silu(z) in fp32.
      const float w0 = weighted_norm(acc[n][2 * half] * rstd, weight.x, false);
      const float w1 = weighted_norm(acc[n][2 * half + 1] * rstd, weight.y, false);
      *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(w0 * gate.x / (1.0f + __expf(-gate.x)),
                                                                            w1 * gate.y / (1.0f + __expf(-gate.y)));
    }
  }
}

}  // namespace

void conv1d_silu_l2norm(const void* x, int64_t x_stride, const void* weight, int kernel, const int64_t* positions,
                        void* y, int tokens, int channels, int qk_channels, cudaStream_t stream) {
  if (tokens == 0) return;
  if (kernel < 1 || kernel > 4 || channels % 128 != 0 || qk_channels % 128 != 0 || x_stride % 8 != 0) {
    throw std::invalid_argument(
        "conv1d_silu_l2norm: needs kernel 1..4, channel counts that are multiples of 128, a row stride multiple of 8");
  }
  const dim3 grid((tokens + kConvTokens - 1) / kConvTokens, (channels / 8 + kConvThreads - 1) / kConvThreads);
  conv1d_silu_l2norm_kernel<<<grid, kConvThreads, 0, stream>>>(static_cast<const bf16*>(x), x_stride, static_cast<const bf16*>(weight),
                                                      kernel, positions, static_cast<bf16*>(y), tokens, channels,
                                                      qk_channels);
  check_cuda_launch("GatedDeltaNet kernel conv1d_silu_l2norm");
}

// The fused wgmma state + output kernel on compute capability 9.0 when built for sm_90a (64 value
// columns per CTA), the mma.sync kernels elsewhere (and where a test forces them:
// kernel_variants.h).
bool warpgroup_kernels() {
#ifdef DFLASHD_CUDA_SM90A
  return warpgroup_mma_on_current_device(MmaKernels::gated_delta_net);
#else
  return false;
#endif
}

// Launches `kernel` as a programmatic dependent of the stream's previous kernel (see
// dependents_may_launch), so that its CTAs start, and its set-up runs, while that kernel's last
// CTAs finish.
template <typename... Args>
cudaError_t launch_dependent(void (*kernel)(Args...), dim3 grid, int threads, size_t shared_bytes, cudaStream_t stream,
                             Args... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, args...);
}

template <int kPairs>
void launch_state(const GdnForward& args, cudaStream_t stream) {
  const size_t bytes = sizeof(StateShared<kPairs>);
  allow_shared_memory(state_kernel<kPairs>, bytes, "GatedDeltaNet kernel state");
  state_kernel<kPairs><<<dim3(args.chunks.num_seqs, args.value_heads, D / (16 * kPairs)), 64 * kPairs, bytes, stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel state");
}

bool gated_delta_rule_fuses_output(int state_columns) {
  return state_columns == 64 && warpgroup_kernels();
}

void gated_delta_rule_forward(const GdnForward& args, cudaStream_t stream) {
  if (args.chunks.num_chunks == 0) return;
  if (args.key_heads <= 0 || args.value_heads % args.key_heads != 0) {
    throw std::invalid_argument("gated_delta_rule_forward: value heads must be a multiple of key heads");
  }
  if (args.value_heads / args.key_heads > kMaxGroup) {
    throw std::invalid_argument("gated_delta_rule_forward: at most " + std::to_string(kMaxGroup) +
                                " value heads per key head (got " + std::to_string(args.value_heads / args.key_heads) + ")");
  }
  if ((args.out_raw != nullptr) + (args.out_plain != nullptr) + (args.out != nullptr) != 1) {
    throw std::invalid_argument("gated_delta_rule_forward: exactly one of out_raw, out_plain and out");
  }
  const dim3 per_chunk(args.chunks.num_chunks, args.value_heads);
  auto mark = [&](int i) {
    if (args.stage_events != nullptr) cudaEventRecord(args.stage_events[i], stream);
  };
  mark(0);
  const size_t prepare_bytes = sizeof(PrepareShared) + mma_tile::kSharedAlignment;
  auto* prepare = warpgroup_kernels() ? prepare_kernel<true> : prepare_kernel<false>;
  allow_shared_memory(prepare, prepare_bytes, "GatedDeltaNet kernel prepare");
  prepare<<<dim3(args.chunks.num_chunks, args.key_heads), kPrepareThreads, prepare_bytes, stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel prepare");
  mark(1);
  if (gated_delta_rule_fuses_output(args.state_columns)) {
    const size_t bytes = sizeof(FusedShared) + mma_tile::kSharedAlignment;
    allow_shared_memory(state_output_kernel, bytes, "GatedDeltaNet kernel state+output (wgmma)");
    check_cuda(launch_dependent(state_output_kernel, dim3(args.chunks.num_seqs, args.value_heads, D / FusedShared::BV),
                                kFusedThreads, bytes, stream, args),
               "GatedDeltaNet kernel state+output (wgmma)");
    mark(2);
    mark(3);
    return;
  }
  switch (args.state_columns) {
    case 32: launch_state<2>(args, stream); break;
    case 64: launch_state<4>(args, stream); break;
    case 128: launch_state<8>(args, stream); break;
    default: throw std::invalid_argument("gated_delta_rule_forward: state_columns must be 32, 64 or 128");
  }
  mark(2);
  allow_shared_memory(output_kernel, sizeof(OutputShared), "GatedDeltaNet kernel output");
  output_kernel<<<per_chunk, kOutputThreads, sizeof(OutputShared), stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel output");
  mark(3);
}

const char* kernels_unavailable_on_current_device() {
  return kernel_image_missing(output_kernel);
}

}  // namespace dflash::target::kernels
