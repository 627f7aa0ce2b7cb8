#include "target/model_config.h"

#include <cmath>
#include <fstream>
#include <optional>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/json_limits.h"

namespace dflash::target {
namespace {

using json = nlohmann::json;

[[noreturn]] void fail(const std::string& source, const std::string& what) {
  throw ModelConfigError(source + ": " + what);
}

int64_t get_int(const json& j, const std::string& source, const char* key, std::optional<int64_t> fallback = {}) {
  if (!j.contains(key) || j[key].is_null()) {
    if (fallback) return *fallback;
    fail(source, std::string("missing key '") + key + "'");
  }
  if (!j[key].is_number_integer()) fail(source, std::string("'") + key + "' must be an integer, got " + j[key].dump());
  const int64_t v = j[key].get<int64_t>();
  if (v < 0) fail(source, std::string("'") + key + "' must be >= 0, got " + std::to_string(v));
  return v;
}

double get_double(const json& j, const std::string& source, const char* key, double fallback) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number()) fail(source, std::string("'") + key + "' must be a number, got " + j[key].dump());
  return j[key].get<double>();
}

bool get_bool(const json& j, const char* key, bool fallback) {
  return j.contains(key) && j[key].is_boolean() ? j[key].get<bool>() : fallback;
}

}  // namespace

const char* family_name(Family family) {
  switch (family) {
    case Family::qwen3_5: return "qwen3_5";
    case Family::qwen3_next: return "qwen3_next";
    case Family::qwen3: return "qwen3";
    case Family::llama: return "llama";
  }
  return "?";
}

bool ModelConfig::layer_is_moe(int64_t layer) const {
  if (num_experts == 0) return false;
  for (int64_t l : mlp_only_layers)
    if (l == layer) return false;
  return (layer + 1) % decoder_sparse_step == 0;
}

std::vector<int64_t> ModelConfig::default_tapped_layers(int count) const {
  // ids[j] = round(1 + j*(L-4)/(K-1)): L=36 -> [1,9,17,25,33], L=64 -> [1,16,31,46,61].
  std::vector<int64_t> ids;
  if (count == 1) return {std::max<int64_t>(0, num_layers - 3)};
  for (int j = 0; j < count; ++j) {
    ids.push_back(static_cast<int64_t>(std::lround(1.0 + j * static_cast<double>(num_layers - 4) / (count - 1))));
  }
  return ids;
}

int64_t ModelConfig::default_mask_token_id() const {
  switch (family) {
    case Family::qwen3_5:
    case Family::qwen3_next: return vocab_size > 248070 ? 248070 : -1;
    case Family::qwen3: return vocab_size > 151669 ? 151669 : -1;
    case Family::llama: return -1;
  }
  return -1;
}

