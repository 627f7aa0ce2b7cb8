// evaluator.h: the eval section (config.h EvalConfig): the real acceptance of the drafter being
// trained, measured beside training. Every eval.every_steps steps drafter replica 0 hands its
// weights over (copied to the first target replica's GPU, its last stage's when it spans
// several); an evaluation thread runs speculative decoding of the prompts with the first target
// replica (decode/eval.h, over all its stages), records the metrics, logs a line, and writes
// export/best when the acceptance length is the best so far (with eval configured,
// export/best follows real acceptance, not the training proxy tau). Plain decoding of the same
// prompts (the speed baseline) runs once, at the first evaluation: the target is frozen.
//
// Thread-safety: maybe_start() from drafter replica 0's thread, finish() and evaluate_final()
// from the owner; every evaluation runs on the evaluation thread, which owns its drafter copy and
// its speculative decoder. An evaluation due while one is in flight is skipped (counted), never
// waited for: training does not stall on evaluation.
#pragma once

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "config/config.h"
#include "decode/eval.h"
#include "drafter/model.h"
#include "pipeline/streams.h"
#include "target/incremental.h"

namespace dflash::pipeline {

class Evaluator {
 public:
  // `target`: one target replica's stages (every layer between them; IncrementalTarget), which
  // outlive the Evaluator; the drafter copy lives on the last stage's device. export/best/eval.json,
  // when present, holds the best acceptance so far (a resumed run keeps its best).
  Evaluator(const config::Config& config, std::vector<const target::TargetModel*> target,
            const drafter::DrafterShape& shape,
            std::vector<decode::EvalPrompt> prompts, prometheus::Registry& registry);
  ~Evaluator();

  // After step `step` (completed steps): when due, copies `current`'s weights and starts an evaluation.
  void maybe_start(int64_t step, const drafter::Drafter& current);
  // Waits for the evaluation in flight, if any (the end of the run).
  void finish();
  // The end of a finished run: waits for the evaluation in flight, then evaluates `current` at
  // `step` unless that step was evaluated already, and waits for that evaluation too.
  void evaluate_final(int64_t step, const drafter::Drafter& current);

 private:
  void hand_over(int64_t step, const drafter::Drafter& current);
  void run();
  void evaluate(int64_t step);

  // ---- Constant after construction ----
  config::EvalConfig settings_;
  std::string best_dir_;
  const target::IncrementalTarget target_;
  std::vector<decode::EvalPrompt> prompts_;
  decode::GenerateSettings generate_;
  prometheus::Gauge* acceptance_length_;
  prometheus::Family<prometheus::Gauge>* acceptance_at_;
  prometheus::Family<prometheus::Gauge>* tokens_per_second_;
  prometheus::Gauge* speedup_;
  prometheus::Gauge* last_step_;
  prometheus::Gauge* seconds_;
  prometheus::Counter* evaluations_;
  prometheus::Counter* skipped_;

  // ---- The evaluation thread's own (after construction) ----
  drafter::Drafter drafter_;  // the weights of the step being evaluated, on the target's device
  std::unique_ptr<decode::SpeculativeDecoder> spec_;  // over target_ and drafter_; made at the first evaluation
  double plain_tokens_per_second_ = 0;
  double best_ = 0;
  int64_t evaluated_step_ = -1;  // the last step evaluated

  // ---- Guarded by mutex_ ----
  std::mutex mutex_;
  std::condition_variable wake_;
  int64_t pending_step_ = -1;  // an evaluation handed over, not yet started
  std::shared_ptr<ReadyEvent> weights_ready_;  // the hand-over's copy, queued on the replica's stream
  bool busy_ = false;          // handed over or running
  bool stop_ = false;

  std::thread thread_;  // last: started when everything it uses exists
};

}  // namespace dflash::pipeline
