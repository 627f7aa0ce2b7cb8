// wgmma.cuh: Hopper warpgroup tensor-core products (wgmma.mma_async, sm_90a) over mma_tile's
// Tiles. Device code only; the functions compile to a trap on other architectures, so host code
// launches kernels that use them only on compute capability 9.0 of a build for sm_90a (as
// drafter/kernels/block_attention.cu's warpgroup_kernels() decides).
//
// Why: with mma.sync every warp reads the whole B operand from shared memory through ldmatrix
// (4x per 4-warp CTA); a warpgroup's wgmma reads it once, straight from shared memory.
//
// Layout: a Tile (64 rows x 128 bf16) is two 64-column halves of 8 KB, each row of a half 128
// bytes with its 16-byte chunks XOR-swizzled by row: exactly the "128-byte swizzle" canonical
// layout of the PTX ISA (8-row core groups 1024 bytes apart). Tiles must be 1024-byte aligned
// (mma_tile::aligned_shared).
//   K-major operand (rows = M or N, columns = the reduction): k-step s (16 columns) starts at
//     half s / 4, byte 32 (s % 4) of the row; stride between 8-row groups (SBO) 1024.
//   MN-major operand (rows = the reduction, columns = N): k-step s (16 rows) starts at byte
//     2048 s; LBO = 8192 (the next 64 columns), SBO = 1024 (the next 8 rows).
// Fragments: the accumulator of an m64nN product gives warp w of the warpgroup rows
// [16 w, 16 w + 16) in the mma.m16n8 accumulator layout of mma_tile.cuh (n8 tile j = c[j]), and
// a register A operand is the mma.m16n8k16 A fragment of the warp's 16 rows, so the softmax and
// to_a code of the mma.sync kernels applies unchanged.
#pragma once

#include <cstdint>

#include "common/mma_tile.cuh"

namespace dflash::wgmma {

using mma_tile::Tile;

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define DFLASHD_WGMMA 1
#endif

// The accumulator of an m64n64 (32 floats), m64n128 (64) or m64n192 (96) product as asm operands %0..
// (read and written), and the same registers in the instruction's text.
#define DFLASHD_WGMMA_D32(d) \
  "+f"(d[0][0]), "+f"(d[0][1]), "+f"(d[0][2]), "+f"(d[0][3]), "+f"(d[1][0]), "+f"(d[1][1]), "+f"(d[1][2]), \
  "+f"(d[1][3]), "+f"(d[2][0]), "+f"(d[2][1]), "+f"(d[2][2]), "+f"(d[2][3]), "+f"(d[3][0]), "+f"(d[3][1]), \
  "+f"(d[3][2]), "+f"(d[3][3]), "+f"(d[4][0]), "+f"(d[4][1]), "+f"(d[4][2]), "+f"(d[4][3]), "+f"(d[5][0]), \
  "+f"(d[5][1]), "+f"(d[5][2]), "+f"(d[5][3]), "+f"(d[6][0]), "+f"(d[6][1]), "+f"(d[6][2]), "+f"(d[6][3]), \
  "+f"(d[7][0]), "+f"(d[7][1]), "+f"(d[7][2]), "+f"(d[7][3])
#define DFLASHD_WGMMA_D64(d) \
  DFLASHD_WGMMA_D32(d), \
  "+f"(d[8][0]), "+f"(d[8][1]), "+f"(d[8][2]), "+f"(d[8][3]), "+f"(d[9][0]), "+f"(d[9][1]), "+f"(d[9][2]), \
  "+f"(d[9][3]), "+f"(d[10][0]), "+f"(d[10][1]), "+f"(d[10][2]), "+f"(d[10][3]), "+f"(d[11][0]), "+f"(d[11][1]), \
  "+f"(d[11][2]), "+f"(d[11][3]), "+f"(d[12][0]), "+f"(d[12][1]), "+f"(d[12][2]), "+f"(d[12][3]), "+f"(d[13][0]), \
  "+f"(d[13][1]), "+f"(d[13][2]), "+f"(d[13][3]), "+f"(d[14][0]), "+f"(d[14][1]), "+f"(d[14][2]), "+f"(d[14][3]), \
  "+f"(d[15][0]), "+f"(d[15][1]), "+f"(d[15][2]), "+f"(d[15][3])
#define DFLASHD_WGMMA_D32_TEXT \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
#define DFLASHD_WGMMA_D64_TEXT \
  "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, "

__device__ __forceinline__ uint64_t descriptor(uint32_t address, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading >> 4) << 16) |
         (static_cast<uint64_t>(stride >> 4) << 32) | (1ull << 62);  // 62: 128-byte swizzle
}

__device__ __forceinline__ uint64_t k_major(const Tile& t, int step) {
  return descriptor(mma_tile::shared_address(t.v) + (step >> 2) * 8192 + (step & 3) * 32, 16, 1024);
}

__device__ __forceinline__ uint64_t mn_major(const Tile& t, int step) {
  return descriptor(mma_tile::shared_address(t.v) + step * 2048, 8192, 1024);
}

