/* mplane tests: the tuner policy (tuner/tuner_core.c) on cost tables shaped like
 * NCCL's: float[7 algorithms][3 protocols], microseconds, -1.0 where NCCL ignores a combination. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "tuner/tuner.h"

#define NA 7
#define NP 3
#define IGN ((float)NCCL_ALGO_PROTO_IGNORE)
#define HEADER "collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks\n"

/* An allreduce on one node of 8 H200s as NCCL 2.28 might cost it: no CollNet, no PAT, NVLS only
 * with Simple, NVLSTree not applicable. */
static const float allreduce_costs[NA][NP] = {
    /* LL     LL128   Simple */
    {8.2f, 9.1f, 14.0f},   /* Tree */
    {6.5f, 7.3f, 12.2f},   /* Ring */
    {IGN, IGN, IGN},       /* CollNetDirect */
    {IGN, IGN, IGN},       /* CollNetChain */
    {IGN, IGN, 20.5f},     /* NVLS */
    {IGN, IGN, IGN},       /* NVLSTree */
    {IGN, IGN, IGN},       /* PAT */
};

/* An allgather: Ring, and PAT with Simple only. */
static const float allgather_costs[NA][NP] = {
    {IGN, IGN, IGN}, {5.0f, 6.0f, 9.0f}, {IGN, IGN, IGN}, {IGN, IGN, IGN},
    {IGN, IGN, IGN}, {IGN, IGN, IGN},    {IGN, IGN, 4.0f},
};

/* NCCL's own pick after the tuner ran: the smallest time that is not ignored and not negative,
 * first in algorithm-major order on ties. */
static void nccl_pick(float t[NA][NP], int *algo, int *proto) {
  float best = 3600000000.0f;
  *algo = *proto = -1;
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) {
      if (t[a][p] == IGN) continue;
      if (t[a][p] >= 0.0f && t[a][p] < best) {
        best = t[a][p];
        *algo = a;
        *proto = p;
      }
    }
}

struct fixture {
  struct mplane_tuner_table *table;
  struct mplane_tuner_ctx *ctx;
};

static struct fixture make(const char *text, int active, size_t nranks, size_t nnodes) {
  struct fixture f = {0};
  char err[512] = "";
  if (mplane_tuner_table_parse("policy.csv", text, strlen(text), &f.table, err, sizeof(err)) != ncclSuccess)
    fail_msg("fixture table does not parse: %s", err);
  assert_int_equal(mplane_tuner_ctx_create(f.table, active, 0x1234, nranks, nnodes, &f.ctx), ncclSuccess);
  return f;
}

static void drop(struct fixture *f) {
  mplane_tuner_ctx_destroy(f->ctx);
  mplane_tuner_table_free(f->table);
}

/* Run the policy on a copy of `costs`; check that only (want_a, want_p) changed (or nothing, when
 * want_a < 0) and that NCCL would now pick want (or its own original pick). */
static enum mplane_tuner_outcome run(struct mplane_tuner_ctx *ctx, int coll, size_t nbytes, const float costs[NA][NP],
                                     int want_a, int want_p, int *nchannels) {
  float t[NA][NP];
  memcpy(t, costs, sizeof(t));
  const struct mplane_tuner_row *row = NULL;
  enum mplane_tuner_outcome out = mplane_tuner_ctx_apply(ctx, coll, nbytes, (float **)t, NA, NP, nchannels, &row);
  for (int a = 0; a < NA; a++)
    for (int p = 0; p < NP; p++) {
      if (a == want_a && p == want_p) continue;
      if (memcmp(&t[a][p], &costs[a][p], sizeof(float)) != 0)
        fail_msg("entry [%d][%d] changed from %g to %g", a, p, costs[a][p], t[a][p]);
    }
  int pa, pp, oa, op;
  nccl_pick(t, &pa, &pp);
  float orig[NA][NP];
  memcpy(orig, costs, sizeof(orig));
  nccl_pick(orig, &oa, &op);
  if (want_a >= 0) {
    assert_int_equal(out, MPLANE_TUNER_APPLIED);
    assert_non_null(row);
    assert_true(t[want_a][want_p] == 0.0f);
    assert_int_equal(pa, want_a);
    assert_int_equal(pp, want_p);
  } else {
    assert_int_not_equal(out, MPLANE_TUNER_APPLIED);
    assert_int_equal(pa, oa);
    assert_int_equal(pp, op);
  }
  return out;
}

