#!/usr/bin/env bash
# Set up, build, and run mplane's main job on this machine.
#
#   scripts/setup.sh            install what is missing (apt-get), build into ./build, run the main job
#   scripts/setup.sh --build    install and build only
#
# The main job prints the devices the plugin discovers and checks bandwidth through the plugin
# between two local processes (over loopback unless MPLANE_SOCKET_IFNAME says otherwise). With a GPU
# and NCCL_TESTS_DIR pointing at a built nccl-tests, it also runs nccl-tests through the plugin.
set -euo pipefail
cd "$(dirname "$0")/.."

need_pkgs=()
have() { command -v "$1" >/dev/null 2>&1; }
have_pc() { pkg-config --exists "$1" 2>/dev/null; }
have meson || need_pkgs+=(meson)
have ninja || need_pkgs+=(ninja-build)
have pkg-config || need_pkgs+=(pkg-config)
have cc || need_pkgs+=(gcc)
have ip || need_pkgs+=(iproute2)
have tcpdump || need_pkgs+=(tcpdump)
have lstopo-no-graphics || need_pkgs+=(hwloc-nox)
have_pc hwloc || need_pkgs+=(libhwloc-dev)
have_pc cmocka || need_pkgs+=(libcmocka-dev)
[ -f /usr/include/infiniband/verbs.h ] || need_pkgs+=(libibverbs-dev)
# The stats test's real parser of Prometheus' text format (tests/unit/stats_prometheus.py).
{ python3 -c 'import prometheus_client' || /usr/bin/python3 -c 'import prometheus_client'; } >/dev/null 2>&1 ||
  need_pkgs+=(python3-prometheus-client)
# The fuzz suite (tests/fuzz): clang and its libFuzzer/sanitizer runtime (libclang-rt-dev on Debian 12).
fuzz_links() { echo 'int LLVMFuzzerTestOneInput(const char *d, unsigned long n) { return 0; }' |
  clang -x c - -fsanitize=fuzzer,address,undefined -o /dev/null >/dev/null 2>&1; }
if ! have clang; then
  need_pkgs+=(clang)
  apt-cache show libclang-rt-dev >/dev/null 2>&1 && need_pkgs+=(libclang-rt-dev)
elif ! fuzz_links && apt-cache show libclang-rt-dev >/dev/null 2>&1; then
  need_pkgs+=(libclang-rt-dev)
fi
if [ ${#need_pkgs[@]} -gt 0 ]; then
  echo "setup: installing ${need_pkgs[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need_pkgs[@]}" >/dev/null
fi

if [ ! -f build/build.ninja ]; then
  meson setup build
fi
ninja -C build

[ "${1:-}" = "--build" ] && exit 0

echo
echo "== main job: devices and a bandwidth check through the plugin =="
export MPLANE_SOCKET_IFNAME="${MPLANE_SOCKET_IFNAME:-lo}"
./build/tools/mplane-netbench --plugin "$PWD/build/libnccl-net-mplane.so" --seconds 2 --raw-streams 4
if have nvidia-smi && nvidia-smi -L >/dev/null 2>&1 && [ -n "${NCCL_TESTS_DIR:-}" ]; then
  echo
  echo "== nccl-tests through mplane =="
  scripts/nccl-tests.sh
else
  echo
  echo "(no GPU, or NCCL_TESTS_DIR unset: skipping nccl-tests; see README 'Validate with nccl-tests')"
fi
