// gemm_bench: the 27B target's projection GEMMs at a forward's and a decode step's rows, to
// choose how the target runs them (target/lt_gemm.h):
//   - bf16 aten: at::matmul; bf16 lt: lt_gemm_bf16 (cuBLASLt's heuristic's first algorithm with
//     32 MB of workspace); bf16 best: the fastest of every algorithm that heuristic offers;
//   - fp8 aten: ATen's _scaled_mm with the block scales (activations 1x128, weights 128x128);
//     fp8 lt: fp8_linear (lt_gemm_fp8, the same product through cuBLASLt with 32 MB).
// Each result is checked against aten's. Last, per row count, the GEMM time of one forward over
// layers 0..61 for each.
// `explore-fp8` / `explore-bf16` instead time the product through every configuration cuBLASLt
// lists (tiles, stages, cluster shapes, custom options; FP8 also with fast accumulation) against
// the heuristic's first; `explore-split-k` the bf16 product through the heuristic's first 8
// algorithms at every split-k and reduction scheme, the weights read from memory (4 copies);
// `stream` the stream-K GEMM against cuBLASLt's heuristic (and which the projections take);
// `grouped-fp8` the FP8 grouped GEMM (kernels/grouped_fp8.h) as one group against cuBLASLt's
// block-scaled product on the same operands.
// Usage: gemm_bench [explore-fp8 | explore-bf16 | explore-split-k | stream | grouped-fp8] [ROWS...]
//        (default: 3072 128)
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/core/InferenceMode.h>
#include <cublasLt.h>

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bench/timing.h"
#include "target/fp8.h"
#include "target/kernels/grouped_fp8.h"
#include "target/kernels/stream_gemm.h"
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

// One product y [m, n] = x [m, k] . W^T through cuBLASLt with a given algorithm (the column-major
// form of target/lt_gemm.cc: A is W transposed, B is x): bf16, or block-scaled FP8 when the
// operands are e4m3 (w_scale per 128x128 block of W, x_scale per 1x128 group of x), to try every
// algorithm the heuristic offers or every configuration cuBLASLt lists.
class LtProduct {
 public:
  LtProduct(cublasLtHandle_t handle, const at::Tensor& x, const at::Tensor& w, at::Tensor out,
            const float* w_scale = nullptr, const float* x_scale = nullptr, bool fast_accum = false)
      : handle_(handle), x_(x), w_(w), out_(std::move(out)) {
    const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
    const bool fp8 = w.scalar_type() == at::kFloat8_e4m3fn;
    in_ = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
    check(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "desc");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T, "transa");
    set(op_, CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N, "transb");
    if (fp8) {
      set(op_, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F, "scale mode a");
      set(op_, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F, "scale mode b");
      set(op_, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(w_scale), "scale a");
      set(op_, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(x_scale), "scale b");
      set(op_, CUBLASLT_MATMUL_DESC_FAST_ACCUM, static_cast<int8_t>(fast_accum), "fast accumulation");
    }
    check(cublasLtMatrixLayoutCreate(&a_, in_, k, n, k), "layout a");
    check(cublasLtMatrixLayoutCreate(&b_, in_, k, m, k), "layout b");
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
  // Every configuration of every algorithm cuBLASLt lists for these types that its check accepts
  // for this product: tiles x stages x cluster shapes x custom options (split-k 1).
  std::vector<cublasLtMatmulAlgo_t> configurations() const {
    std::vector<int> ids(64);
    int count = 0;
    check(cublasLtMatmulAlgoGetIds(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, in_, in_, CUDA_R_16BF, CUDA_R_16BF, 64,
                                   ids.data(), &count),
          "algorithm ids");
    std::vector<cublasLtMatmulAlgo_t> out;
    for (int i = 0; i < count; ++i) {
      cublasLtMatmulAlgo_t algo{};
      if (cublasLtMatmulAlgoInit(handle_, CUBLAS_COMPUTE_32F, CUDA_R_32F, in_, in_, CUDA_R_16BF, CUDA_R_16BF, ids[i],
                                 &algo) != CUBLAS_STATUS_SUCCESS) {
        continue;
      }
      const size_t before = out.size();
      expand(algo, out);
      if (print_ids_) std::printf("    algorithm id %d: %zu configurations pass cuBLASLt's check\n", ids[i], out.size() - before);
    }
    print_ids_ = false;
    return out;
  }
  // The configurations of one algorithm (e.g. the heuristic's) that the check accepts.
  std::vector<cublasLtMatmulAlgo_t> configurations_of(const cublasLtMatmulAlgo_t& algo) const {
    std::vector<cublasLtMatmulAlgo_t> out;
    expand(algo, out);
    return out;
  }
  // Whether cuBLASLt's check accepts a configuration for this product within the workspace.
  bool accepts(const cublasLtMatmulAlgo_t& algo) const {
    cublasLtMatmulHeuristicResult_t result{};
    return cublasLtMatmulAlgoCheck(handle_, op_, a_, b_, d_, d_, &algo, &result) == CUBLAS_STATUS_SUCCESS &&
           result.workspaceSize <= static_cast<size_t>(workspace_.numel());
  }
  void run(const cublasLtMatmulAlgo_t& algo) {
    const float alpha = 1.f, beta = 0.f;
    check(cublasLtMatmul(handle_, op_, &alpha, w_.data_ptr(), a_, x_.data_ptr(), b_, &beta, out_.data_ptr(), d_,
                         out_.data_ptr(), d_, &algo, workspace_.data_ptr(), workspace_.numel(),
                         at::cuda::getCurrentCUDAStream().stream()),
          "matmul");
  }

