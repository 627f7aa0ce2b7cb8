// kernel_probe.h: launches one tiny kernel from dflashd's own fatbin on a GPU, which proves
// that the binary carries code for that GPU's architecture (a binary built without sm_100
// code fails here on a B200 instead of failing later in the first target forward).
#pragma once

#include <string>

namespace dflash::daemon {

// Returns "ok", or the reason the kernel could not run on `device`.
std::string probe_kernels(int device);

}  // namespace dflash::daemon
