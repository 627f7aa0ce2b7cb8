// The FP8 grouped GEMM (grouped_fp8.h): the kernel composed from its pieces (grouped_fp8/: the
// schedule, the TMA + wgmma mainloop, the epilogue) and its host side (tensor maps, launch).
#include "target/kernels/grouped_fp8.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "target/kernels/grouped_fp8/epilogue.cuh"
#include "target/kernels/grouped_fp8/mainloop.cuh"
#include "target/kernels/grouped_fp8/schedule.h"
#include "target/kernels/tensor_map.h"

namespace dflash::grouped_fp8 {
namespace {

constexpr int kThreads = 128 + kConsumerThreads;  // a producer warpgroup and two consumers
constexpr size_t kSharedBytes = sizeof(Shared) + 1024;  // + the alignment of the ring
static_assert(kSharedBytes <= 227 * 1024, "the FP8 grouped GEMM's shared memory exceeds an H200 CTA's");

// The kernel's roles: thread 0 produces; warps 1-3 write the tiles out (`drain`); the consumer
// warpgroups multiply (`consume`, given the consumer thread's index 0..255). The producer
// warpgroup gives registers up to the consumers.
template <typename Produce, typename Drain, typename Consume>
__device__ __forceinline__ void warp_roles(Produce&& produce, Drain&& drain, Consume&& consume) {
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) produce();
    if (threadIdx.x >= 32) drain();
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  consume(static_cast<int>(threadIdx.x) - 128);
}

// Warpgroup 0 produces (thread 0) and writes the tiles out (warps 1-3, while the consumers go on:
// epilogue.cuh), warpgroups 1 and 2 consume; every CTA walks the same tile numbering
// (schedule.h), each from its own index.
__global__ void __launch_bounds__(kThreads, 1)
    grouped_fp8_kernel(const __grid_constant__ XMaps x_maps, const __grid_constant__ CUtensorMap w_map,
                       const Problem p) {
#ifdef DFLASHD_WGMMA
  extern __shared__ unsigned char raw[];
  auto& s = mma_tile::aligned_shared<Shared>(raw);
  if (threadIdx.x == 0) {
    s.ring.init();
    barriers::TransactionBarrier::fence_init();
    for (int box = 0; box < kXBoxes; ++box) tma::prefetch_map(&x_maps.box[box]);
    tma::prefetch_map(&w_map);
  }
  const Walk walk = count_tiles(s, p);  // synchronises the CTA (the barriers' set-up too)
  const int k_blocks = static_cast<int>(p.k / kBlockK);
  auto* y = static_cast<__nv_bfloat16*>(p.y);
  warp_roles(
      [&] { produce(s.ring, x_maps, &w_map, walk, static_cast<int>(p.n), k_blocks); },
      [&] { drain_tiles(s.out, walk, y, p.n); },
      [&](int ct) {
        smem_ring::Position at;
        Accumulators acc;
        int done = 0;
        for (int64_t t = blockIdx.x; t < walk.tiles; t += gridDim.x, ++done) {
          const Tile tile = walk.at(t);
          consume_tile(s.ring, acc, at, tile, p, k_blocks, ct);
          hand_over_tile(acc, s.out, done, ct);
        }
      });
#else
  __trap();
#endif
}

void run_grouped(const Problem& p, int device, cudaStream_t stream) {
  static std::array<std::once_flag, 64> once;  // the attribute is set per device
  std::call_once(once[device], [] {
    allow_shared_memory(grouped_fp8_kernel, kSharedBytes, "FP8 grouped GEMM kernel");
  });
  XMaps x_maps;
  for (int box = 0; box < kXBoxes; ++box) {
    x_maps.box[box] = tensor_map::swizzled_rows(p.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.m, p.k, p.x_stride,
                                                x_box_rows(box), "FP8 grouped GEMM: x");
  }
  const CUtensorMap w_map = tensor_map::swizzled_rows(p.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.groups * p.n, p.k,
                                                      p.k, kTileCols, "FP8 grouped GEMM: W");
  // Every group adds at most one partial m-tile: more CTAs than this would find no tile.
  const int64_t most_tiles = ((p.m + kTileRows - 1) / kTileRows + p.groups) * n_tiles_of(p.n);
  const int64_t ctas = std::min<int64_t>(tensor_map::device_facts(device).sms, most_tiles);
  grouped_fp8_kernel<<<static_cast<unsigned>(ctas), kThreads, kSharedBytes, stream>>>(x_maps, w_map, p);
  check_cuda(cudaGetLastError(), "FP8 grouped GEMM kernel");
}

using tensor_map::aligned;

}  // namespace

bool built_for(int device) {
#ifdef DFLASHD_CUDA_SM90A
  return tensor_map::device_facts(device).hopper;
#else
  (void)device;
  return false;
#endif
}

bool weights_apply(int64_t groups, int64_t n, int64_t k, const void* w, int device) {
  const bool shape = n > 0 && n % 8 == 0 && k > 0 && k % kBlockK == 0 && groups >= 1 && groups <= kMaxGroups &&
                     groups * n < (int64_t{1} << 31);
  return shape && aligned(w) && !off.load() && built_for(device);
}

bool applies(const Problem& p, int device) {
  const bool rest = p.m >= 0 && p.m < (int64_t{1} << 31) && (p.ends != nullptr || p.groups == 1) &&
                    p.x_stride % 16 == 0 && p.x_stride >= p.k && p.factor_stride >= p.m && aligned(p.x) &&
                    aligned(p.y);
  return rest && weights_apply(p.groups, p.n, p.k, p.w, device);
}

void run(const Problem& p, int device, cudaStream_t stream) {
  if (!applies(p, device)) {
    throw std::invalid_argument("FP8 grouped GEMM: " + std::to_string(p.groups) + " groups of [" + std::to_string(p.m) +
                                " rows, " + std::to_string(p.k) + "] -> " + std::to_string(p.n) +
                                " does not run on device " + std::to_string(device) +
                                " (sm_90a, n a multiple of 8, k of 128, 16-byte aligned operands)");
  }
  if (p.m == 0) return;
  run_grouped(p, device, stream);
}

}  // namespace dflash::grouped_fp8
