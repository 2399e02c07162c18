/* The planner the GPU build uses (collectives/ep/ep_plan.h, ep_sched.c), run for all ranks on the
 * CPU (ep_sim.c), against the independent reference model (ep_model.c) on many random routings:
 * uniform, DeepSeek-V3 gated, all experts on one node, every node, dropped/invalid/repeated ids;
 * FP8 and BF16; normal and worst-case (CUDA-graph) offsets; the flat baseline; contiguous and
 * shuffled rank-to-node maps. Dispatch outputs and combine outputs must match bit for bit, network
 * and NVLink bytes must equal the model's, and FP8 results must be within the documented
 * tolerance of x * sum(weights). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ep_check.h"
#include "ep_model.h"
#include "ep_num.h"
#include "ep_plan.h"
#include "ep_ref.h"
#include "ep_sim.h"

typedef struct shape {
  int R, G, E, K, H, Tmax;
  int shuffled; /* ranks not grouped by node */
} shape;

typedef struct result {
  long cases, rows, tokens;
  double worst_fp8_ratio;
} result;

static result totals;

/* Shuffled topology: node of rank r = a permutation, locals by rank order within the node. */
static void make_topology(const shape *sh, int *node_of, int *local_of) {
  int N = sh->R / sh->G;
  int *count = calloc((size_t)N, sizeof(int));
  for (int r = 0; r < sh->R; r++) {
    node_of[r] = sh->shuffled ? ((r * 7 + 3) % sh->R) % N : r / sh->G;
  }
  /* (7r + 3) mod R is a permutation when R is odd or even but not a multiple of 7; mod N balances it */
  for (int r = 0; r < sh->R; r++) local_of[r] = count[node_of[r]]++;
  for (int n = 0; n < N; n++) assert_int_equal(count[n], sh->G);
  free(count);
}

