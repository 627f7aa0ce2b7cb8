// tensor_map.h: the host side the TMA kernels share (stream_gemm.cu, grouped_fp8.cu): what a
// device is, and tensor maps of row-major matrices read in 128-byte swizzled boxes. No torch here.
#pragma once

#include <cuda.h>

#include <cstdint>
#include <string>

namespace dflash::tensor_map {

struct DeviceFacts {
  bool hopper = false;  // compute capability 9.0 (the sm_90a kernels run)
  int sms = 0;
};
// Asked of the driver once per device (0..63; others are refused with their number).
const DeviceFacts& device_facts(int device);

// Whether p is aligned as TMA needs a tensor's base address (16 bytes).
inline bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// A row-major [rows, columns] matrix of `element_bytes`-wide elements (`type`), rows `stride`
// elements apart, read in boxes of box_rows rows x 128 bytes in the 128-byte swizzle (the layout
// wgmma's K-major operands read). Rows and columns outside the matrix land as zeros. A map the
// driver refuses throws with `what` and the shape.
CUtensorMap swizzled_rows(const void* base, CUtensorMapDataType type, int element_bytes, int64_t rows,
                          int64_t columns, int64_t stride, int box_rows, const std::string& what);

}  // namespace dflash::tensor_map
