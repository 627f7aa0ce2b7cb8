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
// S_0^T x_0. When the head's store is due, the state after the tokens is the rule unrolled from
// S_0: with h_m = S_{m-1}^T k_m = S_0^T y_m + sum_{u<m} c_{m,u} v_u (y_m and c_{m,u} the same
// chain, started from k_m, through the tokens before m; one warp a token),
// delta_m = beta_m (v_m - e^g_m h_m) and
//   S = e^G S_0 + sum_m e^(G - G_m) k_m delta_m^T   (G_m the gates' sum up to m, G all of them).
// The pass over the held state that forms S_0^T x_0 forms every S_0^T y_m too (split in two);
// after two barriers (the sums over row blocks, then the deltas) one more pass over the held state
// writes S, rounded to bf16 once. One-token steps round the state after every token, so the
// stored states are as close to the fp32 rule's or closer, not the same bits; the outputs differ
// from theirs by rounding only (the states between stores are never rounded).
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

// What a store adds (store_chains): for each token m, y_m with h_m = S_0^T y_m + sum_{u<m}
// c[m][u] v_u, and k_m; both row-major by state row (one row's eight values in two 16-byte loads),
// zero for the slots past the tokens.
struct StoreChains {
  alignas(16) float y[D][kDefer];
  alignas(16) float k[D][kDefer];
  float c[kDefer][kDefer];
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

// One step of a chain back through token u of `t` (one warp, 4 elements of x a lane):
// c = beta_u (k_u . x), x = e^g_u (x - c k_u); returns c.
__device__ __forceinline__ float chain_step(const DeferredTokens& t, int u, float (&x)[D / 32], int lane) {
  float dot = 0;
#pragma unroll
  for (int r = 0; r < D / 32; ++r) dot += t.k[u][lane + 32 * r] * x[r];
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, offset);
  const float c = t.beta[u] * dot;
#pragma unroll
  for (int r = 0; r < D / 32; ++r) x[r] = t.decay[u] * (x[r] - c * t.k[u][lane + 32 * r]);
  return c;
}

// The output's chain (one warp): x = q, then for t = p .. 0: c_t = beta_t (k_t . x) and
// x = e^g_t (x - c_t k_t). Leaves c_t in t.coef and x_0 in t.x.
__device__ __forceinline__ void form_chain(DeferredTokens& t, const float* q, int p, int lane) {
  float x[D / 32];
#pragma unroll
  for (int r = 0; r < D / 32; ++r) x[r] = q[lane + 32 * r];
  for (int m = p; m >= 0; --m) {
    const float c = chain_step(t, m, x, lane);
    if (lane == 0) t.coef[m] = c;
  }
#pragma unroll
  for (int r = 0; r < D / 32; ++r) t.x[lane + 32 * r] = x[r];
}

// Warp m of the CTA forms token m's chain for a store of `count` tokens (m < kDefer): x = k_m,
// then for u = m - 1 .. 0: c[m][u] = beta_u (k_u . x), x = e^g_u (x - c[m][u] k_u); y_m = x. It
// also writes k_m row-major; past the tokens both are zero (no padded slot reads a stale value).
__device__ __forceinline__ void store_chains(const DeferredTokens& t, StoreChains& out, int count, int m, int lane) {
  float x[D / 32];
#pragma unroll
  for (int r = 0; r < D / 32; ++r) x[r] = m < count ? t.k[m][lane + 32 * r] : 0.f;
#pragma unroll
  for (int r = 0; r < D / 32; ++r) out.k[lane + 32 * r][m] = x[r];
  for (int u = m < count ? m - 1 : -1; u >= 0; --u) {
    const float c = chain_step(t, u, x, lane);
    if (lane == 0) out.c[m][u] = c;
  }
#pragma unroll
  for (int r = 0; r < D / 32; ++r) out.y[lane + 32 * r][m] = x[r];
}

