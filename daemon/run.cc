#include "daemon/run.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "common/health.h"
#include "daemon/exit_codes.h"
#include "daemon/http_endpoint.h"
#include "daemon/machine.h"
#include "daemon/process_metrics.h"
#include "daemon/signals.h"
#include "daemon/systemd_notify.h"

namespace dflash::daemon {

void configure_logging(const config::Config& config, std::optional<log::Level> override_level) {
  log::Options options;
  if (!log::parse_level(config.logging.level, &options.level)) options.level = log::Level::info;
  if (override_level) options.level = *override_level;
  options.json = config.logging.format == "json";
  options.file = config.logging.file;
  log::configure(options);
}

int run_service(const config::Config& config, const RunOptions& options) {
  using Clock = std::chrono::steady_clock;
  // First, before any thread exists: every thread inherits the blocked signal mask.
  std::mutex mutex;
  std::condition_variable wake;
  SignalWatcher signals([&](int) { wake.notify_all(); },
                        [] {
                          try {
                            log::reopen();
                          } catch (const std::exception& e) {
                            log::error("SIGHUP: {}", e.what());
                          }
                        });
  try {
    configure_logging(config, options.log_level);
  } catch (const std::exception& e) {
    log::error("{}", e.what());
    return exit_code::kStartup;
  }
  SystemdNotifier notifier;
  log::info("dflashd {} starting run '{}' from {}", DFLASHD_VERSION, config.run.name, config.source);

  const MachineFacts machine = probe_basic();
  const auto machine_problems = config::check_machine(config, config::Machine{machine.cuda_devices});
  if (!machine_problems.empty()) {
    for (const auto& d : machine_problems) log::error("{}", d.str());
    notifier.status("failed: the config does not fit this machine");
    return exit_code::kStartup;
  }

  auto registry = std::make_shared<prometheus::Registry>();
  auto health = std::make_shared<Health>();
  auto build_info = std::make_shared<BuildInfoCollector>(std::map<std::string, std::string>{
      {"version", machine.dflashd_version},
      {"torch_version", machine.torch_version},
      {"cuda_version", machine.cuda_runtime_version.empty() ? "none" : machine.cuda_runtime_version},
      {"cuda_kernels", machine.cuda_kernels_built ? "true" : "false"},
      {"device", config.gpus.device}});
  auto& state_family = prometheus::BuildGauge()
                           .Name("dflashd_state")
                           .Help("1 for the daemon's current lifecycle state (starting, running, stopping)")
                           .Register(*registry);
  auto& starting = state_family.Add({{"state", "starting"}});
  auto& running = state_family.Add({{"state", "running"}});
  auto& stopping = state_family.Add({{"state", "stopping"}});
  auto& loop_heartbeat = prometheus::BuildGauge()
                             .Name("dflashd_main_loop_heartbeat_timestamp_seconds")
                             .Help("Unix time of the main loop's last iteration")
                             .Register(*registry)
                             .Add({});
  auto& watchdog_pings = prometheus::BuildCounter()
                             .Name("dflashd_systemd_watchdog_pings_total")
                             .Help("WATCHDOG=1 notifications sent to systemd")
                             .Register(*registry)
                             .Add({});
  starting.Set(1);
  health->set_healthy("main");

  std::unique_ptr<HttpEndpoint> endpoint;
  if (!config.metrics.listen.empty()) {
    try {
      endpoint = std::make_unique<HttpEndpoint>(
          config.metrics.listen,
          std::vector<std::shared_ptr<prometheus::Collectable>>{registry, std::make_shared<ProcessCollector>(),
                                                                build_info},
          health);
    } catch (const StartupError& e) {
      log::error("{}", e.what());
      notifier.status(std::string("failed: ") + e.what());
      return exit_code::kStartup;
    }
  }

  // The training pipeline (issue: pipeline) plugs in here. Until then the service runs its
  // lifecycle and endpoints only, and says so.
  log::warn("the training pipeline is not part of this build yet: serving metrics and health only");

  starting.Set(0);
  running.Set(1);
  notifier.ready();
  notifier.status("running: serving metrics (no training pipeline in this build)");

  const auto started = Clock::now();
  auto last_watchdog = Clock::time_point{};
  auto last_log = started;
  const auto watchdog_interval = notifier.watchdog_interval();
  while (!signals.stop_requested()) {
    const auto now = Clock::now();
    loop_heartbeat.Set(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    // The watchdog is fed only from this loop: if it stops turning, systemd notices.
    if (watchdog_interval && now - last_watchdog >= *watchdog_interval) {
      notifier.watchdog();
      watchdog_pings.Increment();
      last_watchdog = now;
    }
    const double elapsed = std::chrono::duration<double>(now - started).count();
    if (config.run.max_seconds > 0 && elapsed >= config.run.max_seconds) {
      log::info("run.max_seconds ({}) reached", config.run.max_seconds);
      break;
    }
    if (std::chrono::duration<double>(now - last_log).count() >= config.metrics.log_every_seconds) {
      log::info("alive for {} s", static_cast<int64_t>(elapsed));
      last_log = now;
    }
    std::unique_lock lock(mutex);
    wake.wait_for(lock, std::chrono::milliseconds(100), [&] { return signals.stop_requested(); });
  }

  running.Set(0);
  stopping.Set(1);
  notifier.stopping();
  log::info("stopping: nothing in flight, exiting");
  endpoint.reset();
  log::info("stopped cleanly");
  log::flush();
  return exit_code::kOk;
}

}  // namespace dflash::daemon
