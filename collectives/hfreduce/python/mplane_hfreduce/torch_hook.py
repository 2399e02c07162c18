"""HFReduce on torch tensors, and DDP's communication hook.

DDP calls a registered hook with each gradient bucket once the bucket is ready; the default hook
all-reduces the bucket's flat buffer and divides by the world size. ddp_comm_hook does the same
on HFReduce: one line switches a DDP job's gradient all-reduce,

    model.register_comm_hook(comm, ddp_comm_hook)

HFReduce's call returns when the result is in place (it waits for the tensor's stream first), so
the hook hands DDP a future that is already complete.
"""
from . import _lib


def _dtype_code(torch, dtype):
    table = {torch.float32: _lib.FLOAT32, torch.float16: _lib.FLOAT16, torch.bfloat16: _lib.BFLOAT16}
    for name, code in (("float8_e4m3fn", _lib.FP8_E4M3), ("float8_e5m2", _lib.FP8_E5M2)):
        if hasattr(torch, name):
            table[getattr(torch, name)] = code
    if dtype not in table:
        raise TypeError(f"HFReduce reduces float32, float16, bfloat16, float8_e4m3fn and float8_e5m2, not {dtype}")
    return table[dtype]


def all_reduce(tensor, comm, op="sum"):
    """In place over every rank of comm: tensor = op(tensor of each rank). A contiguous CPU or CUDA
    tensor; on CUDA the current stream is waited for first. Returns the tensor."""
    import torch
    if op not in _lib.OPS:
        raise ValueError(f"op must be one of {sorted(_lib.OPS)}, not {op!r}")
    if not tensor.is_contiguous():
        raise ValueError("all_reduce needs a contiguous tensor")
    stream = None
    if getattr(tensor, "is_cuda", False):
        stream = torch.cuda.current_stream(tensor.device).cuda_stream
    ptr = tensor.data_ptr()
    comm.allreduce_ptr(ptr, ptr, tensor.numel(), _dtype_code(torch, tensor.dtype), _lib.OPS[op], stream)
    return tensor


def ddp_comm_hook(comm, bucket):
    """DDP communication hook (register_comm_hook(state=comm, hook=ddp_comm_hook)): the bucket's
    gradients divided by the world size, then summed over the ranks by HFReduce, as DDP's default
    all-reduce hook does (dividing first keeps float16 sums in range)."""
    import torch
    buf = bucket.buffer()
    buf.div_(comm.world_size)
    all_reduce(buf, comm, "sum")
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut
