#!/usr/bin/env bash
# The IB transport on real kernel verbs: soft-RoCE (rdma_rxe) with rdma-core's libibverbs and rxe
# provider. Runs INSIDE the VM that scripts/rxe-vm.sh boots (rxe0 on veth0 198.18.0.1, rxe1 on veth1
# 198.18.0.2, traffic between them crossing the veth pair):
#
#   scripts/rxe-vm.sh run -- tests/rxe/suite.sh BUILD_DIR      (meson test -C BUILD_DIR --suite rxe)
#
# Steps, each with a PASS/FAIL summary line and its seconds at the end:
#   devices    ibv_devinfo of rxe0 and rxe1 (both PORT_ACTIVE)
#   planes     both ports in one process: the RoCE subnet probe between them (real kernel verbs, RoCE
#              v2 over the veth pair) finds one subnet, so they are one plane, rails 0 and 1
#   perftest   ib_write_bw rxe1 -> rxe0: the wire works (prints "rxe ib_write_bw: X MB/s")
#   wire       the ABI harness over MPLANE_TRANSPORT=ib, rank 0 on rxe0 and rank 1 on rxe1: every
#              scenario of the IB suite's first part (read from tests/ib/meson.build) that this
#              harness has, plus shared-comms (300 steps); one harness process per scenario
#   loopback   a few scenarios with both ranks on rxe0 (rxe's own loopback, no wire; shared-comms 100 steps)
#   staged     wire scenarios with every connection relayed and its buffers staged (CPU copier)
#   rate       tools/mplane-netbench rxe1 -> rxe0 in ib_write_bw's shape (1 MiB messages, 200 MiB):
#              the plugin's rate beside the wire's, "rxe plugin rate: X MB/s"
#   rma        the one-sided ops (tests/rma's harness, ncclRmaPlugin_v14): RDMA writes, atomic signals and
#              RDMA reads, even ranks on rxe0 and odd ones on rxe1 (so ranks on one device use rxe's
#              loopback and the others the wire); one harness process per scenario
# Logs of each step: $MPLANE_RXE_SHARE/<step>.log (the shared directory of rxe-vm.sh). Exit status:
# 0 when every step passed, 1 otherwise, 2 usage.
set -uo pipefail

BUILD=${1:?usage: suite.sh BUILD_DIR}
BUILD=$(readlink -f "$BUILD")
PLUGIN=$BUILD/tests/libnccl-net-mplane-test.so # the test build: the staged step sets test hooks
HARNESS=$BUILD/tests/abi/abi-harness
LOGS=${MPLANE_RXE_SHARE:-/tmp}
SRC=$(readlink -f "$(dirname "$0")/../..")
LOOPBACK_SCENARIOS=(sizes multirecv shared-order shared-comms)

# Real libibverbs: nothing of the software verbs double may leak in from the caller.
unset MPLANE_IBVERBS_LIB SOFTVERBS_NS SOFTVERBS_LIB
export MPLANE_TRANSPORT=ib
export MPLANE_ABI_TIMEOUT=${MPLANE_ABI_TIMEOUT:-240}
# soft-RoCE moves a work request's bytes in the kernel, here on an emulated CPU shared with the
# peer: an isend of a 32 MiB chunk can take seconds there, which says nothing of the plugin
export MPLANE_ABI_CALL_LIMIT=${MPLANE_ABI_CALL_LIMIT:-10}
export MPLANE_ABI_PLUGIN=$PLUGIN

SUMMARY=()
FAILED=0

# step NAME FUNC: runs FUNC with its output on the console and in NAME.log, records PASS/FAIL.
step() {
  local name=$1 t0=$SECONDS rc
  shift
  echo
  echo "== rxe: $name =="
  "$@" 2>&1 | tee "$LOGS/$name.log"
  rc=${PIPESTATUS[0]}
  if [ "$rc" -eq 0 ]; then
    SUMMARY+=("$(printf 'rxe: PASS  %-10s %4ds' "$name" $((SECONDS - t0)))")
  else
    SUMMARY+=("$(printf 'rxe: FAIL  %-10s %4ds  (status %d, log %s)' "$name" $((SECONDS - t0)) "$rc" "$LOGS/$name.log")")
    FAILED=1
  fi
}

