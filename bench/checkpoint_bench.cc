// checkpoint_bench: what a checkpoint of the Qwen3.5-27B drafter (5 layers, hidden 5120, 32/8
// heads of 128, MLP 17408; fp32 master weights and AdamW moments: about 21 GB) costs the
// drafter's thread, before and after the writer thread (issue 20 item 7), in one process:
//   synchronous   write_checkpoint() on the drafter's thread (what every replica waited for)
//   snapshot      CheckpointSnapshot::take(): the device-to-host copy into page-locked buffers
//                 (first: allocating them; again: reusing them), all the drafter's thread does now
//   background    write_checkpoint(snapshot): the writer thread's share, while training goes on
// Usage: checkpoint_bench DIR   (needs a CUDA GPU and about 45 GB free under DIR)
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "drafter/checkpoint.h"
#include "drafter/model.h"
#include "drafter/optimizer.h"

using namespace dflash;

namespace {
template <typename F>
double seconds(F&& f) {
  const auto start = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}
}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || !at::hasCUDA()) {
    std::fprintf(stderr, "usage: checkpoint_bench DIR (needs a CUDA GPU)\n");
    return 2;
  }
  const std::string root = argv[1];
  drafter::DrafterShape s;
  s.hidden_size = 5120, s.num_layers = 5, s.num_attention_heads = 32, s.num_key_value_heads = 8, s.head_dim = 128;
  s.intermediate_size = 17408, s.vocab_size = 248320, s.rope_theta = 1e7, s.block_size = 16, s.mask_token_id = 248070;
  s.target_layer_ids = {1, 16, 31, 46, 61};
  s.num_target_layers = 64;
  drafter::Drafter model(s, at::TensorOptions().device(at::kCUDA).dtype(at::kBFloat16));
  model.init_random(1);
  drafter::AdamW optimizer(model.parameters(), drafter::OptimizerSettings{});
  {
    c10::NoGradGuard no_grad;
    for (const auto& [name, t] : optimizer.state_tensors()) {
      if (name.rfind("exp_avg", 0) == 0) t.normal_(0, 1e-3).abs_();  // real moments, not zeros
    }
  }
  const double gb = static_cast<double>(s.parameter_count()) * 12 / 1e9;
  std::printf("27B drafter: %.2f B parameters, checkpoint %.1f GB (fp32 masters + 2 moments)\n",
              static_cast<double>(s.parameter_count()) / 1e9, gb);
  const double synchronous = seconds([&] { drafter::write_checkpoint(root, 1, model, optimizer, "{}"); });
  drafter::prune_checkpoints(root, 0 + 1);
  drafter::CheckpointSnapshot snapshot;
  const double first = seconds([&] { snapshot.take(2, model, optimizer, "{}"); });
  const double again = seconds([&] { snapshot.take(2, model, optimizer, "{}"); });
  const double background = seconds([&] { drafter::write_checkpoint(root, snapshot); });
  drafter::prune_checkpoints(root, 1);
  std::printf("%-44s %10s\n", "drafter thread blocked by a checkpoint", "seconds");
  std::printf("%-44s %10.2f\n", "before: synchronous write_checkpoint", synchronous);
  std::printf("%-44s %10.2f  (%.1f GB/s)\n", "after: snapshot, first (pinned allocation)", first, gb / first);
  std::printf("%-44s %10.2f  (%.1f GB/s)\n", "after: snapshot, buffers reused", again, gb / again);
  std::printf("%-44s %10.2f  (writer thread, training goes on)\n", "background write", background);
  return 0;
}
