// mma_tile.cuh: warp-level bf16 tensor-core building blocks shared by the CUDA kernels (the
// drafter's block attention, the target's GatedDeltaNet state pass). Device code only.
//
// A Tile is 64 rows x 128 bf16 in shared memory as two 64-column halves of 8 KB; in each half a
// row is 128 bytes whose 16-byte chunks are XOR-swizzled by row (chunk' = chunk ^ (row & 7)), so
// that ldmatrix reads are free of bank conflicts and the tile is also wgmma's 128-byte-swizzle
// operand layout (common/wgmma.cuh; tiles 1024-byte aligned for that). Fragments
// follow the PTX layout of mma.m16n8k16: lane = 4 g + t; an accumulator c[4] holds (row g, cols
// 2t, 2t+1) and (row g + 8, same cols) of a 16 x 8 tile; an A operand a[4] holds (row g, k 2t,
// 2t+1), (row g + 8, same k), (row g, k 2t + 8, +9), (row g + 8, same k).
#pragma once

#include <cuda_bf16.h>
#include <cuda_pipeline.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dflash::mma_tile {

using bf16 = __nv_bfloat16;
constexpr int D = 128;  // columns of a tile
constexpr int R = 64;   // rows of a tile

struct __align__(16) Tile {
  bf16 v[R * D];
};

// Element offset of 16-byte chunk `chunk` (0..15) of row `row`.
__device__ __forceinline__ int swizzled(int row, int chunk) {
  return (chunk >> 3) * (R * 64) + row * 64 + (((chunk & 7) ^ (row & 7)) << 3);
}

// The dynamic shared memory of a kernel as a T at the first 1024-byte boundary (launch with
// sizeof(T) + kSharedAlignment bytes).
constexpr int kSharedAlignment = 1024;
template <typename T>
__device__ __forceinline__ T& aligned_shared(unsigned char* raw) {
  const uint32_t address = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
  return *reinterpret_cast<T*>(raw + ((kSharedAlignment - (address & (kSharedAlignment - 1))) & (kSharedAlignment - 1)));
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One 16-byte asynchronous copy global -> shared (cp.async.cg, joins the thread's current
// commit group); when !valid nothing is read and the 16 bytes are zero-filled. Inline PTX rather
// than __pipeline_memcpy_async, whose expansion adds never-executed filler instructions that
// still take issue slots in the tile loops.
__device__ __forceinline__ void copy16(void* dst, const void* src, bool valid = true) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)), "l"(src),
               "r"(valid ? 16 : 0)
               : "memory");
}

// Loads a tile asynchronously with kThreads threads: row r from row_of(r) (nullptr: zero-filled).
// The caller commits. Each thread copies one 16-byte column chunk of the rows r0, r0 + kStep, ...
// (kStep a multiple of 8, so its destination advances by a constant: the swizzle depends on
// row & 7 only), which keeps the per-chunk work to the caller's row address and one copy.
template <int kThreads, typename RowOf>
__device__ __forceinline__ void load_tile(Tile& tile, RowOf row_of) {
  static_assert(kThreads % 128 == 0, "tiles load with whole multiples of 128 threads");
  constexpr int kStep = kThreads / 16;
  const int c = threadIdx.x & 15, r0 = threadIdx.x >> 4;
  bf16* dst = tile.v + swizzled(r0, c);
#pragma unroll
  for (int j = 0; j < R / kStep; ++j) {
    const bf16* src = row_of(r0 + j * kStep);
    copy16(dst + j * kStep * 64, src + c * 8, src != nullptr);
  }
}

