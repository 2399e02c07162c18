#!/usr/bin/env bash
# libmplane-ep beside NCCL EP's ep_bench on the same two emulated nodes, in one call, one table.
#
# Both run as two processes on one GPU under MPS (a daemon this script starts with a pipe directory
# of its own), each process its own emulated node (NCCL_HOSTID=node<rank>), so every byte between
# them crosses the net plugin (mplane's socket transport over lo):
#   * libmplane-ep: mplane-ep-bench --gpus 2 --nodes 2 --share-gpus --mode bench (NCCL's host
#     send/receive path over the plugin); DeepSeek-V3 gating (group-limited: 8 groups, top-4).
#   * NCCL EP: ep_bench under mpirun (its GIN kernels over the plugin's RMA tables); its own routing
#     (HT: uniform random experts; LL: random with a few dropped). Its localRank comes from
#     gethostname(), so each rank gets a gethostname() answering node<rank> (a small preload this
#     script compiles), and both use GPU 0.
# Shapes: HT - 4096 tokens per rank, hidden 7168, top-8 of 256 experts (NCCL EP -a ht); small -
# 128 tokens (NCCL EP -a ll, its small-batch mode). BF16 against BF16, libmplane-ep's FP8 dispatch
# beside it. A run of NCCL EP that does not finish within --timeout is killed and the table says so.
#
#   scripts/ep-side-by-side.sh --ep-bench PATH [options]
#     --ep-bench PATH     NCCL EP's ep_bench binary (or NCCL_EP_BENCH=PATH). NCCL EP is not part
#                         of this repository: build it from contrib/nccl_ep of an NCCL source tree of
#                         2.30 or later on the GPU machine (its README: make with MPI and NCCL_HOME)
#                         and give the binary here. Without it only libmplane-ep's rows are measured.
#     --nccl-lib DIR      folder with the libnccl.so.2 (and libnccl_ep.so) ep_bench needs (NCCL 2.30+);
#                         prepended to LD_LIBRARY_PATH for NCCL EP (or NCCL_EP_LIB_DIR)
#     --mplane-nccl-lib DIR  the NCCL libmplane-ep runs on (default: the one it was built against)
#     --sms N             SMs for the HT shape, both libraries (default 24); --ll-sms N for NCCL EP
#                         LL (default 32: with fewer its two ranks' kernels may not fit on one GPU)
#     --iters N           timed iterations (default 10), --warmup N (3)
#     --timeout S         seconds for each NCCL EP run (default 150)
#     --mplane-timeout S  seconds for each libmplane-ep run (default 180; a run takes ~10-20 s)
#     --shapes LIST       ht,small (default both)
#     --budget S          seconds for the whole script (default 0: no limit): each run's limit is
#                         cut to what is left (less a reserve for the table); a run with none left is
#                         reported not run. Before each run a probe makes a CUDA context on the GPU
#                         (scripts/gpu-guard.sh); where it fails the MPS daemon is restarted, and a GPU
#                         still unusable fails that run with the probe's answer; a run killed at its
#                         limit or one that leaves the GPU unusable gets MPS restarted and its row says so
#     --no-build          do not build libmplane-ep first (use what EP_BUILD holds)
#     --no-validate       do not pass -V (validation) to ep_bench
#     --out DIR           results (default $OUT, else build-ep-dev/side-by-side): side-by-side.md
#                         (the table), *.log, nccl-net.txt
#     --from-logs         run nothing: make the table again from the logs of an earlier run in --out
# Environment: EP_BUILD (libmplane-ep build folder, default build-ep-dev), EP_PLUGIN_DIR (a prebuilt
# libnccl-net-mplane.so), MPIRUN, NCCL_HOME (as for scripts/ep-bench.sh, which builds libmplane-ep first).
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
ep_bench="${NCCL_EP_BENCH:-}"
nccl_lib="${NCCL_EP_LIB_DIR:-}"
mplane_nccl_lib=""
sms=24
ll_sms=32
iters=10
warmup=3
timeout_s=150
mplane_timeout=180
shapes="ht,small"
validate=1
from_logs=0
budget=0
no_build=0
out="${OUT:-}"
die() { echo "ep-side-by-side: $*" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --ep-bench) ep_bench=$2; shift 2 ;;
    --nccl-lib) nccl_lib=$2; shift 2 ;;
    --mplane-nccl-lib) mplane_nccl_lib=$2; shift 2 ;;
    --sms) sms=$2; shift 2 ;;
    --ll-sms) ll_sms=$2; shift 2 ;;
    --iters) iters=$2; shift 2 ;;
    --warmup) warmup=$2; shift 2 ;;
    --timeout) timeout_s=$2; shift 2 ;;
    --mplane-timeout) mplane_timeout=$2; shift 2 ;;
    --shapes) shapes=$2; shift 2 ;;
    --no-validate) validate=0; shift ;;
    --budget) budget=$2; shift 2 ;;
    --no-build) no_build=1; shift ;;
    --from-logs) from_logs=1; shift ;;
    --out) out=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown option '$1' (--help lists them)" ;;
  esac
