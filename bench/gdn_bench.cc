// gdn_bench: the GatedDeltaNet fast path on the GPU (issue: GatedDeltaNet kernels).
//   1. One GatedDeltaNet core at the Qwen3.5-27B shape (Hk 16, Hv 48, head 128): our kernels
//      (prepare + state + output, fp32 o out, and with the state pass at 64/32/128 value
//      columns per CTA), the conv+SiLU+L2 kernel, and the reference path (libtorch ops), at
//      2048..16384 tokens, batch 1 and packed. CUDA events, inputs rotated beyond L2.
//   2. A whole 27B-shaped target forward (random weights, up to layer 61, 3072 and 4096
//      tokens): time, tokens/s, and MFU against the bf16 matmul rate measured here.
// The Python peers (FLA, transformers' fallback) run beside it from bench/run_h200.sh gdn.
// Usage: gdn_bench <directory with the 27B config.json> [core | decode]   (bench/configs/qwen3_5-27b;
//        `core`: the core table only, batch-1 4096 and 16384 tokens, no whole forward;
//        `decode`: one decoding step's state update at 64 and 128 sequences against a copy)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "common/kernel_variants.h"
#include "bench/kernel_profile.h"
#include "pipeline/flops.h"
#include "target/gated_delta_net.h"
#include "target/gdn_cuda.h"
#include "target/kernels/gated_delta_net.h"
#include "target/model.h"

using namespace dflash;

