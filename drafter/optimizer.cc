#include "drafter/optimizer.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <map>
#include <stdexcept>

#ifdef DFLASHD_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>

#include "drafter/kernels/adamw.h"
#endif

namespace dflash::drafter {

double scheduled_learning_rate(const OptimizerSettings& s, int64_t step) {
  if (s.warmup_steps > 0 && step < s.warmup_steps) {
    return s.learning_rate * static_cast<double>(step + 1) / static_cast<double>(s.warmup_steps);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, s.total_steps - s.warmup_steps));
  const double progress = std::min(1.0, static_cast<double>(step - s.warmup_steps) / span);
  return s.min_learning_rate + 0.5 * (s.learning_rate - s.min_learning_rate) * (1.0 + std::cos(M_PI * progress));
}

AdamW::AdamW(std::vector<std::pair<std::string, at::Tensor>> parameters, OptimizerSettings settings)
    : settings_(settings) {
  c10::NoGradGuard no_grad;
  for (auto& [name, p] : parameters) {
    Slot slot;
    slot.name = name;
    slot.param = p;
    slot.master = p.scalar_type() == at::kFloat ? p.detach() : p.detach().to(at::kFloat).clone();
    slot.exp_avg = at::zeros_like(slot.master);
    slot.exp_avg_sq = at::zeros_like(slot.master);
    slot.steps = at::zeros({}, slot.master.options());
    slots_.push_back(std::move(slot));
  }
}

void AdamW::zero_grad() {
  for (Slot& s : slots_) {
    if (s.param.grad().defined()) s.param.mutable_grad() = at::Tensor();
  }
}

bool AdamW::one_pass_applies(const std::vector<Slot*>& live) {
#ifdef DFLASHD_WITH_CUDA
  for (const Slot* s : live) {
    if (s->param.scalar_type() != at::kBFloat16 || s->param.grad().scalar_type() != at::kBFloat16 ||
        s->master.scalar_type() != at::kFloat || !s->param.is_contiguous() || !s->master.is_contiguous()) {
      return false;
    }
  }
  return !live.empty();
#else
  (void)live;
  return false;
#endif
}

// The update of the fused path in one kernel (drafter/kernels/adamw.h): the bf16 gradients, the
// clipping factor, the fp32 state and the rounded bf16 parameters in one pass.
void AdamW::one_pass_update(const std::vector<Slot*>& live, const std::vector<at::Tensor>& grads, double lr,
                            double clip) {
#ifdef DFLASHD_WITH_CUDA
  std::vector<kernels::AdamWTensor> tensors;
  for (size_t i = 0; i < live.size(); ++i) {
    Slot& s = *live[i];
    tensors.push_back({s.master.data_ptr<float>(), s.exp_avg.data_ptr<float>(), s.exp_avg_sq.data_ptr<float>(),
                       grads[i].data_ptr(), s.param.data_ptr(), s.param.numel()});
  }
  kernels::AdamWStep k;
  k.lr = static_cast<float>(lr);
  k.beta1 = static_cast<float>(settings_.beta1);
  k.beta2 = static_cast<float>(settings_.beta2);
  k.weight_decay = static_cast<float>(settings_.weight_decay);
  k.epsilon = static_cast<float>(settings_.epsilon);
  k.grad_scale = static_cast<float>(clip);
  k.bias_correction1 = static_cast<float>(1 - std::pow(settings_.beta1, static_cast<double>(step_)));
  k.bias_correction2_sqrt = static_cast<float>(std::sqrt(1 - std::pow(settings_.beta2, static_cast<double>(step_))));
  const at::Tensor scratch = at::empty({static_cast<int64_t>(kernels::adamw_scratch_bytes(tensors))},
                                       live.front()->master.options().dtype(at::kByte));
  kernels::adamw_update(tensors, k, scratch.data_ptr(), at::cuda::getCurrentCUDAStream().stream());
#else
  (void)live, (void)grads, (void)lr, (void)clip;
#endif
}

