/* mplane: the socket data path. The proxy thread posts work and polls; the process's pool of I/O
 * threads (socket_engine.c) moves the data streams' bytes without blocking, and the proxy thread
 * itself moves small messages on the control socket (see socket.h for the protocol). */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/uio.h>
#include <unistd.h>
#include <linux/sockios.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../profiler.h"
#include "socket.h"
#include "socket_splice.h"

#define LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
#define STORE(p, v) __atomic_store_n((p), (v), __ATOMIC_RELEASE)
#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_ACQ_REL)

uint64_t mps_spin_ns(const struct mplane_config *cfg) { return (uint64_t)cfg->socket_spin_us * 1000u; }

/* ------------------------------------------------------------------ send side */

/* A data stream of this comm, given to the engine. 0, or -1 after a WARN (the fd stays the
 * caller's). */
static int stream_attach(struct mps_stream **slot, int fd, int kind, int index, void *comm) {
  struct mps_stream *st = calloc(1, sizeof(*st));
  if (!st) {
    MP_WARN("socket: out of memory for a data stream (%zu bytes)", sizeof(*st));
    return -1;
  }
  st->fd = fd;
  st->kind = kind;
  st->index = index;
  st->comm = comm;
  int fl = fcntl(fd, F_GETFL);
  if (fl >= 0) fcntl(fd, F_SETFL, fl | O_NONBLOCK); /* the pool thread never blocks on one stream */
  if (mps_engine_attach(st) != 0) {
    free(st);
    return -1;
  }
  *slot = st;
  return 0;
}

/* Take a stream back from the engine and free it; its fd is closed by the caller. */
static void stream_release(struct mps_stream *st) {
  if (!st) return;
  mps_engine_detach(st);
  free(st->tasks);
  free(st->acks);
  free(st);
}

ncclResult_t mps_send_comm_start(struct mps_send_comm *c, const struct mplane_config *cfg, const int *fds) {
  c->split_bytes = (size_t)cfg->socket_split_bytes;
  c->chunk_bytes = (size_t)cfg->socket_chunk_bytes;
  c->splice_bytes = (size_t)cfg->socket_splice_bytes;
  c->inline_bytes = (size_t)cfg->socket_inline_bytes;
  c->pad_to = (uint32_t)cfg->socket_pad_bytes;
  c->inline_busy = cfg->socket_inline_busy;
  /* connect finished when our hellos were written, not when the acceptor answered: a listener that
   * is not mplane (accepts TCP, stays silent) is only noticed by the missing ACK */
  c->ack_deadline_ns = mplane_now_ns() + (uint64_t)cfg->connect_timeout_s * 1000000000ull;
  for (int i = 0; i < MPS_MAX_SLOTS; i++) {
    c->reqs[i].kind = MPS_REQ_SEND;
    c->reqs[i].comm = c;
  }
  for (int i = 0; i < c->nopen; i++) {
    if (stream_attach(&c->streams[i], fds[i], MPS_STREAM_SEND, i, c) != 0) {
      for (int j = i; j < c->nopen; j++) close(fds[j]);
      c->nopen = i;
      return ncclSystemError;
    }
  }
  return ncclSuccess;
}

/* Skip the offered groups whose every entry is taken: the oldest open group is the one sends fill. */
static void cts_advance(struct mps_send_comm *c) {
  while (c->cts_head != c->cts_tail) {
    struct mps_cts_group *g = &c->cts[c->cts_head % MPS_MAX_GROUPS];
    if (g->used < g->n) return;
    c->cts_head++;
  }
}

/* A CTS group has arrived: the eager messages sent before we read it take their entries in it, by
 * the rule the receiver follows too (socket.h): oldest message first, the first untaken entry of
 * its tag. A message bigger than its entry landed nowhere (the receiver saw the same); our next
 * call reports it. */
static ncclResult_t eager_assign(struct mps_send_comm *c, struct mps_cts_group *g) {
  unsigned keep = 0;
  for (unsigned j = 0; j < c->neager; j++) {
    int k = -1;
    for (int i = 0; i < g->n && k < 0; i++)
      if (!g->e[i].taken && g->e[i].tag == c->eager[j].tag) k = i;
    if (k < 0) {
      c->eager[keep++] = c->eager[j];
      continue;
    }
    g->e[k].taken = 1;
    g->used++;
    c->eager_unmatched -= c->eager[j].size;
    if (c->eager[j].size > g->e[k].size) {
      mps_error_set(&c->err, ncclInvalidUsage, "send of %llu bytes (tag %d) to peer %s, but its receive buffer "
                    "holds %llu bytes (sent before the receive was posted; nothing was written)",
                    (unsigned long long)c->eager[j].size, c->eager[j].tag, c->peer,
                    (unsigned long long)g->e[k].size);
      return mps_error_check(&c->err);
    }
  }
  c->neager = keep;
  return ncclSuccess;
}

/* One control record from the receiver (ACK, NACK, CTS). */
static ncclResult_t send_ctrl_record(struct mps_send_comm *c, const struct mps_ctrl *m) {
  if (m->magic != MPLANE_HANDLE_MAGIC) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s is not mplane (control magic 0x%08x)", c->peer, m->magic);
    return mps_error_check(&c->err);
  }
  if (m->version != MPLANE_PROTOCOL_VERSION) {
    mps_error_set(&c->err, ncclInvalidUsage, "peer %s refused the connection: it speaks mplane protocol "
                  "version %u, this library speaks %u: use the same mplane build on every node", c->peer,
                  m->version, MPLANE_PROTOCOL_VERSION);
    return mps_error_check(&c->err);
  }
  if (m->type == MPS_NACK) {
    mps_error_set(&c->err, ncclInvalidUsage, "peer %s refused the connection: it found our handshake malformed "
                  "(its log says why)", c->peer);
    return mps_error_check(&c->err);
  }
  if (m->type == MPS_ACK) {
    c->acked = 1;
    c->stream_port = m->ack.stream_port;
    /* The receiver says how many eager messages it holds; we also keep them within our inline limit
     * (they ride the control socket). */
    c->eager_max = m->n < MPS_EAGER_MAX ? m->n : MPS_EAGER_MAX;
    c->eager_bytes = m->eager_bytes < c->inline_bytes ? m->eager_bytes : c->inline_bytes;
    c->eager_hold = m->hold;
    return ncclSuccess;
  }
  if (m->type != MPS_CTS || m->n < 1 || m->n > MPS_MAX_RECVS || c->cts_tail - c->cts_head >= MPS_MAX_GROUPS ||
      m->seq != c->cts_tail) {
    mps_error_set(&c->err, ncclInternalError, "bad control record from peer %s (type %u, n %u, group %llu, "
                  "expected group %llu)", c->peer, m->type, m->n, (unsigned long long)m->seq,
                  (unsigned long long)c->cts_tail);
    return mps_error_check(&c->err);
  }
  c->acked = 1; /* the acceptor sends its ACK first; a CTS proves the handshake as well */
  c->nudged = 0;
  struct mps_cts_group *g = &c->cts[c->cts_tail % MPS_MAX_GROUPS];
  memset(g, 0, sizeof(*g));
  g->seq = m->seq;
  g->n = (int)m->n;
  for (uint32_t i = 0; i < m->n; i++) {
    g->e[i].slot = m->e[i].slot;
    g->e[i].tag = m->e[i].tag;
    g->e[i].size = m->e[i].size;
  }
  c->cts_tail++;
  MP_CHECK(eager_assign(c, g));
  cts_advance(c);
  return ncclSuccess;
}

/* Read every complete control record that has arrived. Never blocks; a read that comes back short
 * has emptied the socket, so that is the last system call. */
