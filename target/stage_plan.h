// stage_plan.h: how a target's layers are cut into pipeline stages (stages.h), without torch:
// each layer's forward cost per token, and the contiguous cut that balances them. The memory
// plan (pipeline/memory_plan.h) uses the same cut to say what each GPU holds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "target/model_config.h"

namespace dflash::target {

// Which part of the model a TargetModel holds: layers first..last; the embedding when it starts
// at layer 0; the final norm and LM head when `head` (a pipeline stage other than the last has
// none of them).
struct LayerRange {
  int64_t first = 0, last = 0;
  bool head = true;
};

// Forward FLOPs per token of each layer 0..num_layers-1 in sequences of `tokens` tokens: twice
// the weights a token passes through (a MoE layer's routed experts and shared expert, not all
// experts) plus the attention's scores over the causal context, or the GatedDeltaNet's state
// updates.
std::vector<double> layer_costs(const ModelConfig& c, int64_t tokens);

// Contiguous ranges covering layers 0..costs.size()-1, `stages` of them (each at least one
// layer), that minimise the largest stage's cost. Throws std::invalid_argument when there are
// more stages than layers.
std::vector<LayerRange> plan_stages(const std::vector<double>& costs, size_t stages);

// The cut of a target's layers 0..last_layer into `stages` for sequences of `tokens` tokens: what
// a StagedTarget builds and the memory plan reports (one rule for both). `shares`, when given,
// receives each stage's share of the forward cost.
std::vector<LayerRange> plan_target_stages(const ModelConfig& c, int64_t last_layer, size_t stages, int64_t tokens,
                                           std::vector<double>* shares = nullptr);

}  // namespace dflash::target
