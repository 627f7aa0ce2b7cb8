#include "decode/speculative.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/Event.h>
#include <c10/core/InferenceMode.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>

#include "common/tensor_math.h"
#include "decode/generation.h"

namespace dflash::decode {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

at::Tensor ids_tensor(const std::vector<int64_t>& ids) {
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong));
}

// The token chosen from the last row of logits [rows, vocab].
int64_t choose(const at::Tensor& logits, const Sampling& s, at::Generator& gen) {
  const at::Tensor last = logits.select(0, logits.size(0) - 1).unsqueeze(0);
  if (s.greedy()) return last.argmax(-1).item<int64_t>();
  return draw(sampling_probs(last, s), gen).item<int64_t>();
}

// The outputs' logits as one [rows, vocab] tensor: a view when they are consecutive rows of one
// tensor (a step's outputs are: no copy of 127 MB at 128 sequences and a 248K vocabulary), else
// concatenated.
at::Tensor joined_rows(const std::vector<at::Tensor>& parts) {
  bool consecutive = true;
  int64_t rows = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const at::Tensor& p = parts[i];
    consecutive = consecutive && p.dim() == 2 && p.is_contiguous() && p.sizes()[1] == parts[0].sizes()[1] &&
                  p.scalar_type() == parts[0].scalar_type() && p.storage().is_alias_of(parts[0].storage()) &&
                  p.storage_offset() == parts[0].storage_offset() + rows * p.size(1);
    rows += p.dim() == 2 ? p.size(0) : 0;
  }
  if (!consecutive || parts.empty()) return at::cat(parts);
  return parts[0].as_strided({rows, parts[0].size(1)}, {parts[0].size(1), 1});
}

// Each output's argmaxes (int64 on the CPU, one per row), all in one copy to the host.
std::vector<at::Tensor> argmaxes(const std::vector<target::DecodeOutput>& out) {
  std::vector<at::Tensor> logits;
  for (const target::DecodeOutput& o : out) logits.push_back(o.logits);
  const at::Tensor all = joined_rows(logits).argmax(-1).to(at::kCPU);
  std::vector<at::Tensor> rows;
  for (int64_t row = 0; const at::Tensor& l : logits) rows.push_back(all.narrow(0, row, l.size(0))), row += l.size(0);
  return rows;
}

// The verify step's decisions on the blocks [last token, drafts...] from the target's logits over
// them (out[j] for blocks[j]): (accepted drafts, bonus token) per block, greedy by matching the
// argmaxes, else by rejection sampling against the drafts' probabilities (draft_probs, rows
// draft_rows[j] .. of block j), every block at once; `gens` the blocks' generators.
std::vector<SpeculativeOutcome> verify_blocks(const std::vector<std::vector<int64_t>>& blocks,
                                              const std::vector<target::DecodeOutput>& out,
                                              const at::Tensor& draft_probs, const std::vector<int64_t>& draft_rows,
                                              const std::vector<at::Generator*>& gens, const Sampling& sampling) {
  std::vector<SpeculativeOutcome> decided(blocks.size());
  if (sampling.greedy()) {
    const std::vector<at::Tensor> posteriors = argmaxes(out);
    for (size_t j = 0; j < blocks.size(); ++j) {
      const int64_t* argmax = posteriors[j].data_ptr<int64_t>();
      const int64_t verify = static_cast<int64_t>(blocks[j].size());
      int64_t& accepted = decided[j].accepted;
      while (accepted + 1 < verify && blocks[j][static_cast<size_t>(accepted + 1)] == argmax[accepted]) ++accepted;
      decided[j].bonus = argmax[accepted];
    }
    return decided;
  }
  std::vector<at::Tensor> logits;
  std::vector<SpeculativeBlock> sampled(blocks.size());
  for (size_t j = 0, row = 0; j < blocks.size(); row += blocks[j].size(), ++j) {
    logits.push_back(out[j].logits);
    sampled[j] = {std::vector<int64_t>(blocks[j].begin() + 1, blocks[j].end()), static_cast<int64_t>(row),
                  draft_rows[j], gens[j]};
  }
  return rejection_sample_blocks(sampled, sampling_probs(joined_rows(logits), sampling), draft_probs);
}

bool is_stop(int64_t token, const std::vector<int64_t>& stops) {
  return std::find(stops.begin(), stops.end(), token) != stops.end();
}

