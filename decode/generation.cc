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

void run_generation(const std::vector<const Decoder*>& decoders, const std::vector<std::vector<int64_t>>& prompts,
                    const GenerateSettings& settings, int64_t max_batch, ShardedOutput& out,
                    const std::atomic<bool>& stop, double report_seconds,
                    const std::function<void(const GenerationProgress&)>& progress) {
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  // Shared by the decoders' threads, guarded by `mutex`: the next prompt to hand out, the output,
  // the counts, the first failure.
  std::mutex mutex;
  std::condition_variable changed;
  size_t next = 0;
  int64_t finished = 0, new_tokens = 0;
  size_t running = decoders.size();
  std::atomic<int64_t> decoded{0};  // every decoder's new tokens as they come (no lock)
  std::exception_ptr failure;
  auto failed = [&] { return failure != nullptr; };

  auto take = [&](Request* r) {
    std::lock_guard<std::mutex> lock(mutex);
    if (stop.load() || failed()) return false;
    while (next < prompts.size() && out.done_before().count(static_cast<int64_t>(next)) > 0) ++next;
    if (next == prompts.size()) return false;
    *r = {static_cast<int64_t>(next), prompts[next], sequence_seed(settings.seed, next)};
    ++next;
    return true;
  };
  auto finish = [&](Request&& r, Generation&& g) {
    std::lock_guard<std::mutex> lock(mutex);
    ++finished;
    new_tokens += g.new_tokens();
    out.add({r.id, std::move(g.tokens), g.prompt_tokens, g.stopped});
  };
  std::vector<std::thread> threads;
  for (const Decoder* decoder : decoders) {
    threads.emplace_back([&, decoder] {
      try {
        decoder->run(settings, max_batch, take, finish, &decoded);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex);
        if (!failure) failure = std::current_exception();
      }
      std::lock_guard<std::mutex> lock(mutex);
      --running;
      changed.notify_all();
    });
  }
  auto report = [&] {
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
  {
    std::unique_lock<std::mutex> lock(mutex);
    while (running > 0) {
      if (!changed.wait_for(lock, std::chrono::duration<double>(report_seconds), [&] { return running == 0; })) {
        const GenerationProgress p = report();
        lock.unlock();
        progress(p);
        lock.lock();
      }
    }
  }
  for (std::thread& t : threads) t.join();
  out.flush();
  progress(report());
  if (failure) std::rethrow_exception(failure);
}

}  // namespace dflash::decode