// widen_pair in three instruction forms, one for each pass a store makes over its held state:
// volatile asm keeps NVVM from merging the passes' widenings, but ptxas sees plain instructions and
// would reuse the first pass's widened values in the next (64 live registers, spilled) where the
// instructions match; distinct forms leave it the held pairs to widen again.
template <int kForm>
__device__ __forceinline__ float2 widen_pair_as(__nv_bfloat162 x) {
  static_assert(kForm >= 0 && kForm <= 2);
  if constexpr (kForm == 0) return widen_pair(x);
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&x);
  uint32_t lo, hi;
  if constexpr (kForm == 1) {
    asm volatile("prmt.b32 %0, %2, 0, 0x1044;\n\tprmt.b32 %1, %2, 0, 0x3244;" : "=r"(lo), "=r"(hi) : "r"(bits));
  } else {
    asm volatile("mul.lo.u32 %0, %2, 65536;\n\tlop3.b32 %1, %2, 0xffff0000, 0, 0xc0;" : "=r"(lo), "=r"(hi)
                 : "r"(bits));
  }
  return {__uint_as_float(lo), __uint_as_float(hi)};
}

// The sums over the thread's rows of the held state (columns j, j + 1), into partial[.][block]:
// S_0^T x_0 (the output's, kOutput) at partial[kDefer], and S_0^T y_m for the kSums tokens m from
// kFirst (a store's) at partial[m]. One pass: each row widened once. A store takes two passes of
// four tokens: the held state, eight tokens' sums and their operands exceed 80 registers.
template <bool kOutput, int kFirst, int kSums, int kForm = 0>
__device__ __forceinline__ void row_sums(const __nv_bfloat162 (&held)[kDecodeRows], const DeferredTokens& t,
                                         const StoreChains& chains, float2 (*partial)[kRowBlocks][kPairColumns],
                                         int block, int pair, int i0) {
  static_assert(kSums == 0 || (kSums == 4 && kFirst % 4 == 0 && kFirst + kSums <= kDefer));
  float2 os = {0, 0}, h[kSums > 0 ? kSums : 1] = {};
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair_as<kForm>(held[i]);
    if constexpr (kOutput) os.x += t.x[i0 + i] * s.x, os.y += t.x[i0 + i] * s.y;
    if constexpr (kSums > 0) {
      const float4 y4 = *reinterpret_cast<const float4*>(&chains.y[i0 + i][kFirst]);
      const float y[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
      for (int m = 0; m < kSums; ++m) h[m].x += y[m] * s.x, h[m].y += y[m] * s.y;
    }
  }
  if constexpr (kOutput) partial[kDefer][block][pair] = os;
#pragma unroll
  for (int m = 0; m < kSums; ++m) partial[kFirst + m][block][pair] = h[m];
}

// Row block b's threads form the deltas of tokens m = 2b, 2b + 1 of its column pair (zero past the
// tokens), each scaled by e^(G - G_m), and leave them in partial[m][0][pair], which only this
// thread reads: h_m = S_0^T y_m (over the row blocks) + sum_{u<m} c[m][u] v_u;
// delta_m = beta_m (v_m - e^g_m h_m). Decays are products, never quotients (no overflow).
__device__ __forceinline__ void form_deltas(const DeferredTokens& t, const StoreChains& chains, int count,
                                            float2 (*partial)[kRowBlocks][kPairColumns], int block, int pair, int j) {
#pragma unroll
  for (int half = 0; half < kDefer / kRowBlocks; ++half) {
    const int m = kDefer / kRowBlocks * block + half;
    float2 delta = {0, 0};
    if (m < count) {
      float2 h = {0, 0};
#pragma unroll
      for (int b = 0; b < kRowBlocks; ++b) h.x += partial[m][b][pair].x, h.y += partial[m][b][pair].y;
      for (int u = 0; u < m; ++u) {
        const float2 vu = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.v[u][j]));
        h.x += chains.c[m][u] * vu.x, h.y += chains.c[m][u] * vu.y;
      }
      float later = 1;  // e^(G - G_m)
      for (int u = m + 1; u < count; ++u) later *= t.decay[u];
      const float2 v = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&t.v[m][j]));
      delta = {later * t.beta[m] * (v.x - t.decay[m] * h.x), later * t.beta[m] * (v.y - t.decay[m] * h.y)};
    }
    partial[m][0][pair] = delta;
  }
}

