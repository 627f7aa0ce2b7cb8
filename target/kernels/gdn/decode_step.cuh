// Stage 5 (decoding): a few tokens of the recurrent rule per sequence, for the incremental
// target's decode and verify steps and crops (target/incremental.h). These are bound by the
// state's traffic (fp32: 64 KB per head, 3 MB per sequence and layer at 27B shapes; bf16 states
// half that): this kernel reads each state once and writes the new one once, where the rule as
// libtorch ops passes over it about eight times per token (token by token) or pads a 16-token
// verify step to a 64-token chunk.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "common/barriers.cuh"
#include "target/kernels/warp_norm.cuh"
#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// Two CTAs per (sequence, value head), one per 64 value columns; kDecodeSplit threads per value
// column j, each holding kDecodeRows key rows of column j of S in registers for all the call's
// tokens, so the state is read once and written once however many tokens run. Per token t:
//   S = e^g_t S;  delta_j = beta_t (v_tj - sum_i k_ti S_ij);  S_ij += k_ti delta_j;  o_tj = sum_i q_ti S_ij
// with q, k L2-normalised here (q also scaled), as the reference path does. 32 rows per thread
// keep the kernel at about 80 registers, three CTAs per SM (a thread holding all 128 rows of a
// column would spill).
constexpr int kDecodeSplit = 4;                       // threads (warps) per column
constexpr int kDecodeRows = D / kDecodeSplit;         // key rows per thread
constexpr int kDecodeCtasPerHead = 2;
constexpr int kDecodeColumns = D / kDecodeCtasPerHead;  // value columns per CTA
constexpr int kDecodeThreads = kDecodeColumns * kDecodeSplit;  // 256
// Three CTAs per SM (at most 85 registers a thread): the kernels are bound by how many state
// bytes are in flight, which is how many CTAs are resident.
constexpr int kDecodeCtasPerSm = 3;

// Sequence s's state [value_heads, 128, 128]: row s of state_in, or where state_rows[s] points.
template <typename State>
__device__ __forceinline__ const State* sequence_state(const void* state_in, const void* const* state_rows, int sequence,
                                                       int value_heads) {
  if (state_rows != nullptr) return static_cast<const State*>(state_rows[sequence]);
  return static_cast<const State*>(state_in) + static_cast<int64_t>(sequence) * value_heads * D * D;
}

// The state as held between steps (GdnDecodeStep::state_bf16): fp32, or bf16 widened on load and
// rounded once on store (the rule itself always runs in fp32).
__device__ __forceinline__ float state_value(float x) { return x; }
__device__ __forceinline__ float state_value(bf16 x) { return __bfloat162float(x); }
template <typename State>
__device__ __forceinline__ State stored_state(float x);
template <>
__device__ __forceinline__ float stored_state<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ bf16 stored_state<bf16>(float x) {
  return __float2bfloat16_rn(x);
}

// q and k of one token (one key head's 128 elements at q_in, k_in), L2-normalised (q also scaled
// by `scale`) into shared memory by the CTA's first D threads (thread c: element c), and, where qk
// is not null, their dot product q.k into qk[0]; `sums` holds the per-warp partial sums. Every
// thread of the CTA calls it (it synchronises); q, k and q.k may be read after it returns. After
// a previous token (`follows_a_token`) it first waits until every thread has read that token's.
__device__ __forceinline__ void normalise_qk(const bf16* q_in, const bf16* k_in, float scale, float* q, float* k, float* qk,
                                             float (*sums)[D / 32], bool follows_a_token) {
  const int c = threadIdx.x, lane = c & 31, warp = c >> 5;
  float qc = 0, kc = 0;
  if (follows_a_token) __syncthreads();
  if (c < D) {
    qc = __bfloat162float(q_in[c]);
    kc = __bfloat162float(k_in[c]);
    float qq = qc * qc, kk = kc * kc, qk_raw = qc * kc;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      qq += __shfl_xor_sync(0xffffffffu, qq, offset);
      kk += __shfl_xor_sync(0xffffffffu, kk, offset);
      if (qk != nullptr) qk_raw += __shfl_xor_sync(0xffffffffu, qk_raw, offset);
    }
    if (lane == 0) sums[0][warp] = qq, sums[1][warp] = kk, sums[2][warp] = qk_raw;
  }
  __syncthreads();
  if (c < D) {
    float q_sum = 0, k_sum = 0, qk_sum = 0;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) q_sum += sums[0][w], k_sum += sums[1][w], qk_sum += qk ? sums[2][w] : 0;
    const float q_factor = rsqrtf(q_sum + 1e-6f) * scale, k_factor = rsqrtf(k_sum + 1e-6f);
    q[c] = qc * q_factor;
    k[c] = kc * k_factor;
    if (qk != nullptr && c == 0) qk[0] = qk_sum * q_factor * k_factor;
  }
  __syncthreads();
}

