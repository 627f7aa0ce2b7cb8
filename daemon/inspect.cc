#include "daemon/inspect.h"

#include <ATen/ATen.h>

#include <iostream>
#include <sstream>

#include "common/safetensors.h"
#include "common/token_file.h"
#include "daemon/exit_codes.h"
#include "target/model.h"

namespace dflash::daemon {
namespace {

constexpr const char* kHelp = R"(Usage: dflashd inspect target --model DIR --tokens FILE --layers 1,3 --out OUT.safetensors
                              [--device cpu|cuda:N] [--dtype float32|bfloat16] [--allow-slow-path]

Runs the target of DIR (a Hugging Face model directory) on every sequence of FILE (JSON Lines,
{"input_ids": [...]} per line) and writes the outputs of the given decoder layers (layer id i =
the output of decoder layer i) to OUT.safetensors: one tensor `layer.<id>` of shape
[sequences, tokens, hidden] per layer (shorter sequences zero-padded to the longest), plus
`lengths` (int64 [sequences]).
)";

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
  std::string model_dir, tokens_path, layers_text, out_path, device_text = "cpu", dtype_text = "float32";
  bool allow_slow = false;
  for (size_t i = 1; i < args.size(); ++i) {
    auto value = [&](std::string* out) {
      if (i + 1 >= args.size()) return false;
      *out = args[++i];
      return true;
    };
    const std::string& a = args[i];
    bool ok = true;
    if (a == "--model") ok = value(&model_dir);
    else if (a == "--tokens") ok = value(&tokens_path);
    else if (a == "--layers") ok = value(&layers_text);
    else if (a == "--out") ok = value(&out_path);
    else if (a == "--device") ok = value(&device_text);
    else if (a == "--dtype") ok = value(&dtype_text);
    else if (a == "--allow-slow-path") allow_slow = true;
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
  if (model_dir.empty() || tokens_path.empty() || layers_text.empty() || out_path.empty()) {
    std::cerr << "dflashd inspect: --model, --tokens, --layers and --out are required\n\n" << kHelp;
    return exit_code::kUsage;
  }
  std::vector<int64_t> layers;
  {
    std::stringstream s(layers_text);
    for (std::string part; std::getline(s, part, ',');) {
      try {
        size_t used = 0;
        layers.push_back(std::stoll(part, &used));
        if (used != part.size()) throw std::invalid_argument(part);
      } catch (const std::exception&) {
        std::cerr << "dflashd inspect: --layers: '" << part << "' is not a layer number\n";
        return exit_code::kUsage;
      }
    }
    std::sort(layers.begin(), layers.end());
    layers.erase(std::unique(layers.begin(), layers.end()), layers.end());
  }
  target::TargetOptions options;
  try {
    options.device = at::Device(device_text);
  } catch (const std::exception&) {
    std::cerr << "dflashd inspect: --device: '" << device_text << "' is not a device (cpu, cuda:0, ...)\n";
    return exit_code::kUsage;
  }
  if (dtype_text == "float32") options.dtype = at::kFloat;
  else if (dtype_text == "bfloat16") options.dtype = at::kBFloat16;
  else {
    std::cerr << "dflashd inspect: --dtype must be float32 or bfloat16\n";
    return exit_code::kUsage;
  }
  options.allow_slow_path = allow_slow;

  try {
    const auto samples = read_token_file(tokens_path);
    if (samples.empty()) {
      std::cerr << tokens_path << ": no sequences\n";
      return exit_code::kFailure;
    }
    const target::ModelConfig config = target::load_model_config(model_dir);
    for (int64_t l : layers) {
      if (l < 0 || l >= config.num_layers) {
        std::cerr << "dflashd inspect: --layers: layer " << l << " does not exist in " << model_dir << " (0.."
                  << config.num_layers - 1 << ")\n";
        return exit_code::kUsage;
      }
    }
    for (const auto& s : samples) {
      for (int64_t id : s.input_ids) {
        if (id >= config.vocab_size) {
          std::cerr << tokens_path << ":" << s.line << ": token id " << id << " is outside the vocabulary of "
                    << model_dir << " (" << config.vocab_size << ")\n";
          return exit_code::kFailure;
        }
      }
    }
    auto model = target::load_target(model_dir, layers.back(), options);
    std::vector<int64_t> ids, cu_seqlens{0}, lengths;
    int64_t longest = 0;
    for (const auto& s : samples) {
      ids.insert(ids.end(), s.input_ids.begin(), s.input_ids.end());
      cu_seqlens.push_back(static_cast<int64_t>(ids.size()));
      lengths.push_back(static_cast<int64_t>(s.input_ids.size()));
      longest = std::max(longest, lengths.back());
    }
    const auto outputs = model->forward(at::tensor(ids, at::TensorOptions().dtype(at::kLong)), cu_seqlens, layers);
    std::vector<at::Tensor> keep;  // owns the bytes until written
    std::vector<TensorToWrite> tensors;
    const int64_t sequences = static_cast<int64_t>(samples.size()), hidden = config.hidden_size;
    for (size_t i = 0; i < layers.size(); ++i) {
      at::Tensor padded = at::zeros({sequences, longest, hidden}, outputs[i].options().device(at::kCPU));
      const at::Tensor packed = outputs[i].cpu();
      for (int64_t s = 0; s < sequences; ++s) {
        padded[s].narrow(0, 0, lengths[s]).copy_(packed.narrow(0, cu_seqlens[s], lengths[s]));
      }
      keep.push_back(padded.contiguous());
      tensors.push_back({"layer." + std::to_string(layers[i]),
                         options.dtype == at::kFloat ? DType::F32 : DType::BF16,
                         {sequences, longest, hidden},
                         keep.back().data_ptr(),
                         static_cast<size_t>(keep.back().nbytes())});
    }
    tensors.push_back({"lengths", DType::I64, {sequences}, lengths.data(), lengths.size() * sizeof(int64_t)});
    write_safetensors(out_path, tensors,
                      {{"model", model_dir}, {"tokens", tokens_path}, {"dtype", dtype_text}, {"device", device_text}});
    std::cout << "wrote " << layers.size() << " layer(s) for " << sequences << " sequence(s) to " << out_path << "\n";
    return exit_code::kOk;
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return exit_code::kFailure;
  }
}

}  // namespace dflash::daemon
