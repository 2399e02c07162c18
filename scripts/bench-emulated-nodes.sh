#!/usr/bin/env bash
# Benchmark: mplane's TCP transport against NCCL's Socket transport between two emulated nodes on
# one GPU, measured the way the TCP transport's targets are stated (docs/benchmarks.md).
#
#   NCCL_TESTS_DIR=/path/to/nccl-tests/build scripts/bench-emulated-nodes.sh [options]
#
#   --plugin PATH      the net plugin (default build/libnccl-net-mplane.so)
#   --rounds N         runs of every configuration, interleaved round by round (default 3); the
#                      tables give the median of the N runs
#   --tests "A B"      which nccl-tests (default "sendrecv all_reduce alltoall")
#   --time "ARGS"      nccl-tests arguments of the time sweep (default "-b 8 -e 1M -f 2 -w 10 -n 50"),
#                      "" to skip it: mplane against NCCL Socket's defaults, with each one's fastest
#                      and slowest run; a point where mplane's median is slower but its fastest run
#                      is no slower than Socket's slowest is marked "within spread"; "faster"
#                      counts the rounds whose mplane run beat the Socket run of the same round
#   --bw "ARGS"        ... of the bandwidth sweep (default "-b 32M -e 128M -f 4 -w 5 -n 20"), "" to
#                      skip it: mplane against NCCL Socket at NCCL_NSOCKS_PERTHREAD x
#                      NCCL_SOCKET_NTHREADS points, the best point's median taken
#   --grid best|full|"POINTS"
#                      those points, each SxT (NCCL_NSOCKS_PERTHREAD=S NCCL_SOCKET_NTHREADS=T, S*T
#                      at most 64) or SxT-CHUNK-BUFF (and NCCL_P2P_NET_CHUNKSIZE, NCCL_BUFFSIZE, K/M
#                      suffixes): best = 1x1 1x2 4x4 4x4-512K-8M 8x4-512K-8M 2x8-512K-8M (the
#                      best points of every grid measured so far: on one H200 2026-12-02 over
#                      loopback 4x4-512K-8M, over a veth pair 1x2 for all_reduce, 8x4-512K-8M for
#                      alltoall, 2x8-512K-8M for sendrecv; the default), full =
#                      {1,2,4,8} x {1,2,4,8}, each at NCCL's sizes and at 512K-8M (32 points)
#   --link lo|veth|both
#                      the link between the two ranks (default lo): lo = loopback; veth = a veth
#                      pair between two network namespaces (tools/mplane-netns; each rank enters its
#                      namespace after MPI_Init through libnetns-after-mpi-init.so, so MPI keeps
#                      loopback); both = one after the other, a summary each. Where this machine
#                      cannot make namespaces (mplane-netns probe exits 77) the veth runs are
#                      measured on loopback with MPLANE_SOCKET_SPEED=100000 (the rate, and so the
#                      defaults, of a 100 GbE NIC) and the summary says so
#   --netns-tools DIR  where mplane-netns and libnetns-after-mpi-init.so are (default: the plugin's
#                      build folder's tools/)
#   --warmup "ARGS"    one mplane run of the first test before the rounds, not counted (default
#                      "-b 32M -e 32M -w 5 -n 20"; a fresh machine's first runs are slow), "" to skip
#   --env VAR=VALUE    added to every mplane run; repeatable (e.g. --env NCCL_MIN_NCHANNELS=8)
#   --variant "NAME VAR=VALUE ..."
#                      one more mplane configuration, run beside the others in every round and
#                      sweep with these variables added; repeatable. The summary adds a table of
#                      each variant's median against mplane's (the verdicts stay mplane's), so a
#                      change is judged against the build in the same runs
#   --gin "ARGS"       the GIN sweep (default off), e.g. "-b 8 -e 16M -f 4 -w 5 -n 20": alltoall_perf
#                      through mplane with -R 2 (GIN needs symmetric registration), as the host path
#                      (no -D), as -D 3 (GIN to every rank) and as -D 4 (LSA to itself, GIN to the
#                      other), in every round; a table of the medians and their ratios, and verdicts
#                      against the GIN targets (docs/gin.md). Leave -D and -R out of ARGS;
#                      --env applies to these runs, --variant does not
#                      --time "" --bw "" --gin "ARGS" runs the GIN sweep alone
#   --gin-variant "NAME VAR=VALUE ..."
#                      one more configuration of the GIN sweep: -D 3 and -D 4 with these variables
#                      added, in every round beside the others; repeatable. The GIN summary adds
#                      each one's medians, their ratios to the same rounds' -D 0 and -D 4, and the
#                      GIN targets' verdicts for it (e.g. --gin-variant "kernel MPLANE_GIN_LANE=kernel")
#   --gin-tests-dir DIR  nccl-tests (MPI=1) of the GIN sweep, built against NCCL 2.30+ (-D needs its
#                      device API); default NCCL_TESTS_DIR
#   --gin-nccl-lib DIR   prepended to LD_LIBRARY_PATH in the GIN sweep's runs (that NCCL's lib)
#   --out DIR          rows.txt, summary.txt and each run's log (default build/bench-emulated-nodes)
#   --no-mps           do not start the CUDA MPS daemon (one already runs, or time-slicing is wanted)
#   --run-timeout S    seconds a run may take before it is killed and reported failed (default 300)
#   --budget S         seconds for the whole script (default 0: no limit; e.g. 540 inside a 10-minute
#                      limit): each run gets what is left (less a reserve for the summary), runs
#                      past it are reported not run, and the summary of what finished is printed
#   --summarize FILE   only print the summary of an earlier rows.txt
#
# Both MPI ranks use GPU 0 (NCCL_TESTS_DEVICE=0) and each exports NCCL_HOSTID=node<rank>, so NCCL
# sees two hosts and every byte goes through the network transport over loopback
# (MPLANE_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo) or the veth pair (=mpv0 / =mpv1's prefix mpv). MPS lets both ranks' kernels run at once; without
# it they take turns on the GPU. NCCL_NVLS_ENABLE=0 always. Needs Open MPI's mpirun (MPIRUN, PATH, or
# /usr/lib/x86_64-linux-gnu/openmpi/bin/mpirun) and nccl-tests built with MPI=1.
#
# Before each run a probe makes a CUDA context and a buffer on the GPU (scripts/gpu-guard.sh); where
# it fails the MPS daemon is restarted and the probe tried again, and a GPU still unusable fails that
# run with the probe's answer while the next runs still try. A run killed at its limit, or one after
# which the probe fails, gets the MPS daemon restarted and is reported failed with that reason.
#
# Every run must exit 0, report 0 wrong values and name the intended network ("Using network
# mplane" / "Using network Socket") in its log, and a GIN run's log must not show GIN assigned to
# another plugin; otherwise it is reported with its log, noted in rows.txt ("# failed ..."), and the
# script exits 1 after the other runs. Exit 77 without a GPU, 2 on bad arguments.
set -uo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
plugin="$here/build/libnccl-net-mplane.so"
rounds=3
tests="sendrecv all_reduce alltoall"
time_args="-b 8 -e 1M -f 2 -w 10 -n 50"
bw_args="-b 32M -e 128M -f 4 -w 5 -n 20"
warmup_args="-b 32M -e 32M -w 5 -n 20"
grid=best
link=lo
netns_tools=""
out="$here/build/bench-emulated-nodes"
mps=1
run_timeout=300
budget=${BENCH_BUDGET:-0}
summarize=""
gin_args=""
gin_dir=""
gin_lib=""
menv=()
gvnames=() gvenvs=() # --gin-variant: the same for the GIN sweep
vnames=() # --variant: names, and their variables as one space-separated string each
venvs=()

