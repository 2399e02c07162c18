/* mplane RMA harness: GPU windows, staging and routes. dmabuf (a window registered through its
 * dma-buf), gpurelay (GPU windows across planes, both ways), staged (64 MiB through the relay's
 * staging ring), getflush (a get into GPU memory is visible after iflush), getsignal (a get of a
 * signal word sees the putSignal before it), noroute (a group no device can connect fails at
 * createContext). */
#include <stdbool.h>
#include <sys/mman.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rma_harness.h"

/* ---- dmabuf: a window registered through regMrSymDmaBuf (a memfd stands in for the dma-buf of GPU
 * memory; the fd is closed right after, as NCCL's proxy does): puts with signals land in it ---- */
void scenario_dmabuf(void) {
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

/* ---- getsignal: a get of a signal word right behind the putSignal that adds to it, on the same
 * connection, sees the add. The target serves them in order; with --gpu the signal window is GPU
 * memory registered SIGNAL_NEVER_RESET (as NCCL registers its signals), whose adds wait in a batch
 * for the driver: the get's copy out of GPU memory must not pass them. Every rank does this to every
 * other at once, GETSIG_ROUNDS times, each on a word of the peer's that only it adds to. ---- */
#define GETSIG_ROUNDS 200
void scenario_getsignal(void) {
  struct env e = {0};
  setup(&e, 1);
  barrier(2);
  int stale = 0;
  for (int i = 1; i <= GETSIG_ROUNDS; i++) {
    void *reqs[2 * MAX_RANKS];
    int n = 0;
    for (int p = 0; p < g_n; p++) {
      if (p == g_rank) continue;
      uint64_t word = (uint64_t)(8 + g_rank) * 8; /* on the peer: this rank's word */
      CHECK(rma->iputSignal(e.rc, 0, 0, NULL, 0, 0, NULL, (uint32_t)p, word, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true,
                            &reqs[n++]));
      CHECK(rma->iget(e.rc, 0, word, e.mh_sig, 8, (uint64_t)p * 8, e.mh_getw, (uint32_t)p, &reqs[n++]));
    }
    wait_reqs(e.cc, reqs, n, 0);
    for (int p = 0; p < g_n; p++) {
      if (p == g_rank) continue;
      uint64_t got = __atomic_load_n((uint64_t *)(void *)(e.getw + (size_t)p * 8), __ATOMIC_ACQUIRE);
      if (got != (uint64_t)i) {
        if (!stale) fprintf(stderr, "rank %d: round %d: the get of rank %d's signal word read %llu, not %d\n", g_rank, i,
                            p, (unsigned long long)got, i);
        stale++;
      }
    }
  }
  if (stale) die("%d of %d gets of a signal word missed the putSignal just before them on the same connection", stale,
                 GETSIG_ROUNDS * (g_n - 1));
  printf("rank %d: getsignal: %d gets each saw the signal added just before them%s\n", g_rank,
         GETSIG_ROUNDS * (g_n - 1), g_gpu ? " (GPU signal window, SIGNAL_NEVER_RESET)" : "");
  barrier(3);
  teardown(&e);
}

/* ---- noroute: a group whose ranks no device can connect fails at createContext, at once ---- */
void scenario_noroute(void) {
  struct env e = {0};
  CHECK(rma->init(&e.ctx, 0x5eed, harness_logger));
  group_connect(&e);
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

void scenario_gpurelay(void) {
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
void scenario_staged(void) {
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
void scenario_getflush(void) {
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


/* ---- getflush-inflight: a get still in flight when a flush is posted is covered by the next ----
 * NCCL's GIN proxy posts its flush read every time; a flush asked for while a get into GPU memory
 * is in flight does not cover that get, so the flush asked for after it completed must read again
 * (a request, never "done at once"), and the bytes are visible after it. */
void scenario_getflush_inflight(void) {
  struct env e = {0};
  setup(&e, 1);
  const size_t blk = 64u << 10;
  void *gmh = NULL, *smh = NULL;
  char *gw = fake_gpu_window(e.cc, (size_t)g_n * blk, NULL, &gmh);
  (void)fake_gpu_window(e.cc, 8 * sizeof(uint64_t), NULL, &smh);
  barrier(2);
  for (int p = 0; p < g_n; p++) {
    void *get = NULL, *early = NULL, *late = NULL;
    CHECK(rma->iget(e.rc, p % NCTX, (uint64_t)p * 4096, e.mh_src, blk, (uint64_t)p * blk, gmh, (uint32_t)p, &get));
    CHECK(rma->iflush(e.rc, p % NCTX, smh, (uint32_t)p, &early)); /* the get is still in flight */
    wait_reqs(e.cc, &get, 1, 0);
    if (early) wait_reqs(e.cc, &early, 1, 0);
    CHECK(rma->iflush(e.rc, p % NCTX, smh, (uint32_t)p, &late));
    if (!late)
      die("iflush after a get from rank %d that was in flight at the previous flush returned no request: the GPU may "
          "not see it", p);
    wait_reqs(e.cc, &late, 1, 0);
    check_bytes(gw + (size_t)p * blk, blk, p, (uint64_t)p * 4096, "get in flight at one flush, covered by the next");
    void *again = NULL; /* now every get is covered: nothing more to read */
    CHECK(rma->iflush(e.rc, p % NCTX, smh, (uint32_t)p, &again));
    if (again) die("iflush with every get into GPU memory already covered returned a request (rank %d)", p);
  }
  printf("rank %d: a get in flight at one flush is covered by the next, every byte checked\n", g_rank);
  barrier(3);
  CHECK(rma->deregMrSym(e.cc, smh));
  CHECK(rma->deregMrSym(e.cc, gmh));
  teardown(&e);
}
