// The top-p boundary search and the kept rows (top_p.h). A sort of 128 rows of a 248K vocabulary
// (what the composite expression does) takes about 5 ms on an H200; this reads each row ten times.
#include "target/kernels/top_p.h"

#include <cstdint>

namespace dflash::target::kernels {
namespace {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;
constexpr int kDigits = 16;  // candidates per pass: 4 bits of the boundary's bit pattern

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// The CTA's sum of x (every thread gets it); `scratch` holds kWarps floats.
__device__ __forceinline__ float block_sum(float x, float* scratch) {
  x = warp_sum(x);
  __syncthreads();  // scratch's last readers are done
  if ((threadIdx.x & 31) == 0) scratch[threadIdx.x >> 5] = x;
  __syncthreads();
  float total = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += scratch[w];
  return total;
}

__global__ void __launch_bounds__(kThreads)
    top_p_keep_kernel(const float* probs, float* out, int64_t vocab, float top_p) {
  const float* row = probs + static_cast<int64_t>(blockIdx.x) * vocab;
  float* out_row = out + static_cast<int64_t>(blockIdx.x) * vocab;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float masses[kWarps][kDigits];
  __shared__ float scratch[kWarps];
  __shared__ uint32_t boundary;
  __shared__ int warp_ties[kWarps];

  // The boundary tau: the largest value v with mass(p >= v) >= top_p, found 4 bits at a time from
  // bit 30 (the sign bit is 0). Pass by pass, candidate k is prefix | k << shift; the mass of the
  // tokens at or above each candidate decides the next 4 bits.
  uint32_t prefix = 0;
  for (int pass = 0; pass < 8; ++pass) {  // bits 30..27, 26..23, .., 6..3, then 2..0
    const int shift = pass < 7 ? 27 - 4 * pass : 0, width = pass < 7 ? 4 : 3;
    float mass[kDigits - 1];
#pragma unroll
    for (int k = 0; k < kDigits - 1; ++k) mass[k] = 0;
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
      const float p = row[i];
      const uint32_t bits = __float_as_uint(p);
      if (bits < prefix) continue;
#pragma unroll
      for (int k = 1; k < kDigits; ++k) mass[k - 1] += bits >= (prefix | static_cast<uint32_t>(k) << shift) ? p : 0.f;
    }
#pragma unroll
    for (int k = 0; k < kDigits - 1; ++k) {
      const float m = warp_sum(mass[k]);
      if (lane == 0) masses[warp][k] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
      uint32_t digit = 0;
      for (int k = (1 << width) - 1; k >= 1 && digit == 0; --k) {
        float m = 0;
        for (int w = 0; w < kWarps; ++w) m += masses[w][k - 1];
        if (m >= top_p) digit = static_cast<uint32_t>(k);
      }
      boundary = prefix | digit << shift;
    }
    __syncthreads();
    prefix = boundary;
  }
  const float tau = __uint_as_float(prefix);

  // The mass above tau and how many tokens equal it; the tied ones are kept, lowest index first,
  // while the mass before them is below top_p.
  float above = 0, ties = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kThreads) {
    const float p = row[i];
    above += p > tau ? p : 0.f;
    ties += p == tau ? 1.f : 0.f;
  }
  above = block_sum(above, scratch);
  const int64_t tied = static_cast<int64_t>(block_sum(ties, scratch));
  int64_t keep_tied = tied;
  if (tau > 0) {
    const float needed = ceilf((top_p - above) / tau);
    keep_tied = needed < 1 ? 1 : (needed < static_cast<float>(tied) ? static_cast<int64_t>(needed) : tied);
  }

  // The row in index order, 1,024 tokens at a time; each tied token's rank among the tied ones
  // before it from a ballot per warp and the warps' counts.
  int64_t tied_before = 0;
  for (int64_t base = 0; base < vocab; base += kThreads) {
    const int64_t i = base + threadIdx.x;
    const float p = i < vocab ? row[i] : 0.f;
    const bool tie = i < vocab && p == tau && tau > 0;
    const uint32_t ballot = __ballot_sync(0xffffffffu, tie);
    __syncthreads();  // warp_ties' last readers are done
    if (lane == 0) warp_ties[warp] = __popc(ballot);
    __syncthreads();
    int64_t rank = tied_before + __popc(ballot & ((1u << lane) - 1));
    int64_t chunk = 0;
    for (int w = 0; w < kWarps; ++w) {
      rank += w < warp ? warp_ties[w] : 0;
      chunk += warp_ties[w];
    }
    tied_before += chunk;
    const bool keep = tau > 0 ? (p > tau || (tie && rank < keep_tied)) : p > 0;
    if (i < vocab) out_row[i] = keep ? p : 0.f;
  }
}

}  // namespace

void top_p_keep(const float* probs, float* out, int rows, int64_t vocab, float top_p, cudaStream_t stream) {
  if (rows > 0) top_p_keep_kernel<<<rows, kThreads, 0, stream>>>(probs, out, vocab, top_p);
}

}  // namespace dflash::target::kernels
