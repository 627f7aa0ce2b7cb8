// The DFlash block attention kernels: see block_attention.h for the tiling and the mask.
//
// Notation: tiles (64 rows x 128, swizzled) and fragments as in common/mma_tile.cuh. Each warp
// owns 16 rows of the 64 (queries in forward / dq, keys in dkv).
#include "drafter/kernels/block_attention.h"

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/fast_math.cuh"
#include "common/mma_tile.cuh"
#include "common/wgmma.cuh"

namespace dflash::drafter::kernels {
namespace {

using namespace dflash::mma_tile;

static_assert(D == kAttentionHeadDim && R == kAttentionTileRows, "tiles of 64 rows (or keys) x 128");
constexpr int kThreads = 128;          // 4 warps x 16 rows
constexpr int kSmallLd = 24;           // bf16 row stride of the [64 rows][16 keys] block-tile matrices
constexpr float kLog2e = 1.4426950408889634f;

// Rows of one (block, key-value head, row tile): row r is pair rt * 64 + r of the rep * B
// (head, block row) pairs; past the last pair it is padding.
struct RowTile {
  int n, h, rt;
  // Element offset of q[m, head] relative to block n's first row; -1: padding.
  __device__ int relative_offset(const BlockAttentionProblem& p, int r) const {
    const int rep = p.q_heads / p.kv_heads, pair = rt * R + r;
    if (pair >= rep * p.block_size) return -1;
    return ((pair % p.block_size) * p.q_heads + h * rep + pair / p.block_size) * D;
  }
  __device__ int64_t block_offset(const BlockAttentionProblem& p) const {
    return static_cast<int64_t>(n) * p.block_size * p.q_heads * D;
  }
  __device__ int64_t row_offset(const BlockAttentionProblem& p, int r) const {  // -1: padding
    const int o = relative_offset(p, r);
    return o < 0 ? -1 : block_offset(p) + o;
  }
  __device__ int64_t slot(const BlockAttentionProblem& p) const {
    return ((static_cast<int64_t>(h) * p.blocks + n) * p.row_tiles() + rt) * R;
  }
};

// The 64 rows of a row tile from a [rows, q_heads, 128] tensor (q, dO); padding rows zero.
// `offsets`: the rows' relative offsets when the caller has them in a table (nullptr: computed).
template <int kLoaders = kThreads>
__device__ __forceinline__ void load_row_tile(Tile& tile, const BlockAttentionProblem& p, const RowTile& rows,
                                              const void* base, const int32_t* offsets = nullptr) {
  const bf16* b = static_cast<const bf16*>(base) + rows.block_offset(p);
  load_tile<kLoaders>(tile, [&](int r) {
    const int o = offsets != nullptr ? offsets[r] : rows.relative_offset(p, r);
    return o < 0 ? nullptr : b + o;
  });
}

// The block row (0 .. block_size - 1) of row r of row tile rt: the position within its block that
// a sliding window and the causal block mask depend on.
__device__ __forceinline__ int block_row(const BlockAttentionProblem& p, int rt, int r) {
  return (rt * R + r) % p.block_size;
}

// Sliding-window layers (p.window > 0): scores of keys outside a row's view to -inf, for rows g
// and g + 8 of this thread's warp in row tile rt. A context tile (first key key0) hides the keys
// j <= anchor + i - window of block row i; the block tile hides the block's keys after row i.
__device__ __forceinline__ void mask_window(float (&s)[8][4], const BlockAttentionProblem& p, int rt, int anchor,
                                            int key0, bool block) {
  const int warp = (threadIdx.x >> 5) & 3, g = (threadIdx.x & 31) >> 2, t4 = threadIdx.x & 3;
  const int i0 = block_row(p, rt, warp * 16 + g), i1 = block_row(p, rt, warp * 16 + g + 8);
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int col = nt * 8 + 2 * t4 + (e & 1), i = e < 2 ? i0 : i1;
      if (block ? col > i : key0 + col <= anchor + i - p.window) s[nt][e] = -INFINITY;
    }
  }
}

// The block of a forward or dQ CTA (block, key-value head, row tile): late (heavy) anchors
// first, key-value heads fastest. Its key tiles: the context tiles [first, ceil(anchor / 64))
// (first 0, or in a sliding-window layer the tile of the block's first visible key, anchor -
// window + 1), then the block's own keys.
struct BlockTiles {
  int n, h, rt, anchor, first, context_tiles;

