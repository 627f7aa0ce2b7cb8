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
// When the head's store is due, the state after its tokens is the rule unrolled from S_0: with
// h_m = S_{m-1}^T k_m = S_0^T y_m + sum_{u<m} c_{m,u} v_u (y_m and c_{m,u} the same chain, started
// from k_m, through the tokens before m), delta_m = beta_m (v_m - e^g_m h_m) and
//   S = e^G S_0 + sum_m e^(G - G_m) k_m delta_m^T   (G_m the gates' sum up to m, G all of them),
// which is S = e^G S_0 + sum_m k_m (a_m - S_0^T y'_m)^T with y'_m = e^(G - G_m) beta_m e^g_m y_m and
// a_m = e^(G - G_m) beta_m (v_m - e^g_m sum_{u<m} c_{m,u} v_u).
//
// Two kernels. The chains touch no state: deferred_chains_kernel forms them (q and k normalised,
// the token logged, x_0 and sum_t c_t v_t for every head, y', k and a for the heads whose store is
// due) into the launch's handoff (gdn_log.h GdnDeferredHandoff), a warp per head, the output's
// chain and a store's token chain stepped together. The state pass, deferred_state_kernel, is
// then a read of the state with few dependent steps: S_0^T x_0 (and S_0^T y'_m where the store is
// due) in one pass over the held state, one barrier, the output, the store. One kernel doing both
// held every head's state in registers through the chains and the barriers between them: 0.113
// against 0.090 ms a layer for the state pass alone at 128 sequences on an H100 (bench/RESULTS.md,
// sessions 54-55). One-token steps round the state after every token, so the stored states are as
// close to the fp32 rule's or closer, not the same bits; the outputs differ from theirs by
// rounding only (the states between stores are never rounded).
// Private to target/kernels/gated_delta_net.cu (one translation unit).
#pragma once

#include "target/kernels/gdn/decode_step.cuh"

