// fp8_gemm_bench: the 27B target's projection GEMMs, bf16 against block-scaled FP8 (activations
// in 1x128 groups, weights in 128x128 blocks), to choose how target/fp8.cc runs them:
//   - bf16: at::matmul with the bf16 weight;
//   - aten: ATen's _scaled_mm with the block scales (what fp8_linear runs);
//   - lt #i: cuBLASLt called directly for the same product with each algorithm its heuristic
//     offers (32 MB of workspace), each checked against aten's result.
// Per shape: TFLOP/s of each and the fastest algorithm's configuration; last, the GEMM time of
// one forward over layers 0..61 (3072 tokens) with aten's choice and with the fastest algorithm.
// Usage: fp8_gemm_bench [ROWS...]   (default: 3072 128)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/InferenceMode.h>
#include <cublasLt.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "target/fp8.h"

using namespace dflash;

namespace {

// The projections of Qwen3.5-27B (bench/configs/qwen3_5-27b) and how many a forward over layers
// 0..61 runs: 47 GatedDeltaNet layers, 15 attention layers, 62 MLPs.
struct Shape {
  const char* name;
  int64_t n, k, per_forward;
};
constexpr Shape kShapes[] = {
    {"gdn in_proj", 16480, 5120, 47}, {"gdn out_proj", 5120, 6144, 47}, {"attn qkv", 14336, 5120, 15},
    {"attn o_proj", 5120, 6144, 15},  {"mlp gate_up", 34816, 5120, 62}, {"mlp down", 5120, 17408, 62},
};

void check(cublasStatus_t status, const char* what) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string(what) + ": cuBLASLt status " + std::to_string(static_cast<int>(status)));
  }
}

template <typename T>
void set(cublasLtMatmulDesc_t op, cublasLtMatmulDescAttributes_t attribute, const T& value, const char* what) {
  check(cublasLtMatmulDescSetAttribute(op, attribute, &value, sizeof(value)), what);
}

// One block-scaled product D [m, n] = act [m, k] . W^T through cuBLASLt: column-major D^T = W . act^T,
// so cuBLAS's A is the weight (128x128 blocks) and B the activations (1x128 groups), as ATen sets it.
class LtProduct {
 public:
  LtProduct(cublasLtHandle_t handle, const target::Fp8Activations& act, const target::Fp8Weight& w, at::Tensor out)
      : handle_(handle), act_(act), w_(w), out_(std::move(out)) {
    const int64_t m = act.q.size(0), n = w.data.size(0), k = w.data.size(1);
    check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "transa");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "transb");
    const void* a_scale = w.scale.data_ptr();
    const void* b_scale = act.factors.data_ptr();
    set(op_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, a_scale, "a scale");
    set(op_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, b_scale, "b scale");
    set(op_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, "a scale mode");
    set(op_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, "b scale mode");
    check(cublasLtMatrixLayoutCreate(&a_, CUDA_R_8F_E4M3, k, n, k), "layout a");
    check(cublasLtMatrixLayoutCreate(&b_, CUDA_R_8F_E4M3, k, m, k), "layout b");
    check(cublasLtMatrixLayoutCreate(&d_, CUDA_R_16BF, n, m, n), "layout d");
    check(cublasLtMatmulPreferenceCreate(&preference_), "preference");
    set_workspace();
  }
  ~LtProduct() {
    cublasLtMatmulPreferenceDestroy(preference_);
    cublasLtMatrixLayoutDestroy(d_);
    cublasLtMatrixLayoutDestroy(b_);
    cublasLtMatrixLayoutDestroy(a_);
    cublasLtMatmulDescDestroy(op_);
  }
  LtProduct(const LtProduct&) = delete;
  LtProduct& operator=(const LtProduct&) = delete;

  std::vector<cublasLtMatmulHeuristicResult_t> algorithms(int wanted) const {
    std::vector<cublasLtMatmulHeuristicResult_t> results(static_cast<size_t>(wanted));
    int found = 0;
    check(cublasLtMatmulAlgoGetHeuristic(handle_, op_, a_, b_, d_, d_, preference_, wanted, results.data(), &found),
          "heuristic");
    results.resize(static_cast<size_t>(found));
    return results;
  }
  void run(const cublasLtMatmulAlgo_t& algo) {
    const float alpha = 1.f, beta = 0.f;
    check(cublasLtMatmul(handle_, op_, &alpha, w_.data.data_ptr(), a_, act_.q.data_ptr(), b_, &beta, out_.data_ptr(),
                         d_, out_.data_ptr(), d_, &algo, workspace_.data_ptr(), workspace_.numel(),
                         at::cuda::getCurrentCUDAStream().stream()),
          "matmul");
  }

 private:
  void set_workspace() {
    workspace_ = at::empty({32 << 20}, out_.options().dtype(at::kByte));
    const uint64_t bytes = static_cast<uint64_t>(workspace_.numel());
    check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                                               sizeof(bytes)),
          "workspace");
  }
  cublasLtHandle_t handle_;
  target::Fp8Activations act_;
  target::Fp8Weight w_;
  at::Tensor out_, workspace_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulPreference_t preference_ = nullptr;
};

