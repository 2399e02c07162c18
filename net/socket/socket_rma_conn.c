/* mplane: a one-sided connection's I/O over TCP (socket_rma.h): how records are sent (at once, from
 * rmaProgress in batches, or by the writer thread), the record parser that serves the peer's puts
 * and gets and takes its answers, the connection threads, and rmaProgress.
 *
 * Who moves the bytes: NCCL's GIN progress thread spins and calls rmaProgress in its loop, so that
 * is where the I/O happens, with no thread hand-off per op. Ops with host data that it posts, and
 * its answers, wait in their connection's queue and rmaProgress sends a queue in one non-blocking
 * sendmsg once a burst is over (signals alone and GPU data go at once: mpr_conn_send); rmaProgress
 * reads every connection with bytes waiting (epoll) through a record parser that takes records in
 * pieces (struct mpr_rd), serving puts and gets and taking answers. Each connection also has a
 * writer thread (large records, the tail of a send the socket did not take, callers that never call
 * rmaProgress) and a reader thread that rests while rmaProgress is being called and reads when it
 * is not; the parser is taken under rlock by whichever thread gets there. Nothing that serves the
 * peer ever blocks on a write, so two peers writing large puts at each other cannot both stall.
 *
 * Responses arrive in the order their requests were written (one reader serves them in order at
 * the target), so each response matches the oldest pending request; anything else fails the
 * connection. A closed or reset connection (a dead peer) fails every request queued or pending on
 * it and marks the context, which query_last_error reports. */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../../common/nccl/rma.h"
#include "../../common/cuda.h"
#include "../../common/test_hooks.h"
#include "../relay.h"
#include "../rma_ctrl.h"
#include "socket.h"
#include "socket_rma.h"

/* ---- windows and time, as the target side reads them ---- */
int mpr_timeout_ms(void) { return mplane_rma_timeout_ms(mps_config()); }

/* Window id -> a copy of its record, with the windows read-held by the caller. */
static int win_find_locked(struct mpr_group *g, uint32_t id, struct mpr_win *out) {
  if (id >= g->nwins || !g->wins[id].live) return 0;
  *out = g->wins[id];
  return 1;
}

int mpr_win_get(struct mpr_group *g, uint32_t id, struct mpr_win *out) {
  pthread_rwlock_rdlock(&g->win_lock);
  int ok = win_find_locked(g, id, out);
  pthread_rwlock_unlock(&g->win_lock);
  return ok;
}

/* About to touch w's memory for a peer: 1 with the windows read-held (win_leave lets go) while w is
 * still registered; 0, nothing held, once deregMrSym took it out of service. */
static int win_enter(struct mpr_group *g, const struct mpr_win *w) {
  pthread_rwlock_rdlock(&g->win_lock);
  if (w->id < g->nwins && g->wins[w->id].live && g->wins[w->id].base == w->base) return 1;
  pthread_rwlock_unlock(&g->win_lock);
  return 0;
}

static void win_leave(struct mpr_group *g) { pthread_rwlock_unlock(&g->win_lock); }

int mpr_range_ok(const struct mpr_win *w, uint64_t off, uint64_t size) {
  return off <= w->size && size <= w->size - off;
}

/* Copy between a window and host memory; GPU windows through the CUDA driver. */
int mpr_win_write(const struct mpr_win *w, uint64_t off, const void *src, size_t n) {
  if (n == 0) return 0;
  if (w->gpu < 0) {
    memcpy(w->base + off, src, n);
    return 0;
  }
  uint64_t t0 = mplane_now_ns();
  int rc = mplane_cuda_memcpy_htod_nb(w->gpu, w->base + off, src, n);
  MP_TRACE(NCCL_NET, "RMA copy of %zu bytes into GPU window %u: %.1f us", n, w->id, (double)(mplane_now_ns() - t0) / 1e3);
  return rc;
}

int mpr_win_read(const struct mpr_win *w, uint64_t off, void *dst, size_t n) {
  if (n == 0) return 0;
  if (w->gpu < 0) {
    memcpy(dst, w->base + off, n);
    return 0;
  }
  uint64_t t0 = mplane_now_ns();
  int rc = mplane_cuda_memcpy_dtoh_nb(w->gpu, dst, w->base + off, n);
  MP_TRACE(NCCL_NET, "RMA copy of %zu bytes out of GPU window %u: %.1f us", n, w->id, (double)(mplane_now_ns() - t0) / 1e3);
  return rc;
}

static int landed(struct mpr_conn *c);

/* Set in a thread once it calls rmaProgress: the ops it posts may wait there to be sent together. */
static __thread int mpr_progress_thread;

static char *stage_get(struct mpr_stage *s, size_t size, int gpu) {
  if (!s->p && gpu >= 0) s->pinned = (s->p = mplane_cuda_host_alloc(gpu, size)) != NULL;
  if (!s->p) s->p = malloc(size);
  return s->p;
}

static void stage_free(struct mpr_stage *s) {
  if (s->pinned) mplane_cuda_host_free(s->p);
  else free(s->p);
  s->p = NULL;
}

/* ---- rings of pinned memory for asynchronous GPU copies ---- */
static size_t clamp_size(size_t v, size_t lo, size_t hi) { return v < lo ? lo : v > hi ? hi : v; }

void mpr_ctxset_size_rings(struct mpr_ctxset *s, size_t nconn) {
  if (nconn == 0) nconn = 1;
  s->lring_size = clamp_size(MPR_RING_BUDGET / nconn, MPR_RING_MIN, MPR_LRING_MAX);
  s->sring_size = clamp_size(MPR_RING_BUDGET / 2 / nconn, MPR_RING_MIN, MPR_SRING_MAX);
  s->wstage_size = clamp_size(MPR_RING_BUDGET / nconn, MPR_WSTAGE_MIN, MPR_STAGE);
}

static int ring_ready(struct mpr_ring *g, size_t size, int gpu) {
  if (!g->p && (g->p = mplane_cuda_host_alloc(gpu, size))) {
    g->size = size;
    g->gpu = gpu;
  }
  return g->p != NULL;
}

/* Freed once no copy still reads or fills it (the last piece's, bounded by the timeout). */
static void ring_free(struct mpr_ring *g) {
  if (!g->p) return;
  uint64_t last = g->eh == g->et ? 0 : g->e[(g->eh - 1) % MPR_RING_ENTRIES].seq;
  if (last && last != UINT64_MAX) mplane_cuda_lane_wait(g->gpu, last, mpr_timeout_ms());
  mplane_cuda_host_free(g->p);
  g->p = NULL;
}

/* Give back, in order, the pieces whose copies completed (a landing ring). */
static void ring_reclaim(struct mpr_ring *g, uint64_t done) {
  while (g->et != g->eh && g->e[g->et % MPR_RING_ENTRIES].seq <= done) g->tail = g->e[g->et++ % MPR_RING_ENTRIES].end;
}

/* Give back, in order, the pieces that end at or before `end` (a send ring: their bytes were sent). */
static void ring_release(struct mpr_ring *g, uint64_t end) {
  while (g->et != g->eh && g->e[g->et % MPR_RING_ENTRIES].end <= end) g->tail = g->e[g->et++ % MPR_RING_ENTRIES].end;
}

/* n contiguous bytes (n <= size), or NULL when the ring is full; the piece's copy is `seq` (set it
 * with ring_set_seq once known). A piece that would wrap starts at the beginning instead. */
static char *ring_take(struct mpr_ring *g, size_t n) {
  uint64_t pos = g->head % g->size, pad = pos + n > g->size ? g->size - pos : 0;
  if (g->eh - g->et == MPR_RING_ENTRIES || g->head + pad + n - g->tail > g->size) return NULL;
  g->head += pad + n;
  g->e[g->eh++ % MPR_RING_ENTRIES] = (typeof(g->e[0])){.end = g->head, .seq = UINT64_MAX};
  return g->p + (pad ? 0 : pos);
}

static void ring_set_seq(struct mpr_ring *g, uint64_t seq) { g->e[(g->eh - 1) % MPR_RING_ENTRIES].seq = seq; }

/* The oldest piece's copy, for a taker that must wait for room (0: the ring is empty). */
static uint64_t ring_oldest_seq(const struct mpr_ring *g) {
  return g->et == g->eh ? 0 : g->e[g->et % MPR_RING_ENTRIES].seq;
}

/* GPU data of a large record, from the writer thread: the stage's two halves take turns, the copy of
 * one piece out of GPU memory running while the piece before it is written. 0 ok, -1 socket, -2 copy. */
