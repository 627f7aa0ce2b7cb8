#include "decode/sampling.h"

#include <ATen/ATen.h>

#include <stdexcept>

namespace dflash::decode {

void check_sampling(const Sampling& s) {
  if (s.temperature < 0 || !(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) {
    throw std::invalid_argument("sampling: temperature must be >= 0, top_p in (0, 1] and top_k >= 0");
  }
}

at::Tensor sampling_probs(const at::Tensor& logits, const Sampling& s) {
  at::Tensor scores = logits.to(at::kFloat) / s.temperature;
  const int64_t vocab = scores.size(-1);
  at::Tensor indices;
  if (s.top_k > 0 && s.top_k < vocab) std::tie(scores, indices) = at::topk(scores, s.top_k, -1);
  at::Tensor probs = at::softmax(scores, -1);
  if (s.top_p < 1.0) {
    auto [sorted, order] = probs.sort(-1, /*descending=*/true);
    const at::Tensor keep = (sorted.cumsum(-1) - sorted) < s.top_p;
    sorted = sorted * keep;
    probs = at::zeros_like(probs).scatter(-1, order, sorted);
    probs = probs / probs.sum(-1, true);
  }
  if (indices.defined()) probs = at::zeros(logits.sizes(), probs.options()).scatter(-1, indices, probs);
  return probs;
}

at::Tensor draw(const at::Tensor& probs, at::Generator& gen) {
  const at::Tensor rows = probs.reshape({-1, probs.size(-1)}).to(at::kCPU);
  return at::multinomial(rows, 1, false, gen).reshape({rows.size(0)});
}

std::vector<int64_t> draw_rows(const at::Tensor& probs_in, const std::vector<at::Generator*>& gens) {
  const at::Tensor probs = probs_in.to(at::kFloat);
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  if (static_cast<int64_t>(gens.size()) != rows) throw std::invalid_argument("draw_rows: one generator per row");
  std::vector<double> u(static_cast<size_t>(rows));
  for (int64_t r = 0; r < rows; ++r) {
    u[static_cast<size_t>(r)] = at::rand({1}, *gens[static_cast<size_t>(r)], at::TensorOptions().dtype(at::kDouble)).item<double>();
  }
  const at::Tensor cdf = probs.cumsum(-1);
  const at::Tensor bound =
      at::tensor(u, at::TensorOptions().dtype(at::kDouble)).to(probs.device(), at::kFloat).unsqueeze(1) * cdf.narrow(1, vocab - 1, 1);
  const at::Tensor index = at::searchsorted(cdf, bound, /*out_int32=*/false, /*right=*/true).clamp_max(vocab - 1);
  // -1 where the search found a zero-probability token: those rows are drawn again below.
  const at::Tensor chosen = at::where(probs.gather(1, index) > 0, index, -1).reshape({rows}).to(at::kCPU);
  std::vector<int64_t> tokens(chosen.data_ptr<int64_t>(), chosen.data_ptr<int64_t>() + rows);
  for (int64_t r = 0; r < rows; ++r) {
    if (tokens[static_cast<size_t>(r)] < 0) {
      tokens[static_cast<size_t>(r)] = draw(probs.select(0, r).unsqueeze(0), *gens[static_cast<size_t>(r)]).item<int64_t>();
    }
  }
  return tokens;
}

std::pair<int64_t, int64_t> rejection_sample(const at::Tensor& draft_tokens, const at::Tensor& target_probs_in,
                                             const at::Tensor& draft_probs_in, at::Generator& gen) {
  const at::Tensor tokens = draft_tokens.to(at::kCPU, at::kLong).reshape({-1});
  const at::Tensor target_probs = target_probs_in.to(at::kCPU), draft_probs = draft_probs_in.to(at::kCPU);
  const int64_t n = tokens.size(0);
  const at::Tensor p = target_probs.narrow(0, 0, n).gather(-1, tokens.unsqueeze(-1)).squeeze(-1);
  const at::Tensor q = draft_probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1);
  const at::Tensor u = at::rand({n}, gen, at::TensorOptions().dtype(at::kFloat));
  const int64_t accepted = (u * q < p).to(at::kInt).cumprod(0).sum().item<int64_t>();
  if (accepted == n) return {accepted, draw(target_probs.select(0, n).unsqueeze(0), gen).item<int64_t>()};
  at::Tensor residual = (target_probs.select(0, accepted) - draft_probs.select(0, accepted)).clamp_min(0);
  const double total = residual.sum().item<double>();
  residual = total > 0 ? residual / total : target_probs.select(0, accepted);
  return {accepted, draw(residual.unsqueeze(0), gen).item<int64_t>()};
}

}  // namespace dflash::decode
