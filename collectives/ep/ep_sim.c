/* libmplane-ep planner simulation (see ep_sim.h). The loops below are the CPU twins of the kernels
 * in ep_kernels.cu: same plans, same offsets, same rounding points; only the data movement is
 * memcpy instead of vector loads. */
#include "ep_sim.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct sim_rank {
  mp_ep_view v;
  int *cnt;
  int32_t *topk;
  int *nslot_k, *rrank_k, *erank_k, *fwd_pos, *dest_rows;
  char *p1s, *p1r, *p2s, *p2r;
  uint8_t *ex_x;
  float *ex_scale, *ex_w;
  int *ex_src;
  long net[MP_EP_NSTEPS], nvl[MP_EP_NSTEPS];
} sim_rank;

struct mp_ep_sim {
  mp_ep_sim_cfg cfg;
  int R, N, G, K, H, Tmax, expand;
  int *node_of, *local_of, *rank_of; /* planner view (identity in flat mode) */
  int *phys_node;                    /* machine nodes */
  sim_rank *rk;
  mp_ep_rows rows;
  char err[512];
};

static int fail(mp_ep_sim *s, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(s->err, sizeof(s->err), fmt, ap);
  va_end(ap);
  return -1;
}

const char *mp_ep_sim_error(const mp_ep_sim *s) { return s->err; }

void mp_ep_sim_free(mp_ep_sim *s) {
  if (!s) return;
  if (s->rk)
    for (int r = 0; r < s->R; r++) {
      sim_rank *k = &s->rk[r];
      free(k->cnt);
      free(k->topk);
      free(k->nslot_k);
      free(k->rrank_k);
      free(k->erank_k);
      free(k->fwd_pos);
      free(k->dest_rows);
      free(k->p1s);
      free(k->p1r);
      free(k->p2s);
      free(k->p2r);
      free(k->ex_x);
      free(k->ex_scale);
      free(k->ex_w);
      free(k->ex_src);
    }
  free(s->rk);
  free(s->node_of);
  free(s->local_of);
  free(s->rank_of);
  free(s->phys_node);
  free(s);
}

static void *zalloc(long bytes) { return calloc(1, (size_t)(bytes > 0 ? bytes : 1)); }

