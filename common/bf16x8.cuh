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

// SwiGLU's product of a bf16 gate and up value, rounded as the composite bf16(silu(g)) * u is
// (the caller rounds the product): silu_mul's kernel and the stream-K GEMM's fused epilogue.
__device__ __forceinline__ float silu_times(float g, float u) {
  return round_bf16(__fdividef(g, 1.f + __expf(-g))) * u;
}

// Gated attention's output: a bf16 value o times bf16(sigmoid(gate)), rounded as the composite
// o * sigmoid(gate) in bf16 is (the caller rounds the product): the sigmoid gate kernel and the
// decoding attention's epilogue.
__device__ __forceinline__ float sigmoid_gated(float o, float gate) {
  return o * round_bf16(1.f / (1.f + __expf(-gate)));
}

// Eight bf16 values held as 16 raw bytes (a load issued before its values are needed).
__device__ __forceinline__ void unpack8(float (&dst)[8], const uint4& raw) {
  const __nv_bfloat16* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) dst[j] = __bfloat162float(v[j]);
}

__device__ __forceinline__ void load8(float (&dst)[8], const __nv_bfloat16* src) {
  unpack8(dst, *reinterpret_cast<const uint4*>(src));
}

// Rounds each value to bf16 (nearest even).
__device__ __forceinline__ uint4 pack8(const float (&src)[8]) {
  uint4 raw;
  __nv_bfloat16* v = reinterpret_cast<__nv_bfloat16*>(&raw);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = __float2bfloat16(src[j]);
  return raw;
}

__device__ __forceinline__ void store8(__nv_bfloat16* dst, const float (&src)[8]) {
  *reinterpret_cast<uint4*>(dst) = pack8(src);
}

}  // namespace dflash::bf16x8
