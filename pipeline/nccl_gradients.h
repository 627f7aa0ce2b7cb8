// nccl_gradients.h: gradient all-reduce across the drafter replicas of all nodes, one per GPU,
// through NCCL: one communicator per local GPU (one node: ncclCommInitAll; several: ranks
// node_rank * local + i by ncclCommInitRank from a unique id that node 0 draws and the node
// group hands round). Each replica's thread calls sum() for its own local index, on its
// device's current stream; NCCL orders the ranks.
//
// Built only with CUDA and NCCL (available() says); a CPU run or a single replica sums on the
// host (trainer.cc's LocalCollective). Errors throw naming the GPU and NCCL's message.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dflash::pipeline {

class NodeGroup;

class NcclGradients {
 public:
  static bool available();
  // One communicator per local device (distinct); `nodes` null for a single-node run.
  NcclGradients(const std::vector<int>& devices, NodeGroup* nodes);
  ~NcclGradients();
  // In place: every replica's tensors become the sum over replicas (accumulated in fp32).
  // Throws once abort() was called.
  void sum(int replica, std::vector<at::Tensor>& tensors);
  // From any thread, once: aborts every communicator (ncclCommAbort), so that the replicas
  // waiting for a peer that failed or hangs (their all-reduce kernels, the host calls behind
  // them) return instead of waiting for ever. The destructor then destroys nothing.
  void abort();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::pipeline
