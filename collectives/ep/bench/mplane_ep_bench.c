/* mplane-ep-bench: the launcher. Forks one process per GPU (no CUDA or NCCL in this process, so
 * the children start clean), relays NCCL unique ids from rank 0 to every rank through pipes, gives
 * each emulated node its own NCCL_HOSTID (so NCCL sends between them through the net plugin), sets
 * NCCL_NVLS_ENABLE=0 always, and kills the ranks if they outlive --timeout. Exit 0 when every rank
 * passed, 1 otherwise, 77 when there is no GPU (meson's skip code).
 *
 *   mplane-ep-bench --gpus 2 --nodes 1 --mode all
 *   mplane-ep-bench --gpus 2 --nodes 2 --mode all --stats-file /tmp/ep-stats-%p.json
 *   mplane-ep-bench --gpus 2 --nodes 2 --share-gpus ...   (two emulated nodes on one GPU, under MPS)
 */
#include <errno.h>
#include <execinfo.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench.h"

static void usage(FILE *f) {
  fprintf(f,
          "usage: mplane-ep-bench [options]\n"
          "  --gpus N          processes, one per GPU (0 = every visible GPU; default 0)\n"
          "  --nodes M         emulated nodes: ranks r*N/M.. share NCCL_HOSTID=mplane-ep-node<m> (default 1)\n"
          "  --mode LIST       check,bytes,bench,ceiling or all (default all)\n"
          "  --tokens T        benchmark tokens per GPU (4096)\n"
          "  --hidden H        (7168)   --experts E (256)   --topk K (8)\n"
          "  --groups G        expert groups (8)   --topk-groups TG (4)   --scaling S (2.5)\n"
          "  --iters I         timed iterations (20), after --warmup W (3)\n"
          "  --sms LIST        data-kernel SM counts to benchmark, 0 = all (default 0,24)\n"
          "  --nvlink-direct   check mode runs the direct intranode path (nvlink_direct = 1: phase-2 rows written\n"
          "                    into the peers' buffers through CUDA IPC); bench mode times it beside the NCCL path\n"
          "  --token-rows      check mode uses token rows (token_rows = 1: one row per received token, expert rows\n"
          "                    name it); bench mode times them beside the expert-row copies\n"
          "  --fp8-in          FP8 checks give dispatch the tokens already quantised (mplane_ep_dispatch_fp8, as\n"
          "                    DeepEP takes them); bench mode times that beside BF16 in\n"
          "  --share-gpus      more processes than GPUs: rank r runs on GPU r %% (visible GPUs), so two emulated nodes\n"
          "                    fit on one GPU and NCCL still carries the network phase through the net plugin (the\n"
          "                    ranks of one node must land on different GPUs). Start MPS first so that the ranks'\n"
          "                    kernels run side by side (nvidia-cuda-mps-control -d; without it they time-slice\n"
          "                    the GPU: the checks hold, the times do not mean much)\n"
          "  --stats-file PAT  plugin counters: sets MPLANE_STATS_FILE=PAT (%%p = pid) in the ranks and reads it\n"
          "  --out FILE        append the results to FILE\n"
          "  --seed S          (1)   --timeout SEC (540)\n");
}

static unsigned parse_modes(const char *s) {
  unsigned m = 0;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", s);
  for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
    if (!strcmp(tok, "all")) m |= MODE_CHECK | MODE_BYTES | MODE_BENCH | MODE_CEILING;
    else if (!strcmp(tok, "check")) m |= MODE_CHECK;
    else if (!strcmp(tok, "bytes")) m |= MODE_BYTES;
    else if (!strcmp(tok, "bench")) m |= MODE_BENCH;
    else if (!strcmp(tok, "ceiling")) m |= MODE_CEILING;
    else return 0;
  }
  return m;
}

