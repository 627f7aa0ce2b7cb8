// bounded_queue.h: a bounded multi-producer multi-consumer queue with backpressure.
//
// moodycamel's BlockingConcurrentQueue never refuses an item (try_enqueue grows it), so the
// bound is a counting semaphore of free slots (docs/architecture.md): push() waits for a slot, pop()
// returns one. Waiting is done in short timed slices so that close() wakes everybody and the
// caller can beat its heartbeat; the time producers spent blocked and consumers spent starved
// is accumulated for the metrics.
//
// Order: FIFO per producer thread, not across producers (moodycamel's guarantee); consumers
// that need a global order reorder by sequence number (the drafter workers do).
// Thread-safety: all methods may be called from any thread. Hand-off ordering: an item pushed
// happens-before it is popped (the queue's own release/acquire).
#pragma once

#include <blockingconcurrentqueue.h>
#include <lightweightsemaphore.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <optional>

namespace dflash::pipeline {

template <class T>
class BoundedQueue {
 public:
  explicit BoundedQueue(int64_t capacity) : capacity_(capacity), slots_(static_cast<ssize_t>(capacity)) {}

  // Blocks while full. Returns false (item dropped) if the queue was closed. `beat` runs every
  // slice of waiting (heartbeats).
  bool push(T item, const std::function<void()>& beat = {}) {
    const auto start = std::chrono::steady_clock::now();
    bool waited = false;
    while (!slots_.wait(kSliceMicros)) {
      waited = true;
      if (closed_.load()) return false;
      if (beat) beat();
    }
    if (waited) blocked_nanos_ += elapsed_nanos(start);
    if (closed_.load()) {
      slots_.signal();
      return false;
    }
    items_.enqueue(std::move(item));
    depth_.fetch_add(1);
    return true;
  }

  // Blocks while empty. Returns nullopt once the queue is closed and drained.
  std::optional<T> pop(const std::function<void()>& beat = {}) {
    const auto start = std::chrono::steady_clock::now();
    bool waited = false;
    T item;
    while (!items_.wait_dequeue_timed(item, kSliceMicros)) {
      waited = true;
      if (closed_.load() && depth_.load() == 0) return std::nullopt;
      if (beat) beat();
    }
    if (waited) starved_nanos_ += elapsed_nanos(start);
    depth_.fetch_sub(1);
    slots_.signal();
    return item;
  }

  // Wakes every waiter; pushes fail from now on, pops drain what is left.
  void close() { closed_.store(true); }
  bool closed() const { return closed_.load(); }

  int64_t capacity() const { return capacity_; }
  int64_t depth() const { return depth_.load(); }
  double producer_blocked_seconds() const { return blocked_nanos_.load() * 1e-9; }
  double consumer_starved_seconds() const { return starved_nanos_.load() * 1e-9; }

 private:
  static constexpr int64_t kSliceMicros = 50'000;
  static int64_t elapsed_nanos(std::chrono::steady_clock::time_point start) {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - start).count();
  }
  const int64_t capacity_;
  moodycamel::BlockingConcurrentQueue<T> items_;
  moodycamel::LightweightSemaphore slots_;
  std::atomic<int64_t> depth_{0};
  std::atomic<bool> closed_{false};
  std::atomic<int64_t> blocked_nanos_{0}, starved_nanos_{0};
};

}  // namespace dflash::pipeline