// Counts the new tokens [from, to) up to and including the first stop token; sets *stopped.
int64_t up_to_stop(const std::vector<int64_t>& tokens, size_t from, int64_t count, const std::vector<int64_t>& stops,
                   bool* stopped) {
  for (int64_t i = 0; i < count; ++i) {
    if (is_stop(tokens[from + i], stops)) {
      *stopped = true;
      return i + 1;
    }
  }
  return count;
}

}  // namespace

// The tokens one plain step chose, one per row, while the device may still be computing
// them: the next step takes its ids from `chosen` on the device, and the host learns them from a
// copy into pinned memory that it waits for only when it needs them (after queueing that next
// step, so the device never waits for the host between steps).
class Decoder::TokensInFlight {
 public:
  explicit TokensInFlight(const at::Tensor& chosen) : chosen_(chosen) {
    host_ = at::empty(chosen.sizes(), chosen.options().device(at::kCPU).pinned_memory(chosen.is_cuda()));
    host_.copy_(chosen, /*non_blocking=*/chosen.is_cuda());
    if (chosen.is_cuda()) {
      copied_.emplace(chosen.device().type());
      copied_->record(c10::impl::VirtualGuardImpl(chosen.device().type()).getStream(chosen.device()));
    }
  }
  // Row `row`'s token as a device tensor [1] (ready when the step is).
  at::Tensor device_row(int64_t row) const { return chosen_.narrow(0, row, 1); }
  // Row `row`'s token on the host, waiting for the copy the first time.
  int64_t host_row(int64_t row) {
    if (copied_) {
      copied_->synchronize();
      copied_.reset();
    }
    return host_.data_ptr<int64_t>()[row];
  }

 private:
  at::Tensor chosen_, host_;             // int64 [rows]: on the device; its pinned host copy
  std::optional<c10::Event> copied_;     // recorded after the copy; reset once waited for
};

void check_prompt(const std::vector<int64_t>& prompt, const target::ModelConfig& target) {
  if (prompt.empty()) throw std::invalid_argument("the prompt is empty");
  for (int64_t id : prompt) {
    if (id < 0 || id >= target.vocab_size) {
      throw std::invalid_argument("token id " + std::to_string(id) + " is outside the vocabulary (" +
                                  std::to_string(target.vocab_size) + ")");
    }
  }
  const int64_t context = target.max_position_embeddings;
  if (context > 0 && static_cast<int64_t>(prompt.size()) >= context) {
    throw std::invalid_argument(std::to_string(prompt.size()) + " tokens: the target's context is " +
                                std::to_string(context) + " (" + target.source +
                                ": max_position_embeddings), which leaves no place for a new token");
  }
}

struct Decoder::Sequence {
  Request request;
  Generation g;
  at::Generator gen;
  target::DecodeCache cache;
  drafter::DrafterContextCache context;  // speculative decoding only
  int64_t start = 0;                     // the last committed token, not yet run through the target
  int64_t max_length = 0;                // prompt + max_new_tokens, at most the target's context
  Clock::time_point decode_start;
  // Plain decoding: the step in flight that chose this sequence's next token (its row
  // `flight_row`), not yet taken into g.tokens; null when none.
  std::shared_ptr<TokensInFlight> flight;
  int64_t flight_row = 0;

  bool finished() const { return g.stopped || start + 1 >= max_length; }
  // After the prompt's prefill: the prompt, then the first new token chosen from its last logits.
  void take_first_token(const at::Tensor& logits, const Sampling& sampling) {
    g.tokens = request.prompt;
    g.tokens.push_back(choose(logits, sampling, gen));
  }
  // A plain step's token: the next of g.tokens. The first new token (its prefill's, taken a round
  // later) is no step's: no acceptance entry.
  void take(int64_t token, const std::vector<int64_t>& stop_token_ids) {
    if (g.new_tokens() > 0) g.acceptance.push_back(1);
    g.tokens.push_back(token);
    g.stopped = is_stop(token, stop_token_ids);
    start += 1;
  }
};

