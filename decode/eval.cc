#include "decode/eval.h"

#include <algorithm>
#include <chrono>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "common/token_file.h"
#include "decode/generation.h"

namespace dflash::decode {

std::vector<int64_t> prompt_of(const TokenSample& sample) {
  size_t end = sample.input_ids.size();
  if (!sample.loss_mask.empty()) {
    end = static_cast<size_t>(std::find(sample.loss_mask.begin(), sample.loss_mask.end(), 1) - sample.loss_mask.begin());
  }
  return std::vector<int64_t>(sample.input_ids.begin(), sample.input_ids.begin() + static_cast<int64_t>(end));
}

std::vector<EvalPrompt> read_eval_prompts(const std::string& path, int64_t limit) {
  std::vector<EvalPrompt> prompts;
  for (const TokenSample& s : read_token_file(path)) {
    std::vector<int64_t> prompt = prompt_of(s);
    if (prompt.empty()) continue;
    prompts.push_back({std::move(prompt), path + ":" + std::to_string(s.line)});
    if (limit > 0 && static_cast<int64_t>(prompts.size()) >= limit) break;
  }
  if (prompts.empty()) throw std::runtime_error(path + ": no prompts (every line is empty or supervised from its first token)");
  return prompts;
}

std::string EvalReport::to_json() const {
  nlohmann::ordered_json j;
  j["prompts"] = prompts;
  j["new_tokens"] = new_tokens;
  j["verify_steps"] = verify_steps;
  j["acceptance_length"] = acceptance_length;
  j["acceptance_at_position"] = acceptance_at;
  j["max_batch"] = max_batch;
  j["decoders"] = decoders;
  j["spec_decode_seconds"] = spec_seconds;
  j["spec_decode_tokens_per_second"] = spec_tokens_per_second;
  if (baseline) {
    j["plain_decode_seconds"] = plain_seconds;
    j["plain_decode_tokens_per_second"] = plain_tokens_per_second;
    j["speedup"] = speedup;
  }
  if (mismatches >= 0) j["outputs_differing_from_plain_greedy"] = mismatches;
  j["settings"] = {{"max_new_tokens", settings.max_new_tokens},
                   {"temperature", settings.sampling.temperature},
                   {"top_p", settings.sampling.top_p},
                   {"top_k", settings.sampling.top_k},
                   {"stop_token_ids", settings.stop_token_ids},
                   {"seed", settings.seed}};
  return j.dump(2) + "\n";
}

std::string describe(const GenerateSettings& s) {
  std::ostringstream text;
  if (s.sampling.greedy()) {
    text << "greedy";
  } else {
    text << "sampled (temperature " << s.sampling.temperature << ", top_p " << s.sampling.top_p << ", top_k "
         << s.sampling.top_k << ")";
  }
  if (!s.stop_token_ids.empty()) text << ", " << s.stop_token_ids.size() << " stop tokens";
  return text.str();
}

namespace {

// Decodes every prompt with `decoders`, naming the prompt's FILE:LINE on a bad one; the wall time
// in *seconds.
std::vector<Generation> decode_prompts(const std::vector<const Decoder*>& decoders,
                                       const std::vector<EvalPrompt>& prompts, const GenerateSettings& settings,
                                       int64_t max_batch, double* seconds) {
  std::vector<std::vector<int64_t>> ids;
  for (const EvalPrompt& p : prompts) ids.push_back(p.ids);
  const target::ModelConfig& target_config = decoders.front()->target().config();
  dflash::check_stop_tokens("stop_token_ids", settings.stop_token_ids, target_config.vocab_size);
  for (const EvalPrompt& p : prompts) {  // bad ids are named by their line before anything runs
    try {
      check_prompt(p.ids, target_config);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(p.where + ": " + e.what());
    }
  }
  const auto begin = std::chrono::steady_clock::now();
  std::vector<Generation> out = generate_all(decoders, ids, settings, max_batch);
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
  return out;
}

}  // namespace

EvalReport evaluate(const std::vector<const Decoder*>& spec, const std::vector<EvalPrompt>& prompts,
                    const GenerateSettings& settings, bool baseline, int64_t max_batch) {
  if (spec.empty()) throw std::invalid_argument("evaluate: no decoders");
  EvalReport r;
  r.prompts = static_cast<int64_t>(prompts.size());
  r.baseline = baseline;
  r.max_batch = max_batch;
  r.decoders = static_cast<int64_t>(spec.size());
  r.settings = settings;
  const std::vector<Generation> fast = decode_prompts(spec, prompts, settings, max_batch, &r.spec_seconds);
  std::vector<int64_t> drafted, accepted;
  int64_t committed = 0;
  for (const Generation& g : fast) {
    r.new_tokens += g.new_tokens();
    r.verify_steps += static_cast<int64_t>(g.acceptance.size());
    for (int64_t a : g.acceptance) committed += a;
    drafted.resize(g.drafted_at.size(), 0);
    accepted.resize(g.accepted_at.size(), 0);
    for (size_t k = 0; k < g.drafted_at.size(); ++k) drafted[k] += g.drafted_at[k], accepted[k] += g.accepted_at[k];
  }
  r.acceptance_length = r.verify_steps > 0 ? static_cast<double>(committed) / static_cast<double>(r.verify_steps) : 0;
  for (size_t k = 0; k < drafted.size(); ++k) {
    r.acceptance_at.push_back(drafted[k] > 0 ? static_cast<double>(accepted[k]) / static_cast<double>(drafted[k]) : 0);
  }
  r.spec_tokens_per_second = r.spec_seconds > 0 ? static_cast<double>(r.new_tokens) / r.spec_seconds : 0;
  if (!baseline) return r;
  const PlainDecoder plain_decoder(spec.front()->target());  // stateless: one object serves every thread
  const std::vector<const Decoder*> plain_running(spec.size(), &plain_decoder);
  const std::vector<Generation> plain = decode_prompts(plain_running, prompts, settings, max_batch, &r.plain_seconds);
  int64_t plain_tokens = 0;
  if (settings.sampling.greedy()) r.mismatches = 0;
  for (size_t i = 0; i < plain.size(); ++i) {
    plain_tokens += plain[i].new_tokens();
    if (r.mismatches >= 0 && plain[i].tokens != fast[i].tokens) ++r.mismatches;
  }
  r.plain_tokens_per_second = r.plain_seconds > 0 ? static_cast<double>(plain_tokens) / r.plain_seconds : 0;
  r.speedup = r.plain_tokens_per_second > 0 ? r.spec_tokens_per_second / r.plain_tokens_per_second : 0;
  return r;
}

}  // namespace dflash::decode
