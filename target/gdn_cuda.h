// gdn_cuda.h: the GatedDeltaNet fast path on the GPU (target/kernels/) behind libtorch tensors,
// and the rule for when it can run. The reference path (gated_delta_net.h) is what it is
// tested against; model.cc picks one per model and reports the choice.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>
#include <vector>

#include "target/model_config.h"

namespace dflash::target {

// What kernel_paths() says of the GatedDeltaNet kernels.
inline constexpr const char* kGdnKernelPath = "cuda kernels (dflashd chunked GatedDeltaNet)";

// Why the kernels cannot run this model's GatedDeltaNet layers on `device` in `dtype` (names the
// device, the dimension or the dtype), or nullopt when they can.
std::optional<std::string> gdn_kernels_unavailable(const ModelConfig& config, at::Device device, at::ScalarType dtype);

// The chunk table of a packed batch (no chunk crosses a sequence boundary), on the device.
struct GdnChunkPlan {
  at::Tensor table;  // int32 [chunks (start) | chunks (length) | sequences + 1 (first chunk)]
  int num_chunks = 0;
  int num_seqs = 0;
};
GdnChunkPlan make_gdn_chunk_plan(const std::vector<int64_t>& cu_seqlens, at::Device device);

// Causal depthwise conv1d + SiLU over x bf16 [tokens, channels] (weight [channels, kernel]), with
// every 128-channel head in [0, qk_channels) L2-normalised. positions: int64 [tokens].
at::Tensor conv1d_silu_l2norm_cuda(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions,
                                   int64_t qk_channels);

// A decoding step's conv (kernels::conv_step): tails bf16 [G, K - 1, C] (each sequence's cached
// inputs, oldest first; any strides with contiguous channels), x bf16 [G * n, C] (the step rows,
// sequence-major). Returns y bf16 [G * n, C] = SiLU(conv) and the new tails [G, K - 1, C]: what
// concatenating the window, conv1d_silu_l2norm_cuda over it (qk_channels 0) and its last K - 1
// rows give, in one pass.
// With `gates` (where gdn_gates_kernel_applies, fused_ops.h), the same launch also forms the
// step's GatedDeltaNet gates g and beta (fp32 [G * n, heads], gdn_gates' values) from the
// projections a, b (bf16 [G * n, heads]) and A_log, dt_bias.
struct ConvStepGates {
  at::Tensor a, b, a_log, dt_bias;
};
struct ConvStepResult {
  at::Tensor y, tails, g, beta;
};
// `settled`: tails and weight were written by kernels that had finished before the launch two
// back began (a decoding cache's batch rows from an earlier step, the layer's weight): the kernel
// may read them before the projection before it has finished (kernels::ConvStep::inputs_settled);
// copies made here never are.
ConvStepResult conv_step_cuda(const at::Tensor& tails, const at::Tensor& x, const at::Tensor& weight,
                              const ConvStepGates* gates = nullptr, bool settled = false);

// The gates of one call: g and beta (fp32 [tokens, value_heads]), or the layer's projections a
// and b (bf16 [tokens, value_heads], contiguous rows) with A_log and dt_bias ([value_heads]), which
// the prepare kernel turns into g and beta as gdn_gates_reference does (no separate kernels).
struct GdnGates {
  at::Tensor g, beta;
  at::Tensor a, b, a_log, dt_bias;
  static GdnGates precomputed(const at::Tensor& g, const at::Tensor& beta) {
    GdnGates gates;
    gates.g = g, gates.beta = beta;
    return gates;
  }
  static GdnGates projections(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log, const at::Tensor& dt_bias) {
    GdnGates gates;
    gates.a = a, gates.b = b, gates.a_log = a_log, gates.dt_bias = dt_bias;
    return gates;
  }
};

// mixed: bf16 [tokens, (2 key_heads + value_heads) * 128] as the conv returns it (q, k
// normalised). With norm_weight defined, returns the layer's gated RMSNorm w * rmsnorm(o) *
// silu(z) as bf16 [tokens, value_heads * 128] (z: bf16 [tokens, value_heads, 128], any row
// stride); without, o itself as [tokens, value_heads, 128] in o_dtype: fp32, or bf16 (what FLA's
// chunk_gated_delta_rule returns: the same values rounded).
// With `carried` (decoding's prefills), the plan's sequences start from carried->before (fp32 or
// bf16 [sequences, value_heads, 128 key dims, 128 value dims], their order in the plan; zero states
// when undefined) and their states after the tokens are returned in carried->after (a new tensor,
// fp32 unless `before` is bf16, which is widened on load and rounded once on store).
struct GdnCarriedStates {
  at::Tensor before, after;
  at::ScalarType dtype = at::kFloat;  // of `after` when `before` is undefined
};
at::Tensor gated_delta_rule_cuda(const at::Tensor& mixed, int64_t key_heads, int64_t value_heads, const GdnGates& gates,
                                 const GdnChunkPlan& plan, const at::Tensor& z = {}, const at::Tensor& norm_weight = {},
                                 double eps = 1e-6, int state_columns = 64, float* stage_ms = nullptr,
                                 at::ScalarType o_dtype = at::kFloat, GdnCarriedStates* carried = nullptr);
// stage_ms (profiling; synchronises): when given, receives the milliseconds of the three
// kernels (prepare, state, output) of this call.

// A few tokens of the rule per sequence (decoding's steps and crops): q, k bf16 [G, n, key_heads,
// 128] and v bf16 [G, n, value_heads, 128] (q and k as the conv returns them, normalised here;
// read in place when each row's heads are dense and the rows evenly spaced), g and beta fp32 [G,
// n, value_heads], state fp32 or bf16 [G, value_heads, 128, 128]. Returns o (fp32 [G, n,
// value_heads, 128]) and the state after the n tokens, a new tensor of the state's dtype (`state`
// is left as it was: a crop may need it; a bf16 state is widened on load and the new one rounded
// once, the rule running in fp32). Reads and writes each state once: n is bounded by the time one
// CTA takes, not memory.
// With `norm` given, o is instead the layer's gated RMSNorm of it (fused_ops.h gated_rms_norm:
// bf16 [G * n, value_heads * 128], the same bits): z bf16 [G * n, value_heads, 128] (the rows'
// gates), weight bf16 [128]. A plain step on bf16 states forms it in the step's kernel and never
// writes o (kernels::GdnDecodeNorm).
struct GdnDecodeResult {
  at::Tensor o, state;
};
struct GdnOutputNorm {
  at::Tensor z, weight;
  double eps = 1e-6;
};
GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                                  const GdnOutputNorm* norm = nullptr);
// The same with sequence s's state [value_heads, 128, 128] (fp32 or bf16: `state_dtype`) read at
// the address state_rows[s] (int64 [sequences] on the GPU): rows of the batch tensors the
// sequences' caches hold, read where they lie instead of gathered into one batch first (a step
// whose sequences are not the last step's batch: a sequence left or joined). The new states are
// one batch [sequences, ...]. The addressed states must stay alive until the kernel has run.
GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state_rows,
                                                  at::ScalarType state_dtype, const GdnOutputNorm* norm = nullptr);

