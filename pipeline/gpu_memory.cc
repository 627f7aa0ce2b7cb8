#include "pipeline/gpu_memory.h"

#ifdef DFLASHD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <cuda_runtime_api.h>

#include "target/moe.h"
#endif

namespace dflash::pipeline {

std::vector<GpuMemory> gpu_memory(const std::vector<int>& devices) {
  std::vector<GpuMemory> out;
#ifdef DFLASHD_WITH_CUDA
  using c10::CachingDeviceAllocator::StatType;
  for (int d : devices) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(d));
    const auto aggregate = static_cast<size_t>(StatType::AGGREGATE);
    out.push_back({d, stats.allocated_bytes[aggregate].current, stats.reserved_bytes[aggregate].current,
                   stats.allocated_bytes[aggregate].peak, stats.num_alloc_retries, stats.num_ooms});
  }
#else
  (void)devices;
#endif
  return out;
}

namespace {

#ifdef DFLASHD_WITH_CUDA
// The CUDA devices this process sees: 0 where CUDA cannot count them (no driver), its error cleared.
int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return count;
}
#endif

}  // namespace

std::vector<int64_t> gpu_capacities() {
  std::vector<int64_t> out;
#ifdef DFLASHD_WITH_CUDA
  for (int i = 0, count = device_count(); i < count; ++i) {
    cudaDeviceProp properties{};
    out.push_back(cudaGetDeviceProperties(&properties, i) == cudaSuccess ? static_cast<int64_t>(properties.totalGlobalMem) : 0);
  }
#endif
  return out;
}

std::vector<bool> grouped_fp8_gpus(const target::ModelConfig& target) {
  std::vector<bool> out;
#ifdef DFLASHD_WITH_CUDA
  for (int d = 0, count = device_count(); d < count; ++d) {
    out.push_back(
        target::fp8_experts_grouped_on(target.num_experts, target.hidden_size, target.moe_intermediate_size, d));
  }
#else
  (void)target;
#endif
  return out;
}

}  // namespace dflash::pipeline
