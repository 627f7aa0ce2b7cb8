// layers.h: the target's weights per decoder layer, as loaded (private to target/): the
// full forward (model.cc) and the incremental one read the same structures.
#pragma once

#include <ATen/ATen.h>

#include <string>

#include "target/fp8.h"
#include "target/model_config.h"
#include "target/moe.h"
#include "target/weights.h"

namespace dflash::target {

// Rows up to which a bf16 projection on a GPU runs through cuBLASLt with a large workspace
// (lt_gemm.h: decode and verify steps, short prefills), ATen's matmul above.
inline constexpr int64_t kCublasLtRows = 1024;

// A projection: weight in the model dtype, or (an FP8 target) block-scaled FP8 weights (fp8.h).
struct Linear {
  at::Tensor weight;  // [out, in]; undefined when fp8 holds it
  Fp8Weight fp8;      // target.dtype: float8
  at::Tensor bias;    // undefined when absent
  at::Tensor operator()(const at::Tensor& x) const;
  // Rows quantised already go straight to the FP8 GEMM (their producer knew this projection's
  // weights were FP8: reads_fp8).
  at::Tensor operator()(const GemmInput& in) const {
    return in.fp8.defined() ? fp8_linear(in.fp8, fp8, bias) : (*this)(in.x);
  }
  bool reads_fp8() const { return fp8.defined(); }
  // For a SwiGLU's stacked gate_up ([gate; up] rows): silu(x . gate^T) * (x . up^T), in one fused
  // GEMM where the stream-K GEMM takes the product (lt_gemm.h), else the product then silu_mul
  // (rounded alike; the fused products' fp32 sums in another order).
  at::Tensor silu_mul_of(const GemmInput& in) const;
  // The same as down_proj's FP8 input: the product on the FP8 GEMM, then silu_mul_fp8 (one pass
  // that writes h quantised).
  Fp8Activations silu_mul_fp8_of(const GemmInput& in) const;
  int64_t bytes() const;  // what the weights hold on the device
};

struct Attention {
  Linear qkv, o;              // q_proj, k_proj, v_proj concatenated at load (one GEMM)
  at::Tensor q_norm, k_norm;  // [head_dim], undefined without qk norm
};

struct GatedDeltaNet {
  // The input projections concatenated at load, one GEMM: [qkv | z | b | a] (qwen3_5 layout) or
  // [qkvz | ba] (qwen3_next layout, grouped per key head); the forward takes column slices.
  Linear in_proj;
  at::Tensor conv;  // [channels, kernel]
  at::Tensor a_log, dt_bias, norm;
  Linear out;
};

struct Mlp {
  Linear gate_up, down;  // dense SwiGLU: gate_proj and up_proj concatenated at load (one GEMM)
  MoeWeights experts;    // MoE layers (moe.h): router, experts in the grouped layout, shared expert
  bool moe = false;
};

struct Layer {
  LayerKind kind;
  at::Tensor input_norm, post_attention_norm;
  Attention attention;
  GatedDeltaNet gdn;
  Mlp mlp;
  // Whether the GEMM after input_norm / post_attention_norm reads FP8, so the norm quantises its
  // rows as it writes them (an MoE block's router and experts read bf16).
  bool mixer_reads_fp8() const {
    return kind == LayerKind::full_attention ? attention.qkv.reads_fp8() : gdn.in_proj.reads_fp8();
  }
  bool mlp_reads_fp8() const { return !mlp.moe && mlp.gate_up.reads_fp8(); }
};

// Decoder layer i's weights from `w` (names and layouts: docs/targets.md); projections that run
// as one GEMM are concatenated here. With fp8, the attention, GatedDeltaNet and dense MLP
// projections and the MoE experts are kept block-scaled FP8 (the router, shared expert, norms
// and conv in opts' dtype).
Layer load_layer(const ModelConfig& c, WeightSource& w, int64_t i, const at::TensorOptions& opts, bool fp8);

// The device bytes of a layer's weights.
int64_t layer_bytes(const Layer& layer);

// RoPE inverse frequencies [rotary_dim / 2] fp32 on the CPU (Llama 3.1 scaling applied).
at::Tensor compute_inv_freq(const ModelConfig& c);

}  // namespace dflash::target
