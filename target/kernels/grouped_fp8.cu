// The FP8 grouped GEMM (grouped_fp8.h): the kernel composed from its pieces (grouped_fp8/: the
// schedule, the TMA + wgmma mainloop, the epilogue) and its host side (tensor maps, launch).
#include "target/kernels/grouped_fp8.h"

#include <algorithm>
#include <array>
#include <mutex>
#include <stdexcept>
#include <string>
#include <type_traits>

#include "common/cuda_check.h"
#include "target/kernels/grouped_fp8/epilogue.cuh"
#include "target/kernels/grouped_fp8/mainloop.cuh"
#include "target/kernels/grouped_fp8/schedule.h"
#include "target/kernels/grouped_fp8/swiglu_epilogue.cuh"
#include "target/kernels/tensor_map.h"

namespace dflash::grouped_fp8 {
namespace {

constexpr int kThreads = 128 + kConsumerThreads;  // a producer warpgroup and two consumers
constexpr size_t kSharedBytes = sizeof(Shared) + 1024;  // + the alignment of the ring
constexpr size_t kDenseSharedBytes = sizeof(DenseShared) + 1024;
template <bool kWarpEpilogue>
constexpr size_t kSwigluSharedBytes = sizeof(std::conditional_t<kWarpEpilogue, SwigluWarpShared, SwigluShared>) + 1024;
static_assert(kSharedBytes <= 227 * 1024, "the FP8 grouped GEMM's shared memory exceeds an H200 CTA's");
static_assert(kDenseSharedBytes <= 227 * 1024, "the dense FP8 GEMM's shared memory exceeds an H200 CTA's");
static_assert(kSwigluSharedBytes<false> <= 227 * 1024 && kSwigluSharedBytes<true> <= 227 * 1024,
              "the FP8 SwiGLU GEMM's shared memory exceeds an H200 CTA's");

// The start of the kernels in clusters of two (dense, SwiGLU): thread 0 sets up the ring's
// barriers (and, by `more`, any others), makes them visible to the cluster and fetches the tensor
// maps' descriptors; then every thread of both CTAs meets, so that neither CTA multicasts into,
// releases a stage to or sends to barriers the other has not set up.
template <typename SharedT, typename More>
__device__ __forceinline__ void set_up_cluster(SharedT& s, const CUtensorMap& x_map, const CUtensorMap& w_map,
                                               More&& more) {
  if (threadIdx.x == 0) {
    s.ring.init();
    more();
    barriers::TransactionBarrier::fence_init();
    tma::prefetch_map(&x_map);
    tma::prefetch_map(&w_map);
  }
  barriers::cluster_sync();
}

// The kernels' roles: thread 0 produces; with kWarpEpilogue warps 1-3 write the tiles out
// (`drain`); the consumer warpgroups multiply (`consume`, given the consumer thread's index
// 0..255). The producer warpgroup gives registers up to the consumers. With kCluster (the kernels
// in clusters of two: dense, SwiGLU) every remaining thread of both CTAs ends at a cluster
// barrier: neither CTA leaves while the other may still multicast into it, release a stage to it
// or send to it.
template <bool kWarpEpilogue, bool kCluster, typename Produce, typename Drain, typename Consume>
__device__ __forceinline__ void warp_roles(Produce&& produce, Drain&& drain, Consume&& consume) {
  if (threadIdx.x < 128) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) produce();
    if constexpr (kWarpEpilogue) {
      if (threadIdx.x >= 32) {
        drain();
        if constexpr (kCluster) barriers::cluster_sync();
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  consume(static_cast<int>(threadIdx.x) - 128);
  if constexpr (kCluster) barriers::cluster_sync();
}

// Warpgroup 0 produces (thread 0), warpgroups 1 and 2 consume; every CTA walks the same tile
// numbering (schedule.h), each from its own index. Its tiles are written out by the consumers, or
// with kWarpEpilogue by warps 1-3 of the producer warpgroup while the consumers go on
// (epilogue.cuh), as the dense kernel's.
template <bool kWarpEpilogue>
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
  warp_roles<kWarpEpilogue, false>(
      [&] { produce(s.ring, x_maps, &w_map, walk, static_cast<int>(p.n), k_blocks); },
      [&] {
        auto tile_at = [&](int64_t t) { return walk.at(t); };
        drain_tiles<kTileCols>(s.out, blockIdx.x, walk.tiles, gridDim.x, tile_at, y, p.n);
      },
      [&](int ct) {
        smem_ring::Position at;
        Accumulators<kTileCols> acc;
        int done = 0;
        for (int64_t t = blockIdx.x; t < walk.tiles; t += gridDim.x, ++done) {
          const Tile tile = walk.at(t);
          consume_tile<kTileCols, 1, false>(s.ring, acc, at, tile, one_block(p, tile, k_blocks), p, k_blocks, ct);
          finish_tile<kWarpEpilogue>(acc, s.out, tile, y, p.n, done, ct);
        }
      });
#else
  __trap();
#endif
}

// One dense group (no ends), m above one tile: clusters of two CTAs, each a pair of m-tiles by a
// tile of kDenseCols columns of W, loaded half by each CTA into both (schedule.h's DensePairs).
// Its tiles are written out by the consumers, or with kWarpEpilogue by warps 1-3 of the producer
// warpgroup while the consumers go on (epilogue.cuh); warp_roles says who ends where.
template <bool kWarpEpilogue>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    dense_fp8_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                     const Problem p) {
#ifdef DFLASHD_WGMMA
  extern __shared__ unsigned char raw[];
  auto& s = mma_tile::aligned_shared<DenseShared>(raw);
  const int rank = static_cast<int>(barriers::cluster_rank());
  set_up_cluster(s, x_map, w_map, [] {});
  const DensePairs pairs(p.m, p.n);
  const int k_blocks = static_cast<int>(p.k / kBlockK);
  const int64_t cluster = blockIdx.x / 2, clusters = gridDim.x / 2;
  auto* y = static_cast<__nv_bfloat16*>(p.y);
  warp_roles<kWarpEpilogue, true>(
      [&] { produce_pairs(s.ring, &x_map, &w_map, pairs, cluster, clusters, k_blocks, rank); },
      [&] {
        auto tile_at = [&](int64_t pair) { return pairs.at(pair, rank); };
        drain_tiles<kDenseCols>(s.out, cluster, pairs.count(), clusters, tile_at, y, p.n);
      },
      [&](int ct) {
        smem_ring::Position at;
        Accumulators<kDenseCols> acc;
        int done = 0;
        for (int64_t pair = cluster; pair < pairs.count(); pair += clusters, ++done) {
          const Tile tile = pairs.at(pair, rank);
          consume_tile<kDenseCols, 2, true>(s.ring, acc, at, tile, spanned_blocks<kDenseCols>(p, tile, k_blocks), p,
                                            k_blocks, ct, static_cast<uint32_t>(rank ^ 1));
          finish_tile<kWarpEpilogue>(acc, s.out, tile, y, p.n, done, ct);
        }
      });
#else
  __trap();
#endif
}

// A SwiGLU's gate_up product (W = [gate; up], p.n = 2 inner) with h formed and quantised in the
// epilogue, in clusters of two CTAs along h (schedule.h's SwigluTiles): both CTAs multiply the
// same 128 rows of x, each loading half into both, by their own 64 rows of gate and of up. The
// epilogue runs in the consumers, or with kWarpEpilogue in warps 1-3 of the producer warpgroup
// while the consumers go on (swiglu_epilogue.cuh); the row maxima's exchange is waited for within
// each tile.
template <bool kWarpEpilogue>
__global__ void __cluster_dims__(2, 1, 1) __launch_bounds__(kThreads, 1)
    swiglu_fp8_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                      const Problem p, const SwigluOutput out) {
#ifdef DFLASHD_WGMMA
  using SharedT = std::conditional_t<kWarpEpilogue, SwigluWarpShared, SwigluShared>;
  extern __shared__ unsigned char raw[];
  auto& s = mma_tile::aligned_shared<SharedT>(raw);
  const int rank = static_cast<int>(barriers::cluster_rank());
  set_up_cluster(s, x_map, w_map, [&] {
    for (uint64_t& arrived : s.peer_arrived) barriers::TransactionBarrier{mma_tile::shared_address(&arrived)}.init(1);
  });
  const int inner = static_cast<int>(p.n / 2), k_blocks = static_cast<int>(p.k / kBlockK);
  const SwigluTiles tiles(p.m, inner);
  const int64_t cluster = blockIdx.x / 2, clusters = gridDim.x / 2;
  const uint32_t peer_rank = static_cast<uint32_t>(rank ^ 1);
  const SwigluPeer peer{barriers::peer_address(mma_tile::shared_address(&s.peer_amax[0][0]), peer_rank),
                        barriers::peer_address(mma_tile::shared_address(&s.peer_arrived[0]), peer_rank)};
  warp_roles<kWarpEpilogue, true>(
      [&] { produce_swiglu(s.ring, &x_map, &w_map, tiles, cluster, clusters, k_blocks, rank, inner); },
      [&] {
        if constexpr (kWarpEpilogue) {
          const int warp = static_cast<int>(threadIdx.x / 32) - 1;
          drain_swiglu_tiles(s, tiles, cluster, clusters, out, inner, rank, peer, warp);
        }
      },
      [&](int ct) {
        smem_ring::Position at;
        Accumulators<kTileCols> acc;
        int done = 0;
        for (int64_t index = cluster; index < tiles.count(); index += clusters, ++done) {
          const Tile tile = tiles.at(index);
          consume_tile<kTileCols, 2, true>(s.ring, acc, at, tile, gate_and_up_blocks(p, tile, tiles.h_blocks, k_blocks),
                                           p, k_blocks, ct, peer_rank);
          if constexpr (kWarpEpilogue) {
            hand_over_tile(acc, s.staged, done, ct);
          } else {
            store_swiglu_tile(acc, s, tile, out, inner, rank, done, peer, ct);
          }
        }
      });
#else
  __trap();
#endif
}

