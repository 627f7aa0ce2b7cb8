// Incremental decoding (target/incremental.h) and speculative decoding (decode/speculative.h) on
// tiny random targets, fp32 on the CPU.
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <set>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "config/config.h"
#include "decode/generation.h"
#include "decode/sampling.h"
#include "decode/speculative.h"
#include "drafter/model.h"
#include "target/fused_ops.h"
#include "target/incremental.h"
#include "target/model.h"
#include "target/model_config.h"
#include "target/stages.h"
#include "tests/kernel_sized.h"
#include "tests/test_util.h"

namespace dflash::target {
namespace {

const char* const kPresets[] = {"tiny-qwen3_5", "tiny-qwen3_next", "tiny-qwen3", "tiny-llama"};

// The full forward's logits and tapped features of one whole sequence (the oracle).
struct Full {
  at::Tensor logits, features;
};
Full full_forward(const TargetModel& model, const at::Tensor& ids, const std::vector<int64_t>& tap) {
  std::vector<int64_t> layers = tap;
  if (layers.empty() || layers.back() != model.last_layer()) layers.push_back(model.last_layer());
  const std::vector<at::Tensor> out = model.forward(ids, {0, ids.size(0)}, layers);
  const ModelConfig& c = model.config();
  const at::Tensor normed = rms_norm_rows(out.back(), model.final_norm_weight(), c.rms_norm_eps, c.zero_centred_norm);
  return {at::matmul(normed, model.lm_head().t()).to(at::kFloat),
          at::cat(std::vector<at::Tensor>(out.begin(), out.begin() + static_cast<int64_t>(tap.size())), -1)};
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

TEST(IncrementalTarget, StepsAndCropsMatchTheFullForward) {
  for (const char* preset : kPresets) {
    for (int64_t recurrent : {int64_t{64}, int64_t{1}}) {  // token by token, chunked
      SCOPED_TRACE(std::string(preset) + (recurrent == 1 ? ", rule chunked" : ", rule token by token"));
      const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
      auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 7);
      const IncrementalTarget decoder(*model, recurrent);
      const std::vector<int64_t> tap{1, config.num_layers - 2};
      const at::Tensor ids = at::randint(0, config.vocab_size, {90}, at::TensorOptions().dtype(at::kLong));
      DecodeCache cache = decoder.new_cache();
      // A long prefill (chunked rule), then steps of 7 of which 0-7 are kept (the rest rolled back
      // and run again with other tokens, as a speculative step's rejected part is).
      int64_t done = 0;
      auto check = [&](const DecodeOutput& out, int64_t begin, int64_t count) {
        const Full full = full_forward(*model, ids.narrow(0, 0, begin + count), tap);
        EXPECT_LT(max_diff(out.logits, full.logits.narrow(0, begin, count)), 1e-4)
            << "tokens " << begin << "+" << count;
        EXPECT_LT(max_diff(out.features, full.features.narrow(0, begin, count)), 1e-4)
            << "tokens " << begin << "+" << count;
      };
      check(decoder.step(cache, ids.narrow(0, 0, 70), tap), 0, 70);
      done = 70;
      const int64_t keeps[] = {3, 0, 7, 1, 5};
      for (int64_t keep : keeps) {
        // Wrong tokens first: what a rejected draft leaves behind must not leak into what follows.
        decoder.step(cache, at::randint(0, config.vocab_size, {7}, at::TensorOptions().dtype(at::kLong)), tap);
        decoder.crop(cache, done);
        const DecodeOutput out = decoder.step(cache, ids.narrow(0, done, 7), tap);
        check(out, done, 7);
        decoder.crop(cache, done + keep);
        done += keep;
        EXPECT_EQ(cache.length, done);
      }
      // One token at a time after all the rolling back.
      for (int i = 0; i < 3 && done < ids.size(0); ++i, ++done)
        check(decoder.step(cache, ids.narrow(0, done, 1), tap), done, 1);
    }
  }
}

TEST(IncrementalTarget, APromptPrefilledInChunksIsThePromptInOneStep) {
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3"}) {
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 3);
    const IncrementalTarget decoder(*model);
    const at::Tensor ids = at::randint(0, config.vocab_size, {150}, at::TensorOptions().dtype(at::kLong));
    DecodeCache whole = decoder.new_cache(), chunked = decoder.new_cache();
    const DecodeOutput a = decoder.step(whole, ids, {2});
    const DecodeOutput b = decoder.prefill(chunked, ids, {2}, 40);  // 40 + 40 + 40 + 30, recurrent and chunked rule
    EXPECT_LT(max_diff(b.features, a.features), 1e-4);
    EXPECT_LT(max_diff(b.logits, a.logits.narrow(0, 149, 1)), 1e-4);
    // And decoding goes on the same from either cache.
    const at::Tensor next = at::randint(0, config.vocab_size, {5}, at::TensorOptions().dtype(at::kLong));
    EXPECT_LT(max_diff(decoder.step(chunked, next, {}).logits, decoder.step(whole, next, {}).logits), 1e-4);
  }
}

// What a cache keeps after a prefill and a plain step: its conv windows are K - 1 rows per
// sequence, not views that keep the prefill's whole window alive (0.5 GB per sequence at 27B).
TEST(IncrementalTarget, ACacheKeepsOnlyItsOwnConvWindow) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_5"), "tiny-qwen3_5");
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 3);
  const IncrementalTarget decoder(*model);
  const auto options = at::TensorOptions().dtype(at::kLong);
  DecodeCache a = decoder.new_cache(), b = decoder.new_cache();
  decoder.prefill(a, at::randint(0, config.vocab_size, {300}, options), {});
  auto own = [](const DecodeCache& cache, const char* when) {
    int layers = 0;
    for (const at::Tensor& conv : cache.stages[0].conv) {
      if (!conv.defined()) continue;
      ++layers;
      EXPECT_EQ(conv.size(1), 3) << when;  // [sequences stepped together, K - 1, channels]
      EXPECT_EQ(conv.storage().nbytes(), conv.numel() * conv.element_size()) << when;
    }
    EXPECT_GT(layers, 0);
  };
  own(a, "after a prefill");
  decoder.prefill(b, at::randint(0, config.vocab_size, {40}, options), {});
  decoder.step_batch({&a, &b}, {at::randint(0, config.vocab_size, {1}, options), at::randint(0, config.vocab_size, {1}, options)},
                     {}, /*croppable=*/false);
  own(a, "after a batched plain step");
}

