#!/usr/bin/env python3
"""A stand-in for one nccl-tests binary (all_reduce_perf, ...), for testing scripts/autotune without a GPU.

usage: fake_nccl_test.py COLLECTIVE [nccl-tests options: -b -e -f -g -n -w -c ...]

It prints what nccl-tests prints (header, "#  Rank ..." device lines, one row per size with
out-of-place and in-place time/algbw/busbw/#wrong, the footer) for a made-up machine whose
algorithm/protocol speeds are a fixed latency + bandwidth model (MODEL below), so the best choice per
size is known in advance. It honours the environment the way NCCL would:
  NCCL_ALGO / NCCL_PROTO   force a combination; one the machine lacks fails like NCCL does
  NCCL_TUNER_PLUGIN + MPLANE_TUNER_CONFIG   the first matching table row decides (as mplane's tuner)
  otherwise                NCCL's default choice, deliberately not the best one (DEFAULT_CHOICE)
Test knobs: FAKE_NOISE (relative noise, default 0), FAKE_HANG ("Algo/Proto" that never finishes),
FAKE_FAIL_DEFAULT=1 (the default run fails), FAKE_NODES (hosts to spread ranks over, default 1),
FAKE_SLEEP (seconds each run takes, default 0), FAKE_MODEL ("Ring/LL128=5,120;..." replaces entries of
MODEL: latency us, bandwidth GB/s).
Latency modes, as a machine whose whole runs are sometimes slow at small sizes: FAKE_SLOW (default 1.3)
multiplies the latency of every choice in a slow run. Which runs are slow: FAKE_MODES, a string of F
(fast) and S (slow), one letter per measuring run in the order they happen (cycled; runs NCCL refuses
do not count), or FAKE_MODE_SEED (with FAKE_MODE_P, default 0.5, the chance of a slow run) for a seeded
random pick per run. Both count runs in the file FAKE_STATE (created on first use); FAKE_SEED also seeds
FAKE_NOISE per run, for repeatable tests.
With NCCL_DEBUG=INFO and TUNING in NCCL_DEBUG_SUBSYS it prints NCCL's per-call
"<Coll>: N Bytes -> Algo X proto Y" lines.
"""
import os
import random
import sys
import time

# (latency us, bandwidth GB/s) per algorithm/protocol on the fake machine.
MODEL = {
    ("Tree", "LL"): (4.0, 15.0),
    ("Tree", "LL128"): (9.0, 100.0),
    ("Tree", "Simple"): (20.0, 250.0),
    ("Ring", "LL"): (5.0, 20.0),
    ("Ring", "LL128"): (8.0, 120.0),
    ("Ring", "Simple"): (15.0, 300.0),
    ("NVLS", "Simple"): (25.0, 400.0),
}
# Which algorithms the fake machine offers per collective (CollNet, NVLSTree and PAT: none).
OFFERED = {
    "all_reduce": {"Tree", "Ring", "NVLS"},
    "all_gather": {"Ring", "NVLS"},
    "reduce_scatter": {"Ring", "NVLS"},
    "broadcast": {"Ring"},
    "reduce": {"Ring"},
}
TABLE_NAME = {"all_reduce": "allreduce", "all_gather": "allgather", "reduce_scatter": "reducescatter",
              "broadcast": "broadcast", "reduce": "reduce"}
ALGO_FROM_TABLE = {"tree": "Tree", "ring": "Ring", "nvls": "NVLS", "nvlstree": "NVLSTree", "pat": "PAT",
                   "collnetdirect": "CollNetDirect", "collnetchain": "CollNetChain"}
PROTO_FROM_TABLE = {"ll": "LL", "ll128": "LL128", "simple": "Simple"}


NCCL_FUNC = {"all_reduce": "AllReduce", "all_gather": "AllGather", "reduce_scatter": "ReduceScatter",
             "broadcast": "Broadcast", "reduce": "Reduce"}


def default_choice(coll, size):
    """NCCL's pick on the fake machine: Ring, LL below 16 KiB, Simple from there."""
    return ("Ring", "LL") if size < 16384 else ("Ring", "Simple")


def parse_size(s):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:].upper(), 1)
    return int(s[:-1] if mult > 1 else s) * mult


def norm(s):
    return s.strip().lower().replace("_", "").replace("-", "")


