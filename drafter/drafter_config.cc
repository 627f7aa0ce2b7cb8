#include "drafter/drafter_config.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common/json_limits.h"

namespace dflash::drafter {

int64_t DrafterShape::parameter_count() const {
  const int64_t h = hidden_size, d = head_dim;
  const int64_t attention = h * num_attention_heads * d * 2 + h * num_key_value_heads * d * 2 + 2 * d;
  const int64_t mlp = 3 * h * intermediate_size;
  return num_layers * (attention + mlp + 2 * h) + num_features() * h * h + 2 * h;
}

DrafterShape shape_for_target(const target::ModelConfig& t, const config::DrafterConfig& c) {
  auto fail = [](const std::string& m) { throw std::invalid_argument(m); };
  DrafterShape s;
  s.hidden_size = t.hidden_size;
  s.vocab_size = t.vocab_size;
  s.rms_norm_eps = t.rms_norm_eps;
  s.num_layers = c.num_layers;
  s.block_size = c.block_size;
  s.num_target_layers = t.num_layers;
  s.num_attention_heads = c.num_attention_heads.value_or(t.num_attention_heads);
  s.num_key_value_heads = c.num_key_value_heads.value_or(t.num_key_value_heads);
  s.head_dim = c.head_dim.value_or(t.head_dim);
  if (!c.num_attention_heads && !c.num_key_value_heads && !c.head_dim && t.head_dim > kRecipeHeadDim) {
    // Targets with heads wider than 128 (Qwen3.5 / 3.6: 256) get the published drafters' attention:
    // heads of 128 (the fused attention kernels' size), as many query heads as the largest power of
    // two that fits the hidden size, a quarter as many key-value heads. Qwen3.5-27B (hidden 5120):
    // 32 / 8; Qwen3.5-35B-A3B (hidden 2048): 16 / 4.
    s.head_dim = kRecipeHeadDim;
    s.num_attention_heads = 1;
    while (2 * s.num_attention_heads * kRecipeHeadDim <= t.hidden_size) s.num_attention_heads *= 2;
    s.num_key_value_heads = std::max<int64_t>(1, s.num_attention_heads / 4);
  }
  // Hybrid targets have an MoE or a very wide MLP; the published drafters use the dense width.
  s.intermediate_size = c.intermediate_size.value_or(t.intermediate_size > 0 ? t.intermediate_size
                                                                              : 4 * t.hidden_size);
  s.rope_theta = c.rope_theta.value_or(t.rope.theta);
  // The drafter serves the target's whole context (the serving engines size their rotary caches
  // from this field).
  if (t.max_position_embeddings > 0) s.max_position_embeddings = t.max_position_embeddings;
  if (c.target_layer_ids.empty()) {
    s.target_layer_ids = t.default_tapped_layers(c.num_target_features);
  } else {
    s.target_layer_ids.assign(c.target_layer_ids.begin(), c.target_layer_ids.end());
  }
  for (int64_t id : s.target_layer_ids) {
    if (id < 0 || id >= t.num_layers) {
      fail("drafter.target_layer_ids: layer " + std::to_string(id) + " does not exist in the target (" +
           std::to_string(t.num_layers) + " layers)");
    }
  }
  s.mask_token_id = c.mask_token_id.value_or(t.default_mask_token_id());
  if (s.mask_token_id < 0) {
    fail(std::string("drafter.mask_token_id: no default for a ") + target::family_name(t.family) +
         " target of vocabulary " + std::to_string(t.vocab_size) + "; set it to an existing token id");
  }
  if (s.mask_token_id >= t.vocab_size) {
    fail("drafter.mask_token_id: " + std::to_string(s.mask_token_id) + " is outside the target vocabulary (" +
         std::to_string(t.vocab_size) + ")");
  }
  if (s.num_attention_heads % s.num_key_value_heads != 0) {
    fail("drafter.num_attention_heads must be a multiple of drafter.num_key_value_heads");
  }
  if (s.head_dim % 2 != 0) fail("drafter.head_dim must be even (rotary embedding)");
  s.layer_types = c.layer_types;
  if (s.layer_types.empty()) s.layer_types.assign(static_cast<size_t>(s.num_layers), "full_attention");
  if (static_cast<int64_t>(s.layer_types.size()) != s.num_layers) {
    fail("drafter.layer_types: " + std::to_string(s.layer_types.size()) + " entries for drafter.num_layers " +
         std::to_string(s.num_layers));
  }
  const bool slides = std::count(s.layer_types.begin(), s.layer_types.end(), "sliding_attention") > 0;
  if (slides && !c.sliding_window) fail("drafter.layer_types has sliding_attention layers: set drafter.sliding_window");
  if (!slides && c.sliding_window) {
    fail("drafter.sliding_window is set but no layer slides: list sliding_attention in drafter.layer_types");
  }
  s.sliding_window = c.sliding_window.value_or(0);
  if (slides && s.sliding_window < s.block_size) {
    fail("drafter.sliding_window " + std::to_string(s.sliding_window) + " is smaller than drafter.block_size " +
         std::to_string(s.block_size) + ": a block must fit its own window");
  }
  return s;
}

std::string export_config_json(const DrafterShape& s) {
  nlohmann::ordered_json j;
  j["architectures"] = {"DFlashDraftModel"};
  j["model_type"] = "qwen3";
  j["hidden_size"] = s.hidden_size;
  j["intermediate_size"] = s.intermediate_size;
  j["num_hidden_layers"] = s.num_layers;
  j["num_attention_heads"] = s.num_attention_heads;
  j["num_key_value_heads"] = s.num_key_value_heads;
  j["head_dim"] = s.head_dim;
  j["hidden_act"] = "silu";
  j["rms_norm_eps"] = s.rms_norm_eps;
  j["rope_theta"] = s.rope_theta;
  j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = s.max_position_embeddings;
  j["vocab_size"] = s.vocab_size;
  j["tie_word_embeddings"] = false;
  j["attention_bias"] = false;
  j["attention_dropout"] = 0.0;
  j["layer_types"] = s.layer_types.empty() ? std::vector<std::string>(static_cast<size_t>(s.num_layers), "full_attention")
                                           : s.layer_types;
  if (s.sliding_window > 0) {
    j["sliding_window"] = s.sliding_window;
  } else {
    j["sliding_window"] = nullptr;
  }
  j["use_sliding_window"] = s.sliding_window > 0;
  j["dtype"] = "bfloat16";
  j["block_size"] = s.block_size;
  j["num_target_layers"] = s.num_target_layers;
  j["dflash_config"] = {{"mask_token_id", s.mask_token_id},
                        {"target_layer_ids", s.target_layer_ids},
                        {"block_size", s.block_size}};
  return j.dump(2) + "\n";
}

DrafterShape parse_export_config(const std::string& json_text, const std::string& source) {
  if (const std::string problem = json_text_problem(json_text); !problem.empty()) {
    throw std::runtime_error(source + ": invalid JSON: " + problem);
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
    DrafterShape s;
    s.hidden_size = j.at("hidden_size");
    s.intermediate_size = j.at("intermediate_size");
    s.num_layers = j.at("num_hidden_layers");
    s.num_attention_heads = j.at("num_attention_heads");
    s.num_key_value_heads = j.at("num_key_value_heads");
    s.head_dim = j.at("head_dim");
    s.rms_norm_eps = j.at("rms_norm_eps");
    s.rope_theta = j.at("rope_theta");
    s.max_position_embeddings = j.value("max_position_embeddings", int64_t{40960});
    s.vocab_size = j.at("vocab_size");
    s.block_size = j.at("block_size");
    s.num_target_layers = j.at("num_target_layers");
    s.mask_token_id = j.at("dflash_config").at("mask_token_id");
    s.target_layer_ids = j.at("dflash_config").at("target_layer_ids").get<std::vector<int64_t>>();
    s.layer_types = j.value("layer_types", std::vector<std::string>(static_cast<size_t>(s.num_layers), "full_attention"));
    if (static_cast<int64_t>(s.layer_types.size()) != s.num_layers) {
      throw std::runtime_error(source + ": layer_types has " + std::to_string(s.layer_types.size()) + " entries for " +
                               std::to_string(s.num_layers) + " layers");
    }
    for (const std::string& t : s.layer_types) {
      if (t != "full_attention" && t != "sliding_attention") {
        throw std::runtime_error(source + ": layer_types: unknown layer type '" + t + "'");
      }
    }
    const bool slides = std::count(s.layer_types.begin(), s.layer_types.end(), "sliding_attention") > 0;
    if (slides) {
      if (!j.contains("sliding_window") || !j["sliding_window"].is_number_integer() || j["sliding_window"].get<int64_t>() < 1) {
        throw std::runtime_error(source + ": sliding_attention layers need a positive integer sliding_window");
      }
      s.sliding_window = j["sliding_window"].get<int64_t>();
    }
    return s;
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(source + ": not a DFlash drafter config.json: " + e.what());
  }
}

namespace {
std::string text_of(int64_t v) { return std::to_string(v); }
std::string text_of(const std::vector<std::string>& names) {
  std::string out = "[";
  for (size_t i = 0; i < names.size(); ++i) out += (i ? ", " : "") + names[i];
  return out + "]";
}
std::string text_of(const std::vector<int64_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) out += (i ? ", " : "") + std::to_string(ids[i]);
  return out + "]";
}
}  // namespace