// target.decode_state_dtype: bfloat16 keeps the GatedDeltaNet states in bf16 between steps,
// rounded once per step, prefill and crop (the rule runs in fp32). The oracle: the same target
// with fp32 states that are rounded to bf16 values by hand after each of those; its logits are
// the bf16-state decoder's, bit for bit. A third decoder, fp32 states never rounded, shows the rounding
// happened (its logits differ).
TEST(IncrementalTarget, Bf16StatesAreRoundedOncePerStep) {
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3_next"}) {
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    TargetOptions bf16_states;
    bf16_states.decode_state_dtype = at::kBFloat16;
    auto exact_model = random_target(config, config.num_layers - 1, TargetOptions{}, 5);
    auto rounded_model = random_target(config, config.num_layers - 1, bf16_states, 5);
    const IncrementalTarget exact(*exact_model), rounded(*rounded_model);
    DecodeCache oracle = exact.new_cache(), unrounded = exact.new_cache(), ours = rounded.new_cache();
    auto round_states = [](DecodeCache& cache) {
      for (at::Tensor& state : cache.stages[0].state) {
        if (state.defined()) state = state.to(at::kBFloat16).to(at::kFloat);
      }
    };
    const auto options = at::TensorOptions().dtype(at::kLong);
    const at::Tensor prompt = at::randint(0, config.vocab_size, {60}, options);
    exact.prefill(oracle, prompt, {}), exact.prefill(unrounded, prompt, {}), rounded.prefill(ours, prompt, {});
    round_states(oracle);
    double rounding_shows = 0;
    for (int step = 0; step < 6; ++step) {
      const int64_t n = step == 2 ? 7 : 1;  // a verify step, cropped to 3 of its 7 tokens
      const at::Tensor next = at::randint(0, config.vocab_size, {n}, options);
      const at::Tensor a = exact.step(oracle, next, {}).logits, b = rounded.step(ours, next, {}).logits;
      const at::Tensor c = exact.step(unrounded, next, {}).logits;
      round_states(oracle);
      EXPECT_TRUE(at::equal(b, a)) << "step " << step << ": " << max_diff(b, a);
      rounding_shows = std::max(rounding_shows, max_diff(c, a));
      if (n > 1) {
        exact.crop(oracle, oracle.length - 4), rounded.crop(ours, ours.length - 4), exact.crop(unrounded, unrounded.length - 4);
        round_states(oracle);
      }
    }
    EXPECT_GT(rounding_shows, 1e-6);  // logits of about 0.5: the roundings move them by 1e-6 .. 1e-5
    int gdn_layers = 0;
    for (size_t i = 0; i < ours.stages[0].state.size(); ++i) {
      if (!ours.stages[0].state[i].defined()) continue;
      ++gdn_layers;
      EXPECT_EQ(ours.stages[0].state[i].scalar_type(), at::kBFloat16) << "layer " << i;
      EXPECT_EQ(ours.stages[0].last_gdn[i].state_before.scalar_type(), at::kBFloat16) << "layer " << i;
    }
    EXPECT_GT(gdn_layers, 0);
  }
  // Other dtypes are refused.
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_5"), "tiny-qwen3_5");
  TargetOptions half_states;
  half_states.decode_state_dtype = at::kHalf;
  auto model = random_target(config, config.num_layers - 1, half_states, 5);
  EXPECT_THROW(IncrementalTarget{*model}, std::invalid_argument);
}

// A preset's whole model with random weights and its incremental forward, tapping the first and
// last layers.
struct PresetDecoding {
  PresetDecoding(const char* preset, uint64_t seed)
      : config(parse_model_config(preset_config_json(preset), preset)),
        model(random_target(config, config.num_layers - 1, TargetOptions{}, seed)),
        decoder(*model),
        tap{0, config.num_layers - 1} {}
  ModelConfig config;
  std::unique_ptr<TargetModel> model;
  IncrementalTarget decoder;
  std::vector<int64_t> tap;
};

// Several sequences in one step (mixed token counts and cache lengths) and one crop: each
// sequence's logits, features and later steps are those of its own steps alone.
TEST(IncrementalTarget, ABatchedStepIsEachSequencesOwnStep) {
  for (const char* preset : kPresets) {
    SCOPED_TRACE(preset);
    const PresetDecoding p(preset, 17);
    const ModelConfig& config = p.config;
    const IncrementalTarget& decoder = p.decoder;
    const std::vector<int64_t>& tap = p.tap;
    const auto options = at::TensorOptions().dtype(at::kLong);
    const std::vector<int64_t> prompt_lengths{5, 12, 30, 12}, counts{3, 3, 1, 7}, keeps{0, 2, 1, 7};
    std::vector<DecodeCache> alone, together;
    std::vector<at::Tensor> ids, next;
    for (size_t s = 0; s < prompt_lengths.size(); ++s) {
      const at::Tensor prompt = at::randint(0, config.vocab_size, {prompt_lengths[s]}, options);
      alone.push_back(decoder.new_cache());
      together.push_back(decoder.new_cache());
      decoder.prefill(alone.back(), prompt, {});
      decoder.prefill(together.back(), prompt, {});
      ids.push_back(at::randint(0, config.vocab_size, {counts[s]}, options));
      next.push_back(at::randint(0, config.vocab_size, {2}, options));
    }
    std::vector<DecodeCache*> batch;
    for (DecodeCache& c : together) batch.push_back(&c);
    const std::vector<DecodeOutput> out = decoder.step_batch(batch, ids, tap);
    std::vector<int64_t> lengths;
    for (size_t s = 0; s < alone.size(); ++s) {
      const DecodeOutput own = decoder.step(alone[s], ids[s], tap);
      EXPECT_LT(max_diff(out[s].logits, own.logits), 1e-4) << "sequence " << s;
      EXPECT_LT(max_diff(out[s].features, own.features), 1e-4) << "sequence " << s;
      EXPECT_EQ(together[s].length, alone[s].length);
      decoder.crop(alone[s], prompt_lengths[s] + keeps[s]);
      lengths.push_back(prompt_lengths[s] + keeps[s]);
    }
    decoder.crop_batch(batch, lengths);
    const std::vector<DecodeOutput> after = decoder.step_batch(batch, next, tap);
    for (size_t s = 0; s < alone.size(); ++s) {
      EXPECT_LT(max_diff(after[s].logits, decoder.step(alone[s], next[s], tap).logits), 1e-4) << "sequence " << s;
    }
    // Steps of 4, 4, 3 and 4 tokens (two groups), of which 1, 3, 1, 2 are kept (the crop gathers
    // sequences 0 and 2 from two batches of steps of different lengths, sequences 0, 1 and 3 are
    // rows 0, 1, 2 of one), then a step without sequence 1 (rows of several batches), in another order.
    std::vector<at::Tensor> fours, ones;
    std::vector<int64_t> kept;
    const int64_t keep4[] = {1, 3, 1, 2}, count4[] = {4, 4, 3, 4};
    for (size_t s = 0; s < alone.size(); ++s) {
      fours.push_back(at::randint(0, config.vocab_size, {count4[s]}, options));
      ones.push_back(at::randint(0, config.vocab_size, {1}, options));
      kept.push_back(together[s].length + keep4[s]);
    }
    decoder.step_batch(batch, fours, tap);
    decoder.crop_batch(batch, kept);
    const std::vector<DecodeOutput> later =
        decoder.step_batch({batch[3], batch[0], batch[2]}, {ones[3], ones[0], ones[2]}, {}, /*croppable=*/false);
    for (size_t s = 0; s < alone.size(); ++s) {
      decoder.step(alone[s], fours[s], tap);
      decoder.crop(alone[s], kept[s]);
    }
    const size_t order[] = {3, 0, 2};
    for (size_t j = 0; j < 3; ++j) {
      EXPECT_LT(max_diff(later[j].logits, decoder.step(alone[order[j]], ones[order[j]], {}).logits), 1e-4)
          << "sequence " << order[j];
    }
    DecodeCache& first = together[0];
    EXPECT_THROW(decoder.step_batch({&first, &first}, {next[0], next[0]}, {}), std::invalid_argument);
    EXPECT_THROW(decoder.step_batch({&first}, {next[0], next[1]}, {}), std::invalid_argument);
  }
}

