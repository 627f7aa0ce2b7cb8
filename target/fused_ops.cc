#include "target/fused_ops.h"

#include <ATen/ATen.h>

#include <cstdint>

#include "common/tensor_math.h"
#include "target/gated_delta_net.h"

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "target/kernels/elementwise.h"
#include "target/kernels/top_p.h"
#endif

namespace dflash::target {
namespace {

bool kernels_apply(std::initializer_list<const at::Tensor*> tensors) {
#ifdef DFLASHD_WITH_CUDA
  for (const at::Tensor* t : tensors) {
    if (!t->is_cuda() || t->scalar_type() != at::kBFloat16 || !t->is_contiguous() || t->size(-1) % 8 != 0) return false;
  }
  return true;
#else
  (void)tensors;
  return false;
#endif
}

std::pair<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor* delta, const at::Tensor& weight,
                                            double eps, bool zero_centred) {
  const bool fused = delta ? kernels_apply({&x, delta, &weight}) : kernels_apply({&x, &weight});
  if (!fused || x.dim() != 2) {
    const at::Tensor sum = delta ? x + *delta : x;
    return {sum, rms_norm(sum, weight, eps, zero_centred)};
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor sum = delta ? at::empty_like(x) : x;
  at::Tensor normed = at::empty_like(x);
  kernels::add_rms_norm(x.data_ptr(), delta ? delta->data_ptr() : nullptr, weight.data_ptr(), sum.data_ptr(),
                        normed.data_ptr(), static_cast<int>(x.size(0)), static_cast<int>(x.size(1)),
                        static_cast<float>(eps), zero_centred, at::cuda::getCurrentCUDAStream().stream());
  return {sum, normed};
#else
  return {};
#endif
}

}  // namespace

bool rows_apply(const at::Tensor& x) {
#ifdef DFLASHD_WITH_CUDA
  return x.is_cuda() && x.scalar_type() == at::kBFloat16 && vector_rows(x);
#else
  (void)x;
  return false;
#endif
}

bool vector_rows(const at::Tensor& x) {
  if (x.dim() == 0 || x.stride(-1) != 1 || reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 != 0) return false;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) {
    if (x.stride(i) % 8 != 0) return false;
  }
  return true;
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps, bool zero_centred) {
  return norm_rows(x, nullptr, weight, eps, zero_centred).second;
}