die() { echo "bench-emulated-nodes.sh: $*" >&2; exit 2; }
need() { [ $# -ge 2 ] || die "$1 needs a value (see --help)"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --plugin) need "$@"; plugin="$2"; shift 2 ;;
    --rounds) need "$@"; rounds="$2"; shift 2 ;;
    --tests) need "$@"; tests="$2"; shift 2 ;;
    --time) need "$@"; time_args="$2"; shift 2 ;;
    --bw) need "$@"; bw_args="$2"; shift 2 ;;
    --warmup) need "$@"; warmup_args="$2"; shift 2 ;;
    --grid) need "$@"; grid="$2"; shift 2 ;;
    --link) need "$@"; link="$2"; shift 2 ;;
    --netns-tools) need "$@"; netns_tools="$2"; shift 2 ;;
    --env) need "$@"; menv+=("$2"); shift 2 ;;
    --variant) need "$@"; read -r vn vv <<<"$2"; vnames+=("${vn:-}"); venvs+=("${vv:-}"); shift 2 ;;
    --gin) need "$@"; gin_args="$2"; shift 2 ;;
    --gin-variant) need "$@"; read -r vn vv <<<"$2"; gvnames+=("${vn:-}"); gvenvs+=("${vv:-}"); shift 2 ;;
    --gin-tests-dir) need "$@"; gin_dir="$2"; shift 2 ;;
    --gin-nccl-lib) need "$@"; gin_lib="$2"; shift 2 ;;
    --out) need "$@"; out="$2"; shift 2 ;;
    --no-mps) mps=0; shift ;;
    --run-timeout) need "$@"; run_timeout="$2"; shift 2 ;;
    --budget) need "$@"; budget="$2"; shift 2 ;;
    --summarize) need "$@"; summarize="$2"; shift 2 ;;
    -h|--help) awk 'NR > 1 && /^set -uo/ {exit} NR > 1' "$0"; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

