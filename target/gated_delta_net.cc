#include "target/gated_delta_net.h"

#include <ATen/ATen.h>

#include <cmath>
#include <mutex>

namespace dflash::target {

GdnGateValues gdn_gates_reference(const at::Tensor& a, const at::Tensor& b, const at::Tensor& a_log,
                                  const at::Tensor& dt_bias) {
  return {-at::exp(a_log.to(at::kFloat)) * at::softplus(a.to(at::kFloat) + dt_bias.to(at::kFloat)),
          at::sigmoid(b.to(at::kFloat))};
}
namespace {

// X with system X = rhs, `system` unit lower triangular (its diagonal and upper part ignored).
// ATen loads its CUDA linear algebra at the first linalg call on a GPU, and that load is not
// thread-safe: two threads' first calls at once fail with "lazy wrapper should be called at most
// once" (pytorch/pytorch#90613; seen with the two decoders of a target split into stages). The
// first CUDA call is therefore made alone.
at::Tensor solve_unit_lower(const at::Tensor& system, const at::Tensor& rhs) {
  const auto solve = [&] {
    return at::linalg_solve_triangular(system, rhs, /*upper=*/false, /*left=*/true, /*unitriangular=*/true);
  };
  if (!system.is_cuda()) return solve();
  static std::once_flag loaded;
  at::Tensor first;
  std::call_once(loaded, [&] { first = solve(); });
  return first.defined() ? first : solve();
}

at::Tensor l2_normalize(const at::Tensor& x) {
  return x * at::rsqrt((x * x).sum(-1, /*keepdim=*/true) + 1e-6);  // eps 1e-6 inside, as FLA and HF
}

}  // namespace

at::Tensor causal_conv1d_silu_reference(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& positions) {
  const int64_t tokens = x.size(0), kernel = weight.size(1);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor wf = weight.to(at::kFloat);
  at::Tensor out = xf * wf.select(1, kernel - 1);  // shift 0: the token itself
  for (int64_t shift = 1; shift < kernel && shift < tokens; ++shift) {
    // x[t - shift], zero where that would cross the start of t's own sequence.
    const at::Tensor shifted = at::cat({at::zeros({shift, x.size(1)}, xf.options()), xf.narrow(0, 0, tokens - shift)});
    const at::Tensor inside = (positions >= shift).to(at::kFloat).unsqueeze(1);
    out = out + shifted * inside * wf.select(1, kernel - 1 - shift);
  }
  return at::silu(out).to(x.scalar_type());
}

at::Tensor chunk_gated_delta_rule_reference(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                            const at::Tensor& g_in, const at::Tensor& beta_in, int64_t chunk_size,
                                            at::Tensor* state_io) {
  const int64_t length = q_in.size(0), key_heads = q_in.size(1), key_dim = q_in.size(2);
  const int64_t value_heads = v_in.size(1), value_dim = v_in.size(2);
  const int64_t group = value_heads / key_heads;
  const int64_t C = chunk_size;
  const int64_t padded = (length + C - 1) / C * C, chunks = padded / C;

  // [T, H, d] -> [Hv, T, d] in fp32; the reference repeats q/k per value head (the kernels do not).
  at::Tensor q = l2_normalize(q_in.to(at::kFloat)) * (1.0 / std::sqrt(static_cast<double>(key_dim)));
  at::Tensor k = l2_normalize(k_in.to(at::kFloat));
  q = q.repeat_interleave(group, 1).transpose(0, 1);
  k = k.repeat_interleave(group, 1).transpose(0, 1);
  at::Tensor v = v_in.to(at::kFloat).transpose(0, 1);
  at::Tensor g = g_in.to(at::kFloat).transpose(0, 1);        // [Hv, T]
  at::Tensor beta = beta_in.to(at::kFloat).transpose(0, 1);  // [Hv, T]
  // Padding past the end: g = beta = k = v = 0, which leaves the real tokens untouched (causal).
  const int64_t pad = padded - length;
  if (pad > 0) {
    q = at::constant_pad_nd(q, {0, 0, 0, pad});
    k = at::constant_pad_nd(k, {0, 0, 0, pad});
    v = at::constant_pad_nd(v, {0, 0, 0, pad});
    g = at::constant_pad_nd(g, {0, pad});
    beta = at::constant_pad_nd(beta, {0, pad});
  }
  q = q.reshape({value_heads, chunks, C, key_dim});
  k = k.reshape({value_heads, chunks, C, key_dim});
  v = v.reshape({value_heads, chunks, C, value_dim});
  beta = beta.reshape({value_heads, chunks, C});
  const at::Tensor gamma = g.reshape({value_heads, chunks, C}).cumsum(-1);  // within-chunk cumulative log decay

  // decay[i, j] = exp(gamma_i - gamma_j) for j <= i, else 0 (mask before exp: no inf * 0).
  const at::Tensor upper = at::ones({C, C}, at::TensorOptions().dtype(at::kBool)).triu(1).to(q.device());
  const at::Tensor decay = (gamma.unsqueeze(-1) - gamma.unsqueeze(-2)).masked_fill(upper, -INFINITY).exp();
  const at::Tensor k_beta = k * beta.unsqueeze(-1);
  // (I + strict_lower(diag(beta) K K^T o decay)): solve_triangular(unitriangular) ignores the diagonal.
  const at::Tensor system = at::matmul(k_beta, k.transpose(-1, -2)) * decay;
  const at::Tensor u = solve_unit_lower(system, v * beta.unsqueeze(-1));                // U = T diag(beta) V
  const at::Tensor w = solve_unit_lower(system, k_beta * gamma.exp().unsqueeze(-1));  // W = T diag(beta e^gamma) K
  const at::Tensor intra = at::matmul(q, k.transpose(-1, -2)) * decay;  // causal, decayed Q K^T
  const at::Tensor q_decayed = q * gamma.exp().unsqueeze(-1);
  const at::Tensor gamma_last = gamma.select(-1, C - 1).unsqueeze(-1);  // [Hv, chunks, 1]
  const at::Tensor k_decayed = k * (gamma_last - gamma).exp().unsqueeze(-1);
  const at::Tensor chunk_decay = gamma_last.exp().unsqueeze(-1);  // [Hv, chunks, 1, 1]

  at::Tensor state = state_io != nullptr && state_io->defined() ? state_io->to(q.options())
                                                                : at::zeros({value_heads, key_dim, value_dim}, q.options());
  std::vector<at::Tensor> outputs;
  outputs.reserve(chunks);
  for (int64_t c = 0; c < chunks; ++c) {  // the one sequential dependency: the state
    const at::Tensor v_new = u.select(1, c) - at::matmul(w.select(1, c), state);              // V' = U - W S
    outputs.push_back(at::matmul(q_decayed.select(1, c), state) + at::matmul(intra.select(1, c), v_new));
    state = state * chunk_decay.select(1, c) + at::matmul(k_decayed.select(1, c).transpose(-1, -2), v_new);
  }
  // Padded tokens (g = 0, k = v = 0) leave the state as the last real token left it.
  if (state_io != nullptr) *state_io = state;
  const at::Tensor o = at::stack(outputs, 1).reshape({value_heads, padded, value_dim});
  return o.narrow(1, 0, length).transpose(0, 1).contiguous();  // [T, Hv, dv]
}

GdnSteps recurrent_gated_delta_rule_steps(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                          const at::Tensor& g_in, const at::Tensor& beta_in, const at::Tensor& initial) {
  const int64_t length = q_in.size(0), key_heads = q_in.size(1), key_dim = q_in.size(2);
  const int64_t value_heads = v_in.size(1), value_dim = v_in.size(2), group = value_heads / key_heads;
  const at::Tensor q = (l2_normalize(q_in.to(at::kFloat)) * (1.0 / std::sqrt(static_cast<double>(key_dim))))
                           .repeat_interleave(group, 1);
  const at::Tensor k = l2_normalize(k_in.to(at::kFloat)).repeat_interleave(group, 1);
  const at::Tensor v = v_in.to(at::kFloat), g = g_in.to(at::kFloat), beta = beta_in.to(at::kFloat);
  at::Tensor state = initial.defined() ? initial.to(q.options())
                                       : at::zeros({value_heads, key_dim, value_dim}, q.options());
  std::vector<at::Tensor> outputs, states;
  for (int64_t t = 0; t < length; ++t) {
    state = state * g[t].exp().view({value_heads, 1, 1});
    const at::Tensor kt = k[t];
    const at::Tensor delta = (v[t] - at::matmul(kt.unsqueeze(1), state).squeeze(1)) * beta[t].unsqueeze(-1);
    state = state + kt.unsqueeze(-1) * delta.unsqueeze(1);
    outputs.push_back(at::matmul(q[t].unsqueeze(1), state).squeeze(1));
    states.push_back(state);
  }
  if (length == 1) return {outputs[0].unsqueeze(0), states[0].unsqueeze(0)};  // a decode step: no copies
  return {at::stack(outputs, 0), at::stack(states, 0)};
}

at::Tensor chunk_gated_delta_rule_packed_reference(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                   const at::Tensor& g, const at::Tensor& beta,
                                                   const std::vector<int64_t>& cu_seqlens, int64_t chunk_size) {
  std::vector<at::Tensor> parts;
  for (size_t s = 0; s + 1 < cu_seqlens.size(); ++s) {
    const int64_t begin = cu_seqlens[s], length = cu_seqlens[s + 1] - begin;
    if (length == 0) continue;
    parts.push_back(chunk_gated_delta_rule_reference(q.narrow(0, begin, length), k.narrow(0, begin, length),
                                                     v.narrow(0, begin, length), g.narrow(0, begin, length),
                                                     beta.narrow(0, begin, length), chunk_size));
  }
  return at::cat(parts, 0);
}

at::Tensor recurrent_gated_delta_rule_oracle(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
                                             const at::Tensor& g_in, const at::Tensor& beta_in) {
  const int64_t length = q_in.size(0), key_heads = q_in.size(1), key_dim = q_in.size(2);
  const int64_t value_heads = v_in.size(1), group = value_heads / key_heads;
  const at::Tensor q = (l2_normalize(q_in.to(at::kDouble)) / std::sqrt(static_cast<double>(key_dim))).repeat_interleave(group, 1);
  const at::Tensor k = l2_normalize(k_in.to(at::kDouble)).repeat_interleave(group, 1);
  const at::Tensor v = v_in.to(at::kDouble), g = g_in.to(at::kDouble), beta = beta_in.to(at::kDouble);
  at::Tensor state = at::zeros({value_heads, key_dim, v_in.size(2)}, q.options());
  std::vector<at::Tensor> outputs;
  for (int64_t t = 0; t < length; ++t) {
    state = state * g[t].exp().view({value_heads, 1, 1});
    const at::Tensor kt = k[t], vt = v[t];                                        // [Hv, dk], [Hv, dv]
    const at::Tensor predicted = at::matmul(kt.unsqueeze(1), state).squeeze(1);  // S^T k
    const at::Tensor delta = (vt - predicted) * beta[t].unsqueeze(-1);
    state = state + kt.unsqueeze(-1) * delta.unsqueeze(1);
    outputs.push_back(at::matmul(q[t].unsqueeze(1), state).squeeze(1));
  }
  return at::stack(outputs, 0);
}

}  // namespace dflash::target