mp_ep_sim *mp_ep_sim_create(const mp_ep_sim_cfg *cfg, char *err, size_t errlen) {
  mp_ep_sim *s = calloc(1, sizeof(*s));
  if (!s) {
    snprintf(err, errlen, "out of memory");
    return NULL;
  }
  s->cfg = *cfg;
  int R = cfg->R;
  s->R = R;
  s->node_of = malloc(sizeof(int) * (size_t)R);
  s->local_of = malloc(sizeof(int) * (size_t)R);
  s->rank_of = malloc(sizeof(int) * (size_t)R);
  s->phys_node = malloc(sizeof(int) * (size_t)R);
  s->rk = calloc((size_t)R, sizeof(sim_rank));
  if (!s->node_of || !s->local_of || !s->rank_of || !s->phys_node || !s->rk) {
    snprintf(err, errlen, "out of memory");
    goto bad;
  }
  if (cfg->G < 1 || R % cfg->G) {
    snprintf(err, errlen, "ranks %d not a multiple of GPUs per node %d", R, cfg->G);
    goto bad;
  }
  for (int r = 0; r < R; r++) s->phys_node[r] = cfg->node_of ? cfg->node_of[r] : r / cfg->G;
  if (cfg->flat) {
    s->N = R;
    s->G = 1;
    s->K = 1;
    s->expand = cfg->K;
    s->Tmax = cfg->Tmax * cfg->K;
    for (int r = 0; r < R; r++) {
      s->node_of[r] = r;
      s->local_of[r] = 0;
      s->rank_of[r] = r;
    }
  } else {
    s->N = R / cfg->G;
    s->G = cfg->G;
    s->K = cfg->K;
    s->expand = 1;
    s->Tmax = cfg->Tmax;
    for (int r = 0; r < R; r++) {
      s->node_of[r] = cfg->node_of ? cfg->node_of[r] : r / cfg->G;
      s->local_of[r] = cfg->local_of ? cfg->local_of[r] : r % cfg->G;
    }
    for (int r = 0; r < R; r++) s->rank_of[s->node_of[r] * s->G + s->local_of[r]] = r;
  }
  s->H = cfg->H;
  for (int r = 0; r < R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_shape sh = {R, s->N, s->G, r, cfg->E, s->K, cfg->H, s->Tmax, s->expand, cfg->graph, cfg->cap_rows};
    if (mp_ep_view_init(&k->v, &sh, s->node_of, s->local_of, s->rank_of, err, errlen) != 0) goto bad;
    mp_ep_shape_rows(&sh, &s->rows);
    const mp_ep_rows *rw = &s->rows;
    k->cnt = zalloc(4L * k->v.cl.total);
    k->topk = zalloc(4L * s->Tmax * s->K);
    k->nslot_k = zalloc(4L * s->Tmax * s->K);
    k->rrank_k = zalloc(4L * s->Tmax * s->K);
    k->erank_k = zalloc(4L * s->Tmax * s->K);
    k->fwd_pos = zalloc(4L * rw->p1r * s->G);
    k->dest_rows = zalloc(4L * rw->p2r * s->K);
    k->p1s = zalloc(rw->p1s * rw->row_bytes);
    k->p1r = zalloc(rw->p1r * rw->row_bytes);
    k->p2s = zalloc(rw->p2s * rw->row_bytes);
    k->p2r = zalloc(rw->p2r * rw->row_bytes);
    k->ex_x = zalloc(rw->cap_rows * 2L * cfg->H);
    k->ex_scale = zalloc(4L * rw->cap_rows * (cfg->H / MP_EP_TILE));
    k->ex_w = zalloc(4L * rw->cap_rows);
    k->ex_src = zalloc(8L * rw->cap_rows);
    if (!k->cnt || !k->topk || !k->nslot_k || !k->rrank_k || !k->erank_k || !k->fwd_pos || !k->dest_rows || !k->p1s ||
        !k->p1r || !k->p2s || !k->p2r || !k->ex_x || !k->ex_scale || !k->ex_w || !k->ex_src) {
      snprintf(err, errlen, "out of memory for rank %d buffers", r);
      goto bad;
    }
    /* poison: rows nobody writes must not be read */
    memset(k->p1s, 0xA5, (size_t)(rw->p1s * rw->row_bytes));
    memset(k->p1r, 0xA5, (size_t)(rw->p1r * rw->row_bytes));
    memset(k->p2s, 0xA5, (size_t)(rw->p2s * rw->row_bytes));
    memset(k->p2r, 0xA5, (size_t)(rw->p2r * rw->row_bytes));
    memset(k->fwd_pos, 0x7f, (size_t)(4L * rw->p1r * s->G));
    memset(k->dest_rows, 0x7f, (size_t)(4L * rw->p2r * s->K));
    mp_ep_view *v = &k->v;
    v->cnt = k->cnt;
    v->topk = k->topk;
    v->nslot_k = k->nslot_k;
    v->rrank_k = k->rrank_k;
    v->erank_k = k->erank_k;
    v->fwd_pos = k->fwd_pos;
    v->dest_rows = k->dest_rows;
    v->p1s = k->p1s;
    v->p1r = k->p1r;
    v->p2s = k->p2s;
    v->p2r = k->p2r;
    v->ex_x = k->ex_x;
    v->ex_scale = k->ex_scale;
    v->ex_w = k->ex_w;
    v->ex_src = k->ex_src;
  }
  return s;
bad:
  mp_ep_sim_free(s);
  return NULL;
}

static char *buf_of(sim_rank *k, int b) {
  switch (b) {
  case MP_EP_BUF_CNT: return (char *)k->cnt;
  case MP_EP_BUF_P1S: return k->p1s;
  case MP_EP_BUF_P1R: return k->p1r;
  case MP_EP_BUF_P2S: return k->p2s;
  case MP_EP_BUF_P2R: return k->p2r;
  }
  return NULL;
}

