// checkpoint_writer.h: checkpoints written off the drafter's thread.
//
// The drafter's replica 0 takes a snapshot between steps (drafter::CheckpointSnapshot: one
// device-to-host copy into page-locked buffers) and hands it over; this component's thread writes
// it (the same COMMIT protocol, the same bytes as a synchronous write) while training goes on.
// Before the 27B drafter's final checkpoint (21 GB) was written on the drafter thread: 44 s
// during which every replica waited.
//
// One snapshot is in flight at a time: acquire() waits for the previous write to finish before
// handing out the buffers again (a checkpoint cadence shorter than a write slows training down
// to the disk's pace instead of queueing snapshots in host memory).
//
// Threads: acquire() / submit() / wait_idle() from one thread (the drafter's replica 0, or the
// owner once the workers are joined); `write` runs on the writer's thread.
#pragma once

#include <condition_variable>
#include <functional>
#include <mutex>
#include <thread>

#include "drafter/checkpoint.h"

namespace dflash::pipeline {

class CheckpointWriter {
 public:
  // `write` writes one snapshot (and whatever goes with it: pruning, metrics, exports); it must
  // not throw.
  explicit CheckpointWriter(std::function<void(const drafter::CheckpointSnapshot&)> write);
  ~CheckpointWriter();  // finishes the write in flight
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  // Waits until no write is in flight; returns the snapshot to fill.
  drafter::CheckpointSnapshot& acquire();
  // Writes the acquired snapshot on the writer's thread.
  void submit();
  // Waits until no write is in flight.
  void wait_idle();

 private:
  void run();
  const std::function<void(const drafter::CheckpointSnapshot&)> write_;
  drafter::CheckpointSnapshot snapshot_;  // owned by the caller between acquire() and submit(), else by the writer
  std::mutex mutex_;
  std::condition_variable changed_;
  bool pending_ = false;   // guarded by mutex_: a submitted snapshot not yet written
  bool stopping_ = false;  // guarded by mutex_
  std::thread thread_;     // last: starts once the fields above exist
};

}  // namespace dflash::pipeline
