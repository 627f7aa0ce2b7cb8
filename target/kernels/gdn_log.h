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

// What the deferred step's chains kernel hands its state pass (gdn/decode_deferred.cuh), fp32, in
// one buffer per launch. A plain step: for each (sequence, value head) the output's x_0 and sum_t
// c_t v_t (kHeadFloats), then for each (sequence, group of kGdnDeferTokens heads) the one head of
// the group whose store falls due: its tokens' y (scaled), k and a, each [8 tokens][128], and e^G
// (kStoreFloats). A store of every head (store_all): one store area per (sequence, value head),
// no output. Zeros stand in for tokens past the head's count.
struct GdnDeferredHandoff {
  static constexpr int64_t kHeadFloats = 2 * kGdnHeadDim;
  static constexpr int64_t kStoreFloats = 3 * kGdnHeadDim * kGdnDeferTokens + 4;
  int sequences = 0, value_heads = 0;
  bool store_all = false;
  DFLASHD_HOST_DEVICE constexpr int groups() const { return (value_heads + kGdnDeferTokens - 1) / kGdnDeferTokens; }
  DFLASHD_HOST_DEVICE constexpr int64_t head_offset(int sequence, int head) const {
    return (int64_t{sequence} * value_heads + head) * kHeadFloats;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t store_offset(int sequence, int head) const {
    if (store_all) return (int64_t{sequence} * value_heads + head) * kStoreFloats;
    return int64_t{sequences} * value_heads * kHeadFloats +
           (int64_t{sequence} * groups() + head / kGdnDeferTokens) * kStoreFloats;
  }
  DFLASHD_HOST_DEVICE constexpr int64_t floats() const {
    if (store_all) return int64_t{sequences} * value_heads * kStoreFloats;
    return int64_t{sequences} * (value_heads * kHeadFloats + groups() * kStoreFloats);
  }
};

}  // namespace dflash::target::kernels