static void run_case(const shape *sh, int kind, int fmt, int graph, int flat, uint64_t seed) {
  int R = sh->R, H = sh->H, K = sh->K, E = sh->E;
  int node_of[64], local_of[64];
  make_topology(sh, node_of, local_of);
  int T[64];
  int32_t *idx[64];
  float *w[64];
  uint16_t *x[64];
  uint64_t rs = seed;
  for (int r = 0; r < R; r++) {
    /* varying token counts, zero included */
    T[r] = (int)(mp_ep_rand_next(&rs) % (uint64_t)(sh->Tmax + 1));
    if (r == 1) T[r] = 0;
    if (r == 0) T[r] = sh->Tmax;
    idx[r] = malloc(sizeof(int32_t) * ((size_t)T[r] * K + 1));
    w[r] = malloc(sizeof(float) * ((size_t)T[r] * K + 1));
    x[r] = malloc(2 * ((size_t)T[r] * H + 1));
    /* the generators assume contiguous nodes; with a shuffled map the "node" kinds become
     * arbitrary rank sets, which is fine for the comparison */
    mp_ep_gen_routing(kind, seed, r, R, sh->G, E, K, T[r], idx[r], w[r]);
    mp_ep_gen_tokens(seed, r, T[r], H, x[r]);
  }
  mp_ep_model_cfg mc = {R, sh->G, node_of, local_of, E, K, H, fmt, flat};
  mp_ep_model *m = mp_ep_model_run(&mc, T, (const int32_t *const *)idx, (const float *const *)w,
                                   (const uint16_t *const *)x);
  assert_non_null(m);
  mp_ep_sim_cfg sc = {R, sh->G, node_of, local_of, E, K, H, sh->Tmax, graph, flat, 0};
  char err[512] = "";
  mp_ep_sim *s = mp_ep_sim_create(&sc, err, sizeof(err));
  if (!s) fail_msg("sim create: %s", err);
  char where[256];
  snprintf(where, sizeof(where), "R=%d G=%d E=%d K=%d H=%d Tmax=%d %s %s %s%s%s seed=%llu", R, sh->G, E, K, H, sh->Tmax,
           mp_ep_route_kind_name(kind), fmt == MP_EP_FMT_FP8 ? "fp8" : "bf16", graph ? "worst-case" : "normal",
           flat ? " flat" : "", sh->shuffled ? " shuffled" : "", (unsigned long long)seed);
  if (mp_ep_sim_layout(s, T, (const int32_t *const *)idx)) fail_msg("%s: layout: %s", where, mp_ep_sim_error(s));
  if (mp_ep_sim_dispatch(s, fmt, (const uint16_t *const *)x, (const float *const *)w))
    fail_msg("%s: dispatch: %s", where, mp_ep_sim_error(s));
  int Er = E / R;
  uint16_t *y[64], *out[64], *want[64];
  for (int d = 0; d < R; d++) {
    mp_ep_sim_result res;
    mp_ep_sim_result_of(s, d, &res);
    assert_int_equal(res.overflow, 0);
    char msg[512] = "";
    long bad = mp_ep_check_dispatch(m, d, fmt, H, res.nrows, res.expert_off, Er, res.x, res.scale, res.w, res.src, msg,
                                    sizeof(msg));
    if (bad) fail_msg("%s: dispatch differs from the model (%ld fields): %s", where, bad, msg);
    totals.rows += res.nrows;
    /* identity experts for FP8 (exercises dequantisation), random outputs for BF16 */
    int nrows = mp_ep_model_rank_out(m, d)->nrows;
    y[d] = malloc(2 * ((size_t)nrows * H + 1));
    if (fmt == MP_EP_FMT_FP8) {
      mp_ep_model_identity(m, d, y[d]);
    } else {
      uint64_t ys = seed ^ (uint64_t)(d * 31 + 5);
      for (long i = 0; i < (long)nrows * H; i++) y[d][i] = mp_f32_to_bf16((float)(mp_ep_rand_unit(&ys) * 4.0 - 2.0));
    }
  }
  for (int r = 0; r < R; r++) {
    out[r] = malloc(2 * ((size_t)T[r] * H + 1));
    want[r] = malloc(2 * ((size_t)T[r] * H + 1));
    memset(out[r], 0xff, 2 * ((size_t)T[r] * H + 1));
  }
  if (mp_ep_sim_combine(s, (const uint16_t *const *)y, out)) fail_msg("%s: combine: %s", where, mp_ep_sim_error(s));
  mp_ep_model_combine(m, (const uint16_t *const *)y, want);
  for (int r = 0; r < R; r++) {
    char msg[512] = "";
    long bad = mp_ep_check_exact(out[r], want[r], (long)T[r] * H, msg, sizeof(msg));
    if (bad) fail_msg("%s: combine at rank %d differs from the model (%ld values): %s", where, r, bad, msg);
    totals.tokens += T[r];
    if (fmt == MP_EP_FMT_FP8) {
      double ratio = 0;
      bad = mp_ep_check_tolerance(fmt, T[r], H, K, E, x[r], idx[r], w[r], out[r], &ratio, msg, sizeof(msg));
      if (bad) fail_msg("%s: rank %d outside the FP8 tolerance (%ld values): %s", where, r, bad, msg);
      if (ratio > totals.worst_fp8_ratio) totals.worst_fp8_ratio = ratio;
    }
  }
  /* bytes: normal mode moves exactly what the model says */
  if (!graph) {
    mp_ep_model_bytes b;
    long txd[64], txc[64];
    mp_ep_model_count(&mc, T, (const int32_t *const *)idx, &b, txd, txc);
    long net[MP_EP_NSTEPS], nvl[MP_EP_NSTEPS], sum_net[MP_EP_NSTEPS] = {0}, sum_nvl[MP_EP_NSTEPS] = {0};
    for (int r = 0; r < R; r++) {
      mp_ep_sim_bytes(s, r, net, nvl);
      for (int i = 0; i < MP_EP_NSTEPS; i++) {
        sum_net[i] += net[i];
        sum_nvl[i] += nvl[i];
      }
      if (net[MP_EP_STEP_D1] != txd[r]) fail_msg("%s: rank %d dispatch network bytes %ld, model %ld", where, r, net[MP_EP_STEP_D1], txd[r]);
      if (net[MP_EP_STEP_C1] + net[MP_EP_STEP_C2] != txc[r])
        fail_msg("%s: rank %d combine network bytes %ld, model %ld", where, r, net[MP_EP_STEP_C1], txc[r]);
    }
    if (flat) {
      assert_int_equal(sum_net[MP_EP_STEP_D1], b.flat_d_net_bytes);
      assert_int_equal(sum_nvl[MP_EP_STEP_D1], b.flat_d_nvl_bytes);
      assert_int_equal(sum_net[MP_EP_STEP_C1], b.flat_c_net_bytes);
      assert_int_equal(sum_nvl[MP_EP_STEP_C1], b.flat_c_nvl_bytes);
    } else {
      if (sum_net[MP_EP_STEP_D1] != b.d_net_bytes)
        fail_msg("%s: dispatch network bytes %ld, model %ld", where, sum_net[MP_EP_STEP_D1], b.d_net_bytes);
      assert_int_equal(sum_nvl[MP_EP_STEP_D1], 0); /* phase 1 stays on its plane: network only */
      if (sum_nvl[MP_EP_STEP_D2] != b.d_nvl_bytes)
        fail_msg("%s: dispatch NVLink bytes %ld, model %ld", where, sum_nvl[MP_EP_STEP_D2], b.d_nvl_bytes);
      assert_int_equal(sum_net[MP_EP_STEP_D2], 0);
      assert_int_equal(sum_net[MP_EP_STEP_C1], b.c_net_bytes);
      assert_int_equal(sum_nvl[MP_EP_STEP_C2], b.c_nvl_bytes);
    }
  }
  for (int r = 0; r < R; r++) {
    free(idx[r]);
    free(w[r]);
    free(x[r]);
    free(y[r]);
    free(out[r]);
    free(want[r]);
  }
  mp_ep_sim_free(s);
  mp_ep_model_free(m);
  totals.cases++;
}

