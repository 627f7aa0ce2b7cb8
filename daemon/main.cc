// main.cc: the dflashd command line. One binary, subcommands, `--help` on each.
#include <cstring>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "common/log.h"
#include "config/config.h"
#include "daemon/exit_codes.h"
#include "drafter/checkpoint.h"
#include "daemon/eval_command.h"
#include "daemon/generate_command.h"
#include "daemon/inspect.h"
#include "daemon/machine.h"
#include "daemon/run.h"
#include "pipeline/gpu_memory.h"
#include "pipeline/run_check.h"

namespace {

using namespace dflash;
namespace exit_code = daemon::exit_code;

constexpr const char* kMainHelp = R"(dflashd: trains DFlash speculative-decoding drafters against frozen target models.

Usage: dflashd COMMAND [OPTIONS]

Commands:
  run        run the training service described by a config file
  validate   check a config file (and this machine) without training
  doctor     print what this machine offers: torch, CUDA, GPUs, NCCL, peer access, kernels
  eval       measure a drafter's real acceptance: speculative decoding with its target
  generate   regenerate training responses with the target (shards, exactly once across restarts)
  inspect    dump a target's tapped hidden states for a token file (debugging)
  export     write a checkpoint's drafter in the serving format (SGLang, vLLM, HF)
  config     print the embedded default config (a documented starting point)
  version    print the version

`dflashd COMMAND --help` describes each command.

Exit codes:
  0        finished, or stopped cleanly on SIGTERM/SIGINT
  1        the run failed (details in the log)
  2        bad command line
  3        the config has errors (all listed on stderr as file:line:col: message)
  4        the machine cannot run this config (port in use, GPU missing, unreadable files)
  128+N    a second signal N arrived during a graceful stop: exited at once
)";

constexpr const char* kRunHelp = R"(Usage: dflashd run (-c FILE | --default-config) [--log-level LEVEL]

Runs the service until the run ends or SIGTERM/SIGINT arrives. The first signal stops
gracefully, a second one at once; SIGHUP reopens the log file. Under systemd (Type=notify)
it reports READY/STATUS/STOPPING and feeds the watchdog.

  -c, --config FILE     the run's YAML config
  --default-config      use the embedded default (tiny models, synthetic data, CPU)
  --log-level LEVEL     trace|debug|info|warn|error|critical|off (overrides logging.level)
)";

constexpr const char* kValidateHelp = R"(Usage: dflashd validate (-c FILE | --default-config) [--offline]

Parses the config strictly; reads the target's config.json (not its weights) and checks its
checkpoint files, the drafter's shape (and drafter.init's), the data files; prints the memory
plan per GPU (target weights, drafter state, queued features, activations) and checks it, and
the GPU ids, against this machine. Prints every problem as file:line:col: message (or file:
message) and exits 3 if there is any; prints "OK" and exits 0 otherwise.

  --offline   skip the checks against this machine, its GPUs and its files (validating a
              config for another host; the memory plan is printed where the target's
              config.json can be read)
)";

constexpr const char* kDoctorHelp = R"(Usage: dflashd doctor

Prints torch and CUDA versions, GPUs with memory, whether dflashd's compiled kernels run on
each GPU, NCCL version, peer access between GPUs and the SDPA backend torch would choose.
Works (and says so) on machines without GPUs. Exits 0.
)";

constexpr const char* kExportHelp = R"(Usage: dflashd export CHECKPOINT_DIR OUT_DIR

Writes the drafter of a checkpoint (a step-N directory with its COMMIT marker) to OUT_DIR as
config.json + model.safetensors (bf16, no embedding or LM head): what SGLang
(--speculative-algorithm DFLASH), vLLM (method "dflash") and transformers load.
)";

constexpr const char* kConfigHelp = R"(Usage: dflashd config default

Prints the embedded default config, every key documented with its default.
)";

struct Args {
  std::string config_path;
  bool default_config = false;
  std::optional<log::Level> log_level;
  bool help = false;
  bool offline = false;
  std::vector<std::string> positional;
};

// Returns an error message, or "" on success.
std::string parse_args(int argc, char** argv, int first, Args* args) {
  for (int i = first; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&](const char* name) -> std::optional<std::string> {
      if (i + 1 >= argc) return std::nullopt;
      (void)name;
      return std::string(argv[++i]);
    };
    if (a == "-h" || a == "--help") {
      args->help = true;
    } else if (a == "-c" || a == "--config") {
      auto v = value("--config");
      if (!v) return a + " needs a file";
      args->config_path = *v;
    } else if (a.rfind("--config=", 0) == 0) {
      args->config_path = a.substr(9);
    } else if (a == "--offline") {
      args->offline = true;
    } else if (a == "--default-config") {
      args->default_config = true;
    } else if (a == "--log-level" || a.rfind("--log-level=", 0) == 0) {
      std::optional<std::string> v = a == "--log-level" ? value("--log-level") : std::optional(a.substr(12));
      if (!v) return "--log-level needs a level";
      log::Level level;
      if (!log::parse_level(*v, &level)) return "--log-level: unknown level '" + *v + "'";
      args->log_level = level;
    } else if (!a.empty() && a[0] == '-') {
      return "unknown option " + a;
    } else {
      args->positional.push_back(a);
    }
  }
  return "";
}

