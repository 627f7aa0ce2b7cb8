// adamw.h: one pass of AdamW over fp32 master weights with bf16 gradients, writing the bf16
// model parameters in the same pass (no torch in this interface; drafter/optimizer.cc calls
// it). It replaces the gradient cast to fp32, PyTorch's fused AdamW and the cast back to the
// model dtype: 30 bytes of memory traffic per parameter instead of about 50. Same arithmetic
// as torch's fused AdamW (decoupled weight decay, bias corrections), in fp32.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

namespace dflash::drafter::kernels {

struct AdamWTensor {
  float* master = nullptr;       // fp32, updated
  float* exp_avg = nullptr;      // fp32, updated
  float* exp_avg_sq = nullptr;   // fp32, updated
  const void* grad = nullptr;    // bf16
  void* param = nullptr;         // bf16, receives the rounded master
  int64_t numel = 0;
};

struct AdamWStep {
  float lr = 0, beta1 = 0, beta2 = 0, weight_decay = 0, epsilon = 0;
  float grad_scale = 1;          // gradient clipping factor
  float bias_correction1 = 1;    // 1 - beta1^step
  float bias_correction2_sqrt = 1;  // sqrt(1 - beta2^step)
};

// Copies the tensor table to the device (`scratch`: device memory of at least
// adamw_scratch_bytes(tensors) bytes, owned by the caller and alive until the stream passes).
size_t adamw_scratch_bytes(const std::vector<AdamWTensor>& tensors);
void adamw_update(const std::vector<AdamWTensor>& tensors, const AdamWStep& step, void* scratch, cudaStream_t stream);

}  // namespace dflash::drafter::kernels
