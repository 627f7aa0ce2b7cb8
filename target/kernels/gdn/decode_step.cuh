// Stage 5 (decoding): a few tokens of the recurrent rule per sequence, for the incremental
// target's decode and verify steps and crops (target/incremental.h). These are bound by the
// state's traffic (fp32: 64 KB per head, 3 MB per sequence and layer at 27B shapes; bf16 states
// half that): this kernel reads each state once and writes the new one once, where the rule as
// libtorch ops passes over it about eight times per token (token by token) or pads a 16-token
// verify step to a 64-token chunk.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// Two CTAs per (sequence, value head), one per 64 value columns; kDecodeSplit threads per value
// column j, each holding kDecodeRows key rows of column j of S in registers for all the call's
// tokens, so the state is read once and written once however many tokens run. Per token t:
//   S = e^g_t S;  delta_j = beta_t (v_tj - sum_i k_ti S_ij);  S_ij += k_ti delta_j;  o_tj = sum_i q_ti S_ij
// with q, k L2-normalised here (q also scaled), as the reference path does. A column's sums over
// i are its threads' partial sums combined by two shuffles. 32 rows per thread keep the kernel at
// about 80 registers, three CTAs per SM (a thread holding all 128 rows of a column would spill).
// A warp holds 8 columns: each of its loads and stores is 4 runs of 32 bytes of fp32 states,
// whole sectors (16 bytes of bf16 states: the neighbouring warp's columns fill the sectors).
constexpr int kDecodeSplit = 4;                       // threads per column: lanes c, c + 8, c + 16, c + 24
constexpr int kDecodeRows = D / kDecodeSplit;         // key rows per thread
constexpr int kDecodeCtasPerHead = 2;
constexpr int kDecodeColumns = D / kDecodeCtasPerHead;  // value columns per CTA
constexpr int kDecodeThreads = kDecodeColumns * kDecodeSplit;  // 256
constexpr int kDecodeColumnsPerWarp = 32 / kDecodeSplit;

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

template <typename State>
__global__ void __launch_bounds__(kDecodeThreads) decode_step_kernel(GdnDecodeStep a) {
  const int item = blockIdx.x / kDecodeCtasPerHead, sequence = item / a.value_heads, head = item % a.value_heads;
  const int key_head = head / (a.value_heads / a.key_heads);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int part = lane / kDecodeColumnsPerWarp;
  const int j =
      blockIdx.x % kDecodeCtasPerHead * kDecodeColumns + warp * kDecodeColumnsPerWarp + lane % kDecodeColumnsPerWarp;
  const int i0 = part * kDecodeRows;  // this thread's rows i0 .. i0 + kDecodeRows - 1 of column j
  __shared__ float q[D], k[D], sums[2][D / 32];
  const int64_t row = static_cast<int64_t>(sequence) * a.value_heads + head;
  const State* state_in = static_cast<const State*>(a.state_in) + row * D * D + static_cast<int64_t>(i0) * D + j;
  float s[kDecodeRows];
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) s[i] = state_value(state_in[i * D]);
  // The sum over a column's kDecodeSplit threads (lanes apart by kDecodeColumnsPerWarp).
  auto column_sum = [](float x) {
#pragma unroll
    for (int offset = kDecodeColumnsPerWarp; offset < 32; offset <<= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
    return x;
  };

  for (int t = 0; t < a.tokens; ++t) {
    const int64_t token = static_cast<int64_t>(sequence) * a.tokens + t;  // [sequences, tokens] rows
    // q and k of this token, L2-normalised by the first D threads (thread c: element c).
    const int c = threadIdx.x;
    float qc = 0, kc = 0;
    __syncthreads();  // the previous token's q, k and sums are read by every thread
    if (c < D) {
      qc = __bfloat162float(static_cast<const bf16*>(a.q)[token * a.q_stride + key_head * D + c]);
      kc = __bfloat162float(static_cast<const bf16*>(a.k)[token * a.k_stride + key_head * D + c]);
      float qq = qc * qc, kk = kc * kc;
#pragma unroll
      for (int offset = 16; offset > 0; offset >>= 1) {
        qq += __shfl_xor_sync(0xffffffffu, qq, offset);
        kk += __shfl_xor_sync(0xffffffffu, kk, offset);
      }
      if (lane == 0) sums[0][warp] = qq, sums[1][warp] = kk;
    }
    __syncthreads();
    if (c < D) {
      float q_sum = 0, k_sum = 0;
#pragma unroll
      for (int w = 0; w < D / 32; ++w) q_sum += sums[0][w], k_sum += sums[1][w];
      q[c] = qc * rsqrtf(q_sum + 1e-6f) * a.scale;
      k[c] = kc * rsqrtf(k_sum + 1e-6f);
    }
    __syncthreads();

    const int64_t gate = token * a.value_heads + head;
    const float decay = __expf(a.g[gate]), beta = a.beta[gate];
    const float v = __bfloat162float(static_cast<const bf16*>(a.v)[token * a.v_stride + head * D + j]);
    float predicted = 0;
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) {
      s[i] *= decay;
      predicted += k[i0 + i] * s[i];
    }
    const float delta = beta * (v - column_sum(predicted));
    float o = 0;
#pragma unroll
    for (int i = 0; i < kDecodeRows; ++i) {
      s[i] += k[i0 + i] * delta;
      o += q[i0 + i] * s[i];
    }
    o = column_sum(o);
    if (part == 0) a.out[gate * D + j] = o;
  }
  State* state_out = static_cast<State*>(a.state_out) + row * D * D + static_cast<int64_t>(i0) * D + j;
#pragma unroll
  for (int i = 0; i < kDecodeRows; ++i) state_out[i * D] = stored_state<State>(s[i]);
}

}  // namespace dflash::target::kernels::gdn
