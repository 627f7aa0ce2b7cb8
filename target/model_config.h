// model_config.h: the architecture of a target model, read from a Hugging Face config.json.
//
// Accepts the text config at the top level or nested under "text_config" (Qwen3.5 / 3.6 VL
// checkpoints), rope_theta at the top level or inside "rope_parameters" / "rope_scaling"
// (transformers 5 vs 4), and the layer_types list or its default rule (full attention when
// (i+1) % full_attention_interval == 0). No torch here. Errors throw ModelConfigError naming
// the file and the key.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash::target {

class ModelConfigError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class Family { qwen3_5, qwen3_next, qwen3, llama };
const char* family_name(Family family);

enum class LayerKind { full_attention, linear_attention };

struct RopeConfig {
  double theta = 10000;
  double partial_rotary_factor = 1.0;
  // Llama 3 frequency scaling ("rope_type": "llama3"); factor 0 = none.
  double llama3_factor = 0;
  double llama3_low_freq_factor = 1;
  double llama3_high_freq_factor = 4;
  int64_t llama3_original_max_position = 8192;
};

struct ModelConfig {
  std::string source;      // the config.json path
  std::string model_type;  // as written ("qwen3_5", "qwen3_5_text", "qwen3_next", "qwen3_5_moe", "qwen3", "llama")
  Family family = Family::qwen3;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;
  int64_t vocab_size = 0;
  int64_t max_position_embeddings = 0;  // the context the target was trained for (0: config.json does not say)
  double rms_norm_eps = 1e-6;
  bool attention_bias = false;
  bool tie_word_embeddings = false;
  bool gated_attention = false;        // qwen3_5 / qwen3_next: q_proj also yields a sigmoid gate
  bool zero_centred_norm = false;      // qwen3_5 / qwen3_next: y = x_hat * (1 + w)
  bool qk_norm = false;                // per-head q_norm / k_norm (qwen3*, not llama)
  RopeConfig rope;
  std::vector<LayerKind> layer_types;
  // GatedDeltaNet (linear attention) layers.
  int64_t linear_num_key_heads = 0;
  int64_t linear_num_value_heads = 0;
  int64_t linear_key_head_dim = 0;
  int64_t linear_value_head_dim = 0;
  int64_t linear_conv_kernel_dim = 0;
  bool fused_gdn_projections = false;  // qwen3_next: in_proj_qkvz / in_proj_ba, grouped per key head
  // Mixture of experts (qwen3_next, qwen3_5_moe).
  int64_t num_experts = 0;
  int64_t num_experts_per_tok = 0;
  int64_t moe_intermediate_size = 0;
  int64_t shared_expert_intermediate_size = 0;
  bool norm_topk_prob = true;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;

  bool layer_is_moe(int64_t layer) const;
  // The default tapped layers of docs/recipe.md: K ids spread from 1 to L-3.
  std::vector<int64_t> default_tapped_layers(int count) const;
  // The mask token the DFlash recipe uses for this family, or -1 if it has none.
  int64_t default_mask_token_id() const;
};

ModelConfig parse_model_config(const std::string& json_text, const std::string& source);
ModelConfig load_model_config(const std::string& model_dir);  // reads model_dir/config.json

// The built-in tiny models (tests, demo): "tiny-qwen3_5", "tiny-qwen3_next", "tiny-qwen3",
// "tiny-llama". Returns the config.json text; throws ModelConfigError for unknown names.
std::string preset_config_json(const std::string& preset);

}  // namespace dflash::target
