/* cmocka tests of planes on the wire: MPLANE_TC_MAP grammar and class resolution (net/tc.c), the
 * relay decision (net/relay.c), and where planes come from (topo/planes.c: MPLANE_PLANES against a
 * node's NICs, the fabric rule). The counters (net/stats.c) are in test_stats.c; the node model's
 * planes from its files in tests/topo. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cmocka.h>

#include "net/relay.h"
#include "net/tc.h"
#include "common/config.h"
#include "topo/planes.h"
#include "topo/topo_internal.h"

static char why[256];

static void test_tc_map_good(void **state) {
  (void)state;
  struct mplane_tc_map m;
  assert_int_equal(mplane_tc_map_parse("default=0,collective=1,alltoall=3,lowlat=5,storage=2", 0, &m, why, sizeof(why)), 0);
  assert_int_equal(m.sl[MPLANE_TC_DEFAULT], 0);
  assert_int_equal(m.sl[MPLANE_TC_COLLECTIVE], 1);
  assert_int_equal(m.sl[MPLANE_TC_ALLTOALL], 3);
  assert_int_equal(m.sl[MPLANE_TC_LOWLAT], 5);
  assert_int_equal(m.sl[MPLANE_TC_STORAGE], 2);
  /* adaptive routing: on for lowlat only, unless the map says otherwise */
  assert_int_equal(m.ar[MPLANE_TC_LOWLAT], 1);
  assert_int_equal(m.ar[MPLANE_TC_ALLTOALL], 0);
  assert_int_equal(mplane_tc_map_parse(" alltoall = 4:ar , LowLat=6:noar", 7, &m, why, sizeof(why)), 0);
  assert_int_equal(m.sl[MPLANE_TC_ALLTOALL], 4);
  assert_int_equal(m.ar[MPLANE_TC_ALLTOALL], 1);
  assert_int_equal(m.ar[MPLANE_TC_LOWLAT], 0);
  /* classes not named take default's SL; default itself falls back to the given SL */
  assert_int_equal(m.sl[MPLANE_TC_DEFAULT], 7);
  assert_int_equal(m.sl[MPLANE_TC_STORAGE], 7);
  assert_int_equal(mplane_tc_map_parse("default=2", 7, &m, why, sizeof(why)), 0);
  assert_int_equal(m.sl[MPLANE_TC_COLLECTIVE], 2);
  assert_int_equal(mplane_tc_map_parse("", 3, &m, why, sizeof(why)), 0);
  assert_int_equal(m.sl[MPLANE_TC_LOWLAT], 3);
  assert_int_equal(mplane_tc_map_parse("storage=15,default=0", 0, &m, why, sizeof(why)), 0);
  assert_int_equal(m.sl[MPLANE_TC_STORAGE], 15);
}

static void expect_bad(const char *map, const char *needle) {
  struct mplane_tc_map m;
  why[0] = 0;
  if (mplane_tc_map_parse(map, 0, &m, why, sizeof(why)) == 0) fail_msg("'%s' was accepted", map);
  if (!strstr(why, needle)) fail_msg("error for '%s' is '%s', expected it to mention '%s'", map, why, needle);
}

static void test_tc_map_bad(void **state) {
  (void)state;
  expect_bad("bulk=1", "unknown class 'bulk' at column 1");
  expect_bad("default=0,alltoall=16", "not an integer from 0 to 15");
  expect_bad("default=0,alltoall=-1", "not an integer from 0 to 15");
  expect_bad("alltoall=x", "not an integer");
  expect_bad("alltoall=3,alltoall=4", "given twice");
  expect_bad("alltoall", "no '='");
  expect_bad("alltoall=", "no service level");
  expect_bad("default=0,", "trailing ','");
  expect_bad("default=0,,lowlat=1", "empty entry at column 11");
  expect_bad("lowlat=5:fast", "not 'ar' or 'noar'");
  assert_int_equal(mplane_tc_validate("default=0,lowlat=5:ar", why, sizeof(why)), 0);
  assert_int_not_equal(mplane_tc_validate("default=99", why, sizeof(why)), 0);
}

#define BIT(x) (1u << (x))

static ncclNetAttr_v11_t attr(uint32_t op, uint32_t algo, uint32_t proto) {
  ncclNetAttr_v11_t a;
  memset(&a, 0xff, sizeof(a));
  a.op = op;
  a.algo = algo;
  a.proto = proto;
  return a;
}

