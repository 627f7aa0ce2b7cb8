// optimizer.h: AdamW with fp32 master weights, global gradient-norm clipping, and the learning
// rate schedule of the recipe (linear warmup, then cosine to the minimum).
//
// Parameters may be bf16 (the model); the optimizer keeps an fp32 master copy of each, applies
// the update to the master and writes it back rounded. For fp32 parameters the master is the
// parameter itself. The update follows torch.optim.AdamW exactly (decoupled weight decay,
// bias-corrected moments). On a GPU (OptimizerSettings::fused_on_gpu) bf16 parameters are
// updated by one kernel pass (drafter/kernels/adamw.h), others by ATen's fused multi-tensor
// AdamW over the masters. Owned by the drafter worker's thread.
#pragma once

#include <ATen/core/Tensor.h>

#include <string>
#include <utility>
#include <vector>

namespace dflash::drafter {

struct OptimizerSettings {
  double learning_rate = 6e-4;
  double min_learning_rate = 0;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  double beta1 = 0.9, beta2 = 0.999, epsilon = 1e-8;
  double weight_decay = 0;
  double grad_clip_norm = 1.0;  // 0: no clipping
  // On a GPU, the update in one pass (bf16 parameters: dflashd's kernel; others: ATen's fused
  // AdamW on the fp32 masters) instead of a handful of element-wise kernels per tensor. Same formula.
  bool fused_on_gpu = true;
};

// Linear warmup from lr/warmup to lr over `warmup_steps`, then cosine from lr to min_lr at
// total_steps. `step` counts optimizer steps from 0.
double scheduled_learning_rate(const OptimizerSettings& s, int64_t step);

struct StepResult {
  double grad_norm = 0;  // before clipping
  double learning_rate = 0;
  bool applied = false;  // false when the gradient was not finite (the step is skipped)
};

class AdamW {
 public:
  AdamW(std::vector<std::pair<std::string, at::Tensor>> parameters, OptimizerSettings settings);

  // Reads each parameter's .grad() (gradients summed over the micro-steps and, for data
  // parallel replicas, already all-reduced), clips, updates, and clears the gradients.
  StepResult step();
  void zero_grad();
  int64_t steps_taken() const { return step_; }

  // Checkpoint state: "master.<name>", "exp_avg.<name>", "exp_avg_sq.<name>" (fp32) and the step.
  std::vector<std::pair<std::string, at::Tensor>> state_tensors() const;
  void load_state(const std::vector<std::pair<std::string, at::Tensor>>& tensors, int64_t steps_taken,
                  const std::string& source);
  const OptimizerSettings& settings() const { return settings_; }

 private:
  struct Slot {
    std::string name;
    at::Tensor param, master, exp_avg, exp_avg_sq;
    at::Tensor steps;  // fp32 scalar on the device: ATen's fused kernel reads the step count here
  };
  static bool one_pass_applies(const std::vector<Slot*>& live);
  void one_pass_update(const std::vector<Slot*>& live, const std::vector<at::Tensor>& grads, double lr, double clip);
  std::vector<Slot> slots_;
  OptimizerSettings settings_;
  int64_t step_ = 0;
};

}  // namespace dflash::drafter
