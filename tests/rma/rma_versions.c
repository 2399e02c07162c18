/* mplane RMA versions test: the plugin's three RMA tables, as NCCL 2.30 (ncclRmaPlugin_v14), 2.31
 * (_v15) and 2.32 (_v16) find them, between 2 processes over loopback.
 *
 *   rma-versions --plugin PATH
 *
 * Without NCCL 2.31 or 2.32 at hand, this is what proves the newer tables:
 * - layout: the entries the versions share are the same functions at each table's own offsets, the
 *   entries that differ are not, and v16's getProperties (which sits one slot later, after
 *   getRmaProperties) answers like v14's;
 * - v16's getRmaProperties on a connected group says flushesAllPutsOnAnySignal false (a signal orders
 *   only the puts of its own context and sender);
 * - init names the table NCCL took in its INFO line;
 * - one round per version, each rank to the other: a run of puts posted with the aggregation hint
 *   (ncclRmaOptFlagsAggregateRequests) ended by a putSignal without it; a signal alone and a weak
 *   putSignal, both hinted, that only rmaProgress ends; two hinted gets ended by an iflush. The
 *   target waits for each signal and checks every byte of its window (the regions written and the
 *   gaps left zero); the gets' bytes are checked too. v14 runs the same ops without the flag. */
#include <dlfcn.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/nccl/rma_v16.h"

#define NRANKS 2
#define NPUT 8                /* the hinted puts of one run */
#define SUB (64u << 10)       /* the region of one put in the target's window */
#define NREGION (NPUT + 2)    /* the run's puts, its closing putSignal, the weak putSignal */
#define SRC_SIZE (1u << 20)
#define GET_SIZE (48u << 10)
#define DEADLINE_S 30

static const int versions[] = {14, 15, 16};
#define NVERSIONS (int)(sizeof(versions) / sizeof(versions[0]))

struct shared {
  char handles[NVERSIONS][NRANKS][NCCL_NET_HANDLE_MAXSIZE];
  volatile int arrived[64];
};

static struct shared *shm;
static int g_rank;

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

