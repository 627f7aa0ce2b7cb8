#include "daemon/systemd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>

#include "common/log.h"

namespace dflash::daemon {

SystemdNotifier::SystemdNotifier() {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path && *path && (path[0] == '/' || path[0] == '@')) {
    socket_path_ = path;
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  }
  const char* usec = std::getenv("WATCHDOG_USEC");
  const char* pid = std::getenv("WATCHDOG_PID");
  const bool for_us = !pid || std::strtoll(pid, nullptr, 10) == static_cast<long long>(::getpid());
  if (usec && for_us) {
    const long long value = std::strtoll(usec, nullptr, 10);
    if (value > 0) watchdog_interval_ = std::chrono::microseconds(value / 2);
  }
}

SystemdNotifier::~SystemdNotifier() {
  if (fd_ >= 0) ::close(fd_);
}

bool SystemdNotifier::send(const std::string& message) {
  if (fd_ < 0) return true;
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  if (socket_path_.size() >= sizeof(address.sun_path)) return false;
  std::memcpy(address.sun_path, socket_path_.data(), socket_path_.size());
  if (address.sun_path[0] == '@') address.sun_path[0] = '\0';  // abstract namespace
  const socklen_t length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + socket_path_.size());
  const ssize_t sent = ::sendto(fd_, message.data(), message.size(), MSG_NOSIGNAL,
                                reinterpret_cast<const sockaddr*>(&address), length);
  if (sent == static_cast<ssize_t>(message.size())) return true;
  if (!warned_) {
    warned_ = true;
    log::warn("systemd notify to {} failed: {}", socket_path_, std::strerror(errno));
  }
  return false;
}

bool SystemdNotifier::ready() { return send("READY=1\nSTATUS=running\nMAINPID=" + std::to_string(::getpid())); }
bool SystemdNotifier::status(const std::string& text) { return send("STATUS=" + text); }
bool SystemdNotifier::watchdog() { return send("WATCHDOG=1"); }
bool SystemdNotifier::stopping() { return send("STOPPING=1\nSTATUS=stopping"); }

}  // namespace dflash::daemon
