// The GatedDeltaNet CUDA kernels: see gated_delta_net.h for the math and the data layout.
#include "target/kernels/gated_delta_net.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>
#include <mma.h>

#include <stdexcept>
#include <string>

#include "common/cuda_check.h"

namespace dflash::target::kernels {
namespace {

namespace wmma = nvcuda::wmma;
using bf16 = __nv_bfloat16;

constexpr int C = kGdnChunk;    // 64 tokens per chunk
constexpr int D = kGdnHeadDim;  // 128
constexpr int LD = D + 8;       // bf16 row stride of 128-wide tiles in shared memory (no bank conflicts)
constexpr int LDA = C + 4;      // fp32 row stride of 64x64 matrices
constexpr int LDT = C + 8;      // bf16 row stride of 64x64 matrices
constexpr int LDS = D + 4;      // fp32 row stride of 64x128 staging

using FragA = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::row_major>;
using FragAT = wmma::fragment<wmma::matrix_a, 16, 16, 16, bf16, wmma::col_major>;
using FragB = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::row_major>;
using FragBT = wmma::fragment<wmma::matrix_b, 16, 16, 16, bf16, wmma::col_major>;
using FragC = wmma::fragment<wmma::accumulator, 16, 16, 16, float>;

// Copies `rows` rows of `cols` bf16 (a multiple of 8) from global memory into shared memory
// asynchronously; rows at or past `valid` are zero-filled. The caller commits and waits.
__device__ inline void load_rows_async(bf16* dst, int dst_ld, const bf16* src, int64_t src_ld, int rows, int valid,
                                       int cols) {
  const int per_row = cols / 8;
  for (int i = threadIdx.x; i < rows * per_row; i += blockDim.x) {
    const int r = i / per_row, c = (i % per_row) * 8;
    bf16* d = dst + r * dst_ld + c;
    if (r < valid) {
      __pipeline_memcpy_async(d, src + r * src_ld + c, 16);
    } else {
      *reinterpret_cast<uint4*>(d) = make_uint4(0, 0, 0, 0);
    }
  }
}

// acc[j] += A (16 x 16K, row-major, lda) . B (16K x 16NJ, row-major, ldb), column tile j of B.
template <int NJ, int K>
__device__ inline void mma_row_tile(FragC (&acc)[NJ], const bf16* a, int lda, const bf16* b, int ldb) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    FragA x;
    wmma::load_matrix_sync(x, a + kk * 16, lda);
#pragma unroll
    for (int j = 0; j < NJ; ++j) {
      FragB y;
      wmma::load_matrix_sync(y, b + kk * 16 * ldb + j * 16, ldb);
      wmma::mma_sync(acc[j], x, y, acc[j]);
    }
  }
}

