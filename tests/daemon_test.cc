// End-to-end tests of the real dflashd binary (which loads the CUDA build of libtorch): the
// metrics endpoint works with torch loaded (docs/architecture.md: civetweb's Exposer did not), the
// systemd protocol, signals, exit codes, validate and doctor.
#include <gtest/gtest.h>
#include <httplib.h>

#include "tests/test_util.h"

namespace dflash {
namespace {

const std::string kBinary = test::dflashd_binary(DFLASHD_BINARY);

std::string write_config(const std::string& dir, int port, const std::string& extra = "") {
  const std::string path = dir + "/run.yaml";
  std::ofstream(path) << "target: {preset: tiny-qwen3, weights: random}\ndrafter: {mask_token_id: 500, num_layers: 1}\ntrain: {max_steps: 100000}\n"
                         "data: {synthetic: {sequences: 8}}\n"
                         "gpus: {device: cpu}\n"
                         "run: {output_dir: " << dir << "/out}\n"
                         "metrics: {listen: \"127.0.0.1:" << port << "\", log_every_seconds: 1}\n"
                      << extra;
  return path;
}

// Polls until the endpoint answers (the daemon is starting).
std::shared_ptr<httplib::Response> get_when_up(int port, const std::string& path) {
  httplib::Client client("127.0.0.1", port);
  client.set_connection_timeout(1);
  for (int i = 0; i < 300; ++i) {
    auto response = client.Get(path.c_str());
    if (response) return std::make_shared<httplib::Response>(*response);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return nullptr;
}

TEST(Daemon, ServesMetricsWithTorchLoadedNotifiesSystemdAndStopsOnSigterm) {
  const std::string dir = test::make_temp_dir("daemon");
  const int port = test::free_port();
  const std::string config = write_config(dir, port);
  test::NotifySocket notify;
  test::Process daemon({kBinary, "run", "-c", config},
                       {"NOTIFY_SOCKET=" + notify.path(), "WATCHDOG_USEC=400000"}, dir);

  EXPECT_NE(notify.wait_for("READY=1"), "") << daemon.err();
  auto metrics = get_when_up(port, "/metrics");
  ASSERT_TRUE(metrics) << daemon.err();
  EXPECT_EQ(metrics->status, 200);
  EXPECT_NE(metrics->body.find("dflashd_build_info{"), std::string::npos);
  EXPECT_NE(metrics->body.find("torch_version=\"2.11.0\""), std::string::npos) << metrics->body;
  EXPECT_NE(metrics->body.find("dflashd_state{state=\"running\"} 1"), std::string::npos);
  EXPECT_NE(metrics->body.find("\nprocess_resident_memory_bytes "), std::string::npos);
  auto health = get_when_up(port, "/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200);

  // The watchdog is fed (WATCHDOG_USEC 0.4 s -> a ping every 0.2 s).
  EXPECT_NE(notify.wait_for("WATCHDOG=1"), "");

  daemon.signal(SIGTERM);
  EXPECT_NE(notify.wait_for("STOPPING=1"), "");
  EXPECT_EQ(daemon.wait(), 0) << daemon.err();
  EXPECT_NE(daemon.err().find("SIGTERM: stopping gracefully"), std::string::npos);
  EXPECT_NE(daemon.err().find("stopped cleanly"), std::string::npos);
}

TEST(Daemon, StopsByItselfAfterMaxSecondsAndOnSigint) {
  const std::string dir = test::make_temp_dir("daemon-max");
  const std::string config = write_config(dir, test::free_port(), "run:\n  max_seconds: 1\n");
  // run: given twice is a duplicate key: make sure the file is valid first.
  std::ofstream(config, std::ios::trunc) << "target: {preset: tiny-qwen3, weights: random}\ndrafter: {mask_token_id: 500, num_layers: 1}\ntrain: {max_steps: 100000}\n"
                                            "data: {synthetic: {sequences: 8}}\n"
                                            "gpus: {device: cpu}\n"
                                            "run: {max_seconds: 1, output_dir: " << dir << "/out}\n"
                                            "metrics: {listen: \"\"}\n";
  test::Process daemon({kBinary, "run", "-c", config}, {}, dir);
  EXPECT_EQ(daemon.wait(), 0) << daemon.err();
  EXPECT_NE(daemon.err().find("run.max_seconds (1) reached"), std::string::npos) << daemon.err();
}

TEST(Daemon, PortInUseIsAStartupErrorExit4) {
  const std::string dir = test::make_temp_dir("daemon-port");
  httplib::Server holder;
  const int port = holder.bind_to_any_port("127.0.0.1");
  ASSERT_GT(port, 0);
  test::Process daemon({kBinary, "run", "-c", write_config(dir, port)}, {}, dir);
  EXPECT_EQ(daemon.wait(), 4);
  EXPECT_NE(daemon.err().find("metrics.listen 127.0.0.1:" + std::to_string(port) + ": address already in use"),
            std::string::npos)
      << daemon.err();
}

TEST(Daemon, ValidateListsEveryErrorAndExits3) {
  const std::string dir = test::make_temp_dir("validate");
  const std::string path = dir + "/bad.yaml";
  std::ofstream(path) << "target:\n  path: /m\ndata:\n  paths: [/d]\ntrain:\n  learnig_rate: 1\n  epochs: 0\n"
                         "gpus:\n  target: [0, 0]\n";
  test::Process validate({kBinary, "validate", "-c", path}, {}, dir);
  EXPECT_EQ(validate.wait(), 3);
  const std::string err = validate.err();
  EXPECT_NE(err.find(path + ":6:3: unknown key 'train.learnig_rate'; did you mean 'learning_rate'?"), std::string::npos) << err;
  EXPECT_NE(err.find(path + ":7:11: train.epochs: must be > 0, got 0"), std::string::npos) << err;
  EXPECT_NE(err.find(path + ":9:15: gpus.target: GPU 0 is listed twice in one group"), std::string::npos) << err;
  EXPECT_NE(err.find("3 errors in " + path), std::string::npos) << err;
}

TEST(Daemon, ValidateChecksGpusAgainstTheMachine) {
  const std::string dir = test::make_temp_dir("validate-gpu");
  const std::string path = dir + "/gpu.yaml";
  std::ofstream(path) << "target: {path: /m}\ndata: {paths: [/d]}\ngpus:\n  target: [0]\n  drafter: [97]\n";
  test::Process validate({kBinary, "validate", "-c", path}, {}, dir);
  EXPECT_EQ(validate.wait(), 3);
  EXPECT_NE(validate.err().find(path + ":5:13: gpus.drafter[0]: GPU 97 does not exist"), std::string::npos)
      << validate.err();
}

TEST(Daemon, ValidateAcceptsTheEmbeddedDefault) {
  const std::string dir = test::make_temp_dir("validate-ok");
  test::Process validate({kBinary, "validate", "--default-config"}, {}, dir);
  EXPECT_EQ(validate.wait(), 0) << validate.err();
  EXPECT_NE(validate.out().find("memory plan (GB, estimated)"), std::string::npos) << validate.out();
  EXPECT_NE(validate.out().find("\n<embedded default>: OK\n"), std::string::npos) << validate.out();
}

TEST(Daemon, ConfigDefaultPrintsAConfigThatValidates) {
  const std::string dir = test::make_temp_dir("config-default");
  test::Process print({kBinary, "config", "default"}, {}, dir);
  ASSERT_EQ(print.wait(), 0);
  const std::string path = dir + "/copy.yaml";
  std::ofstream(path) << print.out();
  test::Process validate({kBinary, "validate", "-c", path}, {}, dir + "/..");
  EXPECT_EQ(validate.wait(), 0) << validate.err();
}

TEST(Daemon, DoctorWorksWithoutGpus) {
  const std::string dir = test::make_temp_dir("doctor");
  test::Process doctor({kBinary, "doctor"}, {}, dir);
  EXPECT_EQ(doctor.wait(), 0) << doctor.err();
  const std::string out = doctor.out();
  EXPECT_NE(out.find("torch            2.11.0"), std::string::npos) << out;
  EXPECT_NE(out.find("GPUs             "), std::string::npos);
  EXPECT_NE(out.find("SDPA backend     "), std::string::npos);
}

// On a Hopper GPU (compute capability 9.0) every kernel self-test of `dflashd doctor` passes: the
// GatedDeltaNet kernels, the FP8 GEMM and the FP8 grouped GEMM of MoE experts. Elsewhere skipped.
TEST(Daemon, GpuDoctorSelfTestsPassOnHopper) {
  const std::string dir = test::make_temp_dir("doctor-gpu");
  test::Process doctor({kBinary, "doctor"}, {}, dir);
  ASSERT_EQ(doctor.wait(), 0) << doctor.err();
  const std::string out = doctor.out();
  const size_t gpu = out.find("  cuda:0  ");
  if (gpu == std::string::npos || out.find(" sm_90 ", gpu) == std::string::npos) {
    GTEST_SKIP() << "no Hopper GPU as cuda:0";
  }
  for (const char* line : {"GatedDeltaNet: ok", "FP8 GEMM: ok", "FP8 grouped GEMM (MoE experts): ok"}) {
    EXPECT_NE(out.find(line, gpu), std::string::npos) << line << " missing:\n" << out;
  }
}

TEST(Daemon, UsageErrorsExit2WithHelp) {
  const std::string dir = test::make_temp_dir("usage");
  test::Process none({kBinary}, {}, dir);
  EXPECT_EQ(none.wait(), 2);
  test::Process unknown({kBinary, "frobnicate"}, {}, dir);
  EXPECT_EQ(unknown.wait(), 2);
  EXPECT_NE(unknown.err().find("unknown command 'frobnicate'"), std::string::npos);
  test::Process both({kBinary, "run", "-c", "x.yaml", "--default-config"}, {}, dir);
  EXPECT_EQ(both.wait(), 2);
  test::Process help({kBinary, "run", "--help"}, {}, dir);
  EXPECT_EQ(help.wait(), 0);
  EXPECT_NE(help.out().find("Usage: dflashd run"), std::string::npos);
}

}  // namespace
}  // namespace dflash
