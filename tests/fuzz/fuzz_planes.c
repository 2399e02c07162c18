/* Fuzz target: MPLANE_PLANES. One grammar, one parser: mplane-config --check (the config load)
 * and topo/'s plane assignment (topo/planes.c, what init applies) must agree on every value; an
 * accepted value prints back to one that parses to the same entries. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "common/config.h"
#include "topo/topo_internal.h"

static const char *devnames[] = {"mlx5_0:1", "mlx5_1:1", "eth0", "lo", "veth0", "ib0"};
#define NDEV (int)(sizeof(devnames) / sizeof(devnames[0]))

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  char *value = fuzz_cstr(data, size);
  char why[512];
  static struct mplane_planes_spec spec, again;
  int parsed = mplane_planes_parse(value, &spec, why, sizeof(why)) == 0;

  /* the config table (mplane-config --check, init) */
  if (strlen(value) < sizeof(((struct mplane_config *)0)->planes) && value[0]) {
    setenv("MPLANE_PLANES", value, 1);
    struct mplane_config cfg;
    char err[2048];
    int loaded = mplane_config_load(&cfg, err, sizeof(err)) == ncclSuccess;
    unsetenv("MPLANE_PLANES");
    FUZZ_REQUIRE(loaded == parsed, "config load %d, parse %d", loaded, parsed);
  }

  /* topo/'s assignment on a node with those NICs */
  static struct mplane_topo t;
  mplane_topo_init(&t);
  for (int d = 0; d < NDEV; d++) mplane_topo_add_virtual_nic(&t, devnames[d]);
  char err[2048];
  ncclResult_t res = mplane_topo_assign_planes(&t, value, err, sizeof(err));
  if (!parsed) FUZZ_REQUIRE(res == ncclInvalidArgument, "topo accepted what the parser refused");
  /* a value that parses is refused only for naming NICs this node does not have (or one twice) */
  if (parsed && res != ncclSuccess)
    FUZZ_REQUIRE(strstr(err, "which this node does not have") || strstr(err, "twice"), "topo refused a valid value: %s",
                 err);

  if (parsed) {
    char back[8192] = "";
    size_t o = 0;
    for (int i = 0; i < spec.n; i++)
      o += (size_t)snprintf(back + o, sizeof(back) - o, "%s%s=%d", i ? "," : "", spec.entry[i].nic, spec.entry[i].plane);
    FUZZ_REQUIRE(mplane_planes_parse(back, &again, why, sizeof(why)) == 0, "'%s' printed back as '%s': %s", value,
                 back, why);
    FUZZ_REQUIRE(again.n == spec.n, "entry count changed");
    for (int i = 0; i < spec.n; i++) {
      FUZZ_REQUIRE(strcmp(again.entry[i].nic, spec.entry[i].nic) == 0, "entry %d name", i);
      FUZZ_REQUIRE(again.entry[i].plane == spec.entry[i].plane, "entry %d plane", i);
      FUZZ_REQUIRE(spec.entry[i].plane >= 0 && spec.entry[i].plane <= MPLANE_PLANES_MAX_PLANE, "plane range");
    }
  }
  free(value);
  return 0;
}
