#!/usr/bin/env bash
# An installed tree works (suite 'install'): meson install into a temporary DESTDIR, then what a user
# runs is run from there: the plugin is dlopened and driven by the ABI harness, the tuner link points
# at it, mplane-config and mplane-topo start, libmplane-hfreduce links and runs from its header and
# library, and the Python bindings install with pip (no build step, no GPU) and import from their
# install folder.
#
#   install_check.sh BUILD_DIR SOURCE_DIR ABI_HARNESS
set -euo pipefail
build=$1 src=$2 harness=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fail() { echo "install: FAIL: $*"; exit 1; }

DESTDIR=$tmp meson install -C "$build" --no-rebuild --quiet >"$tmp/install.log" 2>&1 ||
  { cat "$tmp/install.log"; fail "meson install into $tmp failed"; }
lib=$(find "$tmp" -name libnccl-net-mplane.so -type f | head -n 1)
[ -n "$lib" ] || fail "no libnccl-net-mplane.so installed"
libdir=$(dirname "$lib")
[ "$(readlink "$libdir/libnccl-tuner-mplane.so" 2>/dev/null)" = libnccl-net-mplane.so ] ||
  fail "libnccl-tuner-mplane.so is not a link to libnccl-net-mplane.so in $libdir"
echo "install: plugin and tuner link in ${libdir#"$tmp"}"

MPLANE_SOCKET_IFNAME=lo "$harness" --plugin "$lib" props sizes || fail "the installed plugin does not run"
echo "install: the installed plugin passes the harness' props and sizes"

bindir=$(dirname "$(find "$tmp" -name mplane-config -type f | head -n 1)")
[ -x "$bindir/mplane-config" ] || fail "no mplane-config installed"
"$bindir/mplane-config" --check >/dev/null || fail "the installed mplane-config --check failed"
MPLANE_TOPO_FILE="$src/tests/fixtures/h800-8gpu-8nic.xml" "$bindir/mplane-topo" >/dev/null ||
  fail "the installed mplane-topo failed on the H800 fixture"
echo "install: mplane-config and mplane-topo run from ${bindir#"$tmp"}"

# libmplane-hfreduce: the library, its header and pkg-config file, and a program built against them
# as a user builds one, running a one-rank all-reduce from the install folder
hfr=$(find "$tmp" -name 'libmplane-hfreduce.so' | head -n 1)
[ -n "$hfr" ] || fail "no libmplane-hfreduce.so installed"
hdr=$(find "$tmp" -name mplane_hfreduce.h -type f | head -n 1)
pc=$(find "$tmp" -name mplane-hfreduce.pc -type f | head -n 1)
[ -n "$hdr" ] && [ -n "$pc" ] || fail "mplane_hfreduce.h or mplane-hfreduce.pc not installed"
cat >"$tmp/hfr_user.c" <<'EOC'
#include <mplane_hfreduce.h>
#include <stdio.h>
int main(void) {
  mplane_hfreduce_unique_id id;
  mplane_hfreduce_comm_t comm;
  float x[3] = {1, 2, 3};
  if (mplane_hfreduce_get_unique_id(&id) || mplane_hfreduce_comm_init(&comm, 1, &id, 0) ||
      mplane_hfreduce_allreduce(comm, x, x, 3, MPLANE_HFREDUCE_FLOAT32, MPLANE_HFREDUCE_SUM, NULL) || x[2] != 3) {
    printf("%s\n", mplane_hfreduce_last_error());
    return 1;
  }
  return mplane_hfreduce_comm_destroy(comm);
}
EOC
cc -o "$tmp/hfr_user" "$tmp/hfr_user.c" -I"$(dirname "$hdr")" -L"$(dirname "$hfr")" -lmplane-hfreduce \
  -Wl,-rpath,"$(dirname "$hfr")" || fail "a program does not build against the installed libmplane-hfreduce"
MPLANE_SOCKET_IFNAME=lo MPLANE_TRANSPORT=socket "$tmp/hfr_user" || fail "the installed libmplane-hfreduce does not run"
grep -q -- '-lmplane-hfreduce' "$pc" || fail "mplane-hfreduce.pc does not link the library"
echo "install: libmplane-hfreduce, its header and pkg-config file; a program built against them runs"

# pip builds in the source folder: give it a copy, so the repository stays clean
if python3 -c "import setuptools" 2>/dev/null && python3 -m pip --version >/dev/null 2>&1; then
  cp -r "$src/collectives/ep/python" "$tmp/pysrc"
  # as a user runs it: pip fetches setuptools for the build from PyPI unless the wheel package is here
  iso=""
  python3 -c "import wheel" 2>/dev/null && iso="--no-build-isolation"
  python3 -m pip install --quiet --root-user-action=ignore $iso --no-deps --target "$tmp/site" "$tmp/pysrc" \
    >"$tmp/pip.log" 2>&1 ||
    { cat "$tmp/pip.log"; fail "pip install ./collectives/ep/python failed"; }
  where=$(cd / && PYTHONPATH="$tmp/site" python3 -c "import mplane_ep, os; print(os.path.dirname(mplane_ep.__file__))")
  [ "$where" = "$tmp/site/mplane_ep" ] || fail "mplane_ep imported from $where, not from its install folder"
  echo "install: pip install ./collectives/ep/python, import mplane_ep from the install folder"
  cp -r "$src/collectives/hfreduce/python" "$tmp/hfrpy"
  python3 -m pip install --quiet --root-user-action=ignore $iso --no-deps --target "$tmp/site" "$tmp/hfrpy" \
    >"$tmp/pip.log" 2>&1 ||
    { cat "$tmp/pip.log"; fail "pip install ./collectives/hfreduce/python failed"; }
  where=$(cd / && PYTHONPATH="$tmp/site" python3 -c "import mplane_hfreduce, os; print(os.path.dirname(mplane_hfreduce.__file__))")
  [ "$where" = "$tmp/site/mplane_hfreduce" ] || fail "mplane_hfreduce imported from $where, not from its install folder"
  echo "install: pip install ./collectives/hfreduce/python, import mplane_hfreduce from the install folder"
else
  echo "install: FAIL: python3 has no pip or setuptools: cannot check pip install ./collectives/ep/python"
  exit 1
fi
