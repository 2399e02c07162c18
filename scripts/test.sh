#!/usr/bin/env bash
# Run mplane's whole test suite (what CI runs): builds first if needed.
# Suites: unit, abi, topo, tuner, ib, rxe (real kernel verbs in a qemu VM: scripts/rxe-vm.sh prepares it
# on first use), ep, fabric (needs root), gpu (skips without a GPU), fuzz (libFuzzer targets, seconds
# each; skips without clang; scripts/fuzz.sh runs them longer).
# Benchmarks are a separate suite: meson test -C build --suite bench
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --build
meson configure build -Dtests=enabled >/dev/null # the suites, cmocka required (a user build may have left them out)
meson test -C build --no-suite bench --print-errorlogs "$@"