static ncclResult_t send_poll_ctrl(struct mps_send_comm *c) {
  for (;;) {
    size_t space = sizeof(c->ctrl_buf) - c->ctrl_have;
    ssize_t r = recv(c->ctrl_fd, c->ctrl_buf + c->ctrl_have, space, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ncclSuccess;
    if (r <= 0) {
      mps_error_set(&c->err, ncclRemoteError, "peer %s closed the connection%s%s", c->peer, r < 0 ? ": " : "",
                    r < 0 ? strerror(errno) : " (process exited or closed its comm?)");
      return mps_error_check(&c->err);
    }
    c->ctrl_have += (size_t)r;
    size_t off = 0;
    while (c->ctrl_have - off >= sizeof(struct mps_ctrl)) {
      struct mps_ctrl m;
      memcpy(&m, c->ctrl_buf + off, sizeof(m));
      off += sizeof(m);
      MP_CHECK(send_ctrl_record(c, &m));
    }
    memmove(c->ctrl_buf, c->ctrl_buf + off, c->ctrl_have - off);
    c->ctrl_have -= off;
    if ((size_t)r < space) return ncclSuccess;
  }
}

static struct mps_send_req *send_req_alloc(struct mps_send_comm *c) {
  for (int i = 0; i < MPS_MAX_SLOTS; i++)
    if (!c->reqs[i].used) {
      c->reqs[i].used = 1;
      return &c->reqs[i];
    }
  return NULL;
}

/* ---- lazy data streams (socket.h, MPS_HELLO_LAZY) ---- */

/* Open one more data stream: a non-blocking connect, handed to the engine at once; its pool thread
 * finishes the connect and writes the hello before any chunk queued meanwhile (send_stream_io). */
static ncclResult_t stream_open(struct mps_send_comm *c) {
  if (!c->stream_port) {
    mps_error_set(&c->err, ncclSystemError, "peer %s offers no data streams (its stream listener could not be "
                  "opened: its log says why); messages above MPLANE_SOCKET_INLINE_BYTES cannot go", c->peer);
    return mps_error_check(&c->err);
  }
  int fd;
  if (mps_stream_connect(c, &fd) != 0) {
    mps_error_set(&c->err, ncclSystemError, "cannot open a data stream to peer %s (WARN above)", c->peer);
    return mps_error_check(&c->err);
  }
  c->nstarted++;
  struct mps_stream *st = calloc(1, sizeof(*st));
  if (st) {
    st->fd = fd;
    st->kind = MPS_STREAM_SEND;
    st->index = c->nopen;
    st->comm = c;
    st->connecting = 1;
    st->armed = EPOLLOUT; /* the connect's end */
    st->hello = c->hello;
    st->hello.stream = (uint16_t)c->nstarted;
  }
  if (!st || mps_engine_attach(st) != 0) {
    free(st);
    close(fd);
    mps_error_set(&c->err, ncclSystemError, "no memory or I/O thread for a data stream to peer %s", c->peer);
    return mps_error_check(&c->err);
  }
  c->streams[c->nopen] = st;
  c->nopen++;
  return ncclSuccess;
}

/* A message for the data streams is about to go: the first stream opens for it, and one more (up
 * to the connection's nstreams) each time a message finds every open stream busy writing earlier
 * chunks. The message never waits: it is queued on the streams open now (a stream still connecting
 * writes it after its hello). So a connection that carries one message at a time holds one
 * stream, and one that keeps several in flight (NCCL's steps) opens as many as keep them moving. */
static ncclResult_t streams_grow(struct mps_send_comm *c) {
  int idle = 0;
  for (int i = 0; i < c->nopen && !idle; i++) idle = LOAD(&c->streams[i]->inflight) == 0;
  if (!idle && c->nopen < c->nstreams) MP_CHECK(stream_open(c));
  return ncclSuccess;
}

/* Queue a chunk on stream s; the stream's pool thread writes it. */
static ncclResult_t push_task(struct mps_send_comm *c, int s, const struct mps_task *t) {
  struct mps_task task = *t;
  task.stream = s;
  ADD(&c->streams[s]->inflight, 1);
  if (mps_engine_push(c->streams[s], &task) != 0) {
    mps_error_set(&c->err, ncclSystemError, "out of memory queueing a chunk for peer %s", c->peer);
    return mps_error_check(&c->err);
  }
  return ncclSuccess;
}

static void send_warn_wait(struct mps_send_comm *c, const struct mps_cts_group *g, int tag) {
  int open[MPS_MAX_RECVS], nopen = 0;
  for (int i = 0; i < g->n; i++)
    if (!g->e[i].taken) open[nopen++] = g->e[i].tag;
  char who[112];
  snprintf(who, sizeof(who), "socket: peer %s", c->peer);
  mplane_tag_wait_warn(who, tag, (unsigned long long)g->seq, open, nopen);
}

/* Send requests in flight in this process, all comms together. A proxy thread with several
 * messages moving (many channels, big collectives) hands a mid-sized one to the I/O threads: they
 * copies in parallel, while the proxy thread would copy one message after another. */
static int g_sends_inflight; /* atomic */

static const char mps_filler[MPS_PAD_MAX]; /* the zeros a small chunk is padded with (socket.h) */

/* Write what the control socket takes of the inline chunk in progress; never blocks. The request
 * completes once its last byte is in the kernel, as an I/O thread's would. */
static ncclResult_t send_flush_inline(struct mps_send_comm *c) {
  for (;;) {
    if (!c->inl.req && c->trunc_pending) { /* a "does not fit" notice of a comm with no stream open */
      c->trunc_pending = 0;
      c->inl.req = &c->trunc_req;
      c->inl.hdr = c->trunc_hdr;
      c->inl.data = NULL;
      c->inl.done = 0;
      c->inl.pad = 0; /* a notice carries no filler (rx_header) */
    }
    if (!c->inl.req) return ncclSuccess;
    size_t hlen = sizeof(c->inl.hdr), dlen = c->inl.hdr.len, total = hlen + dlen + c->inl.pad, done = c->inl.done;
    struct iovec iov[3];
    int n = 0;
    if (done < hlen) iov[n++] = (struct iovec){(char *)&c->inl.hdr + done, hlen - done};
    size_t doff = done < hlen ? 0 : done - hlen;
    if (doff < dlen) iov[n++] = (struct iovec){(char *)c->inl.data + doff, dlen - doff};
    size_t poff = done < hlen + dlen ? 0 : done - hlen - dlen;
    if (poff < c->inl.pad) iov[n++] = (struct iovec){(char *)mps_filler, c->inl.pad - poff};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t w = sendmsg(c->ctrl_fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return ncclSuccess;
      mps_error_set(&c->err, ncclRemoteError, "send to peer %s failed: %s (peer closed or died?)", c->peer,
                    strerror(errno));
      mplane_prof_stop(&c->inl.prof);
      return mps_error_check(&c->err);
    }
    c->inl.done += (size_t)w;
    if (c->inl.done == total) {
      mplane_prof_stop(&c->inl.prof);
      ADD(&c->inl.req->chunks_done, 1);
      c->inl.req = NULL;
    }
  }
}

/* Whether a message of `size` may go now, before its CTS (socket.h): the receiver holds eager
 * messages and has room for one more, it is small enough, the control socket is idle, and every
 * group we have read is taken (an open one would be the message's, and it may be waiting for
 * another tag's send: a shared comm's order, kept as it was). */
static int eager_ok(const struct mps_send_comm *c, size_t size) {
  return c->neager < c->eager_max && size <= c->eager_bytes && c->eager_unmatched + size <= c->eager_hold &&
         !c->inl.req && !c->trunc_pending && c->cts_head == c->cts_tail && (size <= MPS_INLINE_ALWAYS || c->inline_busy == 0 || LOAD(&g_sends_inflight) < c->inline_busy);
}

/* Start writing an inline chunk on the control socket: the proxy thread writes it now, no thread
 * hand-off. */
static ncclResult_t send_inline(struct mps_send_comm *c, struct mps_send_req *req, const struct mps_chunk *hdr,
                                const void *data, void **request) {
  req->nchunks = 1;
  req->counted = 1;
  ADD(&g_sends_inflight, 1);
  c->inl.req = req;
  c->inl.hdr = *hdr;
  c->inl.data = data;
  c->inl.done = 0;
  c->inl.pad = 0;
  size_t wire = sizeof(*hdr) + hdr->len;
  if (wire < c->pad_to) {
    c->inl.pad = c->pad_to - wire;
    c->inl.hdr.flags |= (uint32_t)c->inl.pad << MPS_CHUNK_PAD_SHIFT;
  }
  mplane_prof_sock_start(&c->inl.prof, req->phandle, c->ctrl_fd, NCCL_PROFILER_SOCKET_SEND, hdr->len);
  *request = req;
  return send_flush_inline(c);
}

static ncclResult_t send_eager(struct mps_send_comm *c, void *data, size_t size, int tag, void *phandle,
                              void **request) {
  struct mps_send_req *req = send_req_alloc(c);
  if (!req) return ncclSuccess; /* every request in flight: NCCL calls again */
  req->phandle = phandle;
  mplane_tag_wait_matched(&c->tag_wait, tag);
  req->size = size;
  __atomic_store_n(&req->chunks_done, 0, __ATOMIC_RELAXED);
  c->eager[c->neager].tag = tag;
  c->eager[c->neager].size = size;
  c->neager++;
  c->eager_unmatched += size;
  struct mps_chunk h = {.tag = tag, .flags = MPS_CHUNK_EAGER, .base = c->cts_tail, .len = size, .total = size};
  return send_inline(c, req, &h, data, request);
}

/* The chunk size of a message on the data streams: the whole message below
 * MPLANE_SOCKET_SPLIT_BYTES; above, as many chunks as there are streams, but none below
 * MPLANE_SOCKET_CHUNK_BYTES, in 4 KiB multiples so receivers copy aligned pages. Each chunk costs
 * a hand-off to an I/O thread and a wake-up at both ends; NCCL keeps several steps in flight per
 * channel, so the streams a message leaves idle carry the next one
 * (docs/results/2026-12-01-eight-streams.md). */
static size_t chunk_size(const struct mps_send_comm *c, size_t size, int nstreams) {
  if (size < c->split_bytes) return size;
  size_t n = size / c->chunk_bytes;
  if (n < 1) n = 1;
  if (n > (size_t)nstreams) n = (size_t)nstreams;
  size_t per = (size + n - 1) / n;
  return (per + 4095) & ~(size_t)4095;
}

/* The chunks a message of `size` is cut into over nstreams streams (an empty message is one). */
static int chunk_count(const struct mps_send_comm *c, size_t size, int nstreams) {
  size_t per = chunk_size(c, size, nstreams);
  return size > per ? (int)((size + per - 1) / per) : 1;
}

/* Whether a message that has its CTS goes on the control socket now (socket.h): small enough, the
 * control socket idle, and (above MPS_INLINE_ALWAYS) few sends in flight in the process; with no
 * data stream open yet, the last rule waives (a stream would cost more than the wait). */
static int inline_now(const struct mps_send_comm *c, size_t size) {
  return size <= c->inline_bytes && !c->inl.req && !c->trunc_pending &&
         (size <= MPS_INLINE_ALWAYS || c->inline_busy == 0 || c->nopen == 0 ||
          LOAD(&g_sends_inflight) < c->inline_busy);
}

/* The untaken entry of `tag` in the oldest open group we have read, or -1. */
static int head_entry(const struct mps_send_comm *c, int tag) {
  if (c->cts_head == c->cts_tail) return -1;
  const struct mps_cts_group *g = &c->cts[c->cts_head % MPS_MAX_GROUPS];
  for (int i = 0; i < g->n; i++)
    if (!g->e[i].taken && g->e[i].tag == tag) return i;
  return -1;
}

ncclResult_t mps_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                       void **request) {
  struct mps_send_comm *c = send_comm;
  (void)mhandle;
  *request = NULL;
  MP_CHECK(mps_error_check(&c->err));
  if (c->inl.req || c->trunc_pending) MP_CHECK(send_flush_inline(c));
  /* A send that an offer we hold already matches, or that may go eagerly, needs nothing new from
   * the receiver: no look at the control socket (a system call per message saved). The CTS
   * records are read when what we hold runs out. */
  int k = head_entry(c, tag);
  if (k < 0 && eager_ok(c, size)) return send_eager(c, data, size, tag, phandle, request);
  if (k < 0) {
    MP_CHECK(send_poll_ctrl(c));
    MP_CHECK(send_flush_inline(c));
    if (!c->acked && mplane_now_ns() > c->ack_deadline_ns) {
      mps_error_set(&c->err, ncclRemoteError, "peer %s accepted TCP but sent no mplane handshake within %d s "
                    "(MPLANE_CONNECT_TIMEOUT): not an mplane rank, or one that never calls accept", c->peer,
                    mps_config()->connect_timeout_s);
      return mps_error_check(&c->err);
    }
    k = head_entry(c, tag);
  }
  if (k < 0) {
    /* Nothing offered yet: a small message goes eagerly, anything else waits (NCCL retries). */
    if (eager_ok(c, size)) return send_eager(c, data, size, tag, phandle, request);
    /* A later group's send (shared comms, net/tag_wait.h): NULL, NCCL calls again. */
    if (c->cts_head != c->cts_tail && mplane_tag_wait_unmatched(&c->tag_wait, tag))
      send_warn_wait(c, &c->cts[c->cts_head % MPS_MAX_GROUPS], tag);
    if (c->acked && c->eager_max && !c->nudged && LOAD(&c->nudge_req.chunks_done) == c->nudges) {
      /* The receiver may be holding the CTS back (socket.h): ask for it, once until one comes, on a
       * data stream, where its I/O threads read it even while its proxy thread calls nothing (the
       * first stream opens for it if none has yet). */
      if (c->nopen == 0) MP_CHECK(stream_open(c));
      c->nudged = 1;
      c->nudges++;
      int s = (int)(c->rr++ % (unsigned)c->nopen);
      struct mps_task t = {.req = &c->nudge_req, .hdr = {.flags = MPS_CHUNK_WANT_CTS}};
      MP_CHECK(push_task(c, s, &t));
    }
    return ncclSuccess;
  }
  struct mps_cts_group *g = &c->cts[c->cts_head % MPS_MAX_GROUPS];
  int inl = inline_now(c, size);
  if (size <= g->e[k].size && !inl) {
    /* A message that fits goes on the data streams: as many as it will be cut into must be open
     * first (until then NULL, NCCL calls again). A small one waits for the control socket instead,
     * so that a connection that carries only small messages holds no stream. */
    if (size <= c->inline_bytes && c->nopen == 0) return ncclSuccess;
    MP_CHECK(streams_grow(c));
  }
  struct mps_send_req *req = send_req_alloc(c);
  if (!req) return ncclSuccess; /* cannot happen while offers <= slots; be polite anyway */
  req->phandle = phandle; /* before a helper thread sees the request's chunks */
  mplane_tag_wait_matched(&c->tag_wait, tag);
  g->e[k].taken = 1;
  req->counted = 0;
  g->used++;
  cts_advance(c);

  struct mps_task t = {.req = req};
  t.hdr.slot = g->e[k].slot;
  t.hdr.total = size;
  req->size = size;
  __atomic_store_n(&req->chunks_done, 0, __ATOMIC_RELAXED);
  if (size > g->e[k].size) {
    /* Tell the receiver (its test fails too) but move no payload: nothing lands past its buffer. */
    req->used = 0;
    t.req = &c->trunc_req;
    t.hdr.flags = MPS_CHUNK_TRUNCATED;
    if (c->nopen) {
      int s = (int)(c->rr++ % (unsigned)c->nopen);
      MP_CHECK(push_task(c, s, &t));
    } else { /* on the control socket, once it is idle (send_flush_inline) */
      c->trunc_hdr = t.hdr;
      c->trunc_pending = 1;
      MP_CHECK(send_flush_inline(c));
    }
    MP_WARN("socket: send of %zu bytes (tag %d) to peer %s, but its receive buffer holds %llu bytes", size, tag,
            c->peer, (unsigned long long)g->e[k].size);
    return ncclInvalidUsage;
  }
  if (inl) {
    t.hdr.len = size;
    return send_inline(c, req, &t.hdr, data, request);
  }
  req->counted = 1;
  ADD(&g_sends_inflight, 1);
  size_t per = chunk_size(c, size, c->nopen);
  int n = chunk_count(c, size, c->nopen);
  req->nchunks = n;
  unsigned first = c->rr;
  c->rr += (unsigned)n; /* the next message starts on the streams this one left idle */
  for (int i = 0; i < n; i++) {
    int s = (int)((first + (unsigned)i) % (unsigned)c->nopen);
    size_t off = (size_t)i * per;
    t.hdr.offset = off;
    t.hdr.len = size - off < per ? size - off : per;
    t.data = (const char *)data + off;
    MP_CHECK(push_task(c, s, &t));
  }
  *request = req;
  return ncclSuccess;
}