# ---- the summary: medians per configuration, the time ratios and the bandwidth ratios ----
summary() {
  python3 - "$1" <<'PY'
import collections, statistics, sys
rows = collections.defaultdict(list)  # (sweep, config, test, size) -> [(time, busbw)]
rounds = collections.defaultdict(set)  # (sweep, config, test) -> the rounds it ran in
by_round = collections.defaultdict(dict)  # (sweep, config, test, size) -> {round: time}
wrongs = collections.Counter()  # sweep -> wrong values in its recorded rows
failed_runs = []  # (round, sweep, config, test, why): the runs the script refused ("# failed" lines)
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) >= 6 and p[:2] == ["#", "failed"]:
        failed_runs.append((p[2], p[3], p[4], p[5], " ".join(p[6:])))
        continue
    if len(p) < 8 or p[0] == "#":
        continue
    rnd, sweep, config, test, size, t, bw, wrong = p[:8]
    wrongs[sweep] += int(wrong) if wrong.isdigit() else 1  # a value not counted is not a 0
    rows[(sweep, config, test, int(size))].append((float(t), float(bw)))
    rounds[(sweep, config, test)].add(rnd)
    by_round[(sweep, config, test, int(size))][rnd] = float(t)

def med(key, col):
    v = [r[col] for r in rows.get(key, [])]
    return statistics.median(v) if v else None

def spread(key, col):
    v = [r[col] for r in rows.get(key, [])]
    return min(v), max(v)

def faster(test, size):  # (rounds where mplane's run beat Socket's run of the same round, rounds paired)
    m, k = by_round.get(("time", "mplane", test, size), {}), by_round.get(("time", "socket", test, size), {})
    both = set(m) & set(k)
    return sum(m[r] < k[r] for r in both), len(both)

def sizes_of(sweep, test):  # the sizes a sweep of a test ran, leaving out those that move 0 bytes
    return sorted({k[3] for k in rows if k[0] == sweep and k[2] == test and k[3] > 0})

def human(n):
    for unit, div in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div} {unit}"
    return f"{n} B"

tests = sorted({k[2] for k in rows}, key=lambda t: ["sendrecv", "all_reduce", "alltoall"].index(t)
               if t in ("sendrecv", "all_reduce", "alltoall") else 9)
# not the rows per size: alltoall prints several rows of size 0 (sizes below one element per rank)
runs = max((len(v) for v in rounds.values()), default=0)
worst, points, slower, overlap = None, 0, 0, 0
won, paired = 0, 0  # over the slower points: rounds mplane was faster in, rounds
for test in tests:
    pairs = [(s, med(("time", "mplane", test, s), 0), med(("time", "socket", test, s), 0)) for s in sizes_of("time", test)]
    pairs = [p for p in pairs if p[1] is not None and p[2] is not None]
    if not pairs:
        continue
    print(f"\n{test}: time in us, median of {runs} runs (sizes that move 0 bytes left out), and each one's runs")
    print(f"{'size':>10} {'Socket':>10} {'mplane':>10} {'ratio':>7}   {'Socket runs':>15} {'mplane runs':>15} {'faster':>7}")
    for s, m, k in pairs:
        r = m / k
        points += 1
        kl, kh = spread(("time", "socket", test, s), 0)
        ml, mh = spread(("time", "mplane", test, s), 0)
        # slower, but some run of mplane's as fast as some run of Socket's: within the runs' spread
        mark = ""
        w, n = faster(test, s)
        if r > 1.0:
            slower += 1
            won, paired = won + w, paired + n
            if ml <= kh:
                overlap += 1
                mark = "  within spread"
        if worst is None or r > worst[0]:
            worst = (r, test, s)
        print(f"{human(s):>10} {k:10.1f} {m:10.1f} {r:6.2f}x   {f'{kl:.1f}-{kh:.1f}':>15} {f'{ml:.1f}-{mh:.1f}':>15} {f'{w}/{n}':>7}{mark}")
if points:
    verdict = "met" if slower == 0 else f"NOT met at {slower} of {points} points, {overlap} of them within the runs' spread"
    print(f"\ntime <= NCCL Socket's default: {verdict} (highest ratio {worst[0]:.2f}x: {worst[1]} {human(worst[2])})")
    if slower:  # a tie shows as mplane winning about half of the paired rounds at those points
        print(f"at those points mplane's run was the faster of its round's pair in {won} of {paired} rounds")

lines = []
for test in tests:
    for s in sizes_of("bw", test):
        m = med(("bw", "mplane", test, s), 1)
        grid = {k[1]: med(k, 1) for k in rows if k[0] == "bw" and k[2] == test and k[3] == s and k[1].startswith("socket")}
        if m is None or not grid or max(grid.values()) <= 0:
            continue
        best = max(grid, key=grid.get)
        lines.append((test, s, m, best, grid[best], m / grid[best]))
