// trainer_impl.h: the Trainer's state and its parts, private to
// pipeline/trainer*.cc.
//
//   trainer.cc         the public lifecycle (start, supervise, wait) and
//   failure handling trainer_setup.cc   the constructor's four steps, in order
//   trainer_stages.cc  the three stages' loops: reader, target workers, drafter
//   workers
#pragma once

#include <ATen/ATen.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "config/config.h"
#include "drafter/model.h"
#include "pipeline/bounded_queue.h"
#include "pipeline/checkpointer.h"
#include "pipeline/collective.h"
#include "pipeline/dataset.h"
#include "pipeline/drafter_step.h"
#include "pipeline/evaluator.h"
#include "pipeline/failed_samples.h"
#include "pipeline/nodes.h"
#include "pipeline/replicas.h"
#include "pipeline/run_metrics.h"
#include "pipeline/streams.h"
#include "pipeline/trainer.h"
#include "pipeline/workers.h"
#include "target/model_config.h"

namespace dflash::pipeline {

// What the reader hands the target workers.
struct SampleItem {
  int64_t q = 0;  // sample number across epochs
  TokenSample sample;
};

// What a target worker hands a drafter replica.
struct FeatureItem {
  int64_t q = 0;
  at::Tensor features;   // [tokens, K*H] on the drafter replica's device
  at::Tensor input_ids;  // [tokens] int64, same device
  std::vector<uint8_t> loss_mask;
  std::shared_ptr<ReadyEvent> ready;                    // the target's work on them is done (GPU)
  bool skipped() const { return !features.defined(); }  // the sample failed too often (FailedSamples)
};

struct Trainer::Impl {
  // ---- Constant after construction
  // ---------------------------------------------------------
  config::Config config;
  TestHooks hooks;  // tests only (test_hooks.h)
  prometheus::Registry* registry = nullptr;
  std::shared_ptr<Health> health;
  target::ModelConfig target_config;
  drafter::DrafterShape shape;
  std::shared_ptr<Dataset> data;
  StepPlan plan;
  StepSettings step_settings;
  int node_rank = 0;
  int64_t local_replicas = 1;  // drafter replicas of this node
  std::string settings_json;   // training_settings_json(): what nodes compare and checkpoints record
  int nodes_in_run = 1;        // processes of the run (distributed.nodes)
  int64_t start_step = 0;      // the resumed checkpoint's step, or 0

  // ---- Components, thread-safe as their headers say (declared in the order
  // they are built; destroyed in reverse, so each outlives those that use it)
  // ----------------------------------
  std::unique_ptr<RunMetrics> metrics;                     // registration, step records, observations
  std::unique_ptr<WorkerPool> workers;                     // the worker threads and their heartbeats
  std::unique_ptr<Replicas> models;                        // each replica used by its own worker's thread
  std::unique_ptr<Evaluator> evaluator;                    // eval section (null without); reads models->targets[0]
  std::unique_ptr<FailedSamples> failed_samples;           // counts restored from the checkpoint
  std::unique_ptr<FailurePolicy> failure_policy;           // retries, skips, stops (workers.*)
  std::unique_ptr<NodeGroup> nodes;                        // multi-node runs: the other processes
  std::unique_ptr<Collective> collective;                  // the drafter replicas' sums
  std::unique_ptr<BoundedQueue<SampleItem>> sample_queue;  // reader -> target workers
  std::vector<std::unique_ptr<BoundedQueue<FeatureItem>>> feature_queues;  // -> drafter replica r

  // ---- Run state every thread reads and writes (atomics)
  // -------------------------------------
  std::atomic<int64_t> completed_step{0};   // the highest step every local replica finished
  std::atomic<bool> stop_requested{false};  // SIGTERM, a failure, or the drafters are done
  std::atomic<bool> failed{false};
  std::atomic<int> drafters_running{0};
  std::atomic<bool> finished{false};         // every drafter left its loop
  std::atomic<bool> drafter0_exited{false};  // replica 0's weights are no longer being changed
  std::atomic<bool> abandoned{false};        // wait() left stuck threads behind

  // ---- Guarded by failure_mutex
  // ---------------------------------------------------------------
  mutable std::mutex failure_mutex;
  std::string failure_reason;  // the first failure's

  // The constructor's steps, in order (trainer_setup.cc).
  void load_models();
  void open_data();
  void resume();
  void prepare_eval();
  void connect();

  // The stages' loops, one thread each (trainer_stages.cc).
  void reader_loop(Worker &w);
  void target_loop(Worker &w, size_t replica);
  void drafter_loop(Worker &w, int replica);

  // Failure handling and the end of the run (trainer.cc).
  void fail(const std::string &reason);
  void contained(Worker &w, const std::function<void()> &loop);
  void checkpoint_now(int64_t step);
  void export_to(const std::string &dir);
  void abandon(int64_t step, std::chrono::duration<double> grace);
  // Seconds per stage summed over the replicas of a role.
  static std::map<std::string, double> stage_totals(const std::vector<std::unique_ptr<StageClock>> &clocks,
                                                    int64_t *iterations);

  int64_t data_index(int64_t q) const {
    return data->sample_at(q / plan.samples_per_epoch, q % plan.samples_per_epoch);
  }

  // Last member, so destroyed first: its writer thread finishes the write in
  // flight while everything it uses still exists.
  std::unique_ptr<Checkpointer> checkpoints;
};

}  // namespace dflash::pipeline