static ncclResult_t send_test(struct mps_send_req *req, int *done, int *sizes) {
  struct mps_send_comm *c = req->comm;
  *done = 0;
  if (c->inl.req) MP_CHECK(send_flush_inline(c)); /* whichever request NCCL tests, the control socket moves */
  if (LOAD(&req->chunks_done) == req->nchunks) {
    /* All bytes are in the kernel; a later failure shows on the next request. */
    MP_CHECK(mps_error_check(&c->err));
    *done = 1;
    if (sizes) sizes[0] = (int)req->size;
    if (req->counted) ADD(&g_sends_inflight, -1);
    req->counted = 0;
    req->used = 0;
    return ncclSuccess;
  }
  /* A dead receiver shows as a failed write in a send thread; polling the control socket here
   * would cost a system call on every one of NCCL's polls. */
  return mps_error_check(&c->err);
}

/* The control socket carries inline messages the receiver may not have read yet. A close with
 * unread bytes in our receive queue (CTS records of receives we never used) resets the connection
 * and drops what our kernel has not sent, so: read those records, send the FIN after our data,
 * and give data still unsent (the receiver's window is full) a bounded moment to leave. */
static void ctrl_close_orderly(struct mps_send_comm *c) {
  char scratch[sizeof(struct mps_ctrl) * 4];
  shutdown(c->ctrl_fd, SHUT_WR);
  uint64_t deadline = mplane_now_ns() + 1000000000ull;
  for (;;) {
    ssize_t r;
    while ((r = recv(c->ctrl_fd, scratch, sizeof(scratch), MSG_DONTWAIT)) > 0) {}
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) break; /* peer gone */
    int unsent = 0;
    if (ioctl(c->ctrl_fd, SIOCOUTQNSD, &unsent) != 0 || unsent == 0 || mplane_now_ns() > deadline) break;
    struct pollfd p = {.fd = c->ctrl_fd, .events = POLLIN};
    poll(&p, 1, 1);
  }
  close(c->ctrl_fd);
}

