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
// S_0^T x_0. When the head's store is due, the same pass also forms S_0^T k_t for the p + 1 tokens;
// after one barrier each thread forms the tokens' deltas from them and writes the state after the
// p + 1 tokens in one more pass (store_tokens: the rule unrolled from S_0), rounded to bf16 once.
// Token-by-token steps round the state after every token, so the stored states are as close to
// the fp32 rule's or closer, not the same bits; the outputs differ from theirs by rounding only.
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
  float mix[kDefer][kDefer];  // form_mix's, for a store
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
    t.decay[lane] = *reinterpret_cast<const float*>(slot + layout.decay_offset(head));
    t.beta[lane] = *reinterpret_cast<const float*>(slot + layout.beta_offset(head));
  }
}

// Slots count .. kDefer - 1 of `t` as tokens that change nothing (k = v = 0, beta = 0, e^g = 1),
// so a store runs over all kDefer slots without a bound on its loops (every thread of the CTA
// calls it, before the barrier after the tokens are written).
__device__ __forceinline__ void pad_tokens(DeferredTokens& t, int count) {
  const int c = threadIdx.x;
  for (int m = count; m < kDefer; ++m) {
    if (c < D) t.k[m][c] = 0;
    if (c < D / 2) reinterpret_cast<__nv_bfloat162*>(t.v[m])[c] = __floats2bfloat162_rn(0, 0);
    if (c == 0) t.decay[m] = 1, t.beta[m] = 0;
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

// The mixing coefficients of tokens a > b of `t` (the store's forward substitution): mix[a][b] =
// beta_a e^(g_b+1 + .. + g_a) (k_b . k_a). Warps first_warp .. + warps - 1 share the pairs, one dot
// product of 128 elements a warp at a time.
__device__ __forceinline__ void form_mix(DeferredTokens& t, int first_warp, int warps, int warp, int lane) {
  int index = 0;
  for (int a = 1; a < kDefer; ++a) {
    for (int b = 0; b < a; ++b, ++index) {
      if (index % warps != warp - first_warp) continue;
      float dot = 0;
#pragma unroll
      for (int r = 0; r < D / 32; ++r) dot += t.k[a][lane + 32 * r] * t.k[b][lane + 32 * r];
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
      if (lane == 0) {
        float decay = 1;
        for (int w = b + 1; w <= a; ++w) decay *= t.decay[w];
        t.mix[a][b] = t.beta[a] * decay * dot;
      }
    }
  }
}

// A head's state in shared memory (bf16 pairs, row-major: 64 pairs a row), for a CTA that stores
// it: copied by cp.async (every thread commits a group), so no register holds it.
constexpr int kStashBytes = D * D * 2;
__device__ __forceinline__ void stash_state(__nv_bfloat162* stash, const bf16* head_state) {
  for (int c = threadIdx.x; c < kStashBytes / 16; c += kTokenThreads) {
    mma_tile::copy16(reinterpret_cast<char*>(stash) + 16 * c, reinterpret_cast<const char*>(head_state) + 16 * c);
  }
  __pipeline_commit();
}

// The thread's rows i0 .. of its column pair: held in registers, or stashed in shared memory.
struct HeldRows {
  const __nv_bfloat162 (&held)[kDecodeRows];
  __device__ __forceinline__ __nv_bfloat162 operator()(int i) const { return held[i]; }
};
struct StashedRows {
  const __nv_bfloat162* first;  // the stash's row i0, the thread's pair
  __device__ __forceinline__ __nv_bfloat162 operator()(int i) const { return first[i * kPairColumns]; }
};

// One pass over the thread's rows of S_0 (columns j, j + 1): where kOutput, S_0^T x into
// partial[kDefer]; where kStores, h_m = S_0^T k_m for every slot m of `t` into partial[m].
template <bool kOutput, bool kStores, typename Rows>
__device__ __forceinline__ void row_sums(Rows rows, const DeferredTokens& t,
                                         float2 (*partial)[kRowBlocks][kPairColumns], int block, int pair, int i0) {
  float2 os = {0, 0}, h[kDefer] = {};
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair(rows(i));
    if constexpr (kOutput) os.x += t.x[i0 + i] * s.x, os.y += t.x[i0 + i] * s.y;
    if constexpr (kStores) {
#pragma unroll
      for (int m = 0; m < kDefer; ++m) h[m].x += t.k[m][i0 + i] * s.x, h[m].y += t.k[m][i0 + i] * s.y;
    }
  }
  if constexpr (kOutput) partial[kDefer][block][pair] = os;
  if constexpr (kStores) {
#pragma unroll
    for (int m = 0; m < kDefer; ++m) partial[m][block][pair] = h[m];
  }
}

// The state after the tokens of `t` (padded: pad_tokens), stored: with G_m the gates' sum over
// tokens 0 .. m,
//   delta_m = beta_m (v_m - e^G_m h_m) - sum_{b < m} mix[m][b] delta_b   (h_m summed over the
//   column's row blocks: S_0^T k_m, from row_sums);
//   S = e^G_last S_0 + sum_m e^(G_last - G_m) k_m delta_m^T, rounded to bf16 once.
// This is the token-by-token rule S_m = e^g_m S_m-1 + k_m delta_m^T, delta_m = beta_m (v_m - e^g_m
// S_m-1^T k_m), unrolled: every delta from S_0 and the deltas before it, the state then written in
// one pass (one barrier for all the tokens, before this call). The decays are products, never
// quotients, so a small gate cannot overflow them.
__device__ __forceinline__ void store_tokens(StashedRows rows, const DeferredTokens& t,
                                             const float2 (*partial)[kRowBlocks][kPairColumns], int pair, int i0,
                                             int j, __nv_bfloat162* state) {
  float2 delta[kDefer];
  float decay = 1;  // e^G_m
#pragma unroll
  for (int m = 0; m < kDefer; ++m) {
    float2 h = {0, 0};
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) h.x += partial[m][b][pair].x, h.y += partial[m][b][pair].y;
    decay *= t.decay[m];
    const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.v[m][j]));
    float2 d = {t.beta[m] * (v.x - decay * h.x), t.beta[m] * (v.y - decay * h.y)};
