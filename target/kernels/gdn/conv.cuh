// Stage 1: the causal conv1d + SiLU + L2 norm kernel.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "common/barriers.cuh"
#include "target/kernels/gdn/common.cuh"
#include "target/kernels/gdn_gates.cuh"

namespace dflash::target::kernels::gdn {

// ---- 1. causal conv1d + SiLU + L2 norm of the q/k heads ---------------------------------------
// A thread owns 8 adjacent channels (16-byte loads and stores) over kConvTokens tokens: it loads
// the three inputs before its first token and all of its tokens' rows at once, then convolves
// them in registers (the loop unrolled, so the window's shift is a renaming); a head's 128
// channels are 16 lanes of one warp, whose sum of squares is a 4-step shuffle. Few tokens per
// CTA keep many CTAs in flight (a 3072-token forward: 3840) and every thread's loads overlap:
// the kernel is bound by the memory's latency, not its work.
constexpr int kConvTokens = 8;
constexpr int kConvThreads = 128;  // 1024 channels per CTA

// The taps of one output over 8 channels: w[0] x[t] + w[1] x[t-1] + ... (taps past `taps` skipped,
// in this order), then SiLU. Both conv kernels call it, so they round alike.
__device__ __forceinline__ void conv_silu8(float (&out)[8], const float (&w)[4][8], const float (&current)[8],
                                           const float (&history)[3][8], int64_t taps) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    float acc = w[0][e] * current[e];
#pragma unroll
    for (int s = 1; s < 4; ++s) {
      if (s < taps) acc += w[s][e] * history[s - 1][e];
    }
    out[e] = __fdividef(acc, 1.0f + __expf(-acc));  // 2 ulp; a full division costs more than the rest
  }
}

// The window moves by one token: history[i] = x[t - 1 - i] for the next t.
__device__ __forceinline__ void shift_window(float (&history)[3][8], const float (&current)[8]) {
#pragma unroll
  for (int e = 0; e < 8; ++e) {
    history[2][e] = history[1][e];
    history[1][e] = history[0][e];
    history[0][e] = current[e];
  }
}

// w[s][e] = raw's tap of channel e for x[t - s], raw holding the K taps of 8 channels ([8, K]).
template <int K>
__device__ __forceinline__ void unpack_taps(float (&w)[4][8], const uint4 (&raw)[4]) {
  const bf16* v = reinterpret_cast<const bf16*>(raw);
#pragma unroll
  for (int s = 0; s < K; ++s) {
#pragma unroll
    for (int e = 0; e < 8; ++e) w[s][e] = __bfloat162float(v[e * K + K - 1 - s]);
  }
}

// w[s][e]: the tap applied to x[t - s] of channel c0 + e (zero past the kernel width). The 8
// channels' taps are 16 K contiguous bytes of the [channels, K] weight: K vector loads (32 scalar
// loads would cost a one-token decoding step's conv as much as its data).
__device__ __forceinline__ void load_taps(float (&w)[4][8], const bf16* __restrict__ weight, int kernel, int c0) {
  const uint4* src = reinterpret_cast<const uint4*>(weight + static_cast<int64_t>(c0) * kernel);
  uint4 raw[4];
#pragma unroll
  for (int u = 0; u < 4; ++u) {
    if (u < kernel) raw[u] = src[u];
  }
  switch (kernel) {
    case 1: unpack_taps<1>(w, raw); break;
    case 2: unpack_taps<2>(w, raw); break;
    case 3: unpack_taps<3>(w, raw); break;
    default: unpack_taps<4>(w, raw); break;
  }
}

__global__ void __launch_bounds__(kConvThreads) conv1d_silu_l2norm_kernel(const bf16* __restrict__ x, int64_t x_stride,
                                                                          const bf16* __restrict__ weight, int kernel,
                                                                          const int64_t* __restrict__ positions,
                                                                          bf16* __restrict__ y, int tokens, int channels,
                                                                          int qk_channels) {
  const int c0 = (blockIdx.y * kConvThreads + threadIdx.x) * 8;
  const bool active = c0 < channels;       // channels % 128 == 0: whole 16-lane heads agree
  const bool normalise = c0 < qk_channels;  // likewise
  float w[4][8] = {};
  if (active) load_taps(w, weight, kernel, c0);
  const int t0 = blockIdx.x * kConvTokens, count = min(kConvTokens, tokens - t0);
  float history[3][8] = {};  // x[t - 1 - i]
  uint4 rows[kConvTokens];
  if (active) {
#pragma unroll
    for (int i = 0; i < 3; ++i) {
      if (i + 1 < kernel && t0 - 1 - i >= 0) load8(history[i], x + (t0 - 1 - i) * x_stride + c0);
    }
#pragma unroll
    for (int i = 0; i < kConvTokens; ++i) {
      if (i < count) rows[i] = *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(t0 + i) * x_stride + c0);
    }
  }
