// replicas.h: the models of a run on their devices, built once at start: one target replica per
// entry of gpus.target (an id: one GPU; a list of ids: pipeline stages over those GPUs,
// target/stages.h) and one drafter replica per id of gpus.drafter, each with its stage clock;
// a drafter replica also holds its optimizer (made once the plan knows its steps), the target's
// frozen embedding and LM head on its device, and the shared GPU's turn when a target shares it
// (gpus.shared_gpu: turns).
//
// Decided here once per device and reported by the caller: each target layer kind's kernel path
// (refused slow paths throw), the drafter's initial weights (random, or drafter.init: an exported
// drafter or a checkpoint of the configured shape), and drafter.attention.
//
// Ownership: the trainer owns the Replicas; each worker thread uses its own replica only.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/kernel_path.h"
#include "config/config.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"
#include "pipeline/drafter_step.h"
#include "pipeline/streams.h"
#include "target/model.h"
#include "target/stages.h"

namespace dflash::pipeline {

struct Replicas {
  std::vector<std::unique_ptr<target::StagedTarget>> targets;  // one stage when on one GPU
  std::vector<std::unique_ptr<StageClock>> target_clocks;
  std::vector<std::unique_ptr<drafter::Drafter>> drafters;
  std::vector<std::unique_ptr<drafter::AdamW>> optimizers;  // empty until add_optimizers()
  std::vector<std::unique_ptr<StageClock>> drafter_clocks;
  std::vector<at::Device> drafter_devices;
  std::vector<DrafterReplica> drafter;  // what each drafter replica brings to drafter_step()
  std::map<int, std::unique_ptr<std::mutex>> gpu_turns;  // GPUs that run both roles in turns
  KernelPath attention;  // drafter.attention as decided (the same on every drafter GPU of a run)

  // The turn of `device` when both roles share it, else null.
  std::mutex* turn_of(at::Device device) const;
};

// Targets (checkpoint or random weights), drafters (random init, then drafter.init) with the
// attention decided. Throws with the file, key or GPU on bad input or a refused slow path.
std::unique_ptr<Replicas> build_replicas(const config::Config& config, const target::ModelConfig& target,
                                         const drafter::DrafterShape& shape);
// One AdamW per drafter replica for a plan of `total_steps` (train.* settings), and the
// DrafterReplica views.
// How the drafter keeps its activations for backward (train.activation_checkpointing), as the
// other implementation choices are reported: component "drafter.activations", path "checkpointed"
// or "kept".
KernelPath activations_path(const config::TrainConfig& train);

void add_optimizers(Replicas& replicas, const config::TrainConfig& train, int64_t total_steps);

// The device of GPU `id` of the gpus section: cuda:id, or the CPU under gpus.device: cpu (where the
// ids only name replicas).
at::Device device_for(const config::GpuConfig& gpus, int id);

// The model dtype of target.dtype (validated by the config: bfloat16, float16 or float32).
at::ScalarType model_dtype(config::ModelDtype dtype);

}  // namespace dflash::pipeline
