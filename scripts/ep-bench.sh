#!/usr/bin/env bash
# libmplane-ep on a GPU machine: build it, then run mplane-ep-bench on two shapes, in one go:
#   node1: one node of 2 GPUs (NVLink phase only);
#   node2: two emulated nodes of 1 GPU each (NCCL_HOSTID differs, so NCCL carries the network
#          phase through the net plugin - mplane's socket transport over loopback - and the
#          plugin's byte counters are checked against the model). Where only one GPU is visible
#          both nodes run on it (mplane-ep-bench --share-gpus, under an MPS daemon this script
#          starts with a pipe directory of its own and stops at the end); node1 is then skipped.
# Each shape runs the correctness checks (GPU vs the CPU reference model), the byte check (node2)
# and the DeepSeek-V3-shaped benchmark beside the flat all-to-all baseline and the peer-copy ceiling.
#
#   scripts/ep-bench.sh [all|build|node1|node2] ...   (default: all)
#   scripts/ep-bench.sh prepare     (on the development machine, not the GPU one: copies the built
#                                    net plugin with its libhwloc, and nccl.h, into .deps/ - ignored
#                                    by git - for a GPU machine whose image cannot build them; then
#                                    copy .deps along with the tree to that machine)
#
# Results go to $OUT (an output folder the caller names) when set, else build-ep-dev/ep-bench-out: ep-bench.txt (the
# tables), build.log, node1.log, node2.log, nccl-net.txt (which network NCCL used), stats.txt.
# Environment:
#   NCCL_HOME      folder with include/nccl.h and lib/libnccl.so* (default: searched)
#   EP_BUILD       build folder (default build-ep-dev)
#   EP_PLUGIN_DIR  folder holding a prebuilt libnccl-net-mplane.so (used when the meson build of
#                  the whole project is not possible here, e.g. no hwloc or cmocka headers)
#   EP_ARGS        extra mplane-ep-bench arguments (e.g. "--iters 10 --sms 0")
#   EP_TIMEOUT     seconds per shape at most (default 270)
#   EP_BUDGET      seconds for the whole script (default 570: inside a 10-minute limit per command);
#                  a shape gets what is left, and is skipped with a message under 60 s (or under
#                  EP_TIMEOUT, where that is shorter)
#   EP_BENCH_BIN   a built mplane-ep-bench: no build step (its folder holds libmplane-ep.so; the
#                  plugin from EP_PLUGIN_DIR, else none)
# Before each shape a probe makes a CUDA context on the GPU (scripts/gpu-guard.sh); where it fails the
# MPS daemon (when this script started one) is restarted, and a GPU still unusable fails that shape
# with the probe's answer. A shape killed at its limit, or one after which the probe fails, gets the
# MPS daemon restarted and is reported failed with that reason; the next shape still runs.
#   EP_NVCC_FLAGS  extra nvcc flags for the kernels (builds directly, without meson), e.g.
#                  -DMP_EP_TRACE: every fused dispatch prints when its pack, link and unpack blocks ended
#                  and how many tokens / link batches / rows each finished per 10 us
#
#   scripts/ep-bench.sh sweep "VAR=V[,VAR=V...]" ...   the one-node benchmark once per setting (bench
#                  mode, EP_ARGS added; default --sms 0 --nvlink-direct --token-rows), printing its
#                  table rows; e.g. sweep MPLANE_EP_LINK_SMS=16 MPLANE_EP_LINK_SMS=32,MPLANE_EP_RECV_SMS=8
# NCCL_NVLS_ENABLE=0 is always set.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
what=("$@")
[ ${#what[@]} -eq 0 ] && what=(all)
build="${EP_BUILD:-$here/build-ep-dev}"
case "$build" in /*) ;; *) build="$here/$build" ;; esac
out="${OUT:-$build/ep-bench-out}"
mkdir -p "$out"
shape_timeout="${EP_TIMEOUT:-270}"
budget="${EP_BUDGET:-570}"
t_start=$(date +%s)
export NCCL_NVLS_ENABLE=0
export PATH="/usr/local/cuda/bin:$PATH"
results="$out/ep-bench.txt"
# shellcheck source=scripts/gpu-guard.sh
. "$here/scripts/gpu-guard.sh"
guard_init ep-bench "$budget"
guard_t0=$t_start

say() { echo "ep-bench: $*" | tee -a "$results"; }

# ---- NCCL: header and library ----
find_nccl() {
  local cands=()
  [ -n "${NCCL_HOME:-}" ] && cands+=("$NCCL_HOME")
  cands+=("$here/.deps/nccl" /usr/local/cuda /usr /usr/local)
  local py
  for py in python3 /opt/torch/.venv/bin/python3; do
    local d
    d=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "nccl"))' 2>/dev/null) && cands+=("$d")
  done
  cands+=(/opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl)
  NCCL_INC=""; NCCL_LIB=""
  for d in "${cands[@]}"; do
    if [ -z "$NCCL_INC" ] && [ -f "$d/include/nccl.h" ]; then NCCL_INC="$d/include"; NCCL_HOME_FOUND="$d"; fi
  done
  # a bare nccl.h carried in .deps/<something>/ (other scripts carry one that way)
  if [ -z "$NCCL_INC" ]; then
    for h in "$here"/.deps/*/nccl.h; do
      [ -f "$h" ] || continue
      mkdir -p "$build/nccl-inc/include" && cp "$h" "$build/nccl-inc/include/" &&
        { NCCL_INC="$build/nccl-inc/include"; NCCL_HOME_FOUND="$build/nccl-inc"; break; }
    done
  fi
  for d in "${NCCL_HOME_FOUND:-/nonexistent}" "${cands[@]}" /usr/lib/x86_64-linux-gnu; do
    for l in lib/libnccl.so lib64/libnccl.so lib/x86_64-linux-gnu/libnccl.so libnccl.so \
             lib/libnccl.so.2 lib64/libnccl.so.2 lib/x86_64-linux-gnu/libnccl.so.2 libnccl.so.2; do
      if [ -z "$NCCL_LIB" ] && [ -f "$d/$l" ]; then NCCL_LIB="$d/$l"; fi
    done
  done
}

cuda_lib() {
  local root
  root="$(dirname "$(dirname "$(command -v nvcc)")")"
  for l in lib64 lib targets/x86_64-linux/lib; do
    [ -f "$root/$l/libcudart.so" ] && { echo "$root/$l"; return; }
  done
  echo "$root/lib64"
}

env_report() {
  say "date $(date -u +%Y-%m-%dT%H:%MZ), host $(hostname)"
  nvidia-smi -L 2>&1 | sed 's/^/ep-bench:   /' | tee -a "$results"
  nvidia-smi topo -m 2>&1 | head -6 | sed 's/^/ep-bench:   /' | tee -a "$results"
  say "nvcc: $(nvcc --version 2>&1 | tail -1)"
  say "NCCL header: ${NCCL_INC:-none} ($(grep -hE '#define NCCL_(MAJOR|MINOR|PATCH)' "${NCCL_INC:-/x}/nccl.h" 2>/dev/null | awk '{printf "%s.", $3}')) library: ${NCCL_LIB:-none}"
  say "meson: $(meson --version 2>&1 | head -1), ninja: $(ninja --version 2>&1 | head -1)"
}

# ---- build ----
BENCH=""; EPLIB_DIR=""; PLUGIN_DIR=""
direct_build() {
  # libmplane-ep and the launcher without meson (needs only nvcc, a C compiler and NCCL)
  local d="$build/direct" ep="$here/collectives/ep" cl
  cl="$(cuda_lib)"
  mkdir -p "$d"
  local inc=(-I"$ep" -I"$ep/bench" -I"$(dirname "$(command -v nvcc)")/../include" -I"$NCCL_INC")
  set -x
  # shellcheck disable=SC2086
  nvcc -std=c++17 -O2 -Xcompiler -fPIC "-gencode=arch=compute_90,code=[sm_90,compute_90]" ${EP_NVCC_FLAGS:-} "${inc[@]}" \
    -c "$ep/ep_kernels.cu" -o "$d/ep_kernels.o" &&
  cc -std=gnu11 -O2 -g -fPIC -ffp-contract=off -D_GNU_SOURCE "${inc[@]}" -c "$ep/ep_host.c" -o "$d/ep_host.o" &&
  cc -std=gnu11 -O2 -g -fPIC -ffp-contract=off -D_GNU_SOURCE "${inc[@]}" -c "$ep/ep_sched.c" -o "$d/ep_sched.o" &&
  cc -shared -o "$d/libmplane-ep.so" "$d/ep_kernels.o" "$d/ep_host.o" "$d/ep_sched.o" \
    -L"$cl" -lcudart "$NCCL_LIB" -lstdc++ -Wl,-rpath,"$cl" -Wl,-rpath,"$(dirname "$NCCL_LIB")" &&
  # -g -rdynamic: a crashing rank prints a backtrace with function names (mplane_ep_bench.c)
  cc -std=gnu11 -O2 -g -rdynamic -ffp-contract=off -D_GNU_SOURCE "${inc[@]}" -o "$d/mplane-ep-bench" \
    "$ep/bench/mplane_ep_bench.c" "$ep/bench/bench_run.c" "$ep/ep_model.c" "$ep/ep_check.c" "$ep/ep_ref.c" \
    -L"$d" -lmplane-ep -L"$cl" -lcudart "$NCCL_LIB" -lm -lpthread \
    -Wl,-rpath,"$d" -Wl,-rpath,"$cl" -Wl,-rpath,"$(dirname "$NCCL_LIB")"
  local rc=$?
  set +x
  [ $rc -eq 0 ] && BENCH="$d/mplane-ep-bench" && EPLIB_DIR="$d"
  return $rc
}

do_build() {
  find_nccl
  env_report
  if [ -z "$NCCL_INC" ] || [ -z "$NCCL_LIB" ]; then
    say "FAIL: no NCCL header/library found. Set NCCL_HOME, or carry one: mkdir -p .deps/nccl/include .deps/nccl/lib &&"
    say "      cp /usr/local/cuda/include/nccl.h .deps/nccl/include/ (on the dev machine; .deps is ignored by git; name .deps in carry)"
    return 1
  fi
  export NCCL_HOME="$NCCL_HOME_FOUND"
  if [ -z "${EP_NVCC_FLAGS:-}" ]; then
    echo "== meson setup $build (whole project) =="
    if [ ! -f "$build/build.ninja" ]; then meson setup "$build" "$here"; fi && ninja -C "$build"
  else
    echo "== EP_NVCC_FLAGS=$EP_NVCC_FLAGS: building libmplane-ep directly =="
  fi >"$out/build.log" 2>&1
  if [ -z "${EP_NVCC_FLAGS:-}" ] && [ -x "$build/collectives/ep/mplane-ep-bench" ]; then
    BENCH="$build/collectives/ep/mplane-ep-bench"
    EPLIB_DIR="$build/collectives/ep"
    say "built with meson: $BENCH"
  else
    say "meson build of the whole project failed (see build.log: often missing hwloc/cmocka headers); building libmplane-ep directly"
    if direct_build >>"$out/build.log" 2>&1; then say "built directly: $BENCH"
    else say "FAIL: direct build failed, see build.log"; tail -30 "$out/build.log"; return 1; fi
  fi
  # the first plugin whose libraries all resolve here
  for d in ${EP_PLUGIN_DIR:+"$EP_PLUGIN_DIR"} "$build" "$here/.deps/ep-plugin" "$here/build"; do
    [ -f "$d/libnccl-net-mplane.so" ] || continue
    if LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" ldd "$d/libnccl-net-mplane.so" | grep -q "not found"; then
      say "net plugin $d/libnccl-net-mplane.so: $(LD_LIBRARY_PATH="$d:${LD_LIBRARY_PATH:-}" ldd "$d/libnccl-net-mplane.so" | grep "not found" | tr -s ' \t' ' ' | tr '\n' ';') - skipped"
      continue
    fi
    PLUGIN_DIR="$d"
    break
  done
  if [ -n "$PLUGIN_DIR" ]; then say "net plugin: $PLUGIN_DIR/libnccl-net-mplane.so"
  else say "net plugin: NOT available - the two-node shape will use NCCL's own Socket transport and has no plugin counters"; fi
  return 0
}

# ---- GPUs: how many are visible; with one, node2 shares it under MPS ----
visible_gpus() {
  local n
  if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    n=$(tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .)
  else
    n=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
  fi
  echo "${n:-0}"
}
MPS_STARTED=0
start_mps() {
  [ "$MPS_STARTED" = 1 ] && return 0
  if ! command -v nvidia-cuda-mps-control >/dev/null 2>&1; then
    say "no nvidia-cuda-mps-control: the two ranks time-slice the GPU (checks hold; times are not meaningful)"
    return 0
  fi
  export CUDA_MPS_PIPE_DIRECTORY="$out/mps-pipe" CUDA_MPS_LOG_DIRECTORY="$out/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  if guard_mps_start; then
    MPS_STARTED=1
    trap guard_mps_stop EXIT
    say "MPS control daemon started (pipe directory $CUDA_MPS_PIPE_DIRECTORY)"
  else
    say "nvidia-cuda-mps-control -d failed: the two ranks time-slice the GPU"
  fi
}

# ---- a shape ----
run_shape() {
  local name=$1 nodes=$2
  local left=$((budget - ($(date +%s) - t_start)))
  local limit=$shape_timeout
  [ "$left" -lt "$limit" ] && limit=$left
  local least=60
  [ "$shape_timeout" -lt "$least" ] && least=$shape_timeout
  if [ "$limit" -lt "$least" ]; then
    say "---- $name: SKIPPED: only ${left}s of the ${budget}s budget left (run 'scripts/ep-bench.sh $name' on its own)"
    return 1
  fi
  local tmp; tmp="$(mktemp -d /tmp/ep-bench-XXXXXX)"
  local env=(LD_LIBRARY_PATH="$EPLIB_DIR:${PLUGIN_DIR:+$PLUGIN_DIR:}$(dirname "$NCCL_LIB"):$(cuda_lib):${LD_LIBRARY_PATH:-}"
             NCCL_NVLS_ENABLE=0 NCCL_DEBUG=INFO NCCL_DEBUG_SUBSYS=INIT,NET NCCL_DEBUG_FILE="$tmp/nccl.%h.%p.log"
             NCCL_SOCKET_IFNAME=lo MPLANE_SOCKET_IFNAME=lo)
  local args=(--gpus 2 --nodes "$nodes" --mode all --out "$results" --timeout $((limit > 30 ? limit - 15 : limit)))
  local ngpu; ngpu=$(visible_gpus)
  if [ "$ngpu" -lt 2 ]; then
    if [ "$nodes" -lt 2 ]; then
      say "---- $name: SKIPPED: $ngpu GPU visible; one node of 2 GPUs needs 2 (NCCL refuses two ranks of one host on one GPU)"
      return 0
    fi
    start_mps
    args+=(--share-gpus)
    say "$name: $ngpu GPU visible: both emulated nodes run on it (--share-gpus)"
  fi
  if [ -n "$PLUGIN_DIR" ]; then
    env+=(NCCL_NET_PLUGIN=mplane)
    [ "$nodes" -gt 1 ] && args+=(--stats-file "$tmp/stats-%p.json")
  else
    env+=(NCCL_NET_PLUGIN=none)
  fi
  # shellcheck disable=SC2206
  args+=(${EP_ARGS:-})
  if ! guard_before "$name"; then
    say "---- $name: FAILED: not run: $guard_why"
    return 1
  fi
  say "---- $name: $nodes node(s), $(env "${env[@]}" sh -c 'echo NCCL_NET_PLUGIN=$NCCL_NET_PLUGIN'); $BENCH ${args[*]}"
  echo "## $name" >>"$results"
  env "${env[@]}" timeout -k 5 "$limit" "$BENCH" "${args[@]}" >"$out/$name.log" 2>&1
  local rc=$?
  cat "$out/$name.log"
  guard_after "$name" $rc || say "$name: FAILED: $guard_why (exit $rc after a limit of ${limit}s)"
  { echo "== $name =="; grep -hE "Using network|NET/(Plugin|mplane|Socket|IB)|NCCL_NET|Loaded net plugin|Failed to load|WARN" "$tmp"/nccl.*.log 2>/dev/null | sed -E 's/^[^ ]+ [0-9]+:[0-9]+ //' | sort | uniq -c | sort -rn | head -60; } >>"$out/nccl-net.txt"
  { for f in "$tmp"/stats-*.json; do [ -f "$f" ] && { echo "== $name $f"; cat "$f"; }; done; } >>"$out/stats.txt" 2>/dev/null
  local net; net=$(grep -hoE "Using network [A-Za-z0-9_]+" "$tmp"/nccl.*.log 2>/dev/null | sort -u | tr '\n' ' ')
  say "$name: exit $rc; NCCL says: ${net:-no network used (intra-node only)}"
  rm -rf "$tmp"
  return $rc
}

prepare() {
  local so=""
  for d in "$build" "$here/build" "$here"/build-*; do
    [ -f "$d/libnccl-net-mplane.so" ] && { so="$d/libnccl-net-mplane.so"; break; }
  done
  [ -n "$so" ] || { echo "prepare: build the project first (meson setup build && ninja -C build)"; return 1; }
  mkdir -p "$here/.deps/ep-plugin" "$here/.deps/nccl/include"
  cp -L "$so" "$here/.deps/ep-plugin/"
  # hwloc and what it needs (libudev), which GPU images tend to lack; glibc itself stays
  ldd "$so" | awk '/libhwloc|libudev/ {print $3}' | xargs -r -I{} cp -L {} "$here/.deps/ep-plugin/"
  for h in /usr/local/cuda/include/nccl.h /usr/include/nccl.h /usr/local/include/nccl.h; do
    [ -f "$h" ] && { cp "$h" "$here/.deps/nccl/include/"; break; }
  done
  ls -la "$here/.deps/ep-plugin" "$here/.deps/nccl/include"
  echo "prepare: done; copy .deps/ep-plugin and .deps/nccl to the GPU machine with the tree (found there by this script)"
}

# One-node benchmark once per setting: each argument is VAR=V[,VAR=V...].
sweep() {
  [ $# -gt 0 ] || { echo "ep-bench.sh sweep: give settings, e.g. MPLANE_EP_LINK_SMS=16 MPLANE_EP_LINK_SMS=32" >&2; return 2; }
  local base="${EP_ARGS:---sms 0 --nvlink-direct --token-rows}" s kv rc=0
  for s in "$@"; do
    local vars=()
    IFS=, read -r -a vars <<<"$s"
    for kv in "${vars[@]}"; do
      [[ "$kv" =~ ^[A-Z_][A-Z0-9_]*=.*$ ]] || { echo "ep-bench.sh sweep: '$kv' (in '$s') is not VAR=VALUE" >&2; return 2; }
    done
  done
  if [ -z "$BENCH" ]; then do_build || return 1; fi
  for s in "$@"; do
    local vars=()
    IFS=, read -r -a vars <<<"$s"
    say "---- sweep $s"
    ( export "${vars[@]}"; EP_ARGS="--mode bench $base"; run_shape node1 1 ) >/dev/null 2>&1 || rc=1
    grep -E "^\| node-limited|wire rate" "$out/node1.log" | sed "s|^|[$s] |" | tee -a "$results"
  done
  return $rc
}

rc=0
if [ -n "${EP_BENCH_BIN:-}" ]; then
  [ -x "$EP_BENCH_BIN" ] || { echo "ep-bench.sh: EP_BENCH_BIN '$EP_BENCH_BIN' is not an executable file" >&2; exit 2; }
  find_nccl
  BENCH="$EP_BENCH_BIN" EPLIB_DIR="$(dirname "$EP_BENCH_BIN")" PLUGIN_DIR="${EP_PLUGIN_DIR:-}"
fi
if [ "${what[0]}" = prepare ]; then prepare; exit $?; fi
: >"$results"
if [ "${what[0]}" = sweep ]; then sweep "${what[@]:1}"; rc=$?; say "done: $([ $rc -eq 0 ] && echo PASS || echo FAIL)"; exit $rc; fi
for w in "${what[@]}"; do
  case "$w" in
    build) do_build || rc=1 ;;
    node1|node2|all)
      if [ -z "$BENCH" ]; then do_build || { rc=1; break; }; fi
      if [ "$w" = all ] || [ "$w" = node1 ]; then run_shape node1 1 || rc=1; fi
      if [ "$w" = all ] || [ "$w" = node2 ]; then run_shape node2 2 || rc=1; fi ;;
    *) echo "ep-bench.sh: unknown step '$w' (all, build, node1, node2)" >&2; exit 2 ;;
  esac
done
say "done: $([ $rc -eq 0 ] && echo PASS || echo FAIL)"
exit $rc