def table_choice(path, coll, size, nranks, nnodes):
    """First row of an mplane tuner table that matches, as (Algo, Proto), else None."""
    import csv  # here: it costs half the start-up time, and only runs with a table need it
    with open(path, newline="") as f:
        lines = [l for l in f if l.strip() and not l.lstrip().startswith("#")]
    for row in csv.DictReader(lines):
        row = {k.strip(): v.strip() for k, v in row.items()}
        if norm(row["collective"]) not in (TABLE_NAME[coll], "any", "1"):
            continue
        lo = max(parse_size(row["min_bytes"]), 0)
        hi = parse_size(row["max_bytes"])
        if size < lo or (hi >= 0 and size > hi):
            continue
        if int(row["nodes"]) not in (-1, nnodes) or int(row["ranks"]) not in (-1, nranks):
            continue
        return ALGO_FROM_TABLE[norm(row["algorithm"])], PROTO_FROM_TABLE[norm(row["protocol"])]
    return None


def run_index():
    """This run's number (0, 1, ...) from the counter in FAKE_STATE, which it increments; None without it."""
    path = os.environ.get("FAKE_STATE")
    if not path:
        return None
    try:
        with open(path) as f:
            n = int(f.read().strip() or 0)
    except FileNotFoundError:
        n = 0
    with open(path, "w") as f:
        f.write(str(n + 1))
    return n


def slow_mode(n):
    """Whether run number n is in the slow latency mode."""
    modes = os.environ.get("FAKE_MODES", "")
    if modes:
        if n is None:
            nccl_failure("FAKE_MODES needs FAKE_STATE")
        return modes[n % len(modes)].upper() == "S"
    if os.environ.get("FAKE_MODE_SEED"):
        if n is None:
            nccl_failure("FAKE_MODE_SEED needs FAKE_STATE")
        rng = random.Random(int(os.environ["FAKE_MODE_SEED"]) * 1000003 + n)
        return rng.random() < float(os.environ.get("FAKE_MODE_P", "0.5"))
    return False


def apply_model_override():
    for item in filter(None, os.environ.get("FAKE_MODEL", "").split(";")):
        key, _, val = item.partition("=")
        algo, proto = key.strip().split("/")
        lat, bw = (float(x) for x in val.split(","))
        MODEL[(algo, proto)] = (lat, bw)


def nccl_failure(msg):
    print(f"fakehost: Test NCCL failure common.cu:1234 '{msg}'", flush=True)
    print(" .. fakehost pid 4242: Test failure common.cu:1111", flush=True)
    sys.exit(3)