// Prompts of different lengths prefilled in one forward: each sequence's last-token logits,
// features and next step are those of its own prefill; a batch over the token budget is refused.
TEST(IncrementalTarget, PromptsPrefilledTogetherAreEachPrefilledAlone) {
  for (const char* preset : kPresets) {
    SCOPED_TRACE(preset);
    const PresetDecoding p(preset, 23);
    const IncrementalTarget& decoder = p.decoder;
    std::vector<DecodeCache> alone, together;
    const auto options = at::TensorOptions().dtype(at::kLong);
    std::vector<at::Tensor> prompts;
    for (const int64_t n : {70, 9, 70, 131}) {
      prompts.push_back(at::randint(0, p.config.vocab_size, {n}, options));
      alone.push_back(decoder.new_cache());
      together.push_back(decoder.new_cache());
    }
    std::vector<DecodeCache*> batch;
    for (DecodeCache& c : together) batch.push_back(&c);
    const std::vector<DecodeOutput> out = decoder.prefill_batch(batch, prompts, p.tap);
    const at::Tensor next = at::randint(0, p.config.vocab_size, {1}, options);
    for (size_t s = 0; s < prompts.size(); ++s) {
      const DecodeOutput own = decoder.prefill(alone[s], prompts[s], p.tap);
      ASSERT_EQ(out[s].logits.size(0), 1);
      EXPECT_LT(max_diff(out[s].logits, own.logits), 1e-4) << "sequence " << s;
      EXPECT_LT(max_diff(out[s].features, own.features), 1e-4) << "sequence " << s;
      EXPECT_EQ(together[s].length, prompts[s].size(0));
      EXPECT_LT(max_diff(decoder.step(together[s], next, {}).logits, decoder.step(alone[s], next, {}).logits), 1e-4)
          << "sequence " << s;
    }
    DecodeCache big = decoder.new_cache();
    EXPECT_THROW(decoder.prefill_batch({&big}, {at::zeros({IncrementalTarget::kPrefillBatchTokens + 1}, options)}, {}),
                 std::invalid_argument);
  }
}

TEST(IncrementalTarget, RefusesAPartialModelAndCropsOutsideTheLastStep) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_5"), "tiny");
  auto partial = random_target(config, 2, TargetOptions{}, 1);
  EXPECT_THROW(IncrementalTarget{*partial}, std::invalid_argument);
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 1);
  const IncrementalTarget decoder(*model);
  DecodeCache cache = decoder.new_cache();
  decoder.step(cache, at::arange(10, at::TensorOptions().dtype(at::kLong)), {});
  decoder.step(cache, at::arange(4, at::TensorOptions().dtype(at::kLong)), {});
  EXPECT_THROW(decoder.crop(cache, 9), std::invalid_argument);   // before the last step
  EXPECT_THROW(decoder.crop(cache, 15), std::invalid_argument);  // past its end
  EXPECT_NO_THROW(decoder.crop(cache, 12));
  // A prefill and a step that is not croppable keep nothing to roll back into.
  DecodeCache prompt = decoder.new_cache();
  decoder.prefill(prompt, at::arange(10, at::TensorOptions().dtype(at::kLong)), {});
  EXPECT_THROW(decoder.crop(prompt, 9), std::invalid_argument);
  EXPECT_NO_THROW(decoder.crop(prompt, 10));
  decoder.step_batch({&prompt}, {at::arange(3, at::TensorOptions().dtype(at::kLong))}, {}, /*croppable=*/false);
  EXPECT_THROW(decoder.crop(prompt, 12), std::invalid_argument);
  EXPECT_EQ(prompt.length, 13);
}

// A small random drafter for `config` (2 layers, block 8, heads of the drafter's default rule).
drafter::Drafter random_drafter(const ModelConfig& config, uint64_t seed, int block_size = 8, int sliding_window = 0) {
  config::DrafterConfig dc;
  dc.num_layers = 2;
  dc.block_size = block_size;
  if (sliding_window > 0) {  // the first layer slides (the recipe: sliding layers, then a full one)
    dc.layer_types = {"sliding_attention", "full_attention"};
    dc.sliding_window = sliding_window;
  }
  dc.num_target_features = 2;
  dc.mask_token_id = config.vocab_size - 1;
  drafter::Drafter d(drafter::shape_for_target(config, dc), at::TensorOptions().dtype(at::kFloat));
  d.init_random(seed);
  return d;
}

// A target over several stages (a StagedTarget's; StageCache per stage) decodes bit-identically
// to the same target on one device, through every kind of call a decoder makes: prompts
// prefilled together, croppable verify steps of mixed lengths with taps, crops keeping different
// numbers of tokens, plain steps, a sequence leaving and a new one joining.
TEST(IncrementalTarget, StagesDecodeBitIdenticalToOneDevice) {
  for (const char* preset : kPresets) {
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto whole = random_target(config, config.num_layers - 1, TargetOptions{}, 17);
    const IncrementalTarget one(*whole);
    for (size_t count : {2, 3}) {
      SCOPED_TRACE(std::string(preset) + ", " + std::to_string(count) + " stages");
      auto staged = random_staged_target(config, config.num_layers - 1, std::vector<TargetOptions>(count), 17);
      const IncrementalTarget split(staged->models());
      ASSERT_EQ(split.stage_count(), count);
      const std::vector<int64_t> tap{0, 2, config.num_layers - 1};
      const auto long_options = at::TensorOptions().dtype(at::kLong);
      auto ids = [&](int64_t n) { return at::randint(0, config.vocab_size, {n}, long_options); };
      std::vector<DecodeCache> a, b;
      for (int i = 0; i < 4; ++i) a.push_back(one.new_cache()), b.push_back(split.new_cache());
      auto pointers = [](std::vector<DecodeCache>& caches, const std::vector<size_t>& which) {
        std::vector<DecodeCache*> out;
        for (size_t i : which) out.push_back(&caches[i]);
        return out;
      };
      auto same = [&](const std::vector<DecodeOutput>& x, const std::vector<DecodeOutput>& y, const char* what) {
        ASSERT_EQ(x.size(), y.size());
        for (size_t s = 0; s < x.size(); ++s) {
          EXPECT_TRUE(at::equal(x[s].logits, y[s].logits)) << what << ", sequence " << s;
          EXPECT_EQ(x[s].features.defined(), y[s].features.defined()) << what;
          if (!x[s].features.defined()) continue;
          EXPECT_TRUE(at::equal(x[s].features, y[s].features)) << what << ", sequence " << s;
        }
      };
      std::vector<at::Tensor> prompts{ids(30), ids(5), ids(17)};
      same(one.prefill_batch(pointers(a, {0, 1, 2}), prompts, tap),
           split.prefill_batch(pointers(b, {0, 1, 2}), prompts, tap), "prefill_batch");
      for (int round = 0; round < 3; ++round) {
        const std::vector<at::Tensor> verify{ids(7), ids(7), ids(3)};
        same(one.step_batch(pointers(a, {0, 1, 2}), verify, tap), split.step_batch(pointers(b, {0, 1, 2}), verify, tap),
             "verify step");
        const std::vector<int64_t> keep{a[0].length - 4 + round, a[1].length - 7, a[2].length};
        one.crop_batch(pointers(a, {0, 1, 2}), keep), split.crop_batch(pointers(b, {0, 1, 2}), keep);
      }
      // Sequence 1 leaves; sequence 3 joins with its prompt; plain steps of one token each.
      const at::Tensor joining = ids(12);
      same({one.prefill(a[3], joining, tap)}, {split.prefill(b[3], joining, tap)}, "prefill");
      for (int round = 0; round < 3; ++round) {
        const std::vector<at::Tensor> next{ids(1), ids(1), ids(1)};
        same(one.step_batch(pointers(a, {0, 2, 3}), next, {}, /*croppable=*/false),
             split.step_batch(pointers(b, {0, 2, 3}), next, {}, /*croppable=*/false), "plain step");
      }
      for (size_t s = 0; s < a.size(); ++s) EXPECT_EQ(b[s].length, a[s].length) << "sequence " << s;
    }
  }
}

