#include "daemon/inspect.h"

#include <ATen/ATen.h>

#include <iostream>
#include <optional>
#include <sstream>

#include "common/safetensors.h"
#include "common/token_file.h"
#include "daemon/exit_codes.h"
#include "target/model.h"

namespace dflash::daemon {
namespace {

constexpr const char* kHelp = R"(Usage: dflashd inspect target --model DIR --tokens FILE --layers 1,3 --out OUT.safetensors
                              [--device cpu|cuda:N] [--dtype float32|bfloat16|float8] [--allow-slow-path]

Runs the target of DIR (a Hugging Face model directory) on every sequence of FILE (JSON Lines,
{"input_ids": [...]} per line) and writes the outputs of the given decoder layers (layer id i =
the output of decoder layer i) to OUT.safetensors: one tensor `layer.<id>` of shape
[sequences, tokens, hidden] per layer (shorter sequences zero-padded to the longest), plus
`lengths` (int64 [sequences]). --dtype float8 keeps the projections block-scaled FP8 (bf16
activations and outputs), as target.dtype: float8.
)";

}  // namespace

namespace {

struct InspectArgs {
  std::string model_dir, tokens_path, out_path, device_text = "cpu", dtype_text = "float32";
  std::vector<int64_t> layers;  // sorted, unique
  target::TargetOptions options;
};

// `--layers 3,1,2` as sorted unique numbers; false (with a message) on a part that is not one.
bool parse_layers(const std::string& text, std::vector<int64_t>* layers) {
  std::stringstream s(text);
  for (std::string part; std::getline(s, part, ',');) {
    try {
      size_t used = 0;
      layers->push_back(std::stoll(part, &used));
      if (used != part.size()) throw std::invalid_argument(part);
    } catch (const std::exception&) {
      std::cerr << "dflashd inspect: --layers: '" << part << "' is not a layer number\n";
      return false;
    }
  }
  std::sort(layers->begin(), layers->end());
  layers->erase(std::unique(layers->begin(), layers->end()), layers->end());
  return true;
}

// The options after `target`; an exit code when the command ends here (help, bad usage).
std::optional<int> parse_inspect_args(const std::vector<std::string>& args, InspectArgs* out) {
  std::string layers_text;
  for (size_t i = 1; i < args.size(); ++i) {
    auto value = [&](std::string* v) {
      if (i + 1 >= args.size()) return false;
      *v = args[++i];
      return true;
    };
    const std::string& a = args[i];
    bool ok = true;
    if (a == "--model") ok = value(&out->model_dir);
    else if (a == "--tokens") ok = value(&out->tokens_path);
    else if (a == "--layers") ok = value(&layers_text);
    else if (a == "--out") ok = value(&out->out_path);
    else if (a == "--device") ok = value(&out->device_text);
    else if (a == "--dtype") ok = value(&out->dtype_text);
    else if (a == "--allow-slow-path") out->options.allow_slow_path = true;
    else if (a == "--help" || a == "-h") return std::cout << kHelp, exit_code::kOk;
    else {
      std::cerr << "dflashd inspect: unknown option " << a << "\n\n" << kHelp;
      return exit_code::kUsage;
    }
    if (!ok) {
      std::cerr << "dflashd inspect: " << a << " needs a value\n\n" << kHelp;
      return exit_code::kUsage;
    }
  }
  if (out->model_dir.empty() || out->tokens_path.empty() || layers_text.empty() || out->out_path.empty()) {
    std::cerr << "dflashd inspect: --model, --tokens, --layers and --out are required\n\n" << kHelp;
    return exit_code::kUsage;
  }
  if (!parse_layers(layers_text, &out->layers)) return exit_code::kUsage;
  try {
    out->options.device = at::Device(out->device_text);
  } catch (const std::exception&) {
    std::cerr << "dflashd inspect: --device: '" << out->device_text << "' is not a device (cpu, cuda:0, ...)\n";
    return exit_code::kUsage;
  }
  if (out->dtype_text == "float32") out->options.dtype = at::kFloat;
  else if (out->dtype_text == "bfloat16") out->options.dtype = at::kBFloat16;
  else if (out->dtype_text == "float8") out->options.dtype = at::kBFloat16, out->options.fp8_weights = true;
  else {
    std::cerr << "dflashd inspect: --dtype must be float32, bfloat16 or float8\n";
    return exit_code::kUsage;
  }
  return std::nullopt;
}

// Layers that exist and token ids inside the vocabulary; an exit code (with a message) otherwise.
std::optional<int> check_inputs(const InspectArgs& a, const target::ModelConfig& config,
                                const std::vector<TokenSample>& samples) {
  for (int64_t l : a.layers) {
    if (l < 0 || l >= config.num_layers) {
      std::cerr << "dflashd inspect: --layers: layer " << l << " does not exist in " << a.model_dir << " (0.."
                << config.num_layers - 1 << ")\n";
      return exit_code::kUsage;
    }
  }
  for (const auto& s : samples) {
    for (int64_t id : s.input_ids) {
      if (id >= config.vocab_size) {
        std::cerr << a.tokens_path << ":" << s.line << ": token id " << id << " is outside the vocabulary of "
                  << a.model_dir << " (" << config.vocab_size << ")\n";
        return exit_code::kFailure;
      }
    }
  }
  return std::nullopt;
}

// The sequences packed into one forward; each layer's output written zero-padded per sequence.
void write_layer_outputs(const InspectArgs& a, const target::ModelConfig& config,
                         const std::vector<TokenSample>& samples) {
  auto model = target::load_target(a.model_dir, a.layers.back(), a.options);
  std::vector<int64_t> ids, cu_seqlens{0}, lengths;
  int64_t longest = 0;
  for (const auto& s : samples) {
    ids.insert(ids.end(), s.input_ids.begin(), s.input_ids.end());
    cu_seqlens.push_back(static_cast<int64_t>(ids.size()));
    lengths.push_back(static_cast<int64_t>(s.input_ids.size()));
    longest = std::max(longest, lengths.back());
  }
  const auto outputs = model->forward(at::tensor(ids, at::TensorOptions().dtype(at::kLong)), cu_seqlens, a.layers);
  std::vector<at::Tensor> keep;  // owns the bytes until written
  std::vector<TensorToWrite> tensors;
  const int64_t sequences = static_cast<int64_t>(samples.size()), hidden = config.hidden_size;
  for (size_t i = 0; i < a.layers.size(); ++i) {
    at::Tensor padded = at::zeros({sequences, longest, hidden}, outputs[i].options().device(at::kCPU));
    const at::Tensor packed = outputs[i].cpu();
    for (int64_t s = 0; s < sequences; ++s) {
      padded[s].narrow(0, 0, lengths[s]).copy_(packed.narrow(0, cu_seqlens[s], lengths[s]));
    }
    keep.push_back(padded.contiguous());
    tensors.push_back({"layer." + std::to_string(a.layers[i]),
                       a.options.dtype == at::kFloat ? DType::F32 : DType::BF16,
                       {sequences, longest, hidden},
                       keep.back().data_ptr(),
                       static_cast<size_t>(keep.back().nbytes())});
  }
  tensors.push_back({"lengths", DType::I64, {sequences}, lengths.data(), lengths.size() * sizeof(int64_t)});
  write_safetensors(a.out_path, tensors,
                    {{"model", a.model_dir}, {"tokens", a.tokens_path}, {"dtype", a.dtype_text}, {"device", a.device_text}});
  std::cout << "wrote " << a.layers.size() << " layer(s) for " << sequences << " sequence(s) to " << a.out_path << "\n";
}

}  // namespace

int command_inspect(const std::vector<std::string>& args) {
  if (args.empty() || args[0] == "--help" || args[0] == "-h") {
    std::cout << kHelp;
    return args.empty() ? exit_code::kUsage : exit_code::kOk;
  }
  if (args[0] != "target") {
    std::cerr << "dflashd inspect: unknown subject '" << args[0] << "' (only `target` for now)\n\n" << kHelp;
    return exit_code::kUsage;
  }
  InspectArgs a;
  if (const std::optional<int> code = parse_inspect_args(args, &a)) return *code;
  try {
    const auto samples = read_token_file(a.tokens_path);
    if (samples.empty()) {
      std::cerr << a.tokens_path << ": no sequences\n";
      return exit_code::kFailure;
    }
    const target::ModelConfig config = target::load_model_config(a.model_dir);
    if (const std::optional<int> code = check_inputs(a, config, samples)) return *code;
    write_layer_outputs(a, config, samples);
    return exit_code::kOk;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return exit_code::kFailure;
  }
}

}  // namespace dflash::daemon
