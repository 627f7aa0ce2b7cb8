#include "target/gdn_cuda.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>
#include <deque>
#include <stdexcept>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "target/kernels/gated_delta_net.h"
#endif

#include "common/tensor_math.h"
#include "target/fused_ops.h"
#include "target/gated_delta_net.h"

namespace dflash::target {

std::optional<std::string> gdn_kernels_unavailable(const ModelConfig& c, at::Device device, at::ScalarType dtype) {
#ifndef DFLASHD_WITH_CUDA
  (void)c, (void)device, (void)dtype;
  return std::string("this build has no CUDA kernels (configured with DFLASHD_CUDA=OFF or without a CUDA toolkit)");
#else
  if (!device.is_cuda()) return "device " + device.str() + " is not a GPU (the kernels are CUDA)";
  if (c.linear_key_head_dim != kernels::kGdnHeadDim || c.linear_value_head_dim != kernels::kGdnHeadDim) {
    return "linear_key_head_dim " + std::to_string(c.linear_key_head_dim) + " / linear_value_head_dim " +
           std::to_string(c.linear_value_head_dim) + ": the kernels take head size 128 (every released Qwen3.5 / Qwen3-Next)";
  }
  if (c.linear_conv_kernel_dim < 1 || c.linear_conv_kernel_dim > 4) {
    return "linear_conv_kernel_dim " + std::to_string(c.linear_conv_kernel_dim) + ": the conv kernel takes widths 1-4";
  }
  const int64_t hk = c.linear_num_key_heads, hv = c.linear_num_value_heads;
  if (hk <= 0 || hv % hk != 0 || hv / hk > kernels::kGdnMaxGroup) {
    return "linear_num_value_heads " + std::to_string(hv) + " / linear_num_key_heads " + std::to_string(hk) +
           ": the kernels take up to " + std::to_string(kernels::kGdnMaxGroup) + " value heads per key head";
  }
  if (dtype != at::kBFloat16) return std::string("target dtype ") + c10::toString(dtype) + ": the kernels take bfloat16";
  if (!at::hasCUDA() || device.index() >= static_cast<int>(at::cuda::device_count())) {
    return "GPU " + device.str() + " is not visible to this process";
  }
  const c10::cuda::CUDAGuard guard(device);
  const std::string error = kernels::kernels_unavailable_on_current_device();
  if (!error.empty()) {
    const auto* p = at::cuda::getDeviceProperties(device.index());
    return "GPU " + device.str() + " (" + p->name + ", sm_" + std::to_string(p->major) + std::to_string(p->minor) +
           ") has no image of the kernels in this build (" + error + "): add it to CMAKE_CUDA_ARCHITECTURES";
  }
  return std::nullopt;
#endif
}

GdnChunkPlan make_gdn_chunk_plan(const std::vector<int64_t>& cu_seqlens, at::Device device) {
  std::vector<int32_t> start, length, seq_chunks{0};
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    for (int64_t t = cu_seqlens[s]; t < cu_seqlens[s + 1]; t += 64) {
      start.push_back(static_cast<int32_t>(t));
      length.push_back(static_cast<int32_t>(std::min<int64_t>(64, cu_seqlens[s + 1] - t)));
    }
    seq_chunks.push_back(static_cast<int32_t>(start.size()));
  }
  GdnChunkPlan plan;
  plan.num_chunks = static_cast<int>(start.size());
  plan.num_seqs = static_cast<int>(seq_chunks.size()) - 1;
  std::vector<int32_t> table(start);
  table.insert(table.end(), length.begin(), length.end());
  table.insert(table.end(), seq_chunks.begin(), seq_chunks.end());
  plan.table = values_on(table, at::kInt, device);
  return plan;
}