// Decoders over a staged target give the tokens of the same decoders over one device, plain and
// speculative (the drafter on the last stage's device, the embedding copied there), also with a
// decoder per stage on its own thread.
TEST(IncrementalTarget, DecodersOverStagesGiveTheOneDeviceTokens) {
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3_next"}) {
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto whole = random_target(config, config.num_layers - 1, TargetOptions{}, 19);
    auto staged = random_staged_target(config, config.num_layers - 1, std::vector<TargetOptions>(2), 19);
    const IncrementalTarget one(*whole), split(staged->models());
    const drafter::Drafter d = random_drafter(config, 23);
    std::vector<std::vector<int64_t>> prompts;
    for (int64_t length : {1, 9, 33, 4}) {
      const at::Tensor p = at::randint(0, config.vocab_size, {length}, at::TensorOptions().dtype(at::kLong));
      prompts.emplace_back(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + length);
    }
    decode::GenerateSettings settings;
    settings.max_new_tokens = 17;
    settings.sampling.temperature = 1.0;
    settings.seed = 3;
    const auto plain_one = decode::PlainDecoder(one).generate_all(prompts, settings, 3);
    const auto plain_split = decode::PlainDecoder(split).generate_all(prompts, settings, 3);
    const auto spec_one = decode::SpeculativeDecoder(one, d).generate_all(prompts, settings, 2);
    const auto spec_split = decode::SpeculativeDecoder(split, d).generate_all(prompts, settings, 2);
    // A decoder per stage, as dflashd eval and generate run them: one decoder object on two
    // threads, one sequence at once on each, so both are in flight on the stages together.
    const decode::PlainDecoder plain(split);
    const decode::SpeculativeDecoder spec(split, d);
    const auto plain_threads = decode::generate_all({&plain, &plain}, prompts, settings, 1);
    const auto spec_threads = decode::generate_all({&spec, &spec}, prompts, settings, 1);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(plain_split[i].tokens, plain_one[i].tokens) << "prompt " << i;
      EXPECT_EQ(spec_split[i].tokens, spec_one[i].tokens) << "prompt " << i;
      EXPECT_EQ(spec_split[i].acceptance, spec_one[i].acceptance) << "prompt " << i;
      EXPECT_EQ(plain_threads[i].tokens, plain_one[i].tokens) << "prompt " << i;
      EXPECT_EQ(spec_threads[i].tokens, spec_one[i].tokens) << "prompt " << i;
      EXPECT_EQ(spec_threads[i].acceptance, spec_one[i].acceptance) << "prompt " << i;
    }
    // A bad prompt fails its decoder; the other takes no more prompts, and the error comes out
    // once both have ended.
    std::vector<std::vector<int64_t>> with_bad = prompts;
    with_bad.insert(with_bad.begin() + 2, std::vector<int64_t>{config.vocab_size});
    EXPECT_THROW(decode::generate_all({&plain, &plain}, with_bad, settings, 1), std::invalid_argument);
  }
}

// Stages that do not hold every layer in order, with the head on the last, are refused.
TEST(IncrementalTarget, RefusesStagesThatAreNotTheWholeTargetInOrder) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_5"), "tiny");
  auto short_of_one = random_staged_target(config, config.num_layers - 2, std::vector<TargetOptions>(2), 1);
  EXPECT_THROW(IncrementalTarget{short_of_one->models()}, std::invalid_argument);
  auto staged = random_staged_target(config, config.num_layers - 1, std::vector<TargetOptions>(3), 1);
  std::vector<const TargetModel*> stages = staged->models();
  EXPECT_THROW(IncrementalTarget({stages[0], stages[2]}), std::invalid_argument);  // a gap
  EXPECT_THROW(IncrementalTarget({stages[1], stages[0], stages[2]}), std::invalid_argument);
  EXPECT_THROW(IncrementalTarget(std::vector<const TargetModel*>{}), std::invalid_argument);
  EXPECT_NO_THROW(IncrementalTarget{stages});
  // A cache of another split is not this target's.
  auto whole = random_target(config, config.num_layers - 1, TargetOptions{}, 1);
  const IncrementalTarget one(*whole), split(stages);
  DecodeCache cache = one.new_cache();
  EXPECT_THROW(split.step(cache, at::arange(3, at::TensorOptions().dtype(at::kLong)), {}), std::invalid_argument);
}

TEST(DrafterDecoding, ABlockOverTheCachedContextIsTheTrainingForwardOfItsAnchor) {
  for (int window : {0, 8, 13}) {  // full layers; a sliding first layer with windows of one block and more
    SCOPED_TRACE("window " + std::to_string(window));
    const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3"), "tiny");
    const drafter::Drafter d = random_drafter(config, 3, 8, window);
    auto target = random_target(config, config.num_layers - 1, TargetOptions{}, 5);
    const int64_t length = 40, block = d.shape().block_size;
    const at::Tensor ids = at::randint(0, config.vocab_size, {length}, at::TensorOptions().dtype(at::kLong));
    const std::vector<int64_t> tap(d.shape().target_layer_ids.begin(), d.shape().target_layer_ids.end());
    const at::Tensor features = at::cat(target->forward(ids, {0, length}, tap), -1);
    for (int64_t anchor : {1, 17, 31}) {
      drafter::DrafterBatch batch;
      batch.features = features;
      batch.input_ids = ids;
      batch.loss_mask = at::ones({length}, at::TensorOptions().dtype(at::kByte));
      batch.cu_seqlens = {0, length};
      batch.anchors = {at::tensor(std::vector<int64_t>{anchor}, at::TensorOptions().dtype(at::kLong))};
      const at::Tensor trained = d.forward(batch, target->embed_tokens()).detach();
      // The context grown in two pieces, as decoding grows it.
      drafter::DrafterContextCache cache;
      d.extend_context(cache, features.narrow(0, 0, anchor / 2));
      d.extend_context(cache, features.narrow(0, anchor / 2, anchor - anchor / 2));
      const at::Tensor block_ids = drafter::block_token_ids(ids, batch.anchors[0], block, d.shape().mask_token_id);
      const at::Tensor decoded = d.block_hidden(cache, block_ids, target->embed_tokens());
      EXPECT_LT(max_diff(decoded, trained), 1e-5) << "anchor " << anchor;
      // Batched with another sequence's block (padding and masks per member): the same rows.
      drafter::DrafterContextCache other;
      d.extend_context(other, features.narrow(0, 0, 5));
      const std::vector<at::Tensor> both =
          d.block_hiddens({&other, &cache}, {block_ids, block_ids}, target->embed_tokens());
      EXPECT_LT(max_diff(both[1], trained), 1e-5) << "anchor " << anchor << ", batched";
    }
  }
}

