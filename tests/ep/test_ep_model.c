/* libmplane-ep reference model (collectives/ep/ep_model.c) on cases worked out by hand: bytes per
 * phase (the node-limited formula M*H*(1 + 4/128) + M*H*2 against one copy per expert), the
 * NVLink forwarding count, row order, and combine values. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#include <cmocka.h>

#include "ep_check.h"
#include "ep_model.h"
#include "ep_num.h"
#include "ep_plan.h"

/* 8 ranks, 2 GPUs per node (4 nodes), 16 experts (2 per rank), top-4, hidden 128. */
static mp_ep_model_cfg cfg8(int fmt) {
  mp_ep_model_cfg c;
  memset(&c, 0, sizeof(c));
  c.R = 8;
  c.G = 2;
  c.E = 16;
  c.K = 4;
  c.H = 128;
  c.fmt = fmt;
  return c;
}

static void test_bytes_one_token(void **state) {
  (void)state;
  mp_ep_model_cfg c = cfg8(MP_EP_FMT_FP8);
  /* rank 0 (node 0, local 0): experts 4,6 (ranks 2,3: node 1), 10 (rank 5: node 2), 14 (rank 7: node 3) */
  int32_t idx0[4] = {4, 6, 10, 14};
  int32_t none[1] = {0};
  const int32_t *idx[8] = {idx0, none, none, none, none, none, none, none};
  int T[8] = {1, 0, 0, 0, 0, 0, 0, 0};
  mp_ep_model_bytes b;
  long txd[8], txc[8];
  mp_ep_model_count(&c, T, idx, &b, txd, txc);
  assert_int_equal(b.tokens, 1);
  assert_int_equal(b.pairs, 4);
  assert_int_equal(b.remote_nodes, 3);                  /* M = 3 */
  assert_int_equal(b.net_rows, 3);                      /* one network copy per remote node */
  assert_int_equal(b.nvl_rows, 3);                      /* rank 2 -> 3; ranks 4, 6 (forwarders) -> 5, 7 */
  assert_int_equal(b.d_net_payload, 3 * 128 + 3 * 4);   /* M*H*(1 + 4/128) */
  assert_int_equal(b.c_net_bytes, 3 * 128 * 2);         /* M*H*2 */
  assert_int_equal(b.flat_net_rows, 4);                 /* a plain all-to-all sends every expert its copy */
  assert_int_equal(b.flat_nvl_rows, 0);
  assert_int_equal(b.recv_entries, 4);
  long ds = mp_ep_dstride(MP_EP_FMT_FP8, 128, 4, 2);
  assert_int_equal(b.d_net_bytes, 3 * ds);
  /* rank 0 sends the dispatch; forwarders 2, 4, 6 send the combine back */
  assert_int_equal(txd[0], 3 * ds);
  assert_int_equal(txc[2], 256);
  assert_int_equal(txc[4], 256);
  assert_int_equal(txc[6], 256);
  assert_int_equal(txc[0] + txc[1] + txc[3] + txc[5] + txc[7], 0);
}

static void test_bytes_own_node_and_dropped(void **state) {
  (void)state;
  mp_ep_model_cfg c = cfg8(MP_EP_FMT_BF16);
  /* rank 3 (node 1, local 1): token 0 all on its own node (ranks 2, 3), token 1 dropped
   * (ids -1, out of range, repeats), token 2 = expert 0 twice (kept once) on node 0 */
  int32_t idx3[12] = {4, 5, 6, -1, -1, 99, -7, -1, 0, 0, -1, -1};
  int32_t none[1] = {0};
  const int32_t *idx[8] = {none, none, none, idx3, none, none, none, none};
  int T[8] = {0, 0, 0, 3, 0, 0, 0, 0};
  mp_ep_model_bytes b;
  mp_ep_model_count(&c, T, idx, &b, NULL, NULL);
  assert_int_equal(b.tokens, 2);
  assert_int_equal(b.pairs, 4);
  assert_int_equal(b.remote_nodes, 1);
  assert_int_equal(b.net_rows, 1);
  /* token 0: forwarder is rank 3 itself, copies to rank 2; token 2: forwarder (node 0, local 1) =
   * rank 1 copies to rank 0 */
  assert_int_equal(b.nvl_rows, 2);
  assert_int_equal(b.d_net_payload, 2 * 128);
  assert_int_equal(b.flat_net_rows, 1);
  assert_int_equal(b.flat_nvl_rows, 2); /* experts 4, 5 on rank 2 (two copies), expert 6 on rank 3 (self) */
}

