#include "drafter/layer_ops.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "common/tensor_math.h"

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "drafter/kernels/layer_ops.h"
#endif

namespace dflash::drafter {
namespace {

#ifdef DFLASHD_WITH_CUDA
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool kernels_apply(const at::Tensor& x, const at::Tensor& weight) {
  const int64_t n = x.dim() > 0 ? x.size(-1) : 0;
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && weight.scalar_type() == at::kBFloat16 &&
         weight.dim() == 1 && weight.size(0) == n && kernels::rms_norm_supports(n);
}

// 16-byte aligned contiguous rows for the kernels (a copy only where x is neither).
at::Tensor rows_of(const at::Tensor& x) {
  at::Tensor c = x.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

struct FusedRmsNorm : public torch::autograd::Function<FusedRmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& weight, double eps) {
    const at::Tensor rows = rows_of(x), w = rows_of(weight);
    const int n = static_cast<int>(x.size(-1));
    const int64_t count = rows.numel() / n;
    at::Tensor y = at::empty_like(rows);
    at::Tensor rstd = at::empty({count}, rows.options().dtype(at::kFloat));
    kernels::rms_norm_forward(rows.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr<float>(), count, n,
                              static_cast<float>(eps), at::cuda::getCurrentCUDAStream().stream());
    ctx->save_for_backward({rows, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& rows = saved[0];
    const at::Tensor& w = saved[1];
    const at::Tensor& rstd = saved[2];
    const at::Tensor dy = rows_of(grads[0]);
    const int n = static_cast<int>(rows.size(-1));
    const int64_t count = rows.numel() / n;
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
    at::Tensor dx = at::empty_like(rows);
    kernels::rms_norm_backward_input(rows.data_ptr(), w.data_ptr(), dy.data_ptr(), rstd.data_ptr<float>(), dx.data_ptr(),
                                     count, n, stream);
    at::Tensor partial =
        at::empty({kernels::rms_norm_weight_parts(count, n), n}, rows.options().dtype(at::kFloat));
    kernels::rms_norm_backward_weight(rows.data_ptr(), dy.data_ptr(), rstd.data_ptr<float>(), partial.data_ptr<float>(),
                                      count, n, stream);
    return {dx, partial.sum(0).to(w.scalar_type()), at::Tensor()};
  }
};

struct FusedSiluMul : public torch::autograd::Function<FusedSiluMul> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& gate, const at::Tensor& up) {
    const at::Tensor g = rows_of(gate), u = rows_of(up);
    at::Tensor y = at::empty_like(g);
    kernels::silu_mul_forward(g.data_ptr(), u.data_ptr(), y.data_ptr(), g.numel(), at::cuda::getCurrentCUDAStream().stream());
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dy = rows_of(grads[0]);
    at::Tensor d_gate = at::empty_like(saved[0]), d_up = at::empty_like(saved[1]);
    kernels::silu_mul_backward(saved[0].data_ptr(), saved[1].data_ptr(), dy.data_ptr(), d_gate.data_ptr(),
                               d_up.data_ptr(), dy.numel(), at::cuda::getCurrentCUDAStream().stream());
    return {d_gate, d_up};
  }
};

// The rotary embedding of x [rows, heads, d] by tables [rows, 1, d] (kernels::rope_*); the
// tables take no gradient (they come from positions).
struct FusedRope : public torch::autograd::Function<FusedRope> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const at::Tensor rows = rows_of(x), c = rows_of(cos), s = rows_of(sin);
    at::Tensor y = at::empty_like(rows);
    kernels::rope_forward(rows.data_ptr(), c.data_ptr(), s.data_ptr(), y.data_ptr(), x.size(0),
                          static_cast<int>(x.size(1)), static_cast<int>(x.size(2)),
                          at::cuda::getCurrentCUDAStream().stream());
    ctx->save_for_backward({c, s});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dy = rows_of(grads[0]);
    at::Tensor dx = at::empty_like(dy);
    kernels::rope_backward(dy.data_ptr(), saved[0].data_ptr(), saved[1].data_ptr(), dx.data_ptr(), dy.size(0),
                           static_cast<int>(dy.size(1)), static_cast<int>(dy.size(2)),
                           at::cuda::getCurrentCUDAStream().stream());
    return {dx, at::Tensor(), at::Tensor()};
  }
};

bool rope_kernels_apply(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  auto bf16_cuda = [](const at::Tensor& t) { return t.is_cuda() && t.scalar_type() == at::kBFloat16; };
  const bool tables = cos.dim() == 3 && cos.sizes() == sin.sizes() && cos.size(1) == 1 && x.dim() == 3 &&
                      cos.size(0) == x.size(0) && cos.size(2) == x.size(2);
  return tables && bf16_cuda(x) && bf16_cuda(cos) && bf16_cuda(sin) && !cos.requires_grad() && !sin.requires_grad() &&
         kernels::rope_supports(x.size(2));
}
#endif

}  // namespace

at::Tensor trained_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
#ifdef DFLASHD_WITH_CUDA
  if (rope_kernels_apply(x, cos, sin)) return FusedRope::apply(x, cos, sin);
#endif
  return x * cos + rotate_half(x) * sin;
}

at::Tensor trained_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
#ifdef DFLASHD_WITH_CUDA
  if (kernels_apply(x, weight)) return FusedRmsNorm::apply(x, weight, eps);
#endif
  return rms_norm(x, weight, eps);
}

at::Tensor trained_silu_mul(const at::Tensor& gate, const at::Tensor& up) {
#ifdef DFLASHD_WITH_CUDA
  if (gate.is_cuda() && gate.scalar_type() == at::kBFloat16 && up.scalar_type() == at::kBFloat16 &&
      gate.sizes() == up.sizes() && gate.numel() % 8 == 0) {
    return FusedSiluMul::apply(gate, up);
  }
#endif
  return at::silu(gate) * up;
}

}  // namespace dflash::drafter
