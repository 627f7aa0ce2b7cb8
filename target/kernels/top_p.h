// top_p.h: the sampling kernels: nucleus (top-p) filtering of sampling probabilities on the GPU
// without a sort, and a token per row chosen by a uniform without a cumulative-sum tensor.
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

// Per row r of probs [rows, vocab] (fp32, contiguous, non-negative, a positive sum): chosen[r] =
// the first index whose cumulative probability exceeds u[r] (in [0, 1)) times the row's total, or,
// where rounding leaves u[r] times the total at or above every cumulative sum, the row's last
// index of positive probability; never a zero-probability index (a row without one, e.g. of NaN
// logits, gets index 0). One CTA per row: each warp sums a contiguous segment 32 entries at a time
// (a scan per group, the same order when it walks it), the segment whose range holds the target
// walks it. Deterministic: fixed summation orders.
void choose_by_uniform(const float* probs, int rows, int64_t vocab, const double* u, int64_t* chosen,
                       cudaStream_t stream);

}  // namespace dflash::target::kernels
