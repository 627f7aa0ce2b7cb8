// loss.h: the DFlash training objective (docs/recipe.md) and its metrics.
//
// Block n (anchor a), offset k = 1..B-1 predicts token a + k (same-position labels); offset 0
// carries no loss, nor do labels past the sequence end or outside the loss mask. Weighted
// cross entropy w_k = exp(-(k-1)/gamma); loss = sum(CE w valid) / sum(w valid), where the
// denominator is the GLOBAL one (all data-parallel ranks, all accumulation steps): it depends
// only on the labels, so the trainer sums it before the forward and passes it in.
//
// The LM head over the target vocabulary is never materialised for all rows: rows go through
// it in chunks, and each chunk's gradient with respect to the hidden state is computed right
// away (softmax - onehot, weighted) and kept; the backward only scales it. Memory: one chunk
// of logits plus a [rows, H] gradient. Rows without loss (offset 0 of every block, labels past
// the end or outside the loss mask: at least 1 in B) skip the LM head; their gradient is zero.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <random>
#include <vector>

#include "drafter/model.h"

namespace dflash::drafter {

struct BlockTargets {
  at::Tensor labels;   // [rows] int64 (0 where not valid)
  at::Tensor weights;  // [rows] fp32: w_k where valid, else 0
  at::Tensor offsets;  // [rows] int64: position k within the block
  at::Tensor valid;    // [rows with weight > 0] int64 row indices: the only rows the LM head sees
  double weight_sum = 0;
};

// Labels and weights for every block row of the batch, on `device`.
BlockTargets make_block_targets(const DrafterBatch& batch, int64_t block_size, double gamma, const at::Device& device);

struct LossStats {
  double loss_sum = 0;                // sum of CE * w over valid rows (local)
  double weight_sum = 0;              // sum of w over valid rows (local)
  std::vector<int64_t> correct, count;  // per block offset: argmax == label, valid rows
  void add(const LossStats& other);
  // acc_k for k = 1..B-1 (index k), 0 where no row was valid.
  std::vector<double> accuracy() const;
  // Expected acceptance length tau = 1 + sum_k prod_{i<=k} acc_i.
  double tau() const;
};

// The loss (a scalar, differentiable with respect to `hidden`) = local weighted CE sum divided
// by `global_weight_sum`. `lm_head` [vocab, H] is frozen. Fills *stats.
at::Tensor dflash_loss(const at::Tensor& hidden, const at::Tensor& lm_head, const BlockTargets& targets,
                       double global_weight_sum, int64_t chunk_rows, int64_t block_size, LossStats* stats);

// Up to `max_anchors` anchors among positions a with loss_mask[a] and loss_mask[a + 1] both
// set, uniform without replacement, ascending (int64 CPU tensor).
at::Tensor sample_anchors(const std::vector<uint8_t>& loss_mask, int64_t max_anchors, std::mt19937_64& rng);

}  // namespace dflash::drafter
