#include "daemon/decode_args.h"

#include <ATen/ATen.h>

#include <iostream>

#include "target/model_config.h"

namespace dflash::daemon {

bool parse_ids(const std::string& text, std::vector<int64_t>* ids) {
  std::stringstream s(text);
  for (std::string part; std::getline(s, part, ',');) {
    int64_t id = 0;
    if (!parse_number(part, &id) || id < 0) return false;
    ids->push_back(id);
  }
  return !ids->empty();
}

bool parse_target_option(const std::string& k, const std::string& v, TargetArgs* a, bool* ok) {
  *ok = true;
  if (k == "--target") a->dir = v;
  else if (k == "--preset") a->preset = v;
  else if (k == "--device") a->device_text = v;
  else if (k == "--dtype") a->dtype_text = v;
  else if (k == "--target-seed") *ok = parse_number(v, &a->target_seed);
  else return false;
  return true;
}

bool parse_decoding_option(const std::string& k, const std::string& v, decode::GenerateSettings* s,
                           int64_t* max_batch, bool* ok) {
  if (k == "--max-new-tokens") *ok = parse_number(v, &s->max_new_tokens) && s->max_new_tokens > 0;
  else if (k == "--max-batch") *ok = parse_number(v, max_batch) && *max_batch > 0;
  else if (k == "--temperature") *ok = parse_number(v, &s->sampling.temperature);
  else if (k == "--top-p") *ok = parse_number(v, &s->sampling.top_p);
  else if (k == "--top-k") *ok = parse_number(v, &s->sampling.top_k);
  else if (k == "--seed") *ok = parse_number(v, &s->seed);
  else if (k == "--stop-token-ids") *ok = parse_ids(v, &s->stop_token_ids);
  else return false;
  return true;
}

std::optional<target::TargetOptions> target_options(const std::string& command, const TargetArgs& a) {
  target::TargetOptions o;
  try {
    o.device = a.device_text.empty() ? (at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU))
                                     : at::Device(a.device_text);
  } catch (const std::exception&) {
    std::cerr << "dflashd " << command << ": --device: '" << a.device_text << "' is not a device (cpu, cuda:0, ...)\n";
    return std::nullopt;
  }
  const std::string dtype = a.dtype_text.empty() ? (o.device.is_cuda() ? "bfloat16" : "float32") : a.dtype_text;
  if (dtype == "bfloat16") {
    o.dtype = at::kBFloat16;
  } else if (dtype == "float32") {
    o.dtype = at::kFloat;
  } else {
    std::cerr << "dflashd " << command << ": --dtype must be bfloat16 or float32\n";
    return std::nullopt;
  }
  o.allow_slow_path = a.allow_slow_path;
  return o;
}

std::unique_ptr<target::TargetModel> load_decoding_target(const TargetArgs& a, const target::TargetOptions& options) {
  const target::ModelConfig config = a.preset.empty()
                                         ? target::load_model_config(a.dir)
                                         : target::parse_model_config(target::preset_config_json(a.preset), a.preset);
  if (a.preset.empty() && !a.random_weights) return target::load_target(a.dir, config.num_layers - 1, options);
  return target::random_target(config, config.num_layers - 1, options, target::run_target_seed(a.target_seed));
}

}  // namespace dflash::daemon
