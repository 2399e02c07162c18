/* mplane ABI harness: what the core (abi_harness.c) shares with the scenario files. The core has the
 * command line and the scenario table, two processes with one plugin each, links as NCCL's proxy makes
 * them, the data pattern, the request engine and the generic exchange; each scenario family has a file:
 *
 *   abi_basics.c     props, sizes, inflight, inflight-max, multirecv, reload, reconnect
 *   abi_faults.c     kill-receiver, kill-sender, short-recv, bad-handle
 *   abi_fake.c       fake-peer, fake-chunks, fake-version (plain TCP peers that speak our protocol badly)
 *   abi_versions.c   bad-config, v8, v9, v10, v12, threads
 *   abi_lifecycle.c  dead-listener, connect-timeout, silent-listener, half-open, strangers, abort,
 *                    close-early, ctrl-full, ctrl-big, stalled-close
 *   abi_shared.c     shared-order, shared-wait, shared-comms
 *   abi_eager.c      eager-early, eager-bound, eager-short, eager-then-big, eager-then-close, filler
 *   abi_profiler.c   profiler */
#ifndef MPLANE_TESTS_ABI_HARNESS_H
#define MPLANE_TESTS_ABI_HARNESS_H

#include <stdint.h>
#include <sys/types.h>

#include "abi.h"

#define HANDLE_SIZE NCCL_NET_HANDLE_MAXSIZE
#define MAX_INFLIGHT NCCL_NET_MAX_REQUESTS
#define GUARD_BYTE 0xa5

struct opts {
  const char *plugin;
  int version;
  int dev;
};
extern struct opts g_opts;

/* ---- two processes: rank 0 forks rank 1; a socketpair stands in for NCCL's bootstrap ---- */
#define MAX_CHANS 8

struct pair {
  int fd;               /* socketpair end */
  int chan[MAX_CHANS];  /* more channels, one per thread that talks to the peer (pair_fork_chans) */
  pid_t child;          /* rank 0 only */
};
/* Fork the peer; returns this process's rank (0 the parent, 1 the child). */
int pair_fork(struct pair *pp);
/* The same with nchan more channels (pp->chan), one per thread that talks to the peer. */
int pair_fork_chans(struct pair *pp, int nchan);
/* Rank 1 exits here; rank 0 collects its status (0, or abi_fail). */
int pair_finish(struct pair *pp, int rank);
void chan_send(int fd, const void *buf, size_t len);
void chan_recv(int fd, void *buf, size_t len);
void barrier(int fd);

/* ---- one process's plugin ---- */
struct node {
  struct abi_net net;
  void *ctx;
  int ndev, dev;
  struct abi_props props;
};
void node_open(struct node *nd, int version); /* dlopen and the table only: no init */
void node_up(struct node *nd, int version);    /* and init, devices, --dev's properties checked */
void node_down(struct node *nd);
/* abi_fail unless getProperties of dev reads as the version's fields must. */
void check_props(const struct abi_props *p, int dev, int version);

/* ---- a connection both ways, made as NCCL's proxy makes it ---- */
struct link {
  void *lc, *sc, *rc;
  unsigned char handle[HANDLE_SIZE];      /* ours, from listen */
  unsigned char peer_handle[HANDLE_SIZE]; /* the peer's, as NCCL's bootstrap delivers it */
  int connect_nulls, accept_nulls;
};
void link_up(struct node *nd, int fd, struct link *l);
void link_up_with(struct node *nd, void *ctx, int fd, struct link *l); /* on another communicator's ctx */
void link_down(struct node *nd, struct link *l);
/* The usual start of a two-rank scenario: fork the peer, the plugin up (the --version table) and a link
 * both ways; returns the rank. pair_down ends it: link and node down, then the pair's verdict. */
int pair_up(struct pair *pp, struct node *nd, struct link *l);
int pair_down(struct pair *pp, int rank, struct node *nd, struct link *l);
/* What a WARN about the peer behind handle must name (its IP address on sockets, MPLANE_ABI_PEER_ADDR). */
void peer_addr_text(const unsigned char *handle, char *out, size_t len);
/* abi_fail when a call that started at t0 blocked the proxy thread too long. */
void timed(double t0, const char *what);

/* ---- data: a pattern per (offset, message id), buffers with guard bytes behind them ---- */
void fill(void *buf, size_t n, uint32_t msg);
long check(const void *buf, size_t n, uint32_t msg);      /* first wrong offset, or -1 */
void *alloc_buf(size_t size, size_t guard);               /* page aligned, filled with GUARD_BYTE */
long check_guard(const void *buf, size_t from, size_t to); /* first byte that is not GUARD_BYTE, or -1 */
uint32_t msg_id(int sender, uint32_t index);
void rng_seed(uint64_t s);
uint32_t rng(void);
void shuffle(int *v, int n);
void reg(struct node *nd, void *comm, void *data, size_t size, void **mh);
void dereg(struct node *nd, void *comm, void *mh);

/* ---- the request engine: ops posted and tested as NCCL's proxy does ---- */
#define OP_BUFS 8

