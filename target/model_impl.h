// model_impl.h: the target's state and the layer pieces its two forwards share (private to
// target/): the full forward over packed sequences (model.cc) and the incremental one over a
// decoding cache (incremental.cc).
#pragma once

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "target/fused_ops.h"
#include "target/layers.h"
#include "target/model.h"

namespace dflash::target {

struct TargetModel::Impl {
  at::Tensor embed, head, final_norm;
  at::Tensor inv_freq;  // [rotary_dim / 2] fp32
  std::vector<Layer> layers;
};

// An attention layer's q (after q_norm and RoPE), k (k_norm, RoPE), v and, for gated attention,
// the output gate, from one GEMM over x [tokens, hidden]: q [tokens, Hq, d], k and v [tokens,
// Hkv, d], gate a view [tokens, Hq, d] (undefined without gating).
struct AttentionQkv {
  at::Tensor q, k, v, gate;
};
AttentionQkv project_attention(const ModelConfig& c, const Attention& p, const GemmInput& x, const at::Tensor& cos,
                               const at::Tensor& sin);

// o_proj of an attention layer's output `out` [tokens, Hq d], gated first by `gate` (the view
// project_attention returns; undefined: no gate, or the output is gated already). For an FP8
// o_proj the gate writes its quantised input itself (sigmoid_gate_fp8).
at::Tensor attention_output(const Attention& p, const at::Tensor& out, const at::Tensor& gate);

// A GatedDeltaNet layer's input projection split into the conv's input [tokens, 2 Hk dk + Hv dv]
// ([all q | all k | all v] channels), z [tokens, Hv, dv] and the gate projections b, a [tokens, Hv].
struct GdnProjections {
  at::Tensor mixed, z, b, a;
};
GdnProjections project_gdn(const ModelConfig& c, const GatedDeltaNet& p, const GemmInput& x);

// The layer's output from the rule's o (fp32 [tokens, Hv, dv]): w * rmsnorm(o) (cast to `dtype`
// first, as HF) * silu(z), then out_proj.
at::Tensor gdn_output(const ModelConfig& c, const GatedDeltaNet& p, const at::Tensor& o, const at::Tensor& z,
                      at::ScalarType dtype);

// The MLP (dense SwiGLU or MoE) of one layer.
at::Tensor mlp_forward(const ModelConfig& c, const Mlp& p, const GemmInput& x, bool grouped_moe);

// The residual stream of a forward: x plus `pending`, the last sub-layer's output not yet added;
// each add is fused with the RMSNorm that reads its result (fused_ops.h).
class ResidualStream {
 public:
  ResidualStream(at::Tensor x, const ModelConfig& c) : x_(std::move(x)), c_(c) {}
  // A stream continued from another stage's (StreamState: x and the pending sub-layer output).
  ResidualStream(at::Tensor x, at::Tensor pending, const ModelConfig& c)
      : x_(std::move(x)), pending_(std::move(pending)), c_(c) {}
  StreamState state() const { return {x_, pending_}; }
  // The next sub-layer's input: rms_norm(x + pending) with `weight` (x takes the sum).
  at::Tensor add_and_norm(const at::Tensor& weight) {
    if (!pending_.defined()) return rms_norm_rows(x_, weight, c_.rms_norm_eps, c_.zero_centred_norm);
    auto [sum, normed] = add_rms_norm(x_, pending_, weight, c_.rms_norm_eps, c_.zero_centred_norm);
    x_ = std::move(sum);
    pending_ = at::Tensor();
    return normed;
  }
  // add_and_norm for a GEMM input: with fp8 (the GEMM's weights are FP8) the norm writes the rows
  // quantised for it (add_rms_norm_fp8), else as add_and_norm.
  GemmInput add_and_norm(const at::Tensor& weight, bool fp8) {
    if (!fp8) return add_and_norm(weight);
    auto [sum, quantised] = add_rms_norm_fp8(x_, pending_.defined() ? &pending_ : nullptr, weight, c_.rms_norm_eps,
                                             c_.zero_centred_norm);
    x_ = std::move(sum);
    pending_ = at::Tensor();
    return quantised;
  }
  // A sub-layer's output, added by the next add_and_norm (or output()).
  void push(at::Tensor delta) { pending_ = std::move(delta); }
  // The stream with everything added: a layer's output.
  const at::Tensor& output() {
    if (pending_.defined()) x_ = x_ + pending_, pending_ = at::Tensor();
    return x_;
  }

 private:
  at::Tensor x_, pending_;
  const ModelConfig& c_;
};

// RoPE cos / sin [tokens, rotary] in `dtype` for absolute positions (int64 [tokens]).
std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& inv_freq, const at::Tensor& positions,
                                              at::ScalarType dtype);

}  // namespace dflash::target
