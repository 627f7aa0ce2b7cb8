// gemm_bench: the 27B target's projection GEMMs at a forward's and a decode step's rows, to
// choose how the target runs them (target/lt_gemm.h):
//   - bf16 aten: at::matmul; bf16 lt: lt_gemm_bf16 (cuBLASLt's heuristic's first algorithm with
//     32 MB of workspace); bf16 best: the fastest of every algorithm that heuristic offers;
//   - fp8 aten: ATen's _scaled_mm with the block scales (activations 1x128, weights 128x128);
//     fp8 lt: fp8_linear (lt_gemm_fp8, the same product through cuBLASLt with 32 MB).
// Each result is checked against aten's. Last, per row count, the GEMM time of one forward over
// layers 0..61 for each.
// Usage: gemm_bench [ROWS...]   (default: 3072 128)
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
#include "target/lt_gemm.h"

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

// One bf16 product y [m, n] = x [m, k] . W^T through cuBLASLt with a given algorithm (the
// column-major form of target/lt_gemm.cc: A is W transposed, B is x), to try every algorithm the
// heuristic offers.
class LtProduct {
 public:
  LtProduct(cublasLtHandle_t handle, const at::Tensor& x, const at::Tensor& w, at::Tensor out)
      : handle_(handle), x_(x), w_(w), out_(std::move(out)) {
    const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
    check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "transa");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "transb");
    check(cublasLtMatrixLayoutCreate(&a_, CUDA_R_16BF, k, n, k), "layout a");
    check(cublasLtMatrixLayoutCreate(&b_, CUDA_R_16BF, k, m, k), "layout b");
    check(cublasLtMatrixLayoutCreate(&d_, CUDA_R_16BF, n, m, n), "layout d");
    check(cublasLtMatmulPreferenceCreate(&preference_), "preference");
    workspace_ = at::empty({32 << 20}, out_.options().dtype(at::kByte));
    const uint64_t bytes = static_cast<uint64_t>(workspace_.numel());
    check(cublasLtMatmulPreferenceSetAttribute(preference_, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes,
                                               sizeof(bytes)),
          "workspace");
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
    check(cublasLtMatmul(handle_, op_, &alpha, w_.data_ptr(), a_, x_.data_ptr(), b_, &beta, out_.data_ptr(), d_,
                         out_.data_ptr(), d_, &algo, workspace_.data_ptr(), workspace_.numel(),
                         at::cuda::getCurrentCUDAStream().stream()),
          "matmul");
  }

 private:
  cublasLtHandle_t handle_;
  at::Tensor x_, w_, out_, workspace_;
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

// Milliseconds of each way for one shape.
struct Row {
  double bf16_aten, bf16_lt, bf16_best, fp8_aten, fp8_lt;
};

double relative_error(const at::Tensor& got, const at::Tensor& want) {
  return ((got.to(at::kFloat) - want.to(at::kFloat)).abs().max() / want.to(at::kFloat).abs().max()).item<double>();
}

Row bench_shape(cublasLtHandle_t handle, const Shape& s, int64_t m) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const at::Tensor w = (at::randn({s.n, s.k}, gpu) * 0.02).to(at::kBFloat16);
  const double flops = 2.0 * m * s.n * s.k;
  auto tflops = [&](double ms) { return flops / (ms / 1e3) / 1e12; };
  Row r{};

  at::Tensor bf16_reference, got;
  r.bf16_aten = bench::median_ms(10, [&] { bf16_reference = at::matmul(x, w.t()); });
  r.bf16_lt = bench::median_ms(10, [&] { got = target::lt_gemm_bf16(x, w); });
  const double lt_error = relative_error(got, bf16_reference);
  at::Tensor out = at::empty({m, s.n}, gpu.dtype(at::kBFloat16));
  LtProduct product(handle, x, w, out);
  r.bf16_best = 1e30;
  std::string best;
  const auto algorithms = product.algorithms(16);
  for (size_t i = 0; i < algorithms.size(); ++i) {
    try {
      product.run(algorithms[i].algo);
      if (relative_error(out, bf16_reference) > 1e-2) continue;
      const double ms = bench::median_ms(10, [&] { product.run(algorithms[i].algo); });
      if (ms < r.bf16_best) r.bf16_best = ms, best = "#" + std::to_string(i) + " " + describe(algorithms[i].algo);
    } catch (const std::exception&) {
      continue;  // an algorithm this shape cannot run
    }
  }

  const target::Fp8Weight q = target::quantize_blocks(w);
  const target::Fp8Activations act = target::quantize_groups(x, target::fp8_gemm_rows(m, x.device()));
  at::Tensor fp8_reference;
  r.fp8_aten = bench::median_ms(10, [&] {
    fp8_reference = at::_scaled_mm(act.q, q.data.t(), act.factors, q.scale.t(), std::nullopt, std::nullopt, at::kBFloat16);
  });
  r.fp8_lt = bench::median_ms(10, [&] { got = target::fp8_linear(act, q, {}); });
  const double fp8_error = relative_error(got, fp8_reference.narrow(0, 0, m));
  std::printf("%-12s m %5lld n %5lld k %5lld | bf16 aten %.3f ms (%.0f TFLOP/s) lt %.3f (%.0f, vs aten %.0e) best of %zu "
              "%.3f (%.0f; %s) | fp8 aten %.3f (%.0f) lt %.3f (%.0f, vs aten %.0e)\n",
              s.name, static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k), r.bf16_aten,
              tflops(r.bf16_aten), r.bf16_lt, tflops(r.bf16_lt), lt_error, algorithms.size(), r.bf16_best,
              tflops(r.bf16_best), best.c_str(), r.fp8_aten, tflops(r.fp8_aten), r.fp8_lt, tflops(r.fp8_lt), fp8_error);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "gemm_bench needs a GPU\n");
    return 1;
  }
  c10::InferenceMode inference;
  std::vector<int64_t> rows;
  for (int i = 1; i < argc; ++i) rows.push_back(std::atoll(argv[i]));
  if (rows.empty()) rows = {3072, 128};
  cublasLtHandle_t handle = nullptr;
  check(cublasLtCreate(&handle), "handle");
  for (const int64_t m : rows) {
    Row total{};
    for (const Shape& s : kShapes) {
      const Row r = bench_shape(handle, s, m);
      total.bf16_aten += r.bf16_aten * s.per_forward, total.bf16_lt += r.bf16_lt * s.per_forward;
      total.bf16_best += r.bf16_best * s.per_forward, total.fp8_aten += r.fp8_aten * s.per_forward;
      total.fp8_lt += r.fp8_lt * s.per_forward;
    }
    std::printf("| %lld rows, GEMMs of a forward over layers 0..61 | bf16 aten %.1f ms | bf16 lt %.1f | bf16 best algorithm "
                "%.1f | fp8 aten %.1f | fp8 lt %.1f |\n",
                static_cast<long long>(m), total.bf16_aten, total.bf16_lt, total.bf16_best, total.fp8_aten, total.fp8_lt);
  }
  cublasLtDestroy(handle);
  return 0;
}
