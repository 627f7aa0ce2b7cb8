// timing.h: the benchmarks' GPU timer.
#pragma once

#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace dflash::bench {

// Median milliseconds of `repeats` calls after one warm-up, by CUDA events around each call.
inline double median_ms(int repeats, const std::function<void()>& f) {
  f();
  c10::cuda::device_synchronize();
  std::vector<double> ms;
  for (int i = 0; i < repeats; ++i) {
    at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
    start.record();
    f();
    end.record();
    end.synchronize();
    ms.push_back(start.elapsed_time(end));
  }
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace dflash::bench
