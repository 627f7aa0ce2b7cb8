// dir_lock.h: one process per directory. A run's output directory (its checkpoints, exports) and
// a generate job's output are written by one dflashd at a time: two writers would interleave
// checkpoints, prune each other's, or commit shards under the same numbers. DirectoryLock holds an
// exclusive flock(2) on DIR/.dflashd.lock while it lives; the kernel drops it when the process
// ends, however it ends (a SIGKILL leaves no stale lock to clean up). The file holds the holder's
// pid and role, which the refusal names.
#pragma once

#include <string>

namespace dflash {

class DirectoryLock {
 public:
  // Creates `dir` (and its parents) if needed, then takes the lock for `role` (e.g. "dflashd
  // run"). Throws std::runtime_error naming the directory, and the holder when another process
  // holds it.
  DirectoryLock(const std::string& dir, const std::string& role);
  ~DirectoryLock();
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;

 private:
  int fd_ = -1;
};

}  // namespace dflash
