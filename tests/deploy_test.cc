// deploy/: the systemd unit verifies, the alert rules check and pass their unit tests, the
// example configs validate, and every metric the dashboard and the rules use is one the daemon
// exports (checked against a live scrape of a training run).
#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <regex>
#include <set>

#include "tests/test_util.h"

namespace dflash {
namespace {

const std::string kBinary = std::getenv("DFLASHD_BINARY") ? std::getenv("DFLASHD_BINARY") : DFLASHD_BINARY;
const std::string kDeploy = DFLASHD_DEPLOY_DIR;

int run_command(const std::string& command, std::string* output) {
  const std::string dir = test::make_temp_dir("cmd");
  const int status = std::system((command + " > " + dir + "/out 2>&1").c_str());
  *output = test::read_file(dir + "/out");
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

TEST(Deploy, SystemdUnitVerifies) {
  const std::string dir = test::make_temp_dir("unit");
  ::mkdir((dir + "/bin").c_str(), 0755);
  ASSERT_EQ(::symlink(kBinary.c_str(), (dir + "/bin/dflashd").c_str()), 0);
  std::string unit = test::read_file(kDeploy + "/systemd/dflashd@.service");
  for (size_t at; (at = unit.find("/opt/dflashd")) != std::string::npos;) unit.replace(at, 12, dir);
  std::ofstream(dir + "/dflashd@ci.service") << unit;
  std::string output;
  EXPECT_EQ(run_command("systemd-analyze verify --man=no " + dir + "/dflashd@ci.service", &output), 0) << output;
  EXPECT_EQ(output, "") << "systemd-analyze warns";
  EXPECT_NE(unit.find("Type=notify"), std::string::npos);
  EXPECT_NE(unit.find("WatchdogSec="), std::string::npos);
}

TEST(Deploy, AlertRulesCheckAndPassTheirUnitTests) {
  std::string output;
  EXPECT_EQ(run_command("promtool check rules " + kDeploy + "/prometheus/dflashd-alerts.yml", &output), 0) << output;
  EXPECT_EQ(run_command("cd " + kDeploy + "/prometheus && promtool test rules dflashd-alerts.test.yml", &output), 0)
      << output;
  EXPECT_EQ(run_command("promtool check config " + kDeploy + "/prometheus/prometheus.yml", &output), 0) << output;
}

TEST(Deploy, DashboardIsValidJsonWithAQueryPerPanel) {
  const nlohmann::json dashboard = nlohmann::json::parse(test::read_file(kDeploy + "/grafana/dflashd.json"));
  ASSERT_TRUE(dashboard.contains("panels"));
  EXPECT_GE(dashboard["panels"].size(), 15u);
  std::set<std::string> titles;
  for (const auto& panel : dashboard["panels"]) {
    EXPECT_TRUE(titles.insert(panel.at("title").get<std::string>()).second) << "duplicate panel title";
    ASSERT_FALSE(panel.at("targets").empty());
    EXPECT_FALSE(panel["targets"][0].at("expr").get<std::string>().empty());
  }
  for (const char* wanted : {"Tokens per second", "ETA", "MFU", "Loss", "Expected acceptance length (tau)",
                             "Queue depth / capacity", "Workers stalled", "GPU memory", "Checkpoint age"}) {
    EXPECT_TRUE(titles.count(wanted)) << wanted;
  }
}

TEST(Deploy, ExampleConfigsValidate) {
  for (const char* name : {"qwen3-8b-8gpu.yaml", "qwen35-27b-8gpu.yaml", "single-gpu-debug.yaml", "qwen35-27b-multi-node.yaml"}) {
    std::string output;
    EXPECT_EQ(run_command(kBinary + " validate --offline -c " + kDeploy + "/examples/" + name, &output), 0)
        << name << "\n" << output;
  }
}

std::set<std::string> metric_names(const std::string& text) {
  static const std::regex name(R"(\b((?:dflashd|process)_[a-z_]+)\b)");
  std::set<std::string> out;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), name); it != std::sregex_iterator(); ++it) {
    out.insert((*it)[1]);
  }
  return out;
}

TEST(Deploy, DashboardAndRulesUseOnlyExportedMetrics) {
  const int port = test::free_port();
  const std::string dir = test::make_temp_dir("scrape-names");
  std::ofstream(dir + "/run.yaml") << "run: {output_dir: " << dir << "/out}\n"
                                   << "target: {preset: tiny-qwen3_5, weights: random, dtype: float32}\n"
                                   << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
                                   << "gpus: {device: cpu}\ndata: {synthetic: {sequences: 32}}\n"
                                   << "train: {max_steps: 100000}\ncheckpoint: {every_steps: 2}\n"
                                   << "metrics: {listen: \"127.0.0.1:" << port << "\"}\n";
  test::Process p({kBinary, "run", "-c", dir + "/run.yaml"}, {}, dir);
  httplib::Client client("127.0.0.1", port);
  std::set<std::string> exported;
  for (int i = 0; i < 300; ++i) {
    auto response = client.Get("/metrics");
    if (response && response->body.find("dflashd_checkpoint_last_success_timestamp_seconds 0") == std::string::npos &&
        response->body.find("dflashd_checkpoint_last_success_timestamp_seconds ") != std::string::npos) {
      for (std::string line; const char c : response->body) {
        if (c != '\n') {
          line += c;
          continue;
        }
        if (line.rfind("# TYPE ", 0) == 0) exported.insert(line.substr(7, line.find(' ', 7) - 7));
        line.clear();
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
  ASSERT_FALSE(exported.empty()) << p.err();
  // Exported only where there are GPUs: not in a CPU run.
  const std::set<std::string> gpu_only{"dflashd_gpu_memory_bytes", "dflashd_gpu_allocator_retries_total"};
  for (const char* file : {"/grafana/dflashd.json", "/prometheus/dflashd-alerts.yml"}) {
    const std::set<std::string> used = metric_names(test::read_file(kDeploy + file));
    EXPECT_GT(used.size(), 5u) << file;
    for (const std::string& name : used) {
      if (gpu_only.count(name)) continue;
      EXPECT_TRUE(exported.count(name)) << file << " uses " << name << ", which the daemon does not export";
    }
  }
}

}  // namespace
}  // namespace dflash
