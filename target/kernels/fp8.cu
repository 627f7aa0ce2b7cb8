// The activation quantisation of the FP8 GEMMs: see fp8.h.
#include "target/kernels/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>

#include "common/cuda_check.h"

namespace dflash::target::kernels {
namespace {

constexpr int kGroup = 128;         // elements per factor
constexpr int kGroupsPerBlock = 8;  // one warp per group
constexpr float kE4m3Max = 448.f;

// One warp per 1x128 group: each lane holds 4 consecutive elements, the warp's max |x| sets
// the factor, each lane writes its 4 bytes of e4m3.
__global__ void __launch_bounds__(32 * kGroupsPerBlock)
    quantize_groups_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride, int64_t rows, int64_t groups,
                           __nv_fp8_storage_t* __restrict__ q, float* __restrict__ factors) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * kGroupsPerBlock + (threadIdx.x >> 5);
  if (group >= rows * groups) return;
  const int lane = threadIdx.x & 31;
  const int64_t row = group / groups, g = group % groups;
  const int64_t column = g * kGroup + lane * 4;
  const uint2 raw = *reinterpret_cast<const uint2*>(x + row * stride + column);
  const __nv_bfloat162 lo = *reinterpret_cast<const __nv_bfloat162*>(&raw.x);
  const __nv_bfloat162 hi = *reinterpret_cast<const __nv_bfloat162*>(&raw.y);
  const float2 a = __bfloat1622float2(lo), b = __bfloat1622float2(hi);
  float amax = fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(b.x), fabsf(b.y)));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  const float factor = amax > 0.f ? amax / kE4m3Max : 1.f;  // an all-zero group quantises to zeros
  // Division (not a multiply by the reciprocal): the rounding transformers' act_quant uses.
  const float2 qa = make_float2(__fdiv_rn(a.x, factor), __fdiv_rn(a.y, factor));
  const float2 qb = make_float2(__fdiv_rn(b.x, factor), __fdiv_rn(b.y, factor));
  const __nv_fp8x2_storage_t pa = __nv_cvt_float2_to_fp8x2(qa, __NV_SATFINITE, __NV_E4M3);
  const __nv_fp8x2_storage_t pb = __nv_cvt_float2_to_fp8x2(qb, __NV_SATFINITE, __NV_E4M3);
  const uint32_t packed = static_cast<uint32_t>(pa) | (static_cast<uint32_t>(pb) << 16);
  *reinterpret_cast<uint32_t*>(q + row * groups * kGroup + column) = packed;
  if (lane == 0) factors[g * rows + row] = factor;
}

}  // namespace

void quantize_groups_e4m3(const void* x, int64_t stride, int64_t rows, int64_t k, void* q, float* factors,
                          cudaStream_t stream) {
  if (k % kGroup != 0 || stride % 4 != 0 || reinterpret_cast<uintptr_t>(x) % 8 != 0) {
    throw std::invalid_argument("quantize_groups_e4m3: k must be a multiple of 128 and rows 8-byte aligned");
  }
  const int64_t groups = k / kGroup;
  if (rows == 0) return;
  const int64_t blocks = (rows * groups + kGroupsPerBlock - 1) / kGroupsPerBlock;
  quantize_groups_kernel<<<static_cast<unsigned>(blocks), 32 * kGroupsPerBlock, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), stride, rows, groups, static_cast<__nv_fp8_storage_t*>(q), factors);
  check_cuda_launch("quantize_groups_e4m3");
}

}  // namespace dflash::target::kernels
