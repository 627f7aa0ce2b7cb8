// run.h: `dflashd run`, the service. Owns the process lifecycle: signals, systemd notify and
// watchdog, metrics/health endpoint, and (once the pipeline lands) the training run.
#pragma once

#include <optional>
#include <string>

#include "common/log.h"
#include "config/config.h"
#include "pipeline/test_hooks.h"

namespace dflash::daemon {

struct RunOptions {
  std::optional<log::Level> log_level;  // --log-level overrides logging.level
  pipeline::TestHooks hooks;            // none in the shipped binary (pipeline/test_hooks.h)
};

// Returns the process exit code (exit_codes.h).
int run_service(const config::Config& config, const RunOptions& options);

// Applies logging.* of the config (and the --log-level override). Throws on an unopenable file.
void configure_logging(const config::Config& config, std::optional<log::Level> override_level);

}  // namespace dflash::daemon
