#include "target/fp8.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "target/fused_ops.h"
#include "target/kernels/fp8.h"
#include "target/kernels/grouped_fp8.h"
#include "target/lt_gemm.h"
#endif

namespace dflash::target {
namespace {

constexpr double kE4m3Max = 448.0;

// max|x| / 448 over the last dimension, 1 where the maximum is zero.
at::Tensor factors_of(const at::Tensor& amax) { return at::where(amax > 0, amax / kE4m3Max, at::ones_like(amax)); }

}  // namespace

int64_t Fp8Weight::bytes() const { return data.numel() + scale.numel() * 4; }

std::optional<std::string> fp8_shape_unsupported(int64_t out, int64_t in) {
  if (in % (4 * kFp8Block) != 0) {
    return std::to_string(in) + " input features: the block-scaled FP8 GEMM takes a multiple of 512 (its 128-wide "
           "groups' factors are read in rows of 16 bytes)";
  }
  if (out % 16 != 0) return std::to_string(out) + " output features: FP8 GEMMs take a multiple of 16";
  return std::nullopt;
}

Fp8Weight quantize_blocks(const at::Tensor& w) {
  const int64_t out = w.size(0), in = w.size(1), row_blocks = (out + kFp8Block - 1) / kFp8Block;
  if (in % kFp8Block != 0) throw std::invalid_argument("quantize_blocks: the inner size must be a multiple of 128");
  at::Tensor padded = w.to(at::kFloat);
  if (row_blocks * kFp8Block != out) padded = at::constant_pad_nd(padded, {0, 0, 0, row_blocks * kFp8Block - out});
  const at::Tensor blocks = padded.view({row_blocks, kFp8Block, in / kFp8Block, kFp8Block});
  const at::Tensor scale = factors_of(blocks.abs().amax({1, 3}));
  const at::Tensor q = (blocks / scale.view({row_blocks, 1, in / kFp8Block, 1})).to(at::kFloat8_e4m3fn);
  return {q.view({row_blocks * kFp8Block, in}).narrow(0, 0, out).contiguous(), scale.contiguous()};
}

at::Tensor dequantize_blocks(const Fp8Weight& w, at::ScalarType dtype, int64_t block_rows, int64_t block_columns) {
  const int64_t out = w.data.size(-2), in = w.data.size(-1);
#ifdef DFLASHD_WITH_CUDA
  if (w.data.is_cuda() && dtype == at::kBFloat16 && block_rows == kFp8Block && block_columns == kFp8Block &&
      in % 8 == 0 && w.data.is_contiguous() && w.scale.is_contiguous() && w.scale.scalar_type() == at::kFloat) {
    at::Tensor result = at::empty(w.data.sizes(), w.data.options().dtype(at::kBFloat16));
    kernels::dequantize_blocks_bf16(w.data.data_ptr(), w.scale.data_ptr<float>(), w.data.numel() / (out * in), out, in,
                                    result.data_ptr(), at::cuda::getCurrentCUDAStream().stream());
    return result;
  }
#endif
  const at::Tensor factors = w.scale.to(at::kFloat)
                                 .repeat_interleave(block_rows, -2)
                                 .narrow(-2, 0, out)
                                 .repeat_interleave(block_columns, -1)
                                 .narrow(-1, 0, in);
  return (w.data.to(at::kFloat) * factors).to(dtype);
}

Fp8Weight stack_fp8(const std::vector<WeightRows>& parts) {
  std::vector<at::Tensor> data, scales;
  int64_t offset = 0;
  size_t kept = 0;
  for (; kept < parts.size(); ++kept) {
    const WeightRows& p = parts[kept];
    const bool last = kept + 1 == parts.size();
    if (!p.fp8.defined() || offset % kFp8Block != 0 || (!last && p.rows() % kFp8Block != 0)) break;
    data.push_back(p.fp8.data);
    scales.push_back(p.fp8.scale);
    offset += p.rows();
  }
  if (kept < parts.size()) {
    std::vector<at::Tensor> rest;
    for (size_t i = kept; i < parts.size(); ++i) {
      rest.push_back(parts[i].fp8.defined() ? dequantize_blocks(parts[i].fp8, at::kFloat) : parts[i].weight);
    }
    const Fp8Weight quantised = quantize_blocks(rest.size() == 1 ? rest[0] : at::cat(rest, 0));
    data.push_back(quantised.data);
    scales.push_back(quantised.scale);
  }
  if (data.size() == 1) return {data[0], scales[0]};
  return {at::cat(data, 0), at::cat(scales, 0)};
}

int64_t fp8_gemm_rows(int64_t rows, at::Device device) { return device.is_cuda() ? (rows + 15) / 16 * 16 : rows; }

namespace {

// q and factors for padded rows, the rows past `rows` zero with factor 1 (defined values for the
// GEMM's padding).
Fp8Activations allocate_activations(int64_t rows, int64_t padded, int64_t in, const at::TensorOptions& options) {
  at::Tensor q = at::empty({padded, in}, options.dtype(at::kFloat8_e4m3fn));
  at::Tensor factors = at::empty({in / kFp8Block, padded}, options.dtype(at::kFloat));
  if (padded > rows) {
    q.narrow(0, rows, padded - rows).view(at::kByte).zero_();
    factors.narrow(1, rows, padded - rows).fill_(1.0);
  }
  return {q, factors.t(), rows};
}

// The values the block-scaled arithmetic multiplies (q times its group's factor, fp32), every row
// of q: the emulation's activations.
at::Tensor dequantized_activations(const Fp8Activations& a) {
  return a.q.to(at::kFloat) * a.factors.repeat_interleave(kFp8Block, 1);
}

}  // namespace

Fp8Activations empty_activations(int64_t rows, int64_t in, at::Device device) {
  if (in % kFp8Block != 0) {
    throw std::invalid_argument("FP8 activations: the inner size must be a multiple of 128, got " + std::to_string(in));
  }
  return allocate_activations(rows, fp8_gemm_rows(rows, device), in, at::TensorOptions().device(device));
}

Fp8Activations quantize_groups(const at::Tensor& x, int64_t padded_rows) {
  const int64_t rows = x.size(0), in = x.size(1), groups = in / kFp8Block;
  if (in % kFp8Block != 0) throw std::invalid_argument("quantize_groups: the inner size must be a multiple of 128");
  padded_rows = std::max(padded_rows, rows);
#ifdef DFLASHD_WITH_CUDA
  if (rows_apply(x)) {
    Fp8Activations a = allocate_activations(rows, padded_rows, in, x.options());  // bf16 rows
    kernels::quantize_groups_e4m3(x.data_ptr(), x.stride(0), rows, in, a.q.data_ptr(), a.factors.data_ptr<float>(),
                                  padded_rows, at::cuda::getCurrentCUDAStream().stream());
    return a;
  }
#endif
  if (padded_rows > rows) {
    Fp8Activations a = quantize_groups(at::constant_pad_nd(x, {0, 0, 0, padded_rows - rows}), padded_rows);
    a.rows = rows;  // the zero rows got factor 1
    return a;
  }
  const at::Tensor grouped = x.to(at::kFloat).reshape({rows, groups, kFp8Block});
  const at::Tensor factors = factors_of(grouped.abs().amax(-1));
  const at::Tensor q = (grouped / factors.unsqueeze(-1)).to(at::kFloat8_e4m3fn).view({rows, in});
  return {q, factors.t().contiguous().t(), rows, x.scalar_type()};
}

Fp8Activations quantize_gathered_groups(const at::Tensor& x, const at::Tensor& sources, int64_t divisor) {
#ifdef DFLASHD_WITH_CUDA
  const int64_t rows = sources.numel(), in = x.size(1);
  if (rows_apply(x) && in % kFp8Block == 0 && sources.scalar_type() == at::kLong &&
      sources.is_contiguous() && sources.device() == x.device() && divisor >= 1) {
    Fp8Activations a = allocate_activations(rows, rows, in, x.options());
    kernels::quantize_groups_e4m3(x.data_ptr(), x.stride(0), rows, in, a.q.data_ptr(), a.factors.data_ptr<float>(),
                                  rows, at::cuda::getCurrentCUDAStream().stream(), sources.data_ptr<int64_t>(),
                                  divisor);
    return a;
  }
#endif
  return quantize_groups(x.index_select(0, at::div(sources, divisor, "floor")));
}

// With one group the stride ATen reports for the factors' columns is arbitrary: the padded rows.
int64_t factor_stride(const Fp8Activations& a) {
  return a.factors.size(1) == 1 ? a.factors.size(0) : a.factors.stride(1);
}

at::Tensor fp8_linear(const Fp8Activations& a, const Fp8Weight& w, const at::Tensor& bias) {
  const at::ScalarType dtype = a.dtype;
  at::Tensor y;
  if (a.q.is_cuda() && !fp8_gemm_unavailable(a.q.device())) {
#ifdef DFLASHD_WITH_CUDA
    y = lt_gemm_fp8(a, w);
    if (bias.defined()) y.add_(bias);  // rounded once more than the emulation's fp32 add (within its tolerance)
#endif
  } else {
    y = at::matmul(dequantized_activations(a), dequantize_blocks(w, at::kFloat).t());
    if (bias.defined()) y = y + bias.to(at::kFloat);
    y = y.to(dtype);
  }
  return a.q.size(0) != a.rows ? y.narrow(0, 0, a.rows) : y;
}

bool fp8_grouped_gemm_applies(const Fp8Weight& w, at::Device device) {
#ifdef DFLASHD_WITH_CUDA
  if (!device.is_cuda() || !w.defined() || w.data.dim() != 3 || !w.data.is_contiguous() || !w.scale.is_contiguous()) {
    return false;
  }
  return w.scale.scalar_type() == at::kFloat &&
         grouped_fp8::weights_apply(w.data.size(0), w.data.size(1), w.data.size(2), w.data.data_ptr(), device.index());
#else
  (void)w;
  (void)device;
  return false;
#endif
}

at::Tensor fp8_grouped_linear(const Fp8Activations& a, const Fp8Weight& w, const at::Tensor& ends) {
  const int64_t groups = w.data.size(0), out = w.data.size(1), in = w.data.size(2);
  if (ends.scalar_type() != at::kInt || ends.dim() != 1 || ends.size(0) != groups || a.q.size(1) != in) {
    throw std::invalid_argument("fp8_grouped_linear: " + std::to_string(groups) + " experts of [" +
                                std::to_string(out) + ", " + std::to_string(in) + "] against rows of " +
                                std::to_string(a.q.size(1)) + " and " + std::to_string(ends.numel()) + " group ends");
  }
  at::Tensor y = at::empty({a.rows, out}, a.q.options().dtype(a.dtype));
#ifdef DFLASHD_WITH_CUDA
  if (a.q.is_cuda() && a.dtype == at::kBFloat16 && fp8_grouped_gemm_applies(w, a.q.device())) {
    grouped_fp8::Problem p;
    p.x = a.q.data_ptr(), p.x_stride = a.q.stride(0), p.x_factors = a.factors.data_ptr<float>();
    p.factor_stride = factor_stride(a), p.w = w.data.data_ptr(), p.w_factors = w.scale.data_ptr<float>();
    p.ends = ends.data_ptr<int32_t>(), p.y = y.data_ptr(), p.m = a.rows, p.n = out, p.k = in;
    p.groups = static_cast<int>(groups);
    grouped_fp8::run(p, a.q.device().index(), at::cuda::getCurrentCUDAStream().stream());
    return y;
  }
#endif
  const at::Tensor activations = dequantized_activations(a).narrow(0, 0, a.rows);
  const at::Tensor host_ends = ends.cpu();
  const int32_t* end_of = host_ends.data_ptr<int32_t>();
  int64_t begin = 0;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t end = end_of[g];
    if (end == begin) continue;
    const Fp8Weight expert{w.data[g], w.scale[g]};
    y.narrow(0, begin, end - begin)
        .copy_(at::matmul(activations.narrow(0, begin, end - begin), dequantize_blocks(expert, at::kFloat).t()));
    begin = end;
  }
  return y;
}

