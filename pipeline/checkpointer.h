// checkpointer.h: a run's checkpoints as one component that owns their cadence
// (checkpoint.every_steps / every_minutes, forced at the end and on failure), the trainer state
// they carry (data position, tokens and samples consumed, failed-sample counts, the best tau),
// export/best, and resuming from them (checkpoint.resume).
//
// The drafter's replica 0 takes the snapshot between steps (a device-to-host copy); the
// CheckpointWriter's thread writes it with the COMMIT protocol (drafter/checkpoint.h), prunes to
// checkpoint.keep_last and writes export/best when the snapshot's tau is the best so far.
//
// Threads: maybe_checkpoint() from replica 0's thread (or the owner once the workers are done);
// the write on the writer's thread; resume() at construction of the run. A failed checkpoint is
// logged and shown on /healthz; the previous ones stay valid and the run goes on.
#pragma once

#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/health.h"
#include "config/config.h"
#include "drafter/checkpoint.h"
#include "pipeline/checkpoint_writer.h"
#include "pipeline/dataset.h"
#include "pipeline/failed_samples.h"
#include "pipeline/run_metrics.h"

namespace dflash::pipeline {

class Checkpointer {
 public:
  // `data_digest`: Dataset::digest(), recorded in every checkpoint and compared on resume;
  // `settings_json`: training_settings_json(), recorded, and on resume what differs is said.
  Checkpointer(const config::Config& config, const StepPlan& plan, std::string data_digest, std::string settings_json,
               RunMetrics& metrics, Health& health, FailedSamples& failed_samples);

  // By steps, by minutes, or forced (then waited for): the state of `drafter` and `optimizer`
  // after `step` steps.
  void maybe_checkpoint(int64_t step, bool force, const drafter::Drafter& drafter, const drafter::AdamW& optimizer);

  // The checkpoint checkpoint.resume names (auto: the newest complete one) loaded into every
  // replica; restores the metrics' totals, the failed-sample counts and the best tau. Returns the
  // step to continue from (0 without a checkpoint). Throws naming the checkpoint when its data
  // (digest), data size or batch shape differs from the run's (resuming would not be exact); logs
  // the settings that differ from those of the run that wrote it (a changed learning rate, ...).
  int64_t resume(const std::vector<std::unique_ptr<drafter::Drafter>>& drafters,
                 const std::vector<std::unique_ptr<drafter::AdamW>>& optimizers);
  const std::string& resumed_from() const { return resumed_from_; }

 private:
  std::string trainer_state_json(int64_t step);
  void write(const drafter::CheckpointSnapshot& snapshot);  // the writer's thread

  // Constant after construction.
  const config::Config& config_;
  const StepPlan& plan_;
  const std::string data_digest_;
  const std::string settings_json_;
  RunMetrics& metrics_;
  Health& health_;
  FailedSamples& failed_samples_;
  std::string resumed_from_;

  std::chrono::steady_clock::time_point last_time_ = std::chrono::steady_clock::now();  // replica 0's thread
  std::mutex mutex_;        // guards the two below (replica 0's thread and the writer's)
  double best_tau_ = 0;     // the best training tau a checkpoint was written at
  double snapshot_tau_ = 0; // tau at the step of the snapshot in the writer's hands

  // Last: destroyed first, its thread finishes the write in flight while the above exist.
  CheckpointWriter writer_;
};

}  // namespace dflash::pipeline
