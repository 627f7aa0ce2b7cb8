// host_device.h: DFLASHD_HOST_DEVICE marks a function that both the host and a CUDA kernel call
// (a kernel's schedule or shape arithmetic, tested on the host); plain C++ outside nvcc.
#pragma once

#if defined(__CUDACC__)
#define DFLASHD_HOST_DEVICE __host__ __device__
#else
#define DFLASHD_HOST_DEVICE
#endif
