#include "pipeline/checkpoint_writer.h"

namespace dflash::pipeline {

CheckpointWriter::CheckpointWriter(std::function<void(const drafter::CheckpointSnapshot&)> write)
    : write_(std::move(write)), thread_([this] { run(); }) {}

CheckpointWriter::~CheckpointWriter() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  changed_.notify_all();
  thread_.join();
}

drafter::CheckpointSnapshot& CheckpointWriter::acquire() {
  wait_idle();
  return snapshot_;
}

void CheckpointWriter::submit() {
  {
    std::lock_guard lock(mutex_);
    pending_ = true;
  }
  changed_.notify_all();
}

void CheckpointWriter::wait_idle() {
  std::unique_lock lock(mutex_);
  changed_.wait(lock, [&] { return !pending_; });
}

void CheckpointWriter::run() {
  std::unique_lock lock(mutex_);
  while (true) {
    changed_.wait(lock, [&] { return pending_ || stopping_; });
    if (!pending_) return;  // stopping with nothing left to write
    lock.unlock();
    write_(snapshot_);
    lock.lock();
    pending_ = false;
    changed_.notify_all();
  }
}

}  // namespace dflash::pipeline
