#include "decode/eval.h"

#include <algorithm>
#include <nlohmann/json.hpp>
#include <stdexcept>

#include "common/token_file.h"

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
  j["spec_decode_seconds"] = spec_seconds;
  j["spec_decode_tokens_per_second"] = spec_tokens_per_second;
  if (baseline) {
    j["plain_decode_seconds"] = plain_seconds;
    j["plain_decode_tokens_per_second"] = plain_tokens_per_second;
    j["speedup"] = speedup;
  }
  if (mismatches >= 0) j["outputs_differing_from_plain_greedy"] = mismatches;
  return j.dump(2) + "\n";
}

EvalReport evaluate(const SpeculativeDecoder& spec, const target::IncrementalTarget& target,
                    const std::vector<EvalPrompt>& prompts, const GenerateSettings& settings, bool baseline) {
  EvalReport r;
  r.prompts = static_cast<int64_t>(prompts.size());
  r.baseline = baseline;
  std::vector<int64_t> drafted, accepted;
  int64_t committed = 0, plain_tokens = 0;
  if (baseline && settings.sampling.greedy()) r.mismatches = 0;
  for (const EvalPrompt& p : prompts) {
    Generation g;
    try {
      g = spec.generate(p.ids, settings);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(p.where + ": " + e.what());
    }
    r.new_tokens += g.new_tokens();
    r.verify_steps += static_cast<int64_t>(g.acceptance.size());
    for (int64_t a : g.acceptance) committed += a;
    drafted.resize(g.drafted_at.size(), 0);
    accepted.resize(g.accepted_at.size(), 0);
    for (size_t k = 0; k < g.drafted_at.size(); ++k) drafted[k] += g.drafted_at[k], accepted[k] += g.accepted_at[k];
    r.spec_seconds += g.decode_seconds;
    if (!baseline) continue;
    const Generation plain = plain_generate(target, p.ids, settings);
    plain_tokens += plain.new_tokens();
    r.plain_seconds += plain.decode_seconds;
    if (r.mismatches >= 0 && plain.tokens != g.tokens) ++r.mismatches;
  }
  r.acceptance_length = r.verify_steps > 0 ? static_cast<double>(committed) / static_cast<double>(r.verify_steps) : 0;
  for (size_t k = 0; k < drafted.size(); ++k) {
    r.acceptance_at.push_back(drafted[k] > 0 ? static_cast<double>(accepted[k]) / static_cast<double>(drafted[k]) : 0);
  }
  // Decode-time rates: every new token but each prompt's first comes from the decode loop.
  const int64_t decoded = r.new_tokens - r.prompts;
  r.spec_tokens_per_second = r.spec_seconds > 0 ? static_cast<double>(decoded) / r.spec_seconds : 0;
  if (baseline) {
    r.plain_tokens_per_second = r.plain_seconds > 0 ? static_cast<double>(plain_tokens - r.prompts) / r.plain_seconds : 0;
    r.speedup = r.plain_tokens_per_second > 0 ? r.spec_tokens_per_second / r.plain_tokens_per_second : 0;
  }
  return r;
}

}  // namespace dflash::decode
