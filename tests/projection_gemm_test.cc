// The target's projection GEMMs beyond ATen's (target/lt_gemm.h), on a GPU against the fp64
// product of the same bf16 operands: the weight-streaming kernel at a decoding step's rows (one
// and two row tiles, partial feature tiles, one split and several, strided rows) and cuBLASLt's
// bf16 GEMM with its large workspace. Skipped without a GPU (or, for the kernel, off Hopper).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#ifdef DFLASHD_WITH_CUDA
#include "target/kernels/skinny_gemm.h"
#include "target/lt_gemm.h"
#endif

namespace dflash::target {
namespace {

#ifdef DFLASHD_WITH_CUDA
// Largest difference from the fp64 product over its largest magnitude.
double error_of(const at::Tensor& got, const at::Tensor& x, const at::Tensor& w) {
  const at::Tensor want = at::matmul(x.cpu().to(at::kDouble), w.cpu().to(at::kDouble).t());
  return ((got.cpu().to(at::kDouble) - want).abs().max() / want.abs().max()).item<double>();
}
#endif

TEST(ProjectionGemm, GpuSkinnyKernelAndCublasLtMatchTheFp64Product) {
  if (!at::hasCUDA()) GTEST_SKIP() << "needs a GPU";
#ifdef DFLASHD_WITH_CUDA
  const auto gpu = at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16);
  for (const int64_t m : {1, 5, 16, 64, 65, 128}) {
    for (const auto& [n, k] : std::vector<std::pair<int64_t, int64_t>>{{64, 128}, {200, 640}, {5120, 6144}, {1000, 4096}}) {
      const std::string what = std::to_string(m) + " x " + std::to_string(k) + " -> " + std::to_string(n);
      at::manual_seed(m * 31 + n + k);
      // Rows as a column slice of a wider tensor: the stride the target's views have.
      const at::Tensor x = at::randn({m, k + 256}, gpu).narrow(1, 128, k);
      const at::Tensor w = at::randn({n, k}, gpu) * 0.05;
      // bf16 output of an fp32 sum: within a few bf16 roundings of the product's largest value.
      EXPECT_LT(error_of(lt_gemm_bf16(x, w), x, w), 1e-2) << what << " (cuBLASLt)";
      if (const auto why = skinny_linear_unavailable(x, w)) {
        std::printf("skinny kernel not run for %s: %s\n", what.c_str(), why->c_str());
        continue;
      }
      EXPECT_LT(error_of(skinny_linear(x, w), x, w), 1e-2) << what << " (skinny kernel, "
                                                           << kernels::skinny_gemm_splits(n, k, 132) << " splits)";
    }
  }
  // The split rule: two waves of CTAs where the reduction is long enough, none where it is short.
  EXPECT_EQ(kernels::skinny_gemm_splits(5120, 17408, 132), 4);
  EXPECT_EQ(kernels::skinny_gemm_splits(34816, 5120, 132), 1);
  EXPECT_EQ(kernels::skinny_gemm_splits(64, 512, 132), 1);
#else
  GTEST_SKIP() << "a build without CUDA";
#endif
}

}  // namespace
}  // namespace dflash::target
