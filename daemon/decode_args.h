// decode_args.h: what `dflashd eval` and `dflashd generate` read the same way from their command
// lines: numbers, id lists, the target (a directory or a preset, its weights) and its device.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "decode/speculative.h"
#include "target/model.h"

namespace dflash::daemon {

template <typename T>
bool parse_number(const std::string& text, T* out) {
  std::istringstream in(text);
  in >> *out;
  return !in.fail() && in.eof();
}

// "1,2,3" -> ids (non-negative); false on anything else.
bool parse_ids(const std::string& text, std::vector<int64_t>* ids);

// The target a decoding command names: a Hugging Face directory, or a preset; random weights
// (seeded as a run with train.seed = target_seed) for a preset or with random_weights.
struct TargetArgs {
  std::string dir, preset, device_text, dtype_text;
  std::string state_dtype_text;  // --state-dtype: the GatedDeltaNet states between steps (float32)
  bool random_weights = false;
  bool allow_slow_path = false;
  int64_t target_seed = 0;
};

// Handles the option `key` with `value` if it is a TargetArgs one (--target, --preset, --device,
// --dtype, --state-dtype, --target-seed); *ok is false on a bad value.
bool parse_target_option(const std::string& key, const std::string& value, TargetArgs* a, bool* ok);

// Handles the option `key` if it is a decoding setting (--max-new-tokens, --max-batch,
// --temperature, --top-p, --top-k, --seed, --stop-token-ids); *ok is false on a bad value.
bool parse_decoding_option(const std::string& key, const std::string& value, decode::GenerateSettings* s,
                           int64_t* max_batch, bool* ok);

// The device, dtype and state dtype the arguments name, or their defaults (cuda:0 and bfloat16
// when a GPU is visible, else cpu and float32; float32 states); nullopt after printing "dflashd
// COMMAND: ..." otherwise.
std::optional<target::TargetOptions> target_options(const std::string& command, const TargetArgs& a);

// Refuses (std::runtime_error naming the command, the device, the numbers and the largest batch
// that fits) a batch of `sequences` decoding sequences of up to `tokens` positions, in steps of
// `step_tokens`, whose caches (target/decode_plan.h) do not fit in what the target's weights left
// of its GPU. A batch that cannot fit would run out of memory mid-run. Nothing to check on a CPU.
void check_decoding_batch(const std::string& command, const target::TargetModel& model, int64_t sequences,
                          int64_t tokens, int64_t step_tokens);

// The target's config and model with every layer (decoding needs them all).
std::unique_ptr<target::TargetModel> load_decoding_target(const TargetArgs& a, const target::TargetOptions& options);

}  // namespace dflash::daemon
