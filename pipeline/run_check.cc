#include "pipeline/run_check.h"

#include <sys/stat.h>

#include <fstream>

#include "common/token_file.h"
#include "drafter/drafter_config.h"
#include "pipeline/dataset.h"
#include "pipeline/gpu_memory.h"
#include "target/model_config.h"

namespace dflash::pipeline {
namespace {

bool is_file(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

}  // namespace

target::ModelConfig target_model_config(const config::TargetConfig& target) {
  return target.preset.empty() ? target::load_model_config(target.path)
                               : target::parse_model_config(target::preset_config_json(target.preset), target.preset);
}

std::string context_problem(const config::Config& config, const target::ModelConfig& target) {
  if (target.max_position_embeddings <= 0 || config.data.max_length <= target.max_position_embeddings) return "";
  return "data.max_length " + std::to_string(config.data.max_length) + " is past the target's context (" +
         target.source + ": max_position_embeddings " + std::to_string(target.max_position_embeddings) + ")";
}

RunCheck check_run(const config::Config& config, const std::vector<int64_t>& capacities, bool offline) {
  RunCheck check;
  auto problem = [&](const std::string& message) { check.problems.push_back(message); };
  if (offline && config.target.preset.empty() && !is_file(config.target.path + "/config.json")) return check;
  target::ModelConfig target;
  drafter::DrafterShape shape;
  bool shaped = false;
  try {
    target = target_model_config(config.target);
    if (!offline && config.target.preset.empty() && config.target.weights == config::TargetWeights::checkpoint &&
        !is_file(config.target.path + "/model.safetensors") && !is_file(config.target.path + "/model.safetensors.index.json")) {
      problem("target.path: " + config.target.path + " has neither model.safetensors nor model.safetensors.index.json "
              "(target.weights: random runs without them)");
    }
    shape = drafter::shape_for_target(target, config.drafter);
    shaped = true;
    if (const std::string p = context_problem(config, target); !p.empty()) problem(p);
    try {
      check_stop_tokens("eval.stop_token_ids", {config.eval.stop_token_ids.begin(), config.eval.stop_token_ids.end()},
                        target.vocab_size);
    } catch (const std::invalid_argument& e) {
      problem(e.what());  // the checks below still run
    }
    if (config.drafter.init != "random" && !(offline && !is_file(config.drafter.init + "/config.json"))) {
      drafter::check_drafter_init(config.drafter.init, shape);
    }
  } catch (const std::exception& e) {
    problem(e.what());
  }
  if (config.data.synthetic.sequences == 0 && !offline) {
    try {
      for (const std::string& file : data_files(config.data.paths)) {
        if (!std::ifstream(file)) problem("data.paths: " + file + ": cannot read");
      }
    } catch (const std::exception& e) {
      problem(e.what());
    }
  }
  if (shaped) {
    // Online, the GPUs say whether an FP8 target's experts run on the grouped GEMM there.
    const std::vector<bool> grouped = offline || capacities.empty() ? std::vector<bool>{} : grouped_fp8_gpus(target);
    check.memory = plan_memory(config, target, shape, capacities, grouped);
    for (std::string& p : memory_plan_problems(check.memory)) problem(std::move(p));
  }
  return check;
}

}  // namespace dflash::pipeline