static void test_tc_classes(void **state) {
  (void)state;
  int invalid = 0;
  assert_int_equal(mplane_tc_class_from_nccl(NCCL_NET_TRAFFIC_CLASS_UNDEF, &invalid), -1);
  assert_int_equal(invalid, 0);
  /* NCCL 2.30 passes NCCL_CONFIG_UNDEF_INT for a communicator whose trafficClass the user left unset
   * (seen on NCCL 2.30.7: it drew a WARN on every run) */
  invalid = 1;
  assert_int_equal(mplane_tc_class_from_nccl(MPLANE_NCCL_CONFIG_UNDEF_INT, &invalid), -1);
  assert_int_equal(invalid, 0);
  assert_int_equal(mplane_tc_resolve(MPLANE_NCCL_CONFIG_UNDEF_INT, NULL), MPLANE_TC_DEFAULT);
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++) assert_int_equal(mplane_tc_class_from_nccl(c, &invalid), c);
  assert_int_equal(mplane_tc_class_from_nccl(MPLANE_TC_NCLASSES, &invalid), -1);
  assert_int_equal(invalid, 1);
  assert_int_equal(mplane_tc_class_from_nccl(-7, &invalid), -1);
  assert_int_equal(invalid, 1);

  ncclNetAttr_v11_t a = attr(MPLANE_NCCL_ATTR_UNDEF, MPLANE_NCCL_ATTR_UNDEF, MPLANE_NCCL_ATTR_UNDEF);
  assert_int_equal(mplane_tc_class_from_attr(&a), -1);
  assert_int_equal(mplane_tc_class_from_attr(NULL), -1);
  /* NCCL's p2p-only connection: Send|Recv|AlltoAll|Scatter|Gather */
  a = attr(BIT(MPLANE_NCCL_FUNC_SEND) | BIT(MPLANE_NCCL_FUNC_RECV) | BIT(MPLANE_NCCL_FUNC_ALLTOALL) |
               BIT(MPLANE_NCCL_FUNC_SCATTER) | BIT(MPLANE_NCCL_FUNC_GATHER),
           MPLANE_NCCL_ATTR_UNDEF, MPLANE_NCCL_ATTR_UNDEF);
  assert_int_equal(mplane_tc_class_from_attr(&a), MPLANE_TC_ALLTOALL);
  a = attr(BIT(MPLANE_NCCL_FUNC_ALLREDUCE), BIT(1), BIT(MPLANE_NCCL_PROTO_SIMPLE));
  assert_int_equal(mplane_tc_class_from_attr(&a), MPLANE_TC_COLLECTIVE);
  a = attr(BIT(MPLANE_NCCL_FUNC_ALLREDUCE), BIT(1), BIT(MPLANE_NCCL_PROTO_LL));
  assert_int_equal(mplane_tc_class_from_attr(&a), MPLANE_TC_LOWLAT);
  a = attr(BIT(MPLANE_NCCL_FUNC_ALLREDUCE), BIT(1), BIT(MPLANE_NCCL_PROTO_LL128));
  assert_int_equal(mplane_tc_class_from_attr(&a), MPLANE_TC_COLLECTIVE);
  a = attr(BIT(MPLANE_NCCL_FUNC_ALLGATHER) | BIT(MPLANE_NCCL_FUNC_SEND), MPLANE_NCCL_ATTR_UNDEF, MPLANE_NCCL_ATTR_UNDEF);
  assert_int_equal(mplane_tc_class_from_attr(&a), MPLANE_TC_COLLECTIVE);

  /* the communicator's class wins over hints; hints over default */
  a = attr(BIT(MPLANE_NCCL_FUNC_SEND), MPLANE_NCCL_ATTR_UNDEF, MPLANE_NCCL_ATTR_UNDEF);
  assert_int_equal(mplane_tc_resolve_hints(MPLANE_TC_STORAGE, &a), MPLANE_TC_STORAGE);
  assert_int_equal(mplane_tc_resolve_hints(NCCL_NET_TRAFFIC_CLASS_UNDEF, &a), MPLANE_TC_ALLTOALL);
  assert_int_equal(mplane_tc_resolve_hints(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL), MPLANE_TC_DEFAULT);
  assert_int_equal(mplane_tc_resolve_hints(42, &a), MPLANE_TC_ALLTOALL);
  /* main sets MPLANE_TC_MAP: the user's map, so hints choose the class (without one they do not:
   * softverbs sl-site, sl-nomap) */
  assert_int_equal(mplane_tc_hints_choose_class(), 1);
  assert_int_equal(mplane_tc_resolve(NCCL_NET_TRAFFIC_CLASS_UNDEF, &a), MPLANE_TC_ALLTOALL);
  assert_string_equal(mplane_tc_class_name(MPLANE_TC_ALLTOALL), "alltoall");
  assert_int_equal(mplane_tc_class_by_name("LOWLAT", 6), MPLANE_TC_LOWLAT);
}

