#include "daemon/machine.h"

#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <ATen/ops/_fused_sdp_choice.h>
#include <ATen/ops/randn.h>
#include <torch/headeronly/version.h>

#include <sstream>

#ifdef DFLASHD_WITH_CUDA
#include <cuda_runtime.h>

#include "daemon/kernel_probe.h"

#include <cmath>
#include <cstdio>
#include <functional>

#include "target/fp8.h"
#include "target/gdn_cuda.h"
#endif
#ifdef DFLASHD_WITH_NCCL
#include <nccl.h>
#endif

#include "common/log.h"

namespace dflash::daemon {
namespace {

std::string dotted_version(long v, long major_div, long minor_div) {
  if (v <= 0) return "";
  return std::to_string(v / major_div) + "." + std::to_string((v % major_div) / minor_div);
}

// Names of sdp::SDPBackend as returned by at::_fused_sdp_choice.
std::string sdpa_backend_name(int64_t choice) {
  switch (choice) {
    case 0: return "math";
    case 1: return "flash_attention";
    case 2: return "efficient_attention";
    case 3: return "cudnn_attention";
    case 4: return "overrideable";
    default: return "none (error " + std::to_string(choice) + ")";
  }
}

std::string probe_sdpa(bool cuda) {
  try {
    // The drafter's shape class: GQA 32 query / 8 key-value heads of 128, bf16 on a GPU.
    const auto options = cuda ? at::TensorOptions().device(at::kCUDA, 0).dtype(at::kBFloat16)
                              : at::TensorOptions().dtype(at::kFloat);
    const at::Tensor q = at::randn({1, 32, 256, 128}, options);
    const at::Tensor kv = at::randn({1, 8, 256, 128}, options);
    return sdpa_backend_name(at::_fused_sdp_choice(q, kv, kv, {}, 0.0, false, std::nullopt, true)) +
           (cuda ? " (bf16, GQA 32/8 x 128, cuda:0)" : " (fp32, GQA 32/8 x 128, cpu)");
  } catch (const std::exception& e) {
    return std::string("probe failed: ") + e.what();
  }
}

}  // namespace

MachineFacts probe_basic() {
  MachineFacts f;
  f.dflashd_version = DFLASHD_VERSION;
  f.torch_version = TORCH_VERSION;
  const auto& hooks = at::detail::getCUDAHooks();
  f.torch_cuda_build = hooks.isBuilt();
#ifdef DFLASHD_WITH_CUDA
  f.cuda_kernels_built = true;
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  f.cuda_runtime_version = dotted_version(runtime, 1000, 10);
  if (cudaDriverGetVersion(&driver) == cudaSuccess && driver > 0) {
    f.cuda_driver_version = dotted_version(driver, 1000, 10);
  }
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    f.cuda_unavailable_reason = std::string(cudaGetErrorName(error)) + ": " + cudaGetErrorString(error);
    count = 0;
    cudaGetLastError();  // clear the sticky error for later callers
  }
  f.cuda_devices = count;
  if (count == 0 && f.cuda_unavailable_reason.empty()) f.cuda_unavailable_reason = "no CUDA device";
#else
  f.cuda_devices = hooks.isBuilt() && hooks.hasCUDA() ? hooks.deviceCount() : 0;
  if (f.cuda_devices == 0) {
    f.cuda_unavailable_reason = hooks.isBuilt() ? "no CUDA device" : "libtorch built without CUDA";
  }
#endif
  if (f.torch_cuda_build && f.cuda_devices > 0) {
    f.cudnn_version = dotted_version(hooks.versionCuDNN(), 10000, 100);
  }
#ifdef DFLASHD_WITH_NCCL
  int nccl = 0;
  if (ncclGetVersion(&nccl) == ncclSuccess) {
    f.nccl_version = std::to_string(nccl / 10000) + "." + std::to_string((nccl % 10000) / 100) + "." +
                     std::to_string(nccl % 100);
  }
#endif
  return f;
}

#ifdef DFLASHD_WITH_CUDA
// A kernel's self-test against its reference: "ok" or "WRONG" (relative error above 1e-2 or not
// finite) with the error, or "failed: " and why it threw.
std::string self_test(const std::function<double()>& relative_error) {
  try {
    const double error = relative_error();
    char text[96];
    std::snprintf(text, sizeof(text), "%s (self-test relative error %.1e)", std::isfinite(error) && error <= 1e-2 ? "ok" : "WRONG", error);
    return text;
  } catch (const std::exception& e) {
    return std::string("failed: ") + e.what();
  }
}

// The GatedDeltaNet kernels at the real head size on GPU `index`: whether they can run, and a
// small packed run (3 sequences, 2 key / 4 value heads) against the reference path.
std::string probe_gdn_kernels(int index) {
  target::ModelConfig c;
  c.linear_key_head_dim = c.linear_value_head_dim = 128;
  c.linear_num_key_heads = 2, c.linear_num_value_heads = 4;  // the self-test's heads
  c.linear_conv_kernel_dim = 4;
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  if (auto why = target::gdn_kernels_unavailable(c, device, at::kBFloat16)) return "reference path only: " + *why;
  return self_test([&] {
    return target::gdn_kernel_error(target::random_gdn_inputs({70, 1, 129}, 2, 4, 1.0, device), 2, 4);
  });
}