// The sum of x over a column's kDecodeSplit row blocks, through `partial` (every thread of the CTA
// calls it: it synchronises). The k.S and q.S sums of one token use two arrays; normalise_qk's
// barrier separates consecutive tokens'.
__device__ __forceinline__ float column_total(float (*partial)[kDecodeColumns], int block, int column, float x) {
  partial[block][column] = x;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int b = 0; b < kDecodeSplit; ++b) total += partial[b][column];
  return total;
}

// Warp w of a CTA holds rows 32 (w / 2) .. + 31 of the 32 columns 32 (w % 2) .. of its 64: each of
// its loads and stores is one row's 32 consecutive values (one 128-byte line of fp32 states; a warp
// over four rows touched four lines per access and kept the L1 busy). A column's sums over its
// four warps meet in shared memory, once per token for k.S and once for q.S.
template <typename State>
__global__ void __launch_bounds__(kDecodeThreads, kDecodeCtasPerSm) decode_step_kernel(GdnDecodeStep a) {
  barriers::start_as_dependent();
  const int item = blockIdx.x / kDecodeCtasPerHead, sequence = item / a.value_heads, head = item % a.value_heads;
  const int key_head = head / (a.value_heads / a.key_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int block = warp / (kDecodeColumns / 32), column = warp % (kDecodeColumns / 32) * 32 + lane;  // of the CTA's
  const int j = blockIdx.x % kDecodeCtasPerHead * kDecodeColumns + column;
  const int i0 = block * kDecodeRows;  // this thread's rows i0 .. i0 + kDecodeRows - 1 of column j
  __shared__ float q[D], k[D], sums[3][D / 32];
  __shared__ float partial[2][kDecodeSplit][kDecodeColumns];  // each row block's k.S, then q.S, of a column
  const int64_t first_token = static_cast<int64_t>(sequence) * a.tokens;  // [sequences, tokens] rows
  const State* state_in = sequence_state<State>(a.state_in, a.state_rows, sequence, a.value_heads) +
                          static_cast<int64_t>(head) * D * D + i0 * D + j;
  float s[kDecodeRows];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) s[i] = state_value(state_in[i * D]);

  for (int t = 0; t < a.tokens; ++t) {
    const int64_t token = first_token + t;
    normalise_qk(static_cast<const bf16*>(a.q) + token * a.q_stride + key_head * D,
                 static_cast<const bf16*>(a.k) + token * a.k_stride + key_head * D, a.scale, q, k, nullptr, sums,
                 t > 0);
    const int64_t gate = token * a.value_heads + head;
    const float decay = __expf(a.g[gate]), beta = a.beta[gate];
    const float v = __bfloat162float(static_cast<const bf16*>(a.v)[token * a.v_stride + head * D + j]);
    float predicted = 0;
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) {
      s[i] *= decay;
      predicted += k[i0 + i] * s[i];
    }
    const float delta = beta * (v - column_total(partial[0], block, column, predicted));
    float o = 0;
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) {
      s[i] += k[i0 + i] * delta;
      o += q[i0 + i] * s[i];
    }
    o = column_total(partial[1], block, column, o);
    if (block == 0) a.out[gate * D + j] = o;
  }
  const int64_t row = static_cast<int64_t>(sequence) * a.value_heads + head;
  State* state_out = static_cast<State*>(a.state_out) + row * D * D + static_cast<int64_t>(i0) * D + j;
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) state_out[i * D] = stored_state<State>(s[i]);
}

// A bf16 pair widened to fp32. Through a volatile asm statement: each call is its own
// instruction, so the compiler cannot keep the first pass's widened values alive for the second
// (64 more registers, which made it spill) and re-forms them from the pair instead.
__device__ __forceinline__ float2 widen_pair(__nv_bfloat162 x) {
  const uint32_t bits = *reinterpret_cast<const uint32_t*>(&x);
  uint32_t lo, hi;
  asm volatile("shl.b32 %0, %2, 16;\n\tand.b32 %1, %2, 0xffff0000;" : "=r"(lo), "=r"(hi) : "r"(bits));
  return {__uint_as_float(lo), __uint_as_float(hi)};
}

