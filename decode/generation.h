// generation.h: regenerating training responses with the target (`dflashd generate`): every
// prompt not yet in the output decoded by one of several decoders (one per target replica, each
// on its own thread with continuous batching), finished prompts committed to the output's shards
// (shards.h) as they come. Prompt i samples from its own random stream (sequence_seed of the
// settings' seed and i), so the output does not depend on which replica decoded it, on the batch
// around it, or on restarts.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "decode/shards.h"
#include "decode/speculative.h"

namespace dflash::decode {

struct GenerationProgress {
  int64_t total = 0;        // prompts in the job
  int64_t done_before = 0;  // committed by earlier processes
  int64_t committed = 0;    // committed by this one
  int64_t finished = 0;     // decoded by this one (committed or buffered)
  int64_t new_tokens = 0;   // of the prompts this one decoded
  int64_t decoded = 0;      // new tokens decoded by this one so far, sequences in flight included
  double seconds = 0;       // since this one started decoding
  // decoded per second so far (0 before any time passed)
  double decoded_per_second() const { return seconds > 0 ? static_cast<double>(decoded) / seconds : 0; }
};

// Seconds until every prompt of the job is decoded, from the rate of decoded tokens: the prompts
// left (in flight included) times the new tokens a finished prompt took on average
// (max_new_tokens before any finished: an upper bound), less the tokens in flight already hold.
// Infinity before any token is decoded.
double generation_eta_seconds(const GenerationProgress& p, int64_t max_new_tokens);

// Decodes prompts[i] for every i not in out.done_before() with `decoders` (as generate_all
// below), max_batch sequences at once on each, and commits them to `out` (flushing at the end).
// When `stop` becomes true the decoders take no new prompts, finish those in flight, and what
// finished is committed. `progress` is called about every `report_seconds` on the calling thread
// (and once at the end). A decoder's failure stops the others; what finished is committed, then
// the error is rethrown.
void run_generation(const std::vector<const Decoder*>& decoders, const std::vector<std::vector<int64_t>>& prompts,
                    const GenerateSettings& settings, int64_t max_batch, ShardedOutput& out,
                    const std::atomic<bool>& stop, double report_seconds,
                    const std::function<void(const GenerationProgress&)>& progress);

// Every prompt decoded by `decoders`, each on its own thread with max_batch sequences at once (a
// freed slot takes the next prompt; one decoder runs on the calling thread, on its streams),
// request i seeded with sequence_seed(settings.seed, i): the tokens do not depend on how many
// decoders there are. Results in prompt order. A decoder's
// failure stops the others taking prompts; it is rethrown once they have ended. Over a target
// split into S stages, S decoders keep every stage working (their steps take turns on each).
std::vector<Generation> generate_all(const std::vector<const Decoder*>& decoders,
                                     const std::vector<std::vector<int64_t>>& prompts, const GenerateSettings& settings,
                                     int64_t max_batch);

}  // namespace dflash::decode
