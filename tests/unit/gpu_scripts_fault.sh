#!/usr/bin/env bash
# The GPU scripts survive a fault (scripts/gpu-guard.sh), checked without a GPU: nvidia-smi,
# nvidia-cuda-mps-control, mpirun, the nccl-tests binary, ep_bench and mplane-ep-bench are stubs, and
# the GPU probe (GUARD_PROBE) fails while a stub run has left the "GPU" broken - until the MPS daemon
# is restarted (the stub's quit repairs it) or for good (a dead GPU). Each stub run does what a plan
# file says, one line per run: ok, hang (past its limit), break (exits with the driver's "busy or
# unavailable" and leaves the GPU unusable) or dead (the same, and no MPS restart repairs it).
#
# Asserted: a run killed at its limit and one that left the GPU unusable are reported failed with
# their reason, the MPS daemon is restarted after each, the runs after them still run and their rows
# are in the summary, a GPU that stays unusable fails the later runs with the probe's answer (not a
# hang), and with a budget the script's total stays inside it and the summary of what finished is
# printed.
#
#   gpu_scripts_fault.sh SOURCE_ROOT [bench|budget|side-by-side|ep-bench]   (default: all four)
#   gpu_scripts_fault.sh SOURCE_ROOT probe LIBFAKECUDA    the default probe against the CUDA stand-in
set -uo pipefail
root=$1
which=${2:-all}
T=$(mktemp -d /tmp/mplane-gpu-fault.XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# ---------------------------------------------------------------- the stubs
mkdir -p "$T/bin" "$T/tests" "$T/state"
export STATE="$T/state" PATH="$T/bin:$PATH"
cat >"$T/bin/nvidia-smi" <<'EOF'
#!/bin/sh
case "$*" in
  -L) echo "GPU 0: Stub GPU (UUID: GPU-0)"; echo "GPU 1: Stub GPU (UUID: GPU-1)" ;;
  *query-gpu*) echo "Stub GPU" ;;
  *) echo "stub nvidia-smi" ;;
esac
EOF
cat >"$T/bin/nvidia-cuda-mps-control" <<'EOF'
#!/bin/sh
# -d: start the daemon; else a command on stdin (quit: the daemon and its server go, a broken GPU with them)
if [ "${1:-}" = -d ]; then echo start >>"$STATE/mps.log"; exit 0; fi
read -r cmd
echo "$cmd" >>"$STATE/mps.log"
[ "$cmd" = quit ] && rm -f "$STATE/broken"
exit 0
EOF
# mpirun: exports each -x VAR=VALUE, drops the other options, runs the program with its arguments
cat >"$T/bin/mpirun" <<'EOF'
#!/bin/bash
while [ $# -gt 0 ]; do
  case "$1" in
    -x) case "$2" in *=*) export "$2" ;; esac; shift 2 ;;
    -np|--bind-to) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
export OMPI_COMM_WORLD_RANK=0
exec "$@"
EOF
# the next line of the plan (ok when it has no more)
cat >"$T/bin/plan-next" <<'EOF'
#!/bin/sh
n=$(( $(cat "$STATE/n" 2>/dev/null || echo 0) + 1 ))
echo $n >"$STATE/n"
a=$(sed -n "${n}p" "$STATE/plan")
echo "${a:-ok}"
EOF
# a stub run: what the plan says, then (ok) the output its script parses
cat >"$T/bin/stub-run" <<'EOF'
#!/bin/bash
kind=$1
case "$(plan-next)" in
  hang) exec sleep 1000 ;;
  break) touch "$STATE/broken"; echo "CUDA error: CUDA-capable device(s) is/are busy or unavailable"; exit 1 ;;
  dead) touch "$STATE/broken" "$STATE/dead"; echo "CUDA error: CUDA-capable device(s) is/are busy or unavailable"; exit 1 ;;
esac
case "$kind" in
  perf) echo "# NCCL INFO Using network ${NCCL_NET:-mplane}"
        echo "           8             2     float    none      -1    30.1    0.00    0.00      0    29.9    0.00    0.00      0" ;;
  mplane-ep) echo "NCCL 23003, device 0"
             echo "| node-limited | FP8 | 24 | 10 | 2500 | 4800 | 10.0 (net+nvl) | 12.0 | 9.0 | 11.0 | 1 |" ;;
  ep_bench) echo "Dispatch:    total=6000 us"; echo "  recv: total_bw=5.0"
            echo "Combine:     total=17000 us"; echo "  send: total_bw=4.0"; echo "validation: PASSED" ;;
