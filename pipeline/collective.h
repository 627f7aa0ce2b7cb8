// collective.h: the sums the drafter replicas of a run agree on at every step, in one place:
// scalars (the loss denominator, the step's metrics, the stop vote) through host memory, and the
// gradients through NCCL across GPU replicas (or host memory on the CPU and with one replica).
//
// Scalars are summed over the replicas living in threads of this process in replica order (so
// the result does not depend on thread timing), then, in a multi-node run, across the nodes
// (replica 0's thread exchanges the node's sum; every node adds in node order). Every replica
// calls each operation once per step, in the same sequence.
//
// Thread-safety: sum() and sum_gradients() from the replicas' threads as above; abort() from any
// thread, once the run failed: waiters are released with an exception and the NCCL
// communicators aborted, so no replica waits for ever for a failed or stuck peer.
#pragma once

#include <ATen/core/Tensor.h>

#include <condition_variable>
#include <memory>
#include <mutex>
#include <vector>

namespace dflash::pipeline {

class NodeGroup;
class NcclGradients;

class Collective {
 public:
  // `nodes` null for a single-node run; `nccl` null where gradients go through host memory.
  Collective(int replicas, NodeGroup* nodes, std::unique_ptr<NcclGradients> nccl);
  ~Collective();

  double sum(int replica, double value) { return sum(replica, std::vector<double>{value})[0]; }
  // Element-wise sums of equally long vectors, one per replica.
  std::vector<double> sum(int replica, std::vector<double> values);
  // Replaces each tensor by the sum over replicas (on its own device).
  void sum_gradients(int replica, std::vector<at::Tensor>& tensors);
  void abort();

 private:
  void sum_on_host(int replica, std::vector<at::Tensor>& values);
  bool barrier();
  void wait_for_all();

  const int replicas_;
  NodeGroup* const nodes_;
  const std::unique_ptr<NcclGradients> nccl_;
  // Written by each replica for its own index between barriers; read by all after the barrier.
  std::vector<std::vector<double>> scalars_;
  std::vector<std::vector<at::Tensor>*> tensors_;
  std::vector<double> node_scalars_;  // written by replica 0 between barriers
  std::vector<at::Tensor> node_tensors_;
  std::mutex mutex_;  // guards the barrier's state below
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
  bool aborted_ = false;
};

}  // namespace dflash::pipeline
