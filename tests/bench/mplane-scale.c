/* mplane-scale: what one rank of an all-to-all costs in threads and file descriptors, and how long
 * its set-up takes, against the number of peers.
 *
 *   mplane-scale [--plugin PATH] --peers N [--big BYTES] [--max-threads T] [--max-fds-per-peer F]
 *
 * Two processes: the measured rank, and one that plays its N peers. Both drive the plugin through
 * ncclNet_v12 as NCCL's proxy thread does: N listen comms, whose handles go to the other side; N
 * connects and N accepts, each called again while it answers NULL, all in one loop (no call may
 * block); listen comms closed once accepted. Then 8 bytes, and --big bytes (1 MiB), to and from
 * every peer at once, every byte checked. The rank reports its threads and open file descriptors
 * (before the plugin was loaded, and after each phase; per peer = the growth divided by N), the
 * set-up time and each exchange's time. Before anything it raises its open-file limit to the hard
 * limit (the peers' process too).
 *
 * --max-threads and --max-fds-per-peer make it a check (exit 1 past them): counts, never times.
 * --nofile N lowers the rank's open-file limit to N and --expect-warn TEXT makes a plugin error the
 * pass, once a WARN containing TEXT came first (running out must be said, never silent).
 * Any plugin error, a connection not made in 120 s, or a wrong byte fails it (exit 1). */
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/nccl/net.h"

#define HANDLE_BYTES NCCL_NET_HANDLE_MAXSIZE
#define TAG 7

static const char *g_who = "rank";
static const char *g_expect_warn; /* --expect-warn: a plugin error after a WARN saying this is the pass */
static int g_warned;

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "mplane-scale (%s): ", g_who);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

static void plugin_failed(const char *call, int res, int line) {
  if (g_expect_warn && g_warned) {
    printf("%s failed (%d) after the WARN expected ('%s'): as it should\n", call, res, g_expect_warn);
    fflush(stdout);
    _exit(0);
  }
  die("%s failed: %d (line %d)%s", call, res, line, g_expect_warn ? " without the WARN expected" : "");
}

#define NCHECK(call)                                   \
  do {                                                 \
    ncclResult_t r_ = (call);                          \
    if (r_ != ncclSuccess) plugin_failed(#call, r_, __LINE__); \
  } while (0)

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if (level != NCCL_LOG_WARN && !getenv("MPLANE_SCALE_VERBOSE")) return;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_WARN && g_expect_warn && strstr(msg, g_expect_warn)) g_warned = 1;
  fprintf(stderr, "mplane-scale (%s) %s: %s\n", g_who, level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int count_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  struct dirent *e;
  while ((e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  closedir(d);
  return n - (strstr(path, "/fd") ? 1 : 0); /* the DIR's own fd */
}

static long raise_nofile(void) {
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  getrlimit(RLIMIT_NOFILE, &rl);
  return (long)rl.rlim_cur;
}

static void xwrite(int fd, const void *p, size_t n) {
  while (n) {
    ssize_t w = write(fd, p, n);
    if (w <= 0) die("pipe write: %s", strerror(errno));
    p = (const char *)p + w;
    n -= (size_t)w;
  }
}

static void xread(int fd, void *p, size_t n) {
  while (n) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) die("the other process went away");
    p = (char *)p + r;
    n -= (size_t)r;
  }
}

struct side {
  ncclNet_v12_t *net;
  void *ctx;
  int n;
  void **lc, **sc, **rc;
  int to, from; /* pipe ends to and from the other process */
};

static void open_plugin(struct side *s, const char *path) {
  void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("cannot load %s: %s", path, dlerror());
  s->net = dlsym(lib, "ncclNetPlugin_v12");
  if (!s->net) die("%s exports no ncclNetPlugin_v12", path);
  ncclNetCommConfig_v12_t cfg = {NCCL_NET_TRAFFIC_CLASS_UNDEF};
  NCHECK(s->net->init(&s->ctx, 1, &cfg, logger, NULL));
}

/* listen N times, swap handles, then connect and accept everything in one non-blocking loop. */
static void connect_all(struct side *s, int me) {
  int n = s->n;
  char *mine = calloc((size_t)n, HANDLE_BYTES), *theirs = calloc((size_t)n, HANDLE_BYTES);
  s->lc = calloc((size_t)n, sizeof(void *));
  s->sc = calloc((size_t)n, sizeof(void *));
  s->rc = calloc((size_t)n, sizeof(void *));
  for (int i = 0; i < n; i++) NCHECK(s->net->listen(s->ctx, 0, mine + (size_t)i * HANDLE_BYTES, &s->lc[i]));
  if (me == 1) xread(s->from, theirs, (size_t)n * HANDLE_BYTES); /* one at a time: more than a pipe holds */
  xwrite(s->to, mine, (size_t)n * HANDLE_BYTES);
  if (me == 0) xread(s->from, theirs, (size_t)n * HANDLE_BYTES);
  int left = 2 * n;
  double t0 = now();
  while (left > 0) {
    for (int i = 0; i < n; i++) {
      if (!s->sc[i]) {
        NCHECK(s->net->connect(s->ctx, 0, theirs + (size_t)i * HANDLE_BYTES, &s->sc[i], NULL));
        if (s->sc[i]) left--;
      }
      if (!s->rc[i]) {
        NCHECK(s->net->accept(s->lc[i], &s->rc[i], NULL));
        if (s->rc[i]) {
          left--;
          NCHECK(s->net->closeListen(s->lc[i])); /* as NCCL does once it accepted */
          s->lc[i] = NULL;
        }
      }
    }
    if (now() - t0 > 60) die("%d of %d comms not made in 60 s", left, 2 * n);
  }
  free(mine);
  free(theirs);
}

