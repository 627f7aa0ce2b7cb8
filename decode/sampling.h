// sampling.h: choosing tokens from logits as z-lab's dflash package does (dflash/model.py:
// _sampling_probs, sample, _rejection_sample), so speculative decoding here is theirs.
#pragma once

#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace dflash::decode {

struct Sampling {
  double temperature = 0;  // 0: greedy (argmax)
  double top_p = 1;        // (0, 1]
  int64_t top_k = 0;       // 0: all
  bool greedy() const { return temperature <= 0; }
};

// Throws std::invalid_argument unless temperature >= 0, top_p in (0, 1], top_k >= 0.
void check_sampling(const Sampling& s);

// Probabilities [rows, vocab] (fp32) of logits [rows, vocab] at the temperature, kept to the top
// k and then to the smallest set of mass >= top_p (target::top_p_keep: no sort on a GPU; equal
// probabilities at the boundary kept in index order), renormalised.
at::Tensor sampling_probs(const at::Tensor& logits, const Sampling& s);

// One token per row of probs [rows, vocab], drawn from `gen` (a CPU generator): int64 [rows].
at::Tensor draw(const at::Tensor& probs, at::Generator& gen);

// One uniform in [0, 1) from each generator (CPU), in order: what choose_rows takes.
std::vector<double> uniforms(const std::vector<at::Generator*>& gens);

// One token per row of probs [rows, vocab], on the probs' device (int64 [rows], nothing read on
// the host): the first token whose cumulative probability exceeds u[r] times the row's total. On
// a GPU one kernel (target::choose_by_uniform: never a zero-probability token); elsewhere a
// cumulative sum and a binary search per row, where a search that lands on a zero-probability
// token (the fp32 sum's rounding, about one draw in 10^7) takes the row's most likely token.
at::Tensor choose_rows(const at::Tensor& probs, const std::vector<double>& u);

// choose_rows with row r's uniform from its own generator gens[r] (so a row's draws do not
// depend on the other rows), the chosen ids copied to the host together (draw() copies each whole
// row to the host: 1 MB per row at a 248K vocabulary).
std::vector<int64_t> draw_rows(const at::Tensor& probs, const std::vector<at::Generator*>& gens);

// Speculative sampling of several blocks at once. Block b: drafts[b] (n_b tokens) drawn from
// draft_probs rows draft_row .. + n_b - 1, the target's probabilities at target_probs rows
// target_row .. + n_b (both [rows, vocab], on one device). Per block, as z-lab's
// _rejection_sample: draft i is accepted while u_i * q_i(x_i) < p_i(x_i) (u uniform from the
// block's generator, n_b of them); the bonus token is drawn (draw_rows, one more uniform) from
// p_{n_b} when all were accepted, else from max(p - q, 0) at the first rejection (p itself where
// that is all zero). Everything but the acceptance test runs batched on the probabilities'
// device: two small copies to the host, none of a whole row.
struct SpeculativeBlock {
  std::vector<int64_t> drafts;
  int64_t target_row = 0, draft_row = 0;
  at::Generator* gen = nullptr;
};
struct SpeculativeOutcome {
  int64_t accepted = 0, bonus = 0;
};
std::vector<SpeculativeOutcome> rejection_sample_blocks(const std::vector<SpeculativeBlock>& blocks,
                                                        const at::Tensor& target_probs, const at::Tensor& draft_probs);

}  // namespace dflash::decode
