// run_dir.h: a directory with a tiny CPU run's config (the tiny qwen3_5 preset, synthetic
// data), for the tests that start the daemon as a process.
#pragma once

#include <dirent.h>
#include <sys/stat.h>

#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "tests/test_util.h"

namespace dflash::test {

struct RunDir {
  std::string dir, config;
};

inline RunDir make_run(const std::string& tag, const std::string& extra = "", int port = 0) {
  RunDir r;
  r.dir = make_temp_dir(tag);
  r.config = r.dir + "/run.yaml";
  std::ofstream(r.config) << "run: {output_dir: " << r.dir << "/out}\n"
                          << "target: {preset: tiny-qwen3_5, weights: random, dtype: float32}\n"
                          << "drafter: {num_layers: 1, block_size: 8, mask_token_id: 511}\n"
                          << "gpus: {device: cpu}\n"
                          << "data: {synthetic: {sequences: 64, min_length: 24, max_length: 48}}\n"
                          << "metrics: {listen: \"" << (port ? "127.0.0.1:" + std::to_string(port) : "")
                          << "\", log_every_seconds: 1}\n"
                          << extra;
  return r;
}

// Replaces the line of section `key` that make_run wrote ("gpus: {device: cpu}") by `line`.
inline void set_section(const RunDir& r, const std::string& key, const std::string& line) {
  std::string text = read_file(r.config);
  const size_t at = text.find("\n" + key + ": ");
  if (at == std::string::npos) throw std::runtime_error(r.config + ": no section " + key);
  const size_t end = text.find('\n', at + 1);
  text.replace(at + 1, end - at - 1, line);
  std::ofstream(r.config) << text;
}

inline std::string final_weights(const RunDir& r, const std::string& step) {
  return read_file(r.dir + "/out/checkpoints/step-" + step + "/model.safetensors");
}

inline bool exists(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0;
}

inline std::vector<std::string> drafter_checkpoints(const RunDir& r) {
  std::vector<std::string> out;
  if (DIR* dir = ::opendir((r.dir + "/out/checkpoints").c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (n.rfind("step-", 0) == 0 && exists(r.dir + "/out/checkpoints/" + n + "/COMMIT")) out.push_back(n);
    }
    ::closedir(dir);
  }
  return out;
}

}  // namespace dflash::test
