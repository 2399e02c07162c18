/* libmplane-ep CPU reference model (see ep_model.h). Written the plain way on purpose: lists of
 * (token, expert) pairs and sorting, no prefix sums, no shared code with the planner except the
 * number formats (ep_num.h, tested on their own). */
#include "ep_model.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "ep_num.h"
#include "ep_plan.h" /* MP_EP_FMT_*, row strides only */

struct mp_ep_model {
  mp_ep_model_cfg cfg;
  int *node_of, *local_of;
  int *T;
  int **rowmap; /* [s][t*K + k] -> row at the expert's rank, -1 */
  const float **w;
  const int32_t **idx;
  mp_ep_model_rank *out;
};

static int node_of_r(const mp_ep_model_cfg *c, int r) { return c->node_of ? c->node_of[r] : r / c->G; }
static int local_of_r(const mp_ep_model_cfg *c, int r) { return c->local_of ? c->local_of[r] : r % c->G; }

/* Kept experts of a token: valid ids, first occurrence only. */
static int kept(const mp_ep_model_cfg *c, const int32_t *row, int *e_out, int *k_out) {
  int n = 0;
  for (int k = 0; k < c->K; k++) {
    int e = row[k], dup = 0;
    if (e < 0 || e >= c->E) continue;
    for (int i = 0; i < n; i++)
      if (e_out[i] == e) dup = 1;
    if (dup) continue;
    e_out[n] = e;
    k_out[n] = k;
    n++;
  }
  return n;
}

void mp_ep_model_count(const mp_ep_model_cfg *c, const int *T, const int32_t *const *idx, mp_ep_model_bytes *b,
                       long *net_tx_d, long *net_tx_c) {
  int Er = c->E / c->R, G = c->G;
  long ds = mp_ep_dstride(c->fmt, c->H, c->K, G), pay = mp_ep_payload_bytes(c->fmt, c->H), cs = 2L * c->H;
  /* flat mode plans with K = 1 and one GPU per "node" */
  long ds_flat = mp_ep_dstride(c->fmt, c->H, 1, 1);
  int es[64], ks[64];
  memset(b, 0, sizeof(*b));
  if (net_tx_d) memset(net_tx_d, 0, sizeof(long) * (size_t)c->R);
  if (net_tx_c) memset(net_tx_c, 0, sizeof(long) * (size_t)c->R);
  for (int s = 0; s < c->R; s++) {
    int ns = node_of_r(c, s), ls = local_of_r(c, s);
    for (int t = 0; t < T[s]; t++) {
      int n = kept(c, idx[s] + (long)t * c->K, es, ks);
      if (n == 0) continue;
      b->tokens++;
      b->pairs += n;
      /* distinct target ranks and nodes */
      int ranks[64], nr = 0, nodes[64], nn = 0;
      for (int i = 0; i < n; i++) {
        int d = es[i] / Er, nd = node_of_r(c, d), seen = 0;
        for (int q = 0; q < nr; q++)
          if (ranks[q] == d) seen = 1;
        if (!seen) ranks[nr++] = d;
        seen = 0;
        for (int q = 0; q < nn; q++)
          if (nodes[q] == nd) seen = 1;
        if (!seen) nodes[nn++] = nd;
        /* flat: every pair is one copy */
        if (d != s) {
          if (nd != ns) {
            b->flat_net_rows++;
            if (c->flat) {
              if (net_tx_d) net_tx_d[s] += ds_flat;
              if (net_tx_c) net_tx_c[d] += cs;
            }
          } else {
            b->flat_nvl_rows++;
          }
        }
      }
      b->recv_entries += nr;
      for (int q = 0; q < nn; q++) {
        if (nodes[q] != ns) {
          b->remote_nodes++;
          b->net_rows++;
          if (!c->flat) {
            int fwd = -1; /* (nodes[q], ls) */
            for (int r = 0; r < c->R; r++)
              if (node_of_r(c, r) == nodes[q] && local_of_r(c, r) == ls) fwd = r;
            if (net_tx_d) net_tx_d[s] += ds;
            if (net_tx_c && fwd >= 0) net_tx_c[fwd] += cs;
          }
        }
        /* NVLink: the forwarder (nodes[q], ls) copies to the other target ranks of that node */
        for (int i = 0; i < nr; i++)
          if (node_of_r(c, ranks[i]) == nodes[q] && local_of_r(c, ranks[i]) != ls) b->nvl_rows++;
      }
    }
  }
  b->d_net_bytes = b->net_rows * ds;
  b->d_nvl_bytes = b->nvl_rows * ds;
  b->d_net_payload = b->net_rows * pay;
  b->d_nvl_payload = b->nvl_rows * pay;
  b->c_net_bytes = b->net_rows * cs;
  b->c_nvl_bytes = b->nvl_rows * cs;
  b->flat_d_net_bytes = b->flat_net_rows * ds_flat;
  b->flat_d_nvl_bytes = b->flat_nvl_rows * ds_flat;
  b->flat_c_net_bytes = b->flat_net_rows * cs;
  b->flat_c_nvl_bytes = b->flat_nvl_rows * cs;
}

