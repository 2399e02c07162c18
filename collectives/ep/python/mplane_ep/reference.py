"""Pure-torch references for libmplane-ep (no library needed), used by the GPU test and usable as a
baseline in a model:

- route_ref: DeepSeek-V3 group-limited gating, the twin of mp_ep_route_ref (collectives/ep/ep_ref.h)
- effective_topk: which top-k slots count (ids outside [0, E) and repeats of an earlier slot drop)
- fp8_quantize_ref / fp8_dequantize_ref: e4m3 with one float32 scale per 1x128 tile, the formulas
  of collectives/ep/ep_num.h (scale = max(amax, 1e-4) / 448, inv = 448 / max(amax, 1e-4), q = e4m3(x * inv), RNE)
- tolerance: the documented error bound of dispatch + identity experts + combine (ep_model.h)
- expected_dispatch: what rank d must receive, per local expert, in the library's row order
- TorchAllToAllMoE: dispatch/combine with torch.distributed.all_to_all_single, one BF16 copy per
  (token, expert): the plain baseline the library is measured against.
"""

import torch
import torch.distributed as dist

TILE = 128
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4


def effective_topk(topk_idx, num_experts):
    """[T, K] int -> [T, K] int64 with -1 where a slot is dropped (id outside [0, E), or a repeat
    of an earlier slot of the same token)."""
    idx = topk_idx.to(torch.int64)
    valid = (idx >= 0) & (idx < num_experts)
    K = idx.shape[1]
    eq = idx.unsqueeze(2) == idx.unsqueeze(1)  # [T, k, j]
    earlier = torch.tril(torch.ones(K, K, dtype=torch.bool, device=idx.device), diagonal=-1)  # j < k
    repeat = (eq & earlier).any(dim=2)
    return torch.where(valid & ~repeat, idx, torch.full_like(idx, -1))


def route_ref(logits, bias, num_groups, topk_groups, topk, scaling=1.0, normalize=True):
    """Group-limited gating for logits [T, E] (float32). Returns (idx int32 [T, K], w float32 [T, K]),
    experts in descending biased score; ties go to the lower group / expert index."""
    T, E = logits.shape
    s = torch.sigmoid(logits.float())
    b = s + bias.float() if bias is not None else s
    per = E // num_groups
    bg = b.view(T, num_groups, per)
    gscore = bg.topk(min(2, per), dim=2).values.sum(dim=2) if per > 1 else bg[:, :, 0]
    gorder = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, :topk_groups]
    keep = torch.zeros(T, num_groups, dtype=torch.bool, device=logits.device)
    keep.scatter_(1, gorder, True)
    masked = torch.where(keep.repeat_interleave(per, dim=1), b, torch.full_like(b, float("-inf")))
    idx = torch.sort(masked, dim=1, descending=True, stable=True).indices[:, :topk]
    w = s.gather(1, idx)
    if normalize:
        w = w / w.sum(dim=1, keepdim=True)
    w = w * scaling
    return idx.to(torch.int32), w.float()


