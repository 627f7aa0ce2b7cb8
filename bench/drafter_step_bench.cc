// drafter_step_bench: one DFlash drafter training step (forward, chunked LM-head loss, backward,
// AdamW) at the Qwen3.5-27B drafter shape on a GPU: hidden 5120, 32/8 heads of 128, MLP 17408,
// 5 layers, vocabulary 248320, S 3072, 512 anchors, block 16. Prints time, memory and MFU.
// Usage: drafter_step_bench [repeats]   (needs a CUDA GPU; bench/run_h200.sh runs it)
// Long sequences and the current recipe (issue 25): DRAFTER_BENCH_TOKENS (S), DRAFTER_BENCH_ANCHORS,
// DRAFTER_BENCH_WINDOW (> 0: layers 0-3 slide with that window, layer 4 full) and
// DRAFTER_BENCH_PATH (automatic | efficient | kernels) set the step's sequence, anchors and path.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/cuda.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>

#include "common/kernel_variants.h"
#include "bench/kernel_profile.h"
#include "drafter/block_attention.h"
#include "drafter/loss.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"
#include "pipeline/flops.h"
#include "pipeline/gpu_memory.h"

using namespace dflash;

namespace {

int64_t env_or(const char* name, int64_t fallback) {
  const char* v = std::getenv(name);
  return v != nullptr ? std::atoll(v) : fallback;
}
const int64_t kTokens = env_or("DRAFTER_BENCH_TOKENS", 3072);
const int64_t kAnchors = env_or("DRAFTER_BENCH_ANCHORS", 512);
const int64_t kWindow = env_or("DRAFTER_BENCH_WINDOW", 0);

// The Qwen3.5-27B drafter (5 layers, 32/8 heads of 128).
drafter::DrafterShape drafter_27b_shape() {
  drafter::DrafterShape s;
  s.hidden_size = 5120;
  s.num_layers = 5;
  s.num_attention_heads = 32;
  s.num_key_value_heads = 8;
  s.head_dim = 128;
  s.intermediate_size = 17408;
  s.vocab_size = 248320;
  s.rope_theta = 1e7;
  s.block_size = 16;
  s.mask_token_id = 248070;
  s.target_layer_ids = {1, 16, 31, 46, 61};
  s.num_target_layers = 64;
  if (kWindow > 0) {
    s.layer_types = {"sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention"};
    s.sliding_window = kWindow;
  }
  return s;
}


drafter::BlockAttentionPath bench_path() {
  const char* v = std::getenv("DRAFTER_BENCH_PATH");
  const std::string name = v != nullptr ? v : "automatic";
  if (name == "efficient") return drafter::BlockAttentionPath::efficient;
  if (name == "kernels") return drafter::BlockAttentionPath::kernels;
  return drafter::BlockAttentionPath::automatic;
}

// One sequence of kTokens with kAnchors anchors, random features, the first 64 tokens unsupervised.
drafter::DrafterBatch make_batch(const drafter::DrafterShape& s, const at::TensorOptions& bf16) {
  drafter::DrafterBatch batch;
  batch.features = at::randn({kTokens, s.num_features() * s.hidden_size}, bf16);
  batch.input_ids = at::randint(0, 248000, {kTokens}, bf16.dtype(at::kLong));
  std::vector<uint8_t> mask(kTokens, 1);
  for (int i = 0; i < 64; ++i) mask[i] = 0;
  batch.loss_mask = at::tensor(mask, at::TensorOptions().dtype(at::kByte));
  batch.cu_seqlens = {0, kTokens};
  std::mt19937_64 rng(1);
  batch.anchors = {drafter::sample_anchors(mask, kAnchors, rng)};
  return batch;
}

// The median of `runs` synchronised calls of f after `warm` unrecorded ones.
template <typename F>
double median_seconds(F&& f, int runs, int warm = 1) {
  std::vector<double> t;
  for (int i = 0; i < runs + warm; ++i) {
    torch::cuda::synchronize();
    const auto a = std::chrono::steady_clock::now();
    f();
    torch::cuda::synchronize();
    if (i >= warm) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

// One layer's block attention inputs at this shape.
struct AttentionInputs {
  at::Tensor q, kc, vc, kb, vb, dout;
};

// Each GPU path, forward alone and forward + backward (same inputs, same run), timed as the
// flex_attention peer (bench/python/flex_block_attention.py): median of 20 after 3 warm-up runs.
struct PathTime {
  const char* name;
  drafter::BlockAttentionPath path;
  bool mma_sync = false;  // the mma.sync kernels forced while timed
  double forward = 0, both = 0;
};

std::vector<PathTime> time_attention_paths(const AttentionInputs& in, const at::Tensor& anchors) {
  std::vector<PathTime> paths{{"fused kernels", drafter::BlockAttentionPath::kernels},
                              {"fused kernels, mma.sync (forced)", drafter::BlockAttentionPath::kernels, true},
                              {"split path, memory-efficient kernels", drafter::BlockAttentionPath::efficient}};
  for (PathTime& p : paths) {
    force_mma_sync(MmaKernels::block_attention, p.mma_sync);
    drafter::BlockAttentionShape shape{16, 64, 0};
    shape.path = p.path;
    // With a window: the sliding layers' attention (the split path only), then the kernels at
    // the full layer (no window).
    shape.sliding_window = p.path == drafter::BlockAttentionPath::kernels ? 0 : kWindow;
    p.forward = median_seconds([&] {
      c10::NoGradGuard no_grad;
      drafter::block_attention(in.q, in.kc, in.vc, in.kb, in.vb, anchors, shape);
    }, 20, 3);
    p.both = median_seconds(
        [&] { drafter::block_attention(in.q, in.kc, in.vc, in.kb, in.vb, anchors, shape).backward(in.dout); }, 20, 3);
    force_mma_sync(MmaKernels::block_attention, false);
  }
  return paths;
}

// DFLASHD_PROFILE: the kernels of one layer's attention and of a whole step (each call synchronised).
void profile(const AttentionInputs& in, const at::Tensor& anchors, const std::function<void()>& step) {
  drafter::BlockAttentionShape shape{16, 64, 0};
  shape.path = drafter::BlockAttentionPath::kernels;
  bench::print_kernel_profile("block attention of one layer, forward alone, 10 calls", [&] {
    c10::NoGradGuard no_grad;
    for (int i = 0; i < 10; ++i) {
      drafter::block_attention(in.q, in.kc, in.vc, in.kb, in.vb, anchors, shape);
      torch::cuda::synchronize();
    }
  }, 12);
  bench::print_kernel_profile("block attention of one layer, forward + backward, 10 calls", [&] {
    for (int i = 0; i < 10; ++i) {
      drafter::block_attention(in.q, in.kc, in.vc, in.kb, in.vb, anchors, shape).backward(in.dout);
      torch::cuda::synchronize();
    }
  }, 16);
  bench::print_kernel_profile("drafter step (forward, LM head + loss, backward)", [&] {
    step();
    torch::cuda::synchronize();
  }, 30);
}

}  // namespace

int main(int argc, char** argv) {
  const int repeats = argc > 1 ? std::atoi(argv[1]) : 5;
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "drafter_step_bench: no CUDA device\n");
    return 1;
  }
  const drafter::DrafterShape s = drafter_27b_shape();
  const at::Device device(at::kCUDA, 0);
  const auto bf16 = at::TensorOptions().device(device).dtype(at::kBFloat16);
  drafter::Drafter model(s, bf16);
  model.set_attention_path(bench_path());
  {
    c10::NoGradGuard no_grad;
    for (const auto& [name, p] : model.parameters()) {
      if (p.dim() == 1) p.fill_(1.0);
      else p.normal_(0, 0.02);
    }
  }
  const at::Tensor embed = at::randn({s.vocab_size, s.hidden_size}, bf16) * 0.02;
  const at::Tensor head = at::randn({s.vocab_size, s.hidden_size}, bf16) * 0.02;
  const drafter::DrafterBatch batch = make_batch(s, bf16);
  drafter::OptimizerSettings settings;
  settings.total_steps = 1000;
  drafter::AdamW optimizer(model.parameters(), settings);
  const drafter::BlockTargets targets = drafter::make_block_targets(batch, 16, 7.0, device);
  const int64_t rows = batch.anchors[0].size(0) * 16;
  const int64_t anchor_sum = batch.anchors[0].sum().item<int64_t>();
  const at::Tensor& anchor_list = batch.anchors[0];
  const double flops = pipeline::drafter_flops(
      s, kTokens, std::vector<int64_t>(anchor_list.data_ptr<int64_t>(), anchor_list.data_ptr<int64_t>() + anchor_list.numel()));
  auto step = [&] {
    drafter::LossStats stats;
    const at::Tensor hidden = model.forward(batch, embed);
    drafter::dflash_loss(hidden, head, targets, targets.weight_sum, 128 * 16, 16, &stats).backward();
  };