namespace dflash::target::kernels::gdn {

constexpr int kDefer = kGdnDeferTokens;
static_assert((kDefer & (kDefer - 1)) == 0, "counts are taken modulo kDefer by masking");
using Handoff = GdnDeferredHandoff;

// Head `head` of a sequence n tokens after its last full store: the tokens it has not stored, and
// whether its store falls due with the next token (GdnDeferredStores). int arithmetic: a count
// stays far below 2^31.
__device__ __forceinline__ int unstored_tokens(int n, int head) { return min(n, (n + head) & (kDefer - 1)); }
__device__ __forceinline__ bool store_due(int n, int head) { return ((n + 1 + head) & (kDefer - 1)) == 0; }
// The one head of `group` (kDefer heads) whose store falls due with the next token (store_due).
__device__ __forceinline__ int storing_head(int n, int group) {
  return group * kDefer + ((kDefer - 1 - n) & (kDefer - 1));
}

// ---- the chains (deferred_chains_kernel: one warp per value head, kDefer heads a CTA) ----
// A warp holds a head's 128-element vectors four consecutive elements a lane (4 lane .. 4 lane + 3):
// one 16-byte access for fp32, one 8-byte (two bf16 pairs) for bf16.

// A group's tokens in shared memory by log slot (token i since the last full store in slot i %
// kDefer, a step's token in slot n % kDefer): the normalised k of each key head the group's value
// heads use (fp32), each value head's v (bf16, as logged), e^g and beta. All are copied in before
// the chains start, in one memory latency: a chain's steps depend on each other, so a load inside a
// step (v, when it stayed in memory) costs that latency every step.
struct GroupTokens {
  float* k;      // [key span][kDefer][D]
  bf16* v;       // [kDefer heads][kDefer][D]
  float* decay;  // [kDefer heads][kDefer]
  float* beta;   // [kDefer heads][kDefer]
  float* zeros;  // [D]: a token that leaves a chain as it is (next_token)
  // At most the key heads kDefer consecutive value heads use, `ratio` value heads a key head.
  static __host__ __device__ constexpr int key_span(int ratio, int key_heads) {
    const int span = (kDefer - 1) / ratio + 2 < kDefer ? (kDefer - 1) / ratio + 2 : kDefer;
    return span < key_heads ? span : key_heads;
  }
  static constexpr size_t bytes(int key_span) {
    return size_t{4} * key_span * kDefer * D + size_t{2} * kDefer * kDefer * D + size_t{8} * kDefer * kDefer +
           size_t{4} * D;
  }
  __device__ GroupTokens(void* shared, int key_span)
      : k(static_cast<float*>(shared)),
        v(reinterpret_cast<bf16*>(k + key_span * kDefer * D)),
        decay(reinterpret_cast<float*>(v + kDefer * kDefer * D)),
        beta(decay + kDefer * kDefer),
        zeros(beta + kDefer * kDefer) {}
};
// One value head's view of its group's tokens, each by slot.
struct HeadTokens {
  float* k;  // its key head's
  bf16* v;
  float* decay;
  float* beta;
  __device__ HeadTokens(const GroupTokens& g, int local_head, int local_key)
      : k(g.k + local_key * kDefer * D),
        v(g.v + local_head * kDefer * D),
        decay(g.decay + local_head * kDefer),
        beta(g.beta + local_head * kDefer) {}
};
constexpr int kChainThreads = kDefer * 32;
// Four CTAs a SM: 64 registers, no spills on a step's path (at five, 48 registers, the chain loop
// spilled and the pair ran 0.121 against 0.111 ms a layer at 128 sequences on an H100).
constexpr int kChainCtasPerSm = 4;

// A lane's four elements of a 128-element vector.
using Lane4 = float4;
__device__ __forceinline__ Lane4 lane4(const float* v, int lane) { return reinterpret_cast<const float4*>(v)[lane]; }
__device__ __forceinline__ void store4(float* v, int lane, Lane4 x) { reinterpret_cast<float4*>(v)[lane] = x; }
// Four bf16 as two pairs (4-byte aligned rows: GdnDecodeLog's slots, the step's v in pairs).
__device__ __forceinline__ uint2 load_bf16x4(const bf16* v, int lane) {
  const auto* pairs = reinterpret_cast<const uint32_t*>(v) + 2 * lane;
  return {__ldcg(pairs), __ldcg(pairs + 1)};
}
__device__ __forceinline__ Lane4 widen4(uint2 b) {
  return {__uint_as_float(b.x << 16), __uint_as_float(b.x & 0xffff0000u), __uint_as_float(b.y << 16),
          __uint_as_float(b.y & 0xffff0000u)};
}
__device__ __forceinline__ uint2& lane_bf16x4(bf16* row, int lane) { return reinterpret_cast<uint2*>(row)[lane]; }

// The group's logged tokens into shared memory by cp.async (the caller commits): the k of each of
// its key heads for the last min(n, kDefer - 1) tokens (the longest any head holds unstored), a warp
// a token; then this warp's head's v for its p unstored tokens, two rows a warp instruction.
__device__ __forceinline__ void fetch_logged(const GdnDecodeLog& layout, const char* log, int n, int first_key,
                                             int key_span, int key_heads, const GroupTokens& g, int warp, int lane) {
  const int logged = min(n, kDefer - 1), slot_bytes = static_cast<int>(layout.slot_bytes());
  if (warp >= logged) return;
  const int slot = (n - logged + warp) & (kDefer - 1);
  for (int key = 0; key < key_span && first_key + key < key_heads; ++key) {
    mma_tile::copy16(g.k + (key * kDefer + slot) * D + 4 * lane,
                     log + slot * slot_bytes + layout.k_offset(first_key + key) + 16 * lane);
  }
}
__device__ __forceinline__ void fetch_head(const GdnDecodeLog& layout, const char* log, int n, int p, int head,
                                           const HeadTokens& t, int lane) {
  const int slot_bytes = static_cast<int>(layout.slot_bytes()), part = lane & 15;
  for (int m = lane >> 4; m < p; m += 2) {
    const int slot = (n - p + m) & (kDefer - 1);
    mma_tile::copy16(t.v + slot * D + 8 * part, log + slot * slot_bytes + layout.v_offset(head) + 16 * part);
  }
}
// A lane's logged token's gates (lane < p, slot -1 otherwise), loaded into registers with the other
// loads and written to shared memory after them (put_gates): the compiler cannot move a load above
// a store it may alias, so a store between two loads would cost the second a round of latency.
struct LoggedGates {
  int slot;
  float g, beta;
};
__device__ __forceinline__ LoggedGates load_gates(const GdnDecodeLog& layout, const char* log, int n, int p, int head,
                                                  int lane) {
  if (lane >= p) return {-1, 0, 0};
  const int slot = (n - p + lane) & (kDefer - 1);
  const char* row = log + slot * static_cast<int>(layout.slot_bytes());
  return {slot, __ldcg(reinterpret_cast<const float*>(row + layout.g_offset(head))),
          __ldcg(reinterpret_cast<const float*>(row + layout.beta_offset(head)))};
}
__device__ __forceinline__ void put_gates(const LoggedGates& gates, const HeadTokens& t) {
  if (gates.slot >= 0) t.decay[gates.slot] = __expf(gates.g), t.beta[gates.slot] = gates.beta;
}

// The step's token as its producers wrote it: its key head's q and k, its v, g and beta. These
// loads depend on no other load, so the kernel issues them first, in the same round of latency as
// the pending count and the log's address.
struct StepToken {
  uint2 q, k, v;
  float g, beta;
};
__device__ __forceinline__ StepToken load_step_token(const GdnDecodeStep& a, int64_t token, int head, int key_head,
                                                     int lane) {
  const int64_t gate = token * a.value_heads + head;
  return {load_bf16x4(static_cast<const bf16*>(a.q) + token * a.q_stride + key_head * D, lane),
          load_bf16x4(static_cast<const bf16*>(a.k) + token * a.k_stride + key_head * D, lane),
          load_bf16x4(static_cast<const bf16*>(a.v) + token * a.v_stride + head * D, lane), __ldcg(a.g + gate),
          __ldcg(a.beta + gate)};
}

// The sum of x over the warp (lane 0's, given to every lane: all use the same bits).
__device__ __forceinline__ float warp_total(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return __shfl_sync(0xffffffffu, x, 0);
}

// The step's q and k (one key head's 128 elements, as loaded) L2-normalised, q also scaled (the rule
// as normalise_qk forms it; the sums in another order).
__device__ __forceinline__ void normalise_in_warp(uint2 q_in, uint2 k_in, float scale, Lane4& q, Lane4& k) {
  q = widen4(q_in);
  k = widen4(k_in);
  const float qq = q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w, kk = k.x * k.x + k.y * k.y + k.z * k.z + k.w * k.w;
  const float q_factor = rsqrtf(warp_total(qq) + 1e-6f) * scale, k_factor = rsqrtf(warp_total(kk) + 1e-6f);
  q = {q.x * q_factor, q.y * q_factor, q.z * q_factor, q.w * q_factor};
  k = {k.x * k_factor, k.y * k_factor, k.z * k_factor, k.w * k_factor};
}

// A chain in flight (the math above): x and sum_t c_t v_t so far, the slot of its next token and
// the steps it has left.
struct Chain {
  Lane4 x, cv;
  int slot, steps;
};
// What a chain's next step takes: its token's k, v and gates; for a chain with no steps left, a
// token that leaves it as it is (k and v zero, beta 0, e^g 1), so that two chains of different
// lengths step together without branches (run_chains).
struct ChainToken {
  Lane4 k;
  uint2 v;
  float beta, decay;
};
__device__ __forceinline__ ChainToken next_token(const HeadTokens& t, const Chain& ch, const float* zeros, int lane) {
  const bool on = ch.steps > 0;
  const int s = ch.slot;
  const float* k = on ? t.k + s * D : zeros;
  bf16* v = on ? t.v + s * D : reinterpret_cast<bf16*>(const_cast<float*>(zeros));
  return {lane4(k, lane), lane_bf16x4(v, lane), on ? t.beta[s] : 0.f, on ? t.decay[s] : 1.f};
}
__device__ __forceinline__ float dot4(Lane4 a, Lane4 b) { return a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w; }
// The step given the token and k . x summed over the warp: c = beta (k . x), x = e^g (x - c k), cv
// += c v.
__device__ __forceinline__ void advance(Chain& ch, const ChainToken& t, float dot) {
  const float c = t.beta * dot, e = t.decay;
  const Lane4 x = ch.x, k = t.k, w = widen4(t.v);
  ch.x = {e * (x.x - c * k.x), e * (x.y - c * k.y), e * (x.z - c * k.z), e * (x.w - c * k.w)};
  ch.cv = {ch.cv.x + c * w.x, ch.cv.y + c * w.y, ch.cv.z + c * w.z, ch.cv.w + c * w.w};
  ch.slot = (ch.slot - 1) & (kDefer - 1), --ch.steps;
}
// Two independent chains (of heads ta and tb) stepped together to the longer one's end: their
// dependent shuffles interleave. `zeros` is D zero floats in shared memory.
__device__ __forceinline__ void run_chains(const HeadTokens& ta, Chain& a, const HeadTokens& tb, Chain& b,
                                           const float* zeros, int lane) {
  const int steps = max(a.steps, b.steps);
#pragma unroll 1
  for (int i = 0; i < steps; ++i) {
    const ChainToken ka = next_token(ta, a, zeros, lane), kb = next_token(tb, b, zeros, lane);
    float da = dot4(ka.k, a.x), db = dot4(kb.k, b.x);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      da += __shfl_xor_sync(0xffffffffu, da, offset), db += __shfl_xor_sync(0xffffffffu, db, offset);
    }
    advance(a, ka, da), advance(b, kb, db);
  }
}