GdnInputs random_gdn_inputs(const std::vector<int64_t>& lengths, int64_t key_heads, int64_t value_heads, double decay,
                            at::Device device) {
  GdnInputs in;
  in.cu_seqlens = {0};
  for (int64_t l : lengths) in.cu_seqlens.push_back(in.cu_seqlens.back() + l);
  const int64_t n = in.cu_seqlens.back();
  const auto options = at::TensorOptions().device(device);
  auto l2 = [](const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); };
  in.q = l2(at::randn({n, key_heads, 128}, options)).to(at::kBFloat16);
  in.k = l2(at::randn({n, key_heads, 128}, options)).to(at::kBFloat16);
  in.v = at::randn({n, value_heads, 128}, options).to(at::kBFloat16);
  in.g = -decay * (0.05 + 0.95 * at::rand({n, value_heads}, options));
  in.beta = at::sigmoid(at::randn({n, value_heads}, options));
  in.mixed = at::cat({in.q.reshape({n, -1}), in.k.reshape({n, -1}), in.v.reshape({n, -1})}, 1);
  return in;
}

double gdn_kernel_error(const GdnInputs& in, int64_t key_heads, int64_t value_heads, at::Tensor* kernel_output) {
  const at::Tensor ours = gated_delta_rule_cuda(in.mixed, key_heads, value_heads, GdnGates::precomputed(in.g, in.beta),
                                                make_gdn_chunk_plan(in.cu_seqlens, in.mixed.device()));
  const at::Tensor reference = chunk_gated_delta_rule_packed_reference(in.q.to(at::kFloat), in.k.to(at::kFloat),
                                                                       in.v.to(at::kFloat), in.g, in.beta, in.cu_seqlens);
  if (kernel_output != nullptr) *kernel_output = ours;
  const at::Tensor a = ours.to(at::kDouble), b = reference.to(at::kDouble);
  return ((a - b).norm() / b.norm()).item<double>();
}

#ifdef DFLASHD_WITH_CUDA
namespace {

void expect(bool ok, const std::string& what) {
  if (!ok) throw std::invalid_argument("GatedDeltaNet kernels: " + what);
}

}  // namespace

at::Tensor conv1d_silu_l2norm_cuda(const at::Tensor& x_in, const at::Tensor& weight_in, const at::Tensor& positions_in,
                                   int64_t qk_channels) {
  expect(x_in.is_cuda() && x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16, "conv input must be bf16 [tokens, channels] on a GPU");
  const c10::cuda::CUDAGuard guard(x_in.device());
  // Strided rows (a column slice of the fused projection) are read in place.
  const at::Tensor x = vector_rows(x_in) ? x_in : x_in.contiguous();
  const at::Tensor weight = weight_in.to(at::kBFloat16).contiguous();
  const at::Tensor positions = positions_in.to(at::kLong).contiguous();
  expect(weight.dim() == 2 && weight.size(0) == x.size(1), "conv weight must be [channels, kernel]");
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  kernels::conv1d_silu_l2norm(x.data_ptr(), x.stride(0), weight.data_ptr(), static_cast<int>(weight.size(1)),
                              positions.data_ptr<int64_t>(), y.data_ptr(), static_cast<int>(x.size(0)),
                              static_cast<int>(x.size(1)), static_cast<int>(qk_channels),
                              at::cuda::getCurrentCUDAStream().stream());
  return y;
}

namespace {

// Binds the gated norm of a decode step's output (GdnOutputNorm) into the launch where the
// kernels can read z and the weight as they lie; returns the normed rows' tensor, or an undefined
// one where the norm is left to fused_ops' gated_rms_norm after the step.
at::Tensor bind_decode_norm(const GdnOutputNorm& norm, int64_t rows, int64_t value_heads, kernels::GdnDecodeStep& a) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  const at::Tensor& z = norm.z;
  const bool readable = rows_apply(z) && z.dim() == 3 && z.size(0) == rows && z.size(1) == value_heads &&
                        z.size(2) == D && norm.weight.scalar_type() == at::kBFloat16 &&
                        norm.weight.is_contiguous() && norm.weight.numel() == D && norm.weight.device() == z.device();
  if (!readable) return {};
  at::Tensor normed = at::empty({rows, value_heads * D}, z.options().memory_format(at::MemoryFormat::Contiguous));
  a.norm.z = z.data_ptr();
  a.norm.z_stride = z.stride(0);
  a.norm.z_head_stride = z.stride(1);
  a.norm.weight = norm.weight.data_ptr();
  a.norm.eps = static_cast<float>(norm.eps);
  a.norm.normed = normed.data_ptr();
  return normed;
}

