// kernel_profile.h: where the GPU time of one call goes, by kernel, through libtorch's Kineto
// profiler (CUPTI). Benchmarks call print_kernel_profile when DFLASHD_PROFILE is set.
#pragma once

#include <torch/csrc/autograd/profiler_kineto.h>

#include <algorithm>
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
  std::map<std::string, Total> kernels;
  double all = 0;
  for (const auto& e : result->events()) {
    if (e.deviceType() != c10::DeviceType::CUDA) continue;
    const double ms = static_cast<double>(e.durationNs()) / 1e6;
    Total& t = kernels[e.name()];
    t.ms += ms;
    ++t.calls;
    all += ms;
  }
  std::vector<std::pair<std::string, Total>> sorted(kernels.begin(), kernels.end());
  std::sort(sorted.begin(), sorted.end(), [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  std::printf("profile: %s: %.2f ms of GPU time in %zu distinct kernels\n", title, all, sorted.size());
  for (int i = 0; i < std::min<int>(top, static_cast<int>(sorted.size())); ++i) {
    const auto& [name, t] = sorted[i];
    std::printf("  %8.2f ms %5.1f%% %6d  %.110s\n", t.ms, 100 * t.ms / all, t.calls, name.c_str());
  }
}

}  // namespace dflash::bench
