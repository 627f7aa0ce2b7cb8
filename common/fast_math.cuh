// fast_math.cuh: exponentials as one MUFU.EX2 for the kernels' inner loops. Device code only.
//
// ex2.approx.ftz: relative error about 2^-22, results below 2^-126 flushed to zero, 2^-inf = 0.
// exp2f / __expf without fast math add a range test and two multiplies per call (the denormal
// path), which cost as much issue as the exponential itself in the tile loops.
#pragma once

#include <cuda_runtime.h>

namespace dflash {

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// e^x = 2^(x log2 e).
__device__ __forceinline__ float exp_approx(float x) { return exp2_approx(x * 1.4426950408889634f); }

// 1 / (1 + e^-x) = (1 + tanh(x / 2)) / 2 with one MUFU.TANH (relative error about 2^-11: for
// results rounded to bf16).
__device__ __forceinline__ float sigmoid_approx(float x) {
  float t;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(t) : "f"(0.5f * x));
  return fmaf(0.5f, t, 0.5f);
}

}  // namespace dflash
