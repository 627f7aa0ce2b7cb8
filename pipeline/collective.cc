#include "pipeline/collective.h"

#include <ATen/ATen.h>

#include <stdexcept>

#include "pipeline/nccl_gradients.h"
#include "pipeline/nodes.h"

namespace dflash::pipeline {

Collective::Collective(int replicas, NodeGroup* nodes, std::unique_ptr<NcclGradients> nccl)
    : replicas_(replicas), nodes_(nodes), nccl_(std::move(nccl)), scalars_(replicas), tensors_(replicas) {}

Collective::~Collective() = default;

std::vector<double> Collective::sum(int replica, std::vector<double> values) {
  if (replicas_ == 1) return nodes_ ? nodes_->sum(values) : values;
  scalars_[replica] = std::move(values);
  wait_for_all();
  std::vector<double> total(scalars_[0].size(), 0.0);
  for (const auto& v : scalars_) {
    for (size_t i = 0; i < total.size(); ++i) total[i] += v[i];
  }
  if (nodes_) {
    if (replica == 0) node_scalars_ = nodes_->sum(total);
    wait_for_all();
    total = node_scalars_;
  }
  wait_for_all();
  return total;
}

void Collective::sum_gradients(int replica, std::vector<at::Tensor>& tensors) {
  if (nccl_) {
    nccl_->sum(replica, tensors);
  } else {
    sum_on_host(replica, tensors);
  }
}

void Collective::sum_on_host(int replica, std::vector<at::Tensor>& values) {
  if (replicas_ == 1) {
    if (nodes_) nodes_->sum(values);
    return;
  }
  tensors_[replica] = &values;
  wait_for_all();
  std::vector<at::Tensor> totals;
  for (size_t i = 0; i < values.size(); ++i) {
    at::Tensor total = (*tensors_[0])[i].to(values[i].device(), /*non_blocking=*/false, /*copy=*/true);
    for (int r = 1; r < replicas_; ++r) total.add_((*tensors_[r])[i].to(values[i].device()));
    totals.push_back(total);
  }
  if (nodes_) {
    if (replica == 0) {
      nodes_->sum(totals);
      node_tensors_ = totals;
    }
    wait_for_all();
    for (size_t i = 0; i < totals.size(); ++i) totals[i] = node_tensors_[i].to(values[i].device(), false, true);
  }
  wait_for_all();
  values = std::move(totals);
}

void Collective::abort() {
  {
    std::lock_guard lock(mutex_);
    aborted_ = true;
    cv_.notify_all();
  }
  if (nccl_) nccl_->abort();  // replicas waiting in an all-reduce for a failed or stuck peer return
}

bool Collective::barrier() {
  std::unique_lock lock(mutex_);
  const int64_t generation = generation_;
  if (++arrived_ == replicas_) {
    arrived_ = 0;
    ++generation_;
    cv_.notify_all();
    return !aborted_;
  }
  cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
  return !aborted_;
}

void Collective::wait_for_all() {
  if (!barrier()) throw std::runtime_error("run aborted while waiting for the other drafter replicas");
}

}  // namespace dflash::pipeline
