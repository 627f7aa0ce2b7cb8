#include "pipeline/drafter_step.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <optional>
#include <random>

#include "pipeline/collective.h"
#include "pipeline/dataset.h"
#include "pipeline/flops.h"
#include "pipeline/streams.h"

namespace dflash::pipeline {
namespace {

struct MicroBatches {
  std::vector<drafter::DrafterBatch> batches;
  std::vector<drafter::BlockTargets> targets;
  double weight = 0;  // this replica's loss denominator
  int64_t tokens = 0;
  double flops = 0;
};

// Micro-batches of sequences_per_micro_step samples, packed; anchors drawn again for every
// step from (train.seed, sample number).
MicroBatches make_micro_batches(const DrafterReplica& r, const StepSettings& s, const std::vector<StepSample>& samples) {
  MicroBatches m;
  const int64_t block = s.shape.block_size;
  const size_t per_micro = static_cast<size_t>(s.sequences_per_micro_step);
  for (size_t i = 0; i < samples.size(); i += per_micro) {
    drafter::DrafterBatch batch;
    std::vector<at::Tensor> features, ids;
    std::vector<uint8_t> mask;
    batch.cu_seqlens = {0};
    for (size_t j = i; j < std::min(samples.size(), i + per_micro); ++j) {
      const StepSample& sample = samples[j];
      std::mt19937_64 rng(mix64(s.seed ^ mix64(static_cast<uint64_t>(sample.number))));
      batch.anchors.push_back(drafter::sample_anchors(*sample.loss_mask, s.anchors_per_sequence, rng));
      features.push_back(sample.features);
      ids.push_back(sample.input_ids);
      mask.insert(mask.end(), sample.loss_mask->begin(), sample.loss_mask->end());
      const int64_t tokens = sample.input_ids.size(0);
      batch.cu_seqlens.push_back(batch.cu_seqlens.back() + tokens);
      const at::Tensor& anchors = batch.anchors.back();  // int64 on the CPU
      m.flops += drafter_flops(s.shape, tokens,
                               std::vector<int64_t>(anchors.data_ptr<int64_t>(), anchors.data_ptr<int64_t>() + anchors.numel()));
      m.flops += target_flops(s.target, s.shape.target_layer_ids.back(), tokens);
      m.tokens += tokens;
    }
    batch.features = at::cat(features);
    batch.input_ids = at::cat(ids);
    batch.loss_mask = at::tensor(mask, at::TensorOptions().dtype(at::kByte));
    m.targets.push_back(drafter::make_block_targets(batch, block, s.loss_gamma, r.device));
    m.weight += m.targets.back().weight_sum;
    m.batches.push_back(std::move(batch));
  }
  return m;
}

// Each replica's gradients replaced by their sum over replicas (each replica's loss is already
// divided by the global denominator, so the sum is the gradient of the global loss).
void sum_gradients(const DrafterReplica& r, Collective& collective) {
  std::vector<at::Tensor> grads;
  for (const auto& [name, p] : r.model->parameters()) grads.push_back(p.grad().defined() ? p.grad() : at::zeros_like(p));
  collective.sum_gradients(r.index, grads);
  size_t g = 0;
  for (const auto& [name, p] : r.model->parameters()) p.mutable_grad() = grads[g++];
}

// The step's metrics summed over replicas in one exchange: loss sum, tokens, FLOPs, and per
// block position the correct predictions and their count.
void sum_metrics(const DrafterReplica& r, int64_t block, Collective& collective, StepOutput* out) {
  drafter::LossStats& stats = out->stats;
  stats.correct.resize(block, 0);
  stats.count.resize(block, 0);
  std::vector<double> local{stats.loss_sum, static_cast<double>(out->tokens), out->flops};
  local.insert(local.end(), stats.correct.begin(), stats.correct.end());
  local.insert(local.end(), stats.count.begin(), stats.count.end());
  const std::vector<double> global = collective.sum(r.index, std::move(local));
  stats.loss_sum = global[0];
  out->tokens = static_cast<int64_t>(global[1]);
  out->flops = global[2];
  for (int64_t k = 0; k < block; ++k) {
    stats.correct[k] = static_cast<int64_t>(global[3 + k]);
    stats.count[k] = static_cast<int64_t>(global[3 + block + k]);
  }
}

}  // namespace

StepOutput drafter_step(const DrafterReplica& r, const StepSettings& s, const std::vector<StepSample>& samples,
                        Collective& collective, const std::function<void()>& before_forward) {
  StepOutput out;
  StageClock& clock = *r.clock;
  const int64_t block = s.shape.block_size;
  r.optimizer->zero_grad();
  MicroBatches micro = make_micro_batches(r, s, samples);
  out.tokens = micro.tokens;
  out.flops = micro.flops;
  // The global denominator: all replicas, all micro-steps (known before any forward).
  const double global_weight = collective.sum(r.index, micro.weight);
  // The shared GPU's turn, taken once every replica holds its samples, so that no replica waits
  // with the GPU for a target that needs it.
  const GpuTurn turn(r.gpu_turn, r.device);
  clock.start();
  if (before_forward) before_forward();
  for (size_t i = 0; i < micro.batches.size(); ++i) {
    drafter::LossStats micro_stats;
    const at::Tensor hidden = r.model->forward(micro.batches[i], r.embed);
    clock.lap("drafter_forward");
    const at::Tensor loss = drafter::dflash_loss(hidden, r.head, micro.targets[i], global_weight, s.lm_head_chunk_rows,
                                                 block, &micro_stats);
    clock.lap("lm_head_loss");
    // A micro-batch without a block (its samples had no anchor) has nothing to differentiate.
    if (loss.requires_grad()) loss.backward();
    clock.lap("backward");
    out.stats.add(micro_stats);
  }
  sum_gradients(r, collective);
  clock.lap("gradient_allreduce");
  sum_metrics(r, block, collective, &out);
  out.stats.weight_sum = global_weight;
  clock.lap("metrics_exchange");
  if (global_weight > 0) {
    out.result = r.optimizer->step();
  } else {
    // No replica had a supervised block in this step: no update (AdamW would still move the
    // weights by its moments); the step counts as done.
    r.optimizer->zero_grad();
    out.result = drafter::StepResult{0, 0, true};
    out.empty = true;
  }
  clock.lap("optimizer");
  return out;
}

}  // namespace dflash::pipeline