  __device__ explicit BlockTiles(const BlockAttentionProblem& p) {
    const int tiles = p.row_tiles(), rest = blockIdx.x / p.kv_heads;
    n = p.blocks - 1 - rest / tiles;
    h = blockIdx.x % p.kv_heads;
    rt = rest % tiles;
    anchor = p.anchors[n];
    context_tiles = (anchor + R - 1) / R;
    first = p.window > 0 ? min(context_tiles, max(0, anchor - p.window + 1) / R) : 0;
  }
  __device__ int count() const { return context_tiles - first + 1; }
  __device__ bool block_tile(int t) const { return t == context_tiles - first; }
  __device__ RowTile row_tile() const { return {n, h, rt}; }
  __device__ int visible(int t, int block_size) const {
    return block_tile(t) ? block_size : min(R, anchor - (first + t) * R);
  }
  // Sliding-window layers: the masks of key tile t (uniform branch: only the tiles that reach
  // below some row's window, and the block tile).
  __device__ void mask(float (&s)[8][4], const BlockAttentionProblem& p, int t) const {
    if (p.window <= 0) return;
    const bool block = block_tile(t);
    const int key0 = (first + t) * R;
    if (block || key0 <= anchor + p.block_size - 1 - p.window) mask_window(s, p, rt, anchor, key0, block);
  }
  // Key tile t (keys and values); rows past the visible ones zero.
  __device__ void load_keys(Tile& k, Tile& v, const BlockAttentionProblem& p, int t) const {
    const bool context = !block_tile(t);
    const int64_t row = context ? static_cast<int64_t>(first + t) * R : static_cast<int64_t>(n) * p.block_size;
    const int64_t offset = (row * p.kv_heads + h) * D, stride = static_cast<int64_t>(p.kv_heads) * D;
    const int rows = visible(t, p.block_size);
    load_tile<kThreads>(k, static_cast<const bf16*>(context ? p.k_context : p.k_block) + offset, stride, rows);
    load_tile<kThreads>(v, static_cast<const bf16*>(context ? p.v_context : p.v_block) + offset, stride, rows);
  }
};

// The products of a 64-row tile: per warp (mma.sync, its 16 rows, results at once; any sm_80+)
// or per warpgroup (wgmma, sm_90a: each product is issued as one asynchronous group, and
// finish<n>(results...) waits until n groups remain in flight). Same fragments either way.
template <bool kGroup>
struct Products;

template <>
struct Products<false> {
  static __device__ __forceinline__ void product(float (&s)[8][4], const Tile& a, const Tile& b) {
    product_16x64(s, a, (threadIdx.x >> 5) * 16, b);
  }
  static __device__ __forceinline__ void accumulate(float (&acc)[16][4], uint32_t (&a)[4][4], const Tile& v) {
    accumulate_16x128(acc, a, v);
  }
  template <int kPending, typename... Operands>
  static __device__ __forceinline__ void finish(Operands&...) {}
};

template <>
struct Products<true> {
  static __device__ __forceinline__ void product(float (&s)[8][4], const Tile& a, const Tile& b) {
    wgmma::issue_product(s, a, b);
  }
  static __device__ __forceinline__ void accumulate(float (&acc)[16][4], uint32_t (&a)[4][4], const Tile& v) {
    wgmma::issue_accumulate(acc, a, v);
  }
  template <int kPending, typename... Operands>
  static __device__ __forceinline__ void finish(Operands&... operands) {
    wgmma::wait<kPending>(operands...);
  }
};

// ---- forward ---------------------------------------------------------------------------------
// Scores of the columns >= visible to -inf (a tile's last visible columns; uniform branch).
__device__ __forceinline__ void mask_columns(float (&s)[8][4], int visible) {
  if (visible >= R) return;
  const int t4 = threadIdx.x & 3;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      if (nt * 8 + 2 * t4 + (i & 1) >= visible) s[nt][i] = -INFINITY;
    }
  }
}

// The online softmax of rows g and g + 8 of a warp's 16: per key tile of raw scores s, masks the
// columns >= visible, updates the running maxima (in units of c = scale log2 e) and
// (per-thread partial) sums, rescales the output accumulators and leaves exp2(c s - max) in s
// (one FFMA and one EX2 per score).
struct OnlineSoftmax {
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;

