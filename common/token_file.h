// token_file.h: reading token sequences from JSON Lines, one sample per line:
//   {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}
// (loss_mask optional here). Blank lines are skipped. A malformed line is a TokenFileError
// naming the file and the 1-based line: invalid JSON, no input_ids list, a non-integer or
// negative id, a loss_mask whose length differs from input_ids.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash {

class TokenFileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TokenSample {
  std::vector<int64_t> input_ids;
  std::vector<uint8_t> loss_mask;  // empty when the line has none
  int64_t line = 0;                // 1-based line in the file
};

// Parses one line; throws TokenFileError("FILE:LINE: ...") on malformed input.
TokenSample parse_token_line(const std::string& text, const std::string& file, int64_t line);
std::vector<TokenSample> read_token_file(const std::string& path);

// Throws std::invalid_argument ("SETTING: stop token id N is outside the vocabulary (V)...") for a
// stop id no token can be (every response would run to its length); `setting` names where the ids
// came from ("--stop-token-ids", "eval.stop_token_ids").
void check_stop_tokens(const std::string& setting, const std::vector<int64_t>& stop_token_ids, int64_t vocab);

}  // namespace dflash