namespace {

Family family_of(const std::string& type, const std::string& source) {
  if (type == "qwen3_5" || type == "qwen3_5_text") return Family::qwen3_5;
  if (type == "qwen3_next" || type == "qwen3_5_moe" || type == "qwen3_5_moe_text") return Family::qwen3_next;
  if (type == "qwen3") return Family::qwen3;
  if (type == "llama") return Family::llama;
  fail(source, "model_type '" + type + "' is not supported (qwen3_5, qwen3_5_moe, qwen3_next, qwen3, llama)");
}

// RoPE: transformers 5 writes rope_parameters, 4 wrote rope_theta + rope_scaling.
void parse_rope(const json& j, const std::string& source, bool hybrid, RopeConfig* out) {
  const json* rope = nullptr;
  if (j.contains("rope_parameters") && j["rope_parameters"].is_object()) rope = &j["rope_parameters"];
  else if (j.contains("rope_scaling") && j["rope_scaling"].is_object()) rope = &j["rope_scaling"];
  out->theta = get_double(j, source, "rope_theta", rope ? get_double(*rope, source, "rope_theta", 10000) : 10000);
  out->partial_rotary_factor =
      get_double(j, source, "partial_rotary_factor", rope ? get_double(*rope, source, "partial_rotary_factor", 1.0) : 1.0);
  if (!rope) return;
  const std::string rope_type = rope->value("rope_type", rope->value("type", "default"));
  if (rope_type == "llama3") {
    out->llama3_factor = get_double(*rope, source, "factor", 8);
    out->llama3_low_freq_factor = get_double(*rope, source, "low_freq_factor", 1);
    out->llama3_high_freq_factor = get_double(*rope, source, "high_freq_factor", 4);
    out->llama3_original_max_position = get_int(*rope, source, "original_max_position_embeddings", int64_t{8192});
  } else if (rope_type != "default" && !(hybrid && rope_type == "mrope")) {
    fail(source, "rope_type '" + rope_type + "' is not supported (default, llama3)");
  }
}

// The hybrid families' GatedDeltaNet shapes and the layer kinds (layer_types, or every
// full_attention_interval-th layer full attention).
void parse_linear_attention(const json& j, const std::string& source, ModelConfig* c) {
  c->linear_num_key_heads = get_int(j, source, "linear_num_key_heads");
  c->linear_num_value_heads = get_int(j, source, "linear_num_value_heads");
  c->linear_key_head_dim = get_int(j, source, "linear_key_head_dim");
  c->linear_value_head_dim = get_int(j, source, "linear_value_head_dim");
  c->linear_conv_kernel_dim = get_int(j, source, "linear_conv_kernel_dim", int64_t{4});
  c->fused_gdn_projections = c->model_type == "qwen3_next";
  if (c->linear_num_key_heads == 0 || c->linear_num_value_heads % c->linear_num_key_heads != 0) {
    fail(source, "linear_num_value_heads must be a multiple of linear_num_key_heads (> 0)");
  }
  if (j.contains("layer_types") && j["layer_types"].is_array()) {
    for (const auto& t : j["layer_types"]) {
      const std::string name = t.is_string() ? t.get<std::string>() : "";
      if (name == "full_attention") c->layer_types.push_back(LayerKind::full_attention);
      else if (name == "linear_attention") c->layer_types.push_back(LayerKind::linear_attention);
      else fail(source, "layer_types: unknown entry " + t.dump());
    }
    if (static_cast<int64_t>(c->layer_types.size()) != c->num_layers) {
      fail(source, "layer_types has " + std::to_string(c->layer_types.size()) + " entries for " +
                       std::to_string(c->num_layers) + " layers");
    }
  } else {
    const int64_t interval = get_int(j, source, "full_attention_interval", int64_t{4});
    for (int64_t i = 0; i < c->num_layers; ++i) {
      c->layer_types.push_back((i + 1) % interval == 0 ? LayerKind::full_attention : LayerKind::linear_attention);
    }
  }
}

// The mixture-of-experts fields (num_experts 0: every layer dense).
void parse_experts(const json& j, const std::string& source, ModelConfig* c) {
  c->num_experts = get_int(j, source, "num_experts", int64_t{0});
  if (c->num_experts == 0) return;
  c->num_experts_per_tok = get_int(j, source, "num_experts_per_tok");
  c->moe_intermediate_size = get_int(j, source, "moe_intermediate_size");
  c->shared_expert_intermediate_size = get_int(j, source, "shared_expert_intermediate_size", int64_t{0});
  c->norm_topk_prob = get_bool(j, "norm_topk_prob", true);
  c->decoder_sparse_step = std::max<int64_t>(1, get_int(j, source, "decoder_sparse_step", int64_t{1}));
  if (j.contains("mlp_only_layers") && j["mlp_only_layers"].is_array()) {
    for (const auto& l : j["mlp_only_layers"]) c->mlp_only_layers.push_back(l.get<int64_t>());
  }
}

}  // namespace