done
for v in sms ll_sms iters warmup timeout_s mplane_timeout budget; do
  [[ "${!v}" =~ ^[0-9]+$ ]] || die "--${v//_/-} '${!v}': expected a whole number"
done
build="${EP_BUILD:-$here/build-ep-dev}"
case "$build" in /*) ;; *) build="$here/$build" ;; esac
out="${out:-$build/side-by-side}"
mkdir -p "$out" || die "--out '$out': cannot create it"
out="$(cd "$out" && pwd)"
table="$out/side-by-side.md"
rows="$out/rows.txt"
: >"$rows"
say() { echo "ep-side-by-side: $*" | tee -a "$out/notes.txt"; }
[ $from_logs = 1 ] || : >"$out/notes.txt"
touch "$out/notes.txt"

# =============================== running ===============================
# Every long step runs in the background and is waited for: bash runs a trap only once the foreground
# command has ended, so a TERM sent to this script (a `timeout` around it) would otherwise wait for
# the step in flight. On TERM/INT the step (a `timeout` process, which passes the signal on to what
# it runs) is stopped and the script ends; the EXIT trap then stops the MPS daemon.
step_pid=""
run_step() { # run_step LOG CMD...: CMD's output into LOG, its exit status returned
  local log=$1
  shift
  "$@" >"$log" 2>&1 &
  step_pid=$!
  wait "$step_pid"
  local rc=$?
  step_pid=""
  return $rc
}
on_signal() {
  [ -n "$step_pid" ] && kill -TERM "$step_pid" 2>/dev/null
  echo "ep-side-by-side: stopped by a signal" >&2
  exit 143
}
trap on_signal TERM INT
# shellcheck source=scripts/gpu-guard.sh
. "$here/scripts/gpu-guard.sh"
guard_init ep-side-by-side "$budget"
# guarded_limit WANT STATUS: the limit of the next run, after the GPU probe; 1 (and STATUS says why
# the run was not run) where no time is left or the GPU is unusable
guarded_limit() {
  run_limit=$(guard_limit "$1")
  if [ "$run_limit" -le 0 ] || { [ "$run_limit" -lt "$1" ] && [ "$run_limit" -lt 10 ]; }; then # cut short by the budget
    echo "notrun=the budget (${budget}s) was spent" >"$2"
    return 1
  fi
  guard_before "$(basename "$2" .status)" && return 0
  echo "notrun=$guard_why" >"$2"
  return 1
}
prepare_run() {
  if ! command -v nvidia-smi >/dev/null 2>&1 || ! nvidia-smi -L >/dev/null 2>&1; then
    echo "ep-side-by-side: no GPU (nvidia-smi -L failed): nothing measured"
    exit 77
  fi
  if [ -n "$ep_bench" ]; then
    [ -x "$ep_bench" ] || die "--ep-bench '$ep_bench': not an executable file"
    ep_bench="$(cd "$(dirname "$ep_bench")" && pwd)/$(basename "$ep_bench")"
  else
    say "no --ep-bench (NCCL_EP_BENCH): NCCL EP is not run; build ep_bench from contrib/nccl_ep of NCCL 2.30+ on this machine and give its path"
  fi
  # libmplane-ep and the plugin, built as scripts/ep-bench.sh builds them
  if [ $no_build = 0 ]; then
    run_step "$out/build-step.log" env EP_BUILD="$build" OUT="$out/build" "$here/scripts/ep-bench.sh" build ||
      { cat "$out/build-step.log"; die "building libmplane-ep failed (see $out/build)"; }
  else
    : >"$out/build-step.log"
  fi
  grep -E "^ep-bench: (NCCL header|nvcc|date|  GPU)" "$out/build-step.log" | sed 's/^ep-bench: /  /' >>"$out/notes.txt"
  bench=""
  for b in "$build/collectives/ep/mplane-ep-bench" "$build/direct/mplane-ep-bench"; do
    [ -x "$b" ] && { bench=$b; break; }
  done
  [ -n "$bench" ] || die "no mplane-ep-bench in $build after the build"
  plugin=""
  for d in ${EP_PLUGIN_DIR:+"$EP_PLUGIN_DIR"} "$build" "$here/.deps/ep-plugin" "$here/build"; do
    [ -f "$d/libnccl-net-mplane.so" ] && { plugin="$d/libnccl-net-mplane.so"; break; }
  done
  [ -n "$plugin" ] || die "no libnccl-net-mplane.so (build the project: meson setup build && ninja -C build)"
  eplib_dir="$(dirname "$bench")"
  cuda_root="$(dirname "$(dirname "$(command -v nvcc 2>/dev/null || echo /usr/local/cuda/bin/nvcc)")")"
  # MPS: both ranks' kernels on the one GPU at once
  mps=0
  if command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    export CUDA_MPS_PIPE_DIRECTORY="$out/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$out/mps-log"
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if guard_mps_start; then
      mps=1
      trap guard_mps_stop EXIT
    fi
  fi
  if [ $mps = 1 ]; then say "MPS daemon started (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
  else say "no MPS: the two ranks time-slice the GPU (times are not meaningful)"; fi
  export CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}"
  : >"$out/nccl-net.txt"
}

net_lines() { # LOGDIR LABEL: which network NCCL said it used
  local n
  n=$(grep -hoE "Using network [A-Za-z0-9_]+" "$1"/nccl.*.log 2>/dev/null | sort | uniq -c | tr -s ' ' | tr '\n' ';')
  echo "$2: ${n:-no 'Using network' line}" >>"$out/nccl-net.txt"
}

# libmplane-ep: one mplane-ep-bench run per shape; status in mplane-SHAPE.status
run_mplane() {
  local shape=$1 tokens=$2 log="$out/mplane-$1.log" tmp run_limit
  rm -f "$log"
  guarded_limit "$mplane_timeout" "$out/mplane-$shape.status" || { say "libmplane-ep $shape: not run: $(sed -n 's/^notrun=//p' "$out/mplane-$shape.status")"; return 0; }
  tmp=$(mktemp -d "$out/nccl-mplane-$1-XXXX")
  local ld="$eplib_dir:$(dirname "$plugin"):${mplane_nccl_lib:+$mplane_nccl_lib:}$cuda_root/lib64:${LD_LIBRARY_PATH:-}"
  say "libmplane-ep $shape: $bench --gpus 2 --nodes 2 --share-gpus --mode bench --tokens $tokens --sms $sms --iters $iters --warmup $warmup"
  run_step "$log" env LD_LIBRARY_PATH="$ld" NCCL_NET_PLUGIN="$plugin" MPLANE_SOCKET_IFNAME=lo NCCL_SOCKET_IFNAME=lo \
    NCCL_NVLS_ENABLE=0 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$tmp/nccl.%h.%p.log" \
    timeout -k 5 "$run_limit" "$bench" --gpus 2 --nodes 2 --share-gpus --mode bench --tokens "$tokens" --hidden 7168 \
    --experts 256 --topk 8 --groups 8 --topk-groups 4 --sms "$sms" --iters "$iters" --warmup "$warmup" \
    --timeout $((run_limit > 15 ? run_limit - 5 : run_limit))
  local rc=$?
  guard_after "libmplane-ep $shape" $rc || say "libmplane-ep $shape: $guard_why"
  echo "rc=$rc limit=$run_limit${guard_why:+ why=${guard_why// /_}}" >"$out/mplane-$shape.status"
  net_lines "$tmp" "libmplane-ep $shape"
  rm -rf "$tmp"
}

# NCCL EP's ranks: each its own gethostname() (ep_bench derives its local rank, and so its GPU, from it)
shim=""
make_shim() {
  [ -n "$shim" ] && return 0
  local cc; cc=$(command -v cc || command -v gcc) || { say "no C compiler for the gethostname preload"; return 1; }
  cat >"$out/hostname-shim.c" <<'SHIM'
/* gethostname() answering $EP_SBS_HOSTNAME: each rank its own emulated node for ep_bench's localRank */
#define _GNU_SOURCE
#include <errno.h>
#include <stdlib.h>
#include <string.h>
int gethostname(char *name, size_t len) {
  const char *h = getenv("EP_SBS_HOSTNAME");
  if (!h) h = "node0";
  size_t n = strlen(h);
  if (n + 1 > len) { errno = ENAMETOOLONG; return -1; }
  memcpy(name, h, n + 1);
  return 0;
}
SHIM
  "$cc" -shared -fPIC -O2 -o "$out/hostname-shim.so" "$out/hostname-shim.c" || return 1
  shim="$out/hostname-shim.so"
  cat >"$out/rank-wrap.sh" <<'WRAP'
