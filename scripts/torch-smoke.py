#!/usr/bin/env python3
"""Run PyTorch collectives through NCCL (and mplane), check every value, print GB/s.

    scripts/torch-smoke.py [--net mplane|socket] [--emulate-nodes N] [--no-p2p] [--size 64M] ...

Spawns one process per GPU (torch.multiprocessing), builds a NCCL process group and runs, each
checked against a reference computed on the GPU with plain torch:

    all_reduce (sum), all_gather_into_tensor, reduce_scatter_tensor, all_to_all_single (even
    splits), all_to_all_single (uneven splits, some of them empty), batch_isend_irecv (every rank
    sends to and receives from every other rank)

Sizes follow nccl-tests: --size is the whole buffer of the op (all_reduce: the tensor; all_gather:
the gathered output; reduce_scatter: the input; all_to_all: what one rank sends in all; send/recv:
what one rank sends to each peer). algbw = bytes / time, busbw = algbw * nccl-tests' factor; the
time is the slowest rank's mean over --iters calls after --warmup calls.

Which network carries the traffic:
  --net mplane   NCCL_NET_PLUGIN=mplane NCCL_NET=mplane, build/ (or MPLANE_LIB_DIR) on LD_LIBRARY_PATH
  --net socket   NCCL's own TCP transport: NCCL_NET_PLUGIN=none NCCL_NET=Socket
  --net default  leave NCCL's choice alone
GPUs of one host use NVLink/PCIe (P2P) and shared memory unless:
  --emulate-nodes N   processes are split into N emulated nodes, each with its own NCCL_HOSTID, so
                      NCCL (and mplane) treat them as different hosts and talk through the network
  --no-p2p            NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1
On one host both transports use loopback (MPLANE_SOCKET_IFNAME=lo, NCCL_SOCKET_IFNAME=lo) unless
those are set already or --ifname says otherwise. NCCL_NVLS_ENABLE=0 is always set.

Each rank logs NCCL at INFO (subsystems INIT,NET) to <log-dir>/nccl-rank<r>.log; the script reads
'Using network X', 'NET/Plugin: Loaded net plugin X (vN)' and the '[send] via NET/X' channel lines
from them and says which network NCCL used. With --net mplane|socket it fails if NCCL used another
one, or, when the ranks are on different (emulated) hosts or P2P is off, if no channel went through
it. With --net mplane, MPLANE_STATS_FILE is pointed into the log dir and the plugin's byte counters
(per plane and per traffic class) are reported too. --traffic-class C gives the process group
ncclConfig_t.trafficClass C through ProcessGroupNCCL.Options().config.traffic_class; with --net
mplane the run fails if the plugin counted bytes but none in class C.

Exit status: 0 all correct; 1 a wrong value or a rank failed; 2 bad usage; 3 the wrong network;
77 no GPU visible; 124 the run exceeded --timeout.
--backend gloo --device cpu runs the same checks on CPU processes (no NCCL): for testing the script.
"""

import argparse
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time

SIZE_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMGkmg]?)(?:i?[Bb])?\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size '{text}' is not valid: expected bytes with an optional K/M/G suffix, e.g. 64M")
    v = int(m.group(1)) * SIZE_SUFFIX[m.group(2).upper()]
    if v <= 0:
        raise argparse.ArgumentTypeError(f"size '{text}' must be positive")
    return v


def parse_sizes(text):
    return [parse_size(t) for t in text.split(",") if t.strip()]


def fmt_bytes(n):
    for unit, div in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


# ----------------------------------------------------------------------------------------------
# The work each rank does.

ELEM = 4  # float32; values are small integers, so sums are exact and checks are bit-for-bit


