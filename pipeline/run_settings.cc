#include "pipeline/run_settings.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <set>

namespace dflash::pipeline {

std::string training_settings_json(const config::Config& config, const drafter::DrafterShape& shape,
                                   int64_t drafter_replicas_per_node) {
  const config::TrainConfig& t = config.train;
  nlohmann::ordered_json j;
  j["gpus.drafter (replicas per node)"] = drafter_replicas_per_node;
  j["target.dtype"] = config::name_of(config.target.dtype);
  const nlohmann::ordered_json exported = nlohmann::ordered_json::parse(drafter::export_config_json(shape));
  for (auto it = exported.begin(); it != exported.end(); ++it) j["drafter: " + it.key()] = *it;
  j["train.anchors_per_sequence"] = t.anchors_per_sequence;
  j["train.sequences_per_step"] = t.sequences_per_step;
  j["train.grad_accumulation_steps"] = t.grad_accumulation_steps;
  j["train.epochs"] = t.epochs;
  j["train.max_steps"] = t.max_steps;
  j["train.learning_rate"] = t.learning_rate;
  j["train.min_learning_rate"] = t.min_learning_rate;
  j["train.warmup_ratio"] = t.warmup_ratio;
  j["train.weight_decay"] = t.weight_decay;
  j["train.adam_beta1"] = t.adam_beta1;
  j["train.adam_beta2"] = t.adam_beta2;
  j["train.adam_epsilon"] = t.adam_epsilon;
  j["train.grad_clip_norm"] = t.grad_clip_norm;
  j["train.loss_gamma"] = config.loss_gamma();
  j["train.seed"] = t.seed;
  j["train.deterministic"] = t.deterministic;
  j["train.on_nonfinite"] = t.on_nonfinite == config::OnNonfinite::skip ? "skip" : "stop";
  return j.dump();
}

std::string setting_differences(const std::vector<std::string>& values, const std::vector<std::string>& labels) {
  if (std::all_of(values.begin(), values.end(), [&](const std::string& v) { return v == values[0]; })) return "";
  std::vector<nlohmann::json> objects;
  std::set<std::string> keys;
  for (const std::string& v : values) {
    nlohmann::json j = nlohmann::json::parse(v, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object()) break;
    for (auto it = j.begin(); it != j.end(); ++it) keys.insert(it.key());
    objects.push_back(std::move(j));
  }
  std::string text;
  if (objects.size() == values.size()) {
    for (const std::string& key : keys) {
      std::vector<std::string> each;
      for (const nlohmann::json& j : objects) each.push_back(j.contains(key) ? j[key].dump() : "(none)");
      if (std::all_of(each.begin(), each.end(), [&](const std::string& e) { return e == each[0]; })) continue;
      text += (text.empty() ? "" : "; ") + key + ":";
      for (size_t r = 0; r < each.size(); ++r) text += (r ? ", " : " ") + labels[r] + " " + each[r];
    }
    return text;
  }
  for (size_t r = 0; r < values.size(); ++r) text += (r ? "; " : "") + labels[r] + ": " + values[r];
  return text;
}

}  // namespace dflash::pipeline
