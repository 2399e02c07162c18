#!/usr/bin/env bash
# Run scripts/torch-smoke.py through mplane and through NCCL's own Socket transport, same options,
# one after the other, and print their GB/s side by side.
#
#   scripts/torch-compare.sh [--out DIR] [torch-smoke options...]
#   scripts/torch-compare.sh --emulate-nodes 2 --size 1M,64M,256M --out "$OUT"
#
# Any option besides --out goes to both runs (see scripts/torch-smoke.py --help); --net is set here.
# DIR (default: a new temporary folder) receives mplane.json, socket.json, mplane.log, socket.log,
# compare.txt and the per-rank NCCL logs in mplane-logs/ and socket-logs/.
# PYTHON picks the interpreter (default python3). Exit status: 0 when both runs are correct and used
# the network asked for, else the first non-zero exit status of the two (77: no GPU).
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out=""
args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --net|--net=*) echo "torch-compare.sh: --net is set by this script (mplane, then socket)" >&2; exit 2 ;;
    -h|--help) sed -n 2,13p "$0"; exit 0 ;;
    *) args+=("$1"); shift ;;
  esac
done
[ -n "$out" ] || out=$(mktemp -d -t torch-compare-XXXXXX)
mkdir -p "$out"
py="${PYTHON:-python3}"

rc=0
for net in mplane socket; do
  "$py" "$here/torch-smoke.py" --net "$net" --label "$net" --log-dir "$out/$net-logs" \
      --json "$out/$net.json" "${args[@]}" 2>&1 | tee "$out/$net.log"
  r=${PIPESTATUS[0]}
  echo
  [ "$r" = 77 ] && exit 77
  [ "$rc" = 0 ] && rc=$r
done

"$py" - "$out/mplane.json" "$out/socket.json" <<'EOF' | tee "$out/compare.txt"
import json, sys

def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"results": [], "rc": "no result"}

a, b = load(sys.argv[1]), load(sys.argv[2])
rows = {}
for name, run in (("mplane", a), ("socket", b)):
    for r in run.get("results", []):
        rows.setdefault((r["op"], r["size"]), {})[name] = r
def used(run):
    u = sorted({x for rep in run.get("network", []) for x in rep.get("using", [])})
    return ",".join(u) or "?"
print(f"busbw GB/s, {a.get('nprocs', '?')} processes, {a.get('emulate_nodes', 1)} emulated node(s)"
      f"{', P2P/SHM off' if a.get('no_p2p') else ''}; network used: mplane run -> {used(a)}, socket run -> {used(b)}")
print(f"{'op':<20} {'bytes':>12} {'mplane':>9} {'socket':>9} {'ratio':>7} {'wrong':>11}")
for (op, size), d in rows.items():
    m, s = d.get("mplane"), d.get("socket")
    mb = m["busbw_GBps"] if m else None
    sb = s["busbw_GBps"] if s else None
    ratio = f"{mb / sb:.2f}" if mb and sb else "-"
    wrong = f"{m['wrong'] if m else '-'}/{s['wrong'] if s else '-'}"
    nbytes = (m or s)["bytes"]
    print(f"{op:<20} {nbytes:>12} {mb if mb is not None else float('nan'):>9.2f} "
          f"{sb if sb is not None else float('nan'):>9.2f} {ratio:>7} {wrong:>11}")
print(f"exit: mplane {a.get('rc')}, socket {b.get('rc')}")
EOF
echo "outputs: $out"
exit "$rc"