#!/bin/sh
# one emulated node per MPI rank
export NCCL_HOSTID=node$OMPI_COMM_WORLD_RANK EP_SBS_HOSTNAME=node$OMPI_COMM_WORLD_RANK
exec "$@"
WRAP
  chmod +x "$out/rank-wrap.sh"
}

# NCCL EP: ep_bench under mpirun; status in nccl-ep-SHAPE.status (rc, seconds) or why it did not run
run_nccl_ep() {
  local shape=$1 algo=$2 tokens=$3 s=$4 log="$out/nccl-ep-$1.log" st="$out/nccl-ep-$1.status" tmp
  rm -f "$log"
  [ -n "$ep_bench" ] || { echo "notrun=no --ep-bench given" >"$st"; return 0; }
  make_shim || { echo "notrun=could not build the gethostname preload" >"$st"; return 0; }
  local mpirun="${MPIRUN:-$(command -v mpirun || echo /usr/lib/x86_64-linux-gnu/openmpi/bin/mpirun)}"
  [ -x "$mpirun" ] || { echo "notrun=no mpirun (set MPIRUN)" >"$st"; return 0; }
  local run_limit
  guarded_limit "$timeout_s" "$st" || { say "NCCL EP $shape: not run: $(sed -n 's/^notrun=//p' "$st")"; return 0; }
  tmp=$(mktemp -d "$out/nccl-ep-$1-XXXX")
  local ld="${nccl_lib:+$nccl_lib:}$(dirname "$ep_bench"):$(dirname "$ep_bench")/../lib:$cuda_root/lib64:${LD_LIBRARY_PATH:-}"
  local args=(-a "$algo" -t "$tokens" -d 7168 -k 8 -e 256 -S "$s" -w "$warmup" -i "$iters")
  [ $validate = 1 ] && args+=(-V)
  local x=(-x LD_LIBRARY_PATH="$ld" -x LD_PRELOAD="$shim" -x NCCL_NET_PLUGIN="$plugin" -x MPLANE_SOCKET_IFNAME=lo
           -x NCCL_SOCKET_IFNAME=lo -x NCCL_NVLS_ENABLE=0 -x NCCL_MULTI_RANK_GPU_ENABLE=1 -x CUDA_VISIBLE_DEVICES
           -x NCCL_DEBUG=INFO -x NCCL_DEBUG_SUBSYS=INIT,NET -x NCCL_DEBUG_FILE="$tmp/nccl.%h.%p.log")
  [ $mps = 1 ] && x+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
  say "NCCL EP $shape: mpirun -np 2 ... ep_bench ${args[*]} (limit ${run_limit}s)"
  local t0; t0=$(date +%s)
  run_step "$log" timeout -k 10 "$run_limit" "$mpirun" --allow-run-as-root -np 2 --oversubscribe --bind-to none "${x[@]}" \
    "$out/rank-wrap.sh" "$ep_bench" "${args[@]}"
  local rc=$?
  guard_after "NCCL EP $shape" $rc || say "NCCL EP $shape: $guard_why"
  echo "rc=$rc seconds=$(( $(date +%s) - t0 )) limit=$run_limit${guard_why:+ why=${guard_why// /_}}" >"$st"
  net_lines "$tmp" "NCCL EP $shape"
  rm -rf "$tmp"
}