static void test_row_makes_its_choice_cheapest(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,0,65536,tree,ll128,-1,1,8\n"
                                 "allreduce,65537,-1,nvls,simple,16,1,8\n",
                          1, 8, 1);
  int nch = 0;
  /* NCCL alone picks Ring/LL (6.5); the table says Tree/LL128 (9.1). */
  run(f.ctx, ncclFuncAllReduce, 4096, allreduce_costs, NCCL_ALGO_TREE, NCCL_PROTO_LL128, &nch);
  assert_int_equal(nch, 0); /* channels -1: left to NCCL */
  run(f.ctx, ncclFuncAllReduce, 1 << 20, allreduce_costs, NCCL_ALGO_NVLS, NCCL_PROTO_SIMPLE, &nch);
  assert_int_equal(nch, 16);
  drop(&f);
}

/* algorithm and protocol -1: the row sets the channel count and leaves NCCL's costs (so its choice)
 * as they were. */
static void test_channels_only_row(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,32K,1M,-1,-1,2,2,2\n", 1, 2, 2);
  int nch = 0;
  float t[NA][NP];
  memcpy(t, allreduce_costs, sizeof(t));
  const struct mplane_tuner_row *row = NULL;
  assert_int_equal(mplane_tuner_ctx_apply(f.ctx, ncclFuncAllReduce, 65536, (float **)t, NA, NP, &nch, &row),
                   MPLANE_TUNER_APPLIED);
  assert_non_null(row);
  assert_int_equal(nch, 2);
  assert_memory_equal(t, allreduce_costs, sizeof(t));
  nch = 0;
  run(f.ctx, ncclFuncAllReduce, 2 << 20, allreduce_costs, -1, -1, &nch); /* outside the range: nothing */
  assert_int_equal(nch, 0);
  drop(&f);
}

static void test_byte_range_is_inclusive(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,1024,2048,ring,simple,4,-1,-1\n", 1, 8, 1);
  int nch;
  size_t inside[] = {1024, 1500, 2048};
  for (size_t i = 0; i < sizeof(inside) / sizeof(inside[0]); i++) {
    nch = 0;
    run(f.ctx, ncclFuncAllReduce, inside[i], allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE, &nch);
    assert_int_equal(nch, 4);
  }
  size_t outside[] = {0, 1023, 2049, SIZE_MAX};
  for (size_t i = 0; i < sizeof(outside) / sizeof(outside[0]); i++) {
    nch = 0;
    assert_int_equal(run(f.ctx, ncclFuncAllReduce, outside[i], allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
    assert_int_equal(nch, 0);
  }
  drop(&f);
}

static void test_ignored_entry_is_never_chosen(void **state) {
  (void)state;
  /* PAT is ignored for this allreduce, and NVLS has no LL: NCCL's table must stay as it is. */
  struct fixture f = make(HEADER "allreduce,0,1000,pat,simple,8,-1,-1\n"
                                 "allreduce,1001,-1,nvls,ll,8,-1,-1\n",
                          1, 8, 1);
  int nch = 0;
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 100, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_UNAVAILABLE);
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 5000, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_UNAVAILABLE);
  assert_int_equal(nch, 0); /* channels belong to the row's choice: not applied either */
  /* The same PAT row on an allgather, where NCCL offers PAT, applies. */
  drop(&f);
  f = make(HEADER "any,0,1000,pat,simple,8,-1,-1\n", 1, 8, 1);
  run(f.ctx, ncclFuncAllGather, 100, allgather_costs, NCCL_ALGO_PAT, NCCL_PROTO_SIMPLE, &nch);
  assert_int_equal(nch, 8);
  nch = 0;
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 100, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_UNAVAILABLE);
  drop(&f);
}

