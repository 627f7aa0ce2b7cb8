#include "decode/shards.h"

#include <dirent.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <stdexcept>

#include "common/safetensors.h"

namespace dflash::decode {
namespace {

std::string errno_text() { return std::strerror(errno); }

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error(path + ": cannot read");
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  DIR* d = ::opendir(dir.c_str());
  if (!d) throw std::runtime_error(dir + ": cannot list: " + errno_text());
  while (dirent* e = ::readdir(d)) names.push_back(e->d_name);
  ::closedir(d);
  return names;
}

// "shard-000012.jsonl" -> 12 with suffix ".jsonl"; -1 when the name is not a shard's.
int64_t shard_number(const std::string& name, const std::string& suffix) {
  const std::string prefix = "shard-";
  if (name.size() != prefix.size() + 6 + suffix.size() || name.compare(0, prefix.size(), prefix) != 0 ||
      name.compare(name.size() - suffix.size(), suffix.size(), suffix) != 0) {
    return -1;
  }
  int64_t n = 0;
  for (size_t i = prefix.size(); i < prefix.size() + 6; ++i) {
    if (name[i] < '0' || name[i] > '9') return -1;
    n = n * 10 + (name[i] - '0');
  }
  return n;
}

std::string shard_name(int64_t n, const char* suffix) {
  char name[32];
  std::snprintf(name, sizeof name, "shard-%06lld%s", static_cast<long long>(n), suffix);
  return name;
}

// The prompt indices committed shard n's marker lists.
std::vector<int64_t> marker_prompts(const std::string& dir, int64_t n) {
  const std::string path = dir + "/" + shard_name(n, ".done");
  try {
    return nlohmann::json::parse(read_all(path)).at("prompts").get<std::vector<int64_t>>();
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": damaged marker: " + e.what());
  }
}

// DIR/generate.json, the record of the job.
nlohmann::json read_job(const std::string& dir) {
  const std::string path = dir + "/generate.json";
  try {
    return nlohmann::json::parse(read_all(path));
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(path + ": not JSON (" + e.what() + ")");
  }
}

// A shard cut short (no marker) or a temporary file; generate decodes its prompts again.
void remove_file(const std::string& path) {
  if (::unlink(path.c_str()) != 0) {
    throw std::runtime_error(path + ": cannot remove an uncommitted shard: " + errno_text());
  }
}

}  // namespace

ShardListing list_shards(const std::string& dir) {
  ShardListing listing;
  std::set<int64_t> markers, samples;
  for (const std::string& name : entries(dir)) {
    if (name.find(".tmp") != std::string::npos) {
      listing.temporary.push_back(name);
    } else if (const int64_t n = shard_number(name, ".done"); n >= 0) {
      markers.insert(n);
    } else if (const int64_t m = shard_number(name, ".jsonl"); m >= 0) {
      samples.insert(m);
    }
  }
  for (int64_t n : samples) {
    if (markers.count(n) == 0) listing.uncommitted.push_back(shard_name(n, ".jsonl"));
  }
  for (int64_t n : markers) {
    if (samples.count(n) == 0) {
      throw std::runtime_error(dir + "/" + shard_name(n, ".done") + ": a commit marker without its samples " +
                               shard_name(n, ".jsonl") + " (removed by hand?); remove the marker as well, and generate "
                               "decodes its prompts again");
    }
    listing.committed.push_back(n);
  }
  return listing;
}

bool is_generate_output(const std::string& dir) { return ::access((dir + "/generate.json").c_str(), F_OK) == 0; }

GeneratedData generated_data(const std::string& dir) {
  GeneratedData data;
  const nlohmann::json job = read_job(dir);
  const auto prompts = job.is_object() ? job.find("prompts") : job.end();
  data.prompts = prompts != job.end() && prompts->is_number_integer() ? prompts->get<int64_t>() : -1;
  const ShardListing listing = list_shards(dir);
  for (int64_t n : listing.committed) {
    data.files.push_back(dir + "/" + shard_name(n, ".jsonl"));
    data.done += static_cast<int64_t>(marker_prompts(dir, n).size());
  }
  for (const std::string& name : listing.uncommitted) data.uncommitted.push_back(dir + "/" + name);
  return data;
}

