/* A same-node peer that never calls dispatch (or combine) must end the other rank's fused kernel
 * with a message naming it, never a hang. Runs on the CPU emulator (tests/ep/emu) with the kernels'
 * wait limit cut to 2 s (-DMP_EP_WAIT_NS, see meson.build).
 *
 * Each scenario runs two ranks of one node (nvlink_direct, token rows) in a child process: both
 * compute the layout; rank 1 then stops (it sleeps) before dispatch or before combine. The kernel of
 * rank 0 must give up: the child dies of SIGABRT (the emulator's __trap) within 60 s, and its output
 * names the waiting rank, the peer and the call the peer never made. Exit 0: all scenarios behaved. */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "mplane_ep.h"
#include "nccl.h" /* the emulator's: emu_nccl_world_create */

enum { STOP_BEFORE_DISPATCH, STOP_BEFORE_COMBINE };

typedef struct {
  ncclComm_t comm;
  int rank, stop;
} rank_arg;

#define T 24
#define H 256
#define K 4
#define E 16

static void *rank_main(void *p) {
  rank_arg *a = p;
  mplane_ep_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gpus_per_node = 2;
  cfg.num_experts = E;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens = T;
  cfg.nvlink_direct = 1;
  cfg.token_rows = 1;
  cfg.num_sms = 4;
  mplane_ep_ctx *ctx = NULL;
  mplane_ep_layout *lo = NULL;
  if (mplane_ep_create(&ctx, a->comm, &cfg, NULL) || mplane_ep_layout_create(ctx, &lo)) {
    fprintf(stderr, "rank %d: create: %s\n", a->rank, mplane_ep_last_error(ctx));
    exit(3);
  }
  /* every token to one expert on each GPU: rows cross to the peer both ways */
  int32_t idx[T * K];
  float w[T * K];
  uint16_t x[T * H];
  for (int t = 0; t < T; t++)
    for (int k = 0; k < K; k++) {
      idx[t * K + k] = (k % 2) * (E / 2) + (t + k) % (E / 2);
      w[t * K + k] = 0.25f;
    }
  for (int i = 0; i < T * H; i++) x[i] = 0x3f80; /* 1.0 in BF16 */
  void *d_x, *d_y, *d_out;
  int32_t *d_idx;
  float *d_w;
  cudaMalloc(&d_x, sizeof(x));
  cudaMalloc((void **)&d_idx, sizeof(idx));
  cudaMalloc((void **)&d_w, sizeof(w));
  cudaMalloc(&d_out, sizeof(x));
  mplane_ep_info info;
  mplane_ep_get_info(ctx, &info);
  cudaMalloc(&d_y, 2 * (size_t)info.max_recv_rows * H + 16);
  cudaMemcpy(d_x, x, sizeof(x), cudaMemcpyHostToDevice);
  cudaMemcpy(d_idx, idx, sizeof(idx), cudaMemcpyHostToDevice);
  cudaMemcpy(d_w, w, sizeof(w), cudaMemcpyHostToDevice);
  mplane_ep_recv recv;
  memset(&recv, 0, sizeof(recv));
  if (mplane_ep_get_layout(ctx, d_idx, T, lo, NULL)) exit(3);
  if (a->rank == 1 && a->stop == STOP_BEFORE_DISPATCH) pause(); /* gone: the child ends with rank 0's trap */
  if (mplane_ep_dispatch(ctx, lo, d_x, d_w, MPLANE_EP_FMT_FP8, &recv, NULL)) exit(3);
  if (mplane_ep_dequant(ctx, lo, &recv, d_y, NULL)) exit(3);
  if (a->rank == 1 && a->stop == STOP_BEFORE_COMBINE) pause();
  mplane_ep_combine(ctx, lo, d_y, d_out, NULL);
  cudaStreamSynchronize(NULL);
  fprintf(stderr, "rank %d: the call returned although its peer never made it\n", a->rank);
  exit(4);
}

static void run_child(int stop) {
  ncclComm_t comm[2];
  pthread_t th[2];
  rank_arg args[2];
  emu_nccl_world_create(2, comm);
  for (int r = 0; r < 2; r++) {
    args[r] = (rank_arg){comm[r], r, stop};
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  exit(5); /* not reached: a rank exits or the trap aborts */
}

/* Run one scenario in a child; 0 when it died of SIGABRT in time with `want` in its output. */
static int scenario(const char *name, int stop, const char *want) {
  int fd[2];
  if (pipe(fd)) return perror("pipe"), 1;
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    dup2(fd[1], 1);
    dup2(fd[1], 2);
    close(fd[0]);
    run_child(stop);
  }
  close(fd[1]);
  char out[65536];
  size_t n = 0;
  int status = 0, done = 0;
  const time_t t0 = time(NULL);
  while (!done) {
    fd_set rd;
    FD_ZERO(&rd);
    FD_SET(fd[0], &rd);
    struct timeval tv = {1, 0};
    if (select(fd[0] + 1, &rd, NULL, NULL, &tv) > 0) {
      ssize_t r = read(fd[0], out + n, sizeof(out) - 1 - n);
      if (r > 0) n += (size_t)r;
      if (r == 0 || n == sizeof(out) - 1) done = 1;
    }
    if (time(NULL) - t0 > 60) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      fprintf(stderr, "%s: FAIL: still running after 60 s (a hang)\n", name);
      return 1;
    }
  }
  out[n] = 0;
  close(fd[0]);
  waitpid(pid, &status, 0);
  const int secs = (int)(time(NULL) - t0);
  if (!WIFSIGNALED(status) || WTERMSIG(status) != SIGABRT) {
    fprintf(stderr, "%s: FAIL: the child %s %d, expected SIGABRT; its output:\n%s\n", name,
            WIFSIGNALED(status) ? "died of signal" : "exited", WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status),
            out);
    return 1;
  }
  if (!strstr(out, want)) {
    fprintf(stderr, "%s: FAIL: no \"%s\" in its output:\n%s\n", name, want, out);
    return 1;
  }
  printf("%s: the waiting kernel gave up after %d s and said: %s", name, secs, strstr(out, "libmplane-ep: rank"));
  return 0;
}

int main(void) {
  setvbuf(stdout, NULL, _IONBF, 0);
  int bad = 0;
  bad += scenario("peer never dispatches", STOP_BEFORE_DISPATCH,
                  "rank 0 waited 2 s for local GPU 1 (rank 1) to start its nvlink_direct dispatch");
  bad += scenario("peer never combines", STOP_BEFORE_COMBINE,
                  "rank 0 waited 2 s for local GPU 1 (rank 1) to start its nvlink_direct combine");
  printf("test_ep_peer_gone: %s\n", bad ? "FAIL" : "PASS");
  return bad ? 1 : 0;
}