// Token m's chain of a store of the `count` tokens of `t` from slot `first`: from k_m back through
// the tokens before it (none for m >= count).
__device__ __forceinline__ Chain store_chain(const HeadTokens& t, int first, int count, int m, int lane) {
  const int s = (first + m) & (kDefer - 1);
  if (m >= count) return {{0, 0, 0, 0}, {0, 0, 0, 0}, s, 0};
  return {lane4(t.k + s * D, lane), {0, 0, 0, 0}, (s - 1) & (kDefer - 1), m};
}
// Token m's part of that store from its run chain: y'_m, k_m and a_m into the store area (zeros for
// m >= count), and e^G with m = 0.
__device__ __forceinline__ void write_store(const HeadTokens& t, const Chain& ch, int first, int count, int m,
                                            float* store, int lane) {
  float* y = store + m * D;
  float* k = store + (kDefer + m) * D;
  float* a = store + (2 * kDefer + m) * D;
  if (m >= count) {
    store4(y, lane, {0, 0, 0, 0}), store4(k, lane, {0, 0, 0, 0}), store4(a, lane, {0, 0, 0, 0});
    return;
  }
  const int s = (first + m) & (kDefer - 1);
  float later = 1;  // e^(G - G_m): products, never quotients (no overflow)
  for (int u = m + 1; u < count; ++u) later *= t.decay[(first + u) & (kDefer - 1)];
  const float scale = later * t.beta[s], decay = t.decay[s], sy = scale * decay;
  const Lane4 v = widen4(lane_bf16x4(t.v + s * D, lane)), x = ch.x, cv = ch.cv;
  store4(y, lane, {sy * x.x, sy * x.y, sy * x.z, sy * x.w});
  store4(k, lane, lane4(t.k + s * D, lane));
  store4(a, lane, {scale * (v.x - decay * cv.x), scale * (v.y - decay * cv.y), scale * (v.z - decay * cv.z),
                   scale * (v.w - decay * cv.w)});
  if (m == 0 && lane == 0) {
    float total = 1;  // e^G
    for (int u = 0; u < count; ++u) total *= t.decay[(first + u) & (kDefer - 1)];
    store[3 * kDefer * D] = total;
  }
}

