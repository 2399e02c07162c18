/* mplane: the IB data path (protocol in ib.h). Only the proxy thread calls in here; it posts work
 * requests and polls the comm's completion queue. Nothing blocks, and every failure - an error
 * completion, an async event, the peer's side channel closing - becomes an error of test() for every
 * request not complete by then (one already complete still reports success). */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../../common/log.h"
#include "../profiler.h"
#include "ib.h"

#define MPIB_LIVENESS_EVERY 64
#define MPIB_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ)

/* ------------------------------------------------------------------ memory registration */
/* NCCL's data buffers and the one-sided data windows are registered with PCIe relaxed ordering where
 * libibverbs has ibv_reg_mr_iova2 (NCCL's net_ib does the same; GPUDirect bandwidth needs it on many
 * hosts). The flag is optional: a kernel that does not know it ignores it. Never on the FIFO, the
 * length records (reg_local) or signal windows: their order is what a reader relies on (a strongly
 * ordered write never passes the relaxed ones before it, so data stays ahead of what announces it).
 * A library or provider that refuses
 * the flag outright (EINVAL/EOPNOTSUPP) is asked once more without it, and no more after that.
 * MPLANE_IB_PCI_RELAXED_ORDERING=0 (NCCL_IB_PCI_RELAXED_ORDERING=0) leaves it off, for platforms
 * whose relaxed ordering is broken or slow. */
static int relaxed_refused;

static int relaxed_wanted(void) {
  return mpib_config()->ib_relaxed_ordering != 0 && !__atomic_load_n(&relaxed_refused, __ATOMIC_RELAXED);
}

struct ibv_mr *mpib_reg_data(struct ibv_pd *pd, void *addr, size_t len, int access) {
  if (mpib_v.reg_mr_iova2 && relaxed_wanted()) {
    struct ibv_mr *mr = mpib_v.reg_mr_iova2(pd, addr, len, (uint64_t)(uintptr_t)addr,
                                            (unsigned)access | IBV_ACCESS_RELAXED_ORDERING);
    if (mr || (errno != EINVAL && errno != EOPNOTSUPP)) return mr;
    __atomic_store_n(&relaxed_refused, 1, __ATOMIC_RELAXED);
    MP_INFO(NCCL_NET, "NET/IB: memory registration refuses relaxed ordering (%s); registering without it",
            strerror(errno));
  }
  return mpib_v.reg_mr(pd, addr, len, access);
}

struct ibv_mr *mpib_reg_data_dmabuf(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access) {
  if (relaxed_wanted()) {
    struct ibv_mr *mr = mpib_v.reg_dmabuf_mr(pd, offset, len, iova, fd, access | IBV_ACCESS_RELAXED_ORDERING);
    if (mr || (errno != EINVAL && errno != EOPNOTSUPP)) return mr;
  }
  return mpib_v.reg_dmabuf_mr(pd, offset, len, iova, fd, access);
}

static struct ibv_mr *reg_data(struct ibv_pd *pd, void *addr, size_t len) {
  return mpib_reg_data(pd, addr, len, MPIB_ACCESS);
}

/* The registration cache: NCCL registers the same buffer once per comm, and with user-buffer
 * registration once per peer; each registration pins the pages again. A regMr whose pages lie
 * within a live registration of the same protection domain (HCA) shares it, refcounted; the last
 * deregMr releases it. dma-buf registrations are cached the same way, apart from plain ones: NCCL
 * exports a new dma-buf (a new fd) for every regMrDmaBuf of a buffer, so the fd cannot be the key.
 * The key is the range as the NIC addresses it (iova = the buffer's address) and where that range
 * lies in the dma-buf (offset): a registration inside a live one, at the same place of its dma-buf,
 * shares it; any other is registered on its own (safely distinct). The fd is needed only while
 * registering: the MR keeps the dma-buf itself, whatever the caller does with its fd afterwards. */
struct mpib_reg {
  struct ibv_pd *pd;
  uintptr_t start; /* iova */
  size_t len;
  int dmabuf;      /* registered through a dma-buf, start at offset in it */
  uint64_t offset;
  struct ibv_mr *mr;
  int refs;
  struct mpib_reg *next;
};
static pthread_mutex_t reg_cache_lock = PTHREAD_MUTEX_INITIALIZER;
static struct mpib_reg *reg_cache;

static int reg_covers(const struct mpib_reg *e, struct ibv_pd *pd, uintptr_t start, size_t len, int fd,
                      uint64_t offset) {
  if (e->pd != pd || e->dmabuf != (fd >= 0) || start < e->start || start + len > e->start + e->len) return 0;
  return fd < 0 || e->offset + (start - e->start) == offset; /* the same place of a dma-buf of the same layout */
}

/* The live registration covering [start, start + len) (fd >= 0: at offset of that dma-buf), with
 * one more reference, else a new one; NULL (errno set) when registering failed. */