# Index of the RoCE v2 GID that carries the IPv4 address of the device's netdev.
ipv4_gid_index() {
  local dev=$1 g i
  for g in /sys/class/infiniband/"$dev"/ports/1/gids/*; do
    i=${g##*/}
    case "$(cat "$g" 2>/dev/null)" in
      0000:0000:0000:0000:0000:ffff:*)
        grep -qi "v2" "/sys/class/infiniband/$dev/ports/1/gid_attrs/types/$i" 2>/dev/null && { echo "$i"; return 0; } ;;
    esac
  done
  return 1
}

devices() {
  local d rc=0
  for d in rxe0 rxe1; do
    ibv_devinfo -d "$d" | grep -E "hca_id|state|active_mtu|link_layer" || rc=1
    grep -q ACTIVE "/sys/class/infiniband/$d/ports/1/state" || { echo "$d: port 1 not ACTIVE"; rc=1; }
    echo "  RoCE v2 IPv4 GID index: $(ipv4_gid_index "$d" || echo none)"
  done
  return $rc
}

# The RoCE subnet probe on kernel verbs: rxe0 and rxe1 reach each other over the veth pair, so the
# probe write arrives and both ports are one plane (the plugin's INFO lines say so).
planes() {
  local out
  out=$(MPLANE_DEBUG=1 MPLANE_TRANSPORT=ib MPLANE_IB_HCA='=rxe0,rxe1' MPLANE_SOCKET_IFNAME='=veth0' \
          "$BUILD/tools/mplane-netbench" --plugin "$PLUGIN" --devices-only 2>&1) || { echo "$out"; return 1; }
  echo "$out" | grep -E "NET/IB: (rxe|1 plane|[0-9]+ plane)|dev [0-9]:"
  grep -q "rxe0:1 and rxe1:1: one subnet (the probe write arrived)" <<<"$out" || {
    echo "the probe between rxe0 and rxe1 did not find one subnet"
    return 1
  }
  grep -q "NET/IB: 1 plane(s) from the fabric" <<<"$out" || { echo "not one plane from the fabric"; return 1; }
}

perftest() {
  local g0 g1 spid rc line
  g0=$(ipv4_gid_index rxe0) || { echo "rxe0 has no RoCE v2 IPv4 GID"; return 1; }
  g1=$(ipv4_gid_index rxe1) || { echo "rxe1 has no RoCE v2 IPv4 GID"; return 1; }
  # 2 QPs of 100 x 1 MiB: the plugin's shape below (MPLANE_IB_QPS=2 stripes each 1 MiB over both)
  timeout 120 ib_write_bw -d rxe0 -x "$g0" -F -q 2 -s 1048576 -n 100 >"$LOGS/ib_write_bw-server.log" 2>&1 &
  spid=$!
  # The server may take seconds to listen in an emulated guest on a loaded host: dial again while it lives.
  for try in $(seq 1 20); do
    sleep 1
    timeout 120 ib_write_bw -d rxe1 -x "$g1" -F -q 2 -s 1048576 -n 100 198.18.0.1 >"$LOGS/ib_write_bw-client.log" 2>&1
    rc=$?
    grep -q "Couldn't connect" "$LOGS/ib_write_bw-client.log" && kill -0 "$spid" 2>/dev/null || break
  done
  wait "$spid" || rc=1
  cat "$LOGS/ib_write_bw-client.log"
  # the result row: bytes, iterations, peak MB/s, average MB/s, Mpps
  line=$(awk '$1 == 1048576 && $2 ~ /^[0-9]+$/ { print $4 }' "$LOGS/ib_write_bw-client.log") # iterations: all QPs
  [ "$rc" -eq 0 ] && [ -n "$line" ] || { echo "ib_write_bw failed (status $rc)"; cat "$LOGS/ib_write_bw-server.log"; return 1; }
  echo "rxe ib_write_bw: $line MB/s"
}

# The harness scenarios of the IB suite's first part (tests/ib/meson.build, "foreach s : [...]" in its
# abi_harness block), so this suite runs on the wire whatever the IB suite runs on the double.
ib_scenarios() {
  local list
  list=$(sed -n "/^if is_variable('abi_harness')/,/^endif/{p;/^endif/q}" "$SRC/tests/ib/meson.build" 2>/dev/null |
    sed -n '/foreach s : \[/,/\]/p' | grep -o "'[a-z0-9-]*'" | tr -d "'")
  [ -n "$list" ] || { echo "no scenario list in $SRC/tests/ib/meson.build" >&2; return 1; }
  echo "$list"
  echo shared-comms
}

