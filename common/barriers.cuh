// barriers.cuh: typed barriers and hand-offs for warp-specialised kernels, so that kernel bodies
// say what synchronises with what instead of carrying PTX (ThunderKittens' kittens::barrier is
// the model). Each helper is one or two PTX instructions, inlined.
//
//   grid dependency   dependents_may_launch / wait_for_prerequisite (programmatic dependent launch)
//   NamedBarrier      a subset of a CTA's warps: sync (arrive and wait) or arrive (a producer's signal)
//   cluster           cluster_sync, cluster_rank, peer_address (a variable's address in another CTA)
//   TransactionBarrier  an mbarrier whose phase completes when its arrivals and the bytes they
//                     announced have landed; store_to_peer writes into a peer CTA and counts
//                     there
#pragma once

#include <cstdint>

namespace dflash::barriers {

// ---- grid dependency (sm_90 and newer; no-ops elsewhere and when the launch did not ask for it)
// A kernel that says dependents_may_launch lets the next kernel in the stream, launched as a
// programmatic dependent, be scheduled onto SMs as its own CTAs leave (once every CTA of it has
// said so); that kernel calls wait_for_prerequisite before it reads anything its predecessor
// writes, which returns when the predecessor has finished and its writes are visible.
__device__ __forceinline__ void dependents_may_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void wait_for_prerequisite() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

// The first statement of a kernel launched as a programmatic dependent (launch.h) that reads its
// inputs at once: its CTAs are resident before the previous kernel ends, and its own dependents
// may launch as soon as all of its CTAs have started.
__device__ __forceinline__ void start_as_dependent() {
  wait_for_prerequisite();
  dependents_may_launch();
}

// ---- named barriers: ids 1..15 (0 is __syncthreads); `threads` counts every thread that syncs
// or arrives on the barrier (a multiple of 32). A consumer syncs; a producer that must not wait
// arrives.
struct NamedBarrier {
  int id;
  int threads;
  __device__ __forceinline__ void sync() const {
    asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
  __device__ __forceinline__ void arrive() const {
    asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
  }
};

// ---- clusters (sm_90) -------------------------------------------------------------------------
// Every thread of every CTA of the cluster; writes before it (shared memory of any CTA of the
// cluster included) are visible after it.
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_rank() {
  uint32_t rank;
  asm("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
  return rank;
}
// The shared-memory address `local` (of this CTA) as the same variable of CTA `rank` of the
// cluster sees it: for stores into, and barriers of, that CTA.
__device__ __forceinline__ uint32_t peer_address(uint32_t local, uint32_t rank) {
  uint32_t remote;
  asm("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
  return remote;
}

// ---- transaction barriers (mbarrier, sm_90) ----------------------------------------------------
// A 64-bit barrier in shared memory (`address`: its shared-memory address). Each phase completes
// when `arrivals` threads have arrived and every byte announced by expect_bytes has landed;
// waiters name the phase by its parity.
struct TransactionBarrier {
  uint32_t address;
  // Once, by one thread, before any use; then fence_init (one thread) and a CTA or cluster sync.
  __device__ __forceinline__ void init(uint32_t arrivals) const {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(address), "r"(arrivals));
  }
  // Makes initialised barriers visible to the cluster (other CTAs arrive on them).
  static __device__ __forceinline__ void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Arrives and announces `bytes` to land in this phase.
  __device__ __forceinline__ void expect_bytes(uint32_t bytes) const {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(address), "r"(bytes) : "memory");
  }
  // Arrives without announcing bytes (a consumer's release of the buffer the barrier guards).
  __device__ __forceinline__ void arrive() const {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(address) : "memory");
  }
  // Until the phase of parity `phase` has completed.
  __device__ __forceinline__ void wait(uint32_t phase) const {
    uint32_t done = 0;
    while (!done) {
      asm volatile(
          "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
          : "=r"(done)
          : "r"(address), "r"(phase)
          : "memory");
    }
  }
};

// Stores `value` at `remote` in a peer CTA's shared memory and counts its 4 bytes on the peer's
// transaction barrier at `remote_barrier` (both from peer_address). No memory fence: a release
// at cluster scope would also wait for this thread's global stores.
__device__ __forceinline__ void store_to_peer(uint32_t remote, float value, uint32_t remote_barrier) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [%0], %1, [%2];\n" ::"r"(remote), "f"(value),
               "r"(remote_barrier)
               : "memory");
}

}  // namespace dflash::barriers