ncclResult_t mps_close_send(void *send_comm) {
  struct mps_send_comm *c = send_comm;
  if (!c) return ncclSuccess;
  for (int i = 0; i < MPS_MAX_SLOTS; i++)
    if (c->reqs[i].used && c->reqs[i].counted) ADD(&g_sends_inflight, -1);
  STORE(&c->stop, 1);
  /* What a completed request wrote is in the kernel already and still goes out before the FIN;
   * chunks still queued are dropped with the streams. */
  for (int i = 0; i < c->nopen; i++) {
    int fd = c->streams[i] ? c->streams[i]->fd : -1;
    stream_release(c->streams[i]);
    if (fd >= 0) close(fd);
  }
  ctrl_close_orderly(c);
  free(c);
  return ncclSuccess;
}

/* ------------------------------------------------------------------ receive side */

/* Claim the chunk's byte range in its slot before any byte is read. NULL if it is consistent with
 * the message's chunks so far, else what is wrong with it. */
static const char *slot_claim(struct mps_slot *s, const struct mps_chunk *h) {
  if (h->total > s->cap) return "the message is bigger than the buffer";
  if (h->offset > h->total || h->len > h->total - h->offset) return "the chunk lies past the message's end";
  if (h->len == 0 && h->total != 0) return "an empty chunk of a message that is not empty";
  while (__atomic_exchange_n(&s->lock, 1, __ATOMIC_ACQUIRE)) __builtin_ia32_pause();
  const char *bad = NULL;
  if (s->nranges < 0) bad = "data after a 'does not fit' notice for the same buffer";
  else if (s->nranges > 0 && LOAD(&s->total) != h->total) bad = "its total differs from the message's other chunks";
  else if (s->nranges == MPS_MAX_STREAMS) bad = "more chunks than there are streams";
  for (int i = 0; i < s->nranges && !bad; i++) {
    uint64_t a = s->ranges[i].off, b = a + s->ranges[i].len;
    if (h->offset < b && a < h->offset + h->len) bad = "it overlaps a chunk already received";
    if (h->len == 0 && s->ranges[i].len == 0) bad = "the message's one empty chunk came twice";
  }
  if (!bad) {
    if (s->nranges == 0) STORE(&s->total, h->total);
    s->ranges[s->nranges].off = h->offset;
    s->ranges[s->nranges].len = h->len;
    /* atomic: recv_test reads it without the lock (a claimed slot needs no look at the control
     * socket); a plain store beside that read is a data race (ThreadSanitizer) */
    __atomic_store_n(&s->nranges, s->nranges + 1, __ATOMIC_RELAXED);
  }
  __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE);
  return bad;
}

/* A "does not fit" notice claims the whole slot: refused once a chunk claimed part of it (a chunk
 * on another stream could otherwise complete the slot with the notice's total as its size), and no
 * chunk is taken after it (nranges -1). */
static const char *slot_claim_truncated(struct mps_slot *s, const struct mps_chunk *h) {
  if (h->total <= s->cap) return "a 'does not fit' notice for a message that fits";
  while (__atomic_exchange_n(&s->lock, 1, __ATOMIC_ACQUIRE)) __builtin_ia32_pause();
  const char *bad = s->nranges != 0 ? "a 'does not fit' notice after data for the same buffer" : NULL;
  if (!bad) {
    __atomic_store_n(&s->nranges, -1, __ATOMIC_RELAXED); /* read by recv_test without the lock */
    STORE(&s->total, h->total);
  }
  __atomic_store_n(&s->lock, 0, __ATOMIC_RELEASE);
  return bad;
}

/* A chunk header has arrived (on a data stream or the control socket): check it against its slot
 * and claim its byte range. 0 and *sp: its payload may land in *sp; 1: a "does not fit" notice,
 * recorded, no payload follows; -1: the peer's error (set on the comm). */
static int chunk_begin(struct mps_recv_comm *c, const struct mps_chunk *h, struct mps_slot **sp) {
  if (h->slot >= MPS_MAX_SLOTS) {
    mps_error_set(&c->err, ncclInternalError, "peer %s sent data for slot %u which does not exist", c->peer,
                  h->slot);
    return -1;
  }
  struct mps_slot *s = &c->slots[h->slot];
  if (LOAD(&s->state) != MPS_SLOT_POSTED) {
    mps_error_set(&c->err, ncclInternalError, "peer %s sent data for slot %u which is not posted", c->peer,
                  h->slot);
    return -1;
  }
  const char *bad = h->flags & MPS_CHUNK_TRUNCATED ? slot_claim_truncated(s, h) : slot_claim(s, h);
  if (!bad && (h->flags & MPS_CHUNK_TRUNCATED)) {
    STORE(&s->state, MPS_SLOT_TRUNCATED);
    return 1;
  }
  if (bad) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a bad chunk for slot %u: %llu bytes at offset %llu of a "
                  "%llu-byte message into a %llu-byte buffer (%s)", c->peer, h->slot, (unsigned long long)h->len,
                  (unsigned long long)h->offset, (unsigned long long)h->total, (unsigned long long)s->cap, bad);
    return -1;
  }
  *sp = s;
  return 0;
}