static int send_pipelined(int fd, const struct mpr_win *w, uint64_t off, uint64_t n, char *buf, size_t size) {
  const size_t half = size / 2;
  uint64_t seq[2] = {0, 0};
  size_t len[2] = {0, 0};
  for (int cur = 0;; cur ^= 1) {
    for (int k = 0; k < 2 && n; k++) { /* keep both halves busy */
      int h = cur ^ k;
      if (len[h]) continue;
      len[h] = n < half ? n : half;
      if (!(seq[h] = mplane_cuda_copy_async(w->gpu, buf + h * half, w->base + off, len[h], 0))) return -2;
      off += len[h];
      n -= len[h];
    }
    if (!len[cur]) return 0;
    if (mplane_cuda_lane_wait(w->gpu, seq[cur], mpr_timeout_ms()) != 0) return -2;
    if (mplane_rma_write_all(fd, buf + cur * half, len[cur]) != 0) return -1;
    len[cur] = 0;
  }
}

static int send_from(int fd, const struct mpr_win *w, uint64_t off, uint64_t n, struct mpr_stage *stage, size_t size) {
  if (w->gpu < 0) return n == 0 ? 0 : mplane_rma_write_all(fd, w->base + off, n);
  char *buf = stage_get(stage, size, w->gpu);
  if (!buf) return -1;
  if (stage->pinned && mplane_cuda_async_ok(w->gpu)) return send_pipelined(fd, w, off, n, buf, size);
  while (n) {
    size_t step = n < size ? n : size;
    if (mpr_win_read(w, off, buf, step) != 0) return -2;
    if (mplane_rma_write_all(fd, buf, step) != 0) return -1;
    off += step;
    n -= step;
  }
  return 0;
}

/* ---- requests and connection failure ---- */
void mpr_req_finish(struct mpr_req *r, ncclResult_t res, const char *fmt, ...) {
  r->result = res;
  if (fmt) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(r->why, sizeof(r->why), fmt, ap);
    va_end(ap);
  }
  if (res != ncclSuccess) __atomic_store_n(&r->conn->set->has_error, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&r->done, 1, __ATOMIC_RELEASE);
}

const char *mpr_kind_name(int kind) {
  switch (kind) {
  case MPR_K_PUT: return "put";
  case MPR_K_GET: return "get";
  case MPR_K_ACK: return "ack";
  case MPR_K_BYE: return "bye";
  case MPR_K_RAW: return "rest of a record";
  default: return "get answer";
  }
}

/* Fail everything queued or pending on c, once; responses owned by the queue are dropped. The
 * socket is shut down the first time: a writer blocked in the middle of a record (a peer that
 * stopped reading) returns at once instead of going on reading its window for the peer, so a
 * deregMrSym that waits for it (mpr_conn_forget_win) is not kept waiting, and nothing more of the
 * window leaves once it returns. The fd itself stays open until mpr_conn_destroy. */
void mpr_conn_fail(struct mpr_conn *c, const char *why) {
  pthread_mutex_lock(&c->lock);
  int first = !c->failed && !c->stop && !c->peer_closed, cut = !c->failed;
  __atomic_store_n(&c->failed, 1, __ATOMIC_RELEASE); /* reader_idle reads it without the lock */
  struct mpr_req *lists[2] = {c->p_head, c->q_head};
  c->p_head = c->p_tail = c->q_head = c->q_tail = NULL;
  __atomic_store_n(&c->answers, 0, __ATOMIC_RELAXED);
  pthread_cond_broadcast(&c->cond);
  pthread_cond_broadcast(&c->rcond);
  pthread_mutex_unlock(&c->lock);
  if (cut && c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
  if (first) {
    MP_WARN("RMA: context %d, connection to %s failed: %s", c->context, c->peer_str, why);
    __atomic_store_n(&c->set->has_error, 1, __ATOMIC_RELEASE);
  }
  for (int i = 0; i < 2; i++)
    for (struct mpr_req *r = lists[i], *n; r; r = n) {
      n = r->next;
      if (r->kind == MPR_K_ACK || r->kind == MPR_K_GET_RESP || r->kind == MPR_K_BYE || r->kind == MPR_K_RAW) {
        free(r->raw);
        free(r);
      } else mpr_req_finish(r, ncclRemoteError, "RMA %s to %s (context %d, window %u): the connection failed: %s",
                      mpr_kind_name(r->kind), c->peer_str, c->context, r->m.win, why);
    }
}

/* Fail the connection and cut its socket (again, where it had failed already), so a writer blocked
 * on a peer that stopped reading (a stalled process keeps its socket open) and the reader both return. */
void mpr_conn_abort(struct mpr_conn *c, const char *why) {
  mpr_conn_fail(c, why);
  if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
}

/* Number r (a request: it answers in this order) and trace it. Called with the lock held. */
static void number_locked(struct mpr_conn *c, struct mpr_req *r) {
  if (r->kind != MPR_K_PUT && r->kind != MPR_K_GET) return;
  r->m.id = ++c->next_id;
  r->t0_ns = mplane_now_ns();
  MP_TRACE(NCCL_NET, "RMA %s #%llu to %s (context %d): %llu bytes, window %u offset %llu, signal window %u offset %llu op %u value %llu",
           mpr_kind_name(r->kind), (unsigned long long)r->m.id, c->peer_str, c->context, (unsigned long long)r->m.size,
           r->m.win, (unsigned long long)r->m.off, r->m.sig_win, (unsigned long long)r->m.sig_off, r->m.sig_op,
           (unsigned long long)r->m.sig_val);
}

static int refuses_locked(const struct mpr_conn *c, const struct mpr_req *r) {
  return c->failed || (c->peer_closed && r->kind != MPR_K_BYE);
}

static void append_locked(struct mpr_req **head, struct mpr_req **tail, struct mpr_req *r) {
  r->next = NULL;
  if (*tail) (*tail)->next = r;
  else *head = r;
  *tail = r;
}

static int is_answer(int kind) { return kind == MPR_K_ACK || kind == MPR_K_GET_RESP; }

/* Queue r to be written, counting the answers waiting (the reader's backpressure). */
static void queue_locked(struct mpr_conn *c, struct mpr_req *r) {
  append_locked(&c->q_head, &c->q_tail, r);
  if (is_answer(r->kind)) __atomic_store_n(&c->answers, c->answers + 1, __ATOMIC_RELAXED);
}

/* ---- the writer: requests and responses, in order ---- */
#define MPR_BATCH 64 /* queued records the writer takes at once, written with one sendmsg where it can */
enum { MPR_W_IDLE = 0, MPR_W_WRITER, MPR_W_NOW };
#define MPR_SEND_NOW_MAX (64u << 10) /* records with at most this much data may go out from the thread
                                        that makes them, when nothing is queued before them */

/* What the write of one record needs, copied out of its request: once a request's last byte is out,
 * its response may come back and test() free it. */
struct mpr_out {
  int kind;
  struct mpr_msg m;
  struct mpr_win src;
  uint64_t src_off;
  char *raw; /* MPR_K_RAW: bytes to write as they are, freed once written */
  size_t raw_len;
  char *staged; /* the data, copied out of GPU memory into the send ring (mpr_req.staged) */
  uint64_t stage_seq, stage_end;
};

/* Does a record of this kind carry data after its header (a put, a get's answer that was not a
 * refusal), and is that data in GPU memory (copied out through staging)? */
static int carries_data(int kind, const struct mpr_msg *m) {
  return kind == MPR_K_PUT || (kind == MPR_K_GET_RESP && m->status == MPR_OK);
}

static int gpu_data(int kind, const struct mpr_msg *m, const struct mpr_win *src) {
  return carries_data(kind, m) && m->size && src->gpu >= 0;
}

/* Where a record's data sits in its source window (host memory); NULL for a record without data. */
static void *host_data(const struct mpr_out *o) {
  if (o->staged) return o->staged;
  return o->kind != MPR_K_RAW && carries_data(o->kind, &o->m) && o->m.size ? o->src.base + o->src_off : NULL;
}

/* Append a record's bytes to an iov: a raw tail as it is, else the header and its data at `data`. */
static void iov_add(struct iovec *iov, int *k, const struct mpr_out *o, void *data) {
  if (o->kind == MPR_K_RAW) {
    iov[(*k)++] = (struct iovec){.iov_base = o->raw, .iov_len = o->raw_len};
    return;
  }
  iov[(*k)++] = (struct iovec){.iov_base = (void *)&o->m, .iov_len = sizeof(o->m)};
  if (carries_data(o->kind, &o->m) && o->m.size) iov[(*k)++] = (struct iovec){.iov_base = data, .iov_len = o->m.size};
}

/* Copy out what writing r needs; a request becomes pending before a byte moves (its response may
 * come back at once), anything else is freed. 1 if r was a BYE. Called with the lock held. */
static int take_locked(struct mpr_conn *c, struct mpr_req *r, struct mpr_out *o) {
  *o = (struct mpr_out){.kind = r->kind, .m = r->m, .src = r->src, .src_off = r->src_off, .raw = r->raw,
                        .raw_len = r->raw_len, .staged = r->staged, .stage_seq = r->stage_seq,
                        .stage_end = r->stage_end};
  if (r->kind == MPR_K_PUT || r->kind == MPR_K_GET) {
    append_locked(&c->p_head, &c->p_tail, r);
    return 0;
  }
  if (is_answer(r->kind)) __atomic_store_n(&c->answers, c->answers - 1, __ATOMIC_RELAXED);
  int bye = r->kind == MPR_K_BYE;
  free(r);
  return bye;
}

/* Write records in order: runs of headers with their host-memory data go out in one sendmsg (a
 * barrier's 32 signals: one system call, not 32); data in GPU memory goes through staging. 0 ok,
 * -1 socket, -2 a copy out of GPU memory failed. */
static int write_batch(struct mpr_conn *c, const struct mpr_out *o, int n) {
  struct iovec iov[2 * MPR_BATCH];
  int k = 0;
  for (int i = 0; i < n; i++) {
    if (o[i].staged && mplane_cuda_lane_wait(o[i].src.gpu, o[i].stage_seq, mpr_timeout_ms()) != 0) return -2;
    if (o[i].kind != MPR_K_RAW && !o[i].staged && gpu_data(o[i].kind, &o[i].m, &o[i].src)) {
      if (k && mps_sendv_all(c->fd, iov, k) != 0) return -1;
      k = 0;
      if (mplane_rma_write_all(c->fd, &o[i].m, sizeof(o[i].m)) != 0) return -1;
      int rc = send_from(c->fd, &o[i].src, o[i].src_off, o[i].m.size, &c->wstage, c->set->wstage_size);
      if (rc != 0) return rc;
      continue;
    }
    iov_add(iov, &k, &o[i], host_data(&o[i]));
  }
  return k ? mps_sendv_all(c->fd, iov, k) : 0;
}

/* A record copied out asynchronously whose copy has not completed yet. */
static int staged_pending(const struct mpr_req *r) {
  return r->staged && r->stage_seq > mplane_cuda_lane_done(r->src.gpu);
}

/* Take up to MPR_BATCH queued records; a BYE is the last one taken, and with at_once so is the
 * first with data in GPU memory (one staging buffer for a send at once), and the batch stops before
 * a record whose asynchronous copy out of GPU memory is still under way. Called with the lock held. */
static int take_batch(struct mpr_conn *c, struct mpr_out *out, int at_once) {
  int n = 0;
  while (c->q_head && n < MPR_BATCH) {
    struct mpr_req *r = c->q_head;
    if (at_once && n && !r->staged && gpu_data(r->kind, &r->m, &r->src)) break;
    if (at_once && staged_pending(r)) break;
    c->q_head = r->next;
    if (!c->q_head) c->q_tail = NULL;
    if (take_locked(c, r, &out[n++])) break;
  }
  return n;
}

static void trace_wrote(const struct mpr_conn *c, const struct mpr_out *o, int n, const char *how) {
  for (int i = 0; i < n; i++)
    MP_TRACE(NCCL_NET, "RMA wrote %s #%llu to %s (context %d)%s", mpr_kind_name(o[i].kind), (unsigned long long)o[i].m.id,
             c->peer_str, c->context, how);
}

/* A write of records failed (write_batch's or write_now's rc): the connection fails, saying why. */
static void write_failed(struct mpr_conn *c, int rc) {
  char why[160];
  snprintf(why, sizeof(why), rc == -2 ? "a copy out of GPU memory failed" : "send: %s", strerror(errno));
  mpr_conn_fail(c, why);
}

/* A send ended. The writer thread is woken only when it has something to do (records queued behind
 * this send, or a teardown waiting for it): a wake per send made it run, find nothing, and contend
 * for the lock with the sender, once for every signal a GIN barrier posts. */
static void write_done(struct mpr_conn *c, const struct mpr_out *o, int n) {
  uint64_t end = 0;
  for (int i = 0; i < n; i++)
    if (o[i].staged) end = o[i].stage_end; /* sent (or copied into a tail): the send ring's space is free */
  pthread_mutex_lock(&c->lock);
  c->wbusy = MPR_W_IDLE;
  if (end) ring_release(&c->sring, end);
  if (c->drain_waiters) pthread_cond_broadcast(&c->cond);
  else if ((c->q_head && !c->deferred) || c->stop) pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->lock);
}