static struct mpib_reg *reg_cached(struct ibv_pd *pd, uintptr_t start, size_t len, int fd, uint64_t offset) {
  pthread_mutex_lock(&reg_cache_lock);
  struct mpib_reg *e = reg_cache;
  for (; e; e = e->next)
    if (reg_covers(e, pd, start, len, fd, offset)) break;
  if (!e) {
    e = calloc(1, sizeof(*e));
    if (e)
      e->mr = fd >= 0 ? mpib_reg_data_dmabuf(pd, offset, len, (uint64_t)start, fd, MPIB_ACCESS)
                      : reg_data(pd, (void *)start, len);
    if (e && !e->mr) {
      int err = errno;
      free(e);
      e = NULL;
      errno = err;
    } else if (e) {
      *e = (struct mpib_reg){.pd = pd, .start = start, .len = len, .dmabuf = fd >= 0, .offset = offset, .mr = e->mr,
                             .next = reg_cache};
      reg_cache = e;
    }
  }
  if (e) e->refs++;
  pthread_mutex_unlock(&reg_cache_lock);
  return e;
}

static void reg_release(struct mpib_reg *e) {
  pthread_mutex_lock(&reg_cache_lock);
  if (--e->refs == 0) {
    for (struct mpib_reg **p = &reg_cache; *p; p = &(*p)->next)
      if (*p == e) {
        *p = e->next;
        break;
      }
    mpib_v.dereg_mr(e->mr);
    free(e);
  }
  pthread_mutex_unlock(&reg_cache_lock);
}

static ncclResult_t reg_common(void *comm, void *data, size_t size, int type, int fd, uint64_t offset,
                               void **mhandle) {
  struct mpib_comm_base *b = comm;
  *mhandle = NULL;
  if (type != NCCL_PTR_HOST && type != NCCL_PTR_CUDA) {
    MP_WARN("NET/IB: regMr of memory type %d; expected NCCL_PTR_HOST or NCCL_PTR_CUDA", type);
    return ncclInvalidArgument;
  }
  /* GPU memory through a dma-buf needs the HCA's dma-buf support, through plain regMr nvidia-peermem */
  int need = fd >= 0 ? NCCL_PTR_DMABUF : NCCL_PTR_CUDA;
  if (type == NCCL_PTR_CUDA && !(b->dev->props.ptr_support & need)) {
    MP_WARN("NET/IB: %s: %s of GPU memory, but this node %s (ptrSupport 0x%x)", b->dev->props.name,
            fd >= 0 ? "regMrDmaBuf" : "regMr",
            fd >= 0 ? "has no dma-buf support for this HCA (NVIDIA driver and a kernel/HCA that take dma-bufs)"
                    : "has no nvidia-peermem loaded (modprobe nvidia-peermem, or let NCCL use dma-bufs)",
            b->dev->props.ptr_support);
    return ncclInvalidUsage;
  }
  struct mpib_mr *m = calloc(1, sizeof(*m));
  if (!m) return ncclSystemError;
  m->type = type;
  m->addr = data;
  m->size = size;
  if (fd >= 0) {
    if (!mpib_v.reg_dmabuf_mr) {
      free(m);
      MP_WARN("NET/IB: regMrDmaBuf: this libibverbs has no ibv_reg_dmabuf_mr (rdma-core >= 34 needed)");
      return ncclInvalidUsage;
    }
    /* the range as given: a dma-buf may end where the buffer ends, so no rounding to pages */
    m->cached = reg_cached(b->dev->hca->pd, (uintptr_t)data, size, fd, offset);
  } else {
    /* whole pages, as the kernel pins pages anyway */
    uintptr_t start = (uintptr_t)data & ~(uintptr_t)4095;
    size_t len = (((uintptr_t)data + size + 4095) & ~(uintptr_t)4095) - start;
    m->cached = reg_cached(b->dev->hca->pd, start, len ? len : 4096, -1, 0);
  }
  m->mr = m->cached ? m->cached->mr : NULL;
  if (!m->mr) {
    int e = errno;
    free(m);
    MP_WARN("NET/IB: %s: registering %zu bytes of %s memory at %p%s failed: %s%s", b->dev->props.name, size,
            type == NCCL_PTR_CUDA ? "GPU" : "host", data, fd >= 0 ? " (dma-buf)" : "", strerror(e),
            type == NCCL_PTR_CUDA && fd < 0 ? " (GPU memory needs nvidia-peermem loaded, or dma-buf)" : "");
    return ncclSystemError;
  }
  *mhandle = m;
  return ncclSuccess;
}

ncclResult_t mpib_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  return reg_common(comm, data, size, type, -1, 0, mhandle);
}

ncclResult_t mpib_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                void **mhandle) {
  if (fd < 0) return reg_common(comm, data, size, type, -1, 0, mhandle);
  return reg_common(comm, data, size, type, fd, offset, mhandle);
}

ncclResult_t mpib_dereg_mr(void *comm, void *mhandle) {
  (void)comm;
  struct mpib_mr *m = mhandle;
  if (!m) return ncclSuccess;
  if (m->cached) reg_release(m->cached);
  else if (m->mr) mpib_v.dereg_mr(m->mr);
  free(m);
  return ncclSuccess;
}

