// gdn_gates.cuh: the GatedDeltaNet gates from the layer's raw projections, written once for the
// kernels that form them (kernels::gdn_gates in elementwise.cu, the chunked forward's prepare
// stage), so both give the same values. Device code only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::target::kernels {

// g = -exp(A_log) softplus(a + dt_bias), softplus with torch's threshold (x above 20: x).
__device__ __forceinline__ float gdn_decay_gate(float a, float a_log, float dt_bias) {
  const float x = a + dt_bias;
  return -expf(a_log) * (x > 20.0f ? x : log1pf(expf(x)));
}

// beta = sigmoid(b).
__device__ __forceinline__ float gdn_beta_gate(float b) { return 1.0f / (1.0f + expf(-b)); }

// Element i of g and beta (fp32 [rows, heads]): row i / heads, head i % heads, from the
// projections a and b (bf16, row r at r * a_stride, r * b_stride) and A_log, dt_bias.
__device__ __forceinline__ void gdn_gates_at(int64_t i, const __nv_bfloat16* a, int64_t a_stride,
                                             const __nv_bfloat16* b, int64_t b_stride, const float* a_log,
                                             const float* dt_bias, int heads, float* g, float* beta) {
  const int64_t row = i / heads;
  const int head = static_cast<int>(i % heads);
  g[i] = gdn_decay_gate(__bfloat162float(a[row * a_stride + head]), a_log[head], dt_bias[head]);
  beta[i] = gdn_beta_gate(__bfloat162float(b[row * b_stride + head]));
}

}  // namespace dflash::target::kernels
