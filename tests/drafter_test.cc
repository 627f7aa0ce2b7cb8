// Drafter tests: parity of loss and gradients with SpecForge's published DFlash training step,
// the split block attention against the dense-mask reference, each invariant of docs/recipe.md
// section 4, thread safety, optimizer, checkpoints and the exported serving format.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sys/stat.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/function.h>

#include <atomic>
#include <cstdlib>
#include <fstream>
#include <set>
#include <thread>
#include <tuple>

#include "common/kernel_variants.h"
#include "common/safetensors.h"
#include "common/tensor_math.h"
#include "drafter/block_attention.h"
#include "drafter/checkpoint.h"
#ifdef DFLASHD_WITH_CUDA
#include "drafter/kernels/layer_ops.h"
#endif
#include "drafter/layer_ops.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"
#include "tests/test_util.h"

namespace dflash::drafter {
namespace {

const std::string kReferenceDir = DFLASHD_DRAFTER_REFERENCE_DIR;
const std::string kPython = DFLASHD_PYTHON_EXECUTABLE;
const std::string kScript = DFLASHD_SPECFORGE_SCRIPT;

at::Tensor load(const SafetensorsFile& f, const std::string& name) {
  const TensorEntry& e = f.get(name);
  const at::ScalarType type = e.dtype == DType::I64 ? at::kLong : at::kFloat;
  return at::from_blob(const_cast<std::byte*>(e.data), e.shape, at::TensorOptions().dtype(type)).clone();
}

double relative_error(const at::Tensor& ours, const at::Tensor& reference) {
  EXPECT_EQ(ours.sizes(), reference.sizes());
  const double scale = std::max(reference.abs().max().item<double>(), 1e-30);
  return (ours.to(at::kDouble) - reference.to(at::kDouble)).abs().max().item<double>() / scale;
}

DrafterShape tiny_shape() {
  DrafterShape s;
  s.hidden_size = 48;
  s.num_layers = 2;
  s.num_attention_heads = 4;
  s.num_key_value_heads = 2;
  s.head_dim = 16;
  s.intermediate_size = 80;
  s.vocab_size = 320;
  s.rms_norm_eps = 1e-6;
  s.rope_theta = 1e6;
  s.block_size = 4;
  s.mask_token_id = 7;
  s.target_layer_ids = {1, 3, 5};
  s.num_target_layers = 8;
  return s;
}

struct Reference {
  std::shared_ptr<SafetensorsFile> file;
  DrafterBatch batch;
  at::Tensor embed, lm_head;
};

Reference load_reference(const std::string& name = "specforge_step") {
  Reference r;
  r.file = SafetensorsFile::open(kReferenceDir + "/" + name + ".safetensors");
  const at::Tensor ids = load(*r.file, "input_ids"), mask = load(*r.file, "loss_mask");
  const at::Tensor features = load(*r.file, "features"), anchors = load(*r.file, "anchors");
  const at::Tensor keep = load(*r.file, "keep"), lengths = load(*r.file, "lengths");
  std::vector<at::Tensor> ids_parts, mask_parts, feature_parts;
  r.batch.cu_seqlens = {0};
  for (int64_t s = 0; s < ids.size(0); ++s) {
    const int64_t length = lengths[s].item<int64_t>();
    ids_parts.push_back(ids[s].narrow(0, 0, length));
    mask_parts.push_back(mask[s].narrow(0, 0, length));
    feature_parts.push_back(features[s].narrow(0, 0, length));
    r.batch.cu_seqlens.push_back(r.batch.cu_seqlens.back() + length);
    r.batch.anchors.push_back(anchors[s].masked_select(keep[s].to(at::kBool)).contiguous());
  }
  r.batch.input_ids = at::cat(ids_parts);
  r.batch.loss_mask = at::cat(mask_parts).to(at::kByte);
  r.batch.features = at::cat(feature_parts);
  r.embed = load(*r.file, "target.embed");
  r.lm_head = load(*r.file, "target.lm_head");
  return r;
}

Drafter reference_drafter(const Reference& r, const DrafterShape& shape = tiny_shape()) {
  Drafter drafter(shape, at::TensorOptions().dtype(at::kFloat));
  std::vector<std::pair<std::string, at::Tensor>> tensors;
  for (const auto& [name, p] : drafter.parameters()) tensors.emplace_back(name, load(*r.file, "param." + name));
  drafter.load_tensors(tensors, "reference");
  return drafter;
}

at::Tensor step_loss(const Drafter& drafter, const Reference& r, LossStats* stats, int64_t group_blocks = 64) {
  const BlockTargets targets = make_block_targets(r.batch, 4, 7.0, at::kCPU);
  const at::Tensor hidden = drafter.forward(r.batch, r.embed, group_blocks);
  return dflash_loss(hidden, r.lm_head, targets, targets.weight_sum, /*chunk_rows=*/12, 4, stats);
}

TEST(DrafterParity, LossAndGradientsMatchSpecForge) {
  const Reference r = load_reference();
  for (int64_t group_blocks : {64, 2}) {  // one group per sequence, and several
    Drafter drafter = reference_drafter(r);
    LossStats stats;
    const at::Tensor loss = step_loss(drafter, r, &stats, group_blocks);
    loss.backward();
    EXPECT_LE(relative_error(loss.reshape({1}), load(*r.file, "loss")), 1e-5) << loss.item<double>();
    int64_t correct = 0, count = 0;
    for (size_t k = 0; k < stats.correct.size(); ++k) correct += stats.correct[k], count += stats.count[k];
    EXPECT_NEAR(static_cast<double>(correct) / count, load(*r.file, "accuracy").item<double>(), 1e-12);
    for (const auto& [name, p] : drafter.parameters()) {
      ASSERT_TRUE(p.grad().defined()) << name;
      EXPECT_LE(relative_error(p.grad(), load(*r.file, "grad." + name)), 1e-5) << name << " groups " << group_blocks;
    }
  }
}

// The same against SpecForge with layer 0 a sliding_attention layer (window 6): its sliding
// DFlash mask (the window on the context, causal within the block).
TEST(DrafterParity, SlidingWindowLossAndGradientsMatchSpecForge) {
  const Reference r = load_reference("specforge_step_sliding");
  DrafterShape shape = tiny_shape();
  shape.layer_types = {"sliding_attention", "full_attention"};
  shape.sliding_window = 6;
  for (int64_t group_blocks : {64, 2}) {
    Drafter drafter = reference_drafter(r, shape);
    LossStats stats;
    const at::Tensor loss = step_loss(drafter, r, &stats, group_blocks);
    loss.backward();
    EXPECT_LE(relative_error(loss.reshape({1}), load(*r.file, "loss")), 1e-5) << loss.item<double>();
    for (const auto& [name, p] : drafter.parameters()) {
      EXPECT_LE(relative_error(p.grad(), load(*r.file, "grad." + name)), 1e-5) << name << " groups " << group_blocks;
    }
  }
  // And the full-attention reference differs from it: the window changed what was computed.
  const Reference full = load_reference();
  EXPECT_GT(relative_error(load(*r.file, "loss"), load(*full.file, "loss")), 1e-4);
}

// The nodes of t's autograd graph whose name contains `name`.
int64_t graph_nodes_named(const at::Tensor& t, const std::string& name) {
  std::vector<torch::autograd::Node*> todo{t.grad_fn().get()};
  std::set<torch::autograd::Node*> seen;
  int64_t found = 0;
  while (!todo.empty()) {
    torch::autograd::Node* node = todo.back();
    todo.pop_back();
    if (node == nullptr || !seen.insert(node).second) continue;
    if (node->name().find(name) != std::string::npos) ++found;
    for (const torch::autograd::Edge& e : node->next_edges()) todo.push_back(e.function.get());
  }
  return found;
}

// Activation checkpointing (train.activation_checkpointing): every layer run again in backward
// gives the loss and gradients of the plain forward, full and sliding-window layers (whose window
// the recomputed layer must keep), one attention group per sequence and several; and they still
// match SpecForge's.
TEST(DrafterParity, ActivationCheckpointingGivesTheSameLossAndGradients) {
  for (const char* name : {"specforge_step", "specforge_step_sliding"}) {
    const Reference r = load_reference(name);
    DrafterShape shape = tiny_shape();
    if (std::string(name) == "specforge_step_sliding") {
      shape.layer_types = {"sliding_attention", "full_attention"};
      shape.sliding_window = 6;
    }
    for (int64_t group_blocks : {64, 2}) {
      SCOPED_TRACE(std::string(name) + ", groups of " + std::to_string(group_blocks) + " blocks");
      Drafter plain = reference_drafter(r, shape), checkpointed = reference_drafter(r, shape);
      checkpointed.set_activation_checkpointing(true);
      // The checkpointed forward's graph holds one checkpoint node per layer and not the layers'
      // own operations; the plain one none.
      EXPECT_EQ(graph_nodes_named(checkpointed.forward(r.batch, r.embed, group_blocks), "CheckpointedLayer"),
                shape.num_layers);
      EXPECT_EQ(graph_nodes_named(plain.forward(r.batch, r.embed, group_blocks), "CheckpointedLayer"), 0);
      LossStats a, b;
      const at::Tensor loss_plain = step_loss(plain, r, &a, group_blocks);
      const at::Tensor loss_checkpointed = step_loss(checkpointed, r, &b, group_blocks);
      EXPECT_TRUE(at::equal(loss_plain, loss_checkpointed));
      loss_plain.backward();
      loss_checkpointed.backward();
      for (size_t i = 0; i < plain.parameters().size(); ++i) {
        const auto& [param, p] = plain.parameters()[i];
        const at::Tensor& g = checkpointed.parameters()[i].second.grad();
        ASSERT_TRUE(g.defined()) << param;
        EXPECT_LE(relative_error(g, p.grad()), 1e-6) << param;
        EXPECT_LE(relative_error(g, load(*r.file, "grad." + param)), 1e-5) << param;
      }
    }
  }
}

// ---- Block attention -----------------------------------------------------------------------

struct AttentionInputs {
  at::Tensor q, kc, vc, kb, vb, anchors;
};

AttentionInputs random_attention(int64_t context, std::vector<int64_t> anchors, int64_t block, int64_t hq, int64_t hkv,
                                 int64_t d) {
  const int64_t rows = static_cast<int64_t>(anchors.size()) * block;
  const auto o = at::TensorOptions().dtype(at::kDouble);
  return {at::randn({rows, hq, d}, o).requires_grad_(),     at::randn({context, hkv, d}, o).requires_grad_(),
          at::randn({context, hkv, d}, o).requires_grad_(), at::randn({rows, hkv, d}, o).requires_grad_(),
          at::randn({rows, hkv, d}, o).requires_grad_(),    at::tensor(anchors, at::TensorOptions().dtype(at::kLong))};
}

TEST(BlockAttention, SplitPathEqualsDenseMaskForwardAndBackward) {
  at::manual_seed(3);
  // Anchor 0 (no context), repeated anchors (overlapping blocks), GQA 6/2, odd head dim.
  const std::vector<int64_t> anchors{0, 3, 3, 7, 20, 21, 29, 44, 45};
  for (int64_t group_blocks : {1, 2, 4, 64}) {
    AttentionInputs in = random_attention(46, anchors, 5, 6, 2, 12);
    const at::Tensor dout =
        at::randn({static_cast<int64_t>(anchors.size()) * 5, 6, 12}, at::TensorOptions().dtype(at::kDouble));
    const at::Tensor ours = block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, {5, group_blocks, 0});
    const auto ours_grads = torch::autograd::grad({ours}, {in.q, in.kc, in.vc, in.kb, in.vb}, {dout});
    const at::Tensor reference = block_attention_dense_reference(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, 5);
    const auto reference_grads = torch::autograd::grad({reference}, {in.q, in.kc, in.vc, in.kb, in.vb}, {dout});
    // The split path computes in fp32 internally.
    EXPECT_LE(relative_error(ours, reference), 1e-5) << "groups of " << group_blocks;
    for (size_t i = 0; i < ours_grads.size(); ++i) {
      EXPECT_LE(relative_error(ours_grads[i], reference_grads[i]), 1e-5)
          << "grad " << i << " groups of " << group_blocks;
    }
  }
}

// Sliding-window layers: the split path (context inside the group's windows only, causal within
// the block) against the dense mask with the window, forward and backward; windows shorter and
// longer than the context, equal to the block.
TEST(BlockAttention, SlidingWindowSplitPathEqualsDenseMaskForwardAndBackward) {
  at::manual_seed(5);
  const std::vector<int64_t> anchors{0, 3, 3, 7, 20, 21, 29, 44, 45};
  for (int64_t window : {5, 9, 30, 100}) {
    for (int64_t group_blocks : {1, 3, 64}) {
      AttentionInputs in = random_attention(46, anchors, 5, 6, 2, 12);
      const at::Tensor dout =
          at::randn({static_cast<int64_t>(anchors.size()) * 5, 6, 12}, at::TensorOptions().dtype(at::kDouble));
      BlockAttentionShape shape{5, group_blocks, 0};
      shape.sliding_window = window;
      const at::Tensor ours = block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, shape);
      const auto ours_grads = torch::autograd::grad({ours}, {in.q, in.kc, in.vc, in.kb, in.vb}, {dout});
      const at::Tensor reference =
          block_attention_dense_reference(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, 5, window);
      const auto reference_grads = torch::autograd::grad({reference}, {in.q, in.kc, in.vc, in.kb, in.vb}, {dout});
      const std::string what = "window " + std::to_string(window) + ", groups of " + std::to_string(group_blocks);
      EXPECT_LE(relative_error(ours, reference), 1e-5) << what;
      for (size_t i = 0; i < ours_grads.size(); ++i) {
        EXPECT_LE(relative_error(ours_grads[i], reference_grads[i]), 1e-5) << "grad " << i << ", " << what;
      }
    }
  }
  // A window covering every context key and a causal block differs from the full layer only
  // within the block: the full layer's rows see later rows of their block.
  AttentionInputs in = random_attention(46, anchors, 5, 6, 2, 12);
  BlockAttentionShape wide{5, 64, 0};
  wide.sliding_window = 1000;
  EXPECT_GT(relative_error(block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, wide),
                           block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, {5, 64, 0})),
            1e-3);
}