static void test_tc_dscp_and_socket(void **state) {
  (void)state;
  assert_int_equal(mplane_tc_dscp(0), 0);
  assert_int_equal(mplane_tc_dscp(3), 24);
  assert_int_equal(mplane_tc_dscp(5), 40);
  assert_int_equal(mplane_tc_dscp(8), 4);
  assert_int_equal(mplane_tc_dscp(15), 60);
  for (int sl = 0; sl <= 15; sl++) {
    assert_int_equal(mplane_tc_dscp(sl) >> 3, sl & 7);
    assert_int_equal(mplane_tc_priority(sl), sl & 7);
  }
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(mplane_tc_mark_socket(fd, 3, why, sizeof(why)), 0);
  int tos = -1, prio = -1;
  socklen_t l = sizeof(tos);
  assert_int_equal(getsockopt(fd, IPPROTO_IP, IP_TOS, &tos, &l), 0);
  l = sizeof(prio);
  assert_int_equal(getsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, &l), 0);
  assert_int_equal(tos, 0x60);
  assert_int_equal(prio, 3);
  close(fd);
  fd = socket(AF_INET6, SOCK_STREAM, 0);
  if (fd >= 0) {
    assert_int_equal(mplane_tc_mark_socket(fd, 5, why, sizeof(why)), 0);
    l = sizeof(tos);
    assert_int_equal(getsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, &l), 0);
    assert_int_equal(tos, 40 << 2);
    close(fd);
  }
}

static struct mplane_dev_props devs4[4];

static int setup_devs(void **state) {
  (void)state;
  const char *names[4] = {"veth0", "veth1", "veth2", "veth3"};
  for (int d = 0; d < 4; d++) {
    memset(&devs4[d], 0, sizeof(devs4[d]));
    snprintf(devs4[d].name, sizeof(devs4[d].name), "%s", names[d]);
    devs4[d].plane = d;
  }
  return 0;
}

static void test_relay_pick(void **state) {
  (void)state;
  struct mplane_relay_choice c;
  assert_int_equal(mplane_relay_pick(devs4, 4, 2, 2, MPLANE_RELAY_AUTO, &c), ncclSuccess);
  assert_int_equal(c.dev, 2);
  assert_int_equal(c.relayed, 0);
  assert_int_equal(mplane_relay_pick(devs4, 4, 0, 3, MPLANE_RELAY_AUTO, &c), ncclSuccess);
  assert_int_equal(c.dev, 3);
  assert_int_equal(c.relayed, 1);
  assert_int_equal(c.local_plane, 0);
  assert_int_equal(c.peer_plane, 3);
  assert_int_equal(mplane_relay_pick(devs4, 4, 0, 3, MPLANE_RELAY_HOST, &c), ncclSuccess);
  assert_int_equal(c.dev, 3);
  /* off: refused */
  assert_int_equal(mplane_relay_pick(devs4, 4, 0, 3, MPLANE_RELAY_OFF, &c), ncclInvalidUsage);
  /* no local NIC on the peer's plane */
  assert_int_equal(mplane_relay_pick(devs4, 4, 1, 9, MPLANE_RELAY_AUTO, &c), ncclInvalidUsage);
  /* unknown planes: no opinion */
  assert_int_equal(mplane_relay_pick(devs4, 4, 1, -1, MPLANE_RELAY_OFF, &c), ncclSuccess);
  assert_int_equal(c.dev, 1);
  devs4[1].plane = -1;
  assert_int_equal(mplane_relay_pick(devs4, 4, 1, 3, MPLANE_RELAY_OFF, &c), ncclSuccess);
  assert_int_equal(c.dev, 1);
  assert_int_equal(c.relayed, 0);
}