static void *writer_main(void *arg) {
  struct mpr_conn *c = arg;
  struct mpr_out *out = malloc(sizeof(*out) * MPR_BATCH);
  if (!out) {
    mpr_conn_fail(c, "out of memory for the writer");
    return NULL;
  }
  for (;;) {
    pthread_mutex_lock(&c->lock);
    while ((!c->q_head || c->wbusy) && !c->stop && !c->failed) pthread_cond_wait(&c->cond, &c->lock);
    while (c->wbusy && !c->failed) pthread_cond_wait(&c->cond, &c->lock); /* stopping: the last send first */
    if (c->failed || !c->q_head) {
      pthread_mutex_unlock(&c->lock);
      break;
    }
    int n = take_batch(c, out, 0);
    c->wbusy = MPR_W_WRITER;
    pthread_mutex_unlock(&c->lock);
    int rc = write_batch(c, out, n);
    for (int i = 0; i < n; i++) free(out[i].raw);
    write_done(c, out, n);
    if (rc != 0) {
      write_failed(c, rc);
      break;
    }
    trace_wrote(c, out, n, "");
    if (out[n - 1].kind == MPR_K_BYE) break; /* the last word on this connection */
  }
  free(out);
  return NULL;
}

/* ---- sending at once: no thread hand-off for small records ---- */

/* The iov of a run of records, headers and data, for one sendmsg; GPU data (the last record's
 * only: deferral keeps GPU records out of runs) copied out into istage. 0 ok, -2 the copy failed. */
static int records_iov(struct mpr_conn *c, const struct mpr_out *o, int n, struct iovec *iov, int *k) {
  *k = 0;
  for (int i = 0; i < n; i++) {
    void *p = host_data(&o[i]);
    if (o[i].kind != MPR_K_RAW && !o[i].staged && gpu_data(o[i].kind, &o[i].m, &o[i].src)) {
      if (!(p = stage_get(&c->istage, MPR_SEND_NOW_MAX, o[i].src.gpu))) return -2;
      if (mpr_win_read(&o[i].src, o[i].src_off, p, o[i].m.size) != 0) return -2;
    }
    iov_add(iov, k, &o[i], p);
  }
  return 0;
}

/* Hand the unsent tail of a write to the writer, ahead of anything queued since. 0 ok, -1 no memory. */
static int queue_tail(struct mpr_conn *c, const struct iovec *iov, int n, size_t sent) {
  size_t total = 0, k = 0;
  for (int i = 0; i < n; i++) total += iov[i].iov_len;
  if (sent >= total) return 0;
  struct mpr_req *t = calloc(1, sizeof(*t));
  char *raw = malloc(total - sent);
  if (!t || !raw) {
    free(t);
    free(raw);
    return -1;
  }
  for (int i = 0; i < n; i++) { /* copy bytes [sent, total) */
    size_t len = iov[i].iov_len, skip = sent > len ? len : sent;
    memcpy(raw + k, (char *)iov[i].iov_base + skip, len - skip);
    k += len - skip;
    sent -= skip;
  }
  *t = (struct mpr_req){.magic = MPR_REQ_MAGIC, .kind = MPR_K_RAW, .conn = c, .raw = raw, .raw_len = k};
  pthread_mutex_lock(&c->lock);
  t->next = c->q_head;
  c->q_head = t;
  if (!c->q_tail) c->q_tail = t;
  pthread_mutex_unlock(&c->lock);
  return 0;
}

/* Write records now from this thread, without blocking: what the socket does not take goes to the
 * writer thread. 0 ok, -1 socket, -2 GPU copy. */