  __device__ __forceinline__ void step(float (&s)[8][4], float (&o)[16][4], int visible, float c) {
    mask_columns(s, visible);
    float x0 = -INFINITY, x1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      x0 = fmaxf(x0, fmaxf(s[nt][0], s[nt][1]));
      x1 = fmaxf(x1, fmaxf(s[nt][2], s[nt][3]));
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      x0 = fmaxf(x0, __shfl_xor_sync(0xffffffffu, x0, off));
      x1 = fmaxf(x1, __shfl_xor_sync(0xffffffffu, x1, off));
    }
    // Without a window the new maxima are finite (a visible column in every tile); a sliding
    // window can hide a row's every column of a context tile, and until the row sees a key its
    // maximum stays -inf: the exponentials are then taken against 0 (all zero, as they must be).
    const float n0 = fmaxf(m0, x0 * c), n1 = fmaxf(m1, x1 * c);
    const float r0 = n0 == -INFINITY ? 0.f : n0, r1 = n1 == -INFINITY ? 0.f : n1;
    const float alpha0 = exp2_approx(m0 - r0), alpha1 = exp2_approx(m1 - r1);
    m0 = n0;
    m1 = n1;
    float sum0 = 0.f, sum1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      s[nt][0] = exp2_approx(fmaf(s[nt][0], c, -r0));
      s[nt][1] = exp2_approx(fmaf(s[nt][1], c, -r0));
      s[nt][2] = exp2_approx(fmaf(s[nt][2], c, -r1));
      s[nt][3] = exp2_approx(fmaf(s[nt][3], c, -r1));
      sum0 += s[nt][0] + s[nt][1];
      sum1 += s[nt][2] + s[nt][3];
    }
    l0 = l0 * alpha0 + sum0;
    l1 = l1 * alpha1 + sum1;
#pragma unroll
    for (int i = 0; i < 16; ++i) {
      o[i][0] *= alpha0;
      o[i][1] *= alpha0;
      o[i][2] *= alpha1;
      o[i][3] *= alpha1;
    }
  }
};

// The softmax denominators' log2 into the slots and O / l into `out` for this warp's rows.
__device__ __forceinline__ void store_output(const BlockAttentionProblem& p, const RowTile& tile, const OnlineSoftmax& softmax,
                                             const float (&o)[16][4], bf16* __restrict__ out, float* __restrict__ lse2) {
  const int warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  float l0 = softmax.l0, l1 = softmax.l1;
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l0 += __shfl_xor_sync(0xffffffffu, l0, off);
    l1 += __shfl_xor_sync(0xffffffffu, l1, off);
  }
  const int64_t slot = tile.slot(p);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int r = warp * 16 + g + half * 8;
    const int64_t offset = tile.row_offset(p, r);
    const float l = half ? l1 : l0, m = half ? softmax.m1 : softmax.m0;
    if (t4 == 0) lse2[slot + r] = offset < 0 ? INFINITY : m + log2f(l);
    if (offset < 0) continue;
    const float inv = 1.f / l;
#pragma unroll
    for (int dt = 0; dt < 16; ++dt) {
      *reinterpret_cast<uint32_t*>(out + offset + dt * 8 + 2 * t4) = pack(o[dt][2 * half] * inv, o[dt][2 * half + 1] * inv);
    }
  }
}

// One CTA (one warpgroup) per (block, key-value head, row tile). mma.sync: two key-tile
// buffers. wgmma: three, and the warpgroup issues the next tile's scores before this tile's
// softmax, so the tensor cores work while the warps compute exponentials (tile t + 1 resident
// while tile t + 2 loads).
template <bool kGroup>
struct ForwardShared {
  static constexpr int kStages = kGroup ? 3 : 2;
  Tile q, k[kStages], v[kStages];
};

template <bool kGroup>
__global__ void __launch_bounds__(kThreads) forward_kernel(BlockAttentionProblem p, bf16* __restrict__ out,
                                                           float* __restrict__ lse2) {
  using Mma = Products<kGroup>;
  extern __shared__ __align__(16) unsigned char raw[];
  ForwardShared<kGroup>& sh = aligned_shared<ForwardShared<kGroup>>(raw);
  const BlockTiles bt(p);
  const int count = bt.count();
  load_row_tile(sh.q, p, bt.row_tile(), p.q);
  auto load_keys = [&](int t, int buffer) { bt.load_keys(sh.k[buffer], sh.v[buffer], p, t); };
  load_keys(0, 0);
  __pipeline_commit();
  const float c = p.scale * kLog2e;
  float o[16][4] = {};
  OnlineSoftmax softmax;
  if constexpr (kGroup) {
    // Loads one tile ahead of the scores, which run one tile ahead of the softmax.
    constexpr int kBuffers = ForwardShared<true>::kStages;
    pipeline_stage<2, true, kBuffers>(0, count, load_keys);  // tile 1 loading, tile 0 landed
    float s[8][4];
    Mma::product(s, sh.q, sh.k[0]);
    Mma::template finish<0>(s);
    for (int t = 0; t < count; ++t) {
      pipeline_stage<2, true, kBuffers>(t + 1, count, load_keys);  // tile t + 2 loading, t + 1 landed
      float next[8][4];
      if (t + 1 < count) Mma::product(next, sh.q, sh.k[(t + 1) % kBuffers]);
      bt.mask(s, p, t);
      softmax.step(s, o, bt.visible(t, p.block_size), c);
      uint32_t pa[4][4];
      to_a(pa, s);
      Mma::accumulate(o, pa, sh.v[t % kBuffers]);
      Mma::template finish<0>(o, pa, next);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[i][e] = next[i][e];
      }
      __syncthreads();  // buffer t % kBuffers is refilled at iteration t + 1
    }
  } else {
    for (int t = 0; t < count; ++t) {
      pipeline_stage<2>(t, count, load_keys);
      float s[8][4];
      Mma::product(s, sh.q, sh.k[t & 1]);
      bt.mask(s, p, t);
      softmax.step(s, o, bt.visible(t, p.block_size), c);
      uint32_t pa[4][4];
      to_a(pa, s);
      Mma::accumulate(o, pa, sh.v[t & 1]);
      __syncthreads();  // the buffer is refilled by the next iteration's loads
    }
  }
  store_output(p, bt.row_tile(), softmax, o, out, lse2);
}

