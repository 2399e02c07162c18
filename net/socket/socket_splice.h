/* mplane: the sender's zero-copy path on the data streams (socket_splice.c; the protocol: socket.h).
 * Used by one send helper thread at a time: a splicer belongs to its thread. */
#ifndef MPLANE_NET_SOCKET_SPLICE_H
#define MPLANE_NET_SOCKET_SPLICE_H

#include <stddef.h>
#include <stdint.h>

#include "socket.h"

struct mps_splicer {
  int pipe[2];      /* vmsplice -> splice, made at the first chunk spliced; -1: none yet, */
  int no_pipe;      /* ... or none for good: this thread copies (memory the kernel cannot map) */
  int nfds;         /* the thread's streams, */
  int fds[MPS_MAX_STREAMS];
  unsigned cap;     /* ... each with a ring of this many chunks awaiting their ack (a power of two) */
  struct mps_spliced {
    struct mps_send_req *req;
    uint32_t slot;
  } *ring;          /* nfds x cap */
  unsigned head[MPS_MAX_STREAMS], tail[MPS_MAX_STREAMS];
  char carry[MPS_MAX_STREAMS][sizeof(struct mps_ack)]; /* an ack read in part */
  unsigned ncarry[MPS_MAX_STREAMS];
  unsigned pending; /* chunks awaiting their ack, all streams */
};

/* fds: the thread's streams; cap: the most chunks one stream may have in flight. 0 ok, -1 no memory. */
int mps_splicer_init(struct mps_splicer *sp, const int *fds, int nfds, unsigned cap);
void mps_splicer_free(struct mps_splicer *sp);
/* Send task t on stream idx (fds[idx]). 1: spliced, its request's chunk completes on the ack; 0: sent
 * by copy (complete now); -1: the stream failed (errno). */
int mps_splice_chunk(struct mps_splicer *sp, int idx, const struct mps_task *t);
/* Complete the chunks whose acks have arrived. With wake_fd >= 0 and chunks pending, first wait until
 * an ack or wake_fd (new work) comes. 0 ok, -1 the peer failed or broke the protocol (why). */
int mps_splice_reap(struct mps_splicer *sp, int wake_fd, char *why, size_t wlen);

#endif