// A held pair of state columns after one token: e^g S + k delta, rounded to bf16 once (the
// one-token kernel's new state).
__device__ __forceinline__ __nv_bfloat162 stepped_pair(__nv_bfloat162 held, float decay, float k, float delta0,
                                                      float delta1) {
  const float2 s = widen_pair(held);
  float s0 = s.x * decay, s1 = s.y * decay;
  s0 += k * delta0;
  s1 += k * delta1;
  return __floats2bfloat162_rn(s0, s1);
}

// Plain decoding steps (one token per sequence) on bf16 states. The kernel above holds a column's
// rows as fp32 across the call's tokens, so a bf16 state fills only half the registers it costs:
// with the same CTAs resident per SM only half the bytes are in flight, and it is no faster than
// on fp32 states. With one token nothing needs to outlive the token: a thread keeps two adjacent
// columns' 32 rows as the bf16 pairs it loaded (the same registers hold twice the state). A first
// pass forms k.S and q.S; then delta = beta (v - e^g k.S) and o = q.S' = e^g q.S + delta q.k (the
// same quantities as the kernel above, summed in another order); a second pass forms each new pair
// e^g S + k delta, rounds it once and stores it. One CTA per (sequence, value head). Warp w holds
// rows 32 (w / 2) .. + 31 of the 64 columns 64 (w % 2) .., so each of its loads and stores is one
// row's 128 contiguous bytes, one cache line (a warp over four rows touched four lines per access
// and kept the L1 busy: 3.5 TB/s against a copy's 4.1); a column's sums over its four warps meet
// in shared memory.
// With GdnDecodeNorm::normed set, the head's output goes through shared memory to warps 0-3, which
// form its gated RMSNorm as elementwise.h's kernel does (warp_norm.cuh: the same bits) after the
// new state is stored: the layer then needs no separate norm kernel and never writes o.
constexpr int kPairColumns = D / 2;                          // column pairs per head
constexpr int kLineColumns = 64;                             // bf16 columns per 128-byte line
constexpr int kRowBlocks = D / kDecodeRows;                  // warps sharing a column: 4
constexpr int kTokenThreads = D / kLineColumns * kRowBlocks * 32;  // 256

// The norm's inputs of one head, copied into shared memory when the kernel starts (cp.async: no
// registers held, the latency hidden behind the state's): z's row and the weight.
struct NormInputs {
  alignas(16) bf16 z[D];
  alignas(16) bf16 weight[D];
};
__device__ __forceinline__ void fetch_norm_inputs(const GdnDecodeNorm& n, NormInputs& in, int64_t token, int head,
                                                  int warp, int lane) {
  if (warp != 0 || lane >= D / 8) return;
  const bf16* z = static_cast<const bf16*>(n.z) + token * n.z_stride + static_cast<int64_t>(head) * n.z_head_stride;
  mma_tile::copy16(&in.z[8 * lane], z + 8 * lane);
  mma_tile::copy16(&in.weight[8 * lane], static_cast<const bf16*>(n.weight) + 8 * lane);
  __pipeline_commit();
}

// The gated RMSNorm of the head's output (o_row, written by row block 0 before the second pass),
// formed by warps 0-3 once their second pass is issued (its stores drain meanwhile): each warp
// forms the row's factor as gated_rms_norm's kernel does, then its 32 elements, one a lane.
__device__ __forceinline__ void normed_output(const GdnDecodeNorm& n, const NormInputs& in, const float* o_row,
                                              int64_t token, int head, int value_heads, int warp, int lane) {
  if (warp >= D / 32) return;
  if (warp == 0) __pipeline_wait_prior(0);  // the norm's inputs, copied by warp 0
  barriers::NamedBarrier{1, D}.sync();
  float v[8] = {};
  if (lane < D / 8) load_floats8(v, o_row + 8 * lane);
  const float r = warp_rms_factor(v, D, n.eps);
  const int e = warp * 32 + lane;
  const float value = gated_rms_value(o_row[e], r, __bfloat162float(in.weight[e]), __bfloat162float(in.z[e]));
  static_cast<bf16*>(n.normed)[(token * value_heads + head) * D + e] = __float2bfloat16(value);
}