int usage_error(const std::string& message, const char* help) {
  std::cerr << "dflashd: " << message << "\n\n" << help;
  return exit_code::kUsage;
}

// Loads the config named by the arguments; prints the errors and returns nullopt on failure.
std::optional<config::Config> load_config(const Args& args, int* exit_status) {
  try {
    return args.default_config ? config::load_default() : config::load_file(args.config_path);
  } catch (const config::ConfigError& e) {
    for (const auto& d : e.diagnostics()) std::cerr << d.str() << "\n";
    std::cerr << e.diagnostics().size() << (e.diagnostics().size() == 1 ? " error" : " errors") << " in "
              << (args.default_config ? "<embedded default>" : args.config_path) << "\n";
    *exit_status = exit_code::kConfigInvalid;
    return std::nullopt;
  }
}

std::string config_choice_error(const Args& args) {
  if (args.default_config == !args.config_path.empty()) return "give exactly one of -c FILE and --default-config";
  if (!args.positional.empty()) return "unexpected argument " + args.positional[0];
  return "";
}

int command_run(const Args& args) {
  if (args.help) return std::cout << kRunHelp, exit_code::kOk;
  if (auto e = config_choice_error(args); !e.empty()) return usage_error(e, kRunHelp);
  int status = exit_code::kOk;
  auto config = load_config(args, &status);
  if (!config) return status;
  return daemon::run_service(*config, daemon::RunOptions{args.log_level, pipeline::test_hooks_of_this_build()});
}

int command_validate(const Args& args) {
  if (args.help) return std::cout << kValidateHelp, exit_code::kOk;
  if (auto e = config_choice_error(args); !e.empty()) return usage_error(e, kValidateHelp);
  int status = exit_code::kOk;
  auto config = load_config(args, &status);
  if (!config) return status;
  std::vector<config::Diagnostic> problems;
  std::vector<int64_t> capacities;  // GPU memory: unknown offline
  if (!args.offline) {
    const auto machine = daemon::probe_basic();
    problems = config::check_machine(*config, config::Machine{machine.cuda_devices});
    capacities = pipeline::gpu_capacities();
  }
  // The target, the drafter, the data files and the memory plan (no weights or data loaded).
  const pipeline::RunCheck run = pipeline::check_run(*config, capacities, args.offline);
  for (const std::string& p : run.problems) problems.push_back({config->source, {}, p});
  if (!run.memory.empty()) std::cout << pipeline::format_memory_plan(run.memory) << "\n";
  for (const auto& d : problems) std::cerr << d.str() << "\n";
  if (!problems.empty()) {
    std::cerr << problems.size() << (problems.size() == 1 ? " error" : " errors") << " in " << config->source << "\n";
    return exit_code::kConfigInvalid;
  }
  std::cout << config->source << ": OK\n";
  return exit_code::kOk;
}

int command_doctor(const Args& args) {
  if (args.help) return std::cout << kDoctorHelp, exit_code::kOk;
  if (!args.positional.empty()) return usage_error("unexpected argument " + args.positional[0], kDoctorHelp);
  std::cout << daemon::format_report(daemon::probe_full());
  return exit_code::kOk;
}

int command_export(const Args& args) {
  if (args.help) return std::cout << kExportHelp, exit_code::kOk;
  if (args.positional.size() != 2) return usage_error("expected CHECKPOINT_DIR OUT_DIR", kExportHelp);
  try {
    drafter::export_checkpoint(args.positional[0], args.positional[1]);
  } catch (const std::exception& e) {
    std::cerr << "dflashd export: " << e.what() << "\n";
    return exit_code::kFailure;
  }
  std::cout << "exported " << args.positional[0] << " to " << args.positional[1] << "\n";
  return exit_code::kOk;
}

int command_config(const Args& args) {
  if (args.help) return std::cout << kConfigHelp, exit_code::kOk;
  if (args.positional.size() != 1 || args.positional[0] != "default") {
    return usage_error("expected `dflashd config default`", kConfigHelp);
  }
  std::cout << config::default_yaml();
  return exit_code::kOk;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return usage_error("no command given", kMainHelp);
  const std::string command = argv[1];
  if (command == "-h" || command == "--help" || command == "help") return std::cout << kMainHelp, exit_code::kOk;
  if (command == "version" || command == "--version") {
    std::cout << "dflashd " << DFLASHD_VERSION << "\n";
    return exit_code::kOk;
  }
  if (command == "inspect" || command == "eval" || command == "generate") {
    try {
      const std::vector<std::string> rest(argv + 2, argv + argc);
      if (command == "generate") return daemon::command_generate(rest);
      return command == "eval" ? daemon::command_eval(rest) : daemon::command_inspect(rest);
    } catch (const std::exception& e) {
      std::cerr << e.what() << "\n";
      return exit_code::kFailure;
    }
  }
  Args args;
  if (auto error = parse_args(argc, argv, 2, &args); !error.empty()) return usage_error(error, kMainHelp);
  try {
    if (command == "run") return command_run(args);
    if (command == "validate") return command_validate(args);
    if (command == "doctor") return command_doctor(args);
    if (command == "config") return command_config(args);
    if (command == "export") return command_export(args);
  } catch (const std::exception& e) {
    log::critical("{}", e.what());
    log::flush();
    return exit_code::kFailure;
  }
  return usage_error("unknown command '" + command + "'", kMainHelp);
}
