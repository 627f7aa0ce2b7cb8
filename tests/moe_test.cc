// The MoE block (target/moe.h): the grouped path (device routing, grouped GEMMs) against the
// reference host loop, on the CPU in fp32 (ATen's _grouped_mm has a CPU implementation) and on a
// GPU in bf16 against the fp32 reference; whole MoE targets on either path; the refusal of the
// reference path on a GPU. Routing edge cases: experts that get no token, every token on one
// expert, a single token.
#include <gtest/gtest.h>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <fstream>
#include <map>
#include <regex>

#include "common/safetensors.h"
#include "target/model.h"
#include "target/moe.h"
#include "tests/test_util.h"

namespace dflash::target {
namespace {

// A block's weights as the checkpoints hold them; weights() concatenates them as the model does.
struct MoeCase {
  MoeShape shape;
  at::Tensor router, gate_up, down, shared_gate, shared_up, shared_down, shared_expert_gate;
  MoeWeights weights(at::TensorOptions o) const {
    auto c = [&](const at::Tensor& t) { return t.defined() ? t.to(o) : t; };
    return MoeWeights::make(c(router), c(gate_up), c(down), c(shared_gate), c(shared_up), c(shared_down),
                            c(shared_expert_gate));
  }
};

MoeCase random_moe(int64_t experts, int64_t top_k, int64_t hidden, int64_t inner, int64_t shared, at::TensorOptions o) {
  MoeCase m;
  m.shape = {experts, top_k, inner, true, shared};
  m.router = at::randn({experts, hidden}, o) * 0.5;
  m.gate_up = at::randn({experts, 2 * inner, hidden}, o) * 0.1;
  m.down = at::randn({experts, hidden, inner}, o) * 0.1;
  if (shared > 0) {
    m.shared_gate = at::randn({shared, hidden}, o) * 0.1;
    m.shared_up = at::randn({shared, hidden}, o) * 0.1;
    m.shared_down = at::randn({hidden, shared}, o) * 0.1;
    m.shared_expert_gate = at::randn({1, hidden}, o) * 0.1;
  }
  return m;
}

// Inputs whose first feature is 1 and a router that sends every token's first choice to
// `expert` (the other choices stay spread).
void route_everything_to(MoeCase& m, at::Tensor& x, int64_t expert) {
  x.select(1, 0).fill_(1.0);
  m.router.select(1, 0).fill_(-20.0);
  m.router.select(1, 0)[expert].fill_(20.0);
}

double relative_error(const at::Tensor& out, const at::Tensor& ref) {
  return ((out.to(at::kDouble).cpu() - ref.to(at::kDouble).cpu()).norm() / ref.to(at::kDouble).cpu().norm()).item<double>();
}

TEST(Moe, GroupedMatchesTheReferenceOnTheCpu) {
  c10::InferenceMode inference;
  at::manual_seed(5);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  for (const int64_t top_k : {1, 2, 3}) {
    for (const int64_t tokens : {1, 3, 50, 200}) {
      for (const bool one_expert : {false, true}) {
        MoeCase m = random_moe(8, top_k, 32, 16, top_k == 2 ? 0 : 24, f32);
        at::Tensor x = at::randn({tokens, 32}, f32);
        if (one_expert) route_everything_to(m, x, 5);
        const MoeWeights w = m.weights(f32);
        const at::Tensor grouped = moe_grouped(m.shape, w, x);
        const at::Tensor reference = moe_reference(m.shape, w, x);
        ASSERT_EQ(grouped.sizes(), x.sizes());
        EXPECT_LE(relative_error(grouped, reference), 1e-6)
            << "top_k " << top_k << ", " << tokens << " tokens" << (one_expert ? ", all on expert 5" : "");
      }
    }
  }
}

TEST(Moe, GroupedIsDeterministic) {
  c10::InferenceMode inference;
  at::manual_seed(6);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  MoeCase m = random_moe(16, 4, 32, 16, 8, f32);
  const at::Tensor x = at::randn({300, 32}, f32);
  const MoeWeights w = m.weights(f32);
  EXPECT_TRUE(at::equal(moe_grouped(m.shape, w, x), moe_grouped(m.shape, w, x)));
}

// A whole MoE target (tiny qwen3_next: MoE layers, a dense layer, shared expert) on each path.
TEST(Moe, WholeTargetGroupedMatchesTheReferenceOnTheCpu) {
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_next"), "tiny");
  TargetOptions grouped_options, reference_options;
  grouped_options.moe_path = TargetOptions::MoePath::grouped;
  reference_options.moe_path = TargetOptions::MoePath::reference;
  auto grouped = random_target(config, config.num_layers - 1, grouped_options, 3);
  auto reference = random_target(config, config.num_layers - 1, reference_options, 3);
  EXPECT_EQ(grouped->kernel_paths().at("target.moe").path, "grouped");
  EXPECT_EQ(reference->kernel_paths().at("target.moe").path, "reference");
  const at::Tensor ids = at::randint(0, config.vocab_size, {37}, at::TensorOptions().dtype(at::kLong));
  const std::vector<int64_t> layers{1, config.num_layers - 1};
  const auto a = grouped->forward(ids, {0, 20, 37}, layers);
  const auto b = reference->forward(ids, {0, 20, 37}, layers);
  for (size_t i = 0; i < layers.size(); ++i) EXPECT_LE(relative_error(a[i], b[i]), 1e-5) << "layer " << layers[i];
}

// On the GPU at Qwen3.5-35B-A3B's expert shapes (256 experts top-8, inner 512, shared 512,
// hidden 2048). Routing is a discrete choice: the two paths must be compared on the same
// routing, i.e. in the same dtype. fp32: the grouped path (ATen's fallback grouped GEMM there)
// equals the reference loop to rounding; bf16: the grouped GEMM kernel against the reference
// loop in bf16 (bf16 roundings in different places, fp32 accumulation in both).
TEST(Moe, GpuGroupedMatchesTheReferenceWithTheSameRouting) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  c10::InferenceMode inference;
  at::manual_seed(7);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(at::kCUDA);
  const auto bf16 = f32.dtype(at::kBFloat16);
  for (const int64_t tokens : {1, 7, 64, 512, 3072}) {
    for (const bool one_expert : {false, true}) {
      MoeCase m = random_moe(256, 8, 2048, 512, 512, f32);
      at::Tensor x = at::randn({tokens, 2048}, f32);
      if (one_expert) route_everything_to(m, x, 17);
      const std::string what = std::to_string(tokens) + " tokens" + (one_expert ? ", first choices on one expert" : "");
      const MoeWeights w32 = m.weights(f32);
      EXPECT_LE(relative_error(moe_grouped(m.shape, w32, x), moe_reference(m.shape, w32, x)), 1e-5) << "fp32, " << what;
      const MoeWeights w16 = m.weights(bf16);
      const at::Tensor x16 = x.to(at::kBFloat16);
      const at::Tensor out = moe_grouped(m.shape, w16, x16);
      EXPECT_EQ(out.scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::isfinite(out).all().item<bool>());
      EXPECT_LE(relative_error(out, moe_reference(m.shape, w16, x16)), 1e-2) << "bf16, " << what;
    }
  }
  // k = 1 and every token on one expert: one group holds every row, 255 are empty.
  MoeCase m = random_moe(256, 1, 2048, 512, 0, f32);
  at::Tensor x = at::randn({1000, 2048}, f32) * 0.01;
  route_everything_to(m, x, 200);
  const MoeWeights w16 = m.weights(bf16);
  const at::Tensor x16 = x.to(at::kBFloat16);
  EXPECT_LE(relative_error(moe_grouped(m.shape, w16, x16), moe_reference(m.shape, w16, x16)), 1e-2);
}

// Both checkpoint layouts of the experts load into the grouped layout: the released
// checkpoints' one module per expert (what transformers writes: the reference model), and
// transformers 5's fused experts.gate_up_proj [E, 2I, H] / experts.down_proj [E, H, I], written
// here from the same tensors. The two targets' tapped states are identical.
TEST(Moe, PerExpertAndFusedCheckpointLayoutsLoadTheSameModel) {
  const std::string source = std::string(DFLASHD_TARGET_REFERENCE_DIR) + "/qwen3_5_moe";
  const auto file = SafetensorsFile::open(source + "/model.safetensors");
  std::map<std::string, at::Tensor> tensors;
  for (const TensorEntry& e : file->tensors()) {
    ASSERT_EQ(e.dtype, DType::F32) << e.name;
    tensors[e.name] = at::from_blob(const_cast<std::byte*>(e.data), e.shape, at::TensorOptions().dtype(at::kFloat)).clone();
  }
  // layers.L.mlp.experts.X.{gate,up,down}_proj.weight -> layers.L.mlp.experts.{gate_up_proj,down_proj}
  const std::regex per_expert(R"((.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight)");
  std::map<std::string, std::map<int64_t, std::map<std::string, at::Tensor>>> experts;
  std::map<std::string, at::Tensor> fused;
  for (const auto& [name, t] : tensors) {
    std::smatch m;
    if (std::regex_match(name, m, per_expert)) experts[m[1]][std::stoll(m[2])][m[3]] = t;
    else fused[name] = t;
  }
  ASSERT_FALSE(experts.empty()) << "the reference checkpoint has per-expert tensors";
  for (const auto& [prefix, by_expert] : experts) {
    std::vector<at::Tensor> gate_up, down;
    for (const auto& [x, parts] : by_expert) {
      gate_up.push_back(at::cat({parts.at("gate"), parts.at("up")}, 0));
      down.push_back(parts.at("down"));
    }
    fused[prefix + ".gate_up_proj"] = at::stack(gate_up).contiguous();
    fused[prefix + ".down_proj"] = at::stack(down).contiguous();
  }
  const std::string dir = test::make_temp_dir("moe-fused-layout");
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : fused) {
    out.push_back({name, DType::F32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel() * 4)});
  }
  write_safetensors(dir + "/model.safetensors", out);
  std::ofstream(dir + "/config.json") << test::read_file(source + "/config.json");

  const ModelConfig config = load_model_config(source);
  const int64_t last = config.num_layers - 1;
  auto a = load_target(source, last, TargetOptions{});
  auto b = load_target(dir, last, TargetOptions{});
  const at::Tensor ids = at::randint(0, config.vocab_size, {29}, at::TensorOptions().dtype(at::kLong));
  EXPECT_TRUE(at::equal(a->forward(ids, {0, 29}, {last})[0], b->forward(ids, {0, 29}, {last})[0]));
}

