#!/usr/bin/env bash
# Run nccl-tests through mplane (or NCCL's own transports, for comparison) and print a summary.
#
#   NCCL_TESTS_DIR=/path/to/nccl-tests/build scripts/nccl-tests.sh [options]
#
#   --net mplane|socket|ib   who carries inter-node/NET traffic (default mplane)
#   -g N                     GPUs per process (default: all visible GPUs)
#   -b SIZE -e SIZE -f F     size sweep, nccl-tests syntax (default 8 .. 128M, factor 2)
#   --tests "a b c"          which tests (default: sendrecv all_reduce all_gather reduce_scatter alltoall)
#   --force-net              NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: one host's GPUs talk through NET,
#                            so a single node exercises the plugin
#   --log DIR                keep each test's full output in DIR
#
# It does not build nccl-tests: point NCCL_TESTS_DIR at the folder holding all_reduce_perf etc.
# The summary has one row per test: bus bandwidth at the largest size, the average, the count of
# wrong values (must be 0) and the network NCCL reported using. Exit status 1 if any test failed,
# reported wrong values, or did not run over the requested network.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
net=mplane; ngpus=""; b=8; e=128M; f=2; logdir=""; force_net=0
tests="sendrecv all_reduce all_gather reduce_scatter alltoall"
while [ $# -gt 0 ]; do
  case "$1" in
    --net) net="$2"; shift 2 ;;
    -g) ngpus="$2"; shift 2 ;;
    -b) b="$2"; shift 2 ;;
    -e) e="$2"; shift 2 ;;
    -f) f="$2"; shift 2 ;;
    --tests) tests="$2"; shift 2 ;;
    --force-net) force_net=1; shift ;;
    --log) logdir="$2"; shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "nccl-tests.sh: unknown option '$1' (see --help)" >&2; exit 2 ;;
  esac
done
if [ -z "${NCCL_TESTS_DIR:-}" ] || [ ! -x "$NCCL_TESTS_DIR/all_reduce_perf" ]; then
  echo "nccl-tests.sh: set NCCL_TESTS_DIR to a built nccl-tests (the folder with all_reduce_perf)" >&2
  exit 2
fi
if [ -z "$ngpus" ]; then
  ngpus=$(nvidia-smi -L 2>/dev/null | wc -l)
  [ "$ngpus" -gt 0 ] || { echo "nccl-tests.sh: no GPU visible (nvidia-smi -L)" >&2; exit 2; }
fi
[ -n "$logdir" ] || logdir=$(mktemp -d)
mkdir -p "$logdir"

export NCCL_NVLS_ENABLE=0 NCCL_DEBUG=${NCCL_DEBUG:-INFO} NCCL_DEBUG_SUBSYS=${NCCL_DEBUG_SUBSYS:-INIT,NET}
[ $force_net = 1 ] && export NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
case "$net" in
  mplane)
    plugin_dir="${MPLANE_LIB_DIR:-$here/build}"
    [ -f "$plugin_dir/libnccl-net-mplane.so" ] || { echo "nccl-tests.sh: $plugin_dir/libnccl-net-mplane.so missing: run scripts/setup.sh --build" >&2; exit 2; }
    export LD_LIBRARY_PATH="$plugin_dir:${LD_LIBRARY_PATH:-}" NCCL_NET_PLUGIN=mplane NCCL_NET=mplane
    want="mplane" ;;
  socket) export NCCL_NET_PLUGIN=none NCCL_NET=Socket; want="Socket" ;;
  ib) export NCCL_NET_PLUGIN=none NCCL_NET=IB; want="IB" ;;
  *) echo "nccl-tests.sh: --net must be mplane, socket or ib" >&2; exit 2 ;;
esac

fail=0
printf '%-16s %-8s %12s %12s %8s %s\n' test net "busbw@max" "avg busbw" wrong "network used"
for t in $tests; do
  bin="$NCCL_TESTS_DIR/${t}_perf"
  log="$logdir/$t-$net.log"
  if [ ! -x "$bin" ]; then echo "nccl-tests.sh: $bin missing" >&2; fail=1; continue; fi
  "$bin" -g "$ngpus" -b "$b" -e "$e" -f "$f" -c 1 -w 2 -n 10 >"$log" 2>&1
  rc=$?
  # Data rows: size count type redop root time algbw busbw #wrong (out-of-place) ... (in-place)
  last=$(awk '$1 ~ /^[0-9]+$/ && NF >= 9 {row=$0} END {print row}' "$log")
  busbw=$(echo "$last" | awk '{print $8}')
  wrong=$(awk '$1 ~ /^[0-9]+$/ && NF >= 9 {w += $9; if (NF >= 13 && $13 ~ /^[0-9]+$/) w += $13} END {print w+0}' "$log")
  avg=$(awk -F: '/Avg bus bandwidth/ {gsub(/ /, "", $2); print $2}' "$log")
  used=$(grep -oE "Using network [A-Za-z0-9_]+" "$log" | head -1 | awk '{print $3}')
  status=""
  if [ $rc -ne 0 ]; then status="FAILED rc=$rc"; fail=1; fi
  if [ "${wrong:-1}" != 0 ]; then status="$status WRONG VALUES"; fail=1; fi
  if [ "$used" != "$want" ]; then status="$status (wanted $want)"; fail=1; fi
  printf '%-16s %-8s %12s %12s %8s %s %s\n' "$t" "$net" "${busbw:-?}" "${avg:-?}" "$wrong" "${used:-?}" "$status"
done
echo "logs: $logdir"
exit $fail