static void test_deepseek_formula(void **state) {
  (void)state;
  /* a token whose 8 experts sit on 4 remote nodes of 8 GPUs: 4 copies, not 8 */
  mp_ep_model_cfg c;
  memset(&c, 0, sizeof(c));
  c.R = 64;
  c.G = 8;
  c.E = 256;
  c.K = 8;
  c.H = 7168;
  c.fmt = MP_EP_FMT_FP8;
  int32_t row[8] = {32, 36, 64, 70, 96, 100, 128, 140}; /* nodes 1, 2, 3, 4 (32 experts a node) */
  int32_t none[1] = {0};
  const int32_t *idx[64];
  int T[64];
  for (int r = 0; r < 64; r++) {
    idx[r] = none;
    T[r] = 0;
  }
  idx[0] = row;
  T[0] = 1;
  mp_ep_model_bytes b;
  mp_ep_model_count(&c, T, idx, &b, NULL, NULL);
  assert_int_equal(b.remote_nodes, 4);
  assert_int_equal(b.d_net_payload, 4L * (7168 + 7168 / 128 * 4)); /* M*H*(1 + 4/128) = 29.6 KB */
  assert_int_equal(b.c_net_bytes, 4L * 7168 * 2);            /* 57.3 KB */
  assert_int_equal(b.flat_net_rows, 8);
  assert_int_equal(b.nvl_rows, 4); /* each node: the plane's GPU forwards to the second target GPU */
}

static void test_rows_order_and_combine(void **state) {
  (void)state;
  mp_ep_model_cfg c = cfg8(MP_EP_FMT_BF16);
  int H = 128;
  /* every rank sends token t -> expert 8 (rank 4) with weight 0.5, and token 1 also expert 9 */
  int32_t idx[8][8];
  float w[8][8];
  uint16_t x[8][2 * 128];
  const int32_t *ip[8];
  const float *wp[8];
  const uint16_t *xp[8];
  int T[8];
  for (int s = 0; s < 8; s++) {
    T[s] = 2;
    int32_t r0[4] = {8, -1, -1, -1}, r1[4] = {9, 8, -1, -1};
    memcpy(idx[s], r0, sizeof(r0));
    memcpy(idx[s] + 4, r1, sizeof(r1));
    for (int i = 0; i < 8; i++) w[s][i] = 0.5f;
    for (int h = 0; h < 2 * H; h++) x[s][h] = mp_f32_to_bf16((float)(s * 1000 + h));
    ip[s] = idx[s];
    wp[s] = w[s];
    xp[s] = x[s];
  }
  mp_ep_model *m = mp_ep_model_run(&c, T, ip, wp, xp);
  assert_non_null(m);
  const mp_ep_model_rank *o = mp_ep_model_rank_out(m, 4);
  assert_int_equal(o->nrows, 24);
  assert_int_equal(o->expert_off[0], 0);
  assert_int_equal(o->expert_off[1], 16); /* expert 8: two tokens from each of 8 ranks */
  assert_int_equal(o->expert_off[2], 24);
  /* order: source local index, then source node, then token: ranks 0,2,4,6 (local 0) first */
  const int order[8] = {0, 2, 4, 6, 1, 3, 5, 7};
  for (int i = 0; i < 16; i++) {
    assert_int_equal(o->rows[i].src_rank, order[i / 2]);
    assert_int_equal(o->rows[i].src_token, i % 2);
  }
  for (int i = 0; i < 8; i++) assert_int_equal(o->rows[16 + i].src_rank, order[i]);
  for (int r = 0; r < 8; r++) assert_int_equal(mp_ep_model_rank_out(m, r)->nrows, r == 4 ? 24 : 0);
  /* identity experts: token 0 -> 0.5 x; token 1 -> (0.5 + 0.5) x */
  uint16_t *y[8], *out[8];
  for (int d = 0; d < 8; d++) {
    y[d] = calloc((size_t)(mp_ep_model_rank_out(m, d)->nrows + 1) * H, 2);
    mp_ep_model_identity(m, d, y[d]);
    out[d] = calloc(2 * (size_t)H, 2);
  }
  mp_ep_model_combine(m, (const uint16_t *const *)y, out);
  for (int s = 0; s < 8; s++)
    for (int h = 0; h < H; h++) {
      float x0 = mp_bf16_to_f32(x[s][h]), x1 = mp_bf16_to_f32(x[s][H + h]);
      assert_true(mp_bf16_to_f32(out[s][h]) == mp_bf16_to_f32(mp_f32_to_bf16(0.5f * x0)));
      assert_true(mp_bf16_to_f32(out[s][H + h]) == mp_bf16_to_f32(mp_f32_to_bf16(x1)));
    }
  for (int d = 0; d < 8; d++) {
    free(y[d]);
    free(out[d]);
  }
  mp_ep_model_free(m);
}

