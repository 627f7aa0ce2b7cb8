// nodes.h: the processes of a multi-node run (one per node) find each other through a TCP
// store hosted by node 0 (c10d's TCPStore from libtorch, as torchrun's rendezvous) and sum
// what the drafter replicas of all nodes must agree on: the step's scalars, and on CPU runs
// the gradients (GPU runs sum gradients with NCCL across nodes; the NCCL id travels here).
// Every node makes the same calls in the same order; sums run in node order, so all nodes get
// bit-identical results.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"

namespace dflash::pipeline {

struct NodeInfo {
  int nodes = 1, rank = 0;
  std::string master_addr;
  int master_port = 0;
  std::chrono::milliseconds timeout{600000};
};

// The config's distributed section with torchrun's variables applied when from_env is set.
// Throws std::runtime_error naming the variable or value that is missing or wrong.
NodeInfo resolve_nodes(const config::DistributedConfig& c);

class NodeGroup {
 public:
  explicit NodeGroup(const NodeInfo& info);  // blocks until every node has joined (or the timeout)
  ~NodeGroup();
  int nodes() const { return info_.nodes; }
  int rank() const { return info_.rank; }

  // Element-wise sums over the nodes of equally long vectors.
  std::vector<double> sum(const std::vector<double>& values);
  // Replaces each (CPU, fp32-convertible) tensor by its sum over the nodes, in its dtype.
  void sum(std::vector<at::Tensor>& tensors);
  // Node 0's bytes on every node (the NCCL unique id).
  std::vector<uint8_t> broadcast(const std::vector<uint8_t>& from_node0);
  // Throws std::runtime_error on every node unless every node passes the same `mine`:
  // "distributed: the nodes <disagree> (node 0: .., node 1: ..); <advice>"; where `mine` is a JSON
  // object, the message names only the keys that differ, with each node's value.
  void require_same(const std::string& mine, const std::string& disagree, const std::string& advice);

 private:
  std::vector<std::vector<uint8_t>> exchange(const std::vector<uint8_t>& mine);
  struct Impl;
  NodeInfo info_;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::pipeline
