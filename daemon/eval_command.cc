#include "daemon/eval_command.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>
#include <string>

#include "common/safetensors.h"
#include "daemon/decode_args.h"
#include "daemon/exit_codes.h"
#include "decode/eval.h"
#include "drafter/drafter_config.h"
#include "target/incremental.h"
#include "target/model.h"

namespace dflash::daemon {
namespace {

constexpr const char* kHelp = R"(Usage: dflashd eval (--target DIR | --preset NAME) --drafter EXPORT_DIR --prompts FILE.jsonl
                    [--max-new-tokens N] [--max-prompts N] [--max-batch N] [--temperature T] [--top-p P] [--top-k K]
                    [--seed S] [--stop-token-ids 1,2] [--device cpu|cuda:N[,cuda:M...]]
                    [--dtype bfloat16|float32|float8] [--state-dtype float32|bfloat16] [--no-baseline]
                    [--out REPORT.json] [--random-weights] [--target-seed S]
                    [--allow-slow-path]

Measures the drafter's real acceptance: speculative decoding of every prompt with the target
(z-lab dflash_generate's semantics: the drafter proposes a block, the target verifies it in one
step, the matched prefix plus one bonus token is kept; rejection sampling when --temperature > 0),
then plain decoding of the same prompts with the same target (the speed baseline, and the check
that greedy speculative decoding changed no output; --no-baseline skips it).

  --target DIR        the target, a Hugging Face model directory (every layer is loaded)
  --preset NAME       or a built-in tiny target with random weights (tiny-qwen3_5, tiny-qwen3_next,
                      tiny-qwen3, tiny-llama), seeded as a run with train.seed = --target-seed (0)
  --random-weights    --target DIR's config.json with random weights, as a run with
                      target.weights: random and train.seed = --target-seed
  --drafter DIR       an exported drafter (config.json + model.safetensors: `dflashd export`, or a
                      run's export/ directory)
  --prompts FILE      token JSON Lines: {"input_ids": [...]} is a prompt; a line with a loss_mask
                      is a prompt up to its first supervised token (held-out training samples work)
  --max-new-tokens N  per prompt (256)
  --max-prompts N     the first N prompts only (all)
  --max-batch N       prompts decoded at once per decoder (64): each round one batched target step
                      for all of them; a finished prompt's place takes the next one. A target on one
                      device runs one decoder, a target split over S GPUs S (each on its own thread,
                      so that all its stages work at once), as dflashd generate does
  --temperature T     0 (greedy, the default) or the sampling temperature, with --top-p (1) and
  --top-k             --top-k (0: all); --seed S seeds the sampling (0)
  --stop-token-ids    token ids that end a prompt's output
  --device            cuda:0 when a GPU is visible, else cpu; cuda:0,cuda:1 splits the target into
                      pipeline stages over those GPUs (the drafter runs on the last)
  --dtype             bfloat16 on a GPU, float32 on the CPU; float8: FP8 projections (target.dtype: float8)
  --state-dtype       the GatedDeltaNet states between steps: float32 (the default, as transformers) or
                      bfloat16 (half their memory and traffic, as vLLM keeps them by default)
  --out FILE          also write the report as JSON
  --allow-slow-path   accept a target whose GatedDeltaNet or MoE layers cannot run the fast path on
                      the GPU (as target.allow_slow_path)

Prints the acceptance length (tokens per target verify step), acceptance per block position,
and decode tokens/s of speculative and plain decoding. Exits 0, 2 on a bad command line, 1 when
the inputs cannot be used (the message names the file or the mismatch).
)";

struct EvalArgs {
  TargetArgs target;
  std::string drafter_dir, prompts, out;
  int64_t max_prompts = 0;
  int64_t max_batch = 64;
  bool baseline = true;
  decode::GenerateSettings settings;
};

// An exit code when the command ends here (help, bad usage).
std::optional<int> parse_eval_args(const std::vector<std::string>& args, EvalArgs* a) {
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& k = args[i];
    if (k == "--help" || k == "-h") return std::cout << kHelp, exit_code::kOk;
    if (k == "--no-baseline" || k == "--random-weights" || k == "--allow-slow-path") {
      (k == "--no-baseline" ? a->baseline : k == "--random-weights" ? a->target.random_weights : a->target.allow_slow_path) =
          k != "--no-baseline";
      continue;
    }
    if (i + 1 >= args.size()) {
      std::cerr << "dflashd eval: " << k << (k.rfind("--", 0) == 0 ? " needs a value" : ": unexpected argument") << "\n\n" << kHelp;
      return exit_code::kUsage;
    }
    const std::string& v = args[++i];
    bool ok = true;
    if (parse_target_option(k, v, &a->target, &ok) || parse_decoding_option(k, v, &a->settings, &a->max_batch, &ok)) {
    } else if (k == "--drafter") {
      a->drafter_dir = v;
    } else if (k == "--prompts") {
      a->prompts = v;
    } else if (k == "--out") {
      a->out = v;
    } else if (k == "--max-prompts") {
      ok = parse_number(v, &a->max_prompts) && a->max_prompts >= 0;
    } else {
      std::cerr << "dflashd eval: unknown option " << k << "\n\n" << kHelp;
      return exit_code::kUsage;
    }
    if (!ok) {
      std::cerr << "dflashd eval: " << k << ": '" << v << "' is not a valid value\n";
      return exit_code::kUsage;
    }
  }
  if (a->target.dir.empty() == a->target.preset.empty() || a->drafter_dir.empty() || a->prompts.empty()) {
    std::cerr << "dflashd eval: one of --target and --preset, and --drafter and --prompts are required\n\n" << kHelp;
    return exit_code::kUsage;
  }
  try {
    decode::check_sampling(a->settings.sampling);
  } catch (const std::invalid_argument& e) {
    std::cerr << "dflashd eval: " << e.what() << "\n";
    return exit_code::kUsage;
  }
  return std::nullopt;
}

void print_report(const decode::EvalReport& r) {
  const std::string decoders = r.decoders > 1 ? " on each of " + std::to_string(r.decoders) + " decoders" : "";
  std::printf("prompts %lld (%s, %lld at once%s), new tokens %lld, verify steps %lld\n",
              static_cast<long long>(r.prompts), decode::describe(r.settings).c_str(),
              static_cast<long long>(r.max_batch), decoders.c_str(),
              static_cast<long long>(r.new_tokens), static_cast<long long>(r.verify_steps));
  std::printf("acceptance length %.3f tokens per verify step\n", r.acceptance_length);
  std::printf("accepted per draft position:");
  for (double a : r.acceptance_at) std::printf(" %.2f", a);
  std::printf("\nspeculative decoding %.1f tokens/s", r.spec_tokens_per_second);
  if (r.baseline) std::printf(", plain decoding %.1f tokens/s, speedup %.2fx", r.plain_tokens_per_second, r.speedup);
  std::printf("\n");
  if (r.mismatches > 0) {
    std::printf("warning: %lld prompt(s) decoded differently from plain greedy decoding (numerics of a low-precision "
                "target; float32 makes them equal)\n", static_cast<long long>(r.mismatches));
  }
}

}  // namespace

