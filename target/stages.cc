#include "target/stages.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#ifdef DFLASHD_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

#include <algorithm>
#include <optional>
#include <stdexcept>

#include "common/log.h"
#include "target/weights.h"

namespace dflash::target {
namespace {

// A stage thread's own CUDA stream on a GPU (nothing on the CPU), and the wait for its work
// before a result leaves the thread.
class StageStream {
 public:
  explicit StageStream(at::Device device) : device_(device) {
#ifdef DFLASHD_WITH_CUDA
    if (device.is_cuda()) guard_.emplace(c10::cuda::getStreamFromPool(false, device.index()));
#endif
  }
  void finish() const {
#ifdef DFLASHD_WITH_CUDA
    if (device_.is_cuda()) c10::cuda::getCurrentCUDAStream(device_.index()).synchronize();
#endif
  }

 private:
  at::Device device_;
#ifdef DFLASHD_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard_;
#endif
};

}  // namespace

StagedTarget::StagedTarget(const ModelConfig& config, WeightSource& weights, int64_t last_layer,
                           const std::vector<TargetOptions>& stages, int64_t plan_tokens) {
  if (last_layer < 0 || last_layer >= config.num_layers) {
    throw std::invalid_argument(config.source + ": layer " + std::to_string(last_layer) + " requested but the model has " +
                                std::to_string(config.num_layers) + " layers");
  }
  ranges_ = plan_target_stages(config, last_layer, stages.size(), plan_tokens, &shares_);
  for (size_t s = 0; s < stages.size(); ++s) {
    stages_.push_back(std::make_unique<TargetModel>(config, weights, ranges_[s], stages[s]));
    log::info("target stage {}: layers {}..{} on {} ({} % of the forward)", s, ranges_[s].first, ranges_[s].last,
              stages[s].device.str(), static_cast<int>(100 * shares_[s] + 0.5));
  }
}

StagedTarget::~StagedTarget() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  for (std::thread& t : threads_) t.join();
}

std::future<std::vector<at::Tensor>> StagedTarget::submit(const at::Tensor& input_ids,
                                                          const std::vector<int64_t>& cu_seqlens,
                                                          const std::vector<int64_t>& layers) const {
  auto job = std::make_shared<Job>();
  job->input_ids = input_ids;
  job->cu_seqlens = cu_seqlens;
  job->layers = layers;
  std::future<std::vector<at::Tensor>> result = job->result.get_future();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (threads_.empty()) {
      queues_.resize(stages_.size());
      for (size_t s = 0; s < stages_.size(); ++s) threads_.emplace_back([this, s] { stage_loop(s); });
    }
  }
  push(0, std::move(job));
  return result;
}

void StagedTarget::push(size_t stage, std::shared_ptr<Job> job) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    queues_[stage].push_back(std::move(job));
  }
  changed_.notify_all();
}

void StagedTarget::stage_loop(size_t s) const {
  c10::InferenceMode inference;
  const TargetModel& stage = *stages_[s];
  const at::Device device = stage.options().device;
  const StageStream stream(device);
  while (true) {
    std::shared_ptr<Job> job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      changed_.wait(lock, [&] { return stopping_ || !queues_[s].empty(); });
      if (queues_[s].empty()) return;  // stopping, nothing left
      job = std::move(queues_[s].front());
      queues_[s].pop_front();
    }
    try {
      if (job->layers.empty() || stage.first_layer() <= job->layers.back()) {
        job->stream = stage.forward_stage(job->input_ids, job->cu_seqlens, job->stream, job->layers, &job->tapped);
      }
      // The next stage reads this one's results from another thread and stream: hand them over
      // finished.
      stream.finish();
      if (s + 1 < stages_.size()) {
        push(s + 1, std::move(job));
        continue;
      }
      for (at::Tensor& t : job->tapped) t = t.to(device);
      stream.finish();
      job->result.set_value(std::move(job->tapped));
    } catch (...) {
      job->result.set_exception(std::current_exception());
    }
  }
}

std::vector<const TargetModel*> StagedTarget::models() const {
  std::vector<const TargetModel*> out;
  for (const auto& stage : stages_) out.push_back(stage.get());
  return out;
}

std::vector<at::Tensor> StagedTarget::forward(const at::Tensor& input_ids, const std::vector<int64_t>& cu_seqlens,
                                              const std::vector<int64_t>& layers) const {
  const int64_t last = stages_.back()->last_layer();
  for (size_t i = 0; i < layers.size(); ++i) {
    if (layers[i] < 0 || layers[i] > last || (i > 0 && layers[i] <= layers[i - 1])) {
      throw std::invalid_argument("target forward: tapped layers must ascend within 0.." + std::to_string(last) +
                                  ", got " + std::to_string(layers[i]));
    }
  }
  std::vector<at::Tensor> tapped;
  StreamState stream;
  for (const auto& stage : stages_) {
    if (!layers.empty() && stage->first_layer() > layers.back()) break;  // nothing left to tap
    stream = stage->forward_stage(input_ids, cu_seqlens, stream, layers, &tapped);
  }
  const at::Device to = stages_.back()->options().device;
  for (at::Tensor& t : tapped) t = t.to(to);
  return tapped;
}

std::unique_ptr<StagedTarget> load_staged_target(const std::string& model_dir, int64_t last_layer,
                                                 const std::vector<TargetOptions>& stages, int64_t plan_tokens) {
  CheckpointWeights weights(model_dir);
  log_quantization(weights, stages.front());
  return std::make_unique<StagedTarget>(load_model_config(model_dir), weights, last_layer, stages, plan_tokens);
}

std::unique_ptr<StagedTarget> random_staged_target(const ModelConfig& config, int64_t last_layer,
                                                   const std::vector<TargetOptions>& stages, uint64_t seed,
                                                   int64_t plan_tokens) {
  RandomWeights weights(seed);
  return std::make_unique<StagedTarget>(config, weights, last_layer, stages, plan_tokens);
}

}  // namespace dflash::target
