#!/bin/sh
# MPLANE_STATS_FORMAT=both through a real run: mplane-netbench (two processes) with the counters
# file rewritten every second. The Prometheus file must appear while the run still goes (the interval
# writer, not only the close), and at the end parse with prometheus_client's parser and equal the JSON
# (stats_prometheus.py).
#   stats_prometheus.sh NETBENCH PLUGIN CHECKER
set -u
netbench=$1 plugin=$2 checker=$3
py=""
for p in python3 /usr/bin/python3; do
  if "$p" -c 'import prometheus_client' >/dev/null 2>&1; then py=$p; break; fi
done
if [ -z "$py" ]; then
  echo "stats-prometheus: no python3 with prometheus_client (scripts/setup.sh installs python3-prometheus-client)"
  exit 1
fi
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
MPLANE_STATS_FILE="$dir/mplane-%p.json" MPLANE_STATS_FORMAT=both MPLANE_STATS_INTERVAL=1 \
  "$netbench" --plugin "$plugin" --seconds 4 >"$dir/netbench.log" 2>&1 &
bench=$!
seen=0
for i in $(seq 1 60); do
  if ls "$dir"/*.prom >/dev/null 2>&1 && kill -0 "$bench" 2>/dev/null; then seen=1; break; fi
  kill -0 "$bench" 2>/dev/null || break
  sleep 0.1
done
wait "$bench"
rc=$?
mv "$dir/netbench.log" "$dir/../mplane-stats-netbench.$$.log" 2>/dev/null
if [ "$rc" -ne 0 ]; then
  echo "stats-prometheus: mplane-netbench failed ($rc):"
  cat "$dir/../mplane-stats-netbench.$$.log"
  exit 1
fi
rm -f "$dir/../mplane-stats-netbench.$$.log"
if [ "$seen" -ne 1 ]; then
  echo "stats-prometheus: FAIL: no .prom file while the run went on (MPLANE_STATS_INTERVAL=1 should rewrite it every second)"
  exit 1
fi
exec "$py" "$checker" "$dir"
