// speculative.h: DFlash speculative decoding with the target, many sequences at once (each with
// the semantics of z-lab's dflash_generate (dflash==0.1.0, dflash/model.py):
//   prefill the prompt, take its first token; then repeatedly the drafter proposes a block
//   [last token, B - 1 drafts] from the target features of every committed token (its context
//   cache) and the block's embeddings; the target verifies the block in one step; the matched
//   prefix plus one bonus token is kept (greedy), or rejection sampling decides (temperature > 0);
//   the target cache is cropped to the committed tokens; a stop token ends the sequence).
// plain_generate is ordinary decoding with the same target: the baseline for speed and the
// reference that greedy speculative decoding must reproduce token for token (lossless).
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
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
  // Its prefill (plain decoding: the time to queue it; its first token is taken with the next
  // round's), and the wall time from then to its end (shared with the other sequences in flight:
  // a batched run's rate is its tokens over the run's wall time).
  double prefill_seconds = 0, decode_seconds = 0;

  int64_t new_tokens() const { return static_cast<int64_t>(tokens.size()) - prompt_tokens; }
};

// One prompt of a batched run. `id` is the caller's (handed back when it finishes); `seed`
// starts the sequence's own random stream, so a sampled output depends on its prompt, settings
// and seed, not on what else is in the batch.
struct Request {
  int64_t id = 0;
  std::vector<int64_t> prompt;
  uint64_t seed = 0;
};

// Pulls the next request into *r; false when there are none left.
using NextRequest = std::function<bool(Request* r)>;
// Called as each sequence finishes (on the thread of run(), in the order they finish).
using Finished = std::function<void(Request&& r, Generation&& g)>;

// A decoder over the target (and, speculative, a drafter) with continuous batching: at most
// `max_batch` sequences in flight; each round advances all of them in one batched target step
// (one batched drafter call before it), and finished sequences' slots take the next requests
// (their prompts prefilled, then they join the next round: the prompts that arrive together in
// one forward of up to kPrefillBatchTokens tokens, a longer one alone, in chunks). A decoder
// keeps no state of its own between or during calls (each run()'s sequences are its own), so one
// object may run on several threads at once.
class Decoder {
 public:
  virtual ~Decoder() = default;
  // Throws std::invalid_argument on bad settings or prompt ids (naming the request id).
  // `decoded`, when given, grows by the new tokens of every prefill and round as they come (a
  // live count for progress: finished sequences report theirs only when they finish).
  void run(const GenerateSettings& settings, int64_t max_batch, const NextRequest& next, const Finished& done,
           std::atomic<int64_t>* decoded = nullptr) const;
  // All `prompts`, request i seeded with sequence_seed(settings.seed, i); results in prompt order.
  std::vector<Generation> generate_all(const std::vector<std::vector<int64_t>>& prompts, const GenerateSettings& settings,
                                       int64_t max_batch) const;
  // One prompt (seeded with settings.seed). Throws std::invalid_argument on bad settings or ids.
  Generation generate(const std::vector<int64_t>& prompt, const GenerateSettings& settings) const;

  const target::IncrementalTarget& target() const { return target_; }

  struct Sequence;        // one sequence's state between rounds (speculative.cc)
  class TokensInFlight;  // a plain step's tokens, still being computed (speculative.cc)

 protected:
  explicit Decoder(const target::IncrementalTarget& target) : target_(target) {}
  // Prefills s's prompt and takes its first token (plain decoding: chooses it on the device and
  // leaves it in flight, for the next advance() to take).
  virtual void start(Sequence& s, const GenerateSettings& settings) const = 0;
  // start() of sequences admitted together, each with its g.prefill_seconds set: prompts of up to
  // kPrefillBatchTokens together through start_batch (prefill_seconds: the batch's wall time,
  // shared), a longer one alone through start().
  void start_all(const std::vector<Sequence*>& admitted, const GenerateSettings& settings) const;
  // start() of several sequences whose prompts fit one prefill_batch.
  virtual void start_batch(const std::vector<Sequence*>& batch, const GenerateSettings& settings) const = 0;
  // The prompts of `batch` prefilled together into new caches, with the features of `tap`.
  std::vector<target::DecodeOutput> prefill_batch(const std::vector<Sequence*>& batch,
                                                  const std::vector<int64_t>& tap) const;
  // One round: every sequence in `active` (none finished) advances by one target step. The host
  // may learn a step's tokens one round later (plain decoding keeps one step in flight).
  virtual void advance(const std::vector<Sequence*>& active, const GenerateSettings& settings) const = 0;

  const target::IncrementalTarget& target_;
};

// Throws std::invalid_argument ("the prompt is empty", "token id N is outside the vocabulary
// (V)", "N tokens: the target's context is C") for a prompt the target cannot decode; callers
// prefix where the prompt came from.
void check_prompt(const std::vector<int64_t>& prompt, const target::ModelConfig& target);

// The seed of request `index` of a run seeded with `seed` (splitmix64 of the two).
uint64_t sequence_seed(uint64_t seed, uint64_t index);

class SpeculativeDecoder : public Decoder {
 public:
  // Both must outlive the decoder; the drafter's target_layer_ids name the target's tapped layers,
  // and its block size the block.
  SpeculativeDecoder(const target::IncrementalTarget& target, const drafter::Drafter& drafter);

 private:
  void start(Sequence& s, const GenerateSettings& settings) const override;
  void start_batch(const std::vector<Sequence*>& batch, const GenerateSettings& settings) const override;
  // After the prefills `out` of `sequences` (out[j] is sequences[j]'s): each one's first token,
  // its drafter context (all of them extended at once) and its per-position counts.
  void take_prefills(const std::vector<Sequence*>& sequences, const std::vector<target::DecodeOutput>& out,
                     const GenerateSettings& settings) const;
  void advance(const std::vector<Sequence*>& active, const GenerateSettings& settings) const override;

  const drafter::Drafter& drafter_;
  std::vector<int64_t> tap_;
  // The target's embedding where the drafter runs (the target's output device): the target's
  // own tensor on one device, a copy when its stages span several.
  at::Tensor embed_;
};

// Plain decoding: the prompt's prefill, then one target step per token.
class PlainDecoder : public Decoder {
 public:
  explicit PlainDecoder(const target::IncrementalTarget& target) : Decoder(target) {}

 private:
  void start(Sequence& s, const GenerateSettings& settings) const override;
  void start_batch(const std::vector<Sequence*>& batch, const GenerateSettings& settings) const override;
  void advance(const std::vector<Sequence*>& active, const GenerateSettings& settings) const override;
};

// PlainDecoder(target).generate(prompt, settings).
Generation plain_generate(const target::IncrementalTarget& target, const std::vector<int64_t>& prompt,
                          const GenerateSettings& settings);

}  // namespace dflash::decode
