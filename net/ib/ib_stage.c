/* mplane IB: GPU buffers on a relayed connection go through a staging ring beside the relay NIC.
 *
 * The NIC that carries a relayed connection is not the one NCCL chose for the buffer's GPU, so it
 * would read the buffer across the root complex (GPUDirect that NCCL's own GDR checks refuse). A
 * staged send instead has the relay's copier (net/relay.h: the CUDA copy engine, or its CPU
 * stand-in in tests) copy each piece into a slot of a ring registered with the relay NIC, and sends
 * the slot: piece j is copied while piece j - 1 is on the wire. The wire protocol is the one of an
 * unstaged send: the same chunks on the same QPs, every chunk in the adaptive-routing form (plain
 * writes, then a write with immediate that carries the chunk's length), so the receiver needs no
 * change and cannot tell. Receives need no staging: the receiver's NIC is the one NCCL chose. */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <arpa/inet.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../profiler.h"
#include "../relay.h"
#include "ib.h"

int mpib_stage_wanted(const struct mpib_send_comm *c, const struct mpib_mr *m, size_t size) {
  if (!c->relayed || size == 0 || !m) return 0; /* an empty send moves no byte of the buffer */
  return m->type == NCCL_PTR_CUDA || mplane_relay_test_host() > 0;
}

/* A staging ring's registration with the relay NIC d: through its dma-buf where the NIC's verbs take
 * one (NCCL's preference: it needs no nvidia-peermem), else plain ibv_reg_mr (GPU memory: peermem).
 * Shared with the one-sided ops' staging (ib_rma.c). */
struct ibv_mr *mpib_stage_ring_register(struct mpib_dev *d, struct mplane_relay_copier *copier, void *mem, int access,
                                        size_t bytes) {
  struct mpib_hca *h = d->hca;
  if (h->dmabuf && mpib_v.reg_dmabuf_mr) {
    int fd = mplane_relay_copier_dmabuf_fd(copier, mem, bytes);
    if (fd >= 0) {
      struct ibv_mr *mr =
          mpib_v.reg_dmabuf_mr(h->pd, 0, bytes, (uint64_t)(uintptr_t)mem, fd, access);
      int e = errno;
      close(fd);
      if (mr) return mr;
      MP_INFO(NCCL_NET, "%s: the staging ring's dma-buf registration failed (%s); registering it plainly",
              d->props.name, strerror(e));
    }
  }
  return mpib_v.reg_mr(h->pd, mem, bytes, access);
}

static ncclResult_t stage_create(struct mpib_send_comm *c, const void *src) {
  struct mpib_stage *st = calloc(1, sizeof(*st));
  if (!st) return ncclSystemError;
  ncclResult_t res = mplane_relay_copier_create(src, c->staging_gpu, &st->copier);
  if (res != ncclSuccess) {
    free(st);
    mpib_error_set(&c->b.err, res, "%s: no copier for the staging ring of the relayed connection to peer %s",
                   c->b.dev->props.name, c->b.peer);
    return mpib_error_check(&c->b.err);
  }
  st->slot_bytes = mplane_relay_test_slot_bytes(MPIB_STAGE_SLOT_BYTES);
  size_t bytes = st->slot_bytes * MPIB_STAGE_SLOTS;
  st->mem = mplane_relay_copier_alloc(st->copier, bytes);
  errno = 0;
  if (st->mem && !mplane_relay_test_fail_reg())
    st->mr = mpib_stage_ring_register(c->b.dev, st->copier, st->mem, IBV_ACCESS_LOCAL_WRITE, bytes);
  else if (st->mem)
    errno = EFAULT; /* MPLANE_TEST_RELAY_FAIL=reg */
  if (!st->mr) {
    int e = errno;
    const char *what = st->mem ? "registering" : "allocating";
    mplane_relay_copier_destroy(st->copier, st->mem);
    free(st);
    mpib_error_set(&c->b.err, ncclSystemError, "%s: %s the %zu-byte staging ring of the relayed connection to "
                   "peer %s failed: %s", c->b.dev->props.name, what, bytes, c->b.peer,
                   e ? strerror(e) : "out of memory");
    return mpib_error_check(&c->b.err);
  }
  c->stage = st;
  return ncclSuccess;
}