// A store of every head (store_all): a warp's head's store of its p logged tokens from slot
// `first`, two tokens' chains at a time.
__device__ __forceinline__ void form_store(const HeadTokens& t, int first, int p, float* store, const float* zeros,
                                           int lane) {
  for (int m = 0; m < kDefer / 2; ++m) {
    Chain c0 = store_chain(t, first, p, m, lane), c1 = store_chain(t, first, p, m + kDefer / 2, lane);
    run_chains(t, c0, t, c1, zeros, lane);
    write_store(t, c0, first, p, m, store, lane);
    write_store(t, c1, first, p, m + kDefer / 2, store, lane);
  }
}

// One CTA per (group of kDefer value heads, sequence), warp w the group's head w, the group's
// tokens in dynamic shared memory (GroupTokens::bytes). A step: each warp normalises its token's q
// and k and logs the token; then, behind one barrier, it runs its head's output chain together with
// its token's chain of the group's due store (warp m, token m). A store of every head (store_all):
// each warp forms its own head's store, two tokens' chains at a time.
__global__ void __launch_bounds__(kChainThreads, kChainCtasPerSm) deferred_chains_kernel(GdnDecodeStep a) {
  barriers::dependents_may_launch();
  extern __shared__ float4 chain_shared[];
  const Handoff handoff{a.sequences, a.value_heads, a.deferred.store_all};
  const int group = blockIdx.x, sequence = blockIdx.y;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, head = group * kDefer + warp;
  // Small exact quotients in fp32 (no integer division's dozens of instructions).
  const int ratio = __float2int_rn(__fdividef(a.value_heads, a.key_heads));
  const auto key_of = [&](int h) { return __float2int_rz(__fdividef(h + 0.5f, ratio)); };
  const int key_head = key_of(head), first_key = key_of(group * kDefer);
  const int key_span = GroupTokens::key_span(ratio, a.key_heads);
  const GroupTokens g(chain_shared, key_span);
  const auto view = [&](int h) { return HeadTokens(g, h - group * kDefer, min(key_of(h) - first_key, key_span - 1)); };
  const HeadTokens mine = view(head);
  const bool valid = head < a.value_heads, stepping = valid && !a.deferred.store_all;
  const int64_t token = sequence;
  // Every global load first, in two rounds of latency: the step's token with the pending count and
  // the log's address, then the logged tokens (cp.async) and their gates.
  const StepToken step = stepping ? load_step_token(a, token, head, key_head, lane) : StepToken{};
  const int n = static_cast<int>(a.deferred.pending[sequence]);
  const int p = valid ? unstored_tokens(n, head) : 0;
  const GdnDecodeLog layout{a.key_heads, a.value_heads};
  char* log = static_cast<char*>(a.deferred.logs[sequence]);
  fetch_logged(layout, log, n, first_key, key_span, a.key_heads, g, warp, lane);
  if (valid) fetch_head(layout, log, n, p, head, mine, lane);
  __pipeline_commit();
  const LoggedGates gates = valid ? load_gates(layout, log, n, p, head, lane) : LoggedGates{-1, 0, 0};
  if (warp == kDefer - 1) store4(g.zeros, lane, {0, 0, 0, 0});
  if (a.deferred.store_all) {
    put_gates(gates, mine);
    __pipeline_wait_prior(0);
    __syncthreads();
    if (valid && p > 0) {
      form_store(mine, (n - p) & (kDefer - 1), p, a.deferred.handoff + handoff.store_offset(sequence, head), g.zeros,
                 lane);
    }
    return;
  }
  const int now = n & (kDefer - 1);  // the step's token's slot
  Lane4 q = {0, 0, 0, 0};
  if (valid) {
    Lane4 k;
    normalise_in_warp(step.q, step.k, a.scale, q, k);
    // The token joins the group's tokens at slot `now` (its k by the key head's first value head in
    // the group) and the log at the same slot (its k by the key head's first value head).
    char* slot = log + now * static_cast<int>(layout.slot_bytes());
    if (head == max(key_head * ratio, group * kDefer)) store4(mine.k + now * D, lane, k);
    if (head == key_head * ratio) store4(reinterpret_cast<float*>(slot + layout.k_offset(key_head)), lane, k);
    lane_bf16x4(mine.v + now * D, lane) = step.v;
    reinterpret_cast<uint2*>(slot + layout.v_offset(head))[lane] = step.v;
    if (lane == 0) {
      mine.decay[now] = __expf(step.g), mine.beta[now] = step.beta;
      *reinterpret_cast<float*>(slot + layout.g_offset(head)) = step.g;
      *reinterpret_cast<float*>(slot + layout.beta_offset(head)) = step.beta;
    }
  }
  put_gates(gates, mine);  // after the normalisation, which their loads' latency covers
  __pipeline_wait_prior(0);
  __syncthreads();
  // The output's chain from q back through the step's token and the p logged ones; this warp's
  // token of the group's due store (storing_head: unstored + 1 tokens, the step's the last).
  Chain out{q, {0, 0, 0, 0}, now, valid ? p + 1 : 0};
  const int due = storing_head(n, group);
  const bool storing = due < a.value_heads;
  const int count = storing ? unstored_tokens(n, due) + 1 : 0, first = (n + 1 - count) & (kDefer - 1);
  const HeadTokens due_tokens = view(due);
  Chain token_m = store_chain(due_tokens, first, count, warp, lane);
  run_chains(mine, out, due_tokens, token_m, g.zeros, lane);
  if (valid) {
    float* o = a.deferred.handoff + handoff.head_offset(sequence, head);
    store4(o, lane, out.x);
    store4(o + D, lane, out.cv);
  }
  if (storing) {
    write_store(due_tokens, token_m, first, count, warp, a.deferred.handoff + handoff.store_offset(sequence, due),
                lane);
  }
}

