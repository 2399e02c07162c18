/* mplane-ep-bench: one process per GPU running libmplane-ep's correctness checks, the plugin
 * byte-counter check and the DeepSeek-V3-shaped benchmark (docs/moe-alltoall.md). */
#ifndef MPLANE_EP_BENCH_H
#define MPLANE_EP_BENCH_H

#include <stdint.h>
#include <stdio.h>

enum { MODE_CHECK = 1, MODE_BYTES = 2, MODE_BENCH = 4, MODE_CEILING = 8 };

typedef struct bench_opts {
  int gpus;           /* processes, one per GPU */
  int nodes;          /* emulated nodes (distinct NCCL_HOSTID) */
  int per_node;       /* gpus / nodes */
  unsigned modes;
  int tokens, hidden, experts, topk, groups, topk_groups;
  float scaling;
  int iters, warmup;
  int sms[4], n_sms;  /* data-kernel SM counts to benchmark (0 = all) */
  int nvlink_direct;  /* --nvlink-direct: checks use mplane_ep_config.nvlink_direct = 1; bench adds its variants */
  int token_rows;     /* --token-rows: checks use mplane_ep_config.token_rows = 1; bench adds its variants */
  int fp8_in;         /* --fp8-in: FP8 checks dispatch tokens quantised beforehand (mplane_ep_dispatch_fp8); bench adds its variants */
  int share_gpus;     /* --share-gpus: more ranks than GPUs, rank r on GPU r % visible (emulated nodes under MPS) */
  char stats[512];    /* MPLANE_STATS_FILE pattern given to the ranks ("" = none) */
  char out[512];      /* results file (appended by rank 0), "" = none */
  uint64_t seed;
  int timeout_s;
  double ceil_uni, ceil_bi, ceil_local; /* GB/s from the peer-copy run, 0 = not measured */
} bench_opts;

typedef struct rank_env {
  int rank, nranks, device;
  int up_fd;   /* rank 0: unique ids to the launcher */
  int down_fd; /* every rank: unique ids from the launcher */
} rank_env;

/* The work of one rank; returns its exit code (0 pass, 1 a check failed, 2 could not run). */
int bench_rank_main(const bench_opts *o, rank_env *env);
/* Peer-copy ceiling between GPU 0 and GPU 1 (a process of its own). */
int bench_ceiling_main(const bench_opts *o, int fd);

/* printf to stdout, and to the results file when given (rank 0 only writes it). */
void bench_report(const bench_opts *o, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

#endif