ncclResult_t mpib_stage_send(struct mpib_send_comm *c, struct mpib_send_req *r, int ri) {
  if (!c->stage) MP_CHECK(stage_create(c, r->src));
  struct mpib_stage *st = c->stage;
  r->staged = 1;
  r->started = 0;
  r->pending = 1; /* held until the last piece is posted */
  st->queue[st->qtail++ % MPIB_MAX_SENDS] = ri;
  mpib_stage_progress(c);
  return ncclSuccess;
}

/* One landed slot onto the wire: its write, then, when it ends a chunk, the chunk's write with
 * immediate (AR form: the length goes to the receiver's record, ordered after the data on the QP). */
static ncclResult_t post_slot(struct mpib_send_comm *c, struct mpib_stage *st, unsigned idx) {
  struct mpib_stage_slot *s = &st->s[idx];
  struct mpib_send_req *r = &c->reqs[s->ri];
  unsigned chunk = (unsigned)(s->off / r->per);
  int q = (int)((r->first + chunk) % (unsigned)c->b.nqps);
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)(st->mem + (size_t)idx * st->slot_bytes),
                        .length = (uint32_t)s->len, .lkey = st->mr->lkey};
  size_t cstart = (size_t)chunk * r->per, cend = cstart + r->per < r->size ? cstart + r->per : r->size;
  uint64_t lenval = cend - cstart;
  struct ibv_sge lsge = {.addr = (uint64_t)(uintptr_t)&lenval, .length = sizeof(lenval), .lkey = 0};
  struct ibv_send_wr wr[2];
  memset(wr, 0, sizeof(wr));
  wr[0].wr_id = MPIB_WRID(MPIB_WR_STAGE, s->ri, idx);
  wr[0].opcode = IBV_WR_RDMA_WRITE;
  wr[0].send_flags = IBV_SEND_SIGNALED; /* its completion frees the slot */
  wr[0].sg_list = &sge;
  wr[0].num_sge = 1;
  wr[0].wr.rdma.remote_addr = r->raddr + s->off;
  wr[0].wr.rdma.rkey = r->rkey;
  r->pending++;
  if (s->last) {
    wr[0].next = &wr[1];
    wr[1].wr_id = MPIB_WRID(MPIB_WR_DATA, s->ri, chunk);
    wr[1].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr[1].send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
    wr[1].sg_list = &lsge;
    wr[1].num_sge = 1;
    wr[1].imm_data = htonl(mpib_imm(r->slot, r->entry, (unsigned)r->nch, chunk, MPIB_IMM_AR, r->seq));
    wr[1].wr.rdma.remote_addr =
        r->rec_addr + ((uint64_t)(r->slot * MPIB_MAX_RECVS + r->entry) * MPIB_MAX_QPS + chunk) * 8;
    wr[1].wr.rdma.rkey = r->rec_rkey;
    r->pending++;
  }
  s->state = 2;
  MP_CHECK(mpib_post(&c->b, q, wr));
  mplane_prof_ib_start(&r->prof_stage[idx], r->phandle, c->b.devindex, wr[0].wr_id, wr[0].opcode, c->b.qps[q]->qp_num,
                       s->len);
  if (s->off + s->len == r->size) r->pending--; /* the last piece is posted: release the hold */
  return ncclSuccess;
}

/* A failed copy fails the connection; before NCCL hears of it (and may free the buffers of the failed
 * sends), the copies still under way, which read those buffers, are waited for, within a bound. */
#define MPIB_STAGE_DRAIN_NS 10000000000ull