def main():
    coll = sys.argv[1]
    opts = {"-b": "8", "-e": "32M", "-f": "2", "-g": "1", "-n": "20", "-w": "5", "-c": "1"}
    args = sys.argv[2:]
    i = 0
    while i < len(args):
        if args[i] in opts or args[i] in ("-d", "-o", "-t", "-m", "-a", "-z", "-G", "-N"):
            opts[args[i]] = args[i + 1]
            i += 2
        else:
            nccl_failure(f"unknown option {args[i]}")
    b, e, f, g = parse_size(opts["-b"]), parse_size(opts["-e"]), int(opts["-f"]), int(opts["-g"])
    nnodes = int(os.environ.get("FAKE_NODES", "1"))
    nranks = g * nnodes
    algo, proto = os.environ.get("NCCL_ALGO"), os.environ.get("NCCL_PROTO")
    tuner = os.environ.get("NCCL_TUNER_PLUGIN", "")
    table = os.environ.get("MPLANE_TUNER_CONFIG", "")
    use_table = bool(tuner and tuner.lower() != "none" and table and not algo and not proto)
    if use_table and not os.path.exists(tuner) and "/" in tuner:
        nccl_failure(f"tuner plugin {tuner} not found")
    if use_table and os.environ.get("NCCL_DEBUG", "").upper() == "INFO":
        print(f"fakehost:4242:4242 [0] NCCL INFO TUNER/Plugin: Using mplane (v5)")
    if (algo or proto) and not (algo and proto):
        nccl_failure("this fake needs NCCL_ALGO and NCCL_PROTO together")
    if algo and (algo not in OFFERED[coll] or (algo, proto) not in MODEL):
        print(f"fakehost:4242:4242 [0] NCCL WARN Error : no algorithm/protocol available for function "
              f"{coll} with datatype ncclFloat32. NCCL_ALGO was set to {algo}. NCCL_PROTO was set to {proto}.",
              flush=True)
        nccl_failure("invalid usage (run with NCCL_DEBUG=WARN for details)")
    if not algo and os.environ.get("FAKE_FAIL_DEFAULT") == "1":
        nccl_failure("unhandled system error")
    if algo and os.environ.get("FAKE_HANG") == f"{algo}/{proto}":
        time.sleep(3600)

    time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
    apply_model_override()
    n = run_index()
    slow = float(os.environ.get("FAKE_SLOW", "1.3")) if slow_mode(n) else 1.0
    noise = float(os.environ.get("FAKE_NOISE", "0"))
    rng = random.Random(int(os.environ["FAKE_SEED"]) * 1000003 + (n or 0)) if os.environ.get("FAKE_SEED") \
        else random.Random()
    factor = {"all_reduce": 2.0 * (nranks - 1) / nranks, "all_gather": (nranks - 1) / nranks,
              "reduce_scatter": (nranks - 1) / nranks, "broadcast": 1.0, "reduce": 1.0}[coll]
    redop = "none" if coll in ("all_gather", "broadcast") else "sum"
    root = 0 if coll in ("broadcast", "reduce") else -1
    print("# nccl-tests version 2.17.6 nccl-headers=22809 nccl-library=22809")
    print(f"# Collective test starting: {coll}_perf")
    print(f"# nThread 1 nGpus {g} minBytes {b} maxBytes {e} step: {f}(factor) warmup iters: {opts['-w']} "
          f"iters: {opts['-n']} agg iters: 1 validation: {opts['-c']} graph: 0")
    print("#\n# Using devices")
    for r in range(nranks):
        print(f"#  Rank {r:2d} Group  0 Pid {4242 + r // g:6d} on {'fakehost' + str(r // g):>10s} device {r % g:2d} "
              f"[{r % g:04x}:18:00] NVIDIA H200")
    print("#")
    print("#                                                              out-of-place                       in-place          ")
    print("#       size         count      type   redop    root     time   algbw   busbw  #wrong     time   algbw   busbw  #wrong ")
    print("#        (B)    (elements)                               (us)  (GB/s)  (GB/s)             (us)  (GB/s)  (GB/s)         ")
    size, total_bw, rows = b, 0.0, 0
    while size <= e:
        count = size // 4
        if coll in ("all_gather", "reduce_scatter"):
            count = ((count // nranks) & ~3) * nranks
        nbytes = count * 4
        if use_table:
            choice = table_choice(table, coll, nbytes, nranks, nnodes)
            if choice is None or choice[0] not in OFFERED[coll] or choice not in MODEL:
                choice = default_choice(coll, nbytes)  # as NCCL: an ignored entry is never taken
        elif algo:
            choice = (algo, proto)
        else:
            choice = default_choice(coll, nbytes)
        lat, bw = MODEL[choice]
        if os.environ.get("NCCL_DEBUG", "").upper() == "INFO" and "TUNING" in os.environ.get("NCCL_DEBUG_SUBSYS", ""):
            print(f"fakehost:4242:4242 [0] NCCL INFO {NCCL_FUNC[coll]}: {nbytes} Bytes -> Algo {choice[0].upper()} "
                  f"proto {choice[1].upper()} channel{{Lo..Hi}}={{0..1}}")
        cols = []
        for _ in ("out-of-place", "in-place"):
            t = (lat * slow + nbytes / (bw * 1e3)) * (1.0 + rng.uniform(-noise, noise))
            algbw = nbytes / t / 1e3 if nbytes else 0.0
            cols.append(f"  {t:7.2f}  {algbw:6.2f}  {algbw * factor:6.2f}  {0:6d}")
            total_bw += algbw * factor / 2
        print(f"{nbytes:12d}  {count:12d}  {'float':>8s}  {redop:>6s}  {root:6d}" + "".join(cols))
        rows += 1
        size *= f
    print("# Out of bounds values : 0 OK")
    print(f"# Avg bus bandwidth    : {total_bw / max(rows, 1):g} ")
    print("#")
    print(f"# Collective test concluded: {coll}_perf")
    print()


if __name__ == "__main__":
    main()