__device__ inline float warp_sum(float x) {
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// ---- 1. causal conv1d + SiLU + L2 norm of the q/k heads ---------------------------------------
constexpr int kConvTokens = 16;

__global__ void __launch_bounds__(128) conv1d_silu_l2norm_kernel(const bf16* __restrict__ x,
                                                                 const bf16* __restrict__ weight, int kernel,
                                                                 const int64_t* __restrict__ positions,
                                                                 bf16* __restrict__ y, int tokens, int channels,
                                                                 int qk_channels) {
  __shared__ float partial[2][4];
  const int c = blockIdx.y * 128 + threadIdx.x;
  const bool normalise = blockIdx.y * 128 < qk_channels;  // uniform per block
  float w[4] = {0, 0, 0, 0};
  for (int i = 0; i < kernel; ++i) w[i] = __bfloat162float(weight[static_cast<int64_t>(c) * kernel + i]);
  const int t0 = blockIdx.x * kConvTokens, t1 = min(t0 + kConvTokens, tokens);
  for (int t = t0; t < t1; ++t) {
    const int64_t position = positions[t];
    float acc = 0;
    for (int s = 0; s < kernel; ++s) {
      if (s <= position) acc += w[kernel - 1 - s] * __bfloat162float(x[static_cast<int64_t>(t - s) * channels + c]);
    }
    float value = acc / (1.0f + __expf(-acc));
    if (normalise) {
      const float sum = warp_sum(value * value);
      const int buffer = t & 1;
      if ((threadIdx.x & 31) == 0) partial[buffer][threadIdx.x >> 5] = sum;
      __syncthreads();
      const float total = partial[buffer][0] + partial[buffer][1] + partial[buffer][2] + partial[buffer][3];
      value *= rsqrtf(total + 1e-6f);
    }
    y[static_cast<int64_t>(t) * channels + c] = __float2bfloat16(value);
  }
}

// ---- 2. prepare: gamma, T = (I + A)^-1, W, U per (chunk, value head) -------------------------
struct PrepareShared {
  bf16 q[C * LD];
  bf16 k[C * LD];
  bf16 v[C * LD];
  float a[C * LDA];  // A, then (with t) the fp32 staging of W and U
  float t[C * LDA];
  bf16 tb[C * LDT];
  float scratch[4][16 * 17];  // one 16x16 block per off-diagonal pair
  float gamma[C];
  float beta[C];
  float k_scale[C];  // beta e^gamma per row
};
static_assert(2 * C * LDA >= C * LDS, "staging must fit in a and t");

// T = (I + A)^-1 for strictly lower A (64x64, fp32, in s.a) into s.t: the four 16x16 diagonal
// blocks by substitution (warps 0-3, one block each), then the off-diagonal blocks by block
// diagonals, T_ij = -T_ii sum_{m=j}^{i-1} A_im T_mj, each block by two warps of 8 rows.
__device__ void solve_unit_lower(PrepareShared& s) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  for (int i = threadIdx.x; i < C * LDA; i += blockDim.x) s.t[i] = 0;
  __syncthreads();
  if (warp < 4) {
    const int base = warp * 16, j = lane & 15, half = lane >> 4;
    for (int i = 0; i < 16; ++i) {
      float sum = 0;
      if (j < i) {
        for (int m = j + half; m < i; m += 2) sum += s.a[(base + i) * LDA + base + m] * s.t[(base + m) * LDA + base + j];
      }
      sum += __shfl_xor_sync(0xffffffffu, sum, 16);
      if (half == 0) s.t[(base + i) * LDA + base + j] = i == j ? 1.0f : (j < i ? -sum : 0.0f);
      __syncwarp();
    }
  }
  __syncthreads();
  const int pair = warp & 3, row = (warp >> 2) * 8 + (lane >> 2), col0 = (lane & 3) * 4;
  float* x = s.scratch[pair];
  for (int d = 1; d < 4; ++d) {
    const bool active = pair < 4 - d;
    const int bj = pair, bi = pair + d;
    if (active) {
      float acc[4] = {0, 0, 0, 0};
      for (int bm = bj; bm < bi; ++bm) {
        for (int kk = 0; kk < 16; ++kk) {
          const float a = s.a[(bi * 16 + row) * LDA + bm * 16 + kk];
          const float* trow = &s.t[(bm * 16 + kk) * LDA + bj * 16 + col0];
#pragma unroll
          for (int c = 0; c < 4; ++c) acc[c] += a * trow[c];
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) x[row * 17 + col0 + c] = acc[c];
    }
    __syncthreads();
    if (active) {
      float out[4] = {0, 0, 0, 0};
      for (int kk = 0; kk < 16; ++kk) {
        const float tii = s.t[(bi * 16 + row) * LDA + bi * 16 + kk];
#pragma unroll
        for (int c = 0; c < 4; ++c) out[c] += tii * x[kk * 17 + col0 + c];
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) s.t[(bi * 16 + row) * LDA + bj * 16 + col0 + c] = -out[c];
    }
    __syncthreads();
  }
}

constexpr int kPrepareThreads = 256;

__global__ void __launch_bounds__(kPrepareThreads) prepare_kernel(GdnForward a) {
  extern __shared__ __align__(128) unsigned char smem[];
  PrepareShared& s = *reinterpret_cast<PrepareShared*>(smem);
  const int chunk = blockIdx.x, head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
  const int key_head = head / (a.value_heads / a.key_heads);
  const bf16* qkv = static_cast<const bf16*>(a.qkv) + static_cast<int64_t>(start) * a.qkv_stride;
  load_rows_async(s.q, LD, qkv + key_head * D, a.qkv_stride, C, length, D);
  load_rows_async(s.k, LD, qkv + (a.key_heads + key_head) * D, a.qkv_stride, C, length, D);
  load_rows_async(s.v, LD, qkv + (2 * a.key_heads + head) * D, a.qkv_stride, C, length, D);
  __pipeline_commit();

  // gamma: inclusive cumsum of g over the chunk (0 past the end, so gamma stays at its last value).
  if (threadIdx.x < C) {
    const int t = threadIdx.x;
    const int64_t at = static_cast<int64_t>(start + t) * a.value_heads + head;
    float g = t < length ? a.g[at] : 0.0f;
    s.beta[t] = t < length ? a.beta[at] : 0.0f;
    for (int offset = 1; offset < 32; offset <<= 1) {
      const float other = __shfl_up_sync(0xffffffffu, g, offset);
      if (lane >= offset) g += other;
    }
    s.gamma[t] = g;
  }
  __syncthreads();
  if (threadIdx.x >= 32 && threadIdx.x < C) s.gamma[threadIdx.x] += s.gamma[31];
  __pipeline_wait_prior(0);
  __syncthreads();
  if (threadIdx.x < C) {
    a.gamma[(static_cast<int64_t>(chunk) * a.value_heads + head) * C + threadIdx.x] = s.gamma[threadIdx.x];
    s.k_scale[threadIdx.x] = s.beta[threadIdx.x] * __expf(s.gamma[threadIdx.x]);
  }

  // Warps 0-3: K K^T into a; warps 4-7: Q K^T into t (16 rows x 64 columns each).
  {
    const int rows = (warp & 3) * 16;
    const bf16* lhs = warp < 4 ? s.k : s.q;
    float* out = warp < 4 ? s.a : s.t;
    FragC acc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[j], 0.0f);
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      FragA x;
      wmma::load_matrix_sync(x, lhs + rows * LD + kk * 16, LD);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        FragBT y;
        wmma::load_matrix_sync(y, s.k + j * 16 * LD + kk * 16, LD);
        wmma::mma_sync(acc[j], x, y, acc[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::store_matrix_sync(out + rows * LDA + j * 16, acc[j], LDA, wmma::mem_row_major);
  }
  __syncthreads();
  // A = strict_lower(diag(beta) K K^T o decay) in place; P = causal(scale Q K^T o decay) to global.
  __nv_bfloat162* qk =
      reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(a.qk) + (static_cast<int64_t>(chunk) * a.value_heads + head) * C * C);
  for (int i = threadIdx.x; i < C * C / 2; i += blockDim.x) {
    const int r = (2 * i) / C, c = (2 * i) % C;
    float out[2];
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float decay = c + e <= r ? __expf(s.gamma[r] - s.gamma[c + e]) : 0.0f;
      s.a[r * LDA + c + e] = r > c + e ? s.beta[r] * s.a[r * LDA + c + e] * decay : 0.0f;
      out[e] = s.t[r * LDA + c + e] * a.scale * decay;
    }
    qk[i] = __floats2bfloat162_rn(out[0], out[1]);
  }
  __syncthreads();
  solve_unit_lower(s);

  // T to bf16; K rows scaled by beta e^gamma, V rows by beta (in place).
  for (int i = threadIdx.x; i < C * C; i += blockDim.x) s.tb[(i / C) * LDT + i % C] = __float2bfloat16(s.t[(i / C) * LDA + i % C]);
  for (int i = threadIdx.x; i < C * D / 2; i += blockDim.x) {
    const int r = (2 * i) / D, c = (2 * i) % D;
    __nv_bfloat162& k2 = *reinterpret_cast<__nv_bfloat162*>(&s.k[r * LD + c]);
    __nv_bfloat162& v2 = *reinterpret_cast<__nv_bfloat162*>(&s.v[r * LD + c]);
    const float2 kf = __bfloat1622float2(k2), vf = __bfloat1622float2(v2);
    k2 = __floats2bfloat162_rn(kf.x * s.k_scale[r], kf.y * s.k_scale[r]);
    v2 = __floats2bfloat162_rn(vf.x * s.beta[r], vf.y * s.beta[r]);
  }
  __syncthreads();

  // W = T (beta e^gamma K), then U = T (beta V): warp w computes rows 16(w%4), columns 64(w/4) + [0, 64).
  const int64_t tile = (static_cast<int64_t>(chunk) * a.value_heads + head) * C * D;
  float* stage = s.a;  // a and t are free now
  const int rows = (warp & 3) * 16, cols = (warp >> 2) * 64;
  for (int which = 0; which < 2; ++which) {
    const bf16* rhs = which == 0 ? s.k : s.v;
    FragC acc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[j], 0.0f);
    mma_row_tile<4, C / 16>(acc, s.tb + rows * LDT, LDT, rhs + cols, LD);
#pragma unroll
    for (int j = 0; j < 4; ++j) wmma::store_matrix_sync(stage + rows * LDS + cols + j * 16, acc[j], LDS, wmma::mem_row_major);
    __syncthreads();
    __nv_bfloat162* out = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(which == 0 ? a.w : a.u) + tile);
    for (int i = threadIdx.x; i < C * D / 2; i += blockDim.x) {
      const int r = (2 * i) / D, c = (2 * i) % D;
      out[i] = __floats2bfloat162_rn(stage[r * LDS + c], stage[r * LDS + c + 1]);
    }
    __syncthreads();
  }
}

