#!/usr/bin/env bash
# Run one fuzz target for a bounded time on its seed corpus (and any further seed folders).
#   run_fuzz.sh TARGET_EXE SECONDS ARTIFACT_DIR SEED_DIR [SEED_DIR...]
# New inputs go to a scratch folder (deleted afterwards; FUZZ_KEEP_CORPUS=DIR keeps them in DIR),
# never into the committed corpus. A crash,
# a sanitizer report, a failed property or an input that runs past 10 s fails the test; the input
# is kept in ARTIFACT_DIR and the command that replays it is printed.
set -euo pipefail
exe="$1"; secs="$2"; artifacts="$3"; shift 3
name=$(basename "$exe")
mkdir -p "$artifacts"
work=$(mktemp -d "${TMPDIR:-/tmp}/mplane-$name.XXXXXX")
trap 'rm -rf "$work"' EXIT
mkdir "$work/corpus"
export ASAN_OPTIONS="${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:allocator_may_return_null=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"
# Whatever MPLANE_* the caller has set must not steer the targets.
for v in $(env | sed -n 's/^\(MPLANE_[A-Z0-9_]*\)=.*/\1/p'); do unset "$v"; done
set +e
corpus="$work/corpus"
if [ -n "${FUZZ_KEEP_CORPUS:-}" ]; then
  mkdir -p "$FUZZ_KEEP_CORPUS"
  corpus="$FUZZ_KEEP_CORPUS"
fi
# -error_exitcode: libFuzzer's default, 77, is what meson reads as "skipped"
"$exe" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=65536 -print_final_stats=1 -error_exitcode=1 \
  -artifact_prefix="$artifacts/$name-" "$corpus" "$@" 2>"$work/log"
rc=$?
set -e
grep -E '^(INFO: (Loaded|seed corpus)|#[0-9]+ +DONE|stat::number_of_executed_units|stat::new_units_added)' "$work/log" || true
if [ $rc -ne 0 ]; then
  tail -n 60 "$work/log"
  echo "$name: FAILED (rc $rc); the input is in $artifacts/ (replay: $exe $artifacts/$name-<file>)"
fi
exit $rc
