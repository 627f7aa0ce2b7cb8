// The stream-K GEMM (stream_gemm.h): the kernel composed from its pieces (stream_gemm/: the
// schedule, the TMA + wgmma mainloop, the epilogue) and its host side (tensor maps, launch).
#include "target/kernels/stream_gemm.h"

#include <array>
#include <mutex>
#include <stdexcept>
#include <string>

#include "common/cuda_check.h"
#include "common/launch.h"
#include "target/kernels/stream_gemm/epilogue.cuh"
#include "target/kernels/stream_gemm/mainloop.cuh"
#include "target/kernels/stream_gemm/schedule.h"
#include "target/kernels/tensor_map.h"

namespace dflash::stream_gemm {
namespace {

constexpr int kThreads = 128 + kConsumerThreads;  // a producer warpgroup and two consumers

// Stages per ring, as measured fastest (bench/RESULTS.md, session 23): 6 of W (96 KB in flight
// per SM streamed W at 4.1 TB/s without products; deeper rings were no faster), 4-5 of x (3
// starved the products at 128 rows).
template <int kTokens>
inline constexpr int kWStages = 6;
template <int kTokens>
inline constexpr int kXStages = kTokens == 128 ? 5 : 4;
template <int kTokens>
using SharedFor = Shared<kTokens, kWStages<kTokens>, kXStages<kTokens>>;

// The rows of x's box: the product's, rounded up to whole 8-row swizzle groups. The rows of a
// stage beyond them hold whatever was there; they only reach the tokens' columns that are never
// stored (each column of y^T depends on its own row of x). Boxes past the tensor's rows cost time
// filling zeros.
__host__ __device__ constexpr int x_box_rows(int m) { return (m + 7) / 8 * 8; }

template <int kTokens>
constexpr size_t shared_bytes() {
  return sizeof(SharedFor<kTokens>) + 1024;  // + the alignment of the rings
}

// Warpgroup 0 produces (thread 0 W, thread 32 x), warpgroups 1 and 2 consume. The kernel is a
// programmatic dependent of the stream's previous kernel (launch.h), which may still be writing
// x or reading memory that y or the workspace reuse: W, which no kernel writes, streams at once;
// x and every write wait for that kernel.
template <int kTokens>
__global__ void __launch_bounds__(kThreads, 1)
    stream_gemm_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                       Schedule schedule, Output out) {
#ifdef DFLASHD_WGMMA
  extern __shared__ unsigned char raw[];
  auto& shared = mma_tile::aligned_shared<SharedFor<kTokens>>(raw);
  if (threadIdx.x == 0) {
    shared.w.init();
    shared.x.init();
    barriers::TransactionBarrier::fence_init();
    tma::prefetch_map(&w_map);
    tma::prefetch_map(&x_map);
  }
  __syncthreads();
  barriers::dependents_may_launch();
  const int cta = static_cast<int>(blockIdx.x);
  const int64_t begin = schedule.begin(cta), end = schedule.begin(cta + 1);
  const int warpgroup = static_cast<int>(threadIdx.x) / 128;
  if (warpgroup == 0) {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (threadIdx.x == 0) {
      const BoxRows rows{kRowsPerTile, out.glu_inner > 0 ? out.glu_inner : -1};
      produce(shared.w, &w_map, schedule, begin, end, rows, kRowsPerTile * kBlockK * 2, tma::evict_first());
    }
    if (threadIdx.x == 32) {
      barriers::wait_for_prerequisite();
      produce(shared.x, &x_map, schedule, begin, end, BoxRows{}, x_box_rows(out.m) * kBlockK * 2, tma::evict_last());
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
  barriers::wait_for_prerequisite();
  const int ct = static_cast<int>(threadIdx.x) - 128;
  ConsumerPosition at;
  Accumulators<kTokens> acc;
  for (int64_t u = begin; u < end;) {
    const Segment g = schedule.segment(u, end);
    consume_segment(shared, acc, at, g.k_end - g.k_begin, warpgroup - 1);
    finish_segment(acc, g, schedule, out, &shared.out[0][0], cta, ct);
    u += g.k_end - g.k_begin;
  }
#else
  __trap();
#endif
}

// ---- host --------------------------------------------------------------------------------------

// A bf16 [rows, columns] matrix, rows `stride` elements apart, read in boxes of box_rows x 64
// columns (128 bytes).
CUtensorMap bf16_map(const void* base, int64_t rows, int64_t columns, int64_t stride, int box_rows,
                     const char* what) {
  return tensor_map::swizzled_rows(base, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, rows, columns, stride, box_rows,
                                   std::string("stream GEMM: ") + what);
}

template <int kTokens>
void launch(const Problem& p, void* workspace, int device, cudaStream_t stream) {
  static std::array<std::once_flag, 64> once;  // the attribute is set per device
  std::call_once(once[device], [] {
    allow_shared_memory(stream_gemm_kernel<kTokens>, shared_bytes<kTokens>(), "stream GEMM kernel");
  });
  const bool glu = p.glu_inner > 0;
  const CUtensorMap w_map = bf16_map(p.w, p.n, p.k, p.k, glu ? kRowsPerTile / 2 : kRowsPerTile, "W");
  const CUtensorMap x_map = bf16_map(p.x, p.m, p.k, p.x_stride, x_box_rows(static_cast<int>(p.m)), "x");
  // A SwiGLU's tile is 64 features' gate and up rows: as many tiles as a product of 2 I rounded.
  const int64_t glu_rows = 2 * ((p.glu_inner + kRowsPerTile / 2 - 1) / (kRowsPerTile / 2) * (kRowsPerTile / 2));
  const Schedule schedule = Schedule::make(glu ? glu_rows : p.n, p.k, tensor_map::device_facts(device).sms);
  int* flags = static_cast<int*>(workspace);
  const Output out{static_cast<__nv_bfloat16*>(p.y), static_cast<int>(p.m), static_cast<int>(p.n),
                   static_cast<int>(p.glu_inner), flags, reinterpret_cast<float*>(flags + kFlagInts)};
  check_cuda(launch_dependent(stream_gemm_kernel<kTokens>, dim3(schedule.ctas), kThreads, shared_bytes<kTokens>(),
                              stream, w_map, x_map, schedule, out),
             "stream GEMM kernel");
}

using tensor_map::aligned;

}  // namespace

bool applies(const Problem& p, int device) {
#ifdef DFLASHD_CUDA_SM90A
  const bool shape = p.m >= 1 && p.m <= kMaxRows && p.k % 8 == 0 && p.k > 0 && p.n > 0 && p.n < (int64_t{1} << 31) &&
                     p.glu_inner >= 0 && (p.glu_inner == 0 || p.n == 2 * p.glu_inner);
  const bool layout = p.x_stride % 8 == 0 && p.x_stride >= p.k && aligned(p.x) && aligned(p.w);
  return tensor_map::device_facts(device).hopper && !mma_sync_forced(MmaKernels::projections) && shape && layout;
#else
  (void)p;
  (void)device;
  return false;
#endif
}

size_t workspace_bytes(int device) {
  const int sms = tensor_map::device_facts(device).sms;
  if (sms > kFlagInts) throw std::runtime_error("stream GEMM: more SMs than flags: " + std::to_string(sms));
  return kFlagInts * sizeof(int) + static_cast<size_t>(sms) * kSlotFloats<kMaxRows> * sizeof(float);
}

void run(const Problem& p, void* workspace, int device, cudaStream_t stream) {
  if (!applies(p, device) || !aligned(p.y)) {
    throw std::invalid_argument("stream GEMM: " + std::to_string(p.m) + " x " + std::to_string(p.k) + " -> " +
                                std::to_string(p.n) + " does not run on device " + std::to_string(device));
  }
  if (p.m <= 64) {
    launch<64>(p, workspace, device, stream);
  } else {
    launch<128>(p, workspace, device, stream);
  }
}

}  // namespace dflash::stream_gemm
