// The activation quantisation of the FP8 GEMMs: see fp8.h.
#include "target/kernels/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
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

// Eight elements per thread: 8 bytes of e4m3 in, 16 bytes of bf16 out, one factor.
__global__ void dequantize_blocks_kernel(const uint2* __restrict__ q, const float* __restrict__ factors, int64_t rows,
                                         int64_t cols, int64_t row_blocks, int64_t col_blocks, int64_t vectors,
                                         uint4* __restrict__ out) {
  const int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (v >= vectors) return;
  const int64_t element = v * 8, matrix = element / (rows * cols), within = element % (rows * cols);
  const int64_t row = within / cols, column = within % cols;
  const float factor = factors[(matrix * row_blocks + row / kGroup) * col_blocks + column / kGroup];
  const uint2 packed = q[v];
  const __nv_fp8x2_storage_t pairs[4] = {
      static_cast<__nv_fp8x2_storage_t>(packed.x & 0xffffu), static_cast<__nv_fp8x2_storage_t>(packed.x >> 16),
      static_cast<__nv_fp8x2_storage_t>(packed.y & 0xffffu), static_cast<__nv_fp8x2_storage_t>(packed.y >> 16)};
  __nv_bfloat162 result[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
    result[i] = __floats2bfloat162_rn(f.x * factor, f.y * factor);
  }
  out[v] = *reinterpret_cast<const uint4*>(result);
}

}  // namespace

void dequantize_blocks_bf16(const void* q, const float* factors, int64_t batches, int64_t rows, int64_t cols, void* out,
                            cudaStream_t stream) {
  if (cols % 8 != 0) throw std::invalid_argument("dequantize_blocks_bf16: cols must be a multiple of 8");
  const int64_t vectors = batches * rows * cols / 8;
  if (vectors == 0) return;
  constexpr int kThreads = 256;
  dequantize_blocks_kernel<<<static_cast<unsigned>((vectors + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
      static_cast<const uint2*>(q), factors, rows, cols, (rows + kGroup - 1) / kGroup, (cols + kGroup - 1) / kGroup,
      vectors, static_cast<uint4*>(out));
  check_cuda_launch("dequantize_blocks_bf16");
}

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
