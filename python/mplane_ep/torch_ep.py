"""libmplane-ep on torch tensors: a Context per process group; route / dispatch / combine take and
return torch CUDA tensors and run on the current CUDA stream (torch.cuda.current_stream()), so they
order with the surrounding torch work and torch's caching allocator keeps their inputs alive."""

import ctypes

import torch
import torch.distributed as dist

from . import _abi, _nccl

# mplane's traffic classes (net/tc.h): the ncclConfig_t.trafficClass values the plugin understands
TRAFFIC_CLASSES = {"default": 0, "collective": 1, "alltoall": 2, "lowlat": 3, "storage": 4}


def _traffic_class_value(tc):
    if tc is None:
        return None
    if isinstance(tc, int):
        return tc
    try:
        return TRAFFIC_CLASSES[str(tc).lower()]
    except KeyError:
        raise ValueError(f"traffic_class {tc!r}: expected None, an int or one of {', '.join(TRAFFIC_CLASSES)}") from None


def group_comm_ptr(group=None):
    """The ncclComm_t (as an int) of a torch NCCL process group on the current device, through
    ProcessGroupNCCL._comm_ptr() (torch 2.11 has it). The communicator stays torch's: do not destroy
    it, and do not leave torch collectives on that group in flight (async_op=True, not waited) while
    an mplane_ep call uses it."""
    group = group or dist.group.WORLD
    backend = group._get_backend(torch.device("cuda"))
    if not hasattr(backend, "_comm_ptr"):
        raise RuntimeError(f"mplane_ep: this torch ({torch.__version__}) has no ProcessGroupNCCL._comm_ptr(); "
                           "use comm='own'")
    ptr = backend._comm_ptr()
    if not ptr:
        # lazily initialised group: one collective creates the communicator on this device
        dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
        ptr = backend._comm_ptr()
    if not ptr:
        raise RuntimeError("mplane_ep: the process group has no NCCL communicator on this device")
    return ptr


def own_comm(group=None, traffic_class="alltoall", name="mplane_ep"):
    """A new NCCL communicator over the group's ranks (same rank order), with its own
    ncclConfig_t.trafficClass: group rank 0 makes an ncclUniqueId, the group broadcasts it, every
    rank calls ncclCommInitRankConfig on the current device. Returns the ncclComm_t as an int."""
    group = group or dist.group.WORLD
    rank, n = dist.get_rank(group), dist.get_world_size(group)
    on_cuda = dist.get_backend(group) == "nccl"
    dev = torch.device("cuda", torch.cuda.current_device()) if on_cuda else torch.device("cpu")
    buf = torch.zeros(_nccl.NCCL_UNIQUE_ID_BYTES, dtype=torch.uint8, device=dev)
    if rank == 0:
        uid = _nccl.get_unique_id_bytes()
        buf.copy_(torch.frombuffer(bytearray(uid), dtype=torch.uint8))
    dist.broadcast(buf, src=dist.get_global_rank(group, 0), group=group)
    uid = bytes(buf.cpu().tolist())
    return _nccl.comm_init_rank(n, uid, rank, traffic_class=_traffic_class_value(traffic_class), comm_name=name)


def _stream():
    return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)


def _ptr(t):
    return ctypes.c_void_p(t.data_ptr()) if t is not None else ctypes.c_void_p(0)


def _need(t, name, dtype=None, dims=None, device=None):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_cuda or (device is not None and t.device != device):
        raise ValueError(f"{name} must be on {device or 'a CUDA device'}, is on {t.device}")
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{name} must be {dtype}, is {t.dtype}")
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, has shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


