// Stage 4 (mma.sync): the output and the gated norm.
// Private to target/kernels/gated_delta_net.cu (one translation unit): see gated_delta_net.h for
// the math and the data layout.
#pragma once

#include "target/kernels/gdn/common.cuh"

namespace dflash::target::kernels::gdn {

// ---- 4. output: O = diag(scale e^gamma) Q S + P V', then the gated norm -----------------------
// 4 warps, each 16 tokens x all 128 value columns (so the norm over a row stays in the warp's
// quads): Q as a swizzled tile, P in A-fragment order, S^T and V'^T in the fragment order the
// state pass wrote them (the B fragments of two n8 tiles of S or V' as one 16-byte shared load per
// lane, pairs in adjacent registers); products by mma.sync, the row scale applied to the
// accumulators.
constexpr int kOutputThreads = 128;

struct OutputShared {  // 74 KB: three CTAs per SM
  mma_tile::Tile q;
  uint4 state[64 * 32];        // S^T in fragment order: the B operands of Q S
  uint4 v[32 * 32];            // V'^T in fragment order: the B operands of P V'
  uint4 p[16 * 32];             // P in fragment order: the A operands of P V'
  float q_scale[C];             // scale e^gamma per row
};

__global__ void __launch_bounds__(kOutputThreads) output_kernel(GdnForward a) {
  extern __shared__ __align__(128) unsigned char smem[];
  OutputShared& s = *reinterpret_cast<OutputShared*>(smem);
  const int chunk = blockIdx.x, head = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t4 = lane & 3, row0 = warp * 16;
  const int start = a.chunks.start[chunk], length = a.chunks.length[chunk];
  const int key_head = head / (a.value_heads / a.key_heads);
  const int64_t tile = static_cast<int64_t>(chunk) * a.value_heads + head;
  const bf16* q = static_cast<const bf16*>(a.qkv) + static_cast<int64_t>(start) * a.qkv_stride + key_head * D;
  const uint4* state = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.states) + tile * D * D);
  const uint4* v_new = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.v_new) + tile * C * D);
  mma_tile::load_tile<kOutputThreads>(s.q, q, a.qkv_stride, length);
  for (int i = threadIdx.x; i < 64 * 32; i += kOutputThreads) mma_tile::copy16(&s.state[i], state + i);
  for (int i = threadIdx.x; i < 32 * 32; i += kOutputThreads) mma_tile::copy16(&s.v[i], v_new + i);
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const bf16*>(a.qk) + tile * C * C);
  for (int i = threadIdx.x; i < 16 * 32; i += kOutputThreads) mma_tile::copy16(&s.p[i], p + i);
  if (threadIdx.x < C) s.q_scale[threadIdx.x] = a.scale * exp_approx(a.gamma[tile * C + threadIdx.x]);
  __pipeline_commit();
  __pipeline_wait_prior(0);
  __syncthreads();

  float acc[16][4] = {};  // O rows row0 + g (c[0], c[1]) and + 8 (c[2], c[3]); value columns 8n + 2t4
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {  // Q S over the key dims
    uint32_t x[4];
    mma_tile::load_a(x, s.q, row0, ks * 16);
#pragma unroll
    for (int np = 0; np < 8; ++np) {  // value columns [16 np, +16): one fragment-ordered block
      const uint4 y = s.state[(np * 8 + ks) * 32 + lane];
      mma_tile::mma(acc[2 * np], x, y.x, y.y);
      mma_tile::mma(acc[2 * np + 1], x, y.z, y.w);
    }
  }
  const float scale0 = s.q_scale[row0 + g], scale1 = s.q_scale[row0 + g + 8];
#pragma unroll
  for (int n = 0; n < 16; ++n) acc[n][0] *= scale0, acc[n][1] *= scale0, acc[n][2] *= scale1, acc[n][3] *= scale1;
#pragma unroll
  for (int kk = 0; kk < C / 16; ++kk) {  // + P V' over the chunk's tokens
    const uint4 pf = s.p[(warp * 4 + kk) * 32 + lane];
    const uint32_t x[4] = {pf.x, pf.y, pf.z, pf.w};
#pragma unroll
    for (int np = 0; np < 8; ++np) {
      const uint4 y = s.v[(np * 4 + kk) * 32 + lane];
      mma_tile::mma(acc[2 * np], x, y.x, y.y);
      mma_tile::mma(acc[2 * np + 1], x, y.z, y.w);
    }
  }

  // Epilogue: rows row0 + g and row0 + g + 8; a row's 128 values are spread over one quad.
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = row0 + g + 8 * half;
    const int64_t token = start + r;
    float squares = 0.f;
#pragma unroll
    for (int n = 0; n < 16; ++n) squares += acc[n][2 * half] * acc[n][2 * half] + acc[n][2 * half + 1] * acc[n][2 * half + 1];
    squares += __shfl_xor_sync(0xffffffffu, squares, 1);
    squares += __shfl_xor_sync(0xffffffffu, squares, 2);
    if (r >= length) continue;
    if (a.out_raw != nullptr) {
      float* out = a.out_raw + (token * a.value_heads + head) * D;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<float2*>(out + 8 * n + 2 * t4) = make_float2(acc[n][2 * half], acc[n][2 * half + 1]);
      }
      continue;
    }
    if (a.out_plain != nullptr) {
      bf16* out = static_cast<bf16*>(a.out_plain) + (token * a.value_heads + head) * D;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        *reinterpret_cast<__nv_bfloat162*>(out + 8 * n + 2 * t4) = __floats2bfloat162_rn(acc[n][2 * half], acc[n][2 * half + 1]);
      }
      continue;
    }
    const float rstd = rsqrtf(squares / D + a.eps);
    const bf16* z = static_cast<const bf16*>(a.z) + token * a.z_stride + head * D;
    const bf16* w = static_cast<const bf16*>(a.norm_weight);
    bf16* out = static_cast<bf16*>(a.out) + (token * a.value_heads + head) * D;
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      const int col = 8 * n + 2 * t4;
      const float2 gate = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(z + col));
      const float2 weight = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(w + col));
      // As the reference: the weighted rmsnorm(o) rounded as HF does, then times silu(z) in fp32.
      const float w0 = weighted_norm(acc[n][2 * half] * rstd, weight.x, false);
      const float w1 = weighted_norm(acc[n][2 * half + 1] * rstd, weight.y, false);
      *reinterpret_cast<__nv_bfloat162*>(out + col) = __floats2bfloat162_rn(w0 * gate.x / (1.0f + __expf(-gate.x)),
                                                                            w1 * gate.y / (1.0f + __expf(-gate.y)));
    }
  }
}

}  // namespace dflash::target::kernels::gdn