at::Tensor fp8_linear(const at::Tensor& x, const Fp8Weight& w, const at::Tensor& bias) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = w.data.size(0);
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  const bool gemm = x.is_cuda() && !fp8_gemm_unavailable(x.device());
  const Fp8Activations a = quantize_groups(rows, gemm ? fp8_gemm_rows(rows.size(0), x.device()) : 0);
  return fp8_linear(a, w, bias).view(shape);
}

double fp8_gemm_error(at::Device device) {
  const at::Tensor x = at::randn({64, 512}).to(at::kBFloat16);
  const Fp8Weight w = quantize_blocks(at::randn({256, 512}));
  const at::Tensor expected = fp8_linear(x, w, {}).to(at::kDouble);
  const at::Tensor got = fp8_linear(x.to(device), Fp8Weight{w.data.to(device), w.scale.to(device)}, {}).cpu();
  return ((got.to(at::kDouble) - expected).abs().max() / expected.abs().max()).item<double>();
}

std::optional<std::string> fp8_grouped_gemm_unavailable(at::Device device) {
  if (auto why = fp8_gemm_unavailable(device)) return why;
#ifdef DFLASHD_WITH_CUDA
  if (!grouped_fp8::built_for(device.index())) {
    return device.str() + ": the FP8 grouped GEMM is built for sm_90a (compute capability 9.0) only";
  }
#endif
  return std::nullopt;
}

