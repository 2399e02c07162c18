/* libmplane-ep checks and generators (see ep_check.h). */
#include "ep_check.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ep_num.h"
#include "ep_plan.h"
#include "ep_ref.h"

const char *mp_ep_route_kind_name(int kind) {
  static const char *names[] = {"uniform", "gated", "one-node", "all-nodes", "mixed"};
  return kind >= 0 && kind < MP_EP_ROUTE_KINDS ? names[kind] : "?";
}

static int has(const int32_t *row, int n, int e) {
  for (int i = 0; i < n; i++)
    if (row[i] == e) return 1;
  return 0;
}

/* A random expert of [lo, hi) not yet in row[0..n); lo if all are taken. */
static int pick(uint64_t *rs, const int32_t *row, int n, int lo, int hi) {
  int span = hi - lo;
  if (span <= 0) return -1;
  for (int tries = 0; tries < 64; tries++) {
    int e = lo + (int)(mp_ep_rand_next(rs) % (uint64_t)span);
    if (!has(row, n, e)) return e;
  }
  for (int e = lo; e < hi; e++)
    if (!has(row, n, e)) return e;
  return lo;
}

void mp_ep_gen_routing(int kind, uint64_t seed, int rank, int R, int G, int E, int K, int T, int32_t *idx, float *w) {
  uint64_t rs = seed * 1000003ull + (uint64_t)rank * 7919ull + (uint64_t)kind;
  int N = R / G, Er = E / R, per_node = Er * G;
  if (kind == MP_EP_ROUTE_GATED) {
    float *lg = malloc(sizeof(float) * (size_t)E * (size_t)(T > 0 ? T : 1));
    float *bias = malloc(sizeof(float) * (size_t)E);
    if (!lg || !bias) {
      free(lg);
      free(bias);
      return;
    }
    uint64_t bs = seed; /* the bias is a model parameter: the same on every rank */
    for (int e = 0; e < E; e++) bias[e] = (float)(mp_ep_rand_unit(&bs) * 0.2 - 0.1);
    for (long i = 0; i < (long)T * E; i++) lg[i] = (float)(mp_ep_rand_unit(&rs) * 8.0 - 4.0);
    int groups = N, topk_groups = N > 1 ? (N + 1) / 2 : 1;
    if (groups * 2 <= E && E % (groups * 2) == 0 && N == 1) groups = 2, topk_groups = 1;
    mp_ep_route_ref(lg, bias, T, E, K, groups, topk_groups, 2.5f, 1, idx, w);
    free(lg);
    free(bias);
    return;
  }
  for (int t = 0; t < T; t++) {
    int32_t *row = idx + (long)t * K;
    float *wr = w + (long)t * K;
    for (int k = 0; k < K; k++) row[k] = -1;
    if (kind == MP_EP_ROUTE_UNIFORM || kind == MP_EP_ROUTE_MIXED) {
      for (int k = 0; k < K; k++) row[k] = pick(&rs, row, k, 0, E);
    } else if (kind == MP_EP_ROUTE_ONE_NODE) {
      int node = (mp_ep_rand_next(&rs) & 1) ? rank / G : (int)(mp_ep_rand_next(&rs) % (uint64_t)N);
      for (int k = 0; k < K; k++) row[k] = pick(&rs, row, k, node * per_node, (node + 1) * per_node);
    } else { /* ALL_NODES */
      int first = (int)(mp_ep_rand_next(&rs) % (uint64_t)N);
      for (int k = 0; k < K; k++) {
        int node = (first + k) % N;
        row[k] = pick(&rs, row, k, node * per_node, (node + 1) * per_node);
      }
    }
    if (kind == MP_EP_ROUTE_MIXED) {
      uint64_t r = mp_ep_rand_next(&rs) % 100;
      if (r < 6) {
        for (int k = 0; k < K; k++) row[k] = -1; /* token dropped entirely */
      } else {
        for (int k = 0; k < K; k++) {
          uint64_t q = mp_ep_rand_next(&rs) % 100;
          if (q < 10) row[k] = -1;
          else if (q < 14) row[k] = E + (int)(q % 5);        /* out of range: dropped */
          else if (q < 19 && k > 0) row[k] = row[k - 1];     /* repeat: dropped */
        }
      }
    }
    for (int k = 0; k < K; k++) wr[k] = (float)(0.05 + mp_ep_rand_unit(&rs));
  }
}

void mp_ep_gen_tokens(uint64_t seed, int rank, int T, int H, uint16_t *x) {
  uint64_t rs = seed * 0x2545F4914F6CDD1Dull + (uint64_t)rank * 104729ull + 17;
  for (int t = 0; t < T; t++)
    for (int tile = 0; tile < H / MP_EP_TILE; tile++) {
      uint64_t r = mp_ep_rand_next(&rs);
      int zero = (r % 50) == 0;
      double mag = ldexp(1.0, (int)((r >> 8) % 17) - 8);
      for (int i = 0; i < MP_EP_TILE; i++) {
        double u = mp_ep_rand_unit(&rs) * 2.0 - 1.0;
        /* a few large entries so that the tile's amax is an outlier now and then */
        if ((mp_ep_rand_next(&rs) % 97) == 0) u *= 6.0;
        x[(long)t * H + tile * MP_EP_TILE + i] = mp_f32_to_bf16(zero ? 0.0f : (float)(u * mag));
      }
    }
}

