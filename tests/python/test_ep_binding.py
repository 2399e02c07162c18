#!/usr/bin/env python3
"""collectives/ep/python/mplane_ep/_abi.py must mirror collectives/ep/mplane_ep.h exactly: every function with the
same parameter and return types, every struct with the same fields (and, compiled, the same size and
offsets), every MPLANE_EP_* constant with the same value; and a built libmplane-ep.so must export
every bound function. Runs with a plain python3 (no torch, no GPU).

The checker itself is tested first on a sample header with a binding that differs from it.
Exit 77 (skipped) while the header does not exist yet; the self-tests still run and must pass.
Environment: MPLANE_EP_HEADER (default collectives/ep/mplane_ep.h), MPLANE_BUILD_ROOT (to find
libmplane-ep.so), CC (default cc).
"""
import ctypes
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "collectives", "ep", "python"))

import cheader  # noqa: E402
from mplane_ep import _abi, _nccl  # noqa: E402  (no torch needed)

HEADER = os.environ.get("MPLANE_EP_HEADER", os.path.join(ROOT, "collectives", "ep", "mplane_ep.h"))

SAMPLE = """
#ifndef S_H
#define S_H
#include <stdint.h>
#include <cuda_runtime.h>
#ifdef __cplusplus
extern "C" {
#endif
#define MPLANE_EP_ABI_VERSION 2
typedef struct mplane_ep_ctx mplane_ep_ctx; /* opaque */
typedef enum { MPLANE_EP_FMT_FP8 = 0, MPLANE_EP_FMT_BF16 } mplane_ep_fmt;
typedef struct mplane_ep_config {
  int num_experts, hidden; // two on a line
  int64_t max_tokens;
  float scale[4];
} mplane_ep_config;
int mplane_ep_create(mplane_ep_ctx **ctx, ncclComm_t comm, const mplane_ep_config *cfg);
const char *mplane_ep_last_error(const mplane_ep_ctx *ctx);
int mplane_ep_combine(mplane_ep_ctx *ctx, const void *y, void *out, mplane_ep_fmt fmt, cudaStream_t stream);
void mplane_ep_destroy(mplane_ep_ctx *);
#ifdef __cplusplus
}
#endif
#endif
"""


class SampleConfig(ctypes.Structure):
    _c_name_ = "mplane_ep_config"
    _fields_ = [("num_experts", ctypes.c_int), ("hidden", ctypes.c_int), ("max_tokens", ctypes.c_int64),
                ("scale", ctypes.c_float * 4)]


GOOD = {
    "mplane_ep_create": (ctypes.c_int, [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.POINTER(SampleConfig)]),
    "mplane_ep_last_error": (ctypes.c_char_p, [ctypes.c_void_p]),
    "mplane_ep_combine": (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_void_p]),
    "mplane_ep_destroy": (None, [ctypes.c_void_p]),
}
GOOD_CONST = {"MPLANE_EP_ABI_VERSION": 2, "MPLANE_EP_FMT_FP8": 0, "MPLANE_EP_FMT_BF16": 1}


