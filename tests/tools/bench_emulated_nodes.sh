#!/usr/bin/env bash
# scripts/bench-emulated-nodes.sh drives nccl-tests the way the TCP transport's targets are measured.
# No GPU or MPI here: a fake mpirun starts both ranks, fake *_perf programs print nccl-tests' rows
# from a model (mplane 10 us + bytes at 10 GB/s; NCCL Socket's default 20 us + the same; Socket
# with 2 threads 10 us + bytes at 6.7 GB/s, with 1 thread at 5 GB/s; FAKE_SLOW=1 doubles a run's
# time, FAKE_TOGGLE=FILE triples every other mplane run's), and the test checks what the script
# makes of them: each rank's NCCL_HOSTID, the environment of each configuration, the medians and
# ratios, the verdicts, and that a bad run (wrong values, the wrong network) fails the script.
# The GIN sweep: -D 4 takes 5 us more than the host path, -D 3 twice -D 4's time; -D needs -R 2, the
# GIN nccl-tests dir (FAKE_GIN_DIR) and NCCL 2.30 (FAKE_NCCL230) first on LD_LIBRARY_PATH, as a build
# against NCCL 2.28 has no device API; FAKE_WRONG_D=D reports wrong values under -D D,
# FAKE_GIN_PLUGIN names the plugin NCCL assigns GIN to; FAKE_ARGS=FILE records each run's arguments.
# usage: bench_emulated_nodes.sh SCRIPT
set -u
script=$1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
fail() { echo "FAIL: $*"; exit 1; }
mkdir -p "$work/bin" "$work/nt"

cat >"$work/bin/nvidia-smi" <<'EOF'
#!/bin/sh
[ -n "${FAKE_NO_GPU:-}" ] && exit 9
echo "GPU 0: fake"
EOF
# mpirun: -x VAR=VALUE exports, -x VAR passes, flags with a value skipped; the command runs once per rank.
cat >"$work/bin/mpirun" <<'EOF'
#!/bin/bash
np=1
while [ $# -gt 0 ]; do
  case "$1" in
    -np) np=$2; shift 2 ;;
    --bind-to) shift 2 ;;
    -x) case "$2" in *=*) export "${2?}" ;; esac; shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
rc=0
for ((r = 0; r < np; r++)); do OMPI_COMM_WORLD_RANK=$r "$@" || rc=$?; done
exit $rc
EOF
cat >"$work/nt/fake_perf" <<'EOF'
#!/bin/bash
rank=${OMPI_COMM_WORLD_RANK:?}
[ "${NCCL_HOSTID:-}" = "node$rank" ] || { echo "rank $rank: NCCL_HOSTID '${NCCL_HOSTID:-}'"; exit 3; }
[ -n "${FAKE_ENV:-}" ] && echo "rank=$rank net=${NCCL_NET:-} socks=${NCCL_NSOCKS_PERTHREAD:-} threads=${NCCL_SOCKET_NTHREADS:-}" \
  "chunk=${NCCL_P2P_NET_CHUNKSIZE:-} buff=${NCCL_BUFFSIZE:-} if=${NCCL_SOCKET_IFNAME:-}/${MPLANE_SOCKET_IFNAME:-}" \
  "ns=${NETNS_AFTER_MPI_INIT:-} preload=${LD_PRELOAD:-} speed=${MPLANE_SOCKET_SPEED:-}" >>"$FAKE_ENV"
[ "${NCCL_TESTS_DEVICE:-}" = 0 ] && [ "${NCCL_NVLS_ENABLE:-}" = 0 ] || { echo "device/NVLS not set"; exit 3; }
net=${NCCL_NET:?}
[ -n "${FAKE_NET:-}" ] && [ "$net" = mplane ] && net=$FAKE_NET
echo "host: NCCL INFO Using network $net"
[ "$rank" = 0 ] || exit 0
triple=""
if [ -n "${FAKE_TOGGLE:-}" ] && [ "$NCCL_NET" = mplane ]; then
  n=$(( $(cat "$FAKE_TOGGLE" 2>/dev/null || echo 0) + 1 )); echo $n >"$FAKE_TOGGLE"
  [ $((n % 2)) = 1 ] && triple=1
