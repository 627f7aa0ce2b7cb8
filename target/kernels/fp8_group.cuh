// fp8_group.cuh: one 1x128 group of a row quantised to e4m3 by the 16 lanes of a half-warp that
// hold it, 8 consecutive values each (target/fp8.h's activation quantisation). The quantisation
// kernel and the element-wise kernels that produce an FP8 GEMM's input (the RMSNorm before a
// projection, SiLU-mul before down_proj, the attention output gate before o_proj) share it, so
// the rounding is the same wherever a GEMM's input is quantised. Device code only.
#pragma once

#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::target::kernels::fp8_group {

constexpr int kGroup = 128;        // elements per factor
constexpr int kLanes = 16;         // lanes per group, 8 elements each
constexpr float kE4m3Max = 448.f;  // the largest finite e4m3

// A group's factor from its largest magnitude: max|group| / 448, 1 for an all-zero group.
__device__ __forceinline__ float factor_of(float amax) { return amax > 0.f ? amax / kE4m3Max : 1.f; }

// Values of a group divided by its factor, correctly rounded (the rounding of transformers'
// act_quant, and of the CPU's division), without a full division per element: from the correctly
// rounded reciprocal r, q = v r, then one correction with the exact remainder v - q factor (an
// FMA) gives the correctly rounded quotient (Markstein); the quotients here are at most 448 in
// magnitude.
struct Divider {
  float factor, r;  // r = the correctly rounded 1 / factor (divider_of)
  __device__ __forceinline__ float operator()(float x) const {
    const float q = __fmul_rn(x, r);
    return __fmaf_rn(__fmaf_rn(-q, factor, x), r, q);
  }
};
__device__ __forceinline__ Divider divider_of(float factor) { return {factor, __frcp_rn(factor)}; }

// Two values / the factor as two e4m3 bytes (a first), round-to-nearest-even, saturated.
__device__ __forceinline__ uint32_t e4m3x2(const Divider& divide, float a, float b) {
  return static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(make_float2(divide(a), divide(b)), __NV_SATFINITE, __NV_E4M3));
}

// v: this lane's 8 values (already rounded to the model dtype: the GEMM reads what the bf16
// tensor would hold). All 16 lanes of the half-warp (lanes 0-15 or 16-31) must call together;
// the other half may be absent. q = e4m3(v / factor_of(max|group|)): this lane's 8 bytes;
// factor_out is written by the group's first lane.
__device__ __forceinline__ void store_e4m3(const float (&v)[8], __nv_fp8_storage_t* q, float* factor_out) {
  const unsigned half = 0xffffu << (threadIdx.x & 16);
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = kLanes / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(half, amax, off));
  const float factor = factor_of(amax);
  const Divider divide = divider_of(factor);
  uint32_t packed[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    packed[h] = e4m3x2(divide, v[4 * h], v[4 * h + 1]) | (e4m3x2(divide, v[4 * h + 2], v[4 * h + 3]) << 16);
  }
  *reinterpret_cast<uint2*>(q) = make_uint2(packed[0], packed[1]);
  if ((threadIdx.x & (kLanes - 1)) == 0) *factor_out = factor;
}

// Where a GEMM input's quantised rows go: q e4m3 [rows, k] contiguous, factor of (row r, group g)
// at factors[g * factor_stride + r] (column-major, as cuBLASLt's 1x128 scaling reads them).
struct Destination {
  __nv_fp8_storage_t* q = nullptr;
  float* factors = nullptr;
  int64_t factor_stride = 0;
  // Row `row`'s 8 values at `column` (a multiple of 8) of a k-wide row.
  __device__ __forceinline__ void store(const float (&v)[8], int64_t row, int64_t column, int64_t k) const {
    store_e4m3(v, q + row * k + column, factors + column / kGroup * factor_stride + row);
  }
};

}  // namespace dflash::target::kernels::fp8_group
