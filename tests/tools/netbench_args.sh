#!/bin/sh
# mplane-netbench refuses numbers it cannot read, naming the option (a "1M" read as 1 byte would
# measure the wrong thing), and takes K/M/G sizes: a 4K run moves 4096-byte messages.
# usage: netbench_args.sh NETBENCH PLUGIN
set -u
nb=$1
plugin=$2
fail() { echo "FAIL: $*"; exit 1; }
refused() { # option value expected-text
  out=$("$nb" --plugin "$plugin" "$1" "$2" 2>&1); rc=$?
  [ "$rc" -eq 2 ] || fail "$1 '$2' exited with $rc, expected 2: $out"
  echo "$out" | grep -q -- "$1 '$2': expected a whole number$3" || fail "$1 '$2': no error naming it: $out"
  echo "refused: $1 '$2'"
}
refused --size 1Q " of bytes, K/M/G suffixes allowed"
refused --size 4KB " of bytes, K/M/G suffixes allowed"
refused --size -1 " of bytes, K/M/G suffixes allowed"
refused --min-size "" " of bytes, K/M/G suffixes allowed"
refused --window 8x ""
refused --iters 1e3 ""
refused --raw-streams four ""
out=$("$nb" --plugin "$plugin" --seconds 3x 2>&1) && fail "--seconds 3x was taken"
echo "$out" | grep -q -- "--seconds '3x': expected a number of seconds" || fail "--seconds 3x: $out"
out=$("$nb" --plugin "$plugin" --size 4K --window 2 --rounds 3 2>&1) || fail "a 4K run failed: $out"
echo "$out" | grep -q "4096-byte messages" || fail "--size 4K did not move 4096-byte messages: $out"
out=$("$nb" --plugin "$plugin" --size 2G 2>&1) && fail "--size 2G was taken"
echo "$out" | grep -q -- "--size must be at most 1G" || fail "--size 2G: $out"
# --seconds without --rounds: a first run measures the rate (a fixed 4 GB/s guess made --seconds 2
# run 7.5 s on a host that moves 1 GB/s), and the counted run is sized from it.
out=$("$nb" --plugin "$plugin" --size 64K --window 4 --seconds 0.3 2>&1) || fail "a --seconds 0.3 run failed: $out"
echo "$out" | grep -q "^calibration (not counted): plugin .* GB/s over [0-9]* rounds; the counted runs move [0-9]*" ||
  fail "--seconds without --rounds: no calibration run: $out"
echo "$out" | grep -q "65536-byte messages" || fail "--seconds 0.3: no counted plugin run: $out"
echo "PASS: bad numbers refused, 4K read as 4096, --seconds sized by a measured rate"
