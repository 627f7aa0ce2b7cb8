// bf16x8.cuh: eight adjacent bf16 values as one 16-byte access, converted to and from fp32 (the
// vector loads and stores of the element-wise CUDA kernels). Device code only; pointers 16-byte
// aligned.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace dflash::bf16x8 {

// x rounded to bf16 (nearest even) and back: where the composite expression rounds an fp32
// intermediate to the model dtype.
__device__ __forceinline__ float round_bf16(float x) { return __bfloat162float(__float2bfloat16(x)); }

// An RMSNorm's weight applied to normed = x * rsqrt(mean(x^2) + eps), rounded as HF does:
// zero-centred (Qwen3.5 / Qwen3-Next) bf16(normed * (w + 1)); plain bf16(w * bf16(normed)).
__device__ __forceinline__ float weighted_norm(float normed, float w, bool zero_centred) {
  return round_bf16(zero_centred ? normed * (w + 1.f) : w * round_bf16(normed));
}

__device__ __forceinline__ void load8(float (&dst)[8], const __nv_bfloat16* src) {
  const uint4 raw = *reinterpret_cast<const uint4*>(src);
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) dst[j] = __bfloat162float(v[j]);
}

// Rounds each value to bf16 (nearest even).
__device__ __forceinline__ void store8(__nv_bfloat16* dst, const float (&src)[8]) {
  uint4 raw;
  __nv_bfloat16* v = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __float2bfloat16(src[j]);
  *reinterpret_cast<uint4*>(dst) = raw;
}

}  // namespace dflash::bf16x8
