// kernel_sized.h: the tiny test models that the GPU kernels take (header-only, for the tests).
#pragma once

#include <string>

#include "target/model_config.h"

namespace dflash::target {

// A tiny Qwen3.5 whose GatedDeltaNet layers have the real head size (128), its attention heads
// `attention_head_dim` (the preset's 32, or a size the decoding attention kernel takes: 128, 256).
inline ModelConfig kernel_sized_qwen3_5(int attention_head_dim = 32) {
  std::string json = preset_config_json("tiny-qwen3_5");
  for (const std::string key : {"\"linear_key_head_dim\": 16", "\"linear_value_head_dim\": 16"}) {
    json.replace(json.find(key), key.size(), key.substr(0, key.size() - 2) + "128");
  }
  const std::string head = "\"head_dim\": 32";
  json.replace(json.find(head), head.size(), "\"head_dim\": " + std::to_string(attention_head_dim));
  return parse_model_config(json, "tiny-128");
}

}  // namespace dflash::target