std::string shape_differences(const DrafterShape& saved, const DrafterShape& configured) {
  std::string differences;
  auto compare = [&](const char* field, const auto& there, const auto& here) {
    if (there == here) return;
    differences += std::string(differences.empty() ? "" : "; ") + field + " " + text_of(there) + " there, " +
                   text_of(here) + " configured";
  };
  compare("hidden_size", saved.hidden_size, configured.hidden_size);
  compare("num_hidden_layers", saved.num_layers, configured.num_layers);
  compare("num_attention_heads", saved.num_attention_heads, configured.num_attention_heads);
  compare("num_key_value_heads", saved.num_key_value_heads, configured.num_key_value_heads);
  compare("head_dim", saved.head_dim, configured.head_dim);
  compare("intermediate_size", saved.intermediate_size, configured.intermediate_size);
  compare("block_size", saved.block_size, configured.block_size);
  compare("mask_token_id", saved.mask_token_id, configured.mask_token_id);
  compare("target_layer_ids", saved.target_layer_ids, configured.target_layer_ids);
  // A shape without layer_types has full layers only.
  auto types = [](const DrafterShape& s) {
    return s.layer_types.empty() ? std::vector<std::string>(static_cast<size_t>(s.num_layers), "full_attention")
                                 : s.layer_types;
  };
  compare("layer_types", types(saved), types(configured));
  compare("sliding_window", saved.sliding_window, configured.sliding_window);
  return differences;
}

void check_drafter_init(const std::string& dir, const DrafterShape& configured) {
  std::ifstream in(dir + "/config.json");
  if (!in) throw std::runtime_error(dir + "/config.json: cannot read (is " + dir + " an exported drafter or a checkpoint?)");
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const std::string differences = shape_differences(parse_export_config(text, dir + "/config.json"), configured);
  if (!differences.empty()) {
    throw std::runtime_error(dir + "/config.json: this drafter does not fit the configured one (drafter.* and the "
                             "target decide it): " + differences);
  }
}

}  // namespace dflash::drafter
