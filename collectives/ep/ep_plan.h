/* libmplane-ep planner: everything that decides where a token's bytes go, as plain C shared by
 * the CUDA kernels (compiled __host__ __device__), the host code that issues the NCCL sends, and
 * the CPU simulation (ep_sim.c) that CI runs against the independent reference model (ep_model.c).
 *
 * Terms (docs/moe-alltoall.md has the full picture). R ranks, N nodes of G GPUs; rank r sits on
 * node node_of[r] at local index local_of[r]. Expert e lives on rank e / Er (Er experts a rank).
 * A token of source rank s = (n, l):
 *   phase 1 (network): one copy per remote node n' it targets, to rank (n', l) - same local index,
 *     same plane; the copy for its own node is "virtual" (s is its own forwarder);
 *   phase 2 (NVLink): the forwarder (n', l) copies it to each other target GPU (n', j) of its node;
 *     the copy to itself is virtual (it writes the expert rows directly).
 * Every position is decided by prefix sums in token order computed at the source (the layout
 * scans), so the forwarder and the destination never scan: a row carries its slots in its meta.
 *
 * Buffers (rows): p1s = phase-1 send segments, one per node (n' order); p1r = phase-1 receive
 * segments, one per source node (the own-node segment is virtual); p2s = phase-2 send segments,
 * one per local target j; p2r = phase-2 receive segments, one per forwarder l' (the own one
 * virtual). Inside a p2 segment the rows are grouped by source node n' (sub-offsets), then ordered
 * by the source's token order. Combine reuses the same buffers and the same row indices with a
 * BF16 row (stride cstride). Normal mode packs segments back to back from the exchanged counts;
 * worst-case mode (MPLANE_EP_WORST_CASE) puts segment x at x * capacity so the host never needs a
 * count, and the counts on the GPU say which rows are valid. */
#ifndef MPLANE_EP_PLAN_H
#define MPLANE_EP_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "ep_num.h"

#define MP_EP_MAX_TOPK 32
#define MP_EP_MAX_GPN 16
#define MP_EP_MAX_DST (MP_EP_MAX_TOPK + MP_EP_MAX_GPN)

enum { MP_EP_FMT_FP8 = 0, MP_EP_FMT_BF16 = 1 };
enum { MP_EP_BUF_NONE = 0, MP_EP_BUF_CNT, MP_EP_BUF_P1S, MP_EP_BUF_P1R, MP_EP_BUF_P2S, MP_EP_BUF_P2R };
enum { MP_EP_SCAN_RANK = 0, MP_EP_SCAN_NODE, MP_EP_SCAN_EXPERT, MP_EP_SCAN_CLEAR };
enum { MP_EP_ST_EXTOTAL = 0, MP_EP_ST_OVERFLOW = 1, MP_EP_ST_WORDS = 4 };

/* Offsets (in ints) of the parts of one counts block. One block per layout; normal mode copies
 * it to the host once (the only host synchronisation). */
typedef struct mp_ep_cnt_layout {
  int cnt_node, cnt_rank, cnt_exp; /* this rank's tokens: per node [N], rank [R], expert [E] */
  int la, lb;                      /* words of one A / B message */
  int a_send, a_recv;              /* [N][la]: to / from (n', my_local) */
  int b_send, b_recv;              /* [G][lb]: to / from (my_node, j) */
  int off1s, off1r;                /* [N+1] segment starts (rows) of p1s / p1r */
  int off2s, sub2s;                /* [G+1], [G][N+1] p2s segment starts, sub-offsets per source node */
  int off2r, sub2r;                /* [G+1], [G][N+1] p2r likewise */
  int ex_off;                      /* [Er+1] first expert-output row of each local expert */
  int ebase;                       /* [G][N][Er] first row of (forwarder l', source node n', expert) */
  int status;                      /* [MP_EP_ST_WORDS] */
  int total;
} mp_ep_cnt_layout;

/* A la message (source (n, l) -> forwarder (n', l)):
 *   [0] tokens to node n'; [1 + j] tokens to rank (n', j); [1 + G + j*Er + e] tokens to the e-th
 *   expert of rank (n', j).
 * A lb message (forwarder (n, l) -> (n, j)), for each source node n' (block of 1 + Er):
 *   [0] tokens of source (n', l) for (n, j); [1 + e] of them for its e-th expert. */

