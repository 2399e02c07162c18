/* mplane tests: NCCL finds and drives the tuner in the built plugin.
 *
 * NCCL opens "libnccl-tuner-<NCCL_TUNER_PLUGIN>.so", or, without one, reuses the net plugin's
 * library ("libnccl-net-mplane.so"), with dlopen(RTLD_NOW | RTLD_LOCAL) on the bare name (so
 * LD_LIBRARY_PATH decides), then looks up ncclTunerPlugin_v6, _v5, _v4, _v3 in that order. This test
 * does the same with LD_LIBRARY_PATH pointing at the build folder, then drives every version's
 * init / getCollInfo / finalize the way NCCL does. argv[1] picks the environment the test runner set:
 *   none     MPLANE_TUNER_CONFIG unset: nothing changes, one INFO says so
 *   table    fixtures/good.csv: its rows reach NCCL's cost table through every version
 *   overlap  fixtures/overlap.csv: init succeeds, one WARN names both lines
 *   bad      fixtures/bad.csv: every init fails, the WARN names file, line and column
 *   forced   good.csv and NCCL_ALGO or NCCL_PROTO: the tuner steps aside, one INFO says so
 *   badenv   good.csv and an invalid MPLANE_IB_QPS: every init fails, the WARN names that variable */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "common/nccl/tuner.h"

#define NA 7
#define NP 3
#define IGN ((float)NCCL_ALGO_PROTO_IGNORE)

static const char *scenario;
static void *lib_tuner, *lib_net;

static char logged[65536];
static int warns;
static void capture(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if (level == NCCL_LOG_WARN) warns++;
  size_t used = strlen(logged);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(logged + used, sizeof(logged) - used, fmt, ap);
  va_end(ap);
  used = strlen(logged);
  if (used + 2 < sizeof(logged)) strcat(logged, "\n");
}

