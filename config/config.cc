// config.cc: the schema (which keys exist, their types, ranges and defaults) and the checks
// across keys. The defaults themselves live in config.h's struct initialisers.
#include "config/config.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "config/yaml_reader.h"

namespace dflash::config {

std::string Diagnostic::str() const {
  if (position.line <= 0) return file + ": " + message;
  return file + ":" + std::to_string(position.line) + ":" + std::to_string(position.column) + ": " + message;
}

namespace {

std::string join_messages(const std::vector<Diagnostic>& diagnostics) {
  std::string out;
  for (const auto& d : diagnostics) out += (out.empty() ? "" : "\n") + d.str();
  return out;
}

template <class T>
Check<T> at_least(T minimum) {
  return [minimum](const T& v) -> std::string {
    if (v >= minimum) return "";
    std::ostringstream s;
    s << "must be >= " << minimum << ", got " << v;
    return s.str();
  };
}

template <class T>
Check<T> between(T low, T high) {
  return [low, high](const T& v) -> std::string {
    if (v >= low && v <= high) return "";
    std::ostringstream s;
    s << "must be in [" << low << ", " << high << "], got " << v;
    return s.str();
  };
}

template <class T>
Check<T> positive() {
  return [](const T& v) -> std::string {
    if (v > 0) return "";
    std::ostringstream s;
    s << "must be > 0, got " << v;
    return s.str();
  };
}

Check<std::vector<int>> non_negative_ids() {
  return [](const std::vector<int>& ids) -> std::string {
    for (int id : ids)
      if (id < 0) return "ids must be >= 0, got " + std::to_string(id);
    return "";
  };
}

Check<std::vector<std::vector<int>>> replica_ids() {
  return [](const std::vector<std::vector<int>>& replicas) -> std::string {
    for (const std::vector<int>& ids : replicas) {
      if (ids.empty()) return "a replica needs at least one GPU, got []";
      for (int id : ids)
        if (id < 0) return "ids must be >= 0, got " + std::to_string(id);
    }
    return "";
  };
}

void read_run(MapReader m, RunConfig* c) {
  m.field("name", &c->name);
  m.field("output_dir", &c->output_dir);
  m.field("max_seconds", &c->max_seconds, at_least(0.0));
  m.done();
}

void read_target(MapReader m, TargetConfig* c) {
  m.field("path", &c->path);
  m.choice("preset", &c->preset, {"tiny-qwen3_5", "tiny-qwen3_next", "tiny-qwen3", "tiny-llama"});
  m.choice<TargetWeights>("weights", &c->weights, {{"checkpoint", TargetWeights::checkpoint}, {"random", TargetWeights::random}});
  m.choice<ModelDtype>("dtype", &c->dtype,
                       {{"bfloat16", ModelDtype::bfloat16},
                        {"float16", ModelDtype::float16},
                        {"float32", ModelDtype::float32},
                        {"float8", ModelDtype::float8}});
  m.choice<ModelDtype>("decode_state_dtype", &c->decode_state_dtype,
                       {{"float32", ModelDtype::float32}, {"bfloat16", ModelDtype::bfloat16}});
  m.field("allow_slow_path", &c->allow_slow_path);
  m.done();
}

void read_drafter(MapReader m, DrafterConfig* c) {
  m.field("init", &c->init);
  m.field("num_layers", &c->num_layers, between(1, 64));
  m.field("block_size", &c->block_size, between(2, 64));
  m.field("target_layer_ids", &c->target_layer_ids, non_negative_ids());
  m.field("num_target_features", &c->num_target_features, between(1, 32));
  m.field("layer_types", &c->layer_types, Check<std::vector<std::string>>([](const std::vector<std::string>& types) -> std::string {
    for (const std::string& t : types) {
      if (t != "full_attention" && t != "sliding_attention") {
        return "each entry is full_attention or sliding_attention, got '" + t + "'";
      }
    }
    return "";
  }));
  m.field("sliding_window", &c->sliding_window, positive<int>());
  m.field("mask_token_id", &c->mask_token_id, at_least<int64_t>(0));
  m.field("rope_theta", &c->rope_theta, positive<double>());
  m.field("intermediate_size", &c->intermediate_size, positive<int>());
  m.field("num_attention_heads", &c->num_attention_heads, positive<int>());
  m.field("num_key_value_heads", &c->num_key_value_heads, positive<int>());
  m.field("head_dim", &c->head_dim, positive<int>());
  m.choice<AttentionChoice>("attention", &c->attention,
                            {{"auto", AttentionChoice::automatic},
                             {"kernels", AttentionChoice::kernels},
                             {"efficient", AttentionChoice::efficient},
                             {"math", AttentionChoice::math}});
  m.done();
}

void read_gpus(MapReader m, GpuConfig* c) {
  m.choice<Device>("device", &c->device, {{"cuda", Device::cuda}, {"cpu", Device::cpu}});
  m.field("target", &c->target_replicas, replica_ids());
  c->target.clear();
  for (const std::vector<int>& replica : c->target_replicas) c->target.insert(c->target.end(), replica.begin(), replica.end());
  m.field("drafter", &c->drafter, non_negative_ids());
  m.choice<SharedGpu>("shared_gpu", &c->shared_gpu, {{"turns", SharedGpu::turns}, {"concurrent", SharedGpu::concurrent}});
  m.done();
}

void read_distributed(MapReader m, DistributedConfig* c) {
  m.field("from_env", &c->from_env);
  m.field("nodes", &c->nodes, between(1, 4096));
  m.field("node_rank", &c->node_rank, between(0, 4095));
  m.field("master_addr", &c->master_addr);
  m.field("master_port", &c->master_port, between(1, 65535));
  m.field("timeout_seconds", &c->timeout_seconds, positive<double>());
  m.done();
}

void read_queues(MapReader m, QueueConfig* c) {
  m.field("samples", &c->samples, between(1, 1 << 20));
  m.field("features", &c->features, between(1, 1024));
  m.field("feature_memory_budget_bytes", &c->feature_memory_budget_bytes, positive<int64_t>());
  m.done();
}

void read_data(MapReader m, DataConfig* c) {
  m.field("paths", &c->paths);
  MapReader s = m.map("synthetic");
  s.field("sequences", &c->synthetic.sequences, at_least<int64_t>(0));
  s.field("min_length", &c->synthetic.min_length, at_least(2));
  s.field("max_length", &c->synthetic.max_length, at_least(2));
  s.done();
  m.field("max_length", &c->max_length, at_least(2));
  m.field("min_supervised_tokens", &c->min_supervised_tokens, at_least(2));
  m.field("shuffle", &c->shuffle);
  m.field("seed", &c->seed);
  m.choice<OnMalformed>("on_malformed", &c->on_malformed, {{"error", OnMalformed::error}, {"skip", OnMalformed::skip}});
  m.field("eval_fraction", &c->eval_fraction, between(0.0, 0.5));
  m.done();
}

void read_eval(MapReader m, EvalConfig* c) {
  m.field("every_steps", &c->every_steps, at_least<int64_t>(0));
  m.field("prompts", &c->prompts);
  m.field("max_prompts", &c->max_prompts, between(1, 1 << 20));
  m.field("max_new_tokens", &c->max_new_tokens, between(1, 1 << 20));
  m.field("max_batch", &c->max_batch, between(1, 4096));
  m.field("temperature", &c->temperature, at_least(0.0));
  m.field("top_p", &c->top_p, between(1e-9, 1.0));
  m.field("top_k", &c->top_k, at_least(0));
  m.field("stop_token_ids", &c->stop_token_ids);
  m.done();
}

void read_train(MapReader m, TrainConfig* c) {
  m.field("anchors_per_sequence", &c->anchors_per_sequence, between(1, 65536));
  m.field("sequences_per_step", &c->sequences_per_step, between(1, 4096));
  m.field("grad_accumulation_steps", &c->grad_accumulation_steps, between(1, 65536));
  m.field("epochs", &c->epochs, positive<double>());
  m.field("max_steps", &c->max_steps, at_least<int64_t>(0));
  m.field("learning_rate", &c->learning_rate, positive<double>());
  m.field("min_learning_rate", &c->min_learning_rate, at_least(0.0));
  m.field("warmup_ratio", &c->warmup_ratio, between(0.0, 1.0));
  m.field("weight_decay", &c->weight_decay, at_least(0.0));
  m.field("adam_beta1", &c->adam_beta1, between(0.0, 0.999999));
  m.field("adam_beta2", &c->adam_beta2, between(0.0, 0.999999));
  m.field("adam_epsilon", &c->adam_epsilon, positive<double>());
  m.field("grad_clip_norm", &c->grad_clip_norm, at_least(0.0));
  m.field("loss_gamma", &c->loss_gamma, positive<double>());
  m.field("lm_head_chunk_blocks", &c->lm_head_chunk_blocks, between(1, 65536));
  m.field("activation_checkpointing", &c->activation_checkpointing);
  m.field("seed", &c->seed);
  m.field("deterministic", &c->deterministic);
  m.choice<OnNonfinite>("on_nonfinite", &c->on_nonfinite, {{"skip", OnNonfinite::skip}, {"stop", OnNonfinite::stop}});
  m.done();
}

void read_checkpoint(MapReader m, CheckpointConfig* c) {
  m.field("dir", &c->dir);
  m.field("every_steps", &c->every_steps, at_least<int64_t>(0));
  m.field("every_minutes", &c->every_minutes, at_least(0.0));
  m.field("keep_last", &c->keep_last, at_least(1));
  m.field("resume", &c->resume);
  m.field("stop_timeout_seconds", &c->stop_timeout_seconds, positive<double>());
  m.done();
}

void read_workers(MapReader m, WorkerConfig* c) {
  m.field("stall_seconds", &c->stall_seconds, positive<double>());
  m.choice<OnFailure>("on_failure", &c->on_failure, {{"stop", OnFailure::stop}, {"restart", OnFailure::restart}});
  m.field("max_restarts", &c->max_restarts, at_least(0));
  m.field("skip_sample_after_failures", &c->skip_sample_after_failures, at_least(0));
  m.done();
}

void read_metrics(MapReader m, MetricsConfig* c) {
  m.field<std::string>("listen", &c->listen, [](const std::string& v) -> std::string {
    std::string host;
    int port = 0;
    if (v.empty() || split_host_port(v, &host, &port)) return "";
    return "'" + v + "' is not host:port (e.g. 127.0.0.1:9400; port 1-65535)";
  });
  m.field("log_every_seconds", &c->log_every_seconds, positive<double>());
  m.field("throughput_window_seconds", &c->throughput_window_seconds, positive<double>());
  m.field("peak_flops_per_gpu", &c->peak_flops_per_gpu, positive<double>());
  m.done();
}

void read_logging(MapReader m, LoggingConfig* c) {
  m.choice("level", &c->level, {"trace", "debug", "info", "warn", "error", "critical", "off"});
  m.choice("format", &c->format, {"text", "json"});
  m.field("file", &c->file);
  m.done();
}

// The target: a path or a preset, and what a preset allows.
void check_target(const Config& c, Diagnostics* d) {
  auto at = [&](const std::string& key) { return c.position_of(key); };

  if (c.target.path.empty() == c.target.preset.empty()) {
    d->add(c.target.path.empty() ? at("target") : at("target.preset"),
           c.target.path.empty() ? "target: give target.path (a Hugging Face model directory) or target.preset"
                                 : "target: target.path and target.preset exclude each other");
  }
  if (!c.target.preset.empty() && c.positions.count("target.weights") && c.target.weights != TargetWeights::random) {
    d->add(at("target.weights"), "target.weights: a preset has no checkpoint; use weights: random");
  }
}

// The GPU groups: ids in each group, and roles on one GPU that cannot take turns.
void check_gpus(const Config& c, Diagnostics* d) {
  auto at = [&](const std::string& key) { return c.position_of(key); };

  for (const char* group : {"target", "drafter"}) {
    // Each id with where it was written: gpus.drafter[i], gpus.target[r] or gpus.target[r][j].
    std::vector<std::pair<int, std::string>> ids;
    const std::string key = std::string("gpus.") + group;
    if (std::string(group) == "target") {
      for (size_t r = 0; r < c.gpus.target_replicas.size(); ++r) {
        const std::vector<int>& replica = c.gpus.target_replicas[r];
        for (size_t j = 0; j < replica.size(); ++j) {
          const std::string nested = key + "[" + std::to_string(r) + "][" + std::to_string(j) + "]";
          ids.push_back({replica[j], c.positions.count(nested) ? nested : key + "[" + std::to_string(r) + "]"});
        }
      }
    } else {
      for (size_t i = 0; i < c.gpus.drafter.size(); ++i) ids.push_back({c.gpus.drafter[i], key + "[" + std::to_string(i) + "]"});
    }
    if (ids.empty()) d->add(at(key), key + ": at least one id is needed");
    std::set<int> seen;
    for (const auto& [id, where] : ids) {
      if (!seen.insert(id).second) d->add(at(where), key + ": GPU " + std::to_string(id) + " is listed twice in one group");
    }
  }

  // A target replica in stages runs its stages at once: no turns with a drafter on its GPUs.
  if (c.gpus.device == Device::cuda && c.gpus.shared_gpu == SharedGpu::turns) {
    for (size_t r = 0; r < c.gpus.target_replicas.size(); ++r) {
      const std::vector<int>& ids = c.gpus.target_replicas[r];
      for (int id : ids) {
        if (ids.size() > 1 && std::count(c.gpus.drafter.begin(), c.gpus.drafter.end(), id) > 0) {
          d->add(at("gpus.target[" + std::to_string(r) + "]"),
                 "gpus.target[" + std::to_string(r) + "]: GPU " + std::to_string(id) +
                     " holds a stage of a target replica in stages and a drafter; their roles cannot take turns "
                     "(the stages run at once): set gpus.shared_gpu: concurrent, or give the drafter other GPUs");
          break;
        }
      }
    }
  }
}

// The nodes, the drafter, the data and the training schedule.
void check_training(const Config& c, Diagnostics* d) {
  auto at = [&](const std::string& key) { return c.position_of(key); };

  if (c.distributed.node_rank >= c.distributed.nodes) {
    d->add(at("distributed.node_rank"), "distributed.node_rank: " + std::to_string(c.distributed.node_rank) +
                                            " is not below distributed.nodes (" + std::to_string(c.distributed.nodes) + ")");
  }

  const auto& layer_ids = c.drafter.target_layer_ids;
  for (size_t i = 1; i < layer_ids.size(); ++i) {
    if (layer_ids[i] <= layer_ids[i - 1]) {
      d->add(at("drafter.target_layer_ids[" + std::to_string(i) + "]"),
             "drafter.target_layer_ids: ids must be strictly ascending (the fc input order is ascending)");
      break;
    }
  }

  const bool synthetic = c.data.synthetic.sequences > 0;
  if (synthetic == !c.data.paths.empty()) {
    d->add(at("data"), synthetic ? "data: data.paths and data.synthetic exclude each other"
                                 : "data: give data.paths (JSONL files or directories) or data.synthetic.sequences");
  }
  if (c.data.synthetic.min_length > c.data.synthetic.max_length) {
    d->add(at("data.synthetic.min_length"), "data.synthetic.min_length must be <= data.synthetic.max_length");
  }
  if (c.data.min_supervised_tokens > c.data.max_length) {
    d->add(at("data.min_supervised_tokens"), "data.min_supervised_tokens must be <= data.max_length");
  }
  if (c.train.min_learning_rate > c.train.learning_rate) {
    d->add(at("train.min_learning_rate"), "train.min_learning_rate must be <= train.learning_rate");
  }
  if (!c.train.loss_gamma) {
    const int b = c.drafter.block_size;
    if (b != 16 && b != 10 && b != 8) {
      d->add(at("drafter.block_size"), "train.loss_gamma has a recipe default only for block sizes 16, 10 and 8; "
                                       "set train.loss_gamma for block size " + std::to_string(b));
    }
  }
  if (c.gpus.device == Device::cpu &&
      (c.drafter.attention == AttentionChoice::kernels || c.drafter.attention == AttentionChoice::efficient)) {
    d->add(at("drafter.attention"), std::string("drafter.attention: ") + name_of(c.drafter.attention) +
                                        " needs a GPU (gpus.device: cuda); on the CPU use auto or math");
  }
}

// Evaluation and checkpoint cadence.
void check_cadence(const Config& c, Diagnostics* d) {
  auto at = [&](const std::string& key) { return c.position_of(key); };

  if (c.eval.every_steps > 0 && c.eval.prompts.empty() == (c.data.eval_fraction == 0)) {
    d->add(at("eval"), "eval: every_steps needs prompts from exactly one of eval.prompts (a token JSONL file) and "
                       "data.eval_fraction (held-out training samples)");
  }
  if (c.eval.every_steps == 0 && (!c.eval.prompts.empty() || c.data.eval_fraction > 0)) {
    d->add(at(c.eval.prompts.empty() ? "data.eval_fraction" : "eval.prompts"),
           "eval prompts are set but eval.every_steps is 0: nothing would evaluate them");
  }
  if (c.checkpoint.every_steps == 0 && c.checkpoint.every_minutes == 0) {
    d->add(at("checkpoint"), "checkpoint: every_steps and every_minutes are both 0: the run would never checkpoint");
  }
}

// Checks that relate several keys. Each message names the keys and points at the first.
void check_contradictions(const Config& c, Diagnostics* d) {
  check_target(c, d);
  check_gpus(c, d);
  check_training(c, d);
  check_cadence(c, d);
}

}  // namespace

ConfigError::ConfigError(std::vector<Diagnostic> diagnostics)
    : std::runtime_error(join_messages(diagnostics)), diagnostics_(std::move(diagnostics)) {}

const char* name_of(Device device) { return device == Device::cuda ? "cuda" : "cpu"; }

const char* name_of(ModelDtype dtype) {
  switch (dtype) {
    case ModelDtype::bfloat16: return "bfloat16";
    case ModelDtype::float16: return "float16";
    case ModelDtype::float32: return "float32";
    case ModelDtype::float8: return "float8";
  }
  return "?";
}

const char* name_of(AttentionChoice attention) {
  switch (attention) {
    case AttentionChoice::automatic: return "auto";
    case AttentionChoice::kernels: return "kernels";
    case AttentionChoice::efficient: return "efficient";
    case AttentionChoice::math: return "math";
  }
  return "?";
}

int64_t bytes_of(ModelDtype dtype) { return dtype == ModelDtype::float32 ? 4 : 2; }

Position Config::position_of(const std::string& key_path) const {
  // The value itself, else the nearest enclosing section that was given.
  std::string key = key_path;
  while (true) {
    auto it = positions.find(key);
    if (it != positions.end()) return it->second;
    const size_t cut = key.find_last_of(".[");
    if (cut == std::string::npos) return {};
    key = key.substr(0, cut);
  }
}

double Config::loss_gamma() const {
  if (train.loss_gamma) return *train.loss_gamma;
  switch (drafter.block_size) {
    case 16: return 7;
    case 10: return 5;
    case 8: return 4;
    default: return 7;  // unreachable for a validated config: parse() demands loss_gamma then
  }
}

std::string Config::checkpoint_dir() const {
  return checkpoint.dir.empty() ? run.output_dir + "/checkpoints" : checkpoint.dir;
}

bool split_host_port(const std::string& listen, std::string* host, int* port) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == listen.size()) return false;
  std::string h = listen.substr(0, colon);
  if (h.size() >= 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  const std::string p = listen.substr(colon + 1);
  if (!std::all_of(p.begin(), p.end(), ::isdigit) || p.size() > 5) return false;
  const int value = std::stoi(p);
  if (value < 1 || value > 65535) return false;
  *host = h;
  *port = value;
  return true;
}