/* Everything a kernel, the host code or the simulation needs about one rank's operation. Passed
 * by value to kernels: pointers are device pointers there, host pointers in the simulation. */
typedef struct mp_ep_view {
  int R, N, G, me, my_node, my_local;
  const int *node_of, *local_of, *rank_of; /* [R], [R], [N*G] */
  int E, Er, K, H;
  int expand;  /* pseudo tokens per input row: 1, or topk in flat (baseline) mode */
  int T, Tmax; /* tokens now / at most, per rank (pseudo tokens in flat mode) */
  int graph;   /* worst-case segment offsets */
  int fmt;     /* MP_EP_FMT_* of this dispatch */
  int cap_rows;
  long dstride, cstride, meta_off; /* bytes: dispatch row, combine row, meta inside a dispatch row */
  mp_ep_cnt_layout cl;
  int *cnt;
  int32_t *topk;                    /* [Tmax][K] the layout's copy of the expert ids */
  int *nslot_k, *rrank_k, *erank_k; /* [Tmax][K] */
  int *fwd_pos;                     /* [p1r rows][G] */
  int *dest_rows;                   /* [p2r rows][K] */
  char *p1s, *p1r, *p2s, *p2r;
  uint8_t *ex_x;
  float *ex_scale, *ex_w;
  int *ex_src; /* [rows][2]: source rank, source token */
  /* token rows (config token_rows): each (token, this rank) arrival's payload stays in its p2r
   * entry, written once, and expert row r names it in row_token[r] (ex_x / ex_scale unused) */
  int token_rows;
  int32_t *row_token; /* [rows] */
  /* this dispatch's input when it came already in FP8 (mplane_ep_dispatch_fp8): e4m3 [T][H] and
   * scales [T][H / 128]; NULL: BF16 input, quantised by pack */
  const uint8_t *xq;
  const float *xq_scale;
  /* nvlink_direct: phase-2 rows for local target j go straight to peer_p2r[j] (the peer's p2r, an
   * IPC mapping) at the peer's segment for this forwarder; peer_off [R][G+1] holds every rank's
   * p2r segment starts (gathered on the stream before the pack). 0 / NULL: the staging path. */
  int direct;
  char *peer_p2r[MP_EP_MAX_GPN];
  const int *peer_off;
  /* fused direct dispatch (one node): a p2r row is ready when its flag (an int per p2r row, in
   * the receiver's memory; peer_flag[j] maps local peer j's) equals this dispatch's epoch, a
   * counter every rank bumps once per fused dispatch. NULL: the barrier path. */
  int *p2r_flag;
  int *peer_flag[MP_EP_MAX_GPN];
  int *p2s_flag; /* [p2s rows]: the fused dispatch's pack blocks raise one per staged row for its link blocks */
  /* fused dispatch, no all-gather: p2r_flag[start_off + r] is where rank r says it started this
   * epoch's dispatch (its p2r is free), after writing its p2r segment starts into
   * p2r_flag[start_off + R + r * (G + 1) ..] (peer_off points there) and its p2s segment starts
   * into p2r_flag[start_off + R + R * (G + 1) + r * (G + 1) ..]; 0: not in use */
  long start_off;
  int *epoch;
  /* fused direct combine (one node): an expert GPU writes each arrival's weighted sum into the
   * source's p2s row it came from (peer_p2s[j] maps local peer j's p2s) and raises that row's
   * flag, p2r_flag[cflag_off + p2s row] at the source, to the combine's epoch (cepoch counts on
   * the GPU in worst-case mode); before its first write to a peer it waits for the peer's combine
   * start flag, p2r_flag[cflag_off - R + peer rank] here. cflag_off 0: not in use. */
  char *peer_p2s[MP_EP_MAX_GPN];
  long cflag_off;
  int *cepoch;
} mp_ep_view;

/* Fused dispatch and combine (one node): where in p2r_flag rank r's announced p2s segment starts
 * are (G + 1 ints), and where its combine start flag is. */
MP_HD long mp_ep_p2s_starts_at(const mp_ep_view *v, int r) {
  return v->start_off + v->R + (long)v->R * (v->G + 1) + (long)r * (v->G + 1);
}
MP_HD long mp_ep_combine_start_at(const mp_ep_view *v, int r) { return v->cflag_off - v->R + r; }

