// stages.h: a target replica over several devices (pipeline parallelism). Its layers are cut
// into contiguous stages balanced by their forward cost, one TargetModel per device; the
// residual stream goes from stage to stage as x plus the pending sub-layer output, so the split
// changes no rounding: the tapped states are bit-identical to one device's (tests).
//
// Why stages first (docs/architecture.md): the target is frozen and runs forward only, so a
// pipeline has no backward bubbles; with several sequences in flight every stage works at once
// and the only traffic between GPUs is one [tokens, hidden] stream per boundary.
#pragma once

#include <condition_variable>
#include <deque>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
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
  ~StagedTarget();
  StagedTarget(const StagedTarget&) = delete;
  StagedTarget& operator=(const StagedTarget&) = delete;

  // As TargetModel::forward: the outputs of `layers` (ascending), each moved to the last stage's
  // device (where the features leave for the drafter).
  std::vector<at::Tensor> forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                  const std::vector<int64_t>& layers) const;

  // forward() in the background, so that several sequences are in flight: each stage runs on
  // its own thread (started by the first call, on its own CUDA stream), a sequence passes from
  // stage to stage, and while stage 2 runs sequence n stage 1 runs n + 1. Results arrive in
  // submission order; an exception of any stage is the future's. Callers keep at most size()
  // sequences in flight (more only queue). One caller thread at a time.
  std::future<std::vector<at::Tensor>> submit(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                              const std::vector<int64_t>& layers) const;

  size_t size() const { return stages_.size(); }
  const TargetModel& stage(size_t i) const { return *stages_[i]; }
  // Every stage, in order (an IncrementalTarget over this replica).
  std::vector<const TargetModel*> models() const;
  const std::vector<LayerRange>& ranges() const { return ranges_; }
  // Each stage's share of the forward cost (sums to 1).
  const std::vector<double>& cost_shares() const { return shares_; }
  const ModelConfig& config() const { return stages_.front()->config(); }
  const at::Tensor& embed_tokens() const { return stages_.front()->embed_tokens(); }
  const at::Tensor& lm_head() const { return stages_.back()->lm_head(); }

 private:
  // One sequence on its way through the stages.
  struct Job {
    at::Tensor input_ids;
    std::vector<int64_t> cu_seqlens, layers;
    StreamState stream;
    std::vector<at::Tensor> tapped;
    std::promise<std::vector<at::Tensor>> result;
  };
  void stage_loop(size_t stage) const;
  void push(size_t stage, std::shared_ptr<Job> job) const;

  std::vector<LayerRange> ranges_;
  std::vector<double> shares_;
  std::vector<std::unique_ptr<TargetModel>> stages_;

  // The stage threads and the queue in front of each; guarded by mutex_ (threads_ is started
  // by the first submit and joined by the destructor).
  mutable std::mutex mutex_;
  mutable std::condition_variable changed_;
  mutable std::vector<std::deque<std::shared_ptr<Job>>> queues_;
  mutable std::vector<std::thread> threads_;
  mutable bool stopping_ = false;
};

// The staged counterparts of load_target and random_target (a run plans at data.max_length, as
// its memory plan does).
std::unique_ptr<StagedTarget> load_staged_target(const std::string& model_dir, int64_t last_layer,
                                                 const std::vector<TargetOptions>& stages, int64_t plan_tokens = 4096);
std::unique_ptr<StagedTarget> random_staged_target(const ModelConfig& config, int64_t last_layer,
                                                   const std::vector<TargetOptions>& stages, uint64_t seed,
                                                   int64_t plan_tokens = 4096);

}  // namespace dflash::target
