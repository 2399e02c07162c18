/* mplane topo tests: discovery from the hwloc fixtures, pairs, link classes, planes, MPLANE_PLANES,
 * CUDA_VISIBLE_DEVICES, the sysfs fallback, the plugin's device annotation, reports and the NCCL
 * topology XML. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/transport.h"
#include "common/config.h"
#include "plugin/topo_bind.h"
#include "topo/topo.h"
#include "topo/topo_internal.h"
#include "topo_test_util.h"

#define FIX_A "h800-8gpu-8nic.xml"
#define FIX_B "a100-8gpu-4nic.xml"
#define FIX_C "a100-pcie-1nic-cpu.xml"
#define FIX_D "cpu-2nic-nogpu.xml"

static struct mplane_topo *load_opts(const char *file, const char *planes, const char *cuda) {
  struct mplane_topo_options o = {.xml_path = file, .xml_input = "MPLANE_TOPO_FILE", .planes = planes,
                                  .cuda_visible = cuda};
  struct mplane_topo *t = NULL;
  char err[2048];
  ncclResult_t res = mplane_topo_load(&o, &t, err, sizeof(err));
  if (res != ncclSuccess) fprintf(stderr, "load %s: %s\n", file, err);
  assert_int_equal(res, ncclSuccess);
  assert_non_null(t);
  return t;
}

static struct mplane_topo *load(const char *name) { return load_opts(fixture(name), NULL, NULL); }

static int nic(const struct mplane_topo *t, const char *name) {
  int n = mplane_topo_find_nic(t, name);
  if (n < 0) fprintf(stderr, "no NIC %s\n", name);
  assert_true(n >= 0);
  return n;
}

static void assert_pair(const struct mplane_topo *t, int g, const char *nicname, enum mplane_topo_link link,
                        int plane) {
  enum mplane_topo_link l;
  int n = mplane_topo_gpu_nic_pair(t, g, &l);
  assert_true(n >= 0);
  if (strcmp(t->nics[n].name, nicname) != 0 || l != link || t->nics[n].plane != plane)
    fprintf(stderr, "GPU%d: %s %s plane %d, expected %s %s plane %d\n", g, t->nics[n].name,
            mplane_topo_link_name(l), t->nics[n].plane, nicname, mplane_topo_link_name(link), plane);
  assert_string_equal(t->nics[n].name, nicname);
  assert_int_equal(l, link);
  assert_int_equal(t->nics[n].plane, plane);
}

static char *capture(void (*fn)(const struct mplane_topo *, FILE *), const struct mplane_topo *t) {
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  fn(t, f);
  fclose(f);
  return buf;
}

static void write_nccl(const struct mplane_topo *t, FILE *f) { assert_int_equal(mplane_topo_write_nccl_xml(t, f), ncclSuccess); }

static struct xt_node *nccl_tree(const struct mplane_topo *t, char **text_out) {
  char *text = capture(write_nccl, t);
  char why[256];
  struct xt_node *root = xt_parse(text, why, sizeof(why));
  if (!root) fprintf(stderr, "NCCL XML does not parse: %s\n%s", why, text);
  assert_non_null(root);
  if (text_out) *text_out = text;
  else free(text);
  return root;
}

/* ------------------------------------------------------------------ (a) H800, 8 GPUs, 8+1 NICs */

static void test_a_discovery(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  assert_int_equal(t->ngpus, 8);
  assert_int_equal(t->nnics, 9);
  assert_int_equal(t->nnuma, 2);
  assert_string_equal(t->hostname, "h800-node07");
  assert_true(t->from_file);
  static const char *bus[8] = {"0000:1a:00.0", "0000:1e:00.0", "0000:3c:00.0", "0000:40:00.0",
                               "0000:9c:00.0", "0000:a0:00.0", "0000:bc:00.0", "0000:c0:00.0"};
  for (int g = 0; g < 8; g++) {
    assert_string_equal(t->gpus[g].busid, bus[g]);
    assert_int_equal(t->gpus[g].numa, g < 4 ? 0 : 1);
    assert_int_equal(t->gpus[g].index, g);
    assert_int_equal(t->gpus[g].cuda_dev, g);
    assert_string_equal(t->gpus[g].model, "NVIDIA H800");
    assert_true(strncmp(t->gpus[g].uuid, "GPU-", 4) == 0);
  }
  int n0 = nic(t, "mlx5_0");
  assert_string_equal(t->nics[n0].netdev, "ibp27s0");
  assert_string_equal(t->nics[n0].busid, "0000:1b:00.0");
  assert_int_equal(t->nics[n0].kind, MPLANE_TOPO_NIC_RDMA);
  assert_int_equal(t->nics[n0].port, 1);
  assert_true(t->nics[n0].guid == 0xa088c20300d1002aULL);
  assert_int_equal(nic(t, "ibp27s0"), n0);  /* the netdev names the same NIC */
  assert_int_equal(nic(t, "mlx5_0:1"), n0); /* and so does device:port */
  assert_int_equal(mplane_topo_find_nic(t, "mlx5_9"), -1);
  assert_int_equal(mplane_topo_find_nic(t, "mlx5_0:x"), -1);
  /* distinct guids */
  for (int a = 0; a < t->nnics; a++)
    for (int b = 0; b < a; b++) assert_true(t->nics[a].guid != t->nics[b].guid);
  mplane_topo_free(t);
}

static void test_a_pairs_and_planes(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  for (int g = 0; g < 8; g++) {
    char name[16];
    snprintf(name, sizeof(name), "mlx5_%d", g);
    assert_pair(t, g, name, MPLANE_TOPO_LINK_PIX, g);
    assert_int_equal(t->nics[nic(t, name)].rail, 0);
    assert_int_equal(t->nics[nic(t, name)].plane_source, MPLANE_TOPO_PLANE_PCI);
    assert_true(t->nics[nic(t, name)].compute);
  }
  int st = nic(t, "mlx5_8");
  assert_false(t->nics[st].compute);
  assert_false(t->nics[st].excluded);
  assert_int_equal(t->nics[st].plane, -1);
  assert_int_equal(t->nics[st].rail, -1);
  assert_int_equal(t->nics[st].ngpus, 0);
  assert_int_equal(t->nplanes, 8);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_PCI);
  mplane_topo_free(t);
}

