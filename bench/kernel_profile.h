// kernel_profile.h: where the GPU time of one call goes, by kernel, through libtorch's Kineto
// profiler (CUPTI). Benchmarks call print_kernel_profile when DFLASHD_PROFILE is set.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace dflash::bench {

// Runs f once under the profiler and prints the `top` kernels by total GPU time: milliseconds,
// share, launches, name (cut to 110 characters).
inline void print_kernel_profile(const char* title, const std::function<void()>& f, int top = 25) {
  namespace prof = torch::profiler::impl;
  const prof::ProfilerConfig config(prof::ProfilerState::KINETO);
  const std::set<prof::ActivityType> activities{prof::ActivityType::CPU, prof::ActivityType::CUDA};
  torch::autograd::profiler::prepareProfiler(config, activities);
  torch::autograd::profiler::enableProfiler(config, activities);
  f();
  const auto result = torch::autograd::profiler::disableProfiler();
  struct Total {
    double ms = 0;
    int calls = 0;
  };
  std::map<std::string, Total> kernels, host;
  double all = 0;
  uint64_t first = UINT64_MAX, last = 0;
  for (const auto& e : result->events()) {
    const double ms = static_cast<double>(e.durationNs()) / 1e6;
    const bool gpu = e.deviceType() == c10::DeviceType::CUDA;
    Total& t = (gpu ? kernels : host)[e.name()];
    t.ms += ms;
    ++t.calls;
    if (!gpu) continue;
    all += ms;
    first = std::min<uint64_t>(first, e.startNs());
    last = std::max<uint64_t>(last, e.endNs());
  }
  auto print = [&](const std::map<std::string, Total>& totals, int rows) {
    std::vector<std::pair<std::string, Total>> sorted(totals.begin(), totals.end());
    std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
    for (int i = 0; i < std::min<int>(rows, static_cast<int>(sorted.size())); ++i) {
      const auto& [name, t] = sorted[i];
      std::printf("  %8.2f ms %5.1f%% %6d  %.110s\n", t.ms, 100 * t.ms / all, t.calls, name.c_str());
    }
  };
  std::printf("profile: %s: %.2f ms of GPU time in %zu distinct kernels, first start to last end %.2f ms\n", title, all,
              kernels.size(), last > first ? static_cast<double>(last - first) / 1e6 : 0.0);
  print(kernels, top);
  if (std::getenv("DFLASHD_PROFILE_HOST") != nullptr) {
    std::printf("  host side (operators and runtime calls, nested; %% of the GPU time):\n");
    print(host, top);
  }
  // DFLASHD_PROFILE_ORDER=N: the first N events of each side in the order they started (which
  // operator issued which kernel: a layer's sequence).
  if (const char* order = std::getenv("DFLASHD_PROFILE_ORDER")) {
    std::vector<const torch::autograd::profiler::KinetoEvent*> events;
    for (const auto& e : result->events()) events.push_back(&e);
    std::sort(events.begin(), events.end(), [](const auto* a, const auto* b) { return a->startNs() < b->startNs(); });
    for (const bool gpu : {false, true}) {
      std::printf("  %s side in order:\n", gpu ? "GPU" : "host");
      int shown = 0;
      for (const auto* e : events) {
        if ((e->deviceType() == c10::DeviceType::CUDA) != gpu) continue;
        if (shown++ >= std::atoi(order)) break;
        const int64_t start = static_cast<int64_t>(e->startNs()) - static_cast<int64_t>(first);
        std::printf("    %10.3f us +%8.3f  %.100s\n", static_cast<double>(start) / 1e3,
                    static_cast<double>(e->durationNs()) / 1e3, e->name().c_str());
      }
    }
  }
}

}  // namespace dflash::bench
