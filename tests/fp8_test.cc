// Block-scaled FP8 (target/fp8.h, target.dtype: float8): the weight and activation quantisation
// against their definition and e4m3's precision, stacking projections without touching a
// checkpoint's own blocks, the GEMM against the fp64 product of its quantised operands, a whole
// target kept FP8 against the bf16 / fp32 one, and (GPU) cuBLASLt's block-scaled GEMM and the
// quantisation kernel against the CPU emulation.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>

#include "common/safetensors.h"
#include "target/fp8.h"
#include "target/fused_ops.h"
#include "target/kernels/grouped_fp8/schedule.h"
#include "target/layers.h"
#include "target/model.h"
#include "target/moe.h"
#include "target/stages.h"
#include "target/weights.h"
#include "tests/test_util.h"

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "target/kernels/grouped_fp8.h"
#endif

namespace dflash::target {
namespace {

// e4m3 keeps 3 mantissa bits: a rounded normal value is within 2^-4 of itself.
constexpr double kE4m3Relative = 1.0 / 16;

bool bytes_equal(const at::Tensor& a, const at::Tensor& b) {
  return a.sizes() == b.sizes() && at::equal(a.contiguous().view(at::kByte), b.contiguous().view(at::kByte));
}

// Rows of very different magnitudes, so that blocks get different factors.
at::Tensor uneven_weight(int64_t out, int64_t in, uint64_t seed) {
  at::manual_seed(seed);
  return at::randn({out, in}) * at::pow(10.0, at::randint(-3, 2, {out, 1}).to(at::kFloat));
}

TEST(Fp8, BlockQuantisationIsWithinE4m3PrecisionOfEachBlock) {
  at::Tensor w = uneven_weight(300, 256, 1);
  w.narrow(0, 256, 44).narrow(1, 128, 128).zero_();  // an all-zero block (the last row block is partial)
  const Fp8Weight q = quantize_blocks(w);
  ASSERT_EQ(q.data.sizes(), (std::vector<int64_t>{300, 256}));
  ASSERT_EQ(q.scale.sizes(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(q.data.scalar_type(), at::kFloat8_e4m3fn);
  EXPECT_EQ(q.bytes(), 300 * 256 + 6 * 4);
  for (int64_t i = 0; i < 3; ++i) {
    for (int64_t j = 0; j < 2; ++j) {
      const at::Tensor block = w.narrow(0, i * 128, std::min<int64_t>(128, 300 - i * 128)).narrow(1, j * 128, 128);
      const at::Tensor stored = q.data.narrow(0, i * 128, block.size(0)).narrow(1, j * 128, 128).to(at::kFloat);
      const double amax = block.abs().max().item<double>();
      if (amax == 0) {
        EXPECT_EQ(q.scale[i][j].item<float>(), 1.f);
        EXPECT_EQ(stored.abs().max().item<float>(), 0.f);
        continue;
      }
      EXPECT_FLOAT_EQ(q.scale[i][j].item<float>(), static_cast<float>(amax / 448));
      EXPECT_EQ(stored.abs().max().item<float>(), 448.f) << "the block's largest element maps to e4m3's largest";
      // Normal e4m3 values (>= 2^-6 before scaling) are within 2^-4; below, an absolute step.
      const at::Tensor back = stored.to(at::kDouble) * q.scale[i][j].item<double>();
      const at::Tensor error = (back - block.to(at::kDouble)).abs();
      const at::Tensor bound = block.to(at::kDouble).abs() * kE4m3Relative + q.scale[i][j].item<double>() * std::pow(2.0, -10);
      EXPECT_TRUE((error <= bound).all().item<bool>()) << "block " << i << "," << j;
    }
  }
  const at::Tensor dequantized = dequantize_blocks(q, at::kFloat);
  EXPECT_LT((dequantized - w).abs().max().item<double>(), w.abs().max().item<double>() * kE4m3Relative);
}

TEST(Fp8, StackingKeepsACheckpointsAlignedBlocksAndQuantisesTheRest) {
  const Fp8Weight a = quantize_blocks(uneven_weight(256, 256, 2)), b = quantize_blocks(uneven_weight(128, 256, 3));
  const at::Tensor c = uneven_weight(48, 256, 4), d = uneven_weight(48, 256, 5);
  // A GatedDeltaNet's in_proj: qkv and z stored FP8 on block boundaries, b and a in bf16 / float.
  const Fp8Weight stacked = stack_fp8({{{}, a}, {{}, b}, {c, {}}, {d, {}}});
  ASSERT_EQ(stacked.data.sizes(), (std::vector<int64_t>{480, 256}));
  ASSERT_EQ(stacked.scale.sizes(), (std::vector<int64_t>{4, 2}));
  EXPECT_TRUE(bytes_equal(stacked.data.narrow(0, 0, 256), a.data));
  EXPECT_TRUE(bytes_equal(stacked.data.narrow(0, 256, 128), b.data));
  EXPECT_TRUE(at::equal(stacked.scale.narrow(0, 0, 2), a.scale));
  EXPECT_TRUE(at::equal(stacked.scale.narrow(0, 2, 1), b.scale));
  const Fp8Weight tail = quantize_blocks(at::cat({c, d}, 0));
  EXPECT_TRUE(bytes_equal(stacked.data.narrow(0, 384, 96), tail.data));
  EXPECT_TRUE(at::equal(stacked.scale.narrow(0, 3, 1), tail.scale));

  // A stored part that would leave a block straddling two parts: from there on, requantised.
  const Fp8Weight odd = quantize_blocks(uneven_weight(100, 256, 6)), after = quantize_blocks(uneven_weight(60, 256, 7));
  const Fp8Weight mixed = stack_fp8({{{}, a}, {{}, odd}, {{}, after}});
  ASSERT_EQ(mixed.scale.sizes(), (std::vector<int64_t>{4, 2}));
  EXPECT_TRUE(bytes_equal(mixed.data.narrow(0, 0, 256), a.data));
  const at::Tensor expected = at::cat({dequantize_blocks(odd, at::kFloat), dequantize_blocks(after, at::kFloat)}, 0);
  const at::Tensor got = dequantize_blocks(mixed, at::kFloat).narrow(0, 256, 160);
  EXPECT_LT((got - expected).abs().max().item<double>(), expected.abs().max().item<double>() * kE4m3Relative);
  EXPECT_GT((got - expected).abs().max().item<double>(), 0.0) << "the straddling rows were requantised";
}

TEST(Fp8, ActivationGroupsFollowTheirDefinition) {
  at::manual_seed(8);
  at::Tensor x = (at::randn({5, 384}) * 3).to(at::kBFloat16);
  x[2].narrow(0, 128, 128).zero_();
  const Fp8Activations a = quantize_groups(x);
  ASSERT_EQ(a.factors.sizes(), (std::vector<int64_t>{5, 3}));
  EXPECT_EQ(a.factors.strides(), (std::vector<int64_t>{1, 5})) << "column-major, as cuBLASLt reads 1x128 factors";
  EXPECT_EQ(a.factors[2][1].item<float>(), 1.f);
  for (int64_t r = 0; r < 5; ++r) {
    for (int64_t g = 0; g < 3; ++g) {
      const at::Tensor group = x[r].narrow(0, g * 128, 128).to(at::kFloat);
      const float amax = group.abs().max().item<float>();
      if (amax == 0) continue;
      EXPECT_EQ(a.factors[r][g].item<float>(), amax / 448.f);
      const at::Tensor q = a.q[r].narrow(0, g * 128, 128).to(at::kDouble);
      EXPECT_EQ(q.abs().max().item<double>(), 448.0);
      const at::Tensor error = (q * a.factors[r][g].item<double>() - group.to(at::kDouble)).abs();
      EXPECT_TRUE((error <= group.to(at::kDouble).abs() * kE4m3Relative + amax / 448.0 * std::pow(2.0, -10)).all().item<bool>());
    }
  }
}

// The GEMM is the product of its quantised operands (each factor applied per 128-wide slice),
// rounded to bf16 once; and it is FP8: visibly off the bf16 product, within FP8's error.
TEST(Fp8, LinearIsTheFp64ProductOfTheQuantisedOperands) {
  at::manual_seed(9);
  const at::Tensor x = at::randn({2, 7, 256}).to(at::kBFloat16), bias = at::randn({64}).to(at::kBFloat16);
  const at::Tensor w = uneven_weight(64, 256, 10);
  const Fp8Weight q = quantize_blocks(w);
  const at::Tensor y = fp8_linear(x, q, bias);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 7, 64}));
  EXPECT_EQ(y.scalar_type(), at::kBFloat16);
  const Fp8Activations a = quantize_groups(x.reshape({14, 256}));
  const at::Tensor xs = a.q.to(at::kDouble) * a.factors.to(at::kDouble).repeat_interleave(128, 1);
  const at::Tensor exact = (at::matmul(xs, dequantize_blocks(q, at::kDouble).t()) + bias.to(at::kDouble)).view({2, 7, 64});
  const double scale = exact.abs().max().item<double>();
  EXPECT_LT((y.to(at::kDouble) - exact).abs().max().item<double>() / scale, 1.0 / 128);  // bf16's rounding
  const at::Tensor plain = at::linear(x.to(at::kDouble), w.to(at::kDouble), bias.to(at::kDouble));
  const double off = (y.to(at::kDouble) - plain).abs().max().item<double>() / scale;
  EXPECT_GT(off, 1e-3);
  EXPECT_LT(off, 0.1);
}

// Tiny targets whose projections the FP8 GEMM takes (inputs of 512; a GatedDeltaNet in_proj of
// 1,296 rows): tiny-qwen3_5 dense, or tiny-qwen3_next with every layer MoE (experts of 128, a
// shared expert).
std::string fp8_friendly_json(const std::string& preset) {
  auto root = nlohmann::json::parse(preset_config_json(preset));
  auto& j = root.contains("text_config") ? root["text_config"] : root;
  j["hidden_size"] = 512, j["num_hidden_layers"] = 4, j["full_attention_interval"] = 2;
  j["num_attention_heads"] = 4, j["num_key_value_heads"] = 1, j["head_dim"] = 128;
  j["linear_num_key_heads"] = 2, j["linear_num_value_heads"] = 8, j["linear_key_head_dim"] = 64;
  j["linear_value_head_dim"] = 64;
  if (j.contains("num_experts")) {
    j["moe_intermediate_size"] = 128, j["shared_expert_intermediate_size"] = 128;
  } else {
    j["intermediate_size"] = 512;
  }
  return root.dump();
}
ModelConfig fp8_friendly_config(const std::string& preset = "tiny-qwen3_5") {
  return parse_model_config(fp8_friendly_json(preset), preset + " (FP8-friendly)");
}

// Layers 0..3 of c with random weights (seed) on the CPU: FP8 projections, or all bf16.
std::unique_ptr<TargetModel> cpu_target(const ModelConfig& c, uint64_t seed, bool fp8) {
  TargetOptions options{at::kCPU, at::kBFloat16};
  options.fp8_weights = fp8;
  return random_target(c, 3, options, seed);
}

TEST(Fp8, ATargetKeptFp8HalvesItsProjectionsAndStaysNearTheBf16One) {
  const ModelConfig c = fp8_friendly_config();
  auto fp8 = cpu_target(c, 11, true), bf16 = cpu_target(c, 11, false);
  auto fp32 = random_target(c, 3, TargetOptions{}, 11);
  EXPECT_EQ(fp8->kernel_paths().at("target.projections").path, "fp8_emulated");
  EXPECT_EQ(bf16->kernel_paths().at("target.projections").path, "BFloat16");
  // Embedding and head stay bf16 (2 x 512 x 512 x 2 bytes); the projections take one byte each.
  const int64_t embedding_and_head = 2 * 512 * 512 * 2;
  EXPECT_LT(fp8->weight_bytes() - embedding_and_head, (bf16->weight_bytes() - embedding_and_head) * 6 / 10);
  EXPECT_GT(fp8->weight_bytes() - embedding_and_head, (bf16->weight_bytes() - embedding_and_head) / 2);

  at::manual_seed(12);
  const at::Tensor ids = at::randint(0, 512, {70}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor reference = fp32->forward(ids, {0, 30, 70}, {3})[0].to(at::kDouble);
  auto distance = [&](const TargetModel& m) {
    return (m.forward(ids, {0, 30, 70}, {3})[0].to(at::kDouble) - reference).abs().max().item<double>() /
           reference.abs().max().item<double>();
  };
  const double fp8_distance = distance(*fp8), bf16_distance = distance(*bf16);
  std::printf("layer 3 from fp32: FP8 %.4f, bf16 %.4f (max error over max |fp32|)\n", fp8_distance, bf16_distance);
  EXPECT_GT(fp8_distance, 2 * bf16_distance) << "FP8 quantisation moved the states more than bf16 rounding";
  // Random weights amplify a perturbation layer after layer (0.17 here): a bound on the same
  // model, not a fidelity figure (that is GpuTappedStatesMatchTransformersFp8's).
  EXPECT_LT(fp8_distance, 0.3);
}

// MoE experts kept FP8: a quarter of the bf16 bytes for the experts, and the forward is the one of
// the experts dequantized (the same rounding as dequantizing at load).
TEST(Fp8, MoeExpertsAreKeptFp8AndRunDequantized) {
  const ModelConfig c = fp8_friendly_config("tiny-qwen3_next");
  auto fp8 = cpu_target(c, 21, true), bf16 = cpu_target(c, 21, false);
  // Per layer the experts are 4 x 3 x 128 x 512 parameters: 1,572,864 bytes in bf16, 786,432 + 4 x 12
  // factors x 4 bytes in FP8.
  const int64_t saved_per_layer = 4 * 3 * 128 * 512 * 2 - (4 * 3 * 128 * 512 + 4 * 12 * 4);
  EXPECT_GT(bf16->weight_bytes() - fp8->weight_bytes(), 4 * saved_per_layer);
  at::manual_seed(22);
  const at::Tensor ids = at::randint(0, 512, {50}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor a = fp8->forward(ids, {0, 50}, {3})[0].to(at::kDouble), b = bf16->forward(ids, {0, 50}, {3})[0].to(at::kDouble);
  const double distance = ((a - b).norm() / b.norm()).item<double>();
  std::printf("layer 3, FP8 experts and projections from bf16: %.4f (Frobenius)\n", distance);
  EXPECT_GT(distance, 1e-3);
  EXPECT_LT(distance, 0.3);

  // One MoE block: FP8 experts give exactly what their dequantized bf16 copies give.
  const MoeShape shape{4, 2, 128, true, 128};
  const Fp8Weight gate_up{at::stack({quantize_blocks(uneven_weight(256, 128, 23)).data, quantize_blocks(uneven_weight(256, 128, 24)).data,
                                     quantize_blocks(uneven_weight(256, 128, 25)).data, quantize_blocks(uneven_weight(256, 128, 26)).data}),
                          at::ones({4, 2, 1}) * 1e-3};
  const Fp8Weight down{quantize_blocks(uneven_weight(512, 128, 27)).data.view({4, 128, 128}), at::ones({4, 1, 1}) * 2e-3};
  auto make = [&](const at::Tensor& gu, const at::Tensor& d) {
    return MoeWeights::make(at::randn({4, 128}).to(at::kBFloat16), gu, d, at::randn({128, 128}).to(at::kBFloat16) * 0.1,
                            at::randn({128, 128}).to(at::kBFloat16) * 0.1, at::randn({128, 128}).to(at::kBFloat16) * 0.1,
                            at::randn({1, 128}).to(at::kBFloat16));
  };
  at::manual_seed(28);
  MoeWeights kept = make({}, {});
  at::manual_seed(28);
  const MoeWeights dequantized = make(dequantize_blocks(gate_up, at::kBFloat16), dequantize_blocks(down, at::kBFloat16));
  kept.fp8_gate_up = gate_up, kept.fp8_down = down;
  const at::Tensor x = at::randn({9, 128}).to(at::kBFloat16);
  EXPECT_TRUE(at::equal(moe_reference(shape, kept, x), moe_reference(shape, dequantized, x)));
}

// Random weights drawn on the CPU whatever the device (RandomWeights draws on the device itself).
class CpuDrawnWeights : public WeightSource {
 public:
  explicit CpuDrawnWeights(uint64_t seed) : random_(seed) {}
  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                 Init init) override {
    return random_.get(name, shape, options.device(at::kCPU), init).to(options.device());
  }
  bool contains(const std::string&) const override { return true; }
  std::string describe() const override { return "random weights drawn on the CPU"; }

 private:
  RandomWeights random_;
};

// What a target loads, drawn as CpuDrawnWeights draws it and kept (name, values as asked, on the
// CPU), so that a test can write it out as a checkpoint; the MoE experts one module per expert
// (the released layout).
class RecordingWeights : public CpuDrawnWeights {
 public:
  using CpuDrawnWeights::CpuDrawnWeights;
  at::Tensor get(const std::string& name, const std::vector<int64_t>& shape, const at::TensorOptions& options,
                 Init init) override {
    at::Tensor t = CpuDrawnWeights::get(name, shape, options, init);
    if (!recorded.count(name)) recorded.emplace(name, t.cpu()), order.push_back(name);
    return t;
  }
  bool contains(const std::string& name) const override {
    auto ends = [&](const std::string& tail) {
      return name.size() >= tail.size() && name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
    };
    return !ends("experts.gate_up_proj") && !ends("experts.down_proj");
  }
  std::string describe() const override { return "recorded random weights"; }
  std::map<std::string, at::Tensor> recorded;
  std::vector<std::string> order;
};

// w [out, in] (in whole blocks of 128) as e4m3 with power-of-two factors per 128x128 block, each
// block's largest |value| exactly 448: its dequantization is exact in fp32, and quantising that
// again (quantize_blocks) gives these bytes and factors back.
Fp8Weight power_of_two_blocks(const at::Tensor& w) {
  const int64_t out = w.size(0), in = w.size(1), row_blocks = (out + 127) / 128;
  at::Tensor q = at::empty({out, in});
  at::Tensor scale = at::empty({row_blocks, in / 128});
  for (int64_t r = 0; r < row_blocks; ++r) {
    for (int64_t c = 0; c < in / 128; ++c) {
      const at::Tensor block = w.narrow(0, r * 128, std::min<int64_t>(128, out - r * 128)).narrow(1, c * 128, 128);
      const double amax = std::max(block.abs().max().item<double>(), 1e-30);
      const double factor = std::exp2(std::ceil(std::log2(amax / 448.0)));
      at::Tensor scaled = (block / factor).to(at::kFloat8_e4m3fn).to(at::kFloat);
      const int64_t top = block.abs().argmax().item<int64_t>();
      scaled.view(-1)[top] = block.reshape(-1)[top].item<float>() < 0 ? -448.0 : 448.0;
      q.narrow(0, r * 128, block.size(0)).narrow(1, c * 128, 128).copy_(scaled);
      scale[r][c] = factor;
    }
  }
  return {q.to(at::kFloat8_e4m3fn), scale};
}

// Writes `rec`'s tensors as a checkpoint in `dir` with `config`: the projections (2-D `*proj*.weight`
// of whole 128-column blocks: the GatedDeltaNet in_proj parts and the shared expert's too, as Qwen's
// FP8 releases store them) either
// e4m3 with their factors (`fp8`) or their exact dequantized values in fp32; the rest as drawn.
void write_checkpoint(const RecordingWeights& rec, const std::string& dir, const std::string& config, bool fp8) {
  std::vector<at::Tensor> keep;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& name, const at::Tensor& t, DType dtype) {
    keep.push_back(t.contiguous());
    tensors.push_back({"model." + name, dtype, t.sizes().vec(), keep.back().data_ptr(),
                       static_cast<size_t>(keep.back().nbytes())});
  };
  for (const std::string& name : rec.order) {
    const at::Tensor& t = rec.recorded.at(name);
    const bool projection = t.dim() == 2 && t.size(1) % 128 == 0 && name.find("proj") != std::string::npos &&
                            name.compare(name.size() - 7, 7, ".weight") == 0;
    if (!projection) {
      add(name, t, t.scalar_type() == at::kBFloat16 ? DType::BF16 : DType::F32);
      continue;
    }
    const Fp8Weight w = power_of_two_blocks(t.to(at::kFloat));
    if (fp8) {
      add(name, w.data.view(at::kByte), DType::F8_E4M3);
      add(name + "_scale_inv", w.scale, DType::F32);
    } else {
      add(name, dequantize_blocks(w, at::kFloat), DType::F32);
    }
  }
  write_safetensors(dir + "/model.safetensors", tensors);
  std::ofstream(dir + "/config.json") << config;
}

// A target of `preset` (FP8-friendly sizes) from a checkpoint stored block-scaled FP8 as Qwen's
// releases are against the same values stored in fp32 and quantised at load: `kept` (a
// projection stored FP8 as [out, in]) keeps the checkpoint's bytes, and the two targets' tapped
// states are the same bits (target.dtype: float8, on the CPU's emulation).
void check_stored_fp8_checkpoint(const std::string& preset, const std::string& kept, int64_t out, int64_t in) {
  SCOPED_TRACE(preset);
  const std::string json = fp8_friendly_json(preset);
  const ModelConfig c = parse_model_config(json, preset + " (FP8-friendly)");
  TargetOptions options{at::kCPU, at::kBFloat16};
  options.fp8_weights = true;
  RecordingWeights rec(47);
  { const TargetModel drawn(c, rec, 3, options); }  // draws every tensor the target reads
  ASSERT_TRUE(rec.recorded.count(kept)) << kept << " was not read";
  const std::string fp8_dir = test::make_temp_dir("fp8-checkpoint"), float_dir = test::make_temp_dir("fp8-twin");
  auto with_quantization = nlohmann::json::parse(json);
  with_quantization["quantization_config"] = {
      {"quant_method", "fp8"}, {"fmt", "e4m3"}, {"weight_block_size", {128, 128}}};
  write_checkpoint(rec, fp8_dir, with_quantization.dump(), true);
  write_checkpoint(rec, float_dir, json, false);
  CheckpointWeights stored(fp8_dir), twin(float_dir);
  const WeightRows rows = stored.get_rows(kept, {out, in}, at::kCPU);
  ASSERT_TRUE(rows.fp8.defined()) << kept << " stored FP8 was not kept FP8";
  const Fp8Weight expected = power_of_two_blocks(rec.recorded.at(kept));
  EXPECT_TRUE(bytes_equal(rows.fp8.data, expected.data));
  EXPECT_TRUE(at::equal(rows.fp8.scale, expected.scale));
  TargetModel from_fp8(c, stored, 3, options), from_float(c, twin, 3, options);
  at::manual_seed(48);
  const at::Tensor ids = at::randint(0, 512, {70}, at::TensorOptions().dtype(at::kLong));
  const std::vector<at::Tensor> a = from_fp8.forward(ids, {0, 30, 70}, {1, 3});
  const std::vector<at::Tensor> b = from_float.forward(ids, {0, 30, 70}, {1, 3});
  ASSERT_EQ(a.size(), 2u);
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(at::isfinite(a[i]).all().item<bool>());
    EXPECT_TRUE(at::equal(a[i], b[i])) << "tapped layer " << (i == 0 ? 1 : 3);
  }
}

