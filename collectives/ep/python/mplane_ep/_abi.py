"""The C API of libmplane-ep (collectives/ep/mplane_ep.h) as ctypes declarations: one entry per
constant, struct and function of the header, nothing else. tests/python/test_ep_binding.py parses
the header (and compiles it for struct sizes and offsets) and fails on any difference, so keep this
file a mirror: when the header changes, change this file the same way. The library's ABI version
is checked at load time against MPLANE_EP_ABI_VERSION below.

No torch here: this module must import with a plain python3 (CI).
"""

import ctypes
import os

from ctypes import POINTER, c_char_p, c_float, c_int, c_longlong, c_void_p

HEADER = "collectives/ep/mplane_ep.h"

# ---- constants (#define / enum of the header) ----
MPLANE_EP_ABI_VERSION = 2
MPLANE_EP_TILE = 128          # values per FP8 scale
MPLANE_EP_FMT_FP8 = 0         # dispatch on the wire as FP8 e4m3 + float32 scales
MPLANE_EP_FMT_BF16 = 1        # dispatch as BF16
MPLANE_EP_OK = 0
MPLANE_EP_ERR_INVALID = 1     # a bad argument or configuration
MPLANE_EP_ERR_CUDA = 2        # a CUDA call failed
MPLANE_EP_ERR_NCCL = 3        # an NCCL call failed
MPLANE_EP_ERR_NOMEM = 4       # device or host memory
MPLANE_EP_ERR_CAPACITY = 5    # more expert rows arrive than max_recv_rows
MPLANE_EP_ERR_INTERNAL = 6    # GPU and host planner disagree (a bug)
MPLANE_EP_PROFILE_STEPS = 15  # GPU times mplane_ep_get_profile gives (layout, dispatch, combine x 5 steps)

CONSTANTS = {k: v for k, v in dict(globals()).items() if k.startswith("MPLANE_EP_")}
ERROR_NAMES = {v: k for k, v in CONSTANTS.items() if k.startswith("MPLANE_EP_ERR_") or k == "MPLANE_EP_OK"}


# ---- structs ----
class mplane_ep_config(ctypes.Structure):
    """Shape of a context; every buffer is sized once from it."""
    _c_name_ = "mplane_ep_config"
    _fields_ = [
        ("gpus_per_node", c_int),   # 0: as NCCL sees hosts (NCCL_HOSTID, else host name + boot id)
        ("num_experts", c_int),     # E, a multiple of the rank count
        ("hidden", c_int),          # H, a multiple of 128
        ("topk", c_int),            # K, 1..32
        ("max_tokens", c_int),      # tokens per rank per call, at most
        ("max_recv_rows", c_int),   # expert-output rows a rank can receive; 0: the worst case
        ("worst_case", c_int),      # 1: worst-case sizes, no host synchronisation (CUDA graphs)
        ("flat", c_int),            # 1: plain all-to-all, one copy per (token, expert) (the baseline)
        ("num_sms", c_int),         # blocks of the data kernels; 0: every SM
        ("nvlink_direct", c_int),   # 1: phase-2 rows written straight into same-node peers (CUDA IPC)
        ("token_rows", c_int),      # 1: one row per received token; expert rows name it (recv.row_token)
    ]


class mplane_ep_info(ctypes.Structure):
    """What a context resolved."""
    _c_name_ = "mplane_ep_info"
    _fields_ = [
        ("rank", c_int), ("nranks", c_int),
        ("nodes", c_int), ("gpus_per_node", c_int),
        ("node", c_int), ("local", c_int),
        ("local_experts", c_int),
        ("max_recv_rows", c_int),
        ("num_sms", c_int),
    ]


class mplane_ep_layout_info(ctypes.Structure):
    """Counts of one layout (host arrays in normal mode only, device arrays always)."""
    _c_name_ = "mplane_ep_layout_info"
    _fields_ = [
        ("num_tokens", c_int),
        ("num_recv_rows", c_int),           # -1 in worst-case mode
        ("num_recv_tokens", c_int),         # -1 in worst-case mode
        ("tokens_per_rank", POINTER(c_int)),      # host [nranks]
        ("tokens_per_node", POINTER(c_int)),      # host [nodes]
        ("tokens_per_expert", POINTER(c_int)),    # host [num_experts]
        ("recv_expert_offsets", POINTER(c_int)),  # host [local_experts + 1]
        ("d_tokens_per_rank", POINTER(c_int)),    # device
        ("d_tokens_per_node", POINTER(c_int)),
        ("d_tokens_per_expert", POINTER(c_int)),
        ("d_recv_expert_offsets", POINTER(c_int)),
        ("d_status", POINTER(c_int)),             # device [2]: rows received, overflow flag
        ("dispatch_net_bytes", c_longlong), ("dispatch_nvl_bytes", c_longlong),
        ("combine_net_bytes", c_longlong), ("combine_nvl_bytes", c_longlong),
        ("counts_net_bytes", c_longlong), ("counts_nvl_bytes", c_longlong),  # the count exchanges
    ]


