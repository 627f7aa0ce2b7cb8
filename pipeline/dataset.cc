#include "pipeline/dataset.h"

#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <numeric>
#include <random>
#include <stdexcept>

#include "common/log.h"
#include "decode/shards.h"

namespace dflash::pipeline {

uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

namespace {

// The committed shards of a `dflashd generate` output directory: a shard without its marker is a
// commit cut short or under way (generate, run again, removes it and decodes its prompts again),
// so reading it could train on a prompt twice. What is left out, and an unfinished job, are said.
std::vector<std::string> generated_files(const std::string& dir) {
  const decode::GeneratedData g = decode::generated_data(dir);
  if (!g.uncommitted.empty()) {
    log::warn("data.paths: {}: {} shard(s) without a commit marker left out ({}{}): a dflashd generate run cut short "
              "or still running",
              dir, g.uncommitted.size(), g.uncommitted.front(), g.uncommitted.size() > 1 ? ", ..." : "");
  }
  const std::string job = g.prompts < 0 ? "?" : std::to_string(g.prompts);
  if (g.files.empty()) {
    throw std::runtime_error("data.paths: " + dir + ": dflashd generate output without a committed shard yet (0 of " +
                             job + " prompts done)");
  }
  if (g.prompts < 0 || g.done < g.prompts) {
    log::warn("data.paths: {}: dflashd generate has done {} of {} prompts; training on those (run the same generate "
              "command again to finish the job)",
              dir, g.done, job);
  } else {
    log::info("data.paths: {}: dflashd generate output, {} committed shard(s), all {} prompts", dir, g.files.size(),
              job);
  }
  return g.files;
}

}  // namespace

std::vector<std::string> data_files(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const auto& p : paths) {
    struct stat st {};
    if (::stat(p.c_str(), &st) != 0) throw std::runtime_error("data.paths: " + p + ": no such file or directory");
    if (S_ISDIR(st.st_mode) && decode::is_generate_output(p)) {
      const std::vector<std::string> shards = generated_files(p);
      files.insert(files.end(), shards.begin(), shards.end());
    } else if (S_ISDIR(st.st_mode)) {
      std::vector<std::string> shard;
      if (DIR* dir = ::opendir(p.c_str())) {
        while (dirent* e = ::readdir(dir)) {
          const std::string n = e->d_name;
          if (n.size() > 6 && n.substr(n.size() - 6) == ".jsonl") shard.push_back(p + "/" + n);
        }
        ::closedir(dir);
      }
      if (shard.empty()) throw std::runtime_error("data.paths: " + p + ": a directory without *.jsonl files");
      std::sort(shard.begin(), shard.end());
      files.insert(files.end(), shard.begin(), shard.end());
    } else {
      files.push_back(p);
    }
  }
  // A file reached twice (listed twice, or listed and within a listed directory) would be trained
  // on twice an epoch: refused, naming both ways to it.
  std::map<std::pair<dev_t, ino_t>, std::string> seen;
  for (const std::string& f : files) {
    struct stat st {};
    if (::stat(f.c_str(), &st) != 0) continue;  // reported when read
    const auto [it, first] = seen.emplace(std::make_pair(st.st_dev, st.st_ino), f);
    if (!first) {
      throw std::runtime_error("data.paths: " + f + " is read twice (also as " + it->second + "); list each file once");
    }
  }
  return files;
}

namespace {

int64_t supervised(const TokenSample& s) {
  return std::count(s.loss_mask.begin(), s.loss_mask.end(), 1);
}

// Whether some position can anchor a block: it and the next token both supervised (the rule of
// drafter::sample_anchors). A sample without one trains nothing.
bool has_anchor(const TokenSample& s) {
  for (size_t a = 0; a + 1 < s.loss_mask.size(); ++a) {
    if (s.loss_mask[a] && s.loss_mask[a + 1]) return true;
  }
  return false;
}

// A usable sample's ids and loss mask as the run sees them (truncated).
uint64_t sample_digest(const TokenSample& s) {
  uint64_t h = mix64(s.input_ids.size());
  for (size_t i = 0; i < s.input_ids.size(); ++i) {
    h = mix64(h ^ ((static_cast<uint64_t>(s.input_ids[i]) << 1) | (s.loss_mask[i] ? 1 : 0)));
  }
  return h;
}

}  // namespace

std::string Dataset::digest() const {
  char text[17];
  std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(digest_));
  return text;
}

