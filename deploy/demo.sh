#!/usr/bin/env bash
# demo.sh: trains a drafter with dflashd on its embedded default config (tiny random Qwen3.5-
# shaped target, synthetic data, CPU) in a minute or two. While it trains, the metrics and health
# endpoints are read; the run stops by itself and exports the drafter.
# Usage: deploy/demo.sh PATH/TO/dflashd [WORK_DIR]
set -euo pipefail
binary="$(readlink -f "${1:?usage: demo.sh PATH/TO/dflashd [WORK_DIR]}")"
work="${2:-${TMPDIR:-/tmp}/dflashd-demo}"
url="http://127.0.0.1:9400"
rm -rf "$work" && mkdir -p "$work" && cd "$work"

"$binary" validate --default-config
"$binary" run --default-config &
pid=$!
trap 'kill -TERM $pid 2>/dev/null || true' EXIT INT

show() {
  echo "---- $url/metrics (headline)"
  curl -s "$url/metrics" | grep -E '^dflashd_(loss|expected_acceptance_length|tokens_per_second|eta_seconds|optimizer_steps_total|mfu_ratio|queue_depth)' || true
  echo "---- $url/healthz: $(curl -s -w ' (HTTP %{http_code})' "$url/healthz" | tr '\n' ' ')"
}
for i in 1 2 3; do
  sleep 20
  kill -0 $pid 2>/dev/null || break
  show
done
status=0
wait $pid || status=$?
trap - EXIT INT
echo "---- dflashd exited with status $status; exported drafter:"
ls -l "$work/dflashd-run/export/final" 2>/dev/null || true
exit $status
