/* mplane-topo: print the node as mplane sees it: GPUs, NICs, pairs, planes. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/config.h"
#include "topo.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: mplane-topo [--topo FILE] [--json] [--nccl-topo FILE] [--nccl-env]\n"
          "\n"
          "Discover this node (hwloc; sysfs where hwloc sees no PCI device) and print each GPU with\n"
          "its PCI bus id, NUMA node, paired NIC, link class and plane, every NIC, and a picture of\n"
          "the planes.\n"
          "\n"
          "  --topo FILE       read an hwloc XML file (lstopo --of xml) instead of this machine\n"
          "                    (default: MPLANE_TOPO_FILE when set)\n"
          "  --json            print the node as JSON instead\n"
          "  --nccl-topo FILE  write the NCCL topology XML (NCCL_TOPO_FILE form) to FILE ('-': stdout)\n"
          "  --nccl-env        print the NCCL settings a multi-plane job should use, each with why\n"
          "  -h, --help        this text\n"
          "\n"
          "Planes come from MPLANE_PLANES (e.g. mlx5_0=0,mlx5_1=1), else the fabric (IB subnet\n"
          "prefix, IP subnet), else PCI order. CUDA_VISIBLE_DEVICES marks the GPUs a process sees.\n");
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"topo", required_argument, NULL, 't'},      {"json", no_argument, NULL, 'j'},
      {"nccl-topo", required_argument, NULL, 'x'}, {"nccl-env", no_argument, NULL, 'e'},
      {"help", no_argument, NULL, 'h'},            {NULL, 0, NULL, 0},
  };
  const char *topo_file = NULL, *nccl_topo = NULL;
  int json = 0, nccl_env = 0, c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
      case 't': topo_file = optarg; break;
      case 'j': json = 1; break;
      case 'x': nccl_topo = optarg; break;
      case 'e': nccl_env = 1; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "mplane-topo: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  char err[2048];
  struct mplane_config cfg;
  if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) {
    fprintf(stderr, "mplane-topo: %s\n", err);
    return 2;
  }
  struct mplane_topo_options o = {
      .xml_path = topo_file ? topo_file : cfg.topo_file,
      .xml_input = topo_file ? "--topo" : "MPLANE_TOPO_FILE",
      .planes = cfg.planes,
      .cuda_visible = getenv("CUDA_VISIBLE_DEVICES"),
      .live_interfaces = 1,
  };
  struct mplane_topo *t = NULL;
  if (mplane_topo_load(&o, &t, err, sizeof(err)) != ncclSuccess) {
    fprintf(stderr, "mplane-topo: %s\n", err);
    return 1;
  }
  int rc = 0;
  if (nccl_topo) {
    FILE *f = strcmp(nccl_topo, "-") == 0 ? stdout : fopen(nccl_topo, "w");
    if (!f) {
      fprintf(stderr, "mplane-topo: --nccl-topo '%s' cannot be written: %m\n", nccl_topo);
      mplane_topo_free(t);
      return 1;
    }
    if (mplane_topo_write_nccl_xml(t, f) != ncclSuccess) rc = 1;
    if (f != stdout) {
      if (fclose(f) != 0) rc = 1;
      if (rc == 0) fprintf(stderr, "mplane-topo: wrote %s (use it as NCCL_TOPO_FILE)\n", nccl_topo);
    }
    if (rc) fprintf(stderr, "mplane-topo: writing --nccl-topo '%s' failed\n", nccl_topo);
  }
  if (json) mplane_topo_print_json(t, stdout);
  if (nccl_env) mplane_topo_print_nccl_env(t, stdout);
  if (!json && !nccl_env && !(nccl_topo && strcmp(nccl_topo, "-") == 0)) {
    mplane_topo_print_table(t, stdout);
    mplane_topo_print_picture(t, stdout);
  }
  mplane_topo_free(t);
  return rc;
}
