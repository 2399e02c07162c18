#!/usr/bin/env bash
# Run mplane's fuzz targets longer than the test suite does (tests/fuzz; needs clang).
#
#   scripts/fuzz.sh                  every target, 60 s each
#   scripts/fuzz.sh topo_xml 600     one target (config, planes, topo_xml, sysfs, tuner_table, handle,
#                                    socket_wire, ib_record, ib_accounting)
#
# Builds the targets in $BUILD (default build/), then runs each on its seed corpus
# (tests/fuzz/corpus/<target>/) plus what earlier runs found, kept in $BUILD/tests/fuzz/found/<target>/.
# A crash, a sanitizer report or a broken property stops the run; the input is saved in
# $BUILD/tests/fuzz/artifacts/ and the command that replays it is printed. To keep an input as a
# regression seed, copy it (small) into tests/fuzz/corpus/<target>/.
set -euo pipefail
cd "$(dirname "$0")/.."
targets=(config planes topo_xml sysfs tuner_table handle socket_wire ib_record ib_accounting)
want="${1:-all}"
secs="${2:-60}"
build="${BUILD:-build}"
if [ "$want" != all ]; then
  case " ${targets[*]} " in
    *" $want "*) targets=("$want") ;;
    *) echo "fuzz.sh: no target '$want' (targets: ${targets[*]})" >&2; exit 2 ;;
  esac
fi
command -v clang >/dev/null || { echo "fuzz.sh: clang not found (apt-get install clang libclang-rt-dev)" >&2; exit 1; }
[ -f "$build/build.ninja" ] || meson setup "$build"
# A build without infiniband/verbs.h has no IB targets: those are left out, with a note.
have=()
for t in "${targets[@]}"; do
  if ninja -C "$build" -t query "tests/fuzz/fuzz_$t" >/dev/null 2>&1; then have+=("$t"); else echo "fuzz.sh: fuzz_$t is not in this build (skipped)"; fi
done
[ ${#have[@]} -gt 0 ] || exit 1
targets=("${have[@]}")
outs=($(printf "tests/fuzz/fuzz_%s " "${targets[@]}"))
# fuzz_ib_record runs the plugin on the software verbs, found next to it in the build
case " ${targets[*]} " in *" ib_record "*) outs+=(tests/softverbs/libsoftverbs.so) ;; esac
ninja -C "$build" "${outs[@]}"
for t in "${targets[@]}"; do
  seeds=("tests/fuzz/corpus/$t")
  [ "$t" = topo_xml ] && seeds+=(tests/fixtures)
  echo "== fuzz_$t, $secs s"
  FUZZ_KEEP_CORPUS="$build/tests/fuzz/found/$t" \
    tests/fuzz/run_fuzz.sh "$build/tests/fuzz/fuzz_$t" "$secs" "$build/tests/fuzz/artifacts" "${seeds[@]}"
done