// One path on the GPU in bf16 against the dense-mask reference in fp32 on the same rounded
// inputs: output and the five gradients within 2e-2, never NaN. Returns the gradients.
std::vector<at::Tensor> check_gpu_path(BlockAttentionPath path, const std::vector<int64_t>& anchors, int64_t context,
                                       int64_t block, int64_t hq, int64_t hkv, int64_t d, int64_t window = 0) {
  const auto cuda = at::TensorOptions().device(at::kCUDA).dtype(at::kFloat);
  const int64_t rows = static_cast<int64_t>(anchors.size()) * block;
  const at::Tensor q = at::randn({rows, hq, d}, cuda), kc = at::randn({context, hkv, d}, cuda);
  const at::Tensor vc = at::randn({context, hkv, d}, cuda), kb = at::randn({rows, hkv, d}, cuda);
  const at::Tensor vb = at::randn({rows, hkv, d}, cuda), dout = at::randn({rows, hq, d}, cuda);
  const at::Tensor a = at::tensor(anchors, at::TensorOptions().dtype(at::kLong));
  std::vector<at::Tensor> low, full;
  for (const at::Tensor& t : {q, kc, vc, kb, vb}) {
    low.push_back(t.to(at::kBFloat16).requires_grad_());
    full.push_back(t.to(at::kBFloat16).to(at::kFloat).requires_grad_());  // the same rounded inputs
  }
  BlockAttentionShape shape{block, 32, 0};
  shape.path = path;
  shape.sliding_window = window;
  const at::Tensor ours = block_attention(low[0], low[1], low[2], low[3], low[4], a, shape);
  EXPECT_EQ(ours.scalar_type(), at::kBFloat16);
  const auto ours_grads = torch::autograd::grad({ours}, low, {dout.to(at::kBFloat16)});
  const at::Tensor ref = block_attention_dense_reference(full[0], full[1], full[2], full[3], full[4], a, block, window);
  const auto ref_grads = torch::autograd::grad({ref}, full, {dout.to(at::kBFloat16).to(at::kFloat)});
  const std::string what = "path " + std::to_string(static_cast<int>(path)) + ", " + std::to_string(anchors.size()) +
                           " blocks of " + std::to_string(block) + ", heads " + std::to_string(hq) + "/" +
                           std::to_string(hkv) + ", context " + std::to_string(context) + ", window " +
                           std::to_string(window);
  EXPECT_LE(relative_error(ours.to(at::kFloat), ref), 2e-2) << what;
  EXPECT_FALSE(at::isnan(ours).any().item<bool>()) << what;
  for (size_t i = 0; i < ours_grads.size(); ++i) {
    EXPECT_LE(relative_error(ours_grads[i].to(at::kFloat), ref_grads[i]), 2e-2) << "grad " << i << ", " << what;
    EXPECT_FALSE(at::isnan(ours_grads[i]).any().item<bool>()) << "grad " << i << ", " << what;
  }
  return ours_grads;
}

