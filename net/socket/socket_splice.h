/* mplane: the sender's zero-copy path on the data streams (socket_splice.c; the protocol: socket.h).
 * Run by a stream's pool thread, with its thread's pipe (socket_engine.c). */
#ifndef MPLANE_NET_SOCKET_SPLICE_H
#define MPLANE_NET_SOCKET_SPLICE_H

#include <stddef.h>
#include <stdint.h>

#include "socket.h"

/* Move more of st's current chunk (st->cur, spliced) onto its socket without blocking: the header,
 * then the payload through a pipe. 1: all of it is in the socket; 0: the socket is full (call
 * again when it has room); -1: the stream failed (errno); 2: nothing was written and the chunk is
 * now an ordinary copied one (pages the kernel cannot map: splicing stops for the process, an INFO
 * once; or no pipe free). */
int mps_splice_step(struct mps_stream *st);
/* The chunk just spliced waits for its ack. 0, or -1 with no memory for the record. */
int mps_splice_wait_ack(struct mps_stream *st, struct mps_send_req *req, uint32_t slot);
/* Complete the spliced chunks whose acks have arrived, without blocking. 0 ok (the socket is empty
 * or nothing is awaited), 1 the peer closed (or reset) it with nothing awaited, -1 the peer failed or broke
 * the protocol (why). */
int mps_splice_reap(struct mps_stream *st, char *why, size_t wlen);
/* 0 until a chunk's pages could not be spliced: then every stream copies (the memory is not one
 * the kernel can map, and trying costs a failed call per chunk). */
int mps_splice_off(void);

#endif
