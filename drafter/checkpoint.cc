#include "drafter/checkpoint.h"

#include <ATen/ATen.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "common/json_limits.h"
#include "common/safetensors.h"
#include "drafter/tensor_io.h"

namespace dflash::drafter {
namespace {

std::string step_name(int64_t step) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "step-%012lld", static_cast<long long>(step));
  return buffer;
}

bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void remove_tree(const std::string& path) {
  if (DIR* dir = ::opendir(path.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string name = e->d_name;
      if (name == "." || name == "..") continue;
      const std::string child = path + "/" + name;
      struct stat st {};
      if (::lstat(child.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) remove_tree(child);
      else ::unlink(child.c_str());
    }
    ::closedir(dir);
  }
  ::rmdir(path.c_str());
}

void fsync_dir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    ::fsync(fd);
    ::close(fd);
  }
}

void write_tensors(const std::string& path, const NamedTensors& tensors) {
  write_named_tensors(path, tensors, at::kFloat);
}

NamedTensors read_tensors(const std::string& path) {
  try {
    NamedTensors tensors = read_named_tensors(path);
    for (const auto& [name, t] : tensors) {
      if (t.scalar_type() != at::kFloat) throw CheckpointError(path + ": tensor '" + name + "' is not F32");
    }
    return tensors;
  } catch (const SafetensorsError& e) {
    throw CheckpointError(e.what());
  }
}

std::string read_text(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw CheckpointError(path + ": cannot read");
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

}  // namespace

void CheckpointSnapshot::take(int64_t at_step, const Drafter& drafter, const AdamW& optimizer, std::string trainer_state) {
  step = at_step;
  optimizer_steps = optimizer.steps_taken();
  shape = drafter.shape();
  trainer_state_json = std::move(trainer_state);
  // The master copies are the model (bf16 parameters are their rounding); the optimizer file
  // holds the moments. Buffers of the previous take are reused when the names and shapes agree.
  std::vector<std::pair<std::string, at::Tensor>> old_model = std::move(model), old_moments = std::move(moments);
  std::map<std::string, at::Tensor> buffers;
  for (auto& [n, t] : old_model) buffers.emplace(n, std::move(t));
  for (auto& [n, t] : old_moments) buffers.emplace(n, std::move(t));
  model.clear();
  moments.clear();
  for (const auto& [n, t] : optimizer.state_tensors()) {
    const bool master = n.rfind("master.", 0) == 0;
    const std::string name = master ? n.substr(7) : n;
    at::Tensor& buffer = buffers[name];
    if (!buffer.defined() || buffer.sizes() != t.sizes() || buffer.scalar_type() != t.scalar_type()) {
      buffer = at::empty(t.sizes(), at::TensorOptions().dtype(t.scalar_type()).pinned_memory(t.is_cuda()));
    }
    buffer.copy_(t);  // synchronous: the optimizer may change t as soon as take() returns
    (master ? model : moments).emplace_back(name, buffer);
  }
}

std::string write_checkpoint(const std::string& root, const CheckpointSnapshot& snapshot) {
  make_directories(root);
  const std::string name = step_name(snapshot.step);
  const std::string partial = root + "/." + name + ".partial";
  const std::string final_dir = root + "/" + name;
  remove_tree(partial);  // a crash during an earlier write
  make_directories(partial);
  write_file_atomically(partial + "/config.json", export_config_json(snapshot.shape));
  write_tensors(partial + "/model.safetensors", snapshot.model);
  write_tensors(partial + "/optimizer.safetensors", snapshot.moments);
  nlohmann::json state_json = {
      {"format", "dflashd-checkpoint"},
      {"version", 1},
      {"step", snapshot.step},
      {"optimizer_steps", snapshot.optimizer_steps},
      {"trainer", nlohmann::json::parse(snapshot.trainer_state_json.empty() ? "{}" : snapshot.trainer_state_json)}};
  write_file_atomically(partial + "/state.json", state_json.dump(2) + "\n");
  write_file_atomically(partial + "/COMMIT", name + "\n");
  if (exists(final_dir)) remove_tree(final_dir);  // rewriting the same step (after a resume)
  if (::rename(partial.c_str(), final_dir.c_str()) != 0) {
    throw CheckpointError(final_dir + ": cannot rename the finished checkpoint: " + std::strerror(errno));
  }
  fsync_dir(root);
  return final_dir;
}

