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
#include "target/incremental.h"
#include "target/model.h"
#include "target/stages.h"

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

// The target's stages the arguments name: one TargetOptions per device of --device ("cuda:0";
// "cuda:0,cuda:1": the target split into pipeline stages over those GPUs), each with the dtype
// and state dtype; their defaults are cuda:0 and bfloat16 when a GPU is visible, else cpu and
// float32, and float32 states. nullopt after printing "dflashd COMMAND: ..." otherwise.
std::optional<std::vector<target::TargetOptions>> target_options(const std::string& command, const TargetArgs& a);

// Refuses (std::runtime_error naming the command, the GPU, the numbers and the largest --max-batch
// that fits) `sequences` decoding sequences at once on `target` (its `decoders` together) of up
// to `tokens` positions, in steps of `step_tokens`, whose caches (target/decode_plan.h; each
// stage's layers on its GPU) do not fit in what the weights left of a GPU. A batch that cannot
// fit would run out of memory mid-run. Nothing to check on a CPU.
void check_decoding_batch(const std::string& command, const target::IncrementalTarget& target, int64_t sequences,
                          int64_t decoders, int64_t tokens, int64_t step_tokens);

// The target with every layer (decoding needs them all), over `stages` (one per device).
std::unique_ptr<target::StagedTarget> load_decoding_target(const TargetArgs& a,
                                                           const std::vector<target::TargetOptions>& stages);

}  // namespace dflash::daemon