typedef struct pair {
  int s, t, k, e;
  long key1, key2, key3;
} pair;

static int pair_cmp(const void *a, const void *b) {
  const pair *x = a, *y = b;
  if (x->e != y->e) return x->e < y->e ? -1 : 1;
  if (x->key1 != y->key1) return x->key1 < y->key1 ? -1 : 1;
  if (x->key2 != y->key2) return x->key2 < y->key2 ? -1 : 1;
  if (x->key3 != y->key3) return x->key3 < y->key3 ? -1 : 1;
  return 0;
}

void mp_ep_model_free(mp_ep_model *m) {
  if (!m) return;
  for (int r = 0; r < m->cfg.R; r++) {
    if (m->rowmap) free(m->rowmap[r]);
    if (m->out) {
      free(m->out[r].expert_off);
      free(m->out[r].rows);
      free(m->out[r].x);
      free(m->out[r].scale);
    }
  }
  free(m->rowmap);
  free(m->out);
  free(m->node_of);
  free(m->local_of);
  free(m->T);
  free((void *)m->w);
  free((void *)m->idx);
  free(m);
}

void mp_ep_quantize_rows(const uint16_t *x, long T, int H, uint8_t *q, float *scales) {
  const int ntile = H / MP_EP_TILE;
  for (long t = 0; t < T; t++)
    for (int tile = 0; tile < ntile; tile++) {
      const uint16_t *xs = x + t * H + tile * MP_EP_TILE;
      float amax = 0.f;
      for (int i = 0; i < MP_EP_TILE; i++) {
        float a = fabsf(mp_bf16_to_f32(xs[i]));
        if (a > amax) amax = a;
      }
      const float inv = mp_ep_tile_inv(amax);
      scales[t * ntile + tile] = mp_ep_tile_scale(amax);
      for (int i = 0; i < MP_EP_TILE; i++) q[t * H + tile * MP_EP_TILE + i] = mp_ep_quant(mp_bf16_to_f32(xs[i]), inv);
    }
}