def pattern(torch, n, seed, device):
    """n float32 values, a function of (index, seed): small integers (< 1021), exact under sums."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * 7 + seed * 131 + (i >> 10) * 3) % 1021).to(torch.float32)


def uneven_splits(world, unit):
    """in_splits[s][d]: elements rank s sends to rank d; some are 0 (self included for some s)."""
    return [[unit * ((s * world + d) % 3) for d in range(world)] for s in range(world)]


class Op:
    """One collective: setup() allocates, run() issues one call, check() counts wrong values."""

    name = "?"
    busbw_factor = 1.0

    def __init__(self, torch, dist, rank, world, size, device):
        self.torch, self.dist, self.rank, self.world, self.device = torch, dist, rank, world, device
        self.size = size

    def corrupt(self):
        """Spoil one received value (--corrupt: proves the checks can fail)."""
        out = self.buf if isinstance(self, AllReduce) else (
            next(iter(self.recv.values())) if isinstance(self, SendRecv) else self.out)
        out.view(-1)[-1] += 1

    def mismatches(self, got, want):
        if got.shape != want.shape:
            return max(got.numel(), want.numel())
        return int((got != want).sum().item())


class AllReduce(Op):
    name = "all_reduce"

    def setup(self, seed):
        t, n = self.torch, max(1, self.size // ELEM)
        self.bytes = n * ELEM
        self.busbw_factor = 2.0 * (self.world - 1) / self.world
        self.buf = pattern(t, n, self.rank * 17 + seed, self.device)
        self.want = sum(pattern(t, n, r * 17 + seed, self.device) for r in range(self.world))

    def run(self):
        self.dist.all_reduce(self.buf)

    def check(self):
        return self.mismatches(self.buf, self.want)

    def reset(self, seed):  # all_reduce is in place: refill before a checked call
        self.buf.copy_(pattern(self.torch, self.buf.numel(), self.rank * 17 + seed, self.device))
        self.want = sum(pattern(self.torch, self.buf.numel(), r * 17 + seed, self.device) for r in range(self.world))


class AllGather(Op):
    name = "all_gather"

    def setup(self, seed):
        t, n = self.torch, max(1, self.size // ELEM // self.world)
        self.bytes = n * self.world * ELEM
        self.busbw_factor = (self.world - 1) / self.world
        self.inp = pattern(t, n, self.rank * 17 + seed, self.device)
        self.out = t.full((n * self.world,), -1.0, device=self.device)
        self.want = t.cat([pattern(t, n, r * 17 + seed, self.device) for r in range(self.world)])

    def run(self):
        self.dist.all_gather_into_tensor(self.out, self.inp)

    def check(self):
        return self.mismatches(self.out, self.want)


class ReduceScatter(Op):
    name = "reduce_scatter"

    def setup(self, seed):
        t, n = self.torch, max(1, self.size // ELEM // self.world)
        self.bytes = n * self.world * ELEM
        self.busbw_factor = (self.world - 1) / self.world
        self.inp = pattern(t, n * self.world, self.rank * 17 + seed, self.device)
        self.out = t.full((n,), -1.0, device=self.device)
        total = sum(pattern(t, n * self.world, r * 17 + seed, self.device) for r in range(self.world))
        self.want = total[self.rank * n:(self.rank + 1) * n].clone()

    def run(self):
        self.dist.reduce_scatter_tensor(self.out, self.inp)

    def check(self):
        return self.mismatches(self.out, self.want)


class AllToAll(Op):
    name = "all_to_all"

    def chunk(self, src, dst, n, seed):
        return pattern(self.torch, n, 1000 + (src * self.world + dst) * 7 + seed, self.device)

    def setup(self, seed):
        t, w, r = self.torch, self.world, self.rank
        n = max(1, self.size // ELEM // w)
        self.bytes = n * w * ELEM
        self.busbw_factor = (w - 1) / w
        self.inp = t.cat([self.chunk(r, d, n, seed) for d in range(w)])
        self.out = t.full((n * w,), -1.0, device=self.device)
        self.want = t.cat([self.chunk(s, r, n, seed) for s in range(w)])

    def run(self):
        self.dist.all_to_all_single(self.out, self.inp)

    def check(self):
        return self.mismatches(self.out, self.want)


class AllToAllUneven(AllToAll):
    name = "all_to_all_uneven"

    def setup(self, seed):
        t, w, r = self.torch, self.world, self.rank
        unit = max(1, self.size // ELEM // w)  # mean split is one unit: same bytes as the even case on average
        splits = uneven_splits(w, unit)
        self.in_splits = splits[r]
        self.out_splits = [splits[s][r] for s in range(w)]
        # bytes: the mean over ranks of what each rank sends (the ranks send different amounts)
        self.bytes = sum(sum(row) for row in splits) * ELEM // w
        self.busbw_factor = (w - 1) / w
        self.inp = t.cat([self.chunk(r, d, self.in_splits[d], seed) for d in range(w)])
        self.out = t.full((sum(self.out_splits),), -1.0, device=self.device)
        self.want = t.cat([self.chunk(s, r, self.out_splits[s], seed) for s in range(w)])

    def run(self):
        self.dist.all_to_all_single(self.out, self.inp, output_split_sizes=self.out_splits,
                                    input_split_sizes=self.in_splits)


class SendRecv(Op):
    name = "batch_isend_irecv"

    def setup(self, seed):
        t, w, r = self.torch, self.world, self.rank
        n = max(1, self.size // ELEM)
        self.peers = [p for p in range(w) if p != r]
        self.bytes = n * ELEM * len(self.peers)  # what this rank sends per call, to all peers
        self.busbw_factor = 1.0
        self.send = {p: pattern(t, n, 5000 + (r * w + p) * 7 + seed, self.device) for p in self.peers}
        self.recv = {p: t.full((n,), -1.0, device=self.device) for p in self.peers}
        self.want = {p: pattern(t, n, 5000 + (p * w + r) * 7 + seed, self.device) for p in self.peers}

    def run(self):
        d = self.dist
        ops = []
        for p in self.peers:
            ops.append(d.P2POp(d.isend, self.send[p], p))
            ops.append(d.P2POp(d.irecv, self.recv[p], p))
        for req in d.batch_isend_irecv(ops):
            req.wait()

    def check(self):
        return sum(self.mismatches(self.recv[p], self.want[p]) for p in self.peers)


OPS = [AllReduce, AllGather, ReduceScatter, AllToAll, AllToAllUneven, SendRecv]
OP_NAMES = [o.name for o in OPS]


def rank_env(rank, cfg):
    """Environment one rank sets before NCCL initialises (NCCL reads it at its first call)."""
    env = {}
    if cfg["emulate_nodes"] > 1:
        per_node = cfg["nprocs"] // cfg["emulate_nodes"]
        env["NCCL_HOSTID"] = f"{cfg['hostid_prefix']}{rank // per_node}"
    if cfg["backend"] == "nccl":
        env["NCCL_DEBUG_FILE"] = os.path.join(cfg["log_dir"], f"nccl-rank{rank}.log")
    return env


def worker(local_rank, cfg):
    for k, v in rank_env(local_rank, cfg).items():
        os.environ[k] = v
    import torch
    import torch.distributed as dist

    rank, world = local_rank, cfg["nprocs"]
    if cfg["device"] == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        sync = torch.cuda.synchronize
    else:
        device = torch.device("cpu")
        sync = lambda: None  # noqa: E731
    kwargs = dict(backend=cfg["backend"], init_method="file://" + cfg["store"], rank=rank,
                  world_size=world, timeout=datetime.timedelta(seconds=cfg["timeout"]))
    if cfg["device"] == "cuda":
        kwargs["device_id"] = device  # eager NCCL init: the communicator exists before the first op
    if cfg["traffic_class"] is not None:
        # ncclConfig_t.trafficClass of the group's communicator (torch 2.11 exposes it here)
        opts = dist.ProcessGroupNCCL.Options()
        opts.config.traffic_class = cfg["traffic_class"]
        kwargs["pg_options"] = opts
    dist.init_process_group(**kwargs)

    results = []
    for size in cfg["sizes"]:
        for cls in OPS:
            if cls.name not in cfg["ops"]:
                continue
            op = cls(torch, dist, rank, world, size, device)
            # 1. checked calls: --check-iters calls in a row, each on its own buffers and data
            checks = []
            for k in range(cfg["check_iters"]):
                c = cls(torch, dist, rank, world, size, device)
                c.setup(seed=k + 1)
                checks.append(c)
            sync()
            for c in checks:
                c.run()
            sync()
            if cfg["corrupt"] and rank == world - 1:
                checks[-1].corrupt()
            wrong = sum(c.check() for c in checks)
            del checks
            # 2. timed calls
            op.setup(seed=99)
            for _ in range(cfg["warmup"]):
                op.run()
            sync()
            dist.barrier()
            sync()
            t0 = time.perf_counter()
            for _ in range(cfg["iters"]):
                op.run()
            sync()
            elapsed = (time.perf_counter() - t0) / cfg["iters"]
            # 3. the last timed call's output is checked too (all_reduce is in place: one more call)
            if isinstance(op, AllReduce):
                op.reset(seed=99)
                op.run()
                sync()
            wrong += op.check()
            t = torch.tensor([elapsed, float(wrong)], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            slowest = t[0].item()
            wrong_all = torch.tensor([wrong], dtype=torch.int64, device=device)
            dist.all_reduce(wrong_all)
            results.append({"op": cls.name, "size": size, "bytes": op.bytes, "time_us": slowest * 1e6,
                            "algbw_GBps": op.bytes / slowest / 1e9,
                            "busbw_GBps": op.bytes / slowest / 1e9 * op.busbw_factor,
                            "wrong": int(wrong_all.item()), "wrong_this_rank": wrong})
            del op
            if cfg["device"] == "cuda":
                torch.cuda.empty_cache()
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(cfg["log_dir"], f"result-rank{rank}.json"), "w") as f:
        json.dump(results, f)


# ----------------------------------------------------------------------------------------------
# The launcher.

def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def setup_env(args):
    """Process-wide environment, set in the launcher so every spawned rank inherits it
    (LD_LIBRARY_PATH must be in place when a process starts: the loader reads it once)."""
    env = os.environ
    notes = []
    env["NCCL_NVLS_ENABLE"] = "0"
    if args.backend != "nccl":
        return notes
    env["NCCL_DEBUG"] = "INFO"  # to the per-rank files only (NCCL_DEBUG_FILE)
    env.setdefault("NCCL_DEBUG_SUBSYS", "INIT,NET")
    if args.no_p2p:
        env["NCCL_P2P_DISABLE"] = "1"
        env["NCCL_SHM_DISABLE"] = "1"
    if args.net == "mplane":
        lib_dir = os.path.abspath(args.lib_dir or env.get("MPLANE_LIB_DIR") or os.path.join(repo_root(), "build"))
        plugin = os.path.join(lib_dir, "libnccl-net-mplane.so")
        if not os.path.isfile(plugin):
            raise SystemExit(f"torch-smoke: {plugin} not found: build it (scripts/setup.sh --build) or point "
                             "--lib-dir / MPLANE_LIB_DIR at the folder holding libnccl-net-mplane.so")
        env["LD_LIBRARY_PATH"] = lib_dir + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
        env["NCCL_NET_PLUGIN"] = "mplane"
        env["NCCL_NET"] = "mplane"  # fail loudly instead of falling back to NCCL's own transports
        env.setdefault("MPLANE_STATS_FILE", os.path.join(args.log_dir, "mplane-stats.%p.json"))
        notes.append(f"plugin {plugin}")
    elif args.net == "socket":
        env["NCCL_NET_PLUGIN"] = "none"
        env["NCCL_NET"] = "Socket"
    if args.ifname:
        if args.net == "mplane" and "MPLANE_SOCKET_IFNAME" not in env:
            env["MPLANE_SOCKET_IFNAME"] = args.ifname
        if "NCCL_SOCKET_IFNAME" not in env:
            env["NCCL_SOCKET_IFNAME"] = args.ifname
    return notes


def read_network_report(log_dir, nprocs):
    """Per rank: the network NCCL said it used, the plugin it loaded, and how many channels each
    transport carries ('[send] via NET/<name>', 'via P2P', 'via SHM')."""
    ranks = []
    for r in range(nprocs):
        path = os.path.join(log_dir, f"nccl-rank{r}.log")
        rep = {"rank": r, "log": path, "using": [], "plugin": None, "net_channels": {}, "p2p_channels": 0,
               "shm_channels": 0, "warnings": []}
        try:
            with open(path, errors="replace") as f:
                text = f.read()
        except OSError:
            rep["missing"] = True
            ranks.append(rep)
            continue
        rep["using"] = sorted(set(re.findall(r"Using network (\S+)", text)))
        m = re.search(r"NET/Plugin: Loaded net plugin (\S+) \((v\d+)\)", text)
        if m:
            rep["plugin"] = f"{m.group(1)} ({m.group(2)})"
        for name in re.findall(r"\[send\] via NET/([^/\s]+)/", text):
            rep["net_channels"][name] = rep["net_channels"].get(name, 0) + 1
        rep["p2p_channels"] = len(re.findall(r"\[send\] via P2P", text))
        rep["shm_channels"] = len(re.findall(r"\[send\] via SHM", text))
        rep["warnings"] = [ln.strip() for ln in text.splitlines() if " WARN " in ln][:5]
        ranks.append(rep)
    return ranks


# mplane's traffic classes (common/tc_map.h): ncclConfig_t.trafficClass values 0..4
TRAFFIC_CLASSES = {"default": 0, "collective": 1, "alltoall": 2, "lowlat": 3, "storage": 4, "hfreduce": 5}


def parse_traffic_class(text):
    t = text.strip().lower()
    if t in TRAFFIC_CLASSES:
        return TRAFFIC_CLASSES[t]
    if re.fullmatch(r"\d+", t):
        return int(t)
    raise argparse.ArgumentTypeError(f"traffic class '{text}' is not valid: expected one of "
                                     f"{', '.join(TRAFFIC_CLASSES)} or an integer")


def read_plugin_stats(log_dir):
    """Sums of the plugin's per-plane and per-class counters over the MPLANE_STATS_FILE files the
    ranks wrote."""
    tx = rx = n = 0
    classes = {}
    for path in glob.glob(os.path.join(log_dir, "mplane-stats.*.json")):
        try:
            with open(path) as f:
                s = json.load(f)
        except (OSError, ValueError):
            continue
        n += 1
        for p in s.get("planes", []):
            tx += p.get("tx_bytes", 0)
            rx += p.get("rx_bytes", 0)
        for c in s.get("classes", []):
            if "class" in c:
                classes[c["class"]] = classes.get(c["class"], 0) + c.get("tx_bytes", 0)
    return {"files": n, "tx_bytes": tx, "rx_bytes": rx, "class_tx_bytes": classes} if n else None


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.split("\n")[2:]))
    ap.add_argument("--net", choices=["mplane", "socket", "default"], default="mplane")
    ap.add_argument("--emulate-nodes", type=int, default=1, metavar="N",
                    help="split the processes into N emulated nodes (a NCCL_HOSTID each)")
    ap.add_argument("--no-p2p", action="store_true", help="NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1")
    ap.add_argument("--size", type=parse_sizes, default=[64 << 20],
                    help="bytes per op, K/M/G allowed; a comma list runs each size (default 64M)")
    ap.add_argument("--nprocs", type=int, default=0, help="processes (default: one per visible GPU)")
    ap.add_argument("--ops", default=",".join(OP_NAMES), help="comma list, of: " + ", ".join(OP_NAMES))
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--check-iters", type=int, default=3,
                    help="checked calls issued back to back before timing, each on its own buffers (default 3)")
    ap.add_argument("--ifname", default="lo",
                    help="interface for MPLANE_SOCKET_IFNAME / NCCL_SOCKET_IFNAME when unset (default lo; '' = leave alone)")
    ap.add_argument("--lib-dir", help="folder with libnccl-net-mplane.so (default $MPLANE_LIB_DIR or build/)")
    ap.add_argument("--log-dir", help="per-rank NCCL logs and results (default: a new temporary folder)")
    ap.add_argument("--json", help="write the results and the network report to this file")
    ap.add_argument("--label", default="", help="a name for this run in the output and JSON")
    ap.add_argument("--timeout", type=int, default=300, help="seconds for the whole run (and NCCL's own timeout)")
    ap.add_argument("--traffic-class", type=parse_traffic_class, default=None,
                    help="give the process group this ncclConfig_t.trafficClass through ProcessGroupNCCL.Options "
                         "(mplane classes: default, collective, alltoall, lowlat, storage, hfreduce, or a number)")
    ap.add_argument("--corrupt", action="store_true", help="spoil one value per op on the last rank (tests the checks)")
    ap.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    ap.add_argument("--device", choices=["cuda", "cpu"], default=None,
                    help="cpu with --backend gloo checks this script without GPUs")
    args = ap.parse_args()

    args.ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in args.ops if o not in OP_NAMES]
    if bad:
        ap.error(f"--ops: unknown op(s) {', '.join(bad)}; expected some of {', '.join(OP_NAMES)}")
    if args.device is None:
        args.device = "cuda" if args.backend == "nccl" else "cpu"
    if args.backend == "nccl" and args.device != "cuda":
        ap.error("--backend nccl needs --device cuda")
    if args.traffic_class is not None and args.backend != "nccl":
        ap.error("--traffic-class needs --backend nccl")

    import torch
    import torch.multiprocessing as mp

    if args.device == "cuda":
        ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if ngpu == 0:
            print("torch-smoke: no CUDA GPU visible (torch.cuda.device_count() == 0): skipped", file=sys.stderr)
            return 77
        nprocs = args.nprocs or ngpu
        if nprocs > ngpu:
            ap.error(f"--nprocs {nprocs}: only {ngpu} GPU(s) visible")
    else:
        nprocs = args.nprocs or 2
    if nprocs < 2:
        ap.error(f"needs at least 2 processes (have {nprocs})")
    if args.emulate_nodes < 1 or nprocs % args.emulate_nodes:
        ap.error(f"--emulate-nodes {args.emulate_nodes} must divide the process count {nprocs}")

    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="torch-smoke-"))
    os.makedirs(args.log_dir, exist_ok=True)
    for old in glob.glob(os.path.join(args.log_dir, "nccl-rank*.log")) + \
            glob.glob(os.path.join(args.log_dir, "result-rank*.json")) + \
            glob.glob(os.path.join(args.log_dir, "mplane-stats.*.json")):
        os.remove(old)
    notes = setup_env(args)
    store = os.path.join(args.log_dir, "store")  # rendezvous through a file: one host, no port to pick
    if os.path.exists(store):
        os.remove(store)

    cfg = {"nprocs": nprocs, "emulate_nodes": args.emulate_nodes, "sizes": args.size, "ops": args.ops,
           "iters": args.iters, "warmup": args.warmup, "check_iters": args.check_iters,
           "backend": args.backend, "device": args.device, "store": store, "log_dir": args.log_dir,
           "timeout": args.timeout, "corrupt": args.corrupt, "traffic_class": args.traffic_class,
           "hostid_prefix": f"torch-smoke-{os.getpid()}-node"}
    label = args.label or (args.net if args.backend == "nccl" else args.backend)
    where = f"{args.emulate_nodes} emulated node(s)" if args.emulate_nodes > 1 else "one host"
    print(f"torch-smoke [{label}]: {nprocs} processes ({args.device}), {where}, net={args.net if args.backend == 'nccl' else 'n/a (gloo)'}"
          f"{', P2P/SHM off' if args.no_p2p else ''}, torch {torch.__version__}"
          + (f", NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}" if args.backend == "nccl" else ""))
    for n in notes:
        print(f"  {n}")
    print(f"  logs: {args.log_dir}")
    sys.stdout.flush()

    rc = 0
    deadline = time.monotonic() + args.timeout + 30
    ctx = mp.start_processes(worker, args=(cfg,), nprocs=nprocs, join=False, start_method="spawn")
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                print(f"torch-smoke: no result within {args.timeout + 30} s: stopping the ranks", file=sys.stderr)
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                rc = 124
                break
    except Exception as e:  # a rank raised or died: spawn re-raises it here
        print(f"torch-smoke: a rank failed: {e}", file=sys.stderr)
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        rc = 1

    per_rank = []
    for r in range(nprocs):
        try:
            with open(os.path.join(args.log_dir, f"result-rank{r}.json")) as f:
                per_rank.append(json.load(f))
        except (OSError, ValueError):
            per_rank.append(None)
    results = per_rank[0] or []
    if rc == 0 and any(p is None for p in per_rank):
        print("torch-smoke: a rank wrote no result", file=sys.stderr)
        rc = 1

    if results:
        print(f"{'op':<20} {'size':>8} {'bytes':>12} {'time_us':>11} {'algbw_GB/s':>11} {'busbw_GB/s':>11} {'wrong':>7}")
        for res in results:
            print(f"{res['op']:<20} {fmt_bytes(res['size']):>8} {res['bytes']:>12} {res['time_us']:>11.1f} "
                  f"{res['algbw_GBps']:>11.2f} {res['busbw_GBps']:>11.2f} {res['wrong']:>7}"
                  + ("   WRONG VALUES" if res["wrong"] else ""))
    wrong_total = sum(res["wrong"] for res in results)
    if wrong_total:
        rc = 1

    report = {"label": label, "net": args.net, "nprocs": nprocs, "emulate_nodes": args.emulate_nodes,
              "no_p2p": args.no_p2p, "torch": torch.__version__, "results": results, "rc": rc}
    if args.backend == "nccl":
        ranks = read_network_report(args.log_dir, nprocs)
        report["network"] = ranks
        used = sorted({u for rep in ranks for u in rep["using"]})
        net_ch = {}
        for rep in ranks:
            for k, v in rep["net_channels"].items():
                net_ch[k] = net_ch.get(k, 0) + v
        p2p = sum(rep["p2p_channels"] for rep in ranks)
        shm = sum(rep["shm_channels"] for rep in ranks)
        plugins = sorted({rep["plugin"] for rep in ranks if rep["plugin"]})
        print(f"network: NCCL says 'Using network {', '.join(used) or '?'}'"
              + (f"; NET/Plugin: Loaded net plugin {', '.join(plugins)}" if plugins else "")
              + "; send channels: " + ", ".join([f"NET/{k} {v}" for k, v in sorted(net_ch.items())]
                                                 + [f"P2P {p2p}", f"SHM {shm}"]))
        stats = read_plugin_stats(args.log_dir) if args.net == "mplane" else None
        if stats:
            report["plugin_stats"] = stats
            print(f"mplane counters ({stats['files']} processes): {stats['tx_bytes']} bytes sent, "
                  f"{stats['rx_bytes']} bytes received through the plugin; sent per class: "
                  + ", ".join(f"{k} {v}" for k, v in stats["class_tx_bytes"].items() if v))
            if args.traffic_class is not None and stats["tx_bytes"]:
                names = {v: k for k, v in TRAFFIC_CLASSES.items()}
                want_cls = names.get(args.traffic_class)
                if want_cls and not stats["class_tx_bytes"].get(want_cls):
                    print(f"torch-smoke: the group's traffic class is {want_cls} but mplane counted no bytes "
                          "in that class", file=sys.stderr)
                    rc = rc or 3
        elif args.net == "mplane":
            print("mplane counters: no MPLANE_STATS_FILE output found (written when the plugin closes)")
        want = {"mplane": "mplane", "socket": "Socket"}.get(args.net)
        through_net = args.emulate_nodes > 1 or args.no_p2p
        if want:
            missing = [rep["rank"] for rep in ranks if rep["using"] != [want]]
            if missing:
                print(f"torch-smoke: rank(s) {missing} did not report 'Using network {want}' "
                      f"(see {args.log_dir}/nccl-rank*.log)", file=sys.stderr)
                rc = rc or 3
            elif through_net and not net_ch.get(want):
                print(f"torch-smoke: no channel went through NET/{want}", file=sys.stderr)
                rc = rc or 3
        for rep in ranks:
            for w in rep["warnings"]:
                print(f"  rank {rep['rank']} WARN: {w}")
    report["rc"] = rc
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    print(f"torch-smoke [{label}]: " + ("all values correct" if rc == 0 else
                                       f"FAILED (exit {rc}; {wrong_total} wrong values)"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
