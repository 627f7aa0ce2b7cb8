// tensor_io.h: named torch tensors to and from safetensors files (the drafter's export and
// checkpoint files). Writing converts to `dtype` on the CPU and is atomic (common/safetensors.h);
// reading accepts F32 and BF16 and returns CPU tensors of the stored dtype (copies, so they
// outlive the file). Errors name the file and the tensor.
#pragma once

#include <ATen/core/Tensor.h>

#include <map>
#include <string>
#include <utility>
#include <vector>

namespace dflash::drafter {

using NamedTensors = std::vector<std::pair<std::string, at::Tensor>>;

void write_named_tensors(const std::string& path, const NamedTensors& tensors, at::ScalarType dtype,
                         const std::map<std::string, std::string>& metadata = {});
NamedTensors read_named_tensors(const std::string& path);

}  // namespace dflash::drafter
