// run_settings.h: what a training run's steps depend on besides its data (whose digest
// Dataset keeps): the drafter replicas per node, the drafter's shape, the target's precision and
// the train section's settings, as one JSON object. Nodes must agree on it (NodeGroup::require_same);
// a checkpoint records it, and a resume says what differs from the run that wrote it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "drafter/drafter_config.h"

namespace dflash::pipeline {

// The settings as a JSON object, keys named as in the config ("train.learning_rate", ...).
std::string training_settings_json(const config::Config& config, const drafter::DrafterShape& shape,
                                   int64_t drafter_replicas_per_node);

// What differs among `values` (labels[i] names values[i]): for JSON objects the keys whose values
// differ, "key: LABEL0 v0, LABEL1 v1" joined by "; "; otherwise "LABEL0: v0; LABEL1: v1". Empty when
// all are equal.
std::string setting_differences(const std::vector<std::string>& values, const std::vector<std::string>& labels);

}  // namespace dflash::pipeline