// Clusters of kKernel (a kernel of clusters of two, shared_bytes of dynamic shared memory)
// resident at once on `device` (asked once per device), or every SM's pair when the runtime
// cannot say.
template <auto kKernel>
int resident_clusters(size_t shared_bytes, const char* name, int device) {
  static std::array<std::once_flag, 64> once;
  static std::array<int, 64> clusters{};
  std::call_once(once[device], [device, shared_bytes, name] {
    allow_shared_memory(kKernel, shared_bytes, name);
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(2 * 1024);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = shared_bytes;
    int resident = 0;
    if (cudaOccupancyMaxActiveClusters(&resident, kKernel, &config) != cudaSuccess || resident < 1) {
      (void)cudaGetLastError();
      resident = tensor_map::device_facts(device).sms / 2;
    }
    clusters[device] = resident;
  });
  return clusters[device];
}

// kKernel (clusters of two, shared_bytes of dynamic shared memory) on `stream` over `work` items
// (pairs or tiles): a cluster per item up to those resident at once, each walking the items from its
// own index.
template <auto kKernel, typename... Args>
void launch_clusters(size_t shared_bytes, const char* name, int64_t work, int device, cudaStream_t stream,
                     const Args&... args) {
  const int64_t clusters = std::min<int64_t>(resident_clusters<kKernel>(shared_bytes, name, device), work);
  kKernel<<<static_cast<unsigned>(2 * clusters), kThreads, shared_bytes, stream>>>(args...);
  check_cuda(cudaGetLastError(), name);
}