def fp8_quantize_ref(x):
    """x [T, H] (bf16) -> (q [T, H] float8_e4m3fn, scale [T, H/128] float32)."""
    T, H = x.shape
    xf = x.float().view(T, H // TILE, TILE)
    amax = xf.abs().amax(dim=2)
    # Divide by a tensor, not a Python number: on CUDA, torch turns division by a CPU scalar into a
    # multiplication by its reciprocal, one ulp off the library's IEEE division for many amax values
    # (on the H200 every FP8 scale differed from the library's by that ulp).
    a = torch.clamp_min(amax, AMAX_FLOOR)
    scale = a / torch.full_like(amax, FP8_MAX)
    inv = torch.full_like(amax, FP8_MAX) / a
    q = (xf * inv.unsqueeze(2)).to(torch.float8_e4m3fn)
    return q.view(T, H), scale


def fp8_dequantize_ref(q, scale):
    """-> bf16 [T, H]: bf16(float(q) * scale), as an identity expert sees the token."""
    T, H = q.shape
    return (q.float().view(T, H // TILE, TILE) * scale.unsqueeze(2)).view(T, H).to(torch.bfloat16)


def tolerance(x, W, fp8):
    """Per-element bound on |combine(identity(dispatch(x))) - x * W| for nonnegative weights whose
    kept sum is W ([T] or [T, 1]); x [T, H]. From mp_ep_tolerance (ep_model.h)."""
    T, H = x.shape
    ax = x.float().abs()
    W = W.float().view(T, 1)
    bf16_part = W * ax * 4 * 2.0 ** -9
    if not fp8:
        return bf16_part
    amax = ax.view(T, H // TILE, TILE).amax(dim=2).repeat_interleave(TILE, dim=1)
    return W * (ax / 16 + amax / FP8_MAX / 1024) * (1 + 2.0 ** -8) ** 4 + bf16_part


def expected_dispatch(me, nranks, gpus_per_node, num_experts, idx_all, w_all, x_all, fp8):
    """What rank `me` receives (contiguous topology: rank r = node r // G, local r % G).
    idx_all / w_all / x_all: lists over source ranks of [T_s, K] / [T_s, K] / [T_s, H].
    Returns dict: expert_off (list, Er + 1), src [rows, 2] int32, weight [rows] float32, and
    x (bf16 rows) or q (fp8 rows) + scale, all on the device of x_all[0]; rows are grouped by local
    expert, each group ordered by (source local index, source node, source token)."""
    dev = x_all[0].device
    Er = num_experts // nranks
    G = gpus_per_node
    order = sorted(range(nranks), key=lambda s: (s % G, s // G))
    quant = [fp8_quantize_ref(x) for x in x_all] if fp8 else None
    src, weight, rows_x, rows_q, rows_s, off = [], [], [], [], [], [0]
    eff = [effective_topk(i, num_experts) for i in idx_all]
    for er in range(Er):
        e = me * Er + er
        for s in order:
            hit = eff[s] == e                       # [T, K]
            t_idx, k_idx = hit.nonzero(as_tuple=True)  # row-major: ascending token
            if t_idx.numel() == 0:
                continue
            src.append(torch.stack([torch.full_like(t_idx, s), t_idx], dim=1))
            weight.append(w_all[s][t_idx, k_idx].float())
            if fp8:
                rows_q.append(quant[s][0][t_idx])
                rows_s.append(quant[s][1][t_idx])
            else:
                rows_x.append(x_all[s][t_idx])
        off.append(sum(t.shape[0] for t in src))
    H = x_all[0].shape[1]
    out = {"expert_off": off,
           "src": torch.cat(src).to(torch.int32) if src else torch.empty(0, 2, dtype=torch.int32, device=dev),
           "weight": torch.cat(weight) if weight else torch.empty(0, device=dev)}
    if fp8:
        out["q"] = torch.cat(rows_q) if rows_q else torch.empty(0, H, dtype=torch.float8_e4m3fn, device=dev)
        out["scale"] = torch.cat(rows_s) if rows_s else torch.empty(0, H // TILE, device=dev)
    else:
        out["x"] = torch.cat(rows_x) if rows_x else torch.empty(0, H, dtype=torch.bfloat16, device=dev)
    return out


class TorchAllToAllMoE:
    """The plain baseline: every (token, expert) pair sends one BF16 copy of the token to the
    expert's rank with all_to_all_single, the experts run, and each result comes back the same way
    to be summed with its top-k weight (FP32) at the token's origin. Counts are exchanged first
    (one host synchronisation, as any torch implementation with variable splits needs)."""

    def __init__(self, num_experts, group=None):
        self.group = group
        self.E = num_experts
        self.R = dist.get_world_size(group)
        self.Er = num_experts // self.R

    def dispatch(self, x, topk_idx, topk_w):
        T, K = topk_idx.shape
        eff = effective_topk(topk_idx, self.E)
        flat = eff.view(-1)
        pair = (flat >= 0).nonzero(as_tuple=True)[0]          # (token, k) pairs kept
        dest = flat[pair] // self.Er
        order = torch.sort(dest, stable=True).indices
        pair, dest = pair[order], dest[order]
        send_counts = torch.bincount(dest, minlength=self.R)
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        sc, rc = send_counts.tolist(), recv_counts.tolist()
        tok = pair // K
        meta = torch.stack([flat[pair] % self.Er, pair], dim=1).to(torch.int64)  # local expert, (t*K+k)
        recv_x = x.new_empty((sum(rc), x.shape[1]))
        recv_meta = meta.new_empty((sum(rc), 2))
        dist.all_to_all_single(recv_x, x[tok].contiguous(), rc, sc, group=self.group)
        dist.all_to_all_single(recv_meta, meta, rc, sc, group=self.group)
        self._state = (T, K, pair, sc, rc, topk_w)
        return recv_x, recv_meta[:, 0]

    def combine(self, y):
        T, K, pair, sc, rc, topk_w = self._state
        back = y.new_empty((sum(sc), y.shape[1]))
        dist.all_to_all_single(back, y.contiguous(), sc, rc, group=self.group)
        w = topk_w.reshape(-1)[pair].float().unsqueeze(1)
        out = torch.zeros((T, y.shape[1]), dtype=torch.float32, device=y.device)
        out.index_add_(0, pair // K, back.float() * w)
        return out.to(torch.bfloat16)