#define CHECK(call)                                                             \
  do {                                                                          \
    ncclResult_t r_ = (call);                                                   \
    if (r_ != ncclSuccess) die("%s returned %d (line %d)", #call, r_, __LINE__); \
  } while (0)

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- one table, whichever version: the ops with optFlags (v14 drops them) ---- */
struct table {
  int version;
  const ncclRma_v14_t *v14;
  const ncclRma_v15_t *v15;
  const ncclRma_v16_t *v16;
};

static ncclResult_t t_init(const struct table *t, void **ctx, ncclDebugLogger_t log) {
  return t->v16 ? t->v16->init(ctx, 0x5eed, log) : t->v15 ? t->v15->init(ctx, 0x5eed, log) : t->v14->init(ctx, 0x5eed, log);
}

/* The entries whose type is the same in every version are called through v14's view of the table
 * only where the test has shown they are the same functions (check_layout). */
static const ncclRma_v14_t *common_of(const struct table *t) { return t->v14; }

static ncclResult_t t_get_properties(const struct table *t, int dev, ncclNetProperties_v12_t *p) {
  return t->v16 ? t->v16->getProperties(dev, p) : t->v15 ? t->v15->getProperties(dev, p) : t->v14->getProperties(dev, p);
}

static ncclResult_t t_put(const struct table *t, void *rc, int context, uint64_t soff, void *smh, size_t size,
                          uint64_t doff, void *dmh, uint32_t rank, uint32_t flags, void **req) {
  if (t->v16) return t->v16->iput(rc, context, soff, smh, size, doff, dmh, rank, flags, req);
  if (t->v15) return t->v15->iput(rc, context, soff, smh, size, doff, dmh, rank, flags, req);
  return t->v14->iput(rc, context, soff, smh, size, doff, dmh, rank, req);
}

static ncclResult_t t_put_signal(const struct table *t, void *rc, int context, uint64_t soff, void *smh,
                                 size_t size, uint64_t doff, void *dmh, uint32_t rank, uint64_t sig_off,
                                 void *sig_mh, uint64_t value, uint32_t op, bool strong, uint32_t flags,
                                 void **req) {
  if (t->v16)
    return t->v16->iputSignal(rc, context, soff, smh, size, doff, dmh, rank, sig_off, sig_mh, value, op, strong,
                              flags, req);
  if (t->v15)
    return t->v15->iputSignal(rc, context, soff, smh, size, doff, dmh, rank, sig_off, sig_mh, value, op, strong,
                              flags, req);
  return t->v14->iputSignal(rc, context, soff, smh, size, doff, dmh, rank, sig_off, sig_mh, value, op, strong, req);
}

static ncclResult_t t_get(const struct table *t, void *rc, int context, uint64_t roff, void *rmh, size_t size,
                          uint64_t loff, void *lmh, uint32_t rank, uint32_t flags, void **req) {
  if (t->v16) return t->v16->iget(rc, context, roff, rmh, size, loff, lmh, rank, flags, req);
  if (t->v15) return t->v15->iget(rc, context, roff, rmh, size, loff, lmh, rank, flags, req);
  return t->v14->iget(rc, context, roff, rmh, size, loff, lmh, rank, req);
}

/* ---- layout ---- */
#define SAME(a, b, what) \
  do {                   \
    if ((void *)(a) != (void *)(b)) die("%s differs between the tables (a slot out of place)", what); \
  } while (0)

static void check_layout(const ncclRma_v14_t *a, const ncclRma_v15_t *b, const ncclRma_v16_t *c) {
  if (!a->name || !b->name || !c->name || strcmp(a->name, "mplane") || strcmp(b->name, "mplane") ||
      strcmp(c->name, "mplane"))
    die("a table is not named mplane");
  SAME(a->devices, b->devices, "devices (v14/v15)");
  SAME(a->devices, c->devices, "devices (v14/v16)");
  SAME(a->getProperties, b->getProperties, "getProperties (v14/v15)");
  SAME(a->getProperties, c->getProperties, "getProperties (v14/v16)");
  SAME(a->listen, c->listen, "listen");
  SAME(a->connect, c->connect, "connect");
  SAME(a->createContext, b->createContext, "createContext (v14/v15)");
  SAME(a->createContext, c->createContext, "createContext (v14/v16)");
  SAME(a->regMrSym, c->regMrSym, "regMrSym");
  SAME(a->regMrSymDmaBuf, c->regMrSymDmaBuf, "regMrSymDmaBuf");
  SAME(a->deregMrSym, c->deregMrSym, "deregMrSym");
  SAME(a->destroyContext, c->destroyContext, "destroyContext");
  SAME(a->closeColl, c->closeColl, "closeColl");
  SAME(a->closeListen, b->closeListen, "closeListen (v14/v15)");
  SAME(a->closeListen, c->closeListen, "closeListen (v14/v16)");
  SAME(a->iflush, b->iflush, "iflush (v14/v15)");
  SAME(a->iflush, c->iflush, "iflush (v14/v16)");
  SAME(a->test, c->test, "test");
  SAME(a->rmaProgress, c->rmaProgress, "rmaProgress");
  SAME(a->queryLastError, c->queryLastError, "queryLastError");
  SAME(a->finalize, b->finalize, "finalize (v14/v15)");
  SAME(a->finalize, c->finalize, "finalize (v14/v16)");
  SAME(b->iput, c->iput, "iput (v15/v16)");
  SAME(b->iputSignal, c->iputSignal, "iputSignal (v15/v16)");
  SAME(b->iget, c->iget, "iget (v15/v16)");
  /* the ops with optFlags are other functions than v14's, and v16's new entry is a function of its own */
  if ((void *)a->iput == (void *)b->iput || (void *)a->iputSignal == (void *)b->iputSignal ||
      (void *)a->iget == (void *)b->iget)
    die("v15's ops are v14's: optFlags would be taken for the request");
  if (!c->getRmaProperties || (void *)c->getRmaProperties == (void *)c->getProperties)
    die("v16 has no getRmaProperties of its own");
}

/* ---- the log: init's INFO names the table ---- */
static int g_saw_version;
static int g_want_version;
static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  char msg[1024], want[64];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  snprintf(want, sizeof(want), "ncclRmaPlugin_v%d served by", g_want_version);
  if (strstr(msg, want)) g_saw_version = 1;
  if (level == NCCL_LOG_WARN) fprintf(stderr, "rank %d: WARN %s\n", g_rank, msg);
}

/* ---- a round ---- */
struct env {
  void *ctx, *cc, *rc;
  char *recv, *src, *getw;
  uint64_t *sig;
  void *mh_recv, *mh_src, *mh_getw, *mh_sig;
};

static const struct table *cur;
static void *g_rc; /* rmaProgress is called on it while waiting, as NCCL's GIN progress thread does */

