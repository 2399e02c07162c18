#!/usr/bin/env bash
# What the plugin .so shows the dynamic linker.
#
#   check_symbols.sh symbols PLUGIN.so   nm -D --defined-only: ncclNetPlugin_v8..v12 and ncclRmaPlugin_v14..v16
#                                        present (data), and nothing else but ncclTunerPlugin_v3..v6 and the linker's own
#                                        markers (_init, _fini, _edata, _end, __bss_start)
#   check_symbols.sh needed PLUGIN.so    no NCCL, CUDA or verbs library among DT_NEEDED: the plugin must
#                                        load on a machine without them (they are dlopened when used)
set -euo pipefail
mode=${1:?usage: check_symbols.sh symbols|needed PLUGIN.so}
so=${2:?usage: check_symbols.sh symbols|needed PLUGIN.so}
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