/* ------------------------------------------------------------------ striping */
/* Large messages are striped in chunks of at least MPIB_CHUNK_MIN (4 KiB aligned) over up to every
 * QP: smaller pieces gain nothing from another QP and cost a completion each. */
int mpib_chunks(size_t size, int nqps, int split, size_t *per) {
  *per = size;
  if (!split || nqps <= 1 || size <= MPIB_CHUNK_MIN) return 1;
  size_t nch = (size + MPIB_CHUNK_MIN - 1) / MPIB_CHUNK_MIN;
  if (nch > (size_t)nqps) nch = (size_t)nqps;
  size_t p = (size + nch - 1) / nch;
  p = (p + 4095) & ~(size_t)4095;
  *per = p;
  return (int)((size + p - 1) / p);
}

/* ------------------------------------------------------------------ completions */
static const char *wr_what(uint64_t kind) {
  switch (kind) {
    case MPIB_WR_DATA: return "data write";
    case MPIB_WR_FIFO: return "FIFO write";
    case MPIB_WR_RECV: return "receive";
    case MPIB_WR_FLUSH: return "flush read";
    case MPIB_WR_STAGE: return "staging write";
    default: return "work request";
  }
}

static void protocol_error(struct mpib_comm_base *b, const char *what, uint32_t imm) {
  mpib_error_set(&b->err, ncclInternalError, "%s port %d: protocol error from peer %s: %s (imm 0x%08x)",
                 b->dev->hca->name, b->dev->port, b->peer, what, imm);
}

const char *mpib_recv_entry_accept(const struct mpib_recv_comm *c, struct mpib_recv_entry *en, uint32_t byte_len,
                                   uint32_t imm) {
  if (en->trunc || (en->nchunks && en->chunks == en->nchunks)) return "data for a receive buffer already complete";
  if (imm & MPIB_IMM_TRUNC) {
    if (en->chunks) return "a 'does not fit' notice after data";
    en->trunc = 1;
    return NULL;
  }
  unsigned chunk = MPIB_IMM_CHUNK(imm), nchunks = MPIB_IMM_NCHUNKS(imm);
  if (en->chunks && (unsigned)en->nchunks != nchunks) return "chunks of one message disagree on their count";
  if (chunk >= nchunks || (en->chunk_mask & (1u << chunk))) return "a chunk out of range or received twice";
  uint64_t len = byte_len;
  if (imm & MPIB_IMM_AR) {
    unsigned slot = MPIB_IMM_SLOT(imm);
    len = __atomic_load_n(&c->lens[(slot * MPIB_MAX_RECVS + MPIB_IMM_ENTRY(imm)) * MPIB_MAX_QPS + chunk],
                          __ATOMIC_ACQUIRE);
  }
  if (len > en->cap - en->bytes) return "more bytes than the receive buffer holds";
  en->nchunks = (int)nchunks;
  en->chunk_mask |= 1u << chunk;
  en->bytes += len;
  en->chunks++;
  return NULL;
}

static void on_recv(struct mpib_recv_comm *c, const struct ibv_wc *wc) {
  unsigned q = (unsigned)MPIB_WRID_A(wc->wr_id);
  if (q < (unsigned)c->b.nqps) {
    struct ibv_recv_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wc->wr_id;
    int rc = ibv_post_recv(c->b.qps[q], &wr, &bad);
    if (rc) mpib_error_set(&c->b.err, ncclSystemError, "%s port %d: re-posting a receive on QP %u failed: %s",
                           c->b.dev->hca->name, c->b.dev->port, c->b.qps[q]->qp_num, strerror(rc));
  }
  if (!(wc->wc_flags & IBV_WC_WITH_IMM)) return protocol_error(&c->b, "a receive without immediate", 0);
  uint32_t imm = ntohl(wc->imm_data);
  struct mpib_recv_req *r = &c->reqs[MPIB_IMM_SLOT(imm)];
  unsigned e = MPIB_IMM_ENTRY(imm);
  if (!r->used || MPIB_IMM_SEQ(imm) != (uint32_t)(r->seq & 0xfff) || (int)e >= r->n)
    return protocol_error(&c->b, "data for a receive that is not posted", imm);
  struct mpib_recv_entry *en = &r->e[e];
  const char *bad = mpib_recv_entry_accept(c, en, wc->byte_len, imm);
  if (bad) return protocol_error(&c->b, bad, imm);
  if (en->trunc || en->chunks == en->nchunks) {
    mplane_prof_stop(&en->prof);
    r->done_entries++;
  }
}

/* A signaled FIFO write of slot `slot` completed: it and every write its QP posted before it are done
 * (a QP completes in order). `count` is the QP's post count up to it, modulo 2^16; the QP never has
 * more than MPIB_RECV_SQ writes unretired, so the low bits say how far to move. */
static void fifo_retire(struct mpib_recv_comm *c, unsigned slot, uint64_t count) {
  unsigned q = slot % (unsigned)c->b.nqps;
  c->fifo_retired[q] += (uint16_t)((uint16_t)count - (uint16_t)c->fifo_retired[q]);
}

