/* mplane: the sender's zero-copy path on the data streams (socket.h, "Spliced chunks").
 *
 * A helper thread hands a big chunk's pages to the kernel instead of copying them: vmsplice maps
 * them into the thread's pipe, splice moves them from there onto the stream. The socket then holds
 * references to NCCL's buffer rather than a copy, so the request may only complete once the
 * receiver has read the chunk: its helper answers every such chunk with an mps_ack on the same
 * stream (their order is the chunks' order), and this file matches acks to chunks. On loopback the
 * receiver copies straight out of the sender's pages (one copy per byte instead of two); on a NIC
 * the sender's copy is gone. Memory the kernel cannot map (vmsplice fails) is sent by copy, as
 * before, and the thread stops trying. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "../../common/log.h"
#include "socket_splice.h"

#define PIPE_BYTES (1u << 20) /* a 512 KiB chunk in one vmsplice; Linux's default limit for users */

int mps_splicer_init(struct mps_splicer *sp, const int *fds, int nfds, unsigned cap) {
  memset(sp, 0, sizeof(*sp));
  sp->pipe[0] = sp->pipe[1] = -1;
  sp->nfds = nfds;
  sp->cap = cap;
  memcpy(sp->fds, fds, sizeof(int) * (size_t)nfds);
  /* Acks are 8 bytes and a stream has at most cap chunks in flight, so the unread acks never fill
   * the socket's receive buffer: a receiver never blocks on its ack while we block on its window. */
  sp->ring = calloc((size_t)nfds * cap, sizeof(*sp->ring));
  return sp->ring ? 0 : -1;
}

static void close_pipe(struct mps_splicer *sp) {
  if (sp->pipe[0] >= 0) close(sp->pipe[0]);
  if (sp->pipe[1] >= 0) close(sp->pipe[1]);
  sp->pipe[0] = sp->pipe[1] = -1;
}

/* This thread copies from now on: its pipe, if any, goes, and why is logged once. */
static void stop_splicing(struct mps_splicer *sp, const char *why) {
  MP_INFO(NCCL_NET, "socket: %s; this helper thread copies its chunks instead", why);
  close_pipe(sp);
  sp->no_pipe = 1;
}

/* The pipe, made at the first chunk to splice: a thread that never splices holds no descriptors
 * for it (a rank with hundreds of peers counts them against ulimit -n). 0 ready, -1 copy instead. */
static int pipe_ready(struct mps_splicer *sp) {
  if (sp->pipe[1] >= 0) return 0;
  if (sp->no_pipe) return -1;
  if (pipe2(sp->pipe, O_CLOEXEC) != 0) {
    char why[96];
    snprintf(why, sizeof(why), "no pipe to splice with (%s)", strerror(errno));
    stop_splicing(sp, why); /* a failed pipe2 leaves both ends -1 */
    return -1;
  }
  fcntl(sp->pipe[1], F_SETPIPE_SZ, PIPE_BYTES); /* best effort: a smaller pipe takes more calls */
  return 0;
}

void mps_splicer_free(struct mps_splicer *sp) {
  close_pipe(sp);
  free(sp->ring);
  sp->ring = NULL;
}

/* Move everything in the pipe (n bytes) onto fd. 0 ok, -1 error (errno). */
static int pipe_to_socket(struct mps_splicer *sp, int fd, size_t n, int more) {
  while (n > 0) {
    ssize_t s = splice(sp->pipe[0], NULL, fd, NULL, n, SPLICE_F_MOVE | (more ? SPLICE_F_MORE : 0));
    if (s < 0 && errno == EINTR) continue;
    if (s <= 0) return -1;
    n -= (size_t)s;
  }
  return 0;
}