// On a GPU in bf16 the blocks of a batch take FlashAttention's variable-length kernel (contexts
// and blocks packed, no mask); the math path keeps the padded, masked SDPA. Both against the rows
// of the same weights in fp32 on the host: the kernel's error within 1.5 times the padded path's
// (a window one key too wide fails that). Full and sliding layers (a window shorter than a block,
// where both take the padded path; one of a block; one longer than some contexts), heads of 16
// and 128, contexts of different lengths grown by batched extensions, one block cut short.
TEST(DrafterDecoding, GpuBlocksOnFlashAttentionAreAsCloseAsThePaddedPath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3"), "tiny");
  const auto bf16 = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16);
  for (const int64_t head_dim : {16, 128}) {
    for (const int window : {0, 5, 8, 13}) {
      SCOPED_TRACE("head_dim " + std::to_string(head_dim) + ", window " + std::to_string(window));
      // An exported drafter may slide by less than a block (our config refuses it, a config.json
      // from elsewhere need not), so the shape is set here.
      drafter::DrafterShape shape = random_drafter(config, 3, 8, window > 0 ? 8 : 0).shape();
      shape.head_dim = head_dim;
      shape.sliding_window = window;
      drafter::Drafter flash(shape, bf16), padded(shape, bf16), reference(shape, at::TensorOptions().dtype(at::kFloat));
      flash.init_random(7);
      padded.load_tensors(flash.parameters(), "the flash drafter");
      padded.set_attention_path(drafter::BlockAttentionPath::math);
      reference.load_tensors(flash.parameters(), "the flash drafter");  // the bf16 weights, widened
      const int64_t width = shape.num_features() * config.hidden_size;
      const at::Tensor embed = at::randn({config.vocab_size, config.hidden_size}).to(at::kBFloat16).to(at::kFloat);
      const std::vector<std::vector<int64_t>> grown = {{3, 12, 1, 20}, {0, 8, 0, 17}};  // contexts 3, 20, 1, 37
      std::vector<std::vector<at::Tensor>> pieces;
      for (const std::vector<int64_t>& counts : grown) {
        pieces.emplace_back();
        for (int64_t n : counts) pieces.back().push_back(at::randn({n, width}).to(at::kBFloat16).to(at::kFloat));
      }
      std::vector<at::Tensor> blocks;
      for (int64_t rows : {8, 8, 5, 8}) {
        at::Tensor ids = at::full({rows}, shape.mask_token_id, at::TensorOptions().dtype(at::kLong));
        ids[0] = rows * 7;
        blocks.push_back(ids);
      }
      auto rows_of = [&](const drafter::Drafter& d, const at::Tensor& table) {
        std::vector<drafter::DrafterContextCache> caches(4);
        std::vector<drafter::DrafterContextCache*> growing;
        std::vector<const drafter::DrafterContextCache*> reading;
        for (auto& c : caches) growing.push_back(&c), reading.push_back(&c);
        for (const std::vector<at::Tensor>& features : pieces) d.extend_contexts(growing, features);
        return at::cat(d.block_hiddens(reading, blocks, table)).to(at::kCPU, at::kFloat);
      };
      const at::Tensor expected = rows_of(reference, embed);
      const auto error = [&](const at::Tensor& got) {
        return ((got - expected).norm() / expected.norm()).item<double>();
      };
      const double on_flash = error(rows_of(flash, embed.to(bf16))), on_padded = error(rows_of(padded, embed.to(bf16)));
      EXPECT_LT(on_padded, 2e-2);
      EXPECT_LT(on_flash, 1.5 * on_padded + 2e-3) << "padded path's error " << on_padded;
    }
  }
}

// Greedy speculative decoding is lossless: the same tokens as plain greedy decoding of the target.
TEST(SpeculativeDecoding, GreedyOutputIsPlainGreedyDecoding) {
  for (const char* preset : kPresets) {
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 11);
    const IncrementalTarget target(*model);
    const drafter::Drafter d = random_drafter(config, 13);
    const decode::SpeculativeDecoder spec(target, d);
    for (int64_t prompt_length : {1, 9, 70}) {
      const at::Tensor p = at::randint(0, config.vocab_size, {prompt_length}, at::TensorOptions().dtype(at::kLong));
      const std::vector<int64_t> prompt(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + prompt_length);
      decode::GenerateSettings settings;
      settings.max_new_tokens = 23;
      const decode::Generation plain = decode::plain_generate(target, prompt, settings);
      const decode::Generation fast = spec.generate(prompt, settings);
      EXPECT_EQ(fast.tokens, plain.tokens) << "prompt of " << prompt_length;
      EXPECT_EQ(fast.new_tokens(), 23);
      int64_t sum = 0;
      for (int64_t a : fast.acceptance) sum += a;
      EXPECT_EQ(sum + 1, fast.new_tokens()) << "every new token but the first comes from a verify step";
      // A stop token: the output ends at its first occurrence, included.
      settings.stop_token_ids = {plain.tokens[prompt_length + 4]};
      const decode::Generation stopped = spec.generate(prompt, settings);
      const decode::Generation plain_stopped = decode::plain_generate(target, prompt, settings);
      EXPECT_TRUE(stopped.stopped);
      EXPECT_EQ(stopped.tokens, plain_stopped.tokens);
      EXPECT_EQ(stopped.tokens.back(), settings.stop_token_ids[0]);
    }
  }
}

// Many prompts at once, fewer places than prompts (continuous batching): every prompt's output
// and acceptance are those of decoding it alone, greedy and sampled (its own random stream).
TEST(SpeculativeDecoding, BatchedDecodingIsEachPromptDecodedAlone) {
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3"}) {
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 31);
    const IncrementalTarget target(*model);
    const drafter::Drafter d = random_drafter(config, 37);
    const decode::SpeculativeDecoder spec(target, d);
    const decode::PlainDecoder plain(target);
    std::vector<std::vector<int64_t>> prompts;
    for (int64_t length : {1, 9, 33, 4, 17}) {
      const at::Tensor p = at::randint(0, config.vocab_size, {length}, at::TensorOptions().dtype(at::kLong));
      prompts.emplace_back(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + length);
    }
    for (double temperature : {0.0, 1.0}) {
      decode::GenerateSettings settings;
      settings.max_new_tokens = 19;
      settings.sampling.temperature = temperature;
      settings.seed = 5;
      const std::vector<decode::Generation> fast = spec.generate_all(prompts, settings, 3);
      const std::vector<decode::Generation> slow = plain.generate_all(prompts, settings, 2);
      for (size_t i = 0; i < prompts.size(); ++i) {
        decode::GenerateSettings own = settings;
        own.seed = decode::sequence_seed(settings.seed, i);
        const decode::Generation alone = spec.generate(prompts[i], own);
        EXPECT_EQ(fast[i].tokens, alone.tokens) << "prompt " << i << ", temperature " << temperature;
        EXPECT_EQ(fast[i].acceptance, alone.acceptance) << "prompt " << i << ", temperature " << temperature;
        EXPECT_EQ(slow[i].tokens, decode::plain_generate(target, prompts[i], own).tokens) << "prompt " << i;
        if (temperature == 0) {
          EXPECT_EQ(fast[i].tokens, slow[i].tokens) << "prompt " << i;
        }
      }
    }
  }
}

// Plain decoding keeps a step in flight and learns its tokens a round later, so a sequence that
// stops leaves with one step's token untaken while the others go on and prompts join beside them.
// With stop tokens that end the prompts at different steps, every prompt's output (greedy and
// sampled, 2 places for 6 prompts) is the output of decoding it alone: no token of another
// sequence, none lost, none past its stop token or its max_new_tokens.
TEST(PlainDecoding, SequencesStoppingAtDifferentStepsAreEachDecodedAlone) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_5"), "tiny-qwen3_5");
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 47);
  const IncrementalTarget target(*model);
  const decode::PlainDecoder plain(target);
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t length : {3, 8, 1, 12, 5, 6}) {
    const at::Tensor p = at::randint(0, config.vocab_size, {length}, at::TensorOptions().dtype(at::kLong));
    prompts.emplace_back(p.data_ptr<int64_t>(), p.data_ptr<int64_t>() + length);
  }
  for (double temperature : {0.0, 1.0}) {
    SCOPED_TRACE("temperature " + std::to_string(temperature));
    decode::GenerateSettings settings;
    settings.max_new_tokens = 16;
    settings.sampling.temperature = temperature;
    settings.seed = 9;
    // Stop tokens from the unstopped outputs: the 3rd new token of prompt 0, the 7th of prompt 3.
    const std::vector<decode::Generation> free_run = plain.generate_all(prompts, settings, 6);
    settings.stop_token_ids = {free_run[0].tokens[prompts[0].size() + 2], free_run[3].tokens[prompts[3].size() + 6]};
    const std::vector<decode::Generation> batched = plain.generate_all(prompts, settings, 2);
    std::set<int64_t> lengths;
    for (size_t i = 0; i < prompts.size(); ++i) {
      decode::GenerateSettings own = settings;
      own.seed = decode::sequence_seed(settings.seed, i);
      const decode::Generation alone = decode::plain_generate(target, prompts[i], own);
      EXPECT_EQ(batched[i].tokens, alone.tokens) << "prompt " << i;
      EXPECT_EQ(batched[i].stopped, alone.stopped) << "prompt " << i;
      EXPECT_LE(batched[i].new_tokens(), settings.max_new_tokens) << "prompt " << i;
      lengths.insert(batched[i].new_tokens());
    }
    EXPECT_TRUE(batched[0].stopped);
    EXPECT_LE(batched[0].new_tokens(), 3);
    EXPECT_GE(lengths.size(), 2u) << "the prompts should end at different steps";
  }
}

