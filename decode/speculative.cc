#include "decode/speculative.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <stdexcept>
#include <string>

namespace dflash::decode {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

void check_prompt(const std::vector<int64_t>& prompt, int64_t vocab, const GenerateSettings& s) {
  check_sampling(s.sampling);
  if (prompt.empty()) throw std::invalid_argument("generate: the prompt is empty");
  if (s.max_new_tokens < 1) throw std::invalid_argument("generate: max_new_tokens must be >= 1");
  for (int64_t id : prompt) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument("generate: token id " + std::to_string(id) + " is outside the vocabulary (" +
                                  std::to_string(vocab) + ")");
    }
  }
}

at::Tensor ids_tensor(const std::vector<int64_t>& ids) {
  return at::tensor(ids, at::TensorOptions().dtype(at::kLong));
}

// The token chosen from the last row of logits [rows, vocab].
int64_t choose(const at::Tensor& logits, const Sampling& s, at::Generator& gen) {
  const at::Tensor last = logits.select(0, logits.size(0) - 1).unsqueeze(0);
  if (s.greedy()) return last.argmax(-1).item<int64_t>();
  return draw(sampling_probs(last, s), gen).item<int64_t>();
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

SpeculativeDecoder::SpeculativeDecoder(const target::IncrementalTarget& target, const drafter::Drafter& drafter)
    : target_(target), drafter_(drafter), tap_(drafter.shape().target_layer_ids.begin(), drafter.shape().target_layer_ids.end()) {
  const target::ModelConfig& c = target.model().config();
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

Generation SpeculativeDecoder::generate(const std::vector<int64_t>& prompt, const GenerateSettings& s) const {
  c10::InferenceMode inference;
  const target::TargetModel& model = target_.model();
  check_prompt(prompt, model.config().vocab_size, s);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed);
  const int64_t block_size = drafter_.shape().block_size, mask = drafter_.shape().mask_token_id;
  const int64_t n = static_cast<int64_t>(prompt.size()), max_length = n + s.max_new_tokens;
  const at::Tensor head = model.lm_head();
  Generation g;
  g.prompt_tokens = n;
  g.drafted_at.assign(static_cast<size_t>(block_size - 1), 0);
  g.accepted_at.assign(static_cast<size_t>(block_size - 1), 0);

  const auto prefill_start = Clock::now();
  target::DecodeCache cache = target_.new_cache();
  drafter::DrafterContextCache context;
  target::DecodeOutput out = target_.prefill(cache, ids_tensor(prompt), tap_);
  g.tokens = prompt;
  g.tokens.push_back(choose(out.logits, s.sampling, gen));
  drafter_.extend_context(context, out.features);
  g.prefill_seconds = seconds_since(prefill_start);

  const auto decode_start = Clock::now();
  int64_t start = n;  // the last committed token, not yet run through the target
  g.stopped = is_stop(g.tokens[start], s.stop_token_ids);
  while (start + 1 < max_length && !g.stopped) {
    const int64_t verify = std::min(block_size, max_length - start);
    std::vector<int64_t> block(static_cast<size_t>(verify), mask);
    block[0] = g.tokens[start];
    at::Tensor draft_probs;
    if (verify > 1) {
      const at::Tensor hidden = drafter_.block_hidden(context, ids_tensor(block), model.embed_tokens());
      const at::Tensor logits = at::matmul(hidden.narrow(0, 1, verify - 1), head.t()).to(at::kFloat);
      at::Tensor drafts;
      if (s.sampling.greedy()) {
        drafts = logits.argmax(-1).to(at::kCPU);
      } else {
        draft_probs = sampling_probs(logits, s.sampling);
        drafts = draw(draft_probs, gen);
      }
      for (int64_t k = 1; k < verify; ++k) block[k] = drafts[k - 1].item<int64_t>();
    }
    out = target_.step(cache, ids_tensor(block), tap_);
    int64_t accepted = 0, bonus = 0;
    if (s.sampling.greedy()) {
      const at::Tensor posterior = out.logits.argmax(-1).to(at::kCPU);
      while (accepted + 1 < verify && block[accepted + 1] == posterior[accepted].item<int64_t>()) ++accepted;
      bonus = posterior[accepted].item<int64_t>();
    } else {
      const at::Tensor target_probs = sampling_probs(out.logits, s.sampling);
      if (verify > 1) {
        std::tie(accepted, bonus) =
            rejection_sample(ids_tensor(std::vector<int64_t>(block.begin() + 1, block.end())), target_probs, draft_probs, gen);
      } else {
        bonus = draw(target_probs.select(0, verify - 1).unsqueeze(0), gen).item<int64_t>();
      }
    }
    for (int64_t k = 1; k < verify; ++k) {
      ++g.drafted_at[k - 1];
      if (k <= accepted) ++g.accepted_at[k - 1];
    }
    g.tokens.resize(static_cast<size_t>(start + 1));
    g.tokens.insert(g.tokens.end(), block.begin() + 1, block.begin() + 1 + accepted);
    g.tokens.push_back(bonus);
    const int64_t produced =
        up_to_stop(g.tokens, static_cast<size_t>(start + 1), std::min(accepted + 1, max_length - start - 1),
                   s.stop_token_ids, &g.stopped);
    g.tokens.resize(static_cast<size_t>(start + 1 + produced));
    target_.crop(cache, start + produced);
    if (verify > 1) drafter_.extend_context(context, out.features.narrow(0, 0, produced));
    start += produced;
    g.acceptance.push_back(produced);
  }
  g.tokens.resize(static_cast<size_t>(std::min(start + 1, max_length)));
  g.decode_seconds = seconds_since(decode_start);
  return g;
}

Generation plain_generate(const target::IncrementalTarget& target, const std::vector<int64_t>& prompt,
                          const GenerateSettings& s) {
  c10::InferenceMode inference;
  check_prompt(prompt, target.model().config().vocab_size, s);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(s.seed);
  Generation g;
  g.prompt_tokens = static_cast<int64_t>(prompt.size());
  const auto prefill_start = Clock::now();
  target::DecodeCache cache = target.new_cache();
  target::DecodeOutput out = target.prefill(cache, ids_tensor(prompt), {});
  g.tokens = prompt;
  g.tokens.push_back(choose(out.logits, s.sampling, gen));
  g.prefill_seconds = seconds_since(prefill_start);
  const auto decode_start = Clock::now();
  g.stopped = is_stop(g.tokens.back(), s.stop_token_ids);
  while (g.new_tokens() < s.max_new_tokens && !g.stopped) {
    out = target.step(cache, ids_tensor({g.tokens.back()}), {});
    g.tokens.push_back(choose(out.logits, s.sampling, gen));
    g.stopped = is_stop(g.tokens.back(), s.stop_token_ids);
    g.acceptance.push_back(1);
  }
  g.decode_seconds = seconds_since(decode_start);
  return g;
}

}  // namespace dflash::decode