#pragma unroll
  for (int i = 0; i < kConvTokens; ++i) {
    if (i >= count) break;  // count is the CTA's: every lane leaves together
    const int t = t0 + i;
    float current[8] = {}, out[8], squares = 0;
    if (active) bf16x8::unpack8(current, rows[i]);
    conv_silu8(out, w, current, history, positions[t] + 1);  // taps before the sequence's start skipped
#pragma unroll
    for (int e = 0; e < 8; ++e) squares += out[e] * out[e];
#pragma unroll
    for (int offset = 8; offset > 0; offset >>= 1) squares += __shfl_xor_sync(0xffffffffu, squares, offset);
    const float factor = normalise ? rsqrtf(squares + 1e-6f) : 1.0f;
#pragma unroll
    for (int e = 0; e < 8; ++e) out[e] *= factor;
    if (active) bf16x8::store8(y + static_cast<int64_t>(t) * channels + c0, out);
    shift_window(history, current);
  }
}

// ---- 1b. a decoding step's conv over each sequence's cached inputs -----------------------------
// One thread per (sequence, 8 channels): the sequence's K - 1 cached inputs (tails) and its n
// step rows, read once each; writes the n outputs (conv + SiLU, no L2 norm: the decode-step kernel
// normalises q and k) and the sequence's new last K - 1 inputs. Replaces concatenating a window,
// convolving all of it and copying its tail out (three passes).
// The grid: one row of CTAs per sequence (blockIdx.x), kConvStepThreads chunks of 8 channels each
// (blockIdx.y): no index division.
constexpr int kConvStepThreads = 128;

// The first CTA of each sequence also forms its rows' gates (ConvStep::g set).
__device__ __forceinline__ void step_gates(const ConvStep& a, int sequence) {
  const int64_t first = static_cast<int64_t>(sequence) * a.tokens * a.heads;  // its rows' elements
  for (int64_t i = first + threadIdx.x; i < first + static_cast<int64_t>(a.tokens) * a.heads; i += kConvStepThreads) {
    gdn_gates_at(i, static_cast<const bf16*>(a.gate_a), a.a_stride, static_cast<const bf16*>(a.gate_b), a.b_stride,
                 a.a_log, a.dt_bias, a.heads, a.g, a.beta);
  }
}

// The sequence's cached inputs and the taps of the thread's channels.
__device__ __forceinline__ void load_window(const ConvStep& a, int sequence, int c0, float (&w)[4][8],
                                            float (&history)[3][8]) {
  load_taps(w, static_cast<const bf16*>(a.weight), a.kernel, c0);
  const int held = a.kernel - 1;
  const bf16* tails = static_cast<const bf16*>(a.tails) + sequence * a.tails_sequence_stride + c0;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    if (i < held) load8(history[i], tails + (held - 1 - i) * a.tails_row_stride);
  }
}

__global__ void __launch_bounds__(kConvStepThreads) conv_step_kernel(ConvStep a) {
  const int sequence = blockIdx.x, c0 = (blockIdx.y * kConvStepThreads + threadIdx.x) * 8;
  const bool active = c0 < a.channels;
  float w[4][8] = {}, history[3][8] = {}, current[8];
  // Settled inputs load while the kernel before (the projection) still runs.
  if (active && a.inputs_settled) load_window(a, sequence, c0, w, history);
  barriers::start_as_dependent();
  if (a.g != nullptr && blockIdx.y == 0) step_gates(a, sequence);
  if (!active) return;
  if (!a.inputs_settled) load_window(a, sequence, c0, w, history);
  const int held = a.kernel - 1;
  for (int t = 0; t < a.tokens; ++t) {
    const int64_t row = static_cast<int64_t>(sequence) * a.tokens + t;
    load8(current, static_cast<const bf16*>(a.x) + row * a.x_stride + c0);
    float out[8];
    conv_silu8(out, w, current, history, a.kernel);
    bf16x8::store8(static_cast<bf16*>(a.y) + row * a.channels + c0, out);
    shift_window(history, current);
  }
  bf16* new_tails = static_cast<bf16*>(a.new_tails) + static_cast<int64_t>(sequence) * held * a.channels + c0;
#pragma unroll
  for (int i = 0; i < 3; ++i) {
    if (i < held) bf16x8::store8(new_tails + (held - 1 - i) * a.channels, history[i]);
  }
}

}  // namespace dflash::target::kernels::gdn
