// The one-token decoding attention (decode_attention.h): a CTA per (key range, kv head,
// sequence) streams its keys and values in tiles of 32 through a ring of shared-memory stages
// (cp.async), multiplies on mma.sync with the kv head's G query heads as the rows of an m16
// product, and keeps FlashAttention's running softmax; a second kernel merges a sequence's ranges.
//
// Per tile, 4 warps:
//   scores   warp w: S[16 x 8] = Q . K^T for keys 8w .. 8w + 7 (Q's fragments held in registers),
//            scaled to base 2, keys past the range at -inf, into shared memory
//   softmax  every warp: the tile's 32 scores of its rows from shared memory, the running max and
//            sum (the same in each warp), P as bf16 A fragments
//   values   warp w: O[:, its quarter of d] += P . V (V's fragments by ldmatrix.trans)
#include "target/kernels/decode_attention.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "common/barriers.cuh"
#include "common/bf16x8.cuh"
#include "common/cuda_check.h"
#include "common/launch.h"
#include "common/mma_tile.cuh"

namespace dflash::target::kernels {
namespace {

using bf16 = __nv_bfloat16;
using mma_tile::copy16;
using mma_tile::mma;
using mma_tile::pack;
using mma_tile::shared_address;

constexpr int kThreads = 128;
constexpr int kKeys = 32;   // keys per tile
constexpr int kStages = 3;  // tiles in flight or in use per CTA
constexpr int kRows = 16;   // the m16 product's rows: query heads of one kv head, padded
constexpr float kLog2e = 1.4426950408889634f;

// A tile of kKeys rows of D bf16, each row's 16-byte chunks XOR-swizzled by row & 7 (within the
// row), so that ldmatrix over 8 consecutive rows at one chunk touches 8 distinct bank groups.
template <int D>
__device__ __forceinline__ int tile_offset(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

template <int D>
struct Shared {
  alignas(128) bf16 k[kStages][kKeys * D];
  alignas(128) bf16 v[kStages][kKeys * D];
  float s[kRows][kKeys + 4];  // the tile's scores (padded against bank conflicts)
};

template <int D>
constexpr size_t shared_bytes() {
  return sizeof(Shared<D>);
}

// What one CTA works on.
struct Range {
  int b, h, split;
  int length;        // the sequence's keys
  int begin, end;    // the range's keys
  int64_t first;     // the sequence's first key's row
};

__device__ __forceinline__ Range range_of(const DecodeAttention& a, int chunk) {
  Range r;
  r.split = static_cast<int>(blockIdx.x), r.h = static_cast<int>(blockIdx.y), r.b = static_cast<int>(blockIdx.z);
  r.length = a.lengths[r.b];
  r.begin = r.split * chunk;
  r.end = min(r.length, r.begin + chunk);
  r.first = static_cast<int64_t>(a.rows != nullptr ? a.rows[r.b] : r.b) * a.capacity;
  return r;
}

// The CTA whose range holds the sequence's last key writes the step's key and value there
// (a.new_k, a.new_v), before any of its threads reads that row.
template <int D>
__device__ __forceinline__ void append_step_key(const DecodeAttention& a, const Range& r) {
  const int last = r.length - 1;
  if (a.new_k == nullptr || last < r.begin || last >= r.end) return;  // the same in the whole CTA
  constexpr int kChunks = D / 8;
  const int t = static_cast<int>(threadIdx.x);
  if (t < 2 * kChunks) {
    const bool value = t >= kChunks;
    const int chunk = t % kChunks;
    const bf16* from = static_cast<const bf16*>(value ? a.new_v : a.new_k) +
                       static_cast<int64_t>(r.b) * (value ? a.new_v_stride : a.new_k_stride) +
                       static_cast<int64_t>(r.h) * D + chunk * 8;
    bf16* to = static_cast<bf16*>(value ? a.v : a.k) + (r.first + last) * a.kv_heads * D +
               static_cast<int64_t>(r.h) * D + chunk * 8;
    *reinterpret_cast<uint4*>(to) = *reinterpret_cast<const uint4*>(from);
  }
  __threadfence_block();
  __syncthreads();
}

// Two adjacent output elements of sequence b, query head j, from column `column`: rounded to
// bf16, and gated as kernels::sigmoid_gate gates when a.gate is set.
__device__ __forceinline__ uint32_t output_pair(const DecodeAttention& a, int b, int j, int column, float x, float y) {
  if (a.gate == nullptr) return pack(x, y);
  const float2 g = mma_tile::unpack(*reinterpret_cast<const uint32_t*>(
      static_cast<const bf16*>(a.gate) + static_cast<int64_t>(b) * a.gate_stride +
      static_cast<int64_t>(j) * a.gate_head_stride + column));
  using bf16x8::round_bf16;
  return pack(bf16x8::sigmoid_gated(round_bf16(x), g.x), bf16x8::sigmoid_gated(round_bf16(y), g.y));
}

// Issues the copies of keys [key0, key0 + valid) of the range into stage `stage` (rows past
// `valid` zero-filled).
template <int D>
__device__ __forceinline__ void load_tile(Shared<D>& sh, int stage, const DecodeAttention& a, const Range& r,
                                          int key0) {
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  const int valid = min(kKeys, r.end - key0);
  const int64_t row_elements = static_cast<int64_t>(a.kv_heads) * D;
  const bf16* k = static_cast<const bf16*>(a.k) + (r.first + key0) * row_elements + static_cast<int64_t>(r.h) * D;
  const bf16* v = static_cast<const bf16*>(a.v) + (r.first + key0) * row_elements + static_cast<int64_t>(r.h) * D;
#pragma unroll
  for (int j = 0; j < kKeys * kChunks / kThreads; ++j) {
    const int i = static_cast<int>(threadIdx.x) + j * kThreads, row = i / kChunks, chunk = i % kChunks;
    const bool in = row < valid;
    const int64_t at = (in ? row : 0) * row_elements + chunk * 8;
    copy16(sh.k[stage] + tile_offset<D>(row, chunk), k + at, in);
    copy16(sh.v[stage] + tile_offset<D>(row, chunk), v + at, in);
  }
}

// Q's A fragments (rows g, g + 8 of the m16 product: query heads h G + g, h G + g + 8; rows >= G
// zero), k-step ks at q[ks].
template <int D>
__device__ __forceinline__ void load_q(uint32_t (&q)[D / 16][4], const DecodeAttention& a, const Range& r, int group) {
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  const bf16* base = static_cast<const bf16*>(a.q) + static_cast<int64_t>(r.b) * a.q_stride +
                     static_cast<int64_t>(r.h) * group * D;
  const uint32_t* row0 = reinterpret_cast<const uint32_t*>(base + static_cast<int64_t>(g) * D);
  const uint32_t* row8 = reinterpret_cast<const uint32_t*>(base + static_cast<int64_t>(g + 8) * D);
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    const int word = ks * 8 + t;  // (ks * 16 + 2t) / 2
    q[ks][0] = g < group ? row0[word] : 0u;
    q[ks][1] = g + 8 < group ? row8[word] : 0u;
    q[ks][2] = g < group ? row0[word + 4] : 0u;
    q[ks][3] = g + 8 < group ? row8[word + 4] : 0u;
  }
}

// Warp w's scores: keys 8w .. 8w + 7 of the tile against the 16 rows, base-2 scaled, keys at or
// past `valid` at -inf, written to sh.s.
template <int D>
__device__ __forceinline__ void scores(Shared<D>& sh, int stage, const uint32_t (&q)[D / 16][4], float scale_log2,
                                       int valid) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3, m = lane >> 3;
  // Even and odd k-steps into two accumulators: two chains of dependent mma, not one.
  float c[4] = {0.f, 0.f, 0.f, 0.f}, odd[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
  for (int kp = 0; kp < D / 32; ++kp) {  // two k-steps per ldmatrix.x4: chunks 4 kp .. 4 kp + 3
    uint32_t b[4];
    const int row = warp * 8 + (lane & 7);
    mma_tile::ldsm_x4(b, shared_address(sh.k[stage] + tile_offset<D>(row, kp * 4 + m)));
    mma(c, q[2 * kp], b[0], b[1]);
    mma(odd, q[2 * kp + 1], b[2], b[3]);
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) c[i] += odd[i];
  const int key = warp * 8 + 2 * t;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int k = key + (i & 1);
    sh.s[g + (i >> 1) * 8][k] = k < valid ? c[i] * scale_log2 : -INFINITY;
  }
}

// The running softmax of rows g and g + 8 (this lane's share of their sums).
struct Softmax {
  float max[2] = {-INFINITY, -INFINITY};
  float sum[2] = {0.f, 0.f};
};

// Reads the tile's scores of this lane's rows and keys (P's A-fragment positions), updates the
// running max, rescales acc, and returns P as A fragments for the tile's two 16-key k-steps.
template <int kTiles>
__device__ __forceinline__ void softmax_tile(const float (&s)[kRows][kKeys + 4], Softmax& sm, float (&acc)[kTiles][4],
                                             uint32_t (&p)[2][4]) {
  const int lane = static_cast<int>(threadIdx.x) & 31, g = lane >> 2, t = lane & 3;
  float x[2][8];  // [row half][k-step kk, column 2t / 2t + 1 / 2t + 8 / 2t + 9]
#pragma unroll
  for (int half = 0; half < 2; ++half) {
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const float* row = s[g + 8 * half] + kk * 16 + 2 * t;
      x[half][4 * kk + 0] = row[0], x[half][4 * kk + 1] = row[1];
      x[half][4 * kk + 2] = row[8], x[half][4 * kk + 3] = row[9];
    }
  }
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    float tile_max = x[half][0];
#pragma unroll
    for (int i = 1; i < 8; ++i) tile_max = fmaxf(tile_max, x[half][i]);
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    const float next = fmaxf(sm.max[half], tile_max);
    const float base = next == -INFINITY ? 0.f : next;  // a row with no key yet: nothing to scale
    const float rescale = exp2f(sm.max[half] - base);
    sm.max[half] = next;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[half][i] = exp2f(x[half][i] - base);
      sum += x[half][i];
    }
    sm.sum[half] = sm.sum[half] * rescale + sum;