// The fused router kernel against ATen's softmax / top-k / renormalisation on the same bf16
// logits: the same experts (up to ties of equal probability) and the same weights.
TEST(Moe, GpuRouteKernelMatchesTheAtenOps) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  c10::InferenceMode inference;
  at::manual_seed(8);
  for (const auto& [experts, top_k] : {std::pair<int64_t, int64_t>{256, 8}, {512, 10}, {64, 1}, {37, 4}}) {
    const at::Tensor logits = (at::randn({3000, experts + 8}, at::TensorOptions().device(at::kCUDA)) * 3)
                                  .to(at::kBFloat16)
                                  .narrow(1, 0, experts);  // a column slice with a row stride, as in the model
    const MoeShape shape{experts, top_k, 16, true, 0};
    const MoeRouting fused = moe_route(shape, logits);
    auto [p, ids] = at::topk(at::softmax(logits.to(at::kFloat), -1), top_k, -1);
    const at::Tensor weights = p / p.sum(-1, true);
    // bf16 logits tie often: the ids may differ where probabilities are equal (the order of equal
    // values is the kernel's: the lower id first), so compare the probabilities chosen.
    const at::Tensor chosen = at::softmax(logits.to(at::kFloat), -1).gather(1, fused.experts);
    EXPECT_LE((chosen - p).abs().max().item<double>(), 1e-6) << experts << " experts: the chosen probabilities";
    EXPECT_LE((fused.weights - weights).abs().max().item<double>(), 1e-5) << experts << " experts";
    // Distinct logits (each row a permutation of values exact in bf16): the same ids, in order.
    const at::Tensor distinct =
        (at::argsort(at::rand({3000, experts}, at::TensorOptions().device(at::kCUDA)), /*stable=*/false, /*dim=*/1).to(at::kFloat) *
             (8.0 / static_cast<double>(experts)) - 4.0)
            .to(at::kBFloat16);
    auto [q, exact_ids] = at::topk(at::softmax(distinct.to(at::kFloat), -1), top_k, -1);
    EXPECT_TRUE(at::equal(moe_route(shape, distinct).experts, exact_ids)) << experts << " experts, distinct logits";
  }
}

