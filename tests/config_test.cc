// Tests of the strict config parser: every error class with its file:line:col message,
// all errors at once, the defaults, the embedded default, and the machine checks.
#include <gtest/gtest.h>

#include <fstream>

#include "config/config.h"

namespace dflash::config {
namespace {

// A valid minimal config; tests append or replace lines.
const char* kMinimal = R"(target:
  path: /models/qwen
data:
  paths: [/data/train.jsonl]
)";

std::vector<std::string> errors_of(const std::string& yaml) {
  try {
    parse(yaml, "run.yaml");
  } catch (const ConfigError& e) {
    std::vector<std::string> out;
    for (const auto& d : e.diagnostics()) out.push_back(d.str());
    return out;
  }
  return {};
}

::testing::AssertionResult has_error(const std::vector<std::string>& errors, const std::string& expected) {
  for (const auto& e : errors)
    if (e.find(expected) != std::string::npos) return ::testing::AssertionSuccess();
  std::string all;
  for (const auto& e : errors) all += "\n  " + e;
  return ::testing::AssertionFailure() << "no error containing '" << expected << "' among:" << (all.empty() ? " (none)" : all);
}

TEST(Config, MinimalConfigGetsDocumentedDefaults) {
  const Config c = parse(kMinimal, "run.yaml");
  EXPECT_EQ(c.target.path, "/models/qwen");
  EXPECT_EQ(c.target.dtype, config::ModelDtype::bfloat16);
  EXPECT_EQ(c.target.decode_state_dtype, config::ModelDtype::float32);
  EXPECT_EQ(c.drafter.block_size, 16);
  EXPECT_EQ(c.drafter.num_layers, 5);
  EXPECT_FALSE(c.drafter.mask_token_id.has_value());
  EXPECT_EQ(c.gpus.device, Device::cuda);
  EXPECT_EQ(c.gpus.target, std::vector<int>{0});
  EXPECT_EQ(c.train.anchors_per_sequence, 512);
  EXPECT_DOUBLE_EQ(c.train.learning_rate, 6e-4);
  EXPECT_DOUBLE_EQ(c.train.warmup_ratio, 0.04);
  EXPECT_DOUBLE_EQ(c.loss_gamma(), 7.0);
  EXPECT_EQ(c.metrics.listen, "127.0.0.1:9400");
  EXPECT_EQ(c.checkpoint_dir(), "./dflashd-run/checkpoints");
  EXPECT_EQ(c.checkpoint.resume, "auto");
}

// target.decode_state_dtype: float32 or bfloat16, nothing else.
TEST(Config, DecodeStateDtypeIsFloat32OrBfloat16) {
  const std::string target = "target:\n  path: /models/qwen\n  decode_state_dtype: ";
  const std::string data = "\ndata:\n  paths: [/data/train.jsonl]\n";
  EXPECT_EQ(parse(target + "bfloat16" + data, "run.yaml").target.decode_state_dtype, config::ModelDtype::bfloat16);
  EXPECT_EQ(parse(target + "float32" + data, "run.yaml").target.decode_state_dtype, config::ModelDtype::float32);
  EXPECT_TRUE(has_error(errors_of(target + "float16" + data), "run.yaml:3:23: target.decode_state_dtype: 'float16' is not one of"));
}

// gpus.target: an id is a replica on one GPU, a list of ids one replica over those GPUs in
// pipeline stages; a GPU in two replicas, an empty replica and a negative id are errors.
TEST(Config, TargetReplicasAreIdsOrListsOfIds) {
  const Config c = parse(std::string(kMinimal) + "gpus:\n  target: [[0, 1], 2, [3, 4, 5]]\n  drafter: [6]\n", "run.yaml");
  EXPECT_EQ(c.gpus.target_replicas, (std::vector<std::vector<int>>{{0, 1}, {2}, {3, 4, 5}}));
  EXPECT_EQ(c.gpus.target, (std::vector<int>{0, 1, 2, 3, 4, 5}));
  const Config plain = parse(std::string(kMinimal) + "gpus:\n  target: [0, 1]\n", "run.yaml");
  EXPECT_EQ(plain.gpus.target_replicas, (std::vector<std::vector<int>>{{0}, {1}}));
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, 1], [1, 2]]\n"),
                        "run.yaml:6:21: gpus.target: GPU 1 is listed twice in one group"));
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, 1], []]\n"),
                        "gpus.target: a replica needs at least one GPU, got []"));
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, -1]]\n"), "ids must be >= 0, got -1"));
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, x]]\n"),
                        "gpus.target[0][1]: expected an integer, got 'x'"));
  // A replica in stages on a drafter's GPU: its stages run at once, so no turns.
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, 1]]\n  drafter: [1]\n"),
                        "GPU 1 holds a stage of a target replica in stages and a drafter"));
  EXPECT_TRUE(errors_of(std::string(kMinimal) + "gpus:\n  target: [[0, 1]]\n  drafter: [1]\n  shared_gpu: concurrent\n")
                  .empty());
}

