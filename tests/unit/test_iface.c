/* Unit tests: MPLANE_SOCKET_IFNAME, NCCL_SOCKET_IFNAME's grammar (net/socket/socket_iface.c).
 *
 * NCCL's grammar: a comma-separated list of interface name prefixes; a leading '^' turns it into an
 * exclusion list; a leading '=' (after the '^', if any) makes every name in the list exact.
 * mplane adds: loopback only when it is named (never through automatic choice or exclusion), and
 * automatic choice skips container bridges. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "net/socket/socket.h"

#define YES(spec, ifname) check(spec, ifname, 0, 1, __LINE__)
#define NO(spec, ifname) check(spec, ifname, 0, 0, __LINE__)
#define LOOP_YES(spec, ifname) check(spec, ifname, 1, 1, __LINE__)
#define LOOP_NO(spec, ifname) check(spec, ifname, 1, 0, __LINE__)

static void check(const char *spec, const char *ifname, int loop, int want, int line) {
  int got = mps_iface_match(spec, ifname, loop) != 0;
  if (got != want)
    fail_msg("line %d: MPLANE_SOCKET_IFNAME='%s' %s %s%s, expected the opposite", line, spec ? spec : "(null)",
             got ? "selects" : "does not select", ifname, loop ? " (loopback)" : "");
}

static void test_automatic(void **state) {
  (void)state;
  YES("", "eth0");
  YES("", "ens1f0np0");
  YES("", "ib0");
  YES(NULL, "eth0");
  LOOP_NO("", "lo");
  LOOP_NO(NULL, "lo");
  NO("", "docker0");
  NO("", "virbr0");
}

static void test_prefix(void **state) {
  (void)state;
  YES("eth", "eth0");
  YES("eth", "eth12");
  YES("eth0", "eth0");
  YES("eth0", "eth01"); /* a prefix, as in NCCL */
  NO("eth", "ens3");
  NO("eth0", "eth");
  NO("eth1", "eth0");
  LOOP_NO("eth", "lo");
  YES("eth,ib", "ib0");
  YES("eth,ib", "eth3");
  NO("eth,ib", "enp1s0");
  YES("ens,eth", "eth0");
  YES("docker", "docker0"); /* bridges are selectable when named */
  /* empty entries match nothing, and do not match everything */
  NO(",", "eth0");
  NO("eth,,ib", "enp1s0");
  YES("eth,,ib", "ib1");
  YES("eth,", "eth0");
}

static void test_exclude(void **state) {
  (void)state;
  NO("^eth", "eth0");
  NO("^eth", "eth11");
  YES("^eth", "ens3");
  YES("^eth", "docker0"); /* only what is named is excluded */
  LOOP_NO("^eth", "lo");  /* loopback only when named, exclusion never names it */
  LOOP_NO("^", "lo");
  YES("^", "eth0");
  NO("^docker,eth", "docker0");
  NO("^docker,eth", "eth1");
  YES("^docker,eth", "ib0");
  LOOP_NO("^lo", "lo");
}

static void test_exact(void **state) {
  (void)state;
  YES("=eth0", "eth0");
  NO("=eth0", "eth01");
  NO("=eth0", "eth1");
  NO("=eth0", "eth");
  /* '=' applies to the whole list, as in NCCL (NCCL_SOCKET_IFNAME==eth0,eth1 means exactly these) */
  YES("=eth0,eth1", "eth0");
  YES("=eth0,eth1", "eth1");
  NO("=eth0,eth1", "eth10");
  NO("=eth0,eth1", "eth01");
  /* per-entry '=' also reads as exact */
  YES("eth,=ib0", "ib0");
  NO("eth,=ib0", "ib01");
  YES("eth,=ib0", "eth7");
  /* exclusion of exact names */
  NO("^=eth0", "eth0");
  YES("^=eth0", "eth01");
  YES("^=eth0", "eth1");
  NO("^=eth0,eth1", "eth1");
  YES("^=eth0,eth1", "eth10");
  LOOP_NO("^=eth0", "lo");
}

static void test_loopback_when_named(void **state) {
  (void)state;
  LOOP_YES("lo", "lo");
  LOOP_YES("=lo", "lo");
  LOOP_YES("eth,lo", "lo");
  LOOP_YES("=eth0,lo", "lo");
  LOOP_NO("=l", "lo");
  LOOP_NO("eth", "lo");
  LOOP_NO("=eth0", "lo");
  LOOP_NO("^eth", "lo");
  NO("lo", "eth0");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_automatic), cmocka_unit_test(test_prefix),
      cmocka_unit_test(test_exclude),   cmocka_unit_test(test_exact),
      cmocka_unit_test(test_loopback_when_named),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