// ---- backward: dQ, and the gradients of the block's own keys ---------------------------------
// Where a backward kernel puts a gradient: part `part` of fp32 partial sums (each `part_floats`
// long), or with no partials the bf16 gradient itself.
struct GradientOut {
  float* parts;
  bf16* out;
  int64_t part_floats;
  __device__ __forceinline__ void store2(int part, int64_t index, float x, float y) const {
    if (parts != nullptr) {
      *reinterpret_cast<float2*>(parts + part * part_floats + index) = make_float2(x, y);
    } else {
      *reinterpret_cast<uint32_t*>(out + index) = pack(x, y);
    }
  }
};

// The four gradients' destinations (keys, values; block, context) in the scratch layout of
// BlockAttentionBackward::partials.
struct GradientOuts {
  GradientOut dk_block, dv_block, dk_context, dv_context;
  __device__ __forceinline__ explicit GradientOuts(const BlockAttentionProblem& p, const BlockAttentionBackward& g) {
    const int64_t nb = g.block_partial_floats(p), nc = g.context_partial_floats(p);
    const int64_t block_part = nb / max(1, p.row_tiles()), context_part = nc / max(1, g.context_chunks);
    float* scratch = g.partials;
    dk_block = {nb > 0 ? scratch : nullptr, static_cast<bf16*>(g.dk_block), block_part};
    dv_block = {nb > 0 ? scratch + nb : nullptr, static_cast<bf16*>(g.dv_block), block_part};
    dk_context = {nc > 0 ? scratch + 2 * nb : nullptr, static_cast<bf16*>(g.dk_context), context_part};
    dv_context = {nc > 0 ? scratch + 2 * nb + nc : nullptr, static_cast<bf16*>(g.dv_context), context_part};
  }
};

struct DqShared {
  Tile q, dout, k[2], v[2];
  __align__(16) bf16 p[R * kSmallLd];  // P and dS of the block tile, [row][key < 16]
  __align__(16) bf16 ds[R * kSmallLd];
  float lse2[R], delta[R];
};