TEST(BlockAttention, GpuSlidingWindowSplitPathsMatchTheFp32Reference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(19);
  std::vector<int64_t> anchors;
  for (int64_t a = 0; a < 700; a += 7) anchors.push_back(a + (a % 3));
  for (int64_t window : {16, 100}) {
    for (BlockAttentionPath path : {BlockAttentionPath::math, BlockAttentionPath::efficient}) {
      check_gpu_path(path, anchors, 710, 16, 8, 2, 64, window);
    }
  }
}

TEST(BlockAttention, GpuBf16OperandsMatchTheFp32Reference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(9);
  std::vector<int64_t> anchors;
  for (int64_t a = 0; a < 700; a += 7) anchors.push_back(a + (a % 3));
  for (BlockAttentionPath path : {BlockAttentionPath::math, BlockAttentionPath::efficient}) {
    check_gpu_path(path, anchors, 710, 16, 8, 2, 64);
  }
}

// The fused kernels: GQA 4 (one 64-row tile per block), GQA 6 (two row tiles, the second part
// padding), no GQA with block 8 and 10; anchors at 0 (no context), repeated, at the last
// position, context lengths that are not multiples of 64; enough blocks that the context
// gradients are split into several chunks; sliding windows; bit-identical on a second run.
void check_fused_kernels() {
  if (auto why = block_attention_kernels_unavailable(
          at::empty({1, 1, 128}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16)), 16)) {
    FAIL() << *why;
  }
  at::manual_seed(11);
  std::vector<int64_t> many;
  for (int64_t a = 0; a < 1000; a += 5) many.push_back(a + (a % 4));
  many.push_back(1000);
  check_gpu_path(BlockAttentionPath::kernels, many, 1001, 16, 32, 8, 128);
  check_gpu_path(BlockAttentionPath::kernels, {0, 0, 1, 63, 64, 65, 190, 191}, 192, 16, 12, 2, 128);
  check_gpu_path(BlockAttentionPath::kernels, {0, 5, 70, 71, 130}, 131, 10, 4, 4, 128);
  check_gpu_path(BlockAttentionPath::kernels, {3, 3, 40, 99}, 100, 8, 2, 1, 128);
  // Sliding-window layers: a window shorter than the block (rows past it see no context key),
  // one that ends inside a tile, one across tiles, one wider than the context.
  for (int64_t window : {5, 16, 100, 2000}) {
    check_gpu_path(BlockAttentionPath::kernels, many, 1001, 16, 32, 8, 128, window);
    check_gpu_path(BlockAttentionPath::kernels, {0, 0, 1, 63, 64, 65, 190, 191}, 192, 16, 12, 2, 128, window);
  }
  check_gpu_path(BlockAttentionPath::kernels, {0, 5, 70, 71, 130}, 131, 10, 4, 4, 128, 33);
  at::manual_seed(12);
  const auto first = check_gpu_path(BlockAttentionPath::kernels, many, 1001, 16, 32, 8, 128);
  at::manual_seed(12);
  const auto second = check_gpu_path(BlockAttentionPath::kernels, many, 1001, 16, 32, 8, 128);
  for (size_t i = 0; i < first.size(); ++i) EXPECT_TRUE(at::equal(first[i], second[i])) << "grad " << i;
}

// The kernels the device gets by default (wgmma on compute capability 9.0).
TEST(BlockAttention, GpuFusedKernelsMatchTheFp32Reference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  check_fused_kernels();
}

// The mma.sync kernels (the only ones on GPUs other than Hopper), forced where wgmma would run.
TEST(BlockAttention, GpuFusedMmaSyncKernelsMatchTheFp32Reference) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  force_mma_sync(MmaKernels::block_attention, true);
  check_fused_kernels();
  force_mma_sync(MmaKernels::block_attention, false);
}

TEST(BlockAttention, AskingForTheFusedKernelsWhereTheyCannotRunSaysWhy) {
  AttentionInputs in = random_attention(10, {2, 5}, 4, 2, 2, 8);
  BlockAttentionShape shape{4, 64, 0};
  shape.path = BlockAttentionPath::kernels;
  try {
    block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, shape);
    FAIL() << "expected a refusal";
  } catch (const std::invalid_argument& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("fused kernels cannot run"), std::string::npos) << message;
    // Names what is wrong: no GPU / no CUDA build on a CPU tensor.
    EXPECT_TRUE(message.find("not a GPU") != std::string::npos || message.find("no CUDA kernels") != std::string::npos)
        << message;
  }
  // On a GPU, a head size other than 128 is named.
  if (at::hasCUDA()) {
    const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
    auto why = block_attention_kernels_unavailable(at::empty({4, 2, 64}, bf16), 4);
    ASSERT_TRUE(why.has_value());
    EXPECT_NE(why->find("head_dim 64"), std::string::npos) << *why;
  }
}

