// decode_bench: speculative decoding's pieces at a target's shapes on a GPU (random weights,
// bf16, every layer; a random drafter of the DFlash shape for the target):
//   1. prefill of a PROMPT-token prompt;
//   2. one plain decode step (1 token) and one verify step (BLOCK tokens), target only, each with
//      the crop that follows it in speculative decoding;
//   3. the drafter's block (context cache of the prompt) and its extension by BLOCK tokens;
//   4. plain decoding and speculative decoding of PROMPTS prompts x NEW tokens end to end (the
//      random drafter accepts almost nothing: its tokens/s is the floor of speculative decoding,
//      the step times give what an acceptance length L buys: L tokens per drafter + verify step).
// Usage: decode_bench CONFIG_DIR [PROMPTS NEW PROMPT_TOKENS MAX_BATCH]   (needs a GPU); DECODE_BATCHES="16 64 128"
// sets the batch sizes of the batched rounds (16 and 64 by default; a batch whose caches do not fit
// the GPU is reported and skipped); DECODE_DTYPE=float8 keeps the projections block-scaled FP8;
// DECODE_STATE_DTYPE=bfloat16 keeps the GatedDeltaNet states in bf16 (target.decode_state_dtype);
// DECODE_STAGES=S builds the target as S pipeline stages, all on cuda:0 (what a split costs a step
// beyond the stages' own work: their host planning and the stream's hand-over; one GPU).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <nvtx3/nvToolsExt.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernel_profile.h"
#include "bench/timing.h"
#include "common/kernel_variants.h"
#include "config/config.h"
#include "decode/eval.h"
#include "decode/sampling.h"
#include "drafter/drafter_config.h"
#include "target/fused_ops.h"
#include "target/incremental.h"
#include "target/stages.h"
#include "target/kernels/decode_attention.h"
#include "target/kernels/gated_delta_net.h"
#include "target/kernels/grouped_fp8.h"
#include "target/model.h"

using namespace dflash;
using bench::median_ms;