// Deferred stores (kernels::GdnDeferredStores, gdn/decode_deferred.cuh): plain steps on bf16
// states whose heads store their state every kGdnDeferTokens-th token, the tokens in between kept
// in a log per sequence and layer. The states at state_rows are updated in place as their stores
// fall due (GdnDecodeResult::state undefined); o is the one-token step's up to rounding (the states
// between stores are not rounded), and the stored states are the token-by-token steps' bits.
struct GdnDeferredRows {
  at::Tensor logs;     // int64 [sequences] on the GPU: each sequence's log of this layer (GdnDecodeLog::bytes)
  at::Tensor pending;  // int64 [sequences] on the GPU: tokens it stepped since its states were last all stored
};
GdnDecodeResult gated_delta_rule_decode_step_deferred_cuda(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const at::Tensor& g,
                                                           const at::Tensor& beta, const at::Tensor& state_rows,
                                                           const GdnDeferredRows& deferred,
                                                           const GdnOutputNorm* norm = nullptr);
// Every head's unstored tokens stored (the states at state_rows complete; pending is then 0 for
// each sequence, which the caller records).
void gated_delta_rule_store_deferred_cuda(const at::Tensor& state_rows, const GdnDeferredRows& deferred,
                                          int64_t key_heads, int64_t value_heads);

// Random inputs of one GatedDeltaNet core on `device` (the GPU tests and doctor's self-test):
// q, k L2-normalised and v in bf16 [tokens, heads, 128], g = -decay * U(0.05, 1) and beta =
// sigmoid(N(0, 1)) in fp32 [tokens, value_heads], `mixed` as the conv kernel returns it.
struct GdnInputs {
  std::vector<int64_t> cu_seqlens;
  at::Tensor q, k, v, g, beta, mixed;
};
GdnInputs random_gdn_inputs(const std::vector<int64_t>& lengths, int64_t key_heads, int64_t value_heads, double decay,
                            at::Device device);
// The kernels' o against the fp32 reference path on the same inputs: relative L2 error.
double gdn_kernel_error(const GdnInputs& in, int64_t key_heads, int64_t value_heads, at::Tensor* kernel_output = nullptr);

}  // namespace dflash::target