  const double median = median_seconds(step, repeats, 2);
  const double median_opt = median_seconds([&] { optimizer.step(); }, repeats, 2);
  // Where the time goes: the parts timed alone (synchronised), same inputs.
  const double forward_only = median_seconds([&] {
    c10::NoGradGuard no_grad;
    model.forward(batch, embed);
  }, repeats);
  at::Tensor hidden_leaf = model.forward(batch, embed).detach().requires_grad_();
  const double head_loss = median_seconds([&] {
    drafter::LossStats stats;
    drafter::dflash_loss(hidden_leaf, head, targets, targets.weight_sum, 128 * 16, 16, &stats).backward();
  }, repeats);
  const int64_t hq = 32, hkv = 8, d = 128;
  const AttentionInputs in{at::randn({rows, hq, d}, bf16).requires_grad_(), at::randn({kTokens, hkv, d}, bf16).requires_grad_(),
                           at::randn({kTokens, hkv, d}, bf16).requires_grad_(), at::randn({rows, hkv, d}, bf16).requires_grad_(),
                           at::randn({rows, hkv, d}, bf16).requires_grad_(), at::randn({rows, hq, d}, bf16)};
  const std::vector<PathTime> paths = time_attention_paths(in, batch.anchors[0]);
  // The attention's model FLOPs (docs/targets.md): 4 d per visible (row, key) pair forward, 2.5x that backward.
  // Each of a block's 16 rows per query head sees anchor + 16 keys.
  const double pairs = 16.0 * static_cast<double>(hq) * static_cast<double>(anchor_sum + 16 * batch.anchors[0].size(0));
  const double attention_flops = 4.0 * d * pairs;
  if (std::getenv("DFLASHD_PROFILE")) profile(in, batch.anchors[0], step);