// Checkpoints stored FP8: qwen3_5 (the GatedDeltaNet in_proj from its stored qkv, z, b, a parts;
// gated attention's q, k, v; the dense MLP) and an MoE qwen3_next (4 experts and a shared expert
// per layer, each expert its own modules, the router and norms in bf16).
TEST(Fp8, CheckpointsStoredFp8RunAsTheirValuesQuantisedAtLoad) {
  check_stored_fp8_checkpoint("tiny-qwen3_5", "layers.1.mlp.down_proj.weight", 512, 512);
  check_stored_fp8_checkpoint("tiny-qwen3_next", "layers.1.mlp.experts.2.gate_proj.weight", 128, 512);
}

// An FP8 target split into 2 and 3 stages taps the bits of the whole FP8 target (qwen3_5 dense,
// qwen3_next MoE): each stage quantises its own layers' weights as the whole target does.
TEST(Fp8, StagesOfAnFp8TargetTapBitIdenticalStates) {
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3_next"}) {
    SCOPED_TRACE(preset);
    const ModelConfig c = fp8_friendly_config(preset);
    TargetOptions options{at::kCPU, at::kBFloat16};
    options.fp8_weights = true;
    auto whole = random_target(c, 3, options, 52);
    at::manual_seed(53);
    const at::Tensor ids = at::randint(0, 512, {70}, at::TensorOptions().dtype(at::kLong));
    const std::vector<int64_t> tap{0, 1, 2, 3};
    const std::vector<at::Tensor> expected = whole->forward(ids, {0, 30, 70}, tap);
    for (const size_t stages : {2, 3}) {
      auto staged = random_staged_target(c, 3, std::vector<TargetOptions>(stages, options), 52);
      const std::vector<at::Tensor> got = staged->forward(ids, {0, 30, 70}, tap);
      ASSERT_EQ(got.size(), tap.size());
      for (size_t i = 0; i < tap.size(); ++i) {
        EXPECT_TRUE(at::equal(got[i], expected[i])) << stages << " stages, layer " << tap[i];
      }
    }
  }
}