// Rows [0, rows) at first + r * stride (elements); the rest zero-filled. The source pointer
// advances by a constant per copy (no per-row address arithmetic). `thread`: this thread's index
// among the kThreads that load (threadIdx.x unless a kernel splits its threads into groups).
template <int kThreads>
__device__ __forceinline__ void load_tile(Tile& tile, const bf16* first, int64_t stride, int rows, int thread) {
  static_assert(kThreads % 128 == 0, "tiles load with whole multiples of 128 threads");
  constexpr int kStep = kThreads / 16;
  const int c = thread & 15, r0 = thread >> 4;
  bf16* dst = tile.v + swizzled(r0, c);
  const bf16* src = first + r0 * stride + c * 8;
  const int64_t step = kStep * stride;
#pragma unroll
  for (int j = 0; j < R / kStep; ++j) {
    copy16(dst + j * kStep * 64, src, r0 + j * kStep < rows);
    src += step;
  }
}
template <int kThreads>
__device__ __forceinline__ void load_tile(Tile& tile, const bf16* first, int64_t stride, int rows) {
  load_tile<kThreads>(tile, first, stride, rows, static_cast<int>(threadIdx.x));
}

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], uint32_t address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address));
}

// The inverse of ldsm_x4_trans: four 8x8 b16 matrices from fragment registers, each stored
// transposed; lanes 8i .. 8i + 7 give the addresses of matrix i's 8 rows in memory (stmatrix,
// sm_90 and later). (The untransposed store of a whole A operand into a tile: store_a.)
__device__ __forceinline__ void stsm_x4_trans(uint32_t address, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(r[0]), "r"(r[1]),
               "r"(r[2]), "r"(r[3])
               : "memory");
#else
  __trap();
#endif
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

__device__ __forceinline__ float2 unpack(uint32_t x) {
  return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&x));
}

// A operand (16 x 16) of a row-major tile: rows [row0, row0 + 16), columns [col0, col0 + 16).
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const Tile& t, int row0, int col0) {
  const int lane = threadIdx.x & 31;
  ldsm_x4(a, shared_address(t.v + swizzled(row0 + (lane & 15), (col0 >> 3) + (lane >> 4))));
}

// The inverse of load_a: an A operand into rows [row0, row0 + 16), columns [col0, col0 + 16) of
// a tile (stmatrix, sm_90 and later).
__device__ __forceinline__ void store_a(Tile& t, const uint32_t (&a)[4], int row0, int col0) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int lane = threadIdx.x & 31;
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(
                   shared_address(t.v + swizzled(row0 + (lane & 15), (col0 >> 3) + (lane >> 4)))),
               "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])
               : "memory");
#else
  __trap();
#endif
}

// B operands of two n8 tiles [n0, n0 + 8), [n0 + 8, n0 + 16) over k [k0, k0 + 16), from a tile
// stored [n][k] (keys as rows for Q K^T): b = {b0(n0), b1(n0), b0(n0 + 8), b1(n0 + 8)}.
__device__ __forceinline__ void load_b_nk(uint32_t (&b)[4], const Tile& t, int n0, int k0) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
  ldsm_x4(b, shared_address(t.v + swizzled(n0 + ((m >> 1) << 3) + (lane & 7), (k0 >> 3) + (m & 1))));
}

// The same from a tile stored [k][n] (values for P V): transposed by ldmatrix.
__device__ __forceinline__ void load_b_kn(uint32_t (&b)[4], const Tile& t, int k0, int n0) {
  const int lane = threadIdx.x & 31, m = lane >> 3;
  ldsm_x4_trans(b, shared_address(t.v + swizzled(k0 + ((m & 1) << 3) + (lane & 7), (n0 >> 3) + (m >> 1))));
}

// Accumulators of a 16 x 8K product (2K n8 tiles) as the A operands (K k-steps of 16) of the next.
template <int K>
__device__ __forceinline__ void to_a(uint32_t (&a)[K][4], const float (&c)[2 * K][4]) {
#pragma unroll
  for (int kk = 0; kk < K; ++kk) {
    a[kk][0] = pack(c[2 * kk][0], c[2 * kk][1]);
    a[kk][1] = pack(c[2 * kk][2], c[2 * kk][3]);
    a[kk][2] = pack(c[2 * kk + 1][0], c[2 * kk + 1][1]);
    a[kk][3] = pack(c[2 * kk + 1][2], c[2 * kk + 1][3]);
  }
}

