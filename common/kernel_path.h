// kernel_path.h: how every layer kind picks its implementation, and the one shape in which the
// choice is reported. The target's GatedDeltaNet and MoE layers and the drafter's block attention
// each have a fast path (compiled kernels, grouped GEMMs) and a slow, portable one; the rule that
// picks between them and refuses a silent slow path on a GPU is fast_path_chosen, and the choice
// is a KernelPath: the startup log line and dflashd_kernel_path{component, path}.
#pragma once

#include <optional>
#include <stdexcept>
#include <string>

namespace dflash {

// What the configuration asks for: the fast path where it can run (automatic), the fast path or
// a refusal (fast), or the slow path (slow).
enum class PathRequest { automatic, fast, slow };

struct KernelPath {
  std::string component;  // "target.full_attention", "target.linear_attention", "target.moe", "drafter.attention"
  std::string path;       // short name, the metric's label: "kernels", "grouped", "sdpa", "reference", "efficient", "math"
  std::string detail;     // what runs and, where the fast path does not, why
  std::string str() const { return component + ": " + path + (detail.empty() ? "" : " (" + detail + ")"); }
};

// A slow path the configuration does not allow; the message names the layer, the device, why the
// fast path cannot run, what the slow one costs and the fix.
class SlowPathRefused : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct PathRule {
  std::string where;                            // "target layer 3 (linear_attention) on cuda:0"
  PathRequest request = PathRequest::automatic;
  std::optional<std::string> fast_unavailable;  // why the fast path cannot run here; nullopt: it can
  bool on_gpu = false;
  bool slow_allowed = false;  // the user accepted the slow path on a GPU (e.g. target.allow_slow_path)
  std::string fast_path;      // "the CUDA kernels"
  std::string slow_path;      // "the reference path (libtorch ops)"
  std::string slow_cost;      // "about 10x slower than the CUDA kernels"
  std::string fix;            // how to accept the slow path, or to make the fast one run
};

// The rule: the fast path unless the slow one was asked for or the fast one cannot run here. The
// slow path is refused when the fast one was demanded, and on a GPU unless the user accepted it.
// Returns whether the fast path runs; throws SlowPathRefused.
inline bool fast_path_chosen(const PathRule& r) {
  if (r.request != PathRequest::slow && !r.fast_unavailable) return true;
  const std::string why = r.request == PathRequest::slow ? "it was asked for" : *r.fast_unavailable;
  if (r.request == PathRequest::fast) {
    throw SlowPathRefused(r.where + ": " + r.fast_path + " were required but cannot run: " + why);
  }
  if (r.on_gpu && !r.slow_allowed) {
    throw SlowPathRefused(r.where + " would run " + r.slow_path + ", " + r.slow_cost + ": " + why + ". " + r.fix);
  }
  return false;
}

}  // namespace dflash
