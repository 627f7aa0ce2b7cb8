// yaml_reader.h: a strict walker over yaml-cpp nodes.
//
// yaml-cpp silently keeps duplicate keys (lookups return the first) and never complains about
// keys nobody reads, so the walker iterates each mapping itself: it reports duplicates, wrong
// types and out-of-range values with file:line:col, remembers which keys the schema knows, and
// at done() reports the rest as unknown with a "did you mean" for near misses. It never throws
// for bad input: every problem becomes a Diagnostic and parsing continues, so the user sees all
// of them at once.
#pragma once

#include <yaml-cpp/yaml.h>

#include <functional>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "config/config.h"

namespace dflash::config {

class Diagnostics {
 public:
  explicit Diagnostics(std::string file) : file_(std::move(file)) {}
  void add(Position position, std::string message) {
    items_.push_back({file_, position, std::move(message)});
  }
  void add(const YAML::Mark& mark, std::string message) { add(to_position(mark), std::move(message)); }
  static Position to_position(const YAML::Mark& mark) {
    if (mark.is_null()) return {};
    return {mark.line + 1, mark.column + 1};  // yaml-cpp marks are 0-based
  }
  const std::vector<Diagnostic>& items() const { return items_; }
  const std::string& file() const { return file_; }

 private:
  std::string file_;
  std::vector<Diagnostic> items_;
};

// A check on a parsed value: returns an error message, or "" when the value is fine.
template <class T>
using Check = std::function<std::string(const T&)>;

class MapReader {
 public:
  // `node` may be undefined or null (section absent: all defaults).
  MapReader(Diagnostics* diagnostics, std::map<std::string, Position>* positions, const YAML::Node& node,
            std::string path);

  // Reads an optional scalar field; absent or null keeps *out as it is (its default).
  template <class T>
  void field(const char* key, T* out, Check<T> check = {});
  template <class T>
  void field(const char* key, std::optional<T>* out, Check<T> check = {});
  // A field without a default: absent is an error.
  template <class T>
  void required(const char* key, T* out, Check<T> check = {});
  // A string field restricted to a set of values.
  void choice(const char* key, std::string* out, const std::vector<std::string>& allowed);
  // The same, read into an enumeration: `allowed` pairs each word of the file with its value.
  template <class E>
  void choice(const char* key, E* out, const std::vector<std::pair<std::string, E>>& allowed) {
    std::vector<std::string> words;
    std::string word;
    for (const auto& [w, value] : allowed) {
      words.push_back(w);
      if (value == *out) word = w;  // the default's word
    }
    choice(key, &word, words);
    for (const auto& [w, value] : allowed) {
      if (w == word) *out = value;
    }
  }
  // A sub-mapping; absent gives a reader over nothing (defaults).
  MapReader map(const char* key);
  bool has(const char* key) const;
  Position position() const { return Diagnostics::to_position(node_.Mark()); }
  Position position_of(const char* key) const;
  // Reports the keys no field()/map() asked for.
  void done();

 private:
  struct Entry {
    std::string key;
    YAML::Node key_node;
    YAML::Node value;
  };
  const Entry* find(const char* key);
  std::string child_path(const char* key) const { return path_.empty() ? key : path_ + "." + key; }
  template <class T>
  bool convert(const YAML::Node& value, const std::string& path, T* out);

  Diagnostics* diagnostics_;
  std::map<std::string, Position>* positions_;
  YAML::Node node_;
  std::string path_;
  std::vector<Entry> entries_;
  std::set<std::string> known_;
};

// Edit distance, for "did you mean".
size_t edit_distance(const std::string& a, const std::string& b);

}  // namespace dflash::config