  const auto memory = pipeline::gpu_memory({0});
  std::printf("dflashd drafter step (27B drafter shape, S %lld, %lld anchors x 16, automatic attention path, bf16)\n",
              static_cast<long long>(kTokens), static_cast<long long>(batch.anchors[0].size(0)));
  std::printf("  forward+loss+backward  %.3f s  (%.1f TFLOP model, %.0f TFLOP/s, MFU %.1f%% of 790)\n", median,
              flops / 1e12, flops / median / 1e12, 100 * flops / median / 790e12);
  std::printf("  AdamW step             %.3f s\n", median_opt);
  std::printf("  parts: forward alone (no grad) %.3f s; LM head + loss fwd+bwd %.3f s\n", forward_only, head_loss);
  if (kWindow > 0) {
    std::printf("  (the split paths below with a window of %lld, as the sliding layers; the fused kernels without, as\n"
                "   the full layer; TFLOP/s counts every row's whole context)\n", static_cast<long long>(kWindow));
  }
  for (const PathTime& p : paths) {
    std::printf("  block attention, %s: forward %.2f ms (%.0f TFLOP/s), forward+backward %.2f ms per layer (%.0f TFLOP/s; x5 = %.3f s)\n",
                p.name, 1e3 * p.forward, attention_flops / p.forward / 1e12, 1e3 * p.both,
                3.5 * attention_flops / p.both / 1e12, 5 * p.both);
  }
  std::printf("  peak allocated         %.1f GiB\n", memory.empty() ? 0.0 : memory[0].peak_allocated_bytes / 1073741824.0);
  return 0;
}
