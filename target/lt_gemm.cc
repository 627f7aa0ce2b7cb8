#include "target/lt_gemm.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublasLt.h>

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>

#include "target/kernels/stream_gemm.h"

namespace dflash::target {
namespace {

constexpr int64_t kWorkspaceBytes = 32 << 20;

void check(cublasStatus_t status, const char* what, int64_t m, int64_t n, int64_t k) {
  if (status != CUBLAS_STATUS_SUCCESS) {
    throw std::runtime_error(std::string("cuBLASLt ") + what + " for the target's GEMM " + std::to_string(m) + " x " +
                             std::to_string(k) + " -> " + std::to_string(n) + ": status " +
                             std::to_string(static_cast<int>(status)));
  }
}

cudaDataType_t cuda_type(at::ScalarType t) {
  switch (t) {
    case at::kBFloat16: return CUDA_R_16BF;
    case at::kHalf: return CUDA_R_16F;
    case at::kFloat: return CUDA_R_32F;
    case at::kFloat8_e4m3fn: return CUDA_R_8F_E4M3;
    default: throw std::invalid_argument(std::string("cuBLASLt GEMM: no type for ") + c10::toString(t));
  }
}

// What a shape's plan depends on. The scale pointers are set on the descriptor per call; a plan
// belongs to one thread, so no two calls share a descriptor at once.
struct Key {
  int device;
  int64_t m, n, k, x_stride;
  at::ScalarType in, out;
  bool operator<(const Key& o) const {
    return std::tie(device, m, n, k, x_stride, in, out) < std::tie(o.device, o.m, o.n, o.k, o.x_stride, o.in, o.out);
  }
};

// Descriptors of one product D^T [n, m] = W [n, k] . X^T in cuBLAS's column-major terms: A is W
// (k x n, transposed), B is X (k x m), D n x m; the algorithm the heuristic chose.
class Plan {
 public:
  // scales: the first call's factor pointers (FP8; cuBLASLt's heuristic wants them set).
  Plan(const Key& key, const float* w_scale, const float* x_scale) : key_(key) {
    try {
      build(w_scale, x_scale);
    } catch (...) {
      release();  // a constructor that throws runs no destructor
      throw;
    }
  }
  ~Plan() { release(); }
  Plan(const Plan&) = delete;
  Plan& operator=(const Plan&) = delete;

  void run(const void* w, const void* x, void* y, const float* w_scale, const float* x_scale, void* workspace,
           cudaStream_t stream) {
    if (w_scale != nullptr) set_scales(w_scale, x_scale);
    const float alpha = 1.f, beta = 0.f;
    attempt(cublasLtMatmul(at::cuda::getCurrentCUDABlasLtHandle(), op_, &alpha, w, a_, x, b_, &beta, y, d_, y, d_,
                           &algo_, workspace, kWorkspaceBytes, stream),
            "matmul");
  }