TEST(Fp8, ProjectionsThatAreNotWholeGroupsAreRefusedByName) {
  TargetOptions options{at::kCPU, at::kBFloat16};
  options.fp8_weights = true;
  try {
    random_target(parse_model_config(preset_config_json("tiny-qwen3"), "tiny-qwen3"), 1, options, 1);
    FAIL() << "hidden size 64 loaded as FP8";
  } catch (const WeightsError& e) {
    EXPECT_NE(std::string(e.what()).find("layers.0.self_attn.q_proj (with the projections stacked on it) cannot be kept "
                                         "FP8 (target.dtype: float8): 64 input features: the block-scaled FP8 GEMM "
                                         "takes a multiple of 512"),
              std::string::npos)
        << e.what();
  }
  TargetOptions fp32_fp8;
  fp32_fp8.fp8_weights = true;
  EXPECT_THROW(random_target(fp8_friendly_config(), 1, fp32_fp8, 1), std::invalid_argument);
}

// A checkpoint in Qwen's FP8 layout (128x128 blocks) gives its bytes as they are; in other blocks
// (transformers' tiny test checkpoints use 16x16), the weight dequantised for requantising.
TEST(Fp8, CheckpointBlocksOf128AreKeptAsStored) {
  const std::string dir = test::make_temp_dir("fp8-checkpoint");
  const Fp8Weight w = quantize_blocks(uneven_weight(256, 256, 13));
  const std::vector<uint16_t> embed(512 * 128, 0);
  write_safetensors(dir + "/model.safetensors",
                    {{"model.embed_tokens.weight", DType::BF16, {512, 128}, embed.data(), embed.size() * 2},
                     {"model.layers.0.mlp.down_proj.weight", DType::F8_E4M3, {256, 256}, w.data.data_ptr(), 256 * 256},
                     {"model.layers.0.mlp.down_proj.weight_scale_inv", DType::F32, {2, 2}, w.scale.data_ptr(), 16}});
  auto write_config = [&](int block) {
    std::string config = preset_config_json("tiny-qwen3");
    config.insert(config.rfind('}'), R"(, "quantization_config": {"quant_method": "fp8", "weight_block_size": [)" +
                                         std::to_string(block) + ", " + std::to_string(block) + "]}");
    std::ofstream(dir + "/config.json") << config;
  };
  write_config(128);
  {
    CheckpointWeights weights(dir);
    const WeightRows rows = weights.get_rows("layers.0.mlp.down_proj.weight", {256, 256}, at::kCPU);
    ASSERT_TRUE(rows.fp8.defined());
    EXPECT_TRUE(bytes_equal(rows.fp8.data, w.data));
    EXPECT_TRUE(at::equal(rows.fp8.scale, w.scale));
  }
  write_config(64);  // the same bytes read as 64x64 blocks: a scale of the wrong shape
  {
    CheckpointWeights weights(dir);
    EXPECT_THROW(weights.get_rows("layers.0.mlp.down_proj.weight", {256, 256}, at::kCPU), WeightsError);
  }
}

