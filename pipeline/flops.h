// flops.h: model FLOPs of the pipeline's work, for MFU (docs/targets.md accounting: matmuls at
// 2 FLOP per multiply-add, attention cores at their exact masked size, LM head forward plus the
// backward to the hidden state only).
#pragma once

#include <cstdint>

#include "drafter/drafter_config.h"
#include "target/model_config.h"

namespace dflash::pipeline {

// Target forward over `tokens` tokens of one sequence, up to and including `last_layer`.
double target_flops(const target::ModelConfig& c, int64_t last_layer, int64_t tokens);

// One drafter training step over one sequence of `context` tokens with `rows` block rows
// (anchors * B) whose anchors sum to `anchor_sum`: 3x forward of the layers (forward +
// backward), context K/V projections, fc, and the LM head (forward + backward to hidden).
double drafter_flops(const drafter::DrafterShape& s, int64_t context, int64_t rows, int64_t anchor_sum);

}  // namespace dflash::pipeline