// s[8][4] = A(16 rows of `a` from row0) . B^T over the 128 columns, B = 64 rows of `b` ([n][k]).
__device__ __forceinline__ void product_16x64(float (&s)[8][4], const Tile& a, int row0, const Tile& b) {
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
#pragma unroll
  for (int ks = 0; ks < D / 16; ++ks) {
    uint32_t x[4];
    load_a(x, a, row0, ks * 16);
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t y[4];
      load_b_nk(y, b, np * 16, ks * 16);
      mma(s[2 * np], x, y[0], y[1]);
      mma(s[2 * np + 1], x, y[2], y[3]);
    }
  }
}

// s[8][4] (16 x 64) += A . B^T over the columns [k0, k0 + 16K): A 16 rows as K k-step fragments,
// B = the 64 rows of `b` ([n][k]).
template <int K>
__device__ __forceinline__ void product_16x64_add(float (&s)[8][4], const uint32_t (&a)[K][4], const Tile& b, int k0) {
#pragma unroll
  for (int ks = 0; ks < K; ++ks) {
#pragma unroll
    for (int np = 0; np < 4; ++np) {
      uint32_t y[4];
      load_b_nk(y, b, np * 16, k0 + ks * 16);
      mma(s[2 * np], a[ks], y[0], y[1]);
      mma(s[2 * np + 1], a[ks], y[2], y[3]);
    }
  }
}

// s[8][4] = A . B^T over the 128 columns: A 16 rows as fragments (8 k-steps), B = 64 rows of `b` ([n][k]).
__device__ __forceinline__ void product_16x64(float (&s)[8][4], const uint32_t (&a)[D / 16][4], const Tile& b) {
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.f;
  product_16x64_add<D / 16>(s, a, b, 0);
}

// acc[2N][4] (16 x 16N) += A (16 x 64, as 4 k-steps of fragments) . V (64 rows of `v`, [k][n]),
// columns [n0, n0 + 16N) of V.
template <int N>
__device__ __forceinline__ void accumulate_16xn(float (&acc)[2 * N][4], const uint32_t (&a)[4][4], const Tile& v, int n0) {
#pragma unroll
  for (int kk = 0; kk < 4; ++kk) {
#pragma unroll
    for (int dp = 0; dp < N; ++dp) {
      uint32_t y[4];
      load_b_kn(y, v, kk * 16, n0 + dp * 16);
      mma(acc[2 * dp], a[kk], y[0], y[1]);
      mma(acc[2 * dp + 1], a[kk], y[2], y[3]);
    }
  }
}

// acc[16][4] (16 x 128) += A (16 x 64, as 4 k-steps of fragments) . V (64 rows of `v`, [k][n]).
__device__ __forceinline__ void accumulate_16x128(float (&acc)[16][4], const uint32_t (&a)[4][4], const Tile& v) {
  accumulate_16xn<D / 16>(acc, a, v, 0);
}

// Makes this thread's shared-memory writes (cp.async, st.shared) visible to the async proxy
// (wgmma's operand reads); before the barrier that publishes them.
__device__ __forceinline__ void async_proxy_fence() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Software pipelining over kBuffers (default kStages) shared-memory buffers: before iteration i
// of `count` uses buffer i % kBuffers, issue the loads of iteration i + kStages - 1
// (load(j, buffer)) and wait for those of i; then the whole CTA sees them. The caller has issued
// and committed one group per iteration 0 .. kStages - 2, and ends each iteration with a barrier
// (a buffer is refilled kBuffers - kStages + 1 iterations after its use).
// kAsyncReaders: the buffers are read by wgmma (the async proxy), which must be told of the writes.
template <int kStages, bool kAsyncReaders = false, int kBuffers = kStages, typename Load>
__device__ __forceinline__ void pipeline_stage(int i, int count, Load load) {
  if (i + kStages - 1 < count) load(i + kStages - 1, (i + kStages - 1) % kBuffers);
  __pipeline_commit();  // possibly empty: one group per iteration keeps the count regular
  __pipeline_wait_prior(kStages - 1);
  if constexpr (kAsyncReaders) async_proxy_fence();
  __syncthreads();
}

}  // namespace dflash::mma_tile
