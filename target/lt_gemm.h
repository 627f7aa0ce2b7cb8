// lt_gemm.h: the target's projection GEMMs through cuBLASLt called directly, and the choice
// between it and our stream-K GEMM (private to target/; GPU builds only), y [m, n] = x [m, k] .
// W^T with W [n, k] row-major:
// - block-scaled FP8 (x e4m3 in 1x128 groups, W e4m3 in 128x128 blocks: fp8.h's operands);
// - bf16 (x and W bf16, fp32 accumulation).
//
// Why not ATen's _scaled_mm / matmul: both give cuBLASLt a small workspace, so at a decode step's
// rows (128) cuBLASLt's heuristic cannot split the reduction and the long-k projections
// (down_proj, k 17408) ran at a third of the GPU's bandwidth; with 32 MB of workspace the same
// heuristic splits k (bench/RESULTS.md, gemm_bench). ATen's per-call checks also cost host
// time that a decode step of 250 small GEMMs feels.
//
// The algorithm: the first that cuBLASLt's heuristic proposes for the shape, the operand types
// and 32 MB of workspace, asked once per shape and thread: the same GPU, library and shape choose
// the same algorithm, so results do not depend on timing or on which thread ran first.
#pragma once

#include <ATen/core/Tensor.h>

#include "target/fp8.h"

namespace dflash::target {

// a's rows (padded ones included: fp8_gemm_rows) times W^T, [a.q.size(0), n] in a.dtype (bf16,
// fp16 or fp32). a and w on one CUDA device; n and k as fp8_shape_unsupported allows.
at::Tensor lt_gemm_fp8(const Fp8Activations& a, const Fp8Weight& w);

// x [m, k] (rows at any stride that is a multiple of 8, last dim contiguous) times W^T, W [n, k]
// contiguous, both bf16 on one CUDA device: [m, n] bf16.
at::Tensor lt_gemm_bf16(const at::Tensor& x, const at::Tensor& w);

// The same product as the target's projections run it: on Hopper at a decoding step's rows
// (at most 128) and W of 128 MB or more, the stream-K GEMM (kernels/stream_gemm.h: applies,
// preferred); lt_gemm_bf16 otherwise.
at::Tensor projection_bf16(const at::Tensor& x, const at::Tensor& w);

// silu(x . gate^T) * (x . up^T) for a SwiGLU's stacked W = [gate; up] ([2I, k]) in one stream-K
// GEMM whose epilogue applies the SwiGLU as silu_mul does (stream_gemm.h: glu_inner), where
// projection_bf16 would take the stream-K GEMM; undefined otherwise (the caller runs the product
// and silu_mul).
at::Tensor projection_silu_mul_bf16(const at::Tensor& x, const at::Tensor& w);

}  // namespace dflash::target