static void progress(void) {
  const ncclRma_v14_t *c = common_of(cur);
  if (g_rc && c->rmaProgress && c->rmaProgress(g_rc) != ncclSuccess) die("rmaProgress failed");
}

static void barrier(int id) {
  __atomic_fetch_add(&shm->arrived[id], 1, __ATOMIC_SEQ_CST);
  double t0 = now_s();
  while (__atomic_load_n(&shm->arrived[id], __ATOMIC_SEQ_CST) < NRANKS) {
    if (now_s() - t0 > DEADLINE_S) die("barrier %d: the other rank never came", id);
    progress();
    sched_yield();
  }
}

static uint8_t pat(int rank, int version, uint64_t off) {
  return (uint8_t)(rank * 131 + version * 29 + off * 7 + (off >> 12) + 1);
}

/* The run's puts: sizes from 1 byte to a whole region, source offsets spread over the window. */
static uint64_t put_size(int i) { return i == 0 ? 1 : i == NPUT - 1 ? SUB : (uint64_t)(i * 7919) % SUB + 1; }
static uint64_t put_soff(int i) { return (uint64_t)i * 104729 % (SRC_SIZE - SUB); }

static void wait_reqs(void *cc, void **reqs, int n) {
  const ncclRma_v14_t *c = common_of(cur);
  double t0 = now_s();
  for (int left = n; left > 0;) {
    for (int i = 0; i < n; i++) {
      int done = 0;
      if (!reqs[i]) continue;
      CHECK(c->test(cc, reqs[i], &done));
      if (done) {
        reqs[i] = NULL;
        left--;
      }
    }
    if (left && now_s() - t0 > DEADLINE_S) die("v%d: %d requests not done after %d s", cur->version, left, DEADLINE_S);
    progress();
  }
}

static void setup(struct env *e, int vi) {
  const ncclRma_v14_t *c = common_of(cur);
  g_want_version = cur->version;
  g_saw_version = 0;
  CHECK(t_init(cur, &e->ctx, logger));
  if (!g_saw_version) die("init of ncclRmaPlugin_v%d did not say it serves that table", cur->version);
  int ndev = 0;
  CHECK(c->devices(&ndev));
  if (ndev < 1) die("no devices");
  ncclNetProperties_v12_t p;
  memset(&p, 0, sizeof(p));
  CHECK(t_get_properties(cur, 0, &p));
  if (p.netDeviceType != NCCL_NET_DEVICE_GIN_PROXY || !(p.ptrSupport & NCCL_PTR_HOST) || !(p.ptrSupport & NCCL_PTR_CUDA))
    die("v%d getProperties: netDeviceType %d, ptrSupport 0x%x (want GIN_PROXY, HOST and CUDA)", cur->version,
        p.netDeviceType, p.ptrSupport);
  void *lc;
  CHECK(c->listen(e->ctx, 0, shm->handles[vi][g_rank], &lc));
  barrier(vi * 8 + 0);
  void *h[NRANKS];
  for (int r = 0; r < NRANKS; r++) h[r] = shm->handles[vi][r];
  CHECK(c->connect(e->ctx, h, NRANKS, g_rank, lc, &e->cc));
  CHECK(c->closeListen(lc));
  ncclRmaConfig_v14_t cfg = {.nContexts = 2, .trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF, .rankStride = 1};
  CHECK(c->createContext(e->cc, &cfg, &e->rc));
  g_rc = e->rc;
  e->recv = calloc(1, (size_t)NREGION * SUB);
  e->src = malloc(SRC_SIZE);
  e->getw = calloc(1, 2 * GET_SIZE);
  e->sig = calloc(8, sizeof(uint64_t));
  if (!e->recv || !e->src || !e->getw || !e->sig) die("out of memory");
  for (uint64_t o = 0; o < SRC_SIZE; o++) e->src[o] = (char)pat(g_rank, cur->version, o);
  CHECK(c->regMrSym(e->cc, e->recv, (size_t)NREGION * SUB, NCCL_PTR_HOST, 0, &e->mh_recv));
  CHECK(c->regMrSym(e->cc, e->src, SRC_SIZE, NCCL_PTR_HOST, 0, &e->mh_src));
  CHECK(c->regMrSym(e->cc, e->getw, 2 * GET_SIZE, NCCL_PTR_HOST, 0, &e->mh_getw));
  CHECK(c->regMrSym(e->cc, e->sig, 8 * sizeof(uint64_t), NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &e->mh_sig));
  barrier(vi * 8 + 1);
}

