// shards.h: the output directory of `dflashd generate`: training samples in committed shards,
// every prompt in it exactly once however often the process is killed and restarted.
//
//   OUT/generate.json          what the directory is generated from (prompt file, its size and
//                              checksum, the decoding settings); a restart with other prompts or
//                              settings is refused rather than mixed in
//   OUT/shard-NNNNNN.jsonl     samples, token JSON Lines a run's data.paths reads (OUT itself):
//                              {"input_ids", "loss_mask" (1 on the response), "prompt_index",
//                              "finish_reason": "stop" | "length"}
//   OUT/shard-NNNNNN.done      the shard's commit marker, written after its samples are durable:
//                              every prompt index the shard handled (written or skipped) and counts
//
// A commit writes the samples (write_file_atomically: temporary file, fsync, rename, directory
// fsync), then the marker the same way. A shard without its marker was cut by a crash (or is being
// committed): opening the directory deletes it (and any temporary file), and its prompts are
// generated again; a training run reading the directory leaves it out. Not thread-safe: one owner.
#pragma once

#include <cstdint>
#include <set>
#include <string>
#include <vector>

namespace dflash::decode {

// One finished prompt.
struct GeneratedSample {
  int64_t prompt_index = 0;
  std::vector<int64_t> tokens;  // prompt + response
  int64_t prompt_tokens = 0;
  bool stopped = false;  // a stop token ended it ("stop"); else max_new_tokens did ("length": truncated)
};

// The shards of an output directory as they lie on disk.
struct ShardListing {
  std::vector<int64_t> committed;        // shard numbers with their samples and marker, ascending
  std::vector<std::string> uncommitted;  // shard-NNNNNN.jsonl without a marker: a commit cut short or under way
  std::vector<std::string> temporary;    // temporary files of writes cut short (write_file_atomically)
};
// Lists `dir`. Throws std::runtime_error naming a marker whose samples are missing (removed by hand:
// its prompts would count as done with their samples gone).
ShardListing list_shards(const std::string& dir);

// Whether `dir` is the output directory of a generate job (it holds generate.json).
bool is_generate_output(const std::string& dir);

// What a training run reads of a generate output directory (data.paths): the committed shards'
// sample files in order, never one without its marker.
struct GeneratedData {
  std::vector<std::string> files;        // DIR/shard-NNNNNN.jsonl, committed, ascending
  std::vector<std::string> uncommitted;  // DIR/shard-NNNNNN.jsonl left out
  int64_t prompts = -1;                  // the job's prompts (generate.json), -1 where not recorded
  int64_t done = 0;                      // prompts the committed shards handled (written or skipped)
};
// Throws std::runtime_error naming the file when generate.json or a marker is damaged.
GeneratedData generated_data(const std::string& dir);

class ShardedOutput {
 public:
  // Opens (creates) `dir` for a job described by `job` (a JSON object: compared with the
  // directory's generate.json, which is written when new). Deletes uncommitted shards, reads the
  // committed ones' markers. Throws std::runtime_error naming the file on a mismatch or damage.
  // `shard_size`: samples per shard; `keep_truncated`: write "length" samples (else skip them).
  ShardedOutput(std::string dir, const std::string& job, int64_t shard_size, bool keep_truncated);

  // Prompt indices committed before this process (those to skip).
  const std::set<int64_t>& done_before() const { return done_before_; }
  // Keys of `job` that the directory's generate.json lacked (written by an older dflashd; its other
  // keys agreed, and the record now holds them): the caller says what it assumed.
  const std::vector<std::string>& unrecorded() const { return unrecorded_; }
  int64_t removed_uncommitted() const { return removed_uncommitted_; }

  // Buffers a finished prompt; commits a shard when `shard_size` are buffered.
  void add(GeneratedSample sample);
  // Commits what is buffered (no-op when nothing is).
  void flush();

  // Since this process started: committed prompts, written samples, truncated samples skipped,
  // new tokens of the committed prompts.
  int64_t committed() const { return committed_; }
  int64_t written() const { return written_; }
  int64_t skipped_truncated() const { return skipped_; }
  int64_t new_tokens() const { return new_tokens_; }
  const std::string& dir() const { return dir_; }

 private:
  void commit(const std::vector<GeneratedSample>& samples);

  const std::string dir_;
  const int64_t shard_size_;
  const bool keep_truncated_;
  std::set<int64_t> done_before_;
  int64_t removed_uncommitted_ = 0;
  std::vector<std::string> unrecorded_;
  int64_t next_shard_ = 0;
  std::vector<GeneratedSample> buffer_;
  int64_t committed_ = 0, written_ = 0, skipped_ = 0, new_tokens_ = 0;
};

}  // namespace dflash::decode