TEST(BlockAttention, RejectsUnsortedOrOutOfRangeAnchors) {
  AttentionInputs in = random_attention(10, {2, 1}, 4, 2, 2, 8);
  EXPECT_THROW(block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, {4, 64, 0}), std::invalid_argument);
  AttentionInputs far = random_attention(10, {10}, 4, 2, 2, 8);
  EXPECT_THROW(block_attention(far.q, far.kc, far.vc, far.kb, far.vb, far.anchors, {4, 64, 0}), std::invalid_argument);
}

// Invariant 2: context strictly before the anchor.
TEST(DrafterInvariants, ContextIsStrictlyBeforeTheAnchor) {
  at::manual_seed(5);
  // Two blocks in one group: the first block's staircase row is checked inside the window
  // that the second block's larger anchor opens.
  AttentionInputs in = random_attention(30, {12, 20}, 4, 2, 1, 8);
  const BlockAttentionShape shape{4, 64, 0};
  const at::Tensor base = block_attention(in.q, in.kc, in.vc, in.kb, in.vb, in.anchors, shape).detach();
  at::Tensor kc = in.kc.detach().clone(), vc = in.vc.detach().clone();
  kc[12] += 5.0;  // the first anchor's own position: invisible to block 0
  vc[12] += 5.0;
  const at::Tensor moved = block_attention(in.q, kc, vc, in.kb, in.vb, in.anchors, shape);
  EXPECT_TRUE(at::equal(moved.narrow(0, 0, 4), base.narrow(0, 0, 4))) << "context used <= anchor";
  EXPECT_FALSE(at::allclose(moved.narrow(0, 4, 4), base.narrow(0, 4, 4))) << "block 1 (anchor 20) sees key 12";
  kc[11] += 5.0;  // just before the anchor: visible
  EXPECT_FALSE(at::allclose(block_attention(in.q, kc, vc, in.kb, in.vb, in.anchors, shape).narrow(0, 0, 4),
                            base.narrow(0, 0, 4)));
}