TEST(Fp8, GpuQuantisationAndGemmMatchTheEmulation) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  if (const auto why = fp8_gemm_unavailable(at::Device(at::kCUDA, 0))) GTEST_SKIP() << *why;
  const at::Device gpu(at::kCUDA, 0);
  // The dequantization kernel (MoE experts) rounds as ATen's ops: a batch of 3 with a partial
  // row block.
  {
    std::vector<at::Tensor> data, scales;
    for (int e = 0; e < 3; ++e) {
      const Fp8Weight one = quantize_blocks(uneven_weight(200, 384, 30 + e));
      data.push_back(one.data), scales.push_back(one.scale);
    }
    const Fp8Weight batch{at::stack(data), at::stack(scales)};
    const at::Tensor cpu = dequantize_blocks(batch, at::kBFloat16);
    const at::Tensor cuda = dequantize_blocks(Fp8Weight{batch.data.to(gpu), batch.scale.to(gpu)}, at::kBFloat16);
    EXPECT_TRUE(at::equal(cuda.cpu(), cpu));
  }
  for (const int64_t rows : {1, 5, 16, 17, 40, 64, 100, 300}) {
    for (const auto& [out, in] : std::vector<std::pair<int64_t, int64_t>>{{256, 512}, {400, 5120}, {1296, 1024}}) {
      const std::string what = std::to_string(rows) + " x " + std::to_string(in) + " -> " + std::to_string(out);
      try {
        at::manual_seed(rows * 7 + in);
        // A strided view on the GPU (the kernel's row stride), as the target passes column slices.
        const at::Tensor wide = (at::randn({rows, in + 128}) * 2).to(at::kBFloat16);
        const at::Tensor x = wide.narrow(1, 64, in);
        const Fp8Weight w = quantize_blocks(uneven_weight(out, in, 14));
        const Fp8Activations cpu = quantize_groups(x.contiguous());
        const Fp8Activations cuda = quantize_groups(wide.to(gpu).narrow(1, 64, in));
        EXPECT_TRUE(bytes_equal(cuda.q.cpu(), cpu.q)) << what;
        EXPECT_TRUE(at::equal(cuda.factors.cpu(), cpu.factors)) << what;
        if (rows > 1) {
          EXPECT_EQ(cuda.factors.strides(), cpu.factors.strides()) << what;
        }
        // Padded to 16 rows (what the GEMM is given): the same rows, then zeros with factor 1.
        const Fp8Activations padded = quantize_groups(wide.to(gpu).narrow(1, 64, in), (rows + 15) / 16 * 16);
        const Fp8Activations padded_cpu = quantize_groups(x.contiguous(), (rows + 15) / 16 * 16);
        EXPECT_TRUE(bytes_equal(padded.q.cpu(), padded_cpu.q)) << what;
        EXPECT_TRUE(at::equal(padded.factors.cpu(), padded_cpu.factors)) << what;
        EXPECT_EQ(padded.factors.strides(), padded_cpu.factors.strides()) << what;
        const at::Tensor bias = at::randn({out}).to(at::kBFloat16);
        const at::Tensor expected = fp8_linear(x.contiguous(), w, bias).to(at::kDouble);
        const at::Tensor got =
            fp8_linear(wide.to(gpu).narrow(1, 64, in), Fp8Weight{w.data.to(gpu), w.scale.to(gpu)}, bias.to(gpu));
        const double scale = expected.abs().max().item<double>();
        EXPECT_LT((got.cpu().to(at::kDouble) - expected).abs().max().item<double>() / scale, 1.0 / 128) << what;
      } catch (const std::exception& e) {
        ADD_FAILURE() << what << ": " << e.what();
      }
    }
  }
  EXPECT_LT(fp8_gemm_error(gpu), 1e-2) << "dflashd doctor's FP8 self-test";
}

