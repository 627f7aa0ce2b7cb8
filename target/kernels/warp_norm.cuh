// warp_norm.cuh: the RMSNorm of a row held by one warp, written once for the kernels that form it
// so that they sum and round alike: the factor (q/k norm + RoPE and the GatedDeltaNet gated
// RMSNorm in elementwise.cu, the one-token decode kernel's epilogue in gdn/decode_step.cuh) and
// the gated norm's element (elementwise.h: gated_rms_norm; the decode kernel's epilogue gives the
// same bits). Device code only.
#pragma once

#include <cuda_bf16.h>

#include "common/bf16x8.cuh"

namespace dflash::target::kernels {

// 8 fp32 values at p (16-byte aligned, a lane's elements of a row) as two 16-byte loads.
__device__ __forceinline__ void load_floats8(float (&v)[8], const float* p) {
  const float4* src = reinterpret_cast<const float4*>(p);
  const float4 x = src[0], y = src[1];
  v[0] = x.x, v[1] = x.y, v[2] = x.z, v[3] = x.w, v[4] = y.x, v[5] = y.y, v[6] = y.z, v[7] = y.w;
}

// The row's factor rsqrt(mean(o^2) + eps), summed one way: lane l of the warp holds elements
// [8l, 8l + 8) of o in v (zeros at and past d, d <= 256), summed in order, then over the lanes by
// a butterfly. Every lane of the warp calls it and gets the same factor.
__device__ __forceinline__ float warp_rms_factor(const float (&v)[8], int d, float eps) {
  float squares = 0.f;
#pragma unroll
  for (int j = 0; j < 8; ++j) squares += v[j] * v[j];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, off);
  return rsqrtf(squares / static_cast<float>(d) + eps);
}

// One element: bf16(float(bf16(w bf16(o r))) silu(z)), as the model's composite rounds it.
__device__ __forceinline__ float gated_rms_value(float o, float r, float w, float z) {
  using bf16x8::round_bf16;
  return round_bf16(round_bf16(w * round_bf16(o * r)) * (z / (1.f + expf(-z))));
}

}  // namespace dflash::target::kernels