 private:
  static std::vector<uint32_t> capability(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoCapAttributes_t what) {
    size_t bytes = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, what, nullptr, 0, &bytes);
    std::vector<uint32_t> values(bytes / sizeof(uint32_t));
    if (!values.empty()) cublasLtMatmulAlgoCapGetAttribute(&algo, what, values.data(), bytes, &bytes);
    if (values.empty()) values.push_back(0);  // the capability lists nothing: leave it undefined
    return values;
  }
  void expand(cublasLtMatmulAlgo_t algo, std::vector<cublasLtMatmulAlgo_t>& out) const {
    int32_t custom_max = 0;
    size_t written = 0;
    cublasLtMatmulAlgoCapGetAttribute(&algo, CUBLASLT_ALGO_CAP_CUSTOM_OPTION_MAX, &custom_max, sizeof(custom_max),
                                      &written);
    const uint32_t clusters[] = {CUBLASLT_CLUSTER_SHAPE_AUTO, CUBLASLT_CLUSTER_SHAPE_1x1x1, CUBLASLT_CLUSTER_SHAPE_2x1x1,
                                 CUBLASLT_CLUSTER_SHAPE_1x2x1};
    for (const uint32_t tile : capability(algo, CUBLASLT_ALGO_CAP_TILE_IDS)) {
      for (const uint32_t stages : capability(algo, CUBLASLT_ALGO_CAP_STAGES_IDS)) {
        for (const uint32_t cluster : clusters) {
          for (uint32_t custom = 0; custom <= static_cast<uint32_t>(custom_max); ++custom) {
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile));
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages));
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster));
            cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION, &custom, sizeof(custom));
            cublasLtMatmulHeuristicResult_t result{};
            if (cublasLtMatmulAlgoCheck(handle_, op_, a_, b_, d_, d_, &algo, &result) == CUBLAS_STATUS_SUCCESS &&
                result.workspaceSize <= static_cast<size_t>(workspace_.numel())) {
              out.push_back(algo);
            }
          }
        }
      }
    }
  }

  cublasLtHandle_t handle_;
  at::Tensor x_, w_, out_, workspace_;
  cudaDataType_t in_ = CUDA_R_16BF;
  mutable bool print_ids_ = true;  // the first listing says how many configurations each id has
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
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID)) + " custom " +
         std::to_string(get(CUBLASLT_ALGO_CONFIG_CUSTOM_OPTION));
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

