// epilogue.cuh: what the stream-K GEMM's consumers do with a segment's sums (schedule.h says
// which): store the tile's output, or hand the sums to the tile's head through the workspace, or,
// as the head, add the followers' sums and store.
//
// Workspace: one int flag per CTA, then one slot of fp32 sums per CTA. A part writes its slot in
// the consumers' own register order (float4 per thread, coalesced), then raises its flag with
// release semantics; the head waits for the flag with acquire semantics, reads the slot from L2
// and lowers the flag again, so that every flag is down when the kernel ends.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "target/kernels/stream_gemm/mainloop.cuh"

namespace dflash::stream_gemm {

inline constexpr int kConsumerThreads = kConsumerWarps * 32;

template <int kTokens>
inline constexpr int kSlotFloats = kTokens * kRowsPerTile;

// The product's output and workspace as the consumers see them.
struct Output {
  __nv_bfloat16* y;  // [m, n], rows n apart (a SwiGLU: [m, glu_inner])
  int m, n;
  int glu_inner;     // 0, or a SwiGLU's intermediate size (stream_gemm.h)
  int* flags;
  float* slots;
};

// The staged tile's rows of each token as 16-byte stores (element by element where a row of y
// is not 16-byte aligned or the tile runs past n).
__device__ __forceinline__ void copy_out(const __nv_bfloat16* staged, const Output& out, int tile, int ct) {
  const int first_row = tile * kRowsPerTile;
  const int rows = out.n - first_row < kRowsPerTile ? out.n - first_row : kRowsPerTile;
  const bool whole_chunks = out.n % 8 == 0;
  for (int i = ct; i < out.m * (kRowsPerTile / 8); i += kConsumerThreads) {
    const int token = i / (kRowsPerTile / 8), row = (i % (kRowsPerTile / 8)) * 8;
    if (row >= rows) continue;
    __nv_bfloat16* dst = out.y + static_cast<int64_t>(token) * out.n + first_row + row;
    const __nv_bfloat16* src = staged + token * kOutStride + row;
    if (whole_chunks && row + 8 <= rows) {
      *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
    } else {
      for (int e = 0; e < 8 && row + e < rows; ++e) dst[e] = src[e];
    }
  }
}

// A SwiGLU's tile: staged rows 0..63 are the gate's features, 64..127 the same features' up rows;
// each token's 64 features of silu(gate) * up leave as 16-byte stores.
__device__ __forceinline__ void copy_out_glu(const __nv_bfloat16* staged, const Output& out, int tile, int ct) {
  constexpr int kFeatures = kRowsPerTile / 2;
  const int first = tile * kFeatures;
  const int features = out.glu_inner - first < kFeatures ? out.glu_inner - first : kFeatures;
  const bool whole_chunks = out.glu_inner % 8 == 0;
  for (int i = ct; i < out.m * (kFeatures / 8); i += kConsumerThreads) {
    const int token = i / (kFeatures / 8), f = (i % (kFeatures / 8)) * 8;
    if (f >= features) continue;
    const __nv_bfloat16* gate = staged + token * kOutStride + f;
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      v[e] = bf16x8::silu_times(__bfloat162float(gate[e]), __bfloat162float(gate[e + kFeatures]));
    }
    __nv_bfloat16* dst = out.y + static_cast<int64_t>(token) * out.glu_inner + first + f;
    if (whole_chunks && f + 8 <= features) {
      bf16x8::store8(dst, v);
    } else {
      for (int e = 0; e < 8 && f + e < features; ++e) dst[e] = __float2bfloat16(v[e]);
    }
  }
}

// Thread `ct` of the consumers (0..255), warp w = ct / 32 (warpgroup w / 4): c[j][r] is the
// tile's row 16 w + lane / 4 + 8 (r / 2) and token 8 j + 2 (lane % 4) + r % 2. The tile goes
// through shared memory ([token][row], rounded to bf16) so that each token's rows leave as
// 16-byte stores.
template <int kTokens>
__device__ __forceinline__ void store_tile(const Accumulators<kTokens>& acc, __nv_bfloat16* staged, const Output& out,
                                           int tile, int ct) {
  const barriers::NamedBarrier consumers{1, kConsumerThreads};
  const int lane = ct & 31;
  const int row0 = (ct >> 5) * 16 + (lane >> 2), token0 = 2 * (lane & 3);
  consumers.sync();  // the previous tile's stores have read the staging
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      staged[(token0 + 8 * j + (r & 1)) * kOutStride + row0 + 8 * (r >> 1)] = __float2bfloat16(acc.c[j][r]);
    }
  }
  consumers.sync();
  if (out.glu_inner > 0) {
    copy_out_glu(staged, out, tile, ct);
  } else {
    copy_out(staged, out, tile, ct);
  }
}

template <int kTokens>
__device__ __forceinline__ void write_slot(const Accumulators<kTokens>& acc, float* slot, int ct) {
  float4* s = reinterpret_cast<float4*>(slot);
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    const float* c = acc.c[j];
    __stcg(&s[j * kConsumerThreads + ct], make_float4(c[0], c[1], c[2], c[3]));
  }
}

template <int kTokens>
__device__ __forceinline__ void add_slot(Accumulators<kTokens>& acc, const float* slot, int ct) {
  const float4* s = reinterpret_cast<const float4*>(slot);
#pragma unroll
  for (int j = 0; j < kTokens / 8; ++j) {
    const float4 v = __ldcg(&s[j * kConsumerThreads + ct]);
    float* c = acc.c[j];
    c[0] += v.x;
    c[1] += v.y;
    c[2] += v.z;
    c[3] += v.w;
  }
}

__device__ __forceinline__ void raise_flag(int* flag) {
  asm volatile("st.release.gpu.global.s32 [%0], %1;\n" ::"l"(flag), "r"(1) : "memory");
}
__device__ __forceinline__ void wait_for_flag(const int* flag) {
  int raised = 0;
  do {
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];\n" : "=r"(raised) : "l"(flag) : "memory");
  } while (!raised);
}

// The consumers' end of one segment of CTA `cta`.
template <int kTokens>
__device__ __forceinline__ void finish_segment(Accumulators<kTokens>& acc, const Segment& g, const Schedule& schedule,
                                               const Output& out, __nv_bfloat16* staged, int cta, int ct) {
  const barriers::NamedBarrier consumers{1, kConsumerThreads};
  if (g.kind == SegmentKind::part) {
    write_slot(acc, out.slots + static_cast<int64_t>(cta) * kSlotFloats<kTokens>, ct);
    consumers.sync();
    if (ct == 0) raise_flag(&out.flags[cta]);
    return;
  }
  if (g.kind == SegmentKind::head) {
    const int followers_end = schedule.followers_end(cta, g.tile);
    if (ct == 0) {
      for (int f = cta + 1; f < followers_end; ++f) wait_for_flag(&out.flags[f]);
    }
    consumers.sync();
    for (int f = cta + 1; f < followers_end; ++f) {
      add_slot(acc, out.slots + static_cast<int64_t>(f) * kSlotFloats<kTokens>, ct);
    }
    if (ct == 0) {
      for (int f = cta + 1; f < followers_end; ++f) out.flags[f] = 0;
    }
  }
  store_tile(acc, staged, out, g.tile, ct);
}

}  // namespace dflash::stream_gemm
