// Operations that tell the truth: the daemon as a new user runs it, when things go wrong.
// Each test starts the real program (`dflashd`, or `dflashd_faulty`: the same program with
// test hooks read from its environment, tests/faulty_daemon_hooks.cc) on tiny CPU runs, plus
// unit tests of the pieces behind it (role balance, failed samples, drafter shape rules).
#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <string>
#include <thread>

#include "common/safetensors.h"
#include "drafter/drafter_config.h"
#include "pipeline/dataset.h"
#include "pipeline/failed_samples.h"
#include "pipeline/gpu_memory.h"
#include "pipeline/memory_plan.h"
#include "pipeline/role_balance.h"
#include "target/decode_plan.h"
#include "target/model_config.h"
#include "tests/run_dir.h"
#include "tests/test_util.h"

#ifdef DFLASHD_WITH_CUDA
#include "target/kernels/grouped_fp8.h"
#endif

namespace dflash::pipeline {
namespace {

using test::drafter_checkpoints;
using test::exists;
using test::make_run;
using test::RunDir;

const std::string kBinary = test::dflashd_binary(DFLASHD_BINARY);
const std::string kFaulty = DFLASHD_FAULTY_BINARY;

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The value of one sample line of a Prometheus text page ("name{labels} value"); NaN if absent.
double metric(const std::string& page, const std::string& series) {
  const size_t at = page.find("\n" + series + " ");
  if (at == std::string::npos) return std::nan("");
  return std::stod(page.substr(at + series.size() + 2));
}

// ---- item 2: which role limits throughput -----------------------------------------------------

TEST(RoleBalance, NamesTheBusierRoleOverTheWindowAndSuggestsTheBalancingSplit) {
  RoleBalance b(4, 4, 10.0);
  EXPECT_FALSE(b.advice().known);
  // The first 100 s: the drafter is the busy role (cumulative totals would remember this).
  b.observe(0, 0, 0);
  b.observe(100, 40, 390);
  auto a = b.advice();
  ASSERT_TRUE(a.known);
  EXPECT_EQ(a.bottleneck, "drafter");
  EXPECT_LT(a.suggested_target_gpus, 4);
  // Then the target: 4 target GPUs fully busy (4 GPU-seconds per second), the drafters 0.4.
  for (int t = 101; t <= 130; ++t) b.observe(t, 40 + 4.0 * (t - 100), 390 + 0.4 * (t - 100));
  a = b.advice();
  EXPECT_EQ(a.bottleneck, "target");
  EXPECT_NEAR(a.target_busy_ratio, 1.0, 1e-9);
  EXPECT_NEAR(a.drafter_busy_ratio, 0.1, 1e-9);
  EXPECT_EQ(a.suggested_target_gpus, 7);  // 8 x 4 / 4.4 = 7.3
  // One GPU in each group: the only split is 1 + 1.
  RoleBalance one(1, 1, 5.0);
  one.observe(0, 0, 0);
  one.observe(5, 5, 0.2);
  EXPECT_EQ(one.advice().bottleneck, "target");
  EXPECT_EQ(one.advice().suggested_target_gpus, 1);
}

// A run with one role slowed down on purpose: the metrics name that role and suggest moving GPUs
// towards it. n target + n drafter replicas on the CPU (ids are replica numbers there).
void expect_bottleneck(int n, const std::string& slow_role) {
  const int port = test::free_port();
  std::string ids = "[";
  for (int i = 0; i < n; ++i) ids += (i ? ", " : "") + std::to_string(i);
  ids += "]";
  const RunDir r = make_run("balance-" + slow_role + std::to_string(n),
                            "train: {max_steps: 100000}\ncheckpoint: {every_steps: 100000}\n");
  test::set_section(r, "gpus", "gpus: {device: cpu, target: " + ids + ", drafter: " + ids + "}");
  test::set_section(r, "metrics", "metrics: {listen: \"127.0.0.1:" + std::to_string(port) +
                                      "\", log_every_seconds: 1, throughput_window_seconds: 3}");
  test::Process p({kFaulty, "run", "-c", r.config},
                  {"DFLASHD_TEST_SLOW=" + slow_role + ":400"}, r.dir);
  httplib::Client client("127.0.0.1", port);
  std::string page;
  Clock::time_point first_step{};
  bool stepping = false;
  for (int i = 0; i < 400; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    auto response = client.Get("/metrics");
    if (!response) continue;
    page = response->body;
    const double steps = metric(page, "dflashd_optimizer_steps_total");
    if (!stepping && steps >= 1) stepping = true, first_step = Clock::now();
    if (stepping && seconds_since(first_step) > 5 && metric(page, "dflashd_busy_ratio{role=\"target\"}") > 0) break;
  }
  const double target_busy = metric(page, "dflashd_busy_ratio{role=\"target\"}");
  const double drafter_busy = metric(page, "dflashd_busy_ratio{role=\"drafter\"}");
  const double suggested = metric(page, "dflashd_suggested_target_gpus");
  const std::string other = slow_role == "target" ? "drafter" : "target";
  EXPECT_EQ(metric(page, "dflashd_bottleneck{stage=\"" + slow_role + "\"}"), 1) << page;
  EXPECT_EQ(metric(page, "dflashd_bottleneck{stage=\"" + other + "\"}"), 0) << page;
  if (slow_role == "target") {
    EXPECT_GT(target_busy, 0.7) << page;
    EXPECT_GT(target_busy, drafter_busy) << page;
    // More GPUs to the target (the exact split depends on how busy this machine's cores are).
    if (n == 1) EXPECT_EQ(suggested, 1) << page;
    else EXPECT_GT(suggested, n) << page;
  } else {
    EXPECT_GT(drafter_busy, 0.7) << page;
    EXPECT_GT(drafter_busy, target_busy) << page;
    if (n == 1) EXPECT_EQ(suggested, 1) << page;
    else EXPECT_LT(suggested, n) << page;  // more GPUs to the drafter
  }
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
}

TEST(Bottleneck, SlowTargetOneAndOne) { expect_bottleneck(1, "target"); }
TEST(Bottleneck, SlowDrafterOneAndOne) { expect_bottleneck(1, "drafter"); }
TEST(Bottleneck, SlowTargetTwoAndTwo) { expect_bottleneck(2, "target"); }
TEST(Bottleneck, SlowDrafterTwoAndTwo) { expect_bottleneck(2, "drafter"); }
TEST(Bottleneck, SlowTargetFourAndFour) { expect_bottleneck(4, "target"); }
TEST(Bottleneck, SlowDrafterFourAndFour) { expect_bottleneck(4, "drafter"); }

// ---- item 3: a replica that fails or hangs stops every process ---------------------------------

// Two drafter replicas, data parallel, fed by one target.
RunDir two_drafter_run(const std::string& tag, const std::string& extra = "") {
  const RunDir r = make_run(tag, "train: {max_steps: 100000}\ncheckpoint: {every_steps: 100000}\n" + extra);
  test::set_section(r, "gpus", "gpus: {device: cpu, target: [0], drafter: [0, 1]}");
  return r;
}

TEST(ReplicaFailure, AFailingReplicaStopsTheOthersWithACheckpoint) {
  const RunDir r = two_drafter_run("replica-fails");
  const auto start = Clock::now();
  test::Process p({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_FAULT=drafter:1:3"}, r.dir);
  EXPECT_EQ(p.wait(120000), 1) << p.err();
  EXPECT_LT(seconds_since(start), 60);
  EXPECT_NE(p.err().find("drafter-1 failed on step 3: injected fault"), std::string::npos) << p.err();
  EXPECT_TRUE(exists(r.dir + "/out/checkpoints/step-000000000003/COMMIT")) << p.err();
}

TEST(ReplicaFailure, AHungReplicaIsStalledAndTheProcessExitsWithACheckpoint) {
  const RunDir r = two_drafter_run("replica-hangs", "workers: {stall_seconds: 2}\n");
  test::Process p({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_HANG=drafter:1:3"}, r.dir);
  // Stalled after 2 s without a heartbeat, then 2 s for the other workers to leave.
  std::string log;
  for (int i = 0; i < 600 && log.find("stalled") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    log = p.err();
  }
  const auto stalled = Clock::now();
  EXPECT_EQ(p.wait(60000), 1) << p.err();
  EXPECT_LT(seconds_since(stalled), 2 + 2 + 5) << "exits within workers.stall_seconds of the stall";
  EXPECT_NE(p.err().find("stalled: no heartbeat for"), std::string::npos) << p.err();
  EXPECT_NE(p.err().find("did not stop within 2 s"), std::string::npos) << p.err();
  EXPECT_TRUE(exists(r.dir + "/out/checkpoints/step-000000000003/COMMIT")) << p.err();
}

// ---- item 4: a sample that fails every time cannot crash-loop the run --------------------------

TEST(FailedSamples, CountsFailuresAndSkipsAtTheLimit) {
  FailedSamples f(2);
  EXPECT_TRUE(f.record({7, 9}).empty());
  EXPECT_FALSE(f.skipped(7));
  EXPECT_EQ(f.record({7}), (std::vector<int64_t>{7}));
  EXPECT_TRUE(f.skipped(7));
  EXPECT_FALSE(f.skipped(9));
  EXPECT_TRUE(f.record({7}).empty()) << "reported once";
  FailedSamples restored(2);
  restored.restore(f.counts());
  EXPECT_TRUE(restored.skipped(7));
  EXPECT_EQ(restored.skipped_count(), 1);
  FailedSamples never(0);
  never.record({1});
  never.record({1});
  EXPECT_FALSE(never.skipped(1));
}

TEST(CrashLoop, ASampleThatFailsAfterEveryRestartIsSkippedAndNamed) {
  // workers.on_failure: stop, as under systemd's Restart=on-failure: each failure ends the
  // process; the second time the same sample fails it is skipped and the run finishes.
  const RunDir r = make_run("crash-loop", "train: {max_steps: 10}\ncheckpoint: {every_steps: 100000}\n");
  test::Process first({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_FAULT=target:5:always"}, r.dir);
  ASSERT_EQ(first.wait(120000), 1) << first.err();
  EXPECT_NE(first.err().find("target-0 failed on sample 5"), std::string::npos) << first.err();
  const auto checkpoints = drafter_checkpoints(r);
  ASSERT_EQ(checkpoints.size(), 1u) << first.err();
  const auto state = nlohmann::json::parse(test::read_file(r.dir + "/out/checkpoints/" + checkpoints[0] + "/state.json"));
  ASSERT_EQ(state["trainer"]["sample_failures"].size(), 1u) << state.dump();
  EXPECT_EQ(state["trainer"]["sample_failures"].begin().value(), 1);

  test::Process second({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_FAULT=target:5:always"}, r.dir);
  ASSERT_EQ(second.wait(120000), 0) << second.err();
  const std::string log = second.err();
  EXPECT_TRUE(std::regex_search(log, std::regex("skipping sample [0-9]+ \\(synthetic sample [0-9]+\\) from now on: it "
                                                "failed 2 times"))) << log;
  EXPECT_NE(log.find("none of its samples has a block to train"), std::string::npos) << log;
  EXPECT_NE(log.find("run finished at step 10"), std::string::npos) << log;
}

TEST(CrashLoop, WithRestartsTheSampleIsSkippedInOneProcess) {
  const RunDir r = make_run("crash-restart", "train: {max_steps: 10}\n"
                                             "workers: {on_failure: restart, max_restarts: 5, skip_sample_after_failures: 3}\n");
  test::Process p({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_FAULT=target:5:always"}, r.dir);
  ASSERT_EQ(p.wait(120000), 0) << p.err();
  EXPECT_NE(p.err().find("retrying (2 of 5)"), std::string::npos) << p.err();
  EXPECT_EQ(p.err().find("retrying (3 of 5)"), std::string::npos) << "skipped at the third failure: " << p.err();
  EXPECT_NE(p.err().find("it failed 3 times"), std::string::npos) << p.err();
}

// ---- item 9: samples without an anchor ---------------------------------------------------------

TEST(NoAnchor, AlternatingMasksAreSkippedAndCountedAtIndexing) {
  const std::string dir = test::make_temp_dir("no-anchor");
  std::ofstream(dir + "/alternating.jsonl") << R"({"input_ids": [1, 2, 3, 4, 5, 6], "loss_mask": [0, 1, 0, 1, 0, 1]})" << "\n";
  // Alone: no usable sample, said at start (it failed the run on step 0 before).
  const RunDir alone = make_run("no-anchor-alone", "train: {max_steps: 2}\n");
  std::string text = test::read_file(alone.config);
  text.replace(text.find("data: {synthetic: {sequences: 64, min_length: 24, max_length: 48}}"), 66,
               "data: {paths: [" + dir + "/alternating.jsonl]}");
  std::ofstream(alone.config) << text;
  test::Process p({kBinary, "run", "-c", alone.config}, {}, alone.dir);
  EXPECT_EQ(p.wait(60000), 4) << p.err();
  EXPECT_NE(p.err().find("1 without two adjacent supervised tokens"), std::string::npos) << p.err();
  // With usable samples beside it: skipped, counted, and the run trains.
  std::ofstream(dir + "/alternating.jsonl", std::ios::app)
      << R"({"input_ids": [1, 2, 3, 4, 5, 6, 7, 8], "loss_mask": [0, 1, 1, 1, 1, 1, 1, 1]})" << "\n"
      << R"({"input_ids": [9, 8, 7, 6, 5, 4, 3], "loss_mask": [0, 0, 1, 1, 1, 1, 1]})" << "\n";
  config::DataConfig c;
  c.paths = {dir + "/alternating.jsonl"};
  auto data = Dataset::open(c, 100);
  EXPECT_EQ(data->size(), 2);
  EXPECT_EQ(data->skipped_no_anchor(), 1);
  test::Process q({kBinary, "run", "-c", alone.config}, {}, alone.dir);
  EXPECT_EQ(q.wait(60000), 0) << q.err();
  EXPECT_NE(q.err().find("1 without two adjacent supervised tokens (no anchor)"), std::string::npos) << q.err();
}

// ---- item 11: the log file is flushed while the run goes on ------------------------------------

TEST(LogFile, InfoLinesReachTheFileWithinASecondAndSurviveSigkill) {
  const RunDir r = make_run("log-file", "train: {max_steps: 100000}\n");
  std::ofstream(r.config, std::ios::app) << "logging: {file: " << r.dir << "/dflashd.log}\n";
  test::NotifySocket notify;
  test::Process p({kBinary, "run", "-c", r.config}, {"NOTIFY_SOCKET=" + notify.path()}, r.dir);
  ASSERT_NE(notify.wait_for("READY=1", 60000), "");
  std::this_thread::sleep_for(std::chrono::milliseconds(2500));
  const std::string before_kill = test::read_file(r.dir + "/dflashd.log");
  p.signal(SIGKILL);
  p.wait();
  EXPECT_NE(before_kill.find("starting run"), std::string::npos) << before_kill;
  EXPECT_NE(before_kill.find(" info  "), std::string::npos) << before_kill;
  EXPECT_NE(before_kill.find("tok/s"), std::string::npos) << "a headline line of the running run: " << before_kill;
}

// ---- item 12: healthy again after a successful restart -----------------------------------------

TEST(Health, HealthyAgainOnceARestartedWorkerDoesItsWork) {
  const int port = test::free_port();
  const RunDir r = make_run("healthy-again", "train: {max_steps: 100000}\ncheckpoint: {every_steps: 100000}\n"
                                             "workers: {on_failure: restart, max_restarts: 2}\n", port);
  test::Process p({kFaulty, "run", "-c", r.config}, {"DFLASHD_TEST_FAULT=target:5"}, r.dir);
  httplib::Client client("127.0.0.1", port);
  for (int i = 0; i < 600 && p.err().find("recovered") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_NE(p.err().find("target-0 recovered: sample 5 done after a restart"), std::string::npos) << p.err();
  auto health = client.Get("/healthz");
  ASSERT_TRUE(health);
  EXPECT_EQ(health->status, 200) << health->body;
  auto page = client.Get("/metrics");
  ASSERT_TRUE(page);
  EXPECT_EQ(metric(page->body, "dflashd_worker_restarts_total{worker=\"target-0\"}"), 1) << page->body;
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
}

// ---- item 1: drafter.init ----------------------------------------------------------------------

TEST(DrafterInit, TrainingContinuesFromAnExportedDrafterOrACheckpoint) {
  const RunDir a = make_run("init-source", "train: {max_steps: 4}\ncheckpoint: {every_steps: 2}\n");
  test::Process pa({kBinary, "run", "-c", a.config}, {}, a.dir);
  ASSERT_EQ(pa.wait(120000), 0) << pa.err();
  const std::string exported = a.dir + "/out/export/final";
  // One step at a learning rate far below bf16's resolution: the weights stay those loaded, so
  // the new run's export is the old one's, byte for byte (a random start would differ entirely).
  const RunDir b = make_run("init-export", "train: {max_steps: 1, learning_rate: 1.0e-12}\n");
  std::string text = test::read_file(b.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {init: " + exported + ", ");
  std::ofstream(b.config) << text;
  test::Process pb({kBinary, "run", "-c", b.config}, {}, b.dir);
  ASSERT_EQ(pb.wait(120000), 0) << pb.err();
  EXPECT_NE(pb.err().find("drafter initialised from " + exported), std::string::npos) << pb.err();
  EXPECT_EQ(test::read_file(b.dir + "/out/export/final/model.safetensors"), test::read_file(exported + "/model.safetensors"));
  // A checkpoint directory works the same way.
  const RunDir c = make_run("init-checkpoint", "train: {max_steps: 1, learning_rate: 1.0e-12}\n");
  text = test::read_file(c.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {init: " + a.dir + "/out/checkpoints/step-000000000004, ");
  std::ofstream(c.config) << text;
  test::Process pc({kBinary, "run", "-c", c.config}, {}, c.dir);
  ASSERT_EQ(pc.wait(120000), 0) << pc.err();
  EXPECT_EQ(test::read_file(c.dir + "/out/export/final/model.safetensors"), test::read_file(exported + "/model.safetensors"));
  // Another shape: a startup error naming the file and what differs.
  const RunDir d = make_run("init-mismatch");
  text = test::read_file(d.config);
  text.replace(text.find("drafter: {num_layers: 1"), 23, "drafter: {init: " + exported + ", num_layers: 2");
  std::ofstream(d.config) << text;
  test::Process pd({kBinary, "run", "-c", d.config}, {}, d.dir);
  EXPECT_EQ(pd.wait(60000), 4) << pd.err();
  EXPECT_NE(pd.err().find(exported + "/config.json: this drafter does not fit the configured one"), std::string::npos)
      << pd.err();
  EXPECT_NE(pd.err().find("num_hidden_layers 1 there, 2 configured"), std::string::npos) << pd.err();
  // Not a drafter at all.
  const RunDir e = make_run("init-missing");
  text = test::read_file(e.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {init: " + e.dir + "/nothing, ");
  std::ofstream(e.config) << text;
  test::Process pe({kBinary, "run", "-c", e.config}, {}, e.dir);
  EXPECT_EQ(pe.wait(60000), 4) << pe.err();
  EXPECT_NE(pe.err().find(e.dir + "/nothing/config.json: cannot read"), std::string::npos) << pe.err();
}

// ---- item 5: kernel choices are config options -------------------------------------------------

TEST(AttentionChoice, IsAConfigOptionShownInTheLogAndMetrics) {
  const int port = test::free_port();
  // With the drafter's activations checkpointed (train.activation_checkpointing), reported the same way.
  const RunDir r = make_run("attention-math", "train: {max_steps: 100000, activation_checkpointing: true}\n", port);
  std::string text = test::read_file(r.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {attention: math, ");
  std::ofstream(r.config) << text;
  test::Process p({kBinary, "run", "-c", r.config}, {}, r.dir);
  httplib::Client client("127.0.0.1", port);
  std::string body;
  for (int i = 0; i < 300 && body.find("dflashd_kernel_path{component=\"drafter.attention\"") == std::string::npos; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (auto response = client.Get("/metrics")) body = response->body;
  }
  EXPECT_EQ(metric(body, "dflashd_kernel_path{component=\"drafter.attention\",path=\"math\"}"), 1) << body;
  EXPECT_NE(p.err().find("kernel path: drafter.attention: math (split path, portable math (as configured))"), std::string::npos) << p.err();
  EXPECT_EQ(metric(body, "dflashd_kernel_path{component=\"drafter.activations\",path=\"checkpointed\"}"), 1) << body;
  EXPECT_NE(p.err().find("kernel path: drafter.activations: checkpointed"), std::string::npos) << p.err();
  // Steps train with the layers run again in backward.
  for (int i = 0; i < 300 && !(metric(body, "dflashd_optimizer_steps_total") >= 2); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (auto response = client.Get("/metrics")) body = response->body;
  }
  EXPECT_GE(metric(body, "dflashd_optimizer_steps_total"), 2) << p.err();
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0);
  // The GPU-only implementations are refused for a CPU run by the config check.
  const RunDir bad = make_run("attention-kernels-cpu");
  text = test::read_file(bad.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {attention: kernels, ");
  std::ofstream(bad.config) << text;
  test::Process v({kBinary, "validate", "--offline", "-c", bad.config}, {}, bad.dir);
  EXPECT_EQ(v.wait(60000), 3);
  EXPECT_NE(v.err().find("drafter.attention: kernels needs a GPU"), std::string::npos) << v.err();
}

// ---- item 6: the drafter of a Qwen3.5 target gets heads of 128 ---------------------------------

target::ModelConfig qwen35_shaped(int64_t hidden, int64_t head_dim) {
  auto j = nlohmann::json::parse(target::preset_config_json("tiny-qwen3_5"));
  auto& t = j.contains("text_config") ? j["text_config"] : j;
  t["hidden_size"] = hidden;
  t["head_dim"] = head_dim;
  return target::parse_model_config(j.dump(), "qwen35.json");
}

TEST(DrafterShape, Qwen35TargetsGetTheRecipesHeadsOf128) {
  config::DrafterConfig c;
  c.mask_token_id = 5;
  const auto big = drafter::shape_for_target(qwen35_shaped(5120, 256), c);
  EXPECT_EQ(big.head_dim, 128);
  EXPECT_EQ(big.num_attention_heads, 32);
  EXPECT_EQ(big.num_key_value_heads, 8);
  const auto moe = drafter::shape_for_target(qwen35_shaped(2048, 256), c);
  EXPECT_EQ(moe.num_attention_heads, 16);
  EXPECT_EQ(moe.num_key_value_heads, 4);
  // Targets with heads of 128 or less keep theirs; an explicit choice is kept.
  const auto tiny = drafter::shape_for_target(qwen35_shaped(64, 32), c);
  EXPECT_EQ(tiny.head_dim, 32);
  c.head_dim = 256;
  EXPECT_EQ(drafter::shape_for_target(qwen35_shaped(5120, 256), c).head_dim, 256);
}

// ---- item 8: `dflashd validate` checks the files and the memory plan --------------------------

TEST(Validate, ChecksTargetDrafterDataAndPrintsTheMemoryPlan) {
  const RunDir ok = make_run("validate-ok");
  test::Process good({kBinary, "validate", "--offline", "-c", ok.config}, {}, ok.dir);
  ASSERT_EQ(good.wait(60000), 0) << good.err();
  EXPECT_NE(good.out().find("memory plan (GB, estimated)"), std::string::npos) << good.out();
  EXPECT_NE(good.out().find("target+drafter"), std::string::npos) << good.out();
  // A missing model directory, data file and drafter.init: every one named, exit 3.
  const RunDir bad = make_run("validate-bad");
  test::set_section(bad, "target", "target: {path: " + bad.dir + "/no-model}");
  test::set_section(bad, "data", "data: {paths: [" + bad.dir + "/no-data.jsonl]}");
  std::string text = test::read_file(bad.config);
  text.replace(text.find("drafter: {"), 10, "drafter: {init: " + bad.dir + "/no-drafter, ");
  std::ofstream(bad.config) << text;
  test::Process offline({kBinary, "validate", "--offline", "-c", bad.config}, {}, bad.dir);
  EXPECT_EQ(offline.wait(60000), 0) << "another host's files are not here: " << offline.err();
  test::Process v({kBinary, "validate", "-c", bad.config}, {}, bad.dir);
  EXPECT_EQ(v.wait(60000), 3) << v.err();
  EXPECT_NE(v.err().find(bad.dir + "/no-model/config.json"), std::string::npos) << v.err();
  EXPECT_NE(v.err().find("data.paths: " + bad.dir + "/no-data.jsonl: no such file or directory"), std::string::npos) << v.err();
  // The drafter needs the target's config first: fix the target, then drafter.init is checked.
  test::set_section(bad, "target", "target: {preset: tiny-qwen3_5, weights: random, dtype: float32}");
  test::Process w({kBinary, "validate", "-c", bad.config}, {}, bad.dir);
  EXPECT_EQ(w.wait(60000), 3) << w.err();
  EXPECT_NE(w.err().find(bad.dir + "/no-drafter/config.json: cannot read"), std::string::npos) << w.err();
}

// Qwen3.5-27B's shapes (docs/targets.md) on the tiny preset's config.
target::ModelConfig qwen3_5_27b_shapes() {
  auto root = nlohmann::json::parse(target::preset_config_json("tiny-qwen3_5"));
  auto& j = root["text_config"];
  j["hidden_size"] = 5120, j["num_hidden_layers"] = 64, j["intermediate_size"] = 17408, j["vocab_size"] = 248320;
  j["num_attention_heads"] = 24, j["num_key_value_heads"] = 4, j["head_dim"] = 256;
  j["linear_num_key_heads"] = 16, j["linear_num_value_heads"] = 48, j["linear_key_head_dim"] = 128;
  j["linear_value_head_dim"] = 128, j["linear_conv_kernel_dim"] = 4;
  return target::parse_model_config(root.dump(), "27b.json");
}

// The default config on GPUs with the 27B recipe's drafter and 4,096-token sequences.
config::Config a_27b_run() {
  config::Config c = config::load_default();
  c.gpus.device = config::Device::cuda;
  c.target.dtype = config::ModelDtype::bfloat16;
  c.drafter.num_layers = 5;
  c.drafter.mask_token_id.reset();
  c.data.max_length = 4096;
  return c;
}

TEST(MemoryPlan, A27BTargetAndDrafterOnOneGpuOfTooLittleMemoryIsRefusedWithItsNumbers) {
  const target::ModelConfig target = qwen3_5_27b_shapes();
  config::Config c = a_27b_run();
  const drafter::DrafterShape shape = drafter::shape_for_target(target, c.drafter);
  const auto on_h200 = plan_memory(c, target, shape, {143'771LL << 20});
  ASSERT_EQ(on_h200.size(), 1u);
  EXPECT_GT(on_h200[0].target_weights, 50'000'000'000);  // 62 layers of 27B in bf16
  EXPECT_LT(on_h200[0].target_weights, 60'000'000'000);
  EXPECT_GT(on_h200[0].drafter_state, 20'000'000'000);  // fp32 masters + moments of ~1.7B parameters
  EXPECT_TRUE(memory_plan_problems(on_h200).empty()) << format_memory_plan(on_h200);
  // target.dtype: float8 keeps the projections at a byte each (plus a factor per 128x128 block);
  // the embedding, head, norms and convs stay bf16: the 27B target's weights a little over half.
  c.target.dtype = config::ModelDtype::float8;
  const auto fp8 = plan_memory(c, target, shape, {143'771LL << 20});
  EXPECT_LT(fp8[0].target_weights, on_h200[0].target_weights * 6 / 10) << format_memory_plan(fp8);
  EXPECT_GT(fp8[0].target_weights, on_h200[0].target_weights / 2) << format_memory_plan(fp8);
  EXPECT_EQ(fp8[0].drafter_state, on_h200[0].drafter_state);  // the drafter trains in bf16 either way
  c.target.dtype = config::ModelDtype::bfloat16;
  const auto on_h100 = plan_memory(c, target, shape, {80LL << 30});
  const auto problems = memory_plan_problems(on_h100);
  ASSERT_EQ(problems.size(), 1u) << format_memory_plan(on_h100);
  EXPECT_NE(problems[0].find("GPU 0: the run needs about"), std::string::npos) << problems[0];
  EXPECT_NE(problems[0].find("give the target and the drafter separate GPUs"), std::string::npos) << problems[0];
  // Split over two GPUs of that size, each role fits.
  c.gpus.target = {0};
  c.gpus.drafter = {1};
  const auto split = plan_memory(c, target, shape, {80LL << 30, 80LL << 30});
  EXPECT_TRUE(memory_plan_problems(split).empty()) << format_memory_plan(split);
}

TEST(MemoryPlan, TheEvalSectionsDecodingIsPlannedOnTheGpusOfTargetReplicaZero) {
  const target::ModelConfig target = qwen3_5_27b_shapes();
  config::Config c = a_27b_run();
  c.gpus.target = {0};
  c.gpus.drafter = {1};
  const drafter::DrafterShape shape = drafter::shape_for_target(target, c.drafter);
  // The eval section: evaluation's copy of the drafter and its decoding caches (eval.max_batch
  // sequences of up to data.max_length + eval.max_new_tokens positions, verify steps of a block)
  // on target replica 0's GPU; bf16 states make them smaller.
  c.eval.every_steps = 1000;
  const auto with_eval = plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20});
  const int64_t caches = target::decoding_sequence_bytes(target, 4096 + c.eval.max_new_tokens, shape.block_size, 2, 4);
  EXPECT_EQ(with_eval[0].eval_decoding, shape.parameter_count() * 2 + c.eval.max_batch * caches);
  EXPECT_EQ(with_eval[1].eval_decoding, 0);
  EXPECT_NE(format_memory_plan(with_eval).find("eval decoding"), std::string::npos);
  EXPECT_TRUE(memory_plan_problems(with_eval).empty()) << format_memory_plan(with_eval);
  // Target replica 0 over two GPUs (pipeline stages): each holds its layers' caches, the last the
  // drafter's copy and the embedding's; together what one GPU held, plus that embedding.
  c.gpus.target = {0, 1};
  c.gpus.target_replicas = {{0, 1}};
  c.gpus.drafter = {2};
  const auto staged = plan_memory(c, target, shape, std::vector<int64_t>(3, 143'771LL << 20));
  ASSERT_EQ(staged.size(), 3u);
  EXPECT_GT(staged[0].eval_decoding, 0);
  EXPECT_GT(staged[1].eval_decoding, shape.parameter_count() * 2);
  EXPECT_EQ(staged[0].eval_decoding + staged[1].eval_decoding,
            with_eval[0].eval_decoding + target.vocab_size * target.hidden_size * 2);
  EXPECT_EQ(staged[2].eval_decoding, 0);
  c.gpus.target = {0};
  c.gpus.target_replicas = {{0}};
  c.gpus.drafter = {1};
  c.target.decode_state_dtype = config::ModelDtype::bfloat16;
  EXPECT_LT(plan_memory(c, target, shape, {})[0].eval_decoding, with_eval[0].eval_decoding);
  c.target.decode_state_dtype = config::ModelDtype::float32;
  c.eval.max_batch = 128;  // 128 x about 0.9 GB (keys and values of 8,192 positions) do not fit beside the target
  const auto crowded_plan = plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20});
  const auto crowded = memory_plan_problems(crowded_plan);
  ASSERT_EQ(crowded.size(), 1u) << format_memory_plan(crowded_plan);
  EXPECT_NE(crowded[0].find("lower eval.max_batch or set target.decode_state_dtype: bfloat16"), std::string::npos)
      << crowded[0];
}

TEST(MemoryPlan, LongSequencesOnOneGpuAskForActivationCheckpointing) {
  const target::ModelConfig target = qwen3_5_27b_shapes();
  config::Config c = a_27b_run();
  const drafter::DrafterShape shape = drafter::shape_for_target(target, c.drafter);
  // 65,536-token sequences with 2,048 anchors on one H200 (issue 25's long-sequence goal): the
  // drafter's activations do not fit kept, and the refusal says how to checkpoint them; with
  // train.activation_checkpointing they do.
  c.gpus.target = {0};
  c.gpus.drafter = {0};
  c.data.max_length = 65536;
  c.train.anchors_per_sequence = 2048;
  const auto kept = plan_memory(c, target, shape, {143'771LL << 20});
  const auto kept_problems = memory_plan_problems(kept);
  ASSERT_EQ(kept_problems.size(), 1u) << format_memory_plan(kept);
  EXPECT_NE(kept_problems[0].find("set train.activation_checkpointing: true"), std::string::npos) << kept_problems[0];
  c.train.activation_checkpointing = true;
  const auto checkpointed = plan_memory(c, target, shape, {143'771LL << 20});
  EXPECT_LT(checkpointed[0].drafter_activations, kept[0].drafter_activations / 2) << format_memory_plan(checkpointed);
  EXPECT_TRUE(memory_plan_problems(checkpointed).empty()) << format_memory_plan(checkpointed);
}

// An FP8 MoE target (Qwen3.5-35B-A3B's config, bench/configs): a GPU whose experts run on the FP8
// grouped GEMM holds no bf16 copy of a layer's experts; one that does not say so (offline, or
// another GPU) is counted with it: 3 x 2048 x 512 x 256 experts x 2 bytes.
TEST(MemoryPlan, AnFp8MoeTargetsDequantizedExpertsOnlyWhereTheGroupedGemmDoesNotRun) {
  const target::ModelConfig target =
      target::load_model_config(std::string(DFLASHD_SOURCE_DIR) + "/bench/configs/qwen3_5-35b-a3b");
  ASSERT_GT(target.num_experts, 0);
  config::Config c = config::load_default();
  c.gpus.device = config::Device::cuda;
  c.gpus.target = {0, 1};
  c.gpus.drafter = {1};
  c.target.dtype = config::ModelDtype::float8;
  c.drafter.mask_token_id.reset();
  const drafter::DrafterShape shape = drafter::shape_for_target(target, c.drafter);
  const int64_t experts_bf16 = 3 * target.hidden_size * target.moe_intermediate_size * target.num_experts * 2;
  EXPECT_EQ(experts_bf16, 3LL * 2048 * 512 * 256 * 2);
  const auto unknown = plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20});
  const auto hopper = plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20}, {true, false});
  ASSERT_EQ(hopper.size(), 2u);
  EXPECT_EQ(unknown[0].target_activations - hopper[0].target_activations, experts_bf16) << format_memory_plan(hopper);
  EXPECT_EQ(hopper[1].target_activations, unknown[1].target_activations) << format_memory_plan(hopper);
  c.target.dtype = config::ModelDtype::bfloat16;  // no FP8 experts: nothing dequantized anywhere
  EXPECT_EQ(plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20}, {false, false})[0].target_activations,
            plan_memory(c, target, shape, {143'771LL << 20, 143'771LL << 20}, {true, true})[0].target_activations);
}

#ifdef DFLASHD_WITH_CUDA
// Each GPU says whether Qwen3.5-35B-A3B's FP8 experts run on the grouped GEMM there: where the
// kernel was built for the GPU (Hopper, sm_90a), its gate/up and down shapes take it; a dense
// target has no experts to run.
TEST(MemoryPlan, GpuEachGpuSaysWhetherItRunsTheFp8ExpertsGrouped) {
  const std::vector<int64_t> gpus = gpu_capacities();
  if (gpus.empty()) GTEST_SKIP() << "no CUDA device";
  const std::string configs = std::string(DFLASHD_SOURCE_DIR) + "/bench/configs/";
  const std::vector<bool> moe = grouped_fp8_gpus(target::load_model_config(configs + "qwen3_5-35b-a3b"));
  const std::vector<bool> dense = grouped_fp8_gpus(target::load_model_config(configs + "qwen3_5-27b"));
  ASSERT_EQ(moe.size(), gpus.size());
  ASSERT_EQ(dense.size(), gpus.size());
  for (size_t d = 0; d < gpus.size(); ++d) {
    EXPECT_EQ(moe[d], dflash::grouped_fp8::built_for(static_cast<int>(d))) << "GPU " << d;
    EXPECT_FALSE(dense[d]) << "GPU " << d;
  }
}
#endif

// What a decoding sequence holds at 27B shapes (dflashd generate / eval refuse a batch that does
// not fit): 48 GatedDeltaNet layers x (two fp32 states of 48 x 128 x 128 + 3 conv rows of 10,240
// bf16) + 16 attention layers x keys and values at 1,024 positions of 4 x 256 bf16 + one step's
// logits over 248,320 in fp32 and bf16 = 373,537,792 bytes for 768 tokens.
TEST(DecodePlan, A27BSequencesCachesAndTheBatchThatFits) {
  const target::ModelConfig c = qwen3_5_27b_shapes();
  EXPECT_EQ(target::decoding_sequence_bytes(c, 768, 1, 2, 4), 373'537'792);
  EXPECT_EQ(target::decoding_sequence_bytes(c, 1024, 1, 2, 4), 373'537'792);  // the same capacity
  EXPECT_GT(target::decoding_sequence_bytes(c, 1025, 1, 2, 4), 373'537'792 + 60'000'000);  // keys and values doubled
  EXPECT_GT(target::decoding_sequence_bytes(c, 768, 16, 2, 4), 373'537'792 + 15 * 248320 * 6 - 1);  // a verify step's logits
  // An H200 after the weights (about 94 GB left): 128 sequences of 768 tokens fit, 256 do not.
  const int64_t fits = target::decoding_batch_that_fits(94'000'000'000, target::decoding_sequence_bytes(c, 768, 1, 2, 4));
  EXPECT_GE(fits, 128);
  EXPECT_LT(fits, 256);
  EXPECT_EQ(target::decoding_batch_that_fits(1000, 2000), 0);
  // bf16 states (target.decode_state_dtype): 48 x 2 x 48 x 128 x 128 x 2 bytes fewer, 48 logs of
  // the tokens whose stores plain steps defer (8 slots of 16 k heads x 512 + 48 v heads x 264
  // bytes) and one handoff between the deferred step's kernels (48 heads x 12,304 bytes); 256 fit.
  const int64_t logs = 48 * 8 * (16 * 512 + 48 * 264), handoff = 48 * 12'304;
  EXPECT_EQ(target::decoding_sequence_bytes(c, 768, 1, 2, 2), 373'537'792 - 150'994'944 + logs + handoff);
  EXPECT_GE(target::decoding_batch_that_fits(94'000'000'000, target::decoding_sequence_bytes(c, 768, 1, 2, 2)), 256);
}

// A target in two pipeline stages: each GPU holds its stages' share of a sequence's caches (the
// logits on the head's), together one device's; the GPU with the least room for its share limits
// the batch.
TEST(DecodePlan, AStagedTargetsCachesSplitByGpuAndTheTightestGpuLimitsTheBatch) {
  const target::ModelConfig c = qwen3_5_27b_shapes();
  const std::vector<target::LayerRange> stages = target::plan_target_stages(c, c.num_layers - 1, 2, 4096);
  const int64_t whole = target::decoding_sequence_bytes(c, 768, 1, 2, 4);
  const std::map<int, int64_t> split = target::decoding_bytes_by_gpu(c, stages, {0, 1}, 768, 1, 2, 4);
  ASSERT_EQ(split.size(), 2u);
  EXPECT_EQ(split.at(0) + split.at(1), whole);
  EXPECT_GT(split.at(0), 0);
  EXPECT_EQ(target::decoding_bytes_by_gpu(c, stages, {3, 3}, 768, 1, 2, 4).at(3), whole);  // both on GPU 3
  const target::DecodingFit roomy = target::decoding_batch_that_fits(split, {{0, 94'000'000'000}, {1, 94'000'000'000}});
  EXPECT_GE(roomy.sequences, 256);  // half a sequence's caches per GPU: twice what one GPU fits
  const target::DecodingFit tight = target::decoding_batch_that_fits(split, {{0, 94'000'000'000}, {1, 9'000'000'000}});
  EXPECT_EQ(tight.gpu, 1);
  EXPECT_EQ(tight.sequences, target::decoding_batch_that_fits(9'000'000'000, split.at(1)));
  EXPECT_EQ(target::decoding_batch_that_fits(split, {{0, 94'000'000'000}}).sequences, 0);  // GPU 1 unknown: no room
}

// ---- item 10: config.json as a new user's files may have it ------------------------------------

TEST(ModelConfigJson, DeepNestingAndNulBytesAreClearErrors) {
  for (const std::string& text :
       {std::string("{\"a\": ") + std::string(100000, '[') + std::string(100000, ']') + "}",
        target::preset_config_json("tiny-qwen3") + std::string(1, '\0') + "garbage"}) {
    try {
      target::parse_model_config(text, "/models/x/config.json");
      FAIL() << "accepted";
    } catch (const std::exception& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find("/models/x/config.json"), std::string::npos) << what;
      EXPECT_TRUE(what.find("nested deeper than 64 levels") != std::string::npos ||
                  what.find("a NUL byte at offset") != std::string::npos)
          << what;
    }
  }
}

}  // namespace
}  // namespace dflash::pipeline