 private:
  void build(const float* w_scale, const float* x_scale) {
    const Key& key = key_;
    const bool fp8 = key.in == at::kFloat8_e4m3fn;
    attempt(cublasLtMatmulDescCreate(&op_, CUBLAS_COMPUTE_32F, CUDA_R_32F), "descriptor");
    set(CUBLASLT_MATMUL_DESC_TRANSA, CUBLAS_OP_T);
    set(CUBLASLT_MATMUL_DESC_TRANSB, CUBLAS_OP_N);
    if (fp8) {
      set(CUBLASLT_MATMUL_DESC_A_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F);
      set(CUBLASLT_MATMUL_DESC_B_SCALE_MODE, CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F);
      set_scales(w_scale, x_scale);
    }
    attempt(cublasLtMatrixLayoutCreate(&a_, cuda_type(key.in), key.k, key.n, key.k), "layout of W");
    attempt(cublasLtMatrixLayoutCreate(&b_, cuda_type(key.in), key.k, key.m, key.x_stride), "layout of x");
    attempt(cublasLtMatrixLayoutCreate(&d_, cuda_type(key.out), key.n, key.m, key.n), "layout of y");
    cublasLtMatmulPreference_t preference = nullptr;
    attempt(cublasLtMatmulPreferenceCreate(&preference), "preference");
    const uint64_t bytes = kWorkspaceBytes;
    cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof(bytes));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(at::cuda::getCurrentCUDABlasLtHandle(), op_, a_, b_,
                                                                 d_, d_, preference, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(preference);
    attempt(status, "heuristic");
    if (found == 0) attempt(CUBLAS_STATUS_NOT_SUPPORTED, "heuristic (no algorithm)");
    algo_ = result.algo;
  }
  void release() {
    if (d_) cublasLtMatrixLayoutDestroy(d_);
    if (b_) cublasLtMatrixLayoutDestroy(b_);
    if (a_) cublasLtMatrixLayoutDestroy(a_);
    if (op_) cublasLtMatmulDescDestroy(op_);
    d_ = b_ = a_ = nullptr;
    op_ = nullptr;
  }
  void attempt(cublasStatus_t status, const char* what) const { check(status, what, key_.m, key_.n, key_.k); }
  void set_scales(const float* w_scale, const float* x_scale) {
    set(CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, static_cast<const void*>(w_scale));
    set(CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, static_cast<const void*>(x_scale));
  }
  template <typename T>
  void set(cublasLtMatmulDescAttributes_t attribute, const T& value) {
    attempt(cublasLtMatmulDescSetAttribute(op_, attribute, &value, sizeof(value)), "descriptor attribute");
  }
  Key key_;
  cublasLtMatmulDesc_t op_ = nullptr;
  cublasLtMatrixLayout_t a_ = nullptr, b_ = nullptr, d_ = nullptr;
  cublasLtMatmulAlgo_t algo_{};
};

// This thread's plans and workspaces (one per stream: a workspace is busy until its GEMM ends on
// that stream; the next GEMM of the same stream runs after it).
struct ThreadState {
  std::map<Key, std::unique_ptr<Plan>> plans;
  std::map<cudaStream_t, at::Tensor> workspaces;
  std::map<cudaStream_t, at::Tensor> stream_gemm_workspaces;
};

ThreadState& thread_state() {
  thread_local ThreadState state;
  return state;
}

// `stream`'s buffer in `buffers`, allocated at its first use (bytes() of them, zeroed if asked).
template <typename Bytes>
void* stream_buffer(std::map<cudaStream_t, at::Tensor>& buffers, cudaStream_t stream, at::Device device,
                    Bytes bytes, bool zeroed) {
  at::Tensor& w = buffers[stream];
  if (!w.defined()) {
    const auto options = at::TensorOptions().dtype(at::kByte).device(device);
    w = zeroed ? at::zeros({bytes()}, options) : at::empty({bytes()}, options);
  }
  return w.data_ptr();
}

void* workspace(at::Device device, cudaStream_t stream) {
  return stream_buffer(thread_state().workspaces, stream, device, [] { return kWorkspaceBytes; }, false);
}

Plan& plan(const Key& key, const float* w_scale = nullptr, const float* x_scale = nullptr) {
  std::unique_ptr<Plan>& p = thread_state().plans[key];
  if (!p) p = std::make_unique<Plan>(key, w_scale, x_scale);
  return *p;
}

}  // namespace

at::Tensor lt_gemm_fp8(const Fp8Activations& a, const Fp8Weight& w) {
  const int64_t m = a.q.size(0), n = w.data.size(0), k = w.data.size(1);
  const at::Device device = a.q.device();
  const c10::cuda::CUDAGuard guard(device);  // the handle and stream of a's device
  at::Tensor y = at::empty({m, n}, a.q.options().dtype(a.dtype));
  if (m == 0) return y;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  plan({device.index(), m, n, k, k, at::kFloat8_e4m3fn, a.dtype}, w.scale.data_ptr<float>(), a.factors.data_ptr<float>())
      .run(w.data.data_ptr(), a.q.data_ptr(), y.data_ptr(), w.scale.data_ptr<float>(), a.factors.data_ptr<float>(),
           workspace(device, stream), stream);
  return y;
}

at::Tensor lt_gemm_bf16(const at::Tensor& x, const at::Tensor& w) {
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const at::Device device = x.device();
  const c10::cuda::CUDAGuard guard(device);
  at::Tensor y = at::empty({m, n}, x.options());
  if (m == 0) return y;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  plan({device.index(), m, n, k, x.stride(0), at::kBFloat16, at::kBFloat16})
      .run(w.data_ptr(), x.data_ptr(), y.data_ptr(), nullptr, nullptr, workspace(device, stream), stream);
  return y;
}

namespace {

// x . W^T (glu_inner 0) or a SwiGLU of it (glu_inner = n / 2) on the stream-K GEMM where it
// applies and is preferred; undefined otherwise.
at::Tensor stream_gemm_product(const at::Tensor& x, const at::Tensor& w, int64_t glu_inner) {
  const int64_t m = x.size(0), n = w.size(0), k = w.size(1);
  const at::Device device = x.device();
  const c10::cuda::CUDAGuard guard(device);
  stream_gemm::Problem p{x.data_ptr(), x.stride(0), w.data_ptr(), nullptr, m, n, k, glu_inner};
  if (!stream_gemm::preferred(p) || !stream_gemm::applies(p, device.index())) return {};
  at::Tensor y = at::empty({m, glu_inner > 0 ? glu_inner : n}, x.options());
  p.y = y.data_ptr();
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(device.index()).stream();
  // Zeroed once: each run leaves every flag down again.
  void* workspace = stream_buffer(
      thread_state().stream_gemm_workspaces, stream, device,
      [&] { return static_cast<int64_t>(stream_gemm::workspace_bytes(device.index())); }, true);
  stream_gemm::run(p, workspace, device.index(), stream);
  return y;
}

}  // namespace

at::Tensor projection_bf16(const at::Tensor& x, const at::Tensor& w) {
  at::Tensor y = stream_gemm_product(x, w, 0);
  return y.defined() ? y : lt_gemm_bf16(x, w);
}

at::Tensor projection_silu_mul_bf16(const at::Tensor& x, const at::Tensor& w) {
  return w.size(0) % 2 == 0 ? stream_gemm_product(x, w, w.size(0) / 2) : at::Tensor();
}

}  // namespace dflash::target