#pragma unroll
    for (int b = 0; b < m; ++b) d.x -= t.mix[m][b] * delta[b].x, d.y -= t.mix[m][b] * delta[b].y;
    delta[m] = d;
  }
  float later = 1;  // e^(G_last - G_m)
#pragma unroll
  for (int m = kDefer - 1; m >= 0; --m) delta[m].x *= later, delta[m].y *= later, later *= t.decay[m];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair(rows(i));
    float s0 = decay * s.x, s1 = decay * s.y;
#pragma unroll
    for (int m = 0; m < kDefer; ++m) s0 += t.k[m][i0 + i] * delta[m].x, s1 += t.k[m][i0 + i] * delta[m].y;
    state[i * (D / 2)] = __floats2bfloat162_rn(s0, s1);
  }
}

// The current token (slot p of `t`) into slot n % kDefer of the sequence's log: its normalised k by
// the first value head of its key head, each head's v pair by row block 0 (the threads that wrote
// it into `t`), the decay and beta by thread 0.
__device__ __forceinline__ void log_token(const GdnDecodeLog& layout, char* log, int64_t n, int key_head, int head,
                                          bool writes_k, const DeferredTokens& t, int p, int block, int j) {
  char* slot = log + n % kDefer * layout.slot_bytes();
  if (writes_k && threadIdx.x < D) {
    reinterpret_cast<float*>(slot + layout.k_offset(key_head))[threadIdx.x] = t.k[p][threadIdx.x];
  }
  if (block == 0) {
    *reinterpret_cast<__nv_bfloat162*>(slot + layout.v_offset(head) + 2 * j) =
        *reinterpret_cast<const __nv_bfloat162*>(&t.v[p][j]);
  }
  if (threadIdx.x == 0) {
    *reinterpret_cast<float*>(slot + layout.decay_offset(head)) = t.decay[p];
    *reinterpret_cast<float*>(slot + layout.beta_offset(head)) = t.beta[p];
  }
}

