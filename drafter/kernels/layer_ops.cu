// The drafter layers' element-wise kernels: see layer_ops.h.
#include "drafter/kernels/layer_ops.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "common/bf16x8.cuh"
#include "common/cuda_check.h"

namespace dflash::drafter::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf16x8::load8;
using bf16x8::round_bf16;
using bf16x8::store8;

constexpr int kThreads = 256;

// Sum over the kLanes lanes that share a row (aligned groups within the warp).
template <int kLanes>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// kLanes lanes per row, each taking every kLanes-th 8-element chunk of it.
template <int kLanes>
__global__ void __launch_bounds__(kThreads) forward_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                          bf16* __restrict__ y, float* __restrict__ rstd,
                                                          int64_t rows, int n, float eps) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  const int sub = threadIdx.x % kLanes, chunks = n / 8;
  const bool active = row < rows;  // no early return: the shuffles need every lane
  const bf16* xr = x + row * n;
  float squares = 0.f;
  for (int c = sub; active && c < chunks; c += kLanes) {
    float v[8];
    load8(v, xr + 8 * c);
#pragma unroll
    for (int j = 0; j < 8; ++j) squares += v[j] * v[j];
  }
  const float r = rsqrtf(group_sum<kLanes>(squares) / n + eps);
  if (!active) return;
  if (sub == 0) rstd[row] = r;
  for (int c = sub; c < chunks; c += kLanes) {
    float v[8], g[8];
    load8(v, xr + 8 * c);
    load8(g, w + 8 * c);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = g[j] * round_bf16(v[j] * r);
    store8(y + row * n + 8 * c, v);
  }
}

template <int kLanes>
__global__ void __launch_bounds__(kThreads) backward_input_kernel(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                                                 const bf16* __restrict__ dy,
                                                                 const float* __restrict__ rstd, bf16* __restrict__ dx,
                                                                 int64_t rows, int n) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x) / kLanes;
  const int sub = threadIdx.x % kLanes, chunks = n / 8;
  const bool active = row < rows;
  const bf16* xr = x + row * n;
  const bf16* dyr = dy + row * n;
  float dot = 0.f;  // sum_j g_j x_j
  for (int c = sub; active && c < chunks; c += kLanes) {
    float v[8], d[8], g[8];
    load8(v, xr + 8 * c);
    load8(d, dyr + 8 * c);
    load8(g, w + 8 * c);
#pragma unroll
    for (int j = 0; j < 8; ++j) dot += round_bf16(d[j] * g[j]) * v[j];
  }
  dot = group_sum<kLanes>(dot);
  if (!active) return;
  const float r = rstd[row], k = r * r * r * dot / n;
  for (int c = sub; c < chunks; c += kLanes) {
    float v[8], d[8], g[8];
    load8(v, xr + 8 * c);
    load8(d, dyr + 8 * c);
    load8(g, w + 8 * c);
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = r * round_bf16(d[j] * g[j]) - v[j] * k;
    store8(dx + row * n + 8 * c, v);
  }
}

// Threads of a CTA: kWeightThreads / lanes rows at a time, `lanes` = min(chunks, 128) column
// chunks each (grid.x covers the rest of the columns); grid.y parts of the rows. A thread's 8
// sums go to partial[(part * row_lanes + its row lane)][its columns].
constexpr int kWeightThreads = 128;
constexpr int kMaxParts = 512;

struct WeightGrid {
  int lanes, row_lanes, column_blocks, parts;
  int64_t rows_per_part;
};

WeightGrid weight_grid(int64_t rows, int n) {
  WeightGrid g;
  const int chunks = n / 8;
  g.lanes = std::min(chunks, kWeightThreads);
  g.row_lanes = kWeightThreads / g.lanes;
  g.column_blocks = (chunks + g.lanes - 1) / g.lanes;
  const int64_t row_groups = (rows + g.row_lanes - 1) / g.row_lanes;
  g.parts = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(row_groups, std::max(1, 4 * 132 / g.column_blocks))));
  g.parts = std::min(g.parts, kMaxParts);
  g.rows_per_part = (row_groups + g.parts - 1) / g.parts * g.row_lanes;
  return g;
}

__global__ void __launch_bounds__(kWeightThreads) backward_weight_kernel(const bf16* __restrict__ x,
                                                                        const bf16* __restrict__ dy,
                                                                        const float* __restrict__ rstd,
                                                                        float* __restrict__ partial, int64_t rows,
                                                                        int n, WeightGrid g) {
  const int lane = threadIdx.x % g.lanes, row_lane = threadIdx.x / g.lanes;
  const int chunk = blockIdx.x * g.lanes + lane;
  if (row_lane >= g.row_lanes || chunk >= n / 8) return;
  const int64_t first = blockIdx.y * g.rows_per_part, last = min(first + g.rows_per_part, rows);
  float sum[8] = {};
  for (int64_t row = first + row_lane; row < last; row += g.row_lanes) {
    float v[8], d[8];
    load8(v, x + row * n + 8 * chunk);
    load8(d, dy + row * n + 8 * chunk);
    const float r = rstd[row];
#pragma unroll
    for (int j = 0; j < 8; ++j) sum[j] += d[j] * round_bf16(v[j] * r);
  }
  float* out = partial + (static_cast<int64_t>(blockIdx.y) * g.row_lanes + row_lane) * n + 8 * chunk;
#pragma unroll
  for (int j = 0; j < 8; ++j) out[j] = sum[j];
}