TokenSample synthetic_sample(int64_t number, const config::SyntheticData& synthetic, int64_t vocab_size, int64_t seed) {
  std::mt19937_64 rng(mix64(static_cast<uint64_t>(seed) ^ mix64(static_cast<uint64_t>(number))));
  const int64_t length = synthetic.min_length + static_cast<int64_t>(rng() % (synthetic.max_length - synthetic.min_length + 1));
  const int64_t usable = std::max<int64_t>(2, vocab_size - 1);
  const int64_t start = static_cast<int64_t>(rng() % usable), stride = 1 + static_cast<int64_t>(rng() % 3);
  TokenSample s;
  s.line = number;
  for (int64_t t = 0; t < length; ++t) {
    s.input_ids.push_back((start + t * stride) % usable);
    s.loss_mask.push_back(t >= 4 ? 1 : 0);  // a short unsupervised "prompt"
  }
  return s;
}

std::shared_ptr<Dataset> Dataset::open(const config::DataConfig& config, int64_t vocab_size) {
  auto d = std::shared_ptr<Dataset>(new Dataset());
  d->config_ = config;
  d->vocab_size_ = vocab_size;
  d->digest_ = mix64(static_cast<uint64_t>(config.seed) * 2 + (config.shuffle ? 1 : 0));
  int64_t usable = 0;  // usable samples indexed so far: the held-out draw's counter
  auto accept = [&](const TokenSample& s, Entry e) {
    const int64_t tokens = std::min<int64_t>(static_cast<int64_t>(s.input_ids.size()), config.max_length);
    TokenSample truncated = s;
    truncated.input_ids.resize(tokens);
    truncated.loss_mask.resize(tokens);
    if (supervised(truncated) < config.min_supervised_tokens) {
      ++d->skipped_short_;
      return;
    }
    if (!has_anchor(truncated)) {
      ++d->skipped_no_anchor_;
      return;
    }
    e.tokens = static_cast<int32_t>(tokens);
    // data.eval_fraction: a seeded, order-independent choice of samples kept out of training.
    const uint64_t draw = mix64(static_cast<uint64_t>(config.seed) ^ mix64(0xe7a1 + static_cast<uint64_t>(usable++)));
    const bool held_out = static_cast<double>(draw >> 11) * 0x1.0p-53 < config.eval_fraction;
    e.digest = sample_digest(truncated);
    d->digest_ = mix64(d->digest_ ^ e.digest ^ (held_out ? 0x9E3779B97F4A7C15ULL : 0));
    if (held_out) {
      d->held_out_.push_back(e);
      return;
    }
    d->tokens_per_epoch_ += tokens;
    d->index_.push_back(e);
  };
  if (config.synthetic.sequences > 0) {
    for (int64_t i = 0; i < config.synthetic.sequences; ++i) {
      accept(synthetic_sample(i, config.synthetic, vocab_size, config.seed), Entry{-1, i, i, 0});
    }
  } else {
    d->files_ = data_files(config.paths);
    for (int32_t f = 0; f < static_cast<int32_t>(d->files_.size()); ++f) {
      const std::string& path = d->files_[f];
      std::ifstream in(path, std::ios::binary);
      if (!in) throw std::runtime_error("data.paths: " + path + ": cannot read");
      std::string text;
      int64_t line = 0;
      while (true) {
        const int64_t offset = static_cast<int64_t>(in.tellg());
        if (!std::getline(in, text)) break;
        ++line;
        if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
        try {
          TokenSample s = parse_token_line(text, path, line);
          if (s.loss_mask.empty()) throw TokenFileError(path + ":" + std::to_string(line) + ": training data needs a \"loss_mask\"");
          for (int64_t id : s.input_ids) {
            if (id >= vocab_size) {
              throw TokenFileError(path + ":" + std::to_string(line) + ": token id " + std::to_string(id) +
                                   " is outside the target vocabulary (" + std::to_string(vocab_size) + ")");
            }
          }
          accept(s, Entry{f, offset, line, 0});
        } catch (const TokenFileError& e) {
          if (config.on_malformed == config::OnMalformed::error) throw;
          ++d->skipped_malformed_;
          log::warn("skipping malformed sample: {}", e.what());
        }
      }
    }
  }
  if (d->index_.empty()) {
    throw std::runtime_error("data: no usable sample (" + std::to_string(d->skipped_short_) +
                             " with too few supervised tokens, " + std::to_string(d->skipped_no_anchor_) +
                             " without two adjacent supervised tokens, " + std::to_string(d->skipped_malformed_) +
                             " malformed, " + std::to_string(d->held_out_.size()) +
                             " held out for eval by data.eval_fraction)");
  }
  return d;
}

