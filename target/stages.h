// stages.h: a target replica over several devices (pipeline parallelism). Its layers are cut
// into contiguous stages balanced by their forward cost, one TargetModel per device; the
// residual stream goes from stage to stage as x plus the pending sub-layer output, so the split
// changes no rounding: the tapped states are bit-identical to one device's (tests).
//
// Why stages first (docs/architecture.md): the target is frozen and runs forward only, so a
// pipeline has no backward bubbles; with several sequences in flight every stage works at once
// and the only traffic between GPUs is one [tokens, hidden] stream per boundary.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "target/model.h"
#include "target/stage_plan.h"

namespace dflash::target {

class StagedTarget {
 public:
  // Layers 0..last_layer over one stage per entry of `stages` (device and dtype per stage),
  // planned with layer_costs at `plan_tokens`. The first stage holds the embedding, the last the
  // final norm and LM head.
  StagedTarget(const ModelConfig& config, WeightSource& weights, int64_t last_layer,
               const std::vector<TargetOptions>& stages, int64_t plan_tokens = 4096);

  // As TargetModel::forward: the outputs of `layers` (ascending), each moved to the last stage's
  // device (where the features leave for the drafter).
  std::vector<at::Tensor> forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                  const std::vector<int64_t>& layers) const;

  size_t size() const { return stages_.size(); }
  const TargetModel& stage(size_t i) const { return *stages_[i]; }
  const std::vector<LayerRange>& ranges() const { return ranges_; }
  // Each stage's share of the forward cost (sums to 1).
  const std::vector<double>& cost_shares() const { return shares_; }
  const ModelConfig& config() const { return stages_.front()->config(); }
  const at::Tensor& embed_tokens() const { return stages_.front()->embed_tokens(); }
  const at::Tensor& lm_head() const { return stages_.back()->lm_head(); }

 private:
  std::vector<LayerRange> ranges_;
  std::vector<double> shares_;
  std::vector<std::unique_ptr<TargetModel>> stages_;
};

// The staged counterparts of load_target and random_target.
std::unique_ptr<StagedTarget> load_staged_target(const std::string& model_dir, int64_t last_layer,
                                                 const std::vector<TargetOptions>& stages);
std::unique_ptr<StagedTarget> random_staged_target(const ModelConfig& config, int64_t last_layer,
                                                   const std::vector<TargetOptions>& stages, uint64_t seed);

}  // namespace dflash::target