int lanes_per_row(int n) {
  if (!rms_norm_supports(n)) {
    throw std::invalid_argument("rms_norm kernels: row length " + std::to_string(n) +
                                " is not a multiple of 8 with n / 8 >= 32 or a power of two");
  }
  return std::min(n / 8, 32);
}

template <typename Launch>
void dispatch_lanes(int n, Launch launch) {
  switch (lanes_per_row(n)) {
    case 1: launch(std::integral_constant<int, 1>{}); break;
    case 2: launch(std::integral_constant<int, 2>{}); break;
    case 4: launch(std::integral_constant<int, 4>{}); break;
    case 8: launch(std::integral_constant<int, 8>{}); break;
    case 16: launch(std::integral_constant<int, 16>{}); break;
    default: launch(std::integral_constant<int, 32>{}); break;
  }
}

__global__ void __launch_bounds__(kThreads) silu_mul_forward_kernel(const bf16* __restrict__ gate,
                                                                   const bf16* __restrict__ up, bf16* __restrict__ y,
                                                                   int64_t chunks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float g[8], u[8];
    load8(g, gate + 8 * i);
    load8(u, up + 8 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) g[j] = round_bf16(g[j] / (1.f + __expf(-g[j]))) * u[j];
    store8(y + 8 * i, g);
  }
}

__global__ void __launch_bounds__(kThreads) silu_mul_backward_kernel(const bf16* __restrict__ gate,
                                                                    const bf16* __restrict__ up,
                                                                    const bf16* __restrict__ dy, bf16* __restrict__ d_gate,
                                                                    bf16* __restrict__ d_up, int64_t chunks) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < chunks;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    float g[8], u[8], d[8], dg[8], du[8];
    load8(g, gate + 8 * i);
    load8(u, up + 8 * i);
    load8(d, dy + 8 * i);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const float s = 1.f / (1.f + __expf(-g[j]));
      du[j] = d[j] * round_bf16(g[j] * s);
      dg[j] = round_bf16(d[j] * u[j]) * (s * (1.f + g[j] * (1.f - s)));
    }
    store8(d_gate + 8 * i, dg);
    store8(d_up + 8 * i, du);
  }
}

// The rotary embedding over rows of d (heads of a token, `heads` rows per table row): a thread
// takes 8 columns c.. of the first half and their partners c + d/2.. of the second, the pair that
// rotate_half exchanges. kBackward: dx from dy instead of y from x (layer_ops.h).
template <bool kBackward>
__global__ void __launch_bounds__(kThreads) rope_kernel(const bf16* __restrict__ in, const bf16* __restrict__ cos,
                                                        const bf16* __restrict__ sin, bf16* __restrict__ out,
                                                        int64_t pairs, int heads, int d) {
  const int half_chunks = d / 16;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < pairs;
       i += static_cast<int64_t>(gridDim.x) * kThreads) {
    const int64_t row = i / half_chunks;                   // (token, head)
    const int first = static_cast<int>(i % half_chunks) * 8, second = first + d / 2;
    const int64_t table = row / heads * d;                 // the token's cos / sin row
    float a[8], b[8], ca[8], cb[8], sa[8], sb[8];
    load8(a, in + row * d + first);
    load8(b, in + row * d + second);
    load8(ca, cos + table + first);
    load8(cb, cos + table + second);
    load8(sa, sin + table + first);
    load8(sb, sin + table + second);
    float ya[8], yb[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if constexpr (kBackward) {
        // x's first half got dy cos and, through rotate_half, +dy sin of the second half; its
        // second half dy cos and -dy sin of the first (each product rounded, then one sum).
        ya[j] = round_bf16(a[j] * ca[j]) + round_bf16(b[j] * sb[j]);
        yb[j] = round_bf16(b[j] * cb[j]) - round_bf16(a[j] * sa[j]);
      } else {
        // x cos + rotate_half(x) sin, rotate_half(x) = [-x2, x1].
        ya[j] = round_bf16(a[j] * ca[j]) + round_bf16(-b[j] * sa[j]);
        yb[j] = round_bf16(b[j] * cb[j]) + round_bf16(a[j] * sb[j]);
      }
    }
    store8(out + row * d + first, ya);
    store8(out + row * d + second, yb);
  }
}

unsigned row_blocks(int64_t rows, int lanes) {
  return static_cast<unsigned>((rows * lanes + kThreads - 1) / kThreads);
}

}  // namespace

