#include "common/token_file.h"

#include <fstream>
#include <nlohmann/json.hpp>

#include "common/json_limits.h"

namespace dflash {

TokenSample parse_token_line(const std::string& text, const std::string& file, int64_t line) {
  const std::string where = file + ":" + std::to_string(line) + ": ";
  if (const std::string problem = json_text_problem(text); !problem.empty()) {
    throw TokenFileError(where + "invalid JSON: " + problem);
  }
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw TokenFileError(where + "invalid JSON (" + std::string(e.what()) + ")");
  }
  if (!j.is_object() || !j.contains("input_ids") || !j["input_ids"].is_array()) {
    throw TokenFileError(where + "expected an object with an \"input_ids\" list");
  }
  TokenSample sample;
  sample.line = line;
  for (const auto& id : j["input_ids"]) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0) {
      throw TokenFileError(where + "input_ids must hold non-negative integers, found " + id.dump());
    }
    sample.input_ids.push_back(id.get<int64_t>());
  }
  if (j.contains("loss_mask")) {
    if (!j["loss_mask"].is_array()) throw TokenFileError(where + "loss_mask must be a list of 0/1");
    for (const auto& m : j["loss_mask"]) {
      if (!m.is_number_integer() || (m.get<int64_t>() != 0 && m.get<int64_t>() != 1)) {
        throw TokenFileError(where + "loss_mask must hold 0 or 1, found " + m.dump());
      }
      sample.loss_mask.push_back(static_cast<uint8_t>(m.get<int64_t>()));
    }
    if (sample.loss_mask.size() != sample.input_ids.size()) {
      throw TokenFileError(where + "loss_mask has " + std::to_string(sample.loss_mask.size()) + " entries for " +
                           std::to_string(sample.input_ids.size()) + " input_ids");
    }
  }
  return sample;
}

std::vector<TokenSample> read_token_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw TokenFileError(path + ": cannot read");
  std::vector<TokenSample> samples;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    samples.push_back(parse_token_line(text, path, line));
  }
  return samples;
}

void check_stop_tokens(const std::string& setting, const std::vector<int64_t>& stop_token_ids, int64_t vocab) {
  for (int64_t id : stop_token_ids) {
    if (id < 0 || id >= vocab) {
      throw std::invalid_argument(setting + ": stop token id " + std::to_string(id) + " is outside the vocabulary (" +
                                  std::to_string(vocab) + "): no token could end a response with it");
    }
  }
}

}  // namespace dflash
