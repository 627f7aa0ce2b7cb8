// moe.h: the sparse mixture-of-experts MLP of the Qwen3.5-MoE / Qwen3-Next targets (docs/targets.md):
// router softmax(x W_r^T) in fp32, the top-k experts per token, their weights renormalised
// (norm_topk_prob), each expert a SwiGLU of moe_intermediate_size, plus a shared expert SwiGLU
// scaled by sigmoid(shared_expert_gate(x)).
//
// Two implementations of the same function, with the same routing (moe_route):
// - moe_grouped (the GPU path): no host synchronisation. Token-expert pairs are sorted into
//   expert order on the device (a stable sort: each expert's rows keep token order), the group
//   offsets come from a search in the sorted ids, gate/up and down are one grouped GEMM each over
//   all experts (ATen's _grouped_mm: CUTLASS grouped GEMM on Hopper; FP8 experts: the FP8 grouped
//   GEMM of kernels/grouped_fp8.h), SiLU-mul is the fused
//   kernel, and one kernel gathers each token's k expert outputs back, sums them with their
//   weights in a fixed order (deterministic) and adds the gated shared expert.
// - moe_reference (the CPU oracle): one host iteration per expert that has tokens; the counts
//   come to the host once per layer.
// x's projections (router, shared expert gate/up, shared expert gate) are one GEMM; the
// router's softmax, top-k and renormalisation one kernel on a GPU (kernels/moe.h).
#pragma once

#include <ATen/core/Tensor.h>

#include "target/fp8.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>

namespace dflash::target {

struct MoeShape {
  int64_t experts = 0, top_k = 0, inner = 0;
  bool norm_topk_prob = true;
  int64_t shared = 0;  // the shared expert's inner size, 0 without one
};

struct MoeWeights {
  // [router (E) ; shared gate (S) ; shared up (S) ; shared expert gate (1, when S > 0) ; zero
  // rows to a multiple of 8] x H: every projection of x in one GEMM, rows 16-byte aligned.
  at::Tensor input_proj;
  at::Tensor experts_gate_up;  // [E, 2I, H] (each expert's gate rows, then its up rows)
  at::Tensor experts_down;     // [E, H, I]
  at::Tensor shared_down;      // [H, S], undefined without a shared expert
  // FP8 experts (target.dtype: float8): the same two tensors block-scaled (fp8.h), experts_gate_up
  // and experts_down undefined. On Hopper they run as they are stored, on the FP8 grouped GEMM
  // (fp8_experts_grouped); elsewhere each forward dequantizes a layer's experts to bf16 (one
  // kernel, a temporary of the layer's expert size) for ATen's grouped GEMM.
  Fp8Weight fp8_gate_up, fp8_down;

  // The experts' gate/up and down weights in `dtype`: the stored ones, or the FP8 ones dequantized.
  std::pair<at::Tensor, at::Tensor> experts(at::ScalarType dtype) const;

  // Concatenates the projections of x (shared_* undefined without a shared expert).
  static MoeWeights make(const at::Tensor& router, at::Tensor experts_gate_up, at::Tensor experts_down,
                         const at::Tensor& shared_gate, const at::Tensor& shared_up, at::Tensor shared_down,
                         const at::Tensor& shared_expert_gate);
};

// Routing of tokens to experts: weights fp32 [tokens, k], expert ids int64 [tokens, k].
struct MoeRouting {
  at::Tensor weights, experts;
};
// From the router logits [tokens, E] (a column slice of the projections): softmax in fp32,
// top-k, renormalised; the fused kernel on a GPU in bf16, ATen's ops otherwise.
MoeRouting moe_route(const MoeShape& shape, const at::Tensor& logits);

// Whether the experts of `w` run on the FP8 grouped GEMM for rows in `dtype` on `device` (FP8
// experts, bf16 rows, fp8_grouped_gemm_applies there).
bool fp8_experts_grouped(const MoeWeights& w, at::Device device, at::ScalarType dtype);
// The same asked before any weight is loaded (the memory plan): whether FP8 experts of these
// shapes, `experts` x gate_up [2 inner, hidden] and down [hidden, inner], would run on the FP8
// grouped GEMM on CUDA device `device` (false without experts or CUDA).
bool fp8_experts_grouped_on(int64_t experts, int64_t hidden, int64_t inner, int device);

// x [tokens, H] in the weights' dtype; returns [tokens, H].
at::Tensor moe_grouped(const MoeShape& shape, const MoeWeights& w, const at::Tensor& x);
at::Tensor moe_reference(const MoeShape& shape, const MoeWeights& w, const at::Tensor& x);

// Why moe_grouped would not run at full speed on `device` in `dtype` (ATen's grouped GEMM kernel
// takes bf16 on compute capability 9.x or 10.x; elsewhere ATen falls back to a host loop over the
// experts that copies the offsets to the host), or nullopt when it would. The CPU always gets a
// reason: there the reference path runs unless the grouped one is forced (tests).
std::optional<std::string> moe_grouped_unavailable(at::Device device, at::ScalarType dtype);

// What kernel_paths() says of the MoE layers' two paths.
inline constexpr const char* kMoeGroupedPath = "grouped GEMMs (device routing, ATen _grouped_mm)";
inline constexpr const char* kMoeReferencePath = "reference (a host loop over experts)";

}  // namespace dflash::target