// The FP8 grouped GEMM's tiles, as its CTAs count them: every row of every group lands in
// exactly one tile (per n-tile), a tile's rows all belong to its group, at most 128 of them, and
// no tile is empty; groups without rows (first, last, in a row) own no tile.
TEST(GroupedFp8Schedule, EveryRowOfEveryGroupIsInOneTile) {
  namespace gf = dflash::grouped_fp8;
  for (const std::vector<int32_t>& sizes : std::vector<std::vector<int32_t>>{
           {0, 1, 64, 65, 0, 0, 128, 129, 300, 7, 0}, {3072}, {0, 0, 5}, {256, 0}, {1000, 1, 1, 1, 1, 0, 0, 1}}) {
    const int groups = static_cast<int>(sizes.size()), n_tiles = 3;
    std::vector<int32_t> ends(sizes.size());
    std::vector<int> before(sizes.size() + 1, 0);
    for (int g = 0; g < groups; ++g) {
      ends[g] = (g == 0 ? 0 : ends[g - 1]) + sizes[g];
      before[g + 1] = before[g] + gf::m_tiles_of(ends.data(), g);
    }
    const int rows = ends.back();
    std::vector<int> covered(static_cast<size_t>(rows) * n_tiles, 0);
    for (int64_t t = 0; t < static_cast<int64_t>(before[groups]) * n_tiles; ++t) {
      const gf::Tile tile = gf::locate(t, before.data(), ends.data(), groups, n_tiles);
      ASSERT_GE(tile.group, 0);
      ASSERT_LT(tile.group, groups);
      EXPECT_LT(tile.row_begin, tile.row_end) << "tile " << t << " is empty";
      EXPECT_LE(tile.row_end - tile.row_begin, gf::kTileRows);
      EXPECT_GE(tile.row_begin, gf::group_begin(ends.data(), tile.group)) << "tile " << t;
      EXPECT_LE(tile.row_end, ends[tile.group]) << "tile " << t;
      EXPECT_EQ(tile.n_tile, t % n_tiles);
      for (int r = tile.row_begin; r < tile.row_end; ++r) ++covered[static_cast<size_t>(r) * n_tiles + tile.n_tile];
    }
    for (size_t i = 0; i < covered.size(); ++i) ASSERT_EQ(covered[i], 1) << "row " << i / n_tiles;
  }
}


// The CPU emulation of the grouped product is, group by group, fp8_linear's emulation of that
// group's rows and expert (rows past the last group's end are not part of it).
TEST(Fp8, GroupedLinearIsEachGroupsLinear) {
  const std::vector<int32_t> sizes{3, 0, 20, 1};
  std::vector<at::Tensor> data, scales;
  for (int e = 0; e < 4; ++e) {
    const Fp8Weight one = quantize_blocks(uneven_weight(256, 384, 40 + e));
    data.push_back(one.data), scales.push_back(one.scale);
  }
  const Fp8Weight experts{at::stack(data), at::stack(scales)};
  at::manual_seed(45);
  const at::Tensor x = at::randn({30, 384}).to(at::kBFloat16);  // 24 rows in groups, 6 after them
  const at::Tensor ends = at::tensor({3, 3, 23, 24}, at::TensorOptions().dtype(at::kInt));
  const at::Tensor y = fp8_grouped_linear(quantize_groups(x), experts, ends);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{30, 256}));
  int64_t begin = 0;
  for (int e = 0; e < 4; ++e) {
    if (sizes[e] == 0) continue;
    const at::Tensor want = fp8_linear(x.narrow(0, begin, sizes[e]), Fp8Weight{data[e], scales[e]}, {});
    EXPECT_TRUE(at::equal(y.narrow(0, begin, sizes[e]), want)) << "expert " << e;
    begin += sizes[e];
  }
  EXPECT_THROW(fp8_grouped_linear(quantize_groups(x), experts, ends.narrow(0, 0, 3)), std::invalid_argument);
}

#ifdef DFLASHD_WITH_CUDA
// One grouped product on the GPU kernel against the CPU emulation (fp8_grouped_linear), run twice.
struct GroupedCase {
  std::vector<int32_t> sizes;  // rows per group
  int64_t n, k, spare_rows, stride;
};