# =============================== reading the logs ===============================
# a row: shape|library|variant|fmt|sms|layout_us|dispatch_us|dispatch_gbs|combine_us|combine_gbs|note
stat_get() { sed -n "s/.*\b$2=\([^ ]*\).*/\1/p" "$1" 2>/dev/null | head -1; }

parse_mplane() {
  local shape=$1 log="$out/mplane-$1.log" rc
  local notrun; notrun=$(sed -n 's/^notrun=//p' "$out/mplane-$shape.status" 2>/dev/null)
  if [ -n "$notrun" ]; then
    echo "$shape|libmplane-ep|node-limited|-|$sms|-|-|-|-|-|FAILED (not run: $notrun)" >>"$rows"
    return
  fi
  rc=$(stat_get "$out/mplane-$shape.status" rc)
  local ncclv; ncclv=$(grep -oE "NCCL [0-9]+, device" "$log" 2>/dev/null | head -1 | tr -dc '0-9')
  if [ "${rc:-x}" != 0 ] || ! grep -q "^| node-limited |" "$log" 2>/dev/null; then
    local why="exit ${rc:-?}"
    [ "$rc" = 124 ] || [ "$rc" = 137 ] && why="did not finish within $(stat_get "$out/mplane-$shape.status" limit)s"
    local gw; gw=$(stat_get "$out/mplane-$shape.status" why)
    [ -n "$gw" ] && why="$why; ${gw//_/ }; MPS restarted"
    echo "$shape|libmplane-ep|node-limited|-|$sms|-|-|-|-|-|FAILED ($why; see mplane-$shape.log)" >>"$rows"
    return
  fi
  # | name | fmt | SMs | layout | dispatch | combine | dispatch wire (net+nvl) | dispatch DeepEP | combine wire | combine DeepEP | cold |
  awk -F'|' -v shape="$shape" -v v="NCCL ${ncclv:-?}" '
    function t(s) { gsub(/^ +| +$/, "", s); return s }
    /^\| (node-limited|flat all-to-all \(baseline\)) \|/ {
      dw = t($8); sub(/ .*/, "", dw)
      printf "%s|libmplane-ep|%s|%s|%s|%s|%s|%s|%s|%s|wire %s / %s GB/s; %s\n", shape, t($2), t($3), t($4), t($5), t($6), t($9), t($7), t($11), dw, t($10), v
    }' "$log" >>"$rows"
}

