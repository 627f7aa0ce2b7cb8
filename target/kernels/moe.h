// moe.h (kernels): the MoE block's two passes that are not GEMMs (no torch in this interface;
// target/moe.cc wraps them).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace dflash::target::kernels {

// The largest expert count route() takes (Qwen3.5-397B and Qwen3-Next: 512).
inline constexpr int kMoeMaxExperts = 1024;
inline constexpr int kMoeMaxTopK = 32;

// Router: for each of `tokens` rows of `experts` bf16 logits (row r at logits + r * stride),
// p = softmax(logits) in fp32; the top_k largest p in descending order (ties: the lower expert
// id) as weights fp32 [tokens, top_k] (divided by their sum when normalise) and expert ids
// int64 [tokens, top_k]. One warp per token.
void moe_route(const void* logits, int64_t stride, int tokens, int experts, int top_k, bool normalise,
               float* weights, int64_t* ids, cudaStream_t stream);

// Un-permute and combine: out[t] = bf16(sum_j weights[t, j] * rows[position[t * top_k + j]])
// summed in fp32 in j order (deterministic), rows bf16 [pairs, hidden]; with shared (bf16
// [tokens, hidden], contiguous) and its gate logit (bf16, token t's at gate + t * gate_stride)
// out[t] += bf16(bf16(sigmoid(gate)) * shared[t]) as HF rounds it, the sum rounded once more.
// hidden a multiple of 8.
void moe_combine(const void* rows, const int64_t* position, const float* weights, int tokens, int top_k, int hidden,
                 const void* shared, const void* gate, int64_t gate_stride, void* out, cudaStream_t stream);

}  // namespace dflash::target::kernels
