// gdn_gates.cuh: the GatedDeltaNet gates from the layer's raw projections, written once for the
// kernels that form them (kernels::gdn_gates in elementwise.cu, the chunked forward's prepare
// stage), so both give the same values. Device code only.
#pragma once

#include <cuda_runtime.h>

namespace dflash::target::kernels {

// g = -exp(A_log) softplus(a + dt_bias), softplus with torch's threshold (x above 20: x).
__device__ __forceinline__ float gdn_decay_gate(float a, float a_log, float dt_bias) {
  const float x = a + dt_bias;
  return -expf(a_log) * (x > 20.0f ? x : log1pf(expf(x)));
}

// beta = sigmoid(b).
__device__ __forceinline__ float gdn_beta_gate(float b) { return 1.0f / (1.0f + expf(-b)); }

}  // namespace dflash::target::kernels