/* v16: asked on the connected group, the answer is written (false), whatever was there before. */
static void check_rma_properties(struct env *e) {
  if (!cur->v16) return;
  ncclRmaProperties_v16_t props;
  memset(&props, 0xff, sizeof(props));
  props.flushesAllPutsOnAnySignal = true;
  CHECK(cur->v16->getRmaProperties(e->cc, &props));
  if (props.flushesAllPutsOnAnySignal) die("v16 getRmaProperties says a signal flushes every put of the group");
}

/* Each rank to the other: the hinted run of puts, closed by a putSignal without the hint (context
 * 1); a hinted signal alone and a hinted weak putSignal with nothing after them (context 0: only
 * rmaProgress ends that run); two hinted gets closed by an iflush (context 1). */
static void post_round(struct env *e, void **reqs, int *n) {
  uint32_t peer = (uint32_t)(1 - g_rank), agg = ncclRmaOptFlagsAggregateRequests;
  for (int i = 0; i < NPUT; i++)
    CHECK(t_put(cur, e->rc, 1, put_soff(i), e->mh_src, put_size(i), (uint64_t)i * SUB, e->mh_recv, peer, agg,
                &reqs[(*n)++]));
  CHECK(t_put_signal(cur, e->rc, 1, put_soff(NPUT), e->mh_src, SUB, (uint64_t)NPUT * SUB, e->mh_recv, peer,
                     0 * sizeof(uint64_t), e->mh_sig, 0, NCCL_NET_SIGNAL_OP_INC, true, ncclRmaOptFlagsDefault,
                     &reqs[(*n)++]));
  CHECK(t_put_signal(cur, e->rc, 0, 0, NULL, 0, 0, NULL, peer, 1 * sizeof(uint64_t), e->mh_sig, 5,
                     NCCL_NET_SIGNAL_OP_ADD, true, agg, &reqs[(*n)++]));
  CHECK(t_put_signal(cur, e->rc, 0, put_soff(NPUT + 1), e->mh_src, SUB - 3, (uint64_t)(NPUT + 1) * SUB, e->mh_recv,
                     peer, 1 * sizeof(uint64_t), e->mh_sig, 0, NCCL_NET_SIGNAL_OP_INC, false, agg, &reqs[(*n)++]));
  CHECK(t_get(cur, e->rc, 1, 4096, e->mh_src, GET_SIZE, 0, e->mh_getw, peer, agg, &reqs[(*n)++]));
  CHECK(t_get(cur, e->rc, 1, SRC_SIZE - GET_SIZE, e->mh_src, GET_SIZE, GET_SIZE, e->mh_getw, peer, agg,
              &reqs[(*n)++]));
  void *flush = NULL;
  CHECK(common_of(cur)->iflush(e->rc, 1, e->mh_getw, peer, &flush));
  if (flush) reqs[(*n)++] = flush;
}

static void wait_signal(struct env *e, int word, uint64_t want) {
  double t0 = now_s();
  while (__atomic_load_n(&e->sig[word], __ATOMIC_ACQUIRE) < want) {
    if (now_s() - t0 > DEADLINE_S)
      die("v%d: signal %d is %llu after %d s, expected %llu", cur->version, word,
          (unsigned long long)e->sig[word], DEADLINE_S, (unsigned long long)want);
    progress();
    sched_yield();
  }
  if (e->sig[word] != want)
    die("v%d: signal %d is %llu, expected %llu", cur->version, word, (unsigned long long)e->sig[word],
        (unsigned long long)want);
}

/* Region j of the window holds exactly the bytes put there from the peer's source, zeros after. */
static void check_region(struct env *e, int j, uint64_t soff, uint64_t size) {
  int peer = 1 - g_rank;
  const char *r = e->recv + (uint64_t)j * SUB;
  for (uint64_t o = 0; o < SUB; o++) {
    uint8_t want = o < size ? pat(peer, cur->version, soff + o) : 0;
    if ((uint8_t)r[o] != want)
      die("v%d: region %d byte %llu of %u is 0x%02x, expected 0x%02x", cur->version, j, (unsigned long long)o, SUB,
          (uint8_t)r[o], want);
  }
}

