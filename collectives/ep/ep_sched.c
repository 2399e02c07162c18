/* libmplane-ep planner, host side (see ep_sched.h). */
#include "ep_sched.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static long min_l(long a, long b) { return a < b ? a : b; }
static long max_l(long a, long b) { return a > b ? a : b; }

void mp_ep_shape_rows(const mp_ep_shape *s, mp_ep_rows *out) {
  long T = s->Tmax, N = s->N, G = s->G, K = s->K;
  int Er = s->E / s->R;
  out->p1s = s->graph ? N * T : T * min_l(N, K);
  out->p1r = N * T;
  out->p2s = G > 1 ? (s->graph ? G * N * T : N * T * min_l(G, K)) : 0;
  out->p2r = (long)s->R * T;
  long worst = (long)s->R * T * min_l(K, Er);
  out->cap_rows = s->cap_rows > 0 ? min_l(s->cap_rows, worst) : worst;
  out->row_bytes = max_l(mp_ep_dstride(MP_EP_FMT_BF16, s->H, s->K, s->G), mp_ep_cstride(s->H));
}

int mp_ep_view_init(mp_ep_view *v, const mp_ep_shape *s, const int *node_of, const int *local_of,
                    const int *rank_of, char *err, size_t errlen) {
  memset(v, 0, sizeof(*v));
  if (s->R < 1 || s->N < 1 || s->G < 1 || s->N * s->G != s->R) {
    snprintf(err, errlen, "ranks %d != nodes %d x GPUs per node %d", s->R, s->N, s->G);
    return -1;
  }
  if (s->G > MP_EP_MAX_GPN) {
    snprintf(err, errlen, "GPUs per node %d: at most %d supported", s->G, MP_EP_MAX_GPN);
    return -1;
  }
  if (s->K < 1 || s->K > MP_EP_MAX_TOPK) {
    snprintf(err, errlen, "topk %d: expected 1..%d", s->K, MP_EP_MAX_TOPK);
    return -1;
  }
  if (s->E < s->R || s->E % s->R != 0) {
    snprintf(err, errlen, "num_experts %d must be a positive multiple of the rank count %d", s->E, s->R);
    return -1;
  }
  if (s->H < MP_EP_TILE || s->H % MP_EP_TILE != 0) {
    snprintf(err, errlen, "hidden %d must be a positive multiple of %d", s->H, MP_EP_TILE);
    return -1;
  }
  if (s->Tmax < 1) {
    snprintf(err, errlen, "max_tokens %d must be positive", s->Tmax);
    return -1;
  }
  mp_ep_rows rows;
  mp_ep_shape_rows(s, &rows);
  if (rows.p2r > (1L << 30) || rows.cap_rows > (1L << 30) || rows.p1r * s->G > (1L << 30)) {
    snprintf(err, errlen, "max_tokens %d x ranks %d x topk %d is too large (row indices are 32-bit)", s->Tmax,
             s->R, s->K);
    return -1;
  }
  v->R = s->R;
  v->N = s->N;
  v->G = s->G;
  v->me = s->me;
  v->node_of = node_of;
  v->local_of = local_of;
  v->rank_of = rank_of;
  v->my_node = node_of[s->me];
  v->my_local = local_of[s->me];
  v->E = s->E;
  v->Er = s->E / s->R;
  v->K = s->K;
  v->H = s->H;
  v->expand = s->expand > 0 ? s->expand : 1;
  v->Tmax = s->Tmax;
  v->graph = s->graph;
  v->cap_rows = (int)rows.cap_rows;
  v->cstride = mp_ep_cstride(s->H);
  mp_ep_cnt_layout_init(&v->cl, v->R, v->N, v->G, v->E, v->Er);
  return 0;
}

void mp_ep_topology_contiguous(int R, int G, int *node_of, int *local_of, int *rank_of) {
  for (int r = 0; r < R; r++) {
    node_of[r] = r / G;
    local_of[r] = r % G;
    rank_of[r] = r;
  }
}

int mp_ep_topology_from_keys(int R, const uint64_t *keys, int gpus_per_node, int *N, int *G, int *node_of,
                             int *local_of, int *rank_of, char *err, size_t errlen) {
  int nn = 0;
  int *count = calloc((size_t)R, sizeof(int));
  if (!count) {
    snprintf(err, errlen, "out of host memory");
    return -1;
  }
  for (int r = 0; r < R; r++) {
    int n = -1;
    for (int q = 0; q < r; q++)
      if (keys[q] == keys[r]) {
        n = node_of[q];
        break;
      }
    if (n < 0) n = nn++;
    node_of[r] = n;
    local_of[r] = count[n]++;
  }
  int g = count[0];
  for (int n = 1; n < nn; n++)
    if (count[n] != g) {
      snprintf(err, errlen, "nodes have different GPU counts (node 0: %d, node %d: %d); every node must have the same",
               g, n, count[n]);
      free(count);
      return -1;
    }
  free(count);
  if (gpus_per_node > 0 && gpus_per_node != g) {
    snprintf(err, errlen, "gpus_per_node=%d given, but NCCL's host identities group the ranks %d per node", gpus_per_node,
             g);
    return -1;
  }
  for (int r = 0; r < R; r++) rank_of[node_of[r] * g + local_of[r]] = r;
  *N = nn;
  *G = g;
  return 0;
}

