#include "pipeline/nodes.h"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cstdlib>
#include <cstring>
#include <stdexcept>

#include "common/log.h"
#include "pipeline/run_settings.h"

namespace dflash::pipeline {
namespace {

std::string env_or_throw(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    throw std::runtime_error(std::string("distributed.from_env: the environment variable ") + name +
                             " is not set (torchrun sets WORLD_SIZE, RANK, MASTER_ADDR, MASTER_PORT)");
  }
  return v;
}

int env_int(const char* name, int low, int high) {
  const std::string v = env_or_throw(name);
  char* end = nullptr;
  const long x = std::strtol(v.c_str(), &end, 10);
  if (end == v.c_str() || *end != '\0' || x < low || x > high) {
    throw std::runtime_error(std::string("distributed.from_env: ") + name + "='" + v + "' is not an integer in " +
                             std::to_string(low) + ".." + std::to_string(high));
  }
  return static_cast<int>(x);
}

}  // namespace

NodeInfo resolve_nodes(const config::DistributedConfig& c) {
  NodeInfo info;
  info.nodes = c.nodes;
  info.rank = c.node_rank;
  info.master_addr = c.master_addr;
  info.master_port = c.master_port;
  info.timeout = std::chrono::milliseconds(static_cast<int64_t>(c.timeout_seconds * 1000));
  if (c.from_env) {
    info.nodes = env_int("WORLD_SIZE", 1, 4096);
    info.rank = env_int("RANK", 0, info.nodes - 1);
    info.master_addr = env_or_throw("MASTER_ADDR");
    info.master_port = env_int("MASTER_PORT", 1, 65535);
  }
  if (info.rank >= info.nodes) {
    throw std::runtime_error("distributed: node rank " + std::to_string(info.rank) + " is not below the node count " +
                             std::to_string(info.nodes));
  }
  return info;
}

struct NodeGroup::Impl {
  c10::intrusive_ptr<c10d::TCPStore> store;
  int64_t calls = 0;  // every node makes the same sequence of calls: the call number names the keys
};

NodeGroup::NodeGroup(const NodeInfo& info) : info_(info), impl_(std::make_unique<Impl>()) {
  c10d::TCPStoreOptions options;
  options.port = static_cast<std::uint16_t>(info.master_port);
  options.isServer = info.rank == 0;
  options.numWorkers = static_cast<std::size_t>(info.nodes);
  options.waitWorkers = true;
  options.timeout = info.timeout;
  log::info("distributed: node {} of {}, rendezvous at {}:{}", info.rank, info.nodes, info.master_addr, info.master_port);
  try {
    impl_->store = c10::make_intrusive<c10d::TCPStore>(info.master_addr, options);
  } catch (const std::exception& e) {
    throw std::runtime_error("distributed: rendezvous at " + info.master_addr + ":" + std::to_string(info.master_port) +
                             " failed for node " + std::to_string(info.rank) + ": " + e.what());
  }
  log::info("distributed: all {} nodes joined", info.nodes);
}

NodeGroup::~NodeGroup() = default;

std::vector<std::vector<uint8_t>> NodeGroup::exchange(const std::vector<uint8_t>& mine) {
  c10d::Store& store = *impl_->store;
  const std::string prefix = "x/" + std::to_string(impl_->calls++) + "/";
  store.set(prefix + std::to_string(info_.rank), mine);
  std::vector<std::string> keys;
  for (int r = 0; r < info_.nodes; ++r) keys.push_back(prefix + std::to_string(r));
  try {
    store.wait(keys);
  } catch (const std::exception& e) {
    throw std::runtime_error("distributed: node " + std::to_string(info_.rank) + " timed out waiting for the other nodes (" +
                             e.what() + ")");
  }
  std::vector<std::vector<uint8_t>> all = store.multiGet(keys);
  // Node 0 hosts the store: it returns only once every node has read (so no node loses the
  // store mid-exchange when node 0 stops right after, e.g. on an error every node raises), and
  // then deletes the call's keys (the store does not grow with the run).
  if (store.add(prefix + "read", 1) == info_.nodes) store.set(prefix + "done", std::vector<uint8_t>{1});
  if (info_.rank == 0) {
    store.wait({prefix + "done"});
    for (const std::string& k : keys) store.deleteKey(k);
    store.deleteKey(prefix + "read");
    store.deleteKey(prefix + "done");
  }
  return all;
}

std::vector<double> NodeGroup::sum(const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * sizeof(double));
  std::memcpy(bytes.data(), values.data(), bytes.size());
  const auto all = exchange(bytes);
  std::vector<double> total(values.size(), 0.0);
  for (const auto& b : all) {
    if (b.size() != bytes.size()) throw std::runtime_error("distributed: nodes disagree on the size of a sum");
    const double* v = reinterpret_cast<const double*>(b.data());
    for (size_t i = 0; i < total.size(); ++i) total[i] += v[i];
  }
  return total;
}

void NodeGroup::sum(std::vector<at::Tensor>& tensors) {
  // One exchange for all tensors: their bytes back to back.
  std::vector<at::Tensor> mine;
  std::vector<uint8_t> bytes;
  for (const at::Tensor& t : tensors) {
    mine.push_back(t.to(at::kCPU).contiguous());
    const auto* p = static_cast<const uint8_t*>(mine.back().data_ptr());
    bytes.insert(bytes.end(), p, p + mine.back().nbytes());
  }
  const auto all = exchange(bytes);
  for (const auto& b : all) {
    if (b.size() != bytes.size()) throw std::runtime_error("distributed: nodes disagree on the gradients' sizes");
  }
  size_t offset = 0;
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor total;
    for (const auto& b : all) {
      const at::Tensor part =
          at::from_blob(const_cast<uint8_t*>(b.data() + offset), mine[i].sizes(), mine[i].options()).clone();
      if (total.defined()) total.add_(part);
      else total = part;
    }
    offset += mine[i].nbytes();
    tensors[i] = total.to(tensors[i].device());
  }
}

std::vector<uint8_t> NodeGroup::broadcast(const std::vector<uint8_t>& from_node0) {
  return exchange(info_.rank == 0 ? from_node0 : std::vector<uint8_t>{})[0];
}

void NodeGroup::require_same(const std::string& mine, const std::string& disagree, const std::string& advice) {
  std::vector<std::string> values, labels;
  for (const std::vector<uint8_t>& v : exchange(std::vector<uint8_t>(mine.begin(), mine.end()))) {
    labels.push_back("node " + std::to_string(values.size()));
    values.emplace_back(v.begin(), v.end());
  }
  const std::string differences = setting_differences(values, labels);
  if (!differences.empty()) {
    throw std::runtime_error("distributed: the nodes " + disagree + " (" + differences + "); " + advice);
  }
}

}  // namespace dflash::pipeline
