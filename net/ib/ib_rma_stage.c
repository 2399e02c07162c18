/* mplane: the staging ring of the IB RMA backend (ib_rma.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/log.h"
#include "../relay.h"
#include "ib.h"
#include "ib_rma.h"

/* ---- staging: this rank's GPU windows in its ops to cross-plane peers ----
 * The relay device is not the NIC beside the window's GPU, so it must not read or write that GPU's
 * memory across the root complex. As a relayed two-sided send does (ib_stage.c), the relay's copier
 * (net/relay.h: the CUDA copy engine, its CPU stand-in in tests) moves the bytes over NVLink between
 * the window and a ring of slots on the GPU beside the relay NIC, registered with it:
 *   put   copy a piece of the source into a slot, RDMA WRITE the slot to the peer's window; the
 *         slot is free again once the write completed; the signal's atomic after the last piece
 *   get   RDMA READ a piece into a slot, then a 1-byte READ of the slot through a QP of the relay
 *         device connected to itself (the READ's completion, seen by the CPU, does not mean the GPU
 *         sees its bytes; the NIC reading that memory again pushes its earlier writes there first,
 *         as NCCL's GPUDirect flush does; none under MPLANE_IB_GDR_FLUSH_DISABLE=1), then copy the
 *         slot into the window; the slot is free, and the piece done, once the copy ended
 * Large ops go in slot-sized pieces, pipelined: piece j is copied while j - 1 is on the wire. Each
 * context on a relay device has its ring (made at its first staged op) and a queue: the staged ops
 * and, behind them, any op of a connection that has queued ones, so every op of a connection is
 * posted in the order it was made and a signal never passes the data of an earlier op. The queue is
 * moved on by test and rmaProgress. */
enum { SLOT_FREE, SLOT_COPY_IN, SLOT_TO_READ, SLOT_WRITING, SLOT_READING, SLOT_READ_DONE, SLOT_FLUSHING, SLOT_FLUSHED,
       SLOT_COPY_OUT };

struct ibr_slot {
  int state;
  uint64_t ticket;       /* the copier's, in SLOT_COPY_IN and SLOT_COPY_OUT */
  struct ibr_req *r;
  uint64_t off, len;     /* the piece: [off, off + len) of r's range */
};

struct ibr_stage {
  struct mplane_relay_copier *copier;
  char *mem;
  struct ibv_mr *mr;
  size_t slot_bytes;
  struct ibr_slot s[MPIB_STAGE_SLOTS];
  uint64_t fill, post;          /* next slot to fill, next to post (monotonic; slot j is s[j % N]) */
  struct ibr_req *head, *tail;  /* the queue, oldest first */
  struct ibr_req *filling;      /* the oldest queued op with pieces not yet given a slot */
};

static char *slot_mem(struct ibr_stage *st, const struct ibr_slot *sl) {
  return st->mem + (size_t)(sl - st->s) * st->slot_bytes;
}

/* Staged work requests carry their slot (low bit set: requests are at least 8-byte aligned). */
static uint64_t slot_wrid(struct ibr_slot *sl) { return (uint64_t)(uintptr_t)sl | 1u; }
struct ibr_slot *ibr_wrid_slot(uint64_t id) { return id & 1u ? (struct ibr_slot *)(uintptr_t)(id & ~1ull) : NULL; }
struct ibr_req *ibr_slot_req(const struct ibr_slot *sl) { return sl->r; }

/* "window 3 ... (rank 0 on plane 0 relays its connection with rank 1 on plane 1 through mlx5_1)". */
static void stage_where(const struct ibr_req *r, char *buf, size_t len) {
  const struct ibr_conn *c = r->conn;
  const struct ibr_group *g = c->cx->set->g;
  snprintf(buf, len, "window %u [%llu, +%llu) of rank %d on plane %d, relayed to rank %d on plane %d through %s "
           "(plane %d)", r->lwin, (unsigned long long)r->loff, (unsigned long long)r->size, g->rank,
           g->plane[g->rank], c->peer, g->plane[c->peer], g->car[c->car].d->props.name, g->car[c->car].plane);
}

/* A copy that failed (or could not start) fails its op and the connection: nothing after it on the
 * QP may be posted (a later signal would claim data that never came). */