// Invariants 1 and 3: same-position labels; anchor token at offset 0, mask token elsewhere.
TEST(DrafterInvariants, SamePositionLabelsAndAnchorEmbedding) {
  DrafterBatch batch;
  batch.input_ids = at::arange(100, 120, at::TensorOptions().dtype(at::kLong));
  batch.loss_mask = at::ones({20}, at::TensorOptions().dtype(at::kByte));
  batch.loss_mask[15] = 0;
  batch.cu_seqlens = {0, 20};
  batch.anchors = {at::tensor(std::vector<int64_t>{3, 14}, at::TensorOptions().dtype(at::kLong))};
  const BlockTargets t = make_block_targets(batch, 4, 7.0, at::kCPU);
  // Block at 3: offsets 1..3 -> tokens 104, 105, 106 (anchor + k, not anchor + k + 1).
  EXPECT_EQ(t.labels[1].item<int64_t>(), 104);
  EXPECT_EQ(t.labels[3].item<int64_t>(), 106);
  EXPECT_EQ(t.weights[0].item<float>(), 0.0f) << "offset 0 carries no loss";
  EXPECT_FLOAT_EQ(t.weights[1].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(t.weights[2].item<float>(), std::exp(-1.0f / 7.0f));
  // Block at 14: offset 1 -> position 15 is outside the loss mask; 2 -> 16 valid.
  EXPECT_EQ(t.weights[5].item<float>(), 0.0f);
  EXPECT_EQ(t.labels[6].item<int64_t>(), 116);
  const at::Tensor ids = block_token_ids(batch.input_ids, batch.anchors[0], 4, 7);
  EXPECT_TRUE(at::equal(ids, at::tensor(std::vector<int64_t>{103, 7, 7, 7, 114, 7, 7, 7})));
  // Invariant 4: absolute positions.
  EXPECT_TRUE(
      at::equal(block_positions(batch.anchors[0], 4), at::tensor(std::vector<int64_t>{3, 4, 5, 6, 14, 15, 16, 17})));
}

// Invariant 6: labels past the end and other sequences of a packed batch never leak.
TEST(DrafterInvariants, PackedSequencesAndSequenceEndsDoNotLeak) {
  const Reference r = load_reference();
  Drafter drafter = reference_drafter(r);
  const at::Tensor hidden = drafter.forward(r.batch, r.embed).detach();
  DrafterBatch changed = r.batch;
  changed.input_ids = r.batch.input_ids.clone();
  changed.features = r.batch.features.clone();
  const int64_t second = r.batch.cu_seqlens[1];
  changed.input_ids.narrow(0, second, 29).random_(0, 320);
  changed.features.narrow(0, second, 29).normal_();
  const at::Tensor other = drafter.forward(changed, r.embed).detach();
  const int64_t first_rows = r.batch.anchors[0].size(0) * 4;
  EXPECT_TRUE(at::equal(hidden.narrow(0, 0, first_rows), other.narrow(0, 0, first_rows)));
  EXPECT_FALSE(at::equal(hidden, other));
  // The last block of sequence 2 (anchor 27, length 29): offsets 2 and 3 are past the end.
  const BlockTargets t = make_block_targets(r.batch, 4, 7.0, at::kCPU);
  const int64_t last = t.weights.size(0) - 4;
  EXPECT_GT(t.weights[last + 1].item<float>(), 0.0f);
  EXPECT_EQ(t.weights[last + 2].item<float>(), 0.0f);
  EXPECT_EQ(t.weights[last + 3].item<float>(), 0.0f);
}

TEST(Anchors, SampledOnlyWhereAnchorAndNextAreSupervisedUniqueSortedReproducible) {
  std::vector<uint8_t> mask(200, 0);
  for (int i = 10; i < 200; ++i) mask[i] = (i % 7 != 0);
  std::mt19937_64 a(42), b(42);
  const at::Tensor first = sample_anchors(mask, 50, a), again = sample_anchors(mask, 50, b);
  EXPECT_TRUE(at::equal(first, again));
  ASSERT_EQ(first.size(0), 50);
  for (int64_t i = 0; i < 50; ++i) {
    const int64_t p = first[i].item<int64_t>();
    EXPECT_TRUE(mask[p] && mask[p + 1]) << p;
    if (i > 0) {
      EXPECT_LT(first[i - 1].item<int64_t>(), p);
    }
  }
  EXPECT_FALSE(at::equal(sample_anchors(mask, 50, a), first)) << "redrawn each step";
  std::vector<uint8_t> few{0, 1, 1, 0, 1, 1, 1};
  std::mt19937_64 c(1);
  EXPECT_TRUE(at::equal(sample_anchors(few, 512, c), at::tensor(std::vector<int64_t>{1, 4, 5})));
}

// The LM-head loss on a GPU in bf16 (fused kernels) against the same loss computed here from
// the same bf16 logits with ATen ops: loss, hidden-state gradient, per-offset hits and counts.
// Rows without weight skip the head and get a zero gradient; several chunks; a vocabulary
// that is a multiple of 8 but not of the kernels' stride.
// The RMSNorm kernels against the composite expression under autograd, on the same bf16 inputs:
// the output equal but for the last bit of elements where the fp32 sum of squares differs in
// order; the input and weight gradients within bf16 rounding. Row lengths: the hidden size, a
// head (q/k norm: 16 chunks, half-warp rows), one of 129 chunks (a partial last lane round).
TEST(TrainedRmsNorm, GpuKernelsMatchTheCompositeForwardAndBackward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(23);
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  for (const auto& [rows, n] : {std::pair<int64_t, int64_t>{37, 5120}, {1001, 128}, {45, 1032}, {3, 64}}) {
    const std::string what = std::to_string(rows) + " x " + std::to_string(n);
    const at::Tensor x0 = at::randn({rows, n}, bf16) * 3, w0 = at::randn({n}, bf16) * 0.5 + 1,
                     dy = at::randn({rows, n}, bf16);
    const at::Tensor x1 = x0.clone().requires_grad_(), w1 = w0.clone().requires_grad_();
    const at::Tensor x2 = x0.clone().requires_grad_(), w2 = w0.clone().requires_grad_();
    const at::Tensor ours = trained_rms_norm(x1, w1, 1e-6), reference = dflash::rms_norm(x2, w2, 1e-6);
    ours.backward(dy);
    reference.backward(dy);
    EXPECT_GE((ours == reference).to(at::kFloat).mean().item<double>(), 0.99) << what;
    EXPECT_LE(relative_error(ours, reference), 1e-2) << what;
    EXPECT_LE(relative_error(x1.grad(), x2.grad()), 2e-2) << what;
    EXPECT_LE(relative_error(w1.grad(), w2.grad()), 2e-2) << what;
    EXPECT_FALSE(at::equal(x1.grad(), at::zeros_like(x1.grad()))) << what;
  }
  // A row length the kernels cannot take (n / 8 = 3): the composite path, same numbers.
  const at::Tensor x = at::randn({5, 24}, bf16), w = at::randn({24}, bf16);
  EXPECT_TRUE(at::equal(trained_rms_norm(x, w, 1e-6), dflash::rms_norm(x, w, 1e-6)));
}

// The SwiGLU product's kernels against at::silu(gate) * up under autograd: the output identical
// (same roundings, one product each), the gradients within bf16 rounding.
TEST(TrainedSiluMul, GpuKernelsMatchTheCompositeForwardAndBackward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(29);
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor gate0 = at::randn({77, 1736}, bf16) * 3, up0 = at::randn({77, 1736}, bf16),
                   dy = at::randn({77, 1736}, bf16);
  const at::Tensor g1 = gate0.clone().requires_grad_(), u1 = up0.clone().requires_grad_();
  const at::Tensor g2 = gate0.clone().requires_grad_(), u2 = up0.clone().requires_grad_();
  const at::Tensor ours = trained_silu_mul(g1, u1), reference = at::silu(g2) * u2;
  ours.backward(dy);
  reference.backward(dy);
  EXPECT_GE((ours == reference).to(at::kFloat).mean().item<double>(), 0.99);
  EXPECT_LE(relative_error(ours, reference), 1e-2);
  EXPECT_LE(relative_error(g1.grad(), g2.grad()), 2e-2);
  EXPECT_LE(relative_error(u1.grad(), u2.grad()), 2e-2);
  EXPECT_GE((u1.grad() == u2.grad()).to(at::kFloat).mean().item<double>(), 0.99);
}

// The rotary embedding's kernels against x cos + rotate_half(x) sin under autograd, on the same
// bf16 inputs: the output and x's gradient bit for bit (the same roundings: each product once,
// then one sum), for the drafter's heads of 128 and heads of 64 and 256, a table row per token
// shared by its heads.
TEST(TrainedRope, GpuKernelsMatchTheCompositeForwardAndBackward) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(31);
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  for (const auto& [tokens, heads, d] : {std::tuple<int64_t, int64_t, int64_t>{300, 32, 128}, {77, 8, 128},
                                         {5, 3, 64}, {40, 2, 256}}) {
    const std::string what = std::to_string(tokens) + " tokens x " + std::to_string(heads) + " heads of " +
                             std::to_string(d);
    const at::Tensor angles = at::rand({tokens, d / 2}, bf16.dtype(at::kFloat)) * 100;
    const at::Tensor emb = at::cat({angles, angles}, -1);
    const at::Tensor cos = emb.cos().to(at::kBFloat16).unsqueeze(1), sin = emb.sin().to(at::kBFloat16).unsqueeze(1);
    const at::Tensor x0 = at::randn({tokens, heads, d}, bf16) * 3, dy = at::randn({tokens, heads, d}, bf16);
    const at::Tensor x1 = x0.clone().requires_grad_(), x2 = x0.clone().requires_grad_();
    const at::Tensor ours = trained_rope(x1, cos, sin), reference = x2 * cos + dflash::rotate_half(x2) * sin;
    ours.backward(dy);
    reference.backward(dy);
    EXPECT_TRUE(at::equal(ours, reference)) << what;
    EXPECT_TRUE(at::equal(x1.grad(), x2.grad())) << what;
  }
#ifdef DFLASHD_WITH_CUDA
  // Heads the kernels cannot take are refused naming what they got (trained_rope keeps them on
  // the composite).
  const at::Tensor odd = at::zeros({4, 2, 24}, bf16);
  try {
    dflash::drafter::kernels::rope_forward(odd.data_ptr(), odd.data_ptr(), odd.data_ptr(), odd.data_ptr(), 4, 2, 24,
                                           nullptr);
    ADD_FAILURE() << "heads of 24 ran";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("got d 24, 2 heads"), std::string::npos) << e.what();
  }
#endif
}

