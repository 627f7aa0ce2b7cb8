// The one-pass AdamW kernel: see adamw.h.
#include "drafter/kernels/adamw.h"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <stdexcept>
#include <string>

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

__global__ void __launch_bounds__(kThreads) adamw_kernel(const AdamWTensor* __restrict__ tensors,
                                                         const Chunk* __restrict__ chunks, AdamWStep s) {
  const Chunk c = chunks[blockIdx.x];
  const AdamWTensor t = tensors[c.tensor];
  const int64_t end = min(c.begin + kChunk, t.numel);
  const bf16* grad = static_cast<const bf16*>(t.grad);
  bf16* param = static_cast<bf16*>(t.param);
  const float decay = 1.f - s.lr * s.weight_decay, step_size = s.lr / s.bias_correction1;
  for (int64_t i = c.begin + threadIdx.x; i < end; i += kThreads) {
    const float g = __bfloat162float(grad[i]) * s.grad_scale;
    float p = t.master[i] * decay;
    const float m = s.beta1 * t.exp_avg[i] + (1.f - s.beta1) * g;
    const float v = s.beta2 * t.exp_avg_sq[i] + (1.f - s.beta2) * g * g;
    p -= step_size * m / (sqrtf(v) / s.bias_correction2_sqrt + s.epsilon);
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
