// target_bench: the target forward of any config on a GPU, and one MoE layer against its floor.
//   1. the bf16 matmul rate of this GPU (8192^3), the floor's denominator;
//   2. the whole target forward (random weights, bf16, up to the deepest tapped layer by the
//      DFlash rule, or to LAST_LAYER), 3072 tokens: seconds, tokens/s, MFU; then the same target
//      with FP8 projections (target.dtype: float8, on Hopper) and how far its tapped states are
//      from the bf16 ones;
//   3. one MoE block at the config's expert shapes, 3072 tokens: the grouped path (moe.h), the
//      reference host loop (what ran before), the grouped path with FP8 experts on the FP8
//      grouped GEMM and dequantized per call, and the floor: its FLOPs (router, top-k experts'
//      SwiGLU, shared expert) at the measured bf16 matmul rate.
//   An MoE target's FP8 forward runs twice: its experts dequantized per layer (kernels/
//   grouped_fp8.h's hook `off`, in one process), then on the FP8 grouped GEMM; its MoE block also
//   at decode's sizes (64, 128 and 512 tokens).
//   4. with LENGTHS (e.g. 512,768,1024,768): those sequences' forwards one by one against one
//      packed forward of all of them (cu_seqlens), bf16 and FP8: what packing short sequences
//      into one target forward would save.
// Usage: target_bench CONFIG_DIR [LAST_LAYER [LENGTHS]]   (LAST_LAYER -1: no whole forward, the MoE block
// only; with LENGTHS only the packing comparison)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "bench/kernel_profile.h"
#include "bench/timing.h"
#include "pipeline/flops.h"
#include "target/fp8.h"
#include "target/model.h"
#include "target/kernels/grouped_fp8.h"
#include "target/moe.h"

using namespace dflash;
using bench::median_ms;

namespace {

constexpr int64_t kTokens = 3072;

// The whole target forward (layers 0..last) in bf16, then with FP8 projections where the GPU runs
// them, and how far FP8's tapped states are from bf16's.
void bench_forward(const target::ModelConfig& config, const char* config_dir, int64_t last, double rate) {
  const int64_t tokens = kTokens;
  target::TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, false};
  const at::Tensor ids = at::randint(0, config.vocab_size, {tokens}, at::TensorOptions().dtype(at::kLong));
  std::vector<int64_t> tapped = config.default_tapped_layers(5);
  while (!tapped.empty() && tapped.back() > last) tapped.pop_back();
  if (tapped.empty() || tapped.back() != last) tapped.push_back(last);
  const double flops = pipeline::target_flops(config, last, tokens);
  // The forward's time and the tapped states (on the CPU, so that the next model fits).
  auto run = [&](const target::TargetOptions& o, const char* name) {
    auto model = target::random_target(config, last, o, 1);
    const double ms = median_ms(5, [&] { model->forward(ids, {0, tokens}, {last}); });
    std::printf("target forward %s (%s, weights %.1f GB), layers 0..%lld, %lld tokens: %.4f s, %.0f tokens/s, MFU %.1f%%\n",
                config_dir, name, model->weight_bytes() / 1e9, static_cast<long long>(last),
                static_cast<long long>(tokens), ms / 1e3, tokens / (ms / 1e3), 100.0 * flops / (ms / 1e3) / rate);
    for (const auto& [component, path] : model->kernel_paths()) std::printf("  %s\n", path.str().c_str());
    // DFLASHD_PROFILE=1: the forward's kernels by GPU time.
    if (std::getenv("DFLASHD_PROFILE") != nullptr) {
      bench::print_kernel_profile((std::string("target forward, ") + name).c_str(), [&] {
        model->forward(ids, {0, tokens}, {last});
        c10::cuda::device_synchronize();
      });
    }
    std::vector<at::Tensor> states = model->forward(ids, {0, tokens}, tapped);
    for (at::Tensor& t : states) t = t.cpu().to(at::kDouble);
    return states;
  };
  const std::vector<at::Tensor> bf16 = run(options, "bf16");
  // target.dtype: float8 (the bf16 model's weights quantised) and how far its tapped states are.
  if (!target::fp8_gemm_unavailable(options.device)) {
    target::TargetOptions fp8_options = options;
    fp8_options.fp8_weights = true;
    try {
      // An MoE target: first with its FP8 experts dequantized per layer (the path before the FP8
      // grouped GEMM), in the same process.
      if (config.num_experts > 0) {
        grouped_fp8::off = true;
        run(fp8_options, "fp8, experts dequantized per layer");
        grouped_fp8::off = false;
      }
      const std::vector<at::Tensor> fp8 = run(fp8_options, "fp8");
      for (size_t i = 0; i < tapped.size(); ++i) {
        const at::Tensor d = fp8[i] - bf16[i];
        std::printf("  FP8 vs bf16 tapped layer %lld: relative error %.4f (Frobenius), max %.4f of max |bf16|, cosine %.5f\n",
                    static_cast<long long>(tapped[i]), (d.norm() / bf16[i].norm()).item<double>(),
                    (d.abs().max() / bf16[i].abs().max()).item<double>(),
                    (fp8[i] * bf16[i]).sum().item<double>() / (fp8[i].norm() * bf16[i].norm()).item<double>());
      }
    } catch (const std::exception& e) {
      std::printf("  fp8: %s\n", e.what());
    }
  }
}