// Deferred stores' arguments: the logs' and pending counts' device tables, one entry a sequence.
// The logs and counts of `d`, and the launch's handoff between its two kernels (returned: it must
// live until the launch is queued; the caching allocator reuses it after).
at::Tensor bind_deferred(const GdnDeferredRows& d, int64_t sequences, int64_t value_heads, bool store_all,
                         kernels::GdnDecodeStep& a) {
  expect(d.logs.is_cuda() && d.logs.scalar_type() == at::kLong && d.logs.numel() == sequences &&
             d.pending.is_cuda() && d.pending.scalar_type() == at::kLong && d.pending.numel() == sequences &&
             d.logs.is_contiguous() && d.pending.is_contiguous(),
         "deferred stores: logs and pending must be int64 [sequences] on the GPU");
  a.deferred.logs = static_cast<void* const*>(d.logs.data_ptr());
  a.deferred.pending = d.pending.data_ptr<int64_t>();
  a.deferred.store_all = store_all;
  const kernels::GdnDeferredHandoff layout{static_cast<int>(sequences), static_cast<int>(value_heads), store_all};
  at::Tensor handoff = at::empty({layout.floats()}, d.logs.options().dtype(at::kFloat));
  a.deferred.handoff = handoff.data_ptr<float>();
  return handoff;
}

