// streams.h: the GPU side of the workers. Each worker thread runs on its own CUDA stream (so a
// target and a drafter sharing a GPU overlap instead of queueing behind each other on one
// stream); features cross from the target's stream to the drafter's through a CUDA event; and
// every stage of a worker's loop is timed on its stream with CUDA events, read back one
// iteration later so the timing never stalls the GPU. On the CPU all of it is host clocks and
// no-ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace dflash::pipeline {

// Makes a fresh stream of `device`'s pool current for this thread while alive (CPU: nothing).
class WorkerStream {
 public:
  explicit WorkerStream(at::Device device);
  ~WorkerStream();
  WorkerStream(const WorkerStream&) = delete;
  WorkerStream& operator=(const WorkerStream&) = delete;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A GPU shared by a target and a drafter worker runs one role at a time: a worker takes the
// GPU's turn for one iteration and gives it back once its stream has drained, so the stage
// times are the roles' own and not their contention. (Measured on an H200 at the 27B shapes,
// bench/RESULTS.md: the two roles' kernels at once gave 2.5-3.5% more tokens/s than in turns, at
// the price of stage times that mean nothing; gpus.shared_gpu chooses.) With a null mutex:
// nothing.
class GpuTurn {
 public:
  GpuTurn(std::mutex* turn, at::Device device);
  ~GpuTurn();
  GpuTurn(const GpuTurn&) = delete;
  GpuTurn& operator=(const GpuTurn&) = delete;

 private:
  std::unique_lock<std::mutex> lock_;
  at::Device device_;
};

// An event recorded after the producer's work on `device`'s current stream (null on the CPU).
class ReadyEvent;
std::shared_ptr<ReadyEvent> mark_ready(at::Device device);
// Makes the consumer's current stream wait for `ready`, and tells the allocator that `tensors`
// (made on the producer's stream) are in use on the consumer's stream until its work is done.
void wait_ready(const std::shared_ptr<ReadyEvent>& ready, const std::vector<at::Tensor>& tensors);

// Seconds per named stage of one worker's loop (device time on a GPU, wall time on the CPU).
class StageClock {
 public:
  explicit StageClock(at::Device device);
  ~StageClock();
  void start();                         // an iteration begins (resolves the previous one)
  void lap(const std::string& stage);   // the time since the previous mark belongs to `stage`
  std::map<std::string, double> totals() const;  // seconds per stage of resolved iterations
  int64_t iterations() const;                     // how many iterations those are

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::pipeline
