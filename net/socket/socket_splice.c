/* mplane: the sender's zero-copy path on the data streams (socket.h, "Spliced chunks").
 *
 * A pool thread hands a big chunk's pages to the kernel instead of copying them: vmsplice maps
 * them into the thread's pipe, splice moves them from there onto the stream, both without blocking
 * (a full socket leaves the rest in the pipe, which then belongs to that stream until it drains;
 * the thread's other streams copy meanwhile). The socket then holds references to NCCL's buffer
 * rather than a copy, so the request may only complete once the receiver has read the chunk: its
 * pool thread answers every such chunk with an mps_ack on the same stream (their order is the
 * chunks' order), and this file matches acks to chunks. On loopback the receiver copies straight
 * out of the sender's pages (one copy per byte instead of two); on a NIC the sender's copy is gone. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../../common/log.h"
#include "socket_splice.h"

static int g_splice_off; /* atomic: memory the kernel cannot map was seen */

int mps_splice_off(void) { return __atomic_load_n(&g_splice_off, __ATOMIC_RELAXED); }

/* The first pages of the chunk into the pipe, before its header says it is spliced. 1 in the pipe;
 * 0 the kernel cannot map them: the chunk goes by copy, unflagged (and so do all later ones). */
static int splice_first(struct mps_stream *st, int *pipe) {
  struct iovec iov = {(void *)st->cur.t.data, st->cur.hdr.len};
  ssize_t v = vmsplice(pipe[1], &iov, 1, SPLICE_F_NONBLOCK);
  if (v > 0) {
    mps_engine_pipe_hold(st, pipe, (size_t)v);
    return 1;
  }
  if (!__atomic_exchange_n(&g_splice_off, 1, __ATOMIC_RELAXED))
    MP_INFO(NCCL_NET, "socket: cannot splice from %p (%s); chunks are copied from now on", iov.iov_base,
            v < 0 ? strerror(errno) : "nothing mapped");
  return 0;
}

int mps_splice_step(struct mps_stream *st) {
  size_t hlen = sizeof(st->cur.hdr), len = st->cur.hdr.len;
  int *pipe = st->cur.spliced == 1 ? mps_engine_pipe(st) : NULL;
  if (st->cur.done == 0 && st->cur.spliced == 1 && (!pipe || mps_engine_pipe_bytes(st, pipe) == 0)) {
    if (!pipe || !splice_first(st, pipe)) {
      st->cur.spliced = 0; /* nothing on the wire yet: an ordinary copied chunk */
      st->cur.hdr.flags &= ~(uint32_t)MPS_CHUNK_ACK;
      return 2;
    }
  }
  while (st->cur.done < hlen) { /* the header with MSG_MORE: it leaves with the spliced pages after it */
    ssize_t w = send(st->fd, (char *)&st->cur.hdr + st->cur.done, hlen - st->cur.done,
                     MSG_NOSIGNAL | MSG_DONTWAIT | MSG_MORE);
    if (w < 0) return mps_would_block() ? 0 : -1;
    st->cur.done += (size_t)w;
  }
  if (st->cur.spliced == 2) return mps_send_copy_step(st);
  if (!pipe) { /* no pipe free between two pieces: the rest by copy (the ack still comes) */
    st->cur.spliced = 2;
    return mps_send_copy_step(st);
  }
  for (;;) {
    size_t inpipe = mps_engine_pipe_bytes(st, pipe);
    size_t off = st->cur.done - hlen; /* payload bytes on the socket; inpipe more are in the pipe */
    if (inpipe == 0) {
      if (off == len) return 1;
      struct iovec iov = {(void *)(st->cur.t.data + off), len - off};
      ssize_t v = vmsplice(pipe[1], &iov, 1, SPLICE_F_NONBLOCK);
      if (v <= 0) { /* mapped a moment ago: unlikely; the rest by copy, the ack still comes */
        st->cur.spliced = 2;
        return mps_send_copy_step(st);
      }
      inpipe = (size_t)v;
      mps_engine_pipe_hold(st, pipe, inpipe);
    }
    int more = off + inpipe < len;
    ssize_t s = splice(pipe[0], NULL, st->fd, NULL, inpipe,
                       SPLICE_F_MOVE | SPLICE_F_NONBLOCK | (more ? SPLICE_F_MORE : 0));
    if (s < 0) return mps_would_block() ? 0 : -1;
    if (s == 0) return -1;
    st->cur.done += (size_t)s;
    mps_engine_pipe_hold(st, pipe, inpipe - (size_t)s);
  }
}

int mps_splice_wait_ack(struct mps_stream *st, struct mps_send_req *req, uint32_t slot) {
  if (st->atail - st->ahead == st->acap &&
      mps_ring_grow((void **)&st->acks, sizeof(*st->acks), &st->acap, &st->ahead, &st->atail) != 0)
    return -1;
  st->acks[st->atail++ & (st->acap - 1)] = (struct mps_spliced){req, slot};
  return 0;
}

int mps_splice_reap(struct mps_stream *st, char *why, size_t wlen) {
  for (;;) {
    unsigned want = st->atail - st->ahead;
    struct mps_ack acks[64];
    size_t room = want ? (want < 64 ? want : 64) * sizeof(struct mps_ack) - st->ncarry : 1;
    memcpy(acks, st->carry, st->ncarry);
    ssize_t r = recv(st->fd, (char *)acks + st->ncarry, room, MSG_DONTWAIT);
    if (r < 0 && mps_would_block()) return 0;
    /* Closed (or reset: a peer process that exits with bytes of ours unread resets instead of closing)
     * with nothing left to confirm: not an error by itself; a chunk written to it later fails the comm. */
    if (want == 0 && (r == 0 || (r < 0 && (errno == ECONNRESET || errno == EPIPE)))) return 1;
    if (r <= 0) {
      snprintf(why, wlen, "peer closed a data stream before it confirmed %u spliced chunk(s)%s%s", want,
               r < 0 ? ": " : "", r < 0 ? strerror(errno) : "");
      return -1;
    }
    if (want == 0) {
      snprintf(why, wlen, "peer sent bytes on a data stream with no spliced chunk to confirm");
      return -1;
    }
    size_t have = st->ncarry + (size_t)r, n = have / sizeof(struct mps_ack);
    for (size_t i = 0; i < n; i++) {
      struct mps_spliced *e = &st->acks[st->ahead & (st->acap - 1)];
      if (acks[i].magic != MPS_ACK_MAGIC || acks[i].slot != e->slot) {
        snprintf(why, wlen, "peer confirmed a chunk of slot %u (magic 0x%08x) where slot %u was next", acks[i].slot,
                 acks[i].magic, e->slot);
        return -1;
      }
      __atomic_add_fetch(&e->req->chunks_done, 1, __ATOMIC_ACQ_REL);
      st->ahead++;
    }
    st->ncarry = (unsigned)(have - n * sizeof(struct mps_ack));
    memcpy(st->carry, (char *)acks + n * sizeof(struct mps_ack), st->ncarry);
    if ((size_t)r < room) return 0; /* the socket is empty */
  }
}