static int parse_args(int argc, char **argv, bench_opts *o) {
  memset(o, 0, sizeof(*o));
  o->nodes = 1;
  o->modes = MODE_CHECK | MODE_BYTES | MODE_BENCH | MODE_CEILING;
  o->tokens = 4096;
  o->hidden = 7168;
  o->experts = 256;
  o->topk = 8;
  o->groups = 8;
  o->topk_groups = 4;
  o->scaling = 2.5f;
  o->iters = 20;
  o->warmup = 3;
  o->sms[0] = 0;
  o->sms[1] = 24;
  o->n_sms = 2;
  o->seed = 1;
  o->timeout_s = 540;
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
#define NEXT()                                                 \
  do {                                                         \
    if (!v) {                                                  \
      fprintf(stderr, "mplane-ep-bench: %s needs a value\n", a); \
      return -1;                                               \
    }                                                          \
    i++;                                                       \
  } while (0)
    if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
      usage(stdout);
      exit(0);
    } else if (!strcmp(a, "--gpus")) { NEXT(); o->gpus = atoi(v); }
    else if (!strcmp(a, "--nodes")) { NEXT(); o->nodes = atoi(v); }
    else if (!strcmp(a, "--mode")) {
      NEXT();
      o->modes = parse_modes(v);
      if (!o->modes) {
        fprintf(stderr, "mplane-ep-bench: --mode '%s': expected a comma list of check, bytes, bench, ceiling, all\n", v);
        return -1;
      }
    } else if (!strcmp(a, "--tokens")) { NEXT(); o->tokens = atoi(v); }
    else if (!strcmp(a, "--hidden")) { NEXT(); o->hidden = atoi(v); }
    else if (!strcmp(a, "--experts")) { NEXT(); o->experts = atoi(v); }
    else if (!strcmp(a, "--topk")) { NEXT(); o->topk = atoi(v); }
    else if (!strcmp(a, "--groups")) { NEXT(); o->groups = atoi(v); }
    else if (!strcmp(a, "--topk-groups")) { NEXT(); o->topk_groups = atoi(v); }
    else if (!strcmp(a, "--scaling")) { NEXT(); o->scaling = (float)atof(v); }
    else if (!strcmp(a, "--iters")) { NEXT(); o->iters = atoi(v); }
    else if (!strcmp(a, "--warmup")) { NEXT(); o->warmup = atoi(v); }
    else if (!strcmp(a, "--nvlink-direct")) o->nvlink_direct = 1;
    else if (!strcmp(a, "--token-rows")) o->token_rows = 1;
    else if (!strcmp(a, "--fp8-in")) o->fp8_in = 1;
    else if (!strcmp(a, "--share-gpus")) o->share_gpus = 1;
    else if (!strcmp(a, "--sms")) {
      NEXT();
      char buf[128];
      snprintf(buf, sizeof(buf), "%s", v);
      o->n_sms = 0;
      for (char *tok = strtok(buf, ","); tok && o->n_sms < 4; tok = strtok(NULL, ",")) o->sms[o->n_sms++] = atoi(tok);
    } else if (!strcmp(a, "--stats-file")) { NEXT(); snprintf(o->stats, sizeof(o->stats), "%s", v); }
    else if (!strcmp(a, "--out")) { NEXT(); snprintf(o->out, sizeof(o->out), "%s", v); }
    else if (!strcmp(a, "--seed")) { NEXT(); o->seed = strtoull(v, NULL, 10); }
    else if (!strcmp(a, "--timeout")) { NEXT(); o->timeout_s = atoi(v); }
    else {
      fprintf(stderr, "mplane-ep-bench: unknown option '%s'\n", a);
      usage(stderr);
      return -1;
    }
#undef NEXT
  }
  if (o->nodes < 1 || o->tokens < 1 || o->hidden < 128 || o->hidden % 128 || o->topk < 1 || o->iters < 1 ||
      o->groups < 1 || o->topk_groups < 1 || o->topk_groups > o->groups) {
    fprintf(stderr, "mplane-ep-bench: bad sizes (hidden a multiple of 128, topk-groups <= groups, all positive)\n");
    return -1;
  }
  return 0;
}

