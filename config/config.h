// config.h: the run description, one YAML file (schema documented in config/default.yaml and
// README), as plain nested structs.
//
// Parsing is strict: unknown keys (with "did you mean"), duplicate keys, wrong types,
// out-of-range values and contradictions are all collected and reported together as
// `file:line:col: message` (1-based), never only the first. A value the user must give (the
// target model, the data) has no default; everything else has a documented one.
//
// This library depends on nothing of the project (docs/architecture.md: config is read by all).
// Thread-safety: a Config is a value; parse once, then share it read-only.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dflash::config {

// Where a value came from, for messages that point at the file.
struct Position {
  int line = 0;    // 1-based; 0 = unknown
  int column = 0;  // 1-based
};

struct Diagnostic {
  std::string file;
  Position position;
  std::string message;
  std::string str() const;  // "file:line:col: message" (or "file: message" without a position)
};

// Thrown by the loaders with every problem found, in file order.
class ConfigError : public std::runtime_error {
 public:
  explicit ConfigError(std::vector<Diagnostic> diagnostics);
  const std::vector<Diagnostic>& diagnostics() const { return diagnostics_; }

 private:
  std::vector<Diagnostic> diagnostics_;
};

// The choices the code branches on, as enumerations (the config file's words in comments;
// name_of gives them back for messages and labels).
enum class Device { cuda, cpu };
enum class SharedGpu { turns, concurrent };    // a GPU in both groups: one role at a time, or overlapped
enum class OnFailure { stop, restart };        // workers.on_failure
enum class OnNonfinite { skip, stop };         // train.on_nonfinite
enum class OnMalformed { error, skip };        // data.on_malformed
enum class TargetWeights { checkpoint, random };  // target.weights: safetensors, or init from config.json
// target.dtype. float8: the projections block-scaled FP8 (target/fp8.h), activations and the rest bf16.
enum class ModelDtype { bfloat16, float16, float32, float8 };
enum class AttentionChoice { automatic, kernels, efficient, math };  // drafter.attention ("auto" is automatic)
const char* name_of(Device device);
const char* name_of(ModelDtype dtype);
const char* name_of(AttentionChoice attention);
int64_t bytes_of(ModelDtype dtype);  // per element of activations (and of weights but FP8 projections)

struct RunConfig {
  std::string name = "dflashd";
  std::string output_dir = "./dflashd-run";  // checkpoints and exports go below it
  double max_seconds = 0;                    // stop (with a checkpoint) after this long; 0 = no limit
};

struct TargetConfig {
  // Exactly one of: a Hugging Face model directory, or a built-in tiny preset (tests, demo).
  std::string path;
  std::string preset;               // "tiny-qwen3_5", "tiny-qwen3", "tiny-llama"
  TargetWeights weights = TargetWeights::checkpoint;
  ModelDtype dtype = ModelDtype::bfloat16;
  // The GatedDeltaNet states between decoding steps (evaluation, `dflashd generate -c`): float32
  // or bfloat16 (half their memory and traffic; the rule still runs in fp32).
  ModelDtype decode_state_dtype = ModelDtype::float32;
  bool allow_slow_path = false;     // permit the reference GatedDeltaNet path on a GPU
};

struct DrafterConfig {
  std::string init = "random";        // "random" or a directory of an exported drafter
  int num_layers = 5;
  int block_size = 16;
  std::vector<int> target_layer_ids;  // empty: the default rule of docs/recipe.md (5 ids spread evenly)
  int num_target_features = 5;        // K, when target_layer_ids is empty
  // Per layer "full_attention" or "sliding_attention" (empty: all full): a sliding layer's block
  // sees the last `sliding_window` positions of the context and its own block causally.
  std::vector<std::string> layer_types;
  std::optional<int> sliding_window;
  std::optional<int64_t> mask_token_id;  // default: the target family's (Qwen3 151669, Qwen3.5 248070)
  std::optional<double> rope_theta;      // default: the target's
  std::optional<int> intermediate_size;  // defaults: the target's shape
  std::optional<int> num_attention_heads;
  std::optional<int> num_key_value_heads;
  std::optional<int> head_dim;
  // The block attention's implementation: "auto" (the fused kernels on a GPU, refused there when
  // they cannot run; the portable split path on the CPU), "kernels", "efficient" (the split path on
  // PyTorch's memory-efficient kernels, GPU) or "math" (the portable split path).
  AttentionChoice attention = AttentionChoice::automatic;
};

struct GpuConfig {
  Device device = Device::cuda;    // cuda, or cpu (tests, demo: ids are then replica numbers)
  // Target replicas: an id is a replica on that GPU; a list of ids is one replica over those GPUs,
  // its layers in pipeline stages in list order (target/stages.h). `target` lists every id of
  // them in order.
  std::vector<std::vector<int>> target_replicas{{0}};
  std::vector<int> target{0};
  std::vector<int> drafter{0};
  // A GPU in both groups: "turns" runs one role at a time (each role's stage times are its own;
  // measured 3.5 % fewer tokens/s at the 27B shapes on an H200), "concurrent" lets both roles'
  // kernels overlap (stage times then include the contention).
  SharedGpu shared_gpu = SharedGpu::turns;
};

// Several processes, one per node, train one drafter: every node runs its own target and
// drafter groups; the drafter replicas of all nodes are data parallel (NCCL across nodes,
// rendezvous through a TCP store on node 0). With from_env the torchrun variables WORLD_SIZE,
// RANK, MASTER_ADDR and MASTER_PORT replace nodes, node_rank, master_addr and master_port.
struct DistributedConfig {
  bool from_env = false;
  int nodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;
  double timeout_seconds = 600;  // a node silent this long fails the run
};