static void stage_fault(struct ibr_req *r, ncclResult_t res, const char *what) {
  char where[256], why[160];
  stage_where(r, where, sizeof(where));
  ibr_req_fail(r, res == ncclSuccess ? ncclSystemError : res, "RMA %s %s rank %d (context %d): %s the staging slot "
           "failed: %s; the op is not complete", r->what, ibr_to_from(r), r->conn->peer,
           r->conn->cx->index, what, where);
  snprintf(why, sizeof(why), "a copy through the staging ring of %s failed", r->conn->cx->b.dev->props.name);
  ibr_conn_fail(r->conn, why);
}

static ncclResult_t stage_create(struct ibr_cx *x, struct ibr_req *r, const void *window) {
  struct ibr_group *g = x->set->g;
  struct ibr_stage *st = calloc(1, sizeof(*st));
  if (!st) return ncclSystemError;
  char where[256];
  stage_where(r, where, sizeof(where));
  ncclResult_t res = mplane_relay_copier_create(window, g->car[x->car].near_gpu, &st->copier);
  if (res != ncclSuccess) {
    free(st);
    ibr_req_fail(r, res, "RMA %s: no copier for the staging ring of %s", r->what, where);
    return res;
  }
  st->slot_bytes = mplane_relay_test_slot_bytes(MPIB_STAGE_SLOT_BYTES);
  size_t bytes = st->slot_bytes * MPIB_STAGE_SLOTS;
  st->mem = mplane_relay_copier_alloc(st->copier, bytes);
  errno = 0;
  /* remote read: the flush QP reads a slot back (a QP of the same device, connected to itself) */
  if (st->mem && !mplane_relay_test_fail_reg())
    st->mr = mpib_stage_ring_register(x->b.dev, st->copier, st->mem, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ,
                                      bytes);
  else if (st->mem) errno = EFAULT; /* MPLANE_TEST_RELAY_FAIL=reg */
  if (!st->mr) {
    int e = errno;
    mplane_relay_copier_destroy(st->copier, st->mem);
    free(st);
    ibr_req_fail(r, ncclSystemError, "RMA %s: %s the %zu-byte staging ring for %s failed: %s", r->what,
             e || !bytes ? "registering" : "allocating", bytes, where, e ? strerror(e) : "out of memory");
    return ncclSystemError;
  }
  if (!x->flush_qp && !mpib_config()->ib_gdr_flush_disable) {
    struct mpib_dev *d = x->b.dev;
    ncclResult_t fr = mpib_create_qp(&x->b, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE, MPIB_STAGE_SLOTS, 0, 0,
                                     &x->flush_qp);
    if (fr == ncclSuccess) fr = mpib_qp_connect(&x->b, x->flush_qp, x->flush_qp->qp_num, d->lid, x->b.gid.raw, d->mtu);
    if (fr != ncclSuccess) {
      if (x->flush_qp) mpib_v.destroy_qp(x->flush_qp);
      x->flush_qp = NULL;
      mpib_v.dereg_mr(st->mr);
      mplane_relay_copier_destroy(st->copier, st->mem);
      free(st);
      ibr_req_fail(r, fr, "RMA %s: the flush QP of the staging ring for %s could not be made", r->what, where);
      return fr;
    }
  }
  x->stage = st;
  return ncclSuccess;
}

static void queue_push(struct ibr_stage *st, struct ibr_req *r) {
  r->queued = 1;
  r->next = NULL;
  if (st->tail) st->tail->next = r;
  else st->head = r;
  st->tail = r;
  if (!st->filling) st->filling = r;
  r->conn->nqueued++;
}

static void queue_pop(struct ibr_stage *st) {
  struct ibr_req *r = st->head;
  st->head = r->next;
  if (!st->head) st->tail = NULL;
  if (st->filling == r) st->filling = r->next;
  r->queued = 0;
  r->conn->nqueued--;
}

/* Give the queued ops' next pieces free slots, in ring order: a put's piece starts its copy in. */
static void stage_fill(struct ibr_stage *st) {
  while (st->filling) {
    struct ibr_req *r = st->filling;
    if (!r->staged || r->started == r->size || r->failed || r->conn->failed) {
      st->filling = r->next;
      continue;
    }
    struct ibr_slot *sl = &st->s[st->fill % MPIB_STAGE_SLOTS];
    if (sl->state != SLOT_FREE) return;
    uint64_t len = r->size - r->started < st->slot_bytes ? r->size - r->started : st->slot_bytes;
    int state = SLOT_TO_READ;
    uint64_t ticket = 0;
    if (r->op.opcode == IBV_WR_RDMA_WRITE) {
      ncclResult_t res = mplane_relay_copier_start(st->copier, slot_mem(st, sl), r->lbase + r->loff + r->started,
                                                   len, &ticket);
      if (res != ncclSuccess) {
        stage_fault(r, res, "starting the copy of the source into");
        continue;
      }
      if (!ticket) return; /* the copier is full: later */
      state = SLOT_COPY_IN;
    }
    *sl = (struct ibr_slot){.state = state, .ticket = ticket, .r = r, .off = r->started, .len = len};
    r->started += len;
    st->fill++;
  }
}

