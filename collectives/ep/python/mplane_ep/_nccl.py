"""The few NCCL calls mplane_ep needs, through ctypes (no torch here).

Which libnccl: the one already loaded in this process (torch loads its own when it is imported, and a
communicator must be used with the library that made it), else $MPLANE_EP_NCCL_LIB, else
'libnccl.so.2' from the loader's search path. Facts from NCCL's public nccl.h (2.28): ncclUniqueId
is 128 bytes, ncclConfig_t's layout and NCCL_CONFIG_INITIALIZER (undefined int = INT_MIN).
"""

import ctypes
import os

NCCL_UNIQUE_ID_BYTES = 128
NCCL_CONFIG_UNDEF_INT = -2147483648  # INT_MIN
NCCL_CONFIG_MAGIC = 0xCAFEBEEF


class NcclError(RuntimeError):
    """A NCCL call failed; the message holds NCCL's error string and its last error."""


class ncclUniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * NCCL_UNIQUE_ID_BYTES)]


class ncclConfig_v22800(ctypes.Structure):
    """ncclConfig_t of NCCL 2.28 (field order and types from nccl.h). NCCL copies
    min(size, its own sizeof) bytes and ignores fields newer than `version`, so this works with
    NCCL >= 2.19 runtimes too."""

    _fields_ = [
        ("size", ctypes.c_size_t),
        ("magic", ctypes.c_uint),
        ("version", ctypes.c_uint),
        ("blocking", ctypes.c_int),
        ("cgaClusterSize", ctypes.c_int),
        ("minCTAs", ctypes.c_int),
        ("maxCTAs", ctypes.c_int),
        ("netName", ctypes.c_char_p),
        ("splitShare", ctypes.c_int),
        ("trafficClass", ctypes.c_int),
        ("commName", ctypes.c_char_p),
        ("collnetEnable", ctypes.c_int),
        ("CTAPolicy", ctypes.c_int),
        ("shrinkShare", ctypes.c_int),
        ("nvlsCTAs", ctypes.c_int),
        ("nChannelsPerNetPeer", ctypes.c_int),
        ("nvlinkCentricSched", ctypes.c_int),
    ]

    @classmethod
    def initializer(cls):
        """NCCL_CONFIG_INITIALIZER: every user attribute undefined."""
        c = cls()
        c.size = ctypes.sizeof(cls)
        c.magic = NCCL_CONFIG_MAGIC
        c.version = 22800  # NCCL_VERSION(2, 28, 0): the layout above
        for name, typ in cls._fields_[3:]:
            if typ is ctypes.c_int:
                setattr(c, name, NCCL_CONFIG_UNDEF_INT)
        return c


def _loaded_nccl_path():
    """Path of a libnccl.so* already mapped into this process (torch's), or None."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split(None, 5)[-1].strip() if len(line.split()) >= 6 else ""
                base = os.path.basename(path)
                if base.startswith("libnccl.so"):
                    return path
    except OSError:
        pass
    return None


_lib = None


def lib():
    """The libnccl in use (loaded once)."""
    global _lib
    if _lib is not None:
        return _lib
    candidates = [p for p in (_loaded_nccl_path(), os.environ.get("MPLANE_EP_NCCL_LIB"), "libnccl.so.2") if p]
    errors = []
    for path in candidates:
        try:
            l = ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            break
        except OSError as e:
            errors.append(f"{path}: {e}")
    else:
        raise NcclError("mplane_ep: cannot load NCCL (" + "; ".join(errors) +
                        "); import torch first or set MPLANE_EP_NCCL_LIB to libnccl.so.2")
    l.ncclGetErrorString.restype = ctypes.c_char_p
    l.ncclGetErrorString.argtypes = [ctypes.c_int]
    l.ncclGetLastError.restype = ctypes.c_char_p
    l.ncclGetLastError.argtypes = [ctypes.c_void_p]
    l.ncclGetVersion.argtypes = [ctypes.POINTER(ctypes.c_int)]
    l.ncclGetUniqueId.argtypes = [ctypes.POINTER(ncclUniqueId)]
    l.ncclCommInitRankConfig.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int, ncclUniqueId,
                                         ctypes.c_int, ctypes.POINTER(ncclConfig_v22800)]
    l.ncclCommDestroy.argtypes = [ctypes.c_void_p]
    l.ncclCommFinalize.argtypes = [ctypes.c_void_p]
    for f in (l.ncclGetVersion, l.ncclGetUniqueId, l.ncclCommInitRankConfig, l.ncclCommDestroy, l.ncclCommFinalize):
        f.restype = ctypes.c_int
    l._mplane_path = getattr(l, "_name", "?")
    _lib = l
    return l


def check(rc, what):
    if rc != 0:
        l = lib()
        last = l.ncclGetLastError(None)
        last = last.decode(errors="replace") if last else ""
        raise NcclError(f"{what} failed: {l.ncclGetErrorString(rc).decode(errors='replace')} (ncclResult {rc})"
                        + (f": {last}" if last else ""))


def version():
    v = ctypes.c_int()
    check(lib().ncclGetVersion(ctypes.byref(v)), "ncclGetVersion")
    return v.value


def get_unique_id_bytes():
    """ncclGetUniqueId, as 128 raw bytes (to broadcast to the other ranks)."""
    uid = ncclUniqueId()
    check(lib().ncclGetUniqueId(ctypes.byref(uid)), "ncclGetUniqueId")
    return ctypes.string_at(ctypes.addressof(uid), NCCL_UNIQUE_ID_BYTES)


def comm_init_rank(nranks, uid_bytes, rank, traffic_class=None, comm_name=None):
    """ncclCommInitRankConfig (blocking, a collective over the nranks processes). Returns the
    ncclComm_t as an int. traffic_class: ncclConfig_t.trafficClass (None leaves it undefined)."""
    if len(uid_bytes) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"ncclUniqueId must be {NCCL_UNIQUE_ID_BYTES} bytes, got {len(uid_bytes)}")
    uid = ncclUniqueId()
    ctypes.memmove(ctypes.addressof(uid), uid_bytes, NCCL_UNIQUE_ID_BYTES)
    cfg = ncclConfig_v22800.initializer()
    cfg.blocking = 1
    if traffic_class is not None:
        cfg.trafficClass = int(traffic_class)
    name = comm_name.encode() if comm_name else None
    if name:
        cfg.commName = name
    comm = ctypes.c_void_p()
    check(lib().ncclCommInitRankConfig(ctypes.byref(comm), int(nranks), uid, int(rank), ctypes.byref(cfg)),
          f"ncclCommInitRankConfig(nranks={nranks}, rank={rank})")
    return comm.value


def comm_destroy(comm):
    if comm:
        l = lib()
        check(l.ncclCommFinalize(ctypes.c_void_p(comm)), "ncclCommFinalize")
        check(l.ncclCommDestroy(ctypes.c_void_p(comm)), "ncclCommDestroy")