static const shape shapes[] = {
    {1, 1, 8, 4, 128, 9, 0},    /* one GPU */
    {2, 1, 16, 4, 128, 20, 0},  /* two emulated nodes of one GPU */
    {2, 2, 16, 6, 256, 20, 0},  /* one node of two GPUs */
    {4, 2, 32, 8, 128, 24, 0},  /* two nodes of two */
    {4, 2, 8, 3, 128, 17, 1},   /* shuffled rank map, 2 experts a rank */
    {4, 1, 16, 2, 128, 12, 0},  /* four nodes of one */
    {4, 4, 64, 8, 128, 16, 0},  /* one node of four */
    {6, 3, 24, 5, 128, 15, 0},  /* odd sizes */
    {8, 2, 64, 8, 256, 20, 1},  /* four nodes of two, shuffled */
    {8, 4, 32, 4, 128, 14, 0},
    {16, 8, 256, 8, 128, 12, 0}, /* two nodes of eight, DeepSeek-like expert count */
    {12, 4, 48, 7, 128, 10, 0},
};

static void test_random_routings(void **state) {
  (void)state;
  uint64_t seed = 1;
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    for (int kind = 0; kind < MP_EP_ROUTE_KINDS; kind++)
      for (int fmt = 0; fmt < 2; fmt++) run_case(&shapes[i], kind, fmt, 0, 0, seed++);
}

static void test_worst_case_mode(void **state) {
  (void)state;
  uint64_t seed = 1000;
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    for (int kind = 0; kind < MP_EP_ROUTE_KINDS; kind += 2) run_case(&shapes[i], kind, (int)(i & 1), 1, 0, seed++);
}

static void test_flat_baseline(void **state) {
  (void)state;
  uint64_t seed = 2000;
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    for (int kind = 0; kind < MP_EP_ROUTE_KINDS; kind++) run_case(&shapes[i], kind, (int)((i + kind) & 1), kind == 3, 1, seed++);
}

static void test_many_seeds(void **state) {
  (void)state;
  /* more seeds on the shapes the GPU machine runs (2 GPUs) and a 4-node one */
  for (uint64_t seed = 5000; seed < 5040; seed++) {
    run_case(&shapes[1], (int)(seed % MP_EP_ROUTE_KINDS), (int)(seed & 1), (int)((seed >> 1) & 1), 0, seed);
    run_case(&shapes[2], (int)(seed % MP_EP_ROUTE_KINDS), (int)(seed & 1), (int)((seed >> 2) & 1), 0, seed);
    run_case(&shapes[8], (int)(seed % MP_EP_ROUTE_KINDS), (int)(seed & 1), 0, 0, seed);
  }
  printf("ep sim: %ld cases, %ld expert rows, %ld tokens matched the model; worst FP8 error / tolerance %.3f\n",
         totals.cases, totals.rows, totals.tokens, totals.worst_fp8_ratio);
}

/* A token with every expert on the source's own node crosses no network; one reaching every node
 * crosses it once per remote node, not once per expert. */