// The decode step's launch: the states read from `state` (a [sequences, value_heads, 128, 128]
// batch) or, with `state_rows` defined, where its addresses point (`state` then only gives the
// dtype and device of the new batch). With `norm`, o is the layer's gated RMSNorm of it (GdnOutputNorm).
GdnDecodeResult decode_step(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& g_in,
                            const at::Tensor& beta_in, const at::Tensor& state_in, const at::Tensor& state_rows,
                            const GdnOutputNorm* norm, const GdnDeferredRows* deferred = nullptr) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  const int64_t sequences = q_in.size(0), tokens = q_in.size(1), key_heads = q_in.size(2), value_heads = v_in.size(2);
  auto shaped = [&](const at::Tensor& t, int64_t heads) {
    return t.is_cuda() && t.scalar_type() == at::kBFloat16 && t.dim() == 4 && t.size(0) == sequences &&
           t.size(1) == tokens && t.size(2) == heads && t.size(3) == D;
  };
  expect(tokens >= 1 && shaped(q_in, key_heads) && shaped(k_in, key_heads) && shaped(v_in, value_heads),
         "decode step: q, k, v must be bf16 [sequences, tokens >= 1, heads, 128] on a GPU");
  // Rows (token t of sequence s at s * tokens + t) evenly spaced, each row's heads dense: the
  // conv's [sequences, tokens, channels] output is read in place. With one token a row is a
  // sequence (the stride of the size-1 token dim says nothing: a view sets it freely).
  auto rows = [&](const at::Tensor& t) {
    const bool in_place = t.stride(3) == 1 && t.stride(2) == D && (tokens == 1 || t.stride(0) == tokens * t.stride(1));
    return in_place ? t : t.contiguous();
  };
  auto row_stride = [&](const at::Tensor& t) { return tokens == 1 ? t.stride(0) : t.stride(1); };
  const at::Tensor q = rows(q_in), k = rows(k_in), v = rows(v_in);
  const c10::cuda::CUDAGuard guard(q.device());
  const at::Tensor g = g_in.to(at::kFloat).contiguous(), beta = beta_in.to(at::kFloat).contiguous();
  expect(g.numel() == sequences * tokens * value_heads && beta.numel() == g.numel(),
         "decode step: g, beta must be [sequences, tokens, value_heads]");
  const bool by_address = state_rows.defined();
  // bf16 states stay bf16 (read and written as such); anything else runs as fp32.
  at::Tensor state;
  if (by_address) {
    expect(state_rows.is_cuda() && state_rows.scalar_type() == at::kLong && state_rows.numel() == sequences &&
               (state_in.scalar_type() == at::kBFloat16 || state_in.scalar_type() == at::kFloat),
           "decode step: state_rows must be int64 [sequences] on the GPU, the states fp32 or bf16");
    if (deferred == nullptr) state = at::empty({sequences, value_heads, D, D}, state_in.options());
  } else {
    state = (state_in.scalar_type() == at::kBFloat16 ? state_in : state_in.to(at::kFloat)).contiguous();
    expect(state.numel() == sequences * value_heads * D * D,
           "decode step: the state must be [sequences, value_heads, 128, 128]");
  }
  // The output is fp32 whatever the state's dtype (the kernel's epilogue writes fp32).
  GdnDecodeResult r{at::empty({sequences, tokens, value_heads, D}, q.options().dtype(at::kFloat)),
                    by_address ? state : at::empty_like(state)};
  kernels::GdnDecodeStep a;
  a.q = q.data_ptr(), a.k = k.data_ptr(), a.v = v.data_ptr();
  a.q_stride = row_stride(q), a.k_stride = row_stride(k), a.v_stride = row_stride(v);
  a.g = g.data_ptr<float>(), a.beta = beta.data_ptr<float>();
  a.state_in = by_address ? nullptr : state.data_ptr();
  a.state_rows = by_address ? static_cast<const void* const*>(state_rows.data_ptr()) : nullptr;
  a.state_out = r.state.defined() ? r.state.data_ptr() : nullptr, a.out = r.o.data_ptr<float>();
  a.state_bf16 = (state.defined() ? state : state_in).scalar_type() == at::kBFloat16;
  const at::Tensor handoff = deferred ? bind_deferred(*deferred, sequences, value_heads, false, a) : at::Tensor();
  a.sequences = static_cast<int>(sequences), a.tokens = static_cast<int>(tokens);
  a.key_heads = static_cast<int>(key_heads), a.value_heads = static_cast<int>(value_heads);
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  const at::Tensor normed = norm ? bind_decode_norm(*norm, sequences * tokens, value_heads, a) : at::Tensor();
  kernels::gated_delta_rule_decode_step(a, at::cuda::getCurrentCUDAStream().stream());
  if (normed.defined()) {
    r.o = normed;
  } else if (norm != nullptr) {
    r.o = gated_rms_norm(r.o.view({sequences * tokens, value_heads, D}), norm->z, norm->weight, norm->eps,
                         at::kBFloat16);
  }
  return r;
}

}  // namespace

GdnDecodeResult gated_delta_rule_decode_step_deferred_cuda(const at::Tensor& q, const at::Tensor& k,
                                                           const at::Tensor& v, const at::Tensor& g,
                                                           const at::Tensor& beta, const at::Tensor& state_rows,
                                                           const GdnDeferredRows& deferred, const GdnOutputNorm* norm) {
  expect(q.size(1) == 1, "decode step with deferred stores: one token a sequence");
  return decode_step(q, k, v, g, beta, at::empty({0}, q.options()), state_rows, norm, &deferred);
}

