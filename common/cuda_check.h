// cuda_check.h: the error checks of the CUDA kernel launchers (header-only, CUDA runtime only).
#pragma once

#include <cuda_runtime_api.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/kernel_variants.h"

namespace dflash {

// Throws std::runtime_error("<what>: <error name> (<error text>)") unless error is cudaSuccess.
inline void check_cuda(cudaError_t error, const std::string& what) {
  if (error != cudaSuccess) {
    cudaGetLastError();  // clear it
    throw std::runtime_error(what + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")");
  }
}

// The same for the last kernel launch.
inline void check_cuda_launch(const std::string& what) { check_cuda(cudaGetLastError(), what); }

// Lets `kernel` use `bytes` of dynamic shared memory (above the 48 KB default).
template <typename Kernel>
void allow_shared_memory(Kernel kernel, std::size_t bytes, const std::string& what) {
  check_cuda(cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             what + " (shared memory)");
}

// Blocks of a grid-stride loop over `items`: enough for the items, at most 16 per SM of an H100/H200.
inline unsigned grid_stride_blocks(int64_t items, int threads) {
  return static_cast<unsigned>(std::min<int64_t>((items + threads - 1) / threads, 132 * 16));
}

// Whether the current device has compute capability 9.0 (Hopper: the wgmma kernels built for
// sm_90a run there) and no test has forced the kernel set's mma.sync variant
// (kernel_variants.h).
inline bool warpgroup_mma_on_current_device(MmaKernels set) {
  int device = 0, major = 0, minor = 0;
  check_cuda(cudaGetDevice(&device), "current device");
  check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
  check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "compute capability");
  return major == 9 && minor == 0 && !mma_sync_forced(set);
}

// Empty when `kernel` has an image for the current device; otherwise the CUDA error text.
template <typename Kernel>
const char* kernel_image_missing(Kernel kernel) {
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, reinterpret_cast<const void*>(kernel));
  if (error == cudaSuccess) return "";
  cudaGetLastError();  // clear it
  return cudaGetErrorString(error);
}

}  // namespace dflash
