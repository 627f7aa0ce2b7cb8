#include "decode/generation.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <limits>
#include <mutex>
#include <thread>

namespace dflash::decode {

double generation_eta_seconds(const GenerationProgress& p, int64_t max_new_tokens) {
  const double rate = p.decoded_per_second();
  if (rate <= 0) return std::numeric_limits<double>::infinity();
  const double per_prompt = p.finished > 0 ? static_cast<double>(p.new_tokens) / static_cast<double>(p.finished)
                                           : static_cast<double>(max_new_tokens);
  const double left = static_cast<double>(p.total - p.done_before - p.finished);
  const double in_flight = static_cast<double>(p.decoded - p.new_tokens);
  return std::max(0.0, left * per_prompt - in_flight) / rate;
}

namespace {

// The decoders' threads: each runs decoder->run() over the shared `take` and `finish`, which run
// under the pool's lock (one at a time: they need none of their own). The first failure is kept;
// after it `take` is not called again, so the other decoders finish what they hold and end.
class DecoderPool {
 public:
  DecoderPool(const std::vector<const Decoder*>& decoders, const GenerateSettings& settings, int64_t max_batch,
              const NextRequest& take, const Finished& finish, std::atomic<int64_t>* decoded)
      : take_(take), finish_(finish), running_(decoders.size()) {
    for (const Decoder* decoder : decoders) {
      threads_.emplace_back(
          [this, decoder, &settings, max_batch, decoded] { decode_on(*decoder, settings, max_batch, decoded); });
    }
  }
  ~DecoderPool() { join(); }

  // Calls `during` (without the lock) about every `seconds` until every decoder has ended, then
  // joins their threads and rethrows the first failure (a decoder's, or one `during` threw: the
  // decoders take no more prompts after it and end).
  void wait(double seconds, const std::function<void()>& during) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (!changed_.wait_for(lock, std::chrono::duration<double>(seconds), [&] { return running_ == 0; })) {
      lock.unlock();
      std::exception_ptr failed;
      try {
        during();
      } catch (...) {
        failed = std::current_exception();
      }
      lock.lock();
      if (failed && !failure_) failure_ = failed;
    }
    lock.unlock();
    join();
    if (failure_) std::rethrow_exception(failure_);
  }

  // Holds the lock under which `take` and `finish` run (to read what they count).
  std::unique_lock<std::mutex> lock() { return std::unique_lock<std::mutex>(mutex_); }

 private:
  void decode_on(const Decoder& decoder, const GenerateSettings& settings, int64_t max_batch,
                 std::atomic<int64_t>* decoded) {
    try {
      decoder.run(
          settings, max_batch,
          [this](Request* r) {
            std::lock_guard<std::mutex> lock(mutex_);
            return failure_ == nullptr && take_(r);
          },
          [this](Request&& r, Generation&& g) {
            std::lock_guard<std::mutex> lock(mutex_);
            finish_(std::move(r), std::move(g));
          },
          decoded);
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_) failure_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    --running_;
    changed_.notify_all();
  }

  void join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

  const NextRequest& take_;
  const Finished& finish_;
  // ---- Guarded by mutex_ ----
  std::mutex mutex_;
  std::condition_variable changed_;
  size_t running_;              // decoders not yet ended
  std::exception_ptr failure_;  // the first failure: a decoder's (take or finish included) or wait()'s report
  // ---- The owner's ----
  std::vector<std::thread> threads_;
};

}  // namespace

void run_generation(const std::vector<const Decoder*>& decoders, const std::vector<std::vector<int64_t>>& prompts,
                    const GenerateSettings& settings, int64_t max_batch, ShardedOutput& out,
                    const std::atomic<bool>& stop, double report_seconds,
                    const std::function<void(const GenerationProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Touched only by take and finish, which the pool runs under its lock (report() takes it too):
  // the next prompt to hand out, the output, the counts.
  size_t next = 0;
  int64_t finished = 0, new_tokens = 0;
  std::atomic<int64_t> decoded{0};  // every decoder's new tokens as they come (no lock)
  const NextRequest take = [&](Request* r) {
    if (stop.load()) return false;
    while (next < prompts.size() && out.done_before().count(static_cast<int64_t>(next)) > 0) ++next;
    if (next == prompts.size()) return false;
    *r = {static_cast<int64_t>(next), prompts[next], sequence_seed(settings.seed, next)};
    ++next;
    return true;
  };
  const Finished finish = [&](Request&& r, Generation&& g) {
    ++finished;
    new_tokens += g.new_tokens();
    out.add({r.id, std::move(g.tokens), g.prompt_tokens, g.stopped});
  };
  DecoderPool pool(decoders, settings, max_batch, take, finish, &decoded);
  auto report = [&] {
    const std::unique_lock<std::mutex> lock = pool.lock();
    GenerationProgress p;
    p.total = static_cast<int64_t>(prompts.size());
    p.done_before = static_cast<int64_t>(out.done_before().size());
    p.committed = out.committed();
    p.finished = finished;
    p.new_tokens = new_tokens;
    p.decoded = decoded.load();
    p.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    return p;
  };
  std::exception_ptr failure;
  try {
    pool.wait(report_seconds, [&] { progress(report()); });
  } catch (...) {
    failure = std::current_exception();
  }
  out.flush();  // what finished is committed, failure or not
  progress(report());
  if (failure) std::rethrow_exception(failure);
}

std::vector<Generation> generate_all(const std::vector<const Decoder*>& decoders,
                                     const std::vector<std::vector<int64_t>>& prompts, const GenerateSettings& settings,
                                     int64_t max_batch) {
  std::vector<Generation> out(prompts.size());
  size_t next = 0;  // with several decoders under the pool's lock, as is `out`
  const NextRequest take = [&](Request* r) {
    if (next == prompts.size()) return false;
    *r = {static_cast<int64_t>(next), prompts[next], sequence_seed(settings.seed, next)};
    ++next;
    return true;
  };
  const Finished finish = [&](Request&& r, Generation&& g) { out[static_cast<size_t>(r.id)] = std::move(g); };
  // One decoder runs on the calling thread, on its current streams (the evaluator's own stream,
  // which waits for the hand-over of the drafter's weights); only several need threads.
  if (decoders.size() == 1) {
    decoders.front()->run(settings, max_batch, take, finish);
    return out;
  }
  DecoderPool pool(decoders, settings, max_batch, take, finish, nullptr);
  pool.wait(60, [] {});
  return out;
}

}  // namespace dflash::decode