std::string write_checkpoint(const std::string& root, int64_t step, const Drafter& drafter, const AdamW& optimizer,
                             const std::string& trainer_state_json) {
  CheckpointSnapshot snapshot;
  snapshot.take(step, drafter, optimizer, trainer_state_json);
  return write_checkpoint(root, snapshot);
}

std::vector<std::string> list_checkpoints(const std::string& root) {
  std::vector<std::string> names;
  if (DIR* dir = ::opendir(root.c_str())) {
    while (dirent* e = ::readdir(dir)) {
      const std::string n = e->d_name;
      if (n.rfind("step-", 0) == 0 && exists(root + "/" + n + "/COMMIT")) names.push_back(n);
    }
    ::closedir(dir);
  }
  std::sort(names.begin(), names.end());  // zero-padded: lexical order is step order
  for (auto& n : names) n = root + "/" + n;
  return names;
}

void prune_checkpoints(const std::string& root, int keep_last) {
  const auto all = list_checkpoints(root);
  for (size_t i = 0; i + static_cast<size_t>(keep_last) < all.size(); ++i) remove_tree(all[i]);
}

LoadedCheckpoint read_checkpoint(const std::string& dir, Drafter* drafter, AdamW* optimizer) {
  if (!exists(dir + "/COMMIT")) throw CheckpointError(dir + ": not a complete checkpoint (no COMMIT marker)");
  const std::string state_text = read_text(dir + "/state.json");
  if (const std::string problem = json_text_problem(state_text); !problem.empty()) {
    throw CheckpointError(dir + "/state.json: invalid JSON: " + problem);
  }
  nlohmann::json state;
  try {
    state = nlohmann::json::parse(state_text);
  } catch (const nlohmann::json::exception& e) {
    throw CheckpointError(dir + "/state.json: " + e.what());
  }
  if (state.value("format", "") != "dflashd-checkpoint" || state.value("version", 0) != 1) {
    throw CheckpointError(dir + "/state.json: not a version 1 dflashd checkpoint");
  }
  // Tensor shapes alone would let a drafter of another block size, mask token, tapped layers or
  // window take these weights: the whole shape must be the checkpoint's.
  const std::string config_path = dir + "/config.json";
  const std::string differences = shape_differences(parse_export_config(read_text(config_path), config_path),
                                                    drafter->shape());
  if (!differences.empty()) {
    throw CheckpointError(config_path + ": the checkpoint's drafter is not the configured one (drafter.* and the "
                          "target decide it): " + differences + "; configure the drafter it was trained as, or use "
                          "checkpoint.resume: never to start over");
  }
  const auto model = read_tensors(dir + "/model.safetensors");
  drafter->load_tensors(model, dir + "/model.safetensors");
  if (optimizer) {
    auto tensors = read_tensors(dir + "/optimizer.safetensors");
    for (const auto& [name, t] : model) tensors.emplace_back("master." + name, t);
    optimizer->load_state(tensors, state.at("optimizer_steps").get<int64_t>(), dir + "/optimizer.safetensors");
  }
  return {state.at("step").get<int64_t>(), state.at("trainer").dump()};
}

void export_checkpoint(const std::string& checkpoint_dir, const std::string& out_dir) {
  if (!exists(checkpoint_dir + "/COMMIT")) {
    throw CheckpointError(checkpoint_dir + ": not a complete checkpoint (no COMMIT marker)");
  }
  const DrafterShape shape = parse_export_config(read_text(checkpoint_dir + "/config.json"), checkpoint_dir + "/config.json");
  Drafter drafter(shape, at::TensorOptions().dtype(at::kFloat));
  drafter.load_tensors(read_tensors(checkpoint_dir + "/model.safetensors"), checkpoint_dir + "/model.safetensors");
  drafter.save_export(out_dir);
}

}  // namespace dflash::drafter