static int write_now(struct mpr_conn *c, const struct mpr_out *o, int n) {
  struct iovec iov[2 * MPR_BATCH];
  int k;
  if (records_iov(c, o, n, iov, &k) != 0) return -2;
  size_t total = 0;
  for (int i = 0; i < k; i++) total += iov[i].iov_len;
  struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)k};
  ssize_t w;
  do w = sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT); while (w < 0 && errno == EINTR);
  if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK) return -1;
  if (w < 0) w = 0;
  if ((size_t)w < total && queue_tail(c, iov, k, (size_t)w) != 0) {
    errno = ENOMEM;
    return -1;
  }
  return 0;
}

static int queued_locked(const struct mpr_conn *c) {
  int n = 0;
  for (const struct mpr_req *r = c->q_head; r && n < MPR_BATCH; r = r->next) n++;
  return n;
}

static void send_queued_locked(struct mpr_conn *c);

/* Copy r's data (at most MPR_SEND_NOW_MAX bytes of GPU memory) into the connection's send ring on
 * the GPU's stream without waiting; r is then sent from there by rmaProgress once the copy has
 * completed, in order with the rest of the queue. 1 staged, 0 not (no driver support, no room).
 * Lock held. */
static int stage_out_locked(struct mpr_conn *c, struct mpr_req *r) {
  int gpu = r->src.gpu;
  if (!mplane_cuda_async_ok(gpu) || !ring_ready(&c->sring, c->set->sring_size, gpu)) return 0;
  uint64_t head = c->sring.head;
  char *p = ring_take(&c->sring, r->m.size);
  if (!p) return 0;
  uint64_t seq = mplane_cuda_copy_async(gpu, p, r->src.base + r->src_off, r->m.size, 0);
  if (!seq) { /* give the space back: nothing was queued on the stream */
    c->sring.eh--;
    c->sring.head = head;
    return 0;
  }
  ring_set_seq(&c->sring, seq);
  r->staged = p;
  r->stage_seq = seq;
  r->stage_end = c->sring.head;
  return 1;
}

/* Send r without a thread hand-off where it can: big records, and any while the writer is at work
 * or has records queued, go through the writer thread; from a thread that calls rmaProgress a
 * small record with host data, or an answer, waits in the queue for rmaProgress to send it with the
 * rest (the deferred records); otherwise it goes at once from this thread, deferred ones before it.
 * A socket failure fails the connection (r included); the caller's request stays valid for test(). */
ncclResult_t mpr_conn_send(struct mpr_conn *c, struct mpr_req *r) {
  int small = !carries_data(r->kind, &r->m) || r->m.size <= MPR_SEND_NOW_MAX;
  pthread_mutex_lock(&c->lock);
  /* Another thread is sending one record at once (microseconds): wait for it rather than hand this
   * one to the writer thread, whose wake-up can take a millisecond on a host full of spinning threads. */
  for (int i = 0; small && c->wbusy == MPR_W_NOW && i < 1000; i++) {
    pthread_mutex_unlock(&c->lock);
    sched_yield();
    pthread_mutex_lock(&c->lock);
  }
  if (refuses_locked(c, r)) {
    pthread_mutex_unlock(&c->lock);
    return ncclRemoteError;
  }
  number_locked(c, r);
  if (!small || c->wbusy || (c->q_head && !c->deferred)) { /* the writer's: big, or it is at work */
    queue_locked(c, r);
    __atomic_store_n(&c->deferred, 0, __ATOMIC_RELAXED); /* mpr_conn_kick and flush_deferred read it without the lock */
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->lock);
    return ncclSuccess;
  }
  /* A signal alone waits like any other record: one sendmsg at the end of a pass carries every
   * record of the burst. Data in GPU memory is first copied out asynchronously (stage_out_locked);
   * where that cannot be, the record is copied out and sent at once, NCCL's thread waiting. */
  if (mpr_progress_thread && (!gpu_data(r->kind, &r->m, &r->src) || stage_out_locked(c, r))) { /* rmaProgress sends it */
    if (!c->deferred) c->deferred_ns = mplane_now_ns();
    __atomic_store_n(&c->deferred, 1, __ATOMIC_RELAXED); /* mpr_conn_kick and flush_deferred read it without the lock */
    c->ops_added++; /* answers too: an answer waits a pass for the op its poster may add next */
    queue_locked(c, r);
    pthread_mutex_unlock(&c->lock);
    return ncclSuccess;
  }
  queue_locked(c, r);
  send_queued_locked(c); /* unlocks */
  return ncclSuccess;
}

/* Send everything queued from this thread now, without blocking (what the socket does not take
 * goes to the writer thread). Called with the lock held, nothing being written; unlocks. */
static void send_queued_locked(struct mpr_conn *c) {
  struct mpr_out o[MPR_BATCH];
  int n = take_batch(c, o, 1);
  /* What is left behind a copy out of GPU memory stays rmaProgress's to send, no writer wake-up
   * (whether the copy has completed by now or not: it may have, since take_batch looked). */
  __atomic_store_n(&c->deferred, c->q_head && c->q_head->staged, __ATOMIC_RELAXED); /* mpr_conn_kick and flush_deferred read it without the lock */
  if (n == 0) {
    pthread_mutex_unlock(&c->lock);
    return;
  }
  c->wbusy = MPR_W_NOW;
  pthread_mutex_unlock(&c->lock);
  int rc = write_now(c, o, n);
  for (int i = 0; i < n; i++) free(o[i].raw);
  write_done(c, o, n); /* and wakes the writer for anything left behind the batch */
  if (rc == 0) trace_wrote(c, o, n, " at once");
  else write_failed(c, rc);
}

/* A reply: the queue holds an op of ours and an answer owed to the peer (it sent us an op we have
 * not answered yet, and what we post now is likely what it waits for). */
static int reply_queued_locked(const struct mpr_conn *c) {
  int op = 0, answer = 0;
  for (const struct mpr_req *r = c->q_head; r && !(op && answer); r = r->next) {
    if (is_answer(r->kind)) answer = 1;
    else op = 1;
  }
  return op && answer;
}

/* rmaProgress's half of deferred sending: a connection's deferred records go once no op joined them
 * since the previous call (the poster's burst is over), or the oldest waited 20 us, or they fill a
 * batch - or at once, in the pass that posted them, when they are a reply (an op of ours beside the
 * answer owed to the peer's op) and nothing of ours is on the wire unanswered: the peer is then
 * likely waiting for this op, and a round trip (a barrier's signal and its answer) would lose a
 * pass at each end waiting for a burst that is not coming. A burst of ops to one peer still goes
 * in batches (no answers ride with it), and answers alone still wait a pass for the op their
 * poster may add next. */
static void flush_deferred(struct mpr_conn *c, uint64_t now) {
  if (!__atomic_load_n(&c->deferred, __ATOMIC_RELAXED)) return;
  pthread_mutex_lock(&c->lock);
  uint64_t added = c->ops_added;
  /* now is when this rmaProgress began: records its own reading queued are younger (no wrap) */
  int idle = added == c->ops_seen, old = now > c->deferred_ns && now - c->deferred_ns > 20000;
  c->ops_seen = added;
  if (!c->deferred || c->held || c->wbusy || !c->q_head ||
      !(idle || old || (!c->p_head && reply_queued_locked(c)) || queued_locked(c) >= MPR_BATCH)) {
    pthread_mutex_unlock(&c->lock);
    return;
  }
  send_queued_locked(c);
}

/* ---- the reader: the target side of puts and gets, and the responses to ours ---- */
static uint16_t check_put(struct mpr_group *g, const struct mpr_msg *m, struct mpr_win *dst, struct mpr_win *sig,
                          uint64_t *limit) {
  if (m->size > 0) {
    if (!mpr_win_get(g, m->win, dst)) return MPR_BAD_WIN;
    if (!mpr_range_ok(dst, m->off, m->size)) {
      *limit = dst->size;
      return MPR_BAD_RANGE;
    }
  }
  if (m->sig_win != MPR_NO_WIN) {
    if (m->sig_op != NCCL_NET_SIGNAL_OP_INC && m->sig_op != NCCL_NET_SIGNAL_OP_ADD) return MPR_BAD_SIG_OP;
    if (!mpr_win_get(g, m->sig_win, sig)) return MPR_BAD_SIG_WIN;
    if (m->sig_off % 8 || !mpr_range_ok(sig, m->sig_off, 8)) {
      *limit = sig->size;
      return MPR_BAD_SIG_RANGE;
    }
  }
  return MPR_OK;
}

