#include "config/yaml_reader.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <cstdint>
#include <sstream>

namespace dflash::config {

namespace {

const char* kind_name(const YAML::Node& node) {
  switch (node.Type()) {
    case YAML::NodeType::Map: return "a mapping";
    case YAML::NodeType::Sequence: return "a list";
    case YAML::NodeType::Scalar: return "a scalar";
    case YAML::NodeType::Null: return "null";
    default: return "nothing";
  }
}

template <class T>
constexpr const char* type_name() {
  if constexpr (std::is_same_v<T, bool>) return "a boolean (true/false)";
  else if constexpr (std::is_integral_v<T>) return "an integer";
  else if constexpr (std::is_floating_point_v<T>) return "a number";
  else if constexpr (std::is_same_v<T, std::string>) return "a string";
  else return "a list";
}

// yaml-cpp's as<bool> also takes y/n/on/off; accept only what people mean.
bool parse_bool(const std::string& s, bool* out) {
  if (s == "true" || s == "True" || s == "TRUE") return *out = true, true;
  if (s == "false" || s == "False" || s == "FALSE") return *out = false, true;
  return false;
}

}  // namespace

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> previous(b.size() + 1), current(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) previous[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    current[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t substitute = previous[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      current[j] = std::min({previous[j] + 1, current[j - 1] + 1, substitute});
    }
    std::swap(previous, current);
  }
  return previous[b.size()];
}

MapReader::MapReader(Diagnostics* diagnostics, std::map<std::string, Position>* positions,
                     const YAML::Node& node, std::string path)
    : diagnostics_(diagnostics), positions_(positions), node_(node), path_(std::move(path)) {
  if (!node_.IsDefined() || node_.IsNull()) return;
  if (!node_.IsMap()) {
    diagnostics_->add(node_.Mark(), (path_.empty() ? std::string("the document") : path_) +
                                        " must be a mapping, got " + kind_name(node_));
    return;
  }
  for (auto it = node_.begin(); it != node_.end(); ++it) {
    const YAML::Node key_node = it->first;
    if (!key_node.IsScalar()) {
      diagnostics_->add(key_node.Mark(), "keys must be plain names");
      continue;
    }
    std::string key = key_node.Scalar();
    const bool duplicate = std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.key == key; });
    if (duplicate) {
      const Entry* first = find(key.c_str());
      const Position p = Diagnostics::to_position(first->key_node.Mark());
      diagnostics_->add(key_node.Mark(), "duplicate key '" + child_path(key.c_str()) + "' (first given at line " +
                                             std::to_string(p.line) + ")");
      continue;
    }
    entries_.push_back({key, key_node, it->second});
  }
}

const MapReader::Entry* MapReader::find(const char* key) {
  for (const Entry& e : entries_)
    if (e.key == key) return &e;
  return nullptr;
}

bool MapReader::has(const char* key) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.key == key && !e.value.IsNull(); });
}

Position MapReader::position_of(const char* key) const {
  for (const Entry& e : entries_)
    if (e.key == key) return Diagnostics::to_position(e.value.Mark());
  return position();
}

template <class T>
bool MapReader::convert(const YAML::Node& value, const std::string& path, T* out) {
  auto wrong_type = [&] {
    diagnostics_->add(value.Mark(), path + ": expected " + type_name<T>() + ", got " +
                                        (value.IsScalar() ? "'" + value.Scalar() + "'" : kind_name(value)));
    return false;
  };
  if constexpr (std::is_same_v<T, std::vector<std::vector<int>>>) {
    // A list whose items are ids or lists of ids: [0, 1] or [[0, 1], [2, 3]] (an id is a list of one).
    if (!value.IsSequence()) return wrong_type();
    T result;
    bool ok = true;
    for (size_t i = 0; i < value.size(); ++i) {
      const std::string item_path = path + "[" + std::to_string(i) + "]";
      std::vector<int> group;
      int id = 0;
      if (value[i].IsSequence() ? convert(value[i], item_path, &group) : (convert(value[i], item_path, &id) && (group = {id}, true))) {
        result.push_back(group);
        (*positions_)[item_path] = Diagnostics::to_position(value[i].Mark());
      } else {
        ok = false;
      }
    }
    if (ok) *out = std::move(result);
    return ok;
  } else if constexpr (std::is_same_v<T, std::vector<int>> || std::is_same_v<T, std::vector<std::string>>) {
    if (!value.IsSequence()) return wrong_type();
    T result;
    bool ok = true;
    for (size_t i = 0; i < value.size(); ++i) {
      typename T::value_type item{};
      const std::string item_path = path + "[" + std::to_string(i) + "]";
      if (convert(value[i], item_path, &item)) {
        result.push_back(item);
        (*positions_)[item_path] = Diagnostics::to_position(value[i].Mark());
      } else {
        ok = false;
      }
    }
    if (ok) *out = std::move(result);
    return ok;
  } else {
    if (!value.IsScalar()) return wrong_type();
    const std::string& s = value.Scalar();
    if constexpr (std::is_same_v<T, bool>) {
      if (!parse_bool(s, out)) return wrong_type();
      return true;
    } else if constexpr (std::is_same_v<T, std::string>) {
      *out = s;
      return true;
    } else if constexpr (std::is_integral_v<T>) {
      // strtoll over the whole scalar: yaml-cpp's as<int> accepts trailing garbage in some versions.
      if (s.empty()) return wrong_type();
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(s.c_str(), &end, 0);
      if (*end != '\0' || errno == ERANGE) return wrong_type();
      if (v < static_cast<long long>(std::numeric_limits<T>::min()) ||
          v > static_cast<long long>(std::numeric_limits<T>::max())) {
        diagnostics_->add(value.Mark(), path + ": " + s + " is out of range");
        return false;
      }
      *out = static_cast<T>(v);
      return true;
    } else {
      if (s.empty()) return wrong_type();
      char* end = nullptr;
      const double v = std::strtod(s.c_str(), &end);
      if (*end != '\0' || !std::isfinite(v)) return wrong_type();
      *out = static_cast<T>(v);
      return true;
    }
  }
}

