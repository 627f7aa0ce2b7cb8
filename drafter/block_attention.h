// block_attention.h: the DFlash drafter's attention, exact, without compilation and without a
// dense [N*B, S+N*B] mask. Thread-safe: no global state; any number of threads may call it.
//
// One sequence: N blocks of B query rows; block n (anchor a_n) sees the context keys
// j < a_n (strictly: the anchor's own target state does not exist at serving time) and all
// B keys of its own block, nothing else (docs/recipe.md).
//
// The "split" path: keys are split into parts that need no (or only a small) mask, each part
// gives a partial output and its log-sum-exp, and the parts merge through the log-sum-exp.
// Blocks are taken in anchor order, in groups of `group_blocks`; per group
//   part A: the group's rows against context keys [0, a_max of the group) with the staircase
//           mask of that small window,
//   part B: each block against its own B keys, batched, unmasked.
// Backward recomputes the scores per group and runs the standard attention backward of each
// part against the *merged* output and log-sum-exp (the split-KV identity): exact gradients,
// memory O(one group). GQA-native: query heads are grouped per key-value head, keys are never
// repeated. On GPUs with bf16/fp16 inputs the same parts run on PyTorch's fused
// memory-efficient attention kernels (variable-length for the blocks, a staircase bias per
// group; key-value heads repeated for them), which is 2.3x faster at the 27B drafter shape
// (bench/RESULTS.md); BlockAttentionShape::path chooses. Precision of the math
// path: fp32 inputs compute in fp32; bf16/fp16 inputs on a GPU keep their
// precision as matmul operands (tensor cores) with fp32 accumulation, fp32 scores, softmax,
// output and log-sum-exp, as flash attention does. This portable path is the reference for
// the fused kernels (drafter/kernels/block_attention.h): one flash-attention style pass that
// walks only the key tiles a block sees, forward and backward, no compilation, 2.6x faster than
// the split path on the memory-efficient kernels at the 27B drafter shape (bench/RESULTS.md).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <string>

namespace dflash::drafter {

// Which implementation runs. automatic: the fused kernels where they can run (a CUDA GPU with
// their image, bf16, head size 128, block size <= 16), else PyTorch's memory-efficient kernels
// on a GPU with bf16/fp16, else the math path. Asking for the kernels where they cannot run is
// an error that says why. (The daemon decides once at start, from drafter.attention, and refuses
// `automatic` falling back from the kernels on a GPU.)
enum class BlockAttentionPath { automatic, kernels, efficient, math };

struct BlockAttentionShape {
  int64_t block_size = 16;
  int64_t group_blocks = 64;  // blocks per group of the split paths: bounds one group's memory
  double scale = 0;           // 0: head_dim^-0.5
  BlockAttentionPath path = BlockAttentionPath::automatic;
  // A sliding-window layer (> 0): block row r of anchor a (position a + r) sees context keys
  // j > a + r - sliding_window (and j < a), and its own block's rows 0..r (causal); the fused
  // kernels walk only the key tiles that meet a block's windows, the split paths only the context
  // inside a group's windows. 0: a full layer (the whole context before the anchor, the whole
  // block).
  int64_t sliding_window = 0;
};

// Why the fused kernels cannot run for these inputs (names the device, dtype or dimension), or
// nullopt when they can.
std::optional<std::string> block_attention_kernels_unavailable(const at::Tensor& q, int64_t block_size);

// The path `asked` resolves to for queries like `like` (its device, dtype and head size) with
// blocks of block_size: the path, its name "kernels" | "efficient" | "math" (metrics) and a
// description for the startup log that says why the fused kernels do not run where they do not.
// Throws std::invalid_argument where `asked` is kernels and they cannot run.
struct BlockAttentionPathInfo {
  BlockAttentionPath path = BlockAttentionPath::math;
  std::string name, description;
};
BlockAttentionPathInfo describe_block_attention_path(const at::Tensor& like, int64_t block_size,
                                                    BlockAttentionPath asked = BlockAttentionPath::automatic);

// q [M=N*B, Hq, d]; k_context, v_context [S, Hkv, d]; k_block, v_block [M, Hkv, d];
// anchors int64 [N] on the CPU, ascending, each in [0, S). Returns [M, Hq, d] (q's dtype).
// Differentiable with respect to q, k_context, v_context, k_block and v_block.
at::Tensor block_attention(const at::Tensor& q, const at::Tensor& k_context, const at::Tensor& v_context,
                           const at::Tensor& k_block, const at::Tensor& v_block, const at::Tensor& anchors,
                           const BlockAttentionShape& shape);

// The correctness reference: one SDPA over [context ; blocks] with the dense boolean mask of
// docs/recipe.md (what the Python trainers build). Differentiable through autograd.
at::Tensor block_attention_dense_reference(const at::Tensor& q, const at::Tensor& k_context,
                                           const at::Tensor& v_context, const at::Tensor& k_block,
                                           const at::Tensor& v_block, const at::Tensor& anchors,
                                           int64_t block_size, int64_t sliding_window = 0);

}  // namespace dflash::drafter
