"""libmplane-ep on torch tensors: a Context per process group; route / dispatch / combine take and
return torch CUDA tensors and run on the current CUDA stream (torch.cuda.current_stream()), so they
order with the surrounding torch work and torch's caching allocator keeps their inputs alive."""

import ctypes

import torch
import torch.distributed as dist

from . import _abi, _nccl

# mplane's traffic classes (common/tc_map.h): the ncclConfig_t.trafficClass values the plugin understands
TRAFFIC_CLASSES = {"default": 0, "collective": 1, "alltoall": 2, "lowlat": 3, "storage": 4, "hfreduce": 5}


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


class _DeviceInts:
    """A view of library-owned device int32 memory, for torch.as_tensor (zero copy; callers clone it).
    Marked writable: torch 2.11 refuses read-only CUDA array interfaces ("the read only flag is not
    supported"), as seen on the H200 run."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<i4", "data": (ptr, False), "version": 3,
                                         "strides": None, "stream": None}


class _DeviceRows:
    """A zero-copy strided view of library-owned device rows: n rows of `cols` items of `typestr`,
    `stride` bytes apart (the token rows of a token_rows context)."""

    def __init__(self, ptr, n, cols, typestr, itemsize, stride):
        self.__cuda_array_interface__ = {"shape": (n, cols), "typestr": typestr, "data": (ptr, False), "version": 3,
                                         "strides": (stride, itemsize), "stream": None}


def _device_ints(ptr, n, device):
    """Copy n int32 at a library device pointer into a new torch tensor (on the current stream)."""
    if not ptr or n <= 0:
        return torch.empty((max(n, 0),), dtype=torch.int32, device=device)
    return torch.as_tensor(_DeviceInts(ptr, n), device=device).clone()


def _host_ints(p, n):
    return [p[i] for i in range(n)] if p else None


class Layout:
    """The counts and positions of one routing (mplane_ep_get_layout), reused by its dispatch and
    combine. A Context keeps one for dispatch(..., layout=None); make more with Context.layout()."""

    def __init__(self, ctx):
        self.ctx = ctx
        self._h = ctypes.c_void_p()
        ctx._check(ctx._lib.mplane_ep_layout_create(ctx._ctx, ctypes.byref(self._h)), "mplane_ep_layout_create")
        self.num_tokens = None
        self._dispatch_seq = 0

    def compute(self, topk_idx):
        """Collective: the layout of topk_idx [T, K] (int32/int64, device). Ids outside [0, E) and
        repeats within a token are dropped. Normal mode waits on the host for the exchanged counts."""
        c = self.ctx
        c._alive()
        if topk_idx.dtype == torch.int64:
            topk_idx = topk_idx.to(torch.int32)
        _need(topk_idx, "topk_idx", torch.int32, 2, c.device)
        T = topk_idx.shape[0]
        if topk_idx.shape[1] != c.topk:
            raise ValueError(f"topk_idx has {topk_idx.shape[1]} columns, the context top-{c.topk}")
        if T > c.max_tokens:
            raise ValueError(f"{T} tokens, the context was made for at most {c.max_tokens}")
        c._check(c._lib.mplane_ep_get_layout(c._ctx, _ptr(topk_idx), T, self._h, _stream()), "mplane_ep_get_layout")
        self.num_tokens = T
        self.topk_idx = topk_idx
        return self

    def info(self):
        """The layout's counts as Python values (host lists are None in worst-case mode) plus the
        bytes this rank sends per phase."""
        c = self.ctx
        li = _abi.mplane_ep_layout_info()
        c._check(c._lib.mplane_ep_layout_get_info(self._h, ctypes.byref(li)), "mplane_ep_layout_get_info")
        return {
            "num_tokens": li.num_tokens,
            "num_recv_rows": li.num_recv_rows if li.num_recv_rows >= 0 else None,
            "num_recv_tokens": li.num_recv_tokens if li.num_recv_tokens >= 0 else None,
            "tokens_per_rank": _host_ints(li.tokens_per_rank, c.nranks),
            "tokens_per_node": _host_ints(li.tokens_per_node, c.nodes),
            "tokens_per_expert": _host_ints(li.tokens_per_expert, c.num_experts),
            "recv_expert_offsets": _host_ints(li.recv_expert_offsets, c.local_experts + 1),
            "dispatch_net_bytes": li.dispatch_net_bytes, "dispatch_nvl_bytes": li.dispatch_nvl_bytes,
            "combine_net_bytes": li.combine_net_bytes, "combine_nvl_bytes": li.combine_nvl_bytes,
            "counts_net_bytes": li.counts_net_bytes, "counts_nvl_bytes": li.counts_nvl_bytes,
            "_raw": li,
        }

    def token_in_rank(self):
        """[T, nranks] bool (device): the token has an expert on that rank."""
        c = self.ctx
        flags = torch.empty((self.num_tokens, c.nranks), dtype=torch.uint8, device=c.device)
        c._check(c._lib.mplane_ep_token_in_rank(c._ctx, self._h, _ptr(flags), _stream()), "mplane_ep_token_in_rank")
        return flags.bool()

    def close(self):
        if self._h:
            torch.cuda.current_stream().synchronize()
            rc = self.ctx._lib.mplane_ep_layout_destroy(self._h)
            self._h = ctypes.c_void_p()
            if rc != 0:
                raise _abi.EPError(f"mplane_ep_layout_destroy: error {rc}")


class Dispatched:
    """What dispatch returned at this rank: the received rows grouped by local expert.

    x        [rows, H] float8_e4m3fn (fp8=True) or bfloat16 (None with token_rows: see rows())
    scale    [rows, H/128] float32 (fp8=True; None for BF16 and with token_rows)
    weight   [rows] float32: the token's top-k weight for this expert
    src      [rows, 2] int32: source rank, source token
    expert_offsets  [Er + 1] int32 (device): rows of local expert e are
                    expert_offsets[e]:expert_offsets[e+1]
    num_rows the valid row count (an int; None in worst-case mode, where expert_offsets[-1] says it)
    layout   the Layout it used (combine needs it)
    The tensors above are torch's (allocated per call): they stay valid after later dispatches.

    With a token_rows Context each received token is there once, in the library's buffer:
    token_x      [num_recv_tokens, H] float8_e4m3fn or bfloat16, token_scale [num_recv_tokens, H/128]
                 float32 (FP8): zero-copy views, valid until the Context's next dispatch or close
    row_token    [rows] int32: expert row -> its token row (-1: none)
    rows()       (x, scale) gathered per expert row from the token rows (a copy), as without token rows
    """

    def __init__(self, layout, fp8, x, scale, weight, src, expert_offsets, num_rows, recv, token_x=None,
                 token_scale=None, row_token=None):
        self.layout, self.fp8, self.num_tokens = layout, fp8, layout.num_tokens
        self.x, self.scale, self.weight, self.src = x, scale, weight, src
        self.expert_offsets, self.num_rows = expert_offsets, num_rows
        self.token_x, self.token_scale, self.row_token = token_x, token_scale, row_token
        self.num_recv_tokens = token_x.shape[0] if token_x is not None else None
        self._recv = recv  # the mplane_ep_recv the library filled in (for dequant)
        self._seq = layout._dispatch_seq
        self._ctx_seq = 0

    def rows(self):
        """(x, scale) per expert row: x, scale themselves, or gathered from the token rows."""
        if self.row_token is None:
            return self.x, self.scale
        if self.layout.ctx._dispatches != self._ctx_seq:
            raise ValueError("the token rows were overwritten by a later dispatch of the Context")
        n, H = self.row_token.shape[0], self.token_x.shape[1]
        have = self.row_token >= 0
        sel = self.row_token[have].long()
        dev = self.token_x.device
        if not self.fp8:
            x = torch.zeros((n, H), dtype=torch.bfloat16, device=dev)
            x[have] = self.token_x[sel]
            return x, None
        xb = torch.zeros((n, H), dtype=torch.uint8, device=dev)  # FP8 by its bytes (index_put has no FP8 kernel)
        xb[have] = self.token_x.view(torch.uint8)[sel]
        scale = torch.zeros((n, self.token_scale.shape[1]), dtype=torch.float32, device=dev)
        scale[have] = self.token_scale[sel]
        return xb.view(torch.float8_e4m3fn), scale


class Context:
    """A libmplane-ep context over a torch process group (one CUDA device per process).

    comm='own' (default): a new NCCL communicator over the group's ranks, in mplane traffic class
    `traffic_class` (default 'alltoall'), so MPLANE_TC_MAP puts the MoE traffic on its own service
    level. comm='group': the group's own communicator (ProcessGroupNCCL._comm_ptr()), no new
    connections; its traffic class is the group's.
    Other arguments are mplane_ep_config's (collectives/ep/mplane_ep.h).
    """

    def __init__(self, group=None, *, num_experts, hidden, topk, max_tokens, gpus_per_node=0, max_recv_rows=0,
                 worst_case=False, flat=False, num_sms=0, nvlink_direct=False, token_rows=False, comm="own",
                 traffic_class="alltoall", library=None):
        if token_rows and worst_case:
            raise ValueError("token_rows=True with worst_case=True: the binding needs the token count on the host "
                             "(use one of them)")
        if not torch.cuda.is_available():
            raise RuntimeError("mplane_ep needs a CUDA device")
        self.token_rows = bool(token_rows)
        self.group = group or dist.group.WORLD
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.num_experts, self.hidden, self.topk, self.max_tokens = num_experts, hidden, topk, max_tokens
        self.worst_case = bool(worst_case)
        self._lib = _abi.load(library)
        self._ctx = ctypes.c_void_p()
        self._own_comm = False
        self._comm = None
        if comm == "own":
            self._comm = own_comm(self.group, traffic_class)
            self._own_comm = True
        elif comm == "group":
            self._comm = group_comm_ptr(self.group)
        else:
            raise ValueError(f"comm must be 'own' or 'group', got {comm!r}")
        cfg = _abi.mplane_ep_config(gpus_per_node=gpus_per_node, num_experts=num_experts, hidden=hidden, topk=topk,
                                    max_tokens=max_tokens, max_recv_rows=max_recv_rows, worst_case=int(worst_case),
                                    flat=int(flat), num_sms=num_sms, nvlink_direct=int(bool(nvlink_direct)),
                                    token_rows=int(bool(token_rows)))
        rc = self._lib.mplane_ep_create(ctypes.byref(self._ctx), ctypes.c_void_p(self._comm), ctypes.byref(cfg),
                                        _stream())
        if rc != 0:
            msg = _abi.last_error(self._lib, None)
            self._ctx = ctypes.c_void_p()
            self._release_comm()
            raise _abi.EPError(f"mplane_ep_create: {msg} ({_abi.ERROR_NAMES.get(rc, 'error')} = {rc})")
        info = _abi.mplane_ep_info()
        self._check(self._lib.mplane_ep_get_info(self._ctx, ctypes.byref(info)), "mplane_ep_get_info")
        self.rank, self.nranks, self.nodes, self.gpus_per_node = info.rank, info.nranks, info.nodes, info.gpus_per_node
        self.node, self.local, self.local_experts = info.node, info.local, info.local_experts
        self.max_recv_rows, self.num_sms = info.max_recv_rows, info.num_sms
        self._layouts = []
        self._default_layout = None
        self._dispatches = 0  # token rows are the Context's: any later dispatch overwrites them

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

    def info(self):
        return {k: getattr(self, k) for k in ("rank", "nranks", "nodes", "gpus_per_node", "node", "local",
                                              "local_experts", "max_recv_rows", "num_sms")}

    def close(self):
        """Destroy the layouts, the context and its own communicator. Collective: every rank calls it."""
        if self._ctx:
            torch.cuda.current_stream().synchronize()
            for lay in self._layouts:
                lay.close()
            self._layouts = []
            rc = self._lib.mplane_ep_destroy(self._ctx)
            self._ctx = ctypes.c_void_p()
            if rc != 0:
                raise _abi.EPError(f"mplane_ep_destroy: {_abi.last_error(self._lib, None)} (error {rc})")
        self._release_comm()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- operations --
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

    def layout(self, topk_idx=None):
        """A new Layout (computed for topk_idx when given); closed with the Context."""
        self._alive()
        lay = Layout(self)
        self._layouts.append(lay)
        return lay.compute(topk_idx) if topk_idx is not None else lay

    def dispatch(self, x, topk_idx, topk_weights, *, fp8=True, layout=None):
        """x [T, H] bfloat16, or the tokens already in FP8 as DeepEP's dispatch takes them: a tuple
        (x_fp8 [T, H] float8_e4m3fn, x_scales [T, H/128] float32, value = x_fp8 * scale), sent as
        they are (fp8 must be True); topk_idx [T, K] (int32/int64), topk_weights [T, K] float32 ->
        Dispatched (received rows grouped by local expert). Computes the layout of topk_idx first
        (collective), in the Context's own Layout unless `layout` is given already computed for it."""
        self._alive()
        xq = xs = None
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ValueError(f"x as a tuple must be (x_fp8, x_scales), has {len(x)} items")
            if not fp8:
                raise ValueError("x is given in FP8 (a tuple): fp8 must be True")
            xq, xs = x
            _need(xq, "x_fp8", torch.float8_e4m3fn, 2, self.device)
            _need(xs, "x_scales", torch.float32, 2, self.device)
            T, H = xq.shape
            if tuple(xs.shape) != (T, H // _abi.MPLANE_EP_TILE):
                raise ValueError(f"x_scales must be [{T}, {H // _abi.MPLANE_EP_TILE}], is {tuple(xs.shape)}")
        else:
            _need(x, "x", torch.bfloat16, 2, self.device)
            T, H = x.shape
        if H != self.hidden:
            raise ValueError(f"x has hidden size {H}, the context {self.hidden}")
        if layout is None:
            if self._default_layout is None:
                self._default_layout = self.layout()
            layout = self._default_layout.compute(topk_idx)
        elif layout.num_tokens != T:
            raise ValueError(f"the layout is for {layout.num_tokens} tokens, x has {T}")
        _need(topk_weights, "topk_weights", torch.float32, 2, self.device)
        if tuple(topk_weights.shape) != (T, self.topk):
            raise ValueError(f"topk_weights must be [{T}, {self.topk}], is {tuple(topk_weights.shape)}")
        li = layout.info()
        rows = li["num_recv_rows"] if li["num_recv_rows"] is not None else self.max_recv_rows
        dev = self.device
        payload = rows and not self.token_rows  # token rows: the library keeps the payload in its token rows
        rx = rs = None
        if not self.token_rows:
            rx = torch.empty((rows, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
            rs = torch.empty((rows, H // _abi.MPLANE_EP_TILE), dtype=torch.float32, device=dev) if fp8 else None
        rw = torch.empty((rows,), dtype=torch.float32, device=dev)
        rsrc = torch.empty((rows, 2), dtype=torch.int32, device=dev)
        recv = _abi.mplane_ep_recv(x=rx.data_ptr() if payload else None, scales=rs.data_ptr() if fp8 and payload else None,
                                   weights=rw.data_ptr() if rows else None, src=rsrc.data_ptr() if rows else None)
        if rows == 0:  # nothing arrives here; the library's own buffers stand in for the empty tensors
            recv = _abi.mplane_ep_recv()
        if xq is not None:
            rc = self._lib.mplane_ep_dispatch_fp8(self._ctx, layout._h, _ptr(xq), _ptr(xs), _ptr(topk_weights),
                                                  ctypes.byref(recv), _stream())
            self._check(rc, "mplane_ep_dispatch_fp8")
        else:
            fmt = _abi.MPLANE_EP_FMT_FP8 if fp8 else _abi.MPLANE_EP_FMT_BF16
            self._check(self._lib.mplane_ep_dispatch(self._ctx, layout._h, _ptr(x), _ptr(topk_weights), fmt,
                                                     ctypes.byref(recv), _stream()),
                        "mplane_ep_dispatch")
        off = _device_ints(recv.expert_offsets, self.local_experts + 1, dev)
        n = recv.num_rows if recv.num_rows >= 0 else None
        if n is not None and n != rows:
            raise _abi.EPError(f"mplane_ep_dispatch delivered {n} rows, its layout said {rows}")
        layout._dispatch_seq += 1
        self._dispatches += 1
        tok = self._token_views(recv, fp8, H, rows) if self.token_rows else (None, None, None)
        d = Dispatched(layout, fp8, rx, rs, rw, rsrc, off, n, recv, *tok)
        d._ctx_seq = self._dispatches
        return d

    def _token_views(self, recv, fp8, H, rows):
        """token_x, token_scale (zero-copy views of the library's token rows) and row_token."""
        dev, nt, stride = self.device, max(recv.num_tokens, 0), recv.token_stride
        tiles = H // _abi.MPLANE_EP_TILE
        if nt == 0 or not recv.tokens:
            tx = torch.empty((0, H), dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16, device=dev)
            ts = torch.empty((0, tiles), dtype=torch.float32, device=dev) if fp8 else None
        elif fp8:
            tx = torch.as_tensor(_DeviceRows(recv.tokens, nt, H, "|u1", 1, stride), device=dev).view(torch.float8_e4m3fn)
            ts = torch.as_tensor(_DeviceRows(recv.tokens + H, nt, tiles, "<f4", 4, stride), device=dev)
        else:
            tx = torch.as_tensor(_DeviceRows(recv.tokens, nt, H, "<i2", 2, stride), device=dev).view(torch.bfloat16)
            ts = None
        return tx, ts, _device_ints(recv.row_token, rows, dev)

    def dequant(self, dispatched):
        """The identity expert: [rows, H] bfloat16 = the dispatched rows (FP8 dequantised), by the
        library's kernel."""
        self._alive()
        rows = dispatched.weight.shape[0]
        y = torch.empty((rows, self.hidden), dtype=torch.bfloat16, device=self.device)
        if rows:
            self._check(self._lib.mplane_ep_dequant(self._ctx, dispatched.layout._h, ctypes.byref(dispatched._recv),
                                                    _ptr(y), _stream()), "mplane_ep_dequant")
        return y

    def combine(self, y, dispatched):
        """y [rows, H] bfloat16: the expert outputs for the rows of `dispatched`, same order ->
        [T, H] bfloat16 at the tokens' origin: sum over the token's experts of weight * y (float32
        accumulation). `dispatched` must be its layout's latest dispatch."""
        self._alive()
        lay = dispatched.layout
        if dispatched._seq != lay._dispatch_seq or not lay._h:
            raise ValueError("combine must use the latest dispatch of its layout")
        _need(y, "y", torch.bfloat16, 2, self.device)
        rows = dispatched.weight.shape[0]
        if y.shape[1] != self.hidden or y.shape[0] < rows:
            raise ValueError(f"y must be [>= {rows}, {self.hidden}], is {tuple(y.shape)}")
        out = torch.empty((dispatched.num_tokens, self.hidden), dtype=torch.bfloat16, device=self.device)
        self._check(self._lib.mplane_ep_combine(self._ctx, lay._h, _ptr(y), _ptr(out), _stream()), "mplane_ep_combine")
        return out