template <bool kGroup>
__global__ void __launch_bounds__(kThreads) dq_kernel(BlockAttentionProblem p, BlockAttentionBackward gr) {
  extern __shared__ __align__(16) unsigned char raw[];
  using Mma = Products<kGroup>;
  DqShared& sh = aligned_shared<DqShared>(raw);
  const BlockTiles bt(p);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t4 = lane & 3;
  const RowTile tile = bt.row_tile();
  const bf16* dout = reinterpret_cast<const bf16*>(gr.d_out);
  const bf16* out = reinterpret_cast<const bf16*>(gr.out);
  load_row_tile(sh.q, p, tile, p.q);
  load_row_tile(sh.dout, p, tile, gr.d_out);
  auto load_keys = [&](int t, int buffer) { bt.load_keys(sh.k[buffer], sh.v[buffer], p, t); };
  load_keys(0, 0);
  __pipeline_commit();
  // D = rowsum(dO o O) of each row (two threads per row), kept in shared memory and in the
  // slots for the dkv kernel; the forward's log-sum-exp from its slots.
  const int64_t slot = tile.slot(p);
  {
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    const int64_t offset = tile.row_offset(p, r);
    float acc = 0.f;
    if (offset >= 0) {
      const uint4* a = reinterpret_cast<const uint4*>(dout + offset + half * 64);
      const uint4* b = reinterpret_cast<const uint4*>(out + offset + half * 64);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const uint4 x = a[i], y = b[i];
        const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float2 u = unpack(xs[j]), w = unpack(ys[j]);
          acc += u.x * w.x + u.y * w.y;
        }
      }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) {
      sh.delta[r] = acc;
      gr.delta[slot + r] = acc;
      sh.lse2[r] = gr.lse2[slot + r];
    }
  }
  const float c = p.scale * kLog2e;
  const Tile &q = sh.q, &d_out = sh.dout;
  float dq[16][4] = {};
  for (int t = 0; t < bt.count(); ++t) {
    pipeline_stage<2, kGroup>(t, bt.count(), load_keys);
    const Tile &k = sh.k[t & 1], &v = sh.v[t & 1];
    const int visible = bt.visible(t, p.block_size);
    const float lse0 = sh.lse2[warp * 16 + g], lse1 = sh.lse2[warp * 16 + g + 8];
    const float d0 = sh.delta[warp * 16 + g], d1 = sh.delta[warp * 16 + g + 8];
    float s[8][4], dp[8][4];
    Mma::product(s, q, k);
    Mma::product(dp, d_out, v);
    Mma::template finish<1>(s);  // P while dP = dO V^T is computed
    mask_columns(s, visible);  // exp2(-inf) = 0
    bt.mask(s, p, t);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) s[nt][i] = exp2_approx(fmaf(s[nt][i], c, -(i < 2 ? lse0 : lse1)));
    }
    Mma::template finish<0>(dp);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int i = 0; i < 4; ++i) dp[nt][i] = s[nt][i] * (dp[nt][i] - (i < 2 ? d0 : d1));  // dS
    }
    uint32_t da[4][4];
    to_a(da, dp);
    // dQ += dS K: K as the [k][n] operand.
    Mma::accumulate(dq, da, k);
    if (bt.block_tile(t)) {  // the block's own keys: keep P and dS for their gradients
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int r = warp * 16 + g + half * 8, col = nt * 8 + 2 * t4;
          *reinterpret_cast<uint32_t*>(sh.p + r * kSmallLd + col) = pack(s[nt][2 * half], s[nt][2 * half + 1]);
          *reinterpret_cast<uint32_t*>(sh.ds + r * kSmallLd + col) = pack(dp[nt][2 * half], dp[nt][2 * half + 1]);
        }
      }
    }
    Mma::template finish<0>(dq, da);
    __syncthreads();
  }
  bf16* dq_out = reinterpret_cast<bf16*>(gr.dq);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t offset = tile.row_offset(p, warp * 16 + g + half * 8);
    if (offset < 0) continue;
#pragma unroll
    for (int dt = 0; dt < 16; ++dt) {
      *reinterpret_cast<uint32_t*>(dq_out + offset + dt * 8 + 2 * t4) =
          pack(dq[dt][2 * half] * p.scale, dq[dt][2 * half + 1] * p.scale);
    }
  }
  // dV_block = P^T dO and dK_block = scale dS^T Q over this tile's 64 rows (keys as M, 16 of
  // them; rows as K); warp w takes value columns [32 w, 32 w + 32).
  float dv[4][4] = {}, dk[4][4] = {};
#pragma unroll
  for (int kr = 0; kr < 4; ++kr) {
    const int m = lane >> 3;
    const int row = kr * 16 + ((m >> 1) << 3) + (lane & 7), key = (m & 1) * 8;
    uint32_t ap[4], ad[4];
    ldsm_x4_trans(ap, shared_address(sh.p + row * kSmallLd + key));
    ldsm_x4_trans(ad, shared_address(sh.ds + row * kSmallLd + key));
#pragma unroll
    for (int dp2 = 0; dp2 < 2; ++dp2) {
      uint32_t y[4];
      load_b_kn(y, d_out, kr * 16, warp * 32 + dp2 * 16);
      mma(dv[2 * dp2], ap, y[0], y[1]);
      mma(dv[2 * dp2 + 1], ap, y[2], y[3]);
      load_b_kn(y, q, kr * 16, warp * 32 + dp2 * 16);
      mma(dk[2 * dp2], ad, y[0], y[1]);
      mma(dk[2 * dp2 + 1], ad, y[2], y[3]);
    }
  }
  const GradientOuts outs(p, gr);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int key = g + half * 8;
    if (key >= p.block_size) continue;
    const int64_t row = static_cast<int64_t>(tile.n * p.block_size + key) * p.kv_heads + tile.h;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = warp * 32 + j * 8 + 2 * t4;
      outs.dv_block.store2(tile.rt, row * D + col, dv[j][2 * half], dv[j][2 * half + 1]);
      outs.dk_block.store2(tile.rt, row * D + col, dk[j][2 * half] * p.scale, dk[j][2 * half + 1] * p.scale);
    }
  }
}