/* Post the slot at the post cursor (its copy in landed, or a get's): 0 posted, 1 not yet. */
static int stage_post_slot(struct ibr_stage *st, struct ibr_req *r, struct ibr_slot *sl) {
  struct ibr_conn *c = r->conn;
  if (sl->state == SLOT_COPY_IN) {
    int done = 0;
    ncclResult_t res = mplane_relay_copier_poll(st->copier, sl->ticket, &done);
    if (res != ncclSuccess) {
      sl->state = SLOT_FREE; /* the copy is over, failed */
      stage_fault(r, res, "copying the source into");
      return 1;
    }
    if (!done) return 1;
  }
  if (!ibr_room(c, 1)) return 1;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)slot_mem(st, sl), .length = (uint32_t)sl->len,
                        .lkey = st->mr->lkey};
  struct ibv_send_wr wr = {.wr_id = slot_wrid(sl), .sg_list = &sge, .num_sge = 1,
                           .opcode = (enum ibv_wr_opcode)r->op.opcode, .send_flags = IBV_SEND_SIGNALED};
  wr.wr.rdma.remote_addr = r->op.raddr + sl->off;
  wr.wr.rdma.rkey = r->op.rkey;
  int get = r->op.opcode == IBV_WR_RDMA_READ;
  sl->state = get ? SLOT_READING : SLOT_WRITING;
  if (get) r->copies++; /* its copy out is still to come */
  if (ibr_post(c, r, &wr) != 0) {
    sl->state = SLOT_FREE;
    if (get) r->copies--;
    ibr_conn_fail(c, "ibv_post_send failed on a staged op");
  }
  st->post++;
  r->posted += sl->len;
  return 0;
}

/* The head op failed (or its connection did): release the slots it was given, once their copies in
 * are over (they read its source), and take it off the queue. 0 done, 1 wait. */
static int stage_drop_head(struct ibr_stage *st, struct ibr_req *r) {
  while (st->post < st->fill && st->s[st->post % MPIB_STAGE_SLOTS].r == r) {
    struct ibr_slot *sl = &st->s[st->post % MPIB_STAGE_SLOTS];
    if (sl->state == SLOT_COPY_IN) {
      int done = 0;
      if (mplane_relay_copier_poll(st->copier, sl->ticket, &done) == ncclSuccess && !done) return 1;
    }
    sl->state = SLOT_FREE;
    st->post++;
  }
  if (!r->failed) ibr_req_fail_conn(r, r->conn->why);
  queue_pop(st);
  return 0;
}

/* Post from the head of the queue: a staged op's pieces in ring order, then its signal; an op queued
 * behind staged ones whole. Stops at the first that must wait. */
static void stage_post(struct ibr_stage *st) {
  while (st->head) {
    struct ibr_req *r = st->head;
    struct ibr_conn *c = r->conn;
    if (r->failed || c->failed) {
      if (stage_drop_head(st, r)) return;
      continue;
    }
    if (!r->staged) {
      if (!ibr_room(c, ibr_op_nwr(&r->op))) return;
      if (ibr_post_op_locked(c, r, &r->op) != ncclSuccess) ibr_req_fail(r, ncclSystemError, "RMA %s: out of memory", r->what);
      queue_pop(st);
      continue;
    }
    if (r->posted < r->size) {
      if (st->post == st->fill || stage_post_slot(st, r, &st->s[st->post % MPIB_STAGE_SLOTS])) return;
      continue;
    }
    if (r->op.sig) { /* the signal, after every piece of its data on the QP */
      if (!ibr_room(c, 1)) return;
      struct ibr_op sig = r->op;
      sig.size = 0;
      ibr_post_op_locked(c, r, &sig);
    }
    queue_pop(st);
  }
}

/* A get's piece was read into its slot: read one byte of the slot back through the flush QP, so the
 * GPU sees the piece before the copier reads it. 0 posted, 1 later (no room). */
