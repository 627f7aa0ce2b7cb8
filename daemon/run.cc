#include "daemon/run.h"

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <sys/stat.h>

#include <chrono>
#include <cstdlib>
#include <condition_variable>
#include <mutex>
#include <optional>

#include "common/dir_lock.h"
#include "common/health.h"
#include "common/safetensors.h"
#include "daemon/exit_codes.h"
#include "daemon/http_endpoint.h"
#include "daemon/machine.h"
#include "daemon/process_metrics.h"
#include "daemon/signals.h"
#include "daemon/systemd_notify.h"
#include "pipeline/trainer.h"

namespace dflash::daemon {

void configure_logging(const config::Config& config, std::optional<log::Level> override_level) {
  log::Options options;
  if (!log::parse_level(config.logging.level, &options.level)) options.level = log::Level::info;
  if (override_level) options.level = *override_level;
  options.json = config.logging.format == "json";
  options.file = config.logging.file;
  log::configure(options);
}

namespace {

using Clock = std::chrono::steady_clock;

// The daemon's own metrics (the run's are pipeline/run_metrics.h).
struct ServiceMetrics {
  prometheus::Gauge* starting = nullptr;  // dflashd_state{state}: one of the three is 1
  prometheus::Gauge* running = nullptr;
  prometheus::Gauge* stopping = nullptr;
  prometheus::Gauge* loop_heartbeat = nullptr;
  prometheus::Counter* watchdog_pings = nullptr;

