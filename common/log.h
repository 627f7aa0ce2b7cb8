// log.h: the project's logging facade.
//
// Why a facade: the torch wheel bundles fmt 12 headers and torch headers include them, while
// Debian's spdlog is built against fmt 9; a translation unit that sees both does not compile
// (docs/architecture.md). So spdlog lives only in log.cc, and this header has no fmt and no spdlog: a
// message is formatted here with `{}` placeholders filled through operator<<.
//
// Thread-safety: every function may be called from any thread at any time, including
// reopen() from the signal thread while workers log.
#pragma once

#include <sstream>
#include <string>
#include <string_view>

namespace dflash::log {

enum class Level { trace, debug, info, warn, error, critical, off };

// Parses "trace|debug|info|warn|error|critical|off"; returns false on anything else.
bool parse_level(std::string_view text, Level* out);
std::string_view level_name(Level level);

struct Options {
  Level level = Level::info;
  bool json = false;      // one JSON object per line instead of text
  std::string file;       // empty: standard error (journald under systemd)
};

// Replaces the sinks and the level. Throws std::runtime_error naming the file if it cannot
// be opened; the previous configuration stays in force in that case.
void configure(const Options& options);
// Reopens the log file (after logrotate moved it); a no-op when logging to standard error.
void reopen();
void set_level(Level level);
bool enabled(Level level);
void write(Level level, std::string_view message);
void flush();

namespace detail {
inline void format_into(std::ostringstream& out, std::string_view pattern) { out << pattern; }
template <class First, class... Rest>
void format_into(std::ostringstream& out, std::string_view pattern, const First& first, const Rest&... rest) {
  const size_t at = pattern.find("{}");
  if (at == std::string_view::npos) {
    out << pattern;
    return;
  }
  out << pattern.substr(0, at) << first;
  format_into(out, pattern.substr(at + 2), rest...);
}
}  // namespace detail

// `value` with `digits` digits after the point ("%.*f"): a {} prints a double with the stream's
// default precision, so messages pass numbers they round through this.
std::string fixed(double value, int digits);

// format("loaded {} tensors from {}", n, path): each {} takes the next argument.
template <class... Args>
std::string format(std::string_view pattern, const Args&... args) {
  std::ostringstream out;
  detail::format_into(out, pattern, args...);
  return out.str();
}

template <class... Args>
void log(Level level, std::string_view pattern, const Args&... args) {
  if (enabled(level)) write(level, format(pattern, args...));
}
template <class... Args> void trace(std::string_view p, const Args&... a) { log(Level::trace, p, a...); }
template <class... Args> void debug(std::string_view p, const Args&... a) { log(Level::debug, p, a...); }
template <class... Args> void info(std::string_view p, const Args&... a) { log(Level::info, p, a...); }
template <class... Args> void warn(std::string_view p, const Args&... a) { log(Level::warn, p, a...); }
template <class... Args> void error(std::string_view p, const Args&... a) { log(Level::error, p, a...); }
template <class... Args> void critical(std::string_view p, const Args&... a) { log(Level::critical, p, a...); }

}  // namespace dflash::log
