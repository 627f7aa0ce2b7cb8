// log.cc: the only translation unit that includes spdlog (see log.h for why).
#include "common/log.h"

#include <spdlog/sinks/basic_file_sink.h>
#include <spdlog/sinks/stdout_sinks.h>
#include <spdlog/spdlog.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <memory>
#include <mutex>
#include <stdexcept>

#include "common/json_escape.h"

namespace dflash::log {
namespace {

struct State {
  std::mutex mutex;  // guards logger and options; writers copy the shared_ptr under it
  std::shared_ptr<spdlog::logger> logger;
  Options options;
  std::atomic<int> level{static_cast<int>(Level::info)};
};

State& state() {
  static State s;
  return s;
}

spdlog::level::level_enum to_spdlog(Level level) {
  switch (level) {
    case Level::trace: return spdlog::level::trace;
    case Level::debug: return spdlog::level::debug;
    case Level::info: return spdlog::level::info;
    case Level::warn: return spdlog::level::warn;
    case Level::error: return spdlog::level::err;
    case Level::critical: return spdlog::level::critical;
    case Level::off: return spdlog::level::off;
  }
  return spdlog::level::info;
}

std::shared_ptr<spdlog::logger> make_logger(const Options& options) {
  spdlog::sink_ptr sink;
  if (options.file.empty()) {
    sink = std::make_shared<spdlog::sinks::stderr_sink_mt>();
  } else {
    try {
      sink = std::make_shared<spdlog::sinks::basic_file_sink_mt>(options.file, /*truncate=*/false);
    } catch (const spdlog::spdlog_ex& e) {
      throw std::runtime_error("logging.file " + options.file + ": cannot open: " + e.what());
    }
  }
  auto logger = std::make_shared<spdlog::logger>("dflashd", sink);
  // JSON lines: the message arrives already escaped as a JSON string (write() does that), so the
  // pattern only has to wrap it. Thread id is the kernel tid, which joins with top/perf output.
  if (options.json) {
    logger->set_pattern(R"({"time":"%Y-%m-%dT%H:%M:%S.%f%z","level":"%l","thread":%t,"message":%v})");
  } else {
    logger->set_pattern("%Y-%m-%dT%H:%M:%S.%e%z %-5l [%t] %v");
  }
  logger->set_level(spdlog::level::trace);  // filtering happens in enabled()
  logger->flush_on(spdlog::level::warn);
  return logger;
}

std::shared_ptr<spdlog::logger> current() {
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (!s.logger) s.logger = make_logger(s.options);
  return s.logger;
}

}  // namespace

bool parse_level(std::string_view text, Level* out) {
  static constexpr std::pair<std::string_view, Level> kLevels[] = {
      {"trace", Level::trace}, {"debug", Level::debug}, {"info", Level::info},
      {"warn", Level::warn},   {"error", Level::error}, {"critical", Level::critical},
      {"off", Level::off}};
  for (const auto& [name, level] : kLevels) {
    if (text == name) {
      *out = level;
      return true;
    }
  }
  return false;
}

std::string_view level_name(Level level) {
  switch (level) {
    case Level::trace: return "trace";
    case Level::debug: return "debug";
    case Level::info: return "info";
    case Level::warn: return "warn";
    case Level::error: return "error";
    case Level::critical: return "critical";
    case Level::off: return "off";
  }
  return "info";
}

void configure(const Options& options) {
  auto logger = make_logger(options);  // may throw: keep the old configuration then
  State& s = state();
  std::lock_guard lock(s.mutex);
  if (s.logger) s.logger->flush();
  s.logger = std::move(logger);
  // A file is flushed by spdlog's periodic flusher every second (warnings and above at once):
  // a SIGKILL or a crash loses at most the last second of the run's log. The flusher walks the
  // registered loggers, so this one replaces the previous configuration's there.
  spdlog::drop("dflashd");
  if (!options.file.empty()) {
    spdlog::register_logger(s.logger);
    spdlog::flush_every(std::chrono::seconds(1));
  }
  s.options = options;
  s.level.store(static_cast<int>(options.level));
}

void reopen() {
  State& s = state();
  Options options;
  {
    std::lock_guard lock(s.mutex);
    options = s.options;
  }
  if (options.file.empty()) return;
  configure(options);
}

void set_level(Level level) { state().level.store(static_cast<int>(level)); }

bool enabled(Level level) {
  return level != Level::off && static_cast<int>(level) >= state().level.load(std::memory_order_relaxed);
}

void write(Level level, std::string_view message) {
  auto logger = current();
  bool json;
  {
    std::lock_guard lock(state().mutex);
    json = state().options.json;
  }
  if (json) {
    logger->log(to_spdlog(level), "{}", json_quote(message));
  } else {
    logger->log(to_spdlog(level), "{}", message);
  }
}

void flush() { current()->flush(); }

std::string fixed(double value, int digits) {
  char buffer[64];
  std::snprintf(buffer, sizeof(buffer), "%.*f", digits, value);
  return buffer;
}

}  // namespace dflash::log
