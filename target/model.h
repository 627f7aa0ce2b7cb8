// model.h: the frozen target model, run forward up to its deepest tapped layer.
//
// One class serves the four families (qwen3_5, qwen3_next / qwen3_5_moe, qwen3, llama): they
// differ in the mixer of each layer (gated full attention, plain attention, GatedDeltaNet),
// the MLP (dense SwiGLU or MoE with a shared expert) and the norm (zero-centred or not), all
// read from ModelConfig. Only the layers up to the deepest tapped one are loaded.
//
// Batches are packed: the tokens of all sequences concatenated, with cu_seqlens offsets;
// attention, the conv window and the GatedDeltaNet state never cross a sequence boundary.
// forward() runs under inference mode and keeps no autograd state. A TargetModel is used by
// one thread at a time (its worker); different replicas may run in different threads.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/kernel_path.h"
#include "target/model_config.h"
#include "target/stage_plan.h"
#include "target/weights.h"

namespace dflash::target {

struct TargetOptions {
  at::Device device = at::kCPU;
  at::ScalarType dtype = at::kFloat;  // the activations' (and the weights' unless fp8_weights)
  // The GatedDeltaNet reference path on a GPU is refused unless allowed (it is ~10x slower).
  bool allow_slow_path = false;
  // Which GatedDeltaNet implementation: the kernels where they can run (automatic), the kernels
  // or a refusal (kernels), or the reference path (reference; tests and benchmarks). The
  // reference path on a GPU still needs allow_slow_path.
  enum class GdnPath { automatic, kernels, reference };
  GdnPath gdn_path = GdnPath::automatic;
  // Which MoE implementation (moe.h): grouped GEMMs with device routing on a GPU, the reference
  // host loop on the CPU (automatic); grouped or reference forces one (tests, benchmarks). The
  // reference path on a GPU (about 5x slower at 35B-A3B shapes) still needs allow_slow_path.
  enum class MoePath { automatic, grouped, reference };
  MoePath moe_path = MoePath::automatic;
  // The attention, GatedDeltaNet and dense MLP projections kept block-scaled FP8 and run as FP8
  // GEMMs (fp8.h; target.dtype: float8, with dtype bf16). A checkpoint's own 128x128 FP8 blocks
  // are kept as they are; anything else is quantised at load.
  bool fp8_weights = false;
  // The dtype the GatedDeltaNet recurrent states are kept in between decoding steps
  // (IncrementalTarget; target.decode_state_dtype): fp32, as transformers keeps them, or bf16,
  // half the memory and half the state traffic of a decode step (the rule still runs in fp32:
  // the state is rounded once per step), as vLLM keeps them by default (its mamba cache dtype
  // follows the model's).
  at::ScalarType decode_state_dtype = at::kFloat;
};

// The config's word for o.decode_state_dtype ("float32" or "bfloat16": logs, metrics, records).
inline const char* decode_state_dtype_name(const TargetOptions& o) {
  return o.decode_state_dtype == at::kBFloat16 ? "bfloat16" : "float32";
}

// Raised when a layer would run a path the options do not allow; names the layer and the fix.
using dflash::SlowPathRefused;

// The residual stream between two pipeline stages (stages.h): the stream x and the last
// sub-layer's output not yet added to it (the next stage adds it, fused with its first norm, as
// one model would: a split changes no rounding).
struct StreamState {
  at::Tensor x, pending;
};

class TargetModel {
 public:
  // Builds layers 0..last_layer (inclusive) plus the embedding, final norm and LM head.
  TargetModel(ModelConfig config, WeightSource& weights, int64_t last_layer, TargetOptions options);
  // Builds the part `range` says (a pipeline stage).
  TargetModel(ModelConfig config, WeightSource& weights, LayerRange range, TargetOptions options);
  ~TargetModel();

  // input_ids: int64 [tokens] (any device); cu_seqlens: B+1 offsets. Returns the output of each
  // requested decoder layer (ascending ids, each <= last_layer) as [tokens, hidden] in the
  // model dtype on the model's device.
  std::vector<at::Tensor> forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                  const std::vector<int64_t>& layers) const;
  // A pipeline stage's part of forward(): from the token ids (the stage holding layer 0) or the
  // previous stage's stream (moved to this stage's device here), this stage's layers; the outputs
  // of the requested layers within its range (ascending) are appended to *tapped. Returns the
  // stream after its last layer.
  StreamState forward_stage(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                            const StreamState& in, const std::vector<int64_t>& layers,
                            std::vector<at::Tensor>* tapped) const;

  const ModelConfig& config() const { return config_; }
  const TargetOptions& options() const { return options_; }
  int64_t first_layer() const { return first_layer_; }
  int64_t last_layer() const;
  // Throw std::logic_error on a stage that does not hold them (LayerRange).
  const at::Tensor& embed_tokens() const;       // [vocab, hidden]
  const at::Tensor& lm_head() const;            // [vocab, hidden] (the embedding when tied)
  const at::Tensor& final_norm_weight() const;  // [hidden]
  // Which implementation each layer kind runs, by component: "target.full_attention" (sdpa),
  // "target.linear_attention" (kernels or reference), "target.moe" (grouped or reference),
  // "target.projections" (bf16 / fp16 / fp32 GEMMs, fp8, or fp8 emulated).
  std::map<std::string, KernelPath> kernel_paths() const;
  // The bytes this model's weights hold on its device.
  int64_t weight_bytes() const;

 private:
  friend class IncrementalTarget;  // incremental.h: the same layers over a decoding cache
  struct Impl;
  // Layers first_layer_..through from `in` (or the embedding of the ids), tapping `layers`.
  StreamState run_layers(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens, const StreamState& in,
                         int64_t through, const std::vector<int64_t>& layers, std::vector<at::Tensor>* tapped) const;
  ModelConfig config_;
  TargetOptions options_;
  int64_t first_layer_ = 0;
  bool gdn_kernels_ = false;  // the GatedDeltaNet layers run the CUDA kernels
  bool grouped_moe_ = false;  // the MoE layers run moe_grouped
  bool fp8_gemms_ = false;    // the FP8 projections run the block-scaled GEMM (else emulated)
  std::unique_ptr<Impl> impl_;
};

// Loads a target from a Hugging Face directory or initialises it randomly from a config.
std::unique_ptr<TargetModel> load_target(const std::string& model_dir, int64_t last_layer, TargetOptions options);
// The startup log's line on a block-scaled FP8 checkpoint (nothing for an unquantized one).
void log_quantization(const CheckpointWeights& weights, const TargetOptions& options);
// The seed of a run's random target weights (target.weights: random, presets) for train.seed:
// the trainer, `dflashd eval --preset / --random-weights` and tests build the same target.
inline uint64_t run_target_seed(int64_t train_seed) { return 0x7a11 ^ static_cast<uint64_t>(train_seed); }
std::unique_ptr<TargetModel> random_target(const ModelConfig& config, int64_t last_layer, TargetOptions options,
                                           uint64_t seed);

}  // namespace dflash::target
