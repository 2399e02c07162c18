#!/usr/bin/env python3
"""mplane tests: the plugin exports what NCCL looks up, under both names, and nothing internal.

usage: check_exports.py BUILD_DIR

Checks, with nm -D on the built libraries, that:
  - libnccl-tuner-mplane.so is a symbolic link to libnccl-net-mplane.so in BUILD_DIR;
  - ncclTunerPlugin_v3..v6 and ncclNetPlugin_v8..v12 are defined, exported data objects;
  - no mplane_* function or variable leaks out of the library (everything but the tables is hidden).
"""
import os
import subprocess
import sys

TUNER = ["ncclTunerPlugin_v3", "ncclTunerPlugin_v4", "ncclTunerPlugin_v5", "ncclTunerPlugin_v6"]
NET = ["ncclNetPlugin_v8", "ncclNetPlugin_v9", "ncclNetPlugin_v10", "ncclNetPlugin_v11", "ncclNetPlugin_v12"]


def exported(path):
    out = subprocess.run(["nm", "-D", "--defined-only", path], check=True, capture_output=True, text=True).stdout
    syms = {}
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3:
            syms[parts[2]] = parts[1]
    return syms


def main():
    build = sys.argv[1]
    net = os.path.join(build, "libnccl-net-mplane.so")
    tuner = os.path.join(build, "libnccl-tuner-mplane.so")
    errors = []
    if not os.path.islink(tuner):
        errors.append(f"{tuner} is not a symbolic link")
    elif os.readlink(tuner) != "libnccl-net-mplane.so":
        errors.append(f"{tuner} points to {os.readlink(tuner)!r}, not libnccl-net-mplane.so")
    if not os.path.samefile(net, tuner):
        errors.append(f"{tuner} and {net} are not the same file")
    for path in (net, tuner):
        syms = exported(path)
        for name in TUNER + NET:
            kind = syms.get(name)
            if kind is None:
                errors.append(f"{os.path.basename(path)}: {name} is not exported")
            elif kind not in ("D", "R", "B"):
                errors.append(f"{os.path.basename(path)}: {name} has type {kind}, expected an exported data object")
        leaked = sorted(s for s in syms if s.startswith("mplane_"))
        if leaked:
            errors.append(f"{os.path.basename(path)}: internal symbols exported: {', '.join(leaked[:10])}")
        print(f"{os.path.basename(path)}: " + ", ".join(f"{n} ({syms.get(n, '-')})" for n in TUNER + NET))
    for e in errors:
        print("FAIL:", e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
