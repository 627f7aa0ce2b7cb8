// gpu_memory.h: bytes held by torch's CUDA caching allocator per GPU (allocated = in tensors,
// reserved = held from the driver), for dflashd_gpu_memory_bytes. Empty without CUDA.
#pragma once

#include <cstdint>
#include <vector>

namespace dflash::pipeline {

struct GpuMemory {
  int device = 0;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
};

std::vector<GpuMemory> gpu_memory(const std::vector<int>& devices);

}  // namespace dflash::pipeline