static void test_first_row_wins(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,0,8192,ring,ll128,-1,-1,-1\n"
                                 "allreduce,4096,65536,tree,simple,-1,-1,-1\n",
                          1, 8, 1);
  assert_int_equal(f.table->rows[1].overlaps_line, 2);
  int nch = 0;
  run(f.ctx, ncclFuncAllReduce, 4096, allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_LL128, &nch);
  run(f.ctx, ncclFuncAllReduce, 8192, allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_LL128, &nch);
  run(f.ctx, ncclFuncAllReduce, 8193, allreduce_costs, NCCL_ALGO_TREE, NCCL_PROTO_SIMPLE, &nch);
  /* A first row that matches but is unusable decides too: NCCL's choice, not the later row's. */
  drop(&f);
  f = make(HEADER "allreduce,0,8192,collnet_direct,simple,-1,-1,-1\n"
                  "allreduce,0,8192,tree,simple,-1,-1,-1\n",
           1, 8, 1);
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 100, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_UNAVAILABLE);
  drop(&f);
}

static void test_communicator_shape_filters_rows(void **state) {
  (void)state;
  const char *text = HEADER "allreduce,0,-1,tree,simple,-1,2,16\n" /* 2 nodes x 8 */
                            "allreduce,0,-1,ring,ll128,-1,1,-1\n"  /* any single node */
                            "allreduce,0,-1,ring,simple,-1,-1,4\n" /* any 4-rank comm */
                            "allgather,0,-1,ring,ll,-1,-1,-1\n";
  struct fixture f = make(text, 1, 16, 2);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllReduce), 1);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllGather), 1);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncBroadcast), 0);
  int nch = 0;
  run(f.ctx, ncclFuncAllReduce, 1 << 20, allreduce_costs, NCCL_ALGO_TREE, NCCL_PROTO_SIMPLE, &nch);
  drop(&f);
  f = make(text, 1, 8, 1);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllReduce), 1);
  run(f.ctx, ncclFuncAllReduce, 1 << 20, allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_LL128, &nch);
  drop(&f);
  f = make(text, 1, 4, 2);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllReduce), 1);
  run(f.ctx, ncclFuncAllReduce, 1 << 20, allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE, &nch);
  drop(&f);
  f = make(text, 1, 32, 4);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllReduce), 0);
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 1 << 20, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  drop(&f);
}

