#include "daemon/kernel_probe.h"

#include <cuda_runtime.h>

namespace dflash::daemon {
namespace {

__global__ void probe_kernel(int* out) {
  // Each thread adds its index: the host checks the sum, so a kernel that did not run (or ran
  // partially) cannot look like success.
  atomicAdd(out, static_cast<int>(threadIdx.x));
}

std::string cuda_error(const char* what, cudaError_t error) {
  return std::string(what) + ": " + cudaGetErrorName(error) + " (" + cudaGetErrorString(error) + ")";
}

}  // namespace

std::string probe_kernels(int device) {
  cudaError_t error = cudaSetDevice(device);
  if (error != cudaSuccess) return cuda_error("cudaSetDevice", error);
  int* value = nullptr;
  error = cudaMalloc(&value, sizeof(int));
  if (error != cudaSuccess) return cuda_error("cudaMalloc", error);
  cudaMemset(value, 0, sizeof(int));
  probe_kernel<<<1, 64>>>(value);
  error = cudaGetLastError();
  int host = -1;
  if (error == cudaSuccess) error = cudaMemcpy(&host, value, sizeof(int), cudaMemcpyDeviceToHost);
  cudaFree(value);
  if (error == cudaErrorNoKernelImageForDevice || error == cudaErrorInvalidDeviceFunction) {
    return cuda_error("no dflashd kernel image for this GPU's architecture (rebuild with its sm_ in CMAKE_CUDA_ARCHITECTURES)", error);
  }
  if (error != cudaSuccess) return cuda_error("probe kernel", error);
  if (host != 63 * 64 / 2) return "probe kernel returned a wrong result: " + std::to_string(host);
  return "ok";
}

}  // namespace dflash::daemon