// One CTA per (sequence, value head), the thread layout of decode_token_bf16_kernel; a CTA whose
// head stores this step stashes the state in shared memory (kStashBytes of dynamic shared memory)
// instead of holding it. With deferred.store_all no token runs: a head with unstored tokens stores
// them.
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
  const bool stores = store_all || store_due(n, head);
  __shared__ float q[D], k[D], sums[3][D / 32];
  // Each row block's sums of a column pair: h_m of the tokens m (a store), then S_0^T x_0 (the output).
  __shared__ float2 partial[kDefer + 1][kRowBlocks][kPairColumns];
  __shared__ alignas(16) float o_row[D];
  __shared__ NormInputs norm_inputs;
  __shared__ DeferredTokens tokens;
  extern __shared__ __align__(16) __nv_bfloat162 stash[];
  const GdnDecodeLog layout{a.key_heads, a.value_heads};
  char* log = static_cast<char*>(a.deferred.logs[sequence]);
  bf16* head_state = static_cast<bf16*>(const_cast<void*>(a.state_rows[sequence])) + static_cast<int64_t>(head) * D * D;
  auto* state = reinterpret_cast<__nv_bfloat162*>(head_state + i0 * D + j);
  const StashedRows stashed{stash + i0 * kPairColumns + pair};
  __nv_bfloat162 held[kDecodeRows];
  if (stores) {
    stash_state(stash, head_state);
  } else {
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) held[i] = state[i * (D / 2)];
  }
  if (warp == 1) fetch_logged(layout, log, n, p, key_head, head, tokens, lane);
  if (store_all) {
    pad_tokens(tokens, p);
    __pipeline_wait_prior(0);
    __syncthreads();
    form_mix(tokens, 0, kTokenThreads / 32, warp, lane);
    row_sums<false, true>(stashed, tokens, partial, block, pair, i0);
    __syncthreads();
    store_tokens(stashed, tokens, partial, pair, i0, j, state);
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
  if (stores) pad_tokens(tokens, p + 1);
  if (stores || warp == 1) __pipeline_wait_prior(0);
  __syncthreads();
  if (warp == 0) {
    form_chain(tokens, q, p, lane);
  } else if (stores) {
    form_mix(tokens, 1, kTokenThreads / 32 - 1, warp, lane);
  }
  __syncthreads();

  // o = S_0^T x_0 (the thread's rows, then the column's row blocks) + sum_t c_t v_t.
  if (stores) {
    row_sums<true, true>(stashed, tokens, partial, block, pair, i0);
  } else {
    row_sums<true, false>(HeldRows{held}, tokens, partial, block, pair, i0);
  }
  __syncthreads();
  if (block == 0) {
    float2 o = {0, 0};
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) o.x += partial[kDefer][b][pair].x, o.y += partial[kDefer][b][pair].y;
    for (int m = 0; m <= p; ++m) {
      const float2 vm = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&tokens.v[m][j]));
      o.x += tokens.coef[m] * vm.x, o.y += tokens.coef[m] * vm.y;
    }
    *reinterpret_cast<float2*>(normalise ? &o_row[j] : a.out + gate * D + j) = o;
  }
  log_token(layout, log, n, key_head, head, head % ratio == 0, tokens, p, block, j);
  if (stores) store_tokens(stashed, tokens, partial, pair, i0, j, state);
  if (normalise) normed_output(a.norm, norm_inputs, o_row, token, head, a.value_heads, warp, lane);
}

}  // namespace dflash::target::kernels::gdn