static void test_node_limit_extremes(void **state) {
  (void)state;
  for (int kind = MP_EP_ROUTE_ONE_NODE; kind <= MP_EP_ROUTE_ALL_NODES; kind++) {
    int T[8];
    int32_t *idx[8];
    float *w[8];
    for (int r = 0; r < 8; r++) {
      T[r] = 16;
      idx[r] = malloc(sizeof(int32_t) * 16 * 8);
      w[r] = malloc(sizeof(float) * 16 * 8);
      mp_ep_gen_routing(kind, 77, r, 8, 2, 64, 8, 16, idx[r], w[r]);
    }
    mp_ep_model_cfg mc = {8, 2, NULL, NULL, 64, 8, 128, MP_EP_FMT_FP8, 0};
    mp_ep_model_bytes b;
    mp_ep_model_count(&mc, T, (const int32_t *const *)idx, &b, NULL, NULL);
    if (kind == MP_EP_ROUTE_ONE_NODE) {
      assert_true(b.remote_nodes < b.tokens); /* some tokens stay home */
      assert_true(b.remote_nodes <= b.tokens);
    } else {
      assert_int_equal(b.remote_nodes, b.tokens * 3); /* 4 nodes: 3 remote ones each */
      assert_true(b.flat_net_rows > b.net_rows);       /* 6 remote experts vs 3 remote nodes */
    }
    for (int r = 0; r < 8; r++) {
      free(idx[r]);
      free(w[r]);
    }
  }
}

static void test_topology_from_keys(void **state) {
  (void)state;
  uint64_t keys[6] = {7, 9, 7, 9, 7, 9};
  int N, G, node_of[6], local_of[6], rank_of[6];
  char err[256];
  assert_int_equal(mp_ep_topology_from_keys(6, keys, 0, &N, &G, node_of, local_of, rank_of, err, sizeof(err)), 0);
  assert_int_equal(N, 2);
  assert_int_equal(G, 3);
  assert_int_equal(node_of[1], 1);
  assert_int_equal(local_of[4], 2);
  assert_int_equal(rank_of[1 * 3 + 1], 3);
  assert_int_equal(mp_ep_topology_from_keys(6, keys, 2, &N, &G, node_of, local_of, rank_of, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "gpus_per_node=2"));
  uint64_t uneven[3] = {1, 1, 2};
  assert_int_equal(mp_ep_topology_from_keys(3, uneven, 0, &N, &G, node_of, local_of, rank_of, err, sizeof(err)), -1);
  assert_non_null(strstr(err, "different GPU counts"));
}

/* Worst-case mode with too few expert rows: the status says so, nothing is written past the end. */
static void test_overflow_flag(void **state) {
  (void)state;
  int T[2] = {10, 10};
  int32_t *idx[2];
  float *w[2];
  uint16_t *x[2];
  for (int r = 0; r < 2; r++) {
    idx[r] = malloc(sizeof(int32_t) * 40);
    w[r] = malloc(sizeof(float) * 40);
    x[r] = malloc(2 * 10 * 128);
    mp_ep_gen_routing(MP_EP_ROUTE_UNIFORM, 3, r, 2, 1, 8, 4, 10, idx[r], w[r]);
    mp_ep_gen_tokens(3, r, 10, 128, x[r]);
  }
  mp_ep_sim_cfg sc = {2, 1, NULL, NULL, 8, 4, 128, 10, 1, 0, 5};
  char err[256];
  mp_ep_sim *s = mp_ep_sim_create(&sc, err, sizeof(err));
  assert_non_null(s);
  assert_int_equal(mp_ep_sim_layout(s, T, (const int32_t *const *)idx), 0);
  assert_int_equal(mp_ep_sim_dispatch(s, MP_EP_FMT_FP8, (const uint16_t *const *)x, (const float *const *)w), 0);
  mp_ep_sim_result res;
  mp_ep_sim_result_of(s, 0, &res);
  assert_int_equal(res.overflow, 1);
  assert_true(res.nrows > 5);
  mp_ep_sim_free(s);
  for (int r = 0; r < 2; r++) {
    free(idx[r]);
    free(w[r]);
    free(x[r]);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_random_routings),    cmocka_unit_test(test_worst_case_mode),
      cmocka_unit_test(test_flat_baseline),      cmocka_unit_test(test_node_limit_extremes),
      cmocka_unit_test(test_topology_from_keys), cmocka_unit_test(test_overflow_flag),
      cmocka_unit_test(test_many_seeds),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
