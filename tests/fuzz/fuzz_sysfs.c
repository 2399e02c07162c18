/* Fuzz target: the sysfs text parsers (a NUMA node's cpulist, an IB port's rate) and the cpumap
 * they feed. Values stay within their documented bounds; no arithmetic overflows (UBSan aborts). */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "topo/topo_internal.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *s = fuzz_cstr(data, size);
  static int cpus[8192];
  int n = mplane_topo_parse_cpulist(s, cpus, 8192);
  FUZZ_REQUIRE(n >= 0 && n <= 8192, "count %d", n);
  for (int i = 0; i < n; i++) FUZZ_REQUIRE(cpus[i] >= 0 && cpus[i] <= MPLANE_TOPO_MAX_CPU, "cpu %d", cpus[i]);
  char map[256];
  mplane_topo_cpumap(cpus, n, map, sizeof(map));
  FUZZ_REQUIRE(strlen(map) < sizeof(map), "cpumap length");
  int mbps = mplane_topo_parse_ib_rate(s);
  FUZZ_REQUIRE(mbps >= 0 && mbps <= MPLANE_TOPO_MAX_SPEED_MBPS, "rate %d", mbps);
  free(s);
  return 0;
}
