// process_metrics.h: the standard process_* metrics (CPU seconds, memory, open files, threads,
// start time), read from /proc at scrape time, plus dflashd_build_info.
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/metric_family.h>

#include <map>
#include <string>

namespace dflash::daemon {

class ProcessCollector : public prometheus::Collectable {
 public:
  std::vector<prometheus::MetricFamily> Collect() const override;
};

// A gauge fixed at 1 whose labels carry the build facts (version, torch, CUDA, ...).
class BuildInfoCollector : public prometheus::Collectable {
 public:
  explicit BuildInfoCollector(std::map<std::string, std::string> labels) : labels_(std::move(labels)) {}
  std::vector<prometheus::MetricFamily> Collect() const override;

 private:
  std::map<std::string, std::string> labels_;
};

}  // namespace dflash::daemon