StepResult AdamW::step() {
  c10::NoGradGuard no_grad;
  StepResult result;
  result.learning_rate = scheduled_learning_rate(settings_, step_);
  const bool fused = settings_.fused_on_gpu && !slots_.empty() && slots_.front().master.is_cuda();
  std::vector<Slot*> live;
  for (Slot& s : slots_) {
    if (s.param.grad().defined()) live.push_back(&s);
  }
  // bf16 parameters on a GPU: one kernel reads the bf16 gradients as they are (one_pass_update);
  // otherwise the gradients are cast to fp32 (the masters' dtype) first.
  const bool one_pass = fused && one_pass_applies(live);
  std::vector<at::Tensor> grads;
  for (Slot* s : live) grads.push_back(one_pass ? s->param.grad().contiguous() : s->param.grad().to(at::kFloat));
  // The global norm over all gradients, in fp32, one host sync.
  double norm = 0;
  if (!grads.empty()) {
    const std::vector<at::Tensor> norms = at::_foreach_norm(grads, 2, at::kFloat);
    norm = at::stack(norms).norm().item<double>();
  }
  result.grad_norm = norm;
  if (!std::isfinite(norm)) {
    zero_grad();
    return result;  // not applied: the caller counts a non-finite step
  }
  const double clip = settings_.grad_clip_norm > 0 && norm > settings_.grad_clip_norm
                          ? settings_.grad_clip_norm / (norm + 1e-6)
                          : 1.0;
  ++step_;
  const double lr = result.learning_rate;
  if (one_pass) {
    one_pass_update(live, grads, lr, clip);
    zero_grad();
    result.applied = true;
    return result;
  }
  if (clip != 1.0) at::_foreach_mul_(grads, clip);
  if (fused && !live.empty()) {  // (ATen's foreach ops refuse empty lists: a step without gradients)
    std::vector<at::Tensor> masters, avgs, avg_sqs, steps, params, rounded;
    for (Slot* s : live) {
      masters.push_back(s->master);
      avgs.push_back(s->exp_avg);
      avg_sqs.push_back(s->exp_avg_sq);
      steps.push_back(s->steps);
      if (!s->master.is_same(s->param)) {
        params.push_back(s->param.detach());
        rounded.push_back(s->master);
      }
    }
    // ATen's kernel reads the step count from device tensors: this step's, from step_.
    at::_foreach_zero_(steps);
    at::_foreach_add_(steps, static_cast<double>(step_));
    at::_fused_adamw_(masters, grads, avgs, avg_sqs, {}, steps, lr, settings_.beta1, settings_.beta2,
                      settings_.weight_decay, settings_.epsilon, /*amsgrad=*/false, /*maximize=*/false);
    if (!params.empty()) at::_foreach_copy_(params, rounded);  // round to the model dtype
  } else {
    const double bias1 = 1 - std::pow(settings_.beta1, static_cast<double>(step_));
    const double bias2 = 1 - std::pow(settings_.beta2, static_cast<double>(step_));
    for (size_t i = 0; i < live.size(); ++i) {
      Slot& s = *live[i];
      const at::Tensor& g = grads[i];
      s.master.mul_(1 - lr * settings_.weight_decay);  // decoupled weight decay
      s.exp_avg.mul_(settings_.beta1).add_(g, 1 - settings_.beta1);
      s.exp_avg_sq.mul_(settings_.beta2).addcmul_(g, g, 1 - settings_.beta2);
      const at::Tensor denom = (s.exp_avg_sq.sqrt() / std::sqrt(bias2)).add_(settings_.epsilon);
      s.master.addcdiv_(s.exp_avg, denom, -lr / bias1);
      if (!s.master.is_same(s.param)) s.param.detach().copy_(s.master);  // round to the model dtype
    }
  }
  zero_grad();
  result.applied = true;
  return result;
}

std::vector<std::pair<std::string, at::Tensor>> AdamW::state_tensors() const {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const Slot& s : slots_) {
    out.emplace_back("master." + s.name, s.master);
    out.emplace_back("exp_avg." + s.name, s.exp_avg);
    out.emplace_back("exp_avg_sq." + s.name, s.exp_avg_sq);
  }
  return out;
}

void AdamW::load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps_taken,
                       const std::string& source) {
  c10::NoGradGuard no_grad;
  std::map<std::string, const at::Tensor*> by_name;
  for (const auto& [n, t] : tensors) by_name[n] = &t;
  auto take = [&](const std::string& name, at::Tensor& into) {
    auto it = by_name.find(name);
    if (it == by_name.end()) throw std::runtime_error(source + ": missing optimizer tensor '" + name + "'");
    if (it->second->sizes() != into.sizes()) {
      throw std::runtime_error(source + ": optimizer tensor '" + name + "' has the wrong shape");
    }
    into.copy_(*it->second);
  };
  for (Slot& s : slots_) {
    take("master." + s.name, s.master);
    take("exp_avg." + s.name, s.exp_avg);
    take("exp_avg_sq." + s.name, s.exp_avg_sq);
    if (!s.master.is_same(s.param)) s.param.detach().copy_(s.master);
  }
  step_ = steps_taken;
}

}  // namespace dflash::drafter