/* A claimed chunk's payload has landed. */
static void chunk_end(struct mps_slot *s, const struct mps_chunk *h) {
  int posted = MPS_SLOT_POSTED; /* only a posted slot completes: never over a notice or an error */
  if (ADD(&s->received, h->len) == h->total)
    __atomic_compare_exchange_n(&s->state, &posted, MPS_SLOT_DONE, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

static void recv_want_cts(struct mps_recv_comm *c);

ncclResult_t mps_recv_comm_start(struct mps_recv_comm *c, const int *fds) {
  const struct mplane_config *cfg = mps_config();
  c->eager_bytes = (uint64_t)cfg->socket_eager_bytes; /* what accept's ACK offered */
  pthread_mutex_init(&c->cts_lock, NULL); /* before the streams, whose pool threads take it */
  c->nfree = 0;
  for (int i = MPS_MAX_SLOTS - 1; i >= 0; i--) c->free_slots[c->nfree++] = (uint32_t)i;
  for (int i = 0; i < MPS_MAX_GROUPS; i++) {
    c->reqs[i].kind = MPS_REQ_RECV;
    c->reqs[i].comm = c;
  }
  int n = c->nopen;
  c->nopen = 0;
  for (int i = 0; i < n; i++) {
    if (stream_attach(&c->streams[i], fds[i], MPS_STREAM_RECV, i, c) != 0) {
      for (int j = i; j < n; j++) close(fds[j]);
      return ncclSystemError;
    }
    STORE(&c->nopen, i + 1);
  }
  return ncclSuccess;
}

/* ------------------------------------------------------------------ the streams' I/O (pool threads)
 *
 * Each side has one place where a chunk's transfer on a stream starts and one where it ends:
 * send_chunk_start / send_chunk_end, recv_chunk_start / recv_chunk_end. */

/* The stream is done for: no more events. Its fd stays open until its comm closes. */
static void stream_finish(struct mps_stream *st) {
  st->finished = 1;
  mps_engine_arm(st, 0);
}

/* Sender: take the next queued chunk as the current one. 0: none queued. */
static int send_chunk_start(struct mps_send_comm *c, struct mps_stream *st) {
  if (!mps_engine_take(st, &st->cur.t)) return 0;
  st->cur.active = 1;
  st->cur.done = 0;
  st->cur.hdr = st->cur.t.hdr;
  st->cur.spliced = c->splice_bytes && st->cur.hdr.len >= c->splice_bytes && st->cur.hdr.flags == 0 &&
                    !mps_splice_off() && mps_engine_pipe(st) != NULL;
  if (st->cur.spliced) st->cur.hdr.flags |= MPS_CHUNK_ACK;
  /* profiler: one transfer on this stream (a spliced chunk's ends when the kernel has its pages) */
  mplane_prof_sock_start(&st->cur.prof, st->cur.t.req->phandle, st->fd, NCCL_PROFILER_SOCKET_SEND,
                         st->cur.hdr.len);
  return 1;
}

/* Sender: the current chunk is all in the socket (or dropped: the comm failed). A spliced one
 * completes on its ack. */
static void send_chunk_end(struct mps_send_comm *c, struct mps_stream *st, int failed) {
  mplane_prof_stop(&st->cur.prof);
  st->cur.active = 0;
  ADD(&st->inflight, -1);
  if (!failed && st->cur.spliced) {
    if (mps_splice_wait_ack(st, st->cur.t.req, st->cur.hdr.slot) == 0) return;
    mps_error_set(&c->err, ncclSystemError, "out of memory tracking a spliced chunk to peer %s", c->peer);
  }
  ADD(&st->cur.t.req->chunks_done, 1);
}

int mps_send_copy_step(struct mps_stream *st) {
  size_t hlen = sizeof(st->cur.hdr), total = hlen + st->cur.hdr.len;
  while (st->cur.done < total) {
    struct iovec iov[2];
    int n = 0;
    if (st->cur.done < hlen) iov[n++] = (struct iovec){(char *)&st->cur.hdr + st->cur.done, hlen - st->cur.done};
    size_t off = st->cur.done < hlen ? 0 : st->cur.done - hlen;
    if (off < st->cur.hdr.len) iov[n++] = (struct iovec){(char *)st->cur.t.data + off, st->cur.hdr.len - off};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t w = sendmsg(st->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) return mps_would_block() ? 0 : -1;
    st->cur.done += (size_t)w;
  }
  return 1;
}

/* A lazy stream's connect has ended (or not yet): check it, write its hello. 1 done, 0 not yet,
 * -1 failed (the comm's error set). */
static int send_stream_hello(struct mps_send_comm *c, struct mps_stream *st) {
  int soerr = 0;
  socklen_t len = sizeof(soerr);
  if (getsockopt(st->fd, SOL_SOCKET, SO_ERROR, &soerr, &len) == 0 && soerr) {
    mps_error_set(&c->err, ncclRemoteError, "cannot open a data stream to peer %s (port %u): %s", c->peer,
                  c->stream_port, strerror(soerr));
    return -1;
  }
  while (st->hello_sent < sizeof(st->hello)) {
    ssize_t w = send(st->fd, (char *)&st->hello + st->hello_sent, sizeof(st->hello) - st->hello_sent,
                     MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && (mps_would_block() || errno == ENOTCONN)) return 0;
    if (w < 0) {
      mps_error_set(&c->err, ncclRemoteError, "data stream to peer %s failed in its handshake: %s", c->peer,
                    strerror(errno));
      return -1;
    }
    st->hello_sent += (size_t)w;
  }
  st->connecting = 0;
  return 1;
}

static void send_stream_io(struct mps_stream *st, uint32_t events) {
  struct mps_send_comm *c = st->comm;
  char why[160];
  if (st->connecting && !st->finished) {
    int r = send_stream_hello(c, st);
    if (r < 0) stream_finish(st);
    if (r == 0) return mps_engine_arm(st, EPOLLOUT);
  }
  if (!st->finished && (events & (EPOLLIN | EPOLLERR | EPOLLHUP))) {
    int r = mps_splice_reap(st, why, sizeof(why));
    if (r < 0) {
      mps_error_set(&c->err, ncclRemoteError, "send to peer %s failed: %s", c->peer, why);
      stream_finish(st);
    } else if (r > 0) {
      stream_finish(st); /* closed by the peer: a chunk written later fails the comm */
    }
  }
  for (;;) {
    if (!st->cur.active && !send_chunk_start(c, st)) break;
    if (st->finished || LOAD(&c->err.state) != 0) { /* the comm failed: drop the work, test() reports it */
      if (!LOAD(&c->err.state))
        mps_error_set(&c->err, ncclRemoteError, "send to peer %s failed: it closed a data stream (process exited "
                      "or closed its comm?)", c->peer);
      send_chunk_end(c, st, 1);
      continue;
    }
    int r = st->cur.spliced ? mps_splice_step(st) : mps_send_copy_step(st);
    if (r == 2) r = mps_send_copy_step(st);
    if (r == 0) break;
    if (r < 0) {
      mps_error_set(&c->err, ncclRemoteError, "send to peer %s failed: %s (peer closed or died?)", c->peer,
                    strerror(errno));
      stream_finish(st);
    }
    send_chunk_end(c, st, r < 0);
  }
  if (!st->finished) mps_engine_arm(st, EPOLLIN | (st->cur.active ? EPOLLOUT : 0));
}

/* Receiver: a chunk header has arrived whole. 0: its payload follows (or there is none); -1 the
 * stream is done (the peer's error, set). */
static int recv_chunk_start(struct mps_recv_comm *c, struct mps_stream *st) {
  const struct mps_chunk *h = &st->h;
  if (h->flags == MPS_CHUNK_WANT_CTS && h->len == 0) {
    recv_want_cts(c);
    return 0;
  }
  if ((h->flags & ~(uint32_t)(MPS_CHUNK_TRUNCATED | MPS_CHUNK_ACK)) ||
      (h->flags == (MPS_CHUNK_TRUNCATED | MPS_CHUNK_ACK))) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a bad record on a data stream (flags 0x%x: an eager "
                  "message, filler, a WANT_CTS with a payload, or an acked notice)", c->peer, h->flags);
    return -1;
  }
  struct mps_slot *s = NULL;
  int b = chunk_begin(c, h, &s);
  if (b != 0) return b > 0 ? 0 : -1;
  st->slot = s;
  st->dst = s->buf + h->offset;
  st->rem = h->len;
  st->in_payload = 1;
  mplane_prof_sock_start(&st->prof, s->phandle, st->fd, NCCL_PROFILER_SOCKET_RECV, h->len); /* the payload */
  return 0;
}

/* Write the acks queued on st. 1 all out, 0 the socket is full, -1 the sender is gone. The chunk
 * behind each ack completes once it is written: after that our rank may close the comm, and a
 * sender still waiting for the ack of a delivered chunk would then fail. */
static int recv_flush_acks(struct mps_stream *st) {
  while (st->nackq) {
    struct mps_ack_out *o = &st->ackq[0];
    ssize_t w = send(st->fd, (char *)&o->a + st->ackq_done, sizeof(o->a) - st->ackq_done, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0 && mps_would_block()) return 0;
    int gone = w < 0;
    if (!gone) st->ackq_done += (size_t)w;
    if (gone || st->ackq_done == sizeof(o->a)) {
      struct mps_chunk h = {.len = o->len, .total = o->total};
      chunk_end(o->slot, &h);
      memmove(&st->ackq[0], &st->ackq[1], sizeof(st->ackq[0]) * (st->nackq - 1));
      st->nackq--;
      st->ackq_done = 0;
    }
    if (gone) { /* every chunk it sent arrived whole: as a close after them (recv_test) */
      while (st->nackq) {
        struct mps_chunk h = {.len = st->ackq[0].len, .total = st->ackq[0].total};
        chunk_end(st->ackq[0].slot, &h);
        memmove(&st->ackq[0], &st->ackq[1], sizeof(st->ackq[0]) * (--st->nackq));
      }
      return -1;
    }
  }
  return 1;
}

/* Receiver: the current chunk's payload has landed. 0, or -1: the stream is done (sender gone). */
static int recv_chunk_end(struct mps_recv_comm *c, struct mps_stream *st) {
  (void)c;
  mplane_prof_stop(&st->prof);
  st->in_payload = 0;
  if (!(st->h.flags & MPS_CHUNK_ACK)) {
    chunk_end(st->slot, &st->h);
    return 0;
  }
  /* The sender's pages were the source of a spliced chunk: it may reuse them once we say so. */
  st->ackq[st->nackq++] = (struct mps_ack_out){.a = {.magic = MPS_ACK_MAGIC, .slot = st->h.slot},
                                               .slot = st->slot, .len = st->h.len, .total = st->h.total};
  return recv_flush_acks(st) < 0 ? -1 : 0;
}

/* Receiver: the stream ended. An orderly close between chunks is not an error: the sender may close
 * its comm as soon as its last bytes are in its kernel, while other streams still carry the end of a
 * message; recv_test fails a receive still waiting once everything has closed. */
static void recv_stream_closed(struct mps_recv_comm *c, struct mps_stream *st, int orderly) {
  if (!orderly && !LOAD(&c->stop))
    mps_error_set(&c->err, ncclRemoteError, "peer %s closed a data stream mid-message%s%s (process exited or "
                  "killed?)", c->peer, errno ? ": " : "", errno ? strerror(errno) : "");
  if (orderly) ADD(&c->streams_closed, 1);
  mplane_prof_stop(&st->prof); /* a payload cut short: its event ends with the stream */
  stream_finish(st);
}

static void recv_stream_io(struct mps_stream *st, uint32_t events) {
  struct mps_recv_comm *c = st->comm;
  (void)events;
  if (st->finished) return;
  for (;;) {
    if (st->nackq) { /* acks first, in order: read no more until they are out */
      int r = recv_flush_acks(st);
      if (r < 0) return recv_stream_closed(c, st, 1);
      if (r == 0) return mps_engine_arm(st, EPOLLOUT);
    }
    if (!st->in_payload) {
      ssize_t r = recv(st->fd, (char *)&st->h + st->hhave, sizeof(st->h) - st->hhave, MSG_DONTWAIT);
      if (r < 0 && mps_would_block()) break;
      if (r <= 0) {
        if (r == 0) errno = 0;
        return recv_stream_closed(c, st, r == 0 && st->hhave == 0);
      }
      st->hhave += (size_t)r;
      if (st->hhave < sizeof(st->h)) continue;
      st->hhave = 0;
      if (recv_chunk_start(c, st) < 0) return stream_finish(st);
      if (!st->in_payload) continue;
      if (st->rem == 0 && recv_chunk_end(c, st) < 0) return recv_stream_closed(c, st, 1);
      continue;
    }
    ssize_t r = recv(st->fd, st->dst, st->rem, MSG_DONTWAIT);
    if (r < 0 && mps_would_block()) break;
    if (r <= 0) {
      if (r == 0) errno = 0;
      return recv_stream_closed(c, st, 0);
    }
    st->dst += r;
    st->rem -= (uint64_t)r;
    if (st->rem == 0 && recv_chunk_end(c, st) < 0) return recv_stream_closed(c, st, 1);
  }
  mps_engine_arm(st, EPOLLIN);
}

void mps_stream_io(struct mps_stream *st, uint32_t events) {
  if (st->kind == MPS_STREAM_SEND) send_stream_io(st, events);
  else if (st->kind == MPS_STREAM_RECV) recv_stream_io(st, events);
  else mps_stream_accept_io(st, events);
}

/* Write queued CTS records, unless messages come eagerly and the batch is not full (socket.h).
 * cts_lock held: an I/O thread that read a WANT_CTS writes them too. */
static ncclResult_t recv_flush_ctrl(struct mps_recv_comm *c);
static ncclResult_t recv_cts_maybe_locked(struct mps_recv_comm *c) {
  if (c->out_len == 0 || (c->cts_defer && !c->cts_wanted && c->eager_since_flush < MPS_EAGER_MAX / 2 &&
                          c->eager_bytes_since_flush < MPS_EAGER_HOLD / 2))
    return ncclSuccess;
  c->eager_since_flush = 0;
  c->eager_bytes_since_flush = 0;
  c->cts_wanted = 0;
  return recv_flush_ctrl(c);
}

static ncclResult_t recv_cts_maybe(struct mps_recv_comm *c) {
  if (LOAD(&c->out_len) == 0) return ncclSuccess; /* nothing queued; only this thread adds records */
  pthread_mutex_lock(&c->cts_lock);
  ncclResult_t res = recv_cts_maybe_locked(c);
  pthread_mutex_unlock(&c->cts_lock);
  return res;
}

/* An I/O thread read the sender's WANT_CTS: what we hold goes now, and every CTS at once until
 * messages come eagerly again. A failed write sets the comm's error; the proxy thread reports it. */
static void recv_want_cts(struct mps_recv_comm *c) {
  pthread_mutex_lock(&c->cts_lock);
  c->cts_defer = 0;
  c->cts_wanted = 1;
  (void)recv_cts_maybe_locked(c);
  pthread_mutex_unlock(&c->cts_lock);
}

/* Write queued CTS records; never blocks (the rest waits for the next call). A sender may close its
 * comm as soon as its sends are done, eager ones before any CTS: a receive posted after that writes
 * its CTS record to a closed socket, which answers with a reset. That sender reads no more records
 * and needs none for what it sent, so they are dropped, not an error. A receive whose message never
 * comes fails once every stream has closed (recv_test), and a dead sender's streams fail the comm
 * on their own reset. */
static ncclResult_t recv_flush_ctrl(struct mps_recv_comm *c) {
  if (c->ctrl_gone) STORE(&c->out_len, 0);
  while (c->out_len > 0) {
    ssize_t w = send(c->ctrl_fd, c->out_buf, c->out_len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return ncclSuccess;
      if (errno == EPIPE || errno == ECONNRESET) {
        c->ctrl_gone = 1;
        STORE(&c->out_len, 0);
        return ncclSuccess;
      }
      mps_error_set(&c->err, ncclRemoteError, "peer %s closed the control connection: %s", c->peer,
                    strerror(errno));
      return mps_error_check(&c->err);
    }
    memmove(c->out_buf, c->out_buf + w, c->out_len - (size_t)w);
    STORE(&c->out_len, c->out_len - (size_t)w);
  }
  return ncclSuccess;
}

static ncclResult_t eager_match_held(struct mps_recv_comm *c);

ncclResult_t mps_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                       void **phandles, void **request) {
  struct mps_recv_comm *c = recv_comm;
  (void)mhandles;
  *request = NULL;
  if (n < 1 || n > MPS_MAX_RECVS) {
    MP_WARN("socket: irecv of %d buffers; at most %d", n, MPS_MAX_RECVS);
    return ncclInvalidArgument;
  }
  MP_CHECK(mps_error_check(&c->err));
  MP_CHECK(recv_cts_maybe(c));
  struct mps_recv_req *req = NULL;
  for (int i = 0; i < MPS_MAX_GROUPS && !req; i++)
    if (!c->reqs[i].used) req = &c->reqs[i];
  if (!req || c->nfree < n || LOAD(&c->out_len) + sizeof(struct mps_ctrl) > sizeof(c->out_buf)) return ncclSuccess;
  req->used = 1;
  req->n = n;
  req->seq = c->seq;
  req->eager = 0;
  struct mps_ctrl m = {.magic = MPLANE_HANDLE_MAGIC, .version = MPLANE_PROTOCOL_VERSION, .type = MPS_CTS,
                       .n = (uint32_t)n, .seq = c->seq++};
  for (int i = 0; i < n; i++) {
    uint32_t id = c->free_slots[--c->nfree];
    struct mps_slot *s = &c->slots[id];
    s->buf = data[i];
    s->cap = sizes[i];
    __atomic_store_n(&s->received, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->total, 0, __ATOMIC_RELAXED);
    __atomic_store_n(&s->nranges, 0, __ATOMIC_RELAXED); /* recv_test reads it without the lock */
    s->phandle = phandles ? phandles[i] : NULL;
    STORE(&s->state, MPS_SLOT_POSTED); /* before the CTS leaves: a chunk may follow at once */
    req->slots[i] = id;
    req->tags[i] = tags[i];
    m.e[i].slot = id;
    m.e[i].tag = tags[i];
    m.e[i].size = sizes[i];
  }
  pthread_mutex_lock(&c->cts_lock);
  memcpy(c->out_buf + c->out_len, &m, sizeof(m));
  STORE(&c->out_len, c->out_len + sizeof(m));
  ncclResult_t res = recv_cts_maybe_locked(c);
  pthread_mutex_unlock(&c->cts_lock);
  MP_CHECK(res);
  *request = req;
  if (c->nheld) MP_CHECK(eager_match_held(c)); /* messages that came before this receive */
  return ncclSuccess;
}