if lines:
    npoints = len({k[1] for k in rows if k[0] == "bw" and k[1].startswith("socket")})
    print(f"\nbusbw in GB/s, median of {runs} runs; Socket: the best of {npoints} NSOCKS_PERTHREAD x SOCKET_NTHREADS points")
    print(f"{'test':>10} {'size':>8} {'mplane':>8} {'Socket':>8} {'point':>19} {'ratio':>7}")
    for test, s, m, best, b, r in lines:
        print(f"{test:>10} {human(s):>8} {m:8.2f} {b:8.2f} {best:>19} {r:6.2f}x")
    low = [l for l in lines if l[5] < 1.7]
    verdict = "met" if not low else "NOT met: " + ", ".join(f"{t} {human(s)} {r:.2f}x" for t, s, _, _, _, r in low)
    print(f"\nbusbw >= 1.7x NCCL Socket's best point: {verdict}")

# --variant: each one's median beside mplane's, time / time (lower is faster) or busbw / busbw
variants = sorted({k[1] for k in rows if k[1].startswith("mplane-")})
if variants:
    print(f"\nvariants against mplane, median of {runs} runs: time ratio (below 1 is faster) and busbw ratio (above 1 is faster)")
    print(f"{'sweep':>5} {'test':>10} {'size':>8} {'mplane':>9} " + " ".join(f"{v[7:]:>18}" for v in variants))
    for sweep, col, unit in (("time", 0, "us"), ("bw", 1, "GB/s")):
        for test in tests:
            for s in sizes_of(sweep, test):
                m = med((sweep, "mplane", test, s), col)
                if m is None:
                    continue
                cells = []
                for v in variants:
                    x = med((sweep, v, test, s), col)
                    cells.append(f"{x:9.2f} {x / m:7.2f}x" if x is not None and m > 0 else f"{'-':>18}")
                print(f"{sweep:>5} {test:>10} {human(s):>8} {m:9.2f} " + " ".join(cells) + f"  ({unit})")

# --gin: the GIN all-to-all kernels (-D 3, -D 4) against the host path (-D 0), all through mplane
GIN = {"d0": "-D 0", "d3": "-D 3", "d4": "-D 4"}

def fmt(x, spec, width):
    return f"{x:{width}{spec}}" if x is not None else f"{'-':>{width}}"

def gin_verdict(name, ratios, limit):  # ratios: [(size, ratio or None where a median is missing)]
    if not ratios:
        return f"GIN {name}: not measured (no such size in the sweep)"
    seen = [(s, r) for s, r in ratios if r is not None]
    hi = max(seen, key=lambda x: x[1]) if seen else None
    high = f" (highest {hi[1]:.2f}x at {human(hi[0])})" if hi else ""
    bad = [(s, r) for s, r in ratios if r is None or r > limit]
    if not bad:
        return f"GIN {name}: met{high}"
    missing = sum(r is None for _, r in bad)  # a target is not met where it was not measured
    more = f", {missing} of them not measured" if missing else ""
    return f"GIN {name}: NOT met at {len(bad)} of {len(ratios)} sizes{more}{high}"

