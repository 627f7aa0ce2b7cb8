#include "pipeline/nccl_gradients.h"

#include <cstring>

#include "pipeline/nodes.h"

#include <ATen/ATen.h>

#include <chrono>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>

#if defined(DFLASHD_WITH_CUDA) && defined(DFLASHD_WITH_NCCL)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <nccl.h>
#define DFLASHD_NCCL 1
#endif

namespace dflash::pipeline {

#ifdef DFLASHD_NCCL
struct NcclGradients::Impl {
  std::vector<int> devices;                 // constant after construction
  // sum() enqueues under a shared lock, abort() frees the communicators under the exclusive one:
  // no all-reduce is enqueued on an aborted communicator.
  std::shared_timed_mutex mutex;
  std::vector<ncclComm_t> comms;            // guarded by mutex; null once aborted
  bool aborted = false;                     // guarded by mutex
};

namespace {
void check(ncclResult_t result, const std::string& what) {
  if (result != ncclSuccess) throw std::runtime_error(what + ": NCCL error: " + ncclGetErrorString(result));
}
}  // namespace

bool NcclGradients::available() { return true; }

NcclGradients::NcclGradients(const std::vector<int>& devices, NodeGroup* nodes) : impl_(std::make_unique<Impl>()) {
  impl_->devices = devices;
  impl_->comms.resize(devices.size());
  const int local = static_cast<int>(devices.size());
  std::string list;
  for (int d : devices) list += (list.empty() ? "" : ",") + std::to_string(d);
  if (nodes == nullptr) {
    check(ncclCommInitAll(impl_->comms.data(), local, devices.data()), "ncclCommInitAll over GPUs " + list);
    return;
  }
  // Across nodes: node 0 draws the id, the node group hands it round, every node joins its GPUs
  // as ranks node * local + i in one group call.
  const int node = nodes->rank(), world = local * nodes->nodes();
  ncclUniqueId id;
  std::vector<uint8_t> bytes(sizeof(id));
  if (node == 0) {
    check(ncclGetUniqueId(&id), "ncclGetUniqueId");
    std::memcpy(bytes.data(), &id, sizeof(id));
  }
  bytes = nodes->broadcast(bytes);
  if (bytes.size() != sizeof(id)) throw std::runtime_error("distributed: the NCCL id from node 0 has the wrong size");
  std::memcpy(&id, bytes.data(), sizeof(id));
  check(ncclGroupStart(), "ncclGroupStart");
  for (int i = 0; i < local; ++i) {
    c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(devices[i]));
    check(ncclCommInitRank(&impl_->comms[i], world, id, node * local + i),
          "ncclCommInitRank (rank " + std::to_string(node * local + i) + " of " + std::to_string(world) + ", GPU " +
              std::to_string(devices[i]) + ")");
  }
  check(ncclGroupEnd(), "ncclGroupEnd: communicators over GPUs " + list + " of node " + std::to_string(node));
}

NcclGradients::~NcclGradients() {
  for (ncclComm_t c : impl_->comms) {
    if (c) ncclCommDestroy(c);
  }
}

void NcclGradients::abort() {
  // An enqueue that never returns (a wedged proxy) must not keep the abort from happening.
  std::unique_lock lock(impl_->mutex, std::defer_lock);
  const bool locked = lock.try_lock_for(std::chrono::seconds(5));
  if (impl_->aborted) return;
  impl_->aborted = true;
  for (ncclComm_t& c : impl_->comms) {
    if (c) ncclCommAbort(c);
    c = nullptr;
  }
  (void)locked;
}

void NcclGradients::sum(int replica, std::vector<at::Tensor>& tensors) {
  if (tensors.empty()) return;
  const int device = impl_->devices[replica];
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  // One fp32 buffer: a single all-reduce, and bf16 gradients summed without bf16 rounding.
  std::vector<at::Tensor> flat;
  for (const at::Tensor& t : tensors) flat.push_back(t.reshape({-1}).to(at::kFloat));
  at::Tensor buffer = at::cat(flat);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
  std::shared_lock lock(impl_->mutex);
  if (impl_->aborted) throw std::runtime_error("gradient all-reduce on GPU " + std::to_string(device) + ": the run was aborted");
  check(ncclAllReduce(buffer.data_ptr(), buffer.data_ptr(), static_cast<size_t>(buffer.numel()), ncclFloat, ncclSum,
                      impl_->comms[replica], stream),
        "gradient all-reduce on GPU " + std::to_string(device));
  int64_t offset = 0;
  for (at::Tensor& t : tensors) {
    const int64_t n = t.numel();
    t = buffer.narrow(0, offset, n).view(t.sizes()).to(t.scalar_type());
    offset += n;
  }
}
#else
struct NcclGradients::Impl {};
bool NcclGradients::available() { return false; }
NcclGradients::NcclGradients(const std::vector<int>&, NodeGroup*) {
  throw std::runtime_error("this dflashd was built without NCCL: data-parallel GPU replicas need it");
}
NcclGradients::~NcclGradients() = default;
void NcclGradients::sum(int, std::vector<at::Tensor>&) {}
void NcclGradients::abort() {}
#endif

}  // namespace dflash::pipeline