TEST(Config, DrafterLayerTypesAndSlidingWindow) {
  const Config c = parse(std::string(kMinimal) +
                             "drafter:\n  num_layers: 2\n  layer_types: [sliding_attention, full_attention]\n"
                             "  sliding_window: 2048\n",
                         "run.yaml");
  EXPECT_EQ(c.drafter.layer_types, (std::vector<std::string>{"sliding_attention", "full_attention"}));
  EXPECT_EQ(c.drafter.sliding_window, 2048);
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "drafter:\n  layer_types: [local_attention]\n"),
                        "each entry is full_attention or sliding_attention, got 'local_attention'"));
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "drafter:\n  sliding_window: 0\n"), "drafter.sliding_window"));
}

TEST(Config, LossGammaFollowsBlockSize) {
  EXPECT_DOUBLE_EQ(parse(std::string(kMinimal) + "drafter: {block_size: 10}\n", "r").loss_gamma(), 5.0);
  EXPECT_DOUBLE_EQ(parse(std::string(kMinimal) + "drafter: {block_size: 8}\n", "r").loss_gamma(), 4.0);
  EXPECT_DOUBLE_EQ(
      parse(std::string(kMinimal) + "drafter: {block_size: 12}\ntrain: {loss_gamma: 6}\n", "r").loss_gamma(), 6.0);
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "drafter: {block_size: 12}\n"),
                        "run.yaml:5:23: train.loss_gamma has a recipe default only for block sizes 16, 10 and 8"));
}

TEST(Config, EmbeddedDefaultParsesAndIsCpuTinySynthetic) {
  const Config c = load_default();
  EXPECT_EQ(c.source, "<embedded default>");
  EXPECT_EQ(c.gpus.device, Device::cpu);
  EXPECT_EQ(c.target.preset, "tiny-qwen3_5");
  EXPECT_EQ(c.target.weights, config::TargetWeights::random);
  EXPECT_GT(c.data.synthetic.sequences, 0);
  EXPECT_TRUE(c.data.paths.empty());
  EXPECT_TRUE(check_machine(c, Machine{0}).empty());
  // Every default in the struct is what the embedded file documents, section by section.
  EXPECT_DOUBLE_EQ(c.train.learning_rate, 0.002);  // the demo's; the struct default is the recipe's 6e-4
  EXPECT_EQ(c.train.anchors_per_sequence, TrainConfig{}.anchors_per_sequence);
  EXPECT_EQ(c.checkpoint.every_steps, CheckpointConfig{}.every_steps);
  EXPECT_EQ(c.queues.feature_memory_budget_bytes, QueueConfig{}.feature_memory_budget_bytes);
  EXPECT_EQ(c.metrics.listen, MetricsConfig{}.listen);
  EXPECT_DOUBLE_EQ(c.metrics.peak_flops_per_gpu, MetricsConfig{}.peak_flops_per_gpu);
  EXPECT_EQ(c.workers.on_failure, WorkerConfig{}.on_failure);
}

TEST(Config, UnknownKeyWithDidYouMean) {
  const auto errors = errors_of(std::string(kMinimal) + "train:\n  learnig_rate: 0.001\n");
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "run.yaml:6:3: unknown key 'train.learnig_rate'; did you mean 'learning_rate'?");
}

TEST(Config, UnknownKeyFarFromAnyListsKnownKeys) {
  const auto errors = errors_of(std::string(kMinimal) + "gpus:\n  banana: 1\n");
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_TRUE(has_error(errors, "run.yaml:6:3: unknown key 'gpus.banana' (known here: device, drafter, shared_gpu, target)"));
}

TEST(Config, UnknownTopLevelSection) {
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "metrcs: {}\n"),
                        "run.yaml:5:1: unknown key 'metrcs'; did you mean 'metrics'?"));
}

TEST(Config, DuplicateKeys) {
  const auto errors = errors_of(std::string(kMinimal) + "train:\n  epochs: 2\n  epochs: 3\n");
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_EQ(errors[0], "run.yaml:7:3: duplicate key 'train.epochs' (first given at line 6)");
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "train: {}\ntrain: {}\n"),
                        "run.yaml:6:1: duplicate key 'train'"));
}

TEST(Config, DuplicateKeyKeepsNeitherSilently) {
  // The first value stays; the second is reported, never silently used.
  EXPECT_THROW(parse(std::string(kMinimal) + "train:\n  epochs: 2\n  epochs: 3\n", "r"), ConfigError);
}