static int occurrences(const char *needle) {
  int n = 0;
  for (const char *p = logged; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

static const float costs[NA][NP] = {
    {8.2f, 9.1f, 14.0f}, {6.5f, 7.3f, 12.2f}, {IGN, IGN, IGN}, {IGN, IGN, IGN},
    {IGN, IGN, 20.5f},   {IGN, IGN, IGN},     {IGN, IGN, IGN},
};

/* One call as NCCL makes it; returns which entries changed as a bitmask over a*NP+p. */
typedef ncclResult_t (*call_fn)(void *ctx, ncclFunc_t coll, size_t nbytes, float t[NA][NP], int *nch);
static const ncclTuner_v3_t *v3;
static const ncclTuner_v4_t *v4;
static const ncclTuner_v5_t *v5;
static const ncclTuner_v6_t *v6;

static ncclResult_t call_v3(void *c, ncclFunc_t f, size_t n, float t[NA][NP], int *nch) {
  return v3->getCollInfo(c, f, n, 1, (float **)t, NA, NP, nch);
}
static ncclResult_t call_v4(void *c, ncclFunc_t f, size_t n, float t[NA][NP], int *nch) {
  return v4->getCollInfo(c, f, n, 1, (float **)t, NA, NP, 0, nch);
}
static ncclResult_t call_v5(void *c, ncclFunc_t f, size_t n, float t[NA][NP], int *nch) {
  return v5->getCollInfo(c, f, n, 1, (float **)t, NA, NP, 1, nch);
}
static ncclResult_t call_v6(void *c, ncclFunc_t f, size_t n, float t[NA][NP], int *nch) {
  return v6->getCollInfo(c, f, n, 1, (float **)t, NA, NP, 0, nch);
}

static ncclResult_t init_version(int v, void **ctx, size_t nranks, size_t nnodes) {
  ncclNvlDomainInfo_v5_t nvl = {1, (int)nranks, (int)nranks};
  ncclTunerConstants_v5_t constants;
  memset(&constants, 0x5a, sizeof(constants));
  ncclTunerConstants_v5_t before = constants;
  ncclResult_t res;
  switch (v) {
    case 3: res = v3->init(nranks, nnodes, capture, ctx); break;
    case 4: res = v4->init(nranks, nnodes, capture, ctx); break;
    case 5: res = v5->init(ctx, 0xabc5, nranks, nnodes, capture, &nvl, &constants); break;
    default: res = v6->init(ctx, 0xabc6, nranks, nnodes, capture, &nvl, &constants); break;
  }
  /* NCCL's tuning constants are NCCL's: the tuner leaves them as they were. */
  assert_memory_equal(&before, &constants, sizeof(constants));
  return res;
}

static ncclResult_t finalize_version(int v, void *ctx) {
  switch (v) {
    case 3: return v3->destroy(ctx);
    case 4: return v4->destroy(ctx);
    case 5: return v5->finalize(ctx);
    default: return v6->finalize(ctx);
  }
}

static call_fn caller(int v) { return v == 3 ? call_v3 : v == 4 ? call_v4 : v == 5 ? call_v5 : call_v6; }

static unsigned changed(const float t[NA][NP]) {
  unsigned mask = 0;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++)
      if (memcmp(&t[a][p], &costs[a][p], sizeof(float)) != 0) mask |= 1u << (a * NP + p);
  return mask;
}

static void test_both_names_resolve_to_one_library(void **state) {
  (void)state;
  static const char *const syms[] = {"ncclTunerPlugin_v6", "ncclTunerPlugin_v5", "ncclTunerPlugin_v4",
                                     "ncclTunerPlugin_v3"};
  for (size_t i = 0; i < sizeof(syms) / sizeof(syms[0]); i++) {
    void *a = dlsym(lib_tuner, syms[i]);
    void *b = dlsym(lib_net, syms[i]);
    if (!a) fail_msg("%s not found in libnccl-tuner-mplane.so", syms[i]);
    if (!b) fail_msg("%s not found in libnccl-net-mplane.so (NCCL's fallback without NCCL_TUNER_PLUGIN)", syms[i]);
    assert_ptr_equal(a, b);
    assert_string_equal(*(const char *const *)a, "mplane");
  }
  assert_non_null(dlsym(lib_net, "ncclNetPlugin_v11"));
  assert_null(v6->getChunkSize); /* NCCL keeps its own chunk sizes */
  assert_null(dlsym(lib_net, "mplane_tuner_init")); /* internals stay hidden */
}

static void test_every_version(void **state) {
  (void)state;
  for (int v = 3; v <= 6; v++) {
    logged[0] = '\0';
    warns = 0;
    void *ctx = (void *)1;
    ncclResult_t res = init_version(v, &ctx, 8, 1);
    if (strcmp(scenario, "bad") == 0 || strcmp(scenario, "badenv") == 0) {
      assert_int_equal(res, ncclInvalidArgument);
      assert_null(ctx);
      assert_int_equal(warns, 1);
      const char *want = strcmp(scenario, "bad") == 0 ? "bad.csv:3:25: unknown protocol 'LL256'"
                                                      : "MPLANE_IB_QPS='many' is not valid: expected";
      if (!strstr(logged, want)) fail_msg("v%d: WARN was: %s", v, logged);
      continue;
    }
    assert_int_equal(res, ncclSuccess);
    float t[NA][NP];
    int nch = 0;
    /* allreduce 4096 B: good.csv line 3 says tree/ll128 with 12 channels. */
    memcpy(t, costs, sizeof(t));
    assert_int_equal(caller(v)(ctx, ncclFuncAllReduce, 4096, t, &nch), ncclSuccess);
    if (strcmp(scenario, "table") == 0) {
      assert_int_equal(changed(t), 1u << (NCCL_ALGO_TREE * NP + NCCL_PROTO_LL128));
      assert_true(t[NCCL_ALGO_TREE][NCCL_PROTO_LL128] == 0.0f);
      assert_int_equal(nch, 12);
    } else if (strcmp(scenario, "overlap") == 0) {
      assert_int_equal(changed(t), 1u << (NCCL_ALGO_TREE * NP + NCCL_PROTO_LL128)); /* first row wins */
      assert_int_equal(nch, 0);
    } else {
      assert_int_equal(changed(t), 0);
      assert_int_equal(nch, 0);
    }
    /* allreduce 1 MiB: line 4 says nvls/simple, channels left to NCCL. */
    nch = 0;
    memcpy(t, costs, sizeof(t));
    assert_int_equal(caller(v)(ctx, ncclFuncAllReduce, 1 << 20, t, &nch), ncclSuccess);
    if (strcmp(scenario, "table") == 0)
      assert_int_equal(changed(t), 1u << (NCCL_ALGO_NVLS * NP + NCCL_PROTO_SIMPLE));
    else if (strcmp(scenario, "overlap") == 0)
      assert_int_equal(changed(t), 1u << (NCCL_ALGO_RING * NP + NCCL_PROTO_SIMPLE));
    else
      assert_int_equal(changed(t), 0);
    assert_int_equal(nch, 0);
    /* allgather: no row anywhere. broadcast: good.csv's row is for 16 ranks, we are 8. */
    memcpy(t, costs, sizeof(t));
    assert_int_equal(caller(v)(ctx, ncclFuncAllGather, 4096, t, &nch), ncclSuccess);
    assert_int_equal(caller(v)(ctx, ncclFuncBroadcast, 4096, t, &nch), ncclSuccess);
    assert_int_equal(changed(t), 0);
    assert_int_equal(nch, 0);
    assert_int_equal(finalize_version(v, ctx), ncclSuccess);
    assert_int_equal(warns, 0); /* the overlap WARN came once, at the first init */
  }
}

/* Messages that must come once per process, whatever the number of communicators. */
static void test_said_once(void **state) {
  (void)state;
  logged[0] = '\0';
  warns = 0;
  for (int v = 3; v <= 6; v++) {
    void *ctx = NULL;
    ncclResult_t res = init_version(v, &ctx, 8, 1);
    if (strcmp(scenario, "bad") == 0 || strcmp(scenario, "badenv") == 0) {
      assert_int_equal(res, ncclInvalidArgument); /* stays failed: no half-loaded table */
      continue;
    }
    assert_int_equal(res, ncclSuccess);
    float t[NA][NP];
    int nch = 0;
    memcpy(t, costs, sizeof(t));
    assert_int_equal(caller(v)(ctx, ncclFuncAllReduce, 100, t, &nch), ncclSuccess);
    assert_int_equal(finalize_version(v, ctx), ncclSuccess);
  }
  /* The process-wide messages were said in test_every_version's first init: not again. */
  assert_int_equal(occurrences("MPLANE_TUNER_CONFIG is not set"), 0);
  assert_int_equal(occurrences("is set by the user"), 0);
  assert_int_equal(occurrences("overlaps line"), 0);
  assert_int_equal(occurrences("first use of this row"), 0);
  if (strcmp(scenario, "bad") == 0 || strcmp(scenario, "badenv") == 0)
    assert_int_equal(warns, 4); /* each failing init says why */
}

static int setup(void **state) {
  (void)state;
  lib_tuner = dlopen("libnccl-tuner-mplane.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib_tuner) {
    fprintf(stderr, "dlopen libnccl-tuner-mplane.so: %s\n", dlerror());
    return -1;
  }
  lib_net = dlopen("libnccl-net-mplane.so", RTLD_NOW | RTLD_LOCAL);
  if (!lib_net) {
    fprintf(stderr, "dlopen libnccl-net-mplane.so: %s\n", dlerror());
    return -1;
  }
  v6 = dlsym(lib_tuner, "ncclTunerPlugin_v6");
  v5 = dlsym(lib_tuner, "ncclTunerPlugin_v5");
  v4 = dlsym(lib_tuner, "ncclTunerPlugin_v4");
  v3 = dlsym(lib_tuner, "ncclTunerPlugin_v3");
  return v3 && v4 && v5 && v6 ? 0 : -1;
}

/* The first init of the process says the once-only things; check them here, before the rest. */
static void test_first_init_messages(void **state) {
  (void)state;
  logged[0] = '\0';
  warns = 0;
  void *ctx = NULL;
  ncclResult_t res = init_version(5, &ctx, 8, 1);
  if (strcmp(scenario, "bad") == 0 || strcmp(scenario, "badenv") == 0) {
    assert_int_equal(res, ncclInvalidArgument);
    assert_true(warns >= 1); /* badenv: the config loader's own WARN, then the tuner's */
    return;
  }
  assert_int_equal(res, ncclSuccess);
  float t[NA][NP];
  int nch = 0;
  memcpy(t, costs, sizeof(t));
  assert_int_equal(v5->getCollInfo(ctx, ncclFuncAllReduce, 4096, 1, (float **)t, NA, NP, 0, &nch), ncclSuccess);
  assert_int_equal(v5->finalize(ctx), ncclSuccess);
  if (strcmp(scenario, "none") == 0) {
    assert_int_equal(occurrences("MPLANE_TUNER_CONFIG is not set: the tuner changes nothing"), 1);
    assert_int_equal(warns, 0);
  } else if (strcmp(scenario, "table") == 0) {
    assert_int_equal(occurrences("tuner: 3 rows from "), 1);
    assert_int_equal(occurrences("comm 0xabc5 (8 ranks, 1 node): 2 rows of "), 1);
    assert_int_equal(occurrences("good.csv line 3: allreduce of 4096 bytes (8 ranks, 1 node) -> tree/ll128, channels 12"), 1);
    assert_int_equal(occurrences("comm 0xabc5 done: 1 calls, 1 set from the table, 0 where"), 1);
    assert_int_equal(warns, 0);
  } else if (strcmp(scenario, "overlap") == 0) {
    assert_int_equal(warns, 1);
    assert_int_equal(occurrences("overlap.csv: line 3 overlaps line 2 (allreduce, 4096..65536 bytes); line 2 wins"), 1);
  } else if (strcmp(scenario, "forced") == 0) {
    const char *var = getenv("NCCL_ALGO") ? "NCCL_ALGO" : "NCCL_PROTO";
    char want[128];
    snprintf(want, sizeof(want), "%s=%s is set by the user: the tuner steps aside", var, getenv(var));
    assert_int_equal(occurrences(want), 1);
    assert_int_equal(changed(t), 0);
    assert_int_equal(nch, 0);
  }
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s none|table|overlap|bad|badenv|forced [NCCL_ALGO|NCCL_PROTO]\n", argv[0]);
    return 2;
  }
  scenario = argv[1];
  /* The environment the runner gave is the scenario's; drop what it inherited from the shell. */
  const char *forced_var = argc > 2 ? argv[2] : "NCCL_ALGO";
  if (strcmp(scenario, "forced") != 0 || strcmp(forced_var, "NCCL_ALGO") != 0) unsetenv("NCCL_ALGO");
  if (strcmp(scenario, "forced") != 0 || strcmp(forced_var, "NCCL_PROTO") != 0) unsetenv("NCCL_PROTO");
  if (strcmp(scenario, "none") == 0) unsetenv("MPLANE_TUNER_CONFIG");
  if (strcmp(scenario, "forced") == 0 && !getenv(forced_var)) {
    fprintf(stderr, "scenario forced needs %s set\n", forced_var);
    return 2;
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_first_init_messages),
      cmocka_unit_test(test_both_names_resolve_to_one_library),
      cmocka_unit_test(test_every_version),
      cmocka_unit_test(test_said_once),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