class Dispatched:
    """What dispatch returned at this rank: the received rows grouped by local expert.

    x        [rows, H] float8_e4m3fn (fp8=True) or bfloat16
    scale    [rows, H/128] float32 (fp8=True; None for BF16)
    weight   [rows] float32: the token's top-k weight for this expert
    src      [rows, 2] int32: source rank, source token
    expert_offsets  [Er + 1] int32 on the GPU: rows of local expert e are
                    expert_offsets[e]:expert_offsets[e+1]
    num_rows the valid row count (an int; None in worst-case mode, where expert_offsets[-1] says it)
    Rows past num_rows are capacity, not data. Valid until the next dispatch of the same Context.
    """

    def __init__(self, ctx, num_tokens, x, scale, weight, src, expert_offsets, num_rows):
        self.ctx, self.num_tokens = ctx, num_tokens
        self.x, self.scale, self.weight, self.src = x, scale, weight, src
        self.expert_offsets, self.num_rows = expert_offsets, num_rows

    def expert_rows(self, e):
        """(start, end) rows of local expert e (synchronises with the GPU)."""
        off = self.expert_offsets.tolist()
        return off[e], off[e + 1]


class Context:
    """A libmplane-ep context over a torch process group (one CUDA device per process).

    comm='own' (default): a new NCCL communicator over the group's ranks, in mplane traffic class
    `traffic_class` (default 'alltoall'), so MPLANE_TC_MAP puts the MoE traffic on its own service
    level. comm='group': the group's own communicator (ProcessGroupNCCL._comm_ptr()), no new
    connections; its traffic class is the group's.
    """

    def __init__(self, group=None, *, num_experts, hidden, topk, max_tokens, gpus_per_node=0, max_recv_rows=0,
                 worst_case=False, flat=False, comm="own", traffic_class="alltoall", library=None):
        if not torch.cuda.is_available():
            raise RuntimeError("mplane_ep needs a CUDA device")
        self.group = group or dist.group.WORLD
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.worst_case = bool(worst_case)
        self._lib = _abi.load(library)
        self._ctx = ctypes.c_void_p()
        self._own_comm = False
        if comm == "own":
            self._comm = own_comm(self.group, traffic_class)
            self._own_comm = True
        elif comm == "group":
            self._comm = group_comm_ptr(self.group)
        else:
            raise ValueError(f"comm must be 'own' or 'group', got {comm!r}")
        cfg = _abi.mplane_ep_config(gpus_per_node=gpus_per_node, num_experts=num_experts, hidden=hidden, topk=topk,
                                    max_tokens=max_tokens, max_recv_rows=max_recv_rows, worst_case=int(worst_case),
                                    flat=int(flat))
        rc = self._lib.mplane_ep_create(ctypes.byref(self._ctx), ctypes.c_void_p(self._comm), ctypes.byref(cfg),
                                        _stream())
        if rc != 0:
            msg = _abi.last_error(self._lib, None)
            self._release_comm()
            raise _abi.EPError(f"mplane_ep_create: {msg} (error {rc})")
        info = _abi.mplane_ep_info()
        self._check(self._lib.mplane_ep_get_info(self._ctx, ctypes.byref(info)), "mplane_ep_get_info")
        self.rank, self.nranks, self.nodes = info.rank, info.nranks, info.nodes
        self.gpus_per_node, self.local_experts, self.max_recv_rows = info.gpus_per_node, info.local_experts, info.max_recv_rows
        self._last = None

    # -- plumbing --
    def _check(self, rc, what):
        _abi.check(self._lib, self._ctx, rc, what)

    def _alive(self):
        if not self._ctx:
            raise RuntimeError("mplane_ep: the Context is closed")

    def _release_comm(self):
        if self._own_comm and self._comm:
            _nccl.comm_destroy(self._comm)
        self._comm = None

    def close(self):
        """Destroy the context (and its own communicator). Collective: every rank calls it."""
        if self._ctx:
            torch.cuda.current_stream().synchronize()
            rc = self._lib.mplane_ep_destroy(self._ctx)
            self._ctx = ctypes.c_void_p()
            if rc != 0:
                raise _abi.EPError(f"mplane_ep_destroy: {_abi.last_error(self._lib, None)} (error {rc})")
        self._release_comm()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- the three operations --
    def route(self, logits, bias=None, *, num_groups, topk_groups, scaling=1.0, normalize=True):
        """Group-limited gating: logits [T, E] float32 (bias [E] float32 or None) ->
        (topk_idx [T, K] int32, topk_weights [T, K] float32)."""
        self._alive()
        _need(logits, "logits", torch.float32, 2, self.device)
        if logits.shape[1] != self.num_experts:
            raise ValueError(f"logits has {logits.shape[1]} experts, the context {self.num_experts}")
        if bias is not None:
            _need(bias, "bias", torch.float32, 1, self.device)
        T = logits.shape[0]
        idx = torch.empty((T, self.topk), dtype=torch.int32, device=self.device)
        w = torch.empty((T, self.topk), dtype=torch.float32, device=self.device)
        self._check(self._lib.mplane_ep_route(self._ctx, _ptr(logits), _ptr(bias), T, num_groups, topk_groups,
                                              float(scaling), int(bool(normalize)), _ptr(idx), _ptr(w), _stream()),
                    "mplane_ep_route")
        return idx, w

    def dispatch(self, x, topk_idx, topk_weights, *, fp8=True):
        """x [T, H] bfloat16, topk_idx [T, K] (int32 or int64), topk_weights [T, K] float32 ->
        Dispatched (received rows grouped by local expert). T <= max_tokens."""
        self._alive()
        _need(x, "x", torch.bfloat16, 2, self.device)
        T, H = x.shape
        if H != self.hidden:
            raise ValueError(f"x has hidden size {H}, the context {self.hidden}")
        if T > self.max_tokens:
            raise ValueError(f"x has {T} tokens, the context was made for at most {self.max_tokens}")
        if topk_idx.dtype == torch.int64:
            topk_idx = topk_idx.to(torch.int32)
        _need(topk_idx, "topk_idx", torch.int32, 2, self.device)
        _need(topk_weights, "topk_weights", torch.float32, 2, self.device)
        if tuple(topk_idx.shape) != (T, self.topk) or tuple(topk_weights.shape) != (T, self.topk):
            raise ValueError(f"topk_idx / topk_weights must be [{T}, {self.topk}], are "
                             f"{tuple(topk_idx.shape)} / {tuple(topk_weights.shape)}")
        R, dev = self.max_recv_rows, self.device
        rx = torch.empty((R, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
        rs = torch.empty((R, H // _abi.MPLANE_EP_TILE), dtype=torch.float32, device=dev) if fp8 else None
        rw = torch.empty((R,), dtype=torch.float32, device=dev)
        rsrc = torch.empty((R, 2), dtype=torch.int32, device=dev)
        off = torch.empty((self.local_experts + 1,), dtype=torch.int32, device=dev)
        nrecv = ctypes.c_int32(-1)
        fmt = _abi.MPLANE_EP_FMT_FP8 if fp8 else _abi.MPLANE_EP_FMT_BF16
        self._check(self._lib.mplane_ep_dispatch(self._ctx, _ptr(x), _ptr(topk_idx), _ptr(topk_weights), T, fmt,
                                                 _ptr(rx), _ptr(rs), _ptr(rw), _ptr(rsrc), _ptr(off),
                                                 ctypes.byref(nrecv), _stream()),
                    "mplane_ep_dispatch")
        n = nrecv.value if nrecv.value >= 0 and not self.worst_case else None
        if n is not None:
            rx, rw, rsrc = rx[:n], rw[:n], rsrc[:n]
            rs = rs[:n] if rs is not None else None
        d = Dispatched(self, T, rx, rs, rw, rsrc, off, n)
        self._last = d
        return d

    def combine(self, y, dispatched):
        """y [rows, H] bfloat16: the expert outputs for the rows of `dispatched` (the latest
        dispatch), same order -> [T, H] bfloat16 at the tokens' origin, sum over the token's experts
        of weight * y."""
        self._alive()
        if dispatched is not self._last:
            raise ValueError("combine must use the Context's latest dispatch (its layout is the one kept)")
        _need(y, "y", torch.bfloat16, 2, self.device)
        if y.shape[1] != self.hidden or y.shape[0] < (dispatched.num_rows or 0):
            raise ValueError(f"y must be [>= {dispatched.num_rows}, {self.hidden}], is {tuple(y.shape)}")
        out = torch.empty((dispatched.num_tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
        self._check(self._lib.mplane_ep_combine(self._ctx, _ptr(y), _ptr(out), _stream()), "mplane_ep_combine")
        return out
