// test_util.h: small helpers shared by tests: a systemd notify socket stand-in, free ports,
// spawning the real dflashd binary, temporary directories.
#pragma once

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <fcntl.h>
#include <ftw.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace dflash::test {

// An AF_UNIX datagram socket standing in for systemd's notify socket.
class NotifySocket {
 public:
  NotifySocket() {
    path_ = "/tmp/dflashd-notify-" + std::to_string(::getpid()) + "-" + std::to_string(counter()++);
    ::unlink(path_.c_str());
    fd_ = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    sockaddr_un address{};
    address.sun_family = AF_UNIX;
    std::strncpy(address.sun_path, path_.c_str(), sizeof(address.sun_path) - 1);
    if (::bind(fd_, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0) std::abort();
  }
  ~NotifySocket() {
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  const std::string& path() const { return path_; }
  // Waits for the next datagram; "" after the timeout.
  std::string receive(int timeout_ms = 10000) {
    pollfd p{fd_, POLLIN, 0};
    if (::poll(&p, 1, timeout_ms) != 1) return "";
    char buffer[4096];
    const ssize_t n = ::recv(fd_, buffer, sizeof(buffer), 0);
    return n > 0 ? std::string(buffer, static_cast<size_t>(n)) : "";
  }
  // Receives datagrams until one contains `needle` (returns it) or the time runs out ("").
  std::string wait_for(const std::string& needle, int timeout_ms = 20000) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(end - std::chrono::steady_clock::now());
      std::string m = receive(static_cast<int>(left.count()));
      if (m.find(needle) != std::string::npos) return m;
    }
    return "";
  }

 private:
  static int& counter() {
    static int c = 0;
    return c;
  }
  int fd_ = -1;
  std::string path_;
};

// The dflashd a test runs: the build's (`built`, the test target's DFLASHD_BINARY), or the one
// DFLASHD_BINARY names in the environment (a bundle's launcher, where the tests run from a bundle
// on a host without the build tree).
inline std::string dflashd_binary(const char* built) {
  const char* chosen = std::getenv("DFLASHD_BINARY");
  return chosen != nullptr ? chosen : built;
}

// A port that was free a moment ago (the kernel picks it).
inline int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address));
  socklen_t length = sizeof(address);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length);
  ::close(fd);
  return ntohs(address.sin_port);
}

// The temporary directories a test process made, removed when it exits so that repeated
// `make test` runs do not fill the disk. DFLASHD_KEEP_TEST_DIRS=1 keeps them for a post-mortem.
// Only the process that made them removes them: a forked child (a death test) that exits
// must not delete what its parent still uses.
class TempDirRegistry {
 public:
  static TempDirRegistry& instance() {
    static TempDirRegistry registry;
    return registry;
  }
  void add(const std::string& path) { paths_.push_back(path); }
  ~TempDirRegistry() {
    if (::getpid() != owner_ || std::getenv("DFLASHD_KEEP_TEST_DIRS") != nullptr) return;
    for (const auto& path : paths_) remove_tree(path);
  }

 private:
  TempDirRegistry() : owner_(::getpid()) {}
  // nftw rather than std::filesystem::remove_all: libtorch exports its own copy of the
  // std::filesystem symbols, and at exit the binary's calls resolve to it and crash.
  static void remove_tree(const std::string& path) {
    ::nftw(
        path.c_str(), [](const char* p, const struct stat*, int, struct FTW*) { return ::remove(p); }, 16,
        FTW_DEPTH | FTW_PHYS);
  }
  pid_t owner_;
  std::vector<std::string> paths_;
};

inline std::string make_temp_dir(const std::string& tag) {
  std::string pattern = "/tmp/dflashd-test-" + tag + "-XXXXXX";
  if (!::mkdtemp(pattern.data())) std::abort();
  TempDirRegistry::instance().add(pattern);
  return pattern;
}

inline std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// A child process with stdout and stderr in files.
class Process {
 public:
  Process(const std::vector<std::string>& argv, const std::vector<std::string>& extra_env, const std::string& dir)
      : out_path_(dir + "/stdout"), err_path_(dir + "/stderr") {
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out = ::open(out_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = ::open(err_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, 1);
      ::dup2(err, 2);
      sigset_t none;
      sigemptyset(&none);
      ::sigprocmask(SIG_SETMASK, &none, nullptr);
      for (const auto& e : extra_env) ::putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> args;
      for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
      args.push_back(nullptr);
      ::execv(args[0], args.data());
      ::_exit(127);
    }
  }
  ~Process() {
    if (pid_ > 0 && !exited_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  void signal(int s) { ::kill(pid_, s); }
  // Exit status (or 128 + signal), or -1 if still running after the timeout.
  int wait(int timeout_ms = 60000) {
    const auto end = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (std::chrono::steady_clock::now() < end) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  std::string out() const { return read_file(out_path_); }
  std::string err() const { return read_file(err_path_); }

 private:
  pid_t pid_ = -1;
  bool exited_ = false;
  std::string out_path_, err_path_;
};

}  // namespace dflash::test
