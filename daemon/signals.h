// signals.h: turns SIGTERM / SIGINT / SIGHUP into events the daemon handles on a normal thread.
//
// The signals are blocked in every thread (construct this before starting any other thread,
// since threads inherit the mask) and received by one watcher thread with sigtimedwait, so no
// code runs in signal-handler context. Semantics (documented in the README):
//   first SIGTERM or SIGINT:  stop_requested() becomes true; on_stop runs on the watcher thread.
//   second SIGTERM or SIGINT: immediate exit with status 128 + signal number, after flushing logs.
//   SIGHUP: on_reload runs (the daemon reopens its log file).
#pragma once

#include <atomic>
#include <functional>
#include <thread>

namespace dflash::daemon {

class SignalWatcher {
 public:
  SignalWatcher(std::function<void(int signal)> on_stop, std::function<void()> on_reload);
  ~SignalWatcher();  // stops the watcher thread; the signals stay blocked
  SignalWatcher(const SignalWatcher&) = delete;
  SignalWatcher& operator=(const SignalWatcher&) = delete;

  bool stop_requested() const { return stop_signal_.load() != 0; }
  int stop_signal() const { return stop_signal_.load(); }

 private:
  void run();
  std::function<void(int)> on_stop_;
  std::function<void()> on_reload_;
  std::atomic<int> stop_signal_{0};
  std::atomic<bool> quit_{false};
  std::thread thread_;
};

}  // namespace dflash::daemon
