// The shipped daemon: no test hooks (pipeline/test_hooks.h).
#include "pipeline/test_hooks.h"

namespace dflash::pipeline {

TestHooks test_hooks_of_this_build() { return {}; }

}  // namespace dflash::pipeline
