/* mplane-ep-bench's rank code (collectives/ep/bench/bench_run.c) on the CPU emulator: two ranks as
 * threads of this process, one emulated node of two GPUs or two of one (each thread its own host
 * identity), unique ids relayed through pipes as the launcher does. Runs the correctness checks,
 * the byte accounting (without plugin counters) and a small benchmark: what the GPU machine will
 * run, minus the hardware. Usage: bench_emu NODES */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

#include "bench.h"

#undef main /* the launcher's main is renamed for this build (-Dmain=...); this is ours */

static __thread const char *my_host;
const char *mp_ep_emu_hostid(void) { return my_host; }

/* each rank thread is a "process" of its own for the plugin's per-process stats file */
static __thread pid_t my_pid;
pid_t getpid(void) { return my_pid ? my_pid : (pid_t)syscall(SYS_getpid); }
extern const char *emu_stats_pattern;

typedef struct rank_thread {
  bench_opts *o;
  rank_env env;
  int rc;
  char host[32];
} rank_thread;

static void *run_rank(void *p) {
  rank_thread *r = p;
  my_host = r->host;
  my_pid = 424200 + r->env.rank;
  r->rc = bench_rank_main(r->o, &r->env);
  return NULL;
}

typedef struct relay_arg {
  int up, *down, n;
} relay_arg;

static void *relay(void *p) {
  relay_arg *a = p;
  unsigned char id[128];
  for (;;) {
    size_t got = 0;
    while (got < sizeof(id)) {
      ssize_t n = read(a->up, id + got, sizeof(id) - got);
      if (n <= 0) return NULL;
      got += (size_t)n;
    }
    for (int r = 0; r < a->n; r++)
      if (write(a->down[r], id, sizeof(id)) != (ssize_t)sizeof(id)) return NULL;
  }
}

int main(int argc, char **argv) {
  bench_opts o;
  memset(&o, 0, sizeof(o));
  /* bench_emu NODES [direct] [tokens] [fp8in]: direct = --nvlink-direct (phase-2 rows through
   * emulated CUDA IPC), tokens = --token-rows, fp8in = --fp8-in */
  o.gpus = 2;
  o.nodes = argc > 1 ? atoi(argv[1]) : 1;
  for (int i = 2; i < argc; i++) {
    if (!strcmp(argv[i], "direct")) o.nvlink_direct = 1;
    else if (!strcmp(argv[i], "tokens")) o.token_rows = 1;
    else if (!strcmp(argv[i], "fp8in")) o.fp8_in = 1;
    else {
      fprintf(stderr, "bench_emu: unknown argument %s (expected direct, tokens or fp8in)\n", argv[i]);
      return 2;
    }
  }
  o.per_node = o.gpus / o.nodes;
  o.modes = MODE_CHECK | MODE_BYTES | MODE_BENCH;
  o.tokens = 48;
  o.hidden = 256;
  o.experts = 16;
  o.topk = 4;
  o.groups = 4;
  o.topk_groups = 2;
  o.scaling = 2.5f;
  o.iters = 2;
  o.warmup = 1;
  o.sms[0] = 0;
  o.sms[1] = 2;
  o.n_sms = 2;
  o.seed = 1;
  o.timeout_s = 600;
  if (o.nodes > 1) {
    /* every byte the emulated NCCL moves between the two one-GPU nodes is network traffic */
    snprintf(o.stats, sizeof(o.stats), "/tmp/mplane-ep-emu-stats-%d-%%p.json", (int)syscall(SYS_getpid));
    emu_stats_pattern = o.stats;
  }
  setvbuf(stdout, NULL, _IOLBF, 0);
  int up[2], down[2][2];
  if (pipe(up) || pipe(down[0]) || pipe(down[1])) return 2;
  rank_thread rk[2];
  pthread_t th[2], rt;
  int down_w[2] = {down[0][1], down[1][1]};
  relay_arg ra = {up[0], down_w, 2};
  pthread_create(&rt, NULL, relay, &ra);
  for (int r = 0; r < 2; r++) {
    rk[r].o = &o;
    rk[r].env.rank = r;
    rk[r].env.nranks = 2;
    rk[r].env.device = 0;
    rk[r].env.up_fd = r == 0 ? up[1] : -1;
    rk[r].env.down_fd = down[r][0];
    snprintf(rk[r].host, sizeof(rk[r].host), "emu-node%d", r / o.per_node);
    pthread_create(&th[r], NULL, run_rank, &rk[r]);
  }
  int rc = 0;
  for (int r = 0; r < 2; r++) {
    pthread_join(th[r], NULL);
    printf("bench_emu: rank %d exit %d\n", r, rk[r].rc);
    if (rk[r].rc) rc = 1;
  }
  pthread_join(rt, NULL);
  for (int r = 0; r < 2 && o.stats[0]; r++) {
    char path[600];
    snprintf(path, sizeof(path), "/tmp/mplane-ep-emu-stats-%d-%d.json", (int)syscall(SYS_getpid), 424200 + r);
    unlink(path);
  }
  return rc;
}