ShardedOutput::ShardedOutput(std::string dir, const std::string& job, int64_t shard_size, bool keep_truncated)
    : dir_(std::move(dir)), shard_size_(shard_size), keep_truncated_(keep_truncated) {
  if (shard_size_ < 1) throw std::invalid_argument("generate: a shard must hold at least one sample");
  make_directories(dir_);
  const std::string job_path = dir_ + "/generate.json";
  const nlohmann::json wanted = nlohmann::json::parse(job);
  if (is_generate_output(dir_)) {
    const nlohmann::json found = read_job(dir_);
    // A record without some of this job's keys was written by an older dflashd that did not
    // record them: the same job if every key it has agrees (the keys are recorded from now on).
    bool same = found.is_object() && wanted.is_object();
    for (auto it = found.begin(); same && it != found.end(); ++it) same = wanted.contains(it.key()) && wanted[it.key()] == *it;
    if (!same) {
      throw std::runtime_error(job_path + ": this directory holds output of another job (" + found.dump() +
                               "), not of this one (" + wanted.dump() + "); use another --out, or the same prompts "
                               "and settings to continue it");
    }
    for (auto it = wanted.begin(); it != wanted.end(); ++it) {
      if (!found.contains(it.key())) unrecorded_.push_back(it.key());
    }
    if (!unrecorded_.empty()) write_file_atomically(job_path, wanted.dump(2) + "\n");
  } else {
    write_file_atomically(job_path, wanted.dump(2) + "\n");
  }
  const ShardListing listing = list_shards(dir_);
  for (const std::string& name : listing.temporary) remove_file(dir_ + "/" + name);
  for (const std::string& name : listing.uncommitted) remove_file(dir_ + "/" + name);
  removed_uncommitted_ = static_cast<int64_t>(listing.uncommitted.size());
  for (int64_t n : listing.committed) {
    for (int64_t index : marker_prompts(dir_, n)) {
      if (!done_before_.insert(index).second) {
        throw std::runtime_error(dir_ + "/" + shard_name(n, ".done") + ": damaged marker: prompt " +
                                 std::to_string(index) + " is in two shards");
      }
    }
    next_shard_ = n + 1;
  }
}

void ShardedOutput::add(GeneratedSample sample) {
  buffer_.push_back(std::move(sample));
  if (static_cast<int64_t>(buffer_.size()) >= shard_size_) flush();
}

void ShardedOutput::flush() {
  if (buffer_.empty()) return;
  commit(buffer_);
  buffer_.clear();
}

void ShardedOutput::commit(const std::vector<GeneratedSample>& samples) {
  std::string lines;
  std::vector<int64_t> prompts, skipped;
  int64_t kept = 0, new_tokens = 0;
  for (const GeneratedSample& s : samples) {
    prompts.push_back(s.prompt_index);
    new_tokens += static_cast<int64_t>(s.tokens.size()) - s.prompt_tokens;
    if (!s.stopped && !keep_truncated_) {
      skipped.push_back(s.prompt_index);
      continue;
    }
    std::vector<int> mask(s.tokens.size(), 1);
    std::fill(mask.begin(), mask.begin() + s.prompt_tokens, 0);
    nlohmann::ordered_json line;
    line["input_ids"] = s.tokens;
    line["loss_mask"] = mask;
    line["prompt_index"] = s.prompt_index;
    line["finish_reason"] = s.stopped ? "stop" : "length";
    lines += line.dump() + "\n";
    ++kept;
  }
  write_file_atomically(dir_ + "/" + shard_name(next_shard_, ".jsonl"), lines);
  nlohmann::ordered_json marker;
  marker["prompts"] = prompts;
  marker["samples"] = kept;
  marker["skipped_truncated"] = skipped;
  marker["new_tokens"] = new_tokens;
  write_file_atomically(dir_ + "/" + shard_name(next_shard_, ".done"), marker.dump() + "\n");
  ++next_shard_;
  committed_ += static_cast<int64_t>(samples.size());
  written_ += kept;
  skipped_ += static_cast<int64_t>(skipped.size());
  new_tokens_ += new_tokens;
}

}  // namespace dflash::decode
