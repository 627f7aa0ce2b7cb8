// checkpoint.h: resumable training checkpoints, written atomically, and export from them.
//
// On-disk format (version 1), one directory per checkpoint under the checkpoint root:
//   step-<12 digits>/
//     config.json            the drafter's serving config (docs/recipe.md)
//     model.safetensors      fp32 weights (the optimizer's master copy), export names
//     optimizer.safetensors  fp32 AdamW moments: exp_avg.<name>, exp_avg_sq.<name> (the master
//                            weights are model.safetensors)
//     state.json             {"format": "dflashd-checkpoint", "version": 1, "step": N,
//                             "optimizer_steps": N, "trainer": {...}} (trainer: data position,
//                             seeds, metrics: whatever the pipeline needs to resume exactly)
//     COMMIT                 written last; a directory without it is not a checkpoint
// Protocol: everything goes into ".step-<N>.partial/" (each file written to a temporary name,
// fsynced, renamed), then COMMIT, then the directory is renamed to "step-<N>" and the root
// fsynced. A crash at any point leaves either the previous checkpoints only, or a complete new
// one: never a half-written checkpoint that resume would pick. Stale partial directories are
// removed by the next write.
#pragma once

#include <string>
#include <vector>

#include "drafter/model.h"
#include "drafter/optimizer.h"

namespace dflash::drafter {

class CheckpointError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// What a checkpoint holds, copied off the drafter's device. take() runs on the drafter's thread
// between steps and costs one device-to-host copy into buffers kept from the previous take()
// (page-locked on a GPU, so the copy runs at bus speed); write_checkpoint() can then run on
// another thread while training goes on, reading only these copies.
struct CheckpointSnapshot {
  int64_t step = 0;
  int64_t optimizer_steps = 0;
  DrafterShape shape;
  std::vector<std::pair<std::string, at::Tensor>> model;    // fp32 master weights, export names (CPU)
  std::vector<std::pair<std::string, at::Tensor>> moments;  // exp_avg.<name>, exp_avg_sq.<name> (CPU)
  std::string trainer_state_json;

  void take(int64_t at_step, const Drafter& drafter, const AdamW& optimizer, std::string trainer_state);
};

// Writes the snapshot as step snapshot.step under `root` (created if needed). Returns the
// checkpoint's directory.
std::string write_checkpoint(const std::string& root, const CheckpointSnapshot& snapshot);
// The same, straight from the drafter and its optimizer (a snapshot taken and written at once).
std::string write_checkpoint(const std::string& root, int64_t step, const Drafter& drafter, const AdamW& optimizer,
                             const std::string& trainer_state_json);
// Complete checkpoints under root, oldest first ("" root or no checkpoints: empty).
std::vector<std::string> list_checkpoints(const std::string& root);
// Removes all but the newest `keep_last` complete checkpoints.
void prune_checkpoints(const std::string& root, int keep_last);

struct LoadedCheckpoint {
  int64_t step = 0;
  std::string trainer_state_json;
};
// Restores weights and optimizer state; throws CheckpointError naming the directory and file, and
// every field where the checkpoint's drafter (its config.json) differs from `drafter`'s shape.
LoadedCheckpoint read_checkpoint(const std::string& dir, Drafter* drafter, AdamW* optimizer);
// `dflashd export`: the checkpoint's weights in the serving format (bf16) in out_dir.
void export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir);

}  // namespace dflash::drafter
