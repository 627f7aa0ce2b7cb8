// Incremental decoding (target/incremental.h) and speculative decoding (decode/speculative.h) on
// tiny random targets, fp32 on the CPU.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "target/fused_ops.h"
#include "target/incremental.h"
#include "target/model.h"
#include "target/model_config.h"

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
    SCOPED_TRACE(preset);
    const ModelConfig config = parse_model_config(preset_config_json(preset), preset);
    auto model = random_target(config, config.num_layers - 1, TargetOptions{}, 7);
    const IncrementalTarget decoder(*model);
    const std::vector<int64_t> tap{1, config.num_layers - 2};
    const at::Tensor ids = at::randint(0, config.vocab_size, {90}, at::TensorOptions().dtype(at::kLong));
    DecodeCache cache = decoder.new_cache();
    // A long prefill (chunked rule), then steps of 7 of which 0-7 are kept (the rest rolled back
    // and run again with other tokens, as a speculative step's rejected part is).
    int64_t done = 0;
    auto check = [&](const DecodeOutput& out, int64_t begin, int64_t count) {
      const Full full = full_forward(*model, ids.narrow(0, 0, begin + count), tap);
      EXPECT_LT(max_diff(out.logits, full.logits.narrow(0, begin, count)), 1e-4) << "tokens " << begin << "+" << count;
      EXPECT_LT(max_diff(out.features, full.features.narrow(0, begin, count)), 1e-4) << "tokens " << begin << "+" << count;
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
    for (int i = 0; i < 3 && done < ids.size(0); ++i, ++done) check(decoder.step(cache, ids.narrow(0, done, 1), tap), done, 1);
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
}

}  // namespace
}  // namespace dflash::target
