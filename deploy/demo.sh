#!/usr/bin/env bash
# demo.sh: runs dflashd on its embedded default config (tiny models, synthetic data, CPU),
# shows its metrics and health endpoints while it runs, then stops it with SIGTERM and checks
# that it exits cleanly. Usage: deploy/demo.sh PATH/TO/dflashd [SECONDS]
set -euo pipefail
binary="${1:?usage: demo.sh PATH/TO/dflashd [SECONDS]}"
seconds="${2:-15}"
url="http://127.0.0.1:9400"

"$binary" validate --default-config
"$binary" run --default-config &
pid=$!
trap 'kill -KILL $pid 2>/dev/null || true' EXIT

for _ in $(seq 100); do
  curl -fs "$url/healthz" >/dev/null 2>&1 && break
  kill -0 $pid 2>/dev/null || { wait $pid; exit $?; }
  sleep 0.1
done
echo "---- $url/healthz"
curl -s -w ' (HTTP %{http_code})\n' "$url/healthz"
echo "---- $url/metrics (dflashd_* lines)"
curl -s "$url/metrics" | grep -E '^dflashd_' || true
sleep "$seconds"
echo "---- SIGTERM"
kill -TERM $pid
status=0
wait $pid || status=$?
trap - EXIT
echo "---- dflashd exited with status $status"
exit $status
