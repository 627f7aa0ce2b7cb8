// speculative.h: DFlash speculative decoding with the target, one sequence at a time, with the
// semantics of z-lab's dflash_generate (dflash==0.1.0, dflash/model.py):
//   prefill the prompt, take its first token; then repeatedly the drafter proposes a block
//   [last token, B - 1 drafts] from the target features of every committed token (its context
//   cache) and the block's embeddings; the target verifies the block in one step; the matched
//   prefix plus one bonus token is kept (greedy), or rejection sampling decides (temperature > 0);
//   the target cache is cropped to the committed tokens; a stop token ends the sequence.
// plain_generate is ordinary decoding with the same target: the baseline for speed and the
// reference that greedy speculative decoding must reproduce token for token (lossless).
#pragma once

#include <cstdint>
#include <vector>

#include "decode/sampling.h"
#include "drafter/model.h"
#include "target/incremental.h"

namespace dflash::decode {

struct GenerateSettings {
  int64_t max_new_tokens = 256;
  std::vector<int64_t> stop_token_ids;
  Sampling sampling;
  uint64_t seed = 0;  // the random stream of sampling (unused when greedy)
};

struct Generation {
  std::vector<int64_t> tokens;  // the prompt, then the new tokens
  int64_t prompt_tokens = 0;
  // Per target verify step: the tokens it committed (accepted drafts + the bonus token, capped at
  // max_new_tokens and at a stop token), as dflash_generate's acceptance_lengths.
  std::vector<int64_t> acceptance;
  // Per draft position k = 1 .. B - 1: verify steps that drafted position k, and those in which it
  // was accepted (speculative decoding only).
  std::vector<int64_t> drafted_at, accepted_at;
  bool stopped = false;  // a stop token ended it
  double prefill_seconds = 0, decode_seconds = 0;

  int64_t new_tokens() const { return static_cast<int64_t>(tokens.size()) - prompt_tokens; }
};

class SpeculativeDecoder {
 public:
  // Both must outlive the decoder; the drafter's target_layer_ids name the target's tapped layers,
  // and its block size the block.
  SpeculativeDecoder(const target::IncrementalTarget& target, const drafter::Drafter& drafter);
  // prompt: token ids (non-empty). Throws std::invalid_argument on bad settings or ids.
  Generation generate(const std::vector<int64_t>& prompt, const GenerateSettings& settings) const;

 private:
  const target::IncrementalTarget& target_;
  const drafter::Drafter& drafter_;
  std::vector<int64_t> tap_;
};

// Plain decoding: the prompt's prefill, then one target step per token.
Generation plain_generate(const target::IncrementalTarget& target, const std::vector<int64_t>& prompt,
                          const GenerateSettings& settings);

}  // namespace dflash::decode