Config parse(std::string_view yaml_text, const std::string& file_name) {
  Diagnostics diagnostics(file_name);
  Config config;
  config.source = file_name;
  YAML::Node root;
  try {
    root = YAML::Load(std::string(yaml_text));
  } catch (const YAML::Exception& e) {
    diagnostics.add(e.mark, "YAML syntax error: " + e.msg);
    throw ConfigError(diagnostics.items());
  }
  if (!root.IsDefined() || root.IsNull()) {
    diagnostics.add(Position{}, "the file is empty; see `dflashd config default` for a complete example");
    throw ConfigError(diagnostics.items());
  }
  MapReader top(&diagnostics, &config.positions, root, "");
  read_run(top.map("run"), &config.run);
  read_target(top.map("target"), &config.target);
  read_drafter(top.map("drafter"), &config.drafter);
  read_gpus(top.map("gpus"), &config.gpus);
  read_distributed(top.map("distributed"), &config.distributed);
  read_queues(top.map("queues"), &config.queues);
  read_data(top.map("data"), &config.data);
  read_train(top.map("train"), &config.train);
  read_checkpoint(top.map("checkpoint"), &config.checkpoint);
  read_workers(top.map("workers"), &config.workers);
  read_metrics(top.map("metrics"), &config.metrics);
  read_eval(top.map("eval"), &config.eval);
  read_logging(top.map("logging"), &config.logging);
  top.done();
  if (!top.has("target")) diagnostics.add(top.position(), "target: required section (the frozen target model)");
  if (!top.has("data")) diagnostics.add(top.position(), "data: required section (the training data)");
  else check_contradictions(config, &diagnostics);

  if (!diagnostics.items().empty()) {
    std::vector<Diagnostic> sorted = diagnostics.items();
    std::stable_sort(sorted.begin(), sorted.end(), [](const Diagnostic& a, const Diagnostic& b) {
      return std::pair(a.position.line, a.position.column) < std::pair(b.position.line, b.position.column);
    });
    throw ConfigError(std::move(sorted));
  }
  return config;
}

Config load_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw ConfigError({Diagnostic{path, {}, "cannot read the config file: " + std::string(std::strerror(errno))}});
  std::stringstream text;
  text << in.rdbuf();
  return parse(text.str(), path);
}

Config load_default() { return parse(default_yaml(), "<embedded default>"); }

std::vector<Diagnostic> check_machine(const Config& config, const Machine& machine) {
  std::vector<Diagnostic> out;
  if (config.gpus.device != Device::cuda) return out;
  for (const char* group : {"target", "drafter"}) {
    const std::vector<int>& ids = std::string(group) == "target" ? config.gpus.target : config.gpus.drafter;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < machine.cuda_devices) continue;
      const std::string key = std::string("gpus.") + group + "[" + std::to_string(i) + "]";
      std::string have = machine.cuda_devices == 0 ? "this machine has no CUDA GPU (use gpus.device: cpu for a CPU run)"
                                                   : "this machine has GPUs 0.." + std::to_string(machine.cuda_devices - 1);
      out.push_back({config.source, config.position_of(key),
                     key + ": GPU " + std::to_string(ids[i]) + " does not exist; " + have});
    }
  }
  return out;
}

}  // namespace dflash::config
