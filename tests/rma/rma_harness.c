/* mplane RMA harness: dlopens the plugin and drives ncclRmaPlugin_v14 the way NCCL 2.30's GIN proxy
 * does (init, devices, getProperties, listen, connect as a group, closeListen, createContext,
 * symmetric regMrSym, then iput / iputSignal / iget / iflush polled with test, queryLastError, and
 * the teardown), between N processes over loopback. Every byte is checked.
 *
 * This file is the core: the command line and the scenario table, the ranks, barriers, the data
 * pattern, the proxy's polling, setup and teardown, and the checks. The scenarios live in one file per
 * family; rma_harness.h lists them.
 *
 *   rma-harness --plugin PATH [--ranks N] [--big] [--gpu] [--no-progress] SCENARIO
 *
 * MPLANE_RMA_ENV_<r> (space-separated NAME=VALUE pairs) is set in rank r's process before it loads
 * the plugin: ranks on different devices of one machine (the rxe suite puts even ranks on rxe0 and
 * odd ones on rxe1).
 *
 * --gpu puts the windows and signals of alltoall, order, eplike and getsignal in GPU memory (exit 77
 * without a GPU).
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
 *   getflush-inflight  a get in flight when a flush is posted: the next flush reads again (a request)
 *   getflush every rank gets from every rank (itself included) into a window registered as GPU memory
 *            (a memfd dma-buf), waits for the gets, then iflushes each peer with its GPU signal window as
 *            NCCL's GIN proxy does: the flush must be a request (a GPU needs one) and, once done, every
 *            byte must be there (the verbs double holds READ data back from GPU memory until a flush);
 *            gets into host memory alone need no flush (a NULL request)
 *   getsignal every rank adds to a signal word of every other (a putSignal alone) and gets that word
 *            right behind it on the same context, 200 times: each get must see the add (with --gpu,
 *            a GPU signal window registered SIGNAL_NEVER_RESET, whose adds the lane batches)
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
#include "rma_harness.h"
#include "tests/test_hooks_check.h"

struct shared *shm;
int g_rank, g_n, g_big, g_gpu;
int g_gpu_dmabuf; /* --gpu-dmabuf: the source and big windows are "GPU" memfd dma-bufs (no GPU needed) */
int g_target;     /* --target R: the rank the order scenario streams to */
int g_no_progress; /* --no-progress: never call rmaProgress (the plugin's own threads serve) */
void *g_ctx;       /* the context rmaProgress is called on while waiting, as NCCL's GIN proxy does */
uint64_t g_src_size; /* the pattern window: BIG with --big, else 4 MiB */
const ncclRma_v14_t *rma;

void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "rank %d: FAIL: ", g_rank);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  _exit(1);
}

double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Barriers keep calling rmaProgress: NCCL's progress thread never stops for the application. */
void barrier_of(int id, int count) {
  __atomic_fetch_add(&shm->arrived[id], 1, __ATOMIC_SEQ_CST);
  double t0 = now_s();
  while (__atomic_load_n(&shm->arrived[id], __ATOMIC_SEQ_CST) < count) {
    if (now_s() - t0 > DEADLINE_S) die("barrier %d: only %d of %d ranks arrived", id, shm->arrived[id], g_n);
    progress();
    sched_yield();
  }
}

void barrier(int id) { barrier_of(id, g_n); }

/* The k-th crossing (k = 0, 1, ...) of a barrier used many times. */
void barrier_round(long k) {
  __atomic_fetch_add(&shm->rounds, 1, __ATOMIC_SEQ_CST);
  double t0 = now_s();
  while (__atomic_load_n(&shm->rounds, __ATOMIC_SEQ_CST) < (k + 1) * g_n) {
    if (now_s() - t0 > DEADLINE_S) die("round %ld: not every rank arrived", k);
    progress();
    sched_yield();
  }
}

uint8_t pat(int rank, uint64_t off) { return (uint8_t)(rank * 131 + off * 7 + (off >> 12) + 1); }

static uint64_t rng_state;
uint64_t rnd(void) {
  rng_state ^= rng_state << 13;
  rng_state ^= rng_state >> 7;
  rng_state ^= rng_state << 17;
  return rng_state;
}
void seed(int src, int dst, int salt) { rng_state = 0x9e3779b97f4a7c15ull ^ ((uint64_t)src << 40) ^ ((uint64_t)dst << 20) ^ (uint64_t)salt; rnd(); }

/* Sizes: 0, 1, the whole region, and random ones in between. */
uint64_t pick_size(int i, uint64_t max) {
  if (i == 0) return 0;
  if (i == 1) return 1;
  if (i == 2) return max;
  return rnd() % (max + 1);
}

