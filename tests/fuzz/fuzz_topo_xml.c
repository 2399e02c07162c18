/* Fuzz target: hwloc XML topology discovery from a file, the way MPLANE_TOPO_FILE is read. The
 * input goes through the check process first (hwloc alone, in a forked child: hwloc 2.9 crashes on
 * some malformed files, and such a file is refused, never loaded here); what passes is loaded into
 * this process and run through everything the plugin and mplane-topo do with a node: pairs, planes,
 * the NCCL topology XML and the reports. Every walk must end and stay in bounds. */
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "topo/topo_internal.h"

static FILE *devnull;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  devnull = fopen("/dev/null", "w");
  if (!devnull) abort();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size > (1 << 20)) return 0;
  char *buf = fuzz_cstr(data, size);
  char why[512], err[2048];
  /* hwloc only in the child (with_build 0): the model is built here, where the sanitizers see it. */
  if (mplane_topo_xml_check(buf, size, 5000, 0, why, sizeof(why)) != 0) {
    free(buf);
    return 0;
  }
  struct mplane_topo *t = malloc(sizeof(*t));
  if (!t) abort();
  mplane_topo_init(t);
  if (mplane_topo_from_hwloc_xml(t, buf, size, "fuzz.xml", "MPLANE_TOPO_FILE", 0, err, sizeof(err)) == ncclSuccess) {
    mplane_topo_finish(t);
    mplane_topo_apply_cuda_visible(t, NULL);
    if (mplane_topo_assign_planes(t, "", err, sizeof(err)) == ncclSuccess) {
      for (int i = 0; i < t->npci; i++) {
        int chain[32];
        int n = mplane_topo_nccl_parents(t, i, chain, 32);
        for (int k = 0; k < n && k < 32; k++) FUZZ_REQUIRE(chain[k] >= 0 && chain[k] < t->npci, "parent index");
      }
      for (int g = 0; g < t->ngpus; g++) mplane_topo_gpu_nic_pair(t, g, NULL);
      mplane_topo_write_nccl_xml(t, devnull);
      mplane_topo_print_table(t, devnull);
      mplane_topo_print_picture(t, devnull);
      mplane_topo_print_json(t, devnull);
      mplane_topo_print_nccl_env(t, devnull);
    }
  }
  free(t);
  free(buf);
  return 0;
}
