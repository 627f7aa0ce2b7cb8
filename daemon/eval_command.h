// eval_command.h: `dflashd eval`: real acceptance of an exported drafter with its target.
#pragma once

#include <string>
#include <vector>

namespace dflash::daemon {

// args: the arguments after `eval`. Returns the exit code.
int command_eval(const std::vector<std::string>& args);

}  // namespace dflash::daemon
