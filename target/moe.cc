#include "target/moe.h"

#include <ATen/ATen.h>

#include "target/fused_ops.h"

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "target/kernels/grouped_fp8.h"
#include "target/kernels/moe.h"
#endif

namespace dflash::target {
namespace {

#ifdef DFLASHD_WITH_CUDA
// Whether the fused kernels take rows of t: bf16 on a GPU, a row stride of whole 16 bytes.
bool kernels_apply(const at::Tensor& t) {
  return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.stride(0) % 8 == 0;
}
#endif

// The shared expert's output from x's projections: [tokens, H] (undefined without one).
at::Tensor shared_expert(const MoeShape& s, const MoeWeights& w, const at::Tensor& projected) {
  if (s.shared == 0) return {};
  const at::Tensor gate = projected.narrow(1, s.experts, s.shared), up = projected.narrow(1, s.experts + s.shared, s.shared);
  return at::linear(silu_mul(gate, up), w.shared_down);
}

// The shared expert gated and added to the routed experts' sum, as HF rounds it.
at::Tensor add_gated_shared(const MoeShape& s, const at::Tensor& projected, const at::Tensor& shared, at::Tensor out) {
  if (s.shared == 0) return out;
  const at::Tensor gate = projected.narrow(1, s.experts + 2 * s.shared, 1);
  return out + at::sigmoid(gate) * shared;
}

// The routed experts' SwiGLU over x's rows gathered in expert order (group e's rows end at
// offsets[e]). FP8 experts run on the FP8 grouped GEMM where it applies (the rows gathered and
// quantised per 1x128 group by one kernel, SiLU-mul writing down_proj's e4m3 input); otherwise
// the experts in x's dtype (FP8 ones dequantized) on ATen's grouped GEMM.
// `order`: the pairs in expert order (pair p is token p / top_k's).
at::Tensor experts_forward(const MoeShape& s, const MoeWeights& w, const at::Tensor& x, const at::Tensor& order,
                           const at::Tensor& offsets) {
  if (fp8_experts_grouped(w, x.device(), x.scalar_type())) {
    const Fp8Activations rows = quantize_gathered_groups(x, order, s.top_k);     // [pairs, H], quantised
    const at::Tensor gate_up = fp8_grouped_linear(rows, w.fp8_gate_up, offsets);  // [pairs, 2I]
    const Fp8Activations hidden_rows =
        silu_mul_fp8(gate_up.narrow(1, 0, s.inner), gate_up.narrow(1, s.inner, s.inner));
    return fp8_grouped_linear(hidden_rows, w.fp8_down, offsets);
  }
  const at::Tensor rows = x.index_select(0, at::div(order, s.top_k, "floor"));  // [pairs, H]
  const auto [gate_up_weights, down_weights] = w.experts(rows.scalar_type());
  const at::Tensor gate_up = at::_grouped_mm(rows, gate_up_weights.transpose(1, 2), offsets);  // [pairs, 2I]
  const at::Tensor hidden_rows = silu_mul(gate_up.narrow(1, 0, s.inner), gate_up.narrow(1, s.inner, s.inner));
  return at::_grouped_mm(hidden_rows, down_weights.transpose(1, 2), offsets);
}

}  // namespace

MoeWeights MoeWeights::make(const at::Tensor& router, at::Tensor experts_gate_up, at::Tensor experts_down,
                            const at::Tensor& shared_gate, const at::Tensor& shared_up, at::Tensor shared_down,
                            const at::Tensor& shared_expert_gate) {
  std::vector<at::Tensor> rows{router};
  if (shared_down.defined()) rows.insert(rows.end(), {shared_gate, shared_up, shared_expert_gate});
  int64_t count = 0;
  for (const at::Tensor& r : rows) count += r.size(0);
  if (count % 8 != 0) rows.push_back(at::zeros({8 - count % 8, router.size(1)}, router.options()));
  MoeWeights w;
  w.input_proj = at::cat(rows, 0);
  w.experts_gate_up = std::move(experts_gate_up);
  w.experts_down = std::move(experts_down);
  w.shared_down = std::move(shared_down);
  return w;
}

std::pair<at::Tensor, at::Tensor> MoeWeights::experts(at::ScalarType dtype) const {
  if (!fp8_gate_up.defined()) return {experts_gate_up, experts_down};
  return {dequantize_blocks(fp8_gate_up, dtype), dequantize_blocks(fp8_down, dtype)};
}

bool fp8_experts_grouped(const MoeWeights& w, at::Device device, at::ScalarType dtype) {
  return w.fp8_gate_up.defined() && dtype == at::kBFloat16 && fp8_grouped_gemm_applies(w.fp8_gate_up, device) &&
         fp8_grouped_gemm_applies(w.fp8_down, device);
}

bool fp8_experts_grouped_on(int64_t experts, int64_t hidden, int64_t inner, int device) {
#ifdef DFLASHD_WITH_CUDA
  return experts > 0 && grouped_fp8::weights_apply(experts, 2 * inner, hidden, nullptr, device) &&
         grouped_fp8::weights_apply(experts, hidden, inner, nullptr, device);
#else
  (void)experts;
  (void)hidden;
  (void)inner;
  (void)device;
  return false;
#endif
}

MoeRouting moe_route(const MoeShape& s, const at::Tensor& logits) {
  MoeRouting r;
#ifdef DFLASHD_WITH_CUDA
  if (kernels_apply(logits) && s.experts <= kernels::kMoeMaxExperts && s.top_k <= kernels::kMoeMaxTopK) {
    const int64_t tokens = logits.size(0);
    r.weights = at::empty({tokens, s.top_k}, logits.options().dtype(at::kFloat));
    r.experts = at::empty({tokens, s.top_k}, logits.options().dtype(at::kLong));
    kernels::moe_route(logits.data_ptr(), logits.stride(0), static_cast<int>(tokens), static_cast<int>(s.experts),
                       static_cast<int>(s.top_k), s.norm_topk_prob, r.weights.data_ptr<float>(),
                       r.experts.data_ptr<int64_t>(), at::cuda::getCurrentCUDAStream().stream());
    return r;
  }
#endif
  auto [weights, experts] = at::topk(at::softmax(logits.to(at::kFloat), -1), s.top_k, -1);
  r.weights = s.norm_topk_prob ? weights / weights.sum(-1, true) : weights;
  r.experts = experts;
  return r;
}

std::optional<std::string> moe_grouped_unavailable(at::Device device, at::ScalarType dtype) {
  if (!device.is_cuda()) return "device " + device.str() + " is not a GPU";
  if (dtype != at::kBFloat16) return std::string("target dtype ") + c10::toString(dtype) + ": the grouped GEMM kernel takes bfloat16";
#ifdef DFLASHD_WITH_CUDA
  if (!at::hasCUDA() || device.index() >= static_cast<int>(at::cuda::device_count())) {
    return "GPU " + device.str() + " is not visible to this process";
  }
  const auto* p = at::cuda::getDeviceProperties(device.index());
  if (p->major != 9 && p->major != 10) {
    return "GPU " + device.str() + " (" + p->name + ", sm_" + std::to_string(p->major) + std::to_string(p->minor) +
           "): ATen's grouped GEMM kernel runs on sm_90 and sm_100 only";
  }
  return std::nullopt;
#else
  return std::string("this build has no CUDA");
#endif
}

at::Tensor moe_grouped(const MoeShape& s, const MoeWeights& w, const at::Tensor& x) {
  const int64_t tokens = x.size(0), hidden = x.size(1), k = s.top_k;
  const at::Tensor projected = at::linear(x, w.input_proj);  // [T, E + 2S + 1 + pad]
  const MoeRouting routing = moe_route(s, projected.narrow(1, 0, s.experts));
  // Token-expert pairs (token t's j-th expert is pair t k + j) in expert order.
  const auto [sorted, order] = at::sort(routing.experts.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  // offsets[e]: pairs routed to experts 0..e, the end of group e (what _grouped_mm takes).
  const at::Tensor ends = at::arange(1, s.experts + 1, sorted.options());
  const at::Tensor offsets = at::searchsorted(sorted, ends, /*out_int32=*/true, /*right=*/false);
  const at::Tensor down = experts_forward(s, w, x, order, offsets);  // [pairs, H]
  // Where each pair's row went: pair order[p] is row p.
  const at::Tensor position = at::empty_like(order).index_put_({order}, at::arange(order.size(0), order.options()));
  const at::Tensor shared = shared_expert(s, w, projected);
#ifdef DFLASHD_WITH_CUDA
  if (kernels_apply(projected) && hidden % 8 == 0 && down.is_contiguous()) {
    at::Tensor out = at::empty_like(x);
    kernels::moe_combine(down.data_ptr(), position.data_ptr<int64_t>(), routing.weights.data_ptr<float>(),
                         static_cast<int>(tokens), static_cast<int>(k), static_cast<int>(hidden),
                         s.shared > 0 ? shared.data_ptr() : nullptr,
                         s.shared > 0 ? projected.narrow(1, s.experts + 2 * s.shared, 1).data_ptr() : nullptr,
                         projected.stride(0), out.data_ptr(), at::cuda::getCurrentCUDAStream().stream());
    return out;
  }
#endif
  const at::Tensor per_token = down.index_select(0, position).view({tokens, k, hidden});  // [T, k, H]
  const at::Tensor out = at::bmm(routing.weights.to(x.scalar_type()).unsqueeze(1), per_token).squeeze(1);
  return add_gated_shared(s, projected, shared, out);
}

at::Tensor moe_reference(const MoeShape& s, const MoeWeights& w, const at::Tensor& x) {
  const at::Tensor projected = at::linear(x, w.input_proj);
  const MoeRouting routing = moe_route(s, projected.narrow(1, 0, s.experts));
  const at::Tensor weights = routing.weights.to(x.scalar_type());
  at::Tensor out = at::zeros_like(x);
  const at::Tensor flat_expert = routing.experts.reshape({-1});
  const at::Tensor order = at::argsort(flat_expert);
  const at::Tensor counts = at::bincount(flat_expert, {}, s.experts).cpu();
  const int64_t* count = counts.data_ptr<int64_t>();
  const at::Tensor token_of = at::div(order, s.top_k, "floor");
  const at::Tensor weight_of = weights.reshape({-1}).index_select(0, order);
  const auto [gate_up_weights, down_weights] = w.experts(x.scalar_type());
  int64_t offset = 0;
  for (int64_t e = 0; e < s.experts; ++e) {
    if (count[e] == 0) continue;
    const at::Tensor tokens = token_of.narrow(0, offset, count[e]);
    const at::Tensor h = x.index_select(0, tokens);
    const at::Tensor gate_up = at::linear(h, gate_up_weights[e]);
    const at::Tensor act = at::silu(gate_up.narrow(-1, 0, s.inner)) * gate_up.narrow(-1, s.inner, s.inner);
    const at::Tensor y = at::linear(act, down_weights[e]) * weight_of.narrow(0, offset, count[e]).unsqueeze(1);
    out.index_add_(0, tokens, y);
    offset += count[e];
  }
  return add_gated_shared(s, projected, shared_expert(s, w, projected), out);
}

}  // namespace dflash::target
