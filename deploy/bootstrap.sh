#!/usr/bin/env bash
# bootstrap.sh: installs everything dflashd needs to build and test, idempotently.
#
# - Debian packages with apt-get (only the ones missing, so a rerun costs a few dpkg queries);
# - a Python virtual environment OUTSIDE the clone (default ~/.cache/dflashd/venv) holding
#   the torch wheel pinned to the version the GPU hosts run, whose libtorch we link against.
#   CI and every new clone reuse it; a stamp file records what was installed.
#
# Usage: deploy/bootstrap.sh [--print-torch-dir]
# Environment: DFLASHD_CACHE (default ~/.cache/dflashd), DFLASHD_TORCH_VERSION (default 2.11.0),
#              DFLASHD_TEST_PY=1 also installs the Python reference packages used by parity tests.
set -euo pipefail

CACHE="${DFLASHD_CACHE:-$HOME/.cache/dflashd}"
VENV="$CACHE/venv"
TORCH_VERSION="${DFLASHD_TORCH_VERSION:-2.11.0}"

log() { echo "[bootstrap] $*" >&2; }

debian_packages=(
  build-essential cmake ninja-build ccache pkg-config git curl python3-venv
  libspdlog-dev libfmt-dev libyaml-cpp-dev prometheus-cpp-dev libconcurrentqueue-dev
  libcpp-httplib-dev nlohmann-json3-dev libgtest-dev libgmock-dev
  prometheus systemd  # promtool and systemd-analyze check the deploy files in the tests
)

install_debian() {
  local missing=()
  for p in "${debian_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    local sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
}

install_venv() {
  mkdir -p "$CACHE"
  local stamp="$VENV/.dflashd-torch-$TORCH_VERSION"
  if [ ! -f "$stamp" ]; then
    [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
    log "pip install torch==$TORCH_VERSION into $VENV (several GB the first time)"
    "$VENV/bin/pip" install -q --progress-bar off "torch==$TORCH_VERSION"
    touch "$stamp"
  fi
  if [ "${DFLASHD_TEST_PY:-0}" = 1 ]; then
    local tstamp="$VENV/.dflashd-test-py-4"  # bumped when the requirements change
    if [ ! -f "$tstamp" ]; then
      log "pip install the Python reference packages (tests only)"
      "$VENV/bin/pip" install -q --progress-bar off -r "$(dirname "$0")/requirements-test.txt"
      "$VENV/bin/pip" install -q --progress-bar off --no-deps -r "$(dirname "$0")/requirements-test-nodeps.txt"
      touch "$tstamp"
    fi
  fi
}

install_debian
install_venv
if [ "${1:-}" = "--print-torch-dir" ]; then
  "$VENV/bin/python" -c 'import os, torch; print(os.path.dirname(torch.__file__))'
fi