// The sequences of `lengths` through the target one forward each, then packed into one forward.
void bench_packing(const target::ModelConfig& config, int64_t last, const std::vector<int64_t>& lengths) {
  std::vector<int64_t> cu{0};
  for (const int64_t n : lengths) cu.push_back(cu.back() + n);
  const at::Tensor ids = at::randint(0, config.vocab_size, {cu.back()}, at::TensorOptions().dtype(at::kLong));
  target::TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, false};
  for (const bool fp8 : {false, true}) {
    if (fp8 && target::fp8_gemm_unavailable(options.device)) continue;
    options.fp8_weights = fp8;
    auto model = target::random_target(config, last, options, 1);
    const double apart = median_ms(5, [&] {
      for (size_t i = 0; i + 1 < cu.size(); ++i) {
        model->forward(ids.narrow(0, cu[i], lengths[i]), {0, lengths[i]}, {last});
      }
    });
    const double packed = median_ms(5, [&] { model->forward(ids, cu, {last}); });
    std::printf("%s, %zu sequences, %lld tokens: one forward each %.2f ms, packed %.2f ms (%.2fx)\n",
                fp8 ? "fp8" : "bf16", lengths.size(), static_cast<long long>(cu.back()), apart, packed, apart / packed);
  }
}

// One MoE block at the config's expert shapes against its floor.
void bench_moe_block(const target::ModelConfig& config, double rate) {
  const int64_t tokens = kTokens;
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const int64_t h = config.hidden_size, e = config.num_experts, k = config.num_experts_per_tok;
  const int64_t inner = config.moe_intermediate_size, shared = config.shared_expert_intermediate_size;
  at::Tensor shared_gate, shared_up, shared_down, shared_expert_gate;
  if (shared > 0) {
    shared_gate = at::randn({shared, h}, bf16) * 0.02;
    shared_up = at::randn({shared, h}, bf16) * 0.02;
    shared_down = at::randn({h, shared}, bf16) * 0.02;
    shared_expert_gate = at::randn({1, h}, bf16) * 0.02;
  }
  const target::MoeWeights w = target::MoeWeights::make(
      at::randn({e, h}, bf16) * 0.02, at::randn({e, 2 * inner, h}, bf16) * 0.02, at::randn({e, h, inner}, bf16) * 0.02,
      shared_gate, shared_up, shared_down, shared_expert_gate);
  const target::MoeShape shape{e, k, inner, config.norm_topk_prob, shared};
  const at::Tensor x = at::randn({tokens, h}, bf16);
  const double grouped = median_ms(20, [&] { target::moe_grouped(shape, w, x); });
  const double reference = median_ms(5, [&] { target::moe_reference(shape, w, x); });
  const double flops = 2.0 * tokens * (h * e + 3.0 * h * inner * k + 3.0 * h * shared + h);
  const double floor_ms = flops / rate * 1e3;
  std::printf("one MoE block, %lld experts top-%lld, inner %lld, shared %lld, hidden %lld, %lld tokens (%.1f GFLOP)\n",
              static_cast<long long>(e), static_cast<long long>(k), static_cast<long long>(inner),
              static_cast<long long>(shared), static_cast<long long>(h), static_cast<long long>(tokens), flops / 1e9);
  std::printf("  %-40s %9s %10s\n", "", "ms", "x floor");
  std::printf("  %-40s %9.3f %10.2f\n", "floor (FLOPs at the matmul rate)", floor_ms, 1.0);
  std::printf("  %-40s %9.3f %10.2f\n", "grouped (device routing, grouped GEMMs)", grouped, grouped / floor_ms);
  std::printf("  %-40s %9.3f %10.2f\n", "reference (host loop over experts)", reference, reference / floor_ms);
  // The same experts block-scaled FP8 (target.dtype: float8): on the FP8 grouped GEMM, and
  // dequantized per call for the bf16 grouped GEMM (the path before it).
  target::MoeWeights fp8 = w;
  auto experts_fp8 = [](const at::Tensor& experts) {
    const int64_t count = experts.size(0), out = experts.size(1), in = experts.size(2);
    const target::Fp8Weight q = target::quantize_blocks(experts.reshape({count * out, in}));
    return target::Fp8Weight{q.data.view({count, out, in}), q.scale.view({count, out / 128, in / 128})};
  };
  if (!target::fp8_gemm_unavailable(x.device()) && (2 * inner) % 128 == 0 && h % 128 == 0) {
    fp8.fp8_gate_up = experts_fp8(w.experts_gate_up);
    fp8.fp8_down = experts_fp8(w.experts_down);
    fp8.experts_gate_up = fp8.experts_down = at::Tensor();
    const bool kernel = target::fp8_experts_grouped(fp8, x.device(), x.scalar_type());
    const double on_kernel = median_ms(20, [&] { target::moe_grouped(shape, fp8, x); });
    grouped_fp8::off = true;
    const double dequantized = median_ms(20, [&] { target::moe_grouped(shape, fp8, x); });
    grouped_fp8::off = false;
    std::printf("  %-40s %9.3f %10.2f%s\n", "grouped, FP8 experts (grouped FP8 GEMM)", on_kernel, on_kernel / floor_ms,
                kernel ? "" : "  (the kernel does not apply here)");
    std::printf("  %-40s %9.3f %10.2f\n", "grouped, FP8 experts dequantized", dequantized, dequantized / floor_ms);
    // Decode's sizes (a generate step of 64 or 128 sequences, a verify step's blocks): each
    // expert a few rows, its tiles mostly partial.
    for (const int64_t rows : {64, 128, 512}) {
      const at::Tensor xs = x.narrow(0, 0, rows);
      std::printf("  grouped, FP8 experts, %4lld tokens: %.4f ms\n", static_cast<long long>(rows),
                  median_ms(50, [&] { target::moe_grouped(shape, fp8, xs); }));
    }
  }
  // DFLASHD_PROFILE=1: the grouped block's kernels by GPU time (10 calls).
  if (std::getenv("DFLASHD_PROFILE") != nullptr) {
    bench::print_kernel_profile("MoE block, grouped, 10 calls", [&] {
      for (int i = 0; i < 10; ++i) target::moe_grouped(shape, w, x);
      c10::cuda::device_synchronize();
    });
  }
  if (std::getenv("DFLASHD_PROFILE") != nullptr && fp8.fp8_gate_up.defined()) {
    bench::print_kernel_profile("MoE block, grouped, FP8 experts, 10 calls", [&] {
      for (int i = 0; i < 10; ++i) target::moe_grouped(shape, fp8, x);
      c10::cuda::device_synchronize();
    });
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !at::hasCUDA()) {
    std::fprintf(stderr, "usage: target_bench CONFIG_DIR [LAST_LAYER] (needs a GPU)\n");
    return 2;
  }
  c10::InferenceMode inference;
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const at::Tensor a = at::randn({8192, 8192}, bf16), b = at::randn({8192, 8192}, bf16);
  const double mm = median_ms(10, [&] { at::mm(a, b); });
  const double rate = 2.0 * 8192.0 * 8192.0 * 8192.0 / (mm * 1e-3);
  std::printf("bf16 matmul 8192^3: %.3f ms = %.0f TFLOP/s\n", mm, rate / 1e12);

  const target::ModelConfig config = target::load_model_config(argv[1]);
  const int64_t last = argc > 2 ? std::atoll(argv[2]) : config.default_tapped_layers(5).back();
  if (argc > 3) {
    std::vector<int64_t> lengths;
    for (const char* at = argv[3]; *at != 0;) {
      char* end = nullptr;
      lengths.push_back(std::strtoll(at, &end, 10));
      at = *end == ',' ? end + 1 : end;
      if (lengths.back() <= 0 || (*end != ',' && *end != 0)) {
        std::fprintf(stderr, "target_bench: LENGTHS is a comma-separated list of positive lengths, not %s\n", argv[3]);
        return 2;
      }
    }
    bench_packing(config, last, lengths);
    return 0;
  }
  if (last >= 0) bench_forward(config, argv[1], last, rate);
  if (config.num_experts > 0) bench_moe_block(config, rate);
  return 0;
}
