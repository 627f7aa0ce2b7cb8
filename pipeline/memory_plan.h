// memory_plan.h: what a run keeps on each GPU, estimated from the configs before anything is
// loaded, for `dflashd validate` and the startup log: a plan that does not fit is refused with
// its numbers instead of failing with an out-of-memory error minutes or hours in.
//
// Per GPU (bytes; a GPU in both groups carries both roles' lines):
//   target weights     every layer up to the deepest tapped one, the embedding and the LM head,
//                      in target.dtype (one replica per target GPU)
//   target activations one forward of data.max_length tokens: the widest layer's intermediate
//                      tensors (x3 for inputs, outputs and the transient), the tapped states;
//                      with FP8 experts, a layer's experts in bf16 on a GPU where the FP8
//                      grouped GEMM does not run (or is not known to)
//   drafter state      parameters and gradients in target.dtype, fp32 master weights (shared
//                      with the parameters in fp32) and the two AdamW moments; the target's
//                      embedding and LM head when the GPU holds no target
//   queued features    (queues.features + train.sequences_per_step) items of data.max_length
//                      x K x hidden in target.dtype
//   drafter activations one micro-step: per layer the block rows' saved tensors (anchors x block
//                      x sequences_per_step rows) and the context's keys and values; one
//                      LM-head chunk's fp32 logits and their gradient
// An estimate: the caching allocator's fragmentation and libraries' workspaces come on top,
// which is why a plan needs headroom (kHeadroom) to pass.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "drafter/drafter_config.h"
#include "target/model_config.h"

namespace dflash::pipeline {

struct GpuMemoryPlan {
  int gpu = 0;
  bool target = false, drafter = false;  // which roles it carries
  std::string target_layers;             // a target replica's pipeline stages on it: " L0-15" (empty: all layers)
  int64_t target_weights = 0, target_activations = 0;
  int64_t drafter_state = 0, queued_features = 0, drafter_activations = 0;
  bool activations_checkpointed = false;  // train.activation_checkpointing (drafter_activations counts it)
  // Evaluation (the eval section, on target replica 0's GPU): its copy of the drafter and the
  // decoding caches of eval.max_batch sequences of up to data.max_length + eval.max_new_tokens
  // positions (target/decode_plan.h, the GatedDeltaNet states at target.decode_state_dtype).
  int64_t eval_decoding = 0;
  int64_t capacity = 0;  // the GPU's memory, 0 when unknown (offline, or a CPU run)
  int64_t total() const {
    return target_weights + target_activations + drafter_state + queued_features + drafter_activations + eval_decoding;
  }
};

// A plan needs this share of a GPU's memory at most (the rest: fragmentation, CUDA context,
// cuBLAS / cuDNN workspaces, NCCL buffers).
inline constexpr double kHeadroom = 0.92;

// One row per distinct GPU id of the groups (CPU runs: per replica id). `capacities`: bytes per
// CUDA device index (empty: unknown). `grouped_fp8`: per device index, whether an FP8 target's
// experts run there on the FP8 grouped GEMM (gpu_memory.h: grouped_fp8_gpus); a GPU it does not
// say so of (unknown: offline) is counted with the bf16 copy of a layer's experts that the
// forward dequantizes without that kernel.
std::vector<GpuMemoryPlan> plan_memory(const config::Config& config, const target::ModelConfig& target,
                                       const drafter::DrafterShape& shape, const std::vector<int64_t>& capacities,
                                       const std::vector<bool>& grouped_fp8 = {});

// The table for the log and `dflashd validate`, one line per GPU, in GB.
std::string format_memory_plan(const std::vector<GpuMemoryPlan>& plan);

// One message per GPU whose plan exceeds kHeadroom of its capacity, with the numbers and what
// to change; empty when everything fits (or capacities are unknown).
std::vector<std::string> memory_plan_problems(const std::vector<GpuMemoryPlan>& plan);

}  // namespace dflash::pipeline