TEST(Config, WrongTypes) {
  const auto errors = errors_of(std::string(kMinimal) +
                                "train:\n"
                                "  epochs: many\n"           // line 6
                                "  anchors_per_sequence: 1.5\n"
                                "  deterministic: yes\n"
                                "gpus:\n"
                                "  target: 3\n"              // line 10
                                "  drafter: [0, x]\n"
                                "run:\n"
                                "  name: [a, b]\n");
  EXPECT_TRUE(has_error(errors, "run.yaml:6:11: train.epochs: expected a number, got 'many'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:7:25: train.anchors_per_sequence: expected an integer, got '1.5'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:8:18: train.deterministic: expected a boolean (true/false), got 'yes'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:10:11: gpus.target: expected a list, got '3'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:11:16: gpus.drafter[1]: expected an integer, got 'x'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:13:9: run.name: expected a string, got a list"));
  EXPECT_EQ(errors.size(), 6u);
}

TEST(Config, SectionMustBeAMapping) {
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "train: 5\n"),
                        "run.yaml:5:8: train must be a mapping, got a scalar"));
}

TEST(Config, OutOfRangeValues) {
  const auto errors = errors_of(std::string(kMinimal) +
                                "drafter:\n"
                                "  block_size: 1\n"      // line 6
                                "  num_layers: 0\n"
                                "train:\n"
                                "  learning_rate: -1\n"  // line 9
                                "  warmup_ratio: 1.5\n"
                                "queues:\n"
                                "  features: 0\n"        // line 12
                                "metrics:\n"
                                "  listen: localhost:99999\n");
  EXPECT_TRUE(has_error(errors, "run.yaml:6:15: drafter.block_size: must be in [2, 64], got 1"));
  EXPECT_TRUE(has_error(errors, "run.yaml:7:15: drafter.num_layers: must be in [1, 64], got 0"));
  EXPECT_TRUE(has_error(errors, "run.yaml:9:18: train.learning_rate: must be > 0, got -1"));
  EXPECT_TRUE(has_error(errors, "run.yaml:10:17: train.warmup_ratio: must be in [0, 1], got 1.5"));
  EXPECT_TRUE(has_error(errors, "run.yaml:12:13: queues.features: must be in [1, 1024], got 0"));
  EXPECT_TRUE(has_error(errors, "run.yaml:14:11: metrics.listen: 'localhost:99999' is not host:port"));
}

TEST(Config, InvalidChoice) {
  EXPECT_TRUE(has_error(errors_of(std::string(kMinimal) + "logging: {format: xml}\n"),
                        "run.yaml:5:19: logging.format: 'xml' is not one of: text, json"));
}

TEST(Config, ContradictionsAreReported) {
  const auto errors = errors_of(R"(target:
  path: /m
  preset: tiny-qwen3
data:
  paths: [/d]
  synthetic: {sequences: 4, min_length: 50, max_length: 10}
gpus:
  target: [0, 1, 0]
  drafter: []
drafter:
  target_layer_ids: [1, 5, 3]
checkpoint:
  every_steps: 0
  every_minutes: 0
)");
  EXPECT_TRUE(has_error(errors, "run.yaml:3:11: target: target.path and target.preset exclude each other"));
  EXPECT_TRUE(has_error(errors, "run.yaml:8:18: gpus.target: GPU 0 is listed twice in one group"));
  EXPECT_TRUE(has_error(errors, "run.yaml:9:12: gpus.drafter: at least one id is needed"));
  EXPECT_TRUE(has_error(errors, "run.yaml:11:28: drafter.target_layer_ids: ids must be strictly ascending"));
  EXPECT_TRUE(has_error(errors, "data: data.paths and data.synthetic exclude each other"));
  EXPECT_TRUE(has_error(errors, "data.synthetic.min_length must be <= data.synthetic.max_length"));
  EXPECT_TRUE(has_error(errors, "checkpoint: every_steps and every_minutes are both 0"));
}

TEST(Config, MissingRequiredSections) {
  const auto errors = errors_of("run: {name: x}\n");
  EXPECT_TRUE(has_error(errors, "target: required section"));
  EXPECT_TRUE(has_error(errors, "data: required section"));
  EXPECT_TRUE(has_error(errors_of("target: {}\ndata: {paths: [/d]}\n"),
                        "run.yaml:1:9: target: give target.path (a Hugging Face model directory) or target.preset"));
}

TEST(Config, AllErrorsAtOnceInFileOrder) {
  const auto errors = errors_of(R"(target:
  pth: /m
data:
  paths: [/d]
train:
  epochs: -1
  seed: abc
logging:
  level: loud
)");
  ASSERT_GE(errors.size(), 4u);
  EXPECT_TRUE(has_error(errors, "run.yaml:2:3: unknown key 'target.pth'; did you mean 'path'?"));
  EXPECT_TRUE(has_error(errors, "run.yaml:6:11: train.epochs: must be > 0"));
  EXPECT_TRUE(has_error(errors, "run.yaml:7:9: train.seed: expected an integer, got 'abc'"));
  EXPECT_TRUE(has_error(errors, "run.yaml:9:10: logging.level: 'loud' is not one of"));
  // Sorted by position: the unknown key of line 2 comes first, the level of line 9 last.
  EXPECT_NE(errors.front().find("run.yaml:2:3:"), std::string::npos) << errors.front();
  EXPECT_NE(errors.back().find("run.yaml:9:10:"), std::string::npos) << errors.back();
}

