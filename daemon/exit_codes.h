// exit_codes.h: what dflashd's exit status means (also in README and `dflashd --help`).
// systemd's unit uses RestartPreventExitStatus for the codes a restart cannot fix.
#pragma once

namespace dflash::daemon::exit_code {
constexpr int kOk = 0;             // finished, or stopped cleanly on SIGTERM/SIGINT
constexpr int kFailure = 1;        // a run failed (worker failure by policy, I/O error, bug)
constexpr int kUsage = 2;          // bad command line
constexpr int kConfigInvalid = 3;  // the config has errors (all listed on stderr)
constexpr int kStartup = 4;        // the machine cannot run this config (port taken, GPU missing, files)
// 128 + N: a second signal N arrived during a graceful stop and the process exited at once.
}  // namespace dflash::daemon::exit_code