// ---- 3. state: the sequential pass over the chunks of one sequence ---------------------------
template <int BV>
struct StateShared {
  static constexpr int LDV = BV + 8;
  static constexpr int LDF = BV + 4;
  bf16 w[2][C * LD];
  bf16 k[2][C * LD];
  bf16 u[2][C * LDV];
  float gamma[2][C];
  float f[D * LDF];  // S in fp32, then W S
  bf16 sb[D * LDV];  // S in bf16, then V' e^(gamma_last - gamma) in bf16
};

constexpr int kStateThreads = 256;

template <int BV>
__global__ void __launch_bounds__(kStateThreads) state_kernel(GdnForward a) {
  using Shared = StateShared<BV>;
  constexpr int LDV = Shared::LDV, LDF = Shared::LDF, NJ = BV / 16;
  extern __shared__ __align__(128) unsigned char smem[];
  Shared& s = *reinterpret_cast<Shared*>(smem);
  const int seq = blockIdx.x, head = blockIdx.y, v0 = blockIdx.z * BV, warp = threadIdx.x >> 5;
  const int first = a.chunks.seq_chunks[seq], last = a.chunks.seq_chunks[seq + 1];
  const int key_head = head / (a.value_heads / a.key_heads);
  const bf16* qkv = static_cast<const bf16*>(a.qkv);

  auto load = [&](int chunk, int buffer) {
    const int64_t tile = (static_cast<int64_t>(chunk) * a.value_heads + head) * C * D;
    const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
    load_rows_async(s.w[buffer], LD, static_cast<const bf16*>(a.w) + tile, D, C, C, D);
    load_rows_async(s.u[buffer], LDV, static_cast<const bf16*>(a.u) + tile + v0, D, C, C, BV);
    load_rows_async(s.k[buffer], LD, qkv + static_cast<int64_t>(start) * a.qkv_stride + (a.key_heads + key_head) * D,
                    a.qkv_stride, C, length, D);
    if (threadIdx.x < C) {
      __pipeline_memcpy_async(&s.gamma[buffer][threadIdx.x],
                              a.gamma + (static_cast<int64_t>(chunk) * a.value_heads + head) * C + threadIdx.x, 4);
    }
    __pipeline_commit();
  };

  // The state S (128 x BV, fp32) in registers: warp w holds rows [16w, 16w + 16).
  FragC state[NJ];
#pragma unroll
  for (int j = 0; j < NJ; ++j) wmma::fill_fragment(state[j], 0.0f);

  if (first < last) load(first, 0);
  for (int chunk = first; chunk < last; ++chunk) {
    const int buffer = (chunk - first) & 1;
    if (chunk + 1 < last) {
      load(chunk + 1, buffer ^ 1);
      __pipeline_wait_prior(1);
    } else {
      __pipeline_wait_prior(0);
    }
    // S -> fp32 staging -> bf16 (operand of W S and the stored state of this chunk).
#pragma unroll
    for (int j = 0; j < NJ; ++j) wmma::store_matrix_sync(s.f + warp * 16 * LDF + j * 16, state[j], LDF, wmma::mem_row_major);
    __syncthreads();
    bf16* states = static_cast<bf16*>(a.states) + (static_cast<int64_t>(chunk) * a.value_heads + head) * D * D + v0;
    for (int i = threadIdx.x; i < D * BV / 2; i += blockDim.x) {
      const int r = (2 * i) / BV, c = (2 * i) % BV;
      const __nv_bfloat162 pair = __floats2bfloat162_rn(s.f[r * LDF + c], s.f[r * LDF + c + 1]);
      *reinterpret_cast<__nv_bfloat162*>(&s.sb[r * LDV + c]) = pair;
      *reinterpret_cast<__nv_bfloat162*>(&states[r * D + c]) = pair;
    }
    __syncthreads();
    // W S (64 x BV): 4 x NJ tiles over the 8 warps.
    for (int t = warp; t < 4 * NJ; t += 8) {
      const int rows = (t & 3) * 16, cols = (t >> 2) * 16;
      FragC acc;
      wmma::fill_fragment(acc, 0.0f);
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
        FragA x;
        FragB y;
        wmma::load_matrix_sync(x, s.w[buffer] + rows * LD + kk * 16, LD);
        wmma::load_matrix_sync(y, s.sb + kk * 16 * LDV + cols, LDV);
        wmma::mma_sync(acc, x, y, acc);
      }
      wmma::store_matrix_sync(s.f + rows * LDF + cols, acc, LDF, wmma::mem_row_major);
    }
    __syncthreads();
    // V' = U - W S (stored bf16 for the output kernel); its decayed copy feeds the update.
    const float gamma_last = s.gamma[buffer][C - 1];
    bf16* v_new = static_cast<bf16*>(a.v_new) + (static_cast<int64_t>(chunk) * a.value_heads + head) * C * D + v0;
    for (int i = threadIdx.x; i < C * BV; i += blockDim.x) {
      const int r = i / BV, c = i % BV;
      const float value = __bfloat162float(s.u[buffer][r * LDV + c]) - s.f[r * LDF + c];
      v_new[r * D + c] = __float2bfloat16(value);
      s.sb[r * LDV + c] = __float2bfloat16(value * __expf(gamma_last - s.gamma[buffer][r]));
    }
    __syncthreads();
    // S = e^gamma_last S + K^T (V' e^(gamma_last - gamma)).
    const float decay = __expf(gamma_last);
#pragma unroll
    for (int j = 0; j < NJ; ++j)
#pragma unroll
      for (int e = 0; e < state[j].num_elements; ++e) state[j].x[e] *= decay;
#pragma unroll
    for (int kk = 0; kk < C / 16; ++kk) {
      FragAT x;  // K^T rows [16w, +16), tokens [16kk, +16)
      wmma::load_matrix_sync(x, s.k[buffer] + kk * 16 * LD + warp * 16, LD);
#pragma unroll
      for (int j = 0; j < NJ; ++j) {
        FragB y;
        wmma::load_matrix_sync(y, s.sb + kk * 16 * LDV + j * 16, LDV);
        wmma::mma_sync(state[j], x, y, state[j]);
      }
    }
    __syncthreads();  // the buffers of this chunk are reloaded next iteration
  }
}

