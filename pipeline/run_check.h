// run_check.h: what `dflashd validate` checks beyond the config file, without loading weights
// or reading the data: the target's config.json (or preset) and its checkpoint files, the
// drafter's shape (and drafter.init's against it), the data files, and the memory plan per GPU
// (memory_plan.h) against the GPUs' memory when it is known. The startup log shows the same
// memory table, and the run refuses a plan that does not fit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "pipeline/memory_plan.h"
#include "target/model_config.h"

namespace dflash::pipeline {

struct RunCheck {
  std::vector<GpuMemoryPlan> memory;  // empty when the target or drafter could not be read
  std::vector<std::string> problems;  // each names the file, key or GPU
};

// The target's architecture: target.path's config.json, or the built-in preset's. Throws
// naming the file and the key.
target::ModelConfig target_model_config(const config::TargetConfig& target);

// `capacities`: bytes per CUDA device index; empty when unknown (no GPU). `offline`: the config is
// for another host, whose files are not here: a target, data or drafter.init path that cannot be
// read is no problem then (the memory plan needs the target's config.json, so it is left out).
// data.max_length past the target's context (max_position_embeddings), as a message; empty when
// it fits or the target's config does not say.
std::string context_problem(const config::Config& config, const target::ModelConfig& target);

RunCheck check_run(const config::Config& config, const std::vector<int64_t>& capacities, bool offline);

}  // namespace dflash::pipeline