static void test_collective_filters_rows(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allgather,0,-1,ring,ll128,-1,-1,-1\n"
                                 "any,0,100,ring,simple,2,-1,-1\n",
                          1, 8, 1);
  int nch = 0;
  run(f.ctx, ncclFuncAllGather, 50, allgather_costs, NCCL_ALGO_RING, NCCL_PROTO_LL128, &nch);
  assert_int_equal(nch, 0);
  run(f.ctx, ncclFuncAllReduce, 50, allreduce_costs, NCCL_ALGO_RING, NCCL_PROTO_SIMPLE, &nch);
  assert_int_equal(nch, 2);
  nch = 0;
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 500, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  /* Functions without a cost table row of their own (send/recv, all-to-all) are left alone. */
  assert_int_equal(run(f.ctx, ncclFuncSendRecv, 50, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  assert_int_equal(run(f.ctx, ncclFuncAlltoAll, 50, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  assert_int_equal(run(f.ctx, -1, 50, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  assert_int_equal(nch, 0);
  drop(&f);
}

static void test_inactive_context_changes_nothing(void **state) {
  (void)state;
  /* Inactive: NCCL_ALGO/NCCL_PROTO set by the user. NULL table: no MPLANE_TUNER_CONFIG. */
  struct fixture f = make(HEADER "any,0,-1,tree,ll128,8,-1,-1\n", 0, 8, 1);
  int nch = 0;
  assert_int_equal(run(f.ctx, ncclFuncAllReduce, 4096, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  assert_int_equal(nch, 0);
  drop(&f);
  struct mplane_tuner_ctx *ctx;
  assert_int_equal(mplane_tuner_ctx_create(NULL, 1, 1, 8, 1, &ctx), ncclSuccess);
  assert_int_equal(run(ctx, ncclFuncAllReduce, 4096, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  assert_int_equal(run(NULL, ncclFuncAllReduce, 4096, allreduce_costs, -1, -1, &nch), MPLANE_TUNER_PASS);
  mplane_tuner_ctx_destroy(ctx);
}

/* A smaller table than the row names (an older or trimmed NCCL): no write outside it. */
static void test_rows_beyond_the_table_are_not_written(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,0,-1,pat,simple,-1,-1,-1\n"
                                 "allgather,0,-1,ring,ll128,-1,-1,-1\n",
                          1, 8, 1);
  float t[2 * 2 + 4];
  for (int i = 0; i < 8; i++) t[i] = 1.0f + (float)i;
  int nch = 0;
  assert_int_equal(mplane_tuner_ctx_apply(f.ctx, ncclFuncAllReduce, 10, (float **)t, 2, 2, &nch, NULL),
                   MPLANE_TUNER_UNAVAILABLE);
  for (int i = 0; i < 8; i++) assert_true(t[i] == 1.0f + (float)i);
  /* Ring/LL128 exists in a 2x2 table: it is entry [1][1], the fourth float; the guard stays. */
  assert_int_equal(mplane_tuner_ctx_apply(f.ctx, ncclFuncAllGather, 10, (float **)t, 2, 2, &nch, NULL),
                   MPLANE_TUNER_APPLIED);
  assert_true(t[3] == 0.0f);
  for (int i = 0; i < 8; i++)
    if (i != 3) assert_true(t[i] == 1.0f + (float)i);
  drop(&f);
}

/* The layout of a 7x3 table read with another stride must pick the right cell: [ring][ll128] is the
 * fifth float, not the second. */
static void test_layout_is_algorithm_major(void **state) {
  (void)state;
  struct fixture f = make(HEADER "allreduce,0,-1,ring,ll128,-1,-1,-1\n", 1, 8, 1);
  float flat[NA * NP];
  memcpy(flat, allreduce_costs, sizeof(flat));
  assert_int_equal(mplane_tuner_ctx_apply(f.ctx, ncclFuncAllReduce, 10, (float **)flat, NA, NP, NULL, NULL),
                   MPLANE_TUNER_APPLIED);
  assert_true(flat[NCCL_ALGO_RING * NP + NCCL_PROTO_LL128] == 0.0f);
  assert_true(flat[1] == allreduce_costs[0][1]);
  drop(&f);
}

/* The lookup is bounded by the rows kept for the collective: a full table of other collectives costs
 * an allreduce nothing, and a full allreduce table still answers right at its last row. */
static void test_large_table(void **state) {
  (void)state;
  size_t cap = 128 + (size_t)MPLANE_TUNER_MAX_ROWS * 48;
  char *text = malloc(cap);
  assert_non_null(text);
  size_t off = (size_t)sprintf(text, HEADER);
  for (int i = 0; i < MPLANE_TUNER_MAX_ROWS - 1; i++)
    off += (size_t)sprintf(text + off, "broadcast,%d,%d,ring,ll,-1,-1,-1\n", i * 10, i * 10 + 9);
  off += (size_t)sprintf(text + off, "allreduce,0,-1,tree,ll,-1,-1,-1\n");
  struct fixture f = make(text, 1, 8, 1);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncAllReduce), 1);
  assert_int_equal(mplane_tuner_ctx_rows(f.ctx, ncclFuncBroadcast), MPLANE_TUNER_MAX_ROWS - 1);
  int nch = 0;
  run(f.ctx, ncclFuncAllReduce, 123, allreduce_costs, NCCL_ALGO_TREE, NCCL_PROTO_LL, &nch);
  run(f.ctx, ncclFuncBroadcast, (size_t)(MPLANE_TUNER_MAX_ROWS - 2) * 10 + 5, allreduce_costs, NCCL_ALGO_RING,
      NCCL_PROTO_LL, &nch);
  drop(&f);
  free(text);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_row_makes_its_choice_cheapest),
      cmocka_unit_test(test_channels_only_row),
      cmocka_unit_test(test_byte_range_is_inclusive),
      cmocka_unit_test(test_ignored_entry_is_never_chosen),
      cmocka_unit_test(test_first_row_wins),
      cmocka_unit_test(test_communicator_shape_filters_rows),
      cmocka_unit_test(test_collective_filters_rows),
      cmocka_unit_test(test_inactive_context_changes_nothing),
      cmocka_unit_test(test_rows_beyond_the_table_are_not_written),
      cmocka_unit_test(test_layout_is_algorithm_major),
      cmocka_unit_test(test_large_table),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
