// json_limits.h: what every JSON document dflashd reads must satisfy before it is parsed.
//
// nlohmann's parser itself is iterative, but printing a value (as error messages do: "found
// [[[...") recurses once per nesting level, so a line nested 100,000 deep overflowed the stack.
// And the parser treats a NUL byte as the end of the input, so "{...}\0garbage" parsed as
// "{...}". Every reader (data lines, safetensors headers, config.json, state.json, token
// files) checks its text with json_text_problem() first and reports the problem with its own
// file name. The limit is far above what any real document nests (data lines: 2 levels,
// config.json: 3 or 4).
#pragma once

#include <string>
#include <string_view>

namespace dflash {

inline constexpr int kMaxJsonDepth = 64;

// Empty when `text` has no NUL byte and no array or object nested deeper than max_depth;
// otherwise what is wrong, with the byte offset. Brackets inside strings do not count.
inline std::string json_text_problem(std::string_view text, int max_depth = kMaxJsonDepth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (c == '\0') return "a NUL byte at offset " + std::to_string(i) + " (binary data or a corrupt file)";
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth) {
        return "nested deeper than " + std::to_string(max_depth) + " levels at offset " + std::to_string(i);
      }
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return "";
}

}  // namespace dflash
