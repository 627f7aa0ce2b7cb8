// systemd_notify.h: the sd_notify protocol without libsystemd.
//
// Protocol (sd_notify(3)): datagrams of "KEY=VALUE\n..." sent to the AF_UNIX socket named by
// $NOTIFY_SOCKET ('@' prefix = abstract namespace). With Type=notify systemd waits for
// READY=1; STATUS= is shown by `systemctl status`; WATCHDOG=1 must arrive at least every
// $WATCHDOG_USEC microseconds when WatchdogSec is set; STOPPING=1 announces a clean stop.
// Without $NOTIFY_SOCKET every call is a no-op. $WATCHDOG_PID, when set, must be our pid.
//
// Thread-safety: all methods may be called from any thread (each send is one datagram).
#pragma once

#include <chrono>
#include <optional>
#include <string>

namespace dflash::daemon {

class SystemdNotifier {
 public:
  // Reads NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID from the environment.
  SystemdNotifier();
  ~SystemdNotifier();
  SystemdNotifier(const SystemdNotifier&) = delete;
  SystemdNotifier& operator=(const SystemdNotifier&) = delete;

  bool enabled() const { return fd_ >= 0; }
  // The interval at which watchdog() must be called (half systemd's limit), if any.
  std::optional<std::chrono::microseconds> watchdog_interval() const { return watchdog_interval_; }

  // Each returns false if the datagram could not be sent (logged once at warn).
  bool ready();
  bool status(const std::string& text);
  bool watchdog();
  bool stopping();
  bool send(const std::string& message);

 private:
  int fd_ = -1;
  std::string socket_path_;
  std::optional<std::chrono::microseconds> watchdog_interval_;
  bool warned_ = false;
};

}  // namespace dflash::daemon