// ---- 4. output: O = (scale e^gamma Q) S + P V', then the gated norm ---------------------------
struct OutputShared {
  bf16 q[C * LD];
  bf16 state[D * LD];  // S, then the fp32 staging of O
  bf16 v[C * LD];
  bf16 p[C * LDT];
  float q_scale[C];  // scale e^gamma per row
};
static_assert(D * LD * sizeof(bf16) >= C * LDS * sizeof(float), "O staging must fit in the state");

__global__ void __launch_bounds__(256) output_kernel(GdnForward a) {
  extern __shared__ __align__(128) unsigned char smem[];
  OutputShared& s = *reinterpret_cast<OutputShared*>(smem);
  const int chunk = blockIdx.x, head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
  const int key_head = head / (a.value_heads / a.key_heads);
  const int64_t tile = static_cast<int64_t>(chunk) * a.value_heads + head;
  const bf16* qkv = static_cast<const bf16*>(a.qkv) + static_cast<int64_t>(start) * a.qkv_stride;
  load_rows_async(s.q, LD, qkv + key_head * D, a.qkv_stride, C, length, D);
  load_rows_async(s.state, LD, static_cast<const bf16*>(a.states) + tile * D * D, D, D, D, D);
  load_rows_async(s.v, LD, static_cast<const bf16*>(a.v_new) + tile * C * D, D, C, C, D);
  load_rows_async(s.p, LDT, static_cast<const bf16*>(a.qk) + tile * C * C, C, C, C, C);
  if (threadIdx.x < C) s.q_scale[threadIdx.x] = a.scale * __expf(a.gamma[tile * C + threadIdx.x]);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();
  for (int i = threadIdx.x; i < C * D / 2; i += blockDim.x) {
    const int r = (2 * i) / D, c = (2 * i) % D;
    __nv_bfloat162& pair = *reinterpret_cast<__nv_bfloat162*>(&s.q[r * LD + c]);
    const float2 x = __bfloat1622float2(pair);
    pair = __floats2bfloat162_rn(x.x * s.q_scale[r], x.y * s.q_scale[r]);
  }
  __syncthreads();
  // O (64 x 128): warp w owns row tile w/2, column tiles 4(w%2) .. 4(w%2)+3.
  FragC acc[4];
  const int row = (warp >> 1) * 16, col = (warp & 1) * 64;
#pragma unroll
  for (int j = 0; j < 4; ++j) wmma::fill_fragment(acc[j], 0.0f);
  mma_row_tile<4, D / 16>(acc, s.q + row * LD, LD, s.state + col, LD);
  mma_row_tile<4, C / 16>(acc, s.p + row * LDT, LDT, s.v + col, LD);
  __syncthreads();  // the state is read: its space becomes the staging of O
  float* stage = reinterpret_cast<float*>(s.state);
#pragma unroll
  for (int j = 0; j < 4; ++j) wmma::store_matrix_sync(stage + row * LDS + col + j * 16, acc[j], LDS, wmma::mem_row_major);
  __syncthreads();

  // Epilogue: warp w writes rows w, w + 8, ...; lane l columns 4l .. 4l + 3.
  for (int r = warp; r < length; r += 8) {
    const int64_t token = start + r;
    float o[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) o[e] = stage[r * LDS + lane * 4 + e];
    if (a.out_raw != nullptr) {
      float* out = a.out_raw + (token * a.value_heads + head) * D + lane * 4;
#pragma unroll
      for (int e = 0; e < 4; ++e) out[e] = o[e];
      continue;
    }
    const float rstd = rsqrtf(warp_sum(o[0] * o[0] + o[1] * o[1] + o[2] * o[2] + o[3] * o[3]) / D + a.eps);
    const bf16* z = static_cast<const bf16*>(a.z) + token * a.z_stride + head * D + lane * 4;
    const bf16* w = static_cast<const bf16*>(a.norm_weight) + lane * 4;
    bf16* out = static_cast<bf16*>(a.out) + (token * a.value_heads + head) * D + lane * 4;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      // As the reference: rmsnorm(o) and w * it rounded to bf16, then times silu(z) in fp32.
      const float normed = __bfloat162float(__float2bfloat16(o[e] * rstd));
      const float weighted = __bfloat162float(__float2bfloat16(__bfloat162float(w[e]) * normed));
      const float gate = __bfloat162float(z[e]);
      out[e] = __float2bfloat16(weighted * gate / (1.0f + __expf(-gate)));
    }
  }
}

}  // namespace