parse_nccl_ep() {
  local shape=$1 algo=$2 s=$3 log="$out/nccl-ep-$1.log" st="$out/nccl-ep-$1.status" label
  [ "$algo" = ht ] && label="HT (-a ht)" || label="LL (-a ll)"
  local notrun rc secs limit
  notrun=$(sed -n 's/^notrun=//p' "$st" 2>/dev/null)
  if [ -n "$notrun" ] || [ ! -f "$st" ]; then
    echo "$shape|NCCL EP|$label|BF16|$s|-|-|-|-|-|not run: ${notrun:-no status file}" >>"$rows"
    return
  fi
  rc=$(stat_get "$st" rc); secs=$(stat_get "$st" seconds); limit=$(stat_get "$st" limit)
  local vnote=""
  if [ $validate = 1 ] || grep -qiE "validation: *(PASSED|FAILED)" "$log"; then
    vnote="; validation: $(grep -ciE "validation: *PASSED" "$log") passed, $(grep -ciE "validation: *FAILED" "$log") failed"
  fi
  local gw; gw=$(stat_get "$st" why)
  [ -n "$gw" ] && vnote="$vnote; ${gw//_/ }; MPS restarted"
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    local stage; stage=$(grep -E "ncclEpCreateGroup took|handle creation took|Starting benchmark|Tensors set up" "$log" | tail -1 | sed 's/^ *//')
    echo "$shape|NCCL EP|$label|BF16|$s|-|-|-|-|-|DID NOT FINISH within ${limit}s (killed; last step: ${stage:-none})" >>"$rows"
    return
  fi
  if [ "$rc" != 0 ]; then
    echo "$shape|NCCL EP|$label|BF16|$s|-|-|-|-|-|FAILED (exit $rc after ${secs}s; see nccl-ep-$shape.log)$vnote" >>"$rows"
    return
  fi
  local handle; handle=$(grep -oE "handle creation took [0-9.]+ ms" "$log" | awk '{s+=$4; n++} END {if (n) printf "%.1f", s/n}')
  # HT: "Dispatch:    total=X us" then "recv: total_bw=Y"; "Combine:     total=X us" then "send: total_bw=Y"
  # LL: "Dispatch (BF16):  avg=X us" / "Combine (BF16):   avg=X us", each followed by "throughput: avg=Y GB/s"
  awk -v shape="$shape" -v s="$s" -v h="${handle:--}" -v vn="$vnote" -v label="$label" '
    /^--- (BW based on kernel time|Kernel-only)/ { done = 1 }
    done { next }
    /^Dispatch(: +total=| \()/ { t = $0; sub(/.*(total|avg)=/, "", t); d = t + 0; want = "d" }
    /^Combine(: +total=| \()/ { t = $0; sub(/.*(total|avg)=/, "", t); c = t + 0; want = "c" }
    /^ +recv: total_bw=/ && want == "d" { t = $0; sub(/.*total_bw=/, "", t); dg = t + 0; want = "" }
    /^ +send: total_bw=/ && want == "c" { t = $0; sub(/.*total_bw=/, "", t); cg = t + 0; want = "" }
    /throughput: avg=/ && want != "" { t = $0; sub(/.*avg=/, "", t); if (want == "d") dg = t + 0; else cg = t + 0; want = "" }
    END {
      if (d > 0) printf "%s|NCCL EP|%s|BF16|%s|-|%.0f|%.1f|%.0f|%.1f|layout: the handle, made once (%s ms), not per iteration%s\n", shape, label, s, d, dg, c, cg, h, vn
      else printf "%s|NCCL EP|%s|BF16|%s|-|-|-|-|-|exit 0 but no summary in nccl-ep-%s.log%s\n", shape, label, s, shape, vn
    }' "$log" >>"$rows"
}

# =============================== main ===============================
IFS=, read -r -a shape_list <<<"$shapes"
for sh in "${shape_list[@]}"; do
  case "$sh" in ht|small) ;; *) die "--shapes: unknown shape '$sh' (ht, small)" ;; esac
