#!/usr/bin/env bash
# mplane: real kernel verbs on a machine without RDMA. Boots Debian's stock kernel under qemu (TCG),
# with soft-RoCE (rdma_rxe) on a veth pair, and runs a command there against rdma-core's real
# libibverbs and rxe provider, with this machine's root filesystem mounted read-only over virtio-9p.
#
#   scripts/rxe-vm.sh prepare                           install qemu, busybox-static, rdma-core, perftest
#                                                       (apt-get, when missing), fetch the kernel, build
#                                                       the initramfs (cached: a second call is quick)
#   scripts/rxe-vm.sh run [--timeout S] [--env VAR]... -- CMD [ARG]...
#                                                       boot, set up rxe0 and rxe1, run CMD in the
#                                                       current directory, exit with CMD's status
#   scripts/rxe-vm.sh shell                             boot, set up rxe0 and rxe1, interactive bash
#
# Inside the VM: rxe0 on veth0 (198.18.0.1/24), rxe1 on veth1 (198.18.0.2/24), MTU 9000 (active_mtu
# 4096); policy routing sends traffic between the two addresses across the veth pair, not through lo.
# The root filesystem is the host's, read-only; /tmp is writable (the host's /tmp under a tmpfs overlay), and
# $MPLANE_RXE_SHARE is a writable directory shared with the host (the same path on both sides).
# CMD sees MPLANE_*, SOFTVERBS_*, PATH, HOME and every variable named by --env; nothing else.
#
# Environment: MPLANE_RXE_CACHE   cache of kernels and initramfs (default ~/.cache/mplane-rxe)
#              MPLANE_RXE_OUT     use this directory as the shared one and keep it (default: a
#                                 temporary directory, removed at exit)
#              MPLANE_RXE_MEM     guest memory in MiB (default 4096); MPLANE_RXE_SMP guest CPUs (2)
#              MPLANE_RXE_NICE    qemu's nice value where this user may set it (default -5: ahead of
#                                 the other tests that meson runs beside it; 0 to leave it alone)
#
# Exit status of run: CMD's; 77 when qemu or the kernel cannot be installed or downloaded (meson's
# "skipped"); 124 on timeout (default 900 s; qemu is killed); 1 when the guest cannot set up rxe
# (the failing step is named) or ends without reporting a status; 2 usage.
set -euo pipefail

SELF=$(readlink -f "$0")
CACHE=${MPLANE_RXE_CACHE:-${HOME:-/root}/.cache/mplane-rxe}
HOST_PKGS=(qemu-system-x86 busybox-static kmod rdma-core ibverbs-providers libibverbs1 ibverbs-utils perftest
           iproute2 cpio)
# Loaded in the guest in this order, each after its dependencies (resolved from modules.dep).
GUEST_MODULES=(virtio_pci 9pnet_virtio 9p overlay veth crc32_generic rdma_rxe rdma_ucm)
# Bump when the initramfs layout or its /init changes: cached initramfs files are then rebuilt.
INITRD_FORMAT=1

log() { echo "rxe-vm: $*" >&2; }
die() { log "$*"; exit 1; }
skip() { log "SKIP: $*"; exit 77; }

usage() {
  sed -n '2,29p' "$SELF" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

# ------------------------------------------------------------------------------------ host: prepare

as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo -n "$@"; fi; }

pkg_installed() { [ "$(dpkg-query -W -f='${Status}' "$1" 2>/dev/null)" = "install ok installed" ]; }

apt_updated=0
apt_update_once() {
  [ "$apt_updated" -eq 1 ] && return 0
  apt_updated=1
  as_root apt-get update -qq >/dev/null 2>&1
}

install_host_packages() {
  command -v dpkg-query >/dev/null 2>&1 || skip "not a Debian/Ubuntu host (no dpkg): cannot install qemu and the kernel"
  local missing=() p
  for p in "${HOST_PKGS[@]}"; do pkg_installed "$p" || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing ${missing[*]}"
  if ! apt_update_once || ! DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends \
      "${missing[@]}" >/dev/null 2>&1; then
    skip "cannot install ${missing[*]} with apt-get (not root and no sudo, or no package mirror reachable)"
  fi
}

