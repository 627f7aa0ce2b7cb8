#include "pipeline/gpu_memory.h"

#ifdef DFLASHD_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
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

}  // namespace dflash::pipeline
