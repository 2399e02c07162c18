/* mplane ABI harness: what the scenario files share (two processes, one plugin each, links, the
 * data pattern, buffers). abi_harness.c has the command line and most scenarios. */
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
void node_up(struct node *nd, int version);
void node_down(struct node *nd);

/* ---- a connection both ways, made as NCCL's proxy makes it ---- */
struct link {
  void *lc, *sc, *rc;
  unsigned char handle[HANDLE_SIZE];      /* ours, from listen */
  unsigned char peer_handle[HANDLE_SIZE]; /* the peer's, as NCCL's bootstrap delivers it */
  int connect_nulls, accept_nulls;
};
void link_up(struct node *nd, int fd, struct link *l);
void link_down(struct node *nd, struct link *l);
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

/* ---- scenarios that live in their own files ---- */
int handle_is_socket(const unsigned char *handle); /* our listen handle names a TCP address */
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