TEST(Config, YamlSyntaxErrorHasPosition) {
  const auto errors = errors_of("target:\n  path: [unclosed\n");
  ASSERT_EQ(errors.size(), 1u);
  EXPECT_NE(errors[0].find("run.yaml:"), std::string::npos);
  EXPECT_NE(errors[0].find("YAML syntax error"), std::string::npos);
}

TEST(Config, EmptyFile) {
  EXPECT_TRUE(has_error(errors_of(""), "run.yaml: the file is empty"));
}

TEST(Config, MissingFileNamesIt) {
  try {
    load_file("/nonexistent/run.yaml");
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/run.yaml: cannot read the config file"), std::string::npos);
  }
}

TEST(Config, LoadFileReportsTheFileName) {
  const std::string path = ::testing::TempDir() + "/bad_run.yaml";
  std::ofstream(path) << kMinimal << "train:\n  epochs: 0\n";
  try {
    load_file(path);
    FAIL() << "expected ConfigError";
  } catch (const ConfigError& e) {
    ASSERT_EQ(e.diagnostics().size(), 1u);
    EXPECT_EQ(e.diagnostics()[0].str(), path + ":6:11: train.epochs: must be > 0, got 0");
  }
}

TEST(Config, MachineCheckNamesMissingGpus) {
  const Config c = parse(std::string(kMinimal) + "gpus:\n  target: [0, 1]\n  drafter: [2, 3]\n", "run.yaml");
  const auto problems = check_machine(c, Machine{3});
  ASSERT_EQ(problems.size(), 1u);
  EXPECT_EQ(problems[0].str(), "run.yaml:7:16: gpus.drafter[1]: GPU 3 does not exist; this machine has GPUs 0..2");
  const auto none = check_machine(c, Machine{0});
  ASSERT_EQ(none.size(), 4u);
  EXPECT_NE(none[0].message.find("this machine has no CUDA GPU"), std::string::npos);
  EXPECT_TRUE(check_machine(c, Machine{4}).empty());
}

TEST(Config, CpuDeviceSkipsGpuChecksAndAllowsReplicaIds) {
  const Config c = parse(std::string(kMinimal) + "gpus:\n  device: cpu\n  target: [0]\n  drafter: [0, 1, 2]\n", "r");
  EXPECT_TRUE(check_machine(c, Machine{0}).empty());
  EXPECT_EQ(c.gpus.drafter.size(), 3u);
}

TEST(Config, OverlappingGroupsAreAllowed) {
  const Config c = parse(std::string(kMinimal) + "gpus:\n  target: [0, 1]\n  drafter: [1, 2]\n", "r");
  EXPECT_TRUE(check_machine(c, Machine{3}).empty());
  EXPECT_EQ(c.gpus.shared_gpu, SharedGpu::turns);
  EXPECT_EQ(parse(std::string(kMinimal) + "gpus: {target: [0], drafter: [0], shared_gpu: concurrent}\n", "r").gpus.shared_gpu,
            SharedGpu::concurrent);
  try {
    parse(std::string(kMinimal) + "gpus: {shared_gpu: sometimes}\n", "r");
    FAIL() << "expected a ConfigError";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("shared_gpu"), std::string::npos) << e.what();
  }
}

TEST(Config, DistributedRankMustBeBelowTheNodeCount) {
  const auto errors = errors_of(std::string(kMinimal) + "distributed: {nodes: 2, node_rank: 2, master_port: 70000}\n");
  EXPECT_TRUE(has_error(errors, "distributed.node_rank: 2 is not below distributed.nodes (2)"));
  EXPECT_TRUE(has_error(errors, "distributed.master_port: must be in [1, 65535], got 70000"));
}

TEST(Config, SplitHostPort) {
  std::string host;
  int port = 0;
  EXPECT_TRUE(split_host_port("127.0.0.1:9400", &host, &port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, 9400);
  EXPECT_TRUE(split_host_port("[::1]:80", &host, &port));
  EXPECT_EQ(host, "::1");
  EXPECT_FALSE(split_host_port("9400", &host, &port));
  EXPECT_FALSE(split_host_port("host:", &host, &port));
  EXPECT_FALSE(split_host_port("host:0", &host, &port));
  EXPECT_FALSE(split_host_port("host:12a", &host, &port));
}

}  // namespace
}  // namespace dflash::config
