#!/bin/sh
# mplane-doctor on this machine and, with a software verbs library, on emulated nodes of several
# shapes: the verdict and exit status (0 ready, 1 problems, 2 bad arguments), each problem named
# with its fix, and --json that parses and says the same.
#   doctor.sh DOCTOR PLUGIN_DIR [SOFTVERBS_LIB]
set -u
doctor=$1 plugin_dir=$2 softverbs=${3:-}
out=$(mktemp) js=$(mktemp)
trap 'rm -f "$out" "$js"' EXIT
fails=0
fail() { echo "doctor: FAIL: $*"; echo "--- output:"; cat "$out"; fails=$((fails + 1)); }

# run NAME WANT_RC [ENV=VALUE ...]: the human report and the JSON one, the same verdict in both
run() {
  name=$1 want=$2
  shift 2
  env "$@" "$doctor" >"$out" 2>&1
  rc=$?
  [ "$rc" -eq "$want" ] || { fail "$name: exit $rc, expected $want"; return 1; }
  env "$@" "$doctor" --json >"$js" 2>/dev/null
  rcj=$?
  [ "$rcj" -eq "$want" ] || { fail "$name: --json exit $rcj, expected $want"; return 1; }
  python3 - "$js" "$want" <<'PY' || { fail "$name: --json"; cat "$js"; return 1; }
import json, sys
d = json.load(open(sys.argv[1]))
want = "ready" if sys.argv[2] == "0" else "problems"
assert d["verdict"] == want, "verdict %s, expected %s" % (d["verdict"], want)
assert (len(d["problems"]) == 0) == (want == "ready"), d["problems"]
for p in d["problems"]:
    assert p["problem"] and p["fix"], p
assert {c["class"] for c in d["classes"]} == {"default", "collective", "alltoall", "lowlat", "storage", "hfreduce"}, d["classes"]
assert all(0 <= c["sl"] <= 15 for c in d["classes"]), d["classes"]
PY
  echo "doctor: $name: exit $rc as expected"
  return 0
}
has() { grep -q -- "$1" "$out" || fail "$2: the report lacks '$1'"; }

ok_env="LD_LIBRARY_PATH=$plugin_dir NCCL_NET_PLUGIN=mplane MPLANE_SOCKET_IFNAME=lo"

# this machine, over loopback: ready, and what it could not see is said
# shellcheck disable=SC2086
if run "this machine" 0 $ok_env MPLANE_TRANSPORT=socket; then
  has "verdict: READY" "this machine"
  has "transport socket" "this machine"
  has "could not see" "this machine"
  has "alltoall    SL 3" "this machine"
fi
# NCCL could not load the plugin: a problem, with what to do
if run "plugin not loadable" 1 NCCL_NET_PLUGIN=mplane MPLANE_SOCKET_IFNAME=lo MPLANE_TRANSPORT=socket LD_LIBRARY_PATH=/nonexistent; then
  has "NCCL cannot load libnccl-net-mplane.so" "plugin not loadable"
  has "fix: put libnccl-net-mplane.so's folder on LD_LIBRARY_PATH" "plugin not loadable"
fi
# another plugin named for NCCL
# shellcheck disable=SC2086
run "another NCCL_NET_PLUGIN" 1 $ok_env MPLANE_TRANSPORT=socket NCCL_NET_PLUGIN=aws-ofi && has "NCCL_NET_PLUGIN=aws-ofi" "another plugin"
# a bad variable: named, with the accepted form
# shellcheck disable=SC2086
run "bad configuration" 1 $ok_env MPLANE_TRANSPORT=carrier-pigeon && has "MPLANE_TRANSPORT" "bad configuration"
# an interface that does not exist: the plugin's init fails, saying which variable
# shellcheck disable=SC2086
run "no device" 1 $ok_env MPLANE_TRANSPORT=socket MPLANE_SOCKET_IFNAME=nonexistent0 && has "init fails" "no device"
"$doctor" --bogus >"$out" 2>&1
[ $? -eq 2 ] || fail "an unknown option: exit 2 expected"

if [ -n "$softverbs" ]; then
  sv="$ok_env MPLANE_IBVERBS_LIB=$softverbs SOFTVERBS_NS=mplane-doctor-$$"
  # two IB planes (the double's default): ready, each device on its own plane, side channels named
  # shellcheck disable=SC2086
  if run "softverbs: 2 IB planes" 0 $sv; then
    has "transport ib, 2 device(s)" "2 IB planes"
    has "mlx5_1       port 1  ACTIVE IB" "2 IB planes"
    has "mlx5_0:1 side channel on lo" "2 IB planes"
  fi
  # 8 planes, one port down: not ready, the port named, numbering kept for the rest
  # shellcheck disable=SC2086
  if run "softverbs: 8 IB planes, one port down" 1 $sv \
      SOFTVERBS_DEVICES=mlx5_0:ib,mlx5_1:ib,mlx5_2:ib,mlx5_3:ib:down=1,mlx5_4:ib,mlx5_5:ib,mlx5_6:ib,mlx5_7:ib; then
    has "mlx5_3 port 1 is DOWN" "one port down"
    has "transport ib, 7 device(s)" "one port down"
  fi
  # one IB subnet for every NIC (rails of one plane) with a storage port beside them
  # shellcheck disable=SC2086
  run "softverbs: one subnet, rails" 0 $sv SOFTVERBS_DEVICES=mlx5_0:ib:subnet=0,mlx5_1:ib:subnet=0,mlx5_2:ib:subnet=0,mlx5_3:ib:subnet=0 &&
    has "rail 3" "one subnet"
  # RoCE planes: the classes' traffic classes are what the QPs get
  # shellcheck disable=SC2086
  run "softverbs: RoCE planes" 0 $sv SOFTVERBS_DEVICES=mlx5_0:roce:ip=198.18.0.1,mlx5_1:roce:ip=198.18.1.1 &&
    has "ACTIVE RoCE" "RoCE planes"
fi
[ "$fails" -eq 0 ] || exit 1
echo "doctor: all cases as expected"