static int phys_net(const mp_ep_view *v, const int *phys, int peer) {
  const int *p = phys ? phys : v->node_of;
  return p[peer] != p[v->me];
}

/* A data transfer with peer slot k: send rows [c[so+k], c[so+k+1]) of buffer sbuf and receive rows
 * [c[ro+k], c[ro+k+1]) into rbuf, each row `unit` bytes. Dispatch and combine use it with the
 * buffers swapped (combine sends back where dispatch received). */
static void set_rows(mp_ep_xfer *t, const int *c, int k, int sbuf, int so, int rbuf, int ro, long unit) {
  t->send_buf = sbuf;
  t->send_off = c[so + k] * unit;
  t->send_bytes = (long)(c[so + k + 1] - c[so + k]) * unit;
  t->recv_buf = rbuf;
  t->recv_off = c[ro + k] * unit;
  t->recv_bytes = (long)(c[ro + k + 1] - c[ro + k]) * unit;
}

int mp_ep_schedule(const mp_ep_view *v, const int *c, const int *phys_node_of, int step, mp_ep_xfer *x) {
  const mp_ep_cnt_layout *L = &v->cl;
  int n_out = 0;
  long ds = v->dstride, cs = v->cstride;
  if (step == MP_EP_STEP_A || step == MP_EP_STEP_D1 || step == MP_EP_STEP_C1) {
    for (int n = 0; n < v->N; n++) {
      if (n == v->my_node) continue;
      mp_ep_xfer t;
      memset(&t, 0, sizeof(t));
      t.peer = v->rank_of[n * v->G + v->my_local];
      if (step == MP_EP_STEP_A) {
        t.send_buf = t.recv_buf = MP_EP_BUF_CNT;
        t.send_off = 4L * (L->a_send + n * L->la);
        t.recv_off = 4L * (L->a_recv + n * L->la);
        t.send_bytes = t.recv_bytes = 4L * L->la;
      } else if (step == MP_EP_STEP_D1) {
        set_rows(&t, c, n, MP_EP_BUF_P1S, L->off1s, MP_EP_BUF_P1R, L->off1r, ds);
      } else {
        set_rows(&t, c, n, MP_EP_BUF_P1R, L->off1r, MP_EP_BUF_P1S, L->off1s, cs);
      }
      t.net = phys_net(v, phys_node_of, t.peer);
      if (t.send_bytes || t.recv_bytes) x[n_out++] = t;
    }
  } else if (step == MP_EP_STEP_B || step == MP_EP_STEP_D2 || step == MP_EP_STEP_C2) {
    for (int j = 0; j < v->G; j++) {
      if (j == v->my_local) continue;
      mp_ep_xfer t;
      memset(&t, 0, sizeof(t));
      t.peer = v->rank_of[v->my_node * v->G + j];
      if (step == MP_EP_STEP_B) {
        t.send_buf = t.recv_buf = MP_EP_BUF_CNT;
        t.send_off = 4L * (L->b_send + j * L->lb);
        t.recv_off = 4L * (L->b_recv + j * L->lb);
        t.send_bytes = t.recv_bytes = 4L * L->lb;
      } else if (step == MP_EP_STEP_D2) {
        set_rows(&t, c, j, MP_EP_BUF_P2S, L->off2s, MP_EP_BUF_P2R, L->off2r, ds);
      } else {
        set_rows(&t, c, j, MP_EP_BUF_P2R, L->off2r, MP_EP_BUF_P2S, L->off2s, cs);
      }
      t.net = phys_net(v, phys_node_of, t.peer);
      if (t.send_bytes || t.recv_bytes) x[n_out++] = t;
    }
  }
  return n_out;
}

void mp_ep_step_bytes(const mp_ep_view *v, const int *c, const int *phys_node_of, int step, long *net, long *nvl) {
  *net = *nvl = 0;
  mp_ep_xfer *x = malloc(sizeof(*x) * (size_t)(v->N > v->G ? v->N : v->G));
  if (!x) return;
  int nx = mp_ep_schedule(v, c, phys_node_of, step, x);
  for (int i = 0; i < nx; i++) {
    if (x[i].net) *net += x[i].send_bytes;
    else *nvl += x[i].send_bytes;
  }
  free(x);
}