/* The fused dispatch's next epoch (never 0, the flags' initial value): the GPU counter of
 * worst-case mode and the host counter of normal mode step alike. */
MP_HD int mp_ep_next_epoch(int e) { return e == 0x7fffffff ? 1 : e + 1; }

/* Direct mode: the row of local peer l's p2r that p2s row `row`, of segment l, lands in. */
MP_HD long mp_ep_p2s_peer_row(const mp_ep_view *v, long row, int l) {
  const int peer = v->rank_of[v->my_node * v->G + l];
  return v->peer_off[(long)peer * (v->G + 1) + v->my_local] + row - v->cnt[v->cl.off2s + l];
}

/* Direct mode: p2s row `row` is row *peer_row of local peer *j's p2r. */
MP_HD void mp_ep_p2s_peer(const mp_ep_view *v, long row, int *j, long *peer_row) {
  const int *o2s = v->cnt + v->cl.off2s;
  int l = 0;
  while (l + 1 < v->G && row >= o2s[l + 1]) l++;
  *j = l;
  *peer_row = mp_ep_p2s_peer_row(v, row, l);
}

/* Where phase-2 send row `row` (a p2s row index) is written: the own p2s (staging), or in direct
 * mode the target peer's p2r row that the NCCL step would have received it into. */
MP_HD char *mp_ep_p2s_dst(const mp_ep_view *v, long row, long stride) {
  if (!v->direct) return v->p2s + row * stride;
  int j;
  long pr;
  mp_ep_p2s_peer(v, row, &j, &pr);
  return v->peer_p2r[j] + pr * stride;
}

/* The ready flag of that row at the peer (fused direct dispatch); NULL without flags. */
MP_HD int *mp_ep_p2s_flag(const mp_ep_view *v, long row) {
  if (!v->direct || !v->epoch) return NULL;
  int j;
  long pr;
  mp_ep_p2s_peer(v, row, &j, &pr);
  return v->peer_flag[j] + pr;
}

MP_HD long mp_ep_align16(long x) { return (x + 15) & ~15L; }
MP_HD int mp_ep_meta_words(int K, int G) { return 2 + 3 * K + G; }
MP_HD long mp_ep_payload_bytes(int fmt, int H) {
  return fmt == MP_EP_FMT_FP8 ? (long)H + (long)(H / MP_EP_TILE) * 4 : 2L * H;
}
MP_HD long mp_ep_dstride(int fmt, int H, int K, int G) {
  return mp_ep_align16(mp_ep_payload_bytes(fmt, H) + 4L * mp_ep_meta_words(K, G));
}
MP_HD long mp_ep_cstride(int H) { return mp_ep_align16(2L * H); }

MP_HD void mp_ep_cnt_layout_init(mp_ep_cnt_layout *c, int R, int N, int G, int E, int Er) {
  int o = 0;
  c->cnt_node = o; o += N;
  c->cnt_rank = o; o += R;
  c->cnt_exp = o; o += E;
  c->la = 1 + G + G * Er;
  c->lb = N * (1 + Er);
  c->a_send = o; o += N * c->la;
  c->a_recv = o; o += N * c->la;
  c->b_send = o; o += G * c->lb;
  c->b_recv = o; o += G * c->lb;
  c->off1s = o; o += N + 1;
  c->off1r = o; o += N + 1;
  c->off2s = o; o += G + 1;
  c->sub2s = o; o += G * (N + 1);
  c->off2r = o; o += G + 1;
  c->sub2r = o; o += G * (N + 1);
  c->ex_off = o; o += Er + 1;
  c->ebase = o; o += G * N * Er;
  c->status = o; o += MP_EP_ST_WORDS;
  c->total = o;
}

/* Row capacities of the staging buffers for this shape. */
MP_HD long mp_ep_rows_p1(int N, int Tmax) { return (long)N * Tmax; }
MP_HD long mp_ep_rows_p2(int N, int G, int Tmax) { return (long)N * G * Tmax; }

/* The k-th expert of a token, or -1: ids outside [0, E) and repeats of an earlier k are dropped. */
MP_HD int mp_ep_eff_expert(const int32_t *row, int k, int E) {
  int e = row[k];
  if (e < 0 || e >= E) return -1;
  for (int i = 0; i < k; i++)
    if (row[i] == e) return -1;
  return e;
}

