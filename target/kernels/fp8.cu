// The activation quantisation of the FP8 GEMMs: see fp8.h.
#include "target/kernels/fp8.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <stdexcept>

#include "common/cuda_check.h"
#include "target/kernels/fp8_group.cuh"

namespace dflash::target::kernels {
namespace {

using fp8_group::kGroup;
constexpr int kQuantiseThreads = 256;

// Half a warp per 1x128 group: each lane loads its 8 consecutive elements (one 16-byte load) and
// the half-warp stores the group (fp8_group::store_e4m3). A group's 16 lanes return together.
// Row r reads x's row gather[r] / gather_divisor where a gather is given, else row r.
__global__ void __launch_bounds__(kQuantiseThreads)
    quantize_groups_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride, int64_t rows, int64_t groups,
                           const int64_t* __restrict__ gather, int64_t gather_divisor, fp8_group::Destination out) {
  const int64_t group = static_cast<int64_t>(blockIdx.x) * (kQuantiseThreads / fp8_group::kLanes) +
                        threadIdx.x / fp8_group::kLanes;
  if (group >= rows * groups) return;
  const int64_t row = group / groups, column = group % groups * kGroup + threadIdx.x % fp8_group::kLanes * 8;
  const int64_t source = gather != nullptr ? gather[row] / gather_divisor : row;
  float v[8];
  const uint4 raw = *reinterpret_cast<const uint4*>(x + source * stride + column);
  const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(pairs[i]);
    v[2 * i] = f.x, v[2 * i + 1] = f.y;
  }
  out.store(v, row, column, groups * kGroup);
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
                          int64_t factor_stride, cudaStream_t stream, const int64_t* gather, int64_t gather_divisor) {
  if (k % kGroup != 0 || stride % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || factor_stride < rows ||
      gather_divisor < 1) {
    throw std::invalid_argument(
        "quantize_groups_e4m3: k must be a multiple of 128, rows 16-byte aligned, factor_stride >= rows and "
        "gather_divisor >= 1");
  }
  const int64_t groups = k / kGroup;
  if (rows == 0) return;
  constexpr int kGroupsPerBlock = kQuantiseThreads / fp8_group::kLanes;
  const int64_t blocks = (rows * groups + kGroupsPerBlock - 1) / kGroupsPerBlock;
  quantize_groups_kernel<<<static_cast<unsigned>(blocks), kQuantiseThreads, 0, stream>>>(
      static_cast<const __nv_bfloat16*>(x), stride, rows, groups, gather, gather_divisor,
      fp8_group::Destination{static_cast<__nv_fp8_storage_t*>(q), factors, factor_stride});
  check_cuda_launch("quantize_groups_e4m3");
}

}  // namespace dflash::target::kernels