void check_grouped_case(const GroupedCase& c, const at::Device& gpu, cudaStream_t stream) {
  namespace gf = dflash::grouped_fp8;
  const int groups = static_cast<int>(c.sizes.size());
  std::vector<int32_t> ends(c.sizes.size());
  for (int g = 0; g < groups; ++g) ends[g] = (g == 0 ? 0 : ends[g - 1]) + c.sizes[g];
  const int64_t rows = ends.back() + c.spare_rows;
  SCOPED_TRACE(std::to_string(groups) + " groups, " + std::to_string(rows) + " x " + std::to_string(c.k) + " -> " +
               std::to_string(c.n));
  std::vector<at::Tensor> data, scales;
  for (int g = 0; g < groups; ++g) {
    const Fp8Weight one = quantize_blocks(uneven_weight(c.n, c.k, 50 + g) / std::sqrt(static_cast<double>(c.k)));
    data.push_back(one.data), scales.push_back(one.scale);
  }
  const Fp8Weight cpu_w{at::stack(data), at::stack(scales)};
  const Fp8Weight gpu_w{cpu_w.data.to(gpu), cpu_w.scale.to(gpu)};
  at::manual_seed(60 + groups);
  const at::Tensor wide = at::randn({rows, c.stride}).to(at::kBFloat16);
  const Fp8Activations a = quantize_groups(wide.narrow(1, 0, c.k).contiguous());
  const at::Tensor cpu_ends = at::tensor(at::ArrayRef<int32_t>(ends), at::TensorOptions().dtype(at::kInt));
  const at::Tensor want = fp8_grouped_linear(a, cpu_w, cpu_ends).narrow(0, 0, ends.back()).to(at::kFloat);
  // x strided on the GPU: the quantised rows copied into wider rows.
  const at::Tensor q = at::zeros({rows, c.stride}, at::TensorOptions().dtype(at::kByte).device(gpu));
  q.narrow(1, 0, c.k).copy_(a.q.view(at::kByte).to(gpu));
  const at::Tensor factors = a.factors.to(gpu).t().contiguous().t();
  const at::Tensor gpu_ends = cpu_ends.to(gpu);
  const at::Tensor sentinel = at::full({rows, c.n}, 7.0, at::TensorOptions().dtype(at::kBFloat16).device(gpu));
  at::Tensor got = sentinel.clone(), again = sentinel.clone();
  gf::Problem p;
  p.x = q.data_ptr(), p.x_stride = c.stride, p.x_factors = factors.data_ptr<float>();
  p.factor_stride = factors.size(1) == 1 ? rows : factors.stride(1);
  p.w = gpu_w.data.data_ptr(), p.w_factors = gpu_w.scale.data_ptr<float>();
  p.ends = groups == 1 ? nullptr : gpu_ends.data_ptr<int32_t>();
  p.y = got.data_ptr(), p.m = groups == 1 ? ends.back() : rows, p.n = c.n, p.k = c.k, p.groups = groups;
  ASSERT_TRUE(gf::applies(p, 0));
  gf::run(p, 0, stream);
  p.y = again.data_ptr();
  gf::run(p, 0, stream);
  // bf16's rounding, and the tensor cores' FP8 sums within a k-block, which keep fewer bits
  // than fp32 (the reason the factors are applied per k-block): 1e-3 of the largest value.
  const at::Tensor result = got.narrow(0, 0, ends.back()).cpu().to(at::kFloat);
  const at::Tensor error = (result - want).abs();
  const at::Tensor bound = want.abs() * (1.0 / 128) + 1e-3 * want.abs().max().item<double>();
  EXPECT_TRUE(error.le(bound).all().item<bool>()) << "worst excess " << (error - bound).max().item<float>();
  EXPECT_TRUE(at::equal(got, again)) << "a second run differs";
  EXPECT_TRUE(at::equal(got.narrow(0, ends.back(), c.spare_rows), sentinel.narrow(0, ends.back(), c.spare_rows)))
      << "rows past the groups were written";
  // Through fp8_grouped_linear on the GPU: the same kernel.
  if (groups > 1 && c.stride == c.k) {
    const Fp8Activations on_gpu{a.q.to(gpu), a.factors.to(gpu).t().contiguous().t(), a.rows, a.dtype};
    const at::Tensor grouped = fp8_grouped_linear(on_gpu, gpu_w, gpu_ends);
    EXPECT_TRUE(at::equal(grouped.narrow(0, 0, ends.back()), got.narrow(0, 0, ends.back())));
  }
}

// The FP8 grouped GEMM kernel against the CPU emulation of the same e4m3 operands and factors
// (within bf16's rounding and the tensor cores' FP8 sums): empty groups, groups of 1, 64, 65,
// 128, 129 and 300 rows (tiles cut at each group's own first row), k of 1, 2, 3, 4 and 16
// k-blocks, n not a multiple of 128 (the last n-tile partial, reading the next group's rows),
// rows of x strided, 35B-A3B's expert shapes; one group without ends (up to 2304 rows, a partial
// last n-tile, more tiles than CTAs); rows past the last group's end left as they were; a second
// run bit for bit the same (and through fp8_grouped_linear); shapes it cannot take refused by
// name.
TEST(Fp8, GpuGroupedGemmMatchesTheEmulation) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  namespace gf = dflash::grouped_fp8;
  const at::Device gpu(at::kCUDA, 0);
  const Fp8Weight probe = quantize_blocks(at::ones({128, 128}));
  if (!fp8_grouped_gemm_applies(Fp8Weight{probe.data.unsqueeze(0).to(gpu), probe.scale.unsqueeze(0).to(gpu)}, gpu)) {
    EXPECT_NE(at::cuda::getDeviceProperties(0)->major * 10 + at::cuda::getDeviceProperties(0)->minor, 90)
        << "a Hopper GPU where the kernels were built for sm_90a must run them";
    GTEST_SKIP() << "the FP8 grouped GEMM runs on compute capability 9.0 (sm_90a builds) only";
  }
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(0).stream();
  for (const GroupedCase& c : {GroupedCase{{0, 1, 64, 65, 0, 128, 129, 300, 7, 0}, 256, 384, 9, 512},
                               GroupedCase{{1000}, 384, 2048, 0, 2048}, GroupedCase{{0, 0, 5}, 128, 128, 3, 128},
                               GroupedCase{{3, 0, 130}, 200, 256, 2, 256}, GroupedCase{{300}, 16480, 512, 0, 512},
                               GroupedCase{{2304}, 2112, 512, 5, 640},
                               GroupedCase{std::vector<int32_t>(64, 90), 1024, 2048, 16, 2048},
                               GroupedCase{std::vector<int32_t>(64, 90), 2048, 512, 16, 512}}) {
    check_grouped_case(c, gpu, stream);
  }
  EXPECT_LT(fp8_grouped_gemm_error(gpu), 1e-2) << "dflashd doctor's FP8 grouped self-test";
  gf::Problem bad;
  bad.x = bad.w = bad.y = probe.data.data_ptr();
  bad.m = 16, bad.n = 100, bad.k = 128, bad.x_stride = 128, bad.factor_stride = 16;
  EXPECT_FALSE(gf::applies(bad, 0)) << "rows of 100 bf16 are not whole 16-byte chunks";
  try {
    gf::run(bad, 0, stream);
    ADD_FAILURE() << "a shape the kernel cannot take ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("-> 100"), std::string::npos) << e.what();
  }
}

