#include "pipeline/streams.h"

#include <ATen/ATen.h>

#include <chrono>
#include <optional>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace dflash::pipeline {

struct WorkerStream::Impl {
#ifdef DFLASHD_WITH_CUDA
  std::optional<c10::cuda::CUDAStreamGuard> guard;
#endif
};

WorkerStream::WorkerStream(at::Device device) : impl_(std::make_unique<Impl>()) {
#ifdef DFLASHD_WITH_CUDA
  if (device.is_cuda()) impl_->guard.emplace(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, device.index()));
#else
  (void)device;
#endif
}

WorkerStream::~WorkerStream() = default;

GpuTurn::GpuTurn(std::mutex* turn, at::Device device) : device_(device) {
  if (turn != nullptr) lock_ = std::unique_lock<std::mutex>(*turn);
}

GpuTurn::~GpuTurn() {
#ifdef DFLASHD_WITH_CUDA
  if (lock_.owns_lock() && device_.is_cuda()) {
    // A CUDA error here surfaces at the worker's next call; a destructor must not throw.
    cudaStreamSynchronize(c10::cuda::getCurrentCUDAStream(device_.index()).stream());
  }
#endif
}

class ReadyEvent {
 public:
#ifdef DFLASHD_WITH_CUDA
  at::cuda::CUDAEvent event;
#endif
};

std::shared_ptr<ReadyEvent> mark_ready(at::Device device) {
#ifdef DFLASHD_WITH_CUDA
  if (device.is_cuda()) {
    auto ready = std::make_shared<ReadyEvent>();
    ready->event.record(c10::cuda::getCurrentCUDAStream(device.index()));
    return ready;
  }
#else
  (void)device;
#endif
  return nullptr;
}

void wait_ready(const std::shared_ptr<ReadyEvent>& ready, const std::vector<at::Tensor>& tensors) {
#ifdef DFLASHD_WITH_CUDA
  if (!ready) return;
  for (const at::Tensor& t : tensors) {
    if (!t.defined() || !t.is_cuda()) continue;
    const c10::cuda::CUDAStream stream = c10::cuda::getCurrentCUDAStream(t.device().index());
    ready->event.block(stream);
    t.record_stream(stream);
  }
#else
  (void)ready, (void)tensors;
#endif
}

struct StageClock::Impl {
  at::Device device = at::kCPU;
  mutable std::mutex mutex;
  std::map<std::string, double> totals;
  int64_t iterations = 0;
  // CPU: wall clock of the last mark.
  std::chrono::steady_clock::time_point last;
#ifdef DFLASHD_WITH_CUDA
  // GPU: the marks of the iteration in flight (the first is the start, unnamed).
  std::vector<std::pair<std::string, std::unique_ptr<at::cuda::CUDAEvent>>> marks;
  void resolve() {
    if (marks.size() < 2) return;
    marks.back().second->synchronize();  // one iteration old: normally long done
    std::lock_guard lock(mutex);
    for (size_t i = 1; i < marks.size(); ++i) {
      totals[marks[i].first] += marks[i - 1].second->elapsed_time(*marks[i].second) / 1e3;
    }
    ++iterations;
  }
  void mark(const std::string& stage) {
    marks.emplace_back(stage, std::make_unique<at::cuda::CUDAEvent>(cudaEventDefault));
    marks.back().second->record(c10::cuda::getCurrentCUDAStream(device.index()));
  }
#endif
};

StageClock::StageClock(at::Device device) : impl_(std::make_unique<Impl>()) { impl_->device = device; }

StageClock::~StageClock() = default;

void StageClock::start() {
#ifdef DFLASHD_WITH_CUDA
  if (impl_->device.is_cuda()) {
    impl_->resolve();
    impl_->marks.clear();
    impl_->mark("");
    return;
  }
#endif
  impl_->last = std::chrono::steady_clock::now();
  std::lock_guard lock(impl_->mutex);
  ++impl_->iterations;
}

void StageClock::lap(const std::string& stage) {
#ifdef DFLASHD_WITH_CUDA
  if (impl_->device.is_cuda()) {
    if (!impl_->marks.empty()) impl_->mark(stage);
    return;
  }
#endif
  const auto now = std::chrono::steady_clock::now();
  std::lock_guard lock(impl_->mutex);
  impl_->totals[stage] += std::chrono::duration<double>(now - impl_->last).count();
  impl_->last = now;
}

std::map<std::string, double> StageClock::totals() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->totals;
}

int64_t StageClock::iterations() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->iterations;
}

}  // namespace dflash::pipeline