// ---- the state pass (deferred_state_kernel: one CTA per sequence and value head) ----

// What a store reads from the handoff, staged in shared memory: y'_m, k_m and a_m by token (as
// the chains write them, coalesced; a warp's reads of y and k are one row's, broadcast), e^G.
struct StoreInputs {
  alignas(16) float y[kDefer][D];
  alignas(16) float k[kDefer][D];
  alignas(16) float a[kDefer][D];
  float total_decay, padding[3];
};
static_assert(sizeof(StoreInputs) == Handoff::kStoreFloats * sizeof(float), "the store area as the handoff lays it");

// widen_pair in two instruction forms, one for each pass a store makes over its held state:
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
// S_0^T x_0 (the output's, kOutput) at partial[kDefer], and S_0^T y'_m for the kSums tokens m from
// kFirst (a store's) at partial[m]. One pass: each row widened once. A store takes two passes of
// four tokens: the held state, eight tokens' sums and their operands exceed 80 registers.
template <bool kOutput, int kFirst, int kSums, int kForm = 0>
__device__ __forceinline__ void row_sums(const __nv_bfloat162 (&held)[kDecodeRows], const float* x0,
                                         const StoreInputs& in, float2 (*partial)[kRowBlocks][kPairColumns],
                                         int block, int pair, int i0) {
  static_assert(kSums == 0 || (kSums == 4 && kFirst % 4 == 0 && kFirst + kSums <= kDefer));
  float2 os = {0, 0}, h[kSums > 0 ? kSums : 1] = {};
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair_as<kForm>(held[i]);
    if constexpr (kOutput) os.x += x0[i0 + i] * s.x, os.y += x0[i0 + i] * s.y;
#pragma unroll
    for (int m = 0; m < kSums; ++m) {
      const float y = in.y[kFirst + m][i0 + i];
      h[m].x += y * s.x, h[m].y += y * s.y;
    }
  }
  if constexpr (kOutput) partial[kDefer][block][pair] = os;