template <bool kWarpEpilogue>
void run_grouped(const Problem& p, int device, cudaStream_t stream) {
  static std::array<std::once_flag, 64> once;  // the attribute is set per device
  std::call_once(once[device], [] {
    allow_shared_memory(grouped_fp8_kernel<kWarpEpilogue>, kSharedBytes, "FP8 grouped GEMM kernel");
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
  grouped_fp8_kernel<kWarpEpilogue><<<static_cast<unsigned>(ctas), kThreads, kSharedBytes, stream>>>(x_maps, w_map, p);
  check_cuda(cudaGetLastError(), "FP8 grouped GEMM kernel");
}

template <bool kWarpEpilogue>
void run_dense(const Problem& p, int device, cudaStream_t stream) {
  const CUtensorMap x_map = tensor_map::swizzled_rows(p.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.m, p.k, p.x_stride,
                                                      kTileRows, "dense FP8 GEMM: x");
  const CUtensorMap w_map = tensor_map::swizzled_rows(p.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.n, p.k, p.k,
                                                      kDenseCols / 2, "dense FP8 GEMM: W");
  launch_clusters<dense_fp8_kernel<kWarpEpilogue>>(kDenseSharedBytes, "dense FP8 GEMM kernel",
                                                   DensePairs(p.m, p.n).count(), device, stream, x_map, w_map, p);
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

void run(const Problem& p, int device, cudaStream_t stream, Epilogue epilogue) {
  if (!applies(p, device)) {
    throw std::invalid_argument("FP8 grouped GEMM: " + std::to_string(p.groups) + " groups of [" + std::to_string(p.m) +
                                " rows, " + std::to_string(p.k) + "] -> " + std::to_string(p.n) +
                                " does not run on device " + std::to_string(device) +
                                " (sm_90a, n a multiple of 8, k of 128, 16-byte aligned operands)");
  }
  if (p.m == 0) return;
  const bool warps = epilogue == Epilogue::epilogue_warps;
  if (p.ends == nullptr && p.m > kTileRows) {
    warps ? run_dense<true>(p, device, stream) : run_dense<false>(p, device, stream);
  } else {
    warps ? run_grouped<true>(p, device, stream) : run_grouped<false>(p, device, stream);
  }
}

bool swiglu_applies(const Problem& p, const SwigluOutput& out, int device) {
  return p.ends == nullptr && p.groups == 1 && p.n % 256 == 0 && out.q != nullptr && aligned(out.q) &&
         out.factors != nullptr && out.factor_stride >= p.m && applies(p, device);
}

void run_swiglu(const Problem& p, const SwigluOutput& out, Epilogue epilogue, int device,
                cudaStream_t stream) {
  if (!swiglu_applies(p, out, device) || epilogue == Epilogue::off) {
    throw std::invalid_argument("FP8 SwiGLU GEMM: [" + std::to_string(p.m) + " rows, " + std::to_string(p.k) +
                                "] -> gate_up of " + std::to_string(p.n) + " rows does not run on device " +
                                std::to_string(device) +
                                " (sm_90a, one group, gate and up whole 128-row blocks, k a multiple of 128, "
                                "16-byte aligned operands, factor_stride >= m, an epilogue chosen)");
  }
  if (p.m == 0) return;
  const CUtensorMap x_map = tensor_map::swizzled_rows(p.x, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.m, p.k, p.x_stride,
                                                      kSwigluHalf, "FP8 SwiGLU GEMM: x");
  const CUtensorMap w_map = tensor_map::swizzled_rows(p.w, CU_TENSOR_MAP_DATA_TYPE_UINT8, 1, p.n, p.k, p.k,
                                                      kSwigluHalf, "FP8 SwiGLU GEMM: W");
  const int64_t tiles = SwigluTiles(p.m, p.n / 2).count();
  if (epilogue == Epilogue::epilogue_warps) {
    launch_clusters<swiglu_fp8_kernel<true>>(kSwigluSharedBytes<true>, "FP8 SwiGLU GEMM kernel", tiles, device,
                                             stream, x_map, w_map, p, out);
  } else {
    launch_clusters<swiglu_fp8_kernel<false>>(kSwigluSharedBytes<false>, "FP8 SwiGLU GEMM kernel", tiles, device,
                                              stream, x_map, w_map, p, out);
  }
}

}  // namespace dflash::grouped_fp8
