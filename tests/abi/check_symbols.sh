#!/usr/bin/env bash
# What the plugin .so shows the dynamic linker.
#
#   check_symbols.sh symbols PLUGIN.so   nm -D --defined-only: ncclNetPlugin_v8..v12 and ncclRmaPlugin_v14..v16
#                                        present (data), and nothing else but ncclTunerPlugin_v3..v6 and the linker's own
#                                        markers (_init, _fini, _edata, _end, __bss_start)
#   check_symbols.sh needed PLUGIN.so    no NCCL, CUDA or verbs library among DT_NEEDED: the plugin must
#                                        load on a machine without them (they are dlopened when used)
#   check_symbols.sh hooks PLUGIN.so TEST.so
#                                        the test hooks (common/test_hooks.h): no hook's name in the shipped
#                                        PLUGIN.so, nor mplane_test_hooks among its exports; every name in the
#                                        test build TEST.so, which exports mplane_test_hooks
#   check_symbols.sh refused PLUGIN.so HARNESS
#                                        the ABI harness, given a hook, refuses the shipped PLUGIN.so by name
set -euo pipefail
usage="usage: check_symbols.sh symbols|needed PLUGIN.so | hooks PLUGIN.so TEST.so | refused PLUGIN.so HARNESS"
mode=${1:?$usage}
so=${2:?$usage}
[ -f "$so" ] || { echo "FAIL: $so does not exist"; exit 1; }

case "$mode" in
symbols)
  syms=$(nm -D --defined-only "$so")
  echo "$syms"
  fail=0
  for t in ncclNetPlugin_v8 ncclNetPlugin_v9 ncclNetPlugin_v10 ncclNetPlugin_v11 ncclNetPlugin_v12 ncclRmaPlugin_v14 ncclRmaPlugin_v15 ncclRmaPlugin_v16; do
    line=$(awk -v s="$t" '$3 == s' <<<"$syms")
    if [ -z "$line" ]; then
      echo "FAIL: $t is not exported"
      fail=1
    elif ! awk '{ exit !($2 ~ /^[DdRrBbVv]$/) }' <<<"$line"; then
      echo "FAIL: $t is not a data symbol: $line"
      fail=1
    fi
  done
  while read -r _addr type name; do
    [ -n "${name:-}" ] || continue
    case "$name" in
      ncclNetPlugin_v8|ncclNetPlugin_v9|ncclNetPlugin_v10|ncclNetPlugin_v11|ncclNetPlugin_v12) ;;
      ncclRmaPlugin_v14|ncclRmaPlugin_v15|ncclRmaPlugin_v16) ;;
      ncclTunerPlugin_v3|ncclTunerPlugin_v4|ncclTunerPlugin_v5|ncclTunerPlugin_v6) ;;
      _init|_fini|_edata|_end|__bss_start) ;;
      *) echo "FAIL: unexpected exported symbol $name ($type): give it hidden visibility or static"; fail=1 ;;
    esac
  done <<<"$syms"
  [ $fail -eq 0 ] && echo "OK: exports are the ncclNet tables, ncclRmaPlugin_v14..v16$(grep -q ncclTunerPlugin <<<"$syms" && echo ' and the ncclTuner tables')"
  exit $fail
  ;;
hooks)
  test_so=${3:?$usage}
  [ -f "$test_so" ] || { echo "FAIL: $test_so does not exist"; exit 1; }
  fail=0
  for h in MPLANE_CUDA_LIB MPLANE_TEST_RELAY_HOST MPLANE_TEST_RELAY_COPIER MPLANE_TEST_RELAY_SLOT_BYTES \
           MPLANE_TEST_RELAY_FAIL MPLANE_TEST_RMA_PROGRESS_ONLY; do
    if grep -aq "$h" "$so"; then echo "FAIL: the shipped $so holds $h (a test hook)"; fail=1; fi
    if ! grep -aq "$h" "$test_so"; then echo "FAIL: the test build $test_so does not read $h"; fail=1; fi
  done
  if grep -aq MPLANE_TEST_ "$so"; then echo "FAIL: the shipped $so holds a name MPLANE_TEST_*"; fail=1; fi
  if nm -D --defined-only "$so" | awk '$3 == "mplane_test_hooks"' | grep -q .; then
    echo "FAIL: the shipped $so exports mplane_test_hooks"; fail=1
  fi
  if ! nm -D --defined-only "$test_so" | awk '$3 == "mplane_test_hooks"' | grep -q .; then
    echo "FAIL: the test build $test_so does not export mplane_test_hooks"; fail=1
  fi
  [ $fail -eq 0 ] && echo "OK: the shipped plugin reads no test hook; the test build reads every one"
  exit $fail
  ;;
refused)
  harness=${3:?$usage}
  set +e
  out=$(MPLANE_TEST_RELAY_HOST=all "$harness" --plugin "$so" props 2>&1)
  rc=$?
  set -e
  echo "$out" | tail -n 5
  if [ $rc -eq 0 ]; then echo "FAIL: the harness ran the shipped plugin with MPLANE_TEST_RELAY_HOST=all set"; exit 1; fi
  if ! grep -q "MPLANE_TEST_RELAY_HOST=all.*without the test hooks" <<<"$out"; then
    echo "FAIL: the harness failed (rc $rc) but not for the hook it was given"; exit 1
  fi
  echo "OK: given a test hook, the harness refuses the shipped plugin"
  ;;
needed)
  needed=$(readelf -d "$so" | awk '/\(NEEDED\)/ { gsub(/[\[\]]/, "", $NF); print $NF }')
  echo "NEEDED: $(tr '\n' ' ' <<<"$needed")"
  bad=$(grep -Ei '^lib(nccl|cuda|cudart|nvidia-ml|ibverbs|mlx5|rdmacm|efa)[.-]' <<<"$needed" || true)
  if [ -n "$bad" ]; then
    echo "FAIL: the plugin links $(tr '\n' ' ' <<<"$bad")- it must dlopen these so it loads without them"
    exit 1
  fi
  echo "OK: no NCCL, CUDA or verbs library is needed at load time"
  ;;
*)
  echo "usage: check_symbols.sh symbols|needed PLUGIN.so"
  exit 2
  ;;
esac