TEST(LmHeadLoss, GpuKernelsMatchTheCompositeComputation) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  at::manual_seed(21);
  const int64_t rows = 300, hidden_size = 64, vocab = 4104, block = 4;
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const at::Tensor hidden = at::randn({rows, hidden_size}, cuda.dtype(at::kBFloat16)).requires_grad_();
  const at::Tensor head = (at::randn({vocab, hidden_size}, cuda.dtype(at::kFloat)) * 0.5).to(at::kBFloat16);
  BlockTargets t;
  t.labels = at::randint(0, vocab, {rows}, cuda.dtype(at::kLong));
  t.offsets = at::arange(rows, cuda.dtype(at::kLong)).remainder(block);
  t.weights = at::rand({rows}, cuda.dtype(at::kFloat)) * (t.offsets != 0).to(at::kFloat);
  t.valid = at::nonzero(t.weights > 0).squeeze(1);
  t.weight_sum = t.weights.sum().item<double>();
  const double global = 2.0 * t.weight_sum;  // as if another replica held the other half
  const int64_t chunk = 64;
  LossStats stats;
  const at::Tensor loss = dflash_loss(hidden, head, t, global, chunk, block, &stats);
  const at::Tensor grad = torch::autograd::grad({loss}, {hidden})[0];

  // The reference, chunk by chunk over the valid rows (the same GEMM shapes give the same logits).
  const at::Tensor h = hidden.detach().index_select(0, t.valid), y = t.labels.index_select(0, t.valid);
  const at::Tensor w = t.weights.index_select(0, t.valid), k = t.offsets.index_select(0, t.valid);
  at::Tensor grad_ref = at::zeros_like(hidden), loss_ref = at::zeros({}, cuda.dtype(at::kDouble));
  std::vector<int64_t> hits(block, 0), counts(block, 0);
  for (int64_t b = 0; b < h.size(0); b += chunk) {
    const int64_t n = std::min(chunk, h.size(0) - b);
    const at::Tensor logits = at::matmul(h.narrow(0, b, n), head.t()).to(at::kFloat);
    const at::Tensor lse = at::logsumexp(logits, 1);
    const at::Tensor yy = y.narrow(0, b, n), ww = w.narrow(0, b, n);
    loss_ref += ((lse - logits.gather(1, yy.unsqueeze(1)).squeeze(1)) * ww).sum().to(at::kDouble);
    const at::Tensor d = (at::softmax(logits, 1) - at::one_hot(yy, vocab).to(at::kFloat)) * (ww / global).unsqueeze(1);
    grad_ref.index_copy_(0, t.valid.narrow(0, b, n), at::matmul(d.to(at::kBFloat16), head));
    const at::Tensor hit = (logits.argmax(1) == yy).cpu(), kk = k.narrow(0, b, n).cpu();
    for (int64_t i = 0; i < n; ++i) {
      hits[kk[i].item<int64_t>()] += hit[i].item<bool>() ? 1 : 0;
      counts[kk[i].item<int64_t>()] += 1;
    }
  }
  EXPECT_NEAR(loss.item<double>(), loss_ref.item<double>() / global, 1e-4 * std::abs(loss_ref.item<double>() / global));
  EXPECT_LE(relative_error(grad.to(at::kFloat), grad_ref.to(at::kFloat)), 1e-2);
  EXPECT_TRUE(at::all(grad.index_select(0, at::nonzero(t.weights == 0).squeeze(1)) == 0).item<bool>())
      << "rows without weight get no gradient";
  EXPECT_EQ(stats.correct, hits);
  EXPECT_EQ(stats.count, counts);
}

TEST(LossStats, TauFromPerPositionAccuracy) {
  LossStats s;
  s.correct = {0, 8, 4, 1};
  s.count = {0, 10, 8, 4};
  // tau = 1 + 0.8 + 0.8*0.5 + 0.8*0.5*0.25
  EXPECT_NEAR(s.tau(), 1 + 0.8 + 0.4 + 0.1, 1e-12);
}

// ---- Threads, optimizer, checkpoints ----------------------------------------------------------

std::vector<at::Tensor> train_steps(const Reference& r, int steps) {
  Drafter drafter = reference_drafter(r);
  OptimizerSettings settings;
  settings.learning_rate = 1e-2;
  settings.total_steps = steps;
  AdamW optimizer(drafter.parameters(), settings);
  for (int i = 0; i < steps; ++i) {
    LossStats stats;
    step_loss(drafter, r, &stats).backward();
    optimizer.step();
  }
  std::vector<at::Tensor> out;
  for (const auto& [n, p] : drafter.parameters()) out.push_back(p.detach().clone());
  return out;
}

TEST(DrafterThreads, ConcurrentReplicasMatchSequentialRunsBitForBit) {
  const Reference r = load_reference();
  const auto sequential = train_steps(r, 3);
  std::vector<std::vector<at::Tensor>> results(4);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) threads.emplace_back([&, t] { results[t] = train_steps(r, 3); });
  for (auto& t : threads) t.join();
  for (int t = 0; t < 4; ++t) {
    for (size_t i = 0; i < sequential.size(); ++i)
      EXPECT_TRUE(at::equal(results[t][i], sequential[i])) << t << " " << i;
  }
  EXPECT_FALSE(at::equal(sequential[0], reference_drafter(r).parameters()[0].second)) << "training changed weights";
}

TEST(Optimizer, MatchesTheAdamWFormulaAndSchedules) {
  at::Tensor p = at::tensor(std::vector<float>{1.0f, -2.0f}).requires_grad_();
  OptimizerSettings s;
  s.learning_rate = 0.1;
  s.weight_decay = 0.01;
  s.grad_clip_norm = 0;
  s.total_steps = 1000;
  AdamW opt({{"p", p}}, s);
  p.mutable_grad() = at::tensor(std::vector<float>{0.5f, 1.0f});
  opt.step();
  // Step 1: m = 0.1 g, v = 0.001 g^2, m_hat = g, v_hat = g^2 -> update = lr * g/(|g|+eps) = lr * sign(g)
  // after decay p *= (1 - lr*wd).
  EXPECT_NEAR(p[0].item<float>(), 1.0 * (1 - 0.001) - 0.1, 1e-6);
  EXPECT_NEAR(p[1].item<float>(), -2.0 * (1 - 0.001) - 0.1, 1e-6);
  OptimizerSettings w;
  w.learning_rate = 1.0;
  w.min_learning_rate = 0.1;
  w.warmup_steps = 4;
  w.total_steps = 14;
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(w, 0), 0.25);
  EXPECT_DOUBLE_EQ(scheduled_learning_rate(w, 3), 1.0);
  EXPECT_NEAR(scheduled_learning_rate(w, 9), 0.55, 1e-12);  // half way down the cosine
  EXPECT_NEAR(scheduled_learning_rate(w, 14), 0.1, 1e-12);
}

TEST(Optimizer, ClipsToTheGlobalNormAndSkipsNonFiniteSteps) {
  at::Tensor a = at::zeros({1}).requires_grad_(), b = at::zeros({1}).requires_grad_();
  OptimizerSettings s;
  s.learning_rate = 1.0;
  s.grad_clip_norm = 1.0;
  AdamW opt({{"a", a}, {"b", b}}, s);
  a.mutable_grad() = at::full({1}, 3.0f);
  b.mutable_grad() = at::full({1}, 4.0f);
  EXPECT_NEAR(opt.step().grad_norm, 5.0, 1e-9);
  a.mutable_grad() = at::full({1}, NAN);
  b.mutable_grad() = at::full({1}, 1.0f);
  const at::Tensor before = a.detach().clone();
  const StepResult r = opt.step();
  EXPECT_FALSE(r.applied);
  EXPECT_TRUE(at::equal(a.detach(), before));
  EXPECT_EQ(opt.steps_taken(), 1);
}