// One shape's product, bf16 or block-scaled FP8, through every configuration cuBLASLt lists (FP8
// with and without fast accumulation): the heuristic's first against the fastest that stays within
// 1e-2 of ATen's product. Returns {heuristic ms, fastest ms}.
std::pair<double, double> explore(cublasLtHandle_t handle, const Shape& s, int64_t m, bool fp8) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const at::Tensor w = (at::randn({s.n, s.k}, gpu) * 0.02).to(at::kBFloat16);
  const target::Fp8Weight q = target::quantize_blocks(w);
  const target::Fp8Activations act = target::quantize_groups(x, target::fp8_gemm_rows(m, x.device()));
  const at::Tensor reference =
      fp8 ? at::_scaled_mm(act.q, q.data.t(), act.factors, q.scale.t(), std::nullopt, std::nullopt, at::kBFloat16)
          : at::matmul(x, w.t());
  at::Tensor out = at::empty({reference.size(0), s.n}, gpu.dtype(at::kBFloat16));
  double heuristic = 0, fastest = 1e30;
  std::string best;
  size_t tried = 0;
  for (const bool fast : fp8 ? std::vector<bool>{false, true} : std::vector<bool>{false}) {
    LtProduct product = fp8 ? LtProduct(handle, act.q, q.data, out, q.scale.data_ptr<float>(),
                                        act.factors.data_ptr<float>(), fast)
                            : LtProduct(handle, x, w, out);
    std::vector<cublasLtMatmulHeuristicResult_t> first;
    try {
      first = product.algorithms(1);
    } catch (const std::exception& e) {
      std::printf("    %s%s\n", fast ? "fast accumulation: " : "", e.what());  // e.g. no such kernel
    }
    if (!fast) {
      heuristic = first.empty() ? 0 : bench::median_ms(10, [&] { product.run(first[0].algo); });
      std::printf("  %-12s m %5lld heuristic %.3f ms: %s\n", s.name, static_cast<long long>(m), heuristic,
                  first.empty() ? "none" : describe(first[0].algo).c_str());
    }
    std::vector<cublasLtMatmulAlgo_t> configurations = product.configurations();
    if (!first.empty()) {
      const auto around = product.configurations_of(first[0].algo);
      std::printf("    the heuristic's algorithm: %zu configurations pass the check\n", around.size());
      configurations.insert(configurations.end(), around.begin(), around.end());
    }
    for (const cublasLtMatmulAlgo_t& algo : configurations) {
      try {
        product.run(algo);
        ++tried;
        if (relative_error(out, reference) > 1e-2) continue;
        const double ms = bench::median_ms(5, [&] { product.run(algo); });
        if (ms < fastest) fastest = ms, best = describe(algo) + (fast ? " fast-accum" : "");
      } catch (const std::exception&) {
        continue;  // a configuration the check passed that still cannot run
      }
    }
  }
  const double flops = 2.0 * m * s.n * s.k;
  std::printf("%-12s m %5lld n %5lld k %5lld | %s heuristic %.3f ms (%.0f TFLOP/s) | fastest of %zu %.3f (%.0f; %s)\n",
              s.name, static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k),
              fp8 ? "fp8" : "bf16", heuristic, flops / heuristic / 1e9, tried, fastest, flops / fastest / 1e9,
              best.c_str());
  return {heuristic, fastest};
}

// Four copies of a shape's random weights: products rotated over them read W from memory, as a
// decoding step does, not from L2.
std::vector<at::Tensor> rotated_weights(const Shape& s) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  std::vector<at::Tensor> weights;
  for (int i = 0; i < 4; ++i) weights.push_back((at::randn({s.n, s.k}, gpu) * 0.02).to(at::kBFloat16));
  return weights;
}

// Two times per product (ms) summed over a forward over layers 0..61 (each shape per_forward times).
template <typename F>
std::pair<double, double> per_forward(F&& times) {
  double first = 0, second = 0;
  for (const Shape& s : kShapes) {
    const auto [a, b] = times(s);
    first += a * s.per_forward, second += b * s.per_forward;
  }
  return {first, second};
}