/* Drain the comm's CQ. Errors land in b->err. */
static void poll_cq(struct mpib_comm_base *b) {
  struct ibv_wc wcs[32];
  for (int round = 0; round < 8; round++) {
    int n = ibv_poll_cq(b->cq, 32, wcs);
    if (n < 0) {
      mpib_error_set(&b->err, ncclSystemError, "%s port %d: polling the CQ failed (peer %s)", b->dev->hca->name,
                     b->dev->port, b->peer);
      return;
    }
    for (int i = 0; i < n; i++) {
      struct ibv_wc *wc = &wcs[i];
      uint64_t kind = MPIB_WRID_KIND(wc->wr_id);
      if (wc->status != IBV_WC_SUCCESS) {
        if (wc->status == IBV_WC_WR_FLUSH_ERR && __atomic_load_n(&b->err.state, __ATOMIC_ACQUIRE)) continue;
        mpib_error_set(&b->err, ncclRemoteError,
                       "%s port %d: %s completed with error: %s (status %d, vendor error 0x%x) on QP %u; peer %s",
                       b->dev->hca->name, b->dev->port, wr_what(kind), mpib_wc_status_str(wc->status),
                       (int)wc->status, wc->vendor_err, wc->qp_num, b->peer);
        continue;
      }
      if (b->kind == MPIB_SEND_COMM) {
        struct mpib_send_comm *c = (struct mpib_send_comm *)b;
        if (kind == MPIB_WR_DATA && MPIB_WRID_A(wc->wr_id) < MPIB_MAX_SENDS) {
          struct mpib_send_req *r = &c->reqs[MPIB_WRID_A(wc->wr_id)];
          mplane_prof_stop(&r->prof[MPIB_WRID_B(wc->wr_id) % MPIB_MAX_QPS]);
          if (--r->pending == 0 && r->trunc) r->used = 0; /* nobody tests a refused send */
        } else if (kind == MPIB_WR_STAGE && MPIB_WRID_A(wc->wr_id) < MPIB_MAX_SENDS) {
          mplane_prof_stop(&c->reqs[MPIB_WRID_A(wc->wr_id)].prof_stage[MPIB_WRID_B(wc->wr_id) % MPIB_MAX_QPS]);
          c->reqs[MPIB_WRID_A(wc->wr_id)].pending--;
          mpib_stage_slot_done(c, (unsigned)MPIB_WRID_B(wc->wr_id));
        }
      } else {
        struct mpib_recv_comm *c = (struct mpib_recv_comm *)b;
        uint64_t a = MPIB_WRID_A(wc->wr_id);
        if (kind == MPIB_WR_RECV) on_recv(c, wc);
        else if (kind == MPIB_WR_FIFO && a < MPIB_MAX_REQS) fifo_retire(c, (unsigned)a, MPIB_WRID_B(wc->wr_id));
        else if (kind == MPIB_WR_FLUSH && a < MPIB_MAX_FLUSHES) c->freqs[a].pending--;
      }
    }
    if (n < 32) return;
  }
}

/* The side channel stays open for the comm's life: when it reads EOF the peer process is gone (or
 * closed its comm), which verbs alone would only show after the transport retries time out. */