// A MoE block at Qwen3.5-35B-A3B's shapes with FP8 experts runs them on the grouped FP8 GEMM:
// the pairs' rows gathered and quantised by one kernel as by two; the block near the same block
// with the experts dequantized to bf16 (the activations' 1x128 e4m3 quantisation is the
// difference), deterministic.
TEST(Fp8, GpuMoeExpertsRunOnTheGroupedGemm) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  const at::Device gpu(at::kCUDA, 0);
  const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(gpu);
  at::manual_seed(70);
  const int64_t experts = 256, hidden = 2048, inner = 512;
  const MoeShape shape{experts, 8, inner, true, 512};
  const Fp8Weight gate_up = quantize_blocks(
      (at::randn({experts * 2 * inner, hidden}, bf16.dtype(at::kFloat)) / std::sqrt(2048.0)));
  const Fp8Weight down =
      quantize_blocks((at::randn({experts * hidden, inner}, bf16.dtype(at::kFloat)) / std::sqrt(512.0)));
  const Fp8Weight fp8_gate_up{gate_up.data.view({experts, 2 * inner, hidden}),
                              gate_up.scale.view({experts, 2 * inner / 128, hidden / 128})};
  const Fp8Weight fp8_down{down.data.view({experts, hidden, inner}),
                           down.scale.view({experts, hidden / 128, inner / 128})};
  auto make = [&](const at::Tensor& gu, const at::Tensor& d) {
    at::manual_seed(71);
    return MoeWeights::make(at::randn({experts, hidden}, bf16) * 0.02, gu, d, at::randn({512, hidden}, bf16) * 0.02,
                            at::randn({512, hidden}, bf16) * 0.02, at::randn({hidden, 512}, bf16) * 0.02,
                            at::randn({1, hidden}, bf16) * 0.02);
  };
  MoeWeights kept = make({}, {});
  kept.fp8_gate_up = fp8_gate_up, kept.fp8_down = fp8_down;
  const MoeWeights dequantized =
      make(dequantize_blocks(fp8_gate_up, at::kBFloat16), dequantize_blocks(fp8_down, at::kBFloat16));
  ASSERT_TRUE(fp8_experts_grouped(kept, gpu, at::kBFloat16));
  {  // The pairs' rows gathered and quantised by one kernel: the bytes of quantising the gathered rows.
    const at::Tensor x = at::randn({300, hidden}, bf16);
    const at::Tensor order = at::randperm(2400, bf16.dtype(at::kLong));
    const Fp8Activations gathered = quantize_gathered_groups(x, order, 8);
    const Fp8Activations separate = quantize_groups(x.index_select(0, at::div(order, 8, "floor")));
    EXPECT_TRUE(bytes_equal(gathered.q.cpu(), separate.q.cpu()));
    EXPECT_TRUE(at::equal(gathered.factors.cpu(), separate.factors.cpu()));
    EXPECT_EQ(gathered.factors.strides(), separate.factors.strides());
  }
  for (const int64_t tokens : {1, 100, 3072}) {
    const at::Tensor x = at::randn({tokens, hidden}, bf16);
    const at::Tensor got = moe_grouped(shape, kept, x), again = moe_grouped(shape, kept, x);
    const at::Tensor want = moe_grouped(shape, dequantized, x).to(at::kDouble);
    const double error = ((got.to(at::kDouble) - want).norm() / want.norm()).item<double>();
    std::printf("35B-A3B MoE block, %ld tokens: FP8 experts on the grouped GEMM vs dequantized bf16: %.4f\n",
                static_cast<long>(tokens), error);
    EXPECT_LT(error, 0.05) << tokens << " tokens";
    EXPECT_GT(error, 1e-4) << tokens << " tokens: the activations were not quantised";
    EXPECT_TRUE(at::equal(got, again)) << tokens << " tokens";
  }
}
#endif

// The RMSNorm, SiLU-mul and attention-gate kernels that quantise a GEMM's input as they write it
// give the bytes and factors of the bf16 kernel's rows quantised afterwards (the path they
// replace), padded rows included; widths of whole 256-column warps and of a half warp (640, 384)
// past the last.
TEST(Fp8, GpuFusedNormAndSiluQuantiseTheirBf16Rows) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  const at::Device gpu(at::kCUDA, 0);
  for (const int64_t rows : {1, 5, 16, 40, 300}) {
    for (const int64_t n : {384, 640, 5120}) {
      const std::string what = std::to_string(rows) + " x " + std::to_string(n);
      at::manual_seed(rows * 11 + n);
      const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(gpu);
      const at::Tensor x = at::randn({rows, n}, bf16) * 3, delta = at::randn({rows, n}, bf16);
      const at::Tensor weight = at::randn({n}, bf16) * 0.1;
      x.narrow(0, 0, 1).narrow(1, 128, 128).zero_(), delta.narrow(0, 0, 1).narrow(1, 128, 128).zero_();  // zero group
      const int64_t padded = fp8_gemm_rows(rows, gpu);
      for (const bool zero_centred : {false, true}) {
        for (const bool with_delta : {false, true}) {
          const auto [sum, normed] = with_delta ? add_rms_norm(x, delta, weight, 1e-6, zero_centred)
                                                : std::pair{x, rms_norm_rows(x, weight, 1e-6, zero_centred)};
          const Fp8Activations expected = quantize_groups(normed, padded);
          const auto [fused_sum, fused] = add_rms_norm_fp8(x, with_delta ? &delta : nullptr, weight, 1e-6, zero_centred);
          const std::string which = what + (with_delta ? " add" : "") + (zero_centred ? " zero-centred" : "");
          EXPECT_TRUE(at::equal(fused_sum, sum)) << which;
          EXPECT_EQ(fused.rows, rows) << which;
          EXPECT_TRUE(bytes_equal(fused.q.cpu(), expected.q.cpu())) << which;
          EXPECT_TRUE(at::equal(fused.factors.cpu(), expected.factors.cpu())) << which;
          EXPECT_EQ(fused.factors.strides(), expected.factors.strides()) << which;
        }
      }
      // gate and up: the two halves of one gate_up projection (a common row stride of 2n).
      const at::Tensor gate_up = at::randn({rows, 2 * n}, bf16) * 4;
      const at::Tensor gate = gate_up.narrow(1, 0, n), up = gate_up.narrow(1, n, n);
      const Fp8Activations expected = quantize_groups(silu_mul(gate, up), padded);
      const Fp8Activations fused = silu_mul_fp8(gate, up);
      EXPECT_TRUE(bytes_equal(fused.q.cpu(), expected.q.cpu())) << what << " silu_mul";
      EXPECT_TRUE(at::equal(fused.factors.cpu(), expected.factors.cpu())) << what << " silu_mul";
    }
    // Gated attention's output gate before o_proj: gate a strided view ([query | gate] per head),
    // heads of 256 (Qwen3.5) and of 128 over a row that ends past a 256-thread block.
    for (const auto& [heads, d] : {std::pair<int64_t, int64_t>{24, 256}, {5, 128}}) {
      const std::string what = std::to_string(rows) + " x " + std::to_string(heads) + " heads of " + std::to_string(d);
      const auto bf16 = at::TensorOptions().dtype(at::kBFloat16).device(gpu);
      const at::Tensor out = at::randn({rows, heads * d}, bf16) * 2;
      const at::Tensor both = at::randn({rows, heads, 2 * d}, bf16) * 3;
      out.narrow(0, 0, 1).narrow(1, 0, 128).zero_();  // a zero group: factor 1
      const at::Tensor before = out.clone();
      const Fp8Activations expected =
          quantize_groups(sigmoid_gate(out.clone(), both.narrow(-1, d, d)), fp8_gemm_rows(rows, gpu));
      const Fp8Activations fused = sigmoid_gate_fp8(out, both.narrow(-1, d, d));
      EXPECT_TRUE(at::equal(out, before)) << what << ": sigmoid_gate_fp8 wrote its input";
      EXPECT_EQ(fused.rows, rows) << what;
      EXPECT_TRUE(bytes_equal(fused.q.cpu(), expected.q.cpu())) << what << " sigmoid_gate";
      EXPECT_TRUE(at::equal(fused.factors.cpu(), expected.factors.cpu())) << what << " sigmoid_gate";
    }
  }
}

TEST(Fp8, GpuTargetMatchesItsCpuEmulation) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  if (const auto why = fp8_gemm_unavailable(at::Device(at::kCUDA, 0))) GTEST_SKIP() << *why;
  const ModelConfig c = fp8_friendly_config();
  TargetOptions cpu_options{at::kCPU, at::kBFloat16}, gpu_options{at::Device(at::kCUDA, 0), at::kBFloat16, true};
  cpu_options.fp8_weights = gpu_options.fp8_weights = true;
  gpu_options.gdn_path = TargetOptions::GdnPath::reference;  // the same GatedDeltaNet path as the CPU's
  CpuDrawnWeights cpu_weights(15), gpu_weights(15);
  auto cpu = std::make_unique<TargetModel>(c, cpu_weights, 3, cpu_options);
  auto gpu = std::make_unique<TargetModel>(c, gpu_weights, 3, gpu_options);
  EXPECT_EQ(gpu->kernel_paths().at("target.projections").path, "fp8");
  at::manual_seed(16);
  const at::Tensor ids = at::randint(0, 512, {70}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor a = cpu->forward(ids, {0, 30, 70}, {3})[0].to(at::kDouble);
  const at::Tensor b = gpu->forward(ids, {0, 30, 70}, {3})[0].cpu().to(at::kDouble);
  // The GEMM itself matches the emulation to bf16's rounding (GpuQuantisationAndGemmMatchTheEmulation);
  // over 4 layers, rounding flips in FP8 (see below) grow that: 0.097 of the largest value measured.
  const double error = ((a - b).norm() / a.norm()).item<double>();
  std::printf("GPU FP8 target vs its CPU emulation at layer 3: %.4f (Frobenius)\n", error);
  EXPECT_LT(error, 0.1);
}

