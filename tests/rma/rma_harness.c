/* mplane RMA harness: dlopens the plugin and drives ncclRmaPlugin_v14 the way NCCL 2.30's GIN proxy
 * does (init, devices, getProperties, listen, connect as a group, closeListen, createContext,
 * symmetric regMrSym, then iput / iputSignal / iget / iflush polled with test, queryLastError, and
 * the teardown), between N processes over loopback. Every byte is checked.
 *
 *   rma-harness --plugin PATH [--ranks N] [--big] [--gpu] [--no-progress] SCENARIO
 *
 * MPLANE_RMA_ENV_<r> (space-separated NAME=VALUE pairs) is set in rank r's process before it loads
 * the plugin: ranks on different devices of one machine (the rxe suite puts even ranks on rxe0 and
 * odd ones on rxe1).
 *
 * --gpu puts the windows and signals of alltoall, order and eplike in GPU memory (exit 77 without a
 * GPU).
 * While it waits, each rank calls rmaProgress as NCCL's GIN progress thread does (the socket
 * transport then serves its peers from that thread); --no-progress never calls it, so the plugin's
 * own threads must serve everything.
 *
 * Scenarios:
 *   data     puts with signals at random offsets and sizes on several contexts, into disjoint
 *            regions of each rank's window (its own included); the target checks each region, the gaps between them
 *            (still zero) and a guard past the window; then gets of random ranges of each peer's
 *            pattern window; with --big a 64 MiB put and a 64 MiB get per peer; size-0 ops
 *   order    on one context, put j writes region j and adds 1 to a signal: whenever the target
 *            reads signal value v, regions 0..v-1 must be whole (a signal never before its data)
 *   oob      ranges outside a window (put, get, signal), an unknown signal op, a local range past
 *            the source window, a rank that is not connected: each refused with an error, nothing
 *            written, queryLastError says so, and the connection still carries a valid put after
 *   alltoall what nccl-tests' GIN all-to-all kernel does: rounds of puts to every rank (itself
 *            included), 0 B .. 256 KiB, each adding 1 to the same signal word of its target
 *   eplike   what NCCL EP's low-latency dispatch posts: 128 contexts; per round, on every context, to
 *            every rank (itself included), 3..17 token-sized plain puts into a slot per (source,
 *            context), then a signal alone adding that count to a word per (context, source) of a
 *            NEVER_RESET signal window; each word must step from its value before to exactly that plus
 *            the count (values accumulate over rounds), and its slot is checked that moment
 *   stride   rankStride 2 (N = 4): ranks at an even distance are reached, odd ones refused
 *   stall    the last rank stops (SIGSTOP) with its sockets open; the others' ops to it fail once
 *            MPLANE_CONNECT_TIMEOUT has passed, not before, and destroying the context returns
 *   regfail  the last rank's regMrSym fails (a memory type NCCL does not define): every rank's fails,
 *            within seconds, no handle; the windows registered before still carry a put
 *   rate     timed (a benchmark, suite bench): rounds of 32 signal-only puts from every rank to every
 *            other at once, as a GIN barrier posts them; prints us per round and per op
 *   dmabuf   a window registered with regMrSymDmaBuf (a memfd as the dma-buf, its fd closed at once):
 *            puts with signals from every rank land in it, every byte checked
 *   kill     the last rank exits without closing anything; the others' puts and gets to it end in
 *            an error from test and queryLastError within the deadline, never a hang
 *   noroute  createContext must fail, within seconds (ranks on planes no device of theirs can
 *            connect: MPLANE_RELAY=off, or no NIC on the peer's plane), with the WARN asked for
 *   gpurelay 2 ranks on different planes, each with a window and a signal window registered as GPU
 *            memory (memfds as their dma-bufs): both ranks at once put (with signals on the peer's
 *            GPU signal window) from their GPU window and from host memory into the peer's GPU
 *            window, and get from it into their GPU window and into host memory; every byte checked
 *   staged   (--big --gpu-dmabuf, 2 ranks on two planes) rank 0 puts 64 MiB from its GPU window (then
 *            a signal alone, which must not pass it) and gets 64 MiB into one, through its staging
 *            ring, and an odd-sized put with its signal; every byte checked
 *   stagefault (--gpu-dmabuf, MPLANE_TEST_RELAY_FAIL=copy:N) rank 0's staged put and get lose a copy:
 *            errors from test and queryLastError, no signal, nothing outside their ranges, no wrong byte
 *   getflush every rank gets from every rank (itself included) into a window registered as GPU memory
 *            (a memfd dma-buf), waits for the gets, then iflushes each peer with its GPU signal window as
 *            NCCL's GIN proxy does: the flush must be a request (a GPU needs one) and, once done, every
 *            byte must be there (the verbs double holds READ data back from GPU memory until a flush);
 *            gets into host memory alone need no flush (a NULL request)
 *
 * --gpu-dmabuf makes the receive, source, signal and big windows memfd dma-bufs registered as
 * NCCL_PTR_CUDA (the plugin takes them for GPU memory; no GPU needed: the CPU copier and the verbs
 * double reach them), so every rank's ops land in its peers' GPU windows.
 * --target R: the rank the order scenario streams to (0 by default).
 *
 * MPLANE_RMA_EXPECT_WARN=<text>: a WARN containing text must appear in every rank
 * (MPLANE_RMA_EXPECT_WARN_<r>: in rank r, instead).
 * MPLANE_RMA_EXPECT_RANK_PLANES=p0,p1,...: the ranks' planes; with MPLANE_STATS_FILE, alltoall checks
 * that each plane's record holds exactly the bytes put on connections it carries (a rank's puts to a
 * peer on another plane leave from its NIC on the peer's plane: that plane's record, relayed). */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tcp_segs.h"
#include "tests/test_hooks_check.h"
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

static struct shared *shm;
static int g_rank, g_n, g_big, g_gpu;
static int g_gpu_dmabuf; /* --gpu-dmabuf: the source and big windows are "GPU" memfd dma-bufs (no GPU needed) */
static int g_target;     /* --target R: the rank the order scenario streams to */
static int g_no_progress; /* --no-progress: never call rmaProgress (the plugin's own threads serve) */
static void *g_ctx;       /* the context rmaProgress is called on while waiting, as NCCL's GIN proxy does */
static uint64_t g_src_size; /* the pattern window: BIG with --big, else 4 MiB */
static const ncclRma_v14_t *rma;

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "rank %d: FAIL: ", g_rank);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  _exit(1);
}

#define CHECK(call)                                                           \
  do {                                                                        \
    ncclResult_t r_ = (call);                                                 \
    if (r_ != ncclSuccess) die("%s returned %d (line %d)", #call, r_, __LINE__); \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Barrier number `id` (each used once) across `count` ranks, bounded. */
static void progress(void);

/* Barriers keep calling rmaProgress: NCCL's progress thread never stops for the application. */
static void barrier_of(int id, int count) {
  __atomic_fetch_add(&shm->arrived[id], 1, __ATOMIC_SEQ_CST);
  double t0 = now_s();
  while (__atomic_load_n(&shm->arrived[id], __ATOMIC_SEQ_CST) < count) {
    if (now_s() - t0 > DEADLINE_S) die("barrier %d: only %d of %d ranks arrived", id, shm->arrived[id], g_n);
    progress();
    sched_yield();
  }
}

static void barrier(int id) { barrier_of(id, g_n); }

/* The k-th crossing (k = 0, 1, ...) of a barrier used many times. */
static void barrier_round(long k) {
  __atomic_fetch_add(&shm->rounds, 1, __ATOMIC_SEQ_CST);
  double t0 = now_s();
  while (__atomic_load_n(&shm->rounds, __ATOMIC_SEQ_CST) < (k + 1) * g_n) {
    if (now_s() - t0 > DEADLINE_S) die("round %ld: not every rank arrived", k);
    progress();
    sched_yield();
  }
}

static uint8_t pat(int rank, uint64_t off) { return (uint8_t)(rank * 131 + off * 7 + (off >> 12) + 1); }

static uint64_t rng_state;
static uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
static void seed(int src, int dst, int salt) { rng_state = 0x9e3779b97f4a7c15ull ^ ((uint64_t)src << 40) ^ ((uint64_t)dst << 20) ^ (uint64_t)salt; rnd(); }

/* Sizes: 0, 1, the whole region, and random ones in between. */
static uint64_t pick_size(int i, uint64_t max) {
  if (i == 0) return 0;
  if (i == 1) return 1;
  if (i == 2) return max;
  return rnd() % (max + 1);
}

/* The random put i from src to dst: its size, source offset, and offset in dst's window. */
static void put_plan(int src, int dst, int i, uint64_t *size, uint64_t *soff, uint64_t *doff) {
  seed(src, dst, i);
  *size = pick_size(i, SUB);
  *soff = rnd() % (g_src_size - *size + 1);
  *doff = ((uint64_t)src * K + (uint64_t)i) * SUB + rnd() % (SUB - *size + 1);
}

/* What NCCL's GIN progress thread does between polls: let the backend move bytes (and serve its
 * peers) from this thread. */
static void progress(void) {
  if (g_ctx && !g_no_progress && rma->rmaProgress && rma->rmaProgress(g_ctx) != ncclSuccess)
    die("rmaProgress failed");
}

/* Poll requests until all are done; a failure is fatal unless want_err, where it counts. */
static int wait_reqs(void *cc, void **reqs, int n, int want_err) {
  int errors = 0;
  double t0 = now_s();
  for (int left = n; left > 0;) {
    for (int i = 0; i < n; i++) {
      if (!reqs[i]) continue;
      int done = 0;
      ncclResult_t r = rma->test(cc, reqs[i], &done);
      if (r != ncclSuccess) {
        if (!want_err) die("test returned %d", r);
        errors++;
        reqs[i] = NULL;
        left--;
        continue;
      }
      if (done) {
        reqs[i] = NULL;
        left--;
      }
    }
    if (now_s() - t0 > DEADLINE_S) die("%d requests not done after %d s", left, DEADLINE_S);
    progress();
  }
  return errors;
}

/* --gpu: the receive, source and signal windows live in GPU memory (the CUDA driver, dlopened in each
 * rank after the fork), registered as NCCL_PTR_CUDA, as NCCL's GIN proxy registers its windows and
 * signals; the checks copy what they read back first. */
typedef unsigned long long cu_ptr;
static struct {
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*ctx_retain)(void **, int);
  int (*ctx_set)(void *);
  int (*mem_alloc)(cu_ptr *, size_t);
  int (*htod)(cu_ptr, const void *, size_t);
  int (*dtoh)(void *, cu_ptr, size_t);
} cu;

/* 0: the GPU is ready; 77: there is none (the test is skipped, with the reason). */
static int gpu_open(void) {
  const char *libname = getenv("MPLANE_CUDA_LIB"); /* the plugin's test hook: both must load the same driver */
  void *lib = dlopen(libname && *libname ? libname : "libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    printf("rank %d: no CUDA driver (%s): skipped\n", g_rank, dlerror());
    return 77;
  }
  *(void **)&cu.init = dlsym(lib, "cuInit");
  *(void **)&cu.device_get = dlsym(lib, "cuDeviceGet");
  *(void **)&cu.ctx_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
  *(void **)&cu.ctx_set = dlsym(lib, "cuCtxSetCurrent");
  *(void **)&cu.mem_alloc = dlsym(lib, "cuMemAlloc_v2");
  *(void **)&cu.htod = dlsym(lib, "cuMemcpyHtoD_v2");
  *(void **)&cu.dtoh = dlsym(lib, "cuMemcpyDtoH_v2");
  if (!cu.init || !cu.device_get || !cu.ctx_retain || !cu.ctx_set || !cu.mem_alloc || !cu.htod || !cu.dtoh)
    die("libcuda.so.1 lacks a driver call this test uses");
  int dev = 0;
  void *ctx = NULL;
  if (cu.init(0) != 0 || cu.device_get(&dev, 0) != 0) {
    printf("rank %d: no usable GPU (cuInit/cuDeviceGet failed): skipped\n", g_rank);
    return 77;
  }
  if (cu.ctx_retain(&ctx, dev) != 0 || cu.ctx_set(ctx) != 0) die("no context on GPU 0");
  return 0;
}

static void *gpu_alloc_copy(const void *host, size_t n) {
  cu_ptr p = 0;
  if (cu.mem_alloc(&p, n) != 0 || cu.htod(p, host, n) != 0) die("cuMemAlloc/HtoD of %zu bytes failed", n);
  return (void *)(uintptr_t)p;
}

static void gpu_fetch(void *host, const void *dev, size_t n) {
  if (cu.dtoh(host, (cu_ptr)(uintptr_t)dev, n) != 0) die("cuMemcpyDtoH of %zu bytes failed", n);
}

/* --gpu-dmabuf: a window that the plugin takes for GPU memory, without a GPU: a memfd mapped here and
 * registered through regMrSymDmaBuf as NCCL_PTR_CUDA (its fd closed at once, as NCCL's proxy does).
 * The plugin's CPU copier (MPLANE_TEST_RELAY_COPIER=cpu) and the verbs double both reach it, so
 * its bytes can be checked in place. */
static void *fake_gpu_window_in(void *cc, size_t size, size_t mapped, const void *init, uint64_t flags, void **mh) {
  int fd = memfd_create("mplane-rma-fake-gpu", 0);
  if (fd < 0 || ftruncate(fd, (off_t)mapped) != 0) die("memfd: %s", strerror(errno));
  char *win = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (win == MAP_FAILED) die("mmap of the memfd: %s", strerror(errno));
  if (init) memcpy(win, init, mapped);
  CHECK(rma->regMrSymDmaBuf(cc, win, size, NCCL_PTR_CUDA, 0, fd, flags, mh));
  close(fd);
  return win;
}

static void *fake_gpu_window(void *cc, size_t size, const void *init, void **mh) {
  return fake_gpu_window_in(cc, size, size, init, 0, mh);
}

struct env {
  void *ctx, *cc, *rc;
  char *recv, *src, *getw, *big;
  uint64_t *sig;
  char *d_recv, *d_src;  /* --gpu: the GPU windows (recv, src, sig mirror them on the host) */
  uint64_t *d_sig;
  void *mh_recv, *mh_src, *mh_getw, *mh_big, *mh_sig;
  size_t recv_size, getw_size;
};

static int connected(int p, int stride) { return p != g_rank && ((p - g_rank + g_n) % g_n) % stride == 0; }

static const char *expected_warn(void) {
  char name[40];
  snprintf(name, sizeof(name), "MPLANE_RMA_EXPECT_WARN_%d", g_rank);
  return getenv(name) ? getenv(name) : getenv("MPLANE_RMA_EXPECT_WARN");
}

/* The plugin's log (NCCL's logger stands here): WARNs to stderr as before; the cross-plane INFO noted. */
static int g_saw_cross_plane, g_saw_warn;
static void harness_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt,
                           ...) {
  (void)flags;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (strstr(msg, "listen on other planes")) g_saw_cross_plane = 1; /* plugin/rma_plugin.c */
  const char *want = expected_warn();
  if (level == NCCL_LOG_WARN && want && strstr(msg, want)) g_saw_warn = 1;
  if (level == NCCL_LOG_WARN) fprintf(stderr, "WARN %s\n", msg);
  else if (getenv("MPLANE_DEBUG") && atoi(getenv("MPLANE_DEBUG")) > 0) fprintf(stderr, "%s:%d %s\n", file, line, msg);
}

