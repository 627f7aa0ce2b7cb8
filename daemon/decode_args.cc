#include "daemon/decode_args.h"

#include <ATen/ATen.h>

#include <iostream>
#include <stdexcept>

#include "common/log.h"
#include "pipeline/gpu_memory.h"
#include "target/decode_plan.h"
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
  else if (k == "--state-dtype") *ok = (a->state_dtype_text = v) == "float32" || v == "bfloat16";
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
  } else if (dtype == "float8") {
    o.dtype = at::kBFloat16;
    o.fp8_weights = true;
  } else {
    std::cerr << "dflashd " << command << ": --dtype must be bfloat16, float32 or float8\n";
    return std::nullopt;
  }
  o.decode_state_dtype = a.state_dtype_text == "bfloat16" ? at::kBFloat16 : at::kFloat;
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

void check_decoding_batch(const std::string& command, const target::TargetModel& model, int64_t sequences,
                          int64_t tokens, int64_t step_tokens) {
  const at::Device device = model.options().device;
  const std::vector<int64_t> capacities = pipeline::gpu_capacities();
  if (!device.is_cuda() || device.index() < 0 || device.index() >= static_cast<int>(capacities.size())) return;
  const std::vector<pipeline::GpuMemory> used = pipeline::gpu_memory({device.index()});
  // What the weights left, less 1 GB for the CUDA context and the libraries' workspaces.
  const int64_t left = capacities[static_cast<size_t>(device.index())] - (used.empty() ? 0 : used[0].allocated_bytes) -
                       (int64_t{1} << 30);
  const int64_t dtype_bytes = static_cast<int64_t>(c10::elementSize(model.options().dtype));
  const int64_t state_bytes = static_cast<int64_t>(c10::elementSize(model.options().decode_state_dtype));
  const int64_t each = target::decoding_sequence_bytes(model.config(), tokens, step_tokens, dtype_bytes, state_bytes);
  const int64_t fits = target::decoding_batch_that_fits(left, each);
  if (sequences <= fits) return;
  auto gb = [](int64_t bytes) { return log::fixed(static_cast<double>(bytes) / 1e9, 1); };
  throw std::runtime_error(
      command + ": " + std::to_string(sequences) + " sequences at once (--max-batch) of up to " +
      std::to_string(tokens) + " tokens need about " + gb(sequences * each) + " GB of decoding caches on " +
      device.str() + " (" + gb(each) + " GB each), but the target's weights leave about " + gb(left) + " GB: " +
      (fits > 0 ? "use --max-batch " + std::to_string(fits) + " or fewer" : "not one sequence of that length fits") +
      ", or shorter prompts / --max-new-tokens");
}

}  // namespace dflash::daemon
