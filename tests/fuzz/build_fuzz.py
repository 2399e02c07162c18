#!/usr/bin/env python3
"""Build the libFuzzer targets with clang (meson's project compiler is gcc).

The project sources the targets share are compiled once into objects under --objdir (again only
when a source or a header it includes changed), then each target's harness is linked with them.
Writes one Makefile-style depfile naming every source and header, for ninja.

usage: build_fuzz.py --clang CLANG --srcroot DIR --objdir DIR --depfile FILE --stamp-of OUT
                     [--cflag F]... [--ldflag F]... --lib SRC... --target OUT=HARNESS...
"""
import argparse
import concurrent.futures
import os
import subprocess
import sys

SAN = ['-fsanitize=fuzzer,address,undefined', '-fno-sanitize-recover=undefined', '-fno-omit-frame-pointer']


def read_deps(dfile):
    """Prerequisites listed in a clang -MD depfile."""
    try:
        with open(dfile) as f:
            text = f.read().replace('\\\n', ' ')
    except OSError:
        return None
    _, _, rest = text.partition(':')
    return [p for p in rest.split() if p]


def up_to_date(obj, dfile):
    deps = read_deps(dfile)
    if deps is None or not os.path.exists(obj):
        return False
    t = os.path.getmtime(obj)
    try:
        return all(os.path.getmtime(d) <= t for d in deps)
    except OSError:
        return False


def compile_one(a, src, obj, fuzzer_flag):
    dfile = obj + '.d'
    if up_to_date(obj, dfile):
        return None
    san = [s if s != SAN[0] else fuzzer_flag for s in SAN]
    cmd = [a.clang, '-c', src, '-o', obj, '-MD', '-MF', dfile, '-g', '-O1', '-std=gnu11', '-D_GNU_SOURCE',
           '-I', a.srcroot] + san + a.cflag
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if r.returncode != 0:
        return ' '.join(cmd) + '\n' + r.stdout
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--clang', required=True)
    ap.add_argument('--srcroot', required=True)
    ap.add_argument('--objdir', required=True)
    ap.add_argument('--depfile', required=True)
    ap.add_argument('--stamp-of', required=True, help='the output the depfile names (ninja needs one)')
    ap.add_argument('--cflag', action='append', default=[])
    ap.add_argument('--ldflag', action='append', default=[])
    ap.add_argument('--lib', nargs='+', required=True)
    ap.add_argument('--target', nargs='+', required=True)
    a = ap.parse_args()
    os.makedirs(a.objdir, exist_ok=True)

    def obj_of(src, tag):
        rel = os.path.relpath(os.path.abspath(src), a.srcroot).replace('/', '_')
        return os.path.join(a.objdir, tag + rel + '.o')

    # Project sources get -fsanitize=fuzzer-no-link (coverage, no main); harnesses the full flag.
    jobs = [(s, obj_of(s, 'lib_'), '-fsanitize=fuzzer-no-link,address,undefined') for s in a.lib]
    targets = []
    for t in a.target:
        out, _, harness = t.partition('=')
        targets.append((out, harness, obj_of(harness, 'h_')))
        jobs.append((harness, obj_of(harness, 'h_'), '-fsanitize=fuzzer-no-link,address,undefined'))
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        errors = [e for e in ex.map(lambda j: compile_one(a, *j), jobs) if e]
    if errors:
        sys.stderr.write('\n'.join(errors))
        return 1
    lib_objs = [j[1] for j in jobs[:len(a.lib)]]
    for out, harness, hobj in targets:
        cmd = [a.clang, hobj] + lib_objs + ['-o', out] + SAN + a.ldflag
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            sys.stderr.write(' '.join(cmd) + '\n' + r.stdout)
            return 1
    deps = set()
    for _, obj, _ in jobs:
        deps.update(read_deps(obj + '.d') or [])
    with open(a.depfile, 'w') as f:
        f.write(a.stamp_of.replace(' ', '\\ ') + ': ' + ' \\\n  '.join(sorted(d.replace(' ', '\\ ') for d in deps)) + '\n')
    return 0


if __name__ == '__main__':
    sys.exit(main())
