"""mplane_ep: libmplane-ep (node-limited MoE all-to-all over NCCL) from PyTorch.

    import torch, torch.distributed as dist, mplane_ep
    ep = mplane_ep.Context(num_experts=256, hidden=7168, topk=8, max_tokens=4096)   # over WORLD
    idx, w = ep.route(logits, bias, num_groups=8, topk_groups=4, scaling=2.5)
    d = ep.dispatch(x, idx, w, fp8=True)        # rows grouped by local expert (d.expert_offsets)
    y = experts(d)                              # [d.num_rows, H] bfloat16, same row order
    out = ep.combine(y, d)                      # [T, H] bfloat16 at the tokens' origin
    ep.close()

A thin ctypes binding: _abi mirrors collectives/ep/mplane_ep.h (no torch needed to import it),
_nccl holds the NCCL calls, torch_ep the torch layer, reference pure-torch references and the
all_to_all_single baseline. The library is found through $MPLANE_EP_LIB or the build folders.
docs/pytorch.md has the details.
"""

from . import _abi  # noqa: F401  (importable without torch)
from ._abi import EPError  # noqa: F401

__all__ = ["Context", "Dispatched", "EPError", "group_comm_ptr", "own_comm", "TRAFFIC_CLASSES", "reference"]


def __getattr__(name):
    # torch-dependent parts load on first use, so `import mplane_ep` works without torch
    import importlib
    if name in ("Context", "Dispatched", "group_comm_ptr", "own_comm", "TRAFFIC_CLASSES"):
        return getattr(importlib.import_module(__name__ + ".torch_ep"), name)
    if name == "reference":
        return importlib.import_module(__name__ + ".reference")
    raise AttributeError(f"module 'mplane_ep' has no attribute {name!r}")