// run_generation's failures: a decoder's error (a bad prompt) stops the other decoder taking
// prompts, what finished is committed, and the error comes out; an error of the progress report
// does the same (the decoders end rather than run on unwatched). A restart decodes what is left.
TEST(PlainDecoding, GenerationFailuresCommitWhatFinishedAndEndEveryDecoder) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3"), "tiny");
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 47);
  const IncrementalTarget target(*model);
  const decode::PlainDecoder plain(target);
  const std::vector<const decode::Decoder*> two{&plain, &plain};
  decode::GenerateSettings settings;
  settings.max_new_tokens = 5;
  std::vector<std::vector<int64_t>> prompts;
  for (int64_t i = 0; i < 8; ++i) prompts.push_back({3, 5 + i, 7});
  prompts[4] = {config.vocab_size};  // outside the vocabulary
  const std::string dir = test::make_temp_dir("generation-failures");
  const std::atomic<bool> stop{false};
  int64_t reports = 0;
  std::set<int64_t> done;
  {
    decode::ShardedOutput out(dir, "{\"job\": 1}", 100, true);
    EXPECT_THROW(decode::run_generation(two, prompts, settings, 1, out, stop, 60,
                                        [&](const decode::GenerationProgress&) { ++reports; }),
                 std::invalid_argument);
    EXPECT_EQ(reports, 1);  // the final report, after the commit
    EXPECT_GE(out.committed(), 4) << "prompts 0-3 were taken before the bad one, and finished";
  }
  {
    decode::ShardedOutput out(dir, "{\"job\": 1}", 100, true);
    done = out.done_before();
    EXPECT_EQ(done.count(4), 0u);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(done.count(i), 1u) << "prompt " << i;
  }
  // A progress report that throws: the decoders take nothing more, finish what they hold, and
  // what finished is committed before the error comes out.
  prompts[4] = {3, 9, 7};
  {
    decode::ShardedOutput out(dir, "{\"job\": 1}", 100, true);
    EXPECT_THROW(decode::run_generation(two, prompts, settings, 1, out, stop, 1e-4,
                                        [&](const decode::GenerationProgress& p) {
                                          if (p.finished < static_cast<int64_t>(prompts.size())) {
                                            throw std::runtime_error("report failed");
                                          }
                                        }),
                 std::runtime_error);
  }
  decode::ShardedOutput out(dir, "{\"job\": 1}", 100, true);
  EXPECT_GE(out.done_before().size(), done.size());
  decode::run_generation(two, prompts, settings, 1, out, stop, 60, [](const decode::GenerationProgress&) {});
  decode::ShardedOutput all(dir, "{\"job\": 1}", 100, true);
  EXPECT_EQ(all.done_before().size(), prompts.size());
}

// The live count of `dflashd generate`'s progress: every prefill and round adds its new tokens
// as they come, never behind what finished sequences report, and in the end all of them.
TEST(SpeculativeDecoding, TheLiveCountSeesEveryNewTokenAsItComes) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3"), "tiny");
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 41);
  const IncrementalTarget target(*model);
  const drafter::Drafter d = random_drafter(config, 43);
  const decode::SpeculativeDecoder spec(target, d);
  const decode::PlainDecoder plain(target);
  for (const decode::Decoder* decoder : std::vector<const decode::Decoder*>{&plain, &spec}) {
    decode::GenerateSettings settings;
    settings.max_new_tokens = 11;
    size_t next = 0;
    int64_t finished_tokens = 0, checks = 0;
    std::atomic<int64_t> decoded{0};
    decoder->run(
        settings, 2,
        [&](decode::Request* r) {
          if (next == 5) return false;
          *r = {static_cast<int64_t>(next), {3, 7, static_cast<int64_t>(next)}, next};
          ++next;
          return true;
        },
        [&](decode::Request&&, decode::Generation&& g) {
          finished_tokens += g.new_tokens();
          EXPECT_GE(decoded.load(), finished_tokens);
          ++checks;
        },
        &decoded);
    EXPECT_EQ(checks, 5);
    EXPECT_EQ(finished_tokens, 5 * 11);
    EXPECT_EQ(decoded.load(), finished_tokens);
  }
}

// generate's ETA: the prompts left times the average new tokens of a finished prompt (or
// max_new_tokens before any finished), less the tokens in flight, at the decoded-token rate.
TEST(SpeculativeDecoding, GenerationEtaCountsTheTokensLeft) {
  decode::GenerationProgress p;
  p.total = 10, p.done_before = 2, p.seconds = 4;
  EXPECT_TRUE(std::isinf(decode::generation_eta_seconds(p, 16)));
  p.decoded = 40;  // 10 tok/s, none finished: 8 prompts x 16 - 40
  EXPECT_DOUBLE_EQ(decode::generation_eta_seconds(p, 16), (8 * 16 - 40) / 10.0);
  p.finished = 3, p.new_tokens = 30, p.decoded = 50, p.seconds = 5;  // 10 a prompt, 20 in flight
  EXPECT_DOUBLE_EQ(decode::generation_eta_seconds(p, 16), (5 * 10 - 20) / 10.0);
  p.finished = 8, p.new_tokens = 80, p.decoded = 80;
  EXPECT_DOUBLE_EQ(decode::generation_eta_seconds(p, 16), 0.0);
}