static void check_gets(struct env *e) {
  int peer = 1 - g_rank;
  for (uint64_t o = 0; o < GET_SIZE; o++) {
    if ((uint8_t)e->getw[o] != pat(peer, cur->version, 4096 + o))
      die("v%d: get 0 byte %llu is 0x%02x", cur->version, (unsigned long long)o, (uint8_t)e->getw[o]);
    if ((uint8_t)e->getw[GET_SIZE + o] != pat(peer, cur->version, SRC_SIZE - GET_SIZE + o))
      die("v%d: get 1 byte %llu is 0x%02x", cur->version, (unsigned long long)o, (uint8_t)e->getw[GET_SIZE + o]);
  }
}

static void teardown(struct env *e, int vi) {
  const ncclRma_v14_t *c = common_of(cur);
  barrier(vi * 8 + 3); /* the peer is done reading our windows */
  bool err = true;
  CHECK(c->queryLastError(e->rc, &err));
  if (err) die("v%d: queryLastError reports an error after a clean round", cur->version);
  CHECK(c->deregMrSym(e->cc, e->mh_sig));
  CHECK(c->deregMrSym(e->cc, e->mh_getw));
  CHECK(c->deregMrSym(e->cc, e->mh_src));
  CHECK(c->deregMrSym(e->cc, e->mh_recv));
  g_rc = NULL;
  CHECK(c->destroyContext(e->rc));
  CHECK(c->closeColl(e->cc));
  CHECK(c->finalize(e->ctx));
  free(e->recv);
  free(e->src);
  free(e->getw);
  free(e->sig);
}

static void round_of(int vi) {
  struct env e = {0};
  void *reqs[NPUT + 8] = {0};
  int n = 0;
  setup(&e, vi);
  check_rma_properties(&e);
  post_round(&e, reqs, &n);
  wait_signal(&e, 0, 1); /* the run's closing signal: the run's puts are in place before it */
  for (int i = 0; i < NPUT; i++) check_region(&e, i, put_soff(i), put_size(i));
  check_region(&e, NPUT, put_soff(NPUT), SUB);
  wait_signal(&e, 1, 6); /* the signal alone (+5) and the weak putSignal (+1), ended by rmaProgress */
  check_region(&e, NPUT + 1, put_soff(NPUT + 1), SUB - 3);
  wait_reqs(e.cc, reqs, n);
  check_gets(&e);
  teardown(&e, vi);
  printf("rank %d: v%d: %d ops, every byte checked\n", g_rank, cur->version, n);
}

static void run_rank(const char *plugin) {
  void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("dlopen %s: %s", plugin, dlerror());
  const ncclRma_v14_t *v14 = dlsym(lib, "ncclRmaPlugin_v14");
  const ncclRma_v15_t *v15 = dlsym(lib, "ncclRmaPlugin_v15");
  const ncclRma_v16_t *v16 = dlsym(lib, "ncclRmaPlugin_v16");
  if (!v14 || !v15 || !v16) die("exported: v14 %p, v15 %p, v16 %p", (void *)v14, (void *)v15, (void *)v16);
  check_layout(v14, v15, v16);
  for (int vi = 0; vi < NVERSIONS; vi++) {
    struct table t = {.version = versions[vi], .v14 = v14};
    if (t.version == 15) t.v15 = v15;
    if (t.version == 16) t.v16 = v16;
    cur = &t;
    round_of(vi);
  }
}

int main(int argc, char **argv) {
  const char *plugin = NULL;
  for (int i = 1; i < argc; i++)
    if (!strcmp(argv[i], "--plugin") && i + 1 < argc) plugin = argv[++i];
  if (!plugin) {
    fprintf(stderr, "usage: rma-versions --plugin PATH\n");
    return 2;
  }
  shm = mmap(NULL, sizeof(*shm), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  if (shm == MAP_FAILED) return 1;
  memset(shm, 0, sizeof(*shm));
  pid_t pids[NRANKS];
  for (int r = 0; r < NRANKS; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      g_rank = r;
      alarm(3 * DEADLINE_S); /* the last word against a hang */
      run_rank(plugin);
      fflush(stdout);
      _exit(0);
    }
  }
  int fail = 0;
  for (int r = 0; r < NRANKS; r++) {
    int st = 0;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "rank %d ended with %s %d\n", r, WIFSIGNALED(st) ? "signal" : "status",
              WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st));
      fail = 1;
    }
  }
  printf("rma versions v14, v15, v16 with %d ranks: %s\n", NRANKS, fail ? "FAIL" : "OK");
  return fail;
}