/* nctx: the contexts createContext makes (NCCL EP asks for 128, the other scenarios for NCTX). */
static void setup_contexts(struct env *e, int stride, int nctx) {
  CHECK(rma->init(&e->ctx, 0x5eed, harness_logger));
  int ndev = 0;
  CHECK(rma->devices(&ndev));
  if (ndev < 1) die("devices() reported %d devices", ndev);
  ncclNetProperties_v12_t props;
  CHECK(rma->getProperties(0, &props));
  if (props.netDeviceType != NCCL_NET_DEVICE_GIN_PROXY) die("netDeviceType %d, not GIN_PROXY", props.netDeviceType);
  if (!(props.ptrSupport & NCCL_PTR_HOST) || !(props.ptrSupport & NCCL_PTR_CUDA))
    die("ptrSupport 0x%x lacks HOST or CUDA", props.ptrSupport);
  void *lc;
  CHECK(rma->listen(e->ctx, 0, shm->handles[g_rank], &lc));
  barrier(0);
  void *h[MAX_RANKS];
  for (int i = 0; i < g_n; i++) h[i] = shm->handles[i];
  CHECK(rma->connect(e->ctx, h, g_n, g_rank, lc, &e->cc));
  CHECK(rma->closeListen(lc));
  ncclRmaConfig_v14_t cfg = {.nContexts = nctx, .trafficClass = 2 /* alltoall */, .rankStride = stride};
  CHECK(rma->createContext(e->cc, &cfg, &e->rc));
  g_ctx = e->rc;
  /* Windows, in the same order on every rank (symmetric registration). */
  e->recv_size = (size_t)g_n * K * SUB;
  e->getw_size = (size_t)K * SUB;
  e->recv = calloc(1, e->recv_size + GUARD);
  e->src = malloc(g_src_size);
  e->getw = calloc(1, e->getw_size);
  e->sig = calloc(64, sizeof(uint64_t));
  if (!e->recv || !e->src || !e->getw || !e->sig) die("out of memory");
  memset(e->recv + e->recv_size, 0xA5, GUARD);
  for (uint64_t o = 0; o < g_src_size; o++) e->src[o] = (char)pat(g_rank, o);
  int type = g_gpu ? NCCL_PTR_CUDA : NCCL_PTR_HOST;
  if (g_gpu) {
    e->d_recv = gpu_alloc_copy(e->recv, e->recv_size + GUARD);
    e->d_src = gpu_alloc_copy(e->src, g_src_size);
    e->d_sig = gpu_alloc_copy(e->sig, 64 * sizeof(uint64_t));
  }
  if (g_gpu_dmabuf) { /* the guard past the window is mapped, not registered */
    char *w = fake_gpu_window_in(e->cc, e->recv_size, e->recv_size + GUARD, e->recv, 0, &e->mh_recv);
    free(e->recv);
    e->recv = w;
  } else {
    CHECK(rma->regMrSym(e->cc, g_gpu ? e->d_recv : e->recv, e->recv_size, type, 0, &e->mh_recv));
  }
  if (g_gpu_dmabuf) {
    char *w = fake_gpu_window(e->cc, g_src_size, e->src, &e->mh_src);
    free(e->src);
    e->src = w;
  } else {
    CHECK(rma->regMrSym(e->cc, g_gpu ? e->d_src : e->src, g_src_size, type, 0, &e->mh_src));
  }
  CHECK(rma->regMrSym(e->cc, e->getw, e->getw_size, NCCL_PTR_HOST, 0, &e->mh_getw));
  if (g_gpu_dmabuf) { /* NCCL keeps its GIN signals in GPU memory */
    uint64_t *w = fake_gpu_window_in(e->cc, 32 * sizeof(uint64_t), 64 * sizeof(uint64_t), e->sig,
                                     NCCL_NET_MR_FLAG_FORCE_SO | NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET, &e->mh_sig);
    free(e->sig);
    e->sig = w;
  } else {
    CHECK(rma->regMrSym(e->cc, g_gpu ? (void *)e->d_sig : (void *)e->sig, 32 * sizeof(uint64_t), type,
                        NCCL_NET_MR_FLAG_FORCE_SO | NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET, &e->mh_sig));
  }
  if (g_big) {
    if (g_gpu_dmabuf) {
      e->big = fake_gpu_window(e->cc, BIG, NULL, &e->mh_big);
    } else {
      if (!(e->big = calloc(1, BIG))) die("out of memory");
      CHECK(rma->regMrSym(e->cc, e->big, BIG, NCCL_PTR_HOST, 0, &e->mh_big));
    }
  }
  barrier(1);
}

static void setup(struct env *e, int stride) { setup_contexts(e, stride, NCTX); }

static void teardown(struct env *e) {
  bool err = true;
  CHECK(rma->queryLastError(e->rc, &err));
  if (err) die("queryLastError reports an error after a clean run");
  if (e->mh_big) CHECK(rma->deregMrSym(e->cc, e->mh_big));
  CHECK(rma->deregMrSym(e->cc, e->mh_sig));
  CHECK(rma->deregMrSym(e->cc, e->mh_getw));
  CHECK(rma->deregMrSym(e->cc, e->mh_src));
  CHECK(rma->deregMrSym(e->cc, e->mh_recv));
  g_ctx = NULL;
  CHECK(rma->destroyContext(e->rc));
  CHECK(rma->closeColl(e->cc));
  CHECK(rma->finalize(e->ctx));
}

static uint64_t sig_read(struct env *e, int word) {
  if (e->d_sig) gpu_fetch(&e->sig[word], &e->d_sig[word], sizeof(uint64_t));
  return __atomic_load_n(&e->sig[word], __ATOMIC_ACQUIRE);
}

/* The host copy of the receive window's [off, off + n), fresh from the GPU under --gpu. */
static const char *recv_at(struct env *e, uint64_t off, uint64_t n) {
  if (e->d_recv && n) gpu_fetch(e->recv + off, e->d_recv + off, n);
  return e->recv + off;
}

static void wait_signal(struct env *e, int word, uint64_t want) {
  double t0 = now_s();
  while (sig_read(e, word) < want) {
    if (now_s() - t0 > DEADLINE_S) die("signal %d is %llu after %d s, expected %llu", word,
                                       (unsigned long long)sig_read(e, word), DEADLINE_S, (unsigned long long)want);
    progress();
    sched_yield();
  }
  if (sig_read(e, word) != want) die("signal %d is %llu, expected exactly %llu", word,
                                     (unsigned long long)sig_read(e, word), (unsigned long long)want);
}

static void check_bytes(const char *buf, uint64_t n, int owner, uint64_t src_off, const char *what) {
  for (uint64_t o = 0; o < n; o++)
    if ((uint8_t)buf[o] != pat(owner, src_off + o))
      die("%s: byte %llu of %llu is 0x%02x, expected 0x%02x (from rank %d)", what, (unsigned long long)o,
          (unsigned long long)n, (uint8_t)buf[o], pat(owner, src_off + o), owner);
}

static void check_zero(const char *buf, uint64_t from, uint64_t to, const char *what) {
  for (uint64_t o = from; o < to; o++)
    if (buf[o]) die("%s: byte %llu was written (0x%02x) though no put covers it", what, (unsigned long long)o,
                    (uint8_t)buf[o]);
}

static void check_guard(struct env *e) {
  for (int i = 0; i < GUARD; i++)
    if ((uint8_t)e->recv[e->recv_size + i] != 0xA5) die("the guard past the window was written at +%d", i);
}