ModelConfig parse_model_config(const std::string& json_text, const std::string& source) {
  if (const std::string problem = json_text_problem(json_text); !problem.empty()) fail(source, "invalid JSON: " + problem);
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::exception& e) {
    fail(source, std::string("invalid JSON: ") + e.what());
  }
  if (!root.is_object()) fail(source, "not a JSON object");
  // Qwen3.5 VL checkpoints nest the language model's config.
  const json& j = root.contains("text_config") && root["text_config"].is_object() ? root["text_config"] : root;
  ModelConfig c;
  c.source = source;
  c.model_type = root.value("model_type", j.value("model_type", ""));
  c.family = family_of(c.model_type, source);
  const bool hybrid = c.family == Family::qwen3_5 || c.family == Family::qwen3_next;
  c.hidden_size = get_int(j, source, "hidden_size");
  c.num_layers = get_int(j, source, "num_hidden_layers");
  c.num_attention_heads = get_int(j, source, "num_attention_heads");
  c.num_key_value_heads = get_int(j, source, "num_key_value_heads", c.num_attention_heads);
  c.head_dim = get_int(j, source, "head_dim", c.num_attention_heads ? c.hidden_size / c.num_attention_heads : 0);
  c.intermediate_size = get_int(j, source, "intermediate_size", int64_t{0});
  c.vocab_size = get_int(j, source, "vocab_size");
  c.max_position_embeddings = get_int(j, source, "max_position_embeddings", int64_t{0});
  c.rms_norm_eps = get_double(j, source, "rms_norm_eps", 1e-6);
  c.attention_bias = get_bool(j, "attention_bias", false);
  c.tie_word_embeddings = get_bool(root, "tie_word_embeddings", get_bool(j, "tie_word_embeddings", false));
  c.gated_attention = hybrid;
  c.zero_centred_norm = hybrid;
  c.qk_norm = c.family != Family::llama;
  if (c.hidden_size == 0 || c.num_layers == 0 || c.num_attention_heads == 0 || c.num_key_value_heads == 0 ||
      c.head_dim == 0) {
    fail(source, "hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads and head_dim must be > 0");
  }
  if (c.num_attention_heads % c.num_key_value_heads != 0) {
    fail(source, "num_attention_heads (" + std::to_string(c.num_attention_heads) +
                     ") must be a multiple of num_key_value_heads (" + std::to_string(c.num_key_value_heads) + ")");
  }

  parse_rope(j, source, hybrid, &c.rope);
  if (hybrid) {
    parse_linear_attention(j, source, &c);
    parse_experts(j, source, &c);
  } else {
    c.layer_types.assign(c.num_layers, LayerKind::full_attention);
  }
  bool needs_dense_mlp = false;
  for (int64_t i = 0; i < c.num_layers; ++i) needs_dense_mlp |= !c.layer_is_moe(i);
  if (needs_dense_mlp && c.intermediate_size == 0) fail(source, "missing key 'intermediate_size'");
  return c;
}

ModelConfig load_model_config(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) throw ModelConfigError(path + ": cannot read (is " + model_dir + " a Hugging Face model directory?)");
  std::stringstream text;
  text << in.rdbuf();
  return parse_model_config(text.str(), path);
}

std::string preset_config_json(const std::string& preset) {
  // Deliberately odd shapes: value heads a multiple > 1 of key heads, GQA, partial rotary.
  if (preset == "tiny-qwen3_5") {
    return R"({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text",
      "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2,
      "head_dim": 32, "intermediate_size": 96, "vocab_size": 512, "rms_norm_eps": 1e-6,
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
      "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
      "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25}},
      "tie_word_embeddings": false})";
  }
  if (preset == "tiny-qwen3_next") {
    return R"({"model_type": "qwen3_next", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 96, "vocab_size": 512, "rms_norm_eps": 1e-6,
      "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
      "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
      "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
      "shared_expert_intermediate_size": 48, "norm_topk_prob": true, "decoder_sparse_step": 1,
      "rope_theta": 10000000, "partial_rotary_factor": 0.25})";
  }
  if (preset == "tiny-qwen3") {
    return R"({"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
      "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "vocab_size": 512,
      "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": false})";
  }
  if (preset == "tiny-llama") {
    return R"({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
      "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 512, "rms_norm_eps": 1e-5,
      "rope_theta": 500000, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}})";
  }
  throw ModelConfigError("unknown target preset '" + preset + "' (tiny-qwen3_5, tiny-qwen3_next, tiny-qwen3, tiny-llama)");
}

}  // namespace dflash::target
