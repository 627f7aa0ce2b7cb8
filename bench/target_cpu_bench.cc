// target_cpu_bench: CPU timings of the target engine's reference path (issue: target engine):
// the tiny preset models' forward over three sequences, and the chunked GatedDeltaNet
// reference at growing lengths, whose time must grow linearly (the chunk loop is the only
// sequential part). Usage: target_cpu_bench   (any machine; prints one table)
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/InferenceMode.h>

#include <algorithm>
#include <chrono>
#include <cstdio>

#include "target/gated_delta_net.h"
#include "target/model.h"

using namespace dflash;

template <class F>
double median_seconds(int repeats, F f) {
  std::vector<double> t;
  f();  // warm-up
  for (int i = 0; i < repeats; ++i) {
    const auto a = std::chrono::steady_clock::now();
    f();
    t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - a).count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

int main() {
  c10::InferenceMode inference;
  std::printf("tiny preset forward, fp32, CPU (%d threads), 3 packed sequences of 150/37/65 tokens, all layers\n",
              at::get_num_threads());
  for (const char* preset : {"tiny-qwen3_5", "tiny-qwen3_next", "tiny-qwen3", "tiny-llama"}) {
    const auto config = target::parse_model_config(target::preset_config_json(preset), preset);
    auto model = target::random_target(config, config.num_layers - 1, target::TargetOptions{}, 1);
    const at::Tensor ids = at::randint(0, config.vocab_size, {252}, at::TensorOptions().dtype(at::kLong));
    std::vector<int64_t> layers;
    for (int64_t i = 0; i < config.num_layers; ++i) layers.push_back(i);
    const double s = median_seconds(5, [&] { model->forward(ids, {0, 150, 187, 252}, layers); });
    std::printf("  %-16s %7.2f ms\n", preset, s * 1e3);
  }
  std::printf("GatedDeltaNet reference (chunked, fp32), Hk 2 / Hv 6, dk = dv = 64, CPU\n");
  std::printf("  %8s %10s %14s\n", "tokens", "ms", "us per token");
  for (int64_t T : {1024, 2048, 4096, 8192, 16384}) {
    const at::Tensor q = at::randn({T, 2, 64}), k = at::randn({T, 2, 64}), v = at::randn({T, 6, 64});
    const at::Tensor g = -at::rand({T, 6}), beta = at::rand({T, 6});
    const double s = median_seconds(3, [&] { target::chunk_gated_delta_rule_reference(q, k, v, g, beta); });
    std::printf("  %8lld %10.2f %14.2f\n", static_cast<long long>(T), s * 1e3, s * 1e6 / T);
  }
  return 0;
}