void conv1d_silu_l2norm(const void* x, const void* weight, int kernel, const int64_t* positions, void* y, int tokens,
                        int channels, int qk_channels, cudaStream_t stream) {
  if (tokens == 0) return;
  if (kernel < 1 || kernel > 4 || channels % 128 != 0 || qk_channels % 128 != 0) {
    throw std::invalid_argument("conv1d_silu_l2norm: needs kernel 1..4 and channel counts that are multiples of 128");
  }
  const dim3 grid((tokens + kConvTokens - 1) / kConvTokens, channels / 128);
  conv1d_silu_l2norm_kernel<<<grid, 128, 0, stream>>>(static_cast<const bf16*>(x), static_cast<const bf16*>(weight),
                                                      kernel, positions, static_cast<bf16*>(y), tokens, channels,
                                                      qk_channels);
  check_cuda_launch("GatedDeltaNet kernel conv1d_silu_l2norm");
}

template <int BV>
void launch_state(const GdnForward& args, cudaStream_t stream) {
  const size_t bytes = sizeof(StateShared<BV>);
  allow_shared_memory(state_kernel<BV>, bytes, "GatedDeltaNet kernel state");
  state_kernel<BV><<<dim3(args.chunks.num_seqs, args.value_heads, D / BV), kStateThreads, bytes, stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel state");
}