TokenSample Dataset::load(int64_t index) const { return load_entry(index_.at(static_cast<size_t>(index))); }

TokenSample Dataset::load_held_out(int64_t index) const { return load_entry(held_out_.at(static_cast<size_t>(index))); }

std::string Dataset::describe_held_out(int64_t index) const { return describe_entry(held_out_.at(static_cast<size_t>(index))); }

TokenSample Dataset::load_entry(const Entry& e) const {
  TokenSample s;
  if (e.file < 0) {
    s = synthetic_sample(e.offset, config_.synthetic, vocab_size_, config_.seed);
  } else {
    std::ifstream in(files_[e.file], std::ios::binary);
    in.seekg(e.offset);
    std::string text;
    if (!in || !std::getline(in, text)) {
      throw std::runtime_error(files_[e.file] + ":" + std::to_string(e.line) + ": cannot re-read (file changed?)");
    }
    s = parse_token_line(text, files_[e.file], e.line);
  }
  s.input_ids.resize(e.tokens);
  s.loss_mask.resize(e.tokens);
  if (sample_digest(s) != e.digest) {
    throw std::runtime_error(describe_entry(e) + ": changed since the data was indexed at start (a sample is read "
                             "again each time it is trained on); restore the file, or restart the run to index "
                             "the data again (a resume onto other data is refused)");
  }
  return s;
}

std::string Dataset::describe(int64_t index) const { return describe_entry(index_.at(static_cast<size_t>(index))); }

std::string Dataset::describe_entry(const Entry& e) const {
  if (e.file < 0) return "synthetic sample " + std::to_string(e.offset);
  return files_[e.file] + ":" + std::to_string(e.line);
}

std::vector<int64_t> Dataset::epoch_order(int64_t epoch) const {
  std::vector<int64_t> order(index_.size());
  std::iota(order.begin(), order.end(), 0);
  if (config_.shuffle) {
    std::mt19937_64 rng(mix64(static_cast<uint64_t>(config_.seed) * 1000003ULL + static_cast<uint64_t>(epoch)));
    for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[rng() % i]);  // Fisher-Yates
  }
  return order;
}

int64_t Dataset::sample_at(int64_t epoch, int64_t position) const {
  std::lock_guard lock(order_mutex_);
  if (cached_epoch_ != epoch) {
    cached_order_ = epoch_order(epoch);
    cached_epoch_ = epoch;
  }
  return cached_order_.at(static_cast<size_t>(position));
}

StepPlan StepPlan::make(int64_t samples_per_epoch, int64_t replicas, int64_t sequences_per_micro, int64_t micro_steps,
                        double epochs, int64_t max_steps) {
  StepPlan p;
  p.samples_per_epoch = samples_per_epoch;
  p.replicas = replicas;
  p.sequences_per_micro = sequences_per_micro;
  p.micro_steps = micro_steps;
  p.steps_per_epoch = (samples_per_epoch + p.global_batch() - 1) / p.global_batch();  // the last step may be partial
  p.total_steps = max_steps > 0 ? max_steps : static_cast<int64_t>(std::ceil(epochs * static_cast<double>(p.steps_per_epoch)));
  return p;
}

int64_t StepPlan::first_sample(int64_t step) const {
  const int64_t epoch = step / steps_per_epoch, s = step % steps_per_epoch;
  return epoch * samples_per_epoch + s * global_batch();
}

int64_t StepPlan::end_sample(int64_t step) const {
  const int64_t epoch = step / steps_per_epoch, s = step % steps_per_epoch;
  return epoch * samples_per_epoch + std::min(samples_per_epoch, (s + 1) * global_batch());
}

int64_t StepPlan::step_of(int64_t q) const {
  const int64_t epoch = q / samples_per_epoch, position = q % samples_per_epoch;
  return epoch * steps_per_epoch + position / global_batch();
}

int64_t StepPlan::replica_of(int64_t q) const {
  const int64_t offset = q - first_sample(step_of(q));
  return offset / (sequences_per_micro * micro_steps);
}

std::vector<int64_t> StepPlan::samples_for(int64_t step, int64_t replica) const {
  const int64_t per_replica = sequences_per_micro * micro_steps;
  const int64_t begin = first_sample(step) + replica * per_replica;
  const int64_t end = std::min(begin + per_replica, end_sample(step));
  std::vector<int64_t> out;
  for (int64_t q = begin; q < end; ++q) out.push_back(q);
  return out;
}

}  // namespace dflash::pipeline