class Checker(unittest.TestCase):
    """The comparison can pass and can fail."""

    def setUp(self):
        self.h = cheader.parse(SAMPLE)

    def test_parse(self):
        self.assertEqual(self.h.defines["MPLANE_EP_ABI_VERSION"], 2)
        self.assertEqual(self.h.enums, {"MPLANE_EP_FMT_FP8": 0, "MPLANE_EP_FMT_BF16": 1})
        self.assertEqual(self.h.structs["mplane_ep_config"],
                         [("num_experts", "i32"), ("hidden", "i32"), ("max_tokens", "i64"), ("scale", "f32[4]")])
        self.assertEqual(self.h.functions["mplane_ep_create"][1], ["ptr(ptr)", "ptr", "ptr(struct mplane_ep_config)"])
        self.assertEqual(self.h.functions["mplane_ep_destroy"], ("void", ["ptr"], [""]))

    def test_matching_binding_passes(self):
        self.assertEqual(cheader.compare(self.h, GOOD, [SampleConfig], GOOD_CONST, "mplane_ep"), [])

    def test_every_kind_of_difference_is_reported(self):
        bad = dict(GOOD)
        bad["mplane_ep_combine"] = (ctypes.c_int, GOOD["mplane_ep_combine"][1][:4])        # a parameter missing
        bad["mplane_ep_last_error"] = (ctypes.c_void_p, [ctypes.c_void_p])                  # return type
        bad["mplane_ep_create"] = (ctypes.c_int, [ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(SampleConfig)])
        del bad["mplane_ep_destroy"]                                                         # not bound
        bad["mplane_ep_extra"] = (ctypes.c_int, [])                                          # not in the header

        class Short(ctypes.Structure):
            _c_name_ = "mplane_ep_config"
            _fields_ = [("num_experts", ctypes.c_int), ("hidden", ctypes.c_int), ("max_tokens", ctypes.c_int32)]

        errs = cheader.compare(self.h, bad, [Short], {"MPLANE_EP_ABI_VERSION": 1, "MPLANE_EP_FMT_FP8": 0}, "mplane_ep")
        text = "\n".join(errs)
        for needle in ("mplane_ep_combine: 5 parameters", "mplane_ep_last_error: returns str",
                       "mplane_ep_create: parameter 0 (ctx) is ptr(ptr)", "mplane_ep_destroy is in the header but not bound",
                       "mplane_ep_extra is bound but not in the header", "struct mplane_ep_config",
                       "MPLANE_EP_ABI_VERSION is 2 in the header, 1", "MPLANE_EP_FMT_BF16 = 1 is in the header"):
            self.assertIn(needle, text)


class BindingItself(unittest.TestCase):
    def test_constants_are_the_module_values(self):
        for k, v in _abi.CONSTANTS.items():
            self.assertEqual(getattr(_abi, k), v, k)

    def test_every_function_declares_types(self):
        for name, (res, args) in _abi.FUNCTIONS.items():
            for t in args + [res]:
                self.assertFalse(cheader.ctypes_canon(t).startswith("?"), f"{name}: {t!r}")

    def test_nccl_config_is_nccl_2_28_layout(self):
        # ncclConfig_t of NCCL 2.28 (nccl.h): 80 bytes on LP64, trafficClass at 44
        C = _nccl.ncclConfig_v22800
        self.assertEqual(ctypes.sizeof(C), 80)
        self.assertEqual(C.trafficClass.offset, 44)
        self.assertEqual(C.commName.offset, 48)
        c = C.initializer()
        self.assertEqual((c.magic, c.size, c.trafficClass, c.netName), (0xCAFEBEEF, 80, -2**31, None))
        self.assertEqual(ctypes.sizeof(_nccl.ncclUniqueId), 128)

    def test_library_search_honours_env(self):
        old = os.environ.get("MPLANE_EP_LIB")
        os.environ["MPLANE_EP_LIB"] = "/nowhere/libmplane-ep.so"
        try:
            self.assertEqual(_abi.default_library_paths()[0], "/nowhere/libmplane-ep.so")
            with self.assertRaises(_abi.EPError) as cm:
                _abi.load("/nowhere/libmplane-ep.so")
            self.assertIn("MPLANE_EP_LIB", str(cm.exception))
        finally:
            if old is None:
                del os.environ["MPLANE_EP_LIB"]
            else:
                os.environ["MPLANE_EP_LIB"] = old


STUBS = {
    "cuda_runtime_api.h": "typedef struct CUstream_st *cudaStream_t; typedef struct CUevent_st *cudaEvent_t;\n"
                          "typedef int cudaError_t;\n",
    "cuda_runtime.h": "#include <cuda_runtime_api.h>\n",
    "nccl.h": "typedef struct ncclComm *ncclComm_t; typedef int ncclResult_t;\n",
    "cuda_bf16.h": "", "cuda_fp8.h": "",
}