/* The layout keeps a cleaned copy of the ids: each input row of K * expand ids (the caller's
 * top-k; in flat mode one row holds the expand pseudo tokens of a token) with dropped slots set to
 * -1, so repeats are dropped per real token in both modes. */
MP_HD void mp_ep_sanitize_row(const int32_t *in, int32_t *out, int Kin, int E) {
  for (int k = 0; k < Kin; k++) out[k] = mp_ep_eff_expert(in, k, E);
}

MP_HD int mp_ep_expert_rank(const mp_ep_view *v, int e) { return e / v->Er; }

/* Scan units of the layout: R rank scans, N node scans, E expert scans and one clear unit. */
MP_HD int mp_ep_scan_units(const mp_ep_view *v) { return v->R + v->N + v->E + 1; }
MP_HD void mp_ep_scan_unit(const mp_ep_view *v, int u, int *role, int *target) {
  if (u < v->R) { *role = MP_EP_SCAN_RANK; *target = u; }
  else if (u < v->R + v->N) { *role = MP_EP_SCAN_NODE; *target = u - v->R; }
  else if (u < v->R + v->N + v->E) { *role = MP_EP_SCAN_EXPERT; *target = u - v->R - v->N; }
  else { *role = MP_EP_SCAN_CLEAR; *target = 0; }
}

/* Which top-k slots of a token the unit counts (bit k); the token counts once if any bit is set. */
MP_HD uint32_t mp_ep_scan_mask(const mp_ep_view *v, const int32_t *row, int role, int target) {
  uint32_t m = 0;
  for (int k = 0; k < v->K; k++) {
    int e = mp_ep_eff_expert(row, k, v->E);
    int hit;
    if (role == MP_EP_SCAN_CLEAR) {
      hit = e < 0;
    } else {
      if (e < 0) continue;
      int d = mp_ep_expert_rank(v, e);
      hit = role == MP_EP_SCAN_RANK ? d == target
          : role == MP_EP_SCAN_NODE ? v->node_of[d] == target
          : e == target;
    }
    if (hit) m |= 1u << k;
  }
  return m;
}

/* The array a scan unit writes its prefix into, and where its total goes. */
MP_HD int *mp_ep_scan_out(const mp_ep_view *v, int role) {
  return role == MP_EP_SCAN_RANK ? v->rrank_k : role == MP_EP_SCAN_NODE ? v->nslot_k : v->erank_k;
}
MP_HD int mp_ep_scan_total_index(const mp_ep_view *v, int role, int target) {
  return role == MP_EP_SCAN_RANK ? v->cl.cnt_rank + target
       : role == MP_EP_SCAN_NODE ? v->cl.cnt_node + target
       : role == MP_EP_SCAN_EXPERT ? v->cl.cnt_exp + target : -1;
}
/* The clear unit writes -1 into all three arrays for dropped slots. */
MP_HD void mp_ep_scan_clear(const mp_ep_view *v, int t, uint32_t mask) {
  for (int k = 0; k < v->K; k++)
    if (mask & (1u << k)) {
      long i = (long)t * v->K + k;
      v->nslot_k[i] = -1;
      v->rrank_k[i] = -1;
      v->erank_k[i] = -1;
    }
}

/* Word i of the A message to node n (written into a_send, and a_recv for the own node). */
MP_HD int mp_ep_a_word(const mp_ep_view *v, const int *c, int n, int i) {
  const mp_ep_cnt_layout *L = &v->cl;
  if (i == 0) return c[L->cnt_node + n];
  if (i < 1 + v->G) return c[L->cnt_rank + v->rank_of[n * v->G + (i - 1)]];
  int j = (i - 1 - v->G) / v->Er, e = (i - 1 - v->G) % v->Er;
  int d = v->rank_of[n * v->G + j];
  return c[L->cnt_exp + d * v->Er + e];
}

/* Word i of the B message to local j, built from the received A messages. */
MP_HD int mp_ep_b_word(const mp_ep_view *v, const int *c, int j, int i) {
  const mp_ep_cnt_layout *L = &v->cl;
  int n = i / (1 + v->Er), w = i % (1 + v->Er);
  const int *a = c + L->a_recv + n * L->la;
  return w == 0 ? a[1 + j] : a[1 + v->G + j * v->Er + (w - 1)];
}

