// inspect.h: `dflashd inspect target`: dumps the tapped hidden states of a target for the
// sequences of a token file, for debugging a drafter that underperforms.
#pragma once

#include <string>
#include <vector>

namespace dflash::daemon {

// argv after "inspect". Returns the exit code; errors are printed to stderr.
int command_inspect(const std::vector<std::string>& args);

}  // namespace dflash::daemon
