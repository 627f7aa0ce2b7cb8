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

// f(p) for each entry of a row, each thread its own entries in a fixed order (the sums formed from
// them do not depend on the run). A row of a multiple of 4 entries is read as float4, four loads in
// flight per thread: one float per thread kept 4 KB in flight per SM, and each pass over a row
// waited on the memory's latency, not its rate.
template <typename F>
__device__ __forceinline__ void for_each_entry(const float* row, int64_t vocab, F&& f) {
  if (vocab % 4 != 0) {
    for (int64_t i = threadIdx.x; i < vocab; i += kThreads) f(row[i]);
    return;
  }
  const float4* row4 = reinterpret_cast<const float4*>(row);
  const int64_t quads = vocab / 4;
  int64_t i = threadIdx.x;
  for (; i + 3 * kThreads < quads; i += 4 * kThreads) {
    float4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = row4[i + u * kThreads];
#pragma unroll
    for (int u = 0; u < 4; ++u) f(v[u].x), f(v[u].y), f(v[u].z), f(v[u].w);
  }
  for (; i < quads; i += kThreads) {
    const float4 v = row4[i];
    f(v.x), f(v.y), f(v.z), f(v.w);
  }
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
    for_each_entry(row, vocab, [&](float p) {
      const uint32_t bits = __float_as_uint(p);
      if (bits < prefix) return;
#pragma unroll
      for (int k = 1; k < kDigits; ++k) mass[k - 1] += bits >= (prefix | static_cast<uint32_t>(k) << shift) ? p : 0.f;
    });
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
  for_each_entry(row, vocab, [&](float p) {
    above += p > tau ? p : 0.f;
    ties += p == tau ? 1.f : 0.f;
  });
  above = block_sum(above, scratch);
  const int64_t tied = static_cast<int64_t>(block_sum(ties, scratch));
  int64_t keep_tied = tied;
  if (tau > 0) {
    const float needed = ceilf((top_p - above) / tau);
    keep_tied = needed < 1 ? 1 : (needed < static_cast<float>(tied) ? static_cast<int64_t>(needed) : tied);
  }

  // Every tied token kept (the usual case: tau is one token's probability) or none needed: each
  // entry decides alone (four at a time where the row is read as float4).
  if (tau == 0 || keep_tied >= tied) {
    auto kept = [&](float p) { return (tau > 0 ? p >= tau : p > 0) ? p : 0.f; };
    if (vocab % 4 == 0) {
      const float4* row4 = reinterpret_cast<const float4*>(row);
      float4* out4 = reinterpret_cast<float4*>(out_row);
      for (int64_t i = threadIdx.x; i < vocab / 4; i += kThreads) {
        const float4 v = row4[i];
        out4[i] = make_float4(kept(v.x), kept(v.y), kept(v.z), kept(v.w));
      }
    } else {
      for (int64_t i = threadIdx.x; i < vocab; i += kThreads) out_row[i] = kept(row[i]);
    }
    return;
  }
  // Else the row in index order, 1,024 tokens at a time; each tied token's rank among the tied
  // ones before it from a ballot per warp and the warps' counts.
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

// Inclusive prefix sum of x over the warp's lanes (lane order).
__device__ __forceinline__ float warp_inclusive_scan(float x, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset <<= 1) {
    const float y = __shfl_up_sync(0xffffffffu, x, offset);
    if (lane >= offset) x += y;
  }
  return x;
}

// Walks entries [begin, end) of `row` 32 at a time, `base` the running sum (from 0): the first
// index of positive probability whose running sum exceeds `target`, or -1; `last_positive` gets
// the segment's last index of positive probability (-1: none). With target = +inf it only sums:
// `base` ends as the segment's mass, summed in the order every walk of the segment sums.
// kGroups groups' loads are issued before the first is summed (one group at a time kept a warp
// waiting on each load in turn).
constexpr int kGroups = 8;
__device__ __forceinline__ int64_t walk_segment(const float* row, int64_t begin, int64_t end, float target, float& base,
                                                int64_t& last_positive, int lane) {
  for (int64_t first = begin; first < end; first += 32 * kGroups) {
    float p[kGroups];
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const int64_t i = first + 32 * j + lane;
      p[j] = i < end ? row[i] : 0.f;
    }
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      const int64_t group = first + 32 * j;
      const float running = base + warp_inclusive_scan(p[j], lane);
      const uint32_t over = __ballot_sync(0xffffffffu, p[j] > 0 && running > target);
      const uint32_t positive = __ballot_sync(0xffffffffu, p[j] > 0);
      if (positive != 0) last_positive = group + 31 - __clz(positive);
      if (over != 0) return group + __ffs(over) - 1;
      base = __shfl_sync(0xffffffffu, running, 31);
    }
  }
  return -1;
}

__global__ void __launch_bounds__(kThreads)
    choose_kernel(const float* probs, int64_t vocab, const double* u, int64_t* chosen) {
  const float* row = probs + static_cast<int64_t>(blockIdx.x) * vocab;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float segment_mass[kWarps];
  __shared__ int64_t segment_last[kWarps];
  const int64_t per_warp = (vocab + kWarps - 1) / kWarps;
  const int64_t begin = min(vocab, warp * per_warp), end = min(vocab, begin + per_warp);
  float mass = 0;
  int64_t last = -1;
  walk_segment(row, begin, end, INFINITY, mass, last, lane);
  if (lane == 0) segment_mass[warp] = mass, segment_last[warp] = last;
  __syncthreads();
  // The target and the segment that holds it, in warp order (every thread the same): the first
  // whose mass exceeds what is left of the target after the segments before it.
  float total = 0;
  for (int w = 0; w < kWarps; ++w) total += segment_mass[w];
  float left = static_cast<float>(u[blockIdx.x]) * total;
  int holder = -1;
  int64_t last_positive = -1;
  for (int w = 0; w < kWarps; ++w) {
    if (segment_last[w] >= 0) last_positive = segment_last[w];
    if (holder >= 0) continue;
    if (segment_mass[w] > 0 && segment_mass[w] > left) {
      holder = w;
    } else {
      left -= segment_mass[w];
    }
  }
  if (holder < 0) {  // rounding put the target at or above the total (or no entry is positive: NaN)
    if (threadIdx.x == 0) chosen[blockIdx.x] = last_positive >= 0 ? last_positive : 0;
    return;
  }
  if (warp != holder) return;
  // The holder's walk sums in its summing pass's order, so its running sum reaches its mass, which
  // exceeds `left`: it stops within the segment.
  float base = 0;
  int64_t unused = -1;
  const int64_t index = walk_segment(row, begin, end, left, base, unused, lane);
  if (lane == 0) chosen[blockIdx.x] = index >= 0 ? index : segment_last[holder];
}

}  // namespace

void top_p_keep(const float* probs, float* out, int rows, int64_t vocab, float top_p, cudaStream_t stream) {
  if (rows > 0) top_p_keep_kernel<<<rows, kThreads, 0, stream>>>(probs, out, vocab, top_p);
}

void choose_by_uniform(const float* probs, int rows, int64_t vocab, const double* u, int64_t* chosen,
                       cudaStream_t stream) {
  if (rows > 0) choose_kernel<<<rows, kThreads, 0, stream>>>(probs, vocab, u, chosen);
}

}  // namespace dflash::target::kernels