namespace {

// Mean milliseconds per call over `repeats` calls between two CUDA events, after a warm-up.
double cuda_ms(int repeats, const std::function<void(int)>& f) {
  f(0);
  c10::cuda::device_synchronize();
  at::cuda::CUDAEvent start(cudaEventDefault), end(cudaEventDefault);
  start.record();
  for (int i = 0; i < repeats; ++i) f(i);
  end.record();
  end.synchronize();
  return start.elapsed_time(end) / repeats;
}

struct Inputs {
  at::Tensor mixed, raw, conv_weight, positions, g, beta;
  at::Tensor z, norm_weight;  // the gated RMSNorm's gate and weight (what the model runs)
  target::GdnChunkPlan plan;
  at::Tensor q, k, v;  // fp32 views for the reference
  std::vector<int64_t> cu;
};

Inputs make_inputs(const std::vector<int64_t>& lengths, int64_t hk, int64_t hv) {
  Inputs in;
  in.cu = {0};
  std::vector<int64_t> positions;
  for (int64_t l : lengths) {
    in.cu.push_back(in.cu.back() + l);
    for (int64_t t = 0; t < l; ++t) positions.push_back(t);
  }
  const int64_t n = in.cu.back();
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  const int64_t channels = (2 * hk + hv) * 128;
  in.raw = at::randn({n, channels}, cuda).to(at::kBFloat16);
  in.conv_weight = (0.5 * at::randn({channels, 4}, cuda)).to(at::kBFloat16);
  in.positions = at::tensor(positions, at::TensorOptions().dtype(at::kLong)).to(at::kCUDA);
  in.mixed = target::conv1d_silu_l2norm_cuda(in.raw, in.conv_weight, in.positions, 2 * hk * 128);
  in.g = -(0.05 + 0.95 * at::rand({n, hv}, cuda));
  in.beta = at::sigmoid(at::randn({n, hv}, cuda));
  in.plan = target::make_gdn_chunk_plan(in.cu, at::kCUDA);
  in.z = at::randn({n, hv, 128}, cuda).to(at::kBFloat16);
  in.norm_weight = (1.0 + 0.1 * at::randn({128}, cuda)).to(at::kBFloat16);
  const at::Tensor f = in.mixed.to(at::kFloat);
  in.q = f.narrow(1, 0, hk * 128).view({n, hk, 128});
  in.k = f.narrow(1, hk * 128, hk * 128).view({n, hk, 128});
  in.v = f.narrow(1, 2 * hk * 128, hv * 128).view({n, hv, 128});
  return in;
}

// One row of the core table: every variant on one batch of sequences.
void time_core(const std::vector<int64_t>& lengths, int64_t hk, int64_t hv) {
  // Rotate over enough input sets to exceed the 60 MB L2.
  std::vector<Inputs> sets;
  int64_t n = 0;
  for (int64_t l : lengths) n += l;
  const int copies = n >= 8192 ? 2 : 4;
  for (int i = 0; i < copies; ++i) sets.push_back(make_inputs(lengths, hk, hv));
  // `sync`: the mma.sync state pass forced while timed.
  auto core = [&](int columns, bool sync = false, at::ScalarType o_dtype = at::kFloat) {
    force_mma_sync(MmaKernels::gated_delta_net, sync);
    const double ms = cuda_ms(20, [&](int i) {
      const Inputs& in = sets[i % copies];
      target::gated_delta_rule_cuda(in.mixed, hk, hv, target::GdnGates::precomputed(in.g, in.beta), in.plan, {}, {}, 1e-6, columns,
                                    nullptr, o_dtype);
    });
    force_mma_sync(MmaKernels::gated_delta_net, false);
    return ms;
  };
  const double ours = core(64), ours_bf16 = core(64, false, at::kBFloat16), sync64 = core(64, true), ours32 = core(32), ours128 = core(128);
  // With the gated RMSNorm fused (z read, bf16 out): what the target model runs per layer.
  const double normed = cuda_ms(20, [&](int i) {
    const Inputs& in = sets[i % copies];
    target::gated_delta_rule_cuda(in.mixed, hk, hv, target::GdnGates::precomputed(in.g, in.beta), in.plan, in.z, in.norm_weight);
  });
  const double conv = cuda_ms(20, [&](int i) {
    const Inputs& in = sets[i % copies];
    target::conv1d_silu_l2norm_cuda(in.raw, in.conv_weight, in.positions, 2 * hk * 128);
  });
  const double reference = cuda_ms(3, [&](int i) {
    const Inputs& in = sets[i % copies];
    target::chunk_gated_delta_rule_packed_reference(in.q, in.k, in.v, in.g, in.beta, in.cu);
  });
  // Agreement with the reference on this input (relative L2), so a fast wrong kernel shows.
  const Inputs& in = sets[0];
  const at::Tensor o = target::gated_delta_rule_cuda(in.mixed, hk, hv, target::GdnGates::precomputed(in.g, in.beta), in.plan);
  const at::Tensor r = target::chunk_gated_delta_rule_packed_reference(in.q, in.k, in.v, in.g, in.beta, in.cu);
  const double error = ((o - r).norm() / r.norm()).item<double>();
  // Where our time goes: the three kernels of one call (median of 5).
  std::vector<std::array<float, 3>> stages(5);
  for (auto& st : stages) target::gated_delta_rule_cuda(in.mixed, hk, hv, target::GdnGates::precomputed(in.g, in.beta), in.plan, {}, {}, 1e-6, 64, st.data());
  std::sort(stages.begin(), stages.end(), [](const auto& x, const auto& y) { return x[0] + x[1] + x[2] < y[0] + y[1] + y[2]; });
  std::string batch = std::to_string(lengths.size()) + "x" + std::to_string(lengths[0]);
  std::printf("%-14s %8lld %8.3f %8.3f %8.3f %8.3f %8.3f %8.3f %10.3f %12.3f %10.1f   rel.err %.1e  prepare/state/output %.3f/%.3f/%.3f\n",
              batch.c_str(), static_cast<long long>(n), ours, ours_bf16, normed, sync64, ours32, ours128, conv, reference, reference / ours, error,
              stages[2][0], stages[2][1], stages[2][2]);
}

// The same step with the states' stores deferred (gated_delta_rule_decode_step_deferred_cuda): each
// set's logs filled by kGdnDeferTokens steps first, then steps with every count at or past that
// (each step 1/8 of the heads store), rotating over the four state sets as above.
void time_deferred_step(const std::vector<at::Tensor>& states, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta, double step) {
  const int64_t sequences = q.size(0), hk = q.size(2), hv = v.size(2);
  const auto cuda = at::TensorOptions().device(at::kCUDA);
  auto addresses = [&](const at::Tensor& batch) {
    std::vector<int64_t> rows;
    for (int64_t r = 0; r < batch.size(0); ++r) {
      rows.push_back(reinterpret_cast<int64_t>(static_cast<char*>(batch.data_ptr()) +
                                               r * batch.stride(0) * static_cast<int64_t>(batch.element_size())));
    }
    return at::tensor(rows, at::kLong).to(at::kCUDA);
  };
  std::vector<at::Tensor> logs, state_rows, log_rows, counts;
  for (const at::Tensor& set : states) {
    const target::kernels::GdnDecodeLog layout{static_cast<int>(hk), static_cast<int>(hv)};
    logs.push_back(at::zeros({sequences, layout.bytes()}, cuda.dtype(at::kByte)));
    state_rows.push_back(addresses(set));
    log_rows.push_back(addresses(logs.back()));
  }
  constexpr int64_t kDefer = target::kernels::kGdnDeferTokens;
  for (int64_t n = 0; n < 2 * kDefer; ++n) counts.push_back(at::full({sequences}, n, cuda.dtype(at::kLong)));
  auto run = [&](int set, int64_t n) {
    (void)target::gated_delta_rule_decode_step_deferred_cuda(q, k, v, g, beta, state_rows[set],
                                                             {log_rows[set], counts[static_cast<size_t>(n)]});
  };
  for (int set = 0; set < 4; ++set) {
    for (int64_t n = 0; n < kDefer; ++n) run(set, n);
  }
  // Iteration i steps set i % 4 at count 8 + (i / 4) % 8: every set's counts advance by one each
  // time it steps, as a decoding loop's do.
  const double deferred = cuda_ms(32, [&](int i) { run(i % 4, kDefer + (i / 4) % kDefer); });
  const double stores = cuda_ms(4, [&](int i) {
    target::gated_delta_rule_store_deferred_cuda(state_rows[i % 4], {log_rows[i % 4], counts[7]}, hk, hv);
  });
  std::printf("decode step, %lld sequences, bf16 states, stores deferred: step %.3f ms (%.2fx the step above); "
              "all stored at once %.3f ms\n",
              static_cast<long long>(sequences), deferred, step / deferred, stores);
}

// One decoding step's state update (decode_token kernels: one token per sequence) at 27B shapes,
// `sequences` at once, against a plain copy of the same bytes (the rate a kernel that reads and
// writes each state once could reach) and a plain read (a sum). Four state sets rotated (each
// beyond L2).
void time_decode_step(int64_t sequences, int64_t hk, int64_t hv, at::ScalarType state_dtype) {
  const auto bf16 = at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16);
  const auto f32 = bf16.dtype(at::kFloat);
  const at::Tensor q = at::randn({sequences, 1, hk, 128}, bf16), k = at::randn({sequences, 1, hk, 128}, bf16);
  const at::Tensor v = at::randn({sequences, 1, hv, 128}, bf16);
  const at::Tensor g = -at::rand({sequences, 1, hv}, f32), beta = at::rand({sequences, 1, hv}, f32);
  std::vector<at::Tensor> states, copies;
  for (int i = 0; i < 4; ++i) {
    states.push_back(at::randn({sequences, hv, 128, 128}, f32).mul_(0.1).to(state_dtype));
    copies.push_back(at::empty_like(states.back()));
  }
  const double bytes = 2.0 * static_cast<double>(states[0].nbytes());
  const double step =
      cuda_ms(20, [&](int i) { target::gated_delta_rule_decode_step_cuda(q, k, v, g, beta, states[i % 4]); });
  const double copy = cuda_ms(20, [&](int i) { copies[i % 4].copy_(states[(i + 1) % 4]); });
  const double read = cuda_ms(20, [&](int i) { (void)states[i % 4].sum(); });
  std::printf("decode step, %lld sequences, %s states (%.0f MB read + written): step %.3f ms (%.2f TB/s); copy %.3f ms "
              "(%.2f TB/s); read %.3f ms (%.2f TB/s)\n",
              static_cast<long long>(sequences), state_dtype == at::kBFloat16 ? "bf16" : "fp32", bytes / 2e6, step,
              bytes / step / 1e9, copy, bytes / copy / 1e9, read, bytes / 2 / read / 1e9);
  if (state_dtype == at::kBFloat16) time_deferred_step(states, q, k, v, g, beta, step);
}

