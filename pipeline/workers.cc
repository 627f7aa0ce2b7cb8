#include "pipeline/workers.h"

#include "common/log.h"

namespace dflash::pipeline {

Worker& WorkerPool::add(const std::string& name) {
  workers_.push_back(std::make_unique<Worker>());
  Worker& w = *workers_.back();
  w.name = name;
  w.beat();
  w.heartbeat_gauge = &metrics_.worker_heartbeat_family->Add({{"worker", name}});
  w.restarts_counter = &metrics_.worker_restarts_family->Add({{"worker", name}});
  metrics_.worker_stalled_family->Add({{"worker", name}});
  health_.set_healthy(name);
  return w;
}

void WorkerPool::spawn(std::function<void()> body) {
  {
    std::lock_guard lock(mutex_);
    ++running_;
  }
  threads_.emplace_back([this, body = std::move(body)] {
    body();
    std::lock_guard lock(mutex_);
    --running_;
    exited_.notify_all();
  });
}

std::vector<std::string> WorkerPool::check_heartbeats(double now, double stall_seconds) {
  std::vector<std::string> newly_stalled;
  for (auto& w : workers_) {
    const double age = now - w->heartbeat.load();
    w->heartbeat_gauge->Set(w->heartbeat.load());
    const bool stalled = age > stall_seconds;
    metrics_.worker_stalled_family->Add({{"worker", w->name}}).Set(stalled ? 1 : 0);
    if (stalled && !w->stalled.exchange(true)) {
      const std::string reason = "no heartbeat for " + std::to_string(static_cast<int64_t>(age)) + " s";
      health_.set_unhealthy(w->name, "stalled: " + reason);
      log::error("{} stalled: {}", w->name, reason);
      newly_stalled.push_back(w->name + " stalled: " + reason);
    } else if (!stalled && w->stalled.exchange(false)) {
      health_.set_healthy(w->name);
    }
  }
  return newly_stalled;
}

bool WorkerPool::wait_for_exit(std::optional<std::chrono::duration<double>> limit) {
  std::unique_lock lock(mutex_);
  auto all_left = [&] { return running_ == 0; };
  if (limit) return exited_.wait_for(lock, *limit, all_left);
  exited_.wait(lock, all_left);
  return true;
}

int WorkerPool::running() const {
  std::lock_guard lock(mutex_);
  return running_;
}

void WorkerPool::join() {
  for (auto& t : threads_) {
    if (t.joinable()) t.join();
  }
  threads_.clear();
}

void WorkerPool::detach() {
  for (auto& t : threads_) t.detach();
  threads_.clear();
}

}  // namespace dflash::pipeline