static void test_combine_rounding_points(void **state) {
  (void)state;
  /* 2 nodes x 2 GPUs; one token from rank 0 to experts on ranks 2 and 3 (node 1) and rank 1.
   * y values chosen so the BF16 rounding after each reduction level is visible. */
  mp_ep_model_cfg c;
  memset(&c, 0, sizeof(c));
  c.R = 4;
  c.G = 2;
  c.E = 4;
  c.K = 3;
  c.H = 128;
  c.fmt = MP_EP_FMT_BF16;
  int32_t idx0[3] = {2, 3, 1};
  float w0[3] = {1.0f, 1.0f, 1.0f};
  uint16_t x0[128];
  for (int h = 0; h < 128; h++) x0[h] = mp_f32_to_bf16(1.0f);
  int32_t none[1] = {0};
  float wn[1] = {0};
  uint16_t xn[1] = {0};
  const int32_t *ip[4] = {idx0, none, none, none};
  const float *wp[4] = {w0, wn, wn, wn};
  const uint16_t *xp[4] = {x0, xn, xn, xn};
  int T[4] = {1, 0, 0, 0};
  mp_ep_model *m = mp_ep_model_run(&c, T, ip, wp, xp);
  assert_non_null(m);
  uint16_t y1[128], y2[128], y3[128], out0[128];
  for (int h = 0; h < 128; h++) {
    y1[h] = mp_f32_to_bf16(256.0f); /* rank 1 (own node) */
    y2[h] = mp_f32_to_bf16(1.0f);   /* rank 2 */
    y3[h] = mp_f32_to_bf16(1.0f);   /* rank 3 */
  }
  uint16_t *yp[4] = {NULL, y1, y2, y3}, *op[4] = {out0, NULL, NULL, NULL};
  mp_ep_model_combine(m, (const uint16_t *const *)yp, op);
  /* node 1: 1 + 1 = 2 (exact); node 0: 256; total 258 -> bf16 has 8 bits: 258 exact */
  assert_true(mp_bf16_to_f32(out0[0]) == 258.0f);
  /* now y2 = y3 = 0.5: node 1 partial 1.0, total 257 -> ties to even -> 256 */
  for (int h = 0; h < 128; h++) y2[h] = y3[h] = mp_f32_to_bf16(0.5f);
  mp_ep_model_combine(m, (const uint16_t *const *)yp, op);
  assert_true(mp_bf16_to_f32(out0[0]) == 256.0f);
  mp_ep_model_free(m);
}

static void test_tolerance_formula(void **state) {
  (void)state;
  /* BF16: three roundings plus slack; FP8: a sixteenth of |x| plus the subnormal step */
  assert_true(mp_ep_tolerance(MP_EP_FMT_BF16, 1.0, 1.0, 1.0) < 0.01);
  assert_true(mp_ep_tolerance(MP_EP_FMT_BF16, 1.0, 1.0, 1.0) > 3 * ldexp(1.0, -9));
  double t8 = mp_ep_tolerance(MP_EP_FMT_FP8, 1.0, 2.5, 4.0);
  assert_true(t8 > 2.5 / 16 && t8 < 2.5 * 0.08);
}

/* The plugin's MPLANE_STATS_FILE JSON (net/stats.c writes it): tx bytes summed over planes only. */
static void test_stats_json(void **state) {
  (void)state;
  const char *json =
      "{\n  \"pid\": 123,\n  \"node_id\": \"00000000deadbeef\",\n  \"comms_opened\": 4,\n  \"comms_closed\": 3,\n"
      "  \"planes\": [\n    {\"plane\": 0, \"tx_bytes\": 1000, \"tx_msgs\": 2, \"rx_bytes\": 500, \"rx_msgs\": 1, \"relayed_bytes\": 0},\n"
      "    {\"plane\": 3, \"tx_bytes\": 24, \"tx_msgs\": 1, \"rx_bytes\": 0, \"rx_msgs\": 0, \"relayed_bytes\": 24}\n  ],\n"
      "  \"classes\": [\n    {\"class\": \"default\", \"sl\": 0, \"tx_bytes\": 1024, \"tx_msgs\": 3, \"rx_bytes\": 500, "
      "\"rx_msgs\": 1, \"relayed_bytes\": 24}\n  ]\n}\n";
  long long closed = 0;
  assert_int_equal(mp_ep_stats_tx_bytes(json, &closed), 1024);
  assert_int_equal(closed, 3);
  assert_int_equal(mp_ep_stats_tx_bytes("{\"comms_closed\": 0, \"planes\": [], \"classes\": [{\"tx_bytes\": 9}]}", &closed), 0);
  assert_int_equal(closed, 0);
  assert_int_equal(mp_ep_stats_tx_bytes("{}", &closed), -2);
  assert_int_equal(closed, -1);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_bytes_one_token),        cmocka_unit_test(test_bytes_own_node_and_dropped),
      cmocka_unit_test(test_deepseek_formula),       cmocka_unit_test(test_rows_order_and_combine),
      cmocka_unit_test(test_combine_rounding_points), cmocka_unit_test(test_tolerance_formula),
      cmocka_unit_test(test_stats_json),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
