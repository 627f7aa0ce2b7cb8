// dataset.h: the training data, indexed once at start, and the deterministic order in which
// optimizer steps consume it.
//
// Input: JSON Lines files (or directories of *.jsonl shards), one sample per line:
// {"input_ids": [...], "loss_mask": [...]}; or synthetic sequences (tests, demo). At open()
// every line is parsed once: malformed lines are an error naming file and line (or skipped
// and counted, by config), samples longer than data.max_length are truncated, samples with
// fewer than data.min_supervised_tokens supervised tokens, or without two adjacent supervised
// tokens (no anchor for a block), are skipped and counted. The index
// keeps (file, byte offset, digest) per usable sample; load() re-reads one line and refuses it
// when it is no longer the sample indexed (the file changed during the run).
//
// Order: epoch e visits the usable samples in a permutation seeded by (data.seed, e) (or in
// file order without shuffle). Sample number q (counting across epochs) is epoch q / N,
// position q % N. StepPlan maps optimizer steps to sample numbers: a pure function, which is
// what makes resume exact (a checkpoint only needs the step).
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/token_file.h"
#include "config/config.h"

namespace dflash::pipeline {

// The JSONL files of data.paths (a directory: its *.jsonl shards, sorted; a `dflashd generate`
// output directory: its committed shards only, logging what it leaves out); throws naming the
// path that does not exist or holds no shard.
std::vector<std::string> data_files(const std::vector<std::string>& paths);

// splitmix64: a stateless, well-spread hash for deriving seeds (sample order, anchors).
uint64_t mix64(uint64_t x);

class Dataset {
 public:
  // vocab_size bounds the token ids (checked per line) and the synthetic generator.
  static std::shared_ptr<Dataset> open(const config::DataConfig& config, int64_t vocab_size);

  int64_t size() const { return static_cast<int64_t>(index_.size()); }
  int64_t skipped_short() const { return skipped_short_; }        // too few supervised tokens
  // No two adjacent supervised tokens: no position can anchor a block (an alternating mask).
  int64_t skipped_no_anchor() const { return skipped_no_anchor_; }
  int64_t skipped_malformed() const { return skipped_malformed_; }  // on_malformed: skip
  int64_t tokens_per_epoch() const { return tokens_per_epoch_; }
  // 16 hex digits over every usable sample's ids and loss mask (truncated) in file order, which of
  // them are held out, and the order's seed and shuffle: two datasets with the same digest give a
  // run the same samples in the same order (nodes must agree on it; a checkpoint records it).
  std::string digest() const;
  // The usable sample at `index` (0 <= index < size()), truncated. Thread-safe.
  TokenSample load(int64_t index) const;
  // The sample index at `position` of epoch `epoch`.
  int64_t sample_at(int64_t epoch, int64_t position) const;
  int64_t tokens_of(int64_t index) const { return index_[index].tokens; }
  // Where the sample at `index` comes from, for log lines: "FILE:LINE" or "synthetic sample N".
  std::string describe(int64_t index) const;
  // data.eval_fraction's samples, kept out of training (usable ones only, in file order).
  int64_t held_out_size() const { return static_cast<int64_t>(held_out_.size()); }
  TokenSample load_held_out(int64_t index) const;
  std::string describe_held_out(int64_t index) const;

 private:
  struct Entry {
    int32_t file = -1;    // -1: synthetic
    int64_t offset = 0;   // byte offset of the line, or the synthetic sample number
    int64_t line = 0;
    int32_t tokens = 0;
    uint64_t digest = 0;  // of the sample as indexed (truncated): load() checks it is still so
  };
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  TokenSample load_entry(const Entry& e) const;
  std::string describe_entry(const Entry& e) const;
  config::DataConfig config_;
  int64_t vocab_size_ = 0;
  std::vector<std::string> files_;
  std::vector<Entry> index_;
  std::vector<Entry> held_out_;  // data.eval_fraction
  int64_t skipped_short_ = 0, skipped_no_anchor_ = 0, skipped_malformed_ = 0, tokens_per_epoch_ = 0;
  uint64_t digest_ = 0;
  mutable std::mutex order_mutex_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_order_;
};

// The synthetic generator (exposed for tests): arithmetic progressions modulo the vocabulary,
// a few prompt tokens unsupervised. Learnable: the drafter must infer the stride from context.
TokenSample synthetic_sample(int64_t number, const config::SyntheticData& synthetic, int64_t vocab_size, int64_t seed);

struct StepPlan {
  int64_t samples_per_epoch = 0;    // N
  int64_t replicas = 1;             // R drafter replicas
  int64_t sequences_per_micro = 1;  // m
  int64_t micro_steps = 1;          // A (gradient accumulation)
  int64_t steps_per_epoch = 0;
  int64_t total_steps = 0;

  static StepPlan make(int64_t samples_per_epoch, int64_t replicas, int64_t sequences_per_micro, int64_t micro_steps,
                       double epochs, int64_t max_steps);
  int64_t global_batch() const { return replicas * sequences_per_micro * micro_steps; }
  // Sample numbers [first, last) consumed by step t (all replicas).
  int64_t first_sample(int64_t step) const;
  int64_t end_sample(int64_t step) const;
  // The step and replica that consume sample number q.
  int64_t step_of(int64_t q) const;
  int64_t replica_of(int64_t q) const;
  // Sample numbers of step t for replica r, ascending.
  std::vector<int64_t> samples_for(int64_t step, int64_t replica) const;
};

}  // namespace dflash::pipeline