__global__ void __launch_bounds__(kTokenThreads, kDecodeCtasPerSm) decode_token_bf16_kernel(GdnDecodeStep a) {
  barriers::start_as_dependent();
  const int sequence = blockIdx.x / a.value_heads, head = blockIdx.x % a.value_heads;
  const int key_head = head / (a.value_heads / a.key_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int block = warp / (D / kLineColumns), pair = warp % (D / kLineColumns) * 32 + lane;
  const int j = 2 * pair, i0 = block * kDecodeRows;  // the thread's columns j, j + 1 and rows i0 ..
  __shared__ float q[D], k[D], qk[1], sums[3][D / 32];
  __shared__ float2 partial[2][kRowBlocks][kPairColumns];  // each row block's k.S and q.S of a pair
  __shared__ alignas(16) float o_row[D];                   // the head's output, for the norm
  __shared__ NormInputs norm_inputs;
  const int64_t row = static_cast<int64_t>(sequence) * a.value_heads + head, token = sequence;
  const auto* state_in = reinterpret_cast<const __nv_bfloat162*>(
      sequence_state<bf16>(a.state_in, a.state_rows, sequence, a.value_heads) + static_cast<int64_t>(head) * D * D +
      i0 * D + j);
  __nv_bfloat162 held[kDecodeRows];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) held[i] = state_in[i * (D / 2)];
  const bool normalise = a.norm.normed != nullptr;
  if (normalise) fetch_norm_inputs(a.norm, norm_inputs, token, head, warp, lane);
  // The gate, beta and v pair issued with the state's loads (their latency overlaps).
  const int64_t gate = token * a.value_heads + head;
  const float g = a.g[gate], beta = a.beta[gate];
  const __nv_bfloat162 v_pair =
      *reinterpret_cast<const __nv_bfloat162*>(static_cast<const bf16*>(a.v) + token * a.v_stride + head * D + j);
  normalise_qk(static_cast<const bf16*>(a.q) + token * a.q_stride + key_head * D,
               static_cast<const bf16*>(a.k) + token * a.k_stride + key_head * D, a.scale, q, k, qk, sums, false);
  const float decay = __expf(g);
  const float2 v = __bfloat1622float2(v_pair);

  // First pass: k.S and q.S of both columns over the thread's rows (S as loaded; the decay is
  // applied to the sums), then over the column's four row blocks.
  float2 ks = {0, 0}, qs = {0, 0};
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    const float2 s = widen_pair(held[i]);
    ks.x += k[i0 + i] * s.x, ks.y += k[i0 + i] * s.y;
    qs.x += q[i0 + i] * s.x, qs.y += q[i0 + i] * s.y;
  }
  partial[0][block][pair] = ks;
  partial[1][block][pair] = qs;
  __syncthreads();
  ks = qs = {0, 0};
#pragma unroll
  for (int b = 0; b < kRowBlocks; ++b) {
    const float2 kb = partial[0][b][pair], qb = partial[1][b][pair];
    ks.x += kb.x, ks.y += kb.y, qs.x += qb.x, qs.y += qb.y;
  }
  // delta = beta (v - e^g k.S);  o = q.S' = e^g q.S + delta q.k  (S' = e^g S + k delta^T).
  const float delta0 = beta * (v.x - decay * ks.x), delta1 = beta * (v.y - decay * ks.y);
  if (block == 0) {
    const float2 o = {decay * qs.x + delta0 * qk[0], decay * qs.y + delta1 * qk[0]};
    *reinterpret_cast<float2*>(normalise ? &o_row[j] : a.out + gate * D + j) = o;
  }
  // Second pass: the new state, each pair stored as it is formed; k re-read from shared memory
  // (the memory clobber) rather than held from the first pass.
  asm volatile("" ::: "memory");
  auto* state_out = reinterpret_cast<__nv_bfloat162*>(static_cast<bf16*>(a.state_out) + row * D * D + i0 * D + j);
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) {
    state_out[i * (D / 2)] = stepped_pair(held[i], decay, k[i0 + i], delta0, delta1);
  }
  if (normalise) normed_output(a.norm, norm_inputs, o_row, token, head, a.value_heads, warp, lane);
}

}  // namespace dflash::target::kernels::gdn