// ---- backward: dK, dV of the context ---------------------------------------------------------
constexpr int kOffsetTableTiles = 4;  // row tiles whose row offsets the dkv kernel keeps in a table

// Key tiles per CTA: with wgmma two warpgroups, one per 64 keys, share every row tile loaded
// (half the loads per product); with mma.sync one.
template <bool kGroup>
constexpr int kDkvGroups = kGroup ? 2 : 1;

template <bool kGroup>
struct DkvShared {
  Tile k[kDkvGroups<kGroup>], v[kDkvGroups<kGroup>], q[2], dout[2];
  float lse2[2][R], delta[2][R];
  int32_t offsets[kOffsetTableTiles * R];  // RowTile::relative_offset per (row tile, row)
};

template <bool kGroup>
__global__ void __launch_bounds__(kThreads * kDkvGroups<kGroup>) dkv_kernel(BlockAttentionProblem p, BlockAttentionBackward gr) {
  extern __shared__ __align__(16) unsigned char raw[];
  using Mma = Products<kGroup>;
  constexpr int kGroups = kDkvGroups<kGroup>, kCtaThreads = kThreads * kGroups;
  DkvShared<kGroup>& sh = aligned_shared<DkvShared<kGroup>>(raw);
  const int group = threadIdx.x / kThreads, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31, g = lane >> 2,
            t4 = lane & 3;
  // Heavy first: key tiles near the start are seen by the most blocks.
  const int h = blockIdx.x % p.kv_heads, rest = blockIdx.x / p.kv_heads;
  const int chunk = rest % gr.context_chunks, key_tile = rest / gr.context_chunks;
  const int j0 = key_tile * R * kGroups;
  const int per_chunk = (p.blocks + gr.context_chunks - 1) / gr.context_chunks;
  const int chunk_end = min(p.blocks, (chunk + 1) * per_chunk);
  // First block that sees key j0 (anchors ascend): a_n > j0.
  int lo = chunk * per_chunk, hi = chunk_end;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (p.anchors[mid] > j0) hi = mid; else lo = mid + 1;
  }
  const int first = lo;
  // In a sliding-window layer, the blocks after `first` that see a key of this CTA: the loosest
  // window (block row 0) reaches key j from anchors a <= j + window - 1.
  int end = chunk_end;
  if (p.window > 0) {
    const int last_key = j0 + kGroups * R - 1;
    for (hi = chunk_end; lo < hi;) {
      const int mid = (lo + hi) >> 1;
      if (p.anchors[mid] > last_key + p.window - 1) hi = mid; else lo = mid + 1;
    }
    end = lo;
  }
  const int tiles = p.row_tiles();
  const int count = (end - first) * tiles;  // (block, row tile) pairs
  if (count > 0) {
    const int64_t stride = static_cast<int64_t>(p.kv_heads) * D;
#pragma unroll
    for (int i = 0; i < kGroups; ++i) {
      const int j = j0 + i * R;
      const int64_t offset = (static_cast<int64_t>(j) * p.kv_heads + h) * D;
      load_tile<kCtaThreads>(sh.k[i], static_cast<const bf16*>(p.k_context) + offset, stride, p.context - j);
      load_tile<kCtaThreads>(sh.v[i], static_cast<const bf16*>(p.v_context) + offset, stride, p.context - j);
    }
  }
  const bool table = tiles <= kOffsetTableTiles;
  if (table) {
    for (int i = threadIdx.x; i < tiles * R; i += kCtaThreads) sh.offsets[i] = RowTile{0, h, i / R}.relative_offset(p, i % R);
  }
  __syncthreads();
  auto load_rows = [&](int i, int buffer) {
    const RowTile rt{first + i / tiles, h, i % tiles};
    const int32_t* offsets = table ? sh.offsets + rt.rt * R : nullptr;
    load_row_tile<kCtaThreads>(sh.q[buffer], p, rt, p.q, offsets);
    load_row_tile<kCtaThreads>(sh.dout[buffer], p, rt, gr.d_out, offsets);
    const int64_t slot = rt.slot(p);
    if (threadIdx.x < 16) {
      copy16(&sh.lse2[buffer][threadIdx.x * 4], gr.lse2 + slot + threadIdx.x * 4);
    } else if (threadIdx.x < 32) {
      copy16(&sh.delta[buffer][(threadIdx.x - 16) * 4], gr.delta + slot + (threadIdx.x - 16) * 4);
    }
  };
  if (count > 0) load_rows(0, 0);
  __pipeline_commit();

  const float c = p.scale * kLog2e;
  float dk[16][4], dv[16][4];
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    dk[i][0] = dk[i][1] = dk[i][2] = dk[i][3] = 0.f;
    dv[i][0] = dv[i][1] = dv[i][2] = dv[i][3] = 0.f;
  }
  const int key0 = j0 + group * R + warp * 16 + g, key1 = key0 + 8;  // this thread's accumulator rows
  const Tile &k = sh.k[group], &v = sh.v[group];
  for (int i = 0; i < count; ++i) {
    pipeline_stage<2, kGroup>(i, count, load_rows);
    const int b = i & 1;
    const int anchor = p.anchors[first + i / tiles], rt = i % tiles;
    // Uniform: every key of the CTA seen by every row (in a sliding-window layer, also the first
    // key inside the window of the block's last row).
    const bool all_visible = j0 + kGroups * R <= anchor && (p.window <= 0 || j0 > anchor + p.block_size - 1 - p.window);
    const bool see0 = key0 < anchor, see1 = key1 < anchor;
    // wgmma: S^T and dP^T issued together, P computed while dP^T runs, dS while dV += P^T dO
    // runs. mma.sync: dP^T after dV (fewer live registers).
    float s[8][4], dp[8][4];
    Mma::product(s, k, sh.q[b]);  // S^T: keys x rows
    if constexpr (kGroup) Mma::product(dp, v, sh.dout[b]);  // dP^T = V dO^T
    Mma::template finish<1>(s);
    if (all_visible) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) s[nt][e] = exp2_approx(fmaf(s[nt][e], c, -sh.lse2[b][nt * 8 + 2 * t4 + (e & 1)]));
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int col = nt * 8 + 2 * t4 + (e & 1);
          const bool see = (e < 2 ? see0 : see1) &&
                           (p.window <= 0 || (e < 2 ? key0 : key1) > anchor + block_row(p, rt, col) - p.window);
          s[nt][e] = see ? exp2_approx(fmaf(s[nt][e], c, -sh.lse2[b][col])) : 0.f;
        }
      }
    }
    uint32_t pa[4][4];
    to_a(pa, s);
    Mma::accumulate(dv, pa, sh.dout[b]);  // dV += P^T dO
    if constexpr (!kGroup) Mma::product(dp, v, sh.dout[b]);
    Mma::template finish<1>(dp);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = nt * 8 + 2 * t4 + (e & 1);
        dp[nt][e] = s[nt][e] * (dp[nt][e] - sh.delta[b][col]);
      }
    }
    uint32_t da[4][4];
    to_a(da, dp);
    Mma::accumulate(dk, da, sh.q[b]);  // dK += dS^T Q
    Mma::template finish<0>(dv, dk, pa, da);
    __syncthreads();
  }
  const GradientOuts outs(p, gr);
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int j = half ? key1 : key0;
    if (j >= p.context) continue;
    const int64_t row = (static_cast<int64_t>(j) * p.kv_heads + h) * D;