def compiled_layout(header, structs):
    """{struct: (sizeof, {field: offset})} from the C compiler, or None without one. CUDA and NCCL
    headers the header includes are stubbed (after the real ones, if the machine has them)."""
    cc = os.environ.get("CC", "cc")
    if not shutil.which(cc):
        return None
    with tempfile.TemporaryDirectory() as d:
        stub = os.path.join(d, "stub")
        os.mkdir(stub)
        for name, text in STUBS.items():
            with open(os.path.join(stub, name), "w") as f:
                f.write(text)
        src = ["#include <stdio.h>", "#include <stddef.h>", f'#include "{os.path.abspath(header)}"', "int main(void) {"]
        for s in structs:
            name = s._c_name_
            src.append(f'  printf("{name} %zu\\n", sizeof(struct {name}));')
            for fname, _ in s._fields_:
                src.append(f'  printf("{name}.{fname} %zu\\n", offsetof(struct {name}, {fname}));')
        src.append("  return 0; }")
        with open(os.path.join(d, "l.c"), "w") as f:
            f.write("\n".join(src))
        exe = os.path.join(d, "l")
        r = subprocess.run([cc, "-idirafter", stub, "-o", exe, os.path.join(d, "l.c")], capture_output=True, text=True)
        if r.returncode:
            raise AssertionError(f"the header does not compile for the layout check:\n{r.stderr[-2000:]}")
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    layout = {}
    for line in out.splitlines():
        key, val = line.rsplit(" ", 1)
        if "." in key:
            s, f = key.split(".")
            layout[s][1][f] = int(val)
        else:
            layout[key] = (int(val), {})
    return layout


def find_library():
    build = os.environ.get("MPLANE_BUILD_ROOT")
    cands = [os.path.join(build, "collectives", "ep", "libmplane-ep.so"), os.path.join(build, "libmplane-ep.so")] \
        if build else _abi.default_library_paths(ROOT)
    return next((p for p in cands if os.path.isfile(p)), None)


class AgainstHeader(unittest.TestCase):
    def test_binding_mirrors_header(self):
        with open(HEADER) as f:
            h = cheader.parse(f.read())
        errs = cheader.compare(h, _abi.FUNCTIONS, _abi.STRUCTS, _abi.CONSTANTS, "mplane_ep")
        self.assertEqual(errs, [], f"collectives/ep/python/mplane_ep/_abi.py differs from {HEADER}:\n  " + "\n  ".join(errs))
        self.assertIn("MPLANE_EP_ABI_VERSION", h.constants(), "the header should define MPLANE_EP_ABI_VERSION")

    def test_struct_layout_compiled(self):
        layout = compiled_layout(HEADER, _abi.STRUCTS)
        if layout is None:
            self.skipTest("no C compiler")
        for s in _abi.STRUCTS:
            size, offs = layout[s._c_name_]
            self.assertEqual(ctypes.sizeof(s), size, f"sizeof(struct {s._c_name_})")
            for fname, _ in s._fields_:
                self.assertEqual(getattr(s, fname).offset, offs[fname], f"offsetof({s._c_name_}, {fname})")

    def test_built_library_exports_every_function(self):
        lib = find_library()
        if lib is None or not shutil.which("nm"):
            self.skipTest("libmplane-ep.so not built here (it needs nvcc and NCCL)")
        out = subprocess.run(["nm", "-D", "--defined-only", lib], capture_output=True, text=True, check=True).stdout
        exported = {line.split()[-1] for line in out.splitlines() if line.strip()}
        self.assertEqual(sorted(set(_abi.FUNCTIONS) - exported), [], f"not exported by {lib}")


if __name__ == "__main__":
    have_header = os.path.isfile(HEADER)
    suite = unittest.TestSuite()
    loader = unittest.TestLoader()
    for case in (Checker, BindingItself) + ((AgainstHeader,) if have_header else ()):
        suite.addTests(loader.loadTestsFromTestCase(case))
    res = unittest.TextTestRunner(verbosity=2).run(suite)
    if not res.wasSuccessful():
        sys.exit(1)
    if not have_header:
        print(f"SKIP: {HEADER} does not exist yet: the binding could not be compared with it "
              "(the checker's own tests passed)")
        sys.exit(77)
    sys.exit(0)