/* Segment offsets from the exchanged counts (or the worst-case grid). Single thread. */
MP_HD void mp_ep_offsets_segments(const mp_ep_view *v, int *c) {
  const mp_ep_cnt_layout *L = &v->cl;
  int N = v->N, G = v->G, Tm = v->Tmax;
  long acc = 0;
  for (int n = 0; n < N; n++) {
    c[L->off1s + n] = v->graph ? n * Tm : (int)acc;
    acc += c[L->cnt_node + n];
  }
  c[L->off1s + N] = v->graph ? N * Tm : (int)acc;
  acc = 0;
  for (int n = 0; n < N; n++) {
    c[L->off1r + n] = v->graph ? n * Tm : (int)acc;
    acc += c[L->a_recv + n * L->la];
  }
  c[L->off1r + N] = v->graph ? N * Tm : (int)acc;
  acc = 0;
  for (int j = 0; j < G; j++) {
    c[L->off2s + j] = v->graph ? j * N * Tm : (int)acc;
    int s = 0;
    for (int n = 0; n < N; n++) {
      c[L->sub2s + j * (N + 1) + n] = s;
      s += c[L->a_recv + n * L->la + 1 + j];
    }
    c[L->sub2s + j * (N + 1) + N] = s;
    acc += s;
  }
  c[L->off2s + G] = v->graph ? G * N * Tm : (int)acc;
  acc = 0;
  for (int l = 0; l < G; l++) {
    c[L->off2r + l] = v->graph ? l * N * Tm : (int)acc;
    int s = 0;
    for (int n = 0; n < N; n++) {
      c[L->sub2r + l * (N + 1) + n] = s;
      s += c[L->b_recv + l * L->lb + n * (1 + v->Er)];
    }
    c[L->sub2r + l * (N + 1) + N] = s;
    acc += s;
  }
  c[L->off2r + G] = v->graph ? G * N * Tm : (int)acc;
}

/* Rows this rank receives for its local expert e (all forwarders, all source nodes). */
MP_HD int mp_ep_expert_total(const mp_ep_view *v, const int *c, int e) {
  const mp_ep_cnt_layout *L = &v->cl;
  int s = 0;
  for (int l = 0; l < v->G; l++)
    for (int n = 0; n < v->N; n++) s += c[L->b_recv + l * L->lb + n * (1 + v->Er) + 1 + e];
  return s;
}

/* Expert prefix (needs the totals in ex_off[e + 1] slots first); single thread. */
MP_HD void mp_ep_offsets_experts_prefix(const mp_ep_view *v, int *c) {
  const mp_ep_cnt_layout *L = &v->cl;
  int acc = 0;
  for (int e = 0; e < v->Er; e++) {
    int tot = c[L->ex_off + e + 1];
    c[L->ex_off + e] = acc;
    acc += tot;
  }
  c[L->ex_off + v->Er] = acc;
}

/* Per expert: first output row of every (forwarder, source node) block; rows of expert e are
 * ordered by forwarder (= source local index) l', then source node n', then source token. */
MP_HD void mp_ep_offsets_expert_bases(const mp_ep_view *v, int *c, int e) {
  const mp_ep_cnt_layout *L = &v->cl;
  int run = c[L->ex_off + e];
  for (int l = 0; l < v->G; l++)
    for (int n = 0; n < v->N; n++) {
      c[L->ebase + (l * v->N + n) * v->Er + e] = run;
      run += c[L->b_recv + l * L->lb + n * (1 + v->Er) + 1 + e];
    }
}

MP_HD void mp_ep_offsets_status(const mp_ep_view *v, int *c) {
  const mp_ep_cnt_layout *L = &v->cl;
  int tot = c[L->ex_off + v->Er];
  c[L->status + MP_EP_ST_EXTOTAL] = tot;
  c[L->status + MP_EP_ST_OVERFLOW] = tot > v->cap_rows;
  c[L->status + 2] = 0;
  c[L->status + 3] = 0;
}

/* All of the above in order (the host and the simulation; the GPU splits it over threads). */
MP_HD void mp_ep_offsets(const mp_ep_view *v, int *c) {
  mp_ep_offsets_segments(v, c);
  for (int e = 0; e < v->Er; e++) c[v->cl.ex_off + e + 1] = mp_ep_expert_total(v, c, e);
  mp_ep_offsets_experts_prefix(v, c);
  for (int e = 0; e < v->Er; e++) mp_ep_offsets_expert_bases(v, c, e);
  mp_ep_offsets_status(v, c);
}