static void check_peer(struct mpib_comm_base *b) {
  if (++b->live_polls % MPIB_LIVENESS_EVERY != 0 || b->fd < 0) return;
  char byte;
  ssize_t r = recv(b->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
    mpib_error_set(&b->err, ncclRemoteError,
                   "%s port %d: peer %s closed the connection with requests in flight (process exited or closed "
                   "its comm?)", b->dev->hca->name, b->dev->port, b->peer);
}

/* ------------------------------------------------------------------ send */
int mpib_fifo_take(const struct mpib_fifo_wire *w, uint64_t seq, struct mpib_fifo_slot *out) {
  if (__atomic_load_n(&w->e[0].seq, __ATOMIC_ACQUIRE) != seq + 1) return 0;
  uint32_t n = w->e[0].nreqs;
  if (n < 1 || n > MPIB_MAX_RECVS) return -1;
  for (uint32_t i = 1; i < n; i++)
    if (__atomic_load_n(&w->e[i].seq, __ATOMIC_ACQUIRE) != seq + 1) return 0; /* still landing */
  for (uint32_t i = 0; i < n; i++) {
    const struct mpib_fifo_elem *el = &w->e[i];
    if (el->nreqs != n) return -1;
    out->e[i] = (struct mpib_fifo_entry){.addr = el->addr, .size = el->size, .rkey = el->rkey, .tag = el->tag};
  }
  out->n = n;
  out->rec_rkey = w->e[0].rec_rkey;
  out->rec_addr = w->e[0].rec_addr;
  return 1;
}

static struct mpib_send_req *send_req_alloc(struct mpib_send_comm *c, int *index) {
  for (int i = 0; i < MPIB_MAX_SENDS; i++)
    if (!c->reqs[i].used) {
      c->reqs[i].used = 1;
      *index = i;
      return &c->reqs[i];
    }
  return NULL;
}

/* The connection has failed: hand out a request whose test() reports it, so the error reaches NCCL
 * through test (as for requests already in flight) and a caller that only posts never spins. */
static ncclResult_t send_failed(struct mpib_send_comm *c, void **request) {
  int ri;
  struct mpib_send_req *r = send_req_alloc(c, &ri);
  if (!r) return mpib_error_check(&c->b.err);
  r->size = 0;
  r->pending = 1; /* nothing was posted: it never completes, its test reports the error */
  r->trunc = 0;
  *request = r;
  return ncclSuccess;
}

static void send_warn_wait(struct mpib_send_comm *c, int tag) {
  int open[MPIB_MAX_RECVS], nopen = 0;
  for (int i = 0; i < (int)c->cur.n; i++)
    if (!c->cur_taken[i]) open[nopen++] = c->cur.e[i].tag;
  char who[128];
  snprintf(who, sizeof(who), "NET/IB: peer %s", c->b.peer);
  mplane_tag_wait_warn(who, tag, (unsigned long long)c->seq, open, nopen);
}

ncclResult_t mpib_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                        void **request) {
  struct mpib_send_comm *c = send_comm;
  struct mpib_mr *m = mhandle;
  *request = NULL;
  if (size > MPIB_MAX_MSG) {
    /* NCCL keeps to maxP2pBytes; a bigger message would be a work request the HCA refuses */
    MP_WARN("NET/IB: isend of %zu bytes to peer %s; at most %lu (the device's maxP2pBytes)", size, c->b.peer,
            MPIB_MAX_MSG);
    return ncclInvalidArgument;
  }
  if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) return send_failed(c, request);
  if (!c->cur_valid) {
    int got = mpib_fifo_take(&c->fifo[c->seq % MPIB_MAX_REQS], c->seq, &c->cur);
    if (got < 0) {
      mpib_error_set(&c->b.err, ncclInternalError, "peer %s posted receive %llu with an inconsistent FIFO slot "
                     "(buffer counts disagree or out of 1..%d)", c->b.peer, (unsigned long long)c->seq, MPIB_MAX_RECVS);
      return mpib_error_check(&c->b.err);
    }
    if (got == 0) {
      poll_cq(&c->b);
      check_peer(&c->b);
      if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) return send_failed(c, request);
      return ncclSuccess; /* no receive posted yet (or not all of it landed): NCCL calls again */
    }
    c->cur_valid = 1;
    c->cur_used = 0;
    memset(c->cur_taken, 0, sizeof(c->cur_taken));
  }
  int k = -1;
  for (int i = 0; i < (int)c->cur.n; i++)
    if (!c->cur_taken[i] && c->cur.e[i].tag == tag) {
      k = i;
      break;
    }
  if (k < 0) {
    /* A later group's send (shared comms, net/tag_wait.h): NULL, NCCL calls again. Meanwhile
     * completions and the peer's liveness still surface, as while no receive is posted. */
    if (mplane_tag_wait_unmatched(&c->tag_wait, tag)) send_warn_wait(c, tag);
    poll_cq(&c->b);
    check_peer(&c->b);
    if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) return send_failed(c, request);
    return ncclSuccess;
  }
  if (size > 0 && !m) {
    MP_WARN("NET/IB: isend of %zu bytes to peer %s without a registered memory handle", size, c->b.peer);
    return ncclInvalidArgument;
  }
  int ri;
  struct mpib_send_req *r = send_req_alloc(c, &ri);
  if (!r) return ncclSuccess;
  mplane_tag_wait_matched(&c->tag_wait, tag);
  r->size = size;
  r->pending = 0;
  r->trunc = 0;
  r->staged = 0;
  const struct mpib_fifo_entry *en = &c->cur.e[k];
  unsigned slot = (unsigned)(c->seq % MPIB_MAX_REQS);
  unsigned first = c->next_qp % (unsigned)c->b.nqps;
  c->cur_taken[k] = 1;
  uint64_t seq = c->seq;
  if (++c->cur_used == (int)c->cur.n) {
    c->cur_valid = 0;
    c->seq++;
  }
  if (size > en->size) {
    /* Tell the receiver (its test fails too) and write nothing past its buffer. */
    struct ibv_send_wr wr;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = MPIB_WRID(MPIB_WR_DATA, ri, 0);
    wr.opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.imm_data = htonl(mpib_imm(slot, (unsigned)k, 1, 0, MPIB_IMM_TRUNC, seq));
    wr.wr.rdma.remote_addr = en->addr;
    wr.wr.rdma.rkey = en->rkey;
    r->trunc = 1;
    r->pending = 1;
    MP_CHECK(mpib_post(&c->b, (int)first, &wr));
    MP_WARN("NET/IB: send of %zu bytes (tag %d) to peer %s, but its receive buffer holds %llu bytes", size, tag,
            c->b.peer, (unsigned long long)en->size);
    return ncclInvalidUsage;
  }
  int nqps = c->b.nqps;
  size_t per;
  int nch = mpib_chunks(size, nqps, c->split, &per);
  if (mpib_stage_wanted(c, m, size)) {
    /* relayed: the bytes leave from the staging ring beside this NIC (ib_stage.c), same chunks */
    r->src = data;
    r->raddr = en->addr;
    r->rkey = en->rkey;
    r->rec_addr = c->cur.rec_addr;
    r->rec_rkey = c->cur.rec_rkey;
    r->slot = slot;
    r->entry = (unsigned)k;
    r->first = first;
    r->seq = seq;
    r->nch = nch;
    r->per = per;
    r->phandle = phandle;
    c->next_qp = first + (unsigned)nch;
    ncclResult_t res = mpib_stage_send(c, r, ri);
    if (res != ncclSuccess) {
      r->used = 0; /* the connection has failed (c->b.err); later calls report it */
      return res;
    }
    *request = r;
    return ncclSuccess;
  }
  /* As NCCL's net_ib: only a message above the threshold pays the second work request. */
  int ar_form = c->b.ar && size > c->ar_threshold;
  for (int i = 0; i < nch; i++) {
    int q = (int)((first + (unsigned)i) % (unsigned)nqps);
    size_t off = (size_t)i * per;
    size_t len = size == 0 ? 0 : (size - off < per ? size - off : per);
    struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)data + off, .length = (uint32_t)len,
                          .lkey = m ? m->mr->lkey : 0};
    struct ibv_send_wr wr[2];
    memset(wr, 0, sizeof(wr));
    if (!ar_form) {
      wr[0].wr_id = MPIB_WRID(MPIB_WR_DATA, ri, i);
      wr[0].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr[0].send_flags = IBV_SEND_SIGNALED;
      wr[0].sg_list = len ? &sge : NULL;
      wr[0].num_sge = len ? 1 : 0;
      wr[0].imm_data = htonl(mpib_imm(slot, (unsigned)k, (unsigned)nch, (unsigned)i, 0, seq));
      wr[0].wr.rdma.remote_addr = en->addr + off;
      wr[0].wr.rdma.rkey = en->rkey;
    } else {
      /* Adaptive routing: the data may arrive out of order, so it goes as a plain write and a
       * separate write with immediate (ordered after it on the QP) carries the chunk's length. */
      uint64_t lenval = len;
      struct ibv_sge lsge = {.addr = (uint64_t)(uintptr_t)&lenval, .length = sizeof(lenval), .lkey = 0};
      int w = 0;
      if (len) {
        wr[w].wr_id = MPIB_WRID(MPIB_WR_DATA, ri, i);
        wr[w].opcode = IBV_WR_RDMA_WRITE;
        wr[w].sg_list = &sge;
        wr[w].num_sge = 1;
        wr[w].wr.rdma.remote_addr = en->addr + off;
        wr[w].wr.rdma.rkey = en->rkey;
        wr[w].next = &wr[w + 1];
        w++;
      }
      wr[w].wr_id = MPIB_WRID(MPIB_WR_DATA, ri, i);
      wr[w].opcode = IBV_WR_RDMA_WRITE_WITH_IMM;
      wr[w].send_flags = IBV_SEND_SIGNALED | IBV_SEND_INLINE;
      wr[w].sg_list = &lsge;
      wr[w].num_sge = 1;
      wr[w].imm_data = htonl(mpib_imm(slot, (unsigned)k, (unsigned)nch, (unsigned)i, MPIB_IMM_AR, seq));
      /* the length record of (slot, entry, chunk) in the receiver's memory */
      wr[w].wr.rdma.remote_addr =
          c->cur.rec_addr + ((uint64_t)(slot * MPIB_MAX_RECVS + (unsigned)k) * MPIB_MAX_QPS + (unsigned)i) * 8;
      wr[w].wr.rdma.rkey = c->cur.rec_rkey;
    }
    r->pending++;
    MP_CHECK(mpib_post(&c->b, q, &wr[0]));
    /* after the post: its completion is polled on this thread, never before we return */
    mplane_prof_ib_start(&r->prof[i], phandle, c->b.devindex, wr[0].wr_id, wr[0].opcode, c->b.qps[q]->qp_num, len);
  }
  c->next_qp = first + (unsigned)nch;
  *request = r;
  return ncclSuccess;
}

