#include "target/kernels/tensor_map.h"

#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <array>
#include <mutex>
#include <stdexcept>

#include "common/cuda_check.h"

namespace dflash::tensor_map {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult found{};
    check_cuda(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000, cudaEnableDefault, &found),
               "the driver's cuTensorMapEncodeTiled");
    if (found != cudaDriverEntryPointSuccess || f == nullptr) {
      throw std::runtime_error("the driver has no cuTensorMapEncodeTiled");
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return encode;
}

}  // namespace

const DeviceFacts& device_facts(int device) {
  static std::array<DeviceFacts, 64> all;
  static std::array<std::once_flag, 64> once;
  if (device < 0 || device >= 64) throw std::invalid_argument("TMA kernels: device " + std::to_string(device));
  std::call_once(once[device], [device] {
    int major = 0, minor = 0, sms = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device), "compute capability");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device), "compute capability");
    check_cuda(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count");
    all[device] = {major == 9 && minor == 0, sms};
  });
  return all[device];
}

CUtensorMap swizzled_rows(const void* base, CUtensorMapDataType type, int element_bytes, int64_t rows,
                          int64_t columns, int64_t stride, int box_rows, const std::string& what) {
  CUtensorMap map;
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(columns), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(stride) * element_bytes};
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encode_function()(&map, type, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                                       CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                       CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    throw std::runtime_error("tensor map of " + what + " [" + std::to_string(rows) + ", " + std::to_string(columns) +
                             "] (stride " + std::to_string(stride) + "): CUresult " +
                             std::to_string(static_cast<int>(r)));
  }
  return map;
}

}  // namespace dflash::tensor_map