TEST(Optimizer, FusedGpuUpdateMatchesThePerTensorUpdate) {
  if (!at::hasCUDA()) GTEST_SKIP() << "no CUDA device";
  // Clipping, weight decay, warmup: several steps of the fused GPU paths against the per-tensor
  // path on the same gradients. bf16 parameters (fp32 masters) take the one-pass AdamW kernel,
  // fp32 parameters ATen's fused AdamW.
  for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) {
    const std::string what = c10::toString(dtype);
    at::manual_seed(5);
    const auto options = at::TensorOptions().device(at::kCUDA).dtype(dtype);
    std::vector<at::Tensor> fused_params, plain_params;
    for (int64_t n :
         {1000, 37, 131075}) {  // 37 and the last end in single elements; 131075 spans three of the kernel's chunks
      const at::Tensor init = at::randn({n}, options);
      fused_params.push_back(init.clone().requires_grad_());
      plain_params.push_back(init.clone().requires_grad_());
    }
    OptimizerSettings s;
    s.learning_rate = 1e-2;
    s.weight_decay = 0.1;
    s.grad_clip_norm = 0.5;
    s.warmup_steps = 2;
    s.total_steps = 10;
    OptimizerSettings plain_settings = s;
    plain_settings.fused_on_gpu = false;
    AdamW fused({{"a", fused_params[0]}, {"b", fused_params[1]}, {"c", fused_params[2]}}, s);
    AdamW plain({{"a", plain_params[0]}, {"b", plain_params[1]}, {"c", plain_params[2]}}, plain_settings);
    for (int step = 0; step < 5; ++step) {
      for (size_t i = 0; i < fused_params.size(); ++i) {
        const at::Tensor g = at::randn(fused_params[i].sizes(), options);
        fused_params[i].mutable_grad() = g.clone();
        plain_params[i].mutable_grad() = g.clone();
      }
      const StepResult a = fused.step(), b = plain.step();
      EXPECT_NEAR(a.grad_norm, b.grad_norm, 1e-6 * b.grad_norm) << what;
    }
    const auto fs = fused.state_tensors(), ps = plain.state_tensors();
    ASSERT_EQ(fs.size(), ps.size());
    for (size_t i = 0; i < fs.size(); ++i) {
      const double scale = ps[i].second.abs().max().item<double>();
      EXPECT_LE((fs[i].second - ps[i].second).abs().max().item<double>(), 1e-4 * scale + 1e-12)
          << fs[i].first << " " << what;  // fp32 rounding order
    }
    for (size_t i = 0; i < fused_params.size(); ++i) {
      const at::Tensor a = fused_params[i].detach().to(at::kFloat), b = plain_params[i].detach().to(at::kFloat);
      EXPECT_LE((a - b).abs().max().item<double>(), 8e-3 * b.abs().max().item<double>())
          << i << " " << what;  // one bf16 ulp
    }
  }
}

TEST(Checkpoint, ResumeContinuesBitIdenticallyAndPartialDirectoriesAreIgnored) {
  const Reference r = load_reference();
  const std::string root = test::make_temp_dir("ckpt");
  OptimizerSettings settings;
  settings.learning_rate = 1e-2;
  settings.total_steps = 4;
  // Uninterrupted: 4 steps.
  const auto straight = train_steps(r, 4);
  // Interrupted: 2 steps, checkpoint, fresh objects, resume, 2 more.
  {
    Drafter drafter = reference_drafter(r);
    AdamW optimizer(drafter.parameters(), settings);
    for (int i = 0; i < 2; ++i) {
      LossStats stats;
      step_loss(drafter, r, &stats).backward();
      optimizer.step();
    }
    write_checkpoint(root, 2, drafter, optimizer, R"({"data": {"epoch": 0, "position": 17}})");
  }
  // A crash while writing step 3 leaves a partial directory: it must be ignored.
  test::make_temp_dir("unused");
  ::mkdir((root + "/.step-000000000003.partial").c_str(), 0755);
  ::mkdir((root + "/step-000000000004").c_str(), 0755);  // no COMMIT: not a checkpoint
  const auto found = list_checkpoints(root);
  ASSERT_EQ(found.size(), 1u);
  EXPECT_EQ(found[0], root + "/step-000000000002");
  Drafter drafter(tiny_shape(), at::TensorOptions().dtype(at::kFloat));
  drafter.init_random(99);
  AdamW optimizer(drafter.parameters(), settings);
  const LoadedCheckpoint loaded = read_checkpoint(found[0], &drafter, &optimizer);
  EXPECT_EQ(loaded.step, 2);
  EXPECT_EQ(loaded.trainer_state_json, R"({"data":{"epoch":0,"position":17}})");
  for (int i = 0; i < 2; ++i) {
    LossStats stats;
    step_loss(drafter, r, &stats).backward();
    optimizer.step();
  }
  for (size_t i = 0; i < straight.size(); ++i) EXPECT_TRUE(at::equal(drafter.parameters()[i].second, straight[i])) << i;
  // keep-last pruning
  write_checkpoint(root, 5, drafter, optimizer, "{}");
  write_checkpoint(root, 6, drafter, optimizer, "{}");
  prune_checkpoints(root, 2);
  const auto kept = list_checkpoints(root);
  ASSERT_EQ(kept.size(), 2u);
  EXPECT_EQ(kept[0], root + "/step-000000000005");
}

TEST(Checkpoint, CorruptOrIncompleteCheckpointsAreClearErrors) {
  const std::string root = test::make_temp_dir("ckpt-bad");
  Drafter drafter(tiny_shape(), at::TensorOptions().dtype(at::kFloat));
  drafter.init_random(1);
  AdamW optimizer(drafter.parameters(), OptimizerSettings{});
  const std::string dir = write_checkpoint(root, 1, drafter, optimizer, "{}");
  // Truncate the weights file.
  std::ofstream(dir + "/model.safetensors", std::ios::trunc) << "short";
  try {
    read_checkpoint(dir, &drafter, &optimizer);
    FAIL();
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/model.safetensors: truncated"), std::string::npos) << e.what();
  }
  EXPECT_THROW(read_checkpoint(root, &drafter, &optimizer), CheckpointError);  // no COMMIT
}

// Tensor shapes do not say the block size, the mask token, the tapped layers or the window: a
// drafter configured otherwise is refused the checkpoint, every difference named.
TEST(Checkpoint, ADrafterConfiguredOtherwiseIsRefusedEvenWithTheSameTensorShapes) {
  const std::string root = test::make_temp_dir("ckpt-shape");
  Drafter saved(tiny_shape(), at::TensorOptions().dtype(at::kFloat));
  saved.init_random(1);
  AdamW saved_optimizer(saved.parameters(), OptimizerSettings{});
  const std::string dir = write_checkpoint(root, 1, saved, saved_optimizer, "{}");
  DrafterShape other = tiny_shape();
  other.block_size = 8;
  other.target_layer_ids = {2, 3, 5};
  Drafter drafter(other, at::TensorOptions().dtype(at::kFloat));
  AdamW optimizer(drafter.parameters(), OptimizerSettings{});
  try {
    read_checkpoint(dir, &drafter, &optimizer);
    FAIL() << "a drafter of another block size took the checkpoint";
  } catch (const CheckpointError& e) {
    EXPECT_NE(std::string(e.what()).find(dir + "/config.json: the checkpoint's drafter is not the configured one"),
              std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("block_size 4 there, 8 configured; target_layer_ids [1, 3, 5] there"),
              std::string::npos)
        << e.what();
  }
  Drafter same(tiny_shape(), at::TensorOptions().dtype(at::kFloat));
  AdamW same_optimizer(same.parameters(), OptimizerSettings{});
  EXPECT_EQ(read_checkpoint(dir, &same, &same_optimizer).step, 1);
}