bool rms_norm_supports(int64_t n) {
  const int64_t chunks = n / 8;
  return n > 0 && n % 8 == 0 && n <= (int64_t{1} << 30) && (chunks >= 32 || (chunks & (chunks - 1)) == 0);
}

void rms_norm_forward(const void* x, const void* weight, void* y, float* rstd, int64_t rows, int n, float eps,
                      cudaStream_t stream) {
  if (rows == 0) return;
  dispatch_lanes(n, [&](auto lanes) {
    forward_kernel<lanes.value><<<row_blocks(rows, lanes.value), kThreads, 0, stream>>>(
        static_cast<const bf16*>(x), static_cast<const bf16*>(weight), static_cast<bf16*>(y), rstd, rows, n, eps);
  });
  check_cuda_launch("drafter kernel rms_norm_forward");
}

void rms_norm_backward_input(const void* x, const void* weight, const void* dy, const float* rstd, void* dx,
                             int64_t rows, int n, cudaStream_t stream) {
  if (rows == 0) return;
  dispatch_lanes(n, [&](auto lanes) {
    backward_input_kernel<lanes.value><<<row_blocks(rows, lanes.value), kThreads, 0, stream>>>(
        static_cast<const bf16*>(x), static_cast<const bf16*>(weight), static_cast<const bf16*>(dy), rstd,
        static_cast<bf16*>(dx), rows, n);
  });
  check_cuda_launch("drafter kernel rms_norm_backward_input");
}

int64_t rms_norm_weight_parts(int64_t rows, int n) {
  lanes_per_row(n);  // validates n
  const WeightGrid g = weight_grid(rows, n);
  return static_cast<int64_t>(g.parts) * g.row_lanes;
}

void rms_norm_backward_weight(const void* x, const void* dy, const float* rstd, float* partial, int64_t rows, int n,
                              cudaStream_t stream) {
  lanes_per_row(n);
  const WeightGrid g = weight_grid(rows, n);
  backward_weight_kernel<<<dim3(g.column_blocks, g.parts), kWeightThreads, 0, stream>>>(
      static_cast<const bf16*>(x), static_cast<const bf16*>(dy), rstd, partial, rows, n, g);
  check_cuda_launch("drafter kernel rms_norm_backward_weight");
}

void silu_mul_forward(const void* gate, const void* up, void* y, int64_t elements, cudaStream_t stream) {
  const int64_t chunks = elements / 8;
  if (chunks == 0) return;
  silu_mul_forward_kernel<<<grid_stride_blocks(chunks, kThreads), kThreads, 0, stream>>>(
      static_cast<const bf16*>(gate), static_cast<const bf16*>(up), static_cast<bf16*>(y), chunks);
  check_cuda_launch("drafter kernel silu_mul_forward");
}

void silu_mul_backward(const void* gate, const void* up, const void* dy, void* d_gate, void* d_up, int64_t elements,
                       cudaStream_t stream) {
  const int64_t chunks = elements / 8;
  if (chunks == 0) return;
  silu_mul_backward_kernel<<<grid_stride_blocks(chunks, kThreads), kThreads, 0, stream>>>(
      static_cast<const bf16*>(gate), static_cast<const bf16*>(up), static_cast<const bf16*>(dy),
      static_cast<bf16*>(d_gate), static_cast<bf16*>(d_up), chunks);
  check_cuda_launch("drafter kernel silu_mul_backward");
}

bool rope_supports(int64_t d) { return d > 0 && d % 16 == 0; }

namespace {

template <bool kBackward>
void launch_rope(const void* in, const void* cos, const void* sin, void* out, int64_t rows, int heads, int d,
                 cudaStream_t stream, const char* name) {
  if (!rope_supports(d) || heads < 1) {
    throw std::invalid_argument(std::string(name) + ": needs d a multiple of 16 and at least one head, got d " +
                                std::to_string(d) + ", " + std::to_string(heads) + " heads");
  }
  const int64_t pairs = rows * heads * (d / 16);
  if (pairs == 0) return;
  rope_kernel<kBackward><<<grid_stride_blocks(pairs, kThreads), kThreads, 0, stream>>>(
      static_cast<const bf16*>(in), static_cast<const bf16*>(cos), static_cast<const bf16*>(sin),
      static_cast<bf16*>(out), pairs, heads, d);
  check_cuda_launch(name);
}

}  // namespace

void rope_forward(const void* x, const void* cos, const void* sin, void* y, int64_t rows, int heads, int d,
                  cudaStream_t stream) {
  launch_rope<false>(x, cos, sin, y, rows, heads, d, stream, "drafter kernel rope_forward");
}

void rope_backward(const void* dy, const void* cos, const void* sin, void* dx, int64_t rows, int heads, int d,
                   cudaStream_t stream) {
  launch_rope<true>(dy, cos, sin, dx, rows, heads, d, stream, "drafter kernel rope_backward");
}

}  // namespace dflash::drafter::kernels