# Scenarios of LIST the harness has, in LIST's order, each once.
have_scenarios() {
  local have s
  have=$("$HARNESS" --list | awk '{ print $1 }')
  for s in "$@"; do
    if grep -qx -- "$s" <<<"$have"; then echo "$s"; else echo "(this abi-harness has no scenario $s)" >&2; fi
  done | awk '!seen[$0]++'
}

# One harness process per scenario, so a failure names its scenario and the others still run.
harness() {
  local s rc=0 t0
  for s in "$@"; do
    t0=$SECONDS
    if "$HARNESS" --plugin "$PLUGIN" "$s"; then
      echo "  scenario $s: PASS ($((SECONDS - t0))s)"
    else
      echo "  scenario $s: FAIL ($((SECONDS - t0))s)"
      rc=1
    fi
  done
  return $rc
}

# Runs CMD with the harness' rank 0 on rxe0 (side channel on veth0) and rank 1 on rxe1 (veth1).
on_two_devices() {
  MPLANE_SOCKET_IFNAME='' \
  MPLANE_ABI_RANK0_ENV="MPLANE_IB_HCA==rxe0 MPLANE_SOCKET_IFNAME==veth0" \
  MPLANE_ABI_RANK1_ENV="MPLANE_IB_HCA==rxe1 MPLANE_SOCKET_IFNAME==veth1" \
    "$@"
}

wire() {
  if ! grep -qa MPLANE_ABI_RANK "$HARNESS"; then
    echo "this abi-harness has no per-rank environment (MPLANE_ABI_RANK0_ENV): both ranks would open the same device"
    return 1
  fi
  local list
  mapfile -t list < <(mapfile -t ib < <(ib_scenarios); have_scenarios "${ib[@]}")
  echo "scenarios: ${list[*]}"
  # shared-comms at 300 steps, as in the loopback and staged steps: its 1000-step run (46 s of this
  # step on the emulated CPU) is suite ib's abi-shared-comms, the same IB transport code on the double;
  # here each k of 2, 4, 8 still has its senders run ahead of the receiver's groups (the scenario
  # fails when none ever waited), on the wire, on loopback and staged
  MPLANE_ABI_SHARED_STEPS=${MPLANE_ABI_SHARED_STEPS:-300} on_two_devices harness "${list[@]}"
}

# shared-comms at 100 steps here: the wire step runs it at 300 on the same transport and verbs; what
# this step adds is both ranks on one device, and 100 steps of k = 2, 4, 8 still has thousands of sends
# run ahead of the receiver's groups (the scenario fails when none did)
loopback() {
  local list
  mapfile -t list < <(have_scenarios "${LOOPBACK_SCENARIOS[@]}")
  echo "scenarios: ${list[*]}"
  MPLANE_ABI_SHARED_STEPS=${MPLANE_ABI_SHARED_STEPS:-100} MPLANE_IB_HCA='=rxe0' MPLANE_SOCKET_IFNAME='=veth0' harness "${list[@]}"
}

# The RMA harness: "name ranks args..." per scenario; even ranks on rxe0 (veth0), odd ones on rxe1.
RMA_SCENARIOS=("data-2 2 --big data" "data-4 4 data" "order-2 2 order" "order-4 4 order" "alltoall-2 2 alltoall"
               "alltoall-4 4 alltoall" "oob 3 oob" "stride 4 stride" "kill-2 2 kill" "kill-4 4 kill")
