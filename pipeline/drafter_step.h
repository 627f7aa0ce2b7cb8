// drafter_step.h: one optimizer step of one drafter replica, as a function that reads top to
// bottom: micro-batches (anchors drawn per sample) -> the global loss denominator -> per
// micro-batch forward, LM head + loss, backward -> the gradient sum over replicas -> the step's
// metrics summed over replicas -> AdamW. Every replica calls it once per plan step with its own
// samples; the collectives keep them in step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <mutex>
#include <vector>

#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"
#include "target/model_config.h"

namespace dflash::pipeline {

class Collective;
class StageClock;

// What a replica brings to every step (owned by the trainer, used by the replica's thread only).
struct DrafterReplica {
  int index = 0;
  drafter::Drafter* model = nullptr;
  drafter::AdamW* optimizer = nullptr;
  at::Tensor embed, head;           // the target's, frozen, on the replica's device
  at::Device device = at::kCPU;
  StageClock* clock = nullptr;
  std::mutex* gpu_turn = nullptr;   // the shared GPU's turn (gpus.shared_gpu: turns), or null
};

struct StepSettings {
  drafter::DrafterShape shape;
  target::ModelConfig target;  // for the target's share of the step's FLOPs
  double loss_gamma = 7;
  uint64_t seed = 0;            // train.seed: anchors are drawn per (seed, sample number)
  int anchors_per_sequence = 512;
  int sequences_per_micro_step = 1;
  int64_t lm_head_chunk_rows = 2048;
};

// One sequence's features as the target produced them.
struct StepSample {
  int64_t number = 0;                           // sample number across epochs
  at::Tensor features, input_ids;               // on the replica's device, ready to read
  const std::vector<uint8_t>* loss_mask = nullptr;
};

struct StepOutput {
  drafter::LossStats stats;    // summed over replicas
  drafter::StepResult result;
  int64_t tokens = 0;          // summed over replicas
  double flops = 0;            // model FLOPs of the step (target and drafter), summed over replicas
  bool empty = false;          // no replica had a block to train: no update
};

// `before_forward` runs once the denominator is agreed and the GPU's turn taken (test hooks).
StepOutput drafter_step(const DrafterReplica& replica, const StepSettings& settings,
                        const std::vector<StepSample>& samples, Collective& collective,
                        const std::function<void()>& before_forward);

}  // namespace dflash::pipeline
