#!/usr/bin/env bash
# mplane topo on a GPU machine, from a build made elsewhere:
#
#   bash tests/topo/device-check.sh [BUILD_DIR]          (default build-topo)
#
# 1. mplane-topo live: table + picture, --json, --nccl-env, --nccl-topo; beside them what
#    nvidia-smi and sysfs say, so the two can be compared;
# 2. checks: every GPU nvidia-smi lists is found with its PCI bus id and NUMA node, and the RDMA
#    line is honest (no verbs device -> "RDMA NICs: none");
# 3. NCCL through the plugin with the memfd NCCL_TOPO_FILE (when .deps/nccl-tests and NCCL are
#    there): NCCL must say it loaded /proc/self/fd/N, and the run must pass.
#
# Where the image lacks the hwloc runtime, .deps/debs/libhwloc15_*.deb (and libudev1_*.deb when the
# image has no libudev) are unpacked under /tmp/mplane-hwloc and put on LD_LIBRARY_PATH.
# Writes everything to $OUT (or ./topo-device-out). Exit status 0 only when every check passes.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-topo}
out=${OUT:-$PWD/topo-device-out}
mkdir -p "$out"
topo=$build/topo/mplane-topo
fail=0
say() { echo "$*" | tee -a "$out/summary.txt"; }
check() { if eval "$2"; then say "PASS: $1"; else say "FAIL: $1"; fail=1; fi; }

[ -x "$topo" ] || { say "FAIL: $topo is not built"; exit 1; }
if ! ldconfig -p | grep -q 'libhwloc.so.15 '; then
  h=/tmp/mplane-hwloc
  mkdir -p "$h"
  for d in .deps/debs/libhwloc15_*.deb; do [ -f "$d" ] && dpkg -x "$d" "$h"; done
  ldconfig -p | grep -q 'libudev.so.1 ' || for d in .deps/debs/libudev1_*.deb; do [ -f "$d" ] && dpkg -x "$d" "$h"; done
  export LD_LIBRARY_PATH="$h/usr/lib/x86_64-linux-gnu:$h/lib/x86_64-linux-gnu:${LD_LIBRARY_PATH:-}"
  say "hwloc runtime unpacked under $h"
fi
ldd "$topo" | grep -E 'hwloc|udev|not found' | tee -a "$out/summary.txt"

MPLANE_DEBUG=1 "$topo" >"$out/mplane-topo.txt" 2>&1
rc=$?
cat "$out/mplane-topo.txt"
check "mplane-topo exits 0 (it exited $rc)" "[ $rc -eq 0 ]"
"$topo" --json >"$out/mplane-topo.json" 2>"$out/mplane-topo-json.err"
"$topo" --nccl-env >"$out/mplane-topo-env.txt" 2>&1
"$topo" --nccl-topo "$out/nccl-topo.xml" >/dev/null 2>&1
nvidia-smi --query-gpu=index,pci.bus_id,name --format=csv,noheader >"$out/nvidia-smi-gpus.csv" 2>&1
nvidia-smi topo -m >"$out/nvidia-smi-topo.txt" 2>&1
ls /sys/class/infiniband >"$out/sys-infiniband.txt" 2>&1

python3 - "$out" <<'PY' | tee -a "$out/summary.txt"
import json, os, sys
out = sys.argv[1]
ok = True
def check(what, cond):
    global ok
    print(("PASS: " if cond else "FAIL: ") + what)
    ok &= bool(cond)
t = json.load(open(os.path.join(out, "mplane-topo.json")))
smi = [l.split(", ") for l in open(os.path.join(out, "nvidia-smi-gpus.csv")) if l.count(",") >= 2]
want = sorted(b.strip().lower()[-12:] for _, b, _ in smi)   # 00000000:18:00.0 -> 0000:18:00.0
got = sorted(g["busid"] for g in t["gpus"])
check(f"GPUs found by mplane-topo {got} == GPUs nvidia-smi lists {want}", got == want and len(got) > 0)
for g in t["gpus"]:
    sysnuma = open(f"/sys/bus/pci/devices/{g['busid']}/numa_node").read().strip() \
        if os.path.exists(f"/sys/bus/pci/devices/{g['busid']}/numa_node") else "?"
    print(f"GPU{g['index']} {g['busid']} NUMA {g['numa']} (sysfs numa_node {sysnuma}) NIC {g['nic']} "
          f"link {g['link']} plane {g['plane']}")
    check(f"GPU{g['index']} NUMA matches sysfs", sysnuma == "?" or str(g["numa"] if g["numa"] is not None else -1) == sysnuma
          or (sysnuma == "-1" and g["numa"] in (0, None)))
verbs = [l.strip() for l in open(os.path.join(out, "sys-infiniband.txt")) if l.strip() and "No such" not in l]
check(f"RDMA NICs reported {t['rdma_nics']} == verbs devices in /sys/class/infiniband {len(verbs)}",
      t["rdma_nics"] == len(verbs))
text = open(os.path.join(out, "mplane-topo.txt")).read()
if not verbs:
    check("says there is no RDMA NIC", "RDMA NICs: none" in text)
sys.exit(0 if ok else 1)
PY
[ "${PIPESTATUS[0]}" -eq 0 ] || fail=1

# NCCL through the plugin: the memfd topology must be loaded and the collective must pass.
perf=.deps/nccl-tests/all_reduce_perf
if [ -x "$perf" ] && [ -f "$build/libnccl-net-mplane.so" ]; then
  env NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$PWD/$build:${LD_LIBRARY_PATH:-}" NCCL_NET_PLUGIN=mplane NCCL_NET=mplane \
    MPLANE_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 NCCL_DEBUG=INFO \
    NCCL_DEBUG_SUBSYS=INIT,ENV,GRAPH,NET NCCL_TOPO_DUMP_FILE="$out/nccl-topo-dump.xml" \
    timeout 300 "$perf" -g "$(nvidia-smi -L | wc -l)" -b 8M -e 8M -n 5 -c 1 >"$out/nccl-all-reduce.txt" 2>&1
  rc=$?
  grep -E "NCCL_TOPO_FILE|Loading topology|topo: |Avg bus bandwidth|wrong" "$out/nccl-all-reduce.txt" | head -20
  check "all_reduce through mplane exits 0 (it exited $rc)" "[ $rc -eq 0 ]"
  check "NCCL loaded mplane's topology (/proc/self/fd/N)" \
    "grep -q 'Loading topology file /proc/self/fd/' '$out/nccl-all-reduce.txt'"
  check "no wrong values" "grep -q '# Out of bounds values : 0 OK' '$out/nccl-all-reduce.txt'"
else
  say "SKIP: NCCL check ($perf or $build/libnccl-net-mplane.so missing)"
fi
say "$([ $fail -eq 0 ] && echo ALL PASS || echo SOME FAILED); files in $out"
exit $fail