static int stage_flush_slot(struct ibr_cx *x, struct ibr_stage *st, struct ibr_slot *sl) {
  struct ibr_req *r = sl->r;
  struct ibr_conn *c = r->conn;
  if (!ibr_room(c, 1)) return 1;
  struct ibr_group *g = x->set->g;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)g->scratch, .length = 1, .lkey = g->car[x->car].scratch_mr->lkey};
  struct ibv_send_wr wr = {.wr_id = slot_wrid(sl), .sg_list = &sge, .num_sge = 1, .opcode = IBV_WR_RDMA_READ,
                           .send_flags = IBV_SEND_SIGNALED};
  wr.wr.rdma.remote_addr = (uint64_t)(uintptr_t)slot_mem(st, sl);
  wr.wr.rdma.rkey = st->mr->rkey;
  sl->state = SLOT_FLUSHING;
  if (ibr_post_on(c, x->flush_qp, r, &wr) != 0) {
    sl->state = SLOT_FREE;
    r->copies--;
    ibr_conn_fail(c, "ibv_post_send failed on the staging ring's flush QP");
  }
  return 0;
}

/* Gets' pieces whose READ completed: flush them, then copy them out of the slot into the window; a
 * copy that ended frees its slot. */
static void stage_copy_out(struct ibr_cx *x, struct ibr_stage *st) {
  for (int i = 0; i < MPIB_STAGE_SLOTS; i++) {
    struct ibr_slot *sl = &st->s[i];
    struct ibr_req *r = sl->r;
    if (sl->state == SLOT_READ_DONE && stage_flush_slot(x, st, sl)) return;
    if (sl->state == SLOT_FLUSHED) {
      uint64_t ticket = 0;
      ncclResult_t res =
          mplane_relay_copier_start(st->copier, r->lbase + r->loff + sl->off, slot_mem(st, sl), sl->len, &ticket);
      if (res != ncclSuccess) {
        sl->state = SLOT_FREE;
        r->copies--;
        stage_fault(r, res, "starting the copy into the window from");
        continue;
      }
      if (!ticket) return;
      sl->ticket = ticket;
      sl->state = SLOT_COPY_OUT;
    }
    if (sl->state == SLOT_COPY_OUT) {
      int done = 0;
      ncclResult_t res = mplane_relay_copier_poll(st->copier, sl->ticket, &done);
      if (res != ncclSuccess || done) {
        sl->state = SLOT_FREE;
        r->copies--;
      }
      if (res != ncclSuccess) stage_fault(r, res, "copying into the window from");
    }
  }
}

/* A staged work request completed: a write's slot is free, a get's piece goes on to its copy out,
 * through the slot's flush read unless the site says its platform needs none
 * (MPLANE_IB_GDR_FLUSH_DISABLE, as for iflush). */
void ibr_stage_wr_done(struct ibr_slot *sl, int ok) {
  if (sl->state == SLOT_READING && ok) {
    sl->state = mpib_config()->ib_gdr_flush_disable ? SLOT_FLUSHED : SLOT_READ_DONE;
    return;
  }
  if (sl->state == SLOT_FLUSHING && ok) {
    sl->state = SLOT_FLUSHED;
    return;
  }
  if (sl->state == SLOT_READING || sl->state == SLOT_FLUSHING) sl->r->copies--; /* nothing to copy: it failed */
  sl->state = SLOT_FREE;
}

/* Move the context's ring on (caller holds its lock). */
void ibr_stage_progress(struct ibr_cx *x) {
  struct ibr_stage *st = x->stage;
  if (!st) return;
  stage_copy_out(x, st);
  stage_post(st);
  stage_fill(st);
  stage_post(st); /* the stand-in may be done already */
}

/* Copies still under way read sources or write windows: wait for them (bounded) before the ring,
 * the copier and what they touch are freed. */