namespace {


// The verify step (and the crop after an unaccepted block), its GatedDeltaNet rule chunked (the
// default, `chunked`) and token by token, measured in alternation (the first of two back-to-back
// series ran slower either way: allocator and clock warm-up): the second-best of 4 rounds each.
std::pair<double, double> verify_ms(const target::IncrementalTarget& chunked, const target::IncrementalTarget& token_by_token,
                                    target::DecodeCache& cache, const at::Tensor& block, const std::vector<int64_t>& tap,
                                    int64_t prompt_tokens) {
  auto verify_with = [&](const target::IncrementalTarget& t) {
    return median_ms(5, [&] {
      t.step(cache, block, tap);
      t.crop(cache, prompt_tokens + 1);
      t.crop(cache, prompt_tokens);
    });
  };
  std::vector<double> a, b;
  for (int round = 0; round < 4; ++round) {
    a.push_back(verify_with(chunked));
    b.push_back(verify_with(token_by_token));
  }
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  return {a[1], b[1]};
}

// GPU memory held by tensors now and at most so far, GB (for the log: where memory goes).
void print_memory(const char* where) {
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(0);
  std::printf("[memory after %s: %.1f GB allocated, peak %.1f GB]\n", where,
              static_cast<double>(stats.allocated_bytes[0].current) / 1e9,
              static_cast<double>(stats.allocated_bytes[0].peak) / 1e9);
}

// The host's time in `call` on an idle GPU (the median of 5), `before` run first each time (the
// GPU then drained): a call's host work, which a step queued behind others hides.
double host_call_ms(const std::function<void()>& before, const std::function<void()>& call) {
  std::vector<double> host;
  for (int i = 0; i < 5; ++i) {
    before();
    c10::cuda::device_synchronize();
    const auto start = std::chrono::steady_clock::now();
    call();
    host.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  c10::cuda::device_synchronize();
  std::sort(host.begin(), host.end());
  return host[host.size() / 2];
}

// Steps alternating between every sequence and all but the middle one, as when a sequence
// finishes and a prompt joins: each step's members are not the last step's batch in order (what
// generation with responses of different lengths meets every few steps; the states are read
// where they lie and the keys and values stay in place, rather than every cache regathered).
// The mean of the two steps.
double changing_batch_ms(const target::IncrementalTarget& target, const std::vector<target::DecodeCache*>& all,
                         const std::vector<at::Tensor>& one) {
  std::vector<target::DecodeCache*> but_one = all;
  but_one.erase(but_one.begin() + static_cast<int64_t>(all.size() / 2));
  const std::vector<at::Tensor> one_fewer(one.begin(), one.begin() + static_cast<int64_t>(but_one.size()));
  const double ms = median_ms(5, [&] {
    target.step_batch(all, one, {}, /*croppable=*/false);
    target.step_batch(but_one, one_fewer, {}, /*croppable=*/false);
  }) / 2;
  // What planning a changed batch costs the host: its time in the changed step's call, after a
  // step of every sequence.
  const double host = host_call_ms([&] { target.step_batch(all, one, {}, /*croppable=*/false); },
                                   [&] { target.step_batch(but_one, one_fewer, {}, /*croppable=*/false); });
  std::printf("batch of %3lld: the host returns from a changed step (one sequence fewer) after %.2f ms\n",
              static_cast<long long>(all.size()), host);
  // DFLASHD_PROFILE=1: the changed step's kernels, to set beside the plain step's.
  if (std::getenv("DFLASHD_PROFILE") != nullptr) {
    target.step_batch(all, one, {}, /*croppable=*/false);
    c10::cuda::device_synchronize();
    bench::print_kernel_profile(("changed step of " + std::to_string(but_one.size())).c_str(), [&] {
      target.step_batch(but_one, one_fewer, {}, /*croppable=*/false);
      c10::cuda::device_synchronize();
    }, 45);
  }
  return ms;
}

// Plain steps as a decoding loop runs them, each queued while the last one runs (the median of 3
// runs of 8, per step), and the host's time in one step_batch call on an idle GPU (the median of
// 5): a step's host work that the GPU waits for shows as the first above the kernels' time.
std::pair<double, double> back_to_back_ms(const target::IncrementalTarget& target,
                                          const std::vector<target::DecodeCache*>& all,
                                          const std::vector<at::Tensor>& one) {
  constexpr int kSteps = 8;
  const double steps = median_ms(3, [&] {
    for (int i = 0; i < kSteps; ++i) target.step_batch(all, one, {}, /*croppable=*/false);
  }) / kSteps;
  return {steps, host_call_ms([] {}, [&] { target.step_batch(all, one, {}, /*croppable=*/false); })};
}

// DFLASHD_PROFILE=1: where a batched plain step's GPU time goes (GPU time far below the wall
// time means the step is bound by launches, not by the kernels).
void profile_plain_step(const target::IncrementalTarget& target, const std::vector<target::DecodeCache*>& all,
                        const std::vector<at::Tensor>& one) {
  if (std::getenv("DFLASHD_PROFILE") == nullptr) return;
  // The NVTX range names this step for Nsight Compute (`--nvtx --nvtx-include plain_step_128/`).
  const std::string name = "plain_step_" + std::to_string(all.size());
  bench::print_kernel_profile(("plain step of " + std::to_string(all.size())).c_str(), [&] {
    nvtxRangePushA(name.c_str());
    target.step_batch(all, one, {}, /*croppable=*/false);
    c10::cuda::device_synchronize();
    nvtxRangePop();
  }, 45);
}

// The same steps back to back with a kernel hook set (on, then off again), to compare in one
// process: every bf16 projection on cuBLASLt (the stream-K GEMM and its SwiGLU epilogue off:
// kernel_variants.h), or FlashAttention's kernel for the one-token attention
// (target/kernels/decode_attention.h).
double back_to_back_with(const target::IncrementalTarget& target, const std::vector<target::DecodeCache*>& all,
                         const std::vector<at::Tensor>& one, const std::function<void(bool)>& hook) {
  hook(true);
  const double ms = back_to_back_ms(target, all, one).first;
  hook(false);
  return ms;
}

// An FP8 MoE target (DECODE_DTYPE=float8): the same steps back to back with its experts
// dequantized per layer for ATen's bf16 grouped GEMM (grouped_fp8::off, the path before the FP8
// grouped GEMM).
void print_fp8_experts_dequantized(const target::IncrementalTarget& target,
                                   const std::vector<target::DecodeCache*>& all, const std::vector<at::Tensor>& one) {
  const auto paths = target.stage(0).kernel_paths();
  if (target.config().num_experts == 0 || paths.at("target.projections").path != "fp8") return;
  const double ms = back_to_back_with(target, all, one, [](bool on) { grouped_fp8::off = on; });
  std::printf("batch of %3zu: plain steps back to back with the FP8 experts dequantized per layer %.2f ms each\n",
              all.size(), ms);
}

// What choosing a plain step's tokens costs: the argmaxes (of the bf16 logits, as the decoders
// take them, and of the same logits widened to fp32 first, for comparison), and sampled draws
// (temperature 0.7, with and without top-p 0.95: sampling_probs then choose_rows, all rows at
// once), the median of 5 each; DFLASHD_PROFILE=1: the sampled draw's kernels.
void sampled_choice(const std::vector<target::DecodeOutput>& out, int64_t batch) {
  std::vector<at::Tensor> rows;
  for (const target::DecodeOutput& o : out) rows.push_back(o.logits);
  const at::Tensor logits = at::cat(rows);
  const std::vector<double> u(static_cast<size_t>(logits.size(0)), 0.5);
  decode::Sampling top_p{0.7, 0.95, 0}, all{0.7, 1.0, 0};
  const auto draw = [&](const decode::Sampling& s) { decode::choose_rows(decode::sampling_probs(logits, s), u); };
  const double greedy = median_ms(5, [&] { (void)logits.argmax(-1); });
  const double widened = median_ms(5, [&] { (void)target::widen_to_float(logits).argmax(-1); });
  const double plain = median_ms(5, [&] { draw(all); }), nucleus = median_ms(5, [&] { draw(top_p); });
  std::printf("batch of %3lld: choosing the tokens: argmax %.3f ms (widened to fp32 first %.3f); sampled at "
              "temperature 0.7 %.2f ms, with top-p 0.95 %.2f ms\n",
              static_cast<long long>(batch), greedy, widened, plain, nucleus);
  if (std::getenv("DFLASHD_PROFILE") != nullptr) {
    bench::print_kernel_profile("a sampled choice with top-p", [&] {
      draw(top_p);
      c10::cuda::device_synchronize();
    }, 12);
  }
}

// Fresh caches, each prefilled with a random prompt of `prompt_tokens` tokens as `dflashd
// generate` prefills: as many prompts together as one prefill batch takes.
void prefill_random(const target::IncrementalTarget& target, std::vector<target::DecodeCache>& caches,
                    int prompt_tokens) {
  const int64_t vocab = target.config().vocab_size, batch = static_cast<int64_t>(caches.size());
  const int64_t per_prefill = std::max<int64_t>(1, target::IncrementalTarget::kPrefillBatchTokens / prompt_tokens);
  for (int64_t first = 0; first < batch; first += per_prefill) {
    const int64_t n = std::min(per_prefill, batch - first);
    std::vector<target::DecodeCache*> some;
    std::vector<at::Tensor> prompts;
    for (int64_t j = first; j < first + n; ++j) {
      caches[static_cast<size_t>(j)] = target.new_cache();
      some.push_back(&caches[static_cast<size_t>(j)]);
      prompts.push_back(at::randint(0, vocab - 1, {prompt_tokens}, at::TensorOptions().dtype(at::kLong)));
    }
    target.prefill_batch(some, prompts, {});
  }
}

// prefill_random over every cache, timed: the batch's prefills as `dflashd generate` runs them.
void timed_prefills(const target::IncrementalTarget& target, std::vector<target::DecodeCache>& caches,
                    int64_t prompt_tokens) {
  c10::cuda::device_synchronize();
  const auto start = std::chrono::steady_clock::now();
  prefill_random(target, caches, prompt_tokens);
  c10::cuda::device_synchronize();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto batch = static_cast<long long>(caches.size());
  std::printf("batch of %3lld: prefills of %lld prompts of %lld tokens (as generate batches them): %.1f ms "
              "(%.0f tok/s)\n",
              batch, batch, static_cast<long long>(prompt_tokens), 1e3 * seconds,
              static_cast<double>(batch * prompt_tokens) / seconds);
  // DFLASHD_PROFILE=1: one prefill forward's kernels (as many prompts as one takes).
  if (std::getenv("DFLASHD_PROFILE") != nullptr) {
    std::vector<target::DecodeCache> one_forward(
        static_cast<size_t>(std::max<int64_t>(1, target::IncrementalTarget::kPrefillBatchTokens / prompt_tokens)));
    bench::print_kernel_profile("one prefill forward", [&] {
      prefill_random(target, one_forward, static_cast<int>(prompt_tokens));
      c10::cuda::device_synchronize();
    }, 20);
  }
}

// A batch's plain steps (one token each), timed one by one (the host waiting) and back to back,
// and back to back with cuBLASLt's projections, with FlashAttention's kernel and with every
// GatedDeltaNet state stored every step (bf16 states defer them otherwise). Printed as soon
// as measured: on a GPU too small for the later rounds (an H100 at 128 sequences of 27B shapes)
// they still report before the allocation that fails. Returns the step timed one by one.
double plain_rounds(const target::IncrementalTarget& target, const std::vector<target::DecodeCache*>& all,
                    const std::vector<at::Tensor>& one, double plain_one) {
  const int64_t batch = static_cast<int64_t>(all.size());
  const double plain = median_ms(5, [&] { target.step_batch(all, one, {}, /*croppable=*/false); });
  const auto [back_to_back, enqueue] = back_to_back_ms(target, all, one);
  const double back_to_back_lt =
      back_to_back_with(target, all, one, [](bool on) { force_mma_sync(MmaKernels::projections, on); });
  const double back_to_back_fa =
      back_to_back_with(target, all, one, [](bool on) { target::kernels::decode_attention_off = on; });
  const double back_to_back_stored =
      back_to_back_with(target, all, one, [](bool on) { target::kernels::deferred_stores_off = on; });
  std::printf("batch of %3lld: plain step %7.2f ms (%6.0f tok/s, %.1fx one sequence's rate)\n",
              static_cast<long long>(batch), plain, 1e3 * static_cast<double>(batch) / plain,
              static_cast<double>(batch) * plain_one / plain);
  std::printf("batch of %3lld: plain steps back to back %.2f ms each (%.0f tok/s); the host returns from one after "
              "%.2f ms\nbatch of %3lld: plain steps back to back with cuBLASLt's projections (not the stream-K GEMM) "
              "%.2f ms each (%.0f tok/s)\n",
              static_cast<long long>(batch), back_to_back, 1e3 * static_cast<double>(batch) / back_to_back, enqueue,
              static_cast<long long>(batch), back_to_back_lt, 1e3 * static_cast<double>(batch) / back_to_back_lt);
  std::printf("batch of %3lld: plain steps back to back with FlashAttention's kernel for the attention %.2f ms each\n",
              static_cast<long long>(batch), back_to_back_fa);
  std::printf("batch of %3lld: plain steps back to back storing every GatedDeltaNet state every step (bf16 states: "
              "stores not deferred) %.2f ms each\n",
              static_cast<long long>(batch), back_to_back_stored);
  return plain;
}

// Batched rounds of `batch` sequences whose caches hold `prompt_tokens` tokens: a plain step (1
// token each), a verify step (a block each) with the crops after it, and the drafter's batched
// block and context extension; then what 64 x 256 new tokens cost at acceptance length L.
void batched_steps(const target::IncrementalTarget& target, const drafter::Drafter& d, int64_t batch,
                   int prompt_tokens, double plain_one) {
  const int64_t vocab = target.config().vocab_size, block = d.shape().block_size;
  const std::vector<int64_t> tap(d.shape().target_layer_ids.begin(), d.shape().target_layer_ids.end());
  const auto random_ids = [&](int64_t n) {
    return at::randint(0, vocab - 1, {n}, at::TensorOptions().dtype(at::kLong));
  };
  std::vector<target::DecodeCache> caches(static_cast<size_t>(batch));
  std::vector<drafter::DrafterContextCache> contexts(static_cast<size_t>(batch));
  std::vector<target::DecodeCache*> all;
  std::vector<const drafter::DrafterContextCache*> all_contexts;
  at::Tensor features;
  for (size_t j = 0; j < caches.size(); ++j) all.push_back(&caches[j]);
  timed_prefills(target, caches, prompt_tokens);
  {  // one prompt's tapped features: every drafter context is this prompt's
    target::DecodeCache scratch = target.new_cache();
    features = target.prefill(scratch, random_ids(prompt_tokens), tap).features;
  }
  // Each drafter context holds the prompt less a block, grown from one row (capacity 256, then
  // doubled), so that the timed extension below fits its capacity: a context doubles when it
  // fills, which a sequence meets once per doubling, not in every round.
  const int64_t held = std::max<int64_t>(2, prompt_tokens - block);
  for (size_t j = 0; j < caches.size(); ++j) {
    d.extend_context(contexts[j], features.narrow(0, 0, 1));
    d.extend_context(contexts[j], features.narrow(0, 1, held - 1));
    all_contexts.push_back(&contexts[j]);
  }
  const std::vector<int64_t> lengths(static_cast<size_t>(batch), prompt_tokens);
  auto round = [&](int64_t n, const std::vector<int64_t>& taps) {
    const std::vector<at::Tensor> ids(static_cast<size_t>(batch), random_ids(n));
    return median_ms(5, [&] {
      target.step_batch(all, ids, taps);
      target.crop_batch(all, lengths);
    });
  };
  print_memory("the batch's prefills");
  // Plain steps as plain decoding runs them: nothing kept for a crop, the caches growing (by 20
  // tokens over the rounds and the profile); the verify rounds below crop back to the prompt.
  const std::vector<at::Tensor> one(static_cast<size_t>(batch), random_ids(1));
  const double plain = plain_rounds(target, all, one, plain_one);
  print_fp8_experts_dequantized(target, all, one);
  print_memory("plain rounds");
  profile_plain_step(target, all, one);
  const double changing = changing_batch_ms(target, all, one);
  std::printf("batch of %3lld: plain steps alternating with one sequence fewer (the batch changing every step): "
              "%.2f ms (+%.2f ms)\n",
              static_cast<long long>(batch), changing, changing - plain);
  sampled_choice(target.step_batch(all, one, {}, /*croppable=*/false), batch);
  // Back to the prompts for the verify rounds: a plain step keeps nothing to crop with, so the
  // caches are prefilled again.
  prefill_random(target, caches, prompt_tokens);
  const double verify = round(block, tap);
  print_memory("verify rounds");
  const std::vector<at::Tensor> blocks(static_cast<size_t>(batch), random_ids(block));
  const double draft = median_ms(5, [&] { d.block_hiddens(all_contexts, blocks, target.embed_tokens()); });
  const std::vector<at::Tensor> accepted(static_cast<size_t>(batch), features.narrow(0, 0, 5));
  const double extend = median_ms(5, [&] {
    std::vector<drafter::DrafterContextCache> copies = contexts;
    std::vector<drafter::DrafterContextCache*> pointers;
    for (auto& c : copies) pointers.push_back(&c);
    d.extend_contexts(pointers, accepted);
  });
  const double spec_round = verify + draft + extend;
  std::printf("batch of %3lld: verify step + crop %7.2f ms, drafter block %.2f ms, context extension %.2f ms\n",
              static_cast<long long>(batch), verify, draft, extend);
  std::printf("batch of %3lld: 64 prompts x 256 new tokens: plain %.1f s; speculative at L = 3 / 5: %.1f / %.1f s\n",
              static_cast<long long>(batch), 64.0 / batch * 256 * plain / 1e3, 64.0 / batch * 256 / 3 * spec_round / 1e3,
              64.0 / batch * 256 / 5 * spec_round / 1e3);
}

// Plain and speculative decoding of `prompts` random prompts end to end (decode/eval.h), at most
// `max_batch` at once on each of the decoders (one per stage of the target).
void end_to_end(const target::IncrementalTarget& target, const drafter::Drafter& d, int prompts, int new_tokens,
                int prompt_tokens, int max_batch) {
  const int64_t vocab = target.config().vocab_size;
  std::vector<decode::EvalPrompt> set;
  for (int i = 0; i < prompts; ++i) {
    const at::Tensor p = at::randint(0, vocab - 1, {prompt_tokens}, at::TensorOptions().dtype(at::kLong));
    set.push_back({std::vector<int64_t>(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + prompt_tokens), "random"});
  }
  decode::GenerateSettings settings;
  settings.max_new_tokens = new_tokens;
  const decode::SpeculativeDecoder spec(target, d);
  const decode::EvalReport r = decode::evaluate(std::vector<const decode::Decoder*>(target.stage_count(), &spec), set,
                                                settings, true, max_batch);
  std::printf("%d prompts x %d new tokens, %d at once on each of %lld decoder(s): plain %.1f s (%.1f tok/s), "
              "speculative %.1f s (%.1f tok/s) with the random drafter (acceptance length %.3f)\n",
              prompts, new_tokens, max_batch, static_cast<long long>(r.decoders), r.plain_seconds,
              r.plain_tokens_per_second, r.spec_seconds, r.spec_tokens_per_second, r.acceptance_length);
}

// DECODE_BATCHES="16 64 128": the batch sizes of the batched rounds (16 and 64 unless given).
std::vector<int64_t> batch_sizes() {
  const char* b = std::getenv("DECODE_BATCHES");
  if (b == nullptr) return {16, 64};
  std::vector<int64_t> batches;
  for (char* end = nullptr; *b != 0; b = end) {
    const long long v = std::strtoll(b, &end, 10);
    if (end == b) break;
    batches.push_back(v);
  }
  return batches;
}

// The target's options: bf16 on cuda:0; DECODE_STATE_DTYPE=bfloat16 keeps the GatedDeltaNet states
// in bf16 (target.decode_state_dtype), DECODE_DTYPE=float8 the projections block-scaled FP8
// (target.dtype: float8).
target::TargetOptions bench_options() {
  target::TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, false};
  const char* state_dtype = std::getenv("DECODE_STATE_DTYPE");
  const bool bf16_states = state_dtype != nullptr && std::string(state_dtype) == "bfloat16";
  options.decode_state_dtype = bf16_states ? at::kBFloat16 : at::kFloat;
  const char* dtype = std::getenv("DECODE_DTYPE");
  options.fp8_weights = dtype != nullptr && std::string(dtype) == "float8";
  return options;
}

}  // namespace