static void drain_copies(struct mpib_send_comm *c, struct mpib_stage *st) {
  uint64_t t0 = mplane_now_ns();
  for (uint64_t j = st->post; j < st->fill; j++) {
    struct mpib_stage_slot *s = &st->s[j % MPIB_STAGE_SLOTS];
    int done = 0;
    while (s->state == 1 && !done && mplane_relay_copier_poll(st->copier, s->ticket, &done) == ncclSuccess) {
      if (mplane_now_ns() - t0 > MPIB_STAGE_DRAIN_NS) {
        MP_WARN("%s: copies into the staging ring to peer %s did not end within 10 s of a failed one", c->b.dev->props.name,
                c->b.peer);
        return;
      }
      sched_yield();
    }
  }
}

/* Post every slot whose copy has landed, in ring order (a chunk's write with immediate must follow
 * all its pieces on the QP). */
static void land_and_post(struct mpib_send_comm *c, struct mpib_stage *st) {
  while (st->post < st->fill) {
    unsigned idx = (unsigned)(st->post % MPIB_STAGE_SLOTS);
    int done = 0;
    ncclResult_t res = mplane_relay_copier_poll(st->copier, st->s[idx].ticket, &done);
    if (res != ncclSuccess) {
      drain_copies(c, st);
      mpib_error_set(&c->b.err, res, "%s: copying a send into the staging ring of the relayed connection to peer "
                     "%s failed", c->b.dev->props.name, c->b.peer);
      return;
    }
    if (!done) return;
    if (post_slot(c, st, idx) != ncclSuccess) return; /* c->b.err holds why */
    st->post++;
  }
}

/* Start copies into free slots, oldest send first, each piece inside one wire chunk. */
static void fill_slots(struct mpib_send_comm *c, struct mpib_stage *st) {
  while (st->qhead < st->qtail) {
    int ri = st->queue[st->qhead % MPIB_MAX_SENDS];
    struct mpib_send_req *r = &c->reqs[ri];
    unsigned idx = (unsigned)(st->fill % MPIB_STAGE_SLOTS);
    struct mpib_stage_slot *s = &st->s[idx];
    if (s->state != 0) return;
    size_t cend = (r->started / r->per + 1) * r->per;
    if (cend > r->size) cend = r->size;
    size_t len = cend - r->started < st->slot_bytes ? cend - r->started : st->slot_bytes;
    uint64_t ticket = 0;
    ncclResult_t res =
        mplane_relay_copier_start(st->copier, st->mem + (size_t)idx * st->slot_bytes, r->src + r->started, len, &ticket);
    if (res != ncclSuccess) {
      drain_copies(c, st);
      mpib_error_set(&c->b.err, res, "%s: starting a copy into the staging ring of the relayed connection to peer "
                     "%s failed", c->b.dev->props.name, c->b.peer);
      return;
    }
    if (!ticket) return; /* the copier is full: later */
    *s = (struct mpib_stage_slot){.state = 1, .ticket = ticket, .ri = ri, .off = r->started, .len = len,
                                  .last = r->started + len == cend};
    r->started += len;
    st->fill++;
    if (r->started == r->size) st->qhead++;
  }
}

void mpib_stage_progress(struct mpib_send_comm *c) {
  struct mpib_stage *st = c->stage;
  if (!st) return;
  if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) { /* failed (a copy, the peer, a QP) */
    drain_copies(c, st);
    return;
  }
  land_and_post(c, st);
  if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) return;
  fill_slots(c, st);
  land_and_post(c, st); /* the stand-in may already be done: no need to wait for the next call */
}

void mpib_stage_slot_done(struct mpib_send_comm *c, unsigned slot) {
  if (c->stage && slot < MPIB_STAGE_SLOTS) c->stage->s[slot].state = 0;
}

void mpib_stage_destroy(struct mpib_send_comm *c) {
  struct mpib_stage *st = c->stage;
  if (!st) return;
  /* The QPs are gone (no write reads the ring any more); the copier finishes a copy under way. */
  if (st->mr) mpib_v.dereg_mr(st->mr);
  mplane_relay_copier_destroy(st->copier, st->mem);
  free(st);
  c->stage = NULL;
}