/* ---- data ---- */
static void scenario_data(void) {
  struct env e = {0};
  setup(&e, 1);
  void *reqs[MAX_RANKS * K];
  int n = 0;
  for (int i = 0; i < K; i++)
    for (int p = 0; p < g_n; p++) {
      uint64_t size, soff, doff;
      put_plan(g_rank, p, i, &size, &soff, &doff);
      CHECK(rma->iputSignal(e.rc, i % NCTX, soff, e.mh_src, size, doff, e.mh_recv, (uint32_t)p,
                            (uint64_t)g_rank * 8, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true, &reqs[n]));
      n++;
    }
  if (rma->rmaProgress) CHECK(rma->rmaProgress(e.rc));
  wait_reqs(e.cc, reqs, n, 0);
  /* The target side: each rank's K puts (this rank's own included: NCCL's kernels put to every rank
   * of the team) have landed once its signal says K. */
  for (int p = 0; p < g_n; p++) {
    wait_signal(&e, p, K);
    uint64_t cursor = (uint64_t)p * K * SUB;
    for (int i = 0; i < K; i++) {
      uint64_t size, soff, doff;
      put_plan(p, g_rank, i, &size, &soff, &doff);
      check_zero(e.recv, cursor, doff, "gap before a put");
      check_bytes(e.recv + doff, size, p, soff, "random put");
      cursor = ((uint64_t)p * K + i + 1) * SUB;
      check_zero(e.recv, doff + size, cursor, "gap after a put");
    }
  }
  check_guard(&e);
  barrier(2);
  /* Gets of random ranges of each peer's pattern window, on every context. */
  for (int p = 0; p < g_n; p++) {
    uint64_t size[K], soff[K];
    n = 0;
    for (int i = 0; i < K; i++) {
      seed(p, g_rank, 1000 + i);
      size[i] = pick_size(i, SUB);
      soff[i] = rnd() % (g_src_size - size[i] + 1);
      CHECK(rma->iget(e.rc, i % NCTX, soff[i], e.mh_src, size[i], (uint64_t)i * SUB, e.mh_getw, (uint32_t)p,
                      &reqs[n++]));
    }
    wait_reqs(e.cc, reqs, n, 0);
    void *flush = NULL;
    CHECK(rma->iflush(e.rc, 0, e.mh_sig, (uint32_t)p, &flush));
    if (flush) wait_reqs(e.cc, &flush, 1, 0);
    for (int i = 0; i < K; i++) check_bytes(e.getw + (uint64_t)i * SUB, size[i], p, soff[i], "get");
  }
  barrier(3);
  /* Plain puts of 0 bytes and a VA-style signal alone (no data, NULL handles) complete too. */
  for (int p = 0; p < g_n; p++) {
    void *r2[2];
    CHECK(rma->iput(e.rc, 1, 0, e.mh_src, 0, 0, e.mh_recv, (uint32_t)p, &r2[0]));
    CHECK(rma->iputSignal(e.rc, 2, 0, NULL, 0, 0, NULL, (uint32_t)p, (uint64_t)(16 + g_rank) * 8, e.mh_sig, 0,
                          NCCL_NET_SIGNAL_OP_INC, false, &r2[1]));
    wait_reqs(e.cc, r2, 2, 0);
  }
  for (int p = 0; p < g_n; p++) wait_signal(&e, 16 + p, 1);
  barrier(4);
  if (g_big) {
    for (int p = 0; p < g_n; p++) {
      if (p == g_rank) continue;
      void *r1;
      double t0 = now_s();
      CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, BIG, 0, e.mh_big, (uint32_t)p, 24 * 8, e.mh_sig, 1,
                            NCCL_NET_SIGNAL_OP_ADD, true, &r1));
      wait_reqs(e.cc, &r1, 1, 0);
      if (g_rank == 0) printf("64 MiB put to rank %d: %.1f ms\n", p, (now_s() - t0) * 1e3);
    }
    wait_signal(&e, 24, (uint64_t)(g_n - 1));
    /* g_n - 1 puts of the same size into the same window: every one carried its own source's pattern,
     * so with more than two ranks only "one of them, whole" can be checked. */
    if (g_n == 2) check_bytes(e.big, BIG, 1 - g_rank, 0, "64 MiB put");
    barrier(5);
    int p = (g_rank + 1) % g_n;
    void *r1;
    CHECK(rma->iget(e.rc, 1, 0, e.mh_src, BIG, 0, e.mh_big, (uint32_t)p, &r1));
    wait_reqs(e.cc, &r1, 1, 0);
    check_bytes(e.big, BIG, p, 0, "64 MiB get");
  }
  barrier(6);
  teardown(&e);
}

/* ---- order ---- */
static void scenario_order(void) {
  struct env e = {0};
  setup(&e, 1);
  /* Rank g_target (0 unless --target) is the target; every other rank streams ORDER_N puts at it on context 0, each followed by
   * its signal, into its own part of the window. */
  if (g_rank != g_target) {
    void *reqs[ORDER_N];
    for (int j = 0; j < ORDER_N; j++) {
      uint64_t doff = ((uint64_t)g_rank * ORDER_N + (uint64_t)j) * ORDER_SUB;
      CHECK(rma->iputSignal(e.rc, 0, (uint64_t)j * 4096, e.mh_src, ORDER_SUB, doff, e.mh_recv, (uint32_t)g_target,
                            (uint64_t)g_rank * 8, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true, &reqs[j]));
    }
    wait_reqs(e.cc, reqs, ORDER_N, 0);
  } else {
    uint64_t seen[MAX_RANKS] = {0};
    int observations = 0;
    double t0 = now_s();
    for (int left = g_n - 1; left > 0;) {
      for (int p = 0; p < g_n; p++) {
        if (p == g_target) continue;
        uint64_t v = sig_read(&e, p);
        if (v == seen[p]) continue;
        if (v > ORDER_N) die("signal of rank %d is %llu, past %d puts", p, (unsigned long long)v, ORDER_N);
        /* Seen v: puts 0..v-1 of rank p must be whole now (the signal came after their data). */
        for (uint64_t j = seen[p]; j < v; j++) {
          uint64_t doff = ((uint64_t)p * ORDER_N + j) * ORDER_SUB;
          if (doff + ORDER_SUB > e.recv_size) die("order layout does not fit");
          check_bytes(recv_at(&e, doff, ORDER_SUB), ORDER_SUB, p, j * 4096, "data behind an observed signal");
        }
        observations++;
        seen[p] = v;
        if (v == ORDER_N) left--;
      }
      if (now_s() - t0 > DEADLINE_S) die("signals stopped short of %d puts", ORDER_N);
      /* The observer serves only where nothing else can (progress only): elsewhere the plugin's
       * threads land the puts while this thread watches, so a signal seen early would show. */
      if (getenv("MPLANE_TEST_RMA_PROGRESS_ONLY")) progress();
    }
    printf("order: %d signal changes observed, data always in place before its signal\n", observations);
  }
  barrier(2);
  teardown(&e);
}

static void check_expected_warn(void) {
  const char *want = expected_warn();
  if (want && !g_saw_warn) die("no WARN containing '%s'", want);
}

/* The JSON of MPLANE_STATS_FILE for this process (static storage), NULL when the variable is unset. */
static const char *read_stats(char *path, size_t pathlen) {
  const char *pat = getenv("MPLANE_STATS_FILE");
  if (!pat) return NULL;
  const char *p = strstr(pat, "%p");
  if (p) snprintf(path, pathlen, "%.*s%d%s", (int)(p - pat), pat, (int)getpid(), p + 2);
  else snprintf(path, pathlen, "%s", pat);
  FILE *f = fopen(path, "r");
  if (!f) die("MPLANE_STATS_FILE is set but %s was not written", path);
  static char buf[1 << 16];
  size_t n = fread(buf, 1, sizeof(buf) - 1, f);
  fclose(f);
  buf[n] = 0;
  return buf;
}

/* MPLANE_RMA_EXPECT_RANK_PLANES: every plane's record holds the bytes put on the connections that
 * plane carries (to_rank[r]: bytes this rank put to rank r): a peer on another plane is reached from
 * this node's NIC on the peer's plane, and those bytes are counted as relayed. */
static void check_plane_stats(const uint64_t *to_rank) {
  const char *v = getenv("MPLANE_RMA_EXPECT_RANK_PLANES");
  char path[512];
  const char *json = v ? read_stats(path, sizeof(path)) : NULL;
  if (!json) return;
  int plane[MAX_RANKS], n = 0;
  for (const char *c = v; *c && n < MAX_RANKS; c = strchr(c, ',') ? strchr(c, ',') + 1 : c + strlen(c))
    plane[n++] = atoi(c);
  if (n != g_n) die("MPLANE_RMA_EXPECT_RANK_PLANES='%s' names %d ranks, the group has %d", v, n, g_n);
  uint64_t tx[64] = {0}, rel[64] = {0};
  for (int r = 0; r < g_n; r++) {
    int cross = plane[r] != plane[g_rank], carrier = cross ? plane[r] : plane[g_rank];
    tx[carrier] += to_rank[r];
    if (cross) rel[carrier] += to_rank[r];
  }
  const char *at = strstr(json, "\"planes\": [");
  for (int pl = 0; pl < 64; pl++) {
    if (!tx[pl] && !rel[pl]) continue;
    char key[32];
    snprintf(key, sizeof(key), "{\"plane\": %d, ", pl);
    const char *e = at ? strstr(at, key) : NULL;
    unsigned long long b = 0, m = 0, rb = 0, rm = 0, relb = 0;
    if (!e || sscanf(e + strlen(key), "\"tx_bytes\": %llu, \"tx_msgs\": %llu, \"rx_bytes\": %llu, \"rx_msgs\": %llu, "
                     "\"relayed_bytes\": %llu", &b, &m, &rb, &rm, &relb) != 5)
      die("%s has no record of plane %d, which carries %llu bytes of this rank's puts", path, pl,
          (unsigned long long)tx[pl]);
    if (b != tx[pl] || relb != rel[pl])
      die("%s: plane %d sent %llu bytes (%llu relayed); the puts on the connections it carries were %llu bytes "
          "(%llu relayed)", path, pl, b, relb, (unsigned long long)tx[pl], (unsigned long long)rel[pl]);
    printf("rank %d (plane %d): plane %d carried %llu bytes of its puts, %llu of them relayed\n", g_rank,
           plane[g_rank], pl, b, relb);
  }
}

/* MPLANE_STATS_FILE: the plugin's traffic record of this process must show exactly the puts made,
 * under the class the contexts were created with (alltoall) and on some plane. */
static void check_stats(uint64_t put_bytes, uint64_t puts) {
  char path[512];
  const char *buf = read_stats(path, sizeof(path));
  if (!buf) return;
  const char *cls = strstr(buf, "\"class\": \"alltoall\"");
  const char *tx = cls ? strstr(cls, "\"tx_bytes\": ") : NULL;
  const char *msgs = cls ? strstr(cls, "\"tx_msgs\": ") : NULL;
  if (!tx || !msgs) die("%s has no alltoall class record", path);
  unsigned long long b = strtoull(tx + 12, NULL, 10), m = strtoull(msgs + 11, NULL, 10);
  if (b != put_bytes || m != puts)
    die("%s: class alltoall sent %llu bytes in %llu ops, the harness put %llu bytes in %llu", path, b, m,
        (unsigned long long)put_bytes, (unsigned long long)puts);
  printf("rank %d: traffic record matches: %llu bytes in %llu puts, class alltoall\n", g_rank, b, m);
}

/* MPLANE_RMA_EXPECT_CROSS_PLANE=1|0: the plugin must (or must not) have said that peers listen on
 * other planes. */
static void check_cross_plane_note(void) {
  const char *v = getenv("MPLANE_RMA_EXPECT_CROSS_PLANE");
  if (!v) return;
  if (atoi(v) != g_saw_cross_plane)
    die("the plugin %s that peers listen on other planes", g_saw_cross_plane ? "said" : "did not say");
}

/* ---- alltoall: what nccl-tests' GIN all-to-all kernel (-D 3) asks of the proxy ---- */
static void scenario_alltoall(void) {
  struct env e = {0};
  setup(&e, 1);
  /* Every iteration each rank puts its block for r to every rank r (itself included), each put adding 1
   * to the same signal word of the target; then it waits for the word to grow by n: the signal words of
   * all ranks see adds from n connections (n-1 sockets and the rank's own pair) racing. */
  uint64_t base = 0, put_bytes = 0, puts = 0, to_rank[MAX_RANKS] = {0};
  int iters = 0;
  for (uint64_t size = 0; size <= SUB; size = size ? size * 8 : 8)
    for (int it = 0; it < 20; it++, iters++) {
      void *reqs[MAX_RANKS];
      for (int r = 0; r < g_n; r++)
        CHECK(rma->iputSignal(e.rc, 0, (uint64_t)r * SUB, e.mh_src, size, (uint64_t)g_rank * SUB, e.mh_recv,
                              (uint32_t)r, 0, e.mh_sig, 0, NCCL_NET_SIGNAL_OP_INC, true, &reqs[r]));
      put_bytes += size * (uint64_t)g_n;
      puts += (uint64_t)g_n;
      for (int r = 0; r < g_n; r++) to_rank[r] += size;
      wait_reqs(e.cc, reqs, g_n, 0);
      base += (uint64_t)g_n;
      wait_signal(&e, 0, base);
      for (int r = 0; r < g_n; r++)
        check_bytes(recv_at(&e, (uint64_t)r * SUB, size), size, r, (uint64_t)g_rank * SUB, "alltoall block");
      void *flush = NULL;
      for (int r = 0; r < g_n; r++) {
        CHECK(rma->iflush(e.rc, 0, e.mh_sig, (uint32_t)r, &flush));
        if (flush) wait_reqs(e.cc, &flush, 1, 0);
      }
      /* The next round's puts may overwrite blocks only after every rank checked this round's. */
      barrier_round(iters);
    }
  barrier(2);
  teardown(&e);
  check_stats(put_bytes, puts);
  check_plane_stats(to_rank);
  check_cross_plane_note();
}

