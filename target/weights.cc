#include "target/weights.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <dirent.h>

#include <algorithm>
#include <fstream>
#include <functional>
#include <mutex>
#include <nlohmann/json.hpp>
#include <sstream>

#include "common/safetensors.h"

namespace dflash::target {
namespace {

at::ScalarType to_scalar_type(DType dtype, const std::string& where) {
  switch (dtype) {
    case DType::F64: return at::kDouble;
    case DType::F32: return at::kFloat;
    case DType::F16: return at::kHalf;
    case DType::BF16: return at::kBFloat16;
    case DType::I64: return at::kLong;
    case DType::I32: return at::kInt;
    case DType::I16: return at::kShort;
    case DType::I8: return at::kChar;
    case DType::U8: return at::kByte;
    case DType::BOOL: return at::kBool;
    case DType::F8_E4M3: return at::kFloat8_e4m3fn;
    default: throw WeightsError(where + ": unsupported dtype " + dtype_name(dtype) + " for a target weight");
  }
}

// quantization_config of model_dir/config.json: nothing (unquantized), block-scaled FP8 (its
// block shape into *block), or a WeightsError naming what is not supported.
void read_quantization(const std::string& model_dir, std::vector<int64_t>* block) {
  std::ifstream in(model_dir + "/config.json");
  if (!in) return;  // the config's own reader reports a missing config.json
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception&) {
    return;  // reported by the config's reader
  }
  if (!j.contains("quantization_config") || j["quantization_config"].is_null()) return;
  const nlohmann::json& q = j["quantization_config"];
  const std::string where = model_dir + "/config.json: quantization_config";
  const std::string method = q.value("quant_method", "");
  if (method != "fp8") {
    throw WeightsError(where + ".quant_method '" + method + "' is not supported (block-scaled fp8 is)");
  }
  if (q.value("fmt", "e4m3") != "e4m3") throw WeightsError(where + ".fmt must be e4m3");
  const std::vector<int64_t> size = q.value("weight_block_size", std::vector<int64_t>{128, 128});
  if (size.size() != 2 || size[0] < 1 || size[1] < 1) {
    throw WeightsError(where + ".weight_block_size must be two positive sizes");
  }
  *block = size;
}

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() && s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

}  // namespace

CheckpointWeights::CheckpointWeights(const std::string& model_dir) : dir_(model_dir) {
  std::vector<std::string> file_names;
  const std::string index_path = model_dir + "/model.safetensors.index.json";
  std::ifstream index(index_path);
  if (index) {
    nlohmann::json j;
    try {
      index >> j;
    } catch (const nlohmann::json::exception& e) {
      throw WeightsError(index_path + ": invalid JSON: " + e.what());
    }
    if (!j.contains("weight_map") || !j["weight_map"].is_object()) {
      throw WeightsError(index_path + ": no weight_map object");
    }
    for (auto it = j["weight_map"].begin(); it != j["weight_map"].end(); ++it) {
      const std::string f = it.value().get<std::string>();
      if (std::find(file_names.begin(), file_names.end(), f) == file_names.end()) file_names.push_back(f);
    }
  } else if (DIR* dir = ::opendir(model_dir.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (ends_with(name, ".safetensors")) file_names.push_back(name);
    }
    ::closedir(dir);
    std::sort(file_names.begin(), file_names.end());
  } else {
    throw WeightsError(model_dir + ": cannot open the model directory");
  }
  if (file_names.empty()) throw WeightsError(model_dir + ": no *.safetensors files (and no model.safetensors.index.json)");

  std::map<std::string, std::pair<std::shared_ptr<SafetensorsFile>, std::string>> full;
  for (const auto& f : file_names) {
    auto file = SafetensorsFile::open(model_dir + "/" + f);  // throws SafetensorsError naming the file
    files_.push_back(file);
    for (const auto& t : file->tensors()) {
      if (full.count(t.name)) {
        throw WeightsError(model_dir + ": tensor '" + t.name + "' is in both " + full[t.name].first->path() + " and " +
                           file->path());
      }
      full[t.name] = {file, t.name};
    }
  }
  // The language model's prefix is where its embedding lives.
  for (const char* candidate : {"model.language_model.", "model.", "language_model.model.", ""}) {
    if (full.count(std::string(candidate) + "embed_tokens.weight")) {
      prefix_ = candidate;
      break;
    }
  }
  for (auto& [name, location] : full) {
    if (name.rfind(prefix_, 0) == 0 && !prefix_.empty()) {
      by_name_[name.substr(prefix_.size())] = location;
    } else if (prefix_.empty()) {
      by_name_[name] = location;
    }
  }
  read_quantization(model_dir, &fp8_block_);
  // The LM head sits outside the prefix ("lm_head.weight" beside "model.").
  for (const char* head : {"lm_head.weight", "language_model.lm_head.weight"}) {
    if (full.count(head)) {
      by_name_["lm_head.weight"] = full[head];
      break;
    }
  }
}

const std::pair<std::shared_ptr<SafetensorsFile>, std::string>* CheckpointWeights::locate(const std::string& name) const {
  auto it = by_name_.find(name);
  return it == by_name_.end() ? nullptr : &it->second;
}

bool CheckpointWeights::contains(const std::string& name) const { return locate(name) != nullptr; }