/* ---- eager messages at the receiver (socket.h) ---- */

/* The control stream broke (a record we refused): its error, never success (when the error slot is
 * still empty, a remote error); the bytes after a refused header are not records, so the caller must
 * stop reading either way. */
static ncclResult_t rx_failed(struct mps_recv_comm *c) {
  ncclResult_t res = mps_error_check(&c->err);
  return res != ncclSuccess ? res : ncclRemoteError;
}

/* The entry an eager message of `tag` goes to: the first entry of that tag, in the posted groups
 * numbered `base` or later (oldest first), that no earlier eager message took. -1: none is posted. */
static int eager_find(struct mps_recv_comm *c, int32_t tag, uint64_t base, struct mps_recv_req **rp) {
  struct mps_recv_req *best = NULL;
  int bi = -1;
  for (int g = 0; g < MPS_MAX_GROUPS; g++) {
    struct mps_recv_req *r = &c->reqs[g];
    if (!r->used || r->seq < base || (best && r->seq > best->seq)) continue;
    for (int i = 0; i < r->n; i++)
      if (r->tags[i] == tag && !(r->eager & (1u << i))) {
        best = r;
        bi = i;
        break;
      }
  }
  *rp = best;
  return bi;
}

/* An eager message of `size` bytes takes entry i of group r. As chunk_begin: 0, its payload lands
 * in *sp (h is the chunk to end it with); 1, it does not fit: the slot says so, no byte is written;
 * -1, the peer's error. */
