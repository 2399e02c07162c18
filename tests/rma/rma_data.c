/* mplane RMA harness: bytes and their order. data (random puts with signals into disjoint regions,
 * gets, size-0 ops, 64 MiB with --big), order (a signal never before its data) and alltoall (what
 * nccl-tests' GIN all-to-all kernel posts, with the traffic record's checks). */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rma_harness.h"

/* ---- data: random puts with signals, gets, size-0 ops, --big ---- */
void scenario_data(void) {
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
void scenario_order(void) {
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
void scenario_alltoall(void) {
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