static long buf_bytes(const mp_ep_sim *s, const sim_rank *k, int b) {
  const mp_ep_rows *rw = &s->rows;
  switch (b) {
  case MP_EP_BUF_CNT: return 4L * k->v.cl.total;
  case MP_EP_BUF_P1S: return rw->p1s * rw->row_bytes;
  case MP_EP_BUF_P1R: return rw->p1r * rw->row_bytes;
  case MP_EP_BUF_P2S: return rw->p2s * rw->row_bytes;
  case MP_EP_BUF_P2R: return rw->p2r * rw->row_bytes;
  }
  return 0;
}

/* One grouped send/recv step for all ranks: every send must meet a receive of the same size. */
static int exchange(mp_ep_sim *s, int step) {
  int R = s->R, mx = s->N > s->G ? s->N : s->G;
  mp_ep_xfer *x = malloc(sizeof(mp_ep_xfer) * (size_t)R * (size_t)mx);
  int *nx = calloc((size_t)R, sizeof(int));
  if (!x || !nx) {
    free(x);
    free(nx);
    return fail(s, "out of memory");
  }
  for (int r = 0; r < R; r++) {
    sim_rank *k = &s->rk[r];
    nx[r] = mp_ep_schedule(&k->v, k->cnt, s->phys_node, step, x + (long)r * mx);
    k->net[step] = k->nvl[step] = 0;
  }
  int rc = 0;
  for (int r = 0; r < R && !rc; r++)
    for (int i = 0; i < nx[r] && !rc; i++) {
      const mp_ep_xfer *a = &x[(long)r * mx + i];
      const mp_ep_xfer *b = NULL;
      int p = a->peer;
      for (int q = 0; q < nx[p]; q++)
        if (x[(long)p * mx + q].peer == r) b = &x[(long)p * mx + q];
      long rb = b ? b->recv_bytes : 0;
      if (a->send_bytes != rb) {
        rc = fail(s, "step %d: rank %d sends %ld bytes to rank %d, which receives %ld", step, r, a->send_bytes, p, rb);
        break;
      }
      if (a->send_bytes == 0) continue;
      sim_rank *src = &s->rk[r], *dst = &s->rk[p];
      if (a->send_off < 0 || a->send_off + a->send_bytes > buf_bytes(s, src, a->send_buf) || b->recv_off < 0 ||
          b->recv_off + b->recv_bytes > buf_bytes(s, dst, b->recv_buf)) {
        rc = fail(s, "step %d: transfer rank %d -> %d outside its buffer", step, r, p);
        break;
      }
      memcpy(buf_of(dst, b->recv_buf) + b->recv_off, buf_of(src, a->send_buf) + a->send_off, (size_t)a->send_bytes);
      if (a->net) src->net[step] += a->send_bytes;
      else src->nvl[step] += a->send_bytes;
    }
  free(x);
  free(nx);
  return rc;
}