/* A node whose NICs are the plugin's devices of devs4 (veth0, veth1, mlx5_2:1 of HCA mlx5_2, veth3)
 * and extra, with no GPU: every NIC is a compute NIC. */
static struct mplane_topo *node_of(const char *extra) {
  struct mplane_topo *t = malloc(sizeof(*t));
  assert_non_null(t);
  mplane_topo_init(t);
  for (int d = 0; d < 4; d++) assert_true(mplane_topo_add_virtual_nic(t, devs4[d].name) == d);
  snprintf(t->nics[2].ibdev, sizeof(t->nics[2].ibdev), "mlx5_2");
  if (extra) assert_true(mplane_topo_add_virtual_nic(t, extra) == 4);
  return t;
}

static void test_planes_apply(void **state) {
  (void)state;
  snprintf(devs4[2].name, sizeof(devs4[2].name), "mlx5_2:1");
  struct mplane_topo *t = node_of(NULL);
  char err[1024];
  assert_int_equal(mplane_topo_assign_planes(t, "veth0=7,mlx5_2=5", err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[0].plane, 7);
  assert_int_equal(t->nics[1].plane, -1); /* not named: on no plane */
  assert_int_equal(t->nics[2].plane, 5);  /* "mlx5_2" names every port of mlx5_2 */
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_CONFIG);
  /* a name no NIC has: refused, naming it and the node's NICs */
  assert_int_equal(mplane_topo_assign_planes(t, "veth0=7,nosuch=1", err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "'nosuch'"));
  assert_non_null(strstr(err, "veth3"));
  /* bad values: refused, the model unchanged */
  assert_int_equal(mplane_topo_assign_planes(t, "veth0=2", err, sizeof(err)), ncclSuccess);
  assert_int_equal(mplane_topo_assign_planes(t, "veth0=x", err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "veth0"));
  assert_int_not_equal(mplane_topo_assign_planes(t, "veth0", err, sizeof(err)), ncclSuccess);
  assert_int_not_equal(mplane_topo_assign_planes(t, "veth1=200", err, sizeof(err)), ncclSuccess);
  assert_int_equal(t->nics[0].plane, 2);
  assert_int_equal(t->nics[1].plane, -1);
  /* none: no subnet known, so PCI (here name) order */
  assert_int_equal(mplane_topo_assign_planes(t, "", err, sizeof(err)), ncclSuccess);
  for (int n = 0; n < 4; n++) assert_int_equal(t->nics[n].plane, n);
  assert_int_equal(t->plane_source, MPLANE_TOPO_PLANE_PCI);
  free(t);
}

/* MPLANE_PLANES has one grammar, so mplane-config --check (the config load) and init (topo/'s
 * assign_planes against the node) agree on every value. They once had two parsers: 'lo=0 ' passed
 * --check and then failed init; 'veth0=0,' and 'veth0=0,veth1=0' passed init's and failed --check;
 * planes 64..127 passed one and not the other; a plane of 16 or more characters was cut to its
 * first 15. */
static void test_planes_one_grammar(void **state) {
  (void)state;
  struct {
    const char *value;
    int ok;
    int plane0; /* veth0's plane after assign, when ok */
  } cases[] = {
      {"veth0=0 ", 1, 0},
      {"veth0=2\t", 1, 2},
      {" veth0 = 3 , veth1=1", 1, 3},
      {"veth0=63", 1, 63},
      {"veth0=abcdefghijklmnopqrstuvwxyz=1", 0, 0},
      {"abcdefghijklmnopqrstu=5,veth0=6", 1, 6}, /* a long name */
      {"veth0=+1", 0, 0},
      {"veth0=01", 0, 0},
      {"veth0=0000000000000001x", 0, 0},
      {"veth0=0000000000000000", 0, 0},
      {"veth0=64", 0, 0},
      {"veth0=100", 0, 0},
      {"veth0=0,veth1=0", 1, 0}, /* two rails of plane 0 */
      {"veth0=0,veth0=1", 0, 0},
      {"veth0=0,", 0, 0},
      {",veth0=0", 0, 0},
      {"veth0==1", 0, 0},
      {"ve th0=1", 0, 0},
      {"veth0=\v1", 0, 0},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    setup_devs(NULL);
    struct mplane_topo *t = node_of("abcdefghijklmnopqrstu");
    setenv("MPLANE_PLANES", cases[i].value, 1);
    struct mplane_config cfg;
    char err[1024], aerr[1024] = "";
    int checked = mplane_config_load(&cfg, err, sizeof(err)) == ncclSuccess;
    unsetenv("MPLANE_PLANES");
    int applied = mplane_topo_assign_planes(t, cases[i].value, aerr, sizeof(aerr)) == ncclSuccess;
    if (checked != cases[i].ok || applied != cases[i].ok)
      fail_msg("MPLANE_PLANES='%s': config load %s, init's assign %s; expected both to %s (%s)", cases[i].value,
               checked ? "accepts" : "refuses", applied ? "accepts" : "refuses", cases[i].ok ? "accept" : "refuse",
               checked ? aerr : err);
    if (cases[i].ok) assert_int_equal(t->nics[0].plane, cases[i].plane0);
    free(t);
  }
}