/* Add to a 64-bit signal word. Host memory: one atomic add (release: the data is before it). GPU
 * memory: the CUDA driver's signal lane (common/cuda.h), one per GPU for the process, so the adds of every
 * connection's reader are atomic against one another (NCCL's GPU only reads its indexed signals,
 * and resets a VA signal only while no op targets it). */
static int signal_apply(const struct mpr_win *w, uint64_t off, uint64_t add, uint64_t *now) {
  if (w->gpu < 0) {
    *now = __atomic_add_fetch((uint64_t *)(void *)(w->base + off), add, __ATOMIC_SEQ_CST);
    return 0;
  }
  if (w->shadow) return mplane_cuda_signal_add_owned(w->gpu, w->base + off, &w->shadow[off / 8], add, now);
  return mplane_cuda_signal_add(w->gpu, w->base + off, add, now);
}

static int respond(struct mpr_conn *c, int kind, const struct mpr_msg *m, uint16_t status, uint64_t limit,
                   const struct mpr_win *src) {
  struct mpr_req *r = calloc(1, sizeof(*r));
  if (!r) return -1;
  r->magic = MPR_REQ_MAGIC;
  r->kind = kind;
  r->conn = c;
  r->m = (struct mpr_msg){.magic = MPR_MAGIC, .type = kind == MPR_K_ACK ? MPR_ACK : MPR_GET_RESP,
                          .status = status, .win = m->win, .sig_win = m->sig_win, .off = m->off,
                          .size = status == MPR_OK && kind == MPR_K_GET_RESP ? m->size : 0, .id = m->id,
                          .limit = limit};
  if (src) {
    r->src = *src;
    r->src_off = m->off;
  }
  if (mpr_conn_send(c, r) != ncclSuccess) {
    free(r);
    return -1;
  }
  return 0;
}

/* A put's bytes are in place (or dropped): apply its signal, then answer. */
static int put_done(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  const struct mpr_msg *m = &d->m;
  uint16_t st = d->st;
  if (st == MPR_OK && d->gone) st = MPR_BAD_WIN; /* deregistered while its bytes came */
  if (st == MPR_OK && d->cuda_bad) st = MPR_GPU_COPY;
  uint64_t now = 0;
  /* A GPU signal follows the data on the GPU's stream; a host one must wait for it here. */
  if (st == MPR_OK && m->sig_win != MPR_NO_WIN && d->sig.gpu != d->w.gpu && landed(c) != 0) st = MPR_GPU_COPY;
  if (st == MPR_OK && m->sig_win != MPR_NO_WIN) {
    if (!win_enter(c->set->g, &d->sig)) st = MPR_BAD_SIG_WIN;
    else {
      if (signal_apply(&d->sig, m->sig_off, m->sig_op == NCCL_NET_SIGNAL_OP_INC ? 1 : m->sig_val, &now) != 0)
        st = MPR_GPU_COPY;
      win_leave(c->set->g);
    }
  }
  MP_TRACE(NCCL_NET, "RMA served put #%llu from %s (context %d): %llu bytes at window %u offset %llu, signal %u+%llu now %llu, status %u",
           (unsigned long long)m->id, c->peer_str, c->context, (unsigned long long)m->size, m->win,
           (unsigned long long)m->off, m->sig_win, (unsigned long long)m->sig_off, (unsigned long long)now, st);
  return respond(c, MPR_K_ACK, m, st, d->limit, NULL);
}

/* The answer reads the window when it is written, so the windows stay read-held until it is queued:
 * a deregMrSym after that finds it in the queue (mpr_conn_forget_win), none before it can miss it. */
static int serve_get(struct mpr_conn *c, const struct mpr_msg *m) {
  struct mpr_group *g = c->set->g;
  struct mpr_win src;
  uint64_t limit = 0;
  uint16_t st = MPR_OK;
  pthread_rwlock_rdlock(&g->win_lock);
  if (!win_find_locked(g, m->win, &src)) st = MPR_BAD_WIN;
  else if (!mpr_range_ok(&src, m->off, m->size)) {
    st = MPR_BAD_RANGE;
    limit = src.size;
  }
  int rc = respond(c, MPR_K_GET_RESP, m, st, limit, st == MPR_OK ? &src : NULL);
  pthread_rwlock_unlock(&g->win_lock);
  return rc;
}

static const char *status_str(uint16_t st) {
  switch (st) {
  case MPR_BAD_WIN: return "it has no such window";
  case MPR_BAD_RANGE: return "the range lies outside its window";
  case MPR_BAD_SIG_WIN: return "it has no such signal window";
  case MPR_BAD_SIG_RANGE: return "the signal word lies outside its signal window (or is not 8-byte aligned)";
  case MPR_BAD_SIG_OP: return "the signal op is not one NCCL defines (INC 1, ADD 2)";
  case MPR_GPU_COPY: return "its copy into or out of GPU memory failed";
  default: return "an unknown refusal";
  }
}

static void pending_unlink_locked(struct mpr_conn *c) {
  c->p_head = c->p_head->next;
  if (!c->p_head) c->p_tail = NULL;
}

/* The oldest op in flight, taken off the pending list (NULL: none) - except a get answered with
 * bytes, which stays on it until they are all in (get_done), so a connection that fails while they
 * come (a peer that dies mid-answer) fails the get with everything else. */
static struct mpr_req *pending_take(struct mpr_conn *c, const struct mpr_msg *m) {
  pthread_mutex_lock(&c->lock);
  struct mpr_req *r = c->p_head;
  int keep = r && r->kind == MPR_K_GET && m->type == MPR_GET_RESP && m->status == MPR_OK && m->size &&
             r->m.id == m->id && m->size == r->m.size;
  if (r && !keep) pending_unlink_locked(c);
  pthread_mutex_unlock(&c->lock);
  return r;
}

/* A response: match it to the oldest op in flight and finish that op, or (a get's bytes) start
 * reading its data. 0 ok, -1 the connection is broken (why says how). */
static int take_response(struct mpr_conn *c, const struct mpr_msg *m, char *why, size_t whylen) {
  struct mpr_req *r = pending_take(c, m);
  int want = m->type == MPR_ACK ? MPR_K_PUT : MPR_K_GET;
  MP_TRACE(NCCL_NET, "RMA answer #%llu from %s (context %d): type %u status %u", (unsigned long long)m->id,
           c->peer_str, c->context, m->type, m->status);
  if (!r || r->kind != want || r->m.id != m->id) {
    snprintf(why, whylen, "a response (type %u, id %llu) that matches no request in flight", m->type,
             (unsigned long long)m->id);
    if (r) mpr_req_finish(r, ncclRemoteError, "RMA %s to %s: the peer answered out of order", mpr_kind_name(r->kind),
                      c->peer_str);
    return -1;
  }
  if (m->status != MPR_OK) {
    /* the whole message before the finish: once r is done, test() may log it and free r */
    char limit[48] = "";
    if (m->limit) snprintf(limit, sizeof(limit), " of that size (%llu bytes)", (unsigned long long)m->limit);
    mpr_req_finish(r, ncclInvalidUsage,
               "RMA %s to %s refused by the target (context %d, window %u, offset %llu, size %llu%s): %s%s",
               mpr_kind_name(r->kind), c->peer_str, c->context, r->m.win, (unsigned long long)r->m.off,
               (unsigned long long)r->m.size, r->m.sig_win != MPR_NO_WIN ? ", with a signal" : "",
               status_str(m->status), limit);
    return 0;
  }
  if (m->type == MPR_GET_RESP && m->size != r->m.size) {
    snprintf(why, whylen, "a get response of %llu bytes for a get of %llu", (unsigned long long)m->size,
             (unsigned long long)r->m.size);
    mpr_req_finish(r, ncclRemoteError, "RMA get from %s: %s", c->peer_str, why);
    return -1;
  }
  if (m->type == MPR_GET_RESP && m->size) {
    struct mpr_rd *d = &c->in;
    d->phase = MPR_RD_DATA;
    d->r = r;
    d->w = r->dst;
    d->land = 1;
    d->off = r->dst_off;
    d->left = m->size;
    return 0;
  }
  mpr_req_finish(r, ncclSuccess, NULL);
  return 0;
}

/* A get's bytes are in place: it leaves the pending list now, unless the connection failed while
 * they came (that finished it already, and test() may have freed it). */
