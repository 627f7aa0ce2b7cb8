// stream_gemm.h: the target's bf16 projections at a decoding step's rows (at most 128), y [m, n]
// = x [m, k] . W^T with W [n, k] row-major, as a stream-K GEMM of our own (kernels in
// stream_gemm.cu, pieces in stream_gemm/): TMA streams W through a ring of shared-memory stages,
// two wgmma warpgroups multiply, and every SM takes the same number of W's k-blocks, the tiles
// it shares with its neighbours summed through a workspace (stream_gemm/schedule.h).
//
// Why: at 128 rows the product is bound by W's bytes. Where cuBLASLt splits a long reduction it
// runs a second kernel to sum the splits and leaves a partial wave; here every SM streams the
// same share of W and the shares of a tile are summed in the same kernel (preferred() says where
// that measured faster). No torch headers here.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace dflash::stream_gemm {

inline constexpr int64_t kMaxRows = 128;

// glu_inner 0: y = x . W^T. glu_inner I > 0: W is a SwiGLU's stacked [gate; up] ([2I, k], n = 2I)
// and y [m, I] = silu(x . gate^T) * (x . up^T), each product rounded to bf16 first and the rest
// rounded as silu_mul rounds it; the tiles then pair 64 gate rows with the same 64 up rows, so the
// product's output never goes to memory. (The products' fp32 sums may be split among CTAs at
// other k-blocks than the plain product's, so the last bits may differ from silu_mul of it.)
struct Problem {
  const void* x;         // bf16 [m, k], rows x_stride elements apart, 16-byte aligned
  int64_t x_stride;      // a multiple of 8, >= k
  const void* w;         // bf16 [n, k] contiguous, 16-byte aligned; weights: the kernel starts
                         // reading them before the previous kernel on the stream has finished
                         // (launch.h), so no kernel still running may write them
  void* y;               // bf16 [m, n] (or [m, glu_inner]) contiguous
  int64_t m, n, k;
  int64_t glu_inner = 0;
};

// Whether the kernels were built for this GPU (sm_90a, compute capability 9.0), no test or bench
// forced cuBLASLt (force_mma_sync(MmaKernels::projections), kernel_variants.h), and they take the
// problem: 1 <= m <= 128, k a multiple of 8, n < 2^31 (n = 2 glu_inner for a SwiGLU), x and W
// aligned as above (y is not looked at: run checks it).
bool applies(const Problem& p, int device);

// Whether the target's projections take the stream-K GEMM for this problem where it applies:
// W of 64M elements (128 MB) or more. Against cuBLASLt's heuristic at 1-128 rows
// (bench/RESULTS.md, session 23): the long reduction of down_proj 1.02-1.11x (cuBLASLt splits k
// and sums the splits in a second kernel), gate_up 1.00-1.06x, GatedDeltaNet in_proj
// 0.99-1.02x, attention qkv 0.96-1.05x; on the smallest products, out_proj and o_proj (31M
// elements), 0.86-0.91x: the tail of summing a tile's shares is not amortised there.
inline bool preferred(const Problem& p) { return p.n * p.k >= (int64_t{1} << 26); }

// Bytes of workspace one stream needs on `device`; zero it once before its first use. Each run
// leaves it as it found it (every flag down), so a stream reuses it without clearing.
size_t workspace_bytes(int device);

// Runs the product on `stream`. `workspace` belongs to that stream (workspace_bytes, zeroed).
void run(const Problem& p, void* workspace, int device, cudaStream_t stream);

}  // namespace dflash::stream_gemm
