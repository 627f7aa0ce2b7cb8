// block_attention.h: the DFlash drafter's block attention as fused CUDA kernels (no torch in this
// interface; drafter/block_attention.cc wraps them for autograd).
//
// The mask (docs/recipe.md): block n (anchor a_n, B query rows) sees the context keys
// j < a_n and the B keys of its own block. With grouped-query attention the rep = Hq / Hkv query
// heads of one key-value head read the same keys, so one tile of 64 query rows is (block n,
// key-value head h, up to 64 of its rep * B (head, row) pairs): every row of a tile has the same
// visible keys, a prefix of the context plus the block. The kernels walk exactly those key tiles
// (flash-attention style: online softmax, nothing quadratic in memory; in a sliding-window layer
// only the tiles that meet the block's windows, the rows' window edges and the causal block
// masked per element), bf16 operands on tensor
// cores, fp32 scores, softmax and accumulation. Two kernel sets, same fragments and results to
// rounding: mma.sync m16n8k16 per warp (sm_80 and newer), and on Hopper (built for sm_90a)
// wgmma per warpgroup with its products issued asynchronously while the warps compute the
// exponentials (force_mma_sync in common/kernel_variants.h forces the first set).
//   forward   one CTA per (block, key-value head, row tile): O and the log-sum-exp.
//   backward  dq kernel, one CTA per (block, key-value head, row tile): D = rowsum(dO o O), dQ,
//             and the gradients of the block's own keys and values (only this tile reads them);
//             dkv kernel, one CTA per (64 context keys, or 128 as two warpgroups with wgmma,
//             key-value head, chunk of blocks): dK, dV of the context, summed over the blocks
//             that see the keys. No atomics: results are bit-identical run to run (partial sums
//             over row tiles and block chunks are written separately and added in a fixed order
//             by a last kernel; with one row tile or one chunk the bf16 gradients are written
//             directly).
// Head size 128, block size <= 16, sm_80 and newer.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "common/host_device.h"

namespace dflash::drafter::kernels {

constexpr int kAttentionHeadDim = 128;
constexpr int kAttentionMaxBlock = 16;
constexpr int kAttentionTileRows = 64;

struct BlockAttentionProblem {
  const void* q = nullptr;                         // bf16 [blocks * block_size, q_heads, 128]
  const void* k_context = nullptr;                 // bf16 [context, kv_heads, 128]
  const void* v_context = nullptr;
  const void* k_block = nullptr;                   // bf16 [blocks * block_size, kv_heads, 128]
  const void* v_block = nullptr;
  const int32_t* anchors = nullptr;                // device [blocks], ascending, each in [0, context)
  int blocks = 0, block_size = 0, context = 0, q_heads = 0, kv_heads = 0;
  float scale = 0;
  // > 0: a sliding-window layer. Block row i of anchor a sees the context keys j with
  // a + i - window < j < a and its own block's keys 0..i (causal); the kernels walk only the key
  // tiles inside the block's windows and mask the rest. 0: the whole context before the anchor
  // and the whole block.
  int window = 0;
  // Row tiles per (block, key-value head): ceil(q_heads / kv_heads * block_size / 64).
  DFLASHD_HOST_DEVICE int row_tiles() const { return (q_heads / kv_heads * block_size + kAttentionTileRows - 1) / kAttentionTileRows; }
  // Per-row statistics live in "slots": [kv_heads, blocks, row_tiles, 64] fp32.
  DFLASHD_HOST_DEVICE int64_t slots() const { return static_cast<int64_t>(kv_heads) * blocks * row_tiles() * kAttentionTileRows; }
};

// out: bf16 [blocks * block_size, q_heads, 128]; lse2: fp32 slots, log2 of the softmax
// denominator of each row in units of scale * log2(e) scores (+inf on padding slots).
void block_attention_forward(const BlockAttentionProblem& p, void* out, float* lse2, cudaStream_t stream);

struct BlockAttentionBackward {
  const void* out = nullptr;    // the forward's output
  const void* d_out = nullptr;  // bf16, like out
  const float* lse2 = nullptr;  // the forward's slots
  float* delta = nullptr;       // scratch slots: rowsum(dO o O)
  void* dq = nullptr;           // bf16, like q
  void* dk_block = nullptr;     // bf16, like k_block (and v_block)
  void* dv_block = nullptr;
  void* dk_context = nullptr;   // bf16, like k_context (and v_context)
  void* dv_context = nullptr;
  // fp32 scratch of partials_floats(p) floats (none needed when that is 0): the partial sums over
  // row tiles and block chunks, added in a fixed order into the bf16 gradients.
  float* partials = nullptr;
  int context_chunks = 1;       // chunks of blocks that the dkv kernel splits its work into

  DFLASHD_HOST_DEVICE int64_t block_partial_floats(const BlockAttentionProblem& p) const {
    return p.row_tiles() > 1 ? static_cast<int64_t>(p.row_tiles()) * p.blocks * p.block_size * p.kv_heads * kAttentionHeadDim : 0;
  }
  DFLASHD_HOST_DEVICE int64_t context_partial_floats(const BlockAttentionProblem& p) const {
    return context_chunks > 1 ? static_cast<int64_t>(context_chunks) * p.context * p.kv_heads * kAttentionHeadDim : 0;
  }
  // Keys then values, blocks then context.
  DFLASHD_HOST_DEVICE int64_t partials_floats(const BlockAttentionProblem& p) const {
    return 2 * (block_partial_floats(p) + context_partial_floats(p));
  }
};

void block_attention_backward(const BlockAttentionProblem& p, const BlockAttentionBackward& g, cudaStream_t stream);

// A number of block chunks that gives the dkv kernel enough CTAs on a GPU of `sms` SMs.
int context_chunks_for(const BlockAttentionProblem& p, int sms);

// Empty when the kernels have an image for the current device; otherwise the CUDA error text.
const char* attention_kernels_unavailable_on_current_device();

}  // namespace dflash::drafter::kernels