# The kernel package linux-image-amd64 points at today (e.g. linux-image-6.1.0-57-amd64).
kernel_package() {
  apt-cache depends linux-image-amd64 2>/dev/null | awk '$1 == "Depends:" && $2 ~ /^linux-image-[0-9]/ { print $2; exit }'
}

# Newest kernel already in the cache, for a host that can no longer reach its mirror.
cached_kernel() {
  local d
  for d in $(ls -1d "$CACHE"/*/ 2>/dev/null | sort -rV); do
    [ -f "$d/vmlinuz" ] && [ -f "$d/linux-image.deb" ] && { basename "$d"; return 0; }
  done
  return 1
}

# Downloads the kernel package into $CACHE/<kver>/linux-image.deb (not installed: its postinst would
# run update-initramfs and grub on this host) and puts the kernel image beside it.
fetch_kernel() {
  local pkg=$1 kver=${1#linux-image-} dir=$CACHE/${1#linux-image-} tmp
  [ -f "$dir/vmlinuz" ] && [ -f "$dir/linux-image.deb" ] && return 0
  mkdir -p "$dir"
  tmp=$(mktemp -d "$dir/dl.XXXXXX")
  log "downloading $pkg"
  if ! (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1); then
    apt_update_once || true
    (cd "$tmp" && apt-get download "$pkg" >/dev/null 2>&1) || { rm -rf "$tmp"; rmdir "$dir" 2>/dev/null; return 1; }
  fi
  mv "$tmp"/*.deb "$dir/linux-image.deb"
  rm -rf "$tmp"
  dpkg-deb --fsys-tarfile "$dir/linux-image.deb" | tar -xO "./boot/vmlinuz-$kver" >"$dir/vmlinuz.tmp"
  mv "$dir/vmlinuz.tmp" "$dir/vmlinuz"
}

# Prints the kernel version to use, downloading it when needed.
select_kernel() {
  local pkg
  pkg=$(kernel_package)
  if [ -z "$pkg" ]; then
    apt_update_once || true
    pkg=$(kernel_package)
  fi
  if [ -n "$pkg" ] && fetch_kernel "$pkg"; then
    echo "${pkg#linux-image-}"
    return 0
  fi
  if cached_kernel; then
    [ -n "$pkg" ] && log "cannot download $pkg: using the cached kernel"
    return 0
  fi
  if [ -n "$pkg" ]; then
    skip "cannot download the kernel package $pkg (apt-get download failed: no package mirror reachable?)"
  fi
  skip "cannot find Debian's kernel package (apt-cache depends linux-image-amd64 gives none)"
}

# The guest's /init (busybox sh): load the modules, mount the host's root and the shared directory,
# then chroot into the host root and run this script's guest part there.
write_init() {
  cat >"$1" <<'EOF'
#!/bin/busybox sh
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
echo /bin/true >/proc/sys/kernel/modprobe
halt() { sync; poweroff -f; sleep 5; reboot -f; }
fail() { echo "rxe-vm: guest setup failed: $*"; [ -d /share/. ] && echo "setup-failed $*" >/share/status; halt; }
arg() { tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p"; }
script=$(arg mplane_script); share=$(arg mplane_share); mode=$(arg mplane_mode)
for m in $(cat /modules.list); do insmod "/modules/$m" || fail "insmod $m"; done
mkdir -p /share /root
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /share || fail "mount of the shared directory (9p)"
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144,cache=loose,ro hostroot /root || fail "mount of the host root (9p)"
mount -t proc proc /root/proc && mount -t sysfs sysfs /root/sys && mount -t devtmpfs devtmpfs /root/dev \
  || fail "proc, sys and dev in the host root"
mkdir -p /root/dev/pts /root/dev/shm
ln -sf /proc/self/fd /root/dev/fd; ln -sf fd/0 /root/dev/stdin; ln -sf fd/1 /root/dev/stdout; ln -sf fd/2 /root/dev/stderr
mount -t devpts devpts /root/dev/pts; mount -t tmpfs tmpfs /root/dev/shm; mount -t tmpfs tmpfs /root/run
# /tmp: the host's /tmp (read-only) under a tmpfs overlay, so builds kept in /tmp stay visible.
mkdir -p /ovl && mount -t tmpfs tmpfs /ovl && mkdir -p /ovl/upper /ovl/work
mount -t overlay overlay -o lowerdir=/root/tmp,upperdir=/ovl/upper,workdir=/ovl/work /root/tmp \
  || mount -t tmpfs tmpfs /root/tmp || fail "a writable /tmp"
mkdir -p "/root$share" 2>/dev/null
mount -o bind /share "/root$share" || fail "the shared directory at $share"
chroot /root /bin/bash "$script" __guest "$share" "$mode"
halt
EOF
  chmod 755 "$1"
}

initrd_stamp() {
  { echo "$INITRD_FORMAT ${GUEST_MODULES[*]} $(dpkg-query -W -f='${Version}' busybox-static)"; write_init /dev/stdout; } |
    sha256sum | cut -d' ' -f1
}

# Module files (relative to lib/modules/<kver>) in load order, dependencies first, no repeats.
module_chain() {
  local root=$1 kver=$2 m deps all=""
  for m in "${GUEST_MODULES[@]}"; do
    deps=$(modprobe -d "$root" -S "$kver" --show-depends "$m") || die "module $m is not in kernel $kver"
    all+="$deps"$'\n'
  done
  awk '$1 == "insmod" { print $2 }' <<<"$all" | awk '!seen[$0]++' | sed "s|^$root/lib/modules/$kver/||"
}

# $CACHE/<kver>/initrd.gz: busybox-static, the module chain (decompressed: busybox insmod takes plain
# .ko files) and /init.
build_initrd() {
  local kver=$1 dir=$CACHE/$1 x st f base chain
  x=$(mktemp -d "$dir/x.XXXXXX")
  st=$x/initrd
  dpkg-deb -x "$dir/linux-image.deb" "$x/pkg"
  depmod -b "$x/pkg" "$kver"
  mkdir -p "$st/bin" "$st/modules" "$st/proc" "$st/sys" "$st/dev" "$st/root" "$st/share"
  cp /bin/busybox "$st/bin/busybox"
  chain=$(module_chain "$x/pkg" "$kver") || exit 1
  : >"$st/modules.list"
  while read -r f; do
    base=$(basename "$f")
    case "$f" in
      *.ko.xz) xz -dc "$x/pkg/lib/modules/$kver/$f" >"$st/modules/${base%.xz}"; base=${base%.xz} ;;
      *.ko.zst) zstd -qdc "$x/pkg/lib/modules/$kver/$f" >"$st/modules/${base%.zst}"; base=${base%.zst} ;;
      *.ko.gz) gzip -dc "$x/pkg/lib/modules/$kver/$f" >"$st/modules/${base%.gz}"; base=${base%.gz} ;;
      *.ko) cp "$x/pkg/lib/modules/$kver/$f" "$st/modules/$base" ;;
      *) die "unexpected module file $f" ;;
    esac
    echo "$base" >>"$st/modules.list"
  done <<<"$chain"
  write_init "$st/init"
  (cd "$st" && find . | cpio -o -H newc --quiet | gzip -1) >"$dir/initrd.gz.tmp"
  mv "$dir/initrd.gz.tmp" "$dir/initrd.gz"
  initrd_stamp >"$dir/initrd.stamp"
  rm -rf "$x"
}

# Sets KVER, KERNEL, INITRD.
prepare() {
  install_host_packages
  command -v qemu-system-x86_64 >/dev/null 2>&1 || skip "qemu-system-x86_64 is not installed"
  mkdir -p "$CACHE" || skip "cannot create the cache directory $CACHE"
  KVER=$(select_kernel) || exit $?
  local dir=$CACHE/$KVER
  if [ ! -f "$dir/initrd.gz" ] || [ "$(cat "$dir/initrd.stamp" 2>/dev/null)" != "$(initrd_stamp)" ]; then
    log "building the initramfs for $KVER"
    build_initrd "$KVER"
  fi
  KERNEL=$dir/vmlinuz
  INITRD=$dir/initrd.gz
}

# ---------------------------------------------------------------------------------------- host: run

# The job the guest runs: the environment CMD gets, its directory, and CMD itself.
write_job() {
  local job=$1 v
  shift
  {
    echo "# written by rxe-vm.sh"
    for v in $(compgen -e); do
      case "$v" in
        MPLANE_*|SOFTVERBS_*|PATH|HOME) printf 'export %s=%q\n' "$v" "${!v}" ;;
      esac
    done
    for v in "${PASS_ENV[@]}"; do
      [ -n "${!v+x}" ] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    printf 'export MPLANE_RXE_SHARE=%q\n' "$SHARE"
    printf 'cd %q || exit 1\n' "$PWD"
    printf 'exec'
    printf ' %q' "$@"
    echo
  } >"$job"
}

QEMU_PID=""
SHARE=""
KEEP_SHARE=0

cleanup() {
  [ -n "$QEMU_PID" ] && kill "$QEMU_PID" 2>/dev/null || true
  [ -n "$SHARE" ] && [ "$KEEP_SHARE" -eq 0 ] && rm -rf "$SHARE"
  return 0
}

make_share() {
  if [ -n "${MPLANE_RXE_OUT:-}" ]; then
    mkdir -p "$MPLANE_RXE_OUT"
    SHARE=$(readlink -f "$MPLANE_RXE_OUT")
    KEEP_SHARE=1
    rm -f "$SHARE/status" "$SHARE/job.sh"
  else
    SHARE=$(mktemp -d "${TMPDIR:-/tmp}/mplane-rxe.XXXXXX")
  fi
  case "$SHARE" in *[[:space:]]*) die "the shared directory '$SHARE' has a space in its path" ;; esac
  case "$SELF" in *[[:space:]]*) die "this script's path '$SELF' has a space in it" ;; esac
}

# -nographic would also mirror the BIOS screen (and its terminal resets) to the console; this is the
# same serial console without that. The shell keeps qemu's monitor on it (Ctrl-A x quits).
qemu_args() {
  local mode=$1 serial=stdio
  [ "$mode" = shell ] && serial=mon:stdio
  QEMU=(qemu-system-x86_64 -accel "tcg,thread=multi" -cpu max -smp "${MPLANE_RXE_SMP:-2}" -m "${MPLANE_RXE_MEM:-4096}"
        -display none -vga none -serial "$serial" -monitor none -no-reboot -nic none
        -kernel "$KERNEL" -initrd "$INITRD"
        -append "console=ttyS0 quiet loglevel=3 panic=-1 mplane_script=$SELF mplane_share=$SHARE mplane_mode=$mode"
        -virtfs "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap"
        -virtfs "local,path=$SHARE,mount_tag=share,security_model=none,multidevs=remap")
}

# Reads the status the guest left in the shared directory and exits with it.
finish() {
  local st
  st=$(cat "$SHARE/status" 2>/dev/null || true)
  case "$st" in
    "exit "*) exit "${st#exit }" ;;
    "setup-failed "*) die "the guest could not set up rxe: ${st#setup-failed } (console output above)" ;;
    *) die "the guest ended without reporting a status (kernel panic or early init failure? console output above)" ;;
  esac
}

run() {
  local timeout=900
  PASS_ENV=()
  while [ $# -gt 0 ]; do
    case "$1" in
      --timeout) timeout=${2:?--timeout needs seconds}; shift 2 ;;
      --timeout=*) timeout=${1#*=}; shift ;;
      --env) PASS_ENV+=("${2:?--env needs a variable name}"); shift 2 ;;
      --env=*) PASS_ENV+=("${1#*=}"); shift ;;
      --) shift; break ;;
      *) log "unknown argument '$1'"; usage ;;
    esac
  done
  [ $# -gt 0 ] || usage
  prepare
  make_share
  trap cleanup EXIT
  trap 'log "interrupted: killing qemu"; exit 130' INT
  trap 'log "terminated: killing qemu"; exit 143' TERM
  write_job "$SHARE/job.sh" "$@"
  qemu_args run
  log "booting $KVER under qemu (TCG), timeout ${timeout}s"
  local t0=$SECONDS rc=0
  # The guest's clock is this machine's: a guest kept waiting for a CPU by the tests beside it sees
  # its scenarios' windows (a 1.5 s accept loop, 10 s per call) run out. qemu goes first where it may.
  local nice=()
  [ "${MPLANE_RXE_NICE:--5}" != 0 ] && nice -n "${MPLANE_RXE_NICE:--5}" true 2>/dev/null && nice=(nice -n "${MPLANE_RXE_NICE:--5}")
  timeout -k 10 "$timeout" "${nice[@]}" "${QEMU[@]}" </dev/null &
  QEMU_PID=$!
  wait "$QEMU_PID" || rc=$?
  QEMU_PID=""
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    log "TIMEOUT: the guest ran past ${timeout}s; qemu killed"
    exit 124
  fi
  [ "$rc" -eq 0 ] || die "qemu failed (status $rc)"
  log "vm done in $((SECONDS - t0))s"
  finish
}

shell() {
  PASS_ENV=()
  prepare
  make_share
  trap cleanup EXIT
  qemu_args shell
  "${QEMU[@]}"
}

# ------------------------------------------------------------------------ guest (chrooted host root)

gstep() {
  local what=$1
  shift
  "$@" >/tmp/rxe-step.log 2>&1 && return 0
  cat /tmp/rxe-step.log
  echo "setup-failed $what" >"$GSHARE/status"
  echo "rxe-vm: guest setup failed: $what ($*)"
  exit 1
}

port_active() {
  local _
  for _ in $(seq 100); do
    grep -q ACTIVE "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null && return 0
    sleep 0.1
  done
  cat "/sys/class/infiniband/$1/ports/1/state" 2>/dev/null || echo "$1: no such device"
  return 1
}

uverbs_nodes() { ls /dev/infiniband/uverbs0 /dev/infiniband/uverbs1 >/dev/null; }

# The step functions chain their commands with &&: errexit does not apply inside gstep's test.
sysctls() {
  local c
  for c in all default veth0 veth1; do
    sysctl -qw "net.ipv4.conf.$c.accept_local=1" "net.ipv4.conf.$c.rp_filter=0" || return 1
  done
}

# Both addresses are local, so by default every packet between them would take lo. These rules send
# what 198.18.0.1 sends to .2 out of veth0 and the reverse out of veth1; the local table is consulted
# after them, so the packet arriving on the other end is still delivered locally.
routing() {
  ip rule add pref 100 lookup local &&
    ip rule del pref 0 lookup local &&
    ip route add 198.18.0.2/32 dev veth0 src 198.18.0.1 table 101 &&
    ip route add 198.18.0.1/32 dev veth1 src 198.18.0.2 table 102 &&
    ip rule add pref 10 from 198.18.0.1 to 198.18.0.2 iif lo lookup 101 &&
    ip rule add pref 11 from 198.18.0.2 to 198.18.0.1 iif lo lookup 102
}

veth_pair() {
  ip link set lo up &&
    ip link add veth0 type veth peer name veth1 &&
    ip link set veth0 mtu 9000 &&
    ip link set veth1 mtu 9000 &&
    ip addr add 198.18.0.1/24 dev veth0 &&
    ip addr add 198.18.0.2/24 dev veth1 &&
    ip link set veth0 up &&
    ip link set veth1 up
}

guest() {
  GSHARE=$1
  local mode=$2 rc=0
  export PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
  gstep "veth pair veth0/veth1 (ip link add)" veth_pair
  gstep "sysctl accept_local/rp_filter" sysctls
  gstep "policy routing across the veth pair (ip rule)" routing
  gstep "rdma link add rxe0 type rxe netdev veth0" rdma link add rxe0 type rxe netdev veth0
  gstep "rdma link add rxe1 type rxe netdev veth1" rdma link add rxe1 type rxe netdev veth1
  gstep "rxe0 port 1 ACTIVE" port_active rxe0
  gstep "rxe1 port 1 ACTIVE" port_active rxe1
  gstep "/dev/infiniband/uverbs0 and uverbs1" uverbs_nodes
  echo "rxe-vm: guest up in $(cut -d' ' -f1 /proc/uptime)s (kernel $(uname -r)); rxe0 on veth0 198.18.0.1, rxe1 on veth1 198.18.0.2"
  ibv_devices || true
  ulimit -l unlimited
  if [ "$mode" = shell ]; then
    PS1='rxe-vm# ' setsid -c bash -i </dev/console >/dev/console 2>&1 || true
    echo "exit 0" >"$GSHARE/status"
    return 0
  fi
  env -i bash "$GSHARE/job.sh" </dev/null || rc=$?
  echo "exit $rc" >"$GSHARE/status"
}

# ------------------------------------------------------------------------------------------ main

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  prepare)
    t0=$SECONDS
    prepare
    log "ready: kernel $KVER, $KERNEL + $INITRD ($((SECONDS - t0))s)"
    ;;
  run) run "$@" ;;
  shell) shell ;;
  __guest) guest "$@" ;;
  *) usage ;;
esac