static void test_a_link_classes(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  assert_int_equal(mplane_topo_gpu_nic_link(t, 0, nic(t, "mlx5_0")), MPLANE_TOPO_LINK_PIX);
  assert_int_equal(mplane_topo_gpu_nic_link(t, 0, nic(t, "mlx5_1")), MPLANE_TOPO_LINK_PXB); /* same switch, other pair */
  assert_int_equal(mplane_topo_gpu_nic_link(t, 0, nic(t, "mlx5_2")), MPLANE_TOPO_LINK_NODE); /* other root complex */
  assert_int_equal(mplane_topo_gpu_nic_link(t, 0, nic(t, "mlx5_4")), MPLANE_TOPO_LINK_SYS);  /* other socket */
  assert_int_equal(mplane_topo_gpu_nic_link(t, 6, nic(t, "mlx5_8")), MPLANE_TOPO_LINK_PHB);  /* same root complex */
  assert_int_equal(mplane_topo_gpu_nic_link(t, 4, nic(t, "mlx5_8")), MPLANE_TOPO_LINK_NODE);
  assert_int_equal(mplane_topo_gpu_nic_link(t, 0, nic(t, "mlx5_8")), MPLANE_TOPO_LINK_SYS);
  assert_int_equal(mplane_topo_pci_link(t, -1, t->gpus[0].pci), MPLANE_TOPO_LINK_SYS);
  assert_string_equal(mplane_topo_link_name(MPLANE_TOPO_LINK_PXB), "PXB");
  assert_string_equal(mplane_topo_link_name(MPLANE_TOPO_LINK_NODE), "NODE");
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ (b) 8 GPUs, 4 NICs */

static void test_b_two_gpus_per_nic(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_B);
  assert_int_equal(t->ngpus, 8);
  assert_int_equal(t->nnics, 4);
  for (int g = 0; g < 8; g++) {
    char name[16];
    snprintf(name, sizeof(name), "mlx5_%d", g / 2);
    assert_pair(t, g, name, MPLANE_TOPO_LINK_PIX, g / 2);
  }
  for (int n = 0; n < 4; n++) {
    assert_int_equal(t->nics[n].ngpus, 2);
    assert_true(t->nics[n].compute);
  }
  assert_int_equal(mplane_topo_gpu_nic_link(t, 1, nic(t, "mlx5_1")), MPLANE_TOPO_LINK_NODE);
  assert_int_equal(mplane_topo_gpu_nic_link(t, 1, nic(t, "mlx5_3")), MPLANE_TOPO_LINK_SYS);
  assert_int_equal(t->nplanes, 4);
  assert_string_equal(t->gpus[0].uuid, ""); /* no NVML in this fixture */
  assert_string_equal(t->gpus[0].model, "GA100 [A100 SXM4 80GB]");
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ (c) PCIe A100, NIC on the CPU */

static void test_c_nic_on_cpu(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_C);
  assert_int_equal(t->ngpus, 8);
  assert_int_equal(t->nnics, 1);
  for (int g = 0; g < 8; g++) assert_pair(t, g, "mlx5_0", g < 4 ? MPLANE_TOPO_LINK_NODE : MPLANE_TOPO_LINK_SYS, 0);
  assert_int_equal(t->nics[0].ngpus, 8);
  assert_int_equal(t->nplanes, 1);
  /* GPUs sharing a switch are PIX to each other. */
  assert_int_equal(mplane_topo_pci_link(t, t->gpus[0].pci, t->gpus[1].pci), MPLANE_TOPO_LINK_PIX);
  assert_int_equal(mplane_topo_pci_link(t, t->gpus[0].pci, t->gpus[2].pci), MPLANE_TOPO_LINK_NODE);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ (d) no GPU, NUMA -1 */

static void test_d_no_gpu(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_D);
  assert_int_equal(t->ngpus, 0);
  assert_int_equal(t->nnics, 2);
  int e = nic(t, "ens1f0"), m = nic(t, "mlx5_0");
  assert_int_equal(nic(t, "ens2f0np0"), m);
  assert_int_equal(t->nics[e].kind, MPLANE_TOPO_NIC_ETHERNET);
  assert_int_equal(t->nics[m].kind, MPLANE_TOPO_NIC_RDMA);
  assert_int_equal(t->nics[e].numa, 0);
  assert_int_equal(t->nics[m].numa, -1); /* root complex with no NUMA affinity */
  /* Without GPUs every NIC is a compute NIC, planes in PCI order. */
  assert_true(t->nics[e].compute && t->nics[m].compute);
  assert_int_equal(t->nics[e].plane, 0);
  assert_int_equal(t->nics[m].plane, 1);
  assert_int_equal(mplane_topo_gpu_nic_pair(t, 0, NULL), -1);
  mplane_topo_free(t);
}

