// smem_ring.cuh: a ring of shared-memory stages that TMA fills and consumer warps read, for the
// warp-specialised GEMMs (target/kernels/stream_gemm, target/kernels/grouped_fp8). Stage s has
// two barriers: full[s] completes when the producer's bytes have landed, empty[s] when each of the
// kReaders consumer warps has said it finished reading the stage.
#pragma once

#include <cstdint>

#include "common/barriers.cuh"
#include "common/mma_tile.cuh"

namespace dflash::smem_ring {

// kStages buffers of kBytes (1024-byte aligned: TMA's 128-byte swizzle) and their barriers.
template <int kBytes, int kStages, int kReaders>
struct Ring {
  static constexpr int kBufferBytes = kBytes;
  static constexpr int kDepth = kStages;
  alignas(1024) unsigned char buffer[kStages][kBytes];
  uint64_t full[kStages];
  uint64_t empty[kStages];

  __device__ __forceinline__ uint32_t address(int stage) const { return mma_tile::shared_address(buffer[stage]); }
  __device__ __forceinline__ barriers::TransactionBarrier full_at(int stage) const {
    return {mma_tile::shared_address(&full[stage])};
  }
  __device__ __forceinline__ barriers::TransactionBarrier empty_at(int stage) const {
    return {mma_tile::shared_address(&empty[stage])};
  }
  // One thread, before any use (then fence_init and a CTA sync).
  __device__ __forceinline__ void init() const {
    for (int s = 0; s < kStages; ++s) {
      full_at(s).init(1);
      empty_at(s).init(kReaders);
    }
  }
};

// A position in a ring: the stage and the parity of its current use.
struct Position {
  int stage = 0;
  uint32_t phase = 0;
  template <int kStages>
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) {
      stage = 0;
      phase ^= 1;
    }
  }
};

}  // namespace dflash::smem_ring