/* The random put i from src to dst: its size, source offset, and offset in dst's window. */
void put_plan(int src, int dst, int i, uint64_t *size, uint64_t *soff, uint64_t *doff) {
  seed(src, dst, i);
  *size = pick_size(i, SUB);
  *soff = rnd() % (g_src_size - *size + 1);
  *doff = ((uint64_t)src * K + (uint64_t)i) * SUB + rnd() % (SUB - *size + 1);
}

/* What NCCL's GIN progress thread does between polls: let the backend move bytes (and serve its
 * peers) from this thread. */
void progress(void) {
  if (g_ctx && !g_no_progress && rma->rmaProgress && rma->rmaProgress(g_ctx) != ncclSuccess)
    die("rmaProgress failed");
}

/* Poll requests until all are done; a failure is fatal unless want_err, where it counts. */
int wait_reqs(void *cc, void **reqs, int n, int want_err) {
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

void *gpu_alloc_copy(const void *host, size_t n) {
  cu_ptr p = 0;
  if (cu.mem_alloc(&p, n) != 0 || cu.htod(p, host, n) != 0) die("cuMemAlloc/HtoD of %zu bytes failed", n);
  return (void *)(uintptr_t)p;
}

void gpu_fetch(void *host, const void *dev, size_t n) {
  if (cu.dtoh(host, (cu_ptr)(uintptr_t)dev, n) != 0) die("cuMemcpyDtoH of %zu bytes failed", n);
}

/* --gpu-dmabuf: a window that the plugin takes for GPU memory, without a GPU: a memfd mapped here and
 * registered through regMrSymDmaBuf as NCCL_PTR_CUDA (its fd closed at once, as NCCL's proxy does).
 * The plugin's CPU copier (MPLANE_TEST_RELAY_COPIER=cpu) and the verbs double both reach it, so
 * its bytes can be checked in place. */
void *fake_gpu_window_in(void *cc, size_t size, size_t mapped, const void *init, uint64_t flags, void **mh) {
  int fd = memfd_create("mplane-rma-fake-gpu", 0);
  if (fd < 0 || ftruncate(fd, (off_t)mapped) != 0) die("memfd: %s", strerror(errno));
  char *win = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (win == MAP_FAILED) die("mmap of the memfd: %s", strerror(errno));
  if (init) memcpy(win, init, mapped);
  CHECK(rma->regMrSymDmaBuf(cc, win, size, NCCL_PTR_CUDA, 0, fd, flags, mh));
  close(fd);
  return win;
}

void *fake_gpu_window(void *cc, size_t size, const void *init, void **mh) {
  return fake_gpu_window_in(cc, size, size, init, 0, mh);
}

int connected(int p, int stride) { return p != g_rank && ((p - g_rank + g_n) % g_n) % stride == 0; }

const char *expected_warn(void) {
  char name[40];
  snprintf(name, sizeof(name), "MPLANE_RMA_EXPECT_WARN_%d", g_rank);
  return getenv(name) ? getenv(name) : getenv("MPLANE_RMA_EXPECT_WARN");
}

/* The plugin's log (NCCL's logger stands here): WARNs to stderr as before; the cross-plane INFO noted. */
int g_saw_cross_plane, g_saw_warn;
void harness_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
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

void group_connect(struct env *e) {
  void *lc;
  CHECK(rma->listen(e->ctx, 0, shm->handles[g_rank], &lc));
  barrier(0);
  void *h[MAX_RANKS];
  for (int i = 0; i < g_n; i++) h[i] = shm->handles[i];
  CHECK(rma->connect(e->ctx, h, g_n, g_rank, lc, &e->cc));
  CHECK(rma->closeListen(lc));
}

/* nctx: the contexts createContext makes (NCCL EP asks for 128, the other scenarios for NCTX). */
void setup_contexts(struct env *e, int stride, int nctx) {
  CHECK(rma->init(&e->ctx, 0x5eed, harness_logger));
  int ndev = 0;
  CHECK(rma->devices(&ndev));
  if (ndev < 1) die("devices() reported %d devices", ndev);
  ncclNetProperties_v12_t props;
  CHECK(rma->getProperties(0, &props));
  if (props.netDeviceType != NCCL_NET_DEVICE_GIN_PROXY) die("netDeviceType %d, not GIN_PROXY", props.netDeviceType);
  if (!(props.ptrSupport & NCCL_PTR_HOST) || !(props.ptrSupport & NCCL_PTR_CUDA))
    die("ptrSupport 0x%x lacks HOST or CUDA", props.ptrSupport);
  group_connect(e);
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

void setup(struct env *e, int stride) { setup_contexts(e, stride, NCTX); }

void teardown(struct env *e) {
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

uint64_t sig_read(struct env *e, int word) {
  if (e->d_sig) gpu_fetch(&e->sig[word], &e->d_sig[word], sizeof(uint64_t));
  return __atomic_load_n(&e->sig[word], __ATOMIC_ACQUIRE);
}

/* The host copy of the receive window's [off, off + n), fresh from the GPU under --gpu. */
const char *recv_at(struct env *e, uint64_t off, uint64_t n) {
  if (e->d_recv && n) gpu_fetch(e->recv + off, e->d_recv + off, n);
  return e->recv + off;
}

void wait_signal(struct env *e, int word, uint64_t want) {
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

void check_bytes(const char *buf, uint64_t n, int owner, uint64_t src_off, const char *what) {
  for (uint64_t o = 0; o < n; o++)
    if ((uint8_t)buf[o] != pat(owner, src_off + o))
      die("%s: byte %llu of %llu is 0x%02x, expected 0x%02x (from rank %d)", what, (unsigned long long)o,
          (unsigned long long)n, (uint8_t)buf[o], pat(owner, src_off + o), owner);
}

void check_zero(const char *buf, uint64_t from, uint64_t to, const char *what) {
  for (uint64_t o = from; o < to; o++)
    if (buf[o]) die("%s: byte %llu was written (0x%02x) though no put covers it", what, (unsigned long long)o,
                    (uint8_t)buf[o]);
}

void check_guard(struct env *e) {
  for (int i = 0; i < GUARD; i++)
    if ((uint8_t)e->recv[e->recv_size + i] != 0xA5) die("the guard past the window was written at +%d", i);
}

void check_expected_warn(void) {
  const char *want = expected_warn();
  if (want && !g_saw_warn) die("no WARN containing '%s'", want);
}

/* SOFTVERBS_RECORD, when set: this process registered a buffer of `length` bytes through its dma-buf. */
void expect_dmabuf_reg(size_t length, const char *what) {
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

/* Every scenario, by the name the command line gives; gpu: it runs on GPU windows too (--gpu). */
static const struct scenario {
  const char *name;
  void (*fn)(void);
  int gpu;
} scenarios[] = {
    {"data", scenario_data, 0},
    {"order", scenario_order, 1},
    {"alltoall", scenario_alltoall, 1},
    {"oob", scenario_oob, 0},
    {"stride", scenario_stride, 0},
    {"kill", scenario_kill, 0},
    {"peerfault", scenario_peerfault, 0},
    {"stall", scenario_stall, 0},
    {"regfail", scenario_regfail, 0},
    {"stagefault", scenario_stagefault, 0},
    {"rate", scenario_rate, 0},
    {"proxyloop", scenario_proxyloop, 0},
    {"replies", scenario_replies, 0},
    {"lastpass", scenario_lastpass, 0},
    {"eplike", scenario_eplike, 1},
    {"dmabuf", scenario_dmabuf, 0},
    {"noroute", scenario_noroute, 0},
    {"gpurelay", scenario_gpurelay, 0},
    {"staged", scenario_staged, 0},
    {"getflush", scenario_getflush, 0},
    {"getsignal", scenario_getsignal, 1},
    {"getflush-inflight", scenario_getflush_inflight, 0},
};

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
    fprintf(stderr, "usage: rma-harness --plugin PATH [--ranks 2..%d] [--big] [--gpu] [--gpu-dmabuf] [--target R] [--no-progress] data|order|alltoall|oob|stride|kill|stall|regfail|rate|proxyloop|dmabuf|noroute|gpurelay|staged|stagefault|getflush|getflush-inflight|getsignal|eplike\n",
            MAX_RANKS);
    return 2;
  }
  const struct scenario *sc = NULL;
  for (size_t i = 0; i < sizeof(scenarios) / sizeof(scenarios[0]) && !sc; i++)
    if (!strcmp(scenario, scenarios[i].name)) sc = &scenarios[i];
  void (*fn)(void) = sc ? sc->fn : NULL;
  g_src_size = g_big ? BIG : (4u << 20);
  if (g_target < 0 || g_target >= g_n) {
    fprintf(stderr, "--target %d is not a rank of %d\n", g_target, g_n);
    return 2;
  }
  if (g_gpu && !(sc && sc->gpu)) {
    fprintf(stderr, "--gpu runs the alltoall, order, eplike and getsignal scenarios\n");
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