rma() {
  local rh=$BUILD/tests/rma/rma-harness line name n rc=0 t0 r
  [ -x "$rh" ] || { echo "no $rh (build first)"; return 1; }
  for r in 0 1 2 3; do
    if [ $((r % 2)) -eq 0 ]; then export "MPLANE_RMA_ENV_$r=MPLANE_IB_HCA==rxe0 MPLANE_SOCKET_IFNAME==veth0"
    else export "MPLANE_RMA_ENV_$r=MPLANE_IB_HCA==rxe1 MPLANE_SOCKET_IFNAME==veth1"; fi
  done
  for line in "${RMA_SCENARIOS[@]}"; do
    read -r name n args <<<"$line"
    t0=$SECONDS
    # shellcheck disable=SC2086 # args are words
    # rxe on this emulated CPU drops packets of a long burst (its send_err counter) and an RC
    # requester recovers by its retransmit timer: at the default exponent (20, 4.3 s) one 64 MiB
    # put between the two devices outlasts the harness' 60 s deadline; 14 is 67 ms
    if MPLANE_SOCKET_IFNAME='' MPLANE_IB_TIMEOUT=14 "$rh" --plugin "$PLUGIN" --ranks "$n" $args; then
      echo "  rma $name: PASS ($((SECONDS - t0))s)"
    else
      echo "  rma $name: FAIL ($((SECONDS - t0))s)"
      rc=1
    fi
  done
  return $rc
}

# Relayed connections through the staging ring on the wire: every connection counts as relayed and
# host buffers are staged as GPU buffers are (net/relay.h's test switches, the CPU copier, 64 KiB
# slots). One run with the third copy made to fail must fail: staging is in the path.
STAGED_SCENARIOS=(sizes inflight multirecv shared-comms kill-receiver)
staged() {
  local list rc=0
  mapfile -t list < <(have_scenarios "${STAGED_SCENARIOS[@]}")
  echo "scenarios: ${list[*]}"
  export MPLANE_TEST_RELAY_HOST=all MPLANE_TEST_RELAY_COPIER=cpu MPLANE_TEST_RELAY_SLOT_BYTES=65536
  MPLANE_ABI_SHARED_STEPS=${MPLANE_ABI_SHARED_STEPS:-300} on_two_devices harness "${list[@]}" || rc=1
  if MPLANE_TEST_RELAY_FAIL=copy:3 MPLANE_ABI_TIMEOUT=30 on_two_devices "$HARNESS" --plugin "$PLUGIN" sizes >/dev/null 2>&1; then
    echo "  a failed copy into staging (MPLANE_TEST_RELAY_FAIL=copy:3) did not fail the run: staging is not in the path"
    rc=1
  else
    echo "  a failed copy into staging failed the run, as it must"
  fi
  unset MPLANE_TEST_RELAY_HOST MPLANE_TEST_RELAY_COPIER MPLANE_TEST_RELAY_SLOT_BYTES
  return $rc
}

# The plugin's rate in the shape of the ib_write_bw step: rxe1 sends 1 MiB messages to rxe0, 8 in
# flight, 200 MiB in all, every byte checked in the first and last rounds.
plugin_rate() {
  local out secs
  out=$(MPLANE_IB_HCA='=rxe0' MPLANE_SOCKET_IFNAME='=veth0' "$BUILD/tools/mplane-netbench" --plugin "$PLUGIN" \
          --size 1048576 --window 8 --rounds 25 --sender-env "MPLANE_IB_HCA==rxe1 MPLANE_SOCKET_IFNAME==veth1") || {
    echo "$out"
    return 1
  }
  echo "$out"
  # "(25 rounds, 10.98 s, ...)": 25 x 8 x 1 MiB in that many seconds; MB as ib_write_bw's (2^20 bytes)
  secs=$(sed -n 's/.*(25 rounds, \([0-9.]*\) s.*/\1/p' <<<"$out")
  [ -n "$secs" ] || { echo "no time in mplane-netbench's output"; return 1; }
  awk -v t="$secs" 'BEGIN { printf "rxe plugin rate: %.2f MB/s (1 MiB messages, 8 in flight, rxe1 -> rxe0)\n", 200 / t }'
}

[ -x "$HARNESS" ] && [ -f "$PLUGIN" ] || { echo "rxe suite: no $HARNESS or $PLUGIN (build first)"; exit 2; }
T0=$SECONDS
step devices devices
step planes planes
step perftest perftest
step wire wire
step loopback loopback
step staged staged
step rate plugin_rate
step rma rma
echo
printf '%s\n' "${SUMMARY[@]}"
echo "rxe: $([ $FAILED -eq 0 ] && echo PASS || echo FAIL) in $((SECONDS - T0))s"
exit $FAILED
