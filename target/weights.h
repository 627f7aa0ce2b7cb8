// weights.h: where a target's tensors come from: a Hugging Face checkpoint directory (single
// or sharded safetensors, memory-mapped) or seeded random initialisation (dry runs, tests).
//
// Names are the model's own (e.g. "layers.3.mlp.up_proj.weight"); the checkpoint source maps
// them to the file's prefix, which differs between checkpoints ("model.", or
// "model.language_model." in Qwen3.5 VL checkpoints), and ignores what a feature extractor does
// not need (mtp.*, visual.*). Loading copies straight from the mapping to the target device
// and dtype; a CPU tensor of the file's own dtype aliases the mapping (no host copy at all).
//
// Errors (missing tensor, wrong shape, unsupported dtype, bad files) throw WeightsError naming
// the file and the tensor. Not thread-safe: load a model from one thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "target/fp8.h"

namespace dflash {
class SafetensorsFile;
}

namespace dflash::target {

class WeightsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// How a random source initialises a tensor (the checkpoint source ignores it).
enum class Init { normal, ones, zeros, a_log, dt_bias };

class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The tensor `name` with exactly `shape`, on `options`' device and dtype.
  virtual at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                         Init init = Init::normal) = 0;
  // A projection's weight [out, in] for an FP8 target (fp8.h): the checkpoint's own 128x128 FP8
  // blocks where it stores them so, else the weight in fp32 (to be quantised by the caller).
  virtual WeightRows get_rows(const std::string& name, const std::vector<int64_t>& shape, at::Device device) {
    return {get(name, shape, at::TensorOptions().device(device).dtype(at::kFloat)), {}};
  }
  virtual bool contains(const std::string& name) const = 0;
  virtual std::string describe() const = 0;
};

// A checkpoint may be block-scaled FP8 (config.json's quantization_config: quant_method "fp8",
// fmt "e4m3", weight_block_size [rows, columns], as Qwen's *-FP8 releases and transformers'
// FineGrainedFP8 write them): each e4m3 weight W has a `W_scale_inv` holding one fp32 factor per
// block. get() returns weight x factor in the asked dtype (dequantized at load); get_rows() keeps
// 128x128 blocks as they are for an FP8 target (target.dtype: float8).
class CheckpointWeights : public WeightSource {
 public:
  explicit CheckpointWeights(const std::string& model_dir);
  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                 Init init) override;
  WeightRows get_rows(const std::string& name, const std::vector<int64_t>& shape, at::Device device) override;
  bool contains(const std::string& name) const override;
  std::string describe() const override { return dir_; }
  const std::string& prefix() const { return prefix_; }
  // The FP8 block shape (rows, columns), or empty for an unquantized checkpoint.
  const std::vector<int64_t>& fp8_block() const { return fp8_block_; }

 private:
  // The file and full name holding `name`, or nullptr.
  const std::pair<std::shared_ptr<SafetensorsFile>, std::string>* locate(const std::string& name) const;
  // The stored tensor `name` (checked to have `shape`) aliasing the mapping, and "file: tensor 'x'".
  struct Stored {
    at::Tensor view;
    std::string where;
  };
  Stored stored(const std::string& name, const std::vector<int64_t>& shape) const;
  // An FP8 weight's per-block factors (its `_scale_inv`, shape checked), aliasing the mapping.
  at::Tensor block_factors(const at::Tensor& weight, const std::string& name, const std::string& where) const;
  // weight x its per-block factors, on `options`' device and dtype.
  at::Tensor dequantize(const at::Tensor& weight, const std::string& name, const std::string& where,
                        const at::TensorOptions& options) const;
  std::string dir_;
  std::string prefix_;  // e.g. "model." or "model.language_model."
  std::vector<int64_t> fp8_block_;
  std::vector<std::shared_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<std::shared_ptr<SafetensorsFile>, std::string>> by_name_;  // model name -> file, full name
};

class RandomWeights : public WeightSource {
 public:
  explicit RandomWeights(uint64_t seed, double std = 0.02) : seed_(seed), std_(std) {}
  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                 Init init) override;
  bool contains(const std::string&) const override { return true; }
  std::string describe() const override { return "random weights (seed " + std::to_string(seed_) + ")"; }

 private:
  uint64_t seed_;
  double std_;
};

}  // namespace dflash::target