mp_ep_model *mp_ep_model_run(const mp_ep_model_cfg *cfg, const int *T, const int32_t *const *idx,
                             const float *const *w, const uint16_t *const *x) {
  int R = cfg->R, K = cfg->K, H = cfg->H, Er = cfg->E / cfg->R, ntile = H / MP_EP_TILE;
  if (R < 1 || cfg->E % R || K < 1 || K > 64 || H % MP_EP_TILE) return NULL;
  mp_ep_model *m = calloc(1, sizeof(*m));
  if (!m) return NULL;
  m->cfg = *cfg;
  m->node_of = malloc(sizeof(int) * (size_t)R);
  m->local_of = malloc(sizeof(int) * (size_t)R);
  m->T = malloc(sizeof(int) * (size_t)R);
  m->rowmap = calloc((size_t)R, sizeof(int *));
  m->out = calloc((size_t)R, sizeof(mp_ep_model_rank));
  m->w = malloc(sizeof(float *) * (size_t)R);
  m->idx = malloc(sizeof(int32_t *) * (size_t)R);
  if (!m->node_of || !m->local_of || !m->T || !m->rowmap || !m->out || !m->w || !m->idx) goto fail;
  for (int r = 0; r < R; r++) {
    m->node_of[r] = node_of_r(cfg, r);
    m->local_of[r] = local_of_r(cfg, r);
    m->T[r] = T[r];
    m->w[r] = w[r];
    m->idx[r] = idx[r];
  }
  m->cfg.node_of = m->node_of;
  m->cfg.local_of = m->local_of;

  /* quantise every source token once (what goes on the wire) */
  uint8_t **q = calloc((size_t)R, sizeof(uint8_t *));
  float **qs = calloc((size_t)R, sizeof(float *));
  if (!q || !qs) {
    free(q);
    free(qs);
    goto fail;
  }
  int ok = 1;
  if (x && cfg->fmt == MP_EP_FMT_FP8) {
    for (int s = 0; s < R && ok; s++) {
      q[s] = malloc((size_t)T[s] * H + 1);
      qs[s] = malloc(sizeof(float) * ((size_t)T[s] * ntile + 1));
      if (!q[s] || !qs[s]) {
        ok = 0;
        break;
      }
      mp_ep_quantize_rows(x[s], T[s], H, q[s], qs[s]);
    }
  }

  for (int d = 0; d < R && ok; d++) {
    /* every kept (s, t, k) whose expert lives on d */
    long np = 0, cap = 1024;
    pair *ps = malloc(sizeof(pair) * (size_t)cap);
    if (!ps) {
      ok = 0;
      break;
    }
    for (int s = 0; s < R; s++)
      for (int t = 0; t < T[s]; t++) {
        int es[64], ks[64];
        int n = kept(cfg, idx[s] + (long)t * K, es, ks);
        for (int i = 0; i < n; i++) {
          if (es[i] / Er != d) continue;
          if (np == cap) {
            cap *= 2;
            pair *nps = realloc(ps, sizeof(pair) * (size_t)cap);
            if (!nps) {
              ok = 0;
              break;
            }
            ps = nps;
          }
          pair p = {s, t, ks[i], es[i] - d * Er, 0, 0, 0};
          if (cfg->flat) {
            p.key1 = s;
            p.key2 = (long)t * K + ks[i];
          } else {
            p.key1 = m->local_of[s];
            p.key2 = m->node_of[s];
            p.key3 = t;
          }
          ps[np++] = p;
        }
      }
    if (!ok) {
      free(ps);
      break;
    }
    qsort(ps, (size_t)np, sizeof(pair), pair_cmp);
    mp_ep_model_rank *o = &m->out[d];
    o->nrows = (int)np;
    o->expert_off = calloc((size_t)Er + 1, sizeof(int));
    o->rows = malloc(sizeof(mp_ep_model_row) * ((size_t)np + 1));
    if (x) {
      o->x = malloc((size_t)(np + 1) * H * (cfg->fmt == MP_EP_FMT_FP8 ? 1 : 2));
      if (cfg->fmt == MP_EP_FMT_FP8) o->scale = malloc(sizeof(float) * ((size_t)(np + 1) * ntile));
    }
    if (!o->expert_off || !o->rows || (x && !o->x) || (x && cfg->fmt == MP_EP_FMT_FP8 && !o->scale)) {
      free(ps);
      ok = 0;
      break;
    }
    for (long i = 0; i < np; i++) {
      const pair *p = &ps[i];
      o->expert_off[p->e + 1]++;
      o->rows[i].src_rank = p->s;
      o->rows[i].src_token = p->t;
      o->rows[i].k = p->k;
      o->rows[i].expert = p->e + d * Er;
      o->rows[i].w = w[p->s][(long)p->t * K + p->k];
      if (x) {
        if (cfg->fmt == MP_EP_FMT_FP8) {
          memcpy(o->x + i * H, q[p->s] + (long)p->t * H, (size_t)H);
          memcpy(o->scale + i * ntile, qs[p->s] + (long)p->t * ntile, sizeof(float) * (size_t)ntile);
        } else {
          memcpy(o->x + i * 2L * H, x[p->s] + (long)p->t * H, 2 * (size_t)H);
        }
      }
    }
    for (int e = 0; e < Er; e++) o->expert_off[e + 1] += o->expert_off[e];
    free(ps);
  }
  for (int s = 0; s < R; s++) {
    free(q[s]);
    free(qs[s]);
  }
  free(q);
  free(qs);
  if (!ok) goto fail;

  /* (s, t, k) -> row at the expert's rank */
  for (int s = 0; s < R; s++) {
    m->rowmap[s] = malloc(sizeof(int) * ((size_t)T[s] * K + 1));
    if (!m->rowmap[s]) goto fail;
    for (long i = 0; i < (long)T[s] * K; i++) m->rowmap[s][i] = -1;
  }
  for (int d = 0; d < R; d++)
    for (int i = 0; i < m->out[d].nrows; i++) {
      const mp_ep_model_row *r = &m->out[d].rows[i];
      m->rowmap[r->src_rank][(long)r->src_token * K + r->k] = i;
    }
  return m;
fail:
  mp_ep_model_free(m);
  return NULL;
}