void gated_delta_rule_store_deferred_cuda(const at::Tensor& state_rows, const GdnDeferredRows& deferred,
                                          int64_t key_heads, int64_t value_heads) {
  const int64_t sequences = state_rows.numel();
  expect(state_rows.is_cuda() && state_rows.scalar_type() == at::kLong,
         "deferred stores: state_rows must be int64 [sequences] on the GPU");
  const c10::cuda::CUDAGuard guard(state_rows.device());
  kernels::GdnDecodeStep a;
  a.state_rows = static_cast<const void* const*>(state_rows.data_ptr());
  a.state_bf16 = true;
  a.sequences = static_cast<int>(sequences);
  a.key_heads = static_cast<int>(key_heads), a.value_heads = static_cast<int>(value_heads);
  const at::Tensor handoff = bind_deferred(deferred, sequences, value_heads, true, a);
  kernels::gated_delta_rule_decode_step(a, at::cuda::getCurrentCUDAStream().stream());
}

GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state,
                                                  const GdnOutputNorm* norm) {
  return decode_step(q, k, v, g, beta, state, {}, norm);
}

GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state_rows,
                                                  at::ScalarType state_dtype, const GdnOutputNorm* norm) {
  return decode_step(q, k, v, g, beta, at::empty({0}, q.options().dtype(state_dtype)), state_rows, norm);
}

namespace {

// One launch's arguments and the tensors they point into (kept alive until the launch is queued).
struct GdnLaunch {
  kernels::GdnForward args;
  std::deque<at::Tensor> keep;  // a deque: references to held tensors stay valid as more are held
  const at::Tensor& hold(at::Tensor t) { return keep.emplace_back(std::move(t)); }
};

// The gates: the raw projections a, b with A_log and dt_bias (formed inside the kernels), or
// g and beta precomputed (tests, benches).
void bind_gates(const GdnGates& gates, int64_t tokens, int64_t value_heads, GdnLaunch* l) {
  kernels::GdnForward& a = l->args;
  if (gates.a.defined()) {
    expect(gates.a.numel() == tokens * value_heads && gates.b.numel() == tokens * value_heads &&
               gates.a_log.numel() == value_heads && gates.dt_bias.numel() == value_heads,
           "gate projections a, b must be [tokens, value_heads], A_log and dt_bias [value_heads]");
    auto rows = [&](const at::Tensor& t) {  // [tokens, value_heads] with unit column stride, any row stride
      const at::Tensor r = t.to(at::kBFloat16).reshape({tokens, value_heads});
      return r.stride(1) == 1 ? r : r.contiguous();
    };
    const at::Tensor& gate_a = l->hold(rows(gates.a));
    const at::Tensor& gate_b = l->hold(rows(gates.b));
    a.gate_a = gate_a.data_ptr();
    a.gate_b = gate_b.data_ptr();
    a.a_stride = gate_a.stride(0);
    a.b_stride = gate_b.stride(0);
    a.a_log = l->hold(gates.a_log.to(at::kFloat).contiguous()).data_ptr<float>();
    a.dt_bias = l->hold(gates.dt_bias.to(at::kFloat).contiguous()).data_ptr<float>();
  } else {
    const at::Tensor& g = l->hold(gates.g.to(at::kFloat).contiguous());
    const at::Tensor& beta = l->hold(gates.beta.to(at::kFloat).contiguous());
    expect(g.numel() == tokens * value_heads && beta.numel() == tokens * value_heads,
           "g and beta must be [tokens, value_heads]");
    a.g = g.data_ptr<float>();
    a.beta = beta.data_ptr<float>();
  }
}

// The per-chunk intermediates between the kernels (the states and V' only where the state pass
// and the output are separate kernels).
void bind_workspace(const at::TensorOptions& bf, int64_t value_heads, const GdnChunkPlan& plan, int state_columns,
                    GdnLaunch* l) {
  constexpr int64_t D = kernels::kGdnHeadDim, C = kernels::kGdnChunk;
  kernels::GdnForward& a = l->args;
  const int64_t chunks = plan.num_chunks;
  const bool fused = kernels::gated_delta_rule_fuses_output(state_columns);
  a.w = l->hold(at::empty({chunks, value_heads, C, D}, bf)).data_ptr();
  a.u = l->hold(at::empty({chunks, value_heads, C, D}, bf)).data_ptr();
  a.v_new = fused ? nullptr : l->hold(at::empty({chunks, value_heads, C, D}, bf)).data_ptr();
  a.states = fused ? nullptr : l->hold(at::empty({chunks, value_heads, D, D}, bf)).data_ptr();
  a.gamma = l->hold(at::empty({chunks, value_heads, C}, bf.dtype(at::kFloat))).data_ptr<float>();
  a.qk = l->hold(at::empty({chunks, value_heads, C, C}, bf)).data_ptr();
  const int32_t* table = plan.table.data_ptr<int32_t>();
  a.chunks = {table, table + chunks, table + 2 * chunks, plan.num_chunks, plan.num_seqs};
  a.state_columns = state_columns;
}

// The gated RMSNorm's inputs: z (bf16 [tokens, value_heads, 128], contiguous heads) and the
// norm's weight.
void bind_norm(const at::Tensor& z, const at::Tensor& norm_weight_in, int64_t tokens, int64_t value_heads,
               GdnLaunch* l) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  expect(z.defined() && z.scalar_type() == at::kBFloat16 && z.dim() == 3 && z.size(0) == tokens &&
             z.size(1) == value_heads && z.size(2) == D && z.stride(2) == 1 && z.stride(1) == D,
         "z must be bf16 [tokens, value_heads, 128] with contiguous heads");
  kernels::GdnForward& a = l->args;
  a.z = z.data_ptr();
  a.z_stride = z.stride(0);
  a.norm_weight = l->hold(norm_weight_in.to(at::kBFloat16).contiguous()).data_ptr();
}

