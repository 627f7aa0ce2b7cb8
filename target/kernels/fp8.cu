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

constexpr int kGroup = 128;          // elements per factor
constexpr int kLanesPerGroup = 16;   // 8 elements (16 bytes of bf16) per lane
constexpr int kQuantiseThreads = 256;
constexpr float kE4m3Max = 448.f;

// Half a warp per 1x128 group: each lane holds 8 consecutive elements (one 16-byte load), the
// half-warp's max |x| sets the factor, each lane writes its 8 bytes of e4m3. Lanes past the last
// group still take part in the shuffles (no early return) and store nothing.
__global__ void __launch_bounds__(kQuantiseThreads)
    quantize_groups_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride, int64_t rows, int64_t groups,
                           __nv_fp8_storage_t* __restrict__ q, float* __restrict__ factors, int64_t factor_stride) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * (kQuantiseThreads / kLanesPerGroup) +
                        threadIdx.x / kLanesPerGroup;
  const bool valid = group < rows * groups;
  const int lane = threadIdx.x % kLanesPerGroup;
  const int64_t row = valid ? group / groups : 0, g = valid ? group % groups : 0;
  const int64_t column = g * kGroup + lane * 8;
  float v[8];
  if (valid) {
    const uint4 raw = *reinterpret_cast<const uint4*>(x + row * stride + column);
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = __bfloat1622float2(pairs[i]);
      v[2 * i] = f.x, v[2 * i + 1] = f.y;
    }
  } else {
#pragma unroll
    for (int i = 0; i < 8; ++i) v[i] = 0.f;
  }
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int off = kLanesPerGroup / 2; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
  if (!valid) return;
  const float factor = amax > 0.f ? amax / kE4m3Max : 1.f;  // an all-zero group quantises to zeros
  // Division (not a multiply by the reciprocal): the rounding transformers' act_quant uses.
  uint32_t packed[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const float2 a = make_float2(__fdiv_rn(v[4 * half], factor), __fdiv_rn(v[4 * half + 1], factor));
    const float2 b = make_float2(__fdiv_rn(v[4 * half + 2], factor), __fdiv_rn(v[4 * half + 3], factor));
    packed[half] = static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(a, __NV_SATFINITE, __NV_E4M3)) |
                   (static_cast<uint32_t>(__nv_cvt_float2_to_fp8x2(b, __NV_SATFINITE, __NV_E4M3)) << 16);
  }
  *reinterpret_cast<uint2*>(q + row * groups * kGroup + column) = make_uint2(packed[0], packed[1]);
  if (lane == 0) factors[g * factor_stride + row] = factor;
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
                          int64_t factor_stride, cudaStream_t stream) {
  if (k % kGroup != 0 || stride % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || factor_stride < rows) {
    throw std::invalid_argument("quantize_groups_e4m3: k must be a multiple of 128 and rows 16-byte aligned");
  }
  const int64_t groups = k / kGroup;
  if (rows == 0) return;
  constexpr int kGroupsPerBlock = kQuantiseThreads / kLanesPerGroup;
  const int64_t blocks = (rows * groups + kGroupsPerBlock - 1) / kGroupsPerBlock;
  quantize_groups_kernel<<<static_cast<unsigned>(blocks), kQuantiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), stride, rows, groups, static_cast<__nv_fp8_storage_t*>(q), factors,
      factor_stride);
  check_cuda_launch("quantize_groups_e4m3");
}

}  // namespace dflash::target::kernels
