// top_p.h: nucleus (top-p) filtering of sampling probabilities on the GPU, without a sort.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::target::kernels {

// Per row of probs [rows, vocab] (fp32, contiguous, non-negative): out keeps the smallest set of
// the most likely tokens whose mass reaches top_p (a token is kept while the mass of the tokens
// before it, most likely first, is below top_p; among equal probabilities lower indices come
// first) and zeroes the rest, unnormalised. One CTA per row finds the boundary probability by a
// search over its bit pattern, 4 bits per pass over the row (a non-negative float's bits order as
// its value), then writes the row. out may be probs.
void top_p_keep(const float* probs, float* out, int rows, int64_t vocab, float top_p, cudaStream_t stream);

}  // namespace dflash::target::kernels
