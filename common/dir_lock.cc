#include "common/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

#include "common/safetensors.h"

namespace dflash {

DirectoryLock::DirectoryLock(const std::string& dir, const std::string& role) {
  make_directories(dir);
  const std::string path = dir + "/.dflashd.lock";
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0) throw std::runtime_error(path + ": cannot open the directory's lock: " + std::strerror(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    char holder[256] = {};
    const ssize_t n = ::pread(fd_, holder, sizeof holder - 1, 0);
    ::close(fd_);
    fd_ = -1;
    if (error != EWOULDBLOCK) throw std::runtime_error(path + ": cannot lock: " + std::strerror(error));
    std::string who = n > 0 ? std::string(holder, static_cast<size_t>(n)) : "another process";
    while (!who.empty() && (who.back() == '\n' || who.back() == ' ')) who.pop_back();
    throw std::runtime_error(dir + " is in use by " + who + " (" + path + "): one dflashd per directory; stop it, or "
                             "give this one another directory");
  }
  // The holder, for the message of a process refused later.
  const std::string me = role + " (pid " + std::to_string(::getpid()) + ")\n";
  if (::ftruncate(fd_, 0) == 0) (void)!::pwrite(fd_, me.data(), me.size(), 0);
}

DirectoryLock::~DirectoryLock() {
  if (fd_ >= 0) ::close(fd_);  // closing the only descriptor of the lock releases it
}

}  // namespace dflash