fi
[ -n "${FAKE_ARGS:-}" ] && echo "$(basename "$(dirname "$0")") $* LD=${LD_LIBRARY_PATH:-}" >>"$FAKE_ARGS"
b=8; e=8; f=2; d=0; reg=0
while [ $# -gt 0 ]; do
  case "$1" in -b) b=$2; shift 2 ;; -e) e=$2; shift 2 ;; -f) f=$2; shift 2 ;; -D) d=$2; shift 2 ;; -R) reg=$2; shift 2 ;; *) shift ;; esac
done
if [ "$d" != 0 ]; then
  [ "$reg" = 2 ] || { echo "-D requires -R 2"; exit 4; }
  [ "$(dirname "$0")" = "${FAKE_GIN_DIR:-}" ] || { echo "not the GIN nccl-tests"; exit 5; }
  case "${LD_LIBRARY_PATH:-}" in "${FAKE_NCCL230:-none}"*) ;; *) echo "NCCL 2.28: no device API"; exit 5 ;; esac
  echo "host: NCCL INFO GIN/Plugin: Assigned plugin ${FAKE_GIN_PLUGIN:-mplane} type 2 to comm"
fi
num() { case "$1" in *K) echo $(( ${1%K} << 10 )) ;; *M) echo $(( ${1%M} << 20 )) ;; *) echo "$1" ;; esac; }
b=$(num "$b"); e=$(num "$e")
wrong=0
[ -n "${FAKE_WRONG:-}" ] && [ "$NCCL_NET" = mplane ] && wrong=1
[ "${FAKE_WRONG_D:-}" = "$d" ] && wrong=1
echo "#       size         count      type   redop    root     time   algbw   busbw #wrong     time   algbw   busbw #wrong"
# alltoall of sizes below one element per rank: a row of size 0 for each such size
if [ "$(basename "$0")" = alltoall_perf ]; then
  for z in 1 2; do printf "%12d %12d %9s %7s %7d %8.2f %7.2f %7.2f %6d %8.2f %7.2f %7.2f %6d\n" 0 0 float none -1 0.3 0 0 0 0.3 0 0 0; done
fi
for ((s = b; s <= e; s *= f)); do
  awk -v s=$s -v net="$NCCL_NET" -v th="${NCCL_SOCKET_NTHREADS:-}" -v w=$wrong -v slow="${FAKE_SLOW:-}" -v triple="$triple" -v d=$d -v lane="${MPLANE_GIN_LANE:-}" 'BEGIN {
    if (net == "mplane") t = 10 + s / 10000; else if (th == "") t = 20 + s / 10000; else t = 10 + s / 10000 * (th == 2 ? 1.5 : 2)
    if (d == 4) t = t + 5; else if (d == 3) t = 2 * (t + 5)
    if (lane == "kernel" && d != 0) t = t / 2
    if (slow != "") t = 2 * t
    if (triple != "") t = 3 * t
    bw = s / t / 1000
    printf "%12d %12d %9s %7s %7d %8.2f %7.2f %7.2f %6d %8.2f %7.2f %7.2f %6d\n", s, s / 4, "float", "sum", -1, t, bw, bw, w, t, bw, bw, w
  }'
done
EOF
chmod +x "$work/bin/"* "$work/nt/fake_perf"
for t in sendrecv all_reduce alltoall; do ln -s fake_perf "$work/nt/${t}_perf"; done
mkdir -p "$work/gin" "$work/nccl230" # the GIN sweep's own nccl-tests, and its NCCL's lib dir
cp "$work/nt/fake_perf" "$work/gin/alltoall_perf"
touch "$work/plugin.so"
export PATH="$work/bin:$PATH" NCCL_TESTS_DIR="$work/nt" MPIRUN="$work/bin/mpirun"
export GUARD_PROBE=true # no GPU to probe here (the probe and the faults: tests/unit/gpu_scripts_fault.sh)
bench() { "$script" --plugin "$work/plugin.so" --no-mps --rounds 2 --time "-b 1K -e 1M -f 32" --bw "-b 32M -e 64M -f 2" \
  --out "$work/out" "$@" 2>&1; }