/* A request whose work completed successfully reports success even when the connection failed
 * afterwards (the peer closed as soon as it had the data, a later request failed): only the
 * requests still waiting report the error. The side channel is checked before the last CQ poll, so
 * whatever completed before the peer went away is counted before its EOF fails anything. */
static void poll_and_check_peer(struct mpib_comm_base *b) {
  check_peer(b);
  if (__atomic_load_n(&b->err.state, __ATOMIC_ACQUIRE) > 0) poll_cq(b);
}

static ncclResult_t send_test(struct mpib_send_req *r, int *done, int *sizes) {
  struct mpib_send_comm *c = r->comm;
  poll_cq(&c->b);
  mpib_stage_progress(c); /* freed slots take the next copies; landed copies go out */
  if (r->pending != 0) poll_and_check_peer(&c->b);
  if (r->pending == 0) {
    *done = 1;
    if (sizes) sizes[0] = (int)r->size;
    r->used = 0;
    return ncclSuccess;
  }
  /* Before an error reaches NCCL (which may then free the failed sends' buffers), a staged
   * connection waits for the copies that still read them. */
  if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) mpib_stage_progress(c);
  ncclResult_t res = mpib_error_check(&c->b.err);
  if (res != ncclSuccess) { /* its work requests never complete */
    mplane_prof_stop_all(r->prof, MPIB_MAX_QPS);
    mplane_prof_stop_all(r->prof_stage, MPIB_MAX_QPS);
  }
  return res;
}