long mp_ep_check_dispatch(const mp_ep_model *m, int d, int fmt, int H, int nrows, const int *expert_off, int Er,
                          const uint8_t *x, const float *scale, const float *w, const int *src, char *msg,
                          size_t msglen) {
  const mp_ep_model_rank *o = mp_ep_model_rank_out(m, d);
  long bad = 0;
  int nt = H / MP_EP_TILE;
  long elem = fmt == MP_EP_FMT_FP8 ? 1 : 2;
#define MISMATCH(...)                                            \
  do {                                                           \
    if (bad++ == 0 && msg) snprintf(msg, msglen, __VA_ARGS__);   \
  } while (0)
  if (nrows != o->nrows) {
    MISMATCH("rank %d: %d expert rows, model %d", d, nrows, o->nrows);
    return bad;
  }
  for (int e = 0; e <= Er; e++)
    if (expert_off[e] != o->expert_off[e]) MISMATCH("rank %d: expert %d offset %d, model %d", d, e, expert_off[e], o->expert_off[e]);
  if (bad) return bad;
  for (long i = 0; i < nrows; i++) {
    const mp_ep_model_row *r = &o->rows[i];
    if (src[2 * i] != r->src_rank || src[2 * i + 1] != r->src_token)
      MISMATCH("rank %d row %ld: source (%d, %d), model (%d, %d)", d, i, src[2 * i], src[2 * i + 1], r->src_rank,
               r->src_token);
    if (mp_f32_bits(w[i]) != mp_f32_bits(r->w)) MISMATCH("rank %d row %ld: weight %g, model %g", d, i, (double)w[i], (double)r->w);
    if (o->x && memcmp(x + i * H * elem, o->x + i * H * elem, (size_t)(H * elem)) != 0) {
      long h = 0;
      while (h < H * elem && x[i * H * elem + h] == o->x[i * H * elem + h]) h++;
      MISMATCH("rank %d row %ld (source %d token %d): payload byte %ld is 0x%02x, model 0x%02x", d, i, r->src_rank,
               r->src_token, h, x[i * H * elem + h], o->x[i * H * elem + h]);
    }
    if (o->scale && fmt == MP_EP_FMT_FP8)
      for (int tile = 0; tile < nt; tile++)
        if (mp_f32_bits(scale[i * nt + tile]) != mp_f32_bits(o->scale[i * nt + tile]))
          MISMATCH("rank %d row %ld tile %d: scale %.9g, model %.9g", d, i, tile, (double)scale[i * nt + tile],
                   (double)o->scale[i * nt + tile]);
  }
  return bad;
}

long mp_ep_check_exact(const uint16_t *got, const uint16_t *want, long n, char *msg, size_t msglen) {
  long bad = 0;
  for (long i = 0; i < n; i++)
    if (got[i] != want[i]) MISMATCH("element %ld: 0x%04x (%.9g), expected 0x%04x (%.9g)", i, got[i],
                                    (double)mp_bf16_to_f32(got[i]), want[i], (double)mp_bf16_to_f32(want[i]));
  return bad;
}

long mp_ep_check_tolerance(int fmt, int T, int H, int K, int E, const uint16_t *x, const int32_t *idx, const float *w,
                           const uint16_t *out, double *max_ratio, char *msg, size_t msglen) {
  long bad = 0;
  double worst = 0.0;
  for (int t = 0; t < T; t++) {
    const int32_t *row = idx + (long)t * K;
    double W = 0.0;
    for (int k = 0; k < K; k++) {
      int e = row[k], dup = 0;
      if (e < 0 || e >= E) continue;
      for (int q = 0; q < k; q++)
        if (row[q] == e) dup = 1;
      if (!dup) W += w[(long)t * K + k];
    }
    for (int tile = 0; tile < H / MP_EP_TILE; tile++) {
      double amax = 0.0;
      for (int i = 0; i < MP_EP_TILE; i++) {
        double a = fabs((double)mp_bf16_to_f32(x[(long)t * H + tile * MP_EP_TILE + i]));
        if (a > amax) amax = a;
      }
      for (int i = 0; i < MP_EP_TILE; i++) {
        long at = (long)t * H + tile * MP_EP_TILE + i;
        double xv = mp_bf16_to_f32(x[at]), got = mp_bf16_to_f32(out[at]);
        double err = fabs(got - xv * W), tol = mp_ep_tolerance(fmt, xv, W, amax);
        double ratio = err / tol;
        if (ratio > worst) worst = ratio;
        if (!(err <= tol)) MISMATCH("token %d element %d: %.9g, expected %.9g * %.9g = %.9g (error %.3g > tolerance %.3g)", t,
                                    tile * MP_EP_TILE + i, got, xv, W, xv * W, err, tol);
      }
    }
  }
  if (max_ratio) *max_ratio = worst;
  return bad;
}

long long mp_ep_stats_tx_bytes(const char *json, long long *closed) {
  const char *c = strstr(json, "\"comms_closed\"");
  const char *colon = c ? strchr(c, ':') : NULL;
  *closed = colon ? strtoll(colon + 1, NULL, 10) : -1;
  const char *p = strstr(json, "\"planes\"");
  if (!p) return -2;
  const char *open = strchr(p, '[');
  const char *end = open ? strchr(open, ']') : NULL;
  if (!open || !end) return -2;
  long long tx = 0;
  for (const char *q = strstr(open, "\"tx_bytes\""); q && q < end; q = strstr(q + 1, "\"tx_bytes\"")) {
    const char *k = strchr(q, ':');
    if (k) tx += strtoll(k + 1, NULL, 10);
  }
  return tx;
}
