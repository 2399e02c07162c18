#!/usr/bin/env bash
# The ABI harness (and the unit tests) under AddressSanitizer+UBSan+LeakSanitizer and under
# ThreadSanitizer, each in its own build folder. Not part of the default suite (it builds twice and
# runs ~5x slower); run it before merging changes to net/ or plugin/:
#
#   tests/abi/sanitize.sh [BUILD_PREFIX]      (default: build-sanitize -> build-sanitize-asan, -tsan)
#
# Exit status non-zero if any scenario fails or a sanitizer reports (races, leaks, overflows, UB).
set -euo pipefail
cd "$(dirname "$0")/../.."
prefix=${1:-build-sanitize}
fail=0
# our suppressions (tests/abi/tsan.supp says why each is there); TSan's exit code tells its reports apart
tsan_opts="suppressions=$PWD/tests/abi/tsan.supp:exitcode=66"
export TSAN_OPTIONS=$tsan_opts
for kind in asan tsan; do
  dir="$prefix-$kind"
  if [ "$kind" = asan ]; then opt="address,undefined"; else opt="thread"; fi
  [ -f "$dir/build.ninja" ] || meson setup "$dir" -Db_sanitize="$opt" -Db_lundef=false >/dev/null
  ninja -C "$dir" >/dev/null
  echo "== $kind: unit tests"
  meson test -C "$dir" --suite unit --print-errorlogs >/dev/null || { echo "FAIL: unit tests under $kind"; fail=1; }
  echo "== $kind: ABI harness, every scenario"
  export MPLANE_SOCKET_IFNAME=${MPLANE_SOCKET_IFNAME:-lo} MPLANE_ABI_TIMEOUT=300
  export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 TSAN_OPTIONS="$tsan_opts:halt_on_error=1"
  if ! "$dir/tests/abi/abi-harness" --plugin "$PWD/$dir/libnccl-net-mplane.so" all 2>&1 |
       tee "$dir/abi-sanitize.log" | grep -E '\]: (PASS|FAIL)|SUMMARY:'; then :; fi
  if grep -qE '\]: FAIL|SUMMARY: (Address|Thread|Leak|UndefinedBehavior)Sanitizer' "$dir/abi-sanitize.log"; then
    echo "FAIL: see $dir/abi-sanitize.log"
    fail=1
  fi
done
exit $fail