// The state after `count` tokens written over the stored one: e^G S_0 + sum_m k_m delta_m^T (the
// deltas scaled by form_deltas), from the held S_0, rounded to bf16 once.
__device__ __forceinline__ void store_state(const __nv_bfloat162 (&held)[kDecodeRows], const DeferredTokens& t,
                                            const StoreChains& chains, int count,
                                            const float2 (*partial)[kRowBlocks][kPairColumns], int pair, int i0,
                                            __nv_bfloat162* state) {
  float2 delta[kDefer];
#pragma unroll
  for (int m = 0; m < kDefer; ++m) delta[m] = partial[m][0][pair];
  float decay = 1;  // e^G
  for (int m = 0; m < count; ++m) decay *= t.decay[m];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair_as<2>(held[i]);
    const float4 ka = *reinterpret_cast<const float4*>(&chains.k[i0 + i][0]);
    const float4 kb = *reinterpret_cast<const float4*>(&chains.k[i0 + i][4]);
    const float k[kDefer] = {ka.x, ka.y, ka.z, ka.w, kb.x, kb.y, kb.z, kb.w};
    float s0 = decay * s.x, s1 = decay * s.y;
#pragma unroll
    for (int m = 0; m < kDefer; ++m) s0 += k[m] * delta[m].x, s1 += k[m] * delta[m].y;
    state[i * (D / 2)] = __floats2bfloat162_rn(s0, s1);
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
// deferred.store_all no token runs: a head with unstored tokens stores them.
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
  static_assert(kTokenThreads / 32 == kDefer, "a store forms one token's chain a warp");
  __shared__ float q[D], k[D], sums[3][D / 32];
  // Each row block's sums of a column pair: S_0^T y_m of a store's tokens m, then S_0^T x_0.
  __shared__ float2 partial[kDefer + 1][kRowBlocks][kPairColumns];
  __shared__ alignas(16) float o_row[D];
  __shared__ NormInputs norm_inputs;
  __shared__ DeferredTokens tokens;
  __shared__ StoreChains chains;
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
    store_chains(tokens, chains, p, warp, lane);
    __syncthreads();
    row_sums<false, 0, 4>(held, tokens, chains, partial, block, pair, i0);
    row_sums<false, 4, 4, 1>(held, tokens, chains, partial, block, pair, i0);
    __syncthreads();
    form_deltas(tokens, chains, p, partial, block, pair, j);
    __syncthreads();
    store_state(held, tokens, chains, p, partial, pair, i0, state);
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
  // Warp 0 forms the output's chain; where the store is due the others form the tokens' (warp 1
  // token 0's, which is k_0 itself, and its own).
  const bool stores = store_due(n, head);
  if (warp == 0) {
    form_chain(tokens, q, p, lane);
  } else if (stores) {
    if (warp == 1) store_chains(tokens, chains, p + 1, 0, lane);
    store_chains(tokens, chains, p + 1, warp, lane);
  }
  __syncthreads();

  // o = S_0^T x_0 (the thread's rows, then the column's row blocks) + sum_t c_t v_t; a store's
  // sums S_0^T y_m beside it, four tokens a pass.
  if (stores) {
    row_sums<true, 0, 4>(held, tokens, chains, partial, block, pair, i0);
    row_sums<false, 4, 4, 1>(held, tokens, chains, partial, block, pair, i0);
  } else {
    row_sums<true, 0, 0>(held, tokens, chains, partial, block, pair, i0);
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
  log_token(layout, log, n, key_head, head, head % ratio == 0, k, v_pair, g, beta, block, j);
  if (stores) {
    form_deltas(tokens, chains, p + 1, partial, block, pair, j);
    __syncthreads();
    store_state(held, tokens, chains, p + 1, partial, pair, i0, state);
  }
  if (normalise) normed_output(a.norm, norm_inputs, o_row, token, head, a.value_heads, warp, lane);
}

}  // namespace dflash::target::kernels::gdn