#pragma unroll
  for (int m = 0; m < kSums; ++m) partial[kFirst + m][block][pair] = h[m];
}

// The state after the store's tokens written over the stored one, rounded to bf16 once: e^G S_0 +
// sum_m k_m delta_m^T with delta_m = a_m - S_0^T y'_m (its column pair summed over the row blocks).
__device__ __forceinline__ void store_state(const __nv_bfloat162 (&held)[kDecodeRows], const StoreInputs& in,
                                            const float2 (*partial)[kRowBlocks][kPairColumns], int pair, int i0,
                                            __nv_bfloat162* state) {
  const int j = 2 * pair;
  float2 delta[kDefer];
#pragma unroll
  for (int m = 0; m < kDefer; ++m) {
    float2 h = {0, 0};
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) h.x += partial[m][b][pair].x, h.y += partial[m][b][pair].y;
    const float2 am = *reinterpret_cast<const float2*>(&in.a[m][j]);
    delta[m] = {am.x - h.x, am.y - h.y};
  }
  const float decay = in.total_decay;
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair_as<2>(held[i]);
    float s0 = decay * s.x, s1 = decay * s.y;
#pragma unroll
    for (int m = 0; m < kDefer; ++m) s0 += in.k[m][i0 + i] * delta[m].x, s1 += in.k[m][i0 + i] * delta[m].y;
    state[i * (D / 2)] = __floats2bfloat162_rn(s0, s1);
  }
}

