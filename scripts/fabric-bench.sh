#!/usr/bin/env bash
# mplane: relayed vs same-plane bandwidth on the emulated fabric, in one run.
#
#   scripts/fabric-bench.sh [--plugin PATH.so] [--peer PATH/fabric_peer] [--bytes 64M] [--iters 16]
#                           [--rounds 7] [--max-cost 10]
#
# Builds a 2-node, 4-plane fabric (scripts/fabric.sh), then runs, --rounds times, in ABBA order
# (odd rounds same-plane first, even rounds relayed first, so neither mode always runs warm):
#   same-plane: node 1 veth3 -> node 2 veth3 (plane 3 to plane 3)
#   relayed:    node 1 veth0 -> node 2 veth3 (plane 0 to plane 3: mplane carries it on node 1's
#               plane-3 NIC, the relay NIC)
# each sending --iters messages of --bytes through the plugin (ncclNet_v11, as NCCL's proxy does).
# Prints each run, the median of each mode and the median of the per-round relayed/same-plane ratios
# (each pair runs back to back, so a busy machine slows both alike), and fails (exit 1) if that
# median ratio says relaying costs more than --max-cost percent. Exit 77 when not root / no iproute2.
# Defaults find the plugin and driver in build-planes/ (meson setup build-planes).
set -uo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
plugin=$here/build-planes/libnccl-net-mplane.so
peer=$here/build-planes/tests/fabric/fabric_peer
bytes=64M iters=16 rounds=7 max_cost=10
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin) plugin=$2; shift 2 ;;
    --peer) peer=$2; shift 2 ;;
    --bytes) bytes=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --max-cost) max_cost=$2; shift 2 ;;
    *) echo "fabric-bench.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
[ "$(id -u)" = 0 ] || { echo "SKIP: fabric-bench needs root (network namespaces); run it as root"; exit 77; }
command -v ip >/dev/null || { echo "SKIP: iproute2 ('ip') is not installed"; exit 77; }
[ -x "$peer" ] && [ -f "$plugin" ] || { echo "fabric-bench.sh: build first: $plugin / $peer missing" >&2; exit 2; }
fabric=$here/scripts/fabric.sh
# One fabric at a time on this host (several build folders may run the suite at once).
exec 9>/tmp/mplane-fabric.lock
flock -w 600 9 || { echo "FAIL: another fabric run held /tmp/mplane-fabric.lock for 10 minutes"; exit 1; }
work=$(mktemp -d /tmp/mplane-bench.XXXXXX)
trap '"$fabric" down >/dev/null 2>&1; rm -rf "$work"' EXIT
"$fabric" down >/dev/null 2>&1
"$fabric" up --nodes 2 --planes 4 >/dev/null || { echo "fabric.sh up failed" >&2; exit 1; }

run() { # mode connect_dev -> MB/s
  local mode=$1 cdev=$2 h=$work/$1.$RANDOM.handle
  NCCL_HOSTID=node2 ip netns exec mplane-n2 "$peer" listen --plugin "$plugin" --dev veth3 --handle "$h" \
    --bytes "$bytes" --iters "$iters" --no-check >"$work/l.log" 2>&1 &
  local lp=$!
  NCCL_HOSTID=node1 ip netns exec mplane-n1 "$peer" connect --plugin "$plugin" --dev "$cdev" --handle "$h" \
    --bytes "$bytes" --iters "$iters" --no-check >"$work/c.log" 2>&1
  local rc=$?
  wait $lp || rc=1
  [ $rc = 0 ] || { echo "fabric-bench: $mode run failed" >&2; cat "$work/c.log" "$work/l.log" >&2; exit 1; }
  awk '/^bandwidth:/ {print $2}' "$work/c.log"
}

same=() relayed=()
echo "fabric-bench: $iters x $bytes messages per run, $rounds rounds, same-plane and relayed in ABBA order"
for ((r = 1; r <= rounds; r++)); do
  if ((r % 2)); then
    s=$(run same-plane veth3); x=$(run relayed veth0)
  else
    x=$(run relayed veth0); s=$(run same-plane veth3)
  fi
  same+=("$s") relayed+=("$x")
  printf 'round %d: same-plane %8.1f MB/s   relayed %8.1f MB/s\n' "$r" "$s" "$x"
done
median() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print (NR % 2) ? a[(NR+1)/2] : (a[NR/2] + a[NR/2+1]) / 2}'; }
ratios=()
for ((i = 0; i < rounds; i++)); do ratios+=("$(awk -v s="${same[i]}" -v r="${relayed[i]}" 'BEGIN {print r / s}')"); done
ms=$(median "${same[@]}") mr=$(median "${relayed[@]}") mq=$(median "${ratios[@]}")
cost=$(awk -v q="$mq" 'BEGIN {printf "%.1f", (1 - q) * 100}')
printf 'median: same-plane %.1f MB/s, relayed %.1f MB/s; median per-round relayed/same-plane %.3f: relay costs %s%% (limit %s%%)\n' \
  "$ms" "$mr" "$mq" "$cost" "$max_cost"
if awk -v c="$cost" -v m="$max_cost" 'BEGIN {exit !(c > m)}'; then
  echo "FAIL: relaying costs more than $max_cost%"
  exit 1
fi
echo "PASS: relay cost within $max_cost%"