void gated_delta_rule_forward(const GdnForward& args, cudaStream_t stream) {
  if (args.chunks.num_chunks == 0) return;
  if (args.key_heads <= 0 || args.value_heads % args.key_heads != 0) {
    throw std::invalid_argument("gated_delta_rule_forward: value heads must be a multiple of key heads");
  }
  if ((args.out_raw == nullptr) == (args.out == nullptr)) {
    throw std::invalid_argument("gated_delta_rule_forward: exactly one of out_raw and out");
  }
  const dim3 per_chunk(args.chunks.num_chunks, args.value_heads);
  auto mark = [&](int i) {
    if (args.stage_events != nullptr) cudaEventRecord(args.stage_events[i], stream);
  };
  mark(0);
  allow_shared_memory(prepare_kernel, sizeof(PrepareShared), "GatedDeltaNet kernel prepare");
  prepare_kernel<<<per_chunk, kPrepareThreads, sizeof(PrepareShared), stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel prepare");
  mark(1);
  switch (args.state_columns) {
    case 16: launch_state<16>(args, stream); break;
    case 32: launch_state<32>(args, stream); break;
    case 64: launch_state<64>(args, stream); break;
    default: throw std::invalid_argument("gated_delta_rule_forward: state_columns must be 16, 32 or 64");
  }
  mark(2);
  allow_shared_memory(output_kernel, sizeof(OutputShared), "GatedDeltaNet kernel output");
  output_kernel<<<per_chunk, 256, sizeof(OutputShared), stream>>>(args);
  check_cuda_launch("GatedDeltaNet kernel output");
  mark(3);
}

const char* kernels_unavailable_on_current_device() {
  return kernel_image_missing(output_kernel);
}

}  // namespace dflash::target::kernels
