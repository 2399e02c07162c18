#!/usr/bin/env bash
# Benchmark: mplane's TCP transport against NCCL's built-in Socket transport, in one run.
#
#   NCCL_TESTS_DIR=/path/to/nccl-tests/build scripts/bench-vs-socket.sh [-g GPUS] [-s SIZE] [--ifname IF]
#
# For sendrecv and all_reduce at SIZE (default 128M) it measures busbw through:
#   - mplane at its defaults and with 8 streams/threads,
#   - NCCL Socket at its defaults, and at each NCCL_NSOCKS_PERTHREAD x NCCL_SOCKET_NTHREADS setting in
#     a grid (NCCL caps the product at 64), keeping the best,
# with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 so the GPUs of one host talk through the network.
# Prints one table and the ratio mplane / best Socket per test.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
ngpus=2; size=128M; ifname=lo
while [ $# -gt 0 ]; do
  case "$1" in
    -g) ngpus="$2"; shift 2 ;;
    -s) size="$2"; shift 2 ;;
    --ifname) ifname="$2"; shift 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) echo "bench-vs-socket.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
done
[ -x "${NCCL_TESTS_DIR:-}/all_reduce_perf" ] || { echo "set NCCL_TESTS_DIR to a built nccl-tests" >&2; exit 2; }
export NCCL_NVLS_ENABLE=0 NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT
export NCCL_SOCKET_IFNAME=$ifname MPLANE_SOCKET_IFNAME=$ifname

# busbw (out-of-place) of the last data row, and the network NCCL used.
run() {
  local t=$1; shift
  local out
  out=$(env "$@" "$NCCL_TESTS_DIR/${t}_perf" -g "$ngpus" -b "$size" -e "$size" -c 1 -w 3 -n 20 2>&1)
  local bw wrong net
  bw=$(echo "$out" | awk '$1 ~ /^[0-9]+$/ && NF >= 9 {print $8}' | tail -1)
  wrong=$(echo "$out" | awk '$1 ~ /^[0-9]+$/ && NF >= 9 {print $9}' | tail -1)
  net=$(echo "$out" | grep -oE "Using network [A-Za-z0-9_]+" | head -1 | awk '{print $3}')
  echo "${bw:-0} ${wrong:-?} ${net:-?}"
}

printf '%-10s %-44s %10s %7s %s\n' test config "busbw GB/s" wrong network
mplane_env=(LD_LIBRARY_PATH="$here/build:${LD_LIBRARY_PATH:-}" NCCL_NET_PLUGIN=mplane NCCL_NET=mplane)
# mplane sets NCCL_BUFFSIZE / NCCL_P2P_NET_CHUNKSIZE for TCP (MPLANE_NCCL_DEFAULTS); give Socket the
# same to show the gain is the transport's, not the chunk size's.
big_chunks=(NCCL_BUFFSIZE=8388608 NCCL_P2P_NET_CHUNKSIZE=524288)
for t in sendrecv all_reduce; do
  best=0; bestcfg=""
  for cfg in "default" "4x4" "8x2" "2x8" "8x8" "16x4"; do
    if [ "$cfg" = default ]; then r=$(run $t NCCL_NET_PLUGIN=none NCCL_NET=Socket)
    else r=$(run $t NCCL_NET_PLUGIN=none NCCL_NET=Socket NCCL_NSOCKS_PERTHREAD=${cfg%x*} NCCL_SOCKET_NTHREADS=${cfg#*x}); fi
    set -- $r
    printf '%-10s %-44s %10s %7s %s\n' $t "Socket nsocks x nthreads=$cfg" "$1" "$2" "$3"
    if awk -v a="$1" -v b="$best" 'BEGIN{exit !(a>b)}'; then best=$1; bestcfg=$cfg; fi
  done
  r=$(run $t NCCL_NET_PLUGIN=none NCCL_NET=Socket NCCL_NSOCKS_PERTHREAD=${bestcfg%x*} NCCL_SOCKET_NTHREADS=${bestcfg#*x} "${big_chunks[@]}")
  set -- $r
  printf '%-10s %-44s %10s %7s %s\n' $t "Socket $bestcfg + 8M buffers, 512K p2p chunks" "$1" "$2" "$3"
  sbig=$1
  mbest=0; mdef=0
  for cfg in "default" "MPLANE_NCCL_DEFAULTS=0" "MPLANE_SOCKET_SPIN_US=0" \
             "MPLANE_SOCKET_STREAMS=4 MPLANE_SOCKET_CHUNK_BYTES=64K" ${MPLANE_BENCH_VARIANTS:-}; do
    if [ "$cfg" = default ]; then r=$(run $t "${mplane_env[@]}")
    else r=$(run $t "${mplane_env[@]}" $cfg); fi
    set -- $r
    printf '%-10s %-44s %10s %7s %s\n' $t "mplane $cfg" "$1" "$2" "$3"
    if [ "$cfg" = default ]; then mdef=$1; fi
    if awk -v a="$1" -v b="$mbest" 'BEGIN{exit !(a>b)}'; then mbest=$1; fi
  done
  awk -v m="$mdef" -v mb="$mbest" -v s="$best" -v sb="$sbig" -v c="$bestcfg" -v t=$t 'BEGIN{
    printf "%-10s mplane default / best Socket (%s) = %.2fx; / best Socket with big chunks = %.2fx; best mplane / best Socket = %.2fx\n",
      t, c, (s>0?m/s:0), (sb>0?m/sb:0), (s>0?mb/s:0)}'
done