int mps_splice_chunk(struct mps_splicer *sp, int idx, const struct mps_task *t) {
  size_t len = t->hdr.len, done = 0;
  struct iovec iov = {(void *)t->data, len};
  ssize_t v = pipe_ready(sp) == 0 ? vmsplice(sp->pipe[1], &iov, 1, 0) : -1;
  struct iovec whole[2] = {{(void *)&t->hdr, sizeof(t->hdr)}, {(void *)t->data, len}};
  if (v <= 0) {
    if (sp->pipe[1] >= 0) {
      char why[128];
      snprintf(why, sizeof(why), "cannot splice from %p (%s)", t->data, v < 0 ? strerror(errno) : "nothing mapped");
      stop_splicing(sp, why);
    }
    return mps_sendv_all(t->fd, whole, 2) == 0 ? 0 : -1;
  }
  /* the header with MSG_MORE: it leaves in one segment with the spliced pages after it */
  struct mps_chunk h = t->hdr;
  h.flags |= MPS_CHUNK_ACK;
  struct iovec hdr = {&h, sizeof(h)};
  if (mps_sendv_flags(t->fd, &hdr, 1, MSG_MORE) != 0) return -1;
  for (;;) {
    done += (size_t)v;
    if (pipe_to_socket(sp, t->fd, (size_t)v, done < len) != 0) return -1;
    if (done == len) break;
    iov = (struct iovec){(char *)t->data + done, len - done};
    v = vmsplice(sp->pipe[1], &iov, 1, 0);
    if (v <= 0) { /* mapped a moment ago: unlikely; the rest goes by copy, the ack still comes */
      struct iovec rest = {(char *)t->data + done, len - done};
      if (mps_sendv_all(t->fd, &rest, 1) != 0) return -1;
      break;
    }
  }
  unsigned *tail = &sp->tail[idx];
  sp->ring[(size_t)idx * sp->cap + (*tail & (sp->cap - 1))] = (struct mps_spliced){t->req, t->hdr.slot};
  (*tail)++;
  sp->pending++;
  return 1;
}

/* The acks that stream idx has for us, read without blocking. 0 ok, -1 the peer's error (why). */
static int reap_stream(struct mps_splicer *sp, int idx, int *completed, char *why, size_t wlen) {
  while (sp->head[idx] != sp->tail[idx]) {
    unsigned want = sp->tail[idx] - sp->head[idx];
    struct mps_ack acks[64];
    size_t room = (want < 64 ? want : 64) * sizeof(struct mps_ack) - sp->ncarry[idx];
    memcpy(acks, sp->carry[idx], sp->ncarry[idx]);
    ssize_t r = recv(sp->fds[idx], (char *)acks + sp->ncarry[idx], room, MSG_DONTWAIT);
    if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
    if (r <= 0) {
      snprintf(why, wlen, "peer closed a data stream before it confirmed %u spliced chunk(s)%s%s", want,
               r < 0 ? ": " : "", r < 0 ? strerror(errno) : "");
      return -1;
    }
    size_t have = sp->ncarry[idx] + (size_t)r, n = have / sizeof(struct mps_ack);
    for (size_t i = 0; i < n; i++) {
      struct mps_spliced *e = &sp->ring[(size_t)idx * sp->cap + (sp->head[idx] & (sp->cap - 1))];
      if (acks[i].magic != MPS_ACK_MAGIC || acks[i].slot != e->slot) {
        snprintf(why, wlen, "peer confirmed a chunk of slot %u (magic 0x%08x) where slot %u was next", acks[i].slot,
                 acks[i].magic, e->slot);
        return -1;
      }
      __atomic_add_fetch(&e->req->chunks_done, 1, __ATOMIC_ACQ_REL);
      sp->head[idx]++;
      sp->pending--;
      (*completed)++;
    }
    sp->ncarry[idx] = (unsigned)(have - n * sizeof(struct mps_ack));
    memcpy(sp->carry[idx], (char *)acks + n * sizeof(struct mps_ack), sp->ncarry[idx]);
    if ((size_t)r < room) return 0; /* the socket is empty */
  }
  return 0;
}

int mps_splice_reap(struct mps_splicer *sp, int wake_fd, char *why, size_t wlen) {
  for (;;) {
    int completed = 0;
    for (int i = 0; i < sp->nfds; i++)
      if (reap_stream(sp, i, &completed, why, wlen) != 0) return -1;
    if (wake_fd < 0 || completed || sp->pending == 0) return 0;
    /* Nothing yet: sleep until an ack or new work (wake_fd) comes. */
    struct pollfd p[MPS_MAX_STREAMS + 1];
    int n = 0;
    p[n++] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
    for (int i = 0; i < sp->nfds; i++)
      if (sp->head[i] != sp->tail[i]) p[n++] = (struct pollfd){.fd = sp->fds[i], .events = POLLIN};
    if (poll(p, (nfds_t)n, -1) < 0 && errno != EINTR) {
      snprintf(why, wlen, "poll: %s", strerror(errno));
      return -1;
    }
    if (p[0].revents) {
      uint64_t wakes;
      while (read(wake_fd, &wakes, sizeof(wakes)) > 0) {}
      return 0;
    }
  }
}
