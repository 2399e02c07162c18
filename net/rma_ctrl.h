/* mplane: what the transports' one-sided ops (net/socket/socket_rma.c, net/ib/ib_rma.c) share:
 * blocking I/O on TCP sockets (the group's control sockets, used by collective calls: connect,
 * regMrSym, createContext; and the socket transport's own reader and writer threads), the
 * all-gather over the control sockets, and which peers a context connects. */
#ifndef MPLANE_NET_RMA_CTRL_H
#define MPLANE_NET_RMA_CTRL_H

#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>
#include "../common/config.h"
#include "../common/nccl/err.h"

/* MPLANE_CONNECT_TIMEOUT in milliseconds (60 s when unset): how long a collective call waits. */
int mplane_rma_timeout_ms(const struct mplane_config *cfg);

/* Blocking send/receive of exactly n bytes, EINTR retried. write: 0 or -1. read: 0 when n bytes
 * came; 1 on an orderly close before the first byte; -1 otherwise. */
int mplane_rma_write_all(int fd, const void *buf, size_t n);
int mplane_rma_read_all(int fd, void *buf, size_t n);

/* A TCP listener on sa's address, any port: the fd, with sa and *len now naming its port; -1 with
 * errno set when the socket cannot be made, bound or listened on. */
int mplane_rma_listen_any_port(struct sockaddr_storage *sa, socklen_t *len);

/* SO_RCVTIMEO and SO_SNDTIMEO of ms (0: none). */
void mplane_rma_set_timeouts(int fd, int ms);

/* Every rank sends `mine` (len bytes) to every other over ctrl[] (ctrl[rank] unused) and gathers
 * all nranks records into all, rank order. A peer that cannot be reached or says nothing within
 * timeout_ms: a WARN naming the call (`what`) and both ranks, ncclRemoteError. */
ncclResult_t mplane_rma_allgather(const int *ctrl, int rank, int nranks, const void *mine, void *all, size_t len,
                                  int timeout_ms, const char *what);

/* An address a peer's RMA handle names: 0 when its family is IPv4 or IPv6 and addrlen is exactly
 * that family's sockaddr size (which also fits the handle); else -1 with why saying what is wrong.
 * A handle travels through the job's bootstrap from another process: it is checked before any
 * connect, as the two-sided handles are. */
int mplane_rma_addr_check(const struct sockaddr *sa, unsigned addrlen, char *why, size_t whylen);

/* The incoming side of an RMA listener: connections that have not yet sent their whole hello wait
 * here together, so a stranger on the port (a scanner, an HTTP probe, a socket that says nothing)
 * is dropped on its own and the real peers still get in; a hello is read without blocking. */
#define MPLANE_RMA_GATE_MAX 16
#define MPLANE_RMA_HELLO_MAX 64
struct mplane_rma_gate {
  int lfd;
  uint32_t magic;   /* what a hello's first four bytes must be */
  size_t hello_len; /* <= MPLANE_RMA_HELLO_MAX */
  const char *what; /* "RMA connect", "RMA createContext": for the log */
  int n;
  struct {
    int fd;
    size_t have;
    uint64_t since_ms;
    char peer[64];
    unsigned char buf[MPLANE_RMA_HELLO_MAX];
  } p[MPLANE_RMA_GATE_MAX];
};
void mplane_rma_gate_init(struct mplane_rma_gate *g, int lfd, uint32_t magic, size_t hello_len, const char *what);
/* The next connection whose hello arrived whole and passes check (0: take it; else a reason in why,
 * and the connection is dropped with an INFO line naming where it came from), within timeout_ms:
 * its fd (blocking, TCP_NODELAY), the hello copied to hello. -1 when none came in time (why says so). */
int mplane_rma_gate_take(struct mplane_rma_gate *g, void *hello,
                         int (*check)(const void *hello, void *arg, char *why, size_t whylen), void *arg,
                         int timeout_ms, char *why, size_t whylen);
/* Close the connections still waiting (the listener stays the caller's). */
void mplane_rma_gate_close(struct mplane_rma_gate *g);

/* A context connects rank to p when their distance (p - rank mod nranks) is a multiple of the
 * rank stride; the rank itself (distance 0) is a peer too: NCCL's kernels put to every rank of the
 * team, their own included. */
int mplane_rma_peer_connected(int rank, int nranks, int stride, int p);

#endif
