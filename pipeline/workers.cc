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

bool FailurePolicy::run(Worker& w, const std::string& what, const std::function<void()>& work,
                        const std::vector<int64_t>& samples, bool* skipped) const {
  bool retried = false;
  while (true) {
    try {
      work();
      if (retried) {
        // Healthy again once the retried unit of work is done; the restart stays counted in
        // dflashd_worker_restarts_total.
        c_.health.set_healthy(w.name);
        log::info("{} recovered: {} done after a restart", w.name, what);
      }
      return true;
    } catch (const std::exception& e) {
      if (c_.run_failed()) return false;
      c_.metrics.worker_failures_total->Increment();
      const std::string message = w.name + " failed on " + what + ": " + e.what();
      const std::vector<int64_t> now_skipped = c_.failed_samples.record(samples);
      for (int64_t index : now_skipped) {
        c_.metrics.skipped_failed_total->Increment();
        log::error("{}; skipping sample {} ({}) from now on: it failed {} times "
                   "(workers.skip_sample_after_failures), counted in dflashd_samples_skipped_total{reason=\"failed\"}",
                   message, index, c_.describe_sample(index), c_.failed_samples.failures(index));
      }
      if (!now_skipped.empty() && (skipped != nullptr || c_.single_replica)) {
        if (skipped != nullptr) {
          *skipped = true;
          return true;
        }
        retried = true;
        continue;
      }
      const bool restart = c_.config.on_failure == config::OnFailure::restart;
      if (!restart || w.restarts.load() >= c_.config.max_restarts) {
        c_.stop_run(message + (restart ? " (restarts exhausted)" : ""));
        return false;
      }
      w.restarts.fetch_add(1);
      retried = true;
      if (w.restarts_counter) w.restarts_counter->Increment();
      log::warn("{}; retrying ({} of {})", message, w.restarts.load(), c_.config.max_restarts);
      c_.health.set_unhealthy(w.name, "restarted after: " + std::string(e.what()));
    }
  }
}

}  // namespace dflash::pipeline
