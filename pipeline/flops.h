// flops.h: model FLOPs of the pipeline's work, for MFU (docs/targets.md accounting: matmuls at
// 2 FLOP per multiply-add, attention cores at their exact masked size, LM head forward plus the
// backward to the hidden state only).
#pragma once

#include <cstdint>
#include <vector>

#include "drafter/drafter_config.h"
#include "target/model_config.h"

namespace dflash::pipeline {

// Target forward over `tokens` tokens of one sequence, up to and including `last_layer`.
double target_flops(const target::ModelConfig& c, int64_t last_layer, int64_t tokens);

// (row, key) pairs one query head of a drafter layer attends over a sequence's `anchors`: block
// row i of anchor a sees the context keys before a and all B keys of its block; in a
// sliding-window layer (window > 0) only the context keys j > a + i - window and its block's
// keys 0..i.
double drafter_attention_pairs(const std::vector<int64_t>& anchors, int64_t block_size, int64_t window);

// One drafter training step over one sequence of `context` tokens with these anchors (each a
// block of B rows): 3x forward of the layers (forward + backward; each layer's attention core
// at its own mask, sliding or full), context K/V projections, fc, and the LM head (forward +
// backward to hidden).
double drafter_flops(const drafter::DrafterShape& s, int64_t context, const std::vector<int64_t>& anchors);

}  // namespace dflash::pipeline
