// The target forward's fused element-wise kernels: see elementwise.h.
#include "target/kernels/elementwise.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "common/cuda_check.h"
#include "common/launch.h"
#include "target/kernels/fp8_group.cuh"
#include "target/kernels/warp_norm.cuh"
#include "target/kernels/gdn_gates.cuh"

namespace dflash::target::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf16x8::load8;
using bf16x8::round_bf16;
using bf16x8::store8;
using bf16x8::weighted_norm;
constexpr int kNormThreads = 256;

// One CTA per row, the row held in registers as bf16 (the sum is rounded to bf16 anyway): a
// thread's chunks of 8 are (threadIdx.x + i * kNormThreads) * 8, i < kChunks (rows up to kChunks *
// 2048 wide). Every load of the row, the delta and the weight is issued before the first is used
// (predicated, one basic block), then the (rounded) sum and its sum of squares are formed, and the
// normalised row is written from the registers: bf16 to normed_out, or (kFp8) quantised to e4m3
// for an FP8 GEMM (a half-warp holds 128 consecutive columns: one group). Loads issued together
// overlap; a chunk-by-chunk loop with a branch between chunks would wait on each in turn.
template <bool kFp8, int kChunks>
__global__ void __launch_bounds__(kNormThreads) add_rms_norm_kernel(const bf16* __restrict__ x,
                                                                    const bf16* __restrict__ delta,
                                                                    const bf16* __restrict__ weight,
                                                                    bf16* __restrict__ sum_out,
                                                                    bf16* __restrict__ normed_out,
                                                                    fp8_group::Destination fp8, int n, float eps,
                                                                    bool zero_centred) {
  barriers::start_as_dependent();
  const int64_t base = static_cast<int64_t>(blockIdx.x) * n;
  auto column = [&](int i) { return (static_cast<int>(threadIdx.x) + i * kNormThreads) * 8; };
  auto load = [](const bf16* p) { return *reinterpret_cast<const uint4*>(p); };
  uint4 row[kChunks], add[kChunks], w[kChunks];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (column(i) < n) row[i] = load(x + base + column(i)), w[i] = load(weight + column(i));
  }
  if (delta != nullptr) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      if (column(i) < n) add[i] = load(delta + base + column(i));
    }
  }
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (column(i) >= n) continue;
    float v[8];
    bf16x8::unpack8(v, row[i]);
    if (delta != nullptr) {
      float d[8];
      bf16x8::unpack8(d, add[i]);
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = round_bf16(v[j] + d[j]);
      row[i] = bf16x8::pack8(v);
      *reinterpret_cast<uint4*>(sum_out + base + column(i)) = row[i];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += v[j] * v[j];
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, off);
  __shared__ float warps[kNormThreads / 32];
  if ((threadIdx.x & 31) == 0) warps[threadIdx.x >> 5] = squares;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int k = 0; k < kNormThreads / 32; ++k) total += warps[k];
  const float r = rsqrtf(total / static_cast<float>(n) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    if (column(i) >= n) continue;  // n % 128 == 0 for FP8: whole half-warps agree
    float v[8], g[8];
    bf16x8::unpack8(v, row[i]);
    bf16x8::unpack8(g, w[i]);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = weighted_norm(v[j] * r, g[j], zero_centred);
    if constexpr (kFp8) {
      fp8.store(v, blockIdx.x, column(i), n);
    } else {
      store8(normed_out + base + column(i), v);
    }
  }
}

// The smallest instantiation that holds a row of n.
template <bool kFp8>
void launch_add_rms_norm(int rows, int n, cudaStream_t stream, const bf16* x, const bf16* delta, const bf16* weight,
                         bf16* sum_out, bf16* normed_out, fp8_group::Destination fp8, float eps, bool zero_centred) {
  const int chunks = (n / 8 + kNormThreads - 1) / kNormThreads;
  if (chunks > 8) throw std::invalid_argument("add_rms_norm: rows of at most 16384 elements, got " + std::to_string(n));
  const auto kernel = chunks <= 2 ? add_rms_norm_kernel<kFp8, 2>
                      : chunks <= 4 ? add_rms_norm_kernel<kFp8, 4>
                                    : add_rms_norm_kernel<kFp8, 8>;
  check_cuda(launch_dependent(kernel, dim3(rows), kNormThreads, 0, stream, x, delta, weight, sum_out, normed_out,
                              fp8, n, eps, zero_centred),
             "target kernel add_rms_norm");
}

