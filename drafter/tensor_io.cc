#include "drafter/tensor_io.h"

#include <ATen/ATen.h>


#include <stdexcept>

#include "common/safetensors.h"

namespace dflash::drafter {

void write_named_tensors(const std::string& path, const NamedTensors& tensors, at::ScalarType dtype,
                         const std::map<std::string, std::string>& metadata) {
  if (dtype != at::kFloat && dtype != at::kBFloat16) throw std::invalid_argument(path + ": only F32 or BF16 are written");
  std::vector<at::Tensor> keep;  // owns the bytes until written
  std::vector<TensorToWrite> out;
  for (const auto& [name, t] : tensors) {
    keep.push_back(t.detach().to(at::kCPU, dtype).contiguous());
    out.push_back({name, dtype == at::kFloat ? DType::F32 : DType::BF16, keep.back().sizes().vec(),
                   keep.back().data_ptr(), static_cast<size_t>(keep.back().nbytes())});
  }
  write_safetensors(path, out, metadata);
}

NamedTensors read_named_tensors(const std::string& path) {
  auto file = SafetensorsFile::open(path);
  NamedTensors out;
  for (const auto& e : file->tensors()) {
    if (e.dtype != DType::BF16 && e.dtype != DType::F32) {
      throw SafetensorsError(path + ": tensor '" + e.name + "': unsupported dtype " + dtype_name(e.dtype) +
                             " (F32 or BF16 expected)");
    }
    const at::ScalarType type = e.dtype == DType::BF16 ? at::kBFloat16 : at::kFloat;
    out.emplace_back(e.name, at::from_blob(const_cast<std::byte*>(e.data), e.shape, at::TensorOptions().dtype(type)).clone());
  }
  return out;
}

}  // namespace dflash::drafter