/* ------------------------------------------------------------------ receive */
ncclResult_t mpib_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                        void **phandles, void **request) {
  struct mpib_recv_comm *c = recv_comm;
  *request = NULL;
  if (n < 1 || n > MPIB_MAX_RECVS) {
    MP_WARN("NET/IB: irecv of %d buffers; at most %d", n, MPIB_MAX_RECVS);
    return ncclInvalidArgument;
  }
  unsigned k = (unsigned)(c->seq % MPIB_MAX_REQS);
  struct mpib_recv_req *r = &c->reqs[k];
  if (r->used) {
    poll_cq(&c->b);
    return mpib_error_check(&c->b.err); /* the oldest receive is still in flight: NCCL calls again */
  }
  if (__atomic_load_n(&c->b.err.state, __ATOMIC_ACQUIRE) > 0) {
    /* failed connection: a request whose test() reports the error (see send_failed) */
    r->used = 1;
    r->seq = c->seq++;
    r->n = n;
    r->done_entries = 0;
    memset(r->e, 0, sizeof(r->e));
    *request = r; /* done_entries never reaches n: its test reports the error */
    return ncclSuccess;
  }
  unsigned q = k % (unsigned)c->b.nqps;
  if (c->fifo_posted[q] - c->fifo_retired[q] >= MPIB_RECV_SQ) {
    poll_cq(&c->b); /* every MPIB_FIFO_SIGNAL_EVERY-th write is signaled: a completion is on its way */
    if (c->fifo_posted[q] - c->fifo_retired[q] >= MPIB_RECV_SQ) return mpib_error_check(&c->b.err);
  }
  struct mpib_fifo_wire *s = &c->slots[k];
  memset(r->e, 0, sizeof(r->e));
  memset(s, 0, sizeof(*s));
  for (int i = 0; i < n; i++) {
    struct mpib_mr *m = mhandles ? mhandles[i] : NULL;
    if (!m && sizes[i] > 0) {
      MP_WARN("NET/IB: irecv buffer %d (%zu bytes) has no registered memory handle", i, sizes[i]);
      return ncclInvalidArgument;
    }
    struct mpib_fifo_elem *el = &s->e[i];
    el->addr = (uint64_t)(uintptr_t)data[i];
    el->size = sizes[i];
    el->rkey = m ? m->mr->rkey : 0;
    el->tag = tags[i];
    el->nreqs = (uint32_t)n;
    el->rec_addr = (uint64_t)(uintptr_t)c->lens;
    el->rec_rkey = c->lens_mr->rkey;
    el->seq = c->seq + 1;
    r->e[i].cap = sizes[i];
    r->e[i].tag = tags[i];
  }
  r->used = 1;
  r->seq = c->seq;
  r->n = n;
  r->done_entries = 0;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)s, .length = (uint32_t)(n * sizeof(s->e[0])),
                        .lkey = c->slots_mr->lkey};
  struct ibv_send_wr wr;
  memset(&wr, 0, sizeof(wr));
  uint32_t count = c->fifo_posted[q] + 1;
  int signal = count - c->fifo_signaled[q] >= MPIB_FIFO_SIGNAL_EVERY;
  wr.wr_id = MPIB_WRID(MPIB_WR_FIFO, k, count & 0xffff);
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = signal ? IBV_SEND_SIGNALED : 0;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = c->remote_fifo + k * sizeof(struct mpib_fifo_wire);
  wr.wr.rdma.rkey = c->remote_fifo_rkey;
  c->seq++;
  ncclResult_t res = mpib_post(&c->b, (int)q, &wr);
  if (res != ncclSuccess) {
    r->used = 0;
    return res;
  }
  c->fifo_posted[q] = count;
  if (signal) c->fifo_signaled[q] = count;
  for (int i = 0; phandles && i < n; i++)
    mplane_prof_ib_start(&r->e[i].prof, phandles[i], c->b.devindex, wr.wr_id, wr.opcode, c->b.qps[q]->qp_num, sizes[i]);
  *request = r;
  return ncclSuccess;
}

/* All data and immediates are in. The FIFO write's completion is not awaited (it has none, mostly):
 * the sender wrote into every buffer of the slot, which it does only after it saw the whole FIFO
 * write, so the HCA has read the staging slot and a later irecv may rewrite it. */
static int recv_complete(struct mpib_recv_req *r) { return r->done_entries == r->n; }