// Rows of n (a multiple of 8) elements: gate and up rows at a common stride, out contiguous, or
// (kFp8, n a multiple of 128) quantised to e4m3. A CTA takes kSiluThreads chunks of 8 elements of
// one row (blockIdx.x, so any number of rows), blockIdx.y the chunks' place in the row: no index
// division (a 64-bit division per chunk costs more instructions than its element-wise work). The
// 16 chunks of a half-warp are one 128-wide group, as kSiluThreads is a multiple of 16 chunks.
// SiLU's quotient by the fast division (2 ulp in fp32 before the bf16 rounding; the bf16 and FP8
// variants share it, so the FP8 rows are the bf16 rows quantised).
constexpr int kSiluThreads = 128;

template <bool kFp8>
__global__ void __launch_bounds__(kSiluThreads) silu_mul_kernel(const bf16* __restrict__ gate,
                                                                const bf16* __restrict__ up, int64_t stride,
                                                                bf16* __restrict__ out, fp8_group::Destination fp8,
                                                                int row_chunks) {
  const int chunk = blockIdx.y * kSiluThreads + threadIdx.x;
  if (chunk >= row_chunks) return;  // whole half-warps when row_chunks is a multiple of 16
  const int64_t row = blockIdx.x, in = row * stride + chunk * 8;
  float g[8], u[8];
  load8(g, gate + in);
  load8(u, up + in);
#pragma unroll
  for (int j = 0; j < 8; ++j) g[j] = bf16x8::silu_times(g[j], u[j]);
  if constexpr (kFp8) {
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = round_bf16(g[j]);
    fp8.store(g, row, chunk * 8, static_cast<int64_t>(row_chunks) * 8);
  } else {
    store8(out + (row * row_chunks + chunk) * 8, g);
  }
}

dim3 silu_mul_grid(int64_t rows, int64_t n) {
  if (rows > 0x7fffffff) throw std::invalid_argument("silu_mul: more than 2^31 - 1 rows");
  return dim3(static_cast<unsigned>(rows), static_cast<unsigned>((n / 8 + kSiluThreads - 1) / kSiluThreads));
}

constexpr int kRowThreads = 256;  // one warp per row of qk_norm_rope

// One warp per (token, head) row, q's rows first, then k's; lane l holds elements [8l, 8l + 8).
// RoPE's partner of element i < rotary is i + rotary/2 (first half) or i - rotary/2, i.e. lane
// l +- rotary/16.
__global__ void __launch_bounds__(kRowThreads) qk_norm_rope_kernel(QkRows q, QkRows k, int tokens, int d,
                                                                   const bf16* __restrict__ cos,
                                                                   const bf16* __restrict__ sin, int rotary, float eps,
                                                                   bool zero_centred) {
  barriers::start_as_dependent();
  int row = blockIdx.x * (kRowThreads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31, q_rows = tokens * q.heads;
  if (row >= q_rows + tokens * k.heads) return;  // whole warps
  const QkRows job = row < q_rows ? q : k;
  if (row >= q_rows) row -= q_rows;
  const int token = row / job.heads, head = row % job.heads, c = lane * 8;
  const bool active = c < d;
  float v[8] = {};
  if (active) load8(v, static_cast<const bf16*>(job.x) + token * job.token_stride + head * job.head_stride + c);
  const float r = warp_rms_factor(v, d, eps);
  float w[8] = {};
  if (active) load8(w, static_cast<const bf16*>(job.weight) + c);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = weighted_norm(v[j] * r, w[j], zero_centred);
  const int shift = rotary / 16;
  const bool rotated = c < rotary, first_half = lane < shift;
  const int partner = rotated ? (first_half ? lane + shift : lane - shift) : lane;
  float other[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) other[j] = __shfl_sync(0xffffffffu, v[j], partner);
  if (rotated) {
    float cs[8], sn[8];
    load8(cs, cos + static_cast<int64_t>(token) * rotary + c);
    load8(sn, sin + static_cast<int64_t>(token) * rotary + c);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float half = first_half ? -other[j] : other[j];
      v[j] = round_bf16(round_bf16(v[j] * cs[j]) + round_bf16(half * sn[j]));
    }
  }
  if (active) store8(static_cast<bf16*>(job.out) + static_cast<int64_t>(row) * d + c, v);
}

