/* mplane RMA harness: ops the plugin must refuse and peers that fail. oob (ranges outside a window,
 * an unknown signal op, a rank not connected), stride (rankStride 2), kill (a rank exits), peerfault
 * (an op that fails on one context fails the peer on every context), stall (a rank stops), regfail
 * (one rank's regMrSym fails), stagefault (a staged copy fails): each ends in an error, never a hang,
 * and nothing outside the ranges is written. */
#include <signal.h>
#include <stdbool.h>
#include <sys/wait.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rma_harness.h"

/* ---- oob ---- */
static void expect_refused(void *cc, void *req, const char *what) {
  if (!req) die("%s: no request", what);
  if (wait_reqs(cc, &req, 1, 1) != 1) die("%s: completed without an error", what);
}

void scenario_oob(void) {
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
  for (int w = 0; w < 32; w++) { /* atomic: the peers' later signals add to these words (signal_apply) */
    uint64_t v = __atomic_load_n(&e.sig[w], __ATOMIC_ACQUIRE);
    if (v) die("signal word %d is %llu after refused signals", w, (unsigned long long)v);
  }
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
void scenario_stride(void) {
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
void scenario_kill(void) {
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
void scenario_peerfault(void) {
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
void scenario_stall(void) {
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
void scenario_regfail(void) {
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

void scenario_stagefault(void) {
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

