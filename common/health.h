// health.h: what /healthz reports. Components (the main loop, each worker, the checkpointer)
// set their own state; the daemon is healthy while every component is.
//
// Thread-safety: all methods may be called from any thread.
#pragma once

#include <map>
#include <mutex>
#include <string>

namespace dflash {

class Health {
 public:
  struct Report {
    bool healthy = true;
    std::string text;  // "ok", or one line per unhealthy component: "component: reason"
  };

  void set_healthy(const std::string& component) { set(component, true, ""); }
  void set_unhealthy(const std::string& component, std::string reason) { set(component, false, std::move(reason)); }
  void remove(const std::string& component) {
    std::lock_guard lock(mutex_);
    states_.erase(component);
  }

  Report report() const {
    std::lock_guard lock(mutex_);
    Report r;
    for (const auto& [component, state] : states_) {
      if (state.healthy) continue;
      r.healthy = false;
      r.text += component + ": " + state.reason + "\n";
    }
    if (r.healthy) r.text = "ok\n";
    return r;
  }

 private:
  void set(const std::string& component, bool healthy, std::string reason) {
    std::lock_guard lock(mutex_);
    states_[component] = {healthy, std::move(reason)};
  }
  struct State {
    bool healthy;
    std::string reason;
  };
  mutable std::mutex mutex_;
  std::map<std::string, State> states_;
};

}  // namespace dflash