// Sampling: reproducible for a seed, and lossless in distribution: the first new tokens of
// speculative sampling follow the target's own sampling distribution.
TEST(SpeculativeDecoding, SamplingIsReproducibleAndHasTheTargetsDistribution) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3"), "tiny");
  auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 21);
  const IncrementalTarget target(*model);
  const drafter::Drafter d = random_drafter(config, 23, 4);
  const decode::SpeculativeDecoder spec(target, d);
  const std::vector<int64_t> prompt{5, 9, 2};
  decode::GenerateSettings settings;
  settings.max_new_tokens = 3;
  settings.sampling = {1.5, 0.95, 3};
  settings.seed = 7;
  EXPECT_EQ(spec.generate(prompt, settings).tokens, spec.generate(prompt, settings).tokens);
  // The exact distribution of the 2nd and 3rd new tokens given the 1st, from the target's logits.
  std::map<std::vector<int64_t>, double> exact;
  {
    DecodeCache cache = target.new_cache();
    const at::Tensor first =
        decode::sampling_probs(target.step(cache, at::tensor(prompt), {}).logits.narrow(0, 2, 1), settings.sampling)[0];
    for (int64_t a = 0; a < config.vocab_size; ++a) {
      const double pa = first[a].item<double>();
      if (pa == 0) continue;
      DecodeCache ca = target.new_cache();
      std::vector<int64_t> seq = prompt;
      seq.push_back(a);
      const at::Tensor second =
          decode::sampling_probs(target.step(ca, at::tensor(seq), {}).logits.narrow(0, 3, 1), settings.sampling)[0];
      for (int64_t b = 0; b < config.vocab_size; ++b) {
        const double pb = second[b].item<double>();
        if (pb == 0) continue;
        std::vector<int64_t> seq2 = seq;
        seq2.push_back(b);
        DecodeCache cb = target.new_cache();
        const at::Tensor third =
            decode::sampling_probs(target.step(cb, at::tensor(seq2), {}).logits.narrow(0, 4, 1), settings.sampling)[0];
        for (int64_t c = 0; c < config.vocab_size; ++c) {
          if (third[c].item<double>() > 0) exact[{a, b, c}] = pa * pb * third[c].item<double>();
        }
      }
    }
  }
  // Speculative decoding (rejection sampling) and plain decoding (every sequence's draw in one
  // batched pass: decode::draw_rows) both sample the target's distribution.
  const decode::PlainDecoder plain(target);
  for (const decode::Decoder* decoder : std::vector<const decode::Decoder*>{&spec, &plain}) {
    SCOPED_TRACE(decoder == &spec ? "speculative" : "plain");
    const int runs = 1500;  // one prompt, 1500 sequences with their own random streams, 250 at once
    std::map<std::vector<int64_t>, double> seen;
    for (const decode::Generation& g :
         decoder->generate_all(std::vector<std::vector<int64_t>>(runs, prompt), settings, 250)) {
      seen[std::vector<int64_t>(g.tokens.begin() + 3, g.tokens.end())] += 1.0 / runs;
    }
    double tv = 0;  // total variation distance between the empirical and the exact distribution
    for (const auto& [k, p] : exact) tv += std::abs(p - (seen.count(k) ? seen[k] : 0.0));
    for (const auto& [k, p] : seen) {
      if (!exact.count(k)) tv += p;  // an outcome the target cannot produce
    }
    tv /= 2;
    // 27 outcomes, 1500 draws: the expected TV distance of a correct sampler is about 0.05.
    EXPECT_LT(tv, 0.1) << exact.size() << " outcomes";
  }
}

// draw_rows: row r's token depends only on its own generator (a row drawn alone or among others
// gives the same token), zero-probability tokens are never drawn, and the frequencies are the
// probabilities'.
TEST(Sampling, DrawRowsDrawsEachRowFromItsOwnGenerator) {
  const at::Tensor probs = at::tensor(std::vector<float>{0.1f, 0.f, 0.6f, 0.3f, 0.f}).unsqueeze(0);
  const int rows = 4000;
  std::vector<at::Generator> gens, again;
  std::vector<at::Generator*> pointers;
  for (int r = 0; r < rows; ++r) {
    gens.push_back(at::make_generator<at::CPUGeneratorImpl>(decode::sequence_seed(11, static_cast<uint64_t>(r))));
    again.push_back(at::make_generator<at::CPUGeneratorImpl>(decode::sequence_seed(11, static_cast<uint64_t>(r))));
  }
  for (at::Generator& g : gens) pointers.push_back(&g);
  const std::vector<int64_t> tokens = decode::draw_rows(probs.expand({rows, 5}), pointers);
  std::vector<double> freq(5, 0);
  for (int64_t t : tokens) freq[static_cast<size_t>(t)] += 1.0 / rows;
  EXPECT_EQ(freq[1], 0);
  EXPECT_EQ(freq[4], 0);
  EXPECT_NEAR(freq[0], 0.1, 0.02);
  EXPECT_NEAR(freq[2], 0.6, 0.03);
  EXPECT_NEAR(freq[3], 0.3, 0.03);
  // Rows 7 and 8 alone, with other probabilities around them: the same tokens.
  const at::Tensor mixed = at::cat({at::tensor(std::vector<float>{0.f, 0.f, 0.f, 0.f, 1.f}).unsqueeze(0), probs, probs});
  const std::vector<int64_t> alone = decode::draw_rows(mixed, {&again[0], &again[7], &again[8]});
  EXPECT_EQ(alone[0], 4);
  EXPECT_EQ(alone[1], tokens[7]);
  EXPECT_EQ(alone[2], tokens[8]);
}

// A uniform or a generator per row, or a clear error naming what is missing.
TEST(Sampling, ChoosingRowsWithoutOneUniformPerRowIsRefused) {
  const at::Tensor probs = at::tensor(std::vector<float>{0.5f, 0.5f, 0.2f, 0.8f}).view({2, 2});
  auto message = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_EQ(message([&] { decode::choose_rows(probs, {0.5}); }), "choose_rows: one uniform per row");
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(1);
  EXPECT_EQ(message([&] { decode::draw_rows(probs, {&gen}); }), "draw_rows: one generator per row");
  EXPECT_EQ(decode::choose_rows(probs, {0.0, 0.99}).sizes(), at::IntArrayRef({2}));
}

// Greedy speculative decoding against the reference stack: the same tokens as the transformers
// target's own greedy decoding (lossless), and, wherever z-lab's dflash_generate (with the
// transformers target and the export loaded by dflash's DFlashDraftModel, fp32) is itself
// lossless, the same tokens and the same acceptance per step as it. (With transformers 5.23 it is
// not for the hybrid targets: its cache rollback of the GatedDeltaNet layers changes the output,
// bench/RESULTS.md; those cases are logged.)
void compare_with_dflash_generate(const std::string& family, int sliding_window = 0) {
  const std::string target_dir = std::string(DFLASHD_TARGET_REFERENCE_DIR) + "/" + family;
  auto model = load_target(target_dir, load_model_config(target_dir).num_layers - 1, TargetOptions{});
  const IncrementalTarget target(*model);
  // A random drafter, exported and loaded back (bf16-rounded weights on both sides).
  const std::string dir = test::make_temp_dir("dflash-ref-" + family);
  random_drafter(model->config(), 29, 8, sliding_window).save_export(dir + "/drafter");
  const std::string json = test::read_file(dir + "/drafter/config.json");
  drafter::Drafter d(drafter::parse_export_config(json, "export"), at::TensorOptions().dtype(at::kFloat));
  d.load_export(dir + "/drafter");
  const decode::SpeculativeDecoder spec(target, d);
  // Prompts from the target's own greedy output (what the drafter meets when it is used), and
  // random ones.
  std::vector<std::vector<int64_t>> prompts{{3, 1, 4, 1, 5}, {7}, {}};
  for (int i = 0; i < 40; ++i) prompts.back().push_back((i * 37 + 11) % model->config().vocab_size);
  nlohmann::json list = prompts;
  std::ofstream(dir + "/prompts.json") << list.dump();
  const int max_new = 30;
  const std::string command = std::string(DFLASHD_PYTHON_EXECUTABLE) + " " + DFLASHD_DFLASH_SCRIPT + " " + target_dir +
                              " " + dir + "/drafter " + dir + "/prompts.json " + std::to_string(max_new) + " " + dir +
                              "/reference.json > " + dir + "/reference.log 2>&1";
  ASSERT_EQ(std::system(command.c_str()), 0) << test::read_file(dir + "/reference.log");
  const nlohmann::json reference = nlohmann::json::parse(test::read_file(dir + "/reference.json"));
  int lossless_references = 0;
  decode::GenerateSettings settings;
  settings.max_new_tokens = max_new;
  const std::vector<decode::Generation> ours = spec.generate_all(prompts, settings, 2);
  for (size_t p = 0; p < prompts.size(); ++p) {
    const auto plain = reference[p]["plain_greedy"].get<std::vector<int64_t>>();
    const auto theirs = reference[p]["output_ids"].get<std::vector<int64_t>>();
    EXPECT_EQ(ours[p].tokens, plain) << "prompt " << p;
    if (theirs == plain) {
      ++lossless_references;
      EXPECT_EQ(ours[p].tokens, theirs) << "prompt " << p;
      EXPECT_EQ(ours[p].acceptance, reference[p]["acceptance"].get<std::vector<int64_t>>()) << "prompt " << p;
    } else {
      std::printf("%s prompt %zu: dflash_generate is not lossless with transformers' cache here\n", family.c_str(), p);
    }
  }
  // The attention-only targets must have compared against dflash_generate itself.
  if (family == "qwen3" || family == "llama") {
    EXPECT_EQ(lossless_references, 3);
  }
}