uint64_t sequence_seed(uint64_t seed, uint64_t index) {
  uint64_t z = seed + 0x9e3779b97f4a7c15ULL * (index + 1);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

void Decoder::run(const GenerateSettings& settings, int64_t max_batch, const NextRequest& next, const Finished& done,
                  std::atomic<int64_t>* decoded) const {
  c10::InferenceMode inference;
  const DeviceScope scope(target_.device());  // where the drafter runs and the tokens are chosen
  check_sampling(settings.sampling);
  if (settings.max_new_tokens < 1) throw std::invalid_argument("generate: max_new_tokens must be >= 1");
  if (max_batch < 1) throw std::invalid_argument("generate: the batch must hold at least one sequence");
  const int64_t context = target_.config().max_position_embeddings;  // 0: not said
  std::vector<std::unique_ptr<Sequence>> active;
  auto new_tokens = [](const std::vector<Sequence*>& sequences) {
    int64_t n = 0;
    for (const Sequence* s : sequences) n += s->g.new_tokens();
    return n;
  };
  // Adds the new tokens `sequences` took since they held `before` to *decoded.
  auto count = [&](const std::vector<Sequence*>& sequences, int64_t before) {
    if (decoded != nullptr) decoded->fetch_add(new_tokens(sequences) - before);
  };
  auto finish = [&](Sequence& s) {
    s.g.tokens.resize(static_cast<size_t>(std::min(s.start + 1, s.max_length)));
    s.g.decode_seconds = seconds_since(s.decode_start);
    done(std::move(s.request), std::move(s.g));
  };
  bool more = true;
  while (true) {
    // Free slots take the next requests, prefilled together; again while some finish at once.
    while (more && static_cast<int64_t>(active.size()) < max_batch) {
      std::vector<std::unique_ptr<Sequence>> admitted;
      while (more && static_cast<int64_t>(active.size() + admitted.size()) < max_batch) {
        auto s = std::make_unique<Sequence>();
        if (!(more = next(&s->request))) break;
        try {
          check_prompt(s->request.prompt, target_.config());
        } catch (const std::invalid_argument& e) {
          throw std::invalid_argument("request " + std::to_string(s->request.id) + ": " + e.what());
        }
        s->gen = at::make_generator<at::CPUGeneratorImpl>(s->request.seed);
        s->g.prompt_tokens = static_cast<int64_t>(s->request.prompt.size());
        // A response ends at max_new_tokens or at the target's context, whichever comes first.
        s->max_length = s->g.prompt_tokens + settings.max_new_tokens;
        if (context > 0) s->max_length = std::min(s->max_length, context);
        admitted.push_back(std::move(s));
      }
      std::vector<Sequence*> starting;
      for (auto& s : admitted) starting.push_back(s.get());
      start_all(starting, settings);
      count(starting, 0);
      for (auto& s : admitted) {
        s->decode_start = Clock::now();
        if (!s->flight) {  // its first token taken (plain decoding leaves it in flight: the next round takes it)
          s->start = s->g.prompt_tokens;
          s->g.stopped = is_stop(s->g.tokens.back(), settings.stop_token_ids);
          if (s->finished()) {
            finish(*s);
            continue;
          }
        }
        active.push_back(std::move(s));
      }
    }
    if (active.empty()) break;
    std::vector<Sequence*> round;
    for (auto& s : active) round.push_back(s.get());
    const int64_t before = decoded != nullptr ? new_tokens(round) : 0;
    advance(round, settings);
    count(round, before);
    // Finished sequences leave (in slot order); the others keep theirs.
    std::vector<std::unique_ptr<Sequence>> kept;
    for (auto& s : active) {
      if (s->finished()) {
        finish(*s);
      } else {
        kept.push_back(std::move(s));
      }
    }
    active = std::move(kept);
  }
}

std::vector<Generation> Decoder::generate_all(const std::vector<std::vector<int64_t>>& prompts,
                                              const GenerateSettings& settings, int64_t max_batch) const {
  return decode::generate_all({this}, prompts, settings, max_batch);  // on this thread (generation.h)
}

Generation Decoder::generate(const std::vector<int64_t>& prompt, const GenerateSettings& settings) const {
  Generation out;
  bool given = false;
  run(
      settings, 1,
      [&](Request* r) {
        if (given) return false;
        *r = {0, prompt, settings.seed};
        given = true;
        return true;
      },
      [&](Request&&, Generation&& g) { out = std::move(g); });
  return out;
}

SpeculativeDecoder::SpeculativeDecoder(const target::IncrementalTarget& target, const drafter::Drafter& drafter)
    : Decoder(target),
      drafter_(drafter),
      tap_(drafter.shape().target_layer_ids.begin(), drafter.shape().target_layer_ids.end()),
      embed_(target.embed_tokens().to(target.device())) {
  const target::ModelConfig& c = target.config();
  if (drafter.shape().hidden_size != c.hidden_size || drafter.shape().vocab_size != c.vocab_size) {
    throw std::invalid_argument("speculative decoding: the drafter (hidden " + std::to_string(drafter.shape().hidden_size) +
                                ", vocabulary " + std::to_string(drafter.shape().vocab_size) + ") does not fit the target " +
                                c.source + " (hidden " + std::to_string(c.hidden_size) + ", vocabulary " +
                                std::to_string(c.vocab_size) + ")");
  }
  for (int64_t id : tap_) {
    if (id < 0 || id >= c.num_layers) {
      throw std::invalid_argument("speculative decoding: the drafter reads target layer " + std::to_string(id) +
                                  ", which " + c.source + " does not have");
    }
  }
}

void SpeculativeDecoder::start(Sequence& s, const GenerateSettings& settings) const {
  s.cache = target_.new_cache();
  take_prefills({&s}, {target_.prefill(s.cache, ids_tensor(s.request.prompt), tap_)}, settings);
}

void SpeculativeDecoder::start_batch(const std::vector<Sequence*>& batch, const GenerateSettings& settings) const {
  take_prefills(batch, prefill_batch(batch, tap_), settings);
}

void SpeculativeDecoder::take_prefills(const std::vector<Sequence*>& sequences,
                                       const std::vector<target::DecodeOutput>& out,
                                       const GenerateSettings& settings) const {
  const size_t positions = static_cast<size_t>(drafter_.shape().block_size - 1);
  std::vector<drafter::DrafterContextCache*> contexts;
  std::vector<at::Tensor> features;
  for (size_t j = 0; j < sequences.size(); ++j) {
    Sequence& s = *sequences[j];
    s.g.drafted_at.assign(positions, 0);
    s.g.accepted_at.assign(positions, 0);
    s.take_first_token(out[j].logits, settings.sampling);
    contexts.push_back(&s.context), features.push_back(out[j].features);
  }
  drafter_.extend_contexts(contexts, features);
}

void SpeculativeDecoder::advance(const std::vector<Sequence*>& active, const GenerateSettings& settings) const {
  const Sampling& sampling = settings.sampling;
  const int64_t block_size = drafter_.shape().block_size, mask = drafter_.shape().mask_token_id;
  const size_t count = active.size();
  // 1. Blocks [last token, mask ...], as long as the room left allows; the drafter fills them.
  std::vector<std::vector<int64_t>> blocks(count);
  std::vector<Sequence*> drafting;
  std::vector<at::Tensor> draft_ids;
  for (size_t j = 0; j < count; ++j) {
    Sequence& s = *active[j];
    blocks[j].assign(static_cast<size_t>(std::min(block_size, s.max_length - s.start)), mask);
    blocks[j][0] = s.g.tokens[static_cast<size_t>(s.start)];
    if (blocks[j].size() > 1) drafting.push_back(&s), draft_ids.push_back(ids_tensor(blocks[j]));
  }
  // Sampling: every draft row's probabilities (block j's from row draft_rows[j]), each row drawn
  // from its sequence's generator, all at once.
  at::Tensor draft_probs;
  std::vector<int64_t> draft_rows(count, 0);
  std::vector<at::Generator*> gens;
  for (Sequence* s : active) gens.push_back(&s->gen);
  if (!drafting.empty()) {
    std::vector<const drafter::DrafterContextCache*> contexts;
    for (Sequence* s : drafting) contexts.push_back(&s->context);
    const std::vector<at::Tensor> hidden = drafter_.block_hiddens(contexts, draft_ids, embed_);
    std::vector<at::Tensor> rows;
    for (const at::Tensor& h : hidden) rows.push_back(h.narrow(0, 1, h.size(0) - 1));
    // In the head's dtype, as the target's logits: the argmax needs no fp32 copy (1.9 GB at 128
    // blocks of 15 drafts), sampling_probs widens.
    const at::Tensor logits = at::matmul(at::cat(rows), target_.lm_head().t());
    std::vector<at::Generator*> row_gens;
    for (size_t j = 0; j < count; ++j) row_gens.insert(row_gens.end(), blocks[j].size() - 1, gens[j]);
    std::vector<int64_t> drafted;
    if (sampling.greedy()) {
      const at::Tensor greedy = logits.argmax(-1).to(at::kCPU).contiguous();
      drafted.assign(greedy.data_ptr<int64_t>(), greedy.data_ptr<int64_t>() + greedy.numel());
    } else {
      draft_probs = sampling_probs(logits, sampling);
      drafted = draw_rows(draft_probs, row_gens);
    }
    for (size_t j = 0, row = 0; j < count; row += blocks[j].size() - 1, ++j) {
      draft_rows[j] = static_cast<int64_t>(row);
      std::copy_n(drafted.begin() + static_cast<int64_t>(row), blocks[j].size() - 1, blocks[j].begin() + 1);
    }
  }
  // 2. The target verifies every block in one step.
  std::vector<target::DecodeCache*> caches;
  std::vector<at::Tensor> verify_ids;
  for (size_t j = 0; j < count; ++j) caches.push_back(&active[j]->cache), verify_ids.push_back(ids_tensor(blocks[j]));
  const std::vector<target::DecodeOutput> out = target_.step_batch(caches, verify_ids, tap_);
  // 3. Per sequence: the accepted prefix and the bonus token; the caches keep what was committed.
  const std::vector<SpeculativeOutcome> decided = verify_blocks(blocks, out, draft_probs, draft_rows, gens, sampling);
  std::vector<int64_t> lengths(count);
  std::vector<drafter::DrafterContextCache*> contexts;
  std::vector<at::Tensor> committed_features;
  for (size_t j = 0; j < count; ++j) {
    Sequence& s = *active[j];
    const std::vector<int64_t>& block = blocks[j];
    const int64_t verify = static_cast<int64_t>(block.size());
    const auto [accepted, bonus] = decided[j];
    for (int64_t k = 1; k < verify; ++k) {
      ++s.g.drafted_at[k - 1];
      if (k <= accepted) ++s.g.accepted_at[k - 1];
    }
    s.g.tokens.resize(static_cast<size_t>(s.start + 1));
    s.g.tokens.insert(s.g.tokens.end(), block.begin() + 1, block.begin() + 1 + accepted);
    s.g.tokens.push_back(bonus);
    const int64_t produced = up_to_stop(s.g.tokens, static_cast<size_t>(s.start + 1),
                                        std::min(accepted + 1, s.max_length - s.start - 1), settings.stop_token_ids,
                                        &s.g.stopped);
    s.g.tokens.resize(static_cast<size_t>(s.start + 1 + produced));
    lengths[j] = s.start + produced;
    if (verify > 1) contexts.push_back(&s.context), committed_features.push_back(out[j].features.narrow(0, 0, produced));
    s.start += produced;
    s.g.acceptance.push_back(produced);
  }
  target_.crop_batch(caches, lengths);
  if (!contexts.empty()) drafter_.extend_contexts(contexts, committed_features);
}

namespace {

// The token of each of `sequences` from its row of `out` (a step's or a prefill's last logits),
// chosen on the device: the argmax, or sampled with a uniform from the sequence's own generator
// (drawn on the host without waiting for the logits). The host takes them later.
std::shared_ptr<Decoder::TokensInFlight> choose_in_flight(const std::vector<target::DecodeOutput>& out,
                                                          const std::vector<Decoder::Sequence*>& sequences,
                                                          const GenerateSettings& settings) {
  std::vector<at::Tensor> logits;
  for (const target::DecodeOutput& o : out) logits.push_back(o.logits);
  if (settings.sampling.greedy()) return std::make_shared<Decoder::TokensInFlight>(joined_rows(logits).argmax(-1));
  std::vector<at::Generator*> gens;
  for (Decoder::Sequence* s : sequences) gens.push_back(&s->gen);
  return std::make_shared<Decoder::TokensInFlight>(
      choose_rows(sampling_probs(joined_rows(logits), settings.sampling), uniforms(gens)));
}

// Prefilled sequences' first tokens, chosen as a plain step's and left in flight: the host takes
// them in the next round, after queueing it (waiting for them here left the GPU idle while the
// host planned that round).
void first_tokens_in_flight(const std::vector<Decoder::Sequence*>& sequences,
                            const std::vector<target::DecodeOutput>& out, const GenerateSettings& settings) {
  const std::shared_ptr<Decoder::TokensInFlight> first = choose_in_flight(out, sequences, settings);
  for (size_t j = 0; j < sequences.size(); ++j) {
    Decoder::Sequence& s = *sequences[j];
    s.g.tokens = s.request.prompt;
    s.start = s.g.prompt_tokens - 1;  // take() moves it to the prompt's end
    s.flight = first;
    s.flight_row = static_cast<int64_t>(j);
  }
}

}  // namespace

void Decoder::start_all(const std::vector<Sequence*>& admitted, const GenerateSettings& settings) const {
  const int64_t budget = target::IncrementalTarget::kPrefillBatchTokens;
  size_t i = 0;
  while (i < admitted.size()) {
    // The next prompts while they fit the budget together; a longer prompt alone, in chunks.
    std::vector<Sequence*> batch;
    int64_t tokens = 0;
    for (; i < admitted.size(); ++i) {
      const int64_t n = static_cast<int64_t>(admitted[i]->request.prompt.size());
      if (tokens + n > budget) break;
      batch.push_back(admitted[i]);
      tokens += n;
    }
    const auto prefill_start = Clock::now();
    if (batch.empty()) {
      start(*admitted[i], settings);
      admitted[i++]->g.prefill_seconds = seconds_since(prefill_start);
      continue;
    }
    start_batch(batch, settings);
    const double seconds = seconds_since(prefill_start);
    for (Sequence* s : batch) s->g.prefill_seconds = seconds;
  }
}

std::vector<target::DecodeOutput> Decoder::prefill_batch(const std::vector<Sequence*>& batch,
                                                         const std::vector<int64_t>& tap) const {
  std::vector<target::DecodeCache*> caches;
  std::vector<at::Tensor> ids;
  for (Sequence* s : batch) {
    s->cache = target_.new_cache();
    caches.push_back(&s->cache);
    ids.push_back(ids_tensor(s->request.prompt));
  }
  return target_.prefill_batch(caches, ids, tap);
}

void PlainDecoder::start_batch(const std::vector<Sequence*>& batch, const GenerateSettings& settings) const {
  first_tokens_in_flight(batch, prefill_batch(batch, {}), settings);
}

void PlainDecoder::start(Sequence& s, const GenerateSettings& settings) const {
  s.cache = target_.new_cache();
  first_tokens_in_flight({&s}, {target_.prefill(s.cache, ids_tensor(s.request.prompt), {})}, settings);
}

namespace {

// Queues one plain step of `stepping` (ids: each sequence's token in flight, on the device, or
// its last token) and chooses its tokens on the device (sampled: each row with a uniform from its
// sequence's own generator, drawn on the host without waiting for the logits).
std::shared_ptr<Decoder::TokensInFlight> queue_plain_step(const target::IncrementalTarget& target,
                                                          const std::vector<Decoder::Sequence*>& stepping,
                                                          const GenerateSettings& settings) {
  std::vector<target::DecodeCache*> caches;
  std::vector<at::Tensor> ids;
  for (Decoder::Sequence* s : stepping) {
    caches.push_back(&s->cache);
    ids.push_back(s->flight ? s->flight->device_row(s->flight_row) : ids_tensor({s->g.tokens.back()}));
  }
  return choose_in_flight(target.step_batch(caches, ids, {}, /*croppable=*/false), stepping, settings);
}

}  // namespace

// This step's tokens stay on the device as the next step's ids, and the host takes the step
// before's once this one is queued. A sequence whose token in flight is its last by length is not
// stepped again; one that a stop token ends leaves with this step's token untaken (one step of
// work lost per such sequence, against the host's planning and launches between steps).
void PlainDecoder::advance(const std::vector<Sequence*>& active, const GenerateSettings& settings) const {
  std::vector<Sequence*> stepping;
  for (Sequence* s : active) {
    if (!(s->flight && s->start + 2 >= s->max_length)) stepping.push_back(s);
  }
  const std::shared_ptr<TokensInFlight> step =
      stepping.empty() ? nullptr : queue_plain_step(target_, stepping, settings);
  for (Sequence* s : active) {
    if (s->flight) s->take(s->flight->host_row(s->flight_row), settings.stop_token_ids);
    s->flight = nullptr;
  }
  for (size_t j = 0; j < stepping.size(); ++j) {
    stepping[j]->flight = step;
    stepping[j]->flight_row = static_cast<int64_t>(j);
  }
}

Generation plain_generate(const target::IncrementalTarget& target, const std::vector<int64_t>& prompt,
                          const GenerateSettings& settings) {
  return PlainDecoder(target).generate(prompt, settings);
}

}  // namespace dflash::decode
