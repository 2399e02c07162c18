#!/usr/bin/env bash
# mplane: an emulated multi-plane fabric on one Linux host (network namespaces, veth, bridges).
#
#   scripts/fabric.sh up     [--nodes N] [--planes P]   build it (again: harmless, adds what is missing)
#   scripts/fabric.sh down                              remove everything it made
#   scripts/fabric.sh status                            show nodes, planes, addresses and byte counters
#
# Node n (1..N) is the namespace mplane-n<n>. It has one veth "NIC" per plane, veth<p>, with address
# 198.18.<p>.<n>/24 (the benchmarking range 198.18.0.0/15: never 10/8, 172.16/12 or 192.168/16).
# Plane p is one Linux bridge, mplane-br<p>, in the switch namespace mplane-sw; it joins veth<p> of
# every node through switch ports n<n>p<p>. Nothing joins two planes. Inside a node, policy routing
# keeps each NIC to its own plane: a packet from 198.18.p.x leaves through veth<p> or not at all,
# as on a real multi-plane cluster where a plane-0 NIC has no path to plane 3. mplane numbers planes
# from these subnets as from any (topo/planes.c: plane = rank of the subnet), so veth<p> is plane p
# on a node that runs on all P planes; the address range itself means nothing to mplane (a node run
# on some planes only names them with MPLANE_PLANES=veth<p>=<p>).
#
# Run a program on node n:      ip netns exec mplane-n1 <program>
# Plane p's byte counters:      ip netns exec mplane-sw cat /sys/class/net/n1p<p>/statistics/tx_bytes
# Capture plane p:              ip netns exec mplane-sw tcpdump -i mplane-br<p> -nn -v
#
# Needs root and iproute2. Exit codes: 0 ok, 1 error, 2 usage, 3 status: not up, 77 missing
# prerequisite (root, ip) -- meson's "skipped", so tests can pass it through.
set -euo pipefail

NODES=2
PLANES=4
SW=mplane-sw
cmd=${1:-}
[ $# -gt 0 ] && shift
while [ $# -gt 0 ]; do
  case "$1" in
    --nodes) NODES=${2:?--nodes needs a number}; shift 2 ;;
    --planes) PLANES=${2:?--planes needs a number}; shift 2 ;;
    --nodes=*) NODES=${1#*=}; shift ;;
    --planes=*) PLANES=${1#*=}; shift ;;
    *) echo "fabric.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

case "$NODES" in ''|*[!0-9]*) echo "fabric.sh: --nodes '$NODES' is not a number from 1 to 254" >&2; exit 2 ;; esac
case "$PLANES" in ''|*[!0-9]*) echo "fabric.sh: --planes '$PLANES' is not a number from 1 to 16" >&2; exit 2 ;; esac
if [ "$NODES" -lt 1 ] || [ "$NODES" -gt 254 ]; then echo "fabric.sh: --nodes must be 1..254" >&2; exit 2; fi
if [ "$PLANES" -lt 1 ] || [ "$PLANES" -gt 16 ]; then echo "fabric.sh: --planes must be 1..16" >&2; exit 2; fi

need_prereqs() {
  if [ "$(id -u)" != 0 ]; then
    echo "fabric.sh: needs root (it creates network namespaces, veth pairs and bridges); run it with sudo" >&2
    exit 77
  fi
  if ! command -v ip >/dev/null 2>&1; then
    echo "fabric.sh: needs iproute2 ('ip' not found): apt-get install iproute2" >&2
    exit 77
  fi
}

ns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }
link_exists() { ip -n "$1" link show "$2" >/dev/null 2>&1; }
quiet_sysctl() { ip netns exec "$1" sysctl -qw "$2" >/dev/null 2>&1 || true; }

ensure_ns() {
  local ns=$1
  ns_exists "$ns" || ip netns add "$ns"
  ip -n "$ns" link set lo up
  # No IPv6 chatter (router/neighbour solicitations) on the fabric: byte counters stay exact.
  quiet_sysctl "$ns" net.ipv6.conf.all.disable_ipv6=1
  quiet_sysctl "$ns" net.ipv6.conf.default.disable_ipv6=1
}

up() {
  need_prereqs
  ensure_ns "$SW"
  for ((p = 0; p < PLANES; p++)); do
    local br=mplane-br$p
    link_exists "$SW" "$br" || ip -n "$SW" link add "$br" type bridge stp_state 0 forward_delay 0
    ip -n "$SW" link set "$br" up
  done
  for ((n = 1; n <= NODES; n++)); do
    local ns=mplane-n$n
    ensure_ns "$ns"
    quiet_sysctl "$ns" net.ipv4.conf.all.rp_filter=0
    for ((p = 0; p < PLANES; p++)); do
      local nic=veth$p port=n${n}p$p addr=198.18.$p.$n
      if ! link_exists "$ns" "$nic"; then
        link_exists "$SW" "$port" && ip -n "$SW" link del "$port"
        ip link add "$nic" netns "$ns" type veth peer name "$port" netns "$SW"
      fi
      ip -n "$SW" link set "$port" master mplane-br$p
      ip -n "$SW" link set "$port" up
      ip -n "$ns" addr replace "$addr/24" dev "$nic"
      ip -n "$ns" link set "$nic" up
      # Plane p's table knows plane p's subnet and nothing else.
      local table=$((100 + p))
      ip -n "$ns" route replace 198.18.$p.0/24 dev "$nic" src "$addr" table "$table"
      ip -n "$ns" route replace unreachable default table "$table"
      ip -n "$ns" rule show | grep -q "from $addr lookup $table" ||
        ip -n "$ns" rule add from "$addr" lookup "$table" priority $((1000 + p))
    done
  done
  echo "fabric: up, $NODES node(s) x $PLANES plane(s): namespaces mplane-n1..mplane-n$NODES, bridges mplane-br0..mplane-br$((PLANES - 1)) in $SW"
}

down() {
  need_prereqs
  local gone=0
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}'); do
    case "$ns" in
      mplane-n[0-9]*|"$SW") ip netns del "$ns"; gone=$((gone + 1)) ;;
    esac
  done
  echo "fabric: down ($gone namespace(s) removed)"
}

status() {
  need_prereqs
  if ! ns_exists "$SW"; then
    echo "fabric: not up (no namespace $SW)"
    exit 3
  fi
  echo "fabric: switch namespace $SW"
  for br in $(ip -n "$SW" -o link show type bridge | awk -F': ' '{print $2}' | sort -V); do
    local ports
    ports=$(ip -n "$SW" -o link show master "$br" | awk -F': ' '{print $2}' | cut -d@ -f1 | sort -V | tr '\n' ' ')
    echo "  $br: ports $ports"
    for port in $ports; do
      printf '    %-8s rx %12s B  tx %12s B\n' "$port" \
        "$(ip netns exec "$SW" cat /sys/class/net/$port/statistics/rx_bytes)" \
        "$(ip netns exec "$SW" cat /sys/class/net/$port/statistics/tx_bytes)"
    done
  done
  for ns in $(ip netns list | awk '{print $1}' | grep '^mplane-n[0-9]' | sort -V); do
    echo "  node $ns: $(ip -n "$ns" -o -4 addr show | awk '$2 != "lo" {printf "%s=%s ", $2, $4}')"
  done
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) usage ;;
esac