#ifdef DFLASHD_WITH_CUDA
// A whole MoE target kept FP8 on a Hopper GPU (tiny-qwen3_next, every layer MoE, experts of 128)
// runs its experts on the FP8 grouped GEMM, says so in its kernel paths, and stays near the same
// target with its experts dequantized per layer (the activations' quantisation the difference,
// grown over 4 layers of random weights: 0.128 on the H200).
TEST(Fp8, GpuMoeTargetRunsItsExpertsOnTheGroupedGemm) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
  if (const auto why = fp8_gemm_unavailable(at::Device(at::kCUDA, 0))) GTEST_SKIP() << *why;
  const ModelConfig c = fp8_friendly_config("tiny-qwen3_next");
  TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, true};
  options.fp8_weights = true;
  options.gdn_path = TargetOptions::GdnPath::reference;  // heads of 64: the reference path
  CpuDrawnWeights weights(25);
  auto model = std::make_unique<TargetModel>(c, weights, 3, options);
  const std::string moe = model->kernel_paths().at("target.moe").detail;
  if (moe.find(kFp8GroupedPath) == std::string::npos) {
    EXPECT_NE(at::cuda::getDeviceProperties(0)->major * 10 + at::cuda::getDeviceProperties(0)->minor, 90) << moe;
    GTEST_SKIP() << "the FP8 grouped GEMM runs on compute capability 9.0 (sm_90a builds) only: " << moe;
  }
  at::manual_seed(26);
  const at::Tensor ids = at::randint(0, 512, {70}, at::TensorOptions().dtype(at::kLong));
  const at::Tensor grouped = model->forward(ids, {0, 30, 70}, {3})[0].cpu().to(at::kDouble);
  dflash::grouped_fp8::off = true;
  const at::Tensor dequantized = model->forward(ids, {0, 30, 70}, {3})[0].cpu().to(at::kDouble);
  dflash::grouped_fp8::off = false;
  const double error = ((grouped - dequantized).norm() / dequantized.norm()).item<double>();
  std::printf("tiny FP8 MoE target at layer 3, experts on the grouped GEMM vs dequantized: %.4f (Frobenius)\n", error);
  EXPECT_TRUE(at::isfinite(grouped).all().item<bool>());
  EXPECT_GT(error, 1e-4) << "the experts' activations were not quantised";
  EXPECT_LT(error, 0.25);
}
#endif

// The tapped states of an FP8 checkpoint saved by transformers (FineGrainedFP8, 128x128 blocks)
// against transformers' FP8 forward of it (tests/reference/make_fp8_reference.py, run on the GPU
// host; DFLASHD_FP8_REFERENCE_DIR names its output; its block-scaled matmul, a hub kernel that
// cannot be downloaded there, is emulated in PyTorch with the same arithmetic).
// FP8 quantisation is a step function (a step of 1/16 of the value): two implementations whose
// bf16 activations differ in the last bit round some elements to the neighbouring e4m3 value,
// and a random model amplifies that layer after layer. So the same checkpoint in bf16 is the
// yardstick: ours in bf16 against transformers in bf16 (<= 2 %, our bf16 parity), then the
// stated tolerance for FP8, per layer, as Frobenius error over the reference's norm: <= 15 %, and
// below 0.6 x the distance between transformers' own FP8 and bf16 forwards (measured on the
// H200: 0.055 / 0.080 / 0.097 / 0.110 against 0.126 / 0.162 / 0.189 / 0.211 for layers 0-3).
TEST(Fp8, GpuTappedStatesMatchTransformersFp8) {
  const char* dir = std::getenv("DFLASHD_FP8_REFERENCE_DIR");
  if (!at::hasCUDA() || dir == nullptr) GTEST_SKIP() << "needs a GPU and DFLASHD_FP8_REFERENCE_DIR";
  if (const auto why = fp8_gemm_unavailable(at::Device(at::kCUDA, 0))) GTEST_SKIP() << *why;
  const std::string model_dir = std::string(dir) + "/qwen3_fp8";
  auto reference = SafetensorsFile::open(std::string(dir) + "/qwen3_fp8_reference.safetensors");
  auto bf16_reference = SafetensorsFile::open(std::string(dir) + "/qwen3_bf16_reference.safetensors");
  TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16};
  options.fp8_weights = true;
  auto model = load_target(model_dir, 3, options);
  EXPECT_EQ(model->kernel_paths().at("target.projections").path, "fp8");
  auto read = [](const SafetensorsFile& f, const std::string& name) {
    const TensorEntry& e = f.get(name);
    const at::ScalarType type = e.dtype == DType::I64 ? at::kLong : at::kFloat;
    return at::from_blob(const_cast<std::byte*>(e.data), e.shape, at::TensorOptions().dtype(type)).clone();
  };
  std::vector<at::Tensor> ids;
  std::vector<int64_t> cu_seqlens{0};
  for (int s = 0; s < 3; ++s) {
    ids.push_back(read(*reference, "seq." + std::to_string(s) + ".input_ids"));
    cu_seqlens.push_back(cu_seqlens.back() + ids.back().size(0));
  }
  const std::vector<at::Tensor> ours = model->forward(at::cat(ids), cu_seqlens, {0, 1, 2, 3});
  auto bf16_model = load_target(std::string(dir) + "/qwen3_bf16", 3, TargetOptions{at::Device(at::kCUDA, 0), at::kBFloat16});
  const std::vector<at::Tensor> ours_bf16 = bf16_model->forward(at::cat(ids), cu_seqlens, {0, 1, 2, 3});
  for (int layer = 0; layer < 4; ++layer) {
    std::vector<at::Tensor> fp8_parts, bf16_parts;
    for (int s = 0; s < 3; ++s) {
      const std::string name = "seq." + std::to_string(s) + ".layer." + std::to_string(layer);
      fp8_parts.push_back(read(*reference, name));
      bf16_parts.push_back(read(*bf16_reference, name));
    }
    const at::Tensor expected = at::cat(fp8_parts).to(at::kDouble), bf16 = at::cat(bf16_parts).to(at::kDouble);
    const at::Tensor got = ours[layer].cpu().to(at::kDouble);
    const double error = ((got - expected).norm() / expected.norm()).item<double>();
    const double fp8_from_bf16 = ((bf16 - expected).norm() / expected.norm()).item<double>();
    const double bf16_error = ((ours_bf16[layer].cpu().to(at::kDouble) - bf16).norm() / bf16.norm()).item<double>();
    std::printf("layer %d: FP8 ours vs transformers %.5f; bf16 ours vs transformers %.5f; transformers FP8 vs bf16 %.5f\n",
                layer, error, bf16_error, fp8_from_bf16);
    EXPECT_LE(bf16_error, 0.02) << "layer " << layer;
    EXPECT_LE(error, 0.15) << "layer " << layer;
    EXPECT_LT(error, 0.6 * fp8_from_bf16) << "layer " << layer;
  }
}

}  // namespace
}  // namespace dflash::target
