#include "decode/sampling.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "common/tensor_math.h"
#include "target/fused_ops.h"

namespace dflash::decode {

void check_sampling(const Sampling& s) {
  if (s.temperature < 0 || !(s.top_p > 0 && s.top_p <= 1) || s.top_k < 0) {
    throw std::invalid_argument("sampling: temperature must be >= 0, top_p in (0, 1] and top_k >= 0");
  }
}

at::Tensor sampling_probs(const at::Tensor& logits, const Sampling& s) {
  at::Tensor scores = target::widen_to_float(logits) / s.temperature;  // one vectorised pass on a GPU
  const int64_t vocab = scores.size(-1);
  at::Tensor indices;
  if (s.top_k > 0 && s.top_k < vocab) std::tie(scores, indices) = at::topk(scores, s.top_k, -1);
  at::Tensor probs = at::softmax(scores, -1);
  if (s.top_p < 1.0) {
    probs = target::top_p_keep(probs, s.top_p);
    probs = probs / probs.sum(-1, true);
  }
  if (indices.defined()) probs = at::zeros(logits.sizes(), probs.options()).scatter(-1, indices, probs);
  return probs;
}

at::Tensor draw(const at::Tensor& probs, at::Generator& gen) {
  const at::Tensor rows = probs.reshape({-1, probs.size(-1)}).to(at::kCPU);
  return at::multinomial(rows, 1, false, gen).reshape({rows.size(0)});
}

std::vector<double> uniforms(const std::vector<at::Generator*>& gens) {
  std::vector<double> u;
  const auto doubles = at::TensorOptions().dtype(at::kDouble);
  for (at::Generator* gen : gens) u.push_back(at::rand({1}, *gen, doubles).item<double>());
  return u;
}

at::Tensor choose_rows(const at::Tensor& probs_in, const std::vector<double>& u) {
  const at::Tensor probs = probs_in.to(at::kFloat);
  const int64_t rows = probs.size(0), vocab = probs.size(1);
  if (static_cast<int64_t>(u.size()) != rows) throw std::invalid_argument("choose_rows: one uniform per row");
  const at::Tensor u_device = values_on(u, at::kDouble, probs.device());
  if (at::Tensor chosen = target::choose_by_uniform(probs.contiguous(), u_device); chosen.defined()) return chosen;
  const at::Tensor cdf = probs.cumsum(-1);
  const at::Tensor u_rows = u_device.to(at::kFloat).unsqueeze(1);
  const at::Tensor bound = u_rows * cdf.narrow(1, vocab - 1, 1);
  const at::Tensor index = at::searchsorted(cdf, bound, /*out_int32=*/false, /*right=*/true).clamp_max(vocab - 1);
  return at::where(probs.gather(1, index) > 0, index, probs.argmax(-1, /*keepdim=*/true)).reshape({rows});
}

std::vector<int64_t> draw_rows(const at::Tensor& probs, const std::vector<at::Generator*>& gens) {
  if (static_cast<int64_t>(gens.size()) != probs.size(0)) {
    throw std::invalid_argument("draw_rows: one generator per row");
  }
  const at::Tensor chosen = choose_rows(probs, uniforms(gens)).to(at::kCPU);
  return std::vector<int64_t>(chosen.data_ptr<int64_t>(), chosen.data_ptr<int64_t>() + chosen.numel());
}

std::vector<SpeculativeOutcome> rejection_sample_blocks(const std::vector<SpeculativeBlock>& blocks,
                                                        const at::Tensor& target_probs_in,
                                                        const at::Tensor& draft_probs_in) {
  const at::Tensor target_probs = target_probs_in.to(at::kFloat);
  const at::Device device = target_probs.device();
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  // p_i(x_i) and q_i(x_i) of every draft, in one copy to the host.
  std::vector<int64_t> target_rows, draft_rows, tokens;
  for (const SpeculativeBlock& b : blocks) {
    for (size_t i = 0; i < b.drafts.size(); ++i) {
      target_rows.push_back(b.target_row + static_cast<int64_t>(i));
      draft_rows.push_back(b.draft_row + static_cast<int64_t>(i));
      tokens.push_back(b.drafts[i]);
    }
  }
  at::Tensor pq, draft_probs;
  if (!tokens.empty()) {
    draft_probs = draft_probs_in.to(at::kFloat);
    const at::Tensor index = at::stack({at::tensor(target_rows, long_options), at::tensor(draft_rows, long_options),
                                        at::tensor(tokens, long_options)}).to(device);
    pq = at::stack({target_probs.index({index[0], index[2]}), draft_probs.index({index[1], index[2]})}).to(at::kCPU);
  }
  // The acceptance test per block, on the host; then where each bonus row comes from.
  std::vector<SpeculativeOutcome> out(blocks.size());
  std::vector<int64_t> bonus_target_rows, bonus_draft_rows;
  std::vector<at::Generator*> gens;
  for (size_t b = 0, offset = 0; b < blocks.size(); ++b) {
    const int64_t n = static_cast<int64_t>(blocks[b].drafts.size());
    if (n > 0) {
      const at::Tensor u = at::rand({n}, *blocks[b].gen, at::TensorOptions().dtype(at::kFloat));
      const float* uu = u.data_ptr<float>();
      const float* p = pq.data_ptr<float>() + offset;
      const float* q = pq.data_ptr<float>() + pq.size(1) + offset;
      while (out[b].accepted < n && uu[out[b].accepted] * q[out[b].accepted] < p[out[b].accepted]) ++out[b].accepted;
    }
    offset += static_cast<size_t>(n);
    bonus_target_rows.push_back(blocks[b].target_row + out[b].accepted);
    bonus_draft_rows.push_back(out[b].accepted < n ? blocks[b].draft_row + out[b].accepted : -1);
    gens.push_back(blocks[b].gen);
  }
  const at::Tensor rows =
      at::stack({at::tensor(bonus_target_rows, long_options), at::tensor(bonus_draft_rows, long_options)}).to(device);
  const at::Tensor p = target_probs.index_select(0, rows[0]);
  at::Tensor residual = p;
  if (!tokens.empty()) {
    const at::Tensor rejected = (rows[1] >= 0).unsqueeze(1);
    const at::Tensor q = draft_probs.index_select(0, rows[1].clamp_min(0));
    residual = at::where(rejected, (p - q).clamp_min(0), p);
    residual = at::where(residual.sum(-1, true) > 0, residual, p);
  }
  const std::vector<int64_t> bonus = draw_rows(residual, gens);
  for (size_t b = 0; b < blocks.size(); ++b) out[b].bonus = bonus[b];
  return out;
}

}  // namespace dflash::decode