static ncclResult_t recv_test(struct mpib_recv_req *r, int *done, int *sizes) {
  struct mpib_recv_comm *c = r->comm;
  poll_cq(&c->b);
  if (!recv_complete(r)) poll_and_check_peer(&c->b);
  for (int i = 0; i < r->n; i++)
    if (r->e[i].trunc == 1) {
      r->e[i].trunc = 2; /* report once */
      MP_WARN("NET/IB: peer %s sent more than the %llu-byte receive buffer (tag %d) holds; nothing was written",
              c->b.peer, (unsigned long long)r->e[i].cap, r->e[i].tag);
      return ncclInvalidUsage;
    } else if (r->e[i].trunc) {
      return ncclInvalidUsage;
    }
  if (recv_complete(r)) {
    for (int i = 0; i < r->n; i++)
      if (sizes) sizes[i] = (int)r->e[i].bytes;
    r->used = 0;
    *done = 1;
    return ncclSuccess;
  }
  ncclResult_t res = mpib_error_check(&c->b.err);
  for (int i = 0; res != ncclSuccess && i < r->n; i++) mplane_prof_stop(&r->e[i].prof); /* never completes */
  return res;
}

/* ------------------------------------------------------------------ flush */
static ncclResult_t flush_setup(struct mpib_recv_comm *c) {
  c->flush_buf = mpib_alloc_pages(64);
  if (!c->flush_buf) return ncclSystemError;
  c->flush_mr = mpib_reg_local(&c->b, c->flush_buf, 64, IBV_ACCESS_LOCAL_WRITE, "flush buffer");
  if (!c->flush_mr) return ncclSystemError;
  MP_CHECK(mpib_create_qp(&c->b, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE, MPIB_FLUSH_SQ, 0, 0, &c->flush_qp));
  /* a loopback connection: the QP's peer is itself */
  return mpib_qp_connect(&c->b, c->flush_qp, c->flush_qp->qp_num, c->b.dev->lid, c->b.gid.raw, c->b.dev->mtu);
}

ncclResult_t mpib_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request) {
  struct mpib_recv_comm *c = recv_comm;
  *request = NULL;
  int last = -1;
  for (int i = 0; i < n; i++) {
    struct mpib_mr *m = mhandles ? mhandles[i] : NULL;
    if (sizes[i] > 0 && m && m->type == NCCL_PTR_CUDA) last = i;
  }
  if (last < 0) return ncclSuccess; /* host memory is coherent: nothing to flush */
  /* The site says its platform orders the NIC's writes before the GPU's reads (NCCL's
   * NCCL_GDR_FLUSH_DISABLE): NULL, done, and no flush QP is ever made. */
  if (mpib_config()->ib_gdr_flush_disable) return ncclSuccess;
  MP_CHECK(mpib_error_check(&c->b.err));
  if (!c->flush_qp) {
    ncclResult_t res = flush_setup(c);
    if (res != ncclSuccess) {
      MP_WARN("NET/IB: %s: cannot set up the flush QP", c->b.dev->props.name);
      return res;
    }
  }
  int fi = -1;
  for (int i = 0; i < MPIB_MAX_FLUSHES && fi < 0; i++)
    if (!c->freqs[i].used) fi = i;
  if (fi < 0) {
    /* never NULL here: to NCCL a NULL flush request means "nothing to flush", and the GPU would
     * read before the data landed */
    MP_WARN("NET/IB: %s: %d flushes in flight and none tested: cannot flush another receive (peer %s)",
            c->b.dev->props.name, MPIB_MAX_FLUSHES, c->b.peer);
    return ncclInternalError;
  }
  struct mpib_flush_req *f = &c->freqs[fi];
  struct mpib_mr *m = mhandles[last];
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)c->flush_buf, .length = 1, .lkey = c->flush_mr->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = MPIB_WRID(MPIB_WR_FLUSH, fi, 0);
  wr.opcode = IBV_WR_RDMA_READ;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.rdma.remote_addr = (uint64_t)(uintptr_t)data[last];
  wr.wr.rdma.rkey = m->mr->rkey;
  int rc = ibv_post_send(c->flush_qp, &wr, &bad);
  if (rc) {
    MP_WARN("NET/IB: %s: posting the flush read failed: %s", c->b.dev->props.name, strerror(rc));
    return ncclSystemError;
  }
  f->used = 1;
  f->pending = 1;
  *request = f;
  return ncclSuccess;
}

static ncclResult_t flush_test(struct mpib_flush_req *f, int *done, int *sizes) {
  struct mpib_recv_comm *c = f->comm;
  (void)sizes;
  poll_cq(&c->b);
  MP_CHECK(mpib_error_check(&c->b.err));
  if (f->pending <= 0) {
    f->used = 0;
    *done = 1;
  }
  return ncclSuccess;
}

ncclResult_t mpib_test(void *request, int *done, int *sizes) {
  *done = 0;
  uint32_t kind = *(uint32_t *)request;
  if (kind == MPIB_REQ_SEND) return send_test(request, done, sizes);
  if (kind == MPIB_REQ_RECV) return recv_test(request, done, sizes);
  if (kind == MPIB_REQ_FLUSH) return flush_test(request, done, sizes);
  MP_WARN("NET/IB: test on something that is not an mplane request");
  return ncclInvalidArgument;
}
