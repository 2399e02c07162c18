/* mplane tests: the socket transport's built-in tuner rows reach NCCL's calls.
 *
 * A link of 100 Gb/s or more (loopback on a host of 4+ CPUs included) makes NCCL run mid-sized
 * all_reduce as LL on 4 channels, slower than NCCL Socket; the socket transport then hands the tuner
 * rows for those sizes (net/socket/socket_transport.c). This test loads the built plugin, inits its
 * net side on lo as NCCL does, then drives ncclTunerPlugin_v5. argv[1] names the environment the
 * runner set:
 *   loopback     MPLANE_SOCKET_IFNAME=lo at 100 Gb/s (MPLANE_SOCKET_SPEED=100000, a 100 GbE NIC's
 *                rate, whatever this machine's CPUs): 32K..64K-1 get 2 channels (NCCL's algorithm and protocol
 *                stay), 64K..2M Ring/Simple (64K..512K-1 on 1 channel, 512K..1M on 4, then 2),
 *                2M+1..32M-1 4 channels
 *                (NCCL's algorithm and protocol stay); smaller and bigger sizes, and communicators
 *                of one node, are left alone
 *   speed        and MPLANE_SOCKET_SPEED=10000: no rows (a slow link)
 *   nodefaults   and MPLANE_NCCL_DEFAULTS=0: no rows */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/nccl/net.h"
#include "common/nccl/tuner.h"

#define NA 7
#define NP 3

static const char *scenario;
static ncclTuner_v5_t *tuner;

static void quiet(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)level;
  (void)flags;
  (void)file;
  (void)line;
  (void)fmt;
}

/* getCollInfo on a cost table where NCCL alone would pick Ring/LL; returns the channels asked for
 * (0: none) and sets *simple if Ring/Simple became the cheapest (cost 0). Fails if anything else
 * in the table changed. */
static int ask(void *ctx, size_t nbytes, int *simple) {
  float t[NA][NP], orig[NA][NP];
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) t[a][p] = orig[a][p] = 10.0f + (float)(a * NP + p);
  t[NCCL_ALGO_RING][NCCL_PROTO_LL] = orig[NCCL_ALGO_RING][NCCL_PROTO_LL] = 1.0f;
  int nch = 0;
  assert_int_equal(tuner->getCollInfo(ctx, ncclFuncAllReduce, nbytes, 1, (float **)t, NA, NP, 0, &nch), ncclSuccess);
  *simple = t[NCCL_ALGO_RING][NCCL_PROTO_SIMPLE] == 0.0f;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++)
      if (!(a == NCCL_ALGO_RING && p == NCCL_PROTO_SIMPLE) && t[a][p] != orig[a][p])
        fail_msg("%zu bytes: cost [%d][%d] changed from %g to %g", nbytes, a, p, orig[a][p], t[a][p]);
  return nch;
}

static void test_rows(void **state) {
  (void)state;
  int rows = strcmp(scenario, "loopback") == 0;
  void *ctx = NULL;
  assert_int_equal(tuner->init(&ctx, 0x77, 2, 2, quiet, NULL, NULL), ncclSuccess);
  static const struct { size_t bytes; int channels, simple; } want[] = {
      {8192, 0, 0}, {32767, 0, 0}, {32768, 2, 0}, {65535, 2, 0}, {65536, 1, 1},
      {(512 << 10) - 1, 1, 1}, {512 << 10, 4, 1}, {1 << 20, 4, 1}, {(1 << 20) + 1, 2, 1}, {2 << 20, 2, 1},
      {(2 << 20) + 1, 4, 0}, {(32 << 20) - 1, 4, 0}, {32 << 20, 0, 0}, {128 << 20, 0, 0}};
  for (size_t i = 0; i < sizeof(want) / sizeof(want[0]); i++) {
    int simple = 0, nch = ask(ctx, want[i].bytes, &simple);
    int wch = rows ? want[i].channels : 0, wsimple = rows ? want[i].simple : 0;
    if (nch != wch || simple != wsimple)
      fail_msg("%s: all_reduce of %zu bytes on 2 nodes: channels %d, Ring/Simple forced %d; expected %d, %d", scenario,
               want[i].bytes, nch, simple, wch, wsimple);
  }
  assert_int_equal(tuner->finalize(ctx), ncclSuccess);
  /* one node: the rows tune the network, which a one-node communicator does not use */
  assert_int_equal(tuner->init(&ctx, 0x78, 8, 1, quiet, NULL, NULL), ncclSuccess);
  int simple = 0;
  assert_int_equal(ask(ctx, 1 << 20, &simple), 0);
  assert_int_equal(simple, 0);
  assert_int_equal(tuner->finalize(ctx), ncclSuccess);
}

int main(int argc, char **argv) {
  if (argc < 3) {
    fprintf(stderr, "usage: test_tuner_builtin PLUGIN loopback|speed|nodefaults\n");
    return 2;
  }
  scenario = argv[2];
  unsetenv("MPLANE_TUNER_CONFIG");
  void *lib = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    fprintf(stderr, "cannot load %s: %s\n", argv[1], dlerror());
    return 1;
  }
  ncclNet_v11_t *net = dlsym(lib, "ncclNetPlugin_v11");
  tuner = dlsym(lib, "ncclTunerPlugin_v5");
  if (!net || !tuner) {
    fprintf(stderr, "%s exports no ncclNetPlugin_v11 or ncclTunerPlugin_v5\n", argv[1]);
    return 1;
  }
  void *nctx = NULL;
  ncclNetCommConfig_v11_t cfg = {NCCL_NET_TRAFFIC_CLASS_UNDEF};
  if (net->init(&nctx, 1, &cfg, quiet, NULL) != ncclSuccess) {
    fprintf(stderr, "net init failed on MPLANE_SOCKET_IFNAME=%s\n", getenv("MPLANE_SOCKET_IFNAME"));
    return 1;
  }
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_rows)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
