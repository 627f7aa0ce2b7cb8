// flash_attention.h: whether ATen's FlashAttention kernel (_flash_attention_forward, the
// variable-length form the decoders call) can run for activations of `options` and heads of
// `head_dim`: bf16 / fp16 on an sm_80+ GPU, heads of at most 256 and a multiple of 8. Shared by
// the target's decoding steps (target/incremental.cc) and the drafter's decoding blocks
// (drafter/model.cc); each says there why it takes the kernel.
#pragma once

#include <ATen/core/TensorBody.h>
#include <c10/core/TensorOptions.h>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

namespace dflash {

inline bool flash_attention_runs(const at::TensorOptions& options, int64_t head_dim) {
#ifdef DFLASHD_WITH_CUDA
  const at::ScalarType dtype = options.dtype().toScalarType();
  if (!options.device().is_cuda() || (dtype != at::kBFloat16 && dtype != at::kHalf)) return false;
  if (head_dim % 8 != 0 || head_dim > 256) return false;
  return at::cuda::getDeviceProperties(options.device().index())->major >= 8;
#else
  (void)options, (void)head_dim;
  return false;
#endif
}

}  // namespace dflash