// One CTA per (sequence, value head), the thread layout of decode_token_bf16_kernel, a programmatic
// dependent of deferred_chains_kernel: the state and the norm's inputs are loaded before the wait
// (no kernel of the step writes them), the handoff after it. With deferred.store_all a head with
// unstored tokens stores them and nothing else runs.
__global__ void __launch_bounds__(kTokenThreads, kDecodeCtasPerSm) deferred_state_kernel(GdnDecodeStep a) {
  barriers::dependents_may_launch();
  const int sequence = blockIdx.x / a.value_heads, head = blockIdx.x % a.value_heads;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int block = warp / (D / kLineColumns), pair = warp % (D / kLineColumns) * 32 + lane;
  const int j = 2 * pair, i0 = block * kDecodeRows;  // the thread's columns j, j + 1 and rows i0 ..
  const int n = static_cast<int>(a.deferred.pending[sequence]);
  const bool store_all = a.deferred.store_all;
  if (store_all && unstored_tokens(n, head) == 0) return;
  const bool stores = store_all || store_due(n, head);
  __shared__ alignas(16) float head_in[2 * D];  // x_0, then sum_t c_t v_t
  const float* x0 = head_in;
  // Each row block's sums of a column pair: S_0^T y'_m of a store's tokens m, then S_0^T x_0.
  __shared__ float2 partial[kDefer + 1][kRowBlocks][kPairColumns];
  __shared__ alignas(16) float o_row[D];
  __shared__ NormInputs norm_inputs;
  __shared__ StoreInputs in;
  auto* state = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(const_cast<void*>(a.state_rows[sequence])) +
                                                  static_cast<int64_t>(head) * D * D + i0 * D + j);
  __nv_bfloat162 held[kDecodeRows];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) held[i] = state[i * (D / 2)];
  const int64_t token = sequence, gate = token * a.value_heads + head;
  const bool normalise = !store_all && a.norm.normed != nullptr;
  if (normalise) fetch_norm_inputs(a.norm, norm_inputs, token, head, warp, lane);

  barriers::wait_for_prerequisite();  // the chains' handoff
  const Handoff handoff{a.sequences, a.value_heads, store_all};
  const float* mine = a.deferred.handoff + (store_all ? 0 : handoff.head_offset(sequence, head));
  if (!store_all && threadIdx.x < 2 * D / 4) mma_tile::copy16(&head_in[4 * threadIdx.x], mine + 4 * threadIdx.x);
  if (stores) {
    const float* store = a.deferred.handoff + handoff.store_offset(sequence, head);
    for (int c = threadIdx.x; c < Handoff::kStoreFloats / 4; c += kTokenThreads) {
      mma_tile::copy16(reinterpret_cast<float*>(&in) + 4 * c, store + 4 * c);
    }
  }
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  if (store_all) {
    row_sums<false, 0, 4>(held, x0, in, partial, block, pair, i0);
    row_sums<false, 4, 4, 1>(held, x0, in, partial, block, pair, i0);
  } else if (stores) {
    row_sums<true, 0, 4>(held, x0, in, partial, block, pair, i0);
    row_sums<false, 4, 4, 1>(held, x0, in, partial, block, pair, i0);
  } else {
    row_sums<true, 0, 0>(held, x0, in, partial, block, pair, i0);
  }
  __syncthreads();
  if (!store_all && block == 0) {  // o = S_0^T x_0 (over the row blocks) + sum_t c_t v_t
    float2 o = *reinterpret_cast<const float2*>(&head_in[D + j]);
#pragma unroll
    for (int b = 0; b < kRowBlocks; ++b) o.x += partial[kDefer][b][pair].x, o.y += partial[kDefer][b][pair].y;
    *reinterpret_cast<float2*>(normalise ? &o_row[j] : a.out + gate * D + j) = o;
  }
  if (stores) store_state(held, in, partial, pair, i0, state);
  if (normalise) normed_output(a.norm, norm_inputs, o_row, token, head, a.value_heads, warp, lane);
}

}  // namespace dflash::target::kernels::gdn
