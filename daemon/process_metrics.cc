#include "daemon/process_metrics.h"

#include <dirent.h>
#include <sys/resource.h>
#include <unistd.h>

#include <fstream>
#include <sstream>

namespace dflash::daemon {
namespace {

prometheus::MetricFamily gauge_family(const std::string& name, const std::string& help, double value,
                                      prometheus::MetricType type = prometheus::MetricType::Gauge) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(metric);
  return family;
}

// /proc/self/stat fields after the command name (which may contain spaces and parentheses).
std::vector<std::string> stat_fields() {
  std::ifstream in("/proc/self/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t close = text.rfind(')');
  std::vector<std::string> fields;
  if (close == std::string::npos) return fields;
  std::istringstream rest(text.substr(close + 2));
  for (std::string f; rest >> f;) fields.push_back(f);
  return fields;  // fields[0] is field 3 (state)
}

double boot_time_seconds() {
  std::ifstream in("/proc/stat");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("btime ", 0) == 0) return std::stod(line.substr(6));
  }
  return 0;
}

}  // namespace

std::vector<prometheus::MetricFamily> ProcessCollector::Collect() const {
  std::vector<prometheus::MetricFamily> out;
  const std::vector<std::string> f = stat_fields();
  const double ticks = static_cast<double>(sysconf(_SC_CLK_TCK));
  const double page = static_cast<double>(sysconf(_SC_PAGESIZE));
  if (f.size() > 21) {
    // man 5 proc: utime 14, stime 15, num_threads 20, starttime 22, vsize 23, rss 24 (1-based)
    const double cpu = (std::stod(f[11]) + std::stod(f[12])) / ticks;
    out.push_back(gauge_family("process_cpu_seconds_total", "Total user and system CPU time spent in seconds.",
                               cpu, prometheus::MetricType::Counter));
    out.push_back(gauge_family("process_threads", "Number of OS threads in the process.", std::stod(f[17])));
    out.push_back(gauge_family("process_start_time_seconds", "Start time of the process since unix epoch in seconds.",
                               boot_time_seconds() + std::stod(f[19]) / ticks));
    out.push_back(gauge_family("process_virtual_memory_bytes", "Virtual memory size in bytes.", std::stod(f[20])));
    out.push_back(
        gauge_family("process_resident_memory_bytes", "Resident memory size in bytes.", std::stod(f[21]) * page));
  }
  int open_fds = 0;
  if (DIR* dir = opendir("/proc/self/fd")) {
    while (readdir(dir)) ++open_fds;
    closedir(dir);
    open_fds -= 3;  // ".", ".." and the directory's own descriptor
  }
  out.push_back(gauge_family("process_open_fds", "Number of open file descriptors.", open_fds));
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0) {
    out.push_back(gauge_family("process_max_fds", "Maximum number of open file descriptors.",
                               static_cast<double>(limit.rlim_cur)));
  }
  return out;
}

std::vector<prometheus::MetricFamily> BuildInfoCollector::Collect() const {
  prometheus::MetricFamily family = gauge_family(
      "dflashd_build_info", "Build facts of this dflashd binary as labels; the value is always 1.", 1);
  for (const auto& [name, value] : labels_) family.metric[0].label.push_back({name, value});
  return {family};
}

}  // namespace dflash::daemon