/* ---- oob ---- */
static void expect_refused(void *cc, void *req, const char *what) {
  if (!req) die("%s: no request", what);
  if (wait_reqs(cc, &req, 1, 1) != 1) die("%s: completed without an error", what);
}

static void scenario_oob(void) {
  struct env e = {0};
  setup(&e, 1);
  int p = (g_rank + 1) % g_n;
  void *r = NULL;
  /* Ranges the target must refuse: they pass no local check (the target's window is what counts). */
  CHECK(rma->iput(e.rc, 0, 0, e.mh_src, 100, e.recv_size - 10, e.mh_recv, (uint32_t)p, &r));
  expect_refused(e.cc, r, "put past the end of the window");
  CHECK(rma->iput(e.rc, 1, 0, e.mh_src, 16, UINT64_MAX - 8, e.mh_recv, (uint32_t)p, &r));
  expect_refused(e.cc, r, "put at an offset that wraps");
  CHECK(rma->iget(e.rc, 2, g_src_size - 8, e.mh_src, 64, 0, e.mh_getw, (uint32_t)p, &r));
  expect_refused(e.cc, r, "get past the end of the peer's window");
  CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, 64, 0, e.mh_recv, (uint32_t)p, 32 * 8, e.mh_sig, 1,
                        NCCL_NET_SIGNAL_OP_ADD, true, &r));
  expect_refused(e.cc, r, "signal past the end of the signal window");
  CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, 64, 0, e.mh_recv, (uint32_t)p, 3, e.mh_sig, 1,
                        NCCL_NET_SIGNAL_OP_ADD, true, &r));
  expect_refused(e.cc, r, "signal word not 8-byte aligned");
  /* Refused at once, before anything moves. */
  r = NULL;
  if (rma->iputSignal(e.rc, 0, 0, e.mh_src, 64, 0, e.mh_recv, (uint32_t)p, 0, e.mh_sig, 1, 7, true, &r) ==
      ncclSuccess)
    die("signal op 7 was accepted");
  if (rma->iput(e.rc, 0, g_src_size - 4, e.mh_src, 8, 0, e.mh_recv, (uint32_t)p, &r) == ncclSuccess)
    die("a source range past the local window was accepted");
  if (rma->iput(e.rc, 0, 0, e.mh_src, 8, 0, e.mh_recv, (uint32_t)g_n, &r) == ncclSuccess)
    die("a put to rank %d of a group of %d was accepted", g_n, g_n);
  if (rma->iput(e.rc, NCTX, 0, e.mh_src, 8, 0, e.mh_recv, (uint32_t)p, &r) == ncclSuccess)
    die("a put on context %d of %d was accepted", NCTX, NCTX);
  bool err = false;
  CHECK(rma->queryLastError(e.rc, &err));
  if (!err) die("queryLastError reports no error after refused ops");
  barrier(2);
  /* Nothing was written by any refused op; the signal words are untouched. */
  check_zero(e.recv, 0, e.recv_size, "window after refused puts");
  check_guard(&e);
  for (int w = 0; w < 32; w++)
    if (e.sig[w]) die("signal word %d is %llu after refused signals", w, (unsigned long long)e.sig[w]);
  check_zero(e.getw, 0, 64, "get window after a refused get");
  barrier(3);
  /* The connections still work. */
  CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, 4096, 0, e.mh_recv, (uint32_t)p, 8, e.mh_sig, 1,
                        NCCL_NET_SIGNAL_OP_INC, true, &r));
  wait_reqs(e.cc, &r, 1, 0);
  wait_signal(&e, 1, 1);
  check_bytes(e.recv, 4096, (g_rank - 1 + g_n) % g_n, 0, "put after refusals");
  barrier(4);
  /* teardown() insists on no error: this scenario ends by hand. */
  g_ctx = NULL;
  CHECK(rma->destroyContext(e.rc));
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}

/* ---- stride ---- */
static void scenario_stride(void) {
  if (g_n % 2) die("stride needs an even number of ranks");
  struct env e = {0};
  setup(&e, 2);
  for (int p = 0; p < g_n; p++) {
    if (p == g_rank) continue;
    void *r = NULL;
    ncclResult_t res = rma->iput(e.rc, 0, 0, e.mh_src, 512, (uint64_t)g_rank * 512, e.mh_recv, (uint32_t)p, &r);
    if (connected(p, 2)) {
      if (res != ncclSuccess) die("put to rank %d (even distance) failed: %d", p, res);
      wait_reqs(e.cc, &r, 1, 0);
    } else if (res == ncclSuccess) {
      die("put to rank %d (odd distance, not connected with stride 2) was accepted", p);
    }
  }
  barrier(2);
  for (int p = 0; p < g_n; p++) {
    if (p == g_rank) continue;
    if (connected(p, 2)) check_bytes(e.recv + (uint64_t)p * 512, 512, p, 0, "stride put");
    else check_zero(e.recv, (uint64_t)p * 512, (uint64_t)p * 512 + 512, "stride: unconnected rank's part");
  }
  barrier(3);
  teardown(&e);
}

/* ---- kill ---- */
static void scenario_kill(void) {
  struct env e = {0};
  setup(&e, 1);
  int victim = g_n - 1;
  barrier(2);
  if (g_rank == victim) _exit(0); /* no close, no finalize: the process is simply gone */
  double t0 = now_s();
  /* A large put in flight, then more ops, until one fails. */
  void *r = NULL;
  int failed = 0;
  for (int i = 0; !failed && now_s() - t0 < DEADLINE_S; i++) {
    ncclResult_t res = (i % 2 == 0)
                           ? rma->iput(e.rc, i % NCTX, 0, e.mh_src, (size_t)K * SUB, 0, e.mh_recv, (uint32_t)victim, &r)
                           : rma->iget(e.rc, i % NCTX, 0, e.mh_src, 4096, 0, e.mh_getw, (uint32_t)victim, &r);
    if (res != ncclSuccess) {
      failed = 1;
      break;
    }
    int done = 0;
    while (!done) {
      res = rma->test(e.cc, r, &done);
      if (res != ncclSuccess) {
        failed = 1;
        break;
      }
      if (now_s() - t0 > DEADLINE_S) die("a request to the dead rank %d hangs", victim);
    }
    usleep(1000);
  }
  if (!failed) die("no op to the dead rank %d failed within %d s", victim, DEADLINE_S);
  bool err = false;
  CHECK(rma->queryLastError(e.rc, &err));
  if (!err) die("queryLastError reports nothing after rank %d died", victim);
  if (rma->iput(e.rc, 0, 0, e.mh_src, 8, 0, e.mh_recv, (uint32_t)victim, &r) == ncclSuccess) {
    int done = 0;
    if (rma->test(e.cc, r, &done) == ncclSuccess && done) die("a put to the dead rank completed");
  }
  printf("rank %d: ops to the dead rank %d failed after %.2f s\n", g_rank, victim, now_s() - t0);
  /* The survivors still reach each other (their barriers leave the dead rank out). */
  if (g_n > 2) {
    barrier_of(3, g_n - 1);
    int p = g_rank == 0 ? 1 : 0;
    CHECK(rma->iput(e.rc, 0, 0, e.mh_src, 1024, 0, e.mh_recv, (uint32_t)p, &r));
    wait_reqs(e.cc, &r, 1, 0);
    barrier_of(4, g_n - 1);
  }
  g_ctx = NULL;
  CHECK(rma->destroyContext(e.rc));
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}

/* ---- peerfault: an op that fails on one context fails the peer in every context ----
 * Rank 0's first work request ends in error (the verbs double's err_wr=1, set for rank 0 only): a
 * get on context 1. A put on context 0 to the same peer must then be refused, not delivered: on
 * real verbs a peer that is dying still takes writes on its other QPs while its memory is torn
 * down, and a completed put there would be a lost one that NCCL counts as delivered. */
static void scenario_peerfault(void) {
  if (g_n != 2) die("peerfault runs 2 ranks");
  struct env e = {0};
  setup(&e, 1);
  barrier(2);
  if (g_rank == 0) {
    void *r = NULL;
    CHECK(rma->iget(e.rc, 1, 0, e.mh_src, 4096, 0, e.mh_getw, 1, &r));
    expect_refused(e.cc, r, "get whose work request ends in error");
    r = NULL;
    ncclResult_t res = rma->iput(e.rc, 0, 0, e.mh_src, 512, 0, e.mh_recv, 1, &r);
    if (res == ncclSuccess) expect_refused(e.cc, r, "put on another context to the peer that failed");
    bool err = false;
    CHECK(rma->queryLastError(e.rc, &err));
    if (!err) die("queryLastError reports nothing after a completion in error");
    check_expected_warn();
  }
  barrier(3);
  if (g_rank == 1) check_zero(e.recv, 0, 512, "window where the refused put would have landed");
  barrier(4);
  g_ctx = NULL;
  CHECK(rma->destroyContext(e.rc));
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}

/* ---- stall: a peer alive but not serving (SIGSTOP): ops to it fail after the timeout, not before ---- */
static void scenario_stall(void) {
  struct env e = {0};
  setup(&e, 1);
  int victim = g_n - 1;
  const char *tv = getenv("MPLANE_CONNECT_TIMEOUT");
  double timeout = tv ? atof(tv) : 120;
  barrier(2);
  if (g_rank == victim) {
    shm->expect_killed = victim + 1;
    raise(SIGSTOP); /* socket open, nobody reading: a hung process */
    die("the stalled rank was resumed");
  }
  usleep(200 * 1000); /* let the victim stop */
  double t0 = now_s();
  void *r[4] = {0};
  /* a big put that fills the socket and the peer's kernel buffers, then small ops behind it */
  CHECK(rma->iput(e.rc, 0, 0, e.mh_src, g_src_size, 0, e.mh_recv, (uint32_t)victim, &r[0]));
  CHECK(rma->iput(e.rc, 0, 0, e.mh_src, 64, 0, e.mh_recv, (uint32_t)victim, &r[1]));
  CHECK(rma->iget(e.rc, 1, 0, e.mh_src, 4096, 0, e.mh_getw, (uint32_t)victim, &r[2]));
  int failed = 0, left = 3;
  while (left) {
    for (int i = 0; i < 3; i++) {
      if (!r[i]) continue;
      int done = 0;
      ncclResult_t res = rma->test(e.cc, r[i], &done);
      if (res == ncclSuccess && done) die("op %d to the stalled rank %d completed", i, victim);
      if (res != ncclSuccess) {
        failed++;
        r[i] = NULL;
        left--;
      }
    }
    if (now_s() - t0 > timeout + 20) die("ops to the stalled rank %d still pending after %.0f s", victim, now_s() - t0);
    usleep(1000);
  }
  double took = now_s() - t0;
  if (took < 0.8 * timeout) die("ops to the stalled rank failed after %.2f s, before the %.0f s timeout", took, timeout);
  bool err = false;
  CHECK(rma->queryLastError(e.rc, &err));
  if (!err) die("queryLastError reports nothing after the ops to the stalled rank %d failed", victim);
  printf("rank %d: %d ops to the stalled rank %d failed after %.2f s (timeout %.0f s)\n", g_rank, failed, victim,
         took, timeout);
  /* The other ranks still reach each other. */
  if (g_n > 2) {
    barrier_of(3, g_n - 1);
    int p = g_rank == 0 ? 1 : 0;
    void *q = NULL;
    CHECK(rma->iput(e.rc, 0, 0, e.mh_src, 1024, 0, e.mh_recv, (uint32_t)p, &q));
    wait_reqs(e.cc, &q, 1, 0);
    barrier_of(4, g_n - 1);
  }
  double d0 = now_s();
  g_ctx = NULL;
  CHECK(rma->destroyContext(e.rc));
  if (now_s() - d0 > timeout + 10) die("destroyContext took %.1f s with a stalled peer", now_s() - d0);
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
  if (g_rank == 0) kill(shm->pids[victim], SIGKILL);
}

