#include "daemon/signals.h"

#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <ctime>

#include "common/log.h"

namespace dflash::daemon {
namespace {
sigset_t handled_signals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGTERM);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGHUP);
  return set;
}
}  // namespace

SignalWatcher::SignalWatcher(std::function<void(int)> on_stop, std::function<void()> on_reload)
    : on_stop_(std::move(on_stop)), on_reload_(std::move(on_reload)) {
  const sigset_t set = handled_signals();
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  thread_ = std::thread([this] { run(); });
}

SignalWatcher::~SignalWatcher() {
  quit_.store(true);
  if (thread_.joinable()) thread_.join();
}

void SignalWatcher::run() {
  const sigset_t set = handled_signals();
  // A short timeout so the destructor can stop the thread without sending it a signal.
  const timespec timeout{0, 200 * 1000 * 1000};
  while (!quit_.load()) {
    const int signal = sigtimedwait(&set, nullptr, &timeout);
    if (signal < 0) continue;  // EAGAIN (timeout) or EINTR
    if (signal == SIGHUP) {
      log::info("SIGHUP: reopening log files");
      if (on_reload_) on_reload_();
      continue;
    }
    int expected = 0;
    if (stop_signal_.compare_exchange_strong(expected, signal)) {
      log::info("{}: stopping gracefully (send it again to stop at once)", signal == SIGTERM ? "SIGTERM" : "SIGINT");
      if (on_stop_) on_stop_(signal);
    } else {
      log::critical("second {}: exiting at once, without a final checkpoint", signal == SIGTERM ? "SIGTERM" : "SIGINT");
      log::flush();
      _exit(128 + signal);
    }
  }
}

}  // namespace dflash::daemon
