// The one-pass AdamW kernel: see adamw.h.
#include "drafter/kernels/adamw.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>

#include "common/bf16x8.cuh"
#include "common/cuda_check.h"

namespace dflash::drafter::kernels {
namespace {

using bf16 = __nv_bfloat16;
constexpr int64_t kChunk = 65536;  // elements per CTA
constexpr int kThreads = 512;

struct Chunk {
  int tensor;
  int64_t begin;
};

// One element's update, in fp32 (torch's fused AdamW arithmetic).
struct Update {
  float beta1, beta2, epsilon, grad_scale, decay, step_size, bias_correction2_sqrt;
  __device__ __forceinline__ void operator()(float g, float& p, float& m, float& v) const {
    g *= grad_scale;
    p *= decay;
    m = beta1 * m + (1.f - beta1) * g;
    v = beta2 * v + (1.f - beta2) * g * g;
    p -= step_size * m / (sqrtf(v) / bias_correction2_sqrt + epsilon);
  }
};

// Eight elements per thread and access where the tensor's pointers allow 16-byte accesses
// (every allocation does; the per-element loop is for views and the last numel % 8): the
// update is bound by its 28 bytes per parameter, and vector accesses keep enough of them in
// flight to stream at the memory's rate.
__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTensor* __restrict__ tensors,
                                                         const Chunk* __restrict__ chunks, AdamWStep s) {
  const Chunk c = chunks[blockIdx.x];
  const AdamWTensor t = tensors[c.tensor];
  const int64_t end = min(c.begin + kChunk, t.numel);
  const bf16* grad = static_cast<const bf16*>(t.grad);
  bf16* param = static_cast<bf16*>(t.param);
  const Update update{s.beta1, s.beta2, s.epsilon, s.grad_scale, 1.f - s.lr * s.weight_decay,
                      s.lr / s.bias_correction1, s.bias_correction2_sqrt};
  const bool vector = ((reinterpret_cast<uintptr_t>(t.master) | reinterpret_cast<uintptr_t>(t.exp_avg) |
                        reinterpret_cast<uintptr_t>(t.exp_avg_sq) | reinterpret_cast<uintptr_t>(grad) |
                        reinterpret_cast<uintptr_t>(param)) & 15) == 0;
  int64_t first_scalar = c.begin;  // chunk starts are multiples of 8 elements
  if (vector) {
    const int64_t vector_end = c.begin + (end - c.begin) / 8 * 8;
    for (int64_t i = c.begin + 8 * threadIdx.x; i < vector_end; i += 8 * kThreads) {
      float g[8], p[8], m[8], v[8];
      bf16x8::load8(g, grad + i);
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<float4*>(p + 4 * h) = *reinterpret_cast<const float4*>(t.master + i + 4 * h);
        *reinterpret_cast<float4*>(m + 4 * h) = *reinterpret_cast<const float4*>(t.exp_avg + i + 4 * h);
        *reinterpret_cast<float4*>(v + 4 * h) = *reinterpret_cast<const float4*>(t.exp_avg_sq + i + 4 * h);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) update(g[j], p[j], m[j], v[j]);
      for (int h = 0; h < 2; ++h) {
        *reinterpret_cast<float4*>(t.master + i + 4 * h) = *reinterpret_cast<const float4*>(p + 4 * h);
        *reinterpret_cast<float4*>(t.exp_avg + i + 4 * h) = *reinterpret_cast<const float4*>(m + 4 * h);
        *reinterpret_cast<float4*>(t.exp_avg_sq + i + 4 * h) = *reinterpret_cast<const float4*>(v + 4 * h);
      }
      if (param != nullptr) bf16x8::store8(param + i, p);
    }
    first_scalar = vector_end;
  }
  for (int64_t i = first_scalar + threadIdx.x; i < end; i += kThreads) {
    float p = t.master[i], m = t.exp_avg[i], v = t.exp_avg_sq[i];
    update(__bfloat162float(grad[i]), p, m, v);
    t.master[i] = p;
    t.exp_avg[i] = m;
    t.exp_avg_sq[i] = v;
    if (param != nullptr) param[i] = __float2bfloat16(p);
  }
}

std::vector<Chunk> chunks_of(const std::vector<AdamWTensor>& tensors) {
  std::vector<Chunk> chunks;
  for (size_t i = 0; i < tensors.size(); ++i) {
    for (int64_t b = 0; b < tensors[i].numel; b += kChunk) chunks.push_back({static_cast<int>(i), b});
  }
  return chunks;
}

}  // namespace

size_t adamw_scratch_bytes(const std::vector<AdamWTensor>& tensors) {
  return tensors.size() * sizeof(AdamWTensor) + chunks_of(tensors).size() * sizeof(Chunk) + 16;
}

void adamw_update(const std::vector<AdamWTensor>& tensors, const AdamWStep& step, void* scratch, cudaStream_t stream) {
  const std::vector<Chunk> chunks = chunks_of(tensors);
  if (chunks.empty()) return;
  // One host buffer, one copy: the tensor table, then the chunk table (16-byte aligned).
  const size_t table = (tensors.size() * sizeof(AdamWTensor) + 15) / 16 * 16;
  std::vector<unsigned char> host(table + chunks.size() * sizeof(Chunk));
  std::memcpy(host.data(), tensors.data(), tensors.size() * sizeof(AdamWTensor));
  std::memcpy(host.data() + table, chunks.data(), chunks.size() * sizeof(Chunk));
  check_cuda(cudaMemcpyAsync(scratch, host.data(), host.size(), cudaMemcpyHostToDevice, stream), "AdamW kernel table copy");
  // The pageable copy above is staged before cudaMemcpyAsync returns, so `host` may go.
  const auto* d_tensors = static_cast<const AdamWTensor*>(scratch);
  const auto* d_chunks = reinterpret_cast<const Chunk*>(static_cast<unsigned char*>(scratch) + table);
  adamw_kernel<<<static_cast<unsigned>(chunks.size()), kThreads, 0, stream>>>(d_tensors, d_chunks, step);
  check_cuda_launch("AdamW kernel");
}

}  // namespace dflash::drafter::kernels