static int write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* A child that only asks CUDA how many GPUs there are (the launcher itself never touches CUDA). */
static int probe_gpus(char *why, size_t whylen) {
  int fds[2];
  if (pipe(fds)) return -1;
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    char msg[200];
    if (e != cudaSuccess) {
      n = 0;
      snprintf(msg, sizeof(msg), "%s", cudaGetErrorString(e));
    } else {
      snprintf(msg, sizeof(msg), "ok");
    }
    write_all(fds[1], &n, sizeof(n));
    write_all(fds[1], msg, sizeof(msg));
    _exit(0);
  }
  close(fds[1]);
  int n = -1;
  char msg[200] = "no answer";
  if (read(fds[0], &n, sizeof(n)) != (ssize_t)sizeof(n)) n = -1;
  if (read(fds[0], msg, sizeof(msg)) <= 0) snprintf(msg, sizeof(msg), "probe failed");
  msg[sizeof(msg) - 1] = 0;
  close(fds[0]);
  waitpid(pid, NULL, 0);
  snprintf(why, whylen, "%s", msg);
  return n;
}

static void run_ceiling(bench_opts *o) {
  int fds[2];
  if (pipe(fds)) return;
  fflush(stdout);
  pid_t pid = fork();
  if (pid == 0) {
    close(fds[0]);
    int rc = bench_ceiling_main(o, fds[1]);
    fflush(stdout);
    _exit(rc);
  }
  close(fds[1]);
  double v[3] = {0, 0, 0};
  if (read(fds[0], v, sizeof(v)) == (ssize_t)sizeof(v)) {
    o->ceil_uni = v[0];
    o->ceil_bi = v[1];
    o->ceil_local = v[2];
  }
  close(fds[0]);
  waitpid(pid, NULL, 0);
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* A rank that crashes says where: signal, faulting address and a backtrace (symbol names need the
 * -rdynamic -g of scripts/ep-bench.sh and meson.build), then dies of the same signal so that the
 * launcher still reports "killed by signal N". Async-signal-safe calls only. */
static int crash_rank = -1;

static void put_str(const char *s) {
  size_t n = strlen(s);
  while (n) {
    ssize_t w = write(2, s, n);
    if (w <= 0) return;
    s += w;
    n -= (size_t)w;
  }
}

static void put_num(unsigned long v, int base) {
  char buf[32];
  int i = (int)sizeof(buf) - 1;
  buf[i] = 0;
  do {
    buf[--i] = "0123456789abcdef"[v % (unsigned)base];
    v /= (unsigned)base;
  } while (v && i > 0);
  if (base == 16) buf[--i] = 'x', buf[--i] = '0';
  put_str(buf + i);
}

static void crash_handler(int sig, siginfo_t *si, void *uc) {
  (void)uc;
  put_str("mplane-ep-bench: [rank ");
  put_num((unsigned long)(crash_rank < 0 ? 0 : crash_rank), 10);
  put_str("] caught signal ");
  put_num((unsigned long)sig, 10);
  put_str(sig == SIGSEGV ? " (SIGSEGV)" : sig == SIGBUS ? " (SIGBUS)" : sig == SIGABRT ? " (SIGABRT)" : "");
  put_str(", fault address ");
  put_num((unsigned long)(uintptr_t)si->si_addr, 16);
  put_str(", si_code ");
  if (si->si_code < 0) put_str("-");
  put_num((unsigned long)(si->si_code < 0 ? -si->si_code : si->si_code), 10);
  put_str("; backtrace (addr2line -f -e <binary or .so> <offset> for lines):\n");
  void *bt[64];
  int n = backtrace(bt, 64);
  backtrace_symbols_fd(bt, n, 2);
  put_str("mplane-ep-bench: end of backtrace\n");
  signal(sig, SIG_DFL);
  raise(sig);
}

static void install_crash_handler(int rank) {
  crash_rank = rank;
  void *warm[2];
  backtrace(warm, 2); /* loads libgcc's unwinder now, not inside the handler */
  static char alt[1 << 16];
  stack_t ss;
  memset(&ss, 0, sizeof(ss));
  ss.ss_sp = alt;
  ss.ss_size = sizeof(alt);
  sigaltstack(&ss, NULL); /* a stack overflow still gets its backtrace */
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_sigaction = crash_handler;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, NULL);
  sigaction(SIGBUS, &sa, NULL);
  sigaction(SIGABRT, &sa, NULL);
  sigaction(SIGFPE, &sa, NULL);
  sigaction(SIGILL, &sa, NULL);
}