// Eight values a thread, grid-stride: `rows` gated into `out` (the same rows: in place), or with
// kFp8 into o_proj's FP8 input, quantised as they are written (heads * d a multiple of 128: a
// group's 16 chunks are 16 consecutive threads, and every half-warp leaves the loop together).
template <bool kFp8>
__global__ void sigmoid_gate_kernel(const bf16* rows, bf16* out, const bf16* __restrict__ gate, int64_t token_stride,
                                    int64_t head_stride, int heads, int d, int64_t chunks, fp8_group::Destination fp8) {
  barriers::start_as_dependent();
  const int per_token = heads * d / 8;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t token = i / per_token;
    const int within = static_cast<int>(i % per_token) * 8, head = within / d, col = within % d;
    float o[8], g[8];
    load8(o, rows + i * 8);
    load8(g, gate + token * token_stride + static_cast<int64_t>(head) * head_stride + col);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = bf16x8::sigmoid_gated(o[j], g[j]);
    if constexpr (kFp8) {
#pragma unroll
      for (int j = 0; j < 8; ++j) o[j] = round_bf16(o[j]);
      fp8.store(o, token, within, static_cast<int64_t>(per_token) * 8);
    } else {
      store8(out + i * 8, o);
    }
  }
}

// One warp per (token, head) row of gated_rms_norm; lane l holds elements [8l, 8l + 8).
__global__ void __launch_bounds__(kRowThreads) gated_rms_norm_kernel(const float* __restrict__ o,
                                                                     const bf16* __restrict__ z, int64_t token_stride,
                                                                     int64_t head_stride, const bf16* __restrict__ weight,
                                                                     bf16* __restrict__ out, int rows, int heads, int d,
                                                                     float eps) {
  barriers::start_as_dependent();
  const int row = blockIdx.x * (kRowThreads / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (row >= rows) return;  // whole warps
  const int token = row / heads, head = row % heads, c = lane * 8;
  const bool active = c < d;
  float v[8] = {};
  if (active) load_floats8(v, o + static_cast<int64_t>(row) * d + c);
  const float r = warp_rms_factor(v, d, eps);
  if (!active) return;
  float w[8], g[8];
  load8(w, weight + c);
  load8(g, z + token * token_stride + head * head_stride + c);
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = gated_rms_value(v[j], r, w[j], g[j]);
  store8(out + static_cast<int64_t>(row) * d + c, v);
}

// A thread per 8 values: one 16-byte load, two 16-byte stores.
__global__ void widen_bf16_kernel(const uint4* __restrict__ x, float4* __restrict__ out, int64_t chunks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float v[8];
    bf16x8::unpack8(v, x[i]);
    out[2 * i] = make_float4(v[0], v[1], v[2], v[3]);
    out[2 * i + 1] = make_float4(v[4], v[5], v[6], v[7]);
  }
}

// One thread per (token, head).
__global__ void gdn_gates_kernel(const bf16* __restrict__ a, int64_t a_stride, const bf16* __restrict__ b,
                                 int64_t b_stride, const float* __restrict__ a_log, const float* __restrict__ dt_bias,
                                 float* __restrict__ g, float* __restrict__ beta, int heads, int64_t count) {
  barriers::start_as_dependent();
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    gdn_gates_at(i, a, a_stride, b, b_stride, a_log, dt_bias, heads, g, beta);
  }
}

}  // namespace

