"""The C API of libmplane-ep (collectives/ep/mplane_ep.h) as ctypes declarations: one entry per
constant, struct and function of the header, nothing else. tests/python/test_ep_binding.py parses
the header and fails on any difference, so keep this file a mirror: when the header changes, change
this file the same way (and bump nothing here: the ABI version comes from the header).

No torch here: this module must import with a plain python3 (CI).

STATE: written before collectives/ep/mplane_ep.h existed (the library was at its planner and CPU
model), from issue 7's API and the planner's terms (ep_plan.h, ep_sched.h, ep_model.h). The names
and parameters below are the binding's proposal; the header decides. The binding test reports
every difference once the header is there.
"""

import ctypes
import os

from ctypes import POINTER, c_char_p, c_float, c_int, c_int32, c_void_p

HEADER = "collectives/ep/mplane_ep.h"

# ---- constants (#define / enum of the header) ----
MPLANE_EP_ABI_VERSION = 1
MPLANE_EP_FMT_FP8 = 0    # dispatch on the wire as FP8 e4m3, one float32 scale per 1x128 tile
MPLANE_EP_FMT_BF16 = 1   # dispatch as BF16
MPLANE_EP_TILE = 128     # elements per FP8 scale

CONSTANTS = {
    "MPLANE_EP_ABI_VERSION": MPLANE_EP_ABI_VERSION,
    "MPLANE_EP_FMT_FP8": MPLANE_EP_FMT_FP8,
    "MPLANE_EP_FMT_BF16": MPLANE_EP_FMT_BF16,
    "MPLANE_EP_TILE": MPLANE_EP_TILE,
}


# ---- structs ----
class mplane_ep_config(ctypes.Structure):
    """Shape of a context; buffers are sized once from it."""
    _c_name_ = "mplane_ep_config"
    _fields_ = [
        ("gpus_per_node", c_int),   # 0: from NCCL's view of the hosts
        ("num_experts", c_int),     # E, a multiple of the rank count
        ("hidden", c_int),          # H, a multiple of 128
        ("topk", c_int),            # K
        ("max_tokens", c_int),      # tokens per rank per call, at most
        ("max_recv_rows", c_int),   # expert-output rows per rank; 0: the worst case
        ("worst_case", c_int),      # 1: worst-case offsets, no host synchronisation (CUDA graphs)
        ("flat", c_int),            # 1: plain all-to-all, one copy per (token, expert) (the baseline)
    ]


class mplane_ep_info(ctypes.Structure):
    """What a context resolved: topology and sizes."""
    _c_name_ = "mplane_ep_info"
    _fields_ = [
        ("rank", c_int),
        ("nranks", c_int),
        ("nodes", c_int),
        ("gpus_per_node", c_int),
        ("local_experts", c_int),
        ("max_recv_rows", c_int),
    ]


STRUCTS = [mplane_ep_config, mplane_ep_info]

# ---- functions: name -> (restype, argtypes). Pointers to device memory are c_void_p. ----
# Every int-returning call returns 0 on success, else an error code, with the message in
# mplane_ep_last_error(ctx) (ctx NULL: the calling thread's last error, e.g. from create).
FUNCTIONS = {
    "mplane_ep_abi_version": (c_int, []),
    "mplane_ep_last_error": (c_char_p, [c_void_p]),
    "mplane_ep_create": (c_int, [POINTER(c_void_p), c_void_p, POINTER(mplane_ep_config), c_void_p]),
    "mplane_ep_destroy": (c_int, [c_void_p]),
    "mplane_ep_get_info": (c_int, [c_void_p, POINTER(mplane_ep_info)]),
    # route(ctx, logits [T][E] f32, bias [E] f32 or NULL, T, num_groups, topk_groups, scaling,
    #       normalize, topk_idx [T][K] i32 out, topk_weights [T][K] f32 out, stream)
    "mplane_ep_route": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_int, c_int, c_float, c_int,
                                c_void_p, c_void_p, c_void_p]),
    # dispatch(ctx, x [T][H] bf16, topk_idx, topk_weights, T, fmt,
    #          recv_x [rows][H] (fp8 bytes or bf16), recv_scale [rows][H/128] f32, recv_weight [rows] f32,
    #          recv_src [rows][2] i32 (source rank, token), expert_off [Er+1] i32 (device),
    #          num_recv (host int, out; -1 in worst-case mode), stream)
    "mplane_ep_dispatch": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int, c_int,
                                   c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(c_int32), c_void_p]),
    # combine(ctx, y [rows][H] bf16 (expert outputs, rows of the last dispatch), out [T][H] bf16, stream)
    "mplane_ep_combine": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
}


class EPError(RuntimeError):
    """A libmplane-ep call failed; the message is the library's."""


def default_library_paths(repo_root=None):
    """Where libmplane-ep.so is looked for: $MPLANE_EP_LIB (a file), then $MPLANE_LIB_DIR and the
    repository's build folders (build*/collectives/ep, build*/)."""
    paths = []
    if os.environ.get("MPLANE_EP_LIB"):
        paths.append(os.environ["MPLANE_EP_LIB"])
    root = repo_root or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    dirs = []
    if os.environ.get("MPLANE_LIB_DIR"):
        dirs.append(os.environ["MPLANE_LIB_DIR"])
    dirs.append(os.path.join(root, "build"))
    try:
        dirs += sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("build-"))
    except OSError:
        pass
    for d in dirs:
        for sub in ("collectives/ep", ""):
            paths.append(os.path.join(d, sub, "libmplane-ep.so"))
    return paths


def load(path=None):
    """Open libmplane-ep.so, declare every function, and check its ABI version. Load torch (or the
    NCCL the communicator comes from) first: the library's libnccl.so.2 then binds to that one."""
    candidates = [path] if path else default_library_paths()
    tried = []
    for p in candidates:
        if not os.path.isfile(p):
            tried.append(f"{p} (not there)")
            continue
        try:
            lib = ctypes.CDLL(p)
            break
        except OSError as e:
            tried.append(f"{p} ({e})")
    else:
        raise EPError("mplane_ep: libmplane-ep.so not found or not loadable; set MPLANE_EP_LIB to its path. Tried: "
                      + "; ".join(tried))
    missing = []
    for name, (res, args) in FUNCTIONS.items():
        try:
            f = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        f.restype = res
        f.argtypes = args
    if missing:
        raise EPError(f"mplane_ep: {p} lacks {', '.join(missing)}: the library and this binding "
                      f"({__file__}) are from different versions")
    got = lib.mplane_ep_abi_version()
    if got != MPLANE_EP_ABI_VERSION:
        raise EPError(f"mplane_ep: {p} has ABI version {got}, this binding mirrors version {MPLANE_EP_ABI_VERSION} "
                      f"of {HEADER}: rebuild the library or update python/mplane_ep/_abi.py")
    lib._mplane_path = p
    return lib


def last_error(lib, ctx):
    msg = lib.mplane_ep_last_error(ctx)
    return msg.decode(errors="replace") if msg else "(no message)"


def check(lib, ctx, rc, what):
    if rc != 0:
        raise EPError(f"{what}: {last_error(lib, ctx)} (error {rc})")