static void get_done(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  struct mpr_req *r = d->r;
  d->r = NULL;
  if (!d->cuda_bad && landed(c) != 0) d->cuda_bad = 1;
  pthread_mutex_lock(&c->lock);
  int ours = c->p_head == r && !c->failed;
  if (ours) pending_unlink_locked(c);
  pthread_mutex_unlock(&c->lock);
  if (!ours) return;
  if (d->gone)
    mpr_req_finish(r, ncclInvalidUsage, "RMA get from %s: its local window was deregistered while the answer came; "
                   "its bytes were dropped", c->peer_str);
  else if (d->cuda_bad)
    mpr_req_finish(r, ncclSystemError, "RMA get from %s: the copy into GPU memory (window %u) failed", c->peer_str,
                   r->m.win);
  else mpr_req_finish(r, ncclSuccess, NULL);
}

/* A whole header is in: check it and decide what its data (if any) is for. 0 ok, 1 the peer said
 * BYE (reading ends), -1 broken. */
static int header_done(struct mpr_conn *c, char *why, size_t whylen) {
  struct mpr_rd *d = &c->in;
  const struct mpr_msg *m = &d->m;
  if (m->magic != MPR_MAGIC) {
    snprintf(why, whylen, "a record without the RMA magic");
    return -1;
  }
  switch (m->type) {
  case MPR_PUT: {
    struct mpr_win dst = {0};
    d->limit = 0;
    d->st = check_put(c->set->g, m, &dst, &d->sig, &d->limit);
    if (m->size == 0) return put_done(c) == 0 ? 0 : (snprintf(why, whylen, "could not answer a put"), -1);
    d->phase = MPR_RD_DATA;
    d->r = NULL;
    d->w = dst;
    d->land = d->st == MPR_OK;
    d->off = m->off;
    d->left = m->size;
    return 0;
  }
  case MPR_GET:
    if (serve_get(c, m) == 0) return 0;
    snprintf(why, whylen, "could not queue a get's answer");
    return -1;
  case MPR_ACK:
  case MPR_GET_RESP: return take_response(c, m, why, whylen);
  case MPR_BYE: {
    /* The peer destroyed its context: later ops to it fail, and so does anything still waiting. */
    pthread_mutex_lock(&c->lock);
    c->peer_closed = 1;
    int busy = c->p_head || c->q_head;
    pthread_mutex_unlock(&c->lock);
    if (busy) mpr_conn_fail(c, "the peer destroyed its context with ops of ours in flight");
    return 1;
  }
  default: snprintf(why, whylen, "a record of unknown type %u", m->type); return -1;
  }
}

/* Land the stage's bytes in the GPU window (after a failed copy, drop them: the stream stays framed).
 * An asynchronous piece is queued on the GPU's stream, ahead of the signal adds that follow it, and
 * its ring space comes back once the copy completed; nothing here waits for it. */
static void stage_flush(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  if (d->sbuf) {
    uint64_t seq = d->sfill && !d->cuda_bad && !d->gone
                       ? mplane_cuda_copy_async(d->w.gpu, d->w.base + d->off - d->sfill, d->sbuf, d->sfill, 1)
                       : 0;
    if (d->sfill && !d->cuda_bad && !d->gone && !seq) d->cuda_bad = 1;
    ring_set_seq(&c->lring, seq ? seq : d->last_seq); /* a dropped piece is free once the one before is */
    if (seq) d->last_seq = seq;
    d->sbuf = NULL;
  } else if (d->sfill && d->land && !d->cuda_bad &&
             mpr_win_write(&d->w, d->off - d->sfill, c->stage.p, d->sfill) != 0)
    d->cuda_bad = 1;
  d->sfill = 0;
}

/* Landing-ring space for the next piece of a GPU window's bytes: waits for the oldest copy only
 * while the ring is full (all of it in flight). NULL: no ring, or the GPU stopped completing. */
static char *landing_piece(struct mpr_conn *c, size_t n) {
  struct mpr_rd *d = &c->in;
  if (!ring_ready(&c->lring, c->set->lring_size, d->w.gpu)) return NULL;
  for (;;) {
    ring_reclaim(&c->lring, mplane_cuda_lane_done(d->w.gpu));
    char *p = ring_take(&c->lring, n);
    if (p) return p;
    if (mplane_cuda_lane_wait(d->w.gpu, ring_oldest_seq(&c->lring), mpr_timeout_ms()) != 0) return NULL;
  }
}

/* Where the next data bytes go and how many fit there: host windows directly, GPU windows through a
 * landing piece (asynchronous, where the driver can) or the stage, dropped bytes through the stage.
 * NULL: no memory for the stage. */
static char *data_dst(struct mpr_conn *c, size_t *room) {
  struct mpr_rd *d = &c->in;
  if (d->land && d->w.gpu < 0) {
    *room = d->left;
    return d->w.base + d->off;
  }
  if (d->land && !d->cuda_bad && (d->sbuf || mplane_cuda_async_ok(d->w.gpu))) {
    if (!d->sbuf) {
      size_t piece = c->set->lring_size / 4 < MPR_PIECE ? c->set->lring_size / 4 : MPR_PIECE;
      d->scap = d->left < piece ? d->left : piece;
      if (!(d->sbuf = landing_piece(c, d->scap))) {
        d->cuda_bad = 1; /* the rest is read and dropped, the put refused */
        return data_dst(c, room);
      }
      d->sfill = 0;
    }
    *room = d->scap - d->sfill;
    return d->sbuf + d->sfill;
  }
  if (!stage_get(&c->stage, MPR_STAGE, d->land ? d->w.gpu : -1)) return NULL;
  *room = MPR_STAGE - d->sfill < d->left ? MPR_STAGE - d->sfill : d->left;
  return c->stage.p + d->sfill;
}

/* n data bytes arrived at data_dst's place. */
static void data_took(struct mpr_conn *c, size_t n) {
  struct mpr_rd *d = &c->in;
  int staged = !(d->land && d->w.gpu < 0);
  d->off += n;
  d->left -= n;
  if (staged) {
    d->sfill += n;
    if ((d->sbuf ? d->sfill == d->scap : d->sfill == MPR_STAGE) || d->left == 0) stage_flush(c);
  }
}

/* This record's asynchronous copies have completed (a get's bytes in place, or data that a host
 * signal must follow). 0 ok, -1 the GPU did not complete them within the timeout. */
static int landed(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  return d->last_seq ? mplane_cuda_lane_wait(d->w.gpu, d->last_seq, mpr_timeout_ms()) : 0;
}

/* Data bytes from the receive buffer, or straight from the socket when the buffer is empty and
 * what is left is large. 1 took some, 0 nothing has arrived, -1 closed or broken, -2 no memory. */
static int data_step_in(struct mpr_conn *c) {
  size_t room;
  char *dst = data_dst(c, &room);
  if (!dst) return -2;
  if (c->rpos < c->rlen) {
    size_t k = c->rlen - c->rpos < room ? c->rlen - c->rpos : room;
    memcpy(dst, c->rbuf + c->rpos, k);
    c->rpos += k;
    data_took(c, k);
    return 1;
  }
  if (room < MPR_RBUF / 2) return -3; /* small: through the receive buffer */
  ssize_t r = recv(c->fd, dst, room, MSG_DONTWAIT);
  if (r > 0) {
    data_took(c, (size_t)r);
    return 1;
  }
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  return -1;
}

/* The window was deregistered while an op's bytes came: the piece begun is dropped (its ring space
 * comes back in turn) and the rest is read and dropped; the op is refused. */
static void window_gone(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  d->gone = 1;
  if (d->sbuf) stage_flush(c);
  d->land = 0;
  d->sfill = 0;
}

/* A step of an op's bytes, with the window held for the step (never across steps: a peer that
 * stops mid-op keeps no deregMrSym waiting). */
static int data_step(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  struct mpr_group *g = c->set->g;
  if (!d->land) return data_step_in(c);
  if (!win_enter(g, &d->w)) {
    window_gone(c);
    return data_step_in(c);
  }
  int rc = data_step_in(c);
  win_leave(g);
  return rc;
}

/* Refill the receive buffer without waiting. 1 has bytes, 0 nothing has arrived, -1 closed or broken. */
static int rbuf_fill(struct mpr_conn *c) {
  if (c->rpos < c->rlen) return 1;
  ssize_t r;
  do r = recv(c->fd, c->rbuf, MPR_RBUF, MSG_DONTWAIT); while (r < 0 && errno == EINTR);
  if (r > 0) {
    c->rpos = 0;
    c->rlen = (size_t)r;
    return 1;
  }
  if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
  return -1;
}

