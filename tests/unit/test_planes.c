/* cmocka tests of planes on the wire: MPLANE_TC_MAP grammar and class resolution (net/tc.c), the
 * relay decision and plane sources (net/relay.c). The counters (net/stats.c) are in test_stats.c. */
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
  assert_int_equal(mplane_tc_class_from_nccl(5, &invalid), -1);
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

static void test_planes_apply(void **state) {
  (void)state;
  snprintf(devs4[2].name, sizeof(devs4[2].name), "mlx5_2:1");
  assert_int_equal(mplane_planes_apply("veth0=7,mlx5_2=5,nosuch=1", devs4, 4, why, sizeof(why)), 0);
  assert_int_equal(devs4[0].plane, 7);
  assert_int_equal(devs4[1].plane, 1);
  assert_int_equal(devs4[2].plane, 5);
  assert_int_equal(mplane_planes_apply("", devs4, 4, why, sizeof(why)), 0);
  assert_int_equal(devs4[0].plane, 7);
  assert_int_not_equal(mplane_planes_apply("veth0=x", devs4, 4, why, sizeof(why)), 0);
  assert_non_null(strstr(why, "veth0"));
  assert_int_not_equal(mplane_planes_apply("veth0", devs4, 4, why, sizeof(why)), 0);
  assert_int_not_equal(mplane_planes_apply("veth1=200", devs4, 4, why, sizeof(why)), 0);
  assert_int_equal(devs4[1].plane, 1); /* a refused spec changes nothing */
}

/* MPLANE_PLANES has one grammar, so mplane-config --check (the config load) and the transport's early
 * apply at init agree on every value. They once had two parsers: 'lo=0 ' passed --check and then
 * failed init; 'veth0=0,' and 'veth0=0,veth1=0' passed init's and failed --check; planes 64..127
 * passed one and not the other; a plane of 16 or more characters was cut to its first 15. */
static void test_planes_one_grammar(void **state) {
  (void)state;
  struct {
    const char *value;
    int ok;
    int plane0; /* veth0's plane after apply, when ok */
  } cases[] = {
      {"veth0=0 ", 1, 0},
      {"veth0=2\t", 1, 2},
      {" veth0 = 3 , veth1=1", 1, 3},
      {"veth0=63", 1, 63},
      {"veth0=abcdefghijklmnopqrstuvwxyz=1", 0, 0},
      {"abcdefghijklmnopqrstu=5,veth0=6", 1, 6}, /* a long name that matches no device */
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
    setenv("MPLANE_PLANES", cases[i].value, 1);
    struct mplane_config cfg;
    char err[1024];
    int checked = mplane_config_load(&cfg, err, sizeof(err)) == ncclSuccess;
    unsetenv("MPLANE_PLANES");
    int applied = mplane_planes_apply(cases[i].value, devs4, 4, why, sizeof(why)) == 0;
    if (checked != cases[i].ok || applied != cases[i].ok)
      fail_msg("MPLANE_PLANES='%s': config load %s, init's apply %s; expected both to %s (%s)", cases[i].value,
               checked ? "accepts" : "refuses", applied ? "accepts" : "refuses", cases[i].ok ? "accept" : "refuse",
               checked ? why : err);
    if (cases[i].ok) assert_int_equal(devs4[0].plane, cases[i].plane0);
    else assert_int_equal(devs4[0].plane, 0); /* a refused value changes nothing */
  }
}

static struct sockaddr_in sin4(const char *ip) {
  struct sockaddr_in s = {.sin_family = AF_INET};
  inet_pton(AF_INET, ip, &s.sin_addr);
  return s;
}

static void test_planes_from_subnets(void **state) {
  (void)state;
  /* the fabric range gives its third octet, whatever else is there */
  struct sockaddr_in a[4] = {sin4("198.18.3.1"), sin4("198.18.0.1"), sin4("198.18.2.1"), sin4("198.18.1.1")};
  struct sockaddr_in m[4] = {sin4("255.255.255.0"), sin4("255.255.255.0"), sin4("255.255.255.0"), sin4("255.255.255.0")};
  const struct sockaddr *ap[4], *mp[4];
  for (int i = 0; i < 4; i++) ap[i] = (struct sockaddr *)&a[i], mp[i] = (struct sockaddr *)&m[i];
  int planes[4];
  mplane_planes_from_subnets(4, ap, mp, planes);
  assert_int_equal(planes[0], 3);
  assert_int_equal(planes[1], 0);
  assert_int_equal(planes[2], 2);
  assert_int_equal(planes[3], 1);
  /* other subnets: rank of the subnet (documentation ranges; nothing is sent) */
  a[0] = sin4("203.0.113.9");
  a[1] = sin4("198.51.100.7");
  a[2] = sin4("203.0.113.10");
  mplane_planes_from_subnets(3, ap, mp, planes);
  assert_int_equal(planes[0], 1);
  assert_int_equal(planes[1], 0);
  assert_int_equal(planes[2], 1);
  /* one subnet for all: says nothing */
  a[1] = sin4("203.0.113.11");
  mplane_planes_from_subnets(3, ap, mp, planes);
  assert_int_equal(planes[0], -1);
  assert_int_equal(planes[1], -1);
  assert_int_equal(mplane_plane_from_fabric_ip((struct sockaddr *)&a[0]), -1);
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
      cmocka_unit_test(test_planes_from_subnets),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
