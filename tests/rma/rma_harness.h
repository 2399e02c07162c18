/* mplane RMA harness: what the core (rma_harness.c) shares with the scenario files. The core has the
 * command line and the scenario table, the ranks (fork, their own env and network namespace), the
 * barriers, the data pattern, what NCCL's GIN proxy does between polls, the windows of every scenario
 * (setup, teardown) and the checks; each scenario family has a file:
 *
 *   rma_data.c    data, order, alltoall (and the traffic record's checks)
 *   rma_faults.c  oob, stride, kill, peerfault, stall, regfail, stagefault: refused ops and failing peers
 *   rma_gin.c     rate, proxyloop, replies, eplike: the patterns of NCCL's GIN proxy loop and NCCL EP
 *   rma_gpu.c     dmabuf, gpurelay, staged, getflush, getsignal, noroute: GPU windows, staging and routes */
#ifndef MPLANE_TESTS_RMA_HARNESS_H
#define MPLANE_TESTS_RMA_HARNESS_H

#include <stdint.h>
#include <sys/types.h>

#include "common/nccl/rma_v14.h"

#define MAX_RANKS 8
#define NCTX 3
#define SUB (256u << 10)     /* region of one random put */
#define K 12                 /* random puts per (source, target) */
#define BIG (64u << 20)
#define GUARD 4096
#define ORDER_N 64           /* puts in the ordering scenario */
#define ORDER_SUB (32u << 10)
#define DEADLINE_S 60

/* What the ranks share (an anonymous shared mapping made before the fork). */
struct shared {
  char handles[MAX_RANKS][NCCL_NET_HANDLE_MAXSIZE];
  volatile int arrived[64];
  volatile long rounds; /* the reusable barrier of barrier_round */
  volatile pid_t pids[MAX_RANKS];
  volatile int expect_killed; /* stall: this rank + 1 ends by SIGKILL, as the scenario means it to */
  uint64_t t0_ns;              /* proxyloop: when rank 0 posted the first signal of a burst */
  int tcp_port;                /* proxyloop: rank 0's raw TCP listener */
  volatile double seen_us;     /* proxyloop: rank 1's median burst arrival (set before a barrier) */
};

extern struct shared *shm;
extern int g_rank, g_n, g_big, g_gpu;
extern int g_gpu_dmabuf;  /* --gpu-dmabuf: the source and big windows are "GPU" memfd dma-bufs (no GPU needed) */
extern int g_target;      /* --target R: the rank the order scenario streams to */
extern int g_no_progress; /* --no-progress: never call rmaProgress (the plugin's own threads serve) */
extern void *g_ctx;       /* the context rmaProgress is called on while waiting, as NCCL's GIN proxy does */
extern uint64_t g_src_size; /* the pattern window: BIG with --big, else 4 MiB */
extern const ncclRma_v14_t *rma;
extern int g_saw_cross_plane, g_saw_warn; /* what the plugin's log said (harness_logger) */

void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

#define CHECK(call)                                                           \
  do {                                                                        \
    ncclResult_t r_ = (call);                                                 \
    if (r_ != ncclSuccess) die("%s returned %d (line %d)", #call, r_, __LINE__); \
  } while (0)

double now_s(void);

/* ---- barriers: they keep calling rmaProgress, as NCCL's progress thread never stops ---- */
void barrier_of(int id, int count); /* barrier number id (each used once) across count ranks */
void barrier(int id);               /* ... across every rank */
void barrier_round(long k);         /* the k-th crossing (k = 0, 1, ...) of a barrier used many times */

/* ---- the data pattern and the random puts ---- */
uint8_t pat(int rank, uint64_t off);
uint64_t rnd(void);
void seed(int src, int dst, int salt);
uint64_t pick_size(int i, uint64_t max); /* 0, 1, the whole region, and random ones in between */
void put_plan(int src, int dst, int i, uint64_t *size, uint64_t *soff, uint64_t *doff);

/* ---- what NCCL's GIN proxy does while it waits ---- */
void progress(void);
/* Poll requests until all are done; a failure is fatal unless want_err, where it counts. */
int wait_reqs(void *cc, void **reqs, int n, int want_err);

/* ---- GPU memory: the CUDA driver (--gpu) and memfd dma-bufs the plugin takes for GPU memory ---- */
void *gpu_alloc_copy(const void *host, size_t n);
void gpu_fetch(void *host, const void *dev, size_t n);
void *fake_gpu_window_in(void *cc, size_t size, size_t mapped, const void *init, uint64_t flags, void **mh);
void *fake_gpu_window(void *cc, size_t size, const void *init, void **mh);

/* ---- one rank's group, contexts and windows, as every scenario starts ---- */
struct env {
  void *ctx, *cc, *rc;
  char *recv, *src, *getw, *big;
  uint64_t *sig;
  char *d_recv, *d_src;  /* --gpu: the GPU windows (recv, src, sig mirror them on the host) */
  uint64_t *d_sig;
  void *mh_recv, *mh_src, *mh_getw, *mh_big, *mh_sig;
  size_t recv_size, getw_size;
};

int connected(int p, int stride);
const char *expected_warn(void);
/* The plugin's log, as NCCL's logger: WARNs to stderr, the cross-plane note and the expected WARN seen. */
void harness_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...);
/* listen, the handles exchanged (barrier 0), connect as a group, closeListen: e->cc (after init). */
void group_connect(struct env *e);
void setup_contexts(struct env *e, int stride, int nctx);
void setup(struct env *e, int stride);
void teardown(struct env *e);

/* ---- checks ---- */
uint64_t sig_read(struct env *e, int word);
const char *recv_at(struct env *e, uint64_t off, uint64_t n); /* fresh from the GPU under --gpu */
void wait_signal(struct env *e, int word, uint64_t want);
void check_bytes(const char *buf, uint64_t n, int owner, uint64_t src_off, const char *what);
void check_zero(const char *buf, uint64_t from, uint64_t to, const char *what);
void check_guard(struct env *e);
void check_expected_warn(void); /* MPLANE_RMA_EXPECT_WARN(_<r>) came */
void expect_dmabuf_reg(size_t length, const char *what);

/* ---- the scenarios, one file per family ---- */
void scenario_data(void); /* rma_data.c */
void scenario_order(void);
void scenario_alltoall(void);
void scenario_oob(void); /* rma_faults.c */
void scenario_stride(void);
void scenario_kill(void);
void scenario_peerfault(void);
void scenario_stall(void);
void scenario_regfail(void);
void scenario_stagefault(void);
void scenario_rate(void); /* rma_gin.c */
void scenario_proxyloop(void);
void scenario_replies(void);
void scenario_lastpass(void);
void scenario_eplike(void);
void scenario_dmabuf(void); /* rma_gpu.c */
void scenario_noroute(void);
void scenario_gpurelay(void);
void scenario_staged(void);
void scenario_getflush(void);
void scenario_getsignal(void);
void scenario_getflush_inflight(void);

#endif
