// Stage 1: the causal conv1d + SiLU + L2 norm kernel.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// ---- 1. causal conv1d + SiLU + L2 norm of the q/k heads ---------------------------------------
// A thread owns 8 adjacent channels (16-byte loads and stores) over kConvTokens tokens, keeping
// the last three inputs in registers, so every input row is read once; a head's 128 channels are
// 16 lanes of one warp, whose sum of squares is a 4-step shuffle.
constexpr int kConvTokens = 32;
constexpr int kConvThreads = 128;  // 1024 channels per CTA

__global__ void __launch_bounds__(kConvThreads) conv1d_silu_l2norm_kernel(const bf16* __restrict__ x, int64_t x_stride,
                                                                          const bf16* __restrict__ weight, int kernel,
                                                                          const int64_t* __restrict__ positions,
                                                                          bf16* __restrict__ y, int tokens, int channels,
                                                                          int qk_channels) {
  const int c0 = (blockIdx.y * kConvThreads + threadIdx.x) * 8;
  const bool active = c0 < channels;       // channels % 128 == 0: whole 16-lane heads agree
  const bool normalise = c0 < qk_channels;  // likewise
  // w[s][e]: the tap applied to x[t - s] of channel c0 + e (zero past the kernel width).
  float w[4][8] = {};
  if (active) {
    for (int s = 0; s < kernel; ++s)
#pragma unroll
      for (int e = 0; e < 8; ++e) w[s][e] = __bfloat162float(weight[static_cast<int64_t>(c0 + e) * kernel + kernel - 1 - s]);
  }
  const int t0 = blockIdx.x * kConvTokens, t1 = min(t0 + kConvTokens, tokens);
  float history[3][8] = {}, current[8] = {};  // x[t - 1 - i], x[t]
  if (active) {
    for (int i = 0; i < 3; ++i)
      if (i + 1 < kernel && t0 - 1 - i >= 0) load8(history[i], x + (t0 - 1 - i) * x_stride + c0);
    load8(current, x + t0 * x_stride + c0);
  }
  for (int t = t0; t < t1; ++t) {
    float next[8] = {};
    if (active && t + 1 < t1) load8(next, x + (t + 1) * x_stride + c0);
    const int64_t position = positions[t];  // taps before the sequence's first token are skipped
    float out[8], squares = 0;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      float acc = w[0][e] * current[e];
#pragma unroll
      for (int s = 1; s < 4; ++s) {
        if (s <= position) acc += w[s][e] * history[s - 1][e];
      }
      out[e] = acc / (1.0f + __expf(-acc));
      squares += out[e] * out[e];
    }
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float factor = normalise ? rsqrtf(squares + 1e-6f) : 1.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] *= factor;
    if (active) bf16x8::store8(y + static_cast<int64_t>(t) * channels + c0, out);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      history[2][e] = history[1][e];
      history[1][e] = history[0][e];
      history[0][e] = current[e];
      current[e] = next[e];
    }
  }
}

}  // namespace dflash::target::kernels::gdn
