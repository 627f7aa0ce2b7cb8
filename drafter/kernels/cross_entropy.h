// cross_entropy.h: the LM-head loss's element-wise work as two CUDA kernels over bf16 logits
// (no torch in this interface; drafter/loss.cc calls them). The logits of a chunk are read
// twice and overwritten once with their own gradient, where the composite version converted
// them to fp32 and made about ten passes (logsumexp, gather, exp, scatter, scale, casts,
// argmax). Arithmetic in fp32 from the bf16 logits, as the composite version.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::drafter::kernels {

// Per row r of logits (bf16 [rows, vocab], row stride ld elements, vocab and ld multiples of
// 8): lse[r] = log sum exp, picked[r] = logits[r, labels[r]], argmax[r] = first index of the
// maximum.
void logit_row_stats(const void* logits, int rows, int vocab, int64_t ld, const int64_t* labels, float* lse,
                     float* picked, int64_t* argmax, cudaStream_t stream);

// In place: logits[r, v] <- bf16((exp(logits[r, v] - lse[r]) - [v == labels[r]]) * scale[r]),
// the gradient of scale[r] * CE(row r) with respect to its logits.
void logit_gradient(void* logits, int rows, int vocab, int64_t ld, const int64_t* labels, const float* lse,
                    const float* scale, cudaStream_t stream);

}  // namespace dflash::drafter::kernels
