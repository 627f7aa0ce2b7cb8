// gdn_log.h: deferred stores' schedule and log layout (gated_delta_net.h GdnDeferredStores), without
// CUDA or torch: the kernel, the incremental target that allocates the logs and the decoding memory
// plan (target/decode_plan.h) share them.
//
// Plain decoding steps on bf16 states (gdn/decode_deferred.cuh) read every head's state each step
// but store it only every kGdnDeferTokens-th token, the tokens in between kept in a log per
// sequence and layer. With n the tokens a sequence stepped since all its heads last stored, head h
// holds min(n, (n + h % kGdnDeferTokens) % kGdnDeferTokens) of them unstored and stores when
// (n + 1 + h % kGdnDeferTokens) % kGdnDeferTokens == 0: each step an eighth of a sequence's heads
// store. Token i since the last full store lies in slot i % kGdnDeferTokens of the log.
#pragma once

#include <cstdint>

#include "common/host_device.h"

namespace dflash::target::kernels {

constexpr int kGdnHeadDim = 128;
constexpr int kGdnDeferTokens = 8;

// One slot of a log: each key head's normalised k (fp32, as the step normalises it), then each
// value head's v (bf16), g and beta (fp32); slots 16-byte aligned.
struct GdnDecodeLog {
  int key_heads = 0, value_heads = 0;
  DFLASHD_HOST_DEVICE constexpr int64_t k_offset(int key_head) const {
    return int64_t{key_head} * kGdnHeadDim * 4;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t v_offset(int head) const {
    return k_offset(key_heads) + int64_t{head} * kGdnHeadDim * 2;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t g_offset(int head) const {
    return v_offset(value_heads) + int64_t{head} * 4;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t beta_offset(int head) const {
    return g_offset(value_heads) + int64_t{head} * 4;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t slot_bytes() const { return (beta_offset(value_heads) + 15) / 16 * 16; }
  // A whole log: one sequence's in one layer.
  constexpr int64_t bytes() const { return kGdnDeferTokens * slot_bytes(); }
};

}  // namespace dflash::target::kernels