std::pair<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                               double eps, bool zero_centred) {
  return norm_rows(x, &delta, weight, eps, zero_centred);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  // Rows at one common stride: contiguous tensors (as [rows, n]) or 2-D views such as the halves
  // of a fused gate/up projection.
  const bool contiguous = gate.is_contiguous() && up.is_contiguous() && gate.dim() >= 1;
  const bool strided = gate.dim() == 2 && gate.stride(0) == up.stride(0);
  if (gate.sizes() != up.sizes() || !rows_apply(gate) || !rows_apply(up) || gate.size(-1) % 8 != 0 ||
      !(contiguous || strided)) {
    return at::silu(gate) * up;
  }
#ifdef DFLASHD_WITH_CUDA
  const int64_t n = gate.size(-1), rows = n == 0 ? 0 : gate.numel() / n;
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  kernels::silu_mul(gate.data_ptr(), up.data_ptr(), contiguous ? n : gate.stride(0), out.data_ptr(), rows, n,
                    at::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  return {};
#endif
}

std::pair<at::Tensor, Fp8Activations> add_rms_norm_fp8(const at::Tensor& x, const at::Tensor* delta,
                                                       const at::Tensor& weight, double eps, bool zero_centred) {
  const bool fused = (delta ? kernels_apply({&x, delta, &weight}) : kernels_apply({&x, &weight})) && x.dim() == 2 &&
                     x.size(1) % kFp8Block == 0;
  if (!fused) {
    auto [sum, normed] = norm_rows(x, delta, weight, eps, zero_centred);
    return {sum, quantize_groups(normed, fp8_gemm_rows(normed.size(0), normed.device()))};
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor sum = delta ? at::empty_like(x) : x;
  Fp8Activations a = empty_activations(x.size(0), x.size(1), x.device());
  kernels::add_rms_norm_e4m3(x.data_ptr(), delta ? delta->data_ptr() : nullptr, weight.data_ptr(), sum.data_ptr(),
                             static_cast<int>(x.size(0)), static_cast<int>(x.size(1)), static_cast<float>(eps),
                             zero_centred, a.q.data_ptr(), a.factors.data_ptr<float>(), factor_stride(a),
                             at::cuda::getCurrentCUDAStream().stream());
  return {sum, a};
#else
  return {};
#endif
}

Fp8Activations silu_mul_fp8(const at::Tensor& gate, const at::Tensor& up) {
  const bool fused = gate.dim() == 2 && gate.sizes() == up.sizes() && gate.stride(0) == up.stride(0) &&
                     rows_apply(gate) && rows_apply(up) && gate.size(1) % kFp8Block == 0;
  if (!fused) {
    const at::Tensor product = silu_mul(gate, up).reshape({-1, gate.size(-1)});
    return quantize_groups(product, fp8_gemm_rows(product.size(0), product.device()));
  }
#ifdef DFLASHD_WITH_CUDA
  Fp8Activations a = empty_activations(gate.size(0), gate.size(1), gate.device());
  kernels::silu_mul_e4m3(gate.data_ptr(), up.data_ptr(), gate.stride(0), gate.size(0), gate.size(1), a.q.data_ptr(),
                         a.factors.data_ptr<float>(), factor_stride(a), at::cuda::getCurrentCUDAStream().stream());
  return a;
#else
  return {};
#endif
}

at::Tensor apply_rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const int64_t rotary = cos.size(-1);
  const at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  const at::Tensor rot = x.narrow(-1, 0, rotary);
  const at::Tensor rotated = rot * c + rotate_half(rot) * s;
  if (rotary == x.size(-1)) return rotated;
  return at::cat({rotated, x.narrow(-1, rotary, x.size(-1) - rotary)}, -1);
}

namespace {

bool qk_norm_rope_kernel_applies(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                                 const at::Tensor& sin) {
  const int64_t d = x.size(-1), rotary = cos.size(-1);
  return x.dim() == 3 && rows_apply(x) && kernels_apply({&weight, &cos, &sin}) && d <= 256 && rotary % 16 == 0 &&
         rotary <= d && cos.sizes() == sin.sizes() && cos.size(0) == x.size(0);
}

#ifdef DFLASHD_WITH_CUDA
// x's rows for the kernel, and their output (contiguous); an undefined x: none.
kernels::QkRows qk_rows(const at::Tensor& x, const at::Tensor& weight, at::Tensor& out) {
  if (!x.defined()) return {nullptr, 0, 0, 0, nullptr, nullptr};
  out = at::empty(x.sizes(), x.options());
  return {x.data_ptr(), x.stride(0), x.stride(1), static_cast<int>(x.size(1)), weight.data_ptr(), out.data_ptr()};
}
#endif

}  // namespace

at::Tensor qk_norm_rope(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos, const at::Tensor& sin,
                        double eps, bool zero_centred) {
  return qk_norm_rope(x, weight, at::Tensor(), at::Tensor(), cos, sin, eps, zero_centred).first;
}

std::pair<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& q, const at::Tensor& q_weight, const at::Tensor& k,
                                               const at::Tensor& k_weight, const at::Tensor& cos, const at::Tensor& sin,
                                               double eps, bool zero_centred) {
  const bool fused = qk_norm_rope_kernel_applies(q, q_weight, cos, sin) &&
                     (!k.defined() || (qk_norm_rope_kernel_applies(k, k_weight, cos, sin) && k.size(-1) == q.size(-1) &&
                                       k.size(0) == q.size(0)));
  if (!fused) {
    const auto composite = [&](const at::Tensor& x, const at::Tensor& w) {
      return x.defined() ? apply_rope(rms_norm(x, w, eps, zero_centred), cos, sin) : at::Tensor();
    };
    return {composite(q, q_weight), composite(k, k_weight)};
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor q_out, k_out;
  const kernels::QkRows q_rows = qk_rows(q, q_weight, q_out), k_rows = qk_rows(k, k_weight, k_out);
  kernels::qk_norm_rope(q_rows, k_rows, static_cast<int>(q.size(0)), static_cast<int>(q.size(-1)), cos.data_ptr(),
                        sin.data_ptr(), static_cast<int>(cos.size(-1)), static_cast<float>(eps), zero_centred,
                        at::cuda::getCurrentCUDAStream().stream());
  return {q_out, k_out};
#else
  return {};
#endif
}

at::Tensor widen_to_float(const at::Tensor& x) {
  if (!kernels_apply({&x}) || !vector_rows(x)) return x.to(at::kFloat);
#ifdef DFLASHD_WITH_CUDA
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(at::kFloat));
  kernels::widen_bf16(x.data_ptr(), out.data_ptr<float>(), x.numel(), at::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  return {};
#endif
}

// Whether the output gate's kernels take out [tokens, heads * d] and gate [tokens, heads, d].
bool gate_kernels_apply(const at::Tensor& out, const at::Tensor& gate) {
  return gate.dim() == 3 && rows_apply(gate) && kernels_apply({&out}) && out.dim() == 2 &&
         out.size(0) == gate.size(0) && out.size(1) == gate.size(1) * gate.size(2);
}

at::Tensor sigmoid_gate(const at::Tensor& out, const at::Tensor& gate) {
  if (!gate_kernels_apply(out, gate)) return out * at::sigmoid(gate.reshape({gate.size(0), -1}));
#ifdef DFLASHD_WITH_CUDA
  kernels::sigmoid_gate(out.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1), static_cast<int>(gate.size(0)),
                        static_cast<int>(gate.size(1)), static_cast<int>(gate.size(2)),
                        at::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  return {};
#endif
}

Fp8Activations sigmoid_gate_fp8(const at::Tensor& out, const at::Tensor& gate) {
  if (!gate_kernels_apply(out, gate) || out.size(1) % kFp8Block != 0) {
    const at::Tensor gated = sigmoid_gate(out, gate);
    return quantize_groups(gated, fp8_gemm_rows(gated.size(0), gated.device()));
  }
#ifdef DFLASHD_WITH_CUDA
  Fp8Activations a = empty_activations(out.size(0), out.size(1), out.device());
  kernels::sigmoid_gate_e4m3(out.data_ptr(), gate.data_ptr(), gate.stride(0), gate.stride(1),
                             static_cast<int>(gate.size(0)), static_cast<int>(gate.size(1)),
                             static_cast<int>(gate.size(2)), a.q.data_ptr(), a.factors.data_ptr<float>(),
                             factor_stride(a), at::cuda::getCurrentCUDAStream().stream());
  return a;
#else
  return {};
#endif
}

at::Tensor gated_rms_norm(const at::Tensor& o, const at::Tensor& z, const at::Tensor& weight, double eps,
                          at::ScalarType dtype) {
  const int64_t tokens = o.size(0), heads = o.size(1), d = o.size(2);
  const bool fused = dtype == at::kBFloat16 && o.is_cuda() && o.scalar_type() == at::kFloat && o.is_contiguous() &&
                     z.dim() == 3 && z.sizes() == o.sizes() && rows_apply(z) && kernels_apply({&weight}) && d <= 256;
  if (!fused) {
    const at::Tensor normed = (o * at::rsqrt(o.pow(2).mean(-1, true) + eps)).to(dtype);
    const at::Tensor gated = ((weight * normed).to(at::kFloat) * at::silu(z.to(at::kFloat))).to(dtype);
    return gated.reshape({tokens, heads * d});
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor out = at::empty({tokens, heads * d}, o.options().dtype(dtype));
  kernels::gated_rms_norm(o.data_ptr<float>(), z.data_ptr(), z.stride(0), z.stride(1), weight.data_ptr(), out.data_ptr(),
                          static_cast<int>(tokens), static_cast<int>(heads), static_cast<int>(d), static_cast<float>(eps),
                          at::cuda::getCurrentCUDAStream().stream());
  return out;
#else
  return {};
#endif
}

bool gdn_gates_kernel_applies(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                              const at::Tensor& dt_bias) {
  auto column_rows = [](const at::Tensor& t) {  // bf16 on the GPU, [tokens, heads] with contiguous heads
    return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 2 && t.stride(1) == 1;
  };
  return column_rows(a) && column_rows(b) && a.sizes() == b.sizes() && a_log.scalar_type() == at::kFloat &&
         dt_bias.scalar_type() == at::kFloat && a_log.is_contiguous() && dt_bias.is_contiguous() && a_log.is_cuda() &&
         a_log.numel() == a.size(1) && dt_bias.numel() == a.size(1);
}

std::pair<at::Tensor, at::Tensor> gdn_gates(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                            const at::Tensor& dt_bias) {
  if (!gdn_gates_kernel_applies(a, b, a_log, dt_bias)) {
    GdnGateValues v = gdn_gates_reference(a, b, a_log, dt_bias);
    return {v.g, v.beta};
  }
#ifdef DFLASHD_WITH_CUDA
  at::Tensor g = at::empty(a.sizes(), a.options().dtype(at::kFloat)), beta = at::empty_like(g);
  kernels::gdn_gates(a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), a_log.data_ptr<float>(),
                     dt_bias.data_ptr<float>(), g.data_ptr<float>(), beta.data_ptr<float>(), static_cast<int>(a.size(0)),
                     static_cast<int>(a.size(1)), at::cuda::getCurrentCUDAStream().stream());
  return {g, beta};
#else
  return {};
#endif
}

at::Tensor top_p_keep(const at::Tensor& probs, double top_p) {
#ifdef DFLASHD_WITH_CUDA
  if (probs.is_cuda() && probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous()) {
    at::Tensor out = at::empty_like(probs);
    kernels::top_p_keep(probs.data_ptr<float>(), out.data_ptr<float>(), static_cast<int>(probs.size(0)), probs.size(1),
                        static_cast<float>(top_p), at::cuda::getCurrentCUDAStream().stream());
    return out;
  }
#endif
  auto [sorted, order] = probs.sort(/*stable=*/true, -1, /*descending=*/true);
  const at::Tensor kept = sorted * ((sorted.cumsum(-1) - sorted) < top_p);
  return at::zeros_like(probs).scatter(-1, order, kept);
}

at::Tensor choose_by_uniform(const at::Tensor& probs, const at::Tensor& u) {
#ifdef DFLASHD_WITH_CUDA
  if (probs.is_cuda() && probs.scalar_type() == at::kFloat && probs.dim() == 2 && probs.is_contiguous() &&
      u.device() == probs.device() && u.scalar_type() == at::kDouble && u.numel() == probs.size(0) &&
      u.is_contiguous()) {
    at::Tensor chosen = at::empty({probs.size(0)}, probs.options().dtype(at::kLong));
    kernels::choose_by_uniform(probs.data_ptr<float>(), static_cast<int>(probs.size(0)), probs.size(1),
                               u.data_ptr<double>(), chosen.data_ptr<int64_t>(),
                               at::cuda::getCurrentCUDAStream().stream());
    return chosen;
  }
#else
  (void)probs, (void)u;
#endif
  return {};
}

}  // namespace dflash::target