#define IBR_STAGE_DRAIN_S 10.0
void ibr_stage_destroy(struct ibr_cx *x) {
  struct ibr_stage *st = x->stage;
  if (x->flush_qp) mpib_v.destroy_qp(x->flush_qp);
  x->flush_qp = NULL;
  if (!st) return;
  double t0 = mplane_now_s();
  for (int i = 0; i < MPIB_STAGE_SLOTS; i++) {
    struct ibr_slot *sl = &st->s[i];
    int done = sl->state != SLOT_COPY_IN && sl->state != SLOT_COPY_OUT;
    while (!done && mplane_relay_copier_poll(st->copier, sl->ticket, &done) == ncclSuccess && !done) {
      if (mplane_now_s() - t0 > IBR_STAGE_DRAIN_S) {
        MP_WARN("RMA destroyContext: copies through the staging ring of %s (context %d) did not end within %.0f s",
                x->b.dev->props.name, x->index, IBR_STAGE_DRAIN_S);
        break;
      }
      sched_yield();
    }
  }
  if (st->mr) mpib_v.dereg_mr(st->mr);
  mplane_relay_copier_destroy(st->copier, st->mem); /* ends a copy still under way first */
  free(st);
  x->stage = NULL;
}

/* Queue r (its op filled) on its context's ring: staged, or behind its connection's queued ops. */
static ncclResult_t stage_queue(struct ibr_conn *c, struct ibr_req *r, int staged) {
  struct ibr_cx *x = c->cx;
  if (staged && !x->stage && stage_create(x, r, r->lbase) != ncclSuccess) return ncclSuccess; /* r failed */
  r->staged = staged;
  r->queued_at = mplane_now_s();
  queue_push(x->stage, r);
  ibr_stage_progress(x);
  return ncclSuccess;
}

/* An op waits in the queue (for a slot, for the ops before it) at most MPLANE_CONNECT_TIMEOUT; then it
 * fails the connection, so that nothing queued behind it waits for ever. */
void ibr_stage_deadline(struct ibr_req *r) {
  double waited = mplane_now_s() - r->queued_at;
  if (waited * 1000.0 < (double)ibr_timeout_ms()) return;
  char where[256], why[160];
  stage_where(r, where, sizeof(where));
  ibr_req_fail(r, ncclRemoteError, "RMA %s %s rank %d (context %d): waited %.0f s (MPLANE_CONNECT_TIMEOUT) in the queue "
           "of the staging ring for %s", r->what, ibr_to_from(r), r->conn->peer,
           r->conn->cx->index, waited, where);
  snprintf(why, sizeof(why), "an op waited past MPLANE_CONNECT_TIMEOUT for the staging ring of %s",
           r->conn->cx->b.dev->props.name);
  ibr_conn_fail(r->conn, why);
}

/* Start r: at once, or queued behind staging. */
ncclResult_t ibr_start_op(struct ibr_conn *c, struct ibr_req *r, int staged) {
  struct ibr_cx *x = c->cx;
  pthread_mutex_lock(&x->lock);
  ncclResult_t res = ncclSuccess;
  if (staged || c->nqueued) {
    res = stage_queue(c, r, staged);
  } else if (!ibr_room(c, ibr_op_nwr(&r->op))) {
    MP_WARN("RMA %s to rank %d (context %d): %d work requests in flight on its QP, %d on the context: more than the "
            "queues hold (%d, %d)", r->what, c->peer, x->index, c->outstanding, x->outstanding, IBR_SQ, x->cq_depth);
    res = ncclInternalError;
  } else {
    res = ibr_post_op_locked(c, r, &r->op);
  }
  pthread_mutex_unlock(&x->lock);
  if (res != ncclSuccess) free(r);
  return res;
}

/* A local window this connection's device does not reach (GPU memory on a relay device): its bytes go
 * through the staging ring. */
int ibr_staged_window(const struct ibr_conn *c, const struct ibr_win *w) {
  return !w->mr[c->car] && w->type == NCCL_PTR_CUDA && c->car != 0;
}

/* A local window's key on c's device. A window it does not reach is staged (staged_window), so a
 * missing key is a registration that went wrong: the op fails, naming the window and the device. */
ncclResult_t ibr_local_key(struct ibr_req *r, const struct ibr_win *w, uint32_t *lkey, void **request) {
  const struct ibr_conn *c = r->conn;
  if (w->mr[c->car]) {
    *lkey = w->mr[c->car]->lkey;
    return ncclSuccess;
  }
  const struct ibr_group *g = c->cx->set->g;
  ibr_req_fail(r, ncclInternalError, "RMA %s %s rank %d (context %d): local window %u is not registered on %s (plane %d), "
           "which carries this rank's ops to rank %d (plane %d); nothing was %s", r->what,
           ibr_to_from(r), c->peer, c->cx->index, w->id, g->car[c->car].d->props.name,
           g->car[c->car].plane, c->peer, g->plane[c->peer], strcmp(r->what, "get") ? "written" : "read");
  return ibr_refuse(r, request);
}
