// gpu_memory.h: bytes held by torch's CUDA caching allocator per GPU (allocated = in tensors,
// reserved = held from the driver), for dflashd_gpu_memory_bytes, and its retry and OOM counts;
// what the memory plan asks of the GPUs. Empty without CUDA.
#pragma once

#include <cstdint>
#include <vector>

#include "target/model_config.h"

namespace dflash::pipeline {

struct GpuMemory {
  int device = 0;
  int64_t allocated_bytes = 0;
  int64_t reserved_bytes = 0;
  int64_t peak_allocated_bytes = 0;
  // Times the allocator found no cached block, emptied its cache and retried cudaMalloc (each
  // one synchronises the GPU: memory is near the limit), and the out-of-memory errors it raised.
  int64_t alloc_retries = 0;
  int64_t ooms = 0;
};

std::vector<GpuMemory> gpu_memory(const std::vector<int>& devices);
// Each CUDA device's memory in bytes, by device index (empty without CUDA).
std::vector<int64_t> gpu_capacities();
// By device index, whether `target`'s MoE experts, kept FP8, run there on the FP8 grouped GEMM
// (target/moe.h: fp8_experts_grouped_on) rather than dequantized to bf16 a layer at a time (empty
// without CUDA; false for a dense target).
std::vector<bool> grouped_fp8_gpus(const target::ModelConfig& target);

}  // namespace dflash::pipeline