out=$(bench --tests "sendrecv all_reduce") || fail "the run failed: $out"
echo "$out" | grep -q "FAIL" && fail "a run failed: $out"
# 2 rounds x 2 tests x (2 configurations x 3 sizes + (mplane and 6 Socket points) x 2), and the warm-up's one row.
[ "$(grep -vc '^#' "$work/out/rows.txt")" = $((2 * 2 * (2 * 3 + 7 * 2) + 1)) ] || fail "rows.txt: $(cat "$work/out/rows.txt")"
grep -q "^0 warmup mplane sendrecv 33554432 " "$work/out/rows.txt" || fail "no warm-up row: $(cat "$work/out/rows.txt")"
# 1 KiB: 10.10 us against 20.10; 1 MiB: 114.86 against 124.86.
echo "$out" | grep -qE '^ +1 KiB +20\.1 +10\.1 +0\.50x +20\.1-20\.1 +10\.1-10\.1 +2/2$' || fail "no 1 KiB time row at 0.50x: $out"
echo "$out" | grep -qE '^ +1 MiB +124\.9 +114\.9 +0\.92x +124\.9-124\.9 +114\.9-114\.9 +2/2$' || fail "no 1 MiB time row at 0.92x: $out"
echo "$out" | grep -q "time <= NCCL Socket's default: met (highest ratio 0.92x" || fail "time verdict: $out"
# 32 MiB: mplane 9.97 GB/s, Socket 1x2 6.65 (1x1 4.99): 1.50x against the better point.
echo "$out" | grep -qE 'all_reduce +32 MiB +[0-9.]+ +[0-9.]+ +socket-1x2 +1\.50x$' || fail "no 32 MiB row against 1x2 at 1.50x: $out"
echo "$out" | grep -q "busbw >= 1.7x NCCL Socket's best point: NOT met: sendrecv 32 MiB 1.50x" || fail "bandwidth verdict: $out"
echo "$out" | grep -q "best of 6 NSOCKS_PERTHREAD x SOCKET_NTHREADS points" || fail "grid size: $out"
echo "$out" | grep -q "all_reduce: time in us, median of 2 runs" || fail "run count: $out"
echo "$out" | grep -q "^link: loopback$" || fail "no link line: $out"
echo "PASS: time and bandwidth tables, verdicts, rows"

# The Socket grid: best has the measured best point with its chunk and buffer sizes, full is
# {1,2,4,8} x {1,2,4,8} at NCCL's sizes and at 512K-8M, a list of points is taken as given.
out=$(FAKE_ENV="$work/env" bench --tests sendrecv --time "" --warmup "" --rounds 1) || fail "best grid: $out"
for p in 1x1 1x2 4x4 4x4-512K-8M 8x4-512K-8M 2x8-512K-8M; do grep -q " socket-$p sendrecv " "$work/out/rows.txt" || fail "no point $p: $(cat "$work/out/rows.txt")"; done
grep -q "rank=0 net=Socket socks=4 threads=4 chunk=524288 buff=8388608 if=lo/lo " "$work/env" || fail "4x4-512K-8M env: $(cat "$work/env")"
grep -q "rank=0 net=Socket socks=4 threads=4 chunk= buff= " "$work/env" || fail "4x4 env: $(cat "$work/env")"
out=$(bench --tests sendrecv --time "" --warmup "" --rounds 1 --grid full) || fail "full grid: $out"
[ "$(awk '$2 == "bw" && $3 ~ /^socket-/ {print $3}' "$work/out/rows.txt" | sort -u | wc -l)" = 32 ] || fail "full grid points: $(cat "$work/out/rows.txt")"
grep -q " socket-8x8-512K-8M " "$work/out/rows.txt" && grep -q " socket-2x8 " "$work/out/rows.txt" || fail "full grid corners: $(cat "$work/out/rows.txt")"
out=$(bench --tests sendrecv --time "" --warmup "" --rounds 1 --grid "2x2-1M-4M") || fail "listed point: $out"
grep -q " socket-2x2-1M-4M sendrecv " "$work/out/rows.txt" || fail "listed point: $(cat "$work/out/rows.txt")"
echo "$out" | grep -q "best of 1 NSOCKS_PERTHREAD" || fail "one listed point: $out"
for bad in 9x9 4x4-512K 0x1 "1x1 x"; do
  out=$(bench --grid "$bad"); rc=$?
  { [ $rc = 2 ] && echo "$out" | grep -q -- "--grid"; } || fail "--grid '$bad': rc $rc: $out"
