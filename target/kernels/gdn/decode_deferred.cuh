// Stage 5b (decoding): plain steps on bf16 states with the states' stores deferred
// (GdnDeferredStores). decode_token_bf16_kernel reads each head's state and writes the new one
// every step: at 128 sequences and 27B shapes 9.6 GB each way. Here a head writes its state every
// kGdnDeferTokens-th token only and logs the token's k, v, g and beta (a few hundred bytes a head)
// instead; the reads stay.
//
// The math. A token sets S_t = M_t S_{t-1} + beta_t k_t v_t^T with M_t = e^g_t (I - beta_t k_t
// k_t^T) (symmetric), so S_t^T x = S_{t-1}^T (M_t x) + beta_t v_t (k_t . x). From the stored state
// S_0, the logged tokens 1 .. p and the current token p + 1:
//   x_{p+1} = q;  c_t = beta_t (k_t . x_t),  x_{t-1} = e^g_t (x_t - c_t k_t)   for t = p + 1 .. 1;
//   o = S_0^T x_0 + sum_t c_t v_t.
// One warp forms the chain (p + 1 dot products of 128 elements), one pass over the state forms
// S_0^T x_0. When the head's store is due, the CTA replays the p + 1 tokens on its held state as
// decode_token_bf16_kernel steps a token (the same sums in the same order, rounded to bf16 after
// each token) and stores it: the stored states are bit-identical to token-by-token steps'. The
// output differs from theirs by rounding only (the states between stores are never rounded).
// Private to target/kernels/gated_delta_net.cu (one translation unit).
#pragma once

#include "target/kernels/gdn/decode_step.cuh"