// The output: gated RMSNorm with z (bf16 [tokens, value_heads * 128]), or the plain output of
// the rule in bf16 or fp32 ([tokens, value_heads, 128]).
at::Tensor bind_output(const at::Tensor& z, const at::Tensor& norm_weight_in, at::ScalarType o_dtype,
                       const at::TensorOptions& bf, int64_t tokens, int64_t value_heads, GdnLaunch* l) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  kernels::GdnForward& a = l->args;
  expect(o_dtype == at::kFloat || o_dtype == at::kBFloat16, "o_dtype must be float32 or bfloat16");
  if (norm_weight_in.defined()) {
    bind_norm(z, norm_weight_in, tokens, value_heads, l);
    at::Tensor out = at::empty({tokens, value_heads * D}, bf);
    a.out = out.data_ptr();
    return out;
  }
  if (o_dtype == at::kBFloat16) {
    at::Tensor out = at::empty({tokens, value_heads, D}, bf);
    a.out_plain = out.data_ptr();
    return out;
  }
  at::Tensor out = at::empty({tokens, value_heads, D}, bf.dtype(at::kFloat));
  a.out_raw = out.data_ptr<float>();
  return out;
}

// The states a prefill's sequences start from and end with (GdnCarriedStates).
void bind_carried_states(GdnCarriedStates* carried, int64_t sequences, int64_t value_heads, at::Device device,
                         GdnLaunch* l) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  kernels::GdnForward& a = l->args;
  const std::vector<int64_t> shape{sequences, value_heads, D, D};
  if (carried->before.defined()) {
    const at::ScalarType dtype = carried->before.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat;
    const at::Tensor& before = l->hold(carried->before.to(dtype).contiguous());
    expect(before.sizes() == at::IntArrayRef(shape) && before.device() == device,
           "the carried states must be [sequences, value_heads, 128, 128] on the input's device");
    a.state_before = before.data_ptr();
    carried->dtype = dtype;
  }
  expect(carried->dtype == at::kFloat || carried->dtype == at::kBFloat16, "the carried states are fp32 or bf16");
  carried->after = at::empty(shape, at::TensorOptions().dtype(carried->dtype).device(device));
  a.state_after = carried->after.data_ptr();
  a.carried_bf16 = carried->dtype == at::kBFloat16;
}

