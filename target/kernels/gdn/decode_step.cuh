// Stage 5 (decoding): a few tokens of the recurrent rule per sequence, for the incremental
// target's decode and verify steps and crops (target/incremental.h). These are bound by the fp32
// state's traffic (64 KB per head, 3 MB per sequence and layer at 27B shapes): this kernel reads
// each state once and writes the new one once, where the rule as libtorch ops passes over it about
// eight times per token (token by token) or pads a 16-token verify step to a 64-token chunk.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// One CTA per (sequence, value head), one thread per value column j: the thread holds column j of
// S (128 key rows) in registers for all the call's tokens, so the state is read once and written
// once however many tokens run. Per token t:
//   S = e^g_t S;  delta_j = beta_t (v_tj - sum_i k_ti S_ij);  S_ij += k_ti delta_j;  o_tj = sum_i q_ti S_ij
// with q, k L2-normalised here (q also scaled), as the reference path does.
__global__ void __launch_bounds__(D) decode_step_kernel(GdnDecodeStep a) {
  const int sequence = blockIdx.x / a.value_heads, head = blockIdx.x % a.value_heads;
  const int key_head = head / (a.value_heads / a.key_heads);
  const int j = threadIdx.x, warp = j / 32, lane = j % 32;
  __shared__ float q[D], k[D], sums[2][D / 32];
  const int64_t row = static_cast<int64_t>(sequence) * a.value_heads + head;
  const float* state_in = a.state_in + row * D * D + j;
  float s[D];
#pragma unroll
  for (int i = 0; i < D; ++i) s[i] = state_in[i * D];

  for (int t = 0; t < a.tokens; ++t) {
    const int64_t token = static_cast<int64_t>(sequence) * a.tokens + t;  // [sequences, tokens] rows
    const float qj = __bfloat162float(static_cast<const bf16*>(a.q)[token * a.q_stride + key_head * D + j]);
    const float kj = __bfloat162float(static_cast<const bf16*>(a.k)[token * a.k_stride + key_head * D + j]);
    float qq = qj * qj, kk = kj * kj;
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      qq += __shfl_xor_sync(0xffffffffu, qq, offset);
      kk += __shfl_xor_sync(0xffffffffu, kk, offset);
    }
    __syncthreads();  // the previous token's q, k and sums are read by every thread
    if (lane == 0) sums[0][warp] = qq, sums[1][warp] = kk;
    __syncthreads();
    float q_sum = 0, k_sum = 0;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) q_sum += sums[0][w], k_sum += sums[1][w];
    q[j] = qj * rsqrtf(q_sum + 1e-6f) * a.scale;
    k[j] = kj * rsqrtf(k_sum + 1e-6f);
    __syncthreads();

    const int64_t gate = token * a.value_heads + head;
    const float decay = __expf(a.g[gate]), beta = a.beta[gate];
    const float v = __bfloat162float(static_cast<const bf16*>(a.v)[token * a.v_stride + head * D + j]);
    float predicted = 0;
#pragma unroll
    for (int i = 0; i < D; ++i) {
      s[i] *= decay;
      predicted += k[i] * s[i];
    }
    const float delta = beta * (v - predicted);
    float o = 0;
#pragma unroll
    for (int i = 0; i < D; ++i) {
      s[i] += k[i] * delta;
      o += q[i] * s[i];
    }
    a.out[gate * D + j] = o;
  }
  float* state_out = a.state_out + row * D * D + j;
#pragma unroll
  for (int i = 0; i < D; ++i) state_out[i * D] = s[i];
}

}  // namespace dflash::target::kernels::gdn