// Keeps the compiler from moving register reads or writes across the asynchronous products.
template <int N>
__device__ __forceinline__ void fence_operands(float (&c)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) {
    asm volatile("" : "+f"(c[i][0]), "+f"(c[i][1]), "+f"(c[i][2]), "+f"(c[i][3])::"memory");
  }
}
template <int N>
__device__ __forceinline__ void fence_operands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}

__device__ __forceinline__ void arrive() {
#ifdef DFLASHD_WGMMA
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}

__device__ __forceinline__ void commit() {
#ifdef DFLASHD_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#else
  __trap();
#endif
}

// Waits until at most kPending committed groups are in flight, then pins the registers the
// finished products wrote (or read) so the compiler reads them only after the wait.
template <int kPending, typename... Operands>
__device__ __forceinline__ void wait(Operands&... operands) {
#ifdef DFLASHD_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
#endif
  (fence_operands(operands), ...);
}

// d (64 x 64) = (accumulate ? d : 0) + A . B, A and B K-major descriptors.
__device__ __forceinline__ void mma_64x64(float (&d)[8][4], uint64_t a, uint64_t b, int accumulate) {
#ifdef DFLASHD_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      DFLASHD_WGMMA_D32_TEXT
      "%32, %33, p, 1, 1, 0, 0;\n}\n"
      : DFLASHD_WGMMA_D32(d)
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

// d (64 x 64) = (accumulate ? d : 0) + A . B, A the warp's 16 rows as an mma A fragment
// (registers), B a K-major descriptor.
__device__ __forceinline__ void mma_64x64(float (&d)[8][4], const uint32_t (&a)[4], uint64_t b, int accumulate) {
#ifdef DFLASHD_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
      DFLASHD_WGMMA_D32_TEXT
      "{%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
      : DFLASHD_WGMMA_D32(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(accumulate));
#endif
}

// d (64 x 128) += A . B, A the warp's 16 rows as an mma A fragment, B an MN-major descriptor.
__device__ __forceinline__ void mma_64x128(float (&d)[16][4], const uint32_t (&a)[4], uint64_t b) {
#ifdef DFLASHD_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      DFLASHD_WGMMA_D64_TEXT
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : DFLASHD_WGMMA_D64(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
#endif
}

// d (64 x 128) = (accumulate ? d : 0) + A . B, A and B K-major descriptors (B: 128 rows of n).
__device__ __forceinline__ void mma_64x128(float (&d)[16][4], uint64_t a, uint64_t b, int accumulate) {
#ifdef DFLASHD_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 "
      DFLASHD_WGMMA_D64_TEXT
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : DFLASHD_WGMMA_D64(d)
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

// d (64 x 128) = (accumulate ? d : 0) + A . B over 32 columns of e4m3 (32 bytes a row, the
// byte offsets of a bf16 k-step), fp32 sums; A and B K-major descriptors (B: 128 rows of n). FP8
// operands are K-major only (no transpose).
__device__ __forceinline__ void mma_64x128_e4m3(float (&d)[16][4], uint64_t a, uint64_t b, int accumulate) {
#ifdef DFLASHD_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 "
      DFLASHD_WGMMA_D64_TEXT
      "%64, %65, p, 1, 1;\n}\n"
      : DFLASHD_WGMMA_D64(d)
      : "l"(a), "l"(b), "r"(accumulate));
#endif
}

// The warpgroup's products over whole tiles, issued as one committed group each; the caller
// waits (wait<n>(results...)) before it reads the results or lets the operands change.
// s = A . B^T over the 128 columns: A 64 rows of `a`, B 64 rows of `b` (both [row][k]); warp w
// gets rows [16 w, 16 w + 16).
__device__ __forceinline__ void issue_product(float (&s)[8][4], const Tile& a, const Tile& b) {
  arrive();
#pragma unroll
  for (int step = 0; step < 8; ++step) mma_64x64(s, k_major(a, step), k_major(b, step), step);
  commit();
}

// s = A . B^T over the 128 columns: A the warp's 16 rows as 8 k-step fragments (registers), B
// 64 rows of `b` ([n][k]). `a` must stay unchanged until the wait.
__device__ __forceinline__ void issue_product(float (&s)[8][4], uint32_t (&a)[8][4], const Tile& b) {
  fence_operands(a);
  arrive();
#pragma unroll
  for (int step = 0; step < 8; ++step) mma_64x64(s, a[step], k_major(b, step), step);
  commit();
}

// acc (64 x 128) += A (the warp's 16 x 64 as 4 k-step fragments) . V (64 rows of `v`, [k][n]).
// `a` must stay unchanged until the wait.
__device__ __forceinline__ void issue_accumulate(float (&acc)[16][4], uint32_t (&a)[4][4], const Tile& v) {
  fence_operands(acc);
  fence_operands(a);
  arrive();
#pragma unroll
  for (int step = 0; step < 4; ++step) mma_64x128(acc, a[step], mn_major(v, step));
  commit();
}

}  // namespace dflash::wgmma
