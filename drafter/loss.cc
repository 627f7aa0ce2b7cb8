#include "drafter/loss.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "drafter/kernels/cross_entropy.h"
#endif

namespace dflash::drafter {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The fused kernels take bf16 on a GPU with a vocabulary that is a multiple of 8 (every
// released target's); anything else runs the composite ATen version.
bool lm_head_kernels_apply(const at::Tensor& hidden, const at::Tensor& lm_head) {
#ifdef DFLASHD_WITH_CUDA
  return hidden.is_cuda() && hidden.scalar_type() == at::kBFloat16 && lm_head.scalar_type() == at::kBFloat16 &&
         lm_head.size(0) % 8 == 0;
#else
  (void)hidden, (void)lm_head;
  return false;
#endif
}

// One chunk of rows through the head: adds its weighted cross-entropy to loss_sum, writes the
// rows' hidden-state gradient (scaled by 1 / global_weight_sum) into `grad`, and returns 1 where
// a row's argmax is its label. On the fused kernels: bf16 logits, their statistics in one pass,
// then overwritten by their own gradient (lm_head_kernels_apply decides; never without CUDA).
at::Tensor chunk_on_kernels(const at::Tensor& h, const at::Tensor& y, const at::Tensor& w, const at::Tensor& lm_head,
                            double global_weight_sum, at::Tensor& loss_sum, at::Tensor grad) {
#ifdef DFLASHD_WITH_CUDA
  const int64_t n = h.size(0);
  at::Tensor logits = at::matmul(h, lm_head.t());  // [n, vocab]: one chunk only
  const auto fp32 = h.options().dtype(at::kFloat);
  at::Tensor lse = at::empty({n}, fp32), picked = at::empty({n}, fp32), best = at::empty({n}, y.options());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream().stream();
  const int vocab = static_cast<int>(logits.size(1));
  kernels::logit_row_stats(logits.data_ptr(), static_cast<int>(n), vocab, logits.stride(0), y.data_ptr<int64_t>(),
                           lse.data_ptr<float>(), picked.data_ptr<float>(), best.data_ptr<int64_t>(), stream);
  loss_sum += ((lse - picked) * w).sum();
  const at::Tensor scale = (w / global_weight_sum).contiguous();
  kernels::logit_gradient(logits.data_ptr(), static_cast<int>(n), vocab, logits.stride(0), y.data_ptr<int64_t>(),
                          lse.data_ptr<float>(), scale.data_ptr<float>(), stream);
  grad.copy_(at::matmul(logits, lm_head));
  return (best == y).to(at::kLong);
#else
  (void)h, (void)y, (void)w, (void)lm_head, (void)global_weight_sum, (void)loss_sum, (void)grad;
  throw std::logic_error("the fused cross-entropy kernels are not in a build without CUDA");
#endif
}

// The same in composite ATen ops, fp32 logits.
at::Tensor chunk_composite(const at::Tensor& h, const at::Tensor& y, const at::Tensor& w, const at::Tensor& lm_head,
                           double global_weight_sum, at::Tensor& loss_sum, at::Tensor grad) {
  const at::Tensor logits = at::matmul(h, lm_head.t()).to(at::kFloat);  // [n, vocab]: one chunk only
  const at::Tensor lse = at::logsumexp(logits, 1);
  const at::Tensor picked = logits.gather(1, y.unsqueeze(1)).squeeze(1);
  loss_sum += ((lse - picked) * w).sum();
  // d(sum w CE)/d logits = w (softmax - onehot); scaled by 1 / global denominator.
  at::Tensor d_logits = at::exp(logits - lse.unsqueeze(1));
  d_logits.scatter_add_(1, y.unsqueeze(1), -at::ones({h.size(0), 1}, d_logits.options()));
  d_logits.mul_((w / global_weight_sum).unsqueeze(1));
  grad.copy_(at::matmul(d_logits.to(lm_head.scalar_type()), lm_head));
  return (logits.argmax(1) == y).to(at::kLong);
}

struct ChunkedHeadLoss : public torch::autograd::Function<ChunkedHeadLoss> {
  // Returns the loss; the hidden-state gradient is computed here, chunk by chunk.
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& hidden, const at::Tensor& lm_head,
                            const at::Tensor& labels, const at::Tensor& weights, const at::Tensor& offsets,
                            const at::Tensor& valid, double global_weight_sum, int64_t chunk_rows, int64_t block_size, LossStats* stats) {
    c10::NoGradGuard no_grad;
    // Only rows that carry loss go through the head; the others' gradient stays zero.
    at::Tensor grad_hidden = at::zeros_like(hidden);
    const at::Tensor h_valid = hidden.index_select(0, valid), y_valid = labels.index_select(0, valid);
    const at::Tensor w_valid = weights.index_select(0, valid), k_valid = offsets.index_select(0, valid);
    at::Tensor grad_valid = at::empty_like(h_valid);
    const int64_t rows = h_valid.size(0);
    const bool use_kernels = lm_head_kernels_apply(hidden, lm_head);
    at::Tensor loss_sum = at::zeros({}, hidden.options().dtype(at::kFloat));
    at::Tensor correct = at::zeros({block_size}, labels.options());
    at::Tensor count = at::zeros({block_size}, labels.options());
    for (int64_t begin = 0; begin < rows; begin += chunk_rows) {
      const int64_t n = std::min(chunk_rows, rows - begin);
      const at::Tensor h = h_valid.narrow(0, begin, n);
      const at::Tensor y = y_valid.narrow(0, begin, n), w = w_valid.narrow(0, begin, n);
      const at::Tensor grad = grad_valid.narrow(0, begin, n);
      const at::Tensor hit = use_kernels ? chunk_on_kernels(h, y, w, lm_head, global_weight_sum, loss_sum, grad)
                                         : chunk_composite(h, y, w, lm_head, global_weight_sum, loss_sum, grad);
      const at::Tensor k = k_valid.narrow(0, begin, n);
      correct.index_add_(0, k, hit);
      count.index_add_(0, k, at::ones_like(hit));
    }
    grad_hidden.index_copy_(0, valid, grad_valid);
    stats->loss_sum = loss_sum.item<double>();
    const at::Tensor c = correct.cpu(), t = count.cpu();
    stats->correct.assign(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + block_size);
    stats->count.assign(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + block_size);
    ctx->save_for_backward({grad_hidden});
    return loss_sum / global_weight_sum;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const at::Tensor grad_hidden = ctx->get_saved_variables()[0];
    return {grad_hidden * grad_outputs[0].to(grad_hidden.scalar_type()), at::Tensor(), at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

BlockTargets make_block_targets(const DrafterBatch& batch, int64_t block_size, double gamma, const at::Device& device) {
  const at::Tensor ids = batch.input_ids.cpu().to(at::kLong).contiguous();
  const at::Tensor mask = batch.loss_mask.cpu().to(at::kByte).contiguous();
  const int64_t* id = ids.data_ptr<int64_t>();
  const uint8_t* m = mask.data_ptr<uint8_t>();
  std::vector<int64_t> labels, offsets, valid_rows;
  std::vector<float> weights;
  double weight_sum = 0;
  for (size_t s = 0; s + 1 < batch.cu_seqlens.size(); ++s) {
    const int64_t begin = batch.cu_seqlens[s], end = batch.cu_seqlens[s + 1];
    const at::Tensor anchors = batch.anchors[s].contiguous();
    const int64_t* a = anchors.data_ptr<int64_t>();
    for (int64_t n = 0; n < anchors.size(0); ++n) {
      for (int64_t k = 0; k < block_size; ++k) {
        const int64_t position = begin + a[n] + k;  // same-position label: offset k -> token anchor + k
        const bool valid = k >= 1 && position < end && m[position] != 0;
        const float w = valid ? static_cast<float>(std::exp(-(k - 1) / gamma)) : 0.0f;
        if (valid) valid_rows.push_back(static_cast<int64_t>(labels.size()));
        labels.push_back(valid ? id[position] : 0);
        weights.push_back(w);
        offsets.push_back(k);
        weight_sum += w;
      }
    }
  }
  BlockTargets t;
  const auto long_options = at::TensorOptions().dtype(at::kLong);
  t.labels = at::tensor(labels, long_options).to(device);
  t.offsets = at::tensor(offsets, long_options).to(device);
  t.weights = at::tensor(weights, at::TensorOptions().dtype(at::kFloat)).to(device);
  t.valid = at::tensor(valid_rows, long_options).to(device);
  t.weight_sum = weight_sum;
  return t;
}

void LossStats::add(const LossStats& other) {
  loss_sum += other.loss_sum;
  weight_sum += other.weight_sum;
  if (correct.size() < other.correct.size()) {
    correct.resize(other.correct.size(), 0);
    count.resize(other.count.size(), 0);
  }
  for (size_t k = 0; k < other.correct.size(); ++k) {
    correct[k] += other.correct[k];
    count[k] += other.count[k];
  }
}

std::vector<double> LossStats::accuracy() const {
  std::vector<double> acc(correct.size(), 0.0);
  for (size_t k = 1; k < correct.size(); ++k) acc[k] = count[k] ? static_cast<double>(correct[k]) / count[k] : 0.0;
  return acc;
}

double LossStats::tau() const {
  const std::vector<double> acc = accuracy();
  double tau = 1, run = 1;
  for (size_t k = 1; k < acc.size(); ++k) {
    run *= acc[k];
    tau += run;
  }
  return tau;
}

at::Tensor dflash_loss(const at::Tensor& hidden, const at::Tensor& lm_head, const BlockTargets& targets,
                       double global_weight_sum, int64_t chunk_rows, int64_t block_size, LossStats* stats) {
  if (hidden.size(0) == 0 || global_weight_sum <= 0) {
    stats->correct.assign(block_size, 0);
    stats->count.assign(block_size, 0);
    return (hidden.sum() * 0.0).to(at::kFloat);  // keeps the graph connected; contributes nothing
  }
  at::Tensor loss = ChunkedHeadLoss::apply(hidden, lm_head.detach(), targets.labels, targets.weights, targets.offsets,
                                          targets.valid, global_weight_sum, chunk_rows, block_size, stats);
  stats->weight_sum = targets.weight_sum;  // the local sum, computed with the targets
  return loss;
}

at::Tensor sample_anchors(const std::vector<uint8_t>& loss_mask, int64_t max_anchors, std::mt19937_64& rng) {
  std::vector<int64_t> candidates;
  for (size_t a = 0; a + 1 < loss_mask.size(); ++a) {
    if (loss_mask[a] && loss_mask[a + 1]) candidates.push_back(static_cast<int64_t>(a));
  }
  const int64_t take = std::min<int64_t>(max_anchors, static_cast<int64_t>(candidates.size()));
  // Partial Fisher-Yates: the first `take` entries are a uniform sample without replacement.
  for (int64_t i = 0; i < take; ++i) {
    std::uniform_int_distribution<int64_t> pick(i, static_cast<int64_t>(candidates.size()) - 1);
    std::swap(candidates[i], candidates[pick(rng)]);
  }
  candidates.resize(take);
  std::sort(candidates.begin(), candidates.end());
  return at::tensor(candidates, at::TensorOptions().dtype(at::kLong));
}

}  // namespace dflash::drafter