void add_rms_norm(const void* x, const void* delta, const void* weight, void* sum_out, void* normed_out, int rows, int n,
                  float eps, bool zero_centred, cudaStream_t stream) {
  if (rows == 0) return;
  launch_add_rms_norm<false>(rows, n, stream, static_cast<const bf16*>(x), static_cast<const bf16*>(delta),
                             static_cast<const bf16*>(weight), static_cast<bf16*>(sum_out),
                             static_cast<bf16*>(normed_out), {}, eps, zero_centred);
  check_cuda_launch("target kernel add_rms_norm");
}

void add_rms_norm_e4m3(const void* x, const void* delta, const void* weight, void* sum_out, int rows, int n, float eps,
                       bool zero_centred, void* q, float* factors, int64_t factor_stride, cudaStream_t stream) {
  if (n % fp8_group::kGroup != 0 || factor_stride < rows) {
    throw std::invalid_argument("add_rms_norm_e4m3: rows must be whole 128-wide groups, got " + std::to_string(n));
  }
  if (rows == 0) return;
  launch_add_rms_norm<true>(rows, n, stream, static_cast<const bf16*>(x), static_cast<const bf16*>(delta),
                            static_cast<const bf16*>(weight), static_cast<bf16*>(sum_out), nullptr,
                            fp8_group::Destination{static_cast<__nv_fp8_storage_t*>(q), factors, factor_stride}, eps,
                            zero_centred);
  check_cuda_launch("target kernel add_rms_norm_e4m3");
}

void silu_mul(const void* gate, const void* up, int64_t stride, void* out, int64_t rows, int64_t n, cudaStream_t stream) {
  if (rows == 0 || n == 0) return;
  silu_mul_kernel<false><<<silu_mul_grid(rows, n), kSiluThreads, 0, stream>>>(
      static_cast<const bf16*>(gate), static_cast<const bf16*>(up), stride, static_cast<bf16*>(out), {},
      static_cast<int>(n / 8));
  check_cuda_launch("target kernel silu_mul");
}

void silu_mul_e4m3(const void* gate, const void* up, int64_t stride, int64_t rows, int64_t n, void* q, float* factors,
                   int64_t factor_stride, cudaStream_t stream) {
  if (n % fp8_group::kGroup != 0 || factor_stride < rows) {
    throw std::invalid_argument("silu_mul_e4m3: rows must be whole 128-wide groups, got " + std::to_string(n));
  }
  if (rows == 0 || n == 0) return;
  silu_mul_kernel<true><<<silu_mul_grid(rows, n), kSiluThreads, 0, stream>>>(
      static_cast<const bf16*>(gate), static_cast<const bf16*>(up), stride, nullptr,
      fp8_group::Destination{static_cast<__nv_fp8_storage_t*>(q), factors, factor_stride}, static_cast<int>(n / 8));
  check_cuda_launch("target kernel silu_mul_e4m3");
}

void qk_norm_rope(const QkRows& q, const QkRows& k, int tokens, int d, const void* cos, const void* sin, int rotary,
                  float eps, bool zero_centred, cudaStream_t stream) {
  if (d > 256 || d % 8 != 0 || rotary % 16 != 0 || rotary > d) {
    throw std::invalid_argument("qk_norm_rope: needs head size <= 256 and a multiple of 8, rotary dims a multiple of 16");
  }
  const int rows = tokens * (q.heads + k.heads);
  if (rows == 0) return;
  const int per_cta = kRowThreads / 32;
  check_cuda(launch_dependent(qk_norm_rope_kernel, dim3((rows + per_cta - 1) / per_cta), kRowThreads, 0, stream, q, k,
                              tokens, d, static_cast<const bf16*>(cos), static_cast<const bf16*>(sin), rotary, eps,
                              zero_centred),
             "target kernel qk_norm_rope");
}