// Queues the kernels; with `stage_ms`, times the three stages (prepare, state, output) by events.
void launch(GdnLaunch& l, float* stage_ms) {
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  if (stage_ms == nullptr) {
    kernels::gated_delta_rule_forward(l.args, stream);
    return;
  }
  cudaEvent_t events[4];
  for (cudaEvent_t& e : events) cudaEventCreate(&e);
  l.args.stage_events = events;
  kernels::gated_delta_rule_forward(l.args, stream);
  cudaEventSynchronize(events[3]);
  for (int i = 0; i < 3; ++i) cudaEventElapsedTime(&stage_ms[i], events[i], events[i + 1]);
  for (cudaEvent_t& e : events) cudaEventDestroy(e);
}

// The rule's input, gates and workspace (the caller holds a CUDAGuard for mixed's device).
void bind_rule(const at::Tensor& mixed_in, int64_t key_heads, int64_t value_heads, const GdnGates& gates,
               const GdnChunkPlan& plan, double eps, int state_columns, GdnLaunch* l) {
  constexpr int64_t D = kernels::kGdnHeadDim;
  expect(mixed_in.is_cuda() && mixed_in.scalar_type() == at::kBFloat16 && mixed_in.dim() == 2 &&
             mixed_in.size(1) == (2 * key_heads + value_heads) * D,
         "mixed must be bf16 [tokens, (2 key_heads + value_heads) * 128] on a GPU");
  expect(plan.table.defined() && plan.table.device() == mixed_in.device(), "the chunk plan must be on the input's device");
  const at::Tensor& mixed = l->hold(mixed_in.stride(1) == 1 ? mixed_in : mixed_in.contiguous());
  const int64_t tokens = mixed.size(0);
  kernels::GdnForward& a = l->args;
  a.qkv = mixed.data_ptr();
  a.qkv_stride = mixed.stride(0);
  a.tokens = static_cast<int>(tokens);
  a.key_heads = static_cast<int>(key_heads);
  a.value_heads = static_cast<int>(value_heads);
  a.scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(D)));
  a.eps = static_cast<float>(eps);
  bind_gates(gates, tokens, value_heads, l);
  bind_workspace(mixed.options(), value_heads, plan, state_columns, l);
}

}  // namespace

at::Tensor gated_delta_rule_cuda(const at::Tensor& mixed, int64_t key_heads, int64_t value_heads, const GdnGates& gates,
                                 const GdnChunkPlan& plan, const at::Tensor& z, const at::Tensor& norm_weight,
                                 double eps, int state_columns, float* stage_ms, at::ScalarType o_dtype,
                                 GdnCarriedStates* carried) {
  const c10::cuda::CUDAGuard guard(mixed.device());
  GdnLaunch l;
  bind_rule(mixed, key_heads, value_heads, gates, plan, eps, state_columns, &l);
  const int64_t tokens = mixed.size(0);
  const at::Tensor out = bind_output(z, norm_weight, o_dtype, mixed.options(), tokens, value_heads, &l);
  if (carried != nullptr) bind_carried_states(carried, plan.num_seqs, value_heads, mixed.device(), &l);
  launch(l, stage_ms);
  return out;
}