int command_eval(const std::vector<std::string>& args) {
  EvalArgs a;
  if (const std::optional<int> code = parse_eval_args(args, &a)) return *code;
  const std::optional<std::vector<target::TargetOptions>> stages = target_options("eval", a.target);
  if (!stages) return exit_code::kUsage;
  try {
    const std::vector<decode::EvalPrompt> prompts = decode::read_eval_prompts(a.prompts, a.max_prompts);
    const std::unique_ptr<target::StagedTarget> model = load_decoding_target(a.target, *stages);
    const target::IncrementalTarget target(model->models());
    size_t longest = 0;
    for (const decode::EvalPrompt& p : prompts) longest = std::max(longest, p.ids.size());
    std::ifstream in(a.drafter_dir + "/config.json");
    if (!in) throw std::runtime_error(a.drafter_dir + "/config.json: cannot read (is it an exported drafter?)");
    std::stringstream text;
    text << in.rdbuf();
    drafter::Drafter d(drafter::parse_export_config(text.str(), a.drafter_dir + "/config.json"),
                       at::TensorOptions().device(target.device()).dtype(target.options().dtype));
    d.load_export(a.drafter_dir);
    const int64_t block = d.shape().block_size;
    const int64_t decoders = static_cast<int64_t>(target.stage_count());
    check_decoding_batch("dflashd eval", target,
                         std::min<int64_t>(a.max_batch * decoders, static_cast<int64_t>(prompts.size())), decoders,
                         static_cast<int64_t>(longest) + a.settings.max_new_tokens + block, block);
    const decode::SpeculativeDecoder spec(target, d);  // stateless: one object serves every decoder thread
    const decode::EvalReport report =
        decode::evaluate(std::vector<const decode::Decoder*>(static_cast<size_t>(decoders), &spec), prompts,
                         a.settings, a.baseline, a.max_batch);
    print_report(report);
    if (!a.out.empty()) {
      write_file_atomically(a.out, report.to_json());  // throws naming the file
    }
    return exit_code::kOk;
  } catch (const std::exception& e) {
    std::cerr << "dflashd eval: " << e.what() << "\n";
    return exit_code::kFailure;
  }
}

}  // namespace dflash::daemon