/* ---- regfail: regMrSym is collective; one rank's failed registration fails it on every rank ---- */
static void scenario_regfail(void) {
  struct env e = {0};
  setup(&e, 1);
  int odd = g_n - 1;
  static char extra[4096];
  void *mh = NULL;
  double t0 = now_s();
  /* The odd rank names a memory type NCCL does not define; the others register a good window. */
  ncclResult_t res = rma->regMrSym(e.cc, extra, sizeof(extra), g_rank == odd ? 7 : NCCL_PTR_HOST, 0, &mh);
  if (res == ncclSuccess) die("regMrSym succeeded on rank %d while rank %d's registration failed", g_rank, odd);
  if (mh) die("a failed regMrSym left a handle");
  if (now_s() - t0 > 10) die("the failed registration took %.1f s to be reported", now_s() - t0);
  printf("rank %d: regMrSym failed (%d) with rank %d's, after %.2f s\n", g_rank, res, odd, now_s() - t0);
  /* The windows registered before are untouched: a put into one still lands. */
  int p = (g_rank + 1) % g_n;
  void *r = NULL;
  CHECK(rma->iput(e.rc, 0, 0, e.mh_src, 4096, (uint64_t)g_rank * 4096, e.mh_recv, (uint32_t)p, &r));
  wait_reqs(e.cc, &r, 1, 0);
  barrier(2);
  check_bytes(recv_at(&e, (uint64_t)((g_rank + g_n - 1) % g_n) * 4096, 4096), 4096, (g_rank + g_n - 1) % g_n, 0,
              "put after the failed registration");
  barrier(3);
  teardown(&e);
}

/* ---- rate: what a GIN barrier asks of the proxy, timed: every rank posts a burst of 32 signal-only
 * puts (one per block) to every other rank at once, then waits for them and for the peers' 32 ---- */
#define RATE_BURST 32
static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void scenario_rate(void) {
  struct env e = {0};
  setup(&e, 1);
  const int rounds = 300;
  void *reqs[RATE_BURST * MAX_RANKS];
  double t0 = now_s();
  for (int k = 0; k < rounds; k++) {
    int n = 0;
    for (int r = 0; r < g_n; r++)
      for (int b = 0; b < RATE_BURST && r != g_rank; b++)
        CHECK(rma->iputSignal(e.rc, 0, 0, NULL, 0, 0, NULL, (uint32_t)r, (uint64_t)b * 8, e.mh_sig, 0,
                              NCCL_NET_SIGNAL_OP_INC, true, &reqs[n++]));
    wait_reqs(e.cc, reqs, n, 0);
    /* at least: the peers may be a round ahead already (no barrier between rounds, as between kernels) */
    for (int b = 0; b < RATE_BURST; b++)
      while (sig_read(&e, b) < (uint64_t)(k + 1) * (uint64_t)(g_n - 1)) {
        if (now_s() - t0 > DEADLINE_S) die("round %d: signal %d is %llu", k, b, (unsigned long long)sig_read(&e, b));
        progress();
      }
  }
  double dt = now_s() - t0;
  uint64_t ops = (uint64_t)rounds * RATE_BURST * (uint64_t)(g_n - 1);
  printf("rank %d: %d rounds of %d signal puts to each of %d peers: %.1f us per round, %.2f us per op\n", g_rank,
         rounds, RATE_BURST, g_n - 1, dt / rounds * 1e6, dt / (double)ops * 1e6);
  barrier(2);
  /* Ping-pong: rank 0 signals rank 1, which answers with its own signal once it sees it; one signal
   * put each way per round trip, as the dependent steps of a GIN kernel (a put, then the peer's put
   * once it has seen it). Median and p99 of the round trips. */
  enum { PP = 2000 };
  static double rtt[PP];
  if (g_rank < 2) {
    int peer = 1 - g_rank;
    const uint64_t base = sig_read(&e, 0); /* every burst signal has landed (their puts were answered) */
    for (int k = 0; k < PP; k++) {
      double a = now_s();
      while (g_rank == 1 && sig_read(&e, 0) < base + (uint64_t)(k + 1)) {
        if (now_s() - a > DEADLINE_S) die("ping-pong %d: no ping", k);
        progress();
      }
      void *r = NULL;
      CHECK(rma->iputSignal(e.rc, 0, 0, NULL, 0, 0, NULL, (uint32_t)peer, 0, e.mh_sig, 0,
                            NCCL_NET_SIGNAL_OP_INC, true, &r));
      wait_reqs(e.cc, &r, 1, 0);
      while (g_rank == 0 && sig_read(&e, 0) < base + (uint64_t)(k + 1)) {
        if (now_s() - a > DEADLINE_S) die("ping-pong %d: no answer", k);
        progress();
      }
      rtt[k] = now_s() - a;
    }
    if (g_rank == 0) {
      qsort(rtt, PP, sizeof(rtt[0]), cmp_double);
      printf("rank 0: ping-pong of one signal put each way: median %.1f us, p99 %.1f us (%d round trips)\n",
             rtt[PP / 2] * 1e6, rtt[PP * 99 / 100] * 1e6, PP);
    }
  }
  barrier(3);
  teardown(&e);
}

/* ---- proxyloop: NCCL's GIN proxy loop, timed (a benchmark, suite bench; 2 ranks, host windows) ----
 * Each pass does what NCCL 2.30's proxy thread does: test() every open request, post at most one
 * op, call rmaProgress once, yield. Measured against the one-sided path's targets:
 *   a pass that posts a signal-only putSignal costs <= 1 us (median, beside an idle pass);
 *   64 signals posted one per pass are all seen by the peer within 200 us of the first post;
 *   a signal round trip (each side posts once it has seen the other's) <= 2x a 1-byte TCP
 *   ping-pong between the same two processes, polled the same way (MSG_DONTWAIT, yield);
 *   put+signal round trips of 8 KiB and 1 MiB beside TCP ping-pongs of those sizes.
 * It prints the numbers and a verdict per target; it fails only when an op fails or a value is
 * wrong, never on time. */
struct ploop {
  struct env *e;
  void *open[512];
  int nopen;
  double pass_us; /* the last pass, without its yield */
  uint64_t trips[4]; /* ping-pong round trips made so far on each signal word (they start at 0) */
};

static void ploop_test_all(struct ploop *l) {
  for (int i = 0; i < l->nopen;) {
    int done = 0;
    CHECK(rma->test(l->e->cc, l->open[i], &done));
    if (done) l->open[i] = l->open[--l->nopen];
    else i++;
  }
}

/* One pass; with `post` set, it posts one signal-only putSignal (or a put of `size` bytes with its
 * signal) to `peer`, adding 1 to the peer's word `word`. */
static void ploop_pass(struct ploop *l, int post, int peer, int word, size_t size) {
  double t0 = now_s();
  ploop_test_all(l);
  if (post) {
    if (l->nopen == (int)(sizeof(l->open) / sizeof(l->open[0]))) die("proxyloop: too many open requests");
    CHECK(rma->iputSignal(l->e->rc, 0, 0, size ? l->e->mh_src : NULL, size, 0, size ? l->e->mh_recv : NULL,
                          (uint32_t)peer, (uint64_t)word * 8, l->e->mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true,
                          &l->open[l->nopen]));
    l->nopen++;
  }
  if (rma->rmaProgress(l->e->rc) != ncclSuccess) die("rmaProgress failed");
  l->pass_us = (now_s() - t0) * 1e6; /* the yield is the loop's, not the pass's */
  sched_yield();
}

static void ploop_drain(struct ploop *l) {
  double t0 = now_s();
  while (l->nopen) {
    if (now_s() - t0 > DEADLINE_S) die("proxyloop: %d requests not done", l->nopen);
    ploop_pass(l, 0, 0, 0, 0);
  }
}

/* Pass until the local word reaches want. */
static void ploop_wait_word(struct ploop *l, int word, uint64_t want) {
  double t0 = now_s();
  while (__atomic_load_n(&l->e->sig[word], __ATOMIC_ACQUIRE) < want) {
    if (now_s() - t0 > DEADLINE_S) die("proxyloop: word %d is %llu, expected %llu", word,
                                       (unsigned long long)l->e->sig[word], (unsigned long long)want);
    ploop_pass(l, 0, 0, 0, 0);
  }
}

static double median_of(double *v, int n) {
  qsort(v, (size_t)n, sizeof(v[0]), cmp_double);
  return v[n / 2];
}

/* 64 signals one per pass: rank 0 times its passes, rank 1 the arrival of the 64th. */
static void ploop_burst(struct ploop *l, double *post_med, double *idle_med, double *seen_med) {
  enum { ROUNDS = 40, BURST = 64 };
  static double post[ROUNDS * BURST], idle[ROUNDS * BURST], seen[ROUNDS];
  int np = 0, ni = 0;
  for (int k = 0; k < ROUNDS; k++) {
    barrier_round(2 * k);
    if (g_rank == 0) {
      for (int i = 0; i < 8; i++) { /* idle passes, timed the same way */
        ploop_pass(l, 0, 0, 0, 0);
        idle[ni++] = l->pass_us;
      }
      __atomic_store_n(&shm->t0_ns, (uint64_t)(now_s() * 1e9), __ATOMIC_RELEASE);
      for (int i = 0; i < BURST; i++) {
        ploop_pass(l, 1, 1, 1, 0);
        post[np++] = l->pass_us;
      }
      ploop_drain(l);
    } else {
      ploop_wait_word(l, 1, (uint64_t)(k + 1) * BURST);
      seen[k] = now_s() * 1e6 - (double)__atomic_load_n(&shm->t0_ns, __ATOMIC_ACQUIRE) / 1e3;
      ploop_drain(l);
    }
    barrier_round(2 * k + 1);
  }
  if (g_rank == 0) {
    *post_med = median_of(post, np);
    *idle_med = median_of(idle, ni);
  } else *seen_med = median_of(seen, ROUNDS);
}

/* Round trips of a put of `size` bytes (0: a signal alone) with its signal, each side answering once
 * it has seen the other's signal on word 2 + (size != 0). Rank 0 returns the median and p99 (us). */
static void ploop_pingpong(struct ploop *l, size_t size, int n, double *med, double *p99) {
  static double rtt[4000];
  int word = size ? 3 : 2, peer = 1 - g_rank;
  /* Counted, not read: the peer's first signal may land while this rank still waits in the barrier
   * before this call (its passes serve it), and a base read after that would wait for one too many. */
  uint64_t base = l->trips[word];
  l->trips[word] += (uint64_t)n;
  for (int k = 0; k < n; k++) {
    double a = now_s();
    if (g_rank == 1) ploop_wait_word(l, word, base + (uint64_t)k + 1);
    ploop_pass(l, 1, peer, word, size);
    if (g_rank == 0) ploop_wait_word(l, word, base + (uint64_t)k + 1);
    rtt[k] = (now_s() - a) * 1e6;
  }
  ploop_drain(l);
  qsort(rtt, (size_t)n, sizeof(rtt[0]), cmp_double);
  *med = rtt[n / 2];
  *p99 = rtt[n * 99 / 100];
}

/* A TCP connection between ranks 0 and 1 over loopback, non-blocking. */
static int tcp_pair(void) {
  int fd = -1;
  if (g_rank == 0) {
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t al = sizeof(a);
    if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof(a)) != 0 || listen(l, 1) != 0 ||
        getsockname(l, (struct sockaddr *)&a, &al) != 0)
      die("raw TCP listener: %s", strerror(errno));
    __atomic_store_n(&shm->tcp_port, (int)ntohs(a.sin_port), __ATOMIC_RELEASE);
    fd = accept(l, NULL, NULL);
    close(l);
  } else {
    double t0 = now_s();
    while (!__atomic_load_n(&shm->tcp_port, __ATOMIC_ACQUIRE))
      if (now_s() - t0 > DEADLINE_S) die("raw TCP: no listener");
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK),
                            .sin_port = htons((uint16_t)__atomic_load_n(&shm->tcp_port, __ATOMIC_ACQUIRE))};
    fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) die("raw TCP connect: %s", strerror(errno));
  }
  if (fd < 0) die("raw TCP accept: %s", strerror(errno));
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

static void tcp_move(int fd, char *buf, size_t n, int out) {
  double t0 = now_s();
  for (size_t got = 0; got < n;) {
    ssize_t r = out ? send(fd, buf + got, n - got, MSG_DONTWAIT | MSG_NOSIGNAL) : recv(fd, buf + got, n - got, MSG_DONTWAIT);
    if (r > 0) got += (size_t)r;
    else if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) die("raw TCP: %s", strerror(errno));
    else if (now_s() - t0 > DEADLINE_S) die("raw TCP ping-pong stuck");
    else sched_yield();
  }
}

