// gated_delta_net.h: the GatedDeltaNet pieces of the hybrid targets (Qwen3.5, Qwen3-Next) as
// plain libtorch ops: the CPU path, and the correctness reference for the CUDA kernels.
//
// Math (docs/targets.md): per value head, state S (dk x dv, fp32) from 0 at each sequence start:
//   S = exp(g_t) S;  S += k_t (beta_t (v_t - S^T k_t))^T;  o_t = S^T q_t
// computed in the chunked WY form (chunk C = 64): every intra-chunk quantity for all chunks of
// a sequence at once, then one pass over chunks for the state. No per-token or per-row host
// loop; the host loops are over sequences of a packed batch and over chunks.
//
// Packed batches: tokens of several sequences are concatenated; `positions` gives each
// token's index within its own sequence, `cu_seqlens` the sequence boundaries. Nothing leaks
// across a boundary: the conv window and the state restart at 0.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

namespace dflash::target {

// Depthwise causal conv1d over the channels of x [N, C] with weight [C, K] (no bias), then
// SiLU. Computed in fp32, returned in x's dtype.
at::Tensor causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions);

// The gates from a layer's projections: g = -exp(A_log) softplus(a + dt_bias) (<= 0) and beta =
// sigmoid(b), fp32 [T, Hv], from a, b [T, Hv] (any dtype) and A_log, dt_bias [Hv].
struct GdnGateValues {
  at::Tensor g, beta;
};
GdnGateValues gdn_gates_reference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                  const at::Tensor& dt_bias);

// One sequence: q, k [T, Hk, dk] (raw: L2 normalisation and the dk^-0.5 scale happen here),
// v [T, Hv, dv], g and beta [T, Hv] (fp32; g <= 0). Value head h reads key head h / (Hv/Hk).
// Returns o [T, Hv, dv] in fp32. `state` (optional, [Hv, dk, dv] fp32): the state before the first
// token (zeros when undefined), replaced by the state after the last one (incremental decoding).
at::Tensor chunk_gated_delta_rule_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                            const at::Tensor& g, const at::Tensor& beta, int64_t chunk_size = 64,
                                            at::Tensor* state = nullptr);

// The token-by-token recurrence in fp32 from `state` ([Hv, dk, dv]; zeros when undefined), for
// the few tokens of a decoding step: o [T, Hv, dv] and the state after each token [T, Hv, dk, dv]
// (a speculative step keeps the state at the accepted length).
struct GdnSteps {
  at::Tensor o, states;
};
GdnSteps recurrent_gated_delta_rule_steps(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                          const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state);

// The same over a packed batch (cu_seqlens: B+1 offsets into the token dimension).
at::Tensor chunk_gated_delta_rule_packed_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& g, const at::Tensor& beta,
                                                   const std::vector<int64_t>& cu_seqlens, int64_t chunk_size = 64);

// The token-by-token recurrence, float64: an independent oracle for tests only (slow by design).
at::Tensor recurrent_gated_delta_rule_oracle(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             const at::Tensor& g, const at::Tensor& beta);

}  // namespace dflash::target