static int eager_claim(struct mps_recv_comm *c, struct mps_recv_req *r, int i, uint64_t size, struct mps_chunk *h,
                       struct mps_slot **sp) {
  r->eager |= 1u << i;
  *h = (struct mps_chunk){.slot = r->slots[i], .len = size, .total = size};
  if (size > c->slots[h->slot].cap) h->flags = MPS_CHUNK_TRUNCATED;
  return chunk_begin(c, h, sp);
}

/* Give the held eager messages, oldest first, to the groups posted since they came: after irecv
 * posted one, and when a held message's payload is whole. A message whose group is not posted yet
 * stays; the one still arriving (always the newest) waits until it is whole. */
static ncclResult_t eager_match_held(struct mps_recv_comm *c) {
  int keep = 0, moved = -1;
  ncclResult_t res = ncclSuccess;
  for (int k = 0; k < c->nheld; k++) {
    struct mps_eager_held e = c->held[k];
    struct mps_recv_req *r = NULL;
    /* after an error the rest stay held (and are freed with the comm): each buffer has one owner */
    int i = e.whole && res == ncclSuccess ? eager_find(c, e.tag, e.base, &r) : -1;
    if (i < 0) {
      if (c->rx.held == &c->held[k]) moved = keep;
      c->held[keep++] = e;
      continue;
    }
    struct mps_chunk h;
    struct mps_slot *s = NULL;
    int b = eager_claim(c, r, i, e.size, &h, &s);
    if (b == 0) {
      memcpy(s->buf, e.data, e.size);
      chunk_end(s, &h);
    }
    free(e.data);
    c->held[k].data = NULL;
    c->held_bytes -= e.size;
    if (b < 0) res = rx_failed(c);
  }
  c->nheld = keep;
  if (c->rx.held) c->rx.held = moved >= 0 ? &c->held[moved] : NULL;
  return res;
}

/* An eager chunk header has arrived: check it, then find its entry, or hold it if that group is
 * not posted yet. Sets where its payload goes. 0 ok, -1 the peer's error. */
static int eager_begin(struct mps_recv_comm *c) {
  struct mps_ctrl_rx *x = &c->rx;
  const struct mps_chunk h = x->h;
  const char *bad = NULL;
  if (!c->eager_bytes) bad = "we offered none";
  else if (h.len != h.total || h.len > c->eager_bytes) bad = "it is bigger than we offered, or not whole";
  else if (h.base > c->seq) bad = "it names receive groups we never posted";
  struct mps_recv_req *r = NULL;
  int i = bad ? -1 : eager_find(c, h.tag, h.base, &r);
  if (!bad && i < 0 && c->nheld == MPS_EAGER_MAX) bad = "more unmatched eager messages than we hold";
  if (!bad && i < 0 && c->held_bytes + h.len > MPS_EAGER_HOLD) bad = "more unmatched eager bytes than we hold";
  if (bad) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a bad eager message (%llu bytes, tag %d, after group "
                  "%llu; we hold up to %d of at most %llu bytes, %u bytes together): %s", c->peer,
                  (unsigned long long)h.len, h.tag, (unsigned long long)h.base, MPS_EAGER_MAX,
                  (unsigned long long)c->eager_bytes, MPS_EAGER_HOLD, bad);
    return -1;
  }
  x->slot = NULL;
  x->held = NULL;
  x->dst = NULL;
  x->rem = h.len;
  pthread_mutex_lock(&c->cts_lock);
  c->cts_defer = 1; /* the sender is ahead of our CTS records: they may wait for a batch */
  c->eager_since_flush++;
  c->eager_bytes_since_flush += h.len;
  pthread_mutex_unlock(&c->cts_lock);
  if (i >= 0) {
    struct mps_slot *s = NULL;
    int b = eager_claim(c, r, i, h.len, &x->h, &s);
    if (b < 0) return -1;
    if (b == 0) {
      x->slot = s;
      x->dst = s->buf;
    } /* else too big: the payload is read and dropped */
  } else {
    struct mps_eager_held *e = &c->held[c->nheld];
    *e = (struct mps_eager_held){.tag = h.tag, .base = h.base, .size = h.len, .data = malloc(h.len + 1)};
    if (!e->data) {
      mps_error_set(&c->err, ncclSystemError, "out of memory holding an eager message of %llu bytes from peer %s",
                    (unsigned long long)h.len, c->peer);
      return -1;
    }
    c->nheld++;
    c->held_bytes += h.len;
    x->held = e;
    x->dst = e->data;
  }
  return 0;
}

/* The payload of the chunk being read on the control socket is whole. */
static ncclResult_t rx_payload_end(struct mps_recv_comm *c) {
  struct mps_ctrl_rx *x = &c->rx;
  x->in_payload = 0;
  mplane_prof_stop(&x->prof);
  if (x->slot) chunk_end(x->slot, &x->h);
  x->slot = NULL;
  if (x->pad) { /* the filler is read and dropped like a payload nobody takes */
    x->in_payload = 1;
    x->dst = NULL;
    x->rem = x->pad;
    x->pad = 0;
  }
  if (x->held) {
    x->held->whole = 1;
    x->held = NULL;
    return eager_match_held(c);
  }
  return ncclSuccess;
}

/* A chunk header from the control socket is whole: where does its payload go? */
static ncclResult_t rx_header(struct mps_recv_comm *c) {
  struct mps_ctrl_rx *x = &c->rx;
  x->pad = x->h.flags >> MPS_CHUNK_PAD_SHIFT;
  x->h.flags &= MPS_CHUNK_FLAG_BITS;
  if (x->pad > MPS_PAD_MAX || (x->pad && (x->h.flags & MPS_CHUNK_TRUNCATED))) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a chunk with %u filler bytes (at most %d, and none after "
                  "a 'does not fit' notice)", c->peer, x->pad, MPS_PAD_MAX);
    return rx_failed(c);
  }
  if (x->h.flags & ~(uint32_t)(MPS_CHUNK_TRUNCATED | MPS_CHUNK_EAGER | MPS_CHUNK_WANT_CTS)) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a chunk with unknown flags 0x%x on the control socket "
                  "(spliced chunks ride the data streams)", c->peer, x->h.flags);
    return rx_failed(c);
  }
  uint32_t own = x->h.flags & (MPS_CHUNK_EAGER | MPS_CHUNK_WANT_CTS);
  if (own && x->h.flags != own) {
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a chunk with flags 0x%x (eager and WANT_CTS records "
                  "carry no other flag)", c->peer, x->h.flags);
    return rx_failed(c);
  }
  if (x->h.flags & MPS_CHUNK_WANT_CTS) { /* they ride the data streams (recv_chunk) */
    mps_error_set(&c->err, ncclRemoteError, "peer %s sent a WANT_CTS record on the control socket", c->peer);
    return rx_failed(c);
  }
  if (x->h.flags & MPS_CHUNK_EAGER) {
    if (eager_begin(c) < 0) return rx_failed(c);
  } else {
    struct mps_slot *s = NULL;
    int b = chunk_begin(c, &x->h, &s);
    if (b < 0) return rx_failed(c);
    if (b > 0) return ncclSuccess; /* a "does not fit" notice: no payload */
    x->slot = s;
    x->held = NULL;
    x->dst = s->buf + x->h.offset;
    x->rem = x->h.len;
  }
  /* profiler: a payload that lands in a posted buffer (not an eager message held for a later irecv) */
  mplane_prof_sock_start(&x->prof, x->slot ? x->slot->phandle : NULL, c->ctrl_fd, NCCL_PROFILER_SOCKET_RECV, x->h.len);
  x->in_payload = 1;
  return x->rem == 0 ? rx_payload_end(c) : ncclSuccess;
}

