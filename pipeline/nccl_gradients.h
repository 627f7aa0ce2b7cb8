// nccl_gradients.h: gradient all-reduce across the drafter replicas of this process, one per
// GPU, through NCCL (communicators from ncclCommInitAll). Each replica's thread calls sum()
// for its own rank, on its device's current stream; NCCL orders the ranks. Multi-node
// rendezvous (torchrun-style variables, c10d TCPStore) is not built yet.
//
// Built only with CUDA and NCCL (available() says); a CPU run or a single replica sums on the
// host (trainer.cc's LocalCollective). Errors throw naming the GPU and NCCL's message.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <vector>

namespace dflash::pipeline {

class NcclGradients {
 public:
  static bool available();
  // One communicator per device; devices must be distinct.
  explicit NcclGradients(const std::vector<int>& devices);
  ~NcclGradients();
  // In place: every replica's tensors become the sum over replicas (accumulated in fp32).
  void sum(int replica, std::vector<at::Tensor>& tensors);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace dflash::pipeline
