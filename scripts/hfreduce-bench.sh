#!/usr/bin/env bash
# HFReduce's benchmark (docs/hfreduce.md): libmplane-hfreduce's all-reduce on this host, with its
# ceilings beside it from the same run.
#
#   scripts/hfreduce-bench.sh [cpu|gpu|all] [options passed to the all-reduce run]
#
#   cpu  (the default without a GPU)
#        1. the CPU reduce rate of every dtype (4 inputs into 1, one core) beside a STREAM-style
#           triad of the same host, alternated round by round (mplane-hfreduce-bench reduce);
#        2. the host all-reduce, 1 MiB to 512 MiB, NODES x PER_NODE forked ranks over loopback
#           (default 2 x 4: 8 ranks; HFR_NODES, HFR_PER_NODE, HFR_DTYPE, HFR_MAX): time and busbw.
#   gpu  (the default with a GPU) two emulated nodes (NCCL_HOSTID apart), one rank each on GPU
#        rank % GPUs: HFReduce on device buffers, 1 MiB to 512 MiB, then NCCL's all_reduce_perf
#        through mplane (scripts/nccl-tests.sh --force-net, NCCL_TESTS_DIR) on the same GPUs and
#        sizes: busbw beside busbw. GPUs used by HFReduce's side: 0 SMs (copy engine only).
#
# Environment: HFR_BUILD (default build), OUT (a folder for hfreduce-bench.txt; default $HFR_BUILD),
# MPLANE_TRANSPORT / MPLANE_SOCKET_IFNAME as for the plugin (default here: socket over lo).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
build="${HFR_BUILD:-$here/build}"
bench="$build/collectives/hfreduce/mplane-hfreduce-bench"
out="${OUT:-$build}"
mode="${1:-}"
[ $# -gt 0 ] && shift
if [ -z "$mode" ]; then
  if nvidia-smi -L >/dev/null 2>&1; then mode=all; else mode=cpu; fi
fi
if [ ! -x "$bench" ]; then
  echo "hfreduce-bench: $bench is not built (meson setup $build && ninja -C $build)" >&2
  exit 2
fi
mkdir -p "$out"
results="$out/hfreduce-bench.txt"
: >"$results"
say() { echo "$*" | tee -a "$results"; }
export MPLANE_TRANSPORT="${MPLANE_TRANSPORT:-socket}" MPLANE_SOCKET_IFNAME="${MPLANE_SOCKET_IFNAME:-lo}"

say "hfreduce-bench: $(date -u +%FT%TZ), $(uname -n), $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//')"
say "hfreduce-bench: transport $MPLANE_TRANSPORT ($MPLANE_SOCKET_IFNAME), chunk ${MPLANE_HFREDUCE_CHUNK_BYTES:-2M}, slots ${MPLANE_HFREDUCE_SLOTS:-4}"

cpu() {
  "$bench" reduce --mib "${HFR_REDUCE_MIB:-64}" --rounds "${HFR_ROUNDS:-9}" 2>&1 | tee -a "$results" || return 1
  "$bench" allreduce --nodes "${HFR_NODES:-2}" --per-node "${HFR_PER_NODE:-4}" --dtype "${HFR_DTYPE:-bfloat16}" \
    --min 1M --max "${HFR_MAX:-512M}" --iters "${HFR_ITERS:-3}" "$@" 2>&1 | tee -a "$results"
}

gpu() {
  if ! nvidia-smi -L >/dev/null 2>&1; then
    say "hfreduce-bench: gpu: no GPU here (nvidia-smi -L failed): skipped"
    return 0
  fi
  say "---- HFReduce, device buffers, 2 emulated nodes x 1 rank"
  "$bench" allreduce --gpu 1 --nodes 2 --per-node 1 --dtype "${HFR_DTYPE:-float32}" --min 1M --max "${HFR_MAX:-512M}" \
    --iters "${HFR_ITERS:-5}" "$@" 2>&1 | tee -a "$results" || return 1
  if [ -n "${NCCL_TESTS_DIR:-}" ] && [ -x "$NCCL_TESTS_DIR/all_reduce_perf" ]; then
    say "---- NCCL all_reduce_perf through mplane (--force-net: every byte through the plugin's transport)"
    "$here/scripts/nccl-tests.sh" --net mplane --force-net -b 1M -e "${HFR_MAX:-512M}" -f 2 --tests all_reduce \
      --log "$out/hfreduce-bench-nccl" 2>&1 | tee -a "$results"
    for f in "$out"/hfreduce-bench-nccl/*; do [ -f "$f" ] && grep -E '^ +[0-9]+ ' "$f" | tee -a "$results"; done
  else
    say "hfreduce-bench: NCCL side skipped: set NCCL_TESTS_DIR to a built nccl-tests"
  fi
}

case "$mode" in
  cpu) cpu "$@" ;;
  gpu) gpu "$@" ;;
  all) cpu "$@" && gpu "$@" ;;
  -h|--help) sed -n 2,18p "$0"; exit 0 ;;
  *) echo "hfreduce-bench: unknown mode '$mode' (cpu, gpu or all)" >&2; exit 2 ;;
esac
rc=$?
say "hfreduce-bench: results in $results"
exit $rc