#pragma unroll
    for (int n = 0; n < kTiles; ++n) acc[n][2 * half] *= rescale, acc[n][2 * half + 1] *= rescale;
  }
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    p[kk][0] = pack(x[0][4 * kk + 0], x[0][4 * kk + 1]);
    p[kk][1] = pack(x[1][4 * kk + 0], x[1][4 * kk + 1]);
    p[kk][2] = pack(x[0][4 * kk + 2], x[0][4 * kk + 3]);
    p[kk][3] = pack(x[1][4 * kk + 2], x[1][4 * kk + 3]);
  }
}

// Warp w: acc (16 rows x its quarter of d, D / 32 n8 tiles) += P . V.
template <int D>
__device__ __forceinline__ void accumulate(float (&acc)[D / 32][4], const uint32_t (&p)[2][4], const Shared<D>& sh,
                                           int stage) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5, m = lane >> 3;
  const int chunk0 = warp * (D / 32);  // the warp's first 16-byte chunk of d (D / 4 columns)
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
    for (int np = 0; np < D / 64; ++np) {  // two n8 tiles per ldmatrix.x4.trans
      uint32_t b[4];
      const int row = kk * 16 + ((m & 1) << 3) + (lane & 7);
      mma_tile::ldsm_x4_trans(b, shared_address(sh.v[stage] + tile_offset<D>(row, chunk0 + 2 * np + (m >> 1))));
      mma(acc[2 * np], p[kk], b[0], b[1]);
      mma(acc[2 * np + 1], p[kk], b[2], b[3]);
    }
  }
}

