# shellcheck shell=bash
# Sourced by the GPU scripts (bench-emulated-nodes.sh, ep-side-by-side.sh, ep-bench.sh): a run that
# hangs or leaves the GPU unusable must not take the runs after it, nor the script's time limit.
#
#   guard_init NAME BUDGET_S   start the clock; BUDGET_S 0: no limit on the script's total
#   guard_limit WANT           the seconds a run may take: WANT, or less where the budget ends
#                              sooner, less a reserve (a fifth of the budget, 60 s at most) for
#                              killing a run, probing, restarting MPS and the summary; 0: none left
#   guard_before WHAT          0 when the GPU can run WHAT: a probe makes a CUDA context and a
#                              buffer; where it fails the MPS daemon is restarted and the probe
#                              tried again; 1 (and guard_why says why) when it still fails
#   guard_after WHAT RC        after a run that ended with RC: one killed at its limit (124, 137)
#                              or one after which the probe fails gets the MPS daemon restarted;
#                              1 and guard_why when so (the run is to be reported failed with it)
#   guard_mps_start            start the MPS control daemon (CUDA_MPS_PIPE_DIRECTORY set by the
#                              caller); guard_mps_stop stops it; guard_mps=1 while this file runs one
#
# GUARD_PROBE replaces the probe (a command line, run with bash -c; exit 0: the GPU is usable), e.g.
# for tests of the scripts' control flow without a GPU. GUARD_PROBE_TIMEOUT (default 60) bounds it:
# a probe that hangs is a failed probe.
guard_t0=0 guard_budget=0 guard_name="" guard_why="" guard_mps=0

guard_init() {
  guard_name=$1 guard_budget=${2:-0} guard_t0=$(date +%s)
}

guard_elapsed() { echo $(($(date +%s) - guard_t0)); }

guard_limit() {
  local want=$1 reserve=$((guard_budget / 5)) left
  if [ "$guard_budget" -le 0 ]; then
    echo "$want"
    return
  fi
  [ $reserve -gt 60 ] && reserve=60
  left=$((guard_budget - $(guard_elapsed) - reserve))
  [ "$left" -lt 0 ] && left=0
  [ "$left" -lt "$want" ] && echo "$left" || echo "$want"
}

# The default probe: the driver itself (libcuda through python3's ctypes, no framework needed), as a
# process of the application would meet it - a context on GPU 0 (through the MPS server when one
# runs) and 1 MiB allocated and freed. "busy or unavailable" is CUDA error 46.
guard_probe_default() {
  python3 - <<'PY'
import ctypes, sys
try:
    cu = ctypes.CDLL("libcuda.so.1")
except OSError as e:
    sys.exit(f"no libcuda.so.1: {e}")
def check(what, r):
    if r != 0:
        s = ctypes.c_char_p()
        cu.cuGetErrorString(r, ctypes.byref(s))
        sys.exit(f"{what}: CUDA error {r} ({(s.value or b'?').decode()})")
dev, ctx, buf = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
check("cuInit", cu.cuInit(0))
check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), 0))
check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
check("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(buf), ctypes.c_size_t(1 << 20)))
check("cuMemFree", cu.cuMemFree_v2(buf))
check("cuDevicePrimaryCtxRelease", cu.cuDevicePrimaryCtxRelease_v2(dev))
PY
}

# guard_probe: 0 when the GPU is usable; else 1 with guard_why set from the probe's last line.
guard_probe() {
  local out rc
  if [ -n "${GUARD_PROBE:-}" ]; then
    out=$(timeout -k 5 "${GUARD_PROBE_TIMEOUT:-60}" bash -c "$GUARD_PROBE" 2>&1)
  else
    export -f guard_probe_default
    out=$(timeout -k 5 "${GUARD_PROBE_TIMEOUT:-60}" bash -c guard_probe_default 2>&1)
  fi
  rc=$?
  [ $rc -eq 0 ] && return 0
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && out="the probe did not end within ${GUARD_PROBE_TIMEOUT:-60}s"
  guard_why="GPU unusable: $(echo "${out:-probe exit $rc}" | tail -1)"
  return 1
}

guard_mps_start() {
  nvidia-cuda-mps-control -d && guard_mps=1
}

guard_mps_stop() {
  [ "$guard_mps" = 1 ] || return 0
  echo quit | timeout -k 5 20 nvidia-cuda-mps-control >/dev/null 2>&1
  guard_mps=0
  # a daemon started right after may find the old server still holding the GPU: wait (10 s at most)
  local i
  for i in $(seq 1 50); do pgrep -x nvidia-cuda-mps-server >/dev/null 2>&1 || break; sleep 0.2; done
}

# guard_mps_restart WHY: what a killed run or an unusable GPU gets (where this script runs MPS).
guard_mps_restart() {
  [ "$guard_mps" = 1 ] || return 0
  echo "$guard_name: restarting the MPS daemon ($1)"
  guard_mps_stop
  guard_mps_start || echo "$guard_name: the MPS daemon did not start again"
}

guard_before() {
  guard_why=""
  guard_probe && return 0
  local first=$guard_why
  guard_mps_restart "before $1: $first"
  guard_probe && return 0
  guard_why="$first (still after an MPS restart)"
  return 1
}

guard_after() {
  local what=$1 rc=$2
  guard_why=""
  if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
    guard_why="killed at its time limit"
    guard_mps_restart "$what was killed"
    return 1
  fi
  guard_probe && return 0
  guard_mps_restart "after $what: $guard_why"
  guard_why="left the GPU unusable ($guard_why)"
  return 1
}