static const char empty_xml[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"
    "<topology version=\"2.0\">\n"
    "  <object type=\"Machine\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" "
    "allowed_cpuset=\"0x00000001\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" "
    "allowed_nodeset=\"0x00000001\" gp_index=\"1\">\n"
    "    <object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" "
    "nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"2\" local_memory=\"1073741824\"/>\n"
    "    <object type=\"PU\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" "
    "nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"3\"/>\n"
    "  </object>\n</topology>\n";

static char tmpdir[256];

static const char *write_tmp(const char *name, const char *text) {
  static char path[4][512];
  static int next;
  char *p = path[next++ % 4];
  snprintf(p, 512, "%s/%s", tmpdir, name);
  FILE *f = fopen(p, "w");
  assert_non_null(f);
  fputs(text, f);
  fclose(f);
  return p;
}

static void test_nothing_at_all(void **state) {
  (void)state;
  struct mplane_topo *t = load_opts(write_tmp("empty.xml", empty_xml), "", NULL);
  assert_int_equal(t->ngpus, 0);
  assert_int_equal(t->nnics, 0);
  assert_int_equal(t->nplanes, 0);
  char *s = capture(mplane_topo_print_table, t);
  assert_non_null(strstr(s, "no GPU and no NIC found"));
  free(s);
  s = capture(mplane_topo_print_picture, t);
  assert_non_null(strstr(s, "nothing to draw"));
  free(s);
  s = capture(mplane_topo_print_json, t);
  char why[128];
  assert_int_equal(json_check(s, why, sizeof(why)), 0);
  free(s);
  s = capture(mplane_topo_print_nccl_env, t);
  assert_non_null(strstr(s, "no NIC on a plane"));
  free(s);
  struct xt_node *root = nccl_tree(t, NULL);
  assert_string_equal(root->name, "system");
  assert_int_equal(root->nkids, 0);
  xt_free(root);
  /* a plugin device on such a node is a virtual NIC, on plane 0 (no GPU: every NIC computes) */
  struct mplane_dev_props p = {.name = "lo", .plane = 5};
  char err[512];
  assert_int_equal(mplane_topo_annotate_props(t, &p, 1, "", err, sizeof(err)), ncclSuccess);
  assert_int_equal(p.plane, 0);
  assert_int_equal(p.rail, 0);
  assert_true(p.guid != 0);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ bad input */

static void test_bad_files(void **state) {
  (void)state;
  struct mplane_topo *t = (void *)1;
  char err[2048];
  struct mplane_topo_options o = {.xml_path = "/nonexistent/node.xml", .xml_input = "MPLANE_TOPO_FILE"};
  assert_int_equal(mplane_topo_load(&o, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_null(t);
  assert_non_null(strstr(err, "MPLANE_TOPO_FILE='/nonexistent/node.xml' cannot be read"));
  assert_non_null(strstr(err, "No such file"));

  o.xml_path = write_tmp("garbage.xml", "this is not XML at all\n");
  assert_int_equal(mplane_topo_load(&o, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, o.xml_path));
  assert_non_null(strstr(err, "not an hwloc XML file"));

  /* cut in the middle of an element */
  char *a = slurp(fixture(FIX_A));
  assert_non_null(a);
  a[strlen(a) / 2] = '\0';
  o.xml_path = write_tmp("truncated.xml", a);
  free(a);
  o.xml_input = "--topo";
  assert_int_equal(mplane_topo_load(&o, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "--topo='"));
  assert_non_null(strstr(err, "not a valid hwloc XML topology"));
}

/* ------------------------------------------------------------------ MPLANE_PLANES */

static void expect_parse_error(const char *value, const char *why_part) {
  struct mplane_planes_spec spec;
  char why[256] = "";
  int rc = mplane_planes_parse(value, &spec, why, sizeof(why));
  if (rc == 0 || !strstr(why, why_part)) fprintf(stderr, "'%s': rc %d why '%s', expected '%s'\n", value, rc, why, why_part);
  assert_int_equal(rc, -1);
  assert_non_null(strstr(why, why_part));
}

static void test_planes_grammar(void **state) {
  (void)state;
  struct mplane_planes_spec spec;
  char why[256];
  assert_int_equal(mplane_planes_parse("", &spec, why, sizeof(why)), 0);
  assert_int_equal(spec.n, 0);
  assert_int_equal(mplane_planes_parse(NULL, &spec, why, sizeof(why)), 0);
  assert_int_equal(mplane_planes_parse(" mlx5_0 = 1 , eth0=0,mlx5_2:1=63 ", &spec, why, sizeof(why)), 0);
  assert_int_equal(spec.n, 3);
  assert_string_equal(spec.entry[0].nic, "mlx5_0");
  assert_int_equal(spec.entry[0].plane, 1);
  assert_string_equal(spec.entry[1].nic, "eth0");
  assert_string_equal(spec.entry[2].nic, "mlx5_2:1");
  assert_int_equal(spec.entry[2].plane, 63);
  expect_parse_error("mlx5_0", "has no '=plane'");
  expect_parse_error("=1", "names no NIC");
  expect_parse_error("mlx5_0=", "is not an integer from 0 to 63");
  expect_parse_error("mlx5_0=x", "is not an integer");
  expect_parse_error("mlx5_0=-1", "is not an integer");
  expect_parse_error("mlx5_0=64", "is not an integer from 0 to 63");
  expect_parse_error("mlx5_0=0,mlx5_0=1", "'mlx5_0' is given twice");
  assert_int_equal(mplane_planes_parse("mlx5_0=0,mlx5_1=0", &spec, why, sizeof(why)), 0); /* two rails of plane 0 */
  expect_parse_error("mlx5_0=0,", "empty entry");
  expect_parse_error("ml x5=0", "character (' ')");
  assert_int_equal(mplane_planes_parse("mlx5_0=0,mlx5_1=1", &spec, why, sizeof(why)), 0);
}

static void test_planes_in_config(void **state) {
  (void)state;
  struct mplane_config cfg;
  char err[512];
  setenv("MPLANE_PLANES", "mlx5_0=0,mlx5_0=1", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "MPLANE_PLANES='mlx5_0=0,mlx5_0=1' is not valid"));
  assert_non_null(strstr(err, "given twice"));
  setenv("MPLANE_PLANES", "mlx5_0=0,mlx5_1=1", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_string_equal(cfg.planes, "mlx5_0=0,mlx5_1=1");
  unsetenv("MPLANE_PLANES");
}

static void test_planes_from_config(void **state) {
  (void)state;
  struct mplane_topo *t = load_opts(fixture(FIX_A), "mlx5_3=0,ibp61s0=1", NULL);
  int n3 = nic(t, "mlx5_3"), n2 = nic(t, "mlx5_2");
  assert_int_equal(t->nics[n3].plane, 0);
  assert_int_equal(t->nics[n2].plane, 1);
  assert_int_equal(t->nics[n3].plane_source, MPLANE_TOPO_PLANE_CONFIG);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_CONFIG);
  assert_int_equal(t->nplanes, 2);
  /* the NICs it does not name are left out, and GPUs pair among the named ones */
  int n0 = nic(t, "mlx5_0");
  assert_true(t->nics[n0].excluded);
  assert_false(t->nics[n0].compute);
  assert_int_equal(t->nics[n0].plane, -1);
  assert_pair(t, 2, "mlx5_2", MPLANE_TOPO_LINK_PIX, 1);
  assert_pair(t, 3, "mlx5_3", MPLANE_TOPO_LINK_PIX, 0);
  enum mplane_topo_link l;
  assert_true(mplane_topo_gpu_nic_pair(t, 0, &l) >= 0);
  assert_int_equal(l, MPLANE_TOPO_LINK_NODE);
  assert_true(mplane_topo_gpu_nic_pair(t, 5, &l) >= 0);
  assert_int_equal(l, MPLANE_TOPO_LINK_SYS);
  char *s = capture(mplane_topo_print_table, t);
  char line[512];
  assert_true(line_with(s, "mlx5_0 ", "excluded", NULL, line, sizeof(line)));
  free(s);
  mplane_topo_free(t);
}

static void test_planes_config_errors(void **state) {
  (void)state;
  struct mplane_topo_options o = {.xml_path = fixture(FIX_A), .planes = "mlx5_0=0,mlx5_9=1"};
  struct mplane_topo *t = NULL;
  char err[2048];
  assert_int_equal(mplane_topo_load(&o, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_null(t);
  assert_non_null(strstr(err, "MPLANE_PLANES='mlx5_0=0,mlx5_9=1' names NIC 'mlx5_9', which this node does not have"));
  assert_non_null(strstr(err, "mlx5_0 (ibp27s0)")); /* the NICs it does have */
  o.planes = "mlx5_0=0,ibp27s0=1";
  assert_int_equal(mplane_topo_load(&o, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "names NIC mlx5_0 twice ('mlx5_0' and 'ibp27s0')"));
}

/* One fabric the subnets cannot tell (default IB prefixes everywhere): MPLANE_PLANES gives every NIC
 * plane 0, and they become its rails in NIC order. */
static void test_planes_config_one_plane(void **state) {
  (void)state;
  struct mplane_topo *t = load_opts(fixture(FIX_A), "mlx5_3=0,mlx5_2=0,mlx5_0=0", NULL);
  int n0 = nic(t, "mlx5_0"), n2 = nic(t, "mlx5_2"), n3 = nic(t, "mlx5_3");
  assert_int_equal(t->nics[n0].plane, 0);
  assert_int_equal(t->nics[n2].plane, 0);
  assert_int_equal(t->nics[n3].plane, 0);
  assert_true(n0 < n2 && n2 < n3);
  assert_int_equal(t->nics[n0].rail, 0);
  assert_int_equal(t->nics[n2].rail, 1);
  assert_int_equal(t->nics[n3].rail, 2);
  assert_int_equal(t->nplanes, 1);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ planes from the fabric */

static void test_planes_from_ib_subnets(void **state) {
  (void)state;
  /* Fixture (a) with a subnet manager per plane: mlx5_i on subnet fec0:0:0:(7-i). */
  char *a = slurp(fixture(FIX_A));
  assert_non_null(a);
  for (int i = 0; i < 8; i++) {
    char from[64], to[64];
    snprintf(from, sizeof(from), "fe80:0000:0000:0000:a088:c203:00d1:0%d2a", i);
    snprintf(to, sizeof(to), "fec0:0000:0000:%04x:a088:c203:00d1:0%d2a", 7 - i, i);
    char *p = strstr(a, from);
    assert_non_null(p);
    memcpy(p, to, strlen(to));
  }
  struct mplane_topo *t = load_opts(write_tmp("a-subnets.xml", a), NULL, NULL);
  free(a);
  for (int i = 0; i < 8; i++) {
    char name[16], sub[32];
    snprintf(name, sizeof(name), "mlx5_%d", i);
    snprintf(sub, sizeof(sub), "fec0:0000:0000:%04x", 7 - i);
    const struct mplane_topo_nic *n = &t->nics[nic(t, name)];
    assert_int_equal(n->plane, 7 - i);
    assert_int_equal(n->rail, 0);
    assert_int_equal(n->plane_source, MPLANE_TOPO_PLANE_FABRIC);
    assert_string_equal(n->subnet, sub);
  }
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
  assert_pair(t, 0, "mlx5_0", MPLANE_TOPO_LINK_PIX, 7);
  /* MPLANE_PLANES still wins */
  char err[512];
  assert_int_equal(mplane_topo_assign_planes(t, "mlx5_0=0", err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[nic(t, "mlx5_0")].plane, 0);
  mplane_topo_free(t);
}

static void test_planes_from_ip_subnets(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_D);
  int e = nic(t, "ens1f0"), m = nic(t, "mlx5_0");
  char err[512];
  /* 198.18.p.n: the plane is in the subnet, whatever the PCI order */
  mplane_topo_set_subnet(t, e, 2, ((uint64_t)0xc6120100 << 8) | 24, "198.18.1.0/24");
  mplane_topo_set_subnet(t, m, 2, ((uint64_t)0xc6120000 << 8) | 24, "198.18.0.0/24");
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[m].plane, 0);
  assert_int_equal(t->nics[e].plane, 1);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
  /* one subnet for both: one plane, the NICs its rails 0 and 1 (it was a plane each by PCI order, so
   * every connection between them was relayed) */
  mplane_topo_set_subnet(t, m, 2, ((uint64_t)0xc6120100 << 8) | 24, "198.18.1.0/24");
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[e].plane, 0);
  assert_int_equal(t->nics[m].plane, 0);
  assert_int_equal(t->nics[e].rail + t->nics[m].rail, 1);
  assert_int_equal(t->nplanes, 1);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
  /* two NICs on one subnet and a third on another: rails 0 and 1 of one plane */
  int v = mplane_topo_add_virtual_nic(t, "veth9");
  assert_true(v >= 0);
  mplane_topo_set_subnet(t, v, 2, ((uint64_t)0xc6120000 << 8) | 24, "198.18.0.0/24");
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[v].plane, 0);
  assert_int_equal(t->nics[v].rail, 0);
  assert_int_equal(t->nics[e].plane, 1);
  assert_int_equal(t->nics[m].plane, 1);
  assert_int_equal(t->nics[e].rail + t->nics[m].rail, 1); /* rails 0 and 1 */
  assert_int_equal(t->nplanes, 2);
  mplane_topo_free(t);
}

/* A port down in the node's files (hwloc's Port1State 1): the NIC is marked down. By PCI order it
 * keeps its plane (every compute NIC counts, down or not), so the NICs after it keep theirs; with
 * named subnets on the others it takes none and does not send them to PCI order. */
static void test_planes_port_down_in_files(void **state) {
  (void)state;
  char *a = slurp(fixture(FIX_A));
  assert_non_null(a);
  char *p = strstr(a, "fe80:0000:0000:0000:a088:c203:00d1:032a"); /* mlx5_3's GID 0 */
  assert_non_null(p);
  char *st = p;
  while (st > a && strncmp(st, "Port1State\" value=\"4\"", 21) != 0) st--;
  assert_true(st > a);
  st[19] = '1'; /* IB_PORT_DOWN */
  struct mplane_topo *t = load_opts(write_tmp("a-down.xml", a), NULL, NULL);
  int n3 = nic(t, "mlx5_3");
  assert_true(t->nics[n3].down);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_PCI);
  for (int i = 0; i < 8; i++) {
    char name[16];
    snprintf(name, sizeof(name), "mlx5_%d", i);
    assert_int_equal(t->nics[nic(t, name)].plane, i);
  }
  /* the others name their subnets (an SM per plane), the down port shows none */
  char err[512];
  for (int i = 0; i < 8; i++) {
    if (i == 3) continue;
    char name[16], text[32];
    snprintf(name, sizeof(name), "mlx5_%d", i);
    snprintf(text, sizeof(text), "fec0:0000:0000:%04x", i);
    mplane_topo_set_subnet(t, nic(t, name), MPLANE_SUBNET_IB, 0xfec0000000000000ull | (uint64_t)i, text);
  }
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
  assert_int_equal(t->nics[n3].plane, -1);
  assert_int_equal(t->nplanes, 7);
  free(a);
  mplane_topo_free(t);
}

static void test_gpu_node_virtual_nics_only(void **state) {
  (void)state;
  /* Fixture (c) with its NIC's OS devices gone (hwloc sees the PCI function, no netdev, no verbs
   * device): a GPU node whose network is veths only, as when the emulated fabric runs on it. */
  char *c = slurp(fixture(FIX_C));
  assert_non_null(c);
  for (char *p; (p = strstr(c, "osdev_type=\"2\"")) || (p = strstr(c, "osdev_type=\"3\""));) p[12] = '0';
  struct mplane_topo *t = load_opts(write_tmp("c-nonic.xml", c), NULL, NULL);
  free(c);
  assert_int_equal(t->ngpus, 8);
  assert_int_equal(t->nnics, 0);
  const char *names[4] = {"veth3", "veth1", "veth0", "veth2"};
  for (int i = 0; i < 4; i++) {
    int v = mplane_topo_add_virtual_nic(t, names[i]);
    assert_true(v >= 0);
    int p = names[i][4] - '0';
    char text[32];
    snprintf(text, sizeof(text), "198.18.%d.0/24", p);
    mplane_topo_set_subnet(t, v, 2, ((uint64_t)(0xc6120000u | (unsigned)p << 8) << 8) | 24, text);
  }
  mplane_topo_sort_nics(t);
  assert_string_equal(t->nics[0].name, "veth0");
  char err[512];
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  for (int i = 0; i < 4; i++) {
    char name[8];
    snprintf(name, sizeof(name), "veth%d", i);
    const struct mplane_topo_nic *n = &t->nics[nic(t, name)];
    assert_true(n->compute);
    assert_int_equal(n->plane, i);
    assert_int_equal(n->ngpus, 2); /* GPUs spread over them */
  }
  /* With a PCI NIC on the node, a veth carries no GPU's traffic. */
  mplane_topo_free(t);
  t = load(FIX_C);
  int v = mplane_topo_add_virtual_nic(t, "veth0");
  assert_int_equal(mplane_topo_assign_planes(t, NULL, err, sizeof(err)), ncclSuccess);
  assert_false(t->nics[v].compute);
  assert_int_equal(t->nics[v].ngpus, 0);
  assert_int_equal(t->nics[nic(t, "mlx5_0")].ngpus, 8);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ CUDA_VISIBLE_DEVICES */

static void test_cuda_visible(void **state) {
  (void)state;
  struct mplane_topo *t = load_opts(fixture(FIX_A), NULL, "2,3");
  for (int g = 0; g < 8; g++) assert_int_equal(t->gpus[g].cuda_dev, g == 2 ? 0 : g == 3 ? 1 : -1);
  /* planes are the node's, whatever this process sees */
  assert_pair(t, 0, "mlx5_0", MPLANE_TOPO_LINK_PIX, 0);
  assert_pair(t, 3, "mlx5_3", MPLANE_TOPO_LINK_PIX, 3);
  assert_int_equal(t->nplanes, 8);
  char *s = capture(mplane_topo_print_table, t);
  char line[512], tok[16][64];
  assert_true(line_with(s, "0000:1a:00.0", NULL, NULL, line, sizeof(line)));
  assert_int_equal(tokens(line, tok, 16) >= 2, 1);
  assert_string_equal(tok[1], "-");
  assert_true(line_with(s, "0000:40:00.0", NULL, NULL, line, sizeof(line)));
  tokens(line, tok, 16);
  assert_string_equal(tok[1], "1");
  assert_non_null(strstr(s, "CUDA_VISIBLE_DEVICES=2,3"));
  free(s);

  mplane_topo_apply_cuda_visible(t, "GPU-3f0c1a52-8d4e-4b7a-9f21-1a2b3c4d0005,GPU-3f0c1a52-8d4e-4b7a-9f21-1a2b3c4d0001");
  assert_int_equal(t->gpus[5].cuda_dev, 0);
  assert_int_equal(t->gpus[1].cuda_dev, 1);
  assert_int_equal(t->gpus[0].cuda_dev, -1);
  mplane_topo_apply_cuda_visible(t, "GPU-3f0c1a52-8d4e-4b7a-9f21-1a2b3c4d0006"); /* a UUID prefix works too */
  assert_int_equal(t->gpus[6].cuda_dev, 0);
  mplane_topo_apply_cuda_visible(t, "");
  for (int g = 0; g < 8; g++) assert_int_equal(t->gpus[g].cuda_dev, -1);
  mplane_topo_apply_cuda_visible(t, "1,foo,2"); /* CUDA stops at the first entry naming no GPU */
  assert_int_equal(t->gpus[1].cuda_dev, 0);
  assert_int_equal(t->gpus[2].cuda_dev, -1);
  mplane_topo_apply_cuda_visible(t, "4,4");
  assert_int_equal(t->gpus[4].cuda_dev, 0);
  mplane_topo_apply_cuda_visible(t, "9");
  for (int g = 0; g < 8; g++) assert_int_equal(t->gpus[g].cuda_dev, -1);
  mplane_topo_apply_cuda_visible(t, NULL);
  for (int g = 0; g < 8; g++) assert_int_equal(t->gpus[g].cuda_dev, g);
  mplane_topo_free(t);

  t = load_opts(fixture(FIX_B), NULL, "GPU-0000");
  for (int g = 0; g < 8; g++) assert_int_equal(t->gpus[g].cuda_dev, -2); /* no UUIDs known: unknown, not guessed */
  s = capture(mplane_topo_print_table, t);
  assert_true(line_with(s, "0000:13:00.0", NULL, NULL, line, sizeof(line)));
  tokens(line, tok, 16);
  assert_string_equal(tok[1], "?");
  free(s);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ sysfs fallback */

static void test_sysfs_fallback(void **state) {
  (void)state;
  char root[512];
  snprintf(root, sizeof(root), "%s/sysroot", tmpdir);
  mkdir(root, 0755);
  char rel[512];
  snprintf(rel, sizeof(rel), "sys/bus/pci/x");
  sysfs_mkfile(root, rel, "");
  /* switch 0000:11:00.0 below root port 0000:10:01.0 carries a GPU and an IB NIC; a second GPU
   * sits on another root complex of NUMA node 1 */
  const char *rp = "pci0000:10/0000:10:01.0", *up = "pci0000:10/0000:10:01.0/0000:11:00.0";
  sysfs_mkpci(root, rp, "0x060400\n", "0x8086\n", "0\n");
  sysfs_mkpci(root, up, "0x060400\n", "0x1000\n", "0\n");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:00.0", "0x060400\n", "0x1000\n", "0\n");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:01.0", "0x060400\n", "0x1000\n", "0\n");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:00.0/0000:13:00.0", "0x030200\n", "0x10de\n", "0\n");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:01.0/0000:14:00.0", "0x020700\n", "0x15b3\n", "0\n");
  sysfs_mkfile(root, "sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:01.0/0000:14:00.0/infiniband/mlx5_0/x", "");
  sysfs_mkfile(root, "sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0/0000:12:01.0/0000:14:00.0/net/ibp20s0/x", "");
  sysfs_mkfile(root, "sys/class/infiniband/mlx5_0/node_guid", "a088:c203:00aa:bb01\n");
  sysfs_mkfile(root, "sys/class/infiniband/mlx5_0/ports/1/gids/0", "fec0:0000:0000:0003:a088:c203:00aa:bb01\n");
  sysfs_mkfile(root, "sys/class/infiniband/mlx5_0/ports/1/rate", "400 Gb/sec (4X NDR)\n");
  sysfs_mkfile(root, "sys/class/net/ibp20s0/address", "00:00:10:29:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:aa:bb:01\n");
  sysfs_mkpci(root, "pci0000:90/0000:90:01.0", "0x060400\n", "0x8086\n", "1\n");
  sysfs_mkpci(root, "pci0000:90/0000:90:01.0/0000:91:00.0", "0x030200\n", "0x10de\n", "1\n");
  sysfs_mkpci(root, "pci0000:90/0000:90:02.0", "0x060400\n", "0x8086\n", "1\n");
  sysfs_mkpci(root, "pci0000:90/0000:90:02.0/0000:92:00.0", "0x010802\n", "0x144d\n", "1\n"); /* NVMe: ignored */
  sysfs_mkfile(root, "sys/devices/system/node/node0/cpulist", "0-3\n");
  sysfs_mkfile(root, "sys/devices/system/node/node1/cpulist", "4-7,40\n");
  sysfs_mkfile(root, "sys/devices/system/cpu/online", "0-7,40\n");
  sysfs_mkfile(root, "proc/sys/kernel/hostname", "fake-node\n");

  /* The fallback says so once at INFO (MPLANE_DEBUG=1 sends INFO to stderr): catch stderr. */
  char errpath[600];
  snprintf(errpath, sizeof(errpath), "%s/stderr.txt", tmpdir);
  fflush(stderr);
  int saved = dup(2);
  int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  assert_true(fd >= 0);
  dup2(fd, 2);
  close(fd);
  setenv("MPLANE_DEBUG", "1", 1);
  struct mplane_topo_options o = {.sysfs_root = root, .force_sysfs = 1};
  struct mplane_topo *t = NULL, *t2 = NULL;
  char err[512];
  ncclResult_t r1 = mplane_topo_load(&o, &t, err, sizeof(err));
  ncclResult_t r2 = mplane_topo_load(&o, &t2, err, sizeof(err));
  fflush(stderr);
  dup2(saved, 2);
  close(saved);
  unsetenv("MPLANE_DEBUG");
  assert_int_equal(r1, ncclSuccess);
  assert_int_equal(r2, ncclSuccess);
  char *said = slurp(errpath);
  assert_non_null(said);
  char *first = strstr(said, "from sysfs instead");
  assert_non_null(first);
  assert_null(strstr(first + 1, "from sysfs instead")); /* once */
  free(said);
  mplane_topo_free(t2);

  assert_string_equal(t->hostname, "fake-node");
  assert_non_null(strstr(t->source, "sysfs"));
  assert_int_equal(t->ngpus, 2);
  assert_string_equal(t->gpus[0].busid, "0000:13:00.0");
  assert_string_equal(t->gpus[1].busid, "0000:91:00.0");
  assert_int_equal(t->gpus[1].numa, 1);
  assert_int_equal(t->nnics, 1);
  assert_string_equal(t->nics[0].name, "mlx5_0");
  assert_string_equal(t->nics[0].netdev, "ibp20s0");
  assert_true(t->nics[0].guid == 0xa088c20300aabb01ULL);
  assert_int_equal(t->nics[0].speed_mbps, 400000);
  assert_string_equal(t->nics[0].subnet, "fec0:0000:0000:0003");
  assert_pair(t, 0, "mlx5_0", MPLANE_TOPO_LINK_PIX, 0);
  assert_pair(t, 1, "mlx5_0", MPLANE_TOPO_LINK_SYS, 0);
  assert_int_equal(t->nnuma, 2);
  assert_string_equal(t->numa[1].affinity, "00000100,000000f0");
  assert_int_equal(mplane_topo_find_pci(t, "0000:92:00.0"), -1); /* only what mplane needs */
  /* the NCCL XML from it keeps NCCL's shape: switch upstream port, then GPU and NIC */
  struct xt_node *root_node = nccl_tree(t, NULL);
  struct xt_node *gpu = xt_find(root_node, "pci", "busid", "0000:13:00.0");
  assert_non_null(gpu);
  assert_string_equal(xt_attr(gpu->parent, "busid"), "0000:11:00.0");
  assert_string_equal(gpu->parent->parent->name, "cpu");
  struct xt_node *net = xt_find(root_node, "net", "name", "mlx5_0");
  assert_non_null(net);
  assert_string_equal(xt_attr(net->parent->parent, "busid"), "0000:14:00.0");
  assert_string_equal(xt_attr(net->parent->parent->parent, "busid"), "0000:11:00.0");
  assert_string_equal(xt_attr(net, "speed"), "400000");
  xt_free(root_node);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ annotate the plugin's devices */

/* IB ports that all keep the default prefix fe80:: (the fixture's): the node's files cannot tell one
 * fabric from a plane per NIC, and by PCI order every NIC would be a plane. The transport's subnet
 * probe decides it: one subnet for all is one plane, every NIC a rail of it (nothing relayed); two
 * subnets are two planes, numbered by the transport's subnet ids. */
static void test_annotate_probed_subnets(void **state) {
  (void)state;
  for (int two = 0; two <= 1; two++) {
    struct mplane_topo *t = load(FIX_A);
    struct mplane_dev_props p[8];
    memset(p, 0, sizeof(p));
    for (int d = 0; d < 8; d++) {
      snprintf(p[d].name, sizeof(p[d].name), "mlx5_%d:1", d);
      p[d].plane = d;
      p[d].guid = 100 + (uint64_t)d;
      p[d].subnet_kind = MPLANE_SUBNET_PROBED;
      p[d].subnet_key = two ? (uint64_t)(d % 2) : 0;
      snprintf(p[d].subnet, sizeof(p[d].subnet), "fe80:: subnet %d (probed)", (int)p[d].subnet_key);
    }
    char err[1024];
    assert_int_equal(mplane_topo_annotate_props(t, p, 8, NULL, err, sizeof(err)), ncclSuccess);
    for (int d = 0; d < 8; d++) {
      assert_int_equal(p[d].plane, two ? d % 2 : 0);
      assert_int_equal(p[d].rail, two ? d / 2 : d);
    }
    assert_int_equal(t->nplanes, two ? 2 : 1);
    assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
    mplane_topo_free(t);
  }
  /* a subnet the node's files do show wins over the transport's */
  struct mplane_topo *t = load(FIX_A);
  int n1 = nic(t, "mlx5_1");
  mplane_topo_set_subnet(t, n1, 1, 0xfec0000000000001ull, "fec0:0000:0000:0001");
  struct mplane_dev_props p[8];
  memset(p, 0, sizeof(p));
  for (int d = 0; d < 8; d++) {
    snprintf(p[d].name, sizeof(p[d].name), "mlx5_%d:1", d);
    p[d].subnet_kind = MPLANE_SUBNET_PROBED;
  }
  char err[1024];
  assert_int_equal(mplane_topo_annotate_props(t, p, 8, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nplanes, 2);
  assert_int_equal(p[1].plane, 0); /* kind 1 sorts before the transport's kind 4 */
  assert_int_equal(p[0].plane, 1);
  mplane_topo_free(t);
}

/* A port down on a node whose transport numbers the subnets it found: the NIC it reports no port of
 * neither takes a plane nor sends the others to PCI order, and theirs keep the transport's numbers
 * (the ones its peers give them); a RoCE NIC's IP subnet (a hint) gives way to the probe's. */
static void test_annotate_port_down(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  struct mplane_dev_props p[8];
  memset(p, 0, sizeof(p));
  int np = 0;
  for (int d = 0; d < 8; d++) {
    if (d == 3) continue; /* mlx5_3 is down: no device */
    snprintf(p[np].name, sizeof(p[np].name), "mlx5_%d:1", d);
    p[np].subnet_kind = MPLANE_SUBNET_PROBED;
    p[np].subnet_key = (uint64_t)d;
    np++;
  }
  int n5 = nic(t, "mlx5_5");
  mplane_topo_set_subnet(t, n5, MPLANE_SUBNET_IPV4, ((uint64_t)0x0a050000 << 8) | 31, "10.5.0.0/31");
  char err[1024];
  assert_int_equal(mplane_topo_annotate_props(t, p, np, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_FABRIC);
  for (int i = 0; i < np; i++) assert_int_equal(p[i].plane, i < 3 ? i : i + 1);
  assert_int_equal(t->nics[nic(t, "mlx5_3")].plane, -1);
  assert_true(t->nics[nic(t, "mlx5_3")].down);
  assert_int_equal(t->nplanes, 7);
  mplane_topo_free(t);
}

static void test_annotate_props(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  struct mplane_dev_props p[5];
  memset(p, 0, sizeof(p));
  const char *names[5] = {"mlx5_0:1", "mlx5_5:1", "lo", "ibp31s0", "storage0"};
  for (int d = 0; d < 5; d++) {
    snprintf(p[d].name, sizeof(p[d].name), "%s", names[d]);
    p[d].plane = d; /* the transport's guess */
    p[d].guid = 7;  /* one guid for all: must become one per NIC */
    p[d].speed_mbps = 400000;
    p[d].port = 1;
  }
  snprintf(p[4].pci_path, sizeof(p[4].pci_path), "/sys/devices/pci0000:b7/0000:b7:02.0/0000:c2:00.0");
  char err[1024];
  assert_int_equal(mplane_topo_annotate_props(t, p, 5, NULL, err, sizeof(err)), ncclSuccess);
  assert_int_equal(p[0].plane, 0);
  assert_int_equal(p[0].rail, 0);
  assert_int_equal(p[1].plane, 5);
  assert_int_equal(p[2].plane, -1); /* lo: no PCI, no GPU pairs with it on a GPU node */
  assert_int_equal(p[2].rail, -1);
  assert_int_equal(p[3].plane, 1); /* the netdev of mlx5_1 */
  assert_int_equal(p[4].plane, -1); /* found by its PCI path: the storage NIC */
  for (int a = 0; a < 5; a++)
    for (int b = 0; b < a; b++) assert_true(p[a].guid != p[b].guid);
  assert_true(p[0].guid == 0xa088c20300d1002aULL);
  assert_string_equal(p[0].pci_path, ""); /* a topology from a file names no path on this machine */
  /* where a connection relayed by a NIC stages GPU buffers: the GPU paired with it (GPU 0 with
   * mlx5_0, PIX); a NIC no GPU pairs with names none */
  assert_string_equal(p[0].near_gpu, "0000:1a:00.0");
  assert_string_equal(p[4].near_gpu, "");
  int n0 = nic(t, "mlx5_0");
  assert_int_equal(t->nics[n0].dev, 0);
  assert_string_equal(t->nics[n0].name, "mlx5_0:1"); /* the name NCCL will look up */
  assert_int_equal(t->nics[n0].speed_mbps, 400000);
  int lo = nic(t, "lo");
  assert_int_equal(t->nics[lo].kind, MPLANE_TOPO_NIC_VIRTUAL);
  assert_int_equal(t->nics[lo].dev, 2);

  struct xt_node *root = nccl_tree(t, NULL);
  struct xt_node *net = xt_find(root, "net", "name", "mlx5_0:1");
  assert_non_null(net);
  assert_string_equal(xt_attr(net, "dev"), "0");
  assert_string_equal(xt_attr(net, "speed"), "400000");
  assert_string_equal(xt_attr(net, "plane"), "0");
  assert_string_equal(xt_attr(net, "guid"), "0xa088c20300d1002a");
  struct xt_node *lonet = xt_find(root, "net", "name", "lo");
  assert_non_null(lonet);
  char guid[32];
  snprintf(guid, sizeof(guid), "0x%llx", (unsigned long long)p[2].guid);
  assert_string_equal(xt_attr(lonet, "guid"), guid); /* what getProperties reports */
  assert_string_equal(lonet->parent->name, "nic");
  assert_string_equal(lonet->parent->parent->name, "cpu"); /* virtual NICs hang off the first CPU */
  assert_string_equal(xt_attr(lonet->parent->parent, "numaid"), "0");
  assert_null(xt_attr(lonet, "plane"));
  /* dev numbers stay unique: the plugin's, then the NICs it does not drive */
  char seen[64] = {0};
  static const char *nets[9] = {"mlx5_0:1", "ibp31s0", "mlx5_2", "mlx5_3", "mlx5_4",
                                "mlx5_5:1", "mlx5_6",  "mlx5_7", "storage0"};
  for (int i = 0; i < 9; i++) {
    struct xt_node *n = xt_find(root, "net", "name", nets[i]);
    assert_non_null(n);
    int dev = atoi(xt_attr(n, "dev"));
    assert_true(dev >= 0 && dev < 64);
    assert_false(seen[dev]);
    seen[dev] = 1;
  }
  xt_free(root);

  /* MPLANE_PLANES naming a plugin-only device (lo) works once the device joined */
  assert_int_equal(mplane_topo_annotate_props(t, p, 5, "lo=3,mlx5_0=0", err, sizeof(err)), ncclSuccess);
  assert_int_equal(p[2].plane, 3);
  assert_int_equal(p[0].plane, 0);
  assert_int_equal(p[1].plane, -1);
  assert_int_equal(mplane_topo_annotate_props(t, p, 5, "veth7=0", err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "names NIC 'veth7'"));
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ NCCL topology XML */

static void test_nccl_xml_a(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  char *text;
  struct xt_node *root = nccl_tree(t, &text);
  assert_null(strstr(text, "<?xml"));
  free(text);
  assert_string_equal(root->name, "system");
  assert_string_equal(xt_attr(root, "version"), "1");
  assert_int_equal(root->nkids, 2);
  for (int c = 0; c < 2; c++) {
    assert_string_equal(root->kids[c]->name, "cpu");
    char id[4];
    snprintf(id, sizeof(id), "%d", c);
    assert_string_equal(xt_attr(root->kids[c], "numaid"), id);
    assert_string_equal(xt_attr(root->kids[c], "arch"), "x86_64");
    assert_string_equal(xt_attr(root->kids[c], "vendor"), "GenuineIntel");
    assert_string_equal(xt_attr(root->kids[c], "familyid"), "6");
    assert_string_equal(xt_attr(root->kids[c], "modelid"), "143");
  }
  assert_string_equal(xt_attr(root->kids[0], "affinity"), "000000ff");
  assert_string_equal(xt_attr(root->kids[1], "affinity"), "0000ff00");
  /* every GPU and its NIC under the same switch node, that switch under the top switch, under its CPU */
  for (int g = 0; g < 8; g++) {
    struct xt_node *gpu = xt_find(root, "pci", "busid", t->gpus[g].busid);
    assert_non_null(gpu);
    assert_true(strncmp(xt_attr(gpu, "class"), "0x03", 4) == 0);
    assert_string_equal(xt_attr(gpu, "vendor"), "0x10de");
    assert_int_equal(gpu->nkids, 0); /* NCCL adds <gpu> from NVML itself */
    char name[16];
    snprintf(name, sizeof(name), "mlx5_%d", g);
    struct xt_node *net = xt_find(root, "net", "name", name);
    assert_non_null(net);
    struct xt_node *nicpci = net->parent->parent;
    assert_string_equal(net->parent->name, "nic");
    assert_string_equal(nicpci->name, "pci");
    assert_true(strncmp(xt_attr(nicpci, "class"), "0x02", 4) == 0);
    assert_ptr_equal(nicpci->parent, gpu->parent);
    struct xt_node *sw = gpu->parent, *top = sw->parent;
    assert_string_equal(xt_attr(sw, "class"), "0x060400");
    assert_string_equal(top->name, "pci");
    assert_string_equal(xt_attr(top, "class"), "0x060400");
    assert_string_equal(top->parent->name, "cpu");
    assert_string_equal(xt_attr(top->parent, "numaid"), g < 4 ? "0" : "1");
    char plane[8];
    snprintf(plane, sizeof(plane), "%d", g);
    assert_string_equal(xt_attr(net, "plane"), plane);
    assert_string_equal(xt_attr(net, "rail"), "0");
    assert_string_equal(xt_attr(net, "port"), "1");
    assert_non_null(xt_attr(net, "guid"));
    assert_non_null(xt_attr(net, "dev"));
  }
  /* the top switches NCCL would see: 0000:16, 0000:38 (NUMA 0), 0000:98, 0000:b8 (NUMA 1) */
  assert_string_equal(xt_attr(root->kids[0]->kids[0], "busid"), "0000:16:00.0");
  assert_string_equal(xt_attr(root->kids[0]->kids[1], "busid"), "0000:38:00.0");
  assert_string_equal(xt_attr(xt_find(root, "pci", "busid", "0000:1a:00.0")->parent, "busid"), "0000:18:00.0");
  /* the storage NIC: straight under CPU 1 (its root port is not a switch), on no plane */
  struct xt_node *st = xt_find(root, "net", "name", "mlx5_8");
  assert_non_null(st);
  assert_null(xt_attr(st, "plane"));
  assert_null(xt_attr(st, "rail"));
  assert_string_equal(xt_attr(st->parent->parent, "busid"), "0000:c2:00.0");
  assert_string_equal(st->parent->parent->parent->name, "cpu");
  assert_string_equal(xt_attr(st->parent->parent->parent, "numaid"), "1");
  assert_int_equal(xt_count(root, "net"), 9);
  assert_int_equal(xt_count(root, "nic"), 9);
  assert_int_equal(xt_count(root, "cpu"), 2);
  /* nothing NCCL skips: no root port, no downstream port */
  assert_null(xt_find(root, "pci", "busid", "0000:15:01.0"));
  assert_null(xt_find(root, "pci", "busid", "0000:17:00.0"));
  assert_null(xt_find(root, "pci", "busid", "0000:19:00.0"));
  xt_free(root);
  mplane_topo_free(t);
}

static void test_nccl_xml_bcd(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_B);
  struct xt_node *root = nccl_tree(t, NULL);
  for (int g = 0; g < 8; g++) {
    struct xt_node *gpu = xt_find(root, "pci", "busid", t->gpus[g].busid);
    char name[16];
    snprintf(name, sizeof(name), "mlx5_%d", g / 2);
    struct xt_node *net = xt_find(root, "net", "name", name);
    assert_non_null(gpu);
    assert_non_null(net);
    assert_ptr_equal(gpu->parent, net->parent->parent->parent); /* one switch: GPU pair and NIC */
  }
  xt_free(root);
  mplane_topo_free(t);

  t = load(FIX_C);
  root = nccl_tree(t, NULL);
  struct xt_node *net = xt_find(root, "net", "name", "mlx5_0");
  assert_non_null(net);
  assert_string_equal(xt_attr(net->parent->parent, "busid"), "0000:61:00.0");
  assert_string_equal(net->parent->parent->parent->name, "cpu"); /* NIC on the CPU */
  assert_string_equal(xt_attr(net->parent->parent->parent, "numaid"), "0");
  assert_string_equal(xt_attr(net, "plane"), "0");
  assert_string_equal(xt_attr(root->kids[1], "vendor"), "AuthenticAMD");
  xt_free(root);
  mplane_topo_free(t);

  t = load(FIX_D);
  root = nccl_tree(t, NULL);
  struct xt_node *cx6 = xt_find(root, "net", "name", "mlx5_0");
  assert_non_null(cx6);
  assert_string_equal(xt_attr(cx6->parent->parent->parent, "numaid"), "-1"); /* NUMA -1 */
  assert_non_null(xt_attr(cx6->parent->parent->parent, "affinity"));       /* the whole machine */
  struct xt_node *e810 = xt_find(root, "net", "name", "ens1f0");
  assert_string_equal(xt_attr(e810->parent->parent->parent, "numaid"), "0");
  assert_string_equal(xt_attr(e810, "port"), "0");
  assert_int_equal(xt_count(root, "pci"), 2);
  xt_free(root);
  mplane_topo_free(t);
}

static void test_nccl_xml_memfd(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_B);
  char path[64];
  assert_int_equal(mplane_topo_nccl_xml_memfd(t, path, sizeof(path)), ncclSuccess);
  assert_true(strncmp(path, "/proc/self/fd/", 14) == 0);
  char *text = slurp(path);
  assert_non_null(text);
  char why[256];
  struct xt_node *root = xt_parse(text, why, sizeof(why));
  assert_non_null(root);
  assert_int_equal(xt_count(root, "net"), 4);
  xt_free(root);
  free(text);
  /* sealed: nobody rewrites it under NCCL */
  int fd = atoi(path + 14);
  assert_int_equal(write(fd, "x", 1), -1);
  assert_int_equal(errno, EPERM);
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ reports */

static void check_gpu_row(const char *table, int g, const char *cuda, const char *busid, const char *numa,
                          const char *nicname, const char *link, const char *plane) {
  char line[512], tok[16][64];
  assert_true(line_with(table, busid, NULL, NULL, line, sizeof(line)));
  int n = tokens(line, tok, 16);
  char gs[8];
  snprintf(gs, sizeof(gs), "%d", g);
  assert_true(n >= 7);
  assert_string_equal(tok[0], gs);
  assert_string_equal(tok[1], cuda);
  assert_string_equal(tok[2], busid);
  assert_string_equal(tok[3], numa);
  assert_string_equal(tok[n - 3], nicname);
  assert_string_equal(tok[n - 2], link);
  assert_string_equal(tok[n - 1], plane);
}

static void check_nic_row(const char *table, const char *name, const char *kind, const char *busid, const char *numa,
                          const char *role, const char *gpus, const char *plane, const char *rail) {
  char line[512], tok[16][64], key[80];
  snprintf(key, sizeof(key), "%s ", name);
  assert_true(line_with(table, key, kind, busid, line, sizeof(line)));
  int n = tokens(line, tok, 16);
  assert_true(n >= 9);
  assert_string_equal(tok[0], name);
  assert_string_equal(tok[1], kind);
  assert_string_equal(tok[3], busid);
  assert_string_equal(tok[4], numa);
  assert_string_equal(tok[5], role);
  assert_string_equal(tok[6], gpus);
  assert_string_equal(tok[7], plane);
  assert_string_equal(tok[8], rail);
}

static void test_reports_a(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_A);
  char *s = capture(mplane_topo_print_table, t);
  assert_non_null(strstr(s, "8 GPUs, 9 NICs (8 compute, 1 other), 2 NUMA nodes; 8 planes from PCI order"));
  assert_non_null(strstr(s, "RDMA NICs: 9"));
  check_gpu_row(s, 0, "0", "0000:1a:00.0", "0", "mlx5_0", "PIX", "0");
  check_gpu_row(s, 5, "5", "0000:a0:00.0", "1", "mlx5_5", "PIX", "5");
  check_nic_row(s, "mlx5_0", "rdma", "0000:1b:00.0", "0", "compute", "0", "0", "0");
  check_nic_row(s, "mlx5_7", "rdma", "0000:c1:00.0", "1", "compute", "7", "7", "0");
  check_nic_row(s, "mlx5_8", "rdma", "0000:c2:00.0", "1", "storage/front-end", "-", "-", "-");
  free(s);
  s = capture(mplane_topo_print_picture, t);
  int lines = 0;
  for (char *p = s; *p; p++) lines += *p == '\n';
  assert_true(lines <= 24); /* one screen */
  assert_true(line_with(s, "GPU0 ", "--PIX-->", "mlx5_0 ==== plane 0", NULL, 0));
  assert_true(line_with(s, "GPU7 ", "--PIX-->", "mlx5_7 ==== plane 7", NULL, 0));
  assert_true(line_with(s, "mlx5_8", "storage/front-end: on no plane", NULL, NULL, 0));
  assert_true(line_with(s, "switch 0000:16:00.0", NULL, NULL, NULL, 0));
  assert_true(line_with(s, "host bridge 0000:b7", NULL, NULL, NULL, 0));
  assert_true(strstr(s, "NUMA 0") < strstr(s, "NUMA 1"));
  free(s);
  s = capture(mplane_topo_print_json, t);
  char why[128];
  if (json_check(s, why, sizeof(why))) fprintf(stderr, "%s\n%s", why, s);
  assert_int_equal(json_check(s, why, sizeof(why)), 0);
  assert_non_null(strstr(s, "\"busid\": \"0000:1a:00.0\", \"numa\": 0, \"model\": \"NVIDIA H800\""));
  assert_non_null(strstr(s, "\"nic\": \"mlx5_0\", \"link\": \"PIX\", \"plane\": 0}"));
  assert_non_null(strstr(s, "\"role\": \"storage/front-end\", \"gpus\": [], \"plane\": null"));
  assert_non_null(strstr(s, "\"planes\": 8"));
  free(s);
  s = capture(mplane_topo_print_nccl_env, t);
  assert_true(line_with(s, "export NCCL_CROSS_NIC=0", "# ", "share no switch", NULL, 0));
  assert_true(line_with(s, "export NCCL_PXN_DISABLE=0", "# ", NULL, NULL, 0));
  assert_true(line_with(s, "export NCCL_P2P_PXN_LEVEL=2", "# ", NULL, NULL, 0));
  assert_true(line_with(s, "export NCCL_NET_PLUGIN=mplane", "# ", NULL, NULL, 0));
  assert_true(line_with(s, "export NCCL_NET_GDR_LEVEL=PXB", "# ", NULL, NULL, 0));
  assert_non_null(strstr(s, "export MPLANE_PLANES=mlx5_0=0,mlx5_1=1,mlx5_2=2,mlx5_3=3,mlx5_4=4,mlx5_5=5,mlx5_6=6,"
                            "mlx5_7=7\n"));
  assert_non_null(strstr(s, "NCCL_IB_HCA='=mlx5_0:1:0:0,"));
  assert_null(strstr(s, "mlx5_8")); /* the storage NIC carries no job traffic */
  free(s);
  mplane_topo_free(t);
}

static void test_reports_bcd(void **state) {
  (void)state;
  struct mplane_topo *t = load(FIX_B);
  char *s = capture(mplane_topo_print_table, t);
  check_gpu_row(s, 1, "1", "0000:14:00.0", "0", "mlx5_0", "PIX", "0");
  check_gpu_row(s, 6, "6", "0000:a3:00.0", "1", "mlx5_3", "PIX", "3");
  check_nic_row(s, "mlx5_2", "rdma", "0000:95:00.0", "1", "compute", "4-5", "2", "0");
  free(s);
  s = capture(mplane_topo_print_picture, t);
  assert_true(line_with(s, "GPU1 ", "--PIX-->", "mlx5_0 ==== plane 0", NULL, 0));
  free(s);
  s = capture(mplane_topo_print_nccl_env, t);
  assert_true(line_with(s, "export NCCL_CROSS_NIC=0", "the 4 planes", NULL, NULL, 0));
  free(s);
  mplane_topo_free(t);

  t = load(FIX_C);
  s = capture(mplane_topo_print_table, t);
  check_gpu_row(s, 0, "0", "0000:23:00.0", "0", "mlx5_0", "NODE", "0");
  check_gpu_row(s, 7, "7", "0000:c4:00.0", "1", "mlx5_0", "SYS", "0");
  check_nic_row(s, "mlx5_0", "rdma", "0000:61:00.0", "0", "compute", "0-7", "0", "0");
  free(s);
  s = capture(mplane_topo_print_picture, t);
  assert_true(line_with(s, "GPU4 ", "--SYS-->", "mlx5_0 ==== plane 0", NULL, 0));
  assert_true(line_with(s, "host bridge 0000:60", NULL, NULL, NULL, 0));
  assert_true(line_with(s, "mlx5_0 0000:61:00.0", "==== plane 0", "(GPUs 0-7)", NULL, 0));
  free(s);
  s = capture(mplane_topo_print_nccl_env, t);
  assert_null(strstr(s, "export NCCL_CROSS_NIC"));
  assert_non_null(strstr(s, "# one plane"));
  assert_non_null(strstr(s, "pairs are as far as SYS"));
  assert_null(strstr(s, "NCCL_NET_GDR_LEVEL="));
  free(s);
  mplane_topo_free(t);

  t = load(FIX_D);
  s = capture(mplane_topo_print_table, t);
  assert_non_null(strstr(s, "0 GPUs, 2 NICs"));
  assert_non_null(strstr(s, "GPUs: none"));
  assert_null(strstr(s, "PCI bus id   NUMA model")); /* no GPU table */
  check_nic_row(s, "ens1f0", "ethernet", "0000:17:00.0", "0", "compute", "-", "0", "0");
  check_nic_row(s, "mlx5_0", "rdma", "0000:ca:00.0", "-", "compute", "-", "1", "0");
  free(s);
  s = capture(mplane_topo_print_picture, t);
  assert_non_null(strstr(s, "NUMA ? (no affinity)"));
  assert_true(line_with(s, "mlx5_0", "==== plane 1", NULL, NULL, 0));
  free(s);
  s = capture(mplane_topo_print_json, t);
  char why[128];
  assert_int_equal(json_check(s, why, sizeof(why)), 0);
  assert_non_null(strstr(s, "\"gpus\": [],"));
  assert_non_null(strstr(s, "\"numa\": null"));
  free(s);
  s = capture(mplane_topo_print_nccl_env, t);
  assert_non_null(strstr(s, "no GPU here"));
  free(s);
  mplane_topo_free(t);
}

static int setup(void **state) {
  (void)state;
  return tmpdir_make(tmpdir, sizeof(tmpdir), "mplane-topo-test");
}

static int teardown(void **state) {
  (void)state;
  return tmpdir_remove(tmpdir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_a_discovery),
      cmocka_unit_test(test_a_pairs_and_planes),
      cmocka_unit_test(test_a_link_classes),
      cmocka_unit_test(test_b_two_gpus_per_nic),
      cmocka_unit_test(test_c_nic_on_cpu),
      cmocka_unit_test(test_d_no_gpu),
      cmocka_unit_test(test_nothing_at_all),
      cmocka_unit_test(test_bad_files),
      cmocka_unit_test(test_planes_grammar),
      cmocka_unit_test(test_planes_in_config),
      cmocka_unit_test(test_planes_from_config),
      cmocka_unit_test(test_planes_config_errors),
      cmocka_unit_test(test_planes_config_one_plane),
      cmocka_unit_test(test_planes_from_ib_subnets),
      cmocka_unit_test(test_planes_from_ip_subnets),
      cmocka_unit_test(test_planes_port_down_in_files),
      cmocka_unit_test(test_gpu_node_virtual_nics_only),
      cmocka_unit_test(test_cuda_visible),
      cmocka_unit_test(test_sysfs_fallback),
      cmocka_unit_test(test_annotate_props),
      cmocka_unit_test(test_annotate_probed_subnets),
      cmocka_unit_test(test_annotate_port_down),
      cmocka_unit_test(test_nccl_xml_a),
      cmocka_unit_test(test_nccl_xml_bcd),
      cmocka_unit_test(test_nccl_xml_memfd),
      cmocka_unit_test(test_reports_a),
      cmocka_unit_test(test_reports_bcd),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
