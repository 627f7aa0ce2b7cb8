#include "daemon/decode_args.h"

#include <ATen/ATen.h>

#include <iostream>
#include <map>
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

std::optional<std::vector<target::TargetOptions>> target_options(const std::string& command, const TargetArgs& a) {
  std::vector<at::Device> devices;
  std::stringstream list(a.device_text);
  for (std::string part; std::getline(list, part, ',');) {
    try {
      devices.emplace_back(part);
    } catch (const std::exception&) {
      std::cerr << "dflashd " << command << ": --device: '" << part << "' is not a device (cpu, cuda:0, ...)\n";
      return std::nullopt;
    }
    if (devices.back().type() != devices.front().type()) {
      std::cerr << "dflashd " << command << ": --device " << a.device_text << ": the stages of one target are all "
                << "GPUs or all the CPU\n";
      return std::nullopt;
    }
  }
  if (devices.empty()) devices.push_back(at::hasCUDA() ? at::Device(at::kCUDA, 0) : at::Device(at::kCPU));
  target::TargetOptions o;
  o.device = devices.front();
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
  std::vector<target::TargetOptions> stages;
  for (const at::Device& device : devices) {
    stages.push_back(o);
    stages.back().device = device;
  }
  return stages;
}

std::unique_ptr<target::StagedTarget> load_decoding_target(const TargetArgs& a,
                                                           const std::vector<target::TargetOptions>& stages) {
  const target::ModelConfig config = a.preset.empty()
                                         ? target::load_model_config(a.dir)
                                         : target::parse_model_config(target::preset_config_json(a.preset), a.preset);
  if (a.preset.empty() && !a.random_weights) return target::load_staged_target(a.dir, config.num_layers - 1, stages);
  return target::random_staged_target(config, config.num_layers - 1, stages, target::run_target_seed(a.target_seed));
}

void check_decoding_batch(const std::string& command, const target::IncrementalTarget& target, int64_t sequences,
                          int64_t decoders, int64_t tokens, int64_t step_tokens) {
  const std::vector<int64_t> capacities = pipeline::gpu_capacities();
  std::vector<target::LayerRange> stages;
  std::vector<int> gpus;
  for (size_t s = 0; s < target.stage_count(); ++s) {
    const at::Device device = target.stage(s).options().device;
    if (!device.is_cuda() || device.index() < 0 || device.index() >= static_cast<int>(capacities.size())) return;
    stages.push_back({target.stage(s).first_layer(), target.stage(s).last_layer(), s + 1 == target.stage_count()});
    gpus.push_back(device.index());
  }
  const int64_t dtype_bytes = static_cast<int64_t>(c10::elementSize(target.options().dtype));
  const int64_t state_bytes = static_cast<int64_t>(c10::elementSize(target.options().decode_state_dtype));
  const std::map<int, int64_t> each =
      target::decoding_bytes_by_gpu(target.config(), stages, gpus, tokens, step_tokens, dtype_bytes, state_bytes);
  std::map<int, int64_t> left;
  for (const auto& [gpu, bytes] : each) {
    const std::vector<pipeline::GpuMemory> used = pipeline::gpu_memory({gpu});
    // What the weights left, less 1 GB for the CUDA context and the libraries' workspaces.
    const int64_t allocated = used.empty() ? 0 : used[0].allocated_bytes;
    left[gpu] = capacities[static_cast<size_t>(gpu)] - allocated - (int64_t{1} << 30);
  }
  const target::DecodingFit fit = target::decoding_batch_that_fits(each, left);
  if (sequences <= fit.sequences) return;
  auto gb = [](int64_t b) { return log::fixed(static_cast<double>(b) / 1e9, 1); };
  const int64_t bytes = each.at(fit.gpu), per_decoder = fit.sequences / std::max<int64_t>(1, decoders);
  throw std::runtime_error(
      command + ": " + std::to_string(sequences) + " sequences at once (--max-batch" +
      (decoders > 1 ? " x " + std::to_string(decoders) + " decoders" : "") + ") of up to " + std::to_string(tokens) +
      " tokens need about " + gb(sequences * bytes) + " GB of decoding caches on cuda:" + std::to_string(fit.gpu) +
      " (" + gb(bytes) + " GB each), but the target's weights leave about " + gb(left.at(fit.gpu)) + " GB there: " +
      (per_decoder > 0 ? "use --max-batch " + std::to_string(per_decoder) + " or fewer"
                       : "not one sequence of that length fits") +
      ", or shorter prompts / --max-new-tokens" +
      (target.stage_count() > 1 ? "" : ", or split the target over several GPUs (--device cuda:0,cuda:1)"));
}

}  // namespace dflash::daemon