ConvStepResult conv_step_cuda(const at::Tensor& tails_in, const at::Tensor& x_in, const at::Tensor& weight_in,
                              const ConvStepGates* gates, bool settled) {
  expect(tails_in.is_cuda() && tails_in.dim() == 3 && tails_in.scalar_type() == at::kBFloat16 && x_in.dim() == 2 &&
             x_in.scalar_type() == at::kBFloat16,
         "conv step inputs must be bf16 tails [G, K - 1, C] and rows [G * n, C] on a GPU");
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = vector_rows(x_in) ? x_in : x_in.contiguous();
  const at::Tensor tails = vector_rows(tails_in) ? tails_in : tails_in.contiguous();
  const at::Tensor weight = weight_in.to(at::kBFloat16).contiguous();
  const int64_t sequences = tails.size(0), held = tails.size(1), channels = tails.size(2);
  expect(weight.dim() == 2 && weight.size(0) == channels && weight.size(1) == held + 1 && x.size(1) == channels &&
             x.size(0) % std::max<int64_t>(sequences, 1) == 0,
         "conv step: weight [C, K], tails [G, K - 1, C] and rows [G * n, C] disagree");
  ConvStepResult r{at::empty({x.size(0), channels}, x.options()), at::empty({sequences, held, channels}, x.options()),
                   {}, {}};
  kernels::ConvStep a;
  a.tails = tails.data_ptr();
  a.tails_sequence_stride = tails.stride(0), a.tails_row_stride = tails.stride(1);
  a.x = x.data_ptr(), a.x_stride = x.stride(0);
  a.weight = weight.data_ptr();
  a.kernel = static_cast<int>(held + 1), a.sequences = static_cast<int>(sequences);
  a.tokens = sequences == 0 ? 0 : static_cast<int>(x.size(0) / sequences), a.channels = static_cast<int>(channels);
  a.y = r.y.data_ptr(), a.new_tails = r.tails.data_ptr();
  a.inputs_settled = settled && tails.is_same(tails_in) && weight.is_same(weight_in);
  if (gates != nullptr) {
    expect(gdn_gates_kernel_applies(gates->a, gates->b, gates->a_log, gates->dt_bias) && gates->a.size(0) == x.size(0),
           "conv step gates: a, b must be bf16 [rows, heads] with contiguous heads, A_log and dt_bias fp32 [heads]");
    r.g = at::empty(gates->a.sizes(), gates->a.options().dtype(at::kFloat));
    r.beta = at::empty_like(r.g);
    a.gate_a = gates->a.data_ptr(), a.a_stride = gates->a.stride(0);
    a.gate_b = gates->b.data_ptr(), a.b_stride = gates->b.stride(0);
    a.a_log = gates->a_log.data_ptr<float>(), a.dt_bias = gates->dt_bias.data_ptr<float>();
    a.g = r.g.data_ptr<float>(), a.beta = r.beta.data_ptr<float>();
    a.heads = static_cast<int>(gates->a.size(1));
  }
  kernels::conv_step(a, at::cuda::getCurrentCUDAStream().stream());
  return r;
}
#else
ConvStepResult conv_step_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, const ConvStepGates*, bool) {
  throw std::logic_error("conv_step_cuda: this build has no CUDA kernels");
}
at::Tensor conv1d_silu_l2norm_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t) {
  throw std::logic_error("conv1d_silu_l2norm_cuda: this build has no CUDA kernels");
}
at::Tensor gated_delta_rule_cuda(const at::Tensor&, int64_t, int64_t, const GdnGates&, const GdnChunkPlan&,
                                 const at::Tensor&, const at::Tensor&, double, int, float*, at::ScalarType,
                                 GdnCarriedStates*) {
  throw std::logic_error("gated_delta_rule_cuda: this build has no CUDA kernels");
}
GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const GdnOutputNorm*) {
  throw std::logic_error("gated_delta_rule_decode_step_cuda: this build has no CUDA kernels");
}
GdnDecodeResult gated_delta_rule_decode_step_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                  at::ScalarType, const GdnOutputNorm*) {
  throw std::logic_error("gated_delta_rule_decode_step_cuda: this build has no CUDA kernels");
}
GdnDecodeResult gated_delta_rule_decode_step_deferred_cuda(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                                           const GdnDeferredRows&, const GdnOutputNorm*) {
  throw std::logic_error("gated_delta_rule_decode_step_deferred_cuda: this build has no CUDA kernels");
}
void gated_delta_rule_store_deferred_cuda(const at::Tensor&, const GdnDeferredRows&, int64_t, int64_t) {
  throw std::logic_error("gated_delta_rule_store_deferred_cuda: this build has no CUDA kernels");
}
#endif

}  // namespace dflash::target
