#!/usr/bin/env python3
"""GPU test: libmplane-ep from PyTorch (collectives/ep/python/mplane_ep) against pure-torch references, and its
time beside the plain torch all_to_all_single MoE baseline, in one run.

    python3 tests/gpu/test_mplane_ep_torch.py [--emulate-nodes 2] [--net mplane] [--json FILE]

One process per GPU (torch.multiprocessing). With --emulate-nodes N each group of processes gets
its own NCCL_HOSTID, so the library sees N nodes and its network phase goes through NCCL's net
plugin (mplane by default, see --net); --emulate-nodes 1 is one node (NVLink phase only).

Checks, for BF16 and FP8 dispatch, with the library's own communicator (traffic class alltoall)
and, once, with the process group's communicator (ProcessGroupNCCL._comm_ptr()):
  route     top-k ids equal mplane_ep.reference.route_ref (DeepSeek-V3 group-limited gating),
            weights within 1e-6 relative
  dispatch  per local expert, the rows (source rank, token), their weights and payload (FP8 bytes and
            scales, or BF16) equal the top-k gather computed in torch from every rank's inputs
            (all_gather), in the library's row order; routings include dropped slots (-1),
            out-of-range ids and repeats, and ranks have different token counts
  combine   identity experts (y = the received rows, dequantised) -> out within the documented bound
            of x * sum(kept weights) (mplane_ep.reference.tolerance)
The same checks run on the fast path (Context(nvlink_direct=True, token_rows=True): expert rows
gathered from the token rows through row_token) for FP8, BF16 and FP8 tokens given already
quantised ((x_fp8, x_scales), which must give the same bits as the library's own quantisation).
The pure-torch baseline (reference.TorchAllToAllMoE: one BF16 copy per (token, expert) through
all_to_all_single) is checked the same way and timed beside the library on a larger shape.

Exit: 0 all correct; 1 a mismatch or a failure (a missing libmplane-ep.so included); 77 no GPU.
"""

import argparse
import importlib.machinery
import importlib.util
import json
import os
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(ROOT, "collectives", "ep", "python"))


