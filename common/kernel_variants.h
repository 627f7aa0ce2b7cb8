// kernel_variants.h: a test and benchmark hook over the kernel sets that have two variants on
// Hopper, wgmma (what runs there) and mma.sync (what runs on other GPUs). Tests force the
// mma.sync variant on an H200 to check it against the reference there; benchmarks time the
// two in one process. For the target's bf16 projections the two are the stream-K GEMM (Hopper,
// up to 128 rows) and cuBLASLt (everywhere else). The daemon never calls force_mma_sync() and
// reads nothing from the environment for it: on a given GPU the variant is a fixed function of
// its compute capability.
// No CUDA or torch here, so that host-only tests and benches can include it.
#pragma once

#include <atomic>

namespace dflash {

enum class MmaKernels { gated_delta_net = 0, block_attention = 1, projections = 2 };

inline std::atomic<bool> forced_mma_sync[3] = {false, false, false};

// Whether launches of `set` (from any thread, from now on) use the mma.sync variant on Hopper.
inline void force_mma_sync(MmaKernels set, bool force) { forced_mma_sync[static_cast<int>(set)].store(force); }
inline bool mma_sync_forced(MmaKernels set) { return forced_mma_sync[static_cast<int>(set)].load(); }

}  // namespace dflash
