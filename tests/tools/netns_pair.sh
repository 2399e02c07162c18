#!/bin/sh
# mplane-netns makes two network namespaces joined by a veth pair, and the plugin moves checked bytes
# over it (mplane-netbench, sender in the other namespace), its raw ceiling over the same veth
# address; `down` removes them. Skips (77) where this machine cannot make namespaces or a veth,
# with the step it refused.
# usage: netns_pair.sh MPLANE_NETNS MPLANE_NETBENCH PLUGIN
set -u
ns=$1 nb=$2 plugin=$3
fail() { echo "FAIL: $*"; "$ns" down "$dir" >/dev/null 2>&1; exit 1; }
out=$("$ns" probe 2>&1); rc=$?
if [ $rc -eq 77 ]; then echo "SKIP: $out"; exit 77; fi
[ $rc -eq 0 ] || { echo "FAIL: probe exited $rc: $out"; exit 1; }
dir=$(mktemp -d)
trap '"$ns" down "$dir" >/dev/null 2>&1; rm -rf "$dir"' EXIT
"$ns" up "$dir" --mtu 9000 || fail "up failed"
[ -r "$dir/ns0" ] && [ -r "$dir/ns1" ] || fail "no ns0/ns1 written"
out=$("$ns" exec "$dir/ns0" env MPLANE_SOCKET_IFNAME=mpv "$nb" --plugin "$plugin" --sender-netns "$dir/ns1" \
  --size 1M --window 4 --rounds 20 --raw-streams 2 --repeat 2 2>&1) || fail "netbench over the veth: $out"
echo "$out"
echo "$out" | grep -q "dev 0  mpv0" || fail "the plugin did not find mpv0 in ns0"
echo "$out" | grep -q "raw-tcp  198.19.250.1 " || fail "the raw streams did not use the veth address"
echo "$out" | grep -q "^summary  2 pairs" || fail "no summary of the pairs"
# the namespaces are separate: loopback of ns0 does not reach a listener of the root namespace
"$ns" exec "$dir/ns1" sh -c 'cat /sys/class/net/mpv1/mtu 2>/dev/null; exit 0' >/dev/null
"$ns" down "$dir" || fail "down failed"
sleep 0.2
for p in $(cat "$dir/pids" 2>/dev/null); do kill -0 "$p" 2>/dev/null && fail "holder $p still alive after down"; done
out=$("$ns" up 2>&1); [ $? -eq 2 ] || fail "'up' without DIR was taken: $out"
out=$("$ns" up "$dir" --mtu 12x 2>&1); [ $? -eq 2 ] || fail "--mtu 12x was taken: $out"
echo "$out" | grep -q -- "--mtu '12x'" || fail "--mtu 12x: no error naming it: $out"
echo "PASS: a veth pair between two namespaces, bytes checked over it, removed by down"