int mp_ep_sim_layout(mp_ep_sim *s, const int *T, const int32_t *const *idx) {
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    long Tp = (long)T[r] * s->expand;
    if (Tp > v->Tmax || T[r] < 0) return fail(s, "rank %d: %d tokens > max_tokens", r, T[r]);
    v->T = (int)Tp;
    int Kin = v->K * v->expand;
    for (int t = 0; t < T[r]; t++) mp_ep_sanitize_row(idx[r] + (long)t * Kin, k->topk + (long)t * Kin, Kin, v->E);
    memset(k->cnt, 0, 4L * (size_t)v->cl.total);
    int units = mp_ep_scan_units(v);
    for (int u = 0; u < units; u++) {
      int role, target;
      mp_ep_scan_unit(v, u, &role, &target);
      int *out = mp_ep_scan_out(v, role);
      int prefix = 0;
      for (int t = 0; t < v->T; t++) {
        uint32_t m = mp_ep_scan_mask(v, k->topk + (long)t * v->K, role, target);
        if (role == MP_EP_SCAN_CLEAR) {
          mp_ep_scan_clear(v, t, m);
          continue;
        }
        if (!m) continue;
        for (int q = 0; q < v->K; q++)
          if (m & (1u << q)) out[(long)t * v->K + q] = prefix;
        prefix++;
      }
      int ti = mp_ep_scan_total_index(v, role, target);
      if (ti >= 0) k->cnt[ti] = prefix;
    }
    for (int n = 0; n < v->N; n++)
      for (int i = 0; i < v->cl.la; i++) {
        int w = mp_ep_a_word(v, k->cnt, n, i);
        k->cnt[v->cl.a_send + n * v->cl.la + i] = w;
        if (n == v->my_node) k->cnt[v->cl.a_recv + n * v->cl.la + i] = w;
      }
  }
  if (exchange(s, MP_EP_STEP_A)) return -1;
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    for (int j = 0; j < v->G; j++)
      for (int i = 0; i < v->cl.lb; i++) {
        int w = mp_ep_b_word(v, k->cnt, j, i);
        k->cnt[v->cl.b_send + j * v->cl.lb + i] = w;
        if (j == v->my_local) k->cnt[v->cl.b_recv + j * v->cl.lb + i] = w;
      }
  }
  if (exchange(s, MP_EP_STEP_B)) return -1;
  for (int r = 0; r < s->R; r++) mp_ep_offsets(&s->rk[r].v, s->rk[r].cnt);
  return 0;
}

static long ex_elem(int fmt) { return fmt == MP_EP_FMT_FP8 ? 1 : 2; }

/* One token's payload (FP8 + scales, or BF16) in wire layout. */
static void quantize_row(const mp_ep_view *v, const uint16_t *x, char *dst) {
  int H = v->H, nt = H / MP_EP_TILE;
  if (v->fmt == MP_EP_FMT_BF16) {
    memcpy(dst, x, 2 * (size_t)H);
    return;
  }
  float *sc = (float *)(dst + H);
  for (int tile = 0; tile < nt; tile++) {
    float amax = 0.f;
    for (int i = 0; i < MP_EP_TILE; i++) amax = fmaxf(amax, fabsf(mp_bf16_to_f32(x[tile * MP_EP_TILE + i])));
    const float inv = mp_ep_tile_inv(amax);
    sc[tile] = mp_ep_tile_scale(amax);
    for (int i = 0; i < MP_EP_TILE; i++)
      ((uint8_t *)dst)[tile * MP_EP_TILE + i] = mp_ep_quant(mp_bf16_to_f32(x[tile * MP_EP_TILE + i]), inv);
  }
}

/* Expert-output row from a wire payload. */
static void write_expert_row(const mp_ep_view *v, int row, const char *payload, float w, int src_rank, int src_tok) {
  if (row < 0) return;
  int H = v->H;
  memcpy(v->ex_x + (long)row * H * ex_elem(v->fmt), payload, (size_t)(H * ex_elem(v->fmt)));
  if (v->fmt == MP_EP_FMT_FP8)
    memcpy(v->ex_scale + (long)row * (H / MP_EP_TILE), payload + H, 4 * (size_t)(H / MP_EP_TILE));
  v->ex_w[row] = w;
  v->ex_src[2L * row] = src_rank;
  v->ex_src[2L * row + 1] = src_tok / v->expand;
}

