"""The communicator: a rank of an HFReduce job."""
import ctypes

from . import _lib


def get_unique_id(lib=None):
    """Start the bootstrap root in this process; returns the id (bytes) every rank passes to Communicator."""
    lib = lib or _lib.load()
    uid = _lib.UniqueId()
    _lib.check(lib, lib.mplane_hfreduce_get_unique_id(ctypes.byref(uid)), "mplane_hfreduce_get_unique_id")
    return ctypes.string_at(ctypes.addressof(uid), _lib.UNIQUE_ID_BYTES)  # .internal would stop at a NUL


class Communicator:
    def __init__(self, rank, world_size, unique_id, lib=None):
        self.lib = lib or _lib.load()
        if len(unique_id) != _lib.UNIQUE_ID_BYTES:
            raise ValueError(f"unique_id must be {_lib.UNIQUE_ID_BYTES} bytes (from get_unique_id), not {len(unique_id)}")
        uid = _lib.UniqueId()
        ctypes.memmove(ctypes.addressof(uid), unique_id, _lib.UNIQUE_ID_BYTES)
        self.handle = ctypes.c_void_p()
        _lib.check(self.lib, self.lib.mplane_hfreduce_comm_init(ctypes.byref(self.handle), world_size,
                                                                ctypes.byref(uid), rank),
                   f"mplane_hfreduce_comm_init (rank {rank} of {world_size})")
        self.rank, self.world_size = rank, world_size

    @classmethod
    def from_process_group(cls, group=None, lib=None):
        """Every rank of a torch.distributed group: the group's first rank makes the id and
        broadcasts it through the group."""
        import torch.distributed as dist
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [get_unique_id(lib) if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return cls(rank, world, box[0], lib)

    def info(self):
        vals = [ctypes.c_int() for _ in range(6)]
        _lib.check(self.lib, self.lib.mplane_hfreduce_comm_info(self.handle, *[ctypes.byref(v) for v in vals]),
                   "mplane_hfreduce_comm_info")
        return dict(zip(("rank", "nranks", "node", "nnodes", "local_rank", "local_ranks"), (v.value for v in vals)))

    def allreduce_ptr(self, send, recv, count, dtype, op=_lib.SUM, stream=None):
        """The raw call on addresses (host or device memory)."""
        _lib.check(self.lib, self.lib.mplane_hfreduce_allreduce(self.handle, send, recv, count, dtype, op, stream),
                   "mplane_hfreduce_allreduce")

    def close(self):
        if self.handle:
            self.lib.mplane_hfreduce_comm_destroy(self.handle)
            self.handle = ctypes.c_void_p()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