// bf16 at `m` rows with split-k (which `explore` leaves at 1): the heuristic's first 8 algorithms,
// each at split-k 1 .. 16 with every reduction scheme cuBLASLt's check accepts, the weights rotated
// over 4 copies (as a step reads them: from memory, not L2). Returns {heuristic ms, fastest ms}.
std::pair<double, double> explore_split_k(cublasLtHandle_t handle, const Shape& s, int64_t m) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const std::vector<at::Tensor> weights = rotated_weights(s);
  std::vector<std::unique_ptr<LtProduct>> products;
  at::Tensor out = at::empty({m, s.n}, gpu.dtype(at::kBFloat16));
  for (const at::Tensor& w : weights) products.push_back(std::make_unique<LtProduct>(handle, x, w, out));
  const at::Tensor reference = at::matmul(x, weights[0].t());
  auto rotated_ms = [&](const cublasLtMatmulAlgo_t& algo) {
    int i = 0;
    return bench::median_ms(12, [&] { products[static_cast<size_t>(i++ % 4)]->run(algo); });
  };
  const auto algorithms = products[0]->algorithms(8);
  if (algorithms.empty()) return {0, 0};
  const double heuristic = rotated_ms(algorithms[0].algo);
  double fastest = 1e30;
  std::string best;
  size_t tried = 0;
  const uint32_t schemes[] = {CUBLASLT_REDUCTION_SCHEME_NONE, CUBLASLT_REDUCTION_SCHEME_INPLACE,
                              CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE, CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE};
  for (const auto& result : algorithms) {
    for (const int32_t split : {1, 2, 3, 4, 5, 6, 8, 12, 16}) {
      for (const uint32_t scheme : schemes) {
        cublasLtMatmulAlgo_t algo = result.algo;
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &split, sizeof(split));
        cublasLtMatmulAlgoConfigSetAttribute(&algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME, &scheme, sizeof(scheme));
        if (!products[0]->accepts(algo)) continue;
        try {
          products[0]->run(algo);
          ++tried;
          if (relative_error(out, reference) > 1e-2) continue;
          const double ms = rotated_ms(algo);
          if (ms < fastest) fastest = ms, best = describe(algo) + " reduction " + std::to_string(scheme);
        } catch (const std::exception&) {
          continue;
        }
      }
    }
  }
  const double bytes = 2.0 * static_cast<double>(s.n) * static_cast<double>(s.k);
  std::printf("%-12s m %5lld n %5lld k %5lld | bf16, weights from memory: heuristic %.4f ms (%.2f TB/s: %s) | "
              "fastest of %zu split-k variants %.4f (%.2f TB/s: %s)\n",
              s.name, static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k), heuristic,
              bytes / heuristic / 1e9, describe(algorithms[0].algo).c_str(), tried, fastest, bytes / fastest / 1e9,
              best.c_str());
  return {heuristic, fastest};
}

// bf16 at `m` rows: the stream-K GEMM (kernels/stream_gemm.h, run directly) against cuBLASLt's
// heuristic (lt_gemm_bf16), 20 products back to back over 4 rotated copies of the weights (as a
// step reads them: from memory, launch gaps included), and which of the two the target's
// projections take (projection_bf16). Returns {cuBLASLt ms, stream-K ms} per product.
std::pair<double, double> stream_vs_lt(const Shape& s, int64_t m) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const std::vector<at::Tensor> weights = rotated_weights(s);
  const at::Tensor reference = at::matmul(x, weights[0].t());
  const at::Tensor workspace =
      at::zeros({static_cast<int64_t>(stream_gemm::workspace_bytes(0))}, gpu.dtype(at::kByte));
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(0).stream();
  const auto stream_k = [&](const at::Tensor& in, const at::Tensor& w) {
    at::Tensor y = at::empty({m, s.n}, gpu.dtype(at::kBFloat16));
    const stream_gemm::Problem p{in.data_ptr(), in.stride(0), w.data_ptr(), y.data_ptr(), m, s.n, s.k};
    stream_gemm::run(p, workspace.data_ptr(), 0, stream);
    return y;
  };
  const double error = relative_error(stream_k(x, weights[0]), reference);
  auto per_product_ms = [&](auto gemm) {
    return bench::median_ms(7, [&] {
             for (int i = 0; i < 20; ++i) gemm(x, weights[static_cast<size_t>(i % 4)]);
           }) / 20;
  };
  const double lt = per_product_ms(target::lt_gemm_bf16), ours = per_product_ms(stream_k);
  const stream_gemm::Problem shape{x.data_ptr(), s.k, weights[0].data_ptr(), nullptr, m, s.n, s.k};
  const double bytes = 2.0 * static_cast<double>(s.n) * static_cast<double>(s.k);
  std::printf("%-12s m %5lld n %5lld k %5lld | cuBLASLt %.4f ms (%.2f TB/s) | stream-K %.4f ms (%.2f TB/s, vs "
              "aten %.0e) | %.2fx | projections take %s\n",
              s.name, static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k), lt,
              bytes / lt / 1e9, ours, bytes / ours / 1e9, error, lt / ours,
              stream_gemm::preferred(shape) ? "stream-K" : "cuBLASLt");
  return {lt, ours};
}

// Block-scaled FP8 at `m` rows: the FP8 grouped GEMM with one group (every row, no ends) against
// cuBLASLt's (fp8_linear), the same quantised operands, 20 products back to back. Returns
// {cuBLASLt ms, grouped ms} per product.
std::pair<double, double> grouped_vs_lt(const Shape& s, int64_t m) {
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0);
  const at::Tensor x = at::randn({m, s.k}, gpu.dtype(at::kBFloat16));
  const target::Fp8Weight w = target::quantize_blocks(at::randn({s.n, s.k}, gpu) / std::sqrt(static_cast<double>(s.k)));
  const target::Fp8Activations a = target::quantize_groups(x, target::fp8_gemm_rows(m, x.device()));
  const target::Fp8Weight batch{w.data.unsqueeze(0), w.scale.unsqueeze(0)};
  const at::Tensor reference = target::fp8_linear(a, w, {});
  at::Tensor y = at::empty({m, s.n}, gpu.dtype(at::kBFloat16));
  grouped_fp8::Problem p;
  p.x = a.q.data_ptr(), p.x_stride = s.k, p.x_factors = a.factors.data_ptr<float>();
  p.factor_stride = target::factor_stride(a);
  p.w = batch.data.data_ptr(), p.w_factors = batch.scale.data_ptr<float>();
  p.y = y.data_ptr(), p.m = m, p.n = s.n, p.k = s.k;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(0).stream();
  grouped_fp8::run(p, 0, stream);
  const double error = relative_error(y, reference);
  const double lt = bench::median_ms(7, [&] {
                      for (int i = 0; i < 20; ++i) target::fp8_linear(a, w, {});
                    }) / 20;
  const double ours = bench::median_ms(7, [&] {
                        for (int i = 0; i < 20; ++i) grouped_fp8::run(p, 0, stream);
                      }) / 20;
  const double flops = 2.0 * static_cast<double>(m) * static_cast<double>(s.n) * static_cast<double>(s.k);
  std::printf("%-12s m %5lld n %5lld k %5lld | FP8 cuBLASLt %.4f ms (%.0f TFLOP/s) | grouped, one group %.4f ms "
              "(%.0f TFLOP/s, vs cuBLASLt %.0e) | %.2fx\n",
              s.name, static_cast<long long>(m), static_cast<long long>(s.n), static_cast<long long>(s.k), lt,
              flops / lt / 1e9, ours, flops / ours / 1e9, error, lt / ours);
  return {lt, ours};
}

}  // namespace

int main(int argc, char** argv) {
  if (!at::hasCUDA()) {
    std::fprintf(stderr, "gemm_bench needs a GPU\n");
    return 1;
  }
  c10::InferenceMode inference;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);  // lines out as they come, should a shape abort
  const std::string mode = argc > 1 && !std::isdigit(argv[1][0]) ? argv[1] : "";
  if (!mode.empty() && mode != "explore-fp8" && mode != "explore-bf16" && mode != "explore-split-k" &&
      mode != "stream" && mode != "grouped-fp8") {
    std::fprintf(stderr,
                 "gemm_bench: unknown mode %s (explore-fp8, explore-bf16, explore-split-k, stream or grouped-fp8)\n",
                 mode.c_str());
    return 1;
  }
  std::vector<int64_t> rows;
  for (int i = mode.empty() ? 1 : 2; i < argc; ++i) rows.push_back(std::atoll(argv[i]));
  if (rows.empty()) rows = {3072, 128};
  cublasLtHandle_t handle = nullptr;
  check(cublasLtCreate(&handle), "handle");
  for (const int64_t m : rows) {
    if (mode == "stream") {
      const auto [lt, ours] = per_forward([&](const Shape& s) { return stream_vs_lt(s, m); });
      std::printf("| %lld rows, bf16 GEMMs of a forward over layers 0..61, weights from memory | cuBLASLt %.2f ms | "
                  "stream-K %.2f |\n", static_cast<long long>(m), lt, ours);
      continue;
    }
    if (mode == "grouped-fp8") {
      const auto [lt, ours] = per_forward([&](const Shape& s) { return grouped_vs_lt(s, m); });
      std::printf("| %lld rows, FP8 GEMMs of a forward over layers 0..61 | cuBLASLt %.1f ms | the grouped kernel "
                  "%.1f |\n", static_cast<long long>(m), lt, ours);
      continue;
    }
    if (mode == "explore-split-k") {
      const auto [heuristic, fastest] = per_forward([&](const Shape& s) { return explore_split_k(handle, s, m); });
      std::printf("| %lld rows, bf16 GEMMs of a forward over layers 0..61, weights from memory | heuristic %.1f ms | "
                  "fastest split-k variant %.1f |\n", static_cast<long long>(m), heuristic, fastest);
      continue;
    }
    if (!mode.empty()) {
      const auto [heuristic, fastest] =
          per_forward([&](const Shape& s) { return explore(handle, s, m, mode == "explore-fp8"); });
      std::printf("| %lld rows, %s GEMMs of a forward over layers 0..61 | heuristic %.1f ms | fastest configuration "
                  "%.1f |\n", static_cast<long long>(m), mode.c_str() + 8, heuristic, fastest);
      continue;
    }
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