/* `size` bytes to and from every peer at once; each receive checked. me: 0 the rank, 1 the peers. */
static double exchange(struct side *s, size_t size, int me) {
  int n = s->n;
  unsigned char **sb = calloc((size_t)n, sizeof(void *)), **rb = calloc((size_t)n, sizeof(void *));
  void **smh = calloc((size_t)n, sizeof(void *)), **rmh = calloc((size_t)n, sizeof(void *));
  void **sreq = calloc((size_t)n, sizeof(void *)), **rreq = calloc((size_t)n, sizeof(void *));
  for (int i = 0; i < n; i++) {
    sb[i] = malloc(size);
    rb[i] = malloc(size);
    if (!sb[i] || !rb[i]) die("out of memory for %d x %zu bytes", n, size);
    for (size_t k = 0; k < size; k++) sb[i][k] = (unsigned char)(k * 13 + (size_t)i * 7 + (size_t)me);
    memset(rb[i], 0xee, size);
    NCHECK(s->net->regMr(s->sc[i], sb[i], size, NCCL_PTR_HOST, &smh[i]));
    NCHECK(s->net->regMr(s->rc[i], rb[i], size, NCCL_PTR_HOST, &rmh[i]));
  }
  char go = 0;
  xwrite(s->to, &go, 1); /* both sides start together */
  xread(s->from, &go, 1);
  double t0 = now();
  int left = 2 * n;
  while (left > 0) {
    for (int i = 0; i < n; i++) {
      if (rreq[i] == NULL) {
        void *d = rb[i];
        size_t sz = size;
        int tag = TAG;
        NCHECK(s->net->irecv(s->rc[i], 1, &d, &sz, &tag, &rmh[i], NULL, &rreq[i]));
      }
      if (sreq[i] == NULL) NCHECK(s->net->isend(s->sc[i], sb[i], size, TAG, smh[i], NULL, &sreq[i]));
      int done = 0, got = 0;
      if (rreq[i] && rreq[i] != (void *)1) {
        NCHECK(s->net->test(rreq[i], &done, &got));
        if (done) {
          if ((size_t)got != size) die("peer %d: received %d bytes, expected %zu", i, got, size);
          for (size_t k = 0; k < size; k++)
            if (rb[i][k] != (unsigned char)(k * 13 + (size_t)i * 7 + (size_t)(1 - me)))
              die("peer %d: byte %zu of %zu is wrong", i, k, size);
          rreq[i] = (void *)1;
          left--;
        }
      }
      if (sreq[i] && sreq[i] != (void *)1) {
        NCHECK(s->net->test(sreq[i], &done, &got));
        if (done) {
          sreq[i] = (void *)1;
          left--;
        }
      }
    }
    if (now() - t0 > 60) die("%d of %d transfers of %zu bytes not done in 60 s", left, 2 * n, size);
  }
  double dt = now() - t0;
  xwrite(s->to, &go, 1); /* neither side frees its buffers while the other may still read them */
  xread(s->from, &go, 1);
  for (int i = 0; i < n; i++) {
    NCHECK(s->net->deregMr(s->sc[i], smh[i]));
    NCHECK(s->net->deregMr(s->rc[i], rmh[i]));
    free(sb[i]);
    free(rb[i]);
  }
  free(sb);
  free(rb);
  free(smh);
  free(rmh);
  free(sreq);
  free(rreq);
  return dt;
}

static void close_all(struct side *s) {
  for (int i = 0; i < s->n; i++) {
    NCHECK(s->net->closeSend(s->sc[i]));
    NCHECK(s->net->closeRecv(s->rc[i]));
  }
  NCHECK(s->net->finalize(s->ctx));
  free(s->lc); /* the rank's arrays too: LeakSanitizer (tests/abi/sanitize.sh) runs this harness */
  free(s->sc);
  free(s->rc);
}