gin_sizes = sizes_of("gin", "alltoall")
gin_failed = [f for f in failed_runs if f[1] == "gin"]
if gin_sizes or gin_failed:
    nruns = {c: len(rounds.get(("gin", c, "alltoall"), ())) for c in GIN}
    print(f"\nGIN: alltoall through mplane with -R 2, out-of-place time in us, median of the runs "
          f"({', '.join(f'{GIN[c]}: {nruns[c]}' for c in GIN)})")
    print(f"{'size':>10} {'-D 0':>10} {'-D 3':>10} {'-D 4':>10} {'D4/D0':>8} {'D3/D4':>8}")
    table = []
    for s in gin_sizes:
        d0, d3, d4 = (med(("gin", c, "alltoall", s), 0) for c in GIN)
        r40 = d4 / d0 if d4 is not None and d0 else None
        r34 = d3 / d4 if d3 is not None and d4 else None
        table.append((s, r40, r34))
        print(f"{human(s):>10} {fmt(d0, '.1f', 10)} {fmt(d3, '.1f', 10)} {fmt(d4, '.1f', 10)} "
              f"{fmt(r40, '.2f', 7)}{'x' if r40 is not None else ' '} {fmt(r34, '.2f', 7)}{'x' if r34 is not None else ' '}")
    print()
    print(gin_verdict("-D 4 <= 2x -D 0 up to 64 KiB", [(s, a) for s, a, _ in table if s <= 64 << 10], 2.0))
    print(gin_verdict("-D 4 <= 1.2x -D 0 from 2 MiB to 16 MiB",
                      [(s, a) for s, a, _ in table if 2 << 20 <= s <= 16 << 20], 1.2))
    print(gin_verdict("-D 3 <= 1.5x -D 4", [(s, b) for s, _, b in table], 1.5))
    # a run with wrong values is refused (its rows are not taken), so its "# failed" line counts too
    bad = [f for f in gin_failed if f[4] == "wrong values reported"]
    if not sum(nruns.values()) and not bad:
        print("GIN 0 wrong values: not measured (no GIN run finished)")
    elif not bad and not wrongs["gin"]:
        print(f"GIN 0 wrong values: met ({sum(nruns.values())} runs)")
    else:
        runs_bad = ", ".join(f"{GIN.get(c, c)} round {r}" for r, _, c, _, _ in bad)
        print(f"GIN 0 wrong values: NOT met: {runs_bad or str(wrongs['gin']) + ' in the rows'}")
    gvariants = sorted({k[1][3:] for k in rows if k[0] == "gin" and k[1].startswith("d4-")})
    for v in gvariants:
        print(f"\nGIN variant {v}: its -D 3 and -D 4, medians in us, against the same rounds' -D 0 and -D 4")
        print(f"{'size':>10} {'-D 3 ' + v:>14} {'-D 4 ' + v:>14} {'D4/D0':>8} {'D3/D4':>8} {'vs -D 4':>8}")
        vt = []
        for s in gin_sizes:
            d0, d4 = med(("gin", "d0", "alltoall", s), 0), med(("gin", "d4", "alltoall", s), 0)
            v3, v4 = med(("gin", "d3-" + v, "alltoall", s), 0), med(("gin", "d4-" + v, "alltoall", s), 0)
            r40 = v4 / d0 if v4 is not None and d0 else None
            r34 = v3 / v4 if v3 is not None and v4 else None
            rb = v4 / d4 if v4 is not None and d4 else None
            vt.append((s, r40, r34))
            print(f"{human(s):>10} {fmt(v3, '.1f', 14)} {fmt(v4, '.1f', 14)} {fmt(r40, '.2f', 7)}{'x' if r40 is not None else ' '} "
                  f"{fmt(r34, '.2f', 7)}{'x' if r34 is not None else ' '} {fmt(rb, '.2f', 7)}{'x' if rb is not None else ' '}")
        print(gin_verdict(f"{v}: -D 4 <= 2x -D 0 up to 64 KiB", [(s, a) for s, a, _ in vt if s <= 64 << 10], 2.0))
        print(gin_verdict(f"{v}: -D 4 <= 1.2x -D 0 from 2 MiB to 16 MiB",
                          [(s, a) for s, a, _ in vt if 2 << 20 <= s <= 16 << 20], 1.2))
        print(gin_verdict(f"{v}: -D 3 <= 1.5x -D 4", [(s, b) for s, _, b in vt], 1.5))
    if gin_failed:
        print("GIN runs refused: " + ", ".join(f"{GIN.get(c, c)} round {r} ({why})" for r, _, c, _, why in gin_failed))

other_failed = [f for f in failed_runs if f[1] != "gin"]
if other_failed:
    print(f"\nruns failed or not run ({len(other_failed)}): " +
          "; ".join(f"{s} {c} {t} round {r}: {why}" for r, s, c, t, why in other_failed))
PY
}

if [ -n "$summarize" ]; then
  [ -r "$summarize" ] || die "--summarize '$summarize': cannot read it"
  summary "$summarize"
  exit $?
fi

