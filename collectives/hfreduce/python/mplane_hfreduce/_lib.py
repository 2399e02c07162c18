"""The C API of libmplane-hfreduce (collectives/hfreduce/mplane_hfreduce.h) through ctypes."""
import ctypes
import os

ABI_VERSION = 1
UNIQUE_ID_BYTES = 128

FLOAT32, FLOAT16, BFLOAT16, FP8_E4M3, FP8_E5M2 = range(5)
SUM, MAX, MIN = range(3)
OPS = {"sum": SUM, "max": MAX, "min": MIN}


class UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_char * UNIQUE_ID_BYTES)]


def default_library_paths(repo_root=None):
    """$MPLANE_HFREDUCE_LIB, then $MPLANE_LIB_DIR and the repository's build folders
    (build*/collectives/hfreduce), then the loader's search path (an installed library)."""
    paths = []
    if os.environ.get("MPLANE_HFREDUCE_LIB"):
        paths.append(os.environ["MPLANE_HFREDUCE_LIB"])
    # this file is collectives/hfreduce/python/mplane_hfreduce/_lib.py in the repository
    root = repo_root or os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), *[".."] * 4))
    dirs = [os.environ["MPLANE_LIB_DIR"]] if os.environ.get("MPLANE_LIB_DIR") else []
    dirs.append(os.path.join(root, "build"))
    try:
        dirs += sorted(os.path.join(root, d) for d in os.listdir(root) if d.startswith("build-"))
    except OSError:
        pass
    for d in dirs:
        for sub in (os.path.join("collectives", "hfreduce"), ""):
            paths.append(os.path.join(d, sub, "libmplane-hfreduce.so"))
    paths.append("libmplane-hfreduce.so")
    return paths


_lib = None


def load(path=None):
    """Open libmplane-hfreduce.so once, declare its functions, check its ABI version."""
    global _lib
    if _lib is not None and path is None:
        return _lib
    tried = []
    for p in [path] if path else default_library_paths():
        if os.sep in p and not os.path.isfile(p):
            tried.append(p + " (absent)")
            continue
        try:
            lib = ctypes.CDLL(p)
        except OSError as e:
            tried.append(f"{p} ({e})")
            continue
        break
    else:
        raise OSError("libmplane-hfreduce.so not found; set MPLANE_HFREDUCE_LIB. Tried: " + "; ".join(tried))
    c_int, c_void_p, c_size_t = ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t
    decl = {
        "mplane_hfreduce_abi_version": ([], c_int),
        "mplane_hfreduce_get_unique_id": ([ctypes.POINTER(UniqueId)], c_int),
        "mplane_hfreduce_comm_init": ([ctypes.POINTER(c_void_p), c_int, ctypes.POINTER(UniqueId), c_int], c_int),
        "mplane_hfreduce_allreduce": ([c_void_p, c_void_p, c_void_p, c_size_t, c_int, c_int, c_void_p], c_int),
        "mplane_hfreduce_comm_destroy": ([c_void_p], c_int),
        "mplane_hfreduce_comm_info": ([c_void_p] + [ctypes.POINTER(c_int)] * 6, c_int),
        "mplane_hfreduce_last_error": ([], ctypes.c_char_p),
    }
    for name, (args, res) in decl.items():
        f = getattr(lib, name)
        f.argtypes, f.restype = args, res
    if lib.mplane_hfreduce_abi_version() != ABI_VERSION:
        raise OSError(f"{p}: ABI version {lib.mplane_hfreduce_abi_version()}, this binding speaks {ABI_VERSION}")
    if path is None:
        _lib = lib
    return lib


class HFReduceError(RuntimeError):
    pass


def check(lib, rc, what):
    if rc != 0:
        raise HFReduceError(f"{what} failed ({rc}): {lib.mplane_hfreduce_last_error().decode(errors='replace')}")