esac
exit 0
EOF
printf '#!/bin/sh\nexec stub-run perf "$@"\n' >"$T/tests/alltoall_perf"
chmod +x "$T/bin/"* "$T/tests/alltoall_perf"
export GUARD_PROBE='if [ -e "$STATE/broken" ] || [ -e "$STATE/dead" ]; then echo "cuDevicePrimaryCtxRetain: CUDA error 46 (CUDA-capable device(s) is/are busy or unavailable)"; exit 1; fi'
plugin="$T/libnccl-net-mplane.so"
: >"$plugin"

start() { # start PLAN...: a fresh state with this plan
  rm -f "$STATE"/*
  printf '%s\n' "$@" >"$STATE/plan"
}
has() { grep -qE "$2" "$1" || fail "$3 (no line matching '$2' in $1)"; }
restarts() { echo $(($(grep -c '^start' "$STATE/mps.log" 2>/dev/null) - 1)); } # daemon starts after the first

# ---------------------------------------------------------------- bench-emulated-nodes.sh
# Six runs (3 rounds of mplane and Socket): the 2nd hangs past its 3 s limit, the 3rd leaves the GPU
# unusable; the others run and are in the summary.
case "$which" in all|bench)
  start ok hang break ok ok ok
  t0=$(date +%s)
  NCCL_TESTS_DIR="$T/tests" MPIRUN="$T/bin/mpirun" "$root/scripts/bench-emulated-nodes.sh" --plugin "$plugin" \
    --tests alltoall --time "-b 8 -e 8" --bw "" --warmup "" --rounds 3 --run-timeout 2 --budget 120 \
    --out "$T/bench" >"$T/bench.out" 2>&1
  rc=$? took=$(($(date +%s) - t0))
  cat "$T/bench.out"
  [ $rc = 1 ] || fail "bench-emulated-nodes: exit $rc, expected 1 (runs failed)"
  [ $took -le 30 ] || fail "bench-emulated-nodes: took ${took}s (2 s hang limit, 6 short runs)"
  has "$T/bench.out" "FAIL: socket alltoall round 1: did not finish within 2s: killed at its time limit" "the hang is reported"
  has "$T/bench.out" "FAIL: mplane alltoall round 2: left the GPU unusable \(GPU unusable: .*busy or unavailable" "the broken GPU is reported"
  has "$T/bench.out" "runs failed or not run \(2\)" "the summary lists the failed runs"
  has "$T/bench.out" "^ *8 B +[0-9.]+ +[0-9.]+ +1\.00x .* [0-9]/1$" "the summary has the runs that finished (round 3 paired)"
  [ "$(restarts)" = 2 ] || fail "bench-emulated-nodes: $(restarts) MPS restarts, expected 2 (after the hang, after the break)"
  [ "$(cat "$STATE/n")" = 6 ] || fail "bench-emulated-nodes: $(cat "$STATE/n") runs, expected all 6"
  # a GPU that no restart repairs: the runs after it fail at once with the probe's answer
  start ok dead
  NCCL_TESTS_DIR="$T/tests" MPIRUN="$T/bin/mpirun" "$root/scripts/bench-emulated-nodes.sh" --plugin "$plugin" \
    --tests alltoall --time "-b 8 -e 8" --bw "" --warmup "" --rounds 2 --run-timeout 3 \
    --out "$T/bench2" >"$T/bench2.out" 2>&1
  cat "$T/bench2.out"
  has "$T/bench2.out" "FAIL: mplane alltoall round 2: not run: GPU unusable: .*\(still after an MPS restart\)" "a dead GPU fails the later runs"
  [ "$(cat "$STATE/n")" = 2 ] || fail "bench-emulated-nodes: a run was started on a dead GPU"
  ;;
esac

# Every run hangs: with --budget 10 the script ends inside it, the runs past it reported not run.
case "$which" in all|budget)
  start hang hang hang hang hang hang
  t0=$(date +%s)
  NCCL_TESTS_DIR="$T/tests" MPIRUN="$T/bin/mpirun" "$root/scripts/bench-emulated-nodes.sh" --plugin "$plugin" \
    --tests alltoall --time "-b 8 -e 8" --bw "" --warmup "" --rounds 3 --run-timeout 2 --budget 10 \
    --out "$T/budget" >"$T/budget.out" 2>&1
  took=$(($(date +%s) - t0))
  cat "$T/budget.out"
  [ $took -le 10 ] || fail "bench-emulated-nodes --budget 10: took ${took}s"
  has "$T/budget.out" "did not finish within 2s: killed at its time limit" "the runs inside the budget ran"
  has "$T/budget.out" "not run: the budget \(10s\) was spent" "runs past the budget are reported not run"
  has "$T/budget.out" "runs failed or not run \(6\)" "the summary is printed"
  ;;
esac

# ---------------------------------------------------------------- ep-side-by-side.sh
# libmplane-ep HT hangs past its limit (killed, MPS restarted), NCCL EP HT leaves the GPU unusable;
# both small shapes still run and have their rows.
case "$which" in all|side-by-side)
  mkdir -p "$T/ep/collectives/ep"
  printf '#!/bin/sh\nexec stub-run mplane-ep "$@"\n' >"$T/ep/collectives/ep/mplane-ep-bench"
  printf '#!/bin/sh\nexec stub-run ep_bench "$@"\n' >"$T/ep/ep_bench"
  chmod +x "$T/ep/collectives/ep/mplane-ep-bench" "$T/ep/ep_bench"
  cp "$plugin" "$T/ep/libnccl-net-mplane.so"
  start hang break ok ok
  t0=$(date +%s)
  EP_BUILD="$T/ep" MPIRUN="$T/bin/mpirun" "$root/scripts/ep-side-by-side.sh" --no-build --ep-bench "$T/ep/ep_bench" \
    --mplane-timeout 3 --timeout 3 --budget 100 --out "$T/sbs" >"$T/sbs.out" 2>&1
  rc=$? took=$(($(date +%s) - t0))
  cat "$T/sbs.out"
  [ $rc = 0 ] || fail "ep-side-by-side: exit $rc"
  [ $took -le 30 ] || fail "ep-side-by-side: took ${took}s"
  has "$T/sbs.out" "^\| ht \| libmplane-ep .*FAILED \(did not finish within 3s; killed at its time limit; MPS restarted" "the hung libmplane-ep run"
  has "$T/sbs.out" "^\| ht \| NCCL EP .*FAILED \(exit 1 .*left the GPU unusable .*MPS restarted" "the NCCL EP run that broke the GPU"
  has "$T/sbs.out" "^\| small \| libmplane-ep \| node-limited \| FP8 \| 24 \| 10 \| 2500 " "libmplane-ep small still ran"
  has "$T/sbs.out" "^\| small \| NCCL EP \| LL \(-a ll\) \| BF16 \| 32 \| - \| 6000 " "NCCL EP small still ran"
  [ "$(restarts)" = 2 ] || fail "ep-side-by-side: $(restarts) MPS restarts, expected 2"
  ;;
esac

# ---------------------------------------------------------------- ep-bench.sh
# node1 hangs past EP_TIMEOUT; node2 still runs and passes.
case "$which" in all|ep-bench)
  mkdir -p "$T/epb"
  printf '#!/bin/sh\nexec stub-run mplane-ep "$@"\n' >"$T/epb/mplane-ep-bench"
  chmod +x "$T/epb/mplane-ep-bench"
  start hang ok
  t0=$(date +%s)
  EP_BENCH_BIN="$T/epb/mplane-ep-bench" EP_TIMEOUT=2 EP_BUDGET=60 OUT="$T/epb-out" EP_BUILD="$T/epb" \
    "$root/scripts/ep-bench.sh" node1 node2 >"$T/epb.out" 2>&1
  rc=$? took=$(($(date +%s) - t0))
  cat "$T/epb.out"
  [ $rc = 1 ] || fail "ep-bench: exit $rc, expected 1 (node1 failed)"
  [ $took -le 30 ] || fail "ep-bench: took ${took}s"
  has "$T/epb.out" "node1: FAILED: killed at its time limit \(exit 124 after a limit of 2s\)" "the hung shape"
  has "$T/epb.out" "node2: exit 0" "node2 still ran"
  [ "$(cat "$STATE/n")" = 2 ] || fail "ep-bench: $(cat "$STATE/n") runs, expected 2"
  ;;
esac

# ---------------------------------------------------------------- the default probe
# scripts/gpu-guard.sh's own probe (libcuda through python3's ctypes) against the CUDA stand-in as
# libcuda.so.1: it passes with a device, and fails naming the driver's error without one.
case "$which" in probe)
  fake=${3:?probe needs the path of libfakecuda.so}
  mkdir -p "$T/lib" && ln -s "$fake" "$T/lib/libcuda.so.1"
  out=$(unset GUARD_PROBE; export LD_LIBRARY_PATH="$T/lib"; . "$root/scripts/gpu-guard.sh"; guard_probe && echo usable || echo "$guard_why")
  [ "$out" = usable ] || fail "the probe on a working stand-in GPU: $out"
  out=$(unset GUARD_PROBE; export LD_LIBRARY_PATH="$T/lib" MPLANE_FAKE_CUDA_DEVICES=0; . "$root/scripts/gpu-guard.sh"; guard_probe && echo usable || echo "$guard_why")
  [[ "$out" == "GPU unusable: cuDeviceGet: CUDA error 101"* ]] || fail "the probe without a device: '$out'"
  echo "probe without a device: $out"
  ;;
esac

[ $fails = 0 ] && echo "gpu_scripts_fault: all checks passed" || echo "gpu_scripts_fault: $fails checks failed"
[ $fails = 0 ]
