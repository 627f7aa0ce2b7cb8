// The MoE block's routing and combining kernels: see moe.h.
#include "target/kernels/moe.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/bf16x8.cuh"
#include "common/cuda_check.h"

namespace dflash::target::kernels {
namespace {

using bf16 = __nv_bfloat16;
using bf16x8::load8;
using bf16x8::round_bf16;
using bf16x8::store8;

constexpr int kRouteWarps = 8;  // tokens per CTA
constexpr int kPerLane = kMoeMaxExperts / 32;

// Lane l holds experts l, l + 32, l + 64, ... Softmax by warp reductions; then top_k rounds of a
// warp arg-max (the value, then the lower id), the winner's slot cleared.
__global__ void __launch_bounds__(kRouteWarps * 32) moe_route_kernel(const bf16* __restrict__ logits, int64_t stride,
                                                                    int tokens, int experts, int top_k, bool normalise,
                                                                    float* __restrict__ weights,
                                                                    int64_t* __restrict__ ids) {
  const int token = blockIdx.x * kRouteWarps + (threadIdx.x >> 5), lane = threadIdx.x & 31;
  if (token >= tokens) return;  // whole warps
  const bf16* row = logits + token * stride;
  float p[kPerLane];
  float largest = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < experts ? __bfloat162float(row[e]) : -INFINITY;
    largest = fmaxf(largest, p[i]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) largest = fmaxf(largest, __shfl_xor_sync(0xffffffffu, largest, off));
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    p[i] = lane + 32 * i < experts ? __expf(p[i] - largest) : -1.f;  // -1: no expert (below any probability)
    total += p[i] > 0.f ? p[i] : 0.f;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) total += __shfl_xor_sync(0xffffffffu, total, off);
  float chosen_sum = 0.f, chosen = 0.f;
  int chosen_id = 0;
  for (int j = 0; j < top_k; ++j) {
    float best = -2.f;
    int best_id = kMoeMaxExperts;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (p[i] > best) best = p[i], best_id = lane + 32 * i;  // ascending ids per lane: ties keep the lower
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, off);
      const int other_id = __shfl_xor_sync(0xffffffffu, best_id, off);
      if (other > best || (other == best && other_id < best_id)) best = other, best_id = other_id;
    }
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) {
      if (lane + 32 * i == best_id) p[i] = -2.f;  // taken (a register array: no dynamic index)
    }
    const float probability = best / total;
    chosen_sum += probability;
    if (lane == j) chosen = probability, chosen_id = best_id;
  }
  if (lane < top_k) {
    weights[token * top_k + lane] = normalise ? chosen / chosen_sum : chosen;
    ids[token * top_k + lane] = chosen_id;
  }
}

constexpr int kCombineThreads = 256;

// One CTA per token; thread c handles columns [8c, 8c + 8) (and further by strides of 2048).
__global__ void __launch_bounds__(kCombineThreads) moe_combine_kernel(const bf16* __restrict__ rows,
                                                                     const int64_t* __restrict__ position,
                                                                     const float* __restrict__ weights, int top_k,
                                                                     int hidden, const bf16* __restrict__ shared,
                                                                     const bf16* __restrict__ gate, int64_t gate_stride,
                                                                     bf16* __restrict__ out) {
  const int token = blockIdx.x;
  __shared__ int64_t where[kMoeMaxTopK];
  __shared__ float weight[kMoeMaxTopK];
  if (threadIdx.x < top_k) {
    where[threadIdx.x] = position[static_cast<int64_t>(token) * top_k + threadIdx.x] * hidden;
    weight[threadIdx.x] = weights[static_cast<int64_t>(token) * top_k + threadIdx.x];
  }
  __syncthreads();
  const float gated = shared != nullptr
                          ? round_bf16(1.f / (1.f + __expf(-__bfloat162float(gate[token * gate_stride]))))
                          : 0.f;
  for (int c = threadIdx.x * 8; c < hidden; c += kCombineThreads * 8) {
    float sum[8] = {};
    for (int j = 0; j < top_k; ++j) {
      float v[8];
      load8(v, rows + where[j] + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] += weight[j] * v[i];
    }
    if (shared != nullptr) {
      float s[8];
      load8(s, shared + static_cast<int64_t>(token) * hidden + c);
#pragma unroll
      for (int i = 0; i < 8; ++i) sum[i] = round_bf16(sum[i]) + round_bf16(gated * s[i]);
    }
    store8(out + static_cast<int64_t>(token) * hidden + c, sum);
  }
}

}  // namespace

void moe_route(const void* logits, int64_t stride, int tokens, int experts, int top_k, bool normalise, float* weights,
               int64_t* ids, cudaStream_t stream) {
  if (experts < 1 || experts > kMoeMaxExperts || top_k < 1 || top_k > 32 || top_k > experts) {
    throw std::invalid_argument("moe_route: needs 1 <= top_k <= min(32, experts) and experts <= " +
                                std::to_string(kMoeMaxExperts));
  }
  if (tokens == 0) return;
  moe_route_kernel<<<(tokens + kRouteWarps - 1) / kRouteWarps, kRouteWarps * 32, 0, stream>>>(
      static_cast<const bf16*>(logits), stride, tokens, experts, top_k, normalise, weights, ids);
  check_cuda_launch("target kernel moe_route");
}

void moe_combine(const void* rows, const int64_t* position, const float* weights, int tokens, int top_k, int hidden,
                 const void* shared, const void* gate, int64_t gate_stride, void* out, cudaStream_t stream) {
  if (hidden % 8 != 0 || top_k < 1 || top_k > kMoeMaxTopK) {
    throw std::invalid_argument("moe_combine: needs hidden a multiple of 8 and 1 <= top_k <= 32");
  }
  if (tokens == 0) return;
  moe_combine_kernel<<<tokens, kCombineThreads, 0, stream>>>(
      static_cast<const bf16*>(rows), position, weights, top_k, hidden, static_cast<const bf16*>(shared),
      static_cast<const bf16*>(gate), gate_stride, static_cast<bf16*>(out));
  check_cuda_launch("target kernel moe_combine");
}

}  // namespace dflash::target::kernels