def load_smoke():
    loader = importlib.machinery.SourceFileLoader("torch_smoke", os.path.join(ROOT, "scripts", "torch-smoke.py"))
    spec = importlib.util.spec_from_loader("torch_smoke", loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    return mod


def gen_tokens(torch, T, H, seed, device):
    """BF16 tokens whose magnitude changes per 128-tile (2^-8 .. 2^8), some tiles all zero."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((T, H), generator=g, device=device)
    tiles = H // 128
    mag = 2.0 ** (torch.randint(-8, 9, (T, tiles), generator=g, device=device).float())
    mag[torch.rand((T, tiles), generator=g, device=device) < 0.03] = 0
    return (x.view(T, tiles, 128) * mag.unsqueeze(2)).view(T, H).to(torch.bfloat16)


def spoil_routing(torch, idx, E, seed):
    """Dropped slots (-1), out-of-range ids and repeats in a few tokens (the library drops them)."""
    idx = idx.clone()
    g = torch.Generator(device=idx.device).manual_seed(seed)
    T, K = idx.shape
    n = max(1, T // 50)
    rows = torch.randperm(T, generator=g, device=idx.device)[:3 * n]
    idx[rows[:n], K - 1] = -1
    idx[rows[n:2 * n], 0] = E + 5
    if K > 1:
        idx[rows[2 * n:], 1] = idx[rows[2 * n:], 0]
    return idx


def gather_var(torch, dist, t, counts):
    """all_gather of [T_r, ...] tensors with different T_r: pad to the largest, then cut."""
    Tm = max(counts)
    pad = t.new_zeros((Tm,) + tuple(t.shape[1:]))
    pad[:t.shape[0]] = t
    out = [torch.empty_like(pad) for _ in counts]
    dist.all_gather(out, pad)
    return [o[:c] for o, c in zip(out, counts)]


def check_case(torch, dist, ep, R, cfg, fp8, seed, log, fp8_in=False):
    """One dispatch + identity + combine through the library, checked. Returns the error count.
    fp8_in: the tokens go in already quantised (torch's reference quantiser), as DeepEP takes them;
    the rows must be the same bits as the library's own quantisation."""
    rank, world, dev = dist.get_rank(), dist.get_world_size(), ep.device
    E, K, H = cfg["experts"], cfg["topk"], cfg["hidden"]
    T = cfg["tokens"] - 37 * rank  # different token counts per rank
    errors = 0
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    logits = torch.randn((T, E), generator=g, device=dev) * 2
    bias = (torch.rand((E,), generator=torch.Generator(device=dev).manual_seed(seed), device=dev) - 0.5) * 0.2
    ngroups, tgroups = cfg["groups"], cfg["topk_groups"]
    idx, w = ep.route(logits, bias, num_groups=ngroups, topk_groups=tgroups, scaling=2.5)
    ridx, rw = R.route_ref(logits, bias, ngroups, tgroups, K, 2.5, True)
    bad_idx = int((idx != ridx).any(dim=1).sum().item())
    werr = ((w - rw).abs() / rw.abs().clamp_min(1e-30)).masked_fill(idx != ridx, 0).max().item()
    if bad_idx or werr > 1e-6:
        log(f"route: {bad_idx} of {T} tokens with other expert ids, weight error {werr:.2e} (limit 1e-6)")
        errors += bad_idx + (1 if werr > 1e-6 else 0)

    idx = spoil_routing(torch, idx, E, seed + rank)
    x = gen_tokens(torch, T, H, seed * 7 + rank, dev)
    d = ep.dispatch(R.fp8_quantize_ref(x) if fp8_in else x, idx, w, fp8=fp8)
    dx, dscale = d.rows()  # with token rows: gathered from them through row_token
    if ep.token_rows and (d.token_x is None or d.row_token is None):
        log("dispatch: a token_rows context returned no token rows")
        errors += 1

    counts = [0] * world
    ct = torch.tensor([T], device=dev)
    cl = [torch.zeros_like(ct) for _ in range(world)]
    dist.all_gather(cl, ct)
    counts = [int(c.item()) for c in cl]
    idx_all = gather_var(torch, dist, idx, counts)
    w_all = gather_var(torch, dist, w, counts)
    x_all = gather_var(torch, dist, x, counts)
    want = R.expected_dispatch(rank, world, ep.gpus_per_node, E, idx_all, w_all, x_all, fp8)

    # layout counts against the torch top-k gather
    li = d.layout.info()
    eff_all = [R.effective_topk(i, E) for i in idx_all]
    Er = E // world
    want_rank = [int(((eff_all[rank] // Er) == r).logical_and(eff_all[rank] >= 0).any(dim=1).sum().item())
                 for r in range(world)]
    if li["tokens_per_rank"] is not None and li["tokens_per_rank"] != want_rank:
        log(f"layout: tokens_per_rank {li['tokens_per_rank']} != torch {want_rank}")
        errors += 1
    want_exp = [int((eff_all[rank] == e).sum().item()) for e in range(E)]
    if li["tokens_per_expert"] is not None and li["tokens_per_expert"] != want_exp:
        log("layout: tokens_per_expert differs from torch")
        errors += 1

    off = d.expert_offsets.tolist()
    n = off[-1]
    if off != want["expert_off"]:
        log(f"dispatch: expert offsets {off[:8]}... != torch top-k gather {want['expert_off'][:8]}...")
        errors += 1
    elif d.num_rows is not None and d.num_rows != n:
        log(f"dispatch: num_rows {d.num_rows} but expert offsets end at {n}")
        errors += 1
    else:
        e_src = int((d.src[:n] != want["src"]).any(dim=1).sum().item())
        e_w = int((d.weight[:n] != want["weight"]).sum().item())
        if fp8:
            e_x = int((dx[:n].view(torch.uint8) != want["q"].view(torch.uint8)).any(dim=1).sum().item())
            e_s = int((dscale[:n] != want["scale"]).any(dim=1).sum().item())
        else:
            e_x = int((dx[:n] != want["x"]).any(dim=1).sum().item())
            e_s = 0
        if e_src or e_w or e_x or e_s:
            log(f"dispatch: of {n} rows, {e_src} with another source, {e_w} another weight, {e_x} other payload, "
                f"{e_s} other scales than the torch top-k gather")
            errors += e_src + e_w + e_x + e_s

    # identity experts, computed here from what the library delivered
    y = R.fp8_dequantize_ref(dx[:n], dscale[:n]) if fp8 else dx[:n].clone()
    y_lib = ep.dequant(d)  # the library's identity expert must agree bit for bit
    e_dq = int((y_lib[:n] != y).any(dim=1).sum().item())
    if e_dq:
        log(f"dequant: {e_dq} of {n} rows differ from torch's dequantisation")
        errors += e_dq
    out = ep.combine(y, d)
    eff = R.effective_topk(idx, E)
    W = torch.where(eff >= 0, w, torch.zeros_like(w)).sum(dim=1)
    tol = R.tolerance(x, W, fp8)
    err = (out.float() - x.float() * W.unsqueeze(1)).abs()
    viol = int((err > tol).sum().item())
    if viol:
        worst = (err / tol.clamp_min(1e-30)).max().item()
        log(f"combine: {viol} of {out.numel()} values outside the bound (worst error/bound {worst:.2f})")
        errors += viol
    return errors, {"tokens": T, "rows": n, "net_bytes": li["dispatch_net_bytes"] + li["combine_net_bytes"]}


def check_baseline(torch, dist, R, cfg, seed, log, dev=None):
    rank = dist.get_rank()
    dev = dev or torch.device("cuda", torch.cuda.current_device())
    E, K, H = cfg["experts"], cfg["topk"], cfg["hidden"]
    T = cfg["tokens"] - 37 * rank
    g = torch.Generator(device=dev).manual_seed(seed * 1000 + rank)
    logits = torch.randn((T, E), generator=g, device=dev)
    idx, w = R.route_ref(logits, None, cfg["groups"], cfg["topk_groups"], K, 2.5, True)
    idx = spoil_routing(torch, idx, E, seed + rank)
    x = gen_tokens(torch, T, H, seed * 7 + rank, dev)
    base = R.TorchAllToAllMoE(E)
    rx, _ = base.dispatch(x, idx, w)
    out = base.combine(rx)
    eff = R.effective_topk(idx, E)
    W = torch.where(eff >= 0, w, torch.zeros_like(w)).sum(dim=1)
    viol = int(((out.float() - x.float() * W.unsqueeze(1)).abs() > R.tolerance(x, W, False)).sum().item())
    if viol:
        log(f"torch baseline: {viol} values outside the bound")
    return viol


def bench(torch, dist, ep, R, cfg, fp8, iters, warmup):
    """Seconds per dispatch+combine (slowest rank) for the library and for the torch baseline, on
    the same routing and tokens."""
    rank, dev = dist.get_rank(), ep.device
    E, K, H, T = cfg["experts"], cfg["topk"], cfg["hidden"], cfg["tokens"]
    g = torch.Generator(device=dev).manual_seed(99 + rank)
    logits = torch.randn((T, E), generator=g, device=dev)
    idx, w = R.route_ref(logits, None, cfg["groups"], cfg["topk_groups"], K, 2.5, True)
    x = gen_tokens(torch, T, H, 5 + rank, dev)
    d = ep.dispatch(x, idx, w, fp8=fp8)
    li = d.layout.info()
    y = torch.zeros((max(1, d.weight.shape[0]), H), dtype=torch.bfloat16, device=dev)  # same routing: same rows

    def run_ep():
        dd = ep.dispatch(x, idx, w, fp8=fp8)
        ep.combine(y, dd)

    base = R.TorchAllToAllMoE(E)

    def run_base():
        rx, _ = base.dispatch(x, idx, w)
        base.combine(rx)

    times = {}
    for name, fn in (("mplane_ep", run_ep), ("torch_all_to_all", run_base)):
        for _ in range(warmup):
            fn()
        torch.cuda.synchronize()
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times[name] = t.item()
    eff = R.effective_topk(idx, E)
    pairs = int((eff >= 0).sum().item())
    del d
    # bytes this rank sends: the library's own count (network + NVLink/intra-node, both phases) and
    # the baseline's (one BF16 copy per (token, expert) pair to another rank, there and back)
    own = int((eff >= 0).logical_and((eff // (E // dist.get_world_size())) == rank).sum().item())
    return times, {"tokens": T, "pairs": pairs,
                   "ep_bytes": li["dispatch_net_bytes"] + li["dispatch_nvl_bytes"] + li["combine_net_bytes"]
                   + li["combine_nvl_bytes"],
                   "ep_net_bytes": li["dispatch_net_bytes"] + li["combine_net_bytes"],
                   "base_bytes": 2 * (pairs - own) * H * 2}


def worker(local_rank, cfg):
    for k, v in cfg["rank_env"][local_rank].items():
        os.environ[k] = v
    import datetime
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    dist.init_process_group("nccl", init_method="file://" + cfg["store"], rank=local_rank,
                            world_size=cfg["nprocs"], device_id=dev,
                            timeout=datetime.timedelta(seconds=cfg["timeout"]))
    rank = dist.get_rank()
    msgs = []

    def log(m):
        msgs.append(f"rank {rank}: {m}")
        print(f"[rank {rank}] {m}", flush=True)

    result = {"rank": rank, "errors": 0, "cases": [], "bench": []}
    try:
        import mplane_ep
        from mplane_ep import reference as R
        small, big = cfg["check_shape"], cfg["bench_shape"]
        for comm in ("own", "group"):
            for fp8 in (False, True):
                if comm == "group" and not fp8:
                    continue  # the group's communicator: once is enough
                with mplane_ep.Context(num_experts=small["experts"], hidden=small["hidden"], topk=small["topk"],
                                       max_tokens=small["tokens"], comm=comm) as ep:
                    e, info = check_case(torch, dist, ep, R, small, fp8, seed=3 + fp8, log=log)
                    result["errors"] += e
                    result["cases"].append({"comm": comm, "fmt": "fp8" if fp8 else "bf16", "errors": e,
                                            "nodes": ep.nodes, "gpus_per_node": ep.gpus_per_node, **info})
        # the fast path: NVLink-direct writes, token rows, and tokens already in FP8
        for fp8, fp8_in in ((True, False), (True, True), (False, False)):
            with mplane_ep.Context(num_experts=small["experts"], hidden=small["hidden"], topk=small["topk"],
                                   max_tokens=small["tokens"], nvlink_direct=True, token_rows=True) as ep:
                e, info = check_case(torch, dist, ep, R, small, fp8, seed=5 + fp8 + 2 * fp8_in, log=log, fp8_in=fp8_in)
                result["errors"] += e
                result["cases"].append({"comm": "own" + (" direct+tokens fp8-in" if fp8_in else " direct+tokens"),
                                        "fmt": "fp8" if fp8 else "bf16", "errors": e, "nodes": ep.nodes,
                                        "gpus_per_node": ep.gpus_per_node, **info})
        result["errors"] += check_baseline(torch, dist, R, small, 11, log)
        for fp8, fast in ((True, False), (False, False), (True, True)):
            with mplane_ep.Context(num_experts=big["experts"], hidden=big["hidden"], topk=big["topk"],
                                   max_tokens=big["tokens"], nvlink_direct=fast, token_rows=fast) as ep:
                times, info = bench(torch, dist, ep, R, big, fp8, cfg["iters"], cfg["warmup"])
                result["bench"].append({"fmt": ("fp8" if fp8 else "bf16") + (" direct+token rows" if fast else ""),
                                        **times, **info})
    except Exception as e:  # every rank reports; the launcher prints them
        log(f"FAILED: {type(e).__name__}: {e}")
        msgs.append(traceback.format_exc())
        result["errors"] += 1
        result["exception"] = f"{type(e).__name__}: {e}"
    result["messages"] = msgs
    with open(os.path.join(cfg["log_dir"], f"ep-rank{rank}.json"), "w") as f:
        json.dump(result, f)
    try:
        dist.destroy_process_group()
    except Exception:
        pass


def parse_shape(text):
    keys = ["tokens", "hidden", "experts", "topk", "groups", "topk_groups"]
    vals = [int(v) for v in text.split(",")]
    if len(vals) != len(keys):
        raise argparse.ArgumentTypeError(f"shape '{text}': expected {','.join(keys)}")
    return dict(zip(keys, vals))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="\n".join(__doc__.split("\n")[2:]),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--emulate-nodes", type=int, default=2)
    ap.add_argument("--net", choices=["mplane", "socket", "default"], default="mplane")
    ap.add_argument("--nprocs", type=int, default=0)
    ap.add_argument("--check-shape", type=parse_shape, default=parse_shape("1024,2048,64,8,8,4"),
                    help="tokens,hidden,experts,topk,groups,topk_groups for the checks (default 1024,2048,64,8,8,4)")
    ap.add_argument("--bench-shape", type=parse_shape, default=parse_shape("4096,7168,256,8,8,4"),
                    help="the timed shape (default DeepSeek-V3: 4096,7168,256,8,8,4)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--lib-dir", help="folder with libnccl-net-mplane.so (default $MPLANE_LIB_DIR or build/)")
    ap.add_argument("--log-dir")
    ap.add_argument("--json")
    ap.add_argument("--timeout", type=int, default=420)
    args = ap.parse_args()

    try:
        import torch
        import torch.multiprocessing as mp
    except ImportError as e:
        import shutil
        import subprocess
        has_gpu = shutil.which("nvidia-smi") and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0
        if not has_gpu:
            print(f"test_mplane_ep_torch: no GPU (and no torch: {e}): skipped")
            return 77
        print(f"test_mplane_ep_torch: a GPU is here but torch is not importable: {e}", file=sys.stderr)
        return 1

    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if ngpu == 0:
        print("test_mplane_ep_torch: no CUDA GPU visible: skipped")
        return 77
    nprocs = args.nprocs or ngpu
    if nprocs < 2 or nprocs > ngpu or nprocs % args.emulate_nodes:
        ap.error(f"{nprocs} processes on {ngpu} GPUs, {args.emulate_nodes} emulated nodes: need 2 <= processes <= GPUs, "
                 "divisible by the node count")

    smoke = load_smoke()
    args.log_dir = os.path.abspath(args.log_dir or tempfile.mkdtemp(prefix="mplane-ep-torch-"))
    os.makedirs(args.log_dir, exist_ok=True)
    args.backend, args.no_p2p, args.ifname = "nccl", False, "lo"
    notes = smoke.setup_env(args)
    store = os.path.join(args.log_dir, "store")
    if os.path.exists(store):
        os.remove(store)
    per_node = nprocs // args.emulate_nodes
    rank_env = []
    for r in range(nprocs):
        env = {"NCCL_DEBUG_FILE": os.path.join(args.log_dir, f"nccl-rank{r}.log")}
        if args.emulate_nodes > 1:
            env["NCCL_HOSTID"] = f"ep-torch-{os.getpid()}-node{r // per_node}"
        rank_env.append(env)
    cfg = {"nprocs": nprocs, "store": store, "log_dir": args.log_dir, "timeout": args.timeout, "rank_env": rank_env,
           "check_shape": args.check_shape, "bench_shape": args.bench_shape, "iters": args.iters,
           "warmup": args.warmup}
    print(f"test_mplane_ep_torch: {nprocs} processes, {args.emulate_nodes} emulated node(s), net={args.net}, "
          f"torch {torch.__version__}; logs {args.log_dir}")
    for n in notes:
        print(f"  {n}")
    sys.stdout.flush()

    rc = 0
    ctx = mp.start_processes(worker, args=(cfg,), nprocs=nprocs, join=False, start_method="spawn")
    deadline = time.monotonic() + args.timeout + 30
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                print("test_mplane_ep_torch: timed out: stopping the ranks", file=sys.stderr)
                for p in ctx.processes:
                    if p.is_alive():
                        p.terminate()
                rc = 1
                break
    except Exception as e:
        print(f"test_mplane_ep_torch: a rank died: {e}", file=sys.stderr)
        rc = 1

    results = []
    for r in range(nprocs):
        try:
            with open(os.path.join(args.log_dir, f"ep-rank{r}.json")) as f:
                results.append(json.load(f))
        except (OSError, ValueError):
            print(f"test_mplane_ep_torch: rank {r} wrote no result", file=sys.stderr)
            rc = 1
    errors = sum(r["errors"] for r in results)
    for r in results:
        for m in r.get("messages", []):
            print(m)
    if results:
        print(f"{'check':<44} {'tokens':>7} {'rows':>7} {'nodes x gpus':>12} {'errors':>7}")
        for r in results:
            for c in r["cases"]:
                print(f"rank {r['rank']} {c['comm'] + ' comm, ' + c['fmt']:<37} {c['tokens']:>7} {c['rows']:>7} "
                      f"{str(c['nodes']) + ' x ' + str(c['gpus_per_node']):>12} {c['errors']:>7}")
        b = results[0].get("bench", [])
        if b:
            s = args.bench_shape
            print(f"time per dispatch+combine, slowest rank, {s['tokens']} tokens/rank, hidden {s['hidden']}, "
                  f"top-{s['topk']} of {s['experts']} experts, {args.iters} iterations:")
            for row in b:
                ratio = row["torch_all_to_all"] / row["mplane_ep"] if row["mplane_ep"] else float("nan")
                print(f"  {row['fmt']}: mplane_ep {row['mplane_ep'] * 1e3:.2f} ms ({row['ep_bytes'] / 1e6:.1f} MB sent, "
                      f"{row['ep_net_bytes'] / 1e6:.1f} MB of it to other nodes), torch all_to_all_single "
                      f"{row['torch_all_to_all'] * 1e3:.2f} ms ({row['base_bytes'] / 1e6:.1f} MB sent), "
                      f"speedup {ratio:.2f}x")
    net = smoke.read_network_report(args.log_dir, nprocs)
    used = sorted({u for rep in net for u in rep["using"]})
    print(f"network: NCCL says 'Using network {', '.join(used) or '?'}'")
    if errors:
        rc = 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "network": net, "rc": rc}, f, indent=1)
    print("test_mplane_ep_torch: " + ("all correct" if rc == 0 else f"FAILED ({errors} errors)"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