std::string describe(const cublasLtMatmulAlgo_t& algo) {
  auto get = [&](cublasLtMatmulAlgoConfigAttributes_t attribute) {
    int value = 0;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written);
    return value;
  };
  return "id " + std::to_string(get(CUBLASLT_ALGO_CONFIG_ID)) + " tile " + std::to_string(get(CUBLASLT_ALGO_CONFIG_TILE_ID)) +
         " stages " + std::to_string(get(CUBLASLT_ALGO_CONFIG_STAGES_ID)) + " split-k " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_SPLITK_NUM)) + " cluster " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID));
}

struct Row {
  double bf16_ms, aten_ms, best_ms;
};

Row bench_shape(cublasLtHandle_t handle, const Shape& s, int64_t m) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const at::Tensor w = (at::randn({s.n, s.k}, gpu) * 0.02).to(at::kBFloat16);
  const target::Fp8Weight q = target::quantize_blocks(w);
  const target::Fp8Activations act = target::quantize_groups(x, target::fp8_gemm_rows(m, x.device()));
  const double flops = 2.0 * m * s.n * s.k;
  auto tflops = [&](double ms) { return flops / (ms / 1e3) / 1e12; };

  const double bf16_ms = bench::median_ms(10, [&] { at::matmul(x, w.t()); });
  at::Tensor reference;
  const double aten_ms = bench::median_ms(10, [&] { reference = target::fp8_linear(act, q, {}); });
  LtProduct lt(handle, act, q, at::empty({act.q.size(0), s.n}, gpu.dtype(at::kBFloat16)));
  at::Tensor out = at::empty({act.q.size(0), s.n}, gpu.dtype(at::kBFloat16));
  LtProduct checked(handle, act, q, out);
  const auto algorithms = lt.algorithms(16);
  double best_ms = 1e30;
  std::string best;
  std::printf("%-12s m %5lld n %5lld k %5lld: bf16 %.3f ms (%.0f TFLOP/s), aten FP8 %.3f ms (%.0f)\n", s.name,
              static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k), bf16_ms,
              tflops(bf16_ms), aten_ms, tflops(aten_ms));
  for (size_t i = 0; i < algorithms.size(); ++i) {
    try {
      checked.run(algorithms[i].algo);
      const at::Tensor got = out.narrow(0, 0, m).to(at::kFloat), want = reference.to(at::kFloat);
      const double error = ((got - want).abs().max() / want.abs().max()).item<double>();
      const double ms = bench::median_ms(10, [&] { lt.run(algorithms[i].algo); });
      std::printf("  lt #%-2zu %.3f ms (%.0f TFLOP/s), vs aten %.1e, %s, workspace %zu\n", i, ms, tflops(ms), error,
                  describe(algorithms[i].algo).c_str(), algorithms[i].workspaceSize);
      if (error < 1e-2 && ms < best_ms) best_ms = ms, best = "#" + std::to_string(i) + " " + describe(algorithms[i].algo);
    } catch (const std::exception& e) {
      std::printf("  lt #%-2zu failed: %s\n", i, e.what());
    }
  }
  std::printf("  fastest: %s, %.3f ms (%.0f TFLOP/s, %.2fx aten)\n", best.c_str(), best_ms, tflops(best_ms),
              aten_ms / best_ms);
  return {bf16_ms, aten_ms, best_ms};
}

}  // namespace

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "fp8_gemm_bench needs a GPU\n");
    return 1;
  }
  c10::InferenceMode inference;
  std::vector<int64_t> rows;
  for (int i = 1; i < argc; ++i) rows.push_back(std::atoll(argv[i]));
  if (rows.empty()) rows = {3072, 128};
  cublasLtHandle_t handle = nullptr;
  check(cublasLtCreate(&handle), "handle");
  for (const int64_t m : rows) {
    Row total{0, 0, 0};
    for (const Shape& s : kShapes) {
      const Row r = bench_shape(handle, s, m);
      total.bf16_ms += r.bf16_ms * s.per_forward, total.aten_ms += r.aten_ms * s.per_forward;
      total.best_ms += r.best_ms * s.per_forward;
    }
    std::printf("| %lld rows, GEMMs of one forward over layers 0..61 | bf16 %.1f ms | aten FP8 %.1f ms | fastest "
                "cuBLASLt algorithm per shape %.1f ms |\n",
                static_cast<long long>(m), total.bf16_ms, total.aten_ms, total.best_ms);
  }
  cublasLtDestroy(handle);
  return 0;
}