const mp_ep_model_rank *mp_ep_model_rank_out(const mp_ep_model *m, int d) { return &m->out[d]; }

void mp_ep_model_identity(const mp_ep_model *m, int d, uint16_t *y) {
  const mp_ep_model_rank *o = &m->out[d];
  int H = m->cfg.H, ntile = H / MP_EP_TILE;
  for (long i = 0; i < o->nrows; i++) {
    if (m->cfg.fmt == MP_EP_FMT_FP8) {
      for (int h = 0; h < H; h++) y[i * H + h] = mp_ep_dequant_bf16(o->x[i * H + h], o->scale[i * ntile + h / MP_EP_TILE]);
    } else {
      memcpy(y + i * H, o->x + i * 2L * H, 2 * (size_t)H);
    }
  }
}

void mp_ep_model_combine(const mp_ep_model *m, const uint16_t *const *y, uint16_t *const *out) {
  const mp_ep_model_cfg *c = &m->cfg;
  int R = c->R, K = c->K, H = c->H, G = c->G, N = c->R / c->G, Er = c->E / c->R;
  float *acc_out = malloc(sizeof(float) * (size_t)H), *acc_node = malloc(sizeof(float) * (size_t)H),
        *acc_rank = malloc(sizeof(float) * (size_t)H);
  int *rank_at = malloc(sizeof(int) * (size_t)R); /* (node, local) -> rank */
  if (!acc_out || !acc_node || !acc_rank || !rank_at) goto done;
  for (int r = 0; r < R; r++) rank_at[m->node_of[r] * G + m->local_of[r]] = r;
  for (int s = 0; s < R; s++) {
    for (int t = 0; t < m->T[s]; t++) {
      const int32_t *ids = m->idx[s] + (long)t * K;
      const int *rm = m->rowmap[s] + (long)t * K;
      for (int h = 0; h < H; h++) acc_out[h] = 0.f;
      if (c->flat) {
        for (int k = 0; k < K; k++) {
          if (rm[k] < 0) continue;
          const uint16_t *yr = y[ids[k] / Er] + (long)rm[k] * H;
          float wk = m->w[s][(long)t * K + k];
          for (int h = 0; h < H; h++)
            acc_out[h] = acc_out[h] + mp_bf16_to_f32(mp_f32_to_bf16(fmaf(wk, mp_bf16_to_f32(yr[h]), 0.f)));
        }
      } else {
        for (int nd = 0; nd < N; nd++) {
          int any_node = 0;
          for (int h = 0; h < H; h++) acc_node[h] = 0.f;
          for (int j = 0; j < G; j++) {
            int d = rank_at[nd * G + j], any_rank = 0;
            for (int h = 0; h < H; h++) acc_rank[h] = 0.f;
            for (int k = 0; k < K; k++) {
              if (rm[k] < 0 || ids[k] / Er != d) continue;
              any_rank = 1;
              const uint16_t *yr = y[d] + (long)rm[k] * H;
              float wk = m->w[s][(long)t * K + k];
              for (int h = 0; h < H; h++) acc_rank[h] = fmaf(wk, mp_bf16_to_f32(yr[h]), acc_rank[h]);
            }
            if (!any_rank) continue;
            any_node = 1;
            for (int h = 0; h < H; h++) acc_node[h] = acc_node[h] + mp_bf16_to_f32(mp_f32_to_bf16(acc_rank[h]));
          }
          if (!any_node) continue;
          for (int h = 0; h < H; h++) acc_out[h] = acc_out[h] + mp_bf16_to_f32(mp_f32_to_bf16(acc_node[h]));
        }
      }
      for (int h = 0; h < H; h++) out[s][(long)t * H + h] = mp_f32_to_bf16(acc_out[h]);
    }
  }
done:
  free(acc_out);
  free(acc_node);
  free(acc_rank);
  free(rank_at);
}

double mp_ep_tolerance(int fmt, double x, double W, double tile_amax) {
  double ax = fabs(x), r = 4.0 * ldexp(1.0, -9) * 1.01;
  if (fmt == MP_EP_FMT_BF16) return W * ax * r + 1e-30;
  double amax = tile_amax > 1e-4 ? tile_amax : 1e-4;
  return W * (ax / 16.0 + amax / 448.0 / 1024.0) * 1.02 + W * ax * r + 1e-30;
}
