// machine.h: what this machine offers dflashd (torch, CUDA, GPUs, NCCL, peer access, the SDPA
// backend torch would pick, whether our compiled kernels run here). Used by `dflashd doctor`,
// by config checks (GPU ids exist) and for the build-info metric.
//
// Never throws and never crashes on a machine without GPUs or without a driver: what cannot be
// found is reported as such in the facts.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace dflash::daemon {

struct GpuFacts {
  int index = 0;
  std::string name;
  int compute_major = 0, compute_minor = 0;
  int multiprocessors = 0;
  int64_t total_bytes = 0, free_bytes = 0;
  std::string kernel_probe;  // "ok", or why dflashd's compiled kernels cannot run on it
  // The GatedDeltaNet kernels on this GPU: "ok (self-test ...)" after a small run against the
  // reference path, or why the target's linear-attention layers would run the reference path.
  std::string gdn_kernels;
  // The block-scaled FP8 GEMM (target.dtype: float8) on this GPU: "ok (self-test ...)" after a
  // small product against the CPU emulation, or why FP8 projections would be emulated.
  std::string fp8_gemm;
  // The FP8 grouped GEMM (FP8 MoE experts) on this GPU: "ok (self-test ...)" after a small grouped
  // product against the CPU emulation, or why FP8 experts would be dequantized per layer.
  std::string fp8_grouped;
};

struct MachineFacts {
  std::string dflashd_version;
  std::string torch_version;
  bool torch_cuda_build = false;  // the linked libtorch has CUDA
  bool cuda_kernels_built = false;  // this binary carries dflashd's CUDA kernels
  std::string cuda_runtime_version;  // "13.0", or "" without CUDA
  std::string cuda_driver_version;
  std::string cudnn_version;
  std::string nccl_version;
  int cuda_devices = 0;
  std::string cuda_unavailable_reason;  // why cuda_devices is 0, if it is
  std::vector<GpuFacts> gpus;
  std::vector<std::vector<int>> peer_access;  // [from][to] 1 = direct peer copies possible
  std::string sdpa_backend;  // what at::scaled_dot_product_attention would run for bf16 GQA
};

// Cheap facts only (versions, device count): no CUDA context is created.
MachineFacts probe_basic();
// Everything doctor prints: creates a CUDA context on each GPU, launches the probe kernel.
MachineFacts probe_full();
std::string format_report(const MachineFacts& facts);

}  // namespace dflash::daemon