// bf16 on the GPU (the grouped GEMM kernel), the reference path in fp32 on the same weights.
TEST(Moe, GpuWholeTargetMatchesTheReferencePath) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_next"), "tiny");
  TargetOptions grouped_options{at::Device(at::kCUDA, 0), at::kBFloat16, /*allow_slow_path=*/true};
  TargetOptions reference_options = grouped_options;
  reference_options.dtype = at::kFloat;
  reference_options.moe_path = TargetOptions::MoePath::reference;
  auto grouped = random_target(config, config.num_layers - 1, grouped_options, 4);
  auto reference = random_target(config, config.num_layers - 1, reference_options, 4);
  EXPECT_EQ(grouped->kernel_paths().at("target.moe").path, "grouped");
  const at::Tensor ids = at::randint(0, config.vocab_size, {300}, at::TensorOptions().dtype(at::kLong));
  const auto a = grouped->forward(ids, {0, 100, 300}, {config.num_layers - 1});
  const auto b = reference->forward(ids, {0, 100, 300}, {config.num_layers - 1});
  EXPECT_LE(relative_error(a[0], b[0]), 2e-2);
}

TEST(Moe, GpuReferencePathIsRefusedUnlessAllowed) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device: the refusal applies to GPUs only";
  const ModelConfig config = parse_model_config(preset_config_json("tiny-qwen3_next"), "tiny");
  TargetOptions options{at::Device(at::kCUDA, 0), at::kFloat, false};
  options.gdn_path = TargetOptions::GdnPath::automatic;
  options.moe_path = TargetOptions::MoePath::reference;
  options.allow_slow_path = false;
  try {
    random_target(config, config.num_layers - 1, options, 1);
    FAIL() << "expected SlowPathRefused";
  } catch (const SlowPathRefused& e) {
    EXPECT_NE(std::string(e.what()).find("(MoE) on cuda:0 would run a slow path"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("target.allow_slow_path"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace dflash::target