/* Land what has arrived of the inline chunks on the control socket; never blocks. Small reads go
 * through the stage (a header and its payload, often several messages, in one system call); a
 * payload of at least a stage's size is read straight into its buffer. */
static ncclResult_t recv_poll_ctrl(struct mps_recv_comm *c) {
  struct mps_ctrl_rx *x = &c->rx;
  while (!x->closed) {
    if (x->pos == x->have) {
      x->pos = x->have = 0;
      char *dst = x->stage;
      size_t want = sizeof(x->stage);
      int direct = x->in_payload && x->dst && x->rem >= sizeof(x->stage);
      if (direct) {
        dst = x->dst;
        want = x->rem;
      }
      ssize_t r = recv(c->ctrl_fd, dst, want, MSG_DONTWAIT);
      if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return ncclSuccess;
      if (r <= 0) {
        /* At a chunk boundary this is the sender's close (a reset too: it may close with our CTS
         * records unread); recv_test fails a receive still waiting once everything has closed. */
        if (x->in_payload || x->hhave) {
          mps_error_set(&c->err, ncclRemoteError, "peer %s closed the control connection mid-message%s%s (process "
                        "exited or killed?)", c->peer, r < 0 ? ": " : "", r < 0 ? strerror(errno) : "");
          return rx_failed(c);
        }
        x->closed = 1;
        return ncclSuccess;
      }
      if (direct) {
        x->dst += r;
        x->rem -= (uint64_t)r;
        if (x->rem == 0) MP_CHECK(rx_payload_end(c));
        if ((size_t)r < want) return ncclSuccess; /* the socket is empty now */
        continue;
      }
      x->have = (size_t)r;
    }
    while (x->pos < x->have) {
      size_t avail = x->have - x->pos;
      if (x->in_payload) {
        size_t n = avail < x->rem ? avail : (size_t)x->rem;
        if (x->dst) {
          memcpy(x->dst, x->stage + x->pos, n);
          x->dst += n;
        }
        x->pos += n;
        x->rem -= n;
        if (x->rem == 0) MP_CHECK(rx_payload_end(c));
        continue;
      }
      /* once the comm failed (an I/O thread's chunk too), nothing more is parsed */
      if (LOAD(&c->err.state) != 0) return rx_failed(c);
      size_t n = sizeof(x->h) - x->hhave;
      if (n > avail) n = avail;
      memcpy((char *)&x->h + x->hhave, x->stage + x->pos, n);
      x->pos += n;
      x->hhave += n;
      if (x->hhave < sizeof(x->h)) break;
      x->hhave = 0;
      MP_CHECK(rx_header(c));
    }
    if (x->have < sizeof(x->stage)) return ncclSuccess; /* a short read emptied the socket */
  }
  return ncclSuccess;
}

static ncclResult_t recv_test(struct mps_recv_req *req, int *done, int *sizes) {
  struct mps_recv_comm *c = req->comm;
  *done = 0;
  MP_CHECK(recv_cts_maybe(c));
  /* An inline message lands only when the proxy thread reads it; a slot whose message already
   * arrives on a data stream needs no system call here (unless the control socket is inside a
   * chunk, which only more reads finish). */
  int unclaimed = c->rx.in_payload || c->rx.hhave > 0;
  for (int i = 0; i < req->n && !unclaimed; i++) {
    struct mps_slot *s = &c->slots[req->slots[i]];
    unclaimed = LOAD(&s->state) == MPS_SLOT_POSTED && __atomic_load_n(&s->nranges, __ATOMIC_RELAXED) == 0;
  }
  /* Callers test many requests back to back (NCCL's proxy, every channel): one look at the control
   * socket per MPS_CTRL_POLL_NS is enough, the rest would be system calls that find nothing. */
  if (unclaimed) {
    uint64_t t = mplane_now_ns();
    if (t - c->rx.empty_ns >= MPS_CTRL_POLL_NS) {
      MP_CHECK(recv_poll_ctrl(c));
      c->rx.empty_ns = t;
    }
  }
  int complete = 0;
  int closed = LOAD(&c->streams_closed); /* before the slots: a chunk that lands after is seen next call */
  for (int i = 0; i < req->n; i++) {
    struct mps_slot *s = &c->slots[req->slots[i]];
    int st = LOAD(&s->state);
    if (st == MPS_SLOT_TRUNCATED) {
      MP_WARN("socket: peer %s sent %llu bytes (tag %d) into a receive buffer of %llu bytes; nothing was written",
              c->peer, (unsigned long long)LOAD(&s->total), req->tags[i], (unsigned long long)s->cap);
      s->state = MPS_SLOT_BAD; /* report once */
      return ncclInvalidUsage;
    }
    if (st == MPS_SLOT_BAD) return ncclInvalidUsage;
    complete += st == MPS_SLOT_DONE;
  }
  if (complete < req->n) {
    /* Nothing more can come once every stream has closed: the control socket too, or, since a
     * sender writes its inline messages before it closes the data streams, a moment later (the
     * control socket's bytes may trail the streams' FINs on a real network). A connection whose
     * streams were never opened is over once its control socket closed, a moment later too (a
     * stream it opened last may still be saying hello). */
    int nopen = LOAD(&c->nopen);
    if (closed == nopen && (nopen > 0 || c->rx.closed) && !LOAD(&c->stop)) {
      uint64_t t = mplane_now_ns();
      if (!c->streams_closed_ns) c->streams_closed_ns = t;
      if ((c->rx.closed && nopen > 0) || t - c->streams_closed_ns > MPS_CTRL_GRACE_NS)
        mps_error_set(&c->err, ncclRemoteError, "peer %s closed every data stream while a receive was still "
                      "waiting (process exited or closed its comm early?)", c->peer);
    }
    return mps_error_check(&c->err);
  }
  for (int i = 0; i < req->n; i++) {
    struct mps_slot *s = &c->slots[req->slots[i]];
    if (sizes) sizes[i] = (int)s->total;
    s->state = MPS_SLOT_FREE;
    c->free_slots[c->nfree++] = req->slots[i];
  }
  req->used = 0;
  *done = 1;
  return ncclSuccess;
}

ncclResult_t mps_close_recv(void *recv_comm) {
  struct mps_recv_comm *c = recv_comm;
  if (!c) return ncclSuccess;
  STORE(&c->stop, 1);
  mps_recv_unregister(c); /* no stream attaches after this */
  /* Close with a reset, not a FIN: a sender blocked on a full window would otherwise wait for the
   * kernel's FIN timeout (a minute) instead of failing now. */
  struct linger abort_close = {.l_onoff = 1, .l_linger = 0};
  for (int i = 0; i < MPS_MAX_STREAMS; i++) {
    int fd = c->streams[i] ? c->streams[i]->fd : -1;
    stream_release(c->streams[i]);
    if (fd < 0) continue;
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof(abort_close));
    close(fd);
  }
  close(c->ctrl_fd);
  pthread_mutex_destroy(&c->cts_lock); /* zeroed (never started) is a valid unlocked mutex too */
  for (int k = 0; k < c->nheld; k++) free(c->held[k].data);
  free(c);
  return ncclSuccess;
}

ncclResult_t mps_test(void *request, int *done, int *sizes) {
  uint32_t kind = *(uint32_t *)request;
  if (kind == MPS_REQ_SEND) return send_test(request, done, sizes);
  if (kind == MPS_REQ_RECV) return recv_test(request, done, sizes);
  MP_WARN("socket: test on something that is not an mplane request");
  return ncclInvalidArgument;
}
