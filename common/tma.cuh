// tma.cuh: Hopper's tensor memory accelerator (sm_90), device side: a 2-D tile of a tensor map
// copied into shared memory, its bytes counted on a TransactionBarrier (barriers.cuh), with an L2
// eviction hint. The tensor maps are encoded on the host (stream_gemm.cu) and passed as
// __grid_constant__ kernel parameters.
#pragma once

#include <cstdint>

namespace dflash::tma {

// L2 policies for the hint: data read once (streamed weights) leaves first; data every CTA reads
// (the activations) stays.
__device__ __forceinline__ uint64_t evict_first() {
  uint64_t policy = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}
__device__ __forceinline__ uint64_t evict_last() {
  uint64_t policy = 0;
#if __CUDA_ARCH__ >= 900
  asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;\n" : "=l"(policy));
#endif
  return policy;
}

// Loads the box of `map` at (column, row) (elements; column is the contiguous dimension) into
// shared memory at `destination`, completing its bytes on the barrier at `barrier`. Rows and
// columns outside the tensor land as zeros and still count.
__device__ __forceinline__ void load_2d(uint32_t destination, const void* map, int column, int row, uint32_t barrier,
                                        uint64_t policy) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(destination),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(barrier), "l"(policy)
      : "memory");
#endif
}

// Fetches the tensor map's descriptor ahead of its first use.
__device__ __forceinline__ void prefetch_map(const void* map) {
#if __CUDA_ARCH__ >= 900
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
#endif
}

}  // namespace dflash::tma