#pragma unroll
    for (int dt = 0; dt < 16; ++dt) {
      const int col = dt * 8 + 2 * t4;
      outs.dk_context.store2(chunk, row + col, dk[dt][2 * half] * p.scale, dk[dt][2 * half + 1] * p.scale);
      outs.dv_context.store2(chunk, row + col, dv[dt][2 * half], dv[dt][2 * half + 1]);
    }
  }
}

// ---- backward: the partial sums into the bf16 gradients ------------------------------------
// Up to four sums (blockIdx.y), each of `count` fp32 parts of n floats (n % 4 == 0), added in
// part order: deterministic.
struct PartialSum {
  const float* parts = nullptr;
  bf16* out = nullptr;
  int count = 0;
  int64_t n = 0;
};
struct PartialSums {
  PartialSum sums[4];
};

constexpr int kSumThreads = 256;

__global__ void __launch_bounds__(kSumThreads) sum_partials_kernel(PartialSums all) {
  const PartialSum job = all.sums[blockIdx.y];
  for (int64_t i = (static_cast<int64_t>(blockIdx.x) * kSumThreads + threadIdx.x) * 4; i < job.n;
       i += static_cast<int64_t>(gridDim.x) * kSumThreads * 4) {
    float4 acc = *reinterpret_cast<const float4*>(job.parts + i);
    for (int part = 1; part < job.count; ++part) {
      const float4 x = *reinterpret_cast<const float4*>(job.parts + part * job.n + i);
      acc.x += x.x, acc.y += x.y, acc.z += x.z, acc.w += x.w;
    }
    *reinterpret_cast<uint2*>(job.out + i) = make_uint2(pack(acc.x, acc.y), pack(acc.z, acc.w));
  }
}