int main(int argc, char **argv) {
  const char *plugin = "libnccl-net-mplane.so";
  int n = 0, max_threads = 0;
  double max_fpp = 0;
  size_t big = 1 << 20;
  long nofile_rank = 0;
  static struct option lo[] = {{"plugin", 1, 0, 'p'}, {"peers", 1, 0, 'n'}, {"big", 1, 0, 'b'},
                               {"max-threads", 1, 0, 't'}, {"max-fds-per-peer", 1, 0, 'f'},
                               {"nofile", 1, 0, 'o'}, {"expect-warn", 1, 0, 'w'}, {0, 0, 0, 0}};
  for (int c; (c = getopt_long(argc, argv, "", lo, NULL)) != -1;) {
    char *end = NULL;
    switch (c) {
      case 'p': plugin = optarg; break;
      case 'n': n = (int)strtol(optarg, &end, 10); break;
      case 'b': big = (size_t)strtoull(optarg, &end, 10); break;
      case 't': max_threads = (int)strtol(optarg, &end, 10); break;
      case 'f': max_fpp = strtod(optarg, &end); break;
      case 'o': nofile_rank = strtol(optarg, &end, 10); break;
      case 'w': g_expect_warn = optarg; break;
      default:
        fprintf(stderr, "usage: mplane-scale [--plugin PATH] --peers N [--big BYTES] [--max-threads T] "
                        "[--max-fds-per-peer F] [--nofile N --expect-warn TEXT]\n");
        return 2;
    }
    if (end && *end) {
      fprintf(stderr, "mplane-scale: --%s: '%s' is not a number\n", lo[0].name, optarg);
      return 2;
    }
  }
  if (n < 1 || n > 100000 || big < 1 || big > (1u << 28)) {
    fprintf(stderr, "mplane-scale: --peers 1..100000 and --big 1..256M are required\n");
    return 2;
  }
  signal(SIGPIPE, SIG_IGN);
  long nofile = raise_nofile();
  int p2c[2], c2p[2];
  if (pipe(p2c) || pipe(c2p)) die("pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) die("fork: %s", strerror(errno));
  struct side s = {.n = n};
  if (pid == 0) { /* the peers: they go with the rank, whatever way it ends */
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() == 1) _exit(1);
    g_who = "peers";
    s.to = c2p[1];
    s.from = p2c[0];
    open_plugin(&s, plugin);
    connect_all(&s, 1);
    exchange(&s, 8, 1);
    exchange(&s, big, 1);
    close_all(&s);
    _exit(0);
  }
  s.to = p2c[1];
  s.from = c2p[0];
  if (nofile_rank > 0) { /* the rank alone runs short of descriptors (--nofile) */
    struct rlimit rl;
    getrlimit(RLIMIT_NOFILE, &rl);
    rl.rlim_cur = (rlim_t)nofile_rank;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0) die("cannot lower the open-file limit to %ld", nofile_rank);
    nofile = nofile_rank;
  }
  int fds0 = count_dir("/proc/self/fd"), thr0 = count_dir("/proc/self/task");
  double t0 = now();
  open_plugin(&s, plugin);
  connect_all(&s, 0);
  double setup = now() - t0;
  fprintf(stderr, "mplane-scale: %d peers connected in %.2f s\n", n, setup);
  int fds1 = count_dir("/proc/self/fd"), thr1 = count_dir("/proc/self/task");
  double t8 = exchange(&s, 8, 0);
  int fds2 = count_dir("/proc/self/fd"), thr2 = count_dir("/proc/self/task");
  double tbig = exchange(&s, big, 0);
  int fds3 = count_dir("/proc/self/fd"), thr3 = count_dir("/proc/self/task");
  close_all(&s);
  int st = 0;
  if (waitpid(pid, &st, 0) != pid || !WIFEXITED(st) || WEXITSTATUS(st) != 0) die("the peers' process failed");
  double fpp1 = (double)(fds1 - fds0) / n, fpp2 = (double)(fds2 - fds0) / n, fpp3 = (double)(fds3 - fds0) / n;
  printf("peers %d, open-file limit %ld\n", n, nofile);
  printf("set-up     %.2f s: %d threads, %d fds (%.2f per peer)\n", setup, thr1, fds1, fpp1);
  printf("8 B        %.3f s: %d threads, %d fds (%.2f per peer)\n", t8, thr2, fds2, fpp2);
  printf("%-10zu %.3f s: %d threads, %d fds (%.2f per peer)\n", big, tbig, thr3, fds3, fpp3);
  printf("before the plugin: %d threads, %d fds\n", thr0, fds0);
  int bad = 0;
  int threads = thr3 > thr2 ? thr3 : thr2;
  double fpp = fpp3 > fpp2 ? fpp3 : fpp2;
  if (max_threads && threads > max_threads) {
    printf("FAIL: %d threads in the rank, at most %d allowed\n", threads, max_threads);
    bad = 1;
  }
  if (max_fpp > 0 && fpp > max_fpp) {
    printf("FAIL: %.2f fds per peer, at most %.2f allowed\n", fpp, max_fpp);
    bad = 1;
  }
  return bad;
}