// One sequence: its prefill, plain and verify steps, the drafter's block and context extension,
// and what a speculative step costs against a plain one. Returns {plain step, speculative step} ms.
std::pair<double, double> single_sequence_steps(const target::IncrementalTarget& target,
                                                const std::vector<const target::TargetModel*>& stages,
                                                const drafter::Drafter& d, int64_t vocab_size, int prompt_tokens) {
  const int64_t block = d.shape().block_size;
  const std::vector<int64_t> tap(d.shape().target_layer_ids.begin(), d.shape().target_layer_ids.end());
  const auto ids = [&](int64_t n) {
    return at::randint(0, vocab_size - 1, {n}, at::TensorOptions().dtype(at::kLong));
  };
  const at::Tensor prompt = ids(prompt_tokens);
  target::DecodeCache cache = target.new_cache();
  target::DecodeOutput out;
  const double prefill = median_ms(3, [&] {
    cache = target.new_cache();
    out = target.prefill(cache, prompt, tap);
  });
  const at::Tensor one = ids(1), verify_block = ids(block);
  const double plain_step = median_ms(10, [&] {
    target.step(cache, one, {});
    target.crop(cache, prompt_tokens);
  });
  if (std::getenv("DFLASHD_PROFILE") != nullptr) {
    bench::print_kernel_profile("plain decode step, one sequence", [&] {
      target.step(cache, one, {});
      target.crop(cache, prompt_tokens);
      c10::cuda::device_synchronize();
    }, 15);
  }
  const target::IncrementalTarget token_by_token(stages, 64);
  const auto [verify_step, verify_recurrent] = verify_ms(target, token_by_token, cache, verify_block, tap, prompt_tokens);
  drafter::DrafterContextCache context;
  d.extend_context(context, out.features);
  const at::Tensor block_ids = ids(block);
  const double draft = median_ms(10, [&] { d.block_hidden(context, block_ids, target.embed_tokens()); });
  const at::Tensor block_features = out.features.narrow(0, 0, block);
  const double extend = median_ms(10, [&] {
    drafter::DrafterContextCache c = context;
    d.extend_context(c, block_features);
  });
  std::printf("prompt of %d tokens: prefill %.1f ms\n", prompt_tokens, prefill);
  std::printf("plain decode step (1 token):      %7.2f ms\n", plain_step);
  std::printf("verify step (%lld tokens):         %7.2f ms  (%.2fx a plain step)\n", static_cast<long long>(block),
              verify_step, verify_step / plain_step);
  std::printf("verify step, rule token by token:   %7.2f ms\n", verify_recurrent);
  std::printf("drafter block (%lld rows):          %7.2f ms; context extension by %lld: %.2f ms\n",
              static_cast<long long>(block), draft, static_cast<long long>(block), extend);
  const double per_step = verify_step + draft + extend;
  std::printf("speculative step %.2f ms: break-even acceptance length %.2f; at L = 3 / 5 / 7: %.2fx / %.2fx / %.2fx plain\n",
              per_step, per_step / plain_step, 3 * plain_step / per_step, 5 * plain_step / per_step,
              7 * plain_step / per_step);

  return {plain_step, per_step};
}

