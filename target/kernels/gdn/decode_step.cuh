// Stage 5 (decoding): one token of the recurrent rule per sequence, for the incremental target's
// plain decode steps (target/incremental.h). A decode step is bound by the fp32 state's traffic
// (64 KB per head, 3 MB per sequence and layer at 27B shapes): this kernel reads each state once
// and writes the new one once, where the rule as libtorch ops passes over it about eight times.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// One CTA per (sequence, value head), one thread per value column j: the thread holds column j of
// S (128 key rows) in registers, so the two products (S^T k before the update, S^T q after it)
// and the update share one read:
//   S = e^g S;  delta_j = beta (v_j - sum_i k_i S_ij);  S_ij += k_i delta_j;  o_j = sum_i q_i S_ij
// with q, k L2-normalised here (q also scaled), as the reference path does.
__global__ void __launch_bounds__(D) decode_step_kernel(GdnDecodeStep a) {
  const int sequence = blockIdx.x / a.value_heads, head = blockIdx.x % a.value_heads;
  const int key_head = head / (a.value_heads / a.key_heads);
  const int j = threadIdx.x, warp = j / 32, lane = j % 32;
  __shared__ float q[D], k[D], sums[2][D / 32];
  const bf16* q_row = static_cast<const bf16*>(a.q) + sequence * a.q_stride + key_head * D;
  const bf16* k_row = static_cast<const bf16*>(a.k) + sequence * a.k_stride + key_head * D;
  const float qj = __bfloat162float(q_row[j]), kj = __bfloat162float(k_row[j]);
  float qq = qj * qj, kk = kj * kj;
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    qq += __shfl_xor_sync(0xffffffffu, qq, offset);
    kk += __shfl_xor_sync(0xffffffffu, kk, offset);
  }
  if (lane == 0) sums[0][warp] = qq, sums[1][warp] = kk;
  __syncthreads();
  float q_sum = 0, k_sum = 0;
#pragma unroll
  for (int w = 0; w < D / 32; ++w) q_sum += sums[0][w], k_sum += sums[1][w];
  q[j] = qj * rsqrtf(q_sum + 1e-6f) * a.scale;
  k[j] = kj * rsqrtf(k_sum + 1e-6f);
  __syncthreads();

  const int64_t row = static_cast<int64_t>(sequence) * a.value_heads + head;
  const float decay = __expf(a.g[row]), beta = a.beta[row];
  const float v = __bfloat162float(static_cast<const bf16*>(a.v)[sequence * a.v_stride + head * D + j]);
  const float* state_in = a.state_in + row * D * D + j;
  float s[D];
  float predicted = 0;
#pragma unroll
  for (int i = 0; i < D; ++i) {
    s[i] = state_in[i * D] * decay;
    predicted += k[i] * s[i];
  }
  const float delta = beta * (v - predicted);
  float* state_out = a.state_out + row * D * D + j;
  float o = 0;
#pragma unroll
  for (int i = 0; i < D; ++i) {
    s[i] += k[i] * delta;
    o += q[i] * s[i];
    state_out[i * D] = s[i];
  }
  a.out[row * D + j] = o;
}

}  // namespace dflash::target::kernels::gdn