class mplane_ep_recv(ctypes.Structure):
    """Received tokens grouped by local expert; NULL pointers: the context's own buffers."""
    _c_name_ = "mplane_ep_recv"
    _fields_ = [
        ("x", c_void_p),               # device [max_recv_rows][H]: FP8 bytes or BF16
        ("scales", c_void_p),          # device float [max_recv_rows][H / 128] (FP8)
        ("weights", c_void_p),         # device float [max_recv_rows]
        ("src", c_void_p),             # device int32 [max_recv_rows][2]: source rank, token
        ("expert_offsets", c_void_p),  # out: device int32 [local_experts + 1]
        ("num_rows", c_int),           # out: rows received; -1 in worst-case mode
        ("tokens", c_void_p),          # out (token_rows): device rows of token_stride bytes: payload, FP8 scales
        ("token_stride", c_longlong),  # out: bytes per token row
        ("row_token", c_void_p),       # out: device int32 [max_recv_rows]: expert row -> token row (-1: none)
        ("num_tokens", c_int),         # out: token rows; -1 in worst-case mode
    ]


STRUCTS = [mplane_ep_config, mplane_ep_info, mplane_ep_layout_info, mplane_ep_recv]

# ---- functions: name -> (restype, argtypes). Opaque handles (mplane_ep_ctx *, mplane_ep_layout *),
# CUDA streams, NCCL communicators and device pointers are c_void_p. ----
FUNCTIONS = {
    "mplane_ep_abi_version": (c_int, []),
    "mplane_ep_last_error": (c_char_p, [c_void_p]),
    "mplane_ep_create": (c_int, [POINTER(c_void_p), c_void_p, POINTER(mplane_ep_config), c_void_p]),
    "mplane_ep_destroy": (c_int, [c_void_p]),
    "mplane_ep_get_info": (c_int, [c_void_p, POINTER(mplane_ep_info)]),
    # route(ctx, logits, bias, num_tokens, num_groups, topk_groups, scaling, normalize, topk_idx, topk_weights, stream)
    "mplane_ep_route": (c_int, [c_void_p, c_void_p, c_void_p, c_int, c_int, c_int, c_float, c_int, c_void_p,
                                c_void_p, c_void_p]),
    "mplane_ep_layout_create": (c_int, [c_void_p, POINTER(c_void_p)]),
    "mplane_ep_layout_destroy": (c_int, [c_void_p]),
    # get_layout(ctx, topk_idx, num_tokens, layout, stream)
    "mplane_ep_get_layout": (c_int, [c_void_p, c_void_p, c_int, c_void_p, c_void_p]),
    "mplane_ep_layout_get_info": (c_int, [c_void_p, POINTER(mplane_ep_layout_info)]),
    # token_in_rank(ctx, layout, flags, stream)
    "mplane_ep_token_in_rank": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p]),
    # dispatch(ctx, layout, x, topk_weights, fmt, recv, stream)
    "mplane_ep_dispatch": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_int, POINTER(mplane_ep_recv), c_void_p]),
    "mplane_ep_dispatch_fp8": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, POINTER(mplane_ep_recv),
                                       c_void_p]),
    # combine(ctx, layout, y, out, stream)
    "mplane_ep_combine": (c_int, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p]),
    # dequant(ctx, layout, recv, y, stream)
    "mplane_ep_dequant": (c_int, [c_void_p, c_void_p, POINTER(mplane_ep_recv), c_void_p, c_void_p]),
    # diagnostics: set_profiling(ctx, on); get_profile(ctx, float us[MPLANE_EP_PROFILE_STEPS]); profile_name(step)
    "mplane_ep_set_profiling": (c_int, [c_void_p, c_int]),
    "mplane_ep_get_profile": (c_int, [c_void_p, POINTER(c_float)]),
    "mplane_ep_profile_name": (c_char_p, [c_int]),
}


class EPError(RuntimeError):
    """A libmplane-ep call failed; the message is the library's."""


def default_library_paths(repo_root=None):
    """Where libmplane-ep.so is looked for: $MPLANE_EP_LIB (a file), then $MPLANE_LIB_DIR and the
    repository's build folders (build*/collectives/ep, build*/), then by name on the loader's search
    path (an installed library)."""
    paths = []
    if os.environ.get("MPLANE_EP_LIB"):
        paths.append(os.environ["MPLANE_EP_LIB"])
    # the repository: this file is collectives/ep/python/mplane_ep/_abi.py in it
    root = repo_root or os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
    dirs = []
    if os.environ.get("MPLANE_LIB_DIR"):
        dirs.append(os.environ["MPLANE_LIB_DIR"])
    dirs.append(os.path.join(root, "build"))
    try:
        dirs += sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("build-"))
    except OSError:
        pass
    for d in dirs:
        for sub in (os.path.join("collectives", "ep"), ""):
            paths.append(os.path.join(d, sub, "libmplane-ep.so"))
    paths.append("libmplane-ep.so")  # the loader's own search path: an installed library (meson install)
    return paths


def load(path=None):
    """Open libmplane-ep.so, declare every function, and check its ABI version. Load torch (or the
    NCCL the communicator comes from) first: the library's libnccl.so.2 then binds to that one."""
    candidates = [path] if path else default_library_paths()
    tried = []
    for p in candidates:
        if os.sep in p and not os.path.isfile(p):
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
                      f"of {HEADER}: rebuild the library or update collectives/ep/python/mplane_ep/_abi.py")
    lib._mplane_path = p
    return lib


def last_error(lib, ctx):
    msg = lib.mplane_ep_last_error(ctx)
    return msg.decode(errors="replace") if msg else "(no message)"


def check(lib, ctx, rc, what):
    if rc != 0:
        raise EPError(f"{what}: {last_error(lib, ctx)} ({ERROR_NAMES.get(rc, 'error')} = {rc})")
