// launch.h: kernel launches beyond <<<>>> (CUDA runtime only).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace dflash {

// Launches `kernel` as a programmatic dependent of the stream's previous kernel (see
// barriers::dependents_may_launch), so that its CTAs start, and its set-up runs, while that
// kernel's last CTAs finish. The kernel must call barriers::wait_for_prerequisite before it reads
// what that kernel wrote or writes memory it may still read.
template <typename... Params, typename... Args>
cudaError_t launch_dependent(void (*kernel)(Params...), dim3 grid, int threads, size_t shared_bytes,
                             cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = shared_bytes;
  config.stream = stream;
  cudaLaunchAttribute attribute[1];
  attribute[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[0].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace dflash
