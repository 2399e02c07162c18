#!/usr/bin/env python3
"""mplane_hfreduce's torch side (collectives/hfreduce/python): the DDP communication hook and
all_reduce on CPU tensors, across 4 forked processes as 2 nodes x 2 ranks over loopback, through
the real libmplane-hfreduce.so.

With torch installed the tensors are torch's; without it (CI) a stand-in module named torch is
put in sys.modules first: tensors over ctypes memory (float32, float16), torch.futures.Future,
and the hook runs unchanged on them. The output says which ran.

Environment: MPLANE_BUILD_ROOT (to find the library), MPLANE_SOCKET_IFNAME=lo, MPLANE_TRANSPORT=socket.
"""
import ctypes
import os
import struct
import sys
import types

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "collectives", "hfreduce", "python"))

WORLD, PER_NODE = 4, 2

try:
    import torch  # noqa: F401
    REAL_TORCH = True
except ImportError:
    REAL_TORCH = False


def make_standin():
    """The part of torch the hook and all_reduce touch, over ctypes memory."""
    t = types.ModuleType("torch")

    class DType:
        def __init__(self, name, ctype, size):
            self.name, self.ctype, self.size = name, ctype, size

        def __repr__(self):
            return "torch." + self.name

    t.float32 = DType("float32", ctypes.c_float, 4)
    t.float16 = DType("float16", ctypes.c_uint16, 2)
    t.bfloat16 = DType("bfloat16", ctypes.c_uint16, 2)
    t.int64 = DType("int64", ctypes.c_int64, 8)

    def enc(dtype, v):
        return struct.unpack("<H", struct.pack("<e", v))[0] if dtype is t.float16 else v

    def dec(dtype, v):
        return struct.unpack("<e", struct.pack("<H", v))[0] if dtype is t.float16 else float(v)

    class Tensor:
        is_cuda = False

        def __init__(self, values, dtype):
            self.dtype = dtype
            self.mem = (dtype.ctype * len(values))(*[enc(dtype, v) for v in values])

        def data_ptr(self):
            return ctypes.addressof(self.mem)

        def numel(self):
            return len(self.mem)

        def is_contiguous(self):
            return True

        def div_(self, d):
            for i in range(len(self.mem)):
                self.mem[i] = enc(self.dtype, dec(self.dtype, self.mem[i]) / d)
            return self

        def tolist(self):
            return [dec(self.dtype, v) for v in self.mem]

    class Future:
        def set_result(self, v):
            self._v = v

        def wait(self):
            return self._v

        value = wait

    t.tensor = lambda values, dtype: Tensor(values, dtype)
    t.futures = types.SimpleNamespace(Future=Future)
    return t


if not REAL_TORCH:
    sys.modules["torch"] = make_standin()
import torch  # noqa: E402

import mplane_hfreduce as hfr  # noqa: E402


class Bucket:
    """What DDP hands a hook: the bucket's flat gradient buffer."""

    def __init__(self, buf):
        self._buf = buf

    def buffer(self):
        return self._buf


def grads(rank, n=1000):
    return [float((rank * 3 + i) % 8) for i in range(n)]


def rank_main(rank, uid):
    os.environ["NCCL_HOSTID"] = f"hook-node-{rank // PER_NODE}"
    comm = hfr.Communicator(rank, WORLD, uid)
    info = comm.info()
    assert (info["node"], info["nnodes"], info["local_ranks"]) == (rank // PER_NODE, WORLD // PER_NODE, PER_NODE), info
    for dtype in (torch.float32, torch.float16):
        # the hook: the mean of the ranks' gradients (every value here is exact in both types)
        buf = torch.tensor(grads(rank), dtype=dtype)
        fut = hfr.ddp_comm_hook(comm, Bucket(buf))
        got = fut.wait().tolist()
        want = [sum(grads(r)[i] for r in range(WORLD)) / WORLD for i in range(1000)]
        assert got == want, f"{dtype}: hook gave {got[:8]}..., expected {want[:8]}..."
        # the plain function: max over the ranks, in place
        t = torch.tensor(grads(rank), dtype=dtype)
        assert hfr.all_reduce(t, comm, op="max") is t
        assert t.tolist() == [max(grads(r)[i] for r in range(WORLD)) for i in range(1000)]
    try:
        hfr.all_reduce(torch.tensor([1, 2], dtype=torch.int64), comm)
        raise AssertionError("an int64 tensor was accepted")
    except TypeError as e:
        assert "int64" in str(e)
    comm.close()


def main():
    build = os.environ.get("MPLANE_BUILD_ROOT", os.path.join(ROOT, "build"))
    lib = os.path.join(build, "collectives", "hfreduce", "libmplane-hfreduce.so")
    if not os.path.isfile(lib):
        print(f"SKIP: {lib} is not built")
        return 77
    os.environ["MPLANE_HFREDUCE_LIB"] = lib
    uid = hfr.get_unique_id()
    pids = []
    for rank in range(WORLD):
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                rank_main(rank, uid)
            except BaseException as e:  # a failing rank says why, then exits non-zero
                print(f"rank {rank}: FAIL: {e!r}", file=sys.stderr)
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        pids.append(pid)
    failed = 0
    for pid in pids:
        _, st = os.waitpid(pid, 0)
        failed |= st != 0
    if failed:
        print("FAIL: a rank failed")
        return 1
    print(f"hfreduce hook: {WORLD} ranks (2 nodes x {PER_NODE}), float32 and float16, "
          f"{'torch ' + torch.__version__ if REAL_TORCH else 'a torch stand-in (torch is not installed)'}: "
          "ddp_comm_hook gives the mean, all_reduce the max, int64 refused")
    return 0


if __name__ == "__main__":
    sys.exit(main())