namespace dflash::target::kernels::gdn {

constexpr int kDefer = kGdnDeferTokens;

// Head `head` of a sequence n tokens after its last full store: the tokens it has not stored, and
// whether its store falls due with the next token (GdnDeferredStores).
__device__ __forceinline__ int unstored_tokens(int64_t n, int head) {
  return static_cast<int>(min(n, (n + head % kDefer) % kDefer));
}
__device__ __forceinline__ bool store_due(int64_t n, int head) { return (n + 1 + head % kDefer) % kDefer == 0; }

// The tokens a CTA steps, in shared memory: the logged ones at 0 .. p - 1, the current one at p;
// the chain's coefficients c_t and its x_0.
struct DeferredTokens {
  alignas(16) float k[kDefer][D];
  alignas(16) bf16 v[kDefer][D];
  float decay[kDefer], beta[kDefer], coef[kDefer];
  alignas(16) float x[D];
};

// The head's p logged tokens (the last p before token n) copied into `t` by one warp: k and v
// through cp.async (committed as one group: the warp waits for it before the CTA's next barrier),
// the gates loaded.
__device__ __forceinline__ void fetch_logged(const GdnDecodeLog& layout, const char* log, int64_t n, int p,
                                             int key_head, int head, DeferredTokens& t, int lane) {
  for (int m = 0; m < p; ++m) {
    const char* slot = log + (n - p + m) % kDefer * layout.slot_bytes();
    mma_tile::copy16(&t.k[m][4 * lane], slot + layout.k_offset(key_head) + 16 * lane);
    if (lane < D / 8) mma_tile::copy16(&t.v[m][8 * lane], slot + layout.v_offset(head) + 16 * lane);
  }
  __pipeline_commit();
  if (lane < p) {
    const char* slot = log + (n - p + lane) % kDefer * layout.slot_bytes();
    t.decay[lane] = __expf(*reinterpret_cast<const float*>(slot + layout.g_offset(head)));
    t.beta[lane] = *reinterpret_cast<const float*>(slot + layout.beta_offset(head));
  }
}

// The chain (one warp, 4 elements a lane): x = q, then for t = p .. 0: c_t = beta_t (k_t . x) and
// x = e^g_t (x - c_t k_t). Leaves c_t in t.coef and x_0 in t.x.
__device__ __forceinline__ void form_chain(DeferredTokens& t, const float* q, int p, int lane) {
  float x[D / 32];
#pragma unroll
  for (int r = 0; r < D / 32; ++r) x[r] = q[lane + 32 * r];
  for (int m = p; m >= 0; --m) {
    float dot = 0;
#pragma unroll
    for (int r = 0; r < D / 32; ++r) dot += t.k[m][lane + 32 * r] * x[r];
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
    const float c = t.beta[m] * dot;
#pragma unroll
    for (int r = 0; r < D / 32; ++r) x[r] = t.decay[m] * (x[r] - c * t.k[m][lane + 32 * r]);
    if (lane == 0) t.coef[m] = c;
  }
#pragma unroll
  for (int r = 0; r < D / 32; ++r) t.x[lane + 32 * r] = x[r];
}

// The held state (columns j, j + 1 as bf16 pairs, rows i0 ..) stepped through tokens 0 .. count - 1
// of `t` as decode_token_bf16_kernel steps one: k.S over the thread's rows, then over the column's
// row blocks in order; delta = beta (v - e^g k.S); S = e^g S + k delta, rounded to bf16. Every
// thread of the CTA calls it (one barrier a token; the two partial buffers alternate, token m using
// partial[(m + 1) % 2], so the first token's does not meet a caller still reading partial[0]).
__device__ __forceinline__ void replay(__nv_bfloat162 (&held)[kDecodeRows], const DeferredTokens& t, int count,
                                       float2 (*partial)[kRowBlocks][kPairColumns], int block, int pair, int i0,
                                       int j) {
  for (int m = 0; m < count; ++m) {
    const float* k = t.k[m];
    float2 ks = {0, 0};
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) {
      const float2 s = widen_pair(held[i]);
      ks.x += k[i0 + i] * s.x, ks.y += k[i0 + i] * s.y;
    }
    float2(*sums)[kPairColumns] = partial[(m + 1) % 2];
    sums[block][pair] = ks;
    __syncthreads();
    ks = {0, 0};
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) ks.x += sums[b][pair].x, ks.y += sums[b][pair].y;
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.v[m][j]));
    const float decay = t.decay[m];
    const float delta0 = t.beta[m] * (v.x - decay * ks.x), delta1 = t.beta[m] * (v.y - decay * ks.y);
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) held[i] = stepped_pair(held[i], decay, k[i0 + i], delta0, delta1);
  }
}

// The current token into slot n % kDefer of the sequence's log: its normalised k by the first value
// head of its key head, each head's v pair by row block 0, g and beta by thread 0.
__device__ __forceinline__ void log_token(const GdnDecodeLog& layout, char* log, int64_t n, int key_head, int head,
                                          bool writes_k, const float* k, __nv_bfloat162 v_pair, float g, float beta,
                                          int block, int j) {
  char* slot = log + n % kDefer * layout.slot_bytes();
  if (writes_k && threadIdx.x < D) {
    reinterpret_cast<float*>(slot + layout.k_offset(key_head))[threadIdx.x] = k[threadIdx.x];
  }
  if (block == 0) *reinterpret_cast<__nv_bfloat162*>(slot + layout.v_offset(head) + 2 * j) = v_pair;
  if (threadIdx.x == 0) {
    *reinterpret_cast<float*>(slot + layout.g_offset(head)) = g;
    *reinterpret_cast<float*>(slot + layout.beta_offset(head)) = beta;
  }
}

// One CTA per (sequence, value head), the thread layout of decode_token_bf16_kernel. With
// deferred.store_all no token runs: a head with unstored tokens replays and stores them.
__global__ void __launch_bounds__(kTokenThreads, kDecodeCtasPerSm) decode_token_deferred_kernel(GdnDecodeStep a) {
  barriers::start_as_dependent();
  const int sequence = blockIdx.x / a.value_heads, head = blockIdx.x % a.value_heads;
  const int ratio = a.value_heads / a.key_heads, key_head = head / ratio;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int block = warp / (D / kLineColumns), pair = warp % (D / kLineColumns) * 32 + lane;
  const int j = 2 * pair, i0 = block * kDecodeRows;  // the thread's columns j, j + 1 and rows i0 ..
  const int64_t n = a.deferred.pending[sequence];
  const int p = unstored_tokens(n, head);
  const bool store_all = a.deferred.store_all;
  if (store_all && p == 0) return;
  __shared__ float q[D], k[D], sums[3][D / 32];
  __shared__ float2 partial[2][kRowBlocks][kPairColumns];
  __shared__ alignas(16) float o_row[D];
  __shared__ NormInputs norm_inputs;
  __shared__ DeferredTokens tokens;
  const GdnDecodeLog layout{a.key_heads, a.value_heads};
  char* log = static_cast<char*>(a.deferred.logs[sequence]);
  auto* state = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(const_cast<void*>(a.state_rows[sequence])) +
                                                  static_cast<int64_t>(head) * D * D + i0 * D + j);
  __nv_bfloat162 held[kDecodeRows];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) held[i] = state[i * (D / 2)];
  if (warp == 1) fetch_logged(layout, log, n, p, key_head, head, tokens, lane);
  if (store_all) {
    if (warp == 1) __pipeline_wait_prior(0);
    __syncthreads();
    replay(held, tokens, p, partial, block, pair, i0, j);
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) state[i * (D / 2)] = held[i];
    return;
  }
  const bool normalise = a.norm.normed != nullptr;
  const int64_t token = sequence, gate = token * a.value_heads + head;
  if (normalise) fetch_norm_inputs(a.norm, norm_inputs, token, head, warp, lane);
  const float g = a.g[gate], beta = a.beta[gate];
  const __nv_bfloat162 v_pair =
      *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(a.v) + token * a.v_stride + head * D + j);
  normalise_qk(static_cast<const bf16*>(a.q) + token * a.q_stride + key_head * D,
               static_cast<const bf16*>(a.k) + token * a.k_stride + key_head * D, a.scale, q, k, nullptr, sums, false);
  // The current token joins the logged ones at p.
  if (threadIdx.x < D) tokens.k[p][threadIdx.x] = k[threadIdx.x];
  if (block == 0) *reinterpret_cast<__nv_bfloat162*>(&tokens.v[p][j]) = v_pair;
  if (threadIdx.x == 0) tokens.decay[p] = __expf(g), tokens.beta[p] = beta;
  if (warp == 1) __pipeline_wait_prior(0);
  __syncthreads();
  if (warp == 0) form_chain(tokens, q, p, lane);
  __syncthreads();

  // o = S_0^T x_0 (the thread's rows, then the column's row blocks) + sum_t c_t v_t.
  float2 os = {0, 0};
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair(held[i]);
    os.x += tokens.x[i0 + i] * s.x, os.y += tokens.x[i0 + i] * s.y;
  }
  partial[0][block][pair] = os;
  __syncthreads();
  if (block == 0) {
    float2 o = {0, 0};
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) o.x += partial[0][b][pair].x, o.y += partial[0][b][pair].y;
    for (int m = 0; m <= p; ++m) {
      const float2 vm = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&tokens.v[m][j]));
      o.x += tokens.coef[m] * vm.x, o.y += tokens.coef[m] * vm.y;
    }
    *reinterpret_cast<float2*>(normalise ? &o_row[j] : a.out + gate * D + j) = o;
  }
  log_token(layout, log, n, key_head, head, head % ratio == 0, k, v_pair, g, beta, block, j);
  if (store_due(n, head)) {
    replay(held, tokens, p + 1, partial, block, pair, i0, j);
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) state[i * (D / 2)] = held[i];
  }
  if (normalise) normed_output(a.norm, norm_inputs, o_row, token, head, a.value_heads, warp, lane);
}

}  // namespace dflash::target::kernels::gdn