case "$rounds" in ''|*[!0-9]*|0) die "--rounds '$rounds': expected a whole number from 1" ;; esac
case "$run_timeout" in ''|*[!0-9]*|0) die "--run-timeout '$run_timeout': expected a whole number of seconds from 1" ;; esac
case "$budget" in ''|*[!0-9]*) die "--budget '$budget': expected a whole number of seconds (0: no limit)" ;; esac
# shellcheck source=scripts/gpu-guard.sh
. "$here/scripts/gpu-guard.sh"
guard_init bench-emulated-nodes.sh "$budget"
case "$grid" in
  best) points=(1x1 1x2 4x4 4x4-512K-8M 8x4-512K-8M 2x8-512K-8M) ;;
  full) points=(); for t in 1 2 4 8; do for s in 1 2 4 8; do points+=("${s}x$t" "${s}x$t-512K-8M"); done; done ;;
  *) read -r -a points <<<"$grid"
     [ ${#points[@]} -gt 0 ] || die "--grid '$grid': expected best, full or points SxT[-CHUNK-BUFF]"
     for p in "${points[@]}"; do
       [[ $p =~ ^([0-9]+)x([0-9]+)(-[0-9]+[KM]?-[0-9]+[KM]?)?$ ]] && [ $((BASH_REMATCH[1] * BASH_REMATCH[2])) -ge 1 ] &&
         [ $((BASH_REMATCH[1] * BASH_REMATCH[2])) -le 64 ] ||
         die "--grid '$grid': '$p' is not SxT or SxT-CHUNK-BUFF (S*T from 1 to 64, sizes with K/M), or not best/full"
     done ;;
esac
case "$link" in lo|veth|both) ;; *) die "--link '$link': expected lo, veth or both" ;; esac
# point_env POINT: the NCCL variables of one Socket point, one a line
point_env() {
  local p=$1 st=${1%%-*} sz
  echo "NCCL_NSOCKS_PERTHREAD=${st%x*}"
  echo "NCCL_SOCKET_NTHREADS=${st#*x}"
  [ "$p" = "$st" ] && return
  bytes() { case "$1" in *K) echo $((${1%K} << 10)) ;; *M) echo $((${1%M} << 20)) ;; *) echo "$1" ;; esac; }
  sz=${p#*-}
  echo "NCCL_P2P_NET_CHUNKSIZE=$(bytes "${sz%-*}")"
  echo "NCCL_BUFFSIZE=$(bytes "${sz#*-}")"
}
# gin_check: the GIN sweep's options; its nccl-tests default to NCCL_TESTS_DIR's.
gin_check() {
  if [ -z "$gin_args" ]; then
    [ -z "$gin_dir$gin_lib" ] || die "--gin-tests-dir and --gin-nccl-lib belong to the GIN sweep: give --gin \"ARGS\" too"
    return
  fi
  local w
  for w in $gin_args; do # the sweep adds -R 2 and each -D itself
    case "$w" in -D*|-R*|--device_implementation*|--local_register*) die "--gin '$gin_args': leave out '$w' (the sweep adds -R 2 and -D)" ;; esac
  done
  gin_dir=${gin_dir:-${NCCL_TESTS_DIR:-}}
  [ -x "$gin_dir/alltoall_perf" ] || die "--gin: no alltoall_perf in '$gin_dir' (--gin-tests-dir or NCCL_TESTS_DIR: nccl-tests built with MPI=1 against NCCL 2.30+)"
  [ -z "$gin_lib" ] || [ -d "$gin_lib" ] || die "--gin-nccl-lib '$gin_lib': no such directory"
}
# kv_check OPTION WORD: WORD must be VAR=VALUE
kv_check() { case "$2" in [A-Za-z_]*=*) ;; *) die "$1: '$2' is not VAR=VALUE" ;; esac; }
for kv in ${menv[@]+"${menv[@]}"}; do kv_check --env "$kv"; done
# variants_check OPTION NAMES ENVS: each name (of the arrays named NAMES and ENVS) is letters, digits,
# _ . -, given once, and has VAR=VALUE words
variants_check() {
  local opt=$1 i j kv
  local -n names=$2 envs=$3
  for i in ${names[@]+"${!names[@]}"}; do
    case "${names[$i]}" in
      ''|*[!A-Za-z0-9_.-]*|*=*) die "$opt '${names[$i]} ${envs[$i]}': expected a NAME (letters, digits, _ . -) and VAR=VALUE ..." ;;
    esac
    [ -n "${envs[$i]}" ] || die "$opt '${names[$i]}': no VAR=VALUE after the name"
    for kv in ${envs[$i]}; do kv_check "$opt '${names[$i]}'" "$kv"; done
    for ((j = 0; j < i; j++)); do [ "${names[$j]}" != "${names[$i]}" ] || die "$opt '${names[$i]}' given twice"; done
  done
}
[ ${#gvnames[@]} -eq 0 ] || [ -n "$gin_args" ] || die "--gin-variant needs --gin"
variants_check --gin-variant gvnames gvenvs
variants_check --variant vnames venvs
gin_check
[ -n "$time_args$bw_args$gin_args" ] || die "--time, --bw and --gin are all empty: nothing to run"
if [ -n "$time_args$bw_args" ]; then # the GIN sweep alone needs only its own nccl-tests
  for t in $tests; do
    [ -x "${NCCL_TESTS_DIR:-}/${t}_perf" ] || die "set NCCL_TESTS_DIR to a built nccl-tests (MPI=1) with ${t}_perf"
  done
fi
[ -r "$plugin" ] || die "--plugin '$plugin': no such file (build first: ninja -C build)"
plugin="$(cd "$(dirname "$plugin")" && pwd)/$(basename "$plugin")" # NCCL_NET_PLUGIN takes a path
mpirun="${MPIRUN:-$(command -v mpirun || echo /usr/lib/x86_64-linux-gnu/openmpi/bin/mpirun)}"
[ -x "$mpirun" ] || die "no mpirun (Open MPI): set MPIRUN"
if ! nvidia-smi -L >/dev/null 2>&1; then
  echo "bench-emulated-nodes.sh: no GPU (nvidia-smi -L failed): nothing measured"
  exit 77
fi

mkdir -p "$out" || die "--out '$out': cannot create it"
wrap="$out/hostid-wrap.sh"
cat >"$wrap" <<'WRAP'
#!/bin/sh
# one emulated node per MPI rank; on the veth pair, rank r's threads enter namespace r after MPI_Init
export NCCL_HOSTID=node$OMPI_COMM_WORLD_RANK
if [ -n "${BENCH_NETNS_DIR:-}" ]; then
  export NETNS_AFTER_MPI_INIT="$BENCH_NETNS_DIR/ns$OMPI_COMM_WORLD_RANK"
  export LD_PRELOAD="$BENCH_NETNS_SHIM${LD_PRELOAD:+:$LD_PRELOAD}"
fi
exec "$@"
WRAP
chmod +x "$wrap"

if [ $mps = 1 ]; then
  export CUDA_MPS_PIPE_DIRECTORY="$out/mps" CUDA_MPS_LOG_DIRECTORY="$out/mps-log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  guard_mps_start || die "nvidia-cuda-mps-control -d failed (--no-mps runs without it)"
  trap guard_mps_stop EXIT
fi

failed=0
# run_failed WHY (in run): the run is reported, noted in rows.txt, and the script exits 1 at the end
run_failed() {
  echo "FAIL: $config $test round $round: $1 (log: $log)"
  echo "# failed $round $sweep $config $test $1" >>"$rowsf" # the summary counts what was refused
  failed=1
}
perf_dir=${NCCL_TESTS_DIR:-} # where run finds the nccl-tests; run_gin points it at the GIN sweep's
# run ROUND SWEEP CONFIG NET TEST ARGS [VAR=VALUE ...]: one nccl-tests run, its rows into rows.txt.
run() {
  local round=$1 sweep=$2 config=$3 net=$4 test=$5 args=$6
  shift 6
  local log="$out/logs/$sweep-$config-$test-r$round.log"
  local x=(-x NCCL_TESTS_DEVICE=0 -x NCCL_NVLS_ENABLE=0 -x NCCL_DEBUG=INFO -x NCCL_DEBUG_SUBSYS=INIT
           -x "NCCL_SOCKET_IFNAME=$ifname" -x "MPLANE_SOCKET_IFNAME=$ifname" ${link_env[@]+"${link_env[@]}"})
  [ $mps = 1 ] && x+=(-x CUDA_MPS_PIPE_DIRECTORY -x CUDA_MPS_LOG_DIRECTORY)
  local kv
  for kv in "$@"; do x+=(-x "$kv"); done
  local limit rc rows why=""
  limit=$(guard_limit "$run_timeout")
  if [ "$limit" -le 0 ] || { [ "$limit" -lt "$run_timeout" ] && [ "$limit" -lt 5 ]; }; then # cut short by the budget
    run_failed "not run: the budget (${budget}s) was spent"
    return
  fi
  if ! guard_before "$config $test round $round"; then
    run_failed "not run: $guard_why"
    return
  fi
  # shellcheck disable=SC2086 # ARGS is a list of nccl-tests arguments
  timeout -k 10 "$limit" "$mpirun" --allow-run-as-root -np 2 --oversubscribe --bind-to none "${x[@]}" \
    "$wrap" "$perf_dir/${test}_perf" -g 1 $args >"$log" 2>&1
  rc=$?
  if ! guard_after "$config $test round $round" $rc; then
    [ $rc = 124 ] || [ $rc = 137 ] && guard_why="did not finish within ${limit}s: $guard_why"
    run_failed "$guard_why"
    return
  fi
  # nccl-tests' result rows: size, then out-of-place time (col 6), busbw (8) and wrong values (9)
  rows=$(awk -v pre="$round $sweep $config $test" '$1 ~ /^[0-9]+$/ && NF >= 12 {print pre, $1, $6, $8, $9}' "$log")
  if [ $rc -ne 0 ]; then why="exit status $rc"
  elif [ -z "$rows" ]; then why="no result rows"
  elif ! grep -q "Using network $net" "$log"; then why="did not use network $net"
  elif echo "$rows" | awk '$8 != 0 {bad = 1} END {exit !bad}'; then why="wrong values reported"
  elif grep -q "GIN/Plugin: Assigned plugin" "$log" && ! grep -q "GIN/Plugin: Assigned plugin $net " "$log"; then
    why="GIN assigned to another plugin" # NCCL's own GIN backend would be measured instead of mplane's
  fi
  if [ -n "$why" ]; then
    run_failed "$why"
    return
  fi
  echo "$rows" >>"$rowsf"
  echo "ran: $sweep $config $test round $round"
}

M=(NCCL_NET=mplane "NCCL_NET_PLUGIN=$plugin" ${menv[@]+"${menv[@]}"})
S=(NCCL_NET=Socket NCCL_NET_PLUGIN=none NCCL_TUNER_PLUGIN=none)
# run_variants ROUND SWEEP TEST ARGS: each --variant, as mplane plus its variables.
run_variants() {
  local i
  for i in ${vnames[@]+"${!vnames[@]}"}; do
    # shellcheck disable=SC2086 # the variant's variables, one word each
    run "$1" "$2" "mplane-${vnames[$i]}" mplane "$3" "$4" "${M[@]}" ${venvs[$i]}
  done
}
G=() # the GIN sweep's runs: its NCCL first on the library path
[ -n "$gin_lib" ] && G=("LD_LIBRARY_PATH=$gin_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
# run_gin ROUND D: alltoall of the GIN sweep from its own nccl-tests, -D D (0: the host path, no -D).
run_gin() {
  local perf_dir=$gin_dir # bash scoping: run, called from here, sees this one
  local dflag=""
  [ "$2" = 0 ] || dflag=" -D $2"
  run "$1" gin "d$2${3:+-$3}" mplane alltoall "$gin_args -R 2$dflag" "${M[@]}" ${G[@]+"${G[@]}"} ${4:-}
}
# bench_link LINK DIR: every round on one link, rows, logs and summary under DIR.
bench_link() {
  local l=$1 out=$2 how
  mkdir -p "$out/logs" || die "--out '$out': cannot create it"
  rowsf="$out/rows.txt"
  echo "# round sweep config test size time_us busbw_GBps wrong" >"$rowsf"
  ifname=lo link_env=() how="loopback"
  unset BENCH_NETNS_DIR BENCH_NETNS_SHIM
  if [ "$l" = veth ]; then
    local why
    if why=$("$netns_tool" probe 2>&1); then
      "$netns_tool" up "$out/netns" >"$out/netns.log" 2>&1 || { echo "FAIL: mplane-netns up: $(cat "$out/netns.log")"; failed=1; return; }
      export BENCH_NETNS_DIR="$out/netns" BENCH_NETNS_SHIM="$netns_shim"
      link_env=(-x BENCH_NETNS_DIR -x BENCH_NETNS_SHIM) ifname=mpv
      how="a veth pair between two network namespaces ($(cat "$out/netns.log"))"
    else
      echo "veth: $why"
      link_env=(-x MPLANE_SOCKET_SPEED=100000)
      how="loopback with MPLANE_SOCKET_SPEED=100000 (a 100 GbE NIC's rate and defaults): no veth here: $why"
    fi
  fi
  echo "# link: $how" >>"$rowsf"
  first_test=${tests%% *}
  if [ -n "$warmup_args" ]; then
    if [ -n "$time_args$bw_args" ]; then run 0 warmup mplane mplane "$first_test" "$warmup_args" "${M[@]}"
    else # the GIN sweep alone: warm up with its nccl-tests and NCCL (perf_dir set for this call only)
      perf_dir=$gin_dir run 0 warmup mplane mplane alltoall "$warmup_args -R 2" "${M[@]}" ${G[@]+"${G[@]}"}
    fi
  fi
  for ((r = 1; r <= rounds; r++)); do
    for t in $tests; do
      if [ -n "$time_args" ]; then
        run $r time mplane mplane "$t" "$time_args" "${M[@]}"
        run_variants $r time "$t" "$time_args"
        run $r time socket Socket "$t" "$time_args" "${S[@]}"
      fi
      if [ -n "$bw_args" ]; then
        run $r bw mplane mplane "$t" "$bw_args" "${M[@]}"
        run_variants $r bw "$t" "$bw_args"
        for p in "${points[@]}"; do # NSOCKS_PERTHREAD x SOCKET_NTHREADS [chunk, buffer]
          mapfile -t pe < <(point_env "$p")
          run $r bw "socket-$p" Socket "$t" "$bw_args" "${S[@]}" "${pe[@]}"
        done
      fi
    done
    if [ -n "$gin_args" ]; then
      for d in 0 3 4; do run_gin $r $d; done
      for i in ${gvnames[@]+"${!gvnames[@]}"}; do
        for d in 3 4; do run_gin $r $d "${gvnames[$i]}" "${gvenvs[$i]}"; done
      done
    fi
  done
  [ "$l" = veth ] && [ -n "${BENCH_NETNS_DIR:-}" ] && "$netns_tool" down "$BENCH_NETNS_DIR"
  { echo "link: $how"; summary "$rowsf"; } | tee "$out/summary.txt" || { echo "bench-emulated-nodes.sh: the summary failed"; failed=1; }
  echo
  echo "rows: $rowsf; logs: $out/logs"
}

netns_tools=${netns_tools:-$(dirname "$plugin")/tools}
netns_tool="$netns_tools/mplane-netns" netns_shim="$netns_tools/libnetns-after-mpi-init.so"
if [ "$link" != lo ]; then
  [ -x "$netns_tool" ] && [ -r "$netns_shim" ] ||
    die "--link $link: no mplane-netns and libnetns-after-mpi-init.so in '$netns_tools' (--netns-tools DIR)"
fi
case "$link" in
  lo|veth) bench_link "$link" "$out" ;;
  both) bench_link lo "$out/lo"; echo; bench_link veth "$out/veth" ;;
esac
exit $failed