int mp_ep_sim_dispatch(mp_ep_sim *s, int fmt, const uint16_t *const *x, const float *const *w) {
  char *tmp = malloc((size_t)mp_ep_dstride(MP_EP_FMT_BF16, s->H, s->K, s->G));
  if (!tmp) return fail(s, "out of memory");
  for (int r = 0; r < s->R; r++) {
    mp_ep_view *v = &s->rk[r].v;
    v->fmt = fmt;
    v->dstride = mp_ep_dstride(fmt, v->H, v->K, v->G);
    v->meta_off = mp_ep_payload_bytes(fmt, v->H);
  }
  /* pack (source side) */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    for (int t = 0; t < v->T; t++) {
      const int32_t *row = v->topk + (long)t * v->K;
      const float *wrow = w[r] + (long)t * v->K;
      mp_ep_pack_plan p;
      const long tk = (long)t * v->K;
      mp_ep_pack_plan_make(v, k->cnt, row, v->nslot_k + tk, v->rrank_k + tk, v->erank_k + tk, &p);
      mp_ep_pack_plan_commit(v, &p);
      if (p.ndst == 0 && p.nexp == 0) continue;
      quantize_row(v, x[r] + (long)(t / v->expand) * v->H, tmp);
      for (int i = 0; i < p.ndst; i++) {
        char *dst = (p.dst_buf[i] == MP_EP_BUF_P1S ? v->p1s : v->p2s) + (long)p.dst_row[i] * v->dstride;
        memcpy(dst, tmp, (size_t)v->meta_off);
        mp_ep_meta_write(v, (int32_t *)(dst + v->meta_off), t, row, wrow, v->rrank_k + (long)t * v->K,
                         v->erank_k + (long)t * v->K, p.dst_node[i]);
      }
      for (int i = 0; i < p.nexp; i++) write_expert_row(v, p.exp_row[i], tmp, wrow[p.exp_k[i]], v->me, t);
    }
  }
  free(tmp);
  if (exchange(s, MP_EP_STEP_D1)) return -1;
  /* forward (phase-1 rows from remote nodes) */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    long n1 = k->cnt[v->cl.off1r + v->N];
    for (long i = 0; i < n1; i++) {
      int seg;
      if (!mp_ep_p1r_valid(v, k->cnt, i, &seg) || seg == v->my_node) continue;
      const char *src = v->p1r + i * v->dstride;
      const int32_t *m = (const int32_t *)(src + v->meta_off);
      mp_ep_fwd_plan p;
      mp_ep_fwd_plan_make(v, k->cnt, m, &p);
      mp_ep_fwd_plan_commit(v, i, &p);
      for (int q = 0; q < p.ndst; q++) memcpy(v->p2s + (long)p.dst_row[q] * v->dstride, src, (size_t)v->dstride);
      for (int q = 0; q < p.nexp; q++)
        write_expert_row(v, p.exp_row[q], src, mp_bits_f32((uint32_t)m[2 + v->K + p.exp_k[q]]), m[0], m[1]);
    }
  }
  if (exchange(s, MP_EP_STEP_D2)) return -1;
  /* unpack (phase-2 rows from the other forwarders of the node) */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    long n2 = k->cnt[v->cl.off2r + v->G];
    for (long u = 0; u < n2; u++) {
      int seg;
      if (!mp_ep_p2r_valid(v, k->cnt, u, &seg) || seg == v->my_local) continue;
      const char *src = v->p2r + u * v->dstride;
      const int32_t *m = (const int32_t *)(src + v->meta_off);
      mp_ep_unpack_plan(v, k->cnt, u, m, NULL, NULL);
      for (int q = 0; q < v->K; q++) {
        int row = v->dest_rows[u * v->K + q];
        if (row >= 0) write_expert_row(v, row, src, mp_bits_f32((uint32_t)m[2 + v->K + q]), m[0], m[1]);
      }
    }
  }
  return 0;
}