/* Segment of flat index i: the largest s < nseg with off[s] <= i (empty segments skipped). */
MP_HD int mp_ep_seg_find(const int *off, int nseg, long i) {
  int lo = 0, hi = nseg - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (off[mid] <= i) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

/* Is p1r row i (0 <= i < off1r[N]) a real row? Its source node goes to *seg. */
MP_HD int mp_ep_p1r_valid(const mp_ep_view *v, const int *c, long i, int *seg) {
  const mp_ep_cnt_layout *L = &v->cl;
  int s = mp_ep_seg_find(c + L->off1r, v->N, i);
  *seg = s;
  return i - c[L->off1r + s] < c[L->a_recv + s * L->la];
}

/* Is p2s row i (0 <= i < off2s[G]) a real row (worst-case mode pads segments)? Its target
 * local GPU goes to *seg. */
MP_HD int mp_ep_p2s_valid(const mp_ep_view *v, const int *c, long i, int *seg) {
  const mp_ep_cnt_layout *L = &v->cl;
  int s = mp_ep_seg_find(c + L->off2s, v->G, i);
  *seg = s;
  return i - c[L->off2s + s] < c[L->sub2s + s * (v->N + 1) + v->N];
}

/* Is p2r entry i (0 <= i < off2r[G]) a real entry? Its forwarder goes to *seg. */
MP_HD int mp_ep_p2r_valid(const mp_ep_view *v, const int *c, long i, int *seg) {
  const mp_ep_cnt_layout *L = &v->cl;
  int s = mp_ep_seg_find(c + L->off2r, v->G, i);
  *seg = s;
  return i - c[L->off2r + s] < c[L->sub2r + s * (v->N + 1) + v->N];
}

/* Expert-output row of (forwarder l, source node n, local expert er, rank in that stream), or -1
 * past the capacity (worst-case mode with max_recv_rows set too small: the row is dropped). */
MP_HD int mp_ep_expert_row(const mp_ep_view *v, const int *c, int l, int n, int er, int erank) {
  long row = (long)c[v->cl.ebase + (l * v->N + n) * v->Er + er] + erank;
  return row < v->cap_rows ? (int)row : -1;
}

/* ---- meta: int32 words at the end of every dispatch row ----
 * [0] source rank, [1] source (pseudo) token, [2 + k] expert or -1, [2 + K + k] weight bits,
 * [2 + 2K + k] rank of the token in the (source, expert) stream, [2 + 3K + j] rank of the token in
 * the (source, rank (node, j)) stream, -1 if it does not go there; node = the row's target node. */
MP_HD void mp_ep_meta_write(const mp_ep_view *v, int32_t *m, int t, const int32_t *row, const float *wrow,
                            const int *rrank_row, const int *erank_row, int node) {
  int K = v->K;
  m[0] = v->me;
  m[1] = t;
  for (int j = 0; j < v->G; j++) m[2 + 3 * K + j] = -1;
  for (int k = 0; k < K; k++) {
    int e = mp_ep_eff_expert(row, k, v->E);
    m[2 + k] = e;
    m[2 + K + k] = e >= 0 ? (int32_t)mp_f32_bits(wrow[k]) : 0;
    m[2 + 2 * K + k] = e >= 0 ? erank_row[k] : -1;
    if (e >= 0) {
      int d = mp_ep_expert_rank(v, e);
      if (v->node_of[d] == node) m[2 + 3 * K + v->local_of[d]] = rrank_row[k];
    }
  }
}

/* ---- dispatch, source side: where token t goes ---- */
typedef struct mp_ep_pack_plan {
  int ndst;                       /* staging rows: phase-1 rows (remote nodes), phase-2 rows (own node) */
  int dst_buf[MP_EP_MAX_DST];     /* MP_EP_BUF_P1S or MP_EP_BUF_P2S */
  int dst_row[MP_EP_MAX_DST];
  int dst_node[MP_EP_MAX_DST];    /* the node whose stream slots go into that row's meta */
  int nexp;                       /* expert-output rows at this rank (token routed to itself) */
  int exp_row[MP_EP_MAX_TOPK];    /* -1: dropped for capacity */
  int exp_k[MP_EP_MAX_TOPK];
  int entry;                      /* the token's p2r entry at this rank, -1 */
  int v_self;                     /* the token's p1r row in the own-node (virtual) segment, -1 */
  int fwd[MP_EP_MAX_GPN];         /* fwd_pos of v_self */
} mp_ep_pack_plan;

/* Token t's plan from its K expert ids (row) and its slots in the node, rank and expert streams
 * (nslot, rrank, erank: the layout's rows for t). The kernels pass copies of those four rows in
 * shared memory, loaded by the whole warp at once: read from global memory one after the other,
 * their latencies added up to most of the pack kernel's time. */
MP_HD void mp_ep_pack_plan_make(const mp_ep_view *v, const int *c, const int32_t *row, const int *nslot,
                                const int *rrank, const int *erank, mp_ep_pack_plan *p) {
  const mp_ep_cnt_layout *L = &v->cl;
  uint32_t local_done = 0;
  p->ndst = 0;
  p->nexp = 0;
  p->entry = -1;
  p->v_self = -1;
  for (int j = 0; j < v->G; j++) p->fwd[j] = -1;
  for (int k = 0; k < v->K; k++) {
    int e = mp_ep_eff_expert(row, k, v->E);
    if (e < 0) continue;
    int d = mp_ep_expert_rank(v, e), nd = v->node_of[d], jd = v->local_of[d];
    if (nd != v->my_node) {
      int seen = 0;
      for (int i = 0; i < p->ndst; i++)
        if (p->dst_buf[i] == MP_EP_BUF_P1S && p->dst_node[i] == nd) seen = 1;
      if (!seen) {
        p->dst_buf[p->ndst] = MP_EP_BUF_P1S;
        p->dst_row[p->ndst] = c[L->off1s + nd] + nslot[k];
        p->dst_node[p->ndst] = nd;
        p->ndst++;
      }
      continue;
    }
    p->v_self = c[L->off1r + v->my_node] + nslot[k];
    if (jd != v->my_local) {
      if (!(local_done & (1u << jd))) {
        local_done |= 1u << jd;
        int r2 = c[L->off2s + jd] + c[L->sub2s + jd * (v->N + 1) + v->my_node] + rrank[k];
        p->dst_buf[p->ndst] = MP_EP_BUF_P2S;
        p->dst_row[p->ndst] = r2;
        p->dst_node[p->ndst] = v->my_node;
        p->ndst++;
        p->fwd[jd] = r2;
      }
    } else {
      p->entry = c[L->off2r + v->my_local] + c[L->sub2r + v->my_local * (v->N + 1) + v->my_node] + rrank[k];
      p->fwd[jd] = p->entry;
      p->exp_row[p->nexp] = mp_ep_expert_row(v, c, v->my_local, v->my_node, e - v->me * v->Er, erank[k]);
      p->exp_k[p->nexp] = k;
      p->nexp++;
    }
  }
}

/* The index arrays combine needs (fwd_pos of the own-node row, dest_rows of the self entry). */
MP_HD void mp_ep_pack_plan_commit(const mp_ep_view *v, const mp_ep_pack_plan *p) {
  if (p->v_self >= 0)
    for (int j = 0; j < v->G; j++) v->fwd_pos[(long)p->v_self * v->G + j] = p->fwd[j];
  if (p->entry >= 0) {
    int *dr = v->dest_rows + (long)p->entry * v->K;
    for (int k = 0; k < v->K; k++) dr[k] = -1;
    for (int i = 0; i < p->nexp; i++) dr[p->exp_k[i]] = p->exp_row[i];
  }
}

/* ---- dispatch, forwarder side: phase-1 row v (from a remote node) ---- */
typedef struct mp_ep_fwd_plan {
  int ndst;
  int dst_row[MP_EP_MAX_GPN]; /* p2s rows */
  int nexp;
  int exp_row[MP_EP_MAX_TOPK];
  int exp_k[MP_EP_MAX_TOPK];
  int entry; /* p2r entry at this rank when the token targets it, -1 */
  int fwd[MP_EP_MAX_GPN];
  int src_node;
} mp_ep_fwd_plan;

MP_HD void mp_ep_fwd_plan_make(const mp_ep_view *v, const int *c, const int32_t *m, mp_ep_fwd_plan *p) {
  const mp_ep_cnt_layout *L = &v->cl;
  int K = v->K, N = v->N;
  int n = v->node_of[m[0]];
  p->src_node = n;
  p->ndst = 0;
  p->nexp = 0;
  p->entry = -1;
  for (int j = 0; j < v->G; j++) {
    int rr = m[2 + 3 * K + j];
    p->fwd[j] = -1;
    if (rr < 0) continue;
    if (j != v->my_local) {
      int r2 = c[L->off2s + j] + c[L->sub2s + j * (N + 1) + n] + rr;
      p->dst_row[p->ndst++] = r2;
      p->fwd[j] = r2;
    } else {
      p->entry = c[L->off2r + j] + c[L->sub2r + j * (N + 1) + n] + rr;
      p->fwd[j] = p->entry;
      for (int k = 0; k < K; k++) {
        int e = m[2 + k];
        if (e >= 0 && mp_ep_expert_rank(v, e) == v->me) {
          p->exp_row[p->nexp] = mp_ep_expert_row(v, c, v->my_local, n, e - v->me * v->Er, m[2 + 2 * K + k]);
          p->exp_k[p->nexp] = k;
          p->nexp++;
        }
      }
    }
  }
}

MP_HD void mp_ep_fwd_plan_commit(const mp_ep_view *v, long row_v, const mp_ep_fwd_plan *p) {
  for (int j = 0; j < v->G; j++) v->fwd_pos[row_v * v->G + j] = p->fwd[j];
  if (p->entry >= 0) {
    int *dr = v->dest_rows + (long)p->entry * v->K;
    for (int k = 0; k < v->K; k++) dr[k] = -1;
    for (int i = 0; i < p->nexp; i++) dr[p->exp_k[i]] = p->exp_row[i];
  }
}

/* ---- dispatch, destination side: phase-2 entry u (from another forwarder of the node) ----
 * Fills dest_rows[u] and returns how many expert rows the entry has (dropped ones not counted).
 * When rows is given, also lists them and their top-k slots in rows/ks (the kernel: no read-back
 * of dest_rows). */
MP_HD int mp_ep_unpack_plan(const mp_ep_view *v, const int *c, long u, const int32_t *m, int *rows, int *ks) {
  int K = v->K, src = m[0], n = v->node_of[src], l = v->local_of[src], cnt = 0;
  int *dr = v->dest_rows + u * K;
  for (int k = 0; k < K; k++) {
    int e = m[2 + k], r = -1;
    if (e >= 0 && mp_ep_expert_rank(v, e) == v->me) r = mp_ep_expert_row(v, c, l, n, e - v->me * v->Er, m[2 + 2 * K + k]);
    dr[k] = r;
    if (r < 0) continue;
    if (rows) {
      rows[cnt] = r;
      ks[cnt] = k;
    }
    cnt++;
  }
  return cnt;
}

/* ---- combine, at the source: where the per-node partial sums of token t come back ----
 * Ascending node order (the order of the final sum). Returns the count. */
MP_HD int mp_ep_out_sources(const mp_ep_view *v, const int *c, int t, const int32_t *row, int *buf, long *rowi) {
  const mp_ep_cnt_layout *L = &v->cl;
  const int *nslot = v->nslot_k + (long)t * v->K;
  int n = 0, nodes[MP_EP_MAX_TOPK], slots[MP_EP_MAX_TOPK];
  for (int k = 0; k < v->K; k++) {
    int e = mp_ep_eff_expert(row, k, v->E);
    if (e < 0) continue;
    int nd = v->node_of[mp_ep_expert_rank(v, e)], seen = 0;
    for (int i = 0; i < n; i++)
      if (nodes[i] == nd) seen = 1;
    if (seen) continue;
    int i = n++;
    while (i > 0 && nodes[i - 1] > nd) {
      nodes[i] = nodes[i - 1];
      slots[i] = slots[i - 1];
      i--;
    }
    nodes[i] = nd;
    slots[i] = nslot[k];
  }
  for (int i = 0; i < n; i++) {
    if (nodes[i] == v->my_node) {
      buf[i] = MP_EP_BUF_P1R;
      rowi[i] = c[L->off1r + v->my_node] + slots[i];
    } else {
      buf[i] = MP_EP_BUF_P1S;
      rowi[i] = c[L->off1s + nodes[i]] + slots[i];
    }
  }
  return n;
}

#endif