struct QueueConfig {
  int samples = 64;                          // tokenised samples waiting for a target worker
  int features = 2;                          // target features waiting for a drafter worker
  int64_t feature_memory_budget_bytes = 16LL << 30;  // cap on features queued per drafter GPU
};

struct SyntheticData {
  int64_t sequences = 0;  // > 0 selects synthetic data instead of files
  int min_length = 32;
  int max_length = 96;
};

struct DataConfig {
  std::vector<std::string> paths;  // JSONL files or directories of shards
  SyntheticData synthetic;
  int max_length = 3072;           // longer samples are truncated
  int min_supervised_tokens = 2;   // samples with fewer loss-mask positions are skipped (counted)
  bool shuffle = true;
  int64_t seed = 0;
  OnMalformed on_malformed = OnMalformed::error;
  double eval_fraction = 0;        // share of the usable samples held out of training as eval prompts
};

struct TrainConfig {
  int anchors_per_sequence = 512;
  int sequences_per_step = 1;       // per drafter replica, per micro-step
  int grad_accumulation_steps = 1;
  double epochs = 6;
  int64_t max_steps = 0;            // 0: epochs decide
  double learning_rate = 6e-4;
  double min_learning_rate = 0;
  double warmup_ratio = 0.04;
  double weight_decay = 0;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_epsilon = 1e-8;
  double grad_clip_norm = 1.0;
  std::optional<double> loss_gamma;  // default: 7 / 5 / 4 for block size 16 / 10 / 8
  int lm_head_chunk_blocks = 128;
  // Drafter layers keep only their input for backward and run again in it (long sequences: the
  // activations of one layer instead of all; about a third more drafter compute).
  bool activation_checkpointing = false;
  int64_t seed = 0;
  bool deterministic = false;
  OnNonfinite on_nonfinite = OnNonfinite::skip;  // skip the step, or stop with a checkpoint
};

struct CheckpointConfig {
  std::string dir;                   // default: <run.output_dir>/checkpoints
  int64_t every_steps = 1000;
  double every_minutes = 30;
  int keep_last = 3;
  std::string resume = "auto";       // "auto" (newest complete), "never", or a checkpoint path
  double stop_timeout_seconds = 300; // SIGTERM to exit, final checkpoint included
};

struct WorkerConfig {
  double stall_seconds = 600;        // a worker silent this long is reported stalled
  OnFailure on_failure = OnFailure::stop;  // stop (checkpoint and exit), or restart
  int max_restarts = 3;
  // A sample whose processing raised this many exceptions (counted across restarts of the
  // process: the counts live in the checkpoint) is skipped and counted; 0 never skips.
  int skip_sample_after_failures = 2;
};

struct MetricsConfig {
  std::string listen = "127.0.0.1:9400";  // host:port; empty disables the HTTP endpoint
  double log_every_seconds = 30;
  double throughput_window_seconds = 60;
  double peak_flops_per_gpu = 790e12;     // measured H200 dense bf16 matmul rate
};

// Real acceptance during training (docs/operations.md "Evaluation"): speculative decoding of
// prompts with the target and the current drafter every `every_steps` steps, on the first target
// GPU, beside training. The prompts: a token JSONL file, or data.eval_fraction's held-out samples
// (each up to its first supervised token).
struct EvalConfig {
  int64_t every_steps = 0;  // 0: no evaluation during training
  std::string prompts;      // token JSONL; empty: data.eval_fraction's held-out samples
  int max_prompts = 16;
  int max_new_tokens = 128;
  int max_batch = 16;       // prompts decoded at once
  double temperature = 0;   // 0: greedy
  double top_p = 1;
  int top_k = 0;
  std::vector<int> stop_token_ids;
};

struct LoggingConfig {
  std::string level = "info";
  std::string format = "text";  // "text" or "json"
  std::string file;             // empty: standard error
};

struct Config {
  std::string source;  // file name, or "<embedded default>"
  RunConfig run;
  TargetConfig target;
  DrafterConfig drafter;
  GpuConfig gpus;
  DistributedConfig distributed;
  QueueConfig queues;
  DataConfig data;
  TrainConfig train;
  CheckpointConfig checkpoint;
  WorkerConfig workers;
  MetricsConfig metrics;
  EvalConfig eval;
  LoggingConfig logging;
  // Where each value was read ("gpus.target[1]" -> line/col), for later checks.
  std::map<std::string, Position> positions;

  Position position_of(const std::string& key_path) const;
  // Loss weight decay gamma: the configured one, else the recipe's for this block size.
  double loss_gamma() const;
  std::string checkpoint_dir() const;
};

// Parses and validates (everything that needs no machine). Throws ConfigError.
Config parse(std::string_view yaml_text, const std::string& file_name);
Config load_file(const std::string& path);
// The embedded default: tiny random models, synthetic data, CPU. Parses without error.
std::string_view default_yaml();
Config load_default();

// What the checks against the machine need to know about it.
struct Machine {
  int cuda_devices = 0;
};
// Problems of this config on this machine (GPU ids that do not exist, ...); empty when fine.
std::vector<Diagnostic> check_machine(const Config& config, const Machine& machine);

// Splits "host:port"; returns false when malformed.
bool split_host_port(const std::string& listen, std::string* host, int* port);

}  // namespace dflash::config