// Rows g and g + 8 of the range's result: with one range the normalised output (bf16) into
// a.out, else the unnormalised sums, max and sum into the workspace for merge_kernel.
template <int D>
__device__ __forceinline__ void finish(const DecodeAttention& a, const Range& r, int group, int splits,
                                       const float (&acc)[D / 32][4], Softmax& sm) {
  const int lane = static_cast<int>(threadIdx.x) & 31, warp = static_cast<int>(threadIdx.x) >> 5;
  const int g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    sm.sum[half] += __shfl_xor_sync(0xffffffffu, sm.sum[half], 1);
    sm.sum[half] += __shfl_xor_sync(0xffffffffu, sm.sum[half], 2);
  }
  const int64_t slot = (static_cast<int64_t>(r.b) * a.kv_heads + r.h) * splits + r.split;  // this range's partials
  float* partial = static_cast<float*>(a.workspace);
  float* stats = partial + static_cast<int64_t>(a.sequences) * a.kv_heads * splits * group * D;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    if (row >= group) continue;
    const float inverse = sm.sum[half] > 0.f ? 1.f / sm.sum[half] : 0.f;
#pragma unroll
    for (int n = 0; n < D / 32; ++n) {
      const int column = warp * (D / 4) + n * 8 + 2 * t;
      const float x = acc[n][2 * half], y = acc[n][2 * half + 1];
      if (splits == 1) {
        const int head = r.h * group + row;
        bf16* out = static_cast<bf16*>(a.out) + static_cast<int64_t>(r.b) * a.out_stride +
                    static_cast<int64_t>(head) * D + column;
        *reinterpret_cast<uint32_t*>(out) = output_pair(a, r.b, head, column, x * inverse, y * inverse);
      } else {
        *reinterpret_cast<float2*>(partial + (slot * group + row) * D + column) = make_float2(x, y);
      }
    }
    if (splits > 1 && warp == 0 && t == 0) {
      stats[2 * (slot * group + row)] = sm.max[half];
      stats[2 * (slot * group + row) + 1] = sm.sum[half];
    }
  }
}