done
if [ $from_logs = 0 ]; then
  prepare_run
  for sh in "${shape_list[@]}"; do
    case "$sh" in
      ht) run_mplane ht 4096; run_nccl_ep ht ht 4096 "$sms" ;;
      small) run_mplane small 128; run_nccl_ep small ll 128 "$ll_sms" ;;
    esac
  done
fi
for sh in "${shape_list[@]}"; do
  case "$sh" in
    ht) parse_mplane ht; parse_nccl_ep ht ht "$sms" ;;
    small) parse_mplane small; parse_nccl_ep small ll "$ll_sms" ;;
  esac
done

{
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
  echo "## libmplane-ep and NCCL EP, two emulated nodes on one GPU (${gpu:-GPU}, $(date -u +%Y-%m-%d))"
  echo
  echo "hidden 7168, top-8 of 256 experts; HT 4096 tokens per rank, small 128. us: libmplane-ep the max over ranks"
  echo "(GPU time, CUDA events), NCCL EP its average over ranks. GB/s as DeepEP counts: received tokens x row bytes"
  echo "(libmplane-ep) / NCCL EP's own byte count (HT: received tokens x 2H; LL: selections x 2H), over the time."
  echo
  echo "| shape | library | variant | dispatch fmt | SMs | layout us | dispatch us | dispatch GB/s | combine us | combine GB/s | note |"
  echo "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
  awk -F'|' '{ line = "|"; for (i = 1; i <= NF; i++) line = line " " $i " |"; print line }' "$rows"
  # FP8 against BF16 (libmplane-ep, HT), from the same run: wire bytes = wire GB/s x time
  awk -F'|' -v sms="$sms" '$1 == "ht" && $2 == "libmplane-ep" && $3 == "node-limited" && $5 == sms {
      split($11, w, " "); b = (w[2] + 0) * $7
      if ($4 == "FP8") { fu = $7; fb = b } else if ($4 == "BF16") { bu = $7; bb = b } }
    END { if (fb > 0 && bb > 0)
      printf "\nlibmplane-ep HT, %s SMs: FP8 dispatch sends %.3fx the wire bytes of BF16 (target <= 0.55) in %.0f us against %.0f us (%s)\n",
        sms, fb / bb, fu, bu, fu < bu ? "faster" : "NOT faster" }' "$rows"
  awk -F'|' -v sms="$sms" '$1 == "ht" && $5 == sms && $4 == "BF16" {
      if ($2 == "libmplane-ep" && $3 == "node-limited") { md = $7; mc = $9 }
      if ($2 == "NCCL EP" && $7 != "-") { nd = $7; nc = $9 } }
    END { if (md > 0 && nd > 0)
      printf "HT BF16, %s SMs: dispatch libmplane-ep %.0f us, NCCL EP %.0f us (NCCL EP / libmplane-ep %.2fx); combine %.0f us, %.0f us (%.2fx)\n",
        sms, md, nd, nd / md, mc, nc, nc / mc
      else if (md > 0) print "HT BF16: NCCL EP has no time (its row says why): libmplane-ep stands alone" }' "$rows"
  echo
  echo "NCCL's networks (from NCCL_DEBUG=INFO):"
  sed 's/^/  /' "$out/nccl-net.txt" 2>/dev/null
  echo
  sed 's/^ep-side-by-side: /  /' "$out/notes.txt"
} >"$table"
cat "$table"
exit 0