CheckpointWeights::Stored CheckpointWeights::stored(const std::string& name, const std::vector<int64_t>& shape) const {
  const auto* location = locate(name);
  if (!location) {
    const std::string file_name = name == "lm_head.weight" ? name : prefix_ + name;  // the head sits outside the prefix
    throw WeightsError(dir_ + ": missing tensor '" + file_name + "' (looked in " + std::to_string(files_.size()) +
                       " safetensors file" + (files_.size() == 1 ? "" : "s") + ")");
  }
  const auto& [file, full_name] = *location;
  const TensorEntry& entry = file->get(full_name);
  const std::string where = file->path() + ": tensor '" + full_name + "'";
  if (entry.shape != shape) {
    throw WeightsError(where + " has shape " + shape_text(entry.shape) + ", expected " + shape_text(shape));
  }
  // Alias the mapping, keeping the file alive through the deleter.
  auto keep_alive = file;
  const at::Tensor view = at::from_blob(const_cast<std::byte*>(entry.data), entry.shape, [keep_alive](void*) {},
                                        at::TensorOptions().dtype(to_scalar_type(entry.dtype, where)));
  return {view, where};
}

at::Tensor CheckpointWeights::get(const std::string& name, const std::vector<int64_t>& shape,
                                  const at::TensorOptions& options, Init) {
  const Stored s = stored(name, shape);
  if (s.view.scalar_type() == at::kFloat8_e4m3fn) return dequantize(s.view, name, s.where, options);
  // One copy to the target device/dtype. A CPU tensor in the stored dtype stays an alias: no host copy.
  if (options.device().is_cpu() && options.dtype() == s.view.dtype()) return s.view;
  return s.view.to(options, /*non_blocking=*/false, /*copy=*/true);
}

WeightRows CheckpointWeights::get_rows(const std::string& name, const std::vector<int64_t>& shape, at::Device device) {
  const Stored s = stored(name, shape);
  if (s.view.scalar_type() == at::kFloat8_e4m3fn && fp8_block_ == std::vector<int64_t>{kFp8Block, kFp8Block} &&
      shape.size() == 2) {
    // The checkpoint's own blocks are the GEMM's: its bytes and factors are kept as they are.
    return {{}, {s.view.to(device), block_factors(s.view, name, s.where).to(device, at::kFloat).contiguous()}};
  }
  return {get(name, shape, at::TensorOptions().device(device).dtype(at::kFloat), Init::normal), {}};
}

at::Tensor CheckpointWeights::block_factors(const at::Tensor& weight, const std::string& name,
                                            const std::string& where) const {
  if (fp8_block_.empty()) {
    throw WeightsError(where + " is FP8 (e4m3) but " + dir_ + "/config.json has no quantization_config (quant_method "
                       "fp8 with weight_block_size) saying how it is scaled");
  }
  const auto* scale_location = locate(name + "_scale_inv");
  if (!scale_location || weight.dim() < 2) {
    throw WeightsError(where + " is FP8 (e4m3) without its per-block scales '" + name + "_scale_inv'");
  }
  const TensorEntry& scale_entry = scale_location->first->get(scale_location->second);
  const int64_t rows = weight.size(-2), columns = weight.size(-1), br = fp8_block_[0], bc = fp8_block_[1];
  std::vector<int64_t> expected(weight.sizes().begin(), weight.sizes().end() - 2);
  expected.push_back((rows + br - 1) / br);
  expected.push_back((columns + bc - 1) / bc);
  const std::string scale_where = scale_location->first->path() + ": tensor '" + scale_location->second + "'";
  if (scale_entry.shape != expected) {
    throw WeightsError(scale_where + " has shape " + shape_text(scale_entry.shape) + ", expected " +
                       shape_text(expected) + " (blocks of " + std::to_string(br) + "x" + std::to_string(bc) + ")");
  }
  auto keep = scale_location->first;
  return at::from_blob(const_cast<std::byte*>(scale_entry.data), scale_entry.shape, [keep](void*) {},
                       at::TensorOptions().dtype(to_scalar_type(scale_entry.dtype, scale_where)));
}

at::Tensor CheckpointWeights::dequantize(const at::Tensor& weight, const std::string& name, const std::string& where,
                                         const at::TensorOptions& options) const {
  const at::Tensor scale = block_factors(weight, name, where);
  // On the target's device (a GPU dequantizes fast and the host never holds the fp32 copy).
  return dequantize_blocks(Fp8Weight{weight.to(options.device()), scale.to(options.device(), at::kFloat).contiguous()},
                           options.dtype().toScalarType(), fp8_block_[0], fp8_block_[1]);
}

at::Tensor RandomWeights::get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                              Init init) {
  switch (init) {
    case Init::ones: return at::ones(shape, options);
    case Init::zeros: return at::zeros(shape, options);
    default: break;
  }
  // Each tensor is drawn from a generator seeded from (seed, name): the result does not depend
  // on the order in which a model asks for its tensors. On a GPU the numbers are drawn there
  // (a 27B target would not fit in host memory as fp32), with the device's own generator, so
  // CPU and GPU initialisations differ.
  const uint64_t seed = seed_ ^ (std::hash<std::string>{}(name) * 0x9E3779B97F4A7C15ULL);
  at::Generator generator;
  if (options.device().is_cpu()) {
    generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  } else {
    generator = at::globalContext().defaultGenerator(options.device());
    std::lock_guard<std::mutex> lock(generator.mutex());
    generator.set_current_seed(seed);
  }
  at::Tensor t;
  const auto cpu = at::TensorOptions().dtype(at::kFloat).device(options.device());
  if (init == Init::a_log) {
    t = at::log(at::empty(shape, cpu).uniform_(1, 16, generator));  // decay rates like the HF init
  } else if (init == Init::dt_bias) {
    t = at::ones(shape, cpu);
  } else {
    t = at::empty(shape, cpu).normal_(0, std_, generator);
  }
  return t.to(options);
}

}  // namespace dflash::target
