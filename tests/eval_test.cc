// Real acceptance end to end: a drafter trained by `dflashd run` on text its target generated
// greedily reaches a real acceptance length >= 3 in `dflashd eval` (speculative decoding with the
// target), and the eval's report is what the command prints.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include <httplib.h>

#include "config/config.h"
#include "decode/speculative.h"
#include "drafter/model.h"
#include "target/incremental.h"
#include "target/model.h"
#include "target/model_config.h"
#include "tests/test_util.h"

namespace dflash {
namespace {

const std::string kBinary = test::dflashd_binary(DFLASHD_BINARY);

// `count` samples: a random prompt of 4-12 tokens, then the target's greedy continuation of
// `response` tokens, supervised on the response: the recipe's "the target's own responses".
void write_target_generated(const std::string& path, const target::IncrementalTarget& target, int count, int response,
                            uint64_t seed) {
  std::ofstream out(path);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t vocab = target.config().vocab_size - 1;  // the last id is the mask token
  decode::GenerateSettings settings;
  settings.max_new_tokens = response;
  std::vector<std::vector<int64_t>> prompts;
  for (int i = 0; i < count; ++i) {
    const int64_t length = 4 + at::randint(9, {1}, gen).item<int64_t>();
    const at::Tensor p = at::randint(vocab, {length}, gen);
    prompts.emplace_back(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + length);
  }
  for (const decode::Generation& g : decode::PlainDecoder(target).generate_all(prompts, settings, 64)) {
    std::vector<int> mask(g.tokens.size(), 1);
    std::fill(mask.begin(), mask.begin() + g.prompt_tokens, 0);
    out << nlohmann::json{{"input_ids", g.tokens}, {"loss_mask", mask}}.dump() << "\n";
  }
}

// `count` prompts of 5, 8, 11, ... tokens below 500 (the tiny targets' vocabulary is 512).
void write_prompts(const std::string& path, int count) {
  std::ofstream prompts(path);
  for (int i = 0; i < count; ++i) {
    std::vector<int> ids;
    for (int t = 0; t < 5 + 3 * i; ++t) ids.push_back((37 * i + 11 * t + 5) % 500);
    prompts << nlohmann::json{{"input_ids", ids}}.dump() << "\n";
  }
}

// `dflashd eval` of the tiny qwen3_5 target on `device` (one prompt at a time), the drafter in
// `drafter`, dir/prompts.jsonl: the report (dir/NAME.json), its log in dir/NAME.log.
nlohmann::json eval_tiny_on_gpu(const std::string& dir, const std::string& name, const std::string& device,
                                const std::string& drafter, int new_tokens) {
  const std::string cmd = kBinary + " eval --preset tiny-qwen3_5 --allow-slow-path --device " + device +
                          " --drafter " + drafter + " --prompts " + dir + "/prompts.jsonl --max-new-tokens " +
                          std::to_string(new_tokens) + " --max-batch 1 --out " + dir + "/" + name + ".json > " + dir +
                          "/" + name + ".log 2>&1";
  EXPECT_EQ(std::system(cmd.c_str()), 0) << test::read_file(dir + "/" + name + ".log");
  return nlohmann::json::parse(test::read_file(dir + "/" + name + ".json"));
}

TEST(RealAcceptance, ADrafterTrainedOnItsTargetsOutputAcceptsThreeOrMoreTokensPerStep) {
  const std::string dir = test::make_temp_dir("real-acceptance");
  // The target: tiny-qwen3's shape with tied embeddings (as the small Qwen models have), random
  // weights seeded as the run seeds them (train.seed 0): only its config.json is on disk.
  std::string json = target::preset_config_json("tiny-qwen3");
  json.replace(json.find("\"tie_word_embeddings\": false"), 28, "\"tie_word_embeddings\": true");
  std::filesystem::create_directories(dir + "/target");
  std::ofstream(dir + "/target/config.json") << json;
  const target::ModelConfig config = target::parse_model_config(json, dir + "/target/config.json");
  auto model = target::random_target(config, config.num_layers - 1, target::TargetOptions{}, target::run_target_seed(0));
  const target::IncrementalTarget target(*model);
  // Many short samples: the drafter must learn the target's habits, not memorise sequences
  // (160 samples of 48 tokens gave 1.5 on held-out prompts after 1,200 steps; bench/RESULTS.md).
  write_target_generated(dir + "/train.jsonl", target, 480, 32, 1);
  write_target_generated(dir + "/held_out.jsonl", target, 16, 48, 2);
  std::ofstream(dir + "/run.yaml") << "run: {name: real-acceptance, output_dir: " << dir << "/run}\n"
                                   << "target: {path: " << dir << "/target, weights: random, dtype: float32}\n"
                                   << "drafter: {num_layers: 2, block_size: 8, mask_token_id: " << config.vocab_size - 1 << "}\n"
                                   << "gpus: {device: cpu, target: [0], drafter: [0]}\n"
                                   << "data: {paths: [" << dir << "/train.jsonl], max_length: 256}\n"
                                   << "train: {max_steps: 600, learning_rate: 0.005, anchors_per_sequence: 32, sequences_per_step: 4}\n"
                                   << "eval: {every_steps: 200, prompts: " << dir << "/held_out.jsonl, max_prompts: 8, max_new_tokens: 32}\n"
                                   << "checkpoint: {every_steps: 1000}\n"
                                   << "metrics: {listen: \"\"}\n"
                                   << "logging: {level: info}\n";
  const std::string run = kBinary + " run -c " + dir + "/run.yaml > " + dir + "/run.log 2>&1";
  ASSERT_EQ(std::system(run.c_str()), 0) << test::read_file(dir + "/run.log");
  const std::string eval = kBinary + " eval --target " + dir + "/target --random-weights --device cpu --drafter " + dir + "/run/export/final --prompts " +
                           dir + "/held_out.jsonl --max-new-tokens 48 --out " + dir + "/report.json > " + dir +
                           "/eval.log 2>&1";
  ASSERT_EQ(std::system(eval.c_str()), 0) << test::read_file(dir + "/eval.log");
  const nlohmann::json report = nlohmann::json::parse(test::read_file(dir + "/report.json"));
  std::printf("%s", test::read_file(dir + "/eval.log").c_str());
  EXPECT_EQ(report["prompts"], 16);
  EXPECT_EQ(report["outputs_differing_from_plain_greedy"], 0);  // lossless
  EXPECT_GE(report["acceptance_length"].get<double>(), 3.0) << report.dump();
  // The target split into two pipeline stages (--device cpu,cpu) decodes the same tokens.
  const std::string split = kBinary + " eval --target " + dir + "/target --random-weights --device cpu,cpu --drafter " +
                            dir + "/run/export/final --prompts " + dir + "/held_out.jsonl --max-new-tokens 48 --out " +
                            dir + "/split.json > " + dir + "/split.log 2>&1";
  ASSERT_EQ(std::system(split.c_str()), 0) << test::read_file(dir + "/split.log");
  const nlohmann::json split_report = nlohmann::json::parse(test::read_file(dir + "/split.json"));
  for (const char* key : {"new_tokens", "verify_steps", "acceptance_length", "acceptance_at_position"}) {
    EXPECT_EQ(split_report[key], report[key]) << key;
  }
  // ... with a decoder per stage (two threads), and as losslessly.
  EXPECT_EQ(report["decoders"], 1);
  EXPECT_EQ(split_report["decoders"], 2);
  EXPECT_EQ(split_report["outputs_differing_from_plain_greedy"], 0);
  // The run's eval section measured the same thing during training, every 200 steps, and chose
  // export/best by it.
  const std::string log = test::read_file(dir + "/run.log");
  for (const char* step : {"eval at step 200:", "eval at step 400:", "eval at step 600:"}) {
    EXPECT_NE(log.find(step), std::string::npos) << step << "\n" << log;
  }
  EXPECT_NE(log.find("best by eval acceptance"), std::string::npos) << log;
  const nlohmann::json best = nlohmann::json::parse(test::read_file(dir + "/run/export/best/eval.json"));
  EXPECT_GT(best["acceptance_length"].get<double>(), 1.0) << best.dump();
  EXPECT_EQ(best["prompts"], 8);
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/export/best/model.safetensors"));
}

// data.eval_fraction: samples held out of training are the eval's prompts; evaluations run at
// their steps, their metrics are on /metrics, and a finished run evaluates its final drafter.
// The target keeps its decoding states in bf16 (target.decode_state_dtype), as the log says.
TEST(RealAcceptance, HeldOutSamplesAreTheEvalPromptsAndTheMetricsAreExported) {
  const std::string dir = test::make_temp_dir("eval-fraction");
  const int port = test::free_port();
  std::ofstream(dir + "/run.yaml") << "run: {name: eval-fraction, output_dir: " << dir << "/run}\n"
                                   << "target: {preset: tiny-qwen3_5, weights: random, dtype: float32, "
                                   << "decode_state_dtype: bfloat16}\n"
                                   << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
                                   << "gpus: {device: cpu, target: [0], drafter: [0]}\n"
                                   << "data: {synthetic: {sequences: 100, min_length: 24, max_length: 40}, eval_fraction: 0.1}\n"
                                   << "train: {max_steps: 100000, anchors_per_sequence: 16}\n"
                                   << "eval: {every_steps: 5, max_prompts: 4, max_new_tokens: 8}\n"
                                   << "checkpoint: {every_steps: 1000}\n"
                                   << "metrics: {listen: \"127.0.0.1:" << port << "\"}\n";
  test::Process p({kBinary, "run", "-c", dir + "/run.yaml"}, {}, dir);
  httplib::Client client("127.0.0.1", port);
  std::string page;
  auto evaluations = [&] {
    const size_t at = page.find("\ndflashd_evaluations_total ");
    return at == std::string::npos ? 0.0 : std::stod(page.substr(at + 27));
  };
  for (int i = 0; i < 600 && evaluations() < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    if (auto response = client.Get("/metrics")) page = response->body;
  }
  p.signal(SIGTERM);
  EXPECT_EQ(p.wait(60000), 0) << p.err();
  for (const char* series : {"\ndflashd_eval_acceptance_length ", "\ndflashd_eval_acceptance_at_position{position=\"7\"} ",
                             "\ndflashd_eval_tokens_per_second{decoding=\"speculative\"} ",
                             "\ndflashd_eval_tokens_per_second{decoding=\"plain\"} ", "\ndflashd_eval_speedup ",
                             "\ndflashd_evaluations_total "}) {
    EXPECT_NE(page.find(series), std::string::npos) << series << "\n" << page;
  }
  const std::string log = p.err();
  EXPECT_NE(log.find("held out for eval"), std::string::npos) << log;
  EXPECT_NE(log.find("eval: every 5 steps, 4 prompts"), std::string::npos) << log;
  EXPECT_NE(log.find("on cpu (bfloat16 GatedDeltaNet states)"), std::string::npos) << log;  // target.decode_state_dtype
  EXPECT_NE(log.find("eval at step 5:"), std::string::npos) << log;
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/export/best/eval.json"));

  // A finished run evaluates its final drafter even when that step was not due; here with target
  // replica 0 split into two pipeline stages (the eval decodes over both).
  std::ofstream(dir + "/short.yaml") << "run: {name: eval-final, output_dir: " << dir << "/short}\n"
                                     << "target: {preset: tiny-qwen3_5, weights: random, dtype: float32}\n"
                                     << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
                                     << "gpus: {device: cpu, target: [[0, 1]], drafter: [0]}\n"
                                     << "data: {synthetic: {sequences: 100, min_length: 24, max_length: 40}, eval_fraction: 0.1}\n"
                                     << "train: {max_steps: 7, anchors_per_sequence: 16}\n"
                                     << "eval: {every_steps: 5, max_prompts: 4, max_new_tokens: 8}\n"
                                     << "metrics: {listen: \"\"}\n";
  const std::string run = kBinary + " run -c " + dir + "/short.yaml > " + dir + "/short.log 2>&1";
  ASSERT_EQ(std::system(run.c_str()), 0) << test::read_file(dir + "/short.log");
  EXPECT_NE(test::read_file(dir + "/short.log").find("eval at step 7:"), std::string::npos) << test::read_file(dir + "/short.log");
  EXPECT_NE(test::read_file(dir + "/short.log").find("at once, on cpu + cpu"), std::string::npos)
      << test::read_file(dir + "/short.log");
}

// Config errors: an eval without prompts, prompts without an eval.
TEST(RealAcceptance, TheEvalSectionNeedsExactlyOneSourceOfPrompts) {
  const std::string dir = test::make_temp_dir("eval-config");
  auto validate = [&](const std::string& extra) {
    std::ofstream(dir + "/c.yaml") << "target: {preset: tiny-qwen3, weights: random}\n"
                                   << "drafter: {mask_token_id: 511}\ngpus: {device: cpu}\n"
                                   << "data: {synthetic: {sequences: 10}" << extra;
    const std::string cmd = kBinary + " validate --offline -c " + dir + "/c.yaml > " + dir + "/v.log 2>&1";
    return std::system(cmd.c_str());
  };
  EXPECT_NE(validate("}\neval: {every_steps: 5}\n"), 0);
  EXPECT_NE(test::read_file(dir + "/v.log").find("exactly one of eval.prompts"), std::string::npos) << test::read_file(dir + "/v.log");
  EXPECT_NE(validate(", eval_fraction: 0.2}\n"), 0);
  EXPECT_NE(test::read_file(dir + "/v.log").find("eval.every_steps is 0"), std::string::npos) << test::read_file(dir + "/v.log");
  EXPECT_EQ(validate(", eval_fraction: 0.2}\neval: {every_steps: 5}\n"), 0) << test::read_file(dir + "/v.log");
  // A stop id outside the target's vocabulary (512): validate says so, and a run refuses to start.
  EXPECT_NE(validate(", eval_fraction: 0.2}\neval: {every_steps: 5, stop_token_ids: [3, 600]}\n"), 0);
  EXPECT_NE(test::read_file(dir + "/v.log")
                .find("eval.stop_token_ids: stop token id 600 is outside the vocabulary (512)"),
            std::string::npos)
      << test::read_file(dir + "/v.log");
  std::ofstream(dir + "/c.yaml", std::ios::app) << "run: {output_dir: " << dir << "/run}\nmetrics: {listen: \"\"}\n";
  const std::string run = kBinary + " run -c " + dir + "/c.yaml > " + dir + "/r.log 2>&1";
  EXPECT_NE(std::system(run.c_str()), 0);
  EXPECT_NE(test::read_file(dir + "/r.log").find("eval.stop_token_ids: stop token id 600 is outside the vocabulary"),
            std::string::npos)
      << test::read_file(dir + "/r.log");
}

// The eval section's decoding settings reach the decoder: every id a stop token (each prompt ends
// at its first token), sampled (no lossless check: the best export's report has none), and the
// log says what runs.
TEST(RealAcceptance, TheEvalSectionsDecodingSettingsAreUsed) {
  const std::string dir = test::make_temp_dir("eval-settings");
  auto run = [&](const std::string& name, const std::string& eval_extra) {
    std::ofstream(dir + "/" + name + ".yaml")
        << "run: {name: eval-settings, output_dir: " << dir << "/" << name << "}\n"
        << "target: {preset: tiny-qwen3, weights: random, dtype: float32}\n"
        << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
        << "gpus: {device: cpu, target: [0], drafter: [0]}\n"
        << "data: {synthetic: {sequences: 60, min_length: 24, max_length: 40}, eval_fraction: 0.1}\n"
        << "train: {max_steps: 4, anchors_per_sequence: 16}\n"
        << "eval: {every_steps: 4, max_prompts: 3, max_new_tokens: 8, max_batch: 2, temperature: 0.7, top_p: 0.9, "
        << "top_k: 5" << eval_extra << "}\n"
        << "metrics: {listen: \"\"}\n";
    const std::string cmd = kBinary + " run -c " + dir + "/" + name + ".yaml > " + dir + "/" + name + ".log 2>&1";
    EXPECT_EQ(std::system(cmd.c_str()), 0) << test::read_file(dir + "/" + name + ".log");
    return test::read_file(dir + "/" + name + ".log");
  };
  std::string stops;
  for (int id = 0; id < 512; ++id) stops += (id ? "," : "") + std::to_string(id);
  const std::string log = run("stops", ", stop_token_ids: [" + stops + "]");
  EXPECT_NE(log.find("eval: every 4 steps, 3 prompts, 8 new tokens each, sampled (temperature 0.7, top_p 0.9, top_k 5), "
                     "512 stop tokens, 2 at once"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("eval at step 4: acceptance length 0.000 (3 prompts, 3 new tokens;"), std::string::npos) << log;

  // Without the stop tokens the prompts run to max_new_tokens; the best export's report holds the
  // settings and no lossless check (sampled).
  run("plain", "");
  const nlohmann::json best = nlohmann::json::parse(test::read_file(dir + "/plain/export/best/eval.json"));
  EXPECT_EQ(best["new_tokens"], 3 * 8) << best.dump();
  EXPECT_FALSE(best.contains("outputs_differing_from_plain_greedy")) << best.dump();
  EXPECT_EQ(best["settings"]["temperature"], 0.7);
  EXPECT_EQ(best["settings"]["top_k"], 5);
  EXPECT_EQ(best["settings"]["stop_token_ids"].size(), 0u);
  EXPECT_EQ(best["max_batch"], 2);
}

// `dflashd eval` command lines: usage errors exit 2 with the usage, unusable inputs exit 1
// naming the file.
TEST(DflashdEval, BadCommandLinesAreClearErrors) {
  const std::string dir = test::make_temp_dir("eval-cli");
  std::ofstream(dir + "/prompts.jsonl") << "{\"input_ids\": [1, 2, 3]}\n{\"input_ids\": [4, 99999]}\n";
  auto eval = [&](const std::string& args) {
    const std::string cmd = kBinary + " eval " + args + " > " + dir + "/out.log 2>&1";
    const int status = std::system(cmd.c_str());
    return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  };
  auto said = [&](const std::string& text) { return test::read_file(dir + "/out.log").find(text) != std::string::npos; };
  EXPECT_EQ(eval("--preset tiny-qwen3 --prompts " + dir + "/prompts.jsonl"), 2);
  EXPECT_TRUE(said("--drafter and --prompts are required")) << test::read_file(dir + "/out.log");
  EXPECT_EQ(eval("--preset tiny-qwen3 --drafter x --prompts y --beam-width 4"), 2);
  EXPECT_TRUE(said("unknown option --beam-width")) << test::read_file(dir + "/out.log");
  EXPECT_EQ(eval("--preset tiny-qwen3 --drafter x --prompts y --max-batch 0"), 2);
  EXPECT_TRUE(said("--max-batch: '0' is not a valid value")) << test::read_file(dir + "/out.log");
  EXPECT_EQ(eval("--preset tiny-qwen3 --target " + dir + " --drafter x --prompts y"), 2);
  EXPECT_EQ(eval("--preset tiny-qwen3 --device cpu --drafter " + dir + "/missing --prompts " + dir + "/prompts.jsonl"), 1);
  EXPECT_TRUE(said(dir + "/missing")) << test::read_file(dir + "/out.log");
  // A drafter of this target: prompts with an id outside the vocabulary are named by line.
  const target::ModelConfig config = target::parse_model_config(target::preset_config_json("tiny-qwen3"), "tiny");
  config::DrafterConfig dc;
  dc.num_layers = 1;
  dc.mask_token_id = config.vocab_size - 1;
  drafter::DrafterShape shape = drafter::shape_for_target(config, dc);
  drafter::Drafter(shape, at::TensorOptions().dtype(at::kFloat)).save_export(dir + "/drafter");
  EXPECT_EQ(eval("--preset tiny-qwen3 --device cpu --drafter " + dir + "/drafter --prompts " + dir + "/prompts.jsonl"), 1);
  EXPECT_TRUE(said(dir + "/prompts.jsonl:2: token id 99999 is outside the vocabulary")) << test::read_file(dir + "/out.log");
  // A drafter that reads a layer this target does not have.
  shape.target_layer_ids.back() = config.num_layers + 3;
  drafter::Drafter(shape, at::TensorOptions().dtype(at::kFloat)).save_export(dir + "/other");
  EXPECT_EQ(eval("--preset tiny-qwen3 --device cpu --drafter " + dir + "/other --prompts " + dir + "/prompts.jsonl"), 1);
  EXPECT_TRUE(said("reads target layer 11")) << test::read_file(dir + "/out.log");
}

// On a GPU, the tiny target split into two stages there (a speculative decoder per stage, each on
// its own thread, the drafter on the last stage's device) gives the one-stage report, bf16. One
// sequence at once per decoder, so every step's shapes are the same in both runs.
TEST(DflashdEval, GpuTwoStagesOnOneGpuGiveTheOneStageReport) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = test::make_temp_dir("eval-gpu-stages");
  write_prompts(dir + "/prompts.jsonl", 6);
  const target::ModelConfig config = target::parse_model_config(target::preset_config_json("tiny-qwen3_5"), "tiny");
  config::DrafterConfig dc;
  dc.num_layers = 1;
  dc.mask_token_id = config.vocab_size - 1;
  const drafter::DrafterShape shape = drafter::shape_for_target(config, dc);
  drafter::Drafter(shape, at::TensorOptions().dtype(at::kFloat)).save_export(dir + "/drafter");
  std::map<std::string, nlohmann::json> reports;
  for (const std::string name : {"one", "two"}) {
    reports[name] = eval_tiny_on_gpu(dir, name, name == "one" ? "cuda:0" : "cuda:0,cuda:0", dir + "/drafter", 20);
  }
  EXPECT_EQ(reports["two"]["decoders"], 2);
  for (const char* key : {"new_tokens", "verify_steps", "acceptance_length", "acceptance_at_position"}) {
    EXPECT_EQ(reports["two"][key], reports["one"][key]) << key;
  }
  EXPECT_EQ(reports["one"]["new_tokens"], 6 * 20);
}

// On a GPU, the eval section of a run (its own thread and stream, the drafter's weights handed
// over from the training replica's stream) reports what `dflashd eval` reports for the drafter
// the run exported as best, on the same prompts one at a time: the hand-over is complete before
// the evaluation decodes, and the evaluation decodes as the command does.
TEST(RealAcceptance, GpuTheEvalSectionReportsWhatTheCommandReports) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const std::string dir = test::make_temp_dir("eval-section-gpu");
  write_prompts(dir + "/prompts.jsonl", 5);
  std::ofstream(dir + "/run.yaml") << "run: {name: eval-section-gpu, output_dir: " << dir << "/run}\n"
                                   << "target: {preset: tiny-qwen3_5, weights: random, dtype: bfloat16, "
                                   << "allow_slow_path: true}\n"
                                   << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511, "
                                   << "attention: efficient}\n"
                                   << "gpus: {device: cuda, target: [0], drafter: [0]}\n"
                                   << "data: {synthetic: {sequences: 64, min_length: 24, max_length: 48}}\n"
                                   << "train: {max_steps: 6, learning_rate: 0.005, anchors_per_sequence: 16}\n"
                                   << "eval: {every_steps: 6, prompts: " << dir << "/prompts.jsonl, "
                                   << "max_new_tokens: 24, max_batch: 1}\n"
                                   << "metrics: {listen: \"\"}\n";
  const std::string run = kBinary + " run -c " + dir + "/run.yaml > " + dir + "/run.log 2>&1";
  ASSERT_EQ(std::system(run.c_str()), 0) << test::read_file(dir + "/run.log");
  const std::string log = test::read_file(dir + "/run.log");
  EXPECT_NE(log.find("eval at step 6:"), std::string::npos) << log;
  const nlohmann::json section = nlohmann::json::parse(test::read_file(dir + "/run/export/best/eval.json"));
  const nlohmann::json command = eval_tiny_on_gpu(dir, "report", "cuda:0", dir + "/run/export/best", 24);
  EXPECT_EQ(section["step"], 6);
  EXPECT_EQ(section["prompts"], 5);
  for (const char* key : {"new_tokens", "verify_steps", "acceptance_length", "acceptance_at_position",
                          "outputs_differing_from_plain_greedy"}) {
    EXPECT_EQ(section[key], command[key]) << key << "\n" << section.dump() << "\n" << command.dump();
  }
  EXPECT_EQ(command["new_tokens"], 5 * 24);
}

}  // namespace
}  // namespace dflash
