#!/bin/sh
# mplane-config: --help prints the usage and exits 0; an unknown option or a stray argument is
# refused with an error naming it and the usage, exit 2 (before: both printed the table, exit 0);
# no option prints the table, --markdown the README's table, --check validates the environment.
# usage: config_args.sh MPLANE_CONFIG
set -u
cfg=$1
fail() { echo "FAIL: $*"; exit 1; }
out=$("$cfg" --help 2>&1); rc=$?
[ "$rc" -eq 0 ] || fail "--help exited with $rc: $out"
echo "$out" | grep -q "^usage: mplane-config" || fail "--help printed no usage: $out"
echo "$out" | grep -q "MPLANE_SOCKET_IFNAME" && fail "--help printed the table: $out"
for bad in --bogus -x markdown; do
  out=$("$cfg" "$bad" 2>&1); rc=$?
  [ "$rc" -eq 2 ] || fail "'$bad' exited with $rc, expected 2: $out"
  echo "$out" | grep -q -- "unknown option '$bad'" || fail "'$bad': no error naming it: $out"
  echo "$out" | grep -q "^usage: mplane-config" || fail "'$bad': no usage: $out"
  echo "refused: $bad"
done
out=$("$cfg" --check extra 2>&1); rc=$?
[ "$rc" -eq 2 ] || fail "'--check extra' exited with $rc, expected 2: $out"
echo "$out" | grep -q -- "unexpected argument 'extra'" || fail "'--check extra': no error naming it: $out"
out=$("$cfg" 2>&1) || fail "no option: exited with $?: $out"
echo "$out" | grep -q "MPLANE_SOCKET_IFNAME" || fail "no option: no table: $out"
out=$("$cfg" --markdown 2>&1) || fail "--markdown exited with $?: $out"
echo "$out" | grep -q '^| `MPLANE_SOCKET_IFNAME`' || fail "--markdown: no Markdown table: $out"
out=$(env -i MPLANE_TRANSPORT=bogus "$cfg" --check 2>&1) && fail "--check took MPLANE_TRANSPORT=bogus: $out"
echo "$out" | grep -q "MPLANE_TRANSPORT" || fail "--check: the error does not name the variable: $out"
out=$(env -i "$cfg" --check 2>&1) || fail "--check of an empty environment failed: $out"
echo "PASS: --help, refusals, table, --markdown, --check"