static struct sockaddr_in sin4(const char *ip) {
  struct sockaddr_in s = {.sin_family = AF_INET};
  inet_pton(AF_INET, ip, &s.sin_addr);
  return s;
}

/* The subnets of n IPv4 interfaces (/24), as discovery reads them. */
static void subnets_of(int n, const char *const *ips, struct mplane_subnet *out) {
  struct sockaddr_in m = sin4("255.255.255.0");
  for (int i = 0; i < n; i++) {
    struct sockaddr_in a = sin4(ips[i]);
    char text[64];
    assert_int_equal(mplane_subnet_of_ip((struct sockaddr *)&a, (struct sockaddr *)&m, &out[i], text, sizeof(text)), 0);
    assert_int_equal(out[i].kind, MPLANE_SUBNET_IPV4);
  }
}

static void test_planes_by_subnet(void **state) {
  (void)state;
  struct mplane_subnet sn[4];
  int plane[4], rail[4];
  /* the emulated fabric's addresses (198.18.p.n/24) are subnets like any other: plane = rank */
  const char *fabric[4] = {"198.18.3.1", "198.18.0.1", "198.18.2.1", "198.18.1.1"};
  subnets_of(4, fabric, sn);
  char text[64];
  struct sockaddr_in a = sin4("198.18.3.1"), m = sin4("255.255.255.0");
  assert_int_equal(mplane_subnet_of_ip((struct sockaddr *)&a, (struct sockaddr *)&m, &sn[0], text, sizeof(text)), 0);
  assert_string_equal(text, "198.18.3.0/24");
  assert_int_equal(mplane_planes_by_subnet(4, sn, plane, rail), 4);
  assert_int_equal(plane[0], 3);
  assert_int_equal(plane[1], 0);
  assert_int_equal(plane[2], 2);
  assert_int_equal(plane[3], 1);
  for (int i = 0; i < 4; i++) assert_int_equal(rail[i], 0);
  /* no address range means a plane by itself: a node with only that fabric's planes 2 and 3 has
   * planes 0 and 1 (MPLANE_PLANES says otherwise where it must) */
  assert_int_equal(mplane_planes_by_subnet(2, sn + 2, plane, rail), 2);
  assert_int_equal(plane[0], 1);
  assert_int_equal(plane[1], 0);
  /* other subnets: rank of the subnet, rails within one (documentation ranges; nothing is sent) */
  const char *docs[3] = {"203.0.113.9", "198.51.100.7", "203.0.113.10"};
  subnets_of(3, docs, sn);
  assert_int_equal(mplane_planes_by_subnet(3, sn, plane, rail), 2);
  assert_int_equal(plane[0], 1);
  assert_int_equal(plane[1], 0);
  assert_int_equal(plane[2], 1);
  assert_int_equal(rail[0], 0);
  assert_int_equal(rail[2], 1);
  /* one subnet for all: one plane, every NIC a rail of it */
  const char *one[3] = {"203.0.113.9", "203.0.113.11", "203.0.113.10"};
  subnets_of(3, one, sn);
  assert_int_equal(mplane_planes_by_subnet(3, sn, plane, rail), 1);
  for (int i = 0; i < 3; i++) assert_int_equal(plane[i], 0), assert_int_equal(rail[i], i);
  /* one subnet unknown: the fabric does not decide, nothing written */
  sn[1].kind = MPLANE_SUBNET_NONE;
  plane[0] = plane[1] = plane[2] = -7;
  assert_int_equal(mplane_planes_by_subnet(3, sn, plane, rail), 0);
  assert_int_equal(plane[0], -7);
  assert_int_equal(mplane_planes_by_subnet(0, sn, plane, rail), 0);
  /* kinds sort before keys: an IB prefix ranks before any IP subnet */
  subnets_of(2, docs, sn);
  sn[2] = (struct mplane_subnet){.kind = MPLANE_SUBNET_IB, .key = 0xfec0000000000009ull};
  assert_int_equal(mplane_planes_by_subnet(3, sn, plane, rail), 3);
  assert_int_equal(plane[2], 0);
  /* the default GID prefix names no subnet */
  assert_int_equal(mplane_ib_prefix_names_subnet(MPLANE_IB_DEFAULT_GID_PREFIX), 0);
  assert_int_equal(mplane_ib_prefix_names_subnet(0xfec0000000000001ull), 1);
}