int main(int argc, char** argv) {
  if (argc < 2 || !at::hasCUDA()) {
    std::fprintf(stderr, "usage: decode_bench CONFIG_DIR [PROMPTS NEW PROMPT_TOKENS MAX_BATCH] (needs a GPU)\n");
    return 2;
  }
  const int prompts = argc > 2 ? std::atoi(argv[2]) : 4;
  const int new_tokens = argc > 3 ? std::atoi(argv[3]) : 64;
  const int prompt_tokens = argc > 4 ? std::atoi(argv[4]) : 512;
  const int max_batch = argc > 5 ? std::atoi(argv[5]) : 64;
  c10::InferenceMode inference;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines reach the log even if a later stage aborts
  const target::ModelConfig config = target::load_model_config(argv[1]);
  const target::TargetOptions options = bench_options();
  const bool bf16_states = options.decode_state_dtype == at::kBFloat16;
  const char* stages_text = std::getenv("DECODE_STAGES");
  const size_t stages = stages_text == nullptr ? 1 : static_cast<size_t>(std::max(1, std::atoi(stages_text)));
  auto model = target::random_staged_target(config, config.num_layers - 1,
                                            std::vector<target::TargetOptions>(stages, options), 1);
  const target::IncrementalTarget target(model->models());
  const drafter::DrafterShape shape = drafter::shape_for_target(config, config::DrafterConfig{});
  drafter::Drafter d(shape, at::TensorOptions().device(options.device).dtype(options.dtype));
  d.init_random(1);
  const int64_t block = shape.block_size;
  std::printf("target %s: %lld layers in %zu stage(s), %s, %s GatedDeltaNet states, random weights; drafter %lld "
              "layers, block %lld\n",
              argv[1], static_cast<long long>(config.num_layers), stages,
              options.fp8_weights ? "FP8 projections" : "bf16", bf16_states ? "bf16" : "fp32",
              static_cast<long long>(shape.num_layers), static_cast<long long>(block));

  const auto [plain_step, per_step] =
      single_sequence_steps(target, model->models(), d, config.vocab_size, prompt_tokens);
  print_memory("the single-sequence steps");
  for (int64_t batch : batch_sizes()) {
    // A batch whose caches do not fit this GPU (128 sequences at 27B shapes on an 80 GB card) is
    // reported and skipped: its caches are freed as batched_steps unwinds, and the caching
    // allocator returns cached blocks to the driver by itself when the next batch needs them.
    try {
      batched_steps(target, d, batch, prompt_tokens, plain_step);
    } catch (const c10::OutOfMemoryError& e) {
      const std::string what = e.what_without_backtrace();
      std::printf("batch of %3lld: skipped, out of GPU memory: %s\n", static_cast<long long>(batch),
                  what.substr(0, what.find('\n')).c_str());
    }
  }
  end_to_end(target, d, prompts, new_tokens, prompt_tokens, max_batch);
  std::printf("64 prompts x 256 tokens at acceptance length L: %.0f s plain; speculative %.0f s at L = 3, %.0f s at L = 5\n",
              64.0 * 256.0 * plain_step / 1e3, 64.0 * 256.0 / 3.0 * per_step / 1e3, 64.0 * 256.0 / 5.0 * per_step / 1e3);
  return 0;
}