done
echo "PASS: Socket grid"

# --link veth: a fake mplane-netns makes the pair; each rank gets its namespace and the shim, and
# both transports the veth's interfaces. Where namespaces cannot be made, loopback at a 100 GbE
# NIC's rate, said in the summary. --link both: a summary for each link.
mkdir -p "$work/nstools"
cat >"$work/nstools/mplane-netns" <<'EOF'
#!/bin/sh
case "$1" in
  probe) [ -n "${FAKE_NO_NETNS:-}" ] && { echo "mplane-netns: this machine cannot make a veth pair between namespaces: unshare(CLONE_NEWNET): Operation not permitted"; exit 77; }; exit 0 ;;
  up) mkdir -p "$2" && echo /proc/1/ns/net >"$2/ns0" && echo /proc/2/ns/net >"$2/ns1" && echo "mpv0 198.19.250.1/24 <-> mpv1" ;;
  down) echo down >>"$2/../downs" ;;
esac
EOF
chmod +x "$work/nstools/mplane-netns"; touch "$work/nstools/libnetns-after-mpi-init.so"
rm -f "$work/env"
out=$(FAKE_ENV="$work/env" bench --tests sendrecv --rounds 1 --link veth --netns-tools "$work/nstools") || fail "veth: $out"
echo "$out" | grep -q "^link: a veth pair between two network namespaces (mpv0 198.19.250.1/24 <-> mpv1)$" || fail "veth link line: $out"
grep -q "rank=0 net=mplane .* if=mpv/mpv ns=$work/out/netns/ns0 preload=$work/nstools/libnetns-after-mpi-init.so " "$work/env" || fail "rank 0 on veth: $(cat "$work/env")"
grep -q "rank=1 net=Socket .* if=mpv/mpv ns=$work/out/netns/ns1 " "$work/env" || fail "rank 1 on veth: $(cat "$work/env")"
[ -s "$work/out/downs" ] || fail "the pair was not taken down"
rm -f "$work/env"
out=$(FAKE_NO_NETNS=1 FAKE_ENV="$work/env" bench --tests sendrecv --rounds 1 --link veth --netns-tools "$work/nstools") || fail "no netns: $out"
echo "$out" | grep -q "^link: loopback with MPLANE_SOCKET_SPEED=100000 .*: no veth here: mplane-netns: this machine cannot" || fail "fallback link line: $out"
grep -q "rank=0 net=mplane .* if=lo/lo ns= preload= speed=100000" "$work/env" || fail "fallback env: $(cat "$work/env")"
out=$(bench --tests sendrecv --rounds 1 --link both --netns-tools "$work/nstools") || fail "both: $out"
[ -s "$work/out/lo/summary.txt" ] && [ -s "$work/out/veth/summary.txt" ] || fail "both: no summary per link: $(ls -R "$work/out")"
[ "$(echo "$out" | grep -c "^time <= NCCL Socket's default")" = 2 ] || fail "both: two verdicts expected: $out"
out=$(bench --link veth --netns-tools "$work/none"); rc=$?
{ [ $rc = 2 ] && echo "$out" | grep -q -- "--netns-tools"; } || fail "no netns tools: rc $rc: $out"
out=$(bench --link wire); rc=$?
{ [ $rc = 2 ] && echo "$out" | grep -q -- "--link 'wire'"; } || fail "--link wire: rc $rc: $out"
echo "PASS: links"

# A slower median whose runs reach Socket's is marked as within the runs' spread: mplane's two runs
# take 1x and 3x the model's time, a median of 2x, against Socket's 20 us + the same.
out=$(FAKE_TOGGLE="$work/toggle" bench --tests sendrecv --bw "" --warmup "")
echo "$out" | grep -qE '^ +1 KiB +20\.1 +20\.2 +1\.01x +20\.1-20\.1 +10\.1-30\.3 +1/2  within spread$' || fail "no 1 KiB row within spread: $out"
echo "$out" | grep -q "NOT met at 3 of 3 points, 3 of them within the runs' spread (highest ratio 1.84x" || fail "spread verdict: $out"
# each of the 3 points: round 1's mplane run (tripled) slower than Socket's, round 2's faster
echo "$out" | grep -q "faster of its round's pair in 3 of 6 rounds" || fail "paired rounds: $out"
echo "PASS: spread"

# alltoall's repeated rows of size 0 are not runs.
out=$(bench --tests alltoall) || fail "the alltoall run failed: $out"
echo "$out" | grep -q "alltoall: time in us, median of 2 runs" || fail "alltoall run count: $out"
echo "$out" | grep -qE 'alltoall +64 MiB +[0-9.]+ +[0-9.]+ +socket-1x2 +1\.50x$' || fail "alltoall busbw table (rows of size 0 left out): $out"
echo "$out" | grep -q Traceback && fail "the summary failed: $out"
echo "PASS: run count"

# --summarize reads an earlier rows.txt alone.
again=$("$script" --summarize "$work/out/rows.txt") || fail "--summarize failed: $again"
echo "$again" | grep -q "time <= NCCL Socket's default: met" || fail "--summarize: $again"
echo "PASS: --summarize"

# Wrong values, or a run NCCL sent through another network, fail the script and name the run.
out=$(FAKE_WRONG=1 bench --tests sendrecv --rounds 1) && fail "wrong values were taken: $out"
echo "$out" | grep -q "FAIL: mplane sendrecv round 1: wrong values reported (log: " || fail "wrong values: $out"
out=$(FAKE_NET=Socket bench --tests sendrecv --rounds 1) && fail "the wrong network was taken: $out"
echo "$out" | grep -q "FAIL: mplane sendrecv round 1: did not use network mplane" || fail "wrong network: $out"
echo "PASS: bad runs fail the script"

# --variant: runs beside mplane in every round and sweep, a table of ratios; the verdicts stay mplane's.
out=$(bench --tests all_reduce --variant "slow FAKE_SLOW=1") || fail "the variant run failed: $out"
[ "$(grep -c ' mplane-slow all_reduce ' "$work/out/rows.txt")" = $((2 * (3 + 2))) ] || fail "variant rows: $(cat "$work/out/rows.txt")"
echo "$out" | grep -qE '^ +time +all_reduce +1 KiB +10\.10 +20\.20 +2\.00x +\(us\)$' || fail "no variant time row at 2.00x: $out"
echo "$out" | grep -qE '^ +bw +all_reduce +32 MiB +9\.97 +4\.9[89] +0\.50x +\(GB/s\)$' || fail "no variant busbw row at 0.50x: $out"
echo "$out" | grep -q "best of 6 NSOCKS_PERTHREAD x SOCKET_NTHREADS points" || fail "a variant counted as a Socket point: $out"
echo "$out" | grep -q "busbw >= 1.7x NCCL Socket's best point: NOT met: all_reduce 32 MiB 1.50x" || fail "verdict not mplane's: $out"
for bad in "slow" "slow NOEQUALS" "=x A=1" "a/b A=1"; do
  out=$(bench --variant "$bad"); rc=$?
  { [ $rc = 2 ] && echo "$out" | grep -q -- "--variant"; } || fail "--variant '$bad': rc $rc: $out"
done
out=$(bench --variant "v A=1" --variant "v B=2"); rc=$?
{ [ $rc = 2 ] && echo "$out" | grep -q "given twice"; } || fail "a repeated variant name: rc $rc: $out"
echo "PASS: variants"

# No GPU: exit 77 with a message; bad arguments: exit 2 naming them.
out=$(FAKE_NO_GPU=1 bench); rc=$?
{ [ $rc = 77 ] && echo "$out" | grep -q "no GPU"; } || fail "no GPU: rc $rc: $out"
for bad in "--rounds 0" "--grid most" "--env NOEQUALS" "--tests bogus"; do
  # shellcheck disable=SC2086 # each case is an option and its value
  out=$(bench $bad); rc=$?
  { [ $rc = 2 ] && echo "$out" | grep -q -- "${bad%% *}\|bogus_perf"; } || fail "'$bad': rc $rc: $out"
done
echo "PASS: no GPU skips, bad arguments refused"

# --gin: the host path, -D 3 and -D 4 of alltoall in every round, from the GIN nccl-tests with NCCL
# 2.30 first on the library path; --time "" --bw "" runs the GIN sweep alone (no other nccl-tests).
gin() { env -u NCCL_TESTS_DIR FAKE_GIN_DIR="$work/gin" FAKE_NCCL230="$work/nccl230" "$@"; }
gin_bench() { gin "$script" --plugin "$work/plugin.so" --no-mps --out "$work/out" --time "" --bw "" "$@" 2>&1; }
out=$(FAKE_ARGS="$work/args" gin_bench --rounds 2 --gin "-b 1K -e 4M -f 64" --gin-tests-dir "$work/gin" \
  --gin-nccl-lib "$work/nccl230") || fail "the GIN run failed: $out"
# 2 rounds x 3 runs, each with alltoall's 2 rows of size 0 and 3 sizes; the warm-up from the GIN nccl-tests
[ "$(grep -c ' gin ' "$work/out/rows.txt")" = $((2 * 3 * 5)) ] || fail "GIN rows: $(cat "$work/out/rows.txt")"
[ "$(grep -c '^0 warmup mplane alltoall ' "$work/out/rows.txt")" = 3 ] || fail "no GIN warm-up: $(cat "$work/out/rows.txt")"
[ "$(grep -c "^gin -g 1 -b 1K -e 4M -f 64 -R 2 LD=$work/nccl230" "$work/args")" = 2 ] || fail "host path runs: $(cat "$work/args")"
for d in 3 4; do
  [ "$(grep -c "^gin -g 1 -b 1K -e 4M -f 64 -R 2 -D $d LD=$work/nccl230" "$work/args")" = 2 ] || fail "-D $d runs: $(cat "$work/args")"
done
# 1 KiB: 10.1 / 30.2 / 15.1 us; 64 KiB: 16.6 / 43.1 / 21.6 (43.11 / 21.55: the highest -D 3 ratio); 4 MiB: 429.4 / 868.9 / 434.4
echo "$out" | grep -q "^GIN: alltoall through mplane with -R 2, out-of-place time in us, median of the runs (-D 0: 2, -D 3: 2, -D 4: 2)$" || fail "GIN header: $out"
echo "$out" | grep -qE '^ +1 KiB +10\.1 +30\.2 +15\.1 +1\.50x +2\.00x$' || fail "no GIN 1 KiB row: $out"
echo "$out" | grep -qE '^ +64 KiB +16\.6 +43\.1 +21\.6 +1\.30x +2\.00x$' || fail "no GIN 64 KiB row: $out"
echo "$out" | grep -qE '^ +4 MiB +429\.4 +868\.9 +434\.4 +1\.01x +2\.00x$' || fail "no GIN 4 MiB row: $out"
echo "$out" | grep -q "^GIN -D 4 <= 2x -D 0 up to 64 KiB: met (highest 1.50x at 1 KiB)$" || fail "GIN small-size verdict: $out"
echo "$out" | grep -q "^GIN -D 4 <= 1.2x -D 0 from 2 MiB to 16 MiB: met (highest 1.01x at 4 MiB)$" || fail "GIN large-size verdict: $out"
echo "$out" | grep -q "^GIN -D 3 <= 1.5x -D 4: NOT met at 3 of 3 sizes (highest 2.00x at 64 KiB)$" || fail "GIN -D 3 verdict: $out"
echo "$out" | grep -q "^GIN 0 wrong values: met (6 runs)$" || fail "GIN wrong-values verdict: $out"
echo "$out" | grep -q "time <= NCCL Socket" && fail "a time verdict without a time sweep: $out"
echo "PASS: GIN sweep alone"

# --gin-variant: -D 3 and -D 4 again with its variables in every round (the fake halves their times
# under MPLANE_GIN_LANE=kernel), a table against the same rounds' -D 0 and -D 4, and its verdicts.
rm -f "$work/args"
out=$(FAKE_ARGS="$work/args" gin_bench --rounds 2 --warmup "" --gin "-b 1K -e 4M -f 64" --gin-tests-dir "$work/gin" \
  --gin-nccl-lib "$work/nccl230" --gin-variant "kern MPLANE_GIN_LANE=kernel") || fail "the GIN variant run failed: $out"
[ "$(grep -c ' gin ' "$work/out/rows.txt")" = $((2 * 5 * 5)) ] || fail "GIN variant rows: $(cat "$work/out/rows.txt")"
[ "$(grep -c ' gin d4-kern alltoall ' "$work/out/rows.txt")" = $((2 * 5)) ] || fail "no d4-kern rows: $(cat "$work/out/rows.txt")"
echo "$out" | grep -q "^GIN variant kern: its -D 3 and -D 4" || fail "no GIN variant table: $out"
# 1 KiB: -D 0 10.1, -D 4 15.1, kern -D 4 7.55 (0.75x of -D 0), -D 3 15.1 (2.00x), 0.50x of -D 4
echo "$out" | grep -qE '^ +1 KiB +15\.1 +7\.5 +0\.75x +2\.00x +0\.50x$' || fail "no GIN variant 1 KiB row: $out"
echo "$out" | grep -q "^GIN kern: -D 4 <= 2x -D 0 up to 64 KiB: met" || fail "no GIN variant verdict: $out"
echo "$out" | grep -q "^GIN -D 4 <= 2x -D 0 up to 64 KiB: met (highest 1.50x at 1 KiB)$" || fail "the build's verdict moved: $out"
out=$(gin_bench --rounds 1 --gin-variant "kern MPLANE_GIN_LANE=kernel") && fail "--gin-variant without --gin was taken: $out"
out=$(gin_bench --rounds 1 --gin "-b 1K -e 1K" --gin-tests-dir "$work/gin" --gin-variant "kern") && fail "a variant without variables was taken: $out"
echo "PASS: GIN variant"

# The GIN sweep beside the others: the time sweep's tests from NCCL_TESTS_DIR, the GIN runs from theirs.
out=$(FAKE_GIN_DIR="$work/gin" FAKE_NCCL230="$work/nccl230" bench --tests sendrecv --bw "" --gin "-b 1K -e 1K" \
  --gin-tests-dir "$work/gin" --gin-nccl-lib "$work/nccl230") || fail "the time and GIN run failed: $out"
echo "$out" | grep -q "time <= NCCL Socket's default: met" || fail "time verdict beside GIN: $out"
echo "$out" | grep -q "^GIN 0 wrong values: met (6 runs)$" || fail "GIN beside the time sweep: $out"
echo "PASS: GIN sweep beside the time sweep"

# The default nccl-tests against NCCL 2.28 (no --gin-nccl-lib): -D fails, the script names each
# refused run, the targets read as not measured, and it exits 1.
out=$(gin_bench --rounds 1 --warmup "" --gin "-b 1K -e 1K" --gin-tests-dir "$work/nt") && fail "-D without NCCL 2.30 was taken: $out"
echo "$out" | grep -q "FAIL: d3 alltoall round 1: exit status 5" || fail "the -D 3 failure: $out"
echo "$out" | grep -q "^GIN runs refused: -D 3 round 1 (exit status 5), -D 4 round 1 (exit status 5)$" || fail "refused runs: $out"
echo "$out" | grep -q "^GIN -D 4 <= 2x -D 0 up to 64 KiB: NOT met at 1 of 1 sizes, 1 of them not measured$" || fail "unmeasured: $out"
echo "$out" | grep -q "^GIN -D 4 <= 1.2x -D 0 from 2 MiB to 16 MiB: not measured (no such size in the sweep)$" || fail "no large size: $out"
# wrong values under -D 3 refuse those runs and the verdict names them; GIN on another plugin is refused
out=$(FAKE_WRONG_D=3 gin_bench --rounds 2 --warmup "" --gin "-b 1K -e 1K" --gin-tests-dir "$work/gin" \
  --gin-nccl-lib "$work/nccl230") && fail "wrong values were taken: $out"
echo "$out" | grep -q "^GIN 0 wrong values: NOT met: -D 3 round 1, -D 3 round 2$" || fail "GIN wrong values: $out"
out=$(FAKE_GIN_PLUGIN=ib gin_bench --rounds 1 --warmup "" --gin "-b 1K -e 1K" --gin-tests-dir "$work/gin" \
  --gin-nccl-lib "$work/nccl230") && fail "GIN on another plugin was taken: $out"
echo "$out" | grep -q "FAIL: d4 alltoall round 1: GIN assigned to another plugin" || fail "GIN plugin: $out"
echo "PASS: GIN runs refused"

# --summarize of a rows file as the GIN sweep writes it: medians, a missing median, a refused run.
cat >"$work/gin-rows.txt" <<'ROWS'
# round sweep config test size time_us busbw_GBps wrong
1 gin d0 alltoall 32 30.0 0.00 0
2 gin d0 alltoall 32 34.0 0.00 0
3 gin d0 alltoall 32 32.0 0.00 0
1 gin d3 alltoall 32 1500.0 0.00 0
3 gin d3 alltoall 32 1700.0 0.00 0
1 gin d4 alltoall 32 1200.0 0.00 0
2 gin d4 alltoall 32 1300.0 0.00 0
3 gin d4 alltoall 32 1250.0 0.00 0
1 gin d0 alltoall 2097152 280.0 7.49 0
1 gin d3 alltoall 2097152 420.0 4.99 0
1 gin d4 alltoall 2097152 300.0 6.99 0
1 gin d0 alltoall 8388608 700.0 11.98 0
1 gin d4 alltoall 8388608 1000.0 8.39 0
# failed 2 gin d3 alltoall exit status 124
ROWS
out=$("$script" --summarize "$work/gin-rows.txt") || fail "--summarize of GIN rows failed: $out"
echo "$out" | grep -q "median of the runs (-D 0: 3, -D 3: 2, -D 4: 3)$" || fail "GIN run counts: $out"
echo "$out" | grep -qE '^ +32 B +32\.0 +1600\.0 +1250\.0 +39\.06x +1\.28x$' || fail "GIN 32 B row: $out"
echo "$out" | grep -qE '^ +8 MiB +700\.0 +- +1000\.0 +1\.43x +- *$' || fail "GIN 8 MiB row without -D 3: $out"
echo "$out" | grep -q "^GIN -D 4 <= 2x -D 0 up to 64 KiB: NOT met at 1 of 1 sizes (highest 39.06x at 32 B)$" || fail "small: $out"
echo "$out" | grep -q "^GIN -D 4 <= 1.2x -D 0 from 2 MiB to 16 MiB: NOT met at 1 of 2 sizes (highest 1.43x at 8 MiB)$" || fail "large: $out"
echo "$out" | grep -q "^GIN -D 3 <= 1.5x -D 4: NOT met at 1 of 3 sizes, 1 of them not measured (highest 1.40x at 2 MiB)$" || fail "-D 3: $out"
echo "$out" | grep -q "^GIN 0 wrong values: met (8 runs)$" || fail "wrong values: $out"
echo "$out" | grep -q "^GIN runs refused: -D 3 round 2 (exit status 124)$" || fail "refused: $out"
echo "PASS: GIN --summarize"

# The GIN options refused where they cannot run: exit 2, naming what is wrong.
gin_refused() { # TEXT OPTION...: refused with TEXT in the message
  local want=$1 rc
  shift
  out=$(gin_bench "$@"); rc=$?
  { [ $rc = 2 ] && echo "$out" | grep -qF -- "$want"; } || fail "'$*': rc $rc: $out"
}
gin_refused "leave out '-D'" --gin "-b 8 -D 4"
gin_refused "leave out '-R'" --gin "-b 8 -R 1"
gin_refused "belong to the GIN sweep" --gin-tests-dir "$work/gin"
gin_refused "no alltoall_perf in '$work/none'" --gin "-b 8" --gin-tests-dir "$work/none"
gin_refused "--gin-nccl-lib '$work/none': no such directory" --gin "-b 8" --gin-tests-dir "$work/gin" --gin-nccl-lib "$work/none"
gin_refused "nothing to run" --gin ""
echo "PASS: GIN options refused"