// The whole 27B-shaped target forward at 3072 and 4096 tokens, MFU against the measured matmul
// rate; with `profile`, the kernels of the 3072-token forward.
void time_target(const char* config_dir, bool profile) {
  // bf16 matmul rate of this GPU (the MFU denominator).
  const at::Tensor a = at::randn({8192, 8192}, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  const at::Tensor b = at::randn({8192, 8192}, a.options());
  const double mm = cuda_ms(20, [&](int) { at::mm(a, b); });
  const double matmul_rate = 2.0 * 8192.0 * 8192.0 * 8192.0 / (mm * 1e-3);
  std::printf("bf16 matmul 8192^3: %.3f ms = %.0f TFLOP/s\n", mm, matmul_rate / 1e12);
  const target::ModelConfig config = target::load_model_config(config_dir);
  const int64_t last = std::min<int64_t>(61, config.num_layers - 1);
  target::TargetOptions options{at::Device(at::kCUDA, 0), at::kBFloat16, false};
  auto model = target::random_target(config, last, options, 1);
  std::printf("target %s to layer %lld, random weights; %s\n", config_dir,
              static_cast<long long>(last), model->kernel_paths().at("target.linear_attention").str().c_str());
  std::printf("%8s %10s %12s %8s %12s\n", "tokens", "seconds", "tokens/s", "MFU", "of 989 peak");
  for (int64_t tokens : {3072, 4096}) {
    const at::Tensor ids = at::randint(0, config.vocab_size, {tokens}, at::TensorOptions().dtype(at::kLong));
    std::vector<double> times;
    for (int i = 0; i < 4; ++i) {
      c10::cuda::device_synchronize();
      const auto t0 = std::chrono::steady_clock::now();
      model->forward(ids, {0, tokens}, {last});
      c10::cuda::device_synchronize();
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin() + 1, times.end());  // the first is the warm-up
    const double s = times[2];
    const double flops = pipeline::target_flops(config, last, tokens);
    std::printf("%8lld %10.4f %12.0f %7.1f%% %11.1f%%\n", static_cast<long long>(tokens), s, tokens / s,
                100.0 * flops / s / matmul_rate, 100.0 * flops / s / 989e12);
    if (profile && tokens == 3072) {
      bench::print_kernel_profile("target forward, 3072 tokens", [&] {
        model->forward(ids, {0, tokens}, {last});
        c10::cuda::device_synchronize();
      });
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !at::hasCUDA()) {
    std::fprintf(stderr, "usage: gdn_bench <directory with a Qwen3.5-27B config.json> [core] (needs a GPU)\n");
    return 2;
  }
  c10::InferenceMode inference;
  const int64_t hk = 16, hv = 48;
  std::printf("GatedDeltaNet core, Hk %lld / Hv %lld / head 128, bf16 in, fp32 state; ms per call (CUDA events)\n",
              static_cast<long long>(hk), static_cast<long long>(hv));
  // ours: the default kernels (on an H200 the fused wgmma state + output kernel), o in fp32; bf16 o: the same with o
  // in bf16 (FLA's output); sync/64, /32, /128: the mma.sync state pass with 64, 32 or 128 value columns per CTA
  // (force_mma_sync for sync/64). +norm: ours with the gated RMSNorm fused (z in, bf16 out), as the target
  // model calls it.
  std::printf("%-14s %8s %8s %8s %8s %8s %8s %8s %10s %12s %10s\n", "batch", "tokens", "ours", "bf16 o", "+norm", "sync/64",
              "sync/32", "sync/128", "conv+l2", "reference", "ref/ours");
  // DFLASHD_PROFILE=1: only the whole forward, then its kernels by GPU time.
  const bool profile = std::getenv("DFLASHD_PROFILE") != nullptr;
  std::vector<std::vector<int64_t>> shapes = {{2048}, {4096}, {8192}, {16384}, {1024, 1024, 1024, 1024},
                                              {4096, 4096, 4096, 4096}};
  if (argc > 2 && std::string(argv[2]) == "decode") {
    for (const int64_t sequences : {64, 128}) {
      for (const at::ScalarType dtype : {at::kBFloat16, at::kFloat}) time_decode_step(sequences, hk, hv, dtype);
    }
    return 0;
  }
  const bool core_only = argc > 2 && std::string(argv[2]) == "core";
  if (core_only) shapes = {{4096}, {16384}};
  if (profile) shapes.clear();
  for (const auto& lengths : shapes) time_core(lengths, hk, hv);
  if (!core_only) time_target(argv[1], profile);
  return 0;
}