static void tcp_pingpong(int fd, size_t size, int n, double *med, double *p99) {
  static double rtt[4000];
  char *buf = calloc(1, size);
  if (!buf) die("no memory");
  for (int k = 0; k < n; k++) {
    double a = now_s();
    if (g_rank == 1) tcp_move(fd, buf, size, 0);
    tcp_move(fd, buf, size, 1);
    if (g_rank == 0) tcp_move(fd, buf, size, 0);
    rtt[k] = (now_s() - a) * 1e6;
  }
  free(buf);
  qsort(rtt, (size_t)n, sizeof(rtt[0]), cmp_double);
  *med = rtt[n / 2];
  *p99 = rtt[n * 99 / 100];
}

static const char *verdict(int met) { return met ? "met" : "NOT met"; }

static void scenario_proxyloop(void) {
  if (g_n != 2) die("proxyloop needs 2 ranks");
  struct env e = {0};
  setup(&e, 1);
  struct ploop l = {.e = &e};
  int fd = tcp_pair();
  double post = 0, idle = 0, seen = 0;
  ploop_burst(&l, &post, &idle, &seen);
  if (g_rank == 1) shm->seen_us = seen;
  barrier(2);
  static const size_t sizes[] = {0, 8192, 1u << 20};
  double m[3], p[3], tm[3], tp[3];
  for (int i = 0; i < 3; i++) { /* interleaved: the plugin's round trips, then raw TCP's, per size */
    int n = sizes[i] >= (1u << 20) ? 200 : 2000;
    ploop_pingpong(&l, sizes[i], n, &m[i], &p[i]);
    barrier(3 + 2 * i);
    tcp_pingpong(fd, sizes[i] ? sizes[i] : 1, n, &tm[i], &tp[i]);
    barrier(4 + 2 * i);
  }
  if (g_rank == 0) {
    seen = shm->seen_us;
    printf("proxyloop: a pass posting a signal %.2f us (median), an idle pass %.2f us: %s (<= 1 us)\n", post, idle,
           verdict(post <= 1.0));
    printf("proxyloop: 64 signals, one per pass, all seen by the peer after %.1f us (median of 40): %s (<= 200 us)\n",
           seen, verdict(seen <= 200.0));
    for (int i = 0; i < 3; i++)
      printf("proxyloop: round trip, %s: median %.1f us (p99 %.1f) vs raw TCP %zu B %.1f us (p99 %.1f): %.2fx%s\n",
             sizes[i] ? (sizes[i] == 8192 ? "8 KiB put+signal" : "1 MiB put+signal") : "signal alone", m[i], p[i],
             sizes[i] ? sizes[i] : 1, tm[i], tp[i], m[i] / tm[i],
             sizes[i] ? "" : (m[i] <= 2 * tm[i] ? ": met (<= 2x)" : ": NOT met (<= 2x)"));
  }
  close(fd);
  barrier(10);
  teardown(&e);
}

/* ---- replies: a signal ping-pong in NCCL's proxy loop sends one segment per leg ----
 * Each side answers the other's signal (its ACK) and posts its own reply in the next pass; the
 * answer must ride with the reply in one send. It went alone (an age test that wrapped made every
 * answer count as old), so each leg cost two sends, a pass and the peer's second read: the signal
 * round trip was 3.5x raw TCP's. Counted from outside the plugin: the data segments of this
 * process's TCP sockets (TCP_NODELAY on loopback: one per send). Socket transport only. */
static void scenario_replies(void) {
  if (g_n != 2) die("replies needs 2 ranks");
  struct env e = {0};
  setup(&e, 1);
  struct ploop l = {.e = &e};
  enum { TRIPS = 300 };
  double med = 0, p99 = 0;
  ploop_pingpong(&l, 0, 20, &med, &p99); /* warm: the first sends find nothing to ride with */
  barrier(2);
  uint64_t before = tcp_data_segs_out();
  ploop_pingpong(&l, 0, TRIPS, &med, &p99);
  uint64_t segs = tcp_data_segs_out() - before;
  barrier(3);
  if (!before && !segs) die("replies: this kernel counts no TCP data segments (tcpi_data_segs_out)");
  printf("rank %d: %llu data segments for %d signal round trips (%.2f per trip), median round trip %.1f us\n", g_rank,
         (unsigned long long)segs, TRIPS, (double)segs / TRIPS, med);
  /* one per trip and rank, plus the drain's last answer and a few answers that waited past 20 us */
  if (segs > TRIPS + TRIPS / 5)
    die("replies: %llu segments for %d round trips: answers are sent alone, not with the reply", (unsigned long long)segs,
        TRIPS);
  barrier(4);
  teardown(&e);
}

/* SOFTVERBS_RECORD, when set: this process registered a buffer of `length` bytes through its dma-buf. */
static void expect_dmabuf_reg(size_t length, const char *what) {
  const char *rec = getenv("SOFTVERBS_RECORD");
  if (!rec || !*rec) return;
  char want[128], line[1024];
  snprintf(want, sizeof(want), "event=reg_mr pid=%d length=%zu dmabuf=1", (int)getpid(), length);
  FILE *f = fopen(rec, "r");
  int found = 0;
  while (f && !found && fgets(line, sizeof(line), f)) found = strstr(line, want) != NULL;
  if (f) fclose(f);
  if (!found) die("%s has no '%s': %s was not registered through its dma-buf", rec, want, what);
}

/* ---- dmabuf: a window registered through regMrSymDmaBuf (a memfd stands in for the dma-buf of GPU
 * memory; the fd is closed right after, as NCCL's proxy does): puts with signals land in it ---- */
static void scenario_dmabuf(void) {
  struct env e = {0};
  setup(&e, 1);
  ncclNetProperties_v12_t props;
  CHECK(rma->getProperties(0, &props));
  const size_t blk = 64u << 10, size = (size_t)g_n * blk;
  int fd = memfd_create("mplane-rma-dmabuf", 0);
  if (fd < 0 || ftruncate(fd, (off_t)size) != 0) die("memfd: %s", strerror(errno));
  char *win = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (win == MAP_FAILED) die("mmap of the memfd: %s", strerror(errno));
  void *mh = NULL;
  CHECK(rma->regMrSymDmaBuf(e.cc, win, size, NCCL_PTR_HOST, 0, fd, 0, &mh));
  close(fd);
  /* On the verbs double (SOFTVERBS_RECORD): the window was registered through the dma-buf itself. */
  expect_dmabuf_reg(size, "the window");
  barrier(2);
  void *reqs[MAX_RANKS];
  for (int r = 0; r < g_n; r++)
    CHECK(rma->iputSignal(e.rc, 0, (uint64_t)r * SUB, e.mh_src, blk, (uint64_t)g_rank * blk, mh, (uint32_t)r, 0,
                          e.mh_sig, 0, NCCL_NET_SIGNAL_OP_INC, true, &reqs[r]));
  wait_reqs(e.cc, reqs, g_n, 0);
  wait_signal(&e, 0, (uint64_t)g_n);
  for (int r = 0; r < g_n; r++) check_bytes(win + (size_t)r * blk, blk, r, (uint64_t)g_rank * SUB, "dma-buf window");
  printf("rank %d: %d puts landed in the dma-buf window (device ptrSupport 0x%x%s)\n", g_rank, g_n, props.ptrSupport,
         props.ptrSupport & NCCL_PTR_DMABUF ? ", DMABUF" : "");
  barrier(3);
  CHECK(rma->deregMrSym(e.cc, mh));
  munmap(win, size);
  teardown(&e);
}

/* ---- eplike: what NCCL EP's low-latency dispatch posts through GIN. The group has 128 contexts; in
 * each round every rank sends every rank (itself included), on every context c, a few tokens:
 * plain puts into its slot (source, c) of the peer's receive window, then one signal alone adding
 * the number of tokens to the peer's word (c, source) of a NEVER_RESET signal window. The words are
 * never reset, so what a target waits for grows round by round. ---- */
#define EP_NCTX 128    /* the GIN contexts NCCL EP creates */
#define EP_TOKEN 7408u /* a dispatched token as DeepEP's low-latency kernels send it: 7168 FP8 values, 56 scales, an index */
#define EP_MAXTOK 17   /* tokens per (source, context, round): 3..17 */
#define EP_SLOT ((uint64_t)EP_MAXTOK * EP_TOKEN)

/* A window of this scenario's own, beside setup's: host memory, GPU memory (--gpu; host holds the
 * copies read back) or a memfd the plugin takes for GPU memory (--gpu-dmabuf). */
struct ep_win {
  char *host, *dev;
  size_t size;
  void *mh;
};

static void ep_win_reg(struct env *e, struct ep_win *w, size_t size, uint64_t flags) {
  *w = (struct ep_win){.size = size};
  if (g_gpu_dmabuf) {
    w->host = fake_gpu_window_in(e->cc, size, size, NULL, flags, &w->mh);
    return;
  }
  if (!(w->host = calloc(1, size))) die("out of memory");
  if (g_gpu) w->dev = gpu_alloc_copy(w->host, size);
  CHECK(rma->regMrSym(e->cc, g_gpu ? (void *)w->dev : (void *)w->host, size, g_gpu ? NCCL_PTR_CUDA : NCCL_PTR_HOST,
                      flags, &w->mh));
}

/* [off, off + n) as the target sees it now: read back from the GPU under --gpu. */
static const char *ep_at(const struct ep_win *w, uint64_t off, uint64_t n) {
  if (w->dev && n) gpu_fetch(w->host + off, w->dev + off, n);
  return w->host + off;
}

/* Tokens src sends dst on context c in round k, 3..17: the coefficients are prime to 15, so the
 * words of one source on 15 consecutive contexts all get different values (an add landing on the
 * wrong word shows), and each word's value changes from round to round. */
static int ep_tokens(int src, int dst, int c, int k) { return 3 + (src * 7 + dst * 2 + c * 4 + k * 11) % 15; }

/* Where token t for dst (context c, round k) is read in the source's pattern window: a page that
 * moves each round, so a token left in place by an earlier round never passes for this round's. */
static uint64_t ep_src_off(int dst, int c, int k, int t) {
  return (uint64_t)((dst * 31 + c * 7 + k * 3 + t) % 251) * 4096 + (uint64_t)(c % 61) * 8;
}

/* Rounds: 8 with 2 ranks, fewer with more, so that a run posts about the same number of ops (the
 * threads of 128 contexts to every peer share CI's 2 cores); never fewer than 3, so the words
 * accumulate over several rounds. */
static int ep_rounds(void) { return g_n * 3 > 16 ? 3 : 16 / g_n; }

static uint64_t ep_slot(int src, int c) { return ((uint64_t)src * EP_NCTX + (uint64_t)c) * EP_SLOT; }
static int ep_word(int c, int src) { return c * g_n + src; }

/* This rank's round k: on every context, to every rank, its tokens then their signal; returns the
 * requests made. Odd contexts signal with NULL handles, even ones with the windows' handles and 0
 * bytes: NCCL's proxy posts a signal alone in either form. */
static int ep_post(struct env *e, const struct ep_win *recv, const struct ep_win *sig, int k, void **reqs) {
  int n = 0;
  for (int c = 0; c < EP_NCTX; c++)
    for (int i = 0; i < g_n; i++) {
      int p = (g_rank + 1 + i) % g_n; /* the peers first, this rank itself last */
      int ntok = ep_tokens(g_rank, p, c, k);
      uint64_t slot = ep_slot(g_rank, c);
      for (int t = 0; t < ntok; t++)
        CHECK(rma->iput(e->rc, c, ep_src_off(p, c, k, t), e->mh_src, EP_TOKEN, slot + (uint64_t)t * EP_TOKEN,
                        recv->mh, (uint32_t)p, &reqs[n++]));
      int bare = c % 2;
      CHECK(rma->iputSignal(e->rc, c, 0, bare ? NULL : e->mh_src, 0, bare ? 0 : slot, bare ? NULL : recv->mh,
                            (uint32_t)p, (uint64_t)ep_word(c, g_rank) * 8, sig->mh, (uint64_t)ntok,
                            NCCL_NET_SIGNAL_OP_ADD, true, &reqs[n++]));
    }
  return n;
}

/* Source s's tokens on context c in round k, checked the moment its word says they are there; the
 * rest of the slot, past the most tokens any round sent so far, must still be zero. */