/* Reading has ended on c: nobody advances it again, and rmaProgress stops looking at it. */
static void reader_over(struct mpr_conn *c) {
  __atomic_store_n(&c->rd_over, 1, __ATOMIC_RELEASE);
  if (c->set->epfd >= 0) epoll_ctl(c->set->epfd, EPOLL_CTL_DEL, c->fd, NULL);
}

static int conn_pump_records(struct mpr_conn *c);

/* Before the peer's next record: are MPR_ANSWERS_MAX answers to it still unsent? Then its records
 * wait (1); once that has lasted MPLANE_CONNECT_TIMEOUT, why says the connection is to be cut. */
static int answers_full(struct mpr_conn *c, char *why, size_t whylen) {
  int n = __atomic_load_n(&c->answers, __ATOMIC_RELAXED);
  if (n < MPR_ANSWERS_MAX) {
    c->full_since_ns = 0;
    return 0;
  }
  uint64_t now = mplane_now_ns();
  if (!c->full_since_ns) c->full_since_ns = now;
  if ((now - c->full_since_ns) / 1000000 > (uint64_t)mpr_timeout_ms())
    snprintf(why, whylen, "%s sends ops but has taken none of the %d answers waiting for it for %d s "
             "(MPLANE_CONNECT_TIMEOUT): it is stalled, or not an mplane peer", c->peer_str, n, mpr_timeout_ms() / 1000);
  return 1;
}

/* Advance the reader over everything that has arrived, without waiting, then hand the GPU signal
 * writes it made to the driver in one call. Caller holds rlock. 0: all taken, wait for more; 1:
 * reading has ended (a BYE, a failure, a close: already handled); 2: the peer's records wait until
 * it takes the answers owed to it. */
static int conn_pump(struct mpr_conn *c) {
  int over = conn_pump_records(c);
  if (mplane_cuda_signal_flush() != 0 && over != 1) {
    mpr_conn_fail(c, "the CUDA driver refused the signal writes");
    return 1;
  }
  return over;
}

static int conn_pump_records(struct mpr_conn *c) {
  struct mpr_rd *d = &c->in;
  char why[200] = "";
  if (__atomic_load_n(&c->rd_over, __ATOMIC_ACQUIRE)) return 1;
  for (;;) {
    int rc;
    if (d->phase == MPR_RD_DATA) {
      rc = data_step(c);
      if (rc == -3) rc = rbuf_fill(c);
      if (rc == -2) snprintf(why, sizeof(why), "out of memory for the receive staging");
      else if (rc == -1) snprintf(why, sizeof(why), "the connection broke inside a %s's data", d->r ? "get" : "put");
      if (rc < 0) break;
      if (rc == 0) return 0;
      if (d->left == 0) {
        d->phase = MPR_RD_HDR;
        d->hgot = 0;
        if (d->r) get_done(c);
        else if (put_done(c) != 0) {
          snprintf(why, sizeof(why), "could not answer a put");
          break;
        }
      }
      continue;
    }
    if (d->hgot == 0 && answers_full(c, why, sizeof(why))) {
      if (!why[0]) return 2; /* backpressure: its records wait in the socket */
      reader_over(c);
      mpr_conn_abort(c, why);
      return 1;
    }
    rc = rbuf_fill(c);
    if (rc == 0) return 0;
    if (rc < 0) {
      if (d->hgot == 0) snprintf(why, sizeof(why), "the peer closed it (is the process gone?)");
      else snprintf(why, sizeof(why), "recv failed or the peer reset it");
      break;
    }
    size_t k = c->rlen - c->rpos < sizeof(d->m) - d->hgot ? c->rlen - c->rpos : sizeof(d->m) - d->hgot;
    memcpy((char *)&d->m + d->hgot, c->rbuf + c->rpos, k);
    c->rpos += k;
    d->hgot += k;
    if (d->hgot < sizeof(d->m)) continue;
    d->hgot = 0;
    d->sfill = 0;
    d->sbuf = NULL;
    d->last_seq = 0;
    d->cuda_bad = 0;
    d->gone = 0;
    rc = header_done(c, why, sizeof(why));
    if (rc < 0) break;
    if (rc == 1) {
      reader_over(c);
      return 1;
    }
  }
  reader_over(c);
  if (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) mpr_conn_fail(c, why);
  return 1;
}

/* The reader thread: advances the reader whenever bytes arrive and no other thread (NCCL's progress
 * thread, in rmaProgress) has taken them first, so ops are served even when nobody calls rmaProgress. */
#define MPR_PROGRESS_LIVE_NS 100000000ull /* rmaProgress called this recently: it does the reading */

static int progress_live(const struct mpr_ctxset *s) {
  uint64_t last = __atomic_load_n(&s->progress_ns, __ATOMIC_RELAXED);
  return last && mplane_now_ns() - last < MPR_PROGRESS_LIVE_NS;
}

/* While NCCL's thread calls rmaProgress it reads every connection itself; the reader thread then
 * rests (a wake per arriving packet would only contend for the parser), and takes over within
 * MPR_PROGRESS_LIVE_NS once the calls stop. */
static void reader_rest(struct mpr_conn *c) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_nsec += (long)MPR_PROGRESS_LIVE_NS;
  until.tv_sec += until.tv_nsec / 1000000000L;
  until.tv_nsec %= 1000000000L;
  pthread_mutex_lock(&c->lock);
  if (!c->stop && !c->failed) pthread_cond_timedwait(&c->rcond, &c->lock, &until);
  pthread_mutex_unlock(&c->lock);
}

static void *reader_main(void *arg) {
  struct mpr_conn *c = arg;
  for (;;) {
    if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) && __atomic_load_n(&c->rd_over, __ATOMIC_ACQUIRE)) return NULL;
    if (progress_live(c->set) && !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) {
      reader_rest(c);
      continue;
    }
    /* rmaProgress has stopped: what its last pass left deferred (an answer waiting a pass for a
     * reply to ride with) goes through the writer, as test() does for a caller's own records, so an
     * op served in the last pass is still answered. */
    mpr_conn_kick(c);
    struct pollfd p = {.fd = c->fd, .events = POLLIN};
    int r = poll(&p, 1, (int)(MPR_PROGRESS_LIVE_NS / 1000000));
    if (r < 0 && errno != EINTR) {
      reader_over(c);
      if (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE)) mpr_conn_fail(c, "poll failed");
      return NULL;
    }
    if (r <= 0) continue;
    pthread_mutex_lock(&c->rlock);
    int over = conn_pump(c);
    pthread_mutex_unlock(&c->rlock);
    if (over == 1) return NULL;
    if (over == 2) usleep(200); /* the socket stays readable: look again once the writer had a turn */
  }
}

/* The test hook MPLANE_TEST_RMA_PROGRESS_ONLY=1 (common/test_hooks.h): the reader threads never
 * read, so rmaProgress alone must serve every op; a test that passes this way shows the progress path
 * carries everything. */
static void *reader_idle(void *arg) { /* polls: the writer alone waits on the connection's cond */
  struct mpr_conn *c = arg;
  while (!__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) && !__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE))
    usleep(10000);
  return NULL;
}

/* rmaProgress: serve every connection with bytes waiting, from NCCL's progress thread, which calls
 * this in its polling loop; a connection whose reader thread is at it already is skipped. */
ncclResult_t mpr_progress(void *ctx) {
  struct mpr_ctxset *s = ctx;
  if (!s || s->epfd < 0) return ncclSuccess;
  mpr_progress_thread = 1;
  if (mplane_cuda_signal_flush() != 0) __atomic_store_n(&s->has_error, 1, __ATOMIC_RELEASE); /* copies NCCL's ops queued */
  uint64_t now = mplane_now_ns();
  __atomic_store_n(&s->progress_ns, now, __ATOMIC_RELAXED);
  struct epoll_event ev[32];
  int n = epoll_wait(s->epfd, ev, 32, 0);
  for (int i = 0; i < n; i++) {
    struct mpr_conn *c = ev[i].data.ptr;
    if (__atomic_load_n(&c->rd_over, __ATOMIC_ACQUIRE) || pthread_mutex_trylock(&c->rlock) != 0) continue;
    conn_pump(c);
    pthread_mutex_unlock(&c->rlock);
  }
  for (int i = 0; i < s->ncontexts * s->g->nranks; i++)
    if (s->conns[i]) flush_deferred(s->conns[i], now);
  for (int i = 0; i < s->ncontexts; i++)
    if (s->mirrors[i]) flush_deferred(s->mirrors[i], now);
  return ncclSuccess;
}