/* Subnets a transport found keep the numbers it gave them (a port down keeps its slot), after the
 * named ones; numbering groups over the ports present, a down port (-1) a number of its own. */
static void test_planes_probed_numbers(void **state) {
  (void)state;
  int slot[8], plane[8], rail[8];
  /* eight planes, port 3 down: 0 1 2 [3] 4 5 6 7 */
  int eight[8] = {0, 1, 2, -1, 4, 5, 6, 7};
  assert_int_equal(mplane_planes_number_groups(8, eight, slot), 8);
  for (int i = 0; i < 8; i++) assert_int_equal(slot[i], i);
  /* one fabric, port 1 down: the up ports all 0 */
  int one[4] = {5, -1, 5, 5};
  assert_int_equal(mplane_planes_number_groups(4, one, slot), 2);
  assert_int_equal(slot[0], 0);
  assert_int_equal(slot[1], 1);
  assert_int_equal(slot[2], 0);
  assert_int_equal(slot[3], 0);
  /* two planes interleaved: numbered by their first port */
  int two[4] = {9, 4, 9, 4};
  assert_int_equal(mplane_planes_number_groups(4, two, slot), 2);
  assert_int_equal(slot[1], 1);
  assert_int_equal(slot[2], 0);
  /* the rule keeps them: 7 ports up with numbers 0 1 2 4 5 6 7 are those planes, not 0..6 */
  struct mplane_subnet sn[8];
  int keys[7] = {0, 1, 2, 4, 5, 6, 7};
  for (int i = 0; i < 7; i++) sn[i] = (struct mplane_subnet){.kind = MPLANE_SUBNET_PROBED, .key = (uint64_t)keys[i]};
  assert_int_equal(mplane_planes_by_subnet(7, sn, plane, rail), 7);
  for (int i = 0; i < 7; i++) assert_int_equal(plane[i], keys[i]);
  /* named subnets rank first, the found ones follow at their numbers */
  sn[0] = (struct mplane_subnet){.kind = MPLANE_SUBNET_IB, .key = 0xfec0000000000002ull};
  sn[1] = (struct mplane_subnet){.kind = MPLANE_SUBNET_IB, .key = 0xfec0000000000001ull};
  sn[2] = (struct mplane_subnet){.kind = MPLANE_SUBNET_PROBED, .key = 1};
  assert_int_equal(mplane_planes_by_subnet(3, sn, plane, rail), 3);
  assert_int_equal(plane[0], 1);
  assert_int_equal(plane[1], 0);
  assert_int_equal(plane[2], 3);
}

int main(void) {
  setenv("MPLANE_TC_MAP", "default=0,collective=0,alltoall=3,lowlat=5,storage=1", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_tc_map_good),
      cmocka_unit_test(test_tc_map_bad),
      cmocka_unit_test(test_tc_classes),
      cmocka_unit_test(test_tc_dscp_and_socket),
      cmocka_unit_test_setup(test_relay_pick, setup_devs),
      cmocka_unit_test_setup(test_planes_apply, setup_devs),
      cmocka_unit_test(test_planes_one_grammar),
      cmocka_unit_test(test_planes_by_subnet),
      cmocka_unit_test(test_planes_probed_numbers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