// One test per family: each runs the reference in its own Python process (tests run in parallel).
TEST(SpeculativeDecoding, MatchesDflashGenerateWithTheTransformersQwen3_5) { compare_with_dflash_generate("qwen3_5"); }
TEST(SpeculativeDecoding, MatchesDflashGenerateWithTheTransformersQwen3Next) {
  compare_with_dflash_generate("qwen3_next");
}
TEST(SpeculativeDecoding, MatchesDflashGenerateWithTheTransformersQwen3) { compare_with_dflash_generate("qwen3"); }
TEST(SpeculativeDecoding, MatchesDflashGenerateWithTheTransformersLlama) { compare_with_dflash_generate("llama"); }
// A drafter with a sliding-window layer (window 10 over prompts of up to 40 tokens), exported
// and served by z-lab's DFlashDraftModel (its layer_types and sliding_window): the same drafts.
TEST(SpeculativeDecoding, MatchesDflashGenerateWithASlidingWindowDrafter) { compare_with_dflash_generate("qwen3", 10); }

// Plain decoding on a GPU keeps one step in flight: each step's ids are the tokens the step
// before chose, read on the device, and the host takes them a round later. Its output against
// the same batch stepped synchronously (each step's tokens chosen and copied to the host, the next
// ids sent from there), greedy and sampled (each sequence's own generator): the same forwards and
// draws, so the same tokens. Then ids on the host and on the device mixed in one step (a joining
// prompt beside sequences in flight) give what ids all on the host give. The reference chooses
// from the logits widened to fp32 by ATen's cast; ours from the bf16 logits the target gives (the
// argmax) or widened by our kernel (sampled): the same tokens.
TEST(PlainDecoding, GpuStepsInFlightAreTheSynchronousSteps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  for (const char* preset : {"tiny-qwen3", "kernel-sized-qwen3_5"}) {
    SCOPED_TRACE(preset);
    const ModelConfig config = std::string(preset) == "tiny-qwen3"
                                   ? parse_model_config(preset_config_json(preset), preset)
                                   : kernel_sized_qwen3_5();
    TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, false};
    options.decode_state_dtype = at::kBFloat16;
    auto model = random_target(config, config.num_layers - 1, options, 41);
    const IncrementalTarget target(*model);
    std::vector<std::vector<int64_t>> prompts;
    std::vector<at::Tensor> prompt_ids;
    for (int64_t length : {5, 17, 9, 30}) {
      prompt_ids.push_back(at::randint(0, config.vocab_size, {length}, at::TensorOptions().dtype(at::kLong)));
      prompts.emplace_back(prompt_ids.back().data_ptr<int64_t>(), prompt_ids.back().data_ptr<int64_t>() + length);
    }
    for (const double temperature : {0.0, 0.8}) {
      SCOPED_TRACE("temperature " + std::to_string(temperature));
      decode::GenerateSettings settings;
      settings.max_new_tokens = 12;
      settings.sampling.temperature = temperature;
      settings.seed = 3;
      const std::vector<decode::Generation> ours = decode::PlainDecoder(target).generate_all(prompts, settings, 4);

      std::vector<DecodeCache> caches(prompts.size());
      std::vector<DecodeCache*> all;
      std::vector<at::Generator> gens;
      std::vector<at::Generator*> gen_pointers;
      for (size_t j = 0; j < prompts.size(); ++j) {
        caches[j] = target.new_cache(), all.push_back(&caches[j]);
        gens.push_back(at::make_generator<at::CPUGeneratorImpl>(decode::sequence_seed(settings.seed, j)));
      }
      for (at::Generator& g : gens) gen_pointers.push_back(&g);
      const auto choose = [&](const at::Tensor& bf16, size_t j) {  // a prefill's first token, as a step's
        EXPECT_EQ(bf16.scalar_type(), at::kBFloat16);
        const at::Tensor logits = bf16.to(at::kFloat);
        if (temperature == 0) return logits.argmax(-1).cpu();
        return at::tensor(decode::draw_rows(decode::sampling_probs(logits, settings.sampling), {&gens[j]}));
      };
      std::vector<std::vector<int64_t>> expected = prompts;
      std::vector<at::Tensor> next;
      const std::vector<DecodeOutput> prefilled = target.prefill_batch(all, prompt_ids, {});
      for (size_t j = 0; j < all.size(); ++j) next.push_back(choose(prefilled[j].logits, j).reshape({1}));
      for (int64_t step = 0; step < settings.max_new_tokens; ++step) {
        for (size_t j = 0; j < all.size(); ++j) expected[j].push_back(next[j].item<int64_t>());
        if (step + 1 == settings.max_new_tokens) break;
        std::vector<at::Tensor> logits;
        for (const DecodeOutput& o : target.step_batch(all, next, {}, /*croppable=*/false)) logits.push_back(o.logits);
        const at::Tensor rows = at::cat(logits).to(at::kFloat);
        const at::Tensor tokens =
            temperature == 0
                ? rows.argmax(-1).cpu()
                : at::tensor(decode::draw_rows(decode::sampling_probs(rows, settings.sampling), gen_pointers));
        for (size_t j = 0; j < all.size(); ++j) next[j] = tokens.narrow(0, static_cast<int64_t>(j), 1);
      }
      for (size_t j = 0; j < prompts.size(); ++j) {
        EXPECT_EQ(ours[j].tokens, expected[j]) << "prompt " << j;
        EXPECT_EQ(ours[j].new_tokens(), settings.max_new_tokens) << "prompt " << j;
      }
    }

    // Two copies of the same caches, one step each: ids on the host and the device mixed, and
    // ids all on the host.
    std::vector<DecodeCache> mixed(2), host(2);
    for (size_t j = 0; j < 2; ++j) {
      mixed[j] = target.new_cache(), host[j] = target.new_cache();
      target.prefill(mixed[j], prompt_ids[j], {}), target.prefill(host[j], prompt_ids[j], {});
    }
    const at::Tensor a = at::full({1}, 3, at::TensorOptions().dtype(at::kLong)), b = a + 4;
    const std::vector<DecodeOutput> from_both =
        target.step_batch({&mixed[0], &mixed[1]}, {a, b.to(options.device)}, {}, /*croppable=*/false);
    const std::vector<DecodeOutput> from_host = target.step_batch({&host[0], &host[1]}, {a, b}, {}, false);
    for (size_t j = 0; j < 2; ++j) EXPECT_TRUE(at::equal(from_both[j].logits, from_host[j].logits)) << "sequence " << j;
  }
}

}  // namespace
}  // namespace dflash::target