template <class T>
void MapReader::field(const char* key, T* out, Check<T> check) {
  known_.insert(key);
  const Entry* e = find(key);
  if (!e || e->value.IsNull()) return;
  const std::string path = child_path(key);
  T value = *out;
  if (!convert(e->value, path, &value)) return;
  if (check) {
    const std::string problem = check(value);
    if (!problem.empty()) {
      diagnostics_->add(e->value.Mark(), path + ": " + problem);
      return;
    }
  }
  *out = std::move(value);
  (*positions_)[path] = Diagnostics::to_position(e->value.Mark());
}

template <class T>
void MapReader::field(const char* key, std::optional<T>* out, Check<T> check) {
  known_.insert(key);
  const Entry* e = find(key);
  if (!e || e->value.IsNull()) return;
  T value{};
  field(key, &value, check);
  // field() records a position only when the value was accepted.
  if (positions_->count(child_path(key))) *out = value;
}

template <class T>
void MapReader::required(const char* key, T* out, Check<T> check) {
  known_.insert(key);
  if (!has(key)) {
    diagnostics_->add(position(), child_path(key) + ": required, no default");
    return;
  }
  field(key, out, check);
}

void MapReader::choice(const char* key, std::string* out, const std::vector<std::string>& allowed) {
  field<std::string>(key, out, [&allowed](const std::string& v) -> std::string {
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    return "'" + v + "' is not one of: " + list;
  });
}

MapReader MapReader::map(const char* key) {
  known_.insert(key);
  const Entry* e = find(key);
  if (e) (*positions_)[child_path(key)] = Diagnostics::to_position(e->value.Mark());
  return MapReader(diagnostics_, positions_, e ? e->value : YAML::Node(), child_path(key));
}

void MapReader::done() {
  for (const Entry& e : entries_) {
    if (known_.count(e.key)) continue;
    std::string message = "unknown key '" + child_path(e.key.c_str()) + "'";
    std::string best;
    size_t best_distance = SIZE_MAX;
    for (const std::string& k : known_) {
      const size_t d = edit_distance(e.key, k);
      if (d < best_distance) best_distance = d, best = k;
    }
    if (!best.empty() && best_distance <= std::max<size_t>(2, e.key.size() / 3)) {
      message += "; did you mean '" + best + "'?";
    } else if (!known_.empty()) {
      std::string list;
      for (const auto& k : known_) list += (list.empty() ? "" : ", ") + k;
      message += " (known here: " + list + ")";
    }
    diagnostics_->add(e.key_node.Mark(), message);
  }
}

// The instantiations the schema uses.
template void MapReader::field<bool>(const char*, bool*, Check<bool>);
template void MapReader::field<int>(const char*, int*, Check<int>);
template void MapReader::field<int64_t>(const char*, int64_t*, Check<int64_t>);
template void MapReader::field<double>(const char*, double*, Check<double>);
template void MapReader::field<std::string>(const char*, std::string*, Check<std::string>);
template void MapReader::field<std::vector<int>>(const char*, std::vector<int>*, Check<std::vector<int>>);
template void MapReader::field<std::vector<std::vector<int>>>(const char*, std::vector<std::vector<int>>*,
                                                              Check<std::vector<std::vector<int>>>);
template void MapReader::field<std::vector<std::string>>(const char*, std::vector<std::string>*,
                                                         Check<std::vector<std::string>>);
template void MapReader::field<int>(const char*, std::optional<int>*, Check<int>);
template void MapReader::field<int64_t>(const char*, std::optional<int64_t>*, Check<int64_t>);
template void MapReader::field<double>(const char*, std::optional<double>*, Check<double>);
template void MapReader::required<std::string>(const char*, std::string*, Check<std::string>);

}  // namespace dflash::config