static void ep_check_slot(const struct ep_win *recv, int s, int c, int k, int most) {
  int ntok = ep_tokens(s, g_rank, c, k);
  const char *slot = ep_at(recv, ep_slot(s, c), EP_SLOT);
  char what[128];
  for (int t = 0; t < ntok; t++) {
    snprintf(what, sizeof(what), "round %d: token %d of %d from rank %d on context %d, behind its signal", k, t,
             ntok, s, c);
    check_bytes(slot + (uint64_t)t * EP_TOKEN, EP_TOKEN, s, ep_src_off(g_rank, c, k, t), what);
  }
  check_zero(slot, (uint64_t)most * EP_TOKEN, EP_SLOT, "slot past every token sent");
}

/* The signal words now: one read of the whole window (a copy back from the GPU under --gpu). */
static uint64_t ep_word_now(const struct ep_win *sig, int w) {
  return __atomic_load_n((const uint64_t *)(const void *)sig->host + w, __ATOMIC_ACQUIRE);
}

/* Tests every request still open once; returns how many are. */
static int ep_poll_reqs(void *cc, void **reqs, int n) {
  int left = 0;
  for (int i = 0; i < n; i++) {
    if (!reqs[i]) continue;
    int done = 0;
    ncclResult_t r = rma->test(cc, reqs[i], &done);
    if (r != ncclSuccess) die("test of op %d returned %d", i, r);
    if (done) reqs[i] = NULL;
    else left++;
  }
  return left;
}

/* Round k, as a target: each word (c, s) holds want[w] from the rounds before, until it holds that
 * plus this round's add, in one step; its slot is checked right then. Meanwhile this rank's own
 * ops are polled, and rmaProgress called, as NCCL's proxy does. */
static void ep_round(struct env *e, const struct ep_win *recv, struct ep_win *sig, int k, uint64_t *want,
                     int *most, void **reqs) {
  int n = ep_post(e, recv, sig, k, reqs), nw = EP_NCTX * g_n, words_left = nw, reqs_left = n;
  static char seen[EP_NCTX * MAX_RANKS];
  memset(seen, 0, sizeof(seen));
  double t0 = now_s();
  while (words_left || reqs_left) {
    reqs_left = ep_poll_reqs(e->cc, reqs, n);
    if (sig->dev) gpu_fetch(sig->host, sig->dev, sig->size);
    for (int c = 0; c < EP_NCTX; c++)
      for (int s = 0; s < g_n; s++) {
        int w = ep_word(c, s), add = ep_tokens(s, g_rank, c, k);
        if (seen[w]) continue;
        uint64_t v = ep_word_now(sig, w);
        if (v == want[w]) continue;
        if (v != want[w] + (uint64_t)add)
          die("round %d: signal word of context %d, rank %d is %llu: neither %llu (before) nor %llu (after its add "
              "of %d)", k, c, s, (unsigned long long)v, (unsigned long long)want[w],
              (unsigned long long)(want[w] + (uint64_t)add), add);
        if (add > most[w]) most[w] = add;
        ep_check_slot(recv, s, c, k, most[w]);
        want[w] = v;
        seen[w] = 1;
        words_left--;
      }
    if (now_s() - t0 > DEADLINE_S)
      die("round %d: %d of %d signal words and %d of %d ops still pending after %d s", k, words_left, nw, reqs_left, n,
          DEADLINE_S);
    progress();
  }
  if (g_rank == 0)
    printf("eplike round %d: %d ops on %d contexts, every token checked behind its signal, %.1f ms\n", k, n, EP_NCTX,
           (now_s() - t0) * 1e3);
  barrier_round(k); /* the next round's tokens overwrite slots only after every target checked them */
}

static void scenario_eplike(void) {
  struct env e = {0};
  setup_contexts(&e, 1, EP_NCTX);
  struct ep_win recv, sig;
  ep_win_reg(&e, &recv, (size_t)g_n * EP_NCTX * EP_SLOT, 0);
  ep_win_reg(&e, &sig, (size_t)EP_NCTX * (size_t)g_n * sizeof(uint64_t),
             NCCL_NET_MR_FLAG_FORCE_SO | NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET);
  if (g_gpu_dmabuf) expect_dmabuf_reg(recv.size, "the receive window"); /* on the verbs double, SOFTVERBS_RECORD */
  void **reqs = calloc((size_t)EP_NCTX * (size_t)g_n * (EP_MAXTOK + 1), sizeof(void *));
  uint64_t *want = calloc((size_t)EP_NCTX * (size_t)g_n, sizeof(uint64_t));
  int *most = calloc((size_t)EP_NCTX * (size_t)g_n, sizeof(int));
  if (!reqs || !want || !most) die("out of memory");
  barrier(2);
  double t0 = now_s();
  for (int k = 0; k < ep_rounds(); k++) ep_round(&e, &recv, &sig, k, want, most, reqs);
  uint64_t total = 0;
  for (int w = 0; w < EP_NCTX * g_n; w++) total += want[w];
  printf("rank %d: eplike: %d rounds, %llu tokens received on %d contexts, signal words exact, %.2f s\n", g_rank,
         ep_rounds(), (unsigned long long)total, EP_NCTX, now_s() - t0);
  barrier(3);
  CHECK(rma->deregMrSym(e.cc, sig.mh));
  CHECK(rma->deregMrSym(e.cc, recv.mh));
  free(reqs);
  free(want);
  free(most);
  teardown(&e);
}

/* ---- noroute: a group whose ranks no device can connect fails at createContext, at once ---- */
static void scenario_noroute(void) {
  struct env e = {0};
  CHECK(rma->init(&e.ctx, 0x5eed, harness_logger));
  void *lc;
  CHECK(rma->listen(e.ctx, 0, shm->handles[g_rank], &lc));
  barrier(0);
  void *h[MAX_RANKS];
  for (int i = 0; i < g_n; i++) h[i] = shm->handles[i];
  CHECK(rma->connect(e.ctx, h, g_n, g_rank, lc, &e.cc));
  CHECK(rma->closeListen(lc));
  ncclRmaConfig_v14_t cfg = {.nContexts = NCTX, .trafficClass = 2, .rankStride = 1};
  double t0 = now_s();
  ncclResult_t res = rma->createContext(e.cc, &cfg, &e.rc);
  double dt = now_s() - t0;
  if (res == ncclSuccess) die("createContext succeeded, though no device of this node or the peer's can connect them");
  if (dt > 10) die("createContext took %.1f s to fail: a wait ran out instead of a refusal", dt);
  check_expected_warn();
  printf("rank %d: createContext refused (%d) in %.2f s\n", g_rank, res, dt);
  barrier(2);
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}

/* ---- gpurelay: GPU windows across planes, both ways. Each rank's ops to the other leave from its
 * NIC on the peer's plane and land on the peer's own NIC, the one beside its GPU. Window w (GPU):
 * [0, blk) this rank's pattern, [blk, 2 blk) the peer's staged putSignal from its GPU window,
 * [2 blk, 3 blk) this rank's staged get of the peer's [0, blk), [3 blk, 4 blk) the peer's
 * putSignal from host memory; both signals land on the GPU signal window gs; a get of the peer's
 * [0, blk) into host memory. ---- */
static void wait_word(volatile uint64_t *word, uint64_t want, const char *what) {
  double t0 = now_s();
  while (__atomic_load_n(word, __ATOMIC_ACQUIRE) < want) {
    if (now_s() - t0 > DEADLINE_S) die("%s is %llu after %d s, expected %llu", what,
                                       (unsigned long long)*word, DEADLINE_S, (unsigned long long)want);
    progress();
    sched_yield();
  }
  if (*word != want) die("%s is %llu, expected exactly %llu", what, (unsigned long long)*word,
                         (unsigned long long)want);
}

static void scenario_gpurelay(void) {
  if (g_n != 2) die("gpurelay runs 2 ranks");
  struct env e = {0};
  setup(&e, 1);
  const size_t blk = 64u << 10;
  void *mh = NULL, *smh = NULL;
  char *win = fake_gpu_window(e.cc, 4 * blk, NULL, &mh);
  uint64_t *gs = fake_gpu_window(e.cc, 8 * sizeof(uint64_t), NULL, &smh);
  for (uint64_t o = 0; o < blk; o++) win[o] = (char)pat(g_rank, o);
  barrier(2);
  uint32_t p = (uint32_t)(1 - g_rank);
  void *r[4];
  CHECK(rma->iputSignal(e.rc, 1, 0, mh, blk, blk, mh, p, 0, smh, 1, NCCL_NET_SIGNAL_OP_ADD, true, &r[0]));
  CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, blk, 3 * blk, mh, p, 8, smh, 0, NCCL_NET_SIGNAL_OP_INC, true, &r[1]));
  CHECK(rma->iget(e.rc, 2, 0, mh, blk, 2 * blk, mh, p, &r[2]));
  CHECK(rma->iget(e.rc, 0, 0, mh, blk, 0, e.mh_getw, p, &r[3]));
  wait_reqs(e.cc, r, 4, 0);
  wait_word(&gs[0], 1, "the GPU signal word of the staged put");
  wait_word(&gs[1], 1, "the GPU signal word of the put from host memory");
  check_bytes(win + blk, blk, (int)p, 0, "put from the peer's GPU window into this rank's");
  check_bytes(win + 2 * blk, blk, (int)p, 0, "get of the peer's GPU window into this rank's");
  check_bytes(win + 3 * blk, blk, (int)p, 0, "put from the peer's host window into this rank's GPU window");
  check_bytes(e.getw, blk, (int)p, 0, "get of the peer's GPU window into host memory");
  check_zero(e.getw, blk, e.getw_size, "host get window past the get");
  for (int w = 2; w < 8; w++)
    if (gs[w]) die("GPU signal word %d is %llu, no op aimed at it", w, (unsigned long long)gs[w]);
  bool err = true;
  CHECK(rma->queryLastError(e.rc, &err));
  if (err) die("queryLastError reports an error, though every op carried");
  printf("rank %d: puts, signals and gets into the peer's GPU windows across planes carried, every byte checked\n",
         g_rank);
  barrier(3);
  CHECK(rma->deregMrSym(e.cc, smh));
  CHECK(rma->deregMrSym(e.cc, mh));
  g_ctx = NULL;
  CHECK(rma->destroyContext(e.rc));
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}


/* ---- staged (--big --gpu-dmabuf, 2 ranks on two planes): rank 0, which relays, puts 64 MiB from its
 * GPU window and gets 64 MiB into one, through its staging ring; every byte checked ---- */
static void scenario_staged(void) {
  if (g_n != 2 || !g_big || !g_gpu_dmabuf) die("staged runs 2 ranks with --big --gpu-dmabuf");
  struct env e = {0};
  setup(&e, 1);
  void *r = NULL;
  const uint64_t odd = 100003, odd_src = 4097, odd_dst = 3;
  if (g_rank == 0) {
    /* The put, then a signal alone on the same context, as GIN kernels often signal: the signal must
     * wait for the staged data before it. */
    double t0 = now_s();
    void *rs[2];
    CHECK(rma->iput(e.rc, 0, 0, e.mh_src, BIG, 0, e.mh_big, 1, &rs[0]));
    CHECK(rma->iputSignal(e.rc, 0, 0, NULL, 0, 0, NULL, 1, 24 * 8, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_INC, true, &rs[1]));
    wait_reqs(e.cc, rs, 2, 0);
    printf("64 MiB staged put and its signal: %.1f ms\n", (now_s() - t0) * 1e3);
    CHECK(rma->iputSignal(e.rc, 2, odd_src, e.mh_src, odd, odd_dst, e.mh_recv, 1, 25 * 8, e.mh_sig, 1,
                          NCCL_NET_SIGNAL_OP_ADD, true, &r));
    wait_reqs(e.cc, &r, 1, 0);
  } else {
    wait_signal(&e, 24, 1);
    check_bytes(e.big, BIG, 0, 0, "64 MiB put from rank 0's GPU window through its staging ring");
    wait_signal(&e, 25, 1);
    check_zero(e.recv, 0, odd_dst, "before an odd-sized staged put");
    check_bytes(e.recv + odd_dst, odd, 0, odd_src, "odd-sized staged put");
    check_zero(e.recv, odd_dst + odd, e.recv_size, "after an odd-sized staged put");
    check_guard(&e);
  }
  barrier(2);
  if (g_rank == 0) {
    double t0 = now_s();
    CHECK(rma->iget(e.rc, 1, 0, e.mh_src, BIG, 0, e.mh_big, 1, &r));
    wait_reqs(e.cc, &r, 1, 0);
    printf("64 MiB staged get: %.1f ms\n", (now_s() - t0) * 1e3);
    check_bytes(e.big, BIG, 1, 0, "64 MiB get into rank 0's GPU window through its staging ring");
    const char *sb = getenv("MPLANE_TEST_RELAY_SLOT_BYTES");
    expect_dmabuf_reg((sb ? strtoull(sb, NULL, 0) : (4u << 20)) * 4, "the staging ring");
  }
  barrier(3);
  teardown(&e);
}