// The block-scaled FP8 GEMM on GPU `index`: whether it runs there, and a 64 x 512 -> 256 product
// against the CPU emulation (cuBLASLt has returned garbage at some shapes: target/fp8.h).
std::string probe_fp8_gemm(int index) {
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  if (auto why = target::fp8_gemm_unavailable(device)) return "emulated only: " + *why;
  return self_test([&] { return target::fp8_gemm_error(device); });
}

// The FP8 grouped GEMM (FP8 MoE experts) on GPU `index`: whether it runs there (sm_90a), and a
// small grouped product against the CPU emulation.
std::string probe_fp8_grouped(int index) {
  const at::Device device(at::kCUDA, static_cast<c10::DeviceIndex>(index));
  if (auto why = target::fp8_grouped_gemm_unavailable(device)) return "FP8 experts dequantized per layer: " + *why;
  return self_test([&] { return target::fp8_grouped_gemm_error(device); });
}
#endif

MachineFacts probe_full() {
  MachineFacts f = probe_basic();
#ifdef DFLASHD_WITH_CUDA
  for (int i = 0; i < f.cuda_devices; ++i) {
    GpuFacts g;
    g.index = i;
    cudaDeviceProp props{};
    if (cudaGetDeviceProperties(&props, i) == cudaSuccess) {
      g.name = props.name;
      g.compute_major = props.major;
      g.compute_minor = props.minor;
      g.multiprocessors = props.multiProcessorCount;
    }
    size_t free_bytes = 0, total_bytes = 0;
    cudaSetDevice(i);
    if (cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess) {
      g.free_bytes = static_cast<int64_t>(free_bytes);
      g.total_bytes = static_cast<int64_t>(total_bytes);
    }
    g.kernel_probe = probe_kernels(i);
    g.gdn_kernels = probe_gdn_kernels(i);
    g.fp8_gemm = probe_fp8_gemm(i);
    g.fp8_grouped = probe_fp8_grouped(i);
    f.gpus.push_back(g);
  }
  f.peer_access.assign(f.cuda_devices, std::vector<int>(f.cuda_devices, 0));
  for (int a = 0; a < f.cuda_devices; ++a) {
    for (int b = 0; b < f.cuda_devices; ++b) {
      int can = a == b ? 1 : 0;
      if (a != b) cudaDeviceCanAccessPeer(&can, a, b);
      f.peer_access[a][b] = can;
    }
  }
#endif
  f.sdpa_backend = probe_sdpa(f.torch_cuda_build && f.cuda_devices > 0);
  return f;
}

std::string format_report(const MachineFacts& f) {
  std::ostringstream out;
  auto or_none = [](const std::string& s) { return s.empty() ? std::string("-") : s; };
  out << "dflashd " << f.dflashd_version << "\n"
      << "torch            " << f.torch_version << (f.torch_cuda_build ? " (CUDA build)" : " (CPU build)") << "\n"
      << "dflashd kernels  " << (f.cuda_kernels_built ? "CUDA kernels compiled in" : "CPU only (built without CUDA)")
      << "\n"
      << "CUDA runtime     " << or_none(f.cuda_runtime_version) << "\n"
      << "CUDA driver      " << or_none(f.cuda_driver_version) << "\n"
      << "cuDNN            " << or_none(f.cudnn_version) << "\n"
      << "NCCL             " << or_none(f.nccl_version) << "\n"
      << "GPUs             " << f.cuda_devices;
  if (f.cuda_devices == 0) out << " (" << f.cuda_unavailable_reason << ")";
  out << "\n";
  for (const GpuFacts& g : f.gpus) {
    out << "  cuda:" << g.index << "  " << g.name << "  sm_" << g.compute_major << g.compute_minor << "  "
        << g.multiprocessors << " SMs  " << (g.free_bytes >> 20) << " / " << (g.total_bytes >> 20)
        << " MiB free  kernels: " << g.kernel_probe << "\n"
        << "          GatedDeltaNet: " << g.gdn_kernels << "\n"
        << "          FP8 GEMM: " << g.fp8_gemm << "\n"
        << "          FP8 grouped GEMM (MoE experts): " << g.fp8_grouped << "\n";
  }
  if (f.peer_access.size() > 1) {
    out << "peer access (row = from)\n";
    for (size_t a = 0; a < f.peer_access.size(); ++a) {
      out << "  cuda:" << a << " ";
      for (int can : f.peer_access[a]) out << (can ? " yes" : "  no");
      out << "\n";
    }
  }
  out << "SDPA backend     " << or_none(f.sdpa_backend) << "\n";
  return out.str();
}

}  // namespace dflash::daemon
