// eval.h: real acceptance of a drafter with its target: speculative decoding of a set of prompts
// (speculative.h), beside plain decoding of the same prompts for speed and for the lossless check.
// What `dflashd eval` prints and what a training run's eval section records.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "common/token_file.h"
#include "decode/speculative.h"

namespace dflash::decode {

struct EvalPrompt {
  std::vector<int64_t> ids;
  std::string where;  // FILE:LINE, for messages
};

// A sample's prompt: the tokens before its first supervised one (all of them without a
// loss_mask); empty when it is supervised from its first token.
std::vector<int64_t> prompt_of(const TokenSample& sample);

// Prompts from token JSON Lines (common/token_file.h): a line with a loss_mask gives the tokens
// before its first supervised token (the response is what the drafter is trained to predict, so
// held-out training samples are prompts), a line without one gives all its tokens. Lines without
// a prompt (supervised from the first token) are skipped. `limit` > 0 keeps the first `limit`.
// Throws TokenFileError (FILE:LINE) on a malformed line, std::runtime_error on a file without prompts.
std::vector<EvalPrompt> read_eval_prompts(const std::string& path, int64_t limit = 0);

struct EvalReport {
  int64_t prompts = 0;
  int64_t new_tokens = 0;    // speculative decoding's, all prompts
  int64_t verify_steps = 0;  // target verify steps of speculative decoding
  // Mean tokens committed per verify step (dflash_generate's acceptance length), and per draft
  // position k = 1 .. B - 1 the share of verify steps that drafted it and accepted it.
  double acceptance_length = 0;
  std::vector<double> acceptance_at;
  // Wall time of each run over all prompts (prefills included: with continuous batching they
  // interleave with the decoding rounds), and the new tokens per second over it.
  double spec_seconds = 0, plain_seconds = 0;
  int64_t max_batch = 1;  // sequences decoded at once by each decoder
  int64_t decoders = 1;   // decoders at once (one per stage of the target)
  GenerateSettings settings;  // what decoded them
  double spec_tokens_per_second = 0, plain_tokens_per_second = 0, speedup = 0;
  bool baseline = false;       // plain decoding ran
  int64_t mismatches = -1;     // greedy with the baseline: prompts whose outputs differ (0 = lossless); -1 not checked
  std::string to_json() const;
};

// "greedy" or "sampled (temperature T, top_p P, top_k K)", then ", N stop tokens" if any: for logs.
std::string describe(const GenerateSettings& settings);

// Runs every prompt through speculative decoding with `spec` and, with `baseline`, plain decoding
// with as many plain decoders over their target: one decoder (on the calling thread), or one per
// stage of a target split over several GPUs (generation.h generate_all: each on its own thread,
// so every stage works), each
// with at most `max_batch` sequences at once (continuous batching). Prompt i's random stream is
// sequence_seed(settings.seed, i) in both runs, however many decoders there are.
EvalReport evaluate(const std::vector<const Decoder*>& spec, const std::vector<EvalPrompt>& prompts,
                    const GenerateSettings& settings, bool baseline, int64_t max_batch);

}  // namespace dflash::decode
