#include "daemon/generate_command.h"

#include <ATen/ATen.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <functional>
#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "common/dir_lock.h"
#include "common/health.h"
#include "common/log.h"
#include "common/token_file.h"
#include "config/config.h"
#include "daemon/decode_args.h"
#include "daemon/exit_codes.h"
#include "daemon/http_endpoint.h"
#include "daemon/signals.h"
#include "decode/eval.h"
#include "decode/generation.h"
#include "pipeline/replicas.h"
#include "target/incremental.h"
#include "target/model_config.h"

namespace dflash::daemon {
namespace {

constexpr const char* kHelp = R"(Usage: dflashd generate (--target DIR | --preset NAME) --prompts FILE.jsonl --out DIR
                        [--max-new-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S]
                        [--stop-token-ids 1,2] [--max-batch N] [--shard-size N] [--truncated skip|keep]
                        [-c CONFIG] [--device cpu|cuda:N[,cuda:M...]] [--dtype bfloat16|float32|float8]
                        [--state-dtype float32|bfloat16] [--random-weights]
                        [--target-seed S] [--allow-slow-path] [--metrics HOST:PORT] [--log-every SECONDS]

Regenerates training responses with the target: every prompt decoded by the target (plain
decoding, continuous batching: --max-batch sequences at once per decoder, a finished
sequence's place taking the next prompt), written as training samples to shards in --out.

  --target DIR        the target, a Hugging Face model directory (every layer is loaded)
  --preset NAME       or a built-in tiny target with random weights (tests, demos)
  --prompts FILE      token JSON Lines, one prompt per line: {"input_ids": [...]} (tools/prepare_data.py
                      --prompts-only renders conversations up to the assistant turn); a line with a
                      loss_mask is a prompt up to its first supervised token
  --out DIR           shards shard-NNNNNN.jsonl, each committed with a marker shard-NNNNNN.done;
                      output lines: {"input_ids": prompt + response, "loss_mask": 1 on the response,
                      "prompt_index", "finish_reason": "stop" | "length"}. A run's data.paths reads DIR.
                      Run again after a crash or a stop: it continues, and every prompt appears once.
  --max-new-tokens N  per prompt (2048); a response that reaches it, or the target's context
                      (max_position_embeddings), is truncated ("length")
  --truncated         skip (the default: counted, not written) or keep truncated responses
  --temperature T     0 (greedy, the default) or the sampling temperature, with --top-p (1) and
  --top-k K           --top-k (0: all); --seed S (0): prompt i samples from its own stream, seeded
                      from S and i, so the output does not depend on batching, replicas or restarts
  --stop-token-ids    token ids that end a response (the target's end-of-turn ids)
  --max-batch N       sequences decoded at once per decoder (64): a replica on one GPU runs one
                      decoder, a replica split over S GPUs S (each on its own thread, so that all
                      its stages work at once)
  --shard-size N      samples per committed shard (256)
  -c CONFIG           a dflashd config: its target (unless --target / --preset), target.dtype and
                      target.decode_state_dtype, gpus.device and gpus.target (one replica per
                      entry; [[0, 1]]: one replica split into pipeline stages over GPUs 0 and 1),
                      train.seed (random weights), metrics.listen and metrics.log_every_seconds
  --device, --dtype   without -c: one replica; cuda:0 and bfloat16 when a GPU is visible, else cpu, float32;
                      --device cuda:0,cuda:1 splits the target into pipeline stages over those GPUs
                      (a target bigger than one GPU)
  --state-dtype       the GatedDeltaNet states between steps: float32 (the default, as transformers) or
                      bfloat16 (half their memory and a decode step's state traffic, as vLLM keeps
                      them by default; the rule runs in fp32 either way)
  --metrics HOST:PORT serve /metrics and /healthz (dflashd_generate_*)
  --log-every S       seconds between progress lines (30)

SIGTERM or SIGINT: no new prompts start; those in flight finish and are committed; exit 0.
Exits 0, 2 on a bad command line, 1 when the inputs cannot be used (the message names the file).
)";

struct GenerateArgs {
  TargetArgs target;
  std::string prompts, out, config_path, metrics;
  int64_t max_batch = 64;
  int64_t shard_size = 256;
  double log_every = 30;
  bool keep_truncated = false;
  bool log_every_given = false;
  decode::GenerateSettings settings;
};

// An exit code when the command ends here (help, bad usage).
std::optional<int> parse_generate_args(const std::vector<std::string>& args, GenerateArgs* a) {
  a->settings.max_new_tokens = 2048;
  auto usage = [](const std::string& message) {
    std::cerr << "dflashd generate: " << message << "\n\n" << kHelp;
    return exit_code::kUsage;
  };
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    if (k == "--help" || k == "-h") return std::cout << kHelp, exit_code::kOk;
    if (k == "--random-weights" || k == "--allow-slow-path") {
      (k == "--random-weights" ? a->target.random_weights : a->target.allow_slow_path) = true;
      continue;
    }
    if (i + 1 >= args.size()) return usage(k + (k.rfind("-", 0) == 0 ? " needs a value" : ": unexpected argument"));
    const std::string& v = args[++i];
    bool ok = true;
    if (parse_target_option(k, v, &a->target, &ok) || parse_decoding_option(k, v, &a->settings, &a->max_batch, &ok)) {
    } else if (k == "--prompts") {
      a->prompts = v;
    } else if (k == "--out") {
      a->out = v;
    } else if (k == "-c" || k == "--config") {
      a->config_path = v;
    } else if (k == "--metrics") {
      a->metrics = v;
    } else if (k == "--shard-size") {
      ok = parse_number(v, &a->shard_size) && a->shard_size > 0;
    } else if (k == "--log-every") {
      ok = parse_number(v, &a->log_every) && a->log_every > 0;
      a->log_every_given = true;
    } else if (k == "--truncated") {
      ok = v == "skip" || v == "keep";
      a->keep_truncated = v == "keep";
    } else {
      return usage("unknown option " + k);
    }
    if (!ok) {
      std::cerr << "dflashd generate: " << k << ": '" << v << "' is not a valid value\n";
      return exit_code::kUsage;
    }
  }
  if (a->prompts.empty() || a->out.empty()) return usage("--prompts and --out are required");
  if (!a->target.dir.empty() && !a->target.preset.empty()) return usage("give one of --target and --preset");
  if (a->target.dir.empty() && a->target.preset.empty() && a->config_path.empty()) {
    return usage("one of --target, --preset and -c (the config's target) is required");
  }
  if (!a->config_path.empty() && !a->target.device_text.empty()) {
    return usage("--device and -c exclude each other: the config's gpus section places the replicas");
  }
  try {
    decode::check_sampling(a->settings.sampling);
  } catch (const std::invalid_argument& e) {
    return usage(e.what());
  }
  return std::nullopt;
}

// The prompts of a token file, every id checked against the vocabulary and every length against
// the context (FILE:LINE on a bad one).
std::vector<std::vector<int64_t>> read_prompts(const std::string& path, const target::ModelConfig& target) {
  std::vector<std::vector<int64_t>> prompts;
  for (const TokenSample& s : read_token_file(path)) {
    std::vector<int64_t> prompt = decode::prompt_of(s);
    const std::string where = path + ":" + std::to_string(s.line);
    if (prompt.empty()) throw std::runtime_error(where + ": no prompt (empty, or supervised from its first token)");
    try {
      decode::check_prompt(prompt, target);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(where + ": " + e.what());
    }
    prompts.push_back(std::move(prompt));
  }
  if (prompts.empty()) throw std::runtime_error(path + ": no prompts");
  return prompts;
}

// The target's dtype as the config says it (float8: FP8 projections).
std::string dtype_name(const target::TargetOptions& o) {
  return o.fp8_weights ? "float8" : o.dtype == at::kFloat ? "float32" : "bfloat16";
}

// What the output directory is generated from (ShardedOutput compares it on a restart): a
// restart in another precision would mix two targets' responses.
std::string job_description(const GenerateArgs& a, const target::TargetOptions& options,
                            const std::vector<std::vector<int64_t>>& prompts) {
  uint64_t checksum = 1469598103934665603ULL;  // FNV-1a over the prompts' ids and lengths
  auto mix = [&](uint64_t v) {
    for (int b = 0; b < 8; ++b) checksum = (checksum ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ULL;
  };
  for (const auto& p : prompts) {
    mix(p.size());
    for (int64_t id : p) mix(static_cast<uint64_t>(id));
  }
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(checksum));
  const decode::GenerateSettings& s = a.settings;
  nlohmann::ordered_json j;
  j["target"] = a.target.preset.empty() ? a.target.dir : "preset:" + a.target.preset;
  j["dtype"] = dtype_name(options);
  j["state_dtype"] = target::decode_state_dtype_name(options);
  j["prompts"] = prompts.size();
  j["prompts_checksum"] = hex;
  j["max_new_tokens"] = s.max_new_tokens;
  j["temperature"] = s.sampling.temperature;
  j["top_p"] = s.sampling.top_p;
  j["top_k"] = s.sampling.top_k;
  j["seed"] = s.seed;
  j["stop_token_ids"] = s.stop_token_ids;
  j["truncated"] = a.keep_truncated ? "keep" : "skip";
  return j.dump();
}

// The output directory for this job; says what it assumed of a record an older dflashd wrote.
decode::ShardedOutput open_output(const GenerateArgs& a, const target::TargetOptions& options,
                                  const std::vector<std::vector<int64_t>>& prompts) {
  const std::string job = job_description(a, options, prompts);
  decode::ShardedOutput out(a.out, job, a.shard_size, a.keep_truncated);
  if (!out.unrecorded().empty()) {
    std::string keys;
    for (const std::string& k : out.unrecorded()) keys += (keys.empty() ? "" : ", ") + k;
    log::warn("generate: {}/generate.json did not record {} (written by an older dflashd; everything it records "
              "matches): continuing as this run's {}; the record now holds them",
              a.out, keys, job);
  }
  return out;
}

// The replicas' stages: one replica per entry of the config's gpus.target (a list of several ids:
// the target split into pipeline stages over those GPUs), or the --device list as one replica.
std::vector<std::vector<target::TargetOptions>> replica_stages(const std::optional<config::Config>& config,
                                                               const std::vector<target::TargetOptions>& stages) {
  if (!config) return {stages};
  std::vector<std::vector<target::TargetOptions>> out;
  for (const std::vector<int>& ids : config->gpus.target_replicas) {
    std::vector<target::TargetOptions> replica;
    for (const int id : ids) {
      replica.push_back(stages.front());
      replica.back().device = pipeline::device_for(config->gpus, id);
    }
    out.push_back(std::move(replica));
  }
  return out;
}

struct GenerateMetrics {
  prometheus::Gauge *total, *done, *tokens_per_second, *eta;
  prometheus::Counter* new_tokens;
};

GenerateMetrics register_metrics(prometheus::Registry& registry, const target::TargetOptions& options) {
  prometheus::BuildGauge()
      .Name("dflashd_generate_target_info")
      .Help("The precision the target decodes in, as labels (dtype: its weights and activations; state_dtype: its "
            "GatedDeltaNet states between steps); the value is always 1")
      .Register(registry)
      .Add({{"dtype", dtype_name(options)}, {"state_dtype", target::decode_state_dtype_name(options)}})
      .Set(1);
  auto& prompts = prometheus::BuildGauge()
                      .Name("dflashd_generate_prompts")
                      .Help("Prompts of the job: total, and done (committed, this process and earlier ones)")
                      .Register(registry);
  return {&prompts.Add({{"state", "total"}}), &prompts.Add({{"state", "done"}}),
          &prometheus::BuildGauge()
               .Name("dflashd_generate_tokens_per_second")
               .Help("New tokens per second decoded by this process")
               .Register(registry)
               .Add({}),
          &prometheus::BuildGauge()
               .Name("dflashd_generate_eta_seconds")
               .Help("Seconds to the end of the job at the current rate")
               .Register(registry)
               .Add({}),
          &prometheus::BuildCounter()
               .Name("dflashd_generate_new_tokens_total")
               .Help("New tokens decoded by this process")
               .Register(registry)
               .Add({})};
}

std::string duration_text(double seconds) {
  if (!std::isfinite(seconds)) return "unknown";
  const long s = static_cast<long>(seconds);
  char text[32];
  std::snprintf(text, sizeof text, "%ldh%02ldm%02lds", s / 3600, s / 60 % 60, s % 60);
  return text;
}

// -c FILE: the config's target, dtype, seed and metrics where the command line gives none.
std::optional<config::Config> apply_config(GenerateArgs* a) {
  if (a->config_path.empty()) return std::nullopt;
  config::Config config = config::load_file(a->config_path);
  if (a->target.dir.empty() && a->target.preset.empty()) {
    a->target.dir = config.target.path;
    a->target.preset = config.target.preset;
    a->target.random_weights = config.target.weights == config::TargetWeights::random;
    a->target.allow_slow_path = a->target.allow_slow_path || config.target.allow_slow_path;
  }
  if (a->target.dtype_text.empty()) {
    const config::ModelDtype d = config.target.dtype;
    a->target.dtype_text = d == config::ModelDtype::float32 || d == config::ModelDtype::float8 ? config::name_of(d) : "bfloat16";
  }
  if (a->target.state_dtype_text.empty()) a->target.state_dtype_text = config::name_of(config.target.decode_state_dtype);
  a->target.target_seed = config.train.seed;
  if (a->metrics.empty()) a->metrics = config.metrics.listen;
  if (!a->log_every_given) a->log_every = config.metrics.log_every_seconds;
  return config;
}

// Per replica its target and one decoder per stage, each on its own thread: a step runs the
// stages in turn, so while one decoder's step is on a stage another's is on the next. Members
// in the order they depend on each other (decoders on targets, targets on models).
struct GenerateReplicas {
  std::vector<std::unique_ptr<target::StagedTarget>> models;
  std::vector<std::unique_ptr<target::IncrementalTarget>> targets;
  std::vector<std::unique_ptr<decode::PlainDecoder>> decoders;  // one per replica
  std::vector<const decode::Decoder*> running;                    // one per stage: a thread each
  std::string places;  // where each replica's stages are, for the log
};

GenerateReplicas load_replicas(const GenerateArgs& a, const std::optional<config::Config>& config,
                               const std::vector<target::TargetOptions>& stages) {
  GenerateReplicas r;
  for (const std::vector<target::TargetOptions>& replica : replica_stages(config, stages)) {
    r.models.push_back(load_decoding_target(a.target, replica));
    r.targets.push_back(std::make_unique<target::IncrementalTarget>(r.models.back()->models()));
    r.decoders.push_back(std::make_unique<decode::PlainDecoder>(*r.targets.back()));
    // A decoder is stateless: the one object runs on each stage's decoder thread.
    r.running.insert(r.running.end(), replica.size(), r.decoders.back().get());
    r.places += (r.places.empty() ? "" : ", ") + r.targets.back()->places();
  }
  return r;
}

// Warns about prompts whose responses the target's context ends before --max-new-tokens, and
// refuses a batch per decoder that does not fit a replica's GPUs (before the output is opened).
void check_prompts_fit(const GenerateArgs& a, const GenerateReplicas& r,
                       const std::vector<std::vector<int64_t>>& prompts) {
  const target::ModelConfig& target_config = r.targets[0]->config();
  size_t longest = 0;
  int64_t capped = 0;
  const int64_t context = target_config.max_position_embeddings;
  for (const std::vector<int64_t>& p : prompts) {
    longest = std::max(longest, p.size());
    capped += context > 0 && static_cast<int64_t>(p.size()) + a.settings.max_new_tokens > context ? 1 : 0;
  }
  if (capped > 0) {
    log::warn("generate: {} prompt(s) reach the target's context ({} tokens, {}: max_position_embeddings) before "
              "--max-new-tokens: their responses end there, as truncated (\"length\")",
              capped, context, target_config.source);
  }
  for (const auto& target : r.targets) {
    const int64_t decoders = static_cast<int64_t>(target->stage_count());
    check_decoding_batch("dflashd generate", *target,
                         std::min<int64_t>(a.max_batch * decoders, static_cast<int64_t>(prompts.size())), decoders,
                         static_cast<int64_t>(longest) + a.settings.max_new_tokens, 1);
  }
}

// The metrics endpoint (--metrics): the job's registry, healthy while the job runs.
std::unique_ptr<HttpEndpoint> start_endpoint(const std::string& listen,
                                             const std::shared_ptr<prometheus::Registry>& registry) {
  if (listen.empty()) return nullptr;
  auto health = std::make_shared<Health>();
  health->set_healthy("generate");
  const std::vector<std::shared_ptr<prometheus::Collectable>> collectables{registry};
  return std::make_unique<HttpEndpoint>(listen, collectables, health);
}

// What run_generation reports every --log-every seconds and at the end: the log line and the
// metrics. The rate is over the tokens decoded so far, sequences in flight included (finished
// prompts alone would show 0 until the first long response ends).
std::function<void(const decode::GenerationProgress&)> progress_reporter(const GenerateMetrics& metrics,
                                                                          int64_t max_new_tokens) {
  auto counted_tokens = std::make_shared<int64_t>(0);  // new tokens already added to the counter
  return [metrics, max_new_tokens, counted_tokens](const decode::GenerationProgress& p) {
    const double rate = p.decoded_per_second();
    const int64_t done = p.done_before + p.committed;
    const double eta = decode::generation_eta_seconds(p, max_new_tokens);
    metrics.done->Set(static_cast<double>(done));
    metrics.tokens_per_second->Set(rate);
    metrics.eta->Set(std::isfinite(eta) ? eta : -1);
    metrics.new_tokens->Increment(static_cast<double>(p.new_tokens - *counted_tokens));
    *counted_tokens = p.new_tokens;
    log::info("generate: {} / {} prompts ({} %), {} new tokens/s, ETA {}", p.done_before + p.finished, p.total,
              log::fixed(100.0 * static_cast<double>(p.done_before + p.finished) / static_cast<double>(p.total), 1),
              log::fixed(rate, 1), duration_text(eta));
  };
}

int generate(const GenerateArgs& a_in) {
  GenerateArgs a = a_in;
  const std::optional<config::Config> config = apply_config(&a);
  const std::optional<std::vector<target::TargetOptions>> stages = target_options("generate", a.target);
  if (!stages) return exit_code::kUsage;
  const target::TargetOptions& base = stages->front();
  // Signals first: every thread started later inherits the blocked mask.
  std::atomic<bool> stop{false};
  SignalWatcher signals([&](int) { stop.store(true); }, [] {});

  const GenerateReplicas replicas = load_replicas(a, config, *stages);
  const target::ModelConfig& target_config = replicas.targets[0]->config();
  const std::vector<std::vector<int64_t>> prompts = read_prompts(a.prompts, target_config);
  check_stop_tokens("--stop-token-ids", a.settings.stop_token_ids, target_config.vocab_size);
  check_prompts_fit(a, replicas, prompts);
  const DirectoryLock lock(a.out, "dflashd generate of " + a.prompts);  // one writer of the shards
  decode::ShardedOutput out = open_output(a, base, prompts);
  log::info("generate: {} prompts from {}, {} done before{}; {} replica(s) on {}, {} decoder(s), {} sequences at once "
            "each, target {} with {} GatedDeltaNet states; {}, up to {} new tokens, truncated responses {}; output {}",
            prompts.size(), a.prompts, out.done_before().size(),
            out.removed_uncommitted() > 0 ? " (" + std::to_string(out.removed_uncommitted()) + " uncommitted shard(s) removed)" : "",
            replicas.targets.size(), replicas.places, replicas.running.size(), a.max_batch, dtype_name(base),
            target::decode_state_dtype_name(base),
            decode::describe(a.settings), a.settings.max_new_tokens, a.keep_truncated ? "kept" : "skipped", a.out);

  auto registry = std::make_shared<prometheus::Registry>();
  const GenerateMetrics metrics = register_metrics(*registry, base);
  metrics.total->Set(static_cast<double>(prompts.size()));
  metrics.done->Set(static_cast<double>(out.done_before().size()));
  const std::unique_ptr<HttpEndpoint> endpoint = start_endpoint(a.metrics, registry);
  decode::run_generation(replicas.running, prompts, a.settings, a.max_batch, out, stop, a.log_every,
                         progress_reporter(metrics, a.settings.max_new_tokens));
  const int64_t total_done = static_cast<int64_t>(out.done_before().size()) + out.committed();
  log::info("generate: {} this run: {} prompts, {} samples written, {} truncated responses skipped, {} new tokens; {} / "
            "{} prompts in {}{}",
            stop.load() ? "stopped" : "finished", out.committed(), out.written(), out.skipped_truncated(),
            out.new_tokens(), total_done, prompts.size(), a.out,
            total_done < static_cast<int64_t>(prompts.size()) ? " (run the same command again to continue)" : "");
  return exit_code::kOk;
}

}  // namespace

int command_generate(const std::vector<std::string>& args) {
  GenerateArgs a;
  if (const std::optional<int> code = parse_generate_args(args, &a)) return *code;
  try {
    return generate(a);
  } catch (const std::exception& e) {
    log::error("dflashd generate: {}", e.what());
    log::flush();
    return exit_code::kFailure;
  }
}

}  // namespace dflash::daemon