struct op {
  int send;
  int n;
  void *data[OP_BUFS];
  size_t size[OP_BUFS]; /* send: bytes to send; recv: buffer capacity */
  int tag[OP_BUFS];
  void *mh[OP_BUFS];
  size_t expect[OP_BUFS]; /* recv: size test() must report */
  uint32_t msg[OP_BUFS];  /* pattern id of the message in each buffer */
  void *req;
  int posted, done;
  int got[OP_BUFS];
};

enum { RUN_POST_ALL_FIRST = 1 };

struct run_stats {
  int null_posts;   /* isend/irecv calls that returned no request (retried, as NCCL does) */
  int max_sends, max_recvs;
  ncclResult_t err; /* first error returned by isend/irecv/test */
  int err_op;
  double err_time;
};

/* Post and test ops until all are done (0) or one fails (1, st->err set); abi_fail after timeout_s. */
int run_ops(struct node *nd, void *sc, void *rc, struct op *ops, int nops, int flags, double timeout_s,
            struct run_stats *st);
/* Every receive reported its message's size and holds its bytes; nothing written behind them. */
void verify_recvs(struct op *ops, int nops, size_t guard);
void fail_run(const char *what, struct run_stats *st, struct op *ops, size_t mark) __attribute__((noreturn));
/* irecv until it gives a request (NCCL retries a NULL one), each call timed; abi_fail on an error or
 * after 10 s. Returns the request. */
void *post_recv(struct node *nd, void *rc, int n, void **data, size_t *sizes, int *tags, void **mh);
/* Buffers per receive in the grouped scenarios: maxRecvs, at most OP_BUFS. */
int recv_group(const struct node *nd);

/* ---- a generic exchange: both ranks send each other the same list of messages ---- */
struct xfer_spec {
  const size_t *sizes;
  int count;
  size_t slack;  /* extra receive capacity beyond the message */
  int group;     /* buffers per receive (1 = plain) */
  int flags;     /* RUN_* */
  int iflush;    /* call iflush on every completed receive, as NCCL does when forceFlush/GDR */
  int late_recv; /* rank 1 posts its receives 300 ms late: the peer's sends may get NULL and are retried */
  uint32_t seed;
};
void exchange(struct node *nd, struct link *l, int rank, int fd, const struct xfer_spec *x, const char *what);

/* ---- plain TCP peers at our listen address (the socket transport's; other transports skip) ---- */
struct sockaddr_storage;
struct mps_hello;
/* 1 and the TCP address when the handle is a socket transport one, else 0. */
int handle_sockaddr(const unsigned char *handle, struct sockaddr_storage *ss, socklen_t *len);
int sockaddr_port(const struct sockaddr_storage *ss);
/* A blocking TCP client connected to ss; *port: its own port (what a WARN about it names). */
int tcp_client(const struct sockaddr_storage *ss, socklen_t len, int *port);
/* A hello of our protocol with no streams named yet. */
void hello_init(struct mps_hello *hello);
/* Listen and read the TCP address out of the handle; 0 (after a note, and releasing a child waiting in
 * real_peer_send_one) when the transport is not socket: the scenario skips. */
int listen_tcp(struct node *nd, struct pair *pp, unsigned char *handle, void **lc, struct sockaddr_storage *ss,
               socklen_t *sl);
/* Rank 1 of a "strangers then a real peer" scenario: connects to the handle it is given, sends one message. */
int real_peer_send_one(struct pair *pp, struct node *nd, size_t size, int msg, int tag, const char *what);
/* Rank 0's side of it: accept within limit_s (why names what a late accept means), receive and check
 * the message, close. Seconds until accepted. */
double accept_real_peer(struct node *nd, struct pair *pp, const unsigned char *handle, void *lc, size_t size,
                        int msg, int tag, double limit_s, const char *why);

/* ---- the scenarios, one file per family ---- */
int handle_is_socket(const unsigned char *handle); /* our listen handle names a TCP address */
int sc_profiler(void); /* abi_profiler.c */
int sc_props(void); /* abi_basics.c */
int sc_sizes(void);
int sc_inflight(void);
int sc_inflight_max(void);
int sc_multirecv(void);
int sc_reload(void);
int sc_reconnect(void);
int sc_kill_receiver(void); /* abi_faults.c */
int sc_kill_sender(void);
int sc_short_recv(void);
int sc_bad_handle(void);
int sc_fake_peer(void); /* abi_fake.c */
int sc_fake_chunks(void);
int sc_fake_version(void);
int sc_bad_config(void); /* abi_versions.c */
int sc_v8(void);
int sc_v9(void);
int sc_v10(void);
int sc_v12(void);
int sc_threads(void);
int sc_dead_listener(void); /* abi_lifecycle.c */
int sc_connect_timeout(void);
int sc_silent_listener(void);
int sc_half_open(void);
int sc_strangers(void);
int sc_byte_strangers(void);
int sc_abort(void);
int sc_close_early(void);
int sc_ctrl_full(void);
int sc_ctrl_big(void);
int sc_stalled_close(void);
int sc_eager_early(void); /* abi_eager.c */
int sc_eager_bound(void);
int sc_eager_short(void);
int sc_eager_then_big(void);
int sc_eager_then_close(void);
int sc_filler(void);
int sc_shared_order(void); /* abi_shared.c */
int sc_shared_wait(void);
int sc_shared_comms(void);

#endif