double fp8_grouped_gemm_error(at::Device device) {
  std::vector<at::Tensor> data, scales;
  for (int e = 0; e < 4; ++e) {
    const Fp8Weight one = quantize_blocks(at::randn({256, 512}) / std::sqrt(512.0));
    data.push_back(one.data), scales.push_back(one.scale);
  }
  const Fp8Weight cpu_w{at::stack(data), at::stack(scales)}, gpu_w{cpu_w.data.to(device), cpu_w.scale.to(device)};
  if (!fp8_grouped_gemm_applies(gpu_w, device)) {
    throw std::runtime_error("the FP8 grouped GEMM does not run on " + device.str());
  }
  const Fp8Activations a = quantize_groups(at::randn({205, 512}).to(at::kBFloat16));
  const at::Tensor ends = at::tensor({5, 5, 75, 205}, at::TensorOptions().dtype(at::kInt));
  const at::Tensor expected = fp8_grouped_linear(a, cpu_w, ends).to(at::kDouble);
  const Fp8Activations on_device{a.q.to(device), a.factors.to(device).t().contiguous().t(), a.rows, a.dtype};
  const at::Tensor got = fp8_grouped_linear(on_device, gpu_w, ends.to(device)).cpu().to(at::kDouble);
  return ((got - expected).abs().max() / expected.abs().max()).item<double>();
}

std::optional<std::string> fp8_gemm_unavailable(at::Device device) {
  if (!device.is_cuda()) return "the CPU has no FP8 GEMM (the emulation runs)";
#ifdef DFLASHD_WITH_CUDA
  const cudaDeviceProp* props = at::cuda::getDeviceProperties(device.index());
  if (props->major != 9) {
    return "cuda:" + std::to_string(device.index()) + " is compute capability " + std::to_string(props->major) + "." +
           std::to_string(props->minor) + "; cuBLASLt's 128x128 block-scaled FP8 GEMM runs on 9.x (Hopper)";
  }
  return std::nullopt;
#else
  return "this build has no CUDA";
#endif
}

}  // namespace dflash::target