/* Queued records that would read window win (its memory at base) when written: answers to the
 * peer's gets become refusals ("no such window"), puts of ours from it fail (nothing is sent). */
static struct mpr_req *forget_queued_locked(struct mpr_conn *c, uint32_t win, const char *base) {
  struct mpr_req *dropped = NULL, *prev = NULL;
  for (struct mpr_req *r = c->q_head, *next; r; r = next) {
    next = r->next;
    int reads = r->kind != MPR_K_RAW && !r->staged && carries_data(r->kind, &r->m) && r->m.size &&
                r->src.id == win && r->src.base == base;
    if (reads && r->kind == MPR_K_GET_RESP) {
      r->m.status = MPR_BAD_WIN;
      r->m.size = 0;
      r->src = (struct mpr_win){0};
    } else if (reads && r->kind == MPR_K_PUT) {
      if (prev) prev->next = next;
      else c->q_head = next;
      if (c->q_tail == r) c->q_tail = prev;
      r->next = dropped;
      dropped = r;
      continue;
    }
    prev = r;
  }
  return dropped;
}

void mpr_conn_forget_win(struct mpr_conn *c, uint32_t win, const char *base, uint64_t deadline_ns) {
  if (!c) return;
  pthread_mutex_lock(&c->lock);
  struct mpr_req *dropped = forget_queued_locked(c, win, base);
  /* A write under way may be reading the window: it ends first, whatever the connection's state (a
   * failed connection's writer may still be inside a record; its socket is shut down, so it returns).
   * A peer that takes nothing until the deadline has its connection cut, which ends it. */
  c->drain_waiters++;
  int cut = 0;
  while (c->wbusy) {
    uint64_t now = mplane_now_ns();
    if ((now >= deadline_ns || c->failed) && !cut) {
      cut = 1;
      int failed = c->failed;
      pthread_mutex_unlock(&c->lock);
      if (failed && c->fd >= 0) shutdown(c->fd, SHUT_RDWR); /* mpr_conn_fail did; a writer must not outlast it */
      else mpr_conn_abort(c, "the peer took nothing for MPLANE_CONNECT_TIMEOUT while a window it reads was being deregistered");
      pthread_mutex_lock(&c->lock);
      continue;
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_nsec += 10000000L; /* looked at again every 10 ms: the deadline, and a missed wake */
    until.tv_sec += until.tv_nsec / 1000000000L;
    until.tv_nsec %= 1000000000L;
    pthread_cond_timedwait(&c->cond, &c->lock, &until);
  }
  c->drain_waiters--;
  pthread_mutex_unlock(&c->lock);
  for (struct mpr_req *r = dropped, *n; r; r = n) {
    n = r->next;
    mpr_req_finish(r, ncclInvalidUsage, "RMA put to %s (context %d): its source window %u was deregistered before "
                   "the put was sent; nothing was sent", c->peer_str, c->context, win);
  }
}

/* NCCL's aggregation hint (transport.h's hold): while held, the connection's deferred records wait
 * for the run to end; its end sends them at once, in one sendmsg, rather than a pass later. */
void mpr_conn_hold(struct mpr_conn *c, int on) {
  pthread_mutex_lock(&c->lock);
  c->held = on;
  if (!on && c->deferred && !c->wbusy && c->q_head && !c->failed) {
    send_queued_locked(c); /* unlocks */
    return;
  }
  pthread_mutex_unlock(&c->lock);
}

/* A caller that stopped calling rmaProgress: its deferred records go through the writer thread. */
void mpr_conn_kick(struct mpr_conn *c) {
  uint64_t last = __atomic_load_n(&c->set->progress_ns, __ATOMIC_RELAXED);
  if (!__atomic_load_n(&c->deferred, __ATOMIC_RELAXED) || mplane_now_ns() - last < 1000000) return;
  pthread_mutex_lock(&c->lock);
  if (c->deferred) {
    __atomic_store_n(&c->deferred, 0, __ATOMIC_RELAXED); /* mpr_conn_kick and flush_deferred read it without the lock */
    pthread_cond_signal(&c->cond);
  }
  pthread_mutex_unlock(&c->lock);
}

/* ---- setting up and tearing down ---- */
static void join_or_cut(struct mpr_conn *c) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until);
  until.tv_sec += mpr_timeout_ms() / 1000;
  if (pthread_timedjoin_np(c->wr, NULL, &until) == 0) return;
  MP_WARN("RMA: context %d, connection to %s: the peer took nothing for %d s while the context was destroyed; "
          "cutting the connection", c->context, c->peer_str, mpr_timeout_ms() / 1000);
  mpr_conn_abort(c, "the peer stopped reading (stalled?) while the context was destroyed");
  pthread_join(c->wr, NULL);
}

void mpr_conn_destroy(struct mpr_conn *c) {
  if (!c) return;
  struct mpr_req *bye = calloc(1, sizeof(*bye));
  if (bye) {
    bye->magic = MPR_REQ_MAGIC;
    bye->kind = MPR_K_BYE;
    bye->conn = c;
    bye->m = (struct mpr_msg){.magic = MPR_MAGIC, .type = MPR_BYE, .win = MPR_NO_WIN, .sig_win = MPR_NO_WIN};
  }
  /* The BYE and the stop together: a write of the BYE that fails (the peer closed first) is then
   * part of the teardown, not an error to report. */
  pthread_mutex_lock(&c->lock);
  if (bye && !refuses_locked(c, bye)) append_locked(&c->q_head, &c->q_tail, bye);
  else free(bye);
  __atomic_store_n(&c->stop, 1, __ATOMIC_RELEASE);
  pthread_cond_broadcast(&c->cond);
  pthread_cond_broadcast(&c->rcond);
  pthread_mutex_unlock(&c->lock);
  /* The writer sends what is queued, the BYE last, and exits; then the reader is cut off. A peer
   * that stopped reading gets the timeout, then its socket is cut under the writer. */
  if (c->threads) join_or_cut(c);
  if (c->fd >= 0) shutdown(c->fd, SHUT_RDWR);
  if (c->threads) pthread_join(c->rd, NULL);
  mpr_conn_fail(c, "the context was destroyed");
  if (c->fd >= 0) close(c->fd);
  stage_free(&c->stage);
  free(c->rbuf);
  stage_free(&c->wstage);
  stage_free(&c->istage);
  ring_free(&c->lring);
  ring_free(&c->sring);
  pthread_mutex_destroy(&c->lock);
  pthread_mutex_destroy(&c->rlock);
  pthread_cond_destroy(&c->rcond);
  pthread_cond_destroy(&c->cond);
  free(c);
}

static void peer_name(int fd, int rank, char *buf, size_t len) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  char a[80] = "?";
  if (getpeername(fd, (struct sockaddr *)&ss, &sl) == 0) mps_addr_str((struct sockaddr *)&ss, a, sizeof(a));
  snprintf(buf, len, "rank %d (%s)", rank, a);
}

struct mpr_conn *mpr_conn_new(struct mpr_ctxset *s, int context, int peer, int fd) {
  struct mpr_conn *c = calloc(1, sizeof(*c));
  if (!c || !(c->rbuf = malloc(MPR_RBUF))) {
    free(c);
    return NULL;
  }
  c->set = s;
  c->context = context;
  c->peer = peer;
  c->fd = fd;
  pthread_mutex_init(&c->lock, NULL);
  pthread_mutex_init(&c->rlock, NULL);
  pthread_cond_init(&c->cond, NULL);
  pthread_cond_init(&c->rcond, NULL);
  if (peer == s->g->rank) snprintf(c->peer_str, sizeof(c->peer_str), "rank %d (itself)", peer);
  else peer_name(fd, peer, c->peer_str, sizeof(c->peer_str));
  mplane_rma_set_timeouts(fd, 0); /* the data path waits as long as the peer lives; a dead peer closes the socket */
  return c;
}

ncclResult_t mpr_conn_start(struct mpr_conn *c) {
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
  if (epoll_ctl(c->set->epfd, EPOLL_CTL_ADD, c->fd, &ev) != 0) return ncclSystemError;
  if (pthread_create(&c->rd, NULL, mplane_test_rma_progress_only() ? reader_idle : reader_main, c) != 0) return ncclSystemError;
  if (pthread_create(&c->wr, NULL, writer_main, c) != 0) {
    mpr_conn_fail(c, "no writer thread");
    shutdown(c->fd, SHUT_RDWR);
    pthread_join(c->rd, NULL);
    return ncclSystemError;
  }
  c->threads = 1;
  return ncclSuccess;
}