int mp_ep_sim_combine(mp_ep_sim *s, const uint16_t *const *y, uint16_t *const *out) {
  int H = s->H;
  float *acc = malloc(sizeof(float) * (size_t)H);
  if (!acc) return fail(s, "out of memory");
  /* C1: at the expert's rank, weighted sum over the token's local experts */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    long n2 = k->cnt[v->cl.off2r + v->G];
    for (long u = 0; u < n2; u++) {
      int seg;
      if (!mp_ep_p2r_valid(v, k->cnt, u, &seg)) continue;
      for (int h = 0; h < H; h++) acc[h] = 0.f;
      for (int q = 0; q < v->K; q++) {
        int row = v->dest_rows[u * v->K + q];
        if (row < 0) continue;
        float wk = v->ex_w[row];
        const uint16_t *yr = y[r] + (long)row * H;
        for (int h = 0; h < H; h++) acc[h] = MP_FMA(wk, mp_bf16_to_f32(yr[h]), acc[h]);
      }
      uint16_t *dst = (uint16_t *)(v->p2r + u * v->cstride);
      for (int h = 0; h < H; h++) dst[h] = mp_f32_to_bf16(acc[h]);
    }
  }
  if (exchange(s, MP_EP_STEP_C2)) goto bad;
  /* C2: at the forwarder, sum over the node's target ranks */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    long n1 = k->cnt[v->cl.off1r + v->N];
    for (long i = 0; i < n1; i++) {
      int seg;
      if (!mp_ep_p1r_valid(v, k->cnt, i, &seg)) continue;
      for (int h = 0; h < H; h++) acc[h] = 0.f;
      for (int j = 0; j < v->G; j++) {
        int pos = v->fwd_pos[i * v->G + j];
        if (pos < 0) continue;
        const uint16_t *src = (const uint16_t *)((j == v->my_local ? v->p2r : v->p2s) + (long)pos * v->cstride);
        for (int h = 0; h < H; h++) acc[h] = MP_ADD(acc[h], mp_bf16_to_f32(src[h]));
      }
      uint16_t *dst = (uint16_t *)(v->p1r + i * v->cstride);
      for (int h = 0; h < H; h++) dst[h] = mp_f32_to_bf16(acc[h]);
    }
  }
  if (exchange(s, MP_EP_STEP_C1)) goto bad;
  /* C3: at the source, sum over the token's nodes */
  for (int r = 0; r < s->R; r++) {
    sim_rank *k = &s->rk[r];
    mp_ep_view *v = &k->v;
    int Treal = v->T / v->expand;
    for (int t = 0; t < Treal; t++) {
      for (int h = 0; h < H; h++) acc[h] = 0.f;
      for (int p = t * v->expand; p < (t + 1) * v->expand; p++) {
        int bufs[MP_EP_MAX_TOPK];
        long rows[MP_EP_MAX_TOPK];
        int n = mp_ep_out_sources(v, k->cnt, p, v->topk + (long)p * v->K, bufs, rows);
        for (int i = 0; i < n; i++) {
          const uint16_t *src = (const uint16_t *)((bufs[i] == MP_EP_BUF_P1R ? v->p1r : v->p1s) + rows[i] * v->cstride);
          for (int h = 0; h < H; h++) acc[h] = MP_ADD(acc[h], mp_bf16_to_f32(src[h]));
        }
      }
      for (int h = 0; h < H; h++) out[r][(long)t * H + h] = mp_f32_to_bf16(acc[h]);
    }
  }
  free(acc);
  return 0;
bad:
  free(acc);
  return -1;
}

void mp_ep_sim_result_of(const mp_ep_sim *s, int d, mp_ep_sim_result *r) {
  const sim_rank *k = &s->rk[d];
  const mp_ep_view *v = &k->v;
  r->expert_off = k->cnt + v->cl.ex_off;
  r->nrows = k->cnt[v->cl.status + MP_EP_ST_EXTOTAL];
  r->overflow = k->cnt[v->cl.status + MP_EP_ST_OVERFLOW];
  r->x = k->ex_x;
  r->scale = k->ex_scale;
  r->w = k->ex_w;
  r->src = k->ex_src;
}

void mp_ep_sim_bytes(const mp_ep_sim *s, int r, long net[MP_EP_NSTEPS], long nvl[MP_EP_NSTEPS]) {
  for (int i = 0; i < MP_EP_NSTEPS; i++) {
    net[i] = s->rk[r].net[i];
    nvl[i] = s->rk[r].nvl[i];
  }
}

const mp_ep_view *mp_ep_sim_view(const mp_ep_sim *s, int r) { return &s->rk[r].v; }