// The wgmma kernels on compute capability 9.0 when built for sm_90a, the mma.sync ones elsewhere
// (and where a test forces them: kernel_variants.h).
bool warpgroup_kernels() {
#ifdef DFLASHD_CUDA_SM90A
  return warpgroup_mma_on_current_device(MmaKernels::block_attention);
#else
  return false;
#endif
}

// Launches `kernel` with a Shared's worth of dynamic shared memory (plus the alignment slack).
template <typename Shared, typename Kernel, typename... Args>
void launch(Kernel kernel, int ctas, int threads, cudaStream_t stream, const char* what, Args... args) {
  const std::size_t shared = sizeof(Shared) + kSharedAlignment;
  allow_shared_memory(kernel, shared, what);
  kernel<<<ctas, threads, shared, stream>>>(args...);
  check_cuda_launch(what);
}

// CTAs of the dkv kernel along the context (64 keys per warpgroup).
int dkv_key_tiles(const BlockAttentionProblem& p, bool group) {
  const int keys = R * (group ? kDkvGroups<true> : kDkvGroups<false>);
  return (p.context + keys - 1) / keys;
}

template <bool kGroup>
void forward(const BlockAttentionProblem& p, void* out, float* lse2, cudaStream_t stream) {
  launch<ForwardShared<kGroup>>(forward_kernel<kGroup>, p.blocks * p.kv_heads * p.row_tiles(), kThreads, stream,
                                "block attention kernel forward", p, static_cast<bf16*>(out), lse2);
}

template <bool kGroup>
void backward(const BlockAttentionProblem& p, const BlockAttentionBackward& g, cudaStream_t stream) {
  launch<DqShared>(dq_kernel<kGroup>, p.blocks * p.kv_heads * p.row_tiles(), kThreads, stream,
                   "block attention kernel dq", p, g);  // writes delta for dkv
  launch<DkvShared<kGroup>>(dkv_kernel<kGroup>, dkv_key_tiles(p, kGroup) * p.kv_heads * g.context_chunks,
                            kThreads * kDkvGroups<kGroup>, stream, "block attention kernel dkv", p, g);
  PartialSums sums;
  int jobs = 0;
  int64_t longest = 0;
  auto add = [&](const float* parts, void* out, int count, int64_t floats) {
    if (floats == 0) return;
    sums.sums[jobs++] = {parts, static_cast<bf16*>(out), count, floats / count};
    longest = std::max(longest, floats / count);
  };
  const int64_t nb = g.block_partial_floats(p), nc = g.context_partial_floats(p);
  add(g.partials, g.dk_block, p.row_tiles(), nb);
  add(g.partials + nb, g.dv_block, p.row_tiles(), nb);
  add(g.partials + 2 * nb, g.dk_context, g.context_chunks, nc);
  add(g.partials + 2 * nb + nc, g.dv_context, g.context_chunks, nc);
  if (jobs == 0) return;
  const dim3 grid(grid_stride_blocks(longest / 4, kSumThreads) / jobs + 1, jobs);
  sum_partials_kernel<<<grid, kSumThreads, 0, stream>>>(sums);
  check_cuda_launch("block attention kernel sum_partials");
}

}  // namespace

void block_attention_forward(const BlockAttentionProblem& p, void* out, float* lse2, cudaStream_t stream) {
  if (p.blocks == 0) return;
  warpgroup_kernels() ? forward<true>(p, out, lse2, stream) : forward<false>(p, out, lse2, stream);
}

void block_attention_backward(const BlockAttentionProblem& p, const BlockAttentionBackward& g, cudaStream_t stream) {
  if (p.blocks == 0) return;
  warpgroup_kernels() ? backward<true>(p, g, stream) : backward<false>(p, g, stream);
}

int context_chunks_for(const BlockAttentionProblem& p, int sms) {
  const int key_tiles = dkv_key_tiles(p, warpgroup_kernels());
  const int wanted = (8 * sms + key_tiles * p.kv_heads - 1) / std::max(1, key_tiles * p.kv_heads);
  return std::clamp(std::min(wanted, p.blocks / 32), 1, 8);
}

const char* attention_kernels_unavailable_on_current_device() {
  return kernel_image_missing(dkv_kernel<false>);
}

}  // namespace dflash::drafter::kernels