  void set_state(prometheus::Gauge* state) {
    for (prometheus::Gauge* g : {starting, running, stopping}) g->Set(g == state ? 1 : 0);
  }
};

ServiceMetrics register_service_metrics(prometheus::Registry& registry) {
  ServiceMetrics m;
  auto& state_family = prometheus::BuildGauge()
                           .Name("dflashd_state")
                           .Help("1 for the daemon's current lifecycle state (starting, running, stopping)")
                           .Register(registry);
  m.starting = &state_family.Add({{"state", "starting"}});
  m.running = &state_family.Add({{"state", "running"}});
  m.stopping = &state_family.Add({{"state", "stopping"}});
  m.loop_heartbeat = &prometheus::BuildGauge()
                          .Name("dflashd_main_loop_heartbeat_timestamp_seconds")
                          .Help("Unix time of the main loop's last iteration")
                          .Register(registry)
                          .Add({});
  m.watchdog_pings = &prometheus::BuildCounter()
                          .Name("dflashd_systemd_watchdog_pings_total")
                          .Help("WATCHDOG=1 notifications sent to systemd")
                          .Register(registry)
                          .Add({});
  return m;
}

std::shared_ptr<BuildInfoCollector> build_info_of(const MachineFacts& machine, const config::Config& config) {
  return std::make_shared<BuildInfoCollector>(std::map<std::string, std::string>{
      {"version", machine.dflashd_version},
      {"torch_version", machine.torch_version},
      {"cuda_version", machine.cuda_runtime_version.empty() ? "none" : machine.cuda_runtime_version},
      {"cuda_kernels", machine.cuda_kernels_built ? "true" : "false"},
      {"device", config::name_of(config.gpus.device)}});
}

// The main loop until the run is done: supervise the trainer, feed systemd's watchdog (only
// from here: if this loop stops turning, systemd notices), and turn SIGTERM or run.max_seconds
// into a graceful stop bounded by checkpoint.stop_timeout_seconds.
void supervise_until_done(const config::Config& config, pipeline::Trainer& trainer, SignalWatcher& signals,
                          SystemdNotifier& notifier, ServiceMetrics& metrics, std::mutex& mutex,
                          std::condition_variable& wake) {
  const auto started = Clock::now();
  auto last_watchdog = Clock::time_point{};
  auto last_status = Clock::time_point{};
  std::optional<Clock::time_point> stop_deadline;
  const auto watchdog_interval = notifier.watchdog_interval();
  while (!trainer.done()) {
    const auto now = Clock::now();
    metrics.loop_heartbeat->Set(std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
    trainer.supervise();
    if (watchdog_interval && now - last_watchdog >= *watchdog_interval) {
      notifier.watchdog();
      metrics.watchdog_pings->Increment();
      last_watchdog = now;
    }
    const bool out_of_time = config.run.max_seconds > 0 &&
                             std::chrono::duration<double>(now - started).count() >= config.run.max_seconds;
    if ((signals.stop_requested() || out_of_time) && !stop_deadline) {
      if (out_of_time) log::info("run.max_seconds ({}) reached", config.run.max_seconds);
      trainer.request_stop();
      metrics.set_state(metrics.stopping);
      notifier.stopping();
      notifier.status("stopping: finishing the step in flight, then a checkpoint");
      stop_deadline = now + std::chrono::milliseconds(static_cast<int64_t>(config.checkpoint.stop_timeout_seconds * 1000));
    }
    if (stop_deadline && now > *stop_deadline) {
      log::critical("the graceful stop took longer than checkpoint.stop_timeout_seconds ({} s): exiting without a "
                    "final checkpoint (the last complete one stays valid)",
                    config.checkpoint.stop_timeout_seconds);
      log::flush();
      notifier.status("failed: graceful stop timed out");
      // The workers are stuck: joining them (the Trainer's destructor) could hang for ever.
      std::_Exit(exit_code::kFailure);
    }
    if (!stop_deadline && now - last_status >= std::chrono::seconds(5)) {
      notifier.status(trainer.status());
      last_status = now;
    }
    std::unique_lock lock(mutex);
    wake.wait_for(lock, std::chrono::milliseconds(200), [&] { return signals.stop_requested() && !stop_deadline; });
  }
}

// Joins the workers, writes the final checkpoint and says how the run ended (the exit code).
int finish_run(pipeline::Trainer& trainer, SystemdNotifier& notifier, ServiceMetrics& metrics,
               std::unique_ptr<HttpEndpoint>& endpoint) {
  notifier.status("stopping: writing the final checkpoint");
  const pipeline::Outcome outcome = trainer.wait();
  if (trainer.abandoned()) {
    // Worker threads are stuck (in a CUDA or NCCL call): neither joining them nor destroying
    // what they use is possible. The checkpoint, if one could be written, is on disk.
    log::error("run failed at step {}: {}; exiting with worker threads stuck", trainer.step(), trainer.failure());
    log::flush();
    notifier.status("failed: worker threads stuck");
    std::_Exit(exit_code::kFailure);
  }
  trainer.supervise();
  metrics.set_state(metrics.stopping);
  notifier.stopping();
  endpoint.reset();
  if (outcome == pipeline::Outcome::failed) {
    log::error("run failed at step {}: {}", trainer.step(), trainer.failure());
    log::flush();
    return exit_code::kFailure;
  }
  log::info(outcome == pipeline::Outcome::finished ? "run finished at step {}" : "stopped cleanly at step {}",
            trainer.step());
  log::flush();
  return exit_code::kOk;
}

// One dflashd per run directory: run.output_dir, and checkpoint.dir where it lies elsewhere (a
// second run writing the same checkpoints would interleave and prune them).
std::vector<std::unique_ptr<DirectoryLock>> lock_run_directories(const config::Config& config) {
  const std::string role = "dflashd run '" + config.run.name + "' of " + config.source;
  std::vector<std::unique_ptr<DirectoryLock>> locks;
  locks.push_back(std::make_unique<DirectoryLock>(config.run.output_dir, role));
  if (config.checkpoint.dir.empty()) return locks;  // the checkpoints lie in the locked output_dir
  make_directories(config.checkpoint.dir);
  // The same directory named otherwise: a second lock on it would refuse this very process.
  struct stat output {}, checkpoints {};
  const bool same = ::stat(config.run.output_dir.c_str(), &output) == 0 &&
                    ::stat(config.checkpoint.dir.c_str(), &checkpoints) == 0 && output.st_dev == checkpoints.st_dev &&
                    output.st_ino == checkpoints.st_ino;
  if (!same) locks.push_back(std::make_unique<DirectoryLock>(config.checkpoint.dir, role));
  return locks;
}

}  // namespace

int run_service(const config::Config& config, const RunOptions& options) {
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

  std::vector<std::unique_ptr<DirectoryLock>> locks;
  try {
    locks = lock_run_directories(config);
  } catch (const std::exception& e) {
    log::error("{}", e.what());
    notifier.status(std::string("failed: ") + e.what());
    return exit_code::kStartup;
  }

  auto registry = std::make_shared<prometheus::Registry>();
  auto health = std::make_shared<Health>();
  ServiceMetrics metrics = register_service_metrics(*registry);
  metrics.set_state(metrics.starting);
  health->set_healthy("main");

  std::unique_ptr<HttpEndpoint> endpoint;
  if (!config.metrics.listen.empty()) {
    try {
      endpoint = std::make_unique<HttpEndpoint>(
          config.metrics.listen,
          std::vector<std::shared_ptr<prometheus::Collectable>>{registry, std::make_shared<ProcessCollector>(),
                                                                build_info_of(machine, config)},
          health);
    } catch (const StartupError& e) {
      log::error("{}", e.what());
      notifier.status(std::string("failed: ") + e.what());
      return exit_code::kStartup;
    }
  }

  // The training run: loads the target, builds the drafter replicas, opens the data, resumes.
  std::unique_ptr<pipeline::Trainer> trainer;
  try {
    notifier.status("starting: loading the target and the data");
    trainer = std::make_unique<pipeline::Trainer>(config, *registry, health, options.hooks);
  } catch (const std::exception& e) {
    log::error("cannot start the run: {}", e.what());
    notifier.status(std::string("failed: ") + e.what());
    return exit_code::kStartup;
  }

  metrics.set_state(metrics.running);
  trainer->start();
  notifier.ready();
  supervise_until_done(config, *trainer, signals, notifier, metrics, mutex, wake);
  return finish_run(*trainer, notifier, metrics, endpoint);
}

}  // namespace dflash::daemon