// Invariant 7: the exported drafter loads in the published model code and gives our logits.
TEST(DrafterExport, LoadsInSpecForgeModelCodeWithTheSameLogits) {
  const Reference r = load_reference();
  Drafter drafter = reference_drafter(r);
  const std::string dir = test::make_temp_dir("export");
  drafter.save_export(dir);
  // Our logits from the bf16-rounded weights that were exported.
  Drafter reloaded(tiny_shape(), at::TensorOptions().dtype(at::kFloat));
  reloaded.load_export(dir);
  DrafterBatch one;
  one.cu_seqlens = {0, 40};
  one.input_ids = r.batch.input_ids.narrow(0, 0, 40);
  one.loss_mask = r.batch.loss_mask.narrow(0, 0, 40);
  one.features = r.batch.features.narrow(0, 0, 40);
  one.anchors = {r.batch.anchors[0]};
  const at::Tensor logits = at::matmul(reloaded.forward(one, r.embed).detach(), r.lm_head.t()).contiguous();
  const at::Tensor ids = one.input_ids.contiguous(), features = one.features.contiguous();
  const at::Tensor anchors = one.anchors[0].contiguous();
  write_safetensors(
      dir + "/inputs.safetensors",
      {{"features", DType::F32, features.sizes().vec(), features.data_ptr(), (size_t)features.nbytes()},
       {"input_ids", DType::I64, ids.sizes().vec(), ids.data_ptr(), (size_t)ids.nbytes()},
       {"anchors", DType::I64, anchors.sizes().vec(), anchors.data_ptr(), (size_t)anchors.nbytes()},
       {"target.embed", DType::F32, r.embed.sizes().vec(), r.embed.data_ptr(), (size_t)r.embed.nbytes()},
       {"target.lm_head", DType::F32, r.lm_head.sizes().vec(), r.lm_head.data_ptr(), (size_t)r.lm_head.nbytes()},
       {"dflashd.logits", DType::F32, logits.sizes().vec(), logits.data_ptr(), (size_t)logits.nbytes()}});
  const std::string command =
      kPython + " " + kScript + " check-export " + dir + " " + dir + "/inputs.safetensors > " + dir + "/check.log 2>&1";
  EXPECT_EQ(std::system(command.c_str()), 0) << test::read_file(dir + "/check.log");
  // Round trip through our own loader keeps the (bf16-rounded) weights.
  for (size_t i = 0; i < drafter.parameters().size(); ++i) {
    EXPECT_TRUE(
        at::equal(reloaded.parameters()[i].second, drafter.parameters()[i].second.to(at::kBFloat16).to(at::kFloat)));
  }
  // export_checkpoint produces the same files from a checkpoint.
  AdamW optimizer(drafter.parameters(), OptimizerSettings{});
  const std::string ckpt = write_checkpoint(dir + "/ckpt", 3, drafter, optimizer, "{}");
  export_checkpoint(ckpt, dir + "/exported");
  EXPECT_EQ(test::read_file(dir + "/exported/config.json"), test::read_file(dir + "/config.json"));
  EXPECT_EQ(test::read_file(dir + "/exported/model.safetensors"), test::read_file(dir + "/model.safetensors"));
}

// drafter.layer_types / sliding_window: the shape, its errors (naming the key), and the export's
// config.json (layer_types, sliding_window, use_sliding_window) read back.
TEST(DrafterShapeTest, SlidingWindowLayersAndTheirExport) {
  target::ModelConfig t = target::parse_model_config(target::preset_config_json("tiny-qwen3"), "tiny");
  config::DrafterConfig c;
  c.mask_token_id = 5;
  c.num_layers = 3;
  c.block_size = 8;
  c.layer_types = {"sliding_attention", "sliding_attention", "full_attention"};
  c.sliding_window = 32;
  const DrafterShape s = shape_for_target(t, c);
  EXPECT_EQ(s.window_of(0), 32);
  // The drafter serves the target's context: Qwen3.5-27B's 262,144 positions (not a default).
  const target::ModelConfig big = target::load_model_config(std::string(DFLASHD_SOURCE_DIR) + "/bench/configs/qwen3_5-27b");
  config::DrafterConfig recipe;
  EXPECT_EQ(shape_for_target(big, recipe).max_position_embeddings, 262144);
  EXPECT_EQ(nlohmann::json::parse(export_config_json(shape_for_target(big, recipe)))["max_position_embeddings"], 262144);
  EXPECT_EQ(s.window_of(2), 0);
  const std::string json = export_config_json(s);
  const nlohmann::json j = nlohmann::json::parse(json);
  EXPECT_EQ(j["layer_types"], (std::vector<std::string>{"sliding_attention", "sliding_attention", "full_attention"}));
  EXPECT_EQ(j["sliding_window"], 32);
  EXPECT_EQ(j["use_sliding_window"], true);
  const DrafterShape back = parse_export_config(json, "export");
  EXPECT_EQ(back.layer_types, s.layer_types);
  EXPECT_EQ(back.sliding_window, 32);
  EXPECT_EQ(shape_differences(back, s), "");
  config::DrafterConfig full = c;
  full.layer_types.clear();
  full.sliding_window.reset();
  EXPECT_NE(shape_differences(back, shape_for_target(t, full)).find("layer_types"), std::string::npos);
  auto error_of = [&](const config::DrafterConfig& bad) {
    try {
      shape_for_target(t, bad);
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  config::DrafterConfig bad = c;
  bad.layer_types = {"sliding_attention", "full_attention"};
  EXPECT_NE(error_of(bad).find("drafter.layer_types: 2 entries for drafter.num_layers 3"), std::string::npos);
  bad = c;
  bad.sliding_window.reset();
  EXPECT_NE(error_of(bad).find("set drafter.sliding_window"), std::string::npos);
  bad = c;
  bad.sliding_window = 4;
  EXPECT_NE(error_of(bad).find("smaller than drafter.block_size"), std::string::npos);
  bad = full;
  bad.sliding_window = 64;
  EXPECT_NE(error_of(bad).find("no layer slides"), std::string::npos);
  EXPECT_THROW(parse_export_config(json.substr(0, json.find("\"sliding_window\"")) + "\"x\": 1}", "cut"),
               std::runtime_error);
}

TEST(DrafterShapeTest, FromTargetConfigWithDefaultsAndErrors) {
  target::ModelConfig t = target::parse_model_config(target::preset_config_json("tiny-qwen3_5"), "tiny");
  config::DrafterConfig c;
  c.mask_token_id = 5;
  const DrafterShape s = shape_for_target(t, c);
  EXPECT_EQ(s.hidden_size, 64);
  EXPECT_EQ(s.target_layer_ids, (std::vector<int64_t>{1, 2, 3, 4, 5}));
  EXPECT_DOUBLE_EQ(s.rope_theta, 1e7);
  config::DrafterConfig bad;
  EXPECT_THROW(shape_for_target(t, bad), std::invalid_argument);  // tiny vocab: no default mask token
  bad.mask_token_id = 9999;
  EXPECT_THROW(shape_for_target(t, bad), std::invalid_argument);
  bad.mask_token_id = 1;
  bad.target_layer_ids = {1, 9};
  EXPECT_THROW(shape_for_target(t, bad), std::invalid_argument);
  const std::string json = export_config_json(s);
  const DrafterShape back = parse_export_config(json, "x");
  EXPECT_EQ(back.target_layer_ids, s.target_layer_ids);
  EXPECT_EQ(back.mask_token_id, 5);
  EXPECT_NE(json.find("\"architectures\": [\n    \"DFlashDraftModel\""), std::string::npos);
}

}  // namespace
}  // namespace dflash::drafter