/* ---- getflush: a get into GPU memory is visible to the GPU only after iflush ---- */
static void scenario_getflush(void) {
  struct env e = {0};
  setup(&e, 1);
  const size_t blk = 64u << 10;
  void *gmh = NULL, *smh = NULL;
  char *gw = fake_gpu_window(e.cc, (size_t)g_n * blk, NULL, &gmh);
  (void)fake_gpu_window(e.cc, 8 * sizeof(uint64_t), NULL, &smh);
  barrier(2);
  void *reqs[MAX_RANKS];
  for (int p = 0; p < g_n; p++)
    CHECK(rma->iget(e.rc, p % NCTX, (uint64_t)p * 4096, e.mh_src, blk, (uint64_t)p * blk, gmh, (uint32_t)p, &reqs[p]));
  wait_reqs(e.cc, reqs, g_n, 0);
  for (int p = 0; p < g_n; p++) {
    void *flush = NULL;
    CHECK(rma->iflush(e.rc, p % NCTX, smh, (uint32_t)p, &flush));
    if (!flush) die("iflush after a get from rank %d into GPU memory returned no request: the GPU may not see it", p);
    wait_reqs(e.cc, &flush, 1, 0);
  }
  for (int p = 0; p < g_n; p++) check_bytes(gw + (size_t)p * blk, blk, p, (uint64_t)p * 4096, "get into GPU memory, flushed");
  /* Host memory is coherent: a get into it alone leaves nothing to flush. */
  for (int p = 0; p < g_n; p++)
    CHECK(rma->iget(e.rc, p % NCTX, 0, e.mh_src, 4096, (uint64_t)p * 4096, e.mh_getw, (uint32_t)p, &reqs[p]));
  wait_reqs(e.cc, reqs, g_n, 0);
  for (int p = 0; p < g_n; p++) {
    void *flush = NULL;
    CHECK(rma->iflush(e.rc, p % NCTX, smh, (uint32_t)p, &flush));
    if (flush) die("iflush after gets from rank %d into host memory only returned a request", p);
    check_bytes(e.getw + (size_t)p * 4096, 4096, p, 0, "get into host memory");
  }
  printf("rank %d: gets into GPU memory visible after iflush, every byte checked\n", g_rank);
  barrier(3);
  CHECK(rma->deregMrSym(e.cc, smh));
  CHECK(rma->deregMrSym(e.cc, gmh));
  teardown(&e);
}

/* ---- stagefault (--gpu-dmabuf, MPLANE_TEST_RELAY_FAIL=copy:2, 64 KiB slots): rank 0's staged put
 * (context 0) and staged get (context 1) each lose their second copy: both end in an error from test
 * and queryLastError, within the deadline; the signal never comes; nothing lands outside their
 * ranges, and inside them only the right bytes (or none) ---- */
static void check_partial(const char *buf, uint64_t n, int owner, uint64_t src_off, const char *what) {
  for (uint64_t o = 0; o < n; o++)
    if (buf[o] && (uint8_t)buf[o] != pat(owner, src_off + o))
      die("%s: byte %llu is 0x%02x, neither untouched nor the source's 0x%02x", what, (unsigned long long)o,
          (uint8_t)buf[o], pat(owner, src_off + o));
}

static void scenario_stagefault(void) {
  if (g_n != 2 || !g_gpu_dmabuf) die("stagefault runs 2 ranks with --gpu-dmabuf");
  struct env e = {0};
  setup(&e, 1);
  const uint64_t len = 4 * (64u << 10), at = 64u << 10, gsize = 512u << 10;
  void *gmh = NULL;
  char *gw = fake_gpu_window(e.cc, gsize, NULL, &gmh);
  barrier(2);
  if (g_rank == 0) {
    void *r = NULL;
    double t0 = now_s();
    CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, len, SUB, e.mh_recv, 1, 0, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true,
                          &r));
    expect_refused(e.cc, r, "staged put whose second copy fails");
    CHECK(rma->iget(e.rc, 1, 0, e.mh_src, len, at, gmh, 1, &r));
    expect_refused(e.cc, r, "staged get whose second copy fails");
    bool err = false;
    CHECK(rma->queryLastError(e.rc, &err));
    if (!err) die("queryLastError reports no error after failed copies");
    check_expected_warn();
    printf("rank 0: the staged put and get failed with their copies after %.2f s\n", now_s() - t0);
    check_zero(gw, 0, at, "GPU window before the failed get's range");
    check_partial(gw + at, len, 1, 0, "GPU window inside the failed get's range");
    check_zero(gw, at + len, gsize, "GPU window past the failed get's range");
  }
  barrier(3);
  if (g_rank == 1) {
    usleep(200 * 1000); /* a signal that should never come has had time to */
    if (sig_read(&e, 0)) die("the failed put's signal arrived (%llu)", (unsigned long long)sig_read(&e, 0));
    check_zero(e.recv, 0, SUB, "window before the failed put's range");
    check_partial(e.recv + SUB, len, 0, 0, "window inside the failed put's range");
    check_zero(e.recv, SUB + len, e.recv_size, "window past the failed put's range");
    check_guard(&e);
  }
  barrier(4);
  CHECK(rma->deregMrSym(e.cc, gmh));
  g_ctx = NULL;
  double t0 = now_s();
  CHECK(rma->destroyContext(e.rc));
  if (now_s() - t0 > 15) die("destroyContext took %.1f s after failed copies", now_s() - t0);
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
}

/* MPLANE_RMA_NETNS_<r>: this rank runs in that network namespace (/var/run/netns/<name>, as `ip netns`
 * makes them): the emulated multi-plane fabric puts each node in its own (scripts/fabric.sh). */
static void rank_netns(int r) {
  char name[40], path[160];
  snprintf(name, sizeof(name), "MPLANE_RMA_NETNS_%d", r);
  const char *ns = getenv(name);
  if (!ns || !*ns) return;
  snprintf(path, sizeof(path), "/var/run/netns/%s", ns);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0 || setns(fd, CLONE_NEWNET) != 0) die("entering network namespace %s: %s", path, strerror(errno));
  close(fd);
}

/* MPLANE_RMA_ENV_<r>: this rank's own variables, before the plugin reads any. */
static void rank_env(int r) {
  char name[32];
  snprintf(name, sizeof(name), "MPLANE_RMA_ENV_%d", r);
  const char *v = getenv(name);
  if (!v) return;
  char *copy = strdup(v), *save = NULL;
  if (!copy) die("out of memory");
  for (char *t = strtok_r(copy, " ", &save); t; t = strtok_r(NULL, " ", &save)) {
    char *eq = strchr(t, '=');
    if (!eq || eq == t) die("%s: '%s' is not NAME=VALUE", name, t);
    *eq = 0;
    if (setenv(t, eq + 1, 1) != 0) die("%s: setenv %s failed", name, t);
  }
  free(copy);
}

int main(int argc, char **argv) {
  const char *plugin = NULL, *scenario = NULL;
  g_n = 2;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--plugin") && i + 1 < argc) plugin = argv[++i];
    else if (!strcmp(argv[i], "--ranks") && i + 1 < argc) g_n = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--big")) g_big = 1;
    else if (!strcmp(argv[i], "--gpu")) g_gpu = 1;
    else if (!strcmp(argv[i], "--no-progress")) g_no_progress = 1;
    else if (!strcmp(argv[i], "--gpu-dmabuf")) g_gpu_dmabuf = 1;
    else if (!strcmp(argv[i], "--target") && i + 1 < argc) g_target = atoi(argv[++i]);
    else scenario = argv[i];
  }
  if (!plugin || !scenario || g_n < 2 || g_n > MAX_RANKS) {
    fprintf(stderr, "usage: rma-harness --plugin PATH [--ranks 2..%d] [--big] [--gpu] [--gpu-dmabuf] [--target R] [--no-progress] data|order|alltoall|oob|stride|kill|stall|regfail|rate|proxyloop|dmabuf|noroute|gpurelay|staged|stagefault|getflush|eplike\n",
            MAX_RANKS);
    return 2;
  }
  void (*fn)(void) = !strcmp(scenario, "data") ? scenario_data : !strcmp(scenario, "order") ? scenario_order
                     : !strcmp(scenario, "oob") ? scenario_oob : !strcmp(scenario, "stride") ? scenario_stride
                     : !strcmp(scenario, "kill") ? scenario_kill
                     : !strcmp(scenario, "stall") ? scenario_stall
                     : !strcmp(scenario, "peerfault") ? scenario_peerfault
                     : !strcmp(scenario, "regfail") ? scenario_regfail
                     : !strcmp(scenario, "rate") ? scenario_rate
                     : !strcmp(scenario, "proxyloop") ? scenario_proxyloop
                     : !strcmp(scenario, "replies") ? scenario_replies
                     : !strcmp(scenario, "dmabuf") ? scenario_dmabuf
                     : !strcmp(scenario, "noroute") ? scenario_noroute
                     : !strcmp(scenario, "gpurelay") ? scenario_gpurelay
                     : !strcmp(scenario, "staged") ? scenario_staged
                     : !strcmp(scenario, "stagefault") ? scenario_stagefault
                     : !strcmp(scenario, "getflush") ? scenario_getflush
                     : !strcmp(scenario, "eplike") ? scenario_eplike
                     : !strcmp(scenario, "alltoall") ? scenario_alltoall : NULL;
  g_src_size = g_big ? BIG : (4u << 20);
  if (g_target < 0 || g_target >= g_n) {
    fprintf(stderr, "--target %d is not a rank of %d\n", g_target, g_n);
    return 2;
  }
  if (g_gpu && fn != scenario_alltoall && fn != scenario_order && fn != scenario_eplike) {
    fprintf(stderr, "--gpu runs the alltoall, order and eplike scenarios\n");
    return 2;
  }
  if (!fn) {
    fprintf(stderr, "unknown scenario '%s'\n", scenario);
    return 2;
  }
  shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) return 1;
  memset(shm, 0, sizeof(*shm));
  pid_t pids[MAX_RANKS];
  for (int r = 0; r < g_n; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      g_rank = r;
      shm->pids[r] = getpid();
      alarm(2 * DEADLINE_S); /* the last word against a hang */
      rank_netns(r);
      rank_env(r);
      void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
      if (!lib) die("dlopen %s: %s", plugin, dlerror());
      const char *hook = test_hooks_unread(lib);
      if (hook) die("%s is set, but %s is built without the test hooks (load the test build)", hook, plugin);
      rma = dlsym(lib, "ncclRmaPlugin_v14");
      if (!rma) die("%s exports no ncclRmaPlugin_v14", plugin);
      if (g_gpu) {
        int rc = gpu_open();
        if (rc) {
          fflush(stdout);
          _exit(rc);
        }
      }
      fn();
      fflush(stdout);
      _exit(0);
    }
  }
  int fail = 0, skipped = 0;
  for (int r = 0; r < g_n; r++) {
    int st = 0;
    if (shm->expect_killed == r + 1) kill(pids[r], SIGKILL); /* the others are done: never wait on a stopped rank */
    waitpid(pids[r], &st, 0);
    if (WIFEXITED(st) && WEXITSTATUS(st) == 77) {
      skipped++;
      continue;
    }
    if (shm->expect_killed == r + 1 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL) continue;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d ended with %s %d\n", r, WIFSIGNALED(st) ? "signal" : "status",
              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
      fail = 1;
    }
  }
  if (skipped == g_n) {
    printf("%s with %d ranks on GPU windows: skipped (no GPU)\n", scenario, g_n);
    return 77;
  }
  if (skipped) fail = 1; /* some ranks found a GPU and others none: not a clean skip */
  printf("%s with %d ranks%s: %s\n", scenario, g_n, g_gpu ? " on GPU windows" : "", fail ? "FAIL" : "OK");
  return fail;
}
