// drafter_config.h: the shape of a DFlash drafter and its serving config.json (docs/recipe.md
// section 5), without torch.
//
// A drafter has the target's hidden size and vocabulary (it borrows the target's embedding and
// LM head), its own number of layers, and taps K target layers. By default it takes the
// target's attention and MLP shape, except for targets with heads wider than 128 (Qwen3.5 /
// 3.6: 256), whose drafters get the published recipe's attention: heads of 128, query heads
// the largest power of two with heads x 128 <= hidden size, a quarter as many key-value heads
// (27B: 32 / 8, 35B-A3B: 16 / 4). The run config may override each.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "target/model_config.h"

namespace dflash::drafter {

// The head size of the published drafters and of the fused attention kernels.
inline constexpr int64_t kRecipeHeadDim = 128;

struct DrafterShape {
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  double rms_norm_eps = 1e-6;
  double rope_theta = 1e6;
  int64_t max_position_embeddings = 40960;  // the target's context where its config.json gives it
  int64_t block_size = 16;
  int64_t mask_token_id = 0;
  std::vector<int64_t> target_layer_ids;  // ascending
  int64_t num_target_layers = 0;
  // Per layer "full_attention" or "sliding_attention" (num_layers entries); a sliding layer's block
  // row at position p sees context positions > p - sliding_window and its block's rows up to its
  // own (z-lab's dflash model code, SpecForge's sliding DFlash mask).
  std::vector<std::string> layer_types;
  int64_t sliding_window = 0;  // > 0 when a layer slides
  // The window of layer i: sliding_window for a sliding layer, 0 (none) for a full one (and for
  // every layer of a shape without layer_types).
  int64_t window_of(int64_t layer) const {
    const size_t i = static_cast<size_t>(layer);
    return i < layer_types.size() && layer_types[i] == "sliding_attention" ? sliding_window : 0;
  }

  int64_t num_features() const { return static_cast<int64_t>(target_layer_ids.size()); }
  // Parameters of the drafter itself (decoder layers, fc, norms; no embedding, no head).
  int64_t parameter_count() const;
};

// The drafter for `target` under the run's drafter section. Throws std::invalid_argument naming
// the config key for impossible combinations (tapped layer past the target's last, mask token
// outside the vocabulary, heads not dividing, no mask token known for the family).
DrafterShape shape_for_target(const target::ModelConfig& target, const config::DrafterConfig& drafter);

// config.json of the exported drafter (what SGLang, vLLM and transformers load).
std::string export_config_json(const DrafterShape& shape);
// Reads an exported config.json back (for drafter.init); throws std::runtime_error naming the file.
DrafterShape parse_export_config(const std::string& json_text, const std::string& source);
// What keeps a saved drafter (an export or a checkpoint) from being loaded as `configured`:
// every field that decides a tensor's shape or what the drafter computes, as "field SAVED there,
// CONFIGURED configured" joined by "; ". Empty when they agree.
std::string shape_differences(const DrafterShape& saved, const DrafterShape& configured);
// drafter.init's directory: its config.json read and compared with `configured`; throws
// std::runtime_error naming the file and every difference.
void check_drafter_init(const std::string& dir, const DrafterShape& configured);

}  // namespace dflash::drafter