void sigmoid_gate(void* out, const void* gate, int64_t token_stride, int64_t head_stride, int tokens, int heads, int d,
                  cudaStream_t stream) {
  if (d % 8 != 0) throw std::invalid_argument("sigmoid_gate: needs a head size that is a multiple of 8");
  const int64_t chunks = static_cast<int64_t>(tokens) * heads * d / 8;
  if (chunks == 0) return;
  const int threads = 256;
  check_cuda(launch_dependent(sigmoid_gate_kernel<false>, dim3(grid_stride_blocks(chunks, threads)), threads, 0, stream,
                              static_cast<const bf16*>(out), static_cast<bf16*>(out), static_cast<const bf16*>(gate),
                              token_stride, head_stride, heads, d, chunks, fp8_group::Destination{}),
             "target kernel sigmoid_gate");
}

void sigmoid_gate_e4m3(const void* out, const void* gate, int64_t token_stride, int64_t head_stride, int tokens,
                       int heads, int d, void* q, float* factors, int64_t factor_stride, cudaStream_t stream) {
  if (d % 8 != 0 || static_cast<int64_t>(heads) * d % fp8_group::kGroup != 0 || factor_stride < tokens) {
    throw std::invalid_argument("sigmoid_gate_e4m3: rows must be whole 128-wide groups, got " + std::to_string(heads) +
                                " heads of " + std::to_string(d));
  }
  const int64_t chunks = static_cast<int64_t>(tokens) * heads * d / 8;
  if (chunks == 0) return;
  const int threads = 256;
  check_cuda(launch_dependent(sigmoid_gate_kernel<true>, dim3(grid_stride_blocks(chunks, threads)), threads, 0, stream,
                              static_cast<const bf16*>(out), nullptr, static_cast<const bf16*>(gate), token_stride,
                              head_stride, heads, d, chunks,
                              fp8_group::Destination{static_cast<__nv_fp8_storage_t*>(q), factors, factor_stride}),
             "target kernel sigmoid_gate_e4m3");
}

void gated_rms_norm(const float* o, const void* z, int64_t token_stride, int64_t head_stride, const void* weight,
                    void* out, int tokens, int heads, int d, float eps, cudaStream_t stream) {
  if (d > 256 || d % 8 != 0) throw std::invalid_argument("gated_rms_norm: needs a head size <= 256 and a multiple of 8");
  const int rows = tokens * heads;
  if (rows == 0) return;
  const int per_cta = kRowThreads / 32;
  check_cuda(launch_dependent(gated_rms_norm_kernel, dim3((rows + per_cta - 1) / per_cta), kRowThreads, 0, stream, o,
                              static_cast<const bf16*>(z), token_stride, head_stride, static_cast<const bf16*>(weight),
                              static_cast<bf16*>(out), rows, heads, d, eps),
             "target kernel gated_rms_norm");
}

void widen_bf16(const void* x, float* out, int64_t n, cudaStream_t stream) {
  if (n % 8 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 || reinterpret_cast<uintptr_t>(out) % 16 != 0) {
    throw std::invalid_argument("widen_bf16: needs a multiple of 8 values, 16-byte aligned");
  }
  const int64_t chunks = n / 8;
  if (chunks == 0) return;
  const int threads = 256;
  widen_bf16_kernel<<<grid_stride_blocks(chunks, threads), threads, 0, stream>>>(
      static_cast<const uint4*>(x), reinterpret_cast<float4*>(out), chunks);
  check_cuda_launch("target kernel widen_bf16");
}

void gdn_gates(const void* a, int64_t a_stride, const void* b, int64_t b_stride, const float* a_log,
               const float* dt_bias, float* g, float* beta, int tokens, int heads, cudaStream_t stream) {
  const int64_t count = static_cast<int64_t>(tokens) * heads;
  if (count == 0) return;
  const int threads = 256;
  check_cuda(launch_dependent(gdn_gates_kernel, dim3(grid_stride_blocks(count, threads)), threads, 0, stream,
                              static_cast<const bf16*>(a), a_stride, static_cast<const bf16*>(b), b_stride, a_log,
                              dt_bias, g, beta, heads, count),
             "target kernel gdn_gates");
}

}  // namespace dflash::target::kernels