template <int D>
__global__ void __launch_bounds__(kThreads) decode_attention_kernel(DecodeAttention a, int group, int splits,
                                                                    int chunk, float scale_log2) {
  extern __shared__ unsigned char raw[];
  auto& sh = *reinterpret_cast<Shared<D>*>(raw);
  barriers::start_as_dependent();  // q, the caches and the lengths come from the kernels before
  const Range r = range_of(a, chunk);
  append_step_key<D>(a, r);
  Softmax sm;
  float acc[D / 32][4];
#pragma unroll
  for (int n = 0; n < D / 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;
  const int tiles = r.end > r.begin ? (r.end - r.begin + kKeys - 1) / kKeys : 0;
  if (tiles > 0) {
    uint32_t q[D / 16][4];
    load_q<D>(q, a, r, group);
#pragma unroll
    for (int i = 0; i < kStages - 1; ++i) {
      if (i < tiles) load_tile<D>(sh, i, a, r, r.begin + i * kKeys);
      __pipeline_commit();
    }
    for (int i = 0; i < tiles; ++i) {
      const int stage = i % kStages;
      mma_tile::pipeline_stage<kStages>(i, tiles, [&](int j, int buffer) {
        load_tile<D>(sh, buffer, a, r, r.begin + j * kKeys);
      });
      scores<D>(sh, stage, q, scale_log2, r.end - (r.begin + i * kKeys));
      __syncthreads();
      uint32_t p[2][4];
      softmax_tile<D / 32>(sh.s, sm, acc, p);
      accumulate<D>(acc, p, sh, stage);
      __syncthreads();  // the stage and the scores are reused
    }
  }
  finish<D>(a, r, group, splits, acc, sm);
}

// One CTA per (query head, sequence): out = the ranges' sums weighted by exp2(max - the
// largest max), over their weighted sums (ranges without keys skipped); a thread per two columns.
template <int D>
__global__ void __launch_bounds__(D / 2) merge_kernel(DecodeAttention a, int group, int splits) {
  barriers::start_as_dependent();
  const int head = static_cast<int>(blockIdx.x), b = static_cast<int>(blockIdx.y);
  const int h = head / group, row = head % group, column = 2 * static_cast<int>(threadIdx.x);
  const int64_t first = (static_cast<int64_t>(b) * a.kv_heads + h) * splits;
  const float* partial = static_cast<const float*>(a.workspace);
  const float* stats = partial + static_cast<int64_t>(a.sequences) * a.kv_heads * splits * group * D;
  float largest = -INFINITY;
  for (int s = 0; s < splits; ++s) largest = fmaxf(largest, stats[2 * ((first + s) * group + row)]);
  float x = 0.f, y = 0.f, total = 0.f;
  for (int s = 0; s < splits; ++s) {
    const int64_t at = (first + s) * group + row;
    const float m = stats[2 * at];
    if (m == -INFINITY) continue;
    const float w = exp2f(m - largest);
    const float2 o = *reinterpret_cast<const float2*>(partial + at * D + column);
    x += w * o.x, y += w * o.y, total += w * stats[2 * at + 1];
  }
  const float inverse = total > 0.f ? 1.f / total : 0.f;
  bf16* out =
      static_cast<bf16*>(a.out) + static_cast<int64_t>(b) * a.out_stride + static_cast<int64_t>(head) * D + column;
  *reinterpret_cast<uint32_t*>(out) = output_pair(a, b, head, column, x * inverse, y * inverse);
}

// Keys per range when `longest` keys are split into `splits` ranges of whole tiles.
int range_keys(int longest, int splits) { return ((longest + splits - 1) / splits + kKeys - 1) / kKeys * kKeys; }

template <int D>
void launch(const DecodeAttention& a, int splits, cudaStream_t stream) {
  allow_shared_memory(decode_attention_kernel<D>, shared_bytes<D>(), "decode attention");
  const int group = a.heads / a.kv_heads;
  const int chunk = range_keys(a.longest, splits);
  const float scale_log2 = a.scale * kLog2e;
  check_cuda(launch_dependent(decode_attention_kernel<D>, dim3(splits, a.kv_heads, a.sequences), kThreads,
                              shared_bytes<D>(), stream, a, group, splits, chunk, scale_log2),
             "decode attention");
  if (splits > 1) {
    check_cuda(launch_dependent(merge_kernel<D>, dim3(a.heads, a.sequences), D / 2, 0, stream, a, group, splits),
               "decode attention: merging the key ranges");
  }
}

}  // namespace