int main(int argc, char **argv) {
  bench_opts o;
  setvbuf(stdout, NULL, _IOLBF, 0);
  if (parse_args(argc, argv, &o)) return 2;
  char why[256];
  int ngpu = probe_gpus(why, sizeof(why));
  if (ngpu <= 0) {
    printf("mplane-ep-bench: SKIP: no GPU visible (cudaGetDeviceCount: %s)\n", why);
    return 77;
  }
  if (o.gpus <= 0) o.gpus = ngpu;
  if (o.gpus % o.nodes) {
    printf("mplane-ep-bench: %d GPUs do not split into %d nodes\n", o.gpus, o.nodes);
    return 2;
  }
  o.per_node = o.gpus / o.nodes;
  if (o.gpus > ngpu && !o.share_gpus) {
    printf("mplane-ep-bench: %d processes asked for (--gpus), %d GPU(s) visible. To run several processes on one GPU as\n"
           "  emulated nodes (each node its own NCCL_HOSTID, so the network phase goes through the net plugin), add\n"
           "  --share-gpus, with MPS running so that their kernels run side by side:\n"
           "    nvidia-cuda-mps-control -d && mplane-ep-bench --gpus %d --nodes %d --share-gpus ...\n"
           "  (scripts/ep-bench.sh does this by itself where fewer GPUs are visible than its shapes need)\n",
           o.gpus, ngpu, o.gpus, o.gpus);
    return 2;
  }
  if (o.gpus > ngpu && o.per_node > ngpu) {
    printf("mplane-ep-bench: --share-gpus: the %d ranks of an emulated node need %d different GPUs, %d visible "
           "(NCCL refuses two ranks of one host on one GPU); use more --nodes\n",
           o.per_node, o.per_node, ngpu);
    return 2;
  }
  int sharing = o.gpus > ngpu;
  printf("mplane-ep-bench: %d rank(s) as %d emulated node(s) of %d, on %d GPU(s)%s, modes%s%s%s%s\n", o.gpus, o.nodes,
         o.per_node, sharing ? ngpu : o.gpus, sharing ? " shared (--share-gpus)" : "",
         o.modes & MODE_CHECK ? " check" : "", o.modes & MODE_BYTES ? " bytes" : "", o.modes & MODE_BENCH ? " bench" : "",
         o.modes & MODE_CEILING ? " ceiling" : "");
  if (sharing) {
    const char *pipe_dir = getenv("CUDA_MPS_PIPE_DIRECTORY");
    char ctl[600];
    snprintf(ctl, sizeof(ctl), "%s/control", pipe_dir && *pipe_dir ? pipe_dir : "/tmp/nvidia-mps");
    if (access(ctl, F_OK) == 0)
      printf("mplane-ep-bench: MPS control daemon found (%s): the ranks sharing a GPU run side by side\n", ctl);
    else
      printf("mplane-ep-bench: NOTE: no MPS control daemon (%s absent): ranks sharing a GPU time-slice it, so the\n"
             "  checks hold but the times are not meaningful; start one with nvidia-cuda-mps-control -d\n", ctl);
  }
  if ((o.modes & MODE_CEILING) && ngpu >= 2) run_ceiling(&o);
  else if (o.modes & MODE_CEILING) printf("ceiling: one GPU only, no peer copy to measure\n");
  if (!(o.modes & (MODE_CHECK | MODE_BYTES | MODE_BENCH))) return 0;

  int up[2];
  if (pipe(up)) return 2;
  int *down_w = calloc((size_t)o.gpus, sizeof(int));
  pid_t *pids = calloc((size_t)o.gpus, sizeof(pid_t));
  if (!down_w || !pids) return 2;
  fflush(stdout);
  for (int r = 0; r < o.gpus; r++) {
    int down[2];
    if (pipe(down)) return 2;
    pid_t pid = fork();
    if (pid < 0) return 2;
    if (pid == 0) {
      close(down[1]);
      close(up[0]);
      for (int q = 0; q < r; q++) close(down_w[q]);
      if (r != 0) close(up[1]);
      install_crash_handler(r);
      char host[64];
      if (o.nodes > 1) {
        snprintf(host, sizeof(host), "mplane-ep-node%d", r / o.per_node);
        setenv("NCCL_HOSTID", host, 1);
      }
      setenv("NCCL_NVLS_ENABLE", "0", 1);
      /* ranks of different emulated nodes on one GPU: NCCL's own check is per host (NCCL_HOSTID) */
      if (sharing) setenv("NCCL_MULTI_RANK_GPU_ENABLE", "1", 0);
      if (o.stats[0]) setenv("MPLANE_STATS_FILE", o.stats, 1);
      rank_env env = {r, o.gpus, r % ngpu, r == 0 ? up[1] : -1, down[0]};
      int rc = bench_rank_main(&o, &env);
      fflush(stdout);
      fflush(stderr);
      _exit(rc);
    }
    close(down[0]);
    down_w[r] = down[1];
    pids[r] = pid;
  }
  close(up[1]);

  /* relay unique ids until rank 0 closes its end; watch the deadline */
  double deadline = now_s() + o.timeout_s;
  int alive = o.gpus, timed_out = 0, up_open = 1, worst = 0;
  int *status = calloc((size_t)o.gpus, sizeof(int));
  while (alive > 0) {
    if (up_open) {
      struct pollfd pf = {up[0], POLLIN, 0};
      int pr = poll(&pf, 1, 200);
      if (pr > 0) {
        unsigned char id[128];
        ssize_t got = 0;
        while (got < (ssize_t)sizeof(id)) {
          ssize_t n = read(up[0], id + got, sizeof(id) - (size_t)got);
          if (n <= 0) break;
          got += n;
        }
        if (got == (ssize_t)sizeof(id)) {
          for (int r = 0; r < o.gpus; r++)
            if (down_w[r] >= 0 && write_all(down_w[r], id, sizeof(id))) {
              close(down_w[r]);
              down_w[r] = -1;
            }
        } else {
          up_open = 0;
        }
      }
    } else {
      usleep(200000);
    }
    for (int r = 0; r < o.gpus; r++) {
      if (!pids[r]) continue;
      int st;
      pid_t w = waitpid(pids[r], &st, WNOHANG);
      if (w == pids[r]) {
        pids[r] = 0;
        alive--;
        status[r] = st;
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0);
        if (code) printf("mplane-ep-bench: rank %d %s %d\n", r, WIFEXITED(st) ? "exited with" : "killed by signal",
                         WIFEXITED(st) ? code : WTERMSIG(st));
        if (code > worst) worst = code;
        if (code && !timed_out) {
          /* a rank that failed leaves the others waiting in NCCL: give them 20 s, then stop them */
          if (deadline > now_s() + 20) deadline = now_s() + 20;
        }
      }
    }
    if (alive > 0 && now_s() > deadline) {
      timed_out = 1;
      printf("mplane-ep-bench: ranks still running at the deadline: stopping them\n");
      for (int r = 0; r < o.gpus; r++)
        if (pids[r]) kill(pids[r], SIGTERM);
      sleep(3);
      for (int r = 0; r < o.gpus; r++)
        if (pids[r]) kill(pids[r], SIGKILL);
      deadline = now_s() + 1e9;
    }
  }
  for (int r = 0; r < o.gpus; r++)
    if (down_w[r] >= 0) close(down_w[r]);
  close(up[0]);
  int ok = !timed_out && worst == 0;
  printf("mplane-ep-bench: %s\n", ok ? "PASS (every rank)" : timed_out ? "FAIL (timeout)" : "FAIL");
  free(status);
  free(down_w);
  free(pids);
  return ok ? 0 : 1;
}
