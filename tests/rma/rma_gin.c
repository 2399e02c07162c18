/* mplane RMA harness: what NCCL's GIN proxy loop and NCCL EP post. rate (a GIN barrier's burst of
 * signal-only puts, timed), proxyloop (the proxy loop's pass against the one-sided path's targets,
 * beside raw TCP), replies (a signal ping-pong: one TCP segment per leg), eplike (NCCL EP's
 * low-latency dispatch over 128 contexts and a NEVER_RESET signal window). */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdbool.h>
#include <sys/socket.h>
#include <time.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "rma_harness.h"
#include "tcp_segs.h"

/* ---- rate: what a GIN barrier asks of the proxy, timed: every rank posts a burst of 32 signal-only
 * puts (one per block) to every other rank at once, then waits for them and for the peers' 32 ---- */
#define RATE_BURST 32
static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

void scenario_rate(void) {
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

void scenario_proxyloop(void) {
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
void scenario_replies(void) {
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

/* ---- lastpass: an op served in rmaProgress's last pass is still answered ----
 * Rank 1 calls rmaProgress (NCCL's proxy loop) until rank 0's put has landed, then calls nothing of
 * the plugin again. Its answer waited in the queue for a reply to ride with, in a pass that never
 * came, so rank 0's put never completed: the answer must leave without another rmaProgress (the
 * reader thread hands it to the writer once the calls stop). Socket transport. */
void scenario_lastpass(void) {
  if (g_n != 2) die("lastpass needs 2 ranks");
  struct env e = {0};
  setup(&e, 1);
  struct ploop l = {.e = &e};
  enum { DONE = 40 }; /* shm->arrived[DONE]: rank 0's put completed */
  if (g_rank == 1)
    for (double t0 = now_s(); now_s() - t0 < 0.05;) ploop_pass(&l, 0, 0, 0, 0); /* rmaProgress is live */
  barrier(2);
  if (g_rank == 0) {
    void *r = NULL;
    CHECK(rma->iputSignal(e.rc, 0, 0, e.mh_src, 512, 0, e.mh_recv, 1, 8, e.mh_sig, 1, NCCL_NET_SIGNAL_OP_ADD, true,
                          &r));
    wait_reqs(e.cc, &r, 1, 0);
    __atomic_store_n(&shm->arrived[DONE], 1, __ATOMIC_RELEASE);
  } else {
    double t0 = now_s();
    while (sig_read(&e, 1) < 1) {
      if (now_s() - t0 > DEADLINE_S) die("lastpass: rank 0's put never landed");
      ploop_pass(&l, 0, 0, 0, 0);
    }
    t0 = now_s(); /* from here on nothing of the plugin is called */
    while (!__atomic_load_n(&shm->arrived[DONE], __ATOMIC_ACQUIRE)) {
      if (now_s() - t0 > 10) die("lastpass: the put served in rmaProgress's last pass was never answered (10 s)");
      usleep(1000);
    }
    printf("rank 1: the put served in the last pass was answered %.0f ms after it\n", (now_s() - t0) * 1e3);
  }
  barrier(3);
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

void scenario_eplike(void) {
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