int decode_attention_splits(const DecodeAttention& a, int sms) {
  // Ranges split only to fill the GPU once (2 CTAs resident per SM at d = 256, 4 at 128): a
  // sequence's keys in one range need no merge, and its CTA streams them as one pipeline. Ranges
  // of at least two tiles, and only as many as hold keys once rounded to whole tiles.
  const int resident = a.d == 256 ? 2 : 4;
  const int pairs = std::max(1, a.sequences * a.kv_heads);
  const int wanted = (resident * sms * 9 / 10 + pairs - 1) / pairs;
  const int tiles = (a.longest + kKeys - 1) / kKeys;
  const int splits = std::max(1, std::min(wanted, tiles / 2));
  const int keys = range_keys(std::max(1, a.longest), splits);
  return (std::max(1, a.longest) + keys - 1) / keys;
}

size_t decode_attention_workspace(const DecodeAttention& a, int sms) {
  const int splits = decode_attention_splits(a, sms);
  if (splits == 1) return 0;
  const size_t rows = static_cast<size_t>(a.sequences) * a.kv_heads * splits * (a.heads / a.kv_heads);
  return rows * (static_cast<size_t>(a.d) + 2) * sizeof(float);
}

void decode_attention(const DecodeAttention& a, int sms, cudaStream_t stream) {
  if (a.sequences == 0) return;
  const int group = a.kv_heads > 0 ? a.heads / a.kv_heads : 0;
  if (!decode_attention_head_dim(a.d) || group < 1 || group > kDecodeAttentionMaxGroup ||
      a.heads != group * a.kv_heads || a.longest < 1) {
    throw std::invalid_argument("decode attention: " + std::to_string(a.heads) + " query heads over " +
                                std::to_string(a.kv_heads) + " kv heads of " + std::to_string(a.d) +
                                " (d 128 or 256, at most 16 query heads per kv head, at least one key)");
  }
  const int splits = decode_attention_splits(a, sms);
  if (splits > 1 && a.workspace == nullptr) throw std::invalid_argument("decode attention: no workspace");
  if (a.d == 128) {
    launch<128>(a, splits, stream);
  } else {
    launch<256>(a, splits, stream);
  }
}

}  // namespace dflash::target::kernels
