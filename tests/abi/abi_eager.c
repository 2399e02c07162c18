/* mplane ABI harness: small messages sent before their receive is posted (the socket transport's
 * eager sends, net/socket/socket.h). Socket only: elsewhere a send waits for its receive.
 *
 *   eager-early  6 small sends of two tags (0 B .. the eager limit) all complete before the
 *                receiver posts anything; then groups {A,B} x 3 each hold the sends of their turn,
 *                and ordinary traffic (1 B .. 1 MiB, receives posted first) still lands intact
 *   eager-bound  32 small sends complete with nothing posted, the 33rd waits (NULL) until the
 *                receiver posts; so do 8 of 64 KiB (512 KiB held) and then an 8-byte one; a
 *                message above the eager limit waits as well; all land in order
 *   eager-short  a small send completes, then its receive is posted with a shorter buffer: the
 *                receive fails with ncclInvalidUsage and nothing written past the buffer, and the
 *                sender's comm fails within a bounded number of later calls
 *   eager-then-big  after an eager message, a 1 MiB send gets its CTS while the receiver calls nothing
 *   eager-then-close  6 small sends complete eagerly and the sender closes its comm; only then does
 *                the receiver post its receives, one at a time: all 6 land intact and no call fails
 *                (their CTS records now go to a closed socket)
 *   filler       small messages go padded to MPLANE_SOCKET_PAD_BYTES on the control socket (the
 *                receiving socket counts the bytes) and land intact between unpadded ones; with
 *                the variable at 0, nothing is padded
 *
 * Rank 0 sends, rank 1 receives. */
#include <dirent.h>
#include <stddef.h>
#include <linux/tcp.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "abi_harness.h"
#include "net/socket/socket.h" /* the chunk header's size, for the filler's byte count */

#define EG_LIMIT (64 << 10) /* MPLANE_SOCKET_EAGER_BYTES set below */
#define EG_HELD 32          /* eager messages a receiver holds unmatched (MPS_EAGER_MAX) */
#define EG_HOLD (512 << 10) /* ... and their bytes at most (MPS_EAGER_HOLD) */
#define EG_GUARD 4096
#define EG_WAIT_S 5.0

struct eg_msg {
  int tag;
  size_t size;
};

static void eg_env(void) {
  setenv("MPLANE_SOCKET_EAGER_BYTES", "64K", 1);
  setenv("MPLANE_SOCKET_INLINE_BYTES", "128K", 1);
}

/* Both ranks meet, then the link and the node come down. */
static void eg_unlink(struct pair *pp, struct node *nd, struct link *l) {
  barrier(pp->fd);
  link_down(nd, l);
  node_down(nd);
}

/* The end of a scenario: down, and the pair's verdict. */
static int eg_down(struct pair *pp, int rank, struct node *nd, struct link *l) {
  eg_unlink(pp, nd, l);
  return pair_finish(pp, rank);
}

/* n buffers of cap bytes (and a guard) registered with comm. */
static void eg_alloc(struct node *nd, void *comm, void **buf, void **mh, int n, size_t cap) {
  for (int i = 0; i < n; i++) {
    buf[i] = alloc_buf(cap, EG_GUARD);
    reg(nd, comm, buf[i], cap, &mh[i]);
  }
}

/* Deregister and free n buffers of comm. */
static void eg_free(struct node *nd, void *comm, void **buf, void **mh, int n) {
  for (int i = 0; i < n; i++) {
    dereg(nd, comm, mh[i]);
    free(buf[i]);
  }
}

/* Up and linked, or 0 (both ranks, after a note) when the transport is not the socket one. */
static int eg_up(struct pair *pp, int *rank, struct node *nd, struct link *l) {
  *rank = pair_fork(pp);
  node_up(nd, g_opts.version);
  link_up(nd, pp->fd, l);
  if (handle_is_socket(l->handle)) return 1;
  abi_note("SKIP: eager sends are the socket transport's (the listen handle is not a TCP address)");
  eg_unlink(pp, nd, l);
  return 0;
}

/* isend until a request comes; fails after EG_WAIT_S with `why`. */
static void *eg_send(struct node *nd, void *sc, void *buf, size_t size, int tag, void *mh, const char *why) {
  void *req = NULL;
  for (double t0 = abi_now(); !req;) {
    ncclResult_t res = abi_isend(&nd->net, sc, buf, size, tag, mh, &req);
    if (res != ncclSuccess) abi_fail("isend of %zu bytes (tag %d) failed (%d)", size, tag, res);
    if (!req && abi_now() - t0 > EG_WAIT_S) abi_fail("isend of %zu bytes (tag %d) gave no request in %.0f s: %s", size, tag, EG_WAIT_S, why);
  }
  return req;
}

static void eg_wait(struct node *nd, void *req, int *sizes, const char *what) {
  int done = 0;
  for (double t0 = abi_now(); !done;) {
    ncclResult_t res = abi_test(&nd->net, req, &done, sizes);
    if (res != ncclSuccess) abi_fail("test of %s failed (%d)", what, res);
    if (!done && abi_now() - t0 > EG_WAIT_S) abi_fail("%s not done in %.0f s", what, EG_WAIT_S);
  }
}

/* Message i holds msg_id(0, i) over `size` bytes; check it and the guard behind it. */
static void eg_check(const void *buf, int got, size_t size, size_t cap, uint32_t i, const char *what) {
  if (got != (int)size) abi_fail("%s: test() reported %d bytes, %zu were sent", what, got, size);
  long bad = check(buf, size, msg_id(0, i));
  if (bad >= 0) abi_fail("%s: wrong byte at offset %ld of %zu (landed in the wrong buffer?)", what, bad, size);
  bad = check_guard(buf, size, cap + EG_GUARD);
  if (bad >= 0) abi_fail("%s: byte %ld past the %zu-byte message was written", what, bad, size);
}

/* Ordinary traffic after the eager phase: receives posted first, 1 B .. 1 MiB, in order. */
static void eg_after(struct node *nd, struct link *l, struct pair *pp, int rank) {
  static const size_t sizes[] = {1, 70000, 1 << 20, 0, 4096, 200000, 65536, 3};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  void *buf[N], *mh[N], *req[N];
  size_t cap = 1 << 20;
  void *comm = rank == 0 ? l->sc : l->rc;
  eg_alloc(nd, comm, buf, mh, N, cap);
  char c = 'p';
  if (rank == 1) {
    int tag = 5;
    for (int i = 0; i < N; i++) req[i] = post_recv(nd, l->rc, 1, &buf[i], &cap, &tag, &mh[i]);
    chan_send(pp->fd, &c, 1);
    for (int i = 0; i < N; i++) {
      int got = -1;
      eg_wait(nd, req[i], &got, "a receive after the eager phase");
      eg_check(buf[i], got, sizes[i], cap, 100 + (uint32_t)i, "after the eager phase");
    }
  } else {
    chan_recv(pp->fd, &c, 1);
    for (int i = 0; i < N; i++) {
      fill(buf[i], sizes[i], msg_id(0, 100 + (uint32_t)i));
      req[i] = eg_send(nd, l->sc, buf[i], sizes[i], 5, mh[i], "its receive is posted");
    }
    for (int i = 0; i < N; i++) eg_wait(nd, req[i], NULL, "a send after the eager phase");
  }
  eg_free(nd, comm, buf, mh, N);
  abi_note("then %d messages of 0 B .. 1 MiB with receives posted first: all intact", N);
}

int sc_eager_early(void) {
  eg_env();
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank), 77;
  enum { A = 3, B = 8, N = 6, G = 3 };
  /* send order; message m is the (m's turn)-th of its tag */
  static const struct eg_msg msgs[N] = {{A, 1}, {A, 0}, {B, 4096}, {A, 100}, {B, EG_LIMIT}, {B, 7}};
  static const int turn[N] = {0, 1, 0, 2, 1, 2};
  const size_t cap = EG_LIMIT + 1000;
  void *buf[N], *mh[N];
  void *comm = rank == 0 ? l.sc : l.rc;
  eg_alloc(&nd, comm, buf, mh, N, cap);
  char c = 'd';
  if (rank == 0) {
    void *req[N];
    double t0 = abi_now();
    for (int i = 0; i < N; i++) {
      fill(buf[i], msgs[i].size, msg_id(0, (uint32_t)i));
      req[i] = eg_send(&nd, l.sc, buf[i], msgs[i].size, msgs[i].tag, mh[i],
                       "a small send must not wait for its receive (eager)");
      eg_wait(&nd, req[i], NULL, "a small send with no receive posted (eager)");
    }
    abi_note("%d sends of 0 B .. %d KiB, tags %d and %d, done in %.3f s with no receive posted", N, EG_LIMIT >> 10, A, B,
             abi_now() - t0);
    chan_send(pp.fd, &c, 1);
  } else {
    chan_recv(pp.fd, &c, 1); /* every send is done: nothing was posted */
    usleep(20000);
    /* group g, buffer 0 (tag A) and 1 (tag B): buffer index of message m is 2*turn + (tag == B) */
    void *gbuf[G][2], *gmh[G][2], *req[G];
    int tags[2] = {A, B};
    size_t caps[2] = {cap, cap};
    for (int g = 0; g < G; g++) {
      for (int t = 0; t < 2; t++) {
        int m = -1;
        for (int i = 0; i < N; i++)
          if (turn[i] == g && msgs[i].tag == tags[t]) m = i;
        gbuf[g][t] = buf[m];
        gmh[g][t] = mh[m];
      }
      req[g] = post_recv(&nd, l.rc, 2, gbuf[g], caps, tags, gmh[g]);
    }
    for (int g = 0; g < G; g++) {
      int got[2] = {-1, -1};
      eg_wait(&nd, req[g], got, "a receive group posted after its sends");
      for (int t = 0; t < 2; t++) {
        int m = -1;
        for (int i = 0; i < N; i++)
          if (turn[i] == g && msgs[i].tag == tags[t]) m = i;
        char what[96];
        snprintf(what, sizeof(what), "group %d, tag %d (send %d of that tag)", g, tags[t], g);
        eg_check(gbuf[g][t], got[t], msgs[m].size, cap, (uint32_t)m, what);
      }
    }
    abi_note("groups {%d,%d} x %d posted after their sends: each holds the sends of its turn", A, B, G);
  }
  eg_free(&nd, comm, buf, mh, N);
  eg_after(&nd, &l, &pp, rank);
  return eg_down(&pp, rank, &nd, &l);
}

/* Wait for receive i of eg_recv_all and check it. */
static void eg_land(struct node *nd, void **req, void **buf, const size_t *size, size_t cap, int i, int tag,
                    uint32_t id0, const char *what) {
  int got = -1;
  char w[96];
  snprintf(w, sizeof(w), "%s, receive %d of tag %d", what, i, tag);
  eg_wait(nd, req[i], &got, w);
  eg_check(buf[i], got, size[i], cap, id0 + (uint32_t)i, w);
}

/* Receive n messages of tag in order, at most as many receives posted as the comm takes (a NULL
 * irecv waits for the oldest to land); each is checked against msg_id(0, id0 + i). */
static void eg_recv_all(struct node *nd, struct link *l, void **buf, void **mh, const size_t *size, size_t cap,
                        int n, int tag, uint32_t id0, const char *what) {
  void **req = calloc((size_t)n, sizeof(void *));
  int oldest = 0;
  for (int i = 0; i < n; i++) {
    while (oldest < i && !req[i]) {
      if (abi_irecv(&nd->net, l->rc, 1, &buf[i], &cap, &tag, &mh[i], &req[i]) != ncclSuccess) abi_fail("irecv failed");
      if (!req[i]) eg_land(nd, req, buf, size, cap, oldest++, tag, id0, what);
    }
    if (!req[i]) req[i] = post_recv(nd, l->rc, 1, &buf[i], &cap, &tag, &mh[i]);
  }
  while (oldest < n) eg_land(nd, req, buf, size, cap, oldest++, tag, id0, what);
  free(req);
}

/* Rank 0: sends 0..held-1 complete with nothing posted, send `held` waits (NULL) until rank 1 posts;
 * rank 1 then receives all held + 1 in order. */
static void eg_bound(struct node *nd, struct link *l, struct pair *pp, int rank, void **buf, void **mh,
                     const size_t *size, size_t cap, int held, int tag, uint32_t id0, const char *bound) {
  char c = 'b';
  if (rank == 1) {
    for (int i = 0; i <= held; i++) memset(buf[i], GUARD_BYTE, cap + EG_GUARD); /* the previous bound's bytes */
    chan_recv(pp->fd, &c, 1);
    eg_recv_all(nd, l, buf, mh, size, cap, held + 1, tag, id0, bound);
    abi_note("%s: %d receives posted late (%d held, 1 past the bound): all in order", bound, held + 1, held);
    return;
  }
  void **req = calloc((size_t)held + 1, sizeof(void *));
  for (int i = 0; i < held; i++) {
    fill(buf[i], size[i], msg_id(0, id0 + (uint32_t)i));
    req[i] = eg_send(nd, l->sc, buf[i], size[i], tag, mh[i], "a small send must not wait for its receive (eager)");
    eg_wait(nd, req[i], NULL, "a small send with no receive posted (eager)");
  }
  /* the bound: the receiver holds `held` unmatched messages, the next one waits for a receive */
  fill(buf[held], size[held], msg_id(0, id0 + (uint32_t)held));
  long nulls = 0;
  for (double until = abi_now() + 0.3; abi_now() < until; nulls++) {
    if (abi_isend(&nd->net, l->sc, buf[held], size[held], tag, mh[held], &req[held]) != ncclSuccess)
      abi_fail("%s: isend past the eager bound failed: it must wait (NULL), not fail", bound);
    if (req[held]) abi_fail("%s: send %d went with %d unmatched eager messages held", bound, held + 1, held);
  }
  abi_note("%s: %d sends done with nothing posted; send %d waited (NULL) %ld times in 0.3 s", bound, held, held + 1,
           nulls);
  chan_send(pp->fd, &c, 1);
  req[held] = eg_send(nd, l->sc, buf[held], size[held], tag, mh[held], "its receive is posted now");
  for (int i = 0; i <= held; i++) eg_wait(nd, req[i], NULL, "a send");
  free(req);
}

int sc_eager_bound(void) {
  eg_env();
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank), 77;
  enum { N = EG_HELD + 1, TAG = 6 };
  const size_t big = EG_LIMIT + 1, cap = EG_LIMIT + 1;
  void *buf[N], *mh[N];
  void *comm = rank == 0 ? l.sc : l.rc;
  eg_alloc(&nd, comm, buf, mh, N, cap);
  /* the count: EG_HELD small ones (well inside the byte bound) */
  size_t size[N];
  for (int i = 0; i < N; i++) size[i] = (size_t)(i * 997) % 5000;
  eg_bound(&nd, &l, &pp, rank, buf, mh, size, cap, EG_HELD, TAG, 0, "count bound");
  /* the bytes: EG_HOLD / EG_LIMIT of the largest, then even a small one waits */
  int held = EG_HOLD / EG_LIMIT;
  for (int i = 0; i < held; i++) size[i] = EG_LIMIT;
  size[held] = 8;
  eg_bound(&nd, &l, &pp, rank, buf, mh, size, cap, held, TAG, 100, "byte bound");
  /* a message above the eager limit waits for its receive as before */
  char c = 'b';
  if (rank == 0) {
    void *req = NULL;
    fill(buf[0], big, msg_id(0, 50));
    for (double until = abi_now() + 0.3; abi_now() < until;) {
      if (abi_isend(&nd.net, l.sc, buf[0], big, TAG, mh[0], &req) != ncclSuccess) abi_fail("isend of %zu bytes failed", big);
      if (req) abi_fail("a %zu-byte send (above the %d-byte eager limit) went before its receive was posted", big, EG_LIMIT);
    }
    chan_send(pp.fd, &c, 1);
    req = eg_send(&nd, l.sc, buf[0], big, TAG, mh[0], "its receive is posted now");
    eg_wait(&nd, req, NULL, "a send above the eager limit");
    abi_note("a %zu-byte send waited for its receive", big);
  } else {
    chan_recv(pp.fd, &c, 1);
    int tag = TAG, got = -1;
    size_t caps = cap;
    void *req = post_recv(&nd, l.rc, 1, &buf[0], &caps, &tag, &mh[0]);
    eg_wait(&nd, req, &got, "the receive of a message above the eager limit");
    eg_check(buf[0], got, big, cap, 50, "a message above the eager limit");
  }
  eg_free(&nd, comm, buf, mh, N);
  return eg_down(&pp, rank, &nd, &l);
}

int sc_eager_short(void) {
  eg_env();
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank), 77;
  const size_t send = 5000, cap = 4096, guard = 1 << 16;
  char c = 's';
  if (rank == 0) {
    void *buf = alloc_buf(send, 0), *mh, *req;
    fill(buf, send, 7);
    reg(&nd, l.sc, buf, send, &mh);
    req = eg_send(&nd, l.sc, buf, send, 5, mh, "a small send must not wait for its receive (eager)");
    eg_wait(&nd, req, NULL, "a small send with no receive posted (eager)");
    chan_send(pp.fd, &c, 1);
    chan_recv(pp.fd, &c, 1); /* the receiver has failed */
    /* the receiver's offer says its buffer was too short: a later call on the comm fails */
    ncclResult_t err = ncclSuccess;
    int calls = 0;
    double t0 = abi_now();
    for (; err == ncclSuccess && calls < 4 * EG_HELD && abi_now() - t0 < 10; calls++) {
      void *r2 = NULL;
      int d2 = 0;
      while (!r2 && err == ncclSuccess && abi_now() - t0 < 10) err = abi_isend(&nd.net, l.sc, buf, 1, 5, mh, &r2);
      while (r2 && err == ncclSuccess && !d2 && abi_now() - t0 < 10) err = abi_test(&nd.net, r2, &d2, NULL);
    }
    if (err != ncclInvalidUsage)
      abi_fail("the sender's comm gave %d after %d more sends, expected ncclInvalidUsage: its eager message did not "
               "fit the receive buffer", err, calls);
    abi_note("the sender's comm failed (ncclInvalidUsage) %d sends later", calls);
    dereg(&nd, l.sc, mh);
    free(buf);
  } else {
    chan_recv(pp.fd, &c, 1);
    usleep(20000);
    void *buf = alloc_buf(cap, guard), *mh, *req = NULL;
    reg(&nd, l.rc, buf, cap + guard, &mh);
    size_t mark = abi_log_mark();
    int tag = 5, done = 0;
    size_t sz = cap;
    req = post_recv(&nd, l.rc, 1, &buf, &sz, &tag, &mh);
    ncclResult_t err = ncclSuccess;
    for (double t0 = abi_now(); err == ncclSuccess && !done && abi_now() - t0 < 10;) err = abi_test(&nd.net, req, &done, NULL);
    if (done) abi_fail("a %zu-byte message into a %zu-byte buffer completed", send, cap);
    if (err != ncclInvalidUsage) abi_fail("the receive gave %d, expected ncclInvalidUsage", err);
    long bad = check_guard(buf, 0, cap + guard);
    if (bad >= 0) abi_fail("byte %ld of the buffer or past it was written", bad);
    if (!abi_log_warn_has(mark, "nothing was written", NULL)) abi_fail("no WARN about the short receive");
    abi_note("%zu bytes sent before a %zu-byte receive: ncclInvalidUsage, nothing written", send, cap);
    chan_send(pp.fd, &c, 1);
    dereg(&nd, l.rc, mh);
    free(buf);
  }
  return eg_down(&pp, rank, &nd, &l);
}

/* After a message that came eagerly the receiver holds its next CTS back (a batch); a message too
 * big to go eagerly must still get it while the receiver's proxy calls nothing at all (NCCL's
 * proxy may be busy posting elsewhere; the inflight scenario posts everything before any test):
 * the sender's WANT_CTS rides a data stream, which the receiver's helper threads read. */
int sc_eager_then_big(void) {
  eg_env();
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank), 77;
  const size_t small = 100, big = 1 << 20;
  void *comm = rank == 0 ? l.sc : l.rc;
  void *buf[2], *mh[2];
  eg_alloc(&nd, comm, buf, mh, 2, big);
  char c = 'p';
  int tag = 5;
  size_t cap = big;
  if (rank == 1) {
    chan_recv(pp.fd, &c, 1); /* the small send is done: it went eagerly */
    void *req = post_recv(&nd, l.rc, 1, &buf[0], &cap, &tag, &mh[0]);
    int got = -1;
    eg_wait(&nd, req, &got, "the small receive");
    eg_check(buf[0], got, small, big, 0, "the small message");
    req = post_recv(&nd, l.rc, 1, &buf[1], &cap, &tag, &mh[1]); /* its CTS may wait for a batch */
    chan_send(pp.fd, &c, 1);
    chan_recv(pp.fd, &c, 1); /* no plugin call until the sender has its request (or gave up) */
    if (c != 'g') abi_fail("the 1 MiB send got no request while this side's proxy called nothing");
    eg_wait(&nd, req, &got, "the 1 MiB receive");
    eg_check(buf[1], got, big, big, 1, "the 1 MiB message");
    abi_note("a 1 MiB send after an eager one got its CTS while the receiver called nothing");
  } else {
    fill(buf[0], small, msg_id(0, 0));
    void *req = eg_send(&nd, l.sc, buf[0], small, tag, mh[0], "a small send must not wait for its receive (eager)");
    eg_wait(&nd, req, NULL, "the small send");
    chan_send(pp.fd, &c, 1);
    chan_recv(pp.fd, &c, 1);
    fill(buf[1], big, msg_id(0, 1));
    req = NULL;
    for (double t0 = abi_now(); !req && abi_now() - t0 < EG_WAIT_S;)
      if (abi_isend(&nd.net, l.sc, buf[1], big, tag, mh[1], &req) != ncclSuccess) abi_fail("isend of 1 MiB failed");
    c = req ? 'g' : 'f';
    chan_send(pp.fd, &c, 1);
    if (!req) abi_fail("a 1 MiB send got no request in %.0f s while the receiver's proxy called nothing", EG_WAIT_S);
    eg_wait(&nd, req, NULL, "the 1 MiB send");
  }
  eg_free(&nd, comm, buf, mh, 2);
  return eg_down(&pp, rank, &nd, &l);
}

int sc_eager_then_close(void) {
  eg_env();
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank), 77;
  enum { N = 6 };
  static const size_t sizes[N] = {8, 0, 4096, 100, EG_LIMIT, 1};
  const size_t cap = EG_LIMIT;
  void *comm = rank == 0 ? l.sc : l.rc;
  void *buf[N], *mh[N];
  eg_alloc(&nd, comm, buf, mh, N, cap);
  char c = 'p';
  int tag = 9;
  if (rank == 0) {
    for (int i = 0; i < N; i++) { /* one at a time: above 16K a send goes eagerly only when few are in flight */
      fill(buf[i], sizes[i], msg_id(0, (uint32_t)i));
      void *req = eg_send(&nd, l.sc, buf[i], sizes[i], tag, mh[i], "a small send must not wait for its receive (eager)");
      eg_wait(&nd, req, NULL, "an eager send");
    }
    for (int i = 0; i < N; i++) dereg(&nd, l.sc, mh[i]);
    if (abi_close_send(&nd.net, l.sc) != ncclSuccess) abi_fail("closeSend after the eager sends failed");
    l.sc = NULL;
    chan_send(pp.fd, &c, 1);
    for (int i = 0; i < N; i++) free(buf[i]);
  } else {
    chan_recv(pp.fd, &c, 1); /* the sender's comm is closed */
    usleep(100 * 1000);      /* ... and its close has reached this side */
    /* All receives posted before any test: nothing of the eager messages is read yet, so each
     * receive writes its CTS record at once. The first goes to the closed socket and brings back a
     * reset; the next writes then fail. */
    void *req[N];
    for (int i = 0; i < N; i++) {
      size_t bcap = cap;
      req[i] = post_recv(&nd, l.rc, 1, &buf[i], &bcap, &tag, &mh[i]);
      if (i == 0) usleep(20 * 1000);
    }
    for (int i = 0; i < N; i++) {
      int got = -1;
      eg_wait(&nd, req[i], &got, "a receive posted after the sender closed");
      eg_check(buf[i], got, sizes[i], cap, (uint32_t)i, "a message received after its sender closed");
    }
    eg_free(&nd, comm, buf, mh, N);
    abi_note("%d eager messages received after their sender closed its comm: all intact, no error", N);
  }
  return eg_down(&pp, rank, &nd, &l);
}

/* The most bytes any TCP socket of this process has received (the control socket's count). */
static unsigned long long eg_tcp_max_received(void) {
  unsigned long long most = 0;
  DIR *d = opendir("/proc/self/fd");
  if (!d) abi_fail("cannot list /proc/self/fd");
  for (struct dirent *e; (e = readdir(d));) {
    struct tcp_info ti;
    socklen_t len = sizeof(ti);
    memset(&ti, 0, sizeof(ti));
    int fd = atoi(e->d_name);
    if (e->d_name[0] == '.' || fd == dirfd(d)) continue;
    if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &len) != 0) continue; /* not a TCP socket */
    if (len < offsetof(struct tcp_info, tcpi_bytes_received) + sizeof(ti.tcpi_bytes_received))
      abi_fail("TCP_INFO has no tcpi_bytes_received on this kernel (%u bytes)", len);
    if (ti.tcpi_bytes_received > most) most = ti.tcpi_bytes_received;
  }
  closedir(d);
  return most;
}

int sc_filler(void) {
  /* below, at and above the padding point (544 bytes of header + data, header 32) */
  static const size_t sizes[] = {8, 0, 3, 100, 511, 512, 600, 8, 1000, 8, 200, 1};
  enum { N = sizeof(sizes) / sizeof(sizes[0]), ROUNDS = 12, HDR = sizeof(struct mps_chunk) };
  const char *env = getenv("MPLANE_SOCKET_PAD_BYTES");
  size_t pad = env ? (size_t)atol(env) : 544;
  struct pair pp;
  struct node nd;
  struct link l;
  int rank;
  if (!eg_up(&pp, &rank, &nd, &l)) return pair_finish(&pp, rank);
  void *buf[N], *mh[N], *req[N];
  size_t cap = 4096;
  void *comm = rank == 0 ? l.sc : l.rc;
  eg_alloc(&nd, comm, buf, mh, N, cap);
  unsigned long long padded = 0, bare = 0;
  for (int r = 0; r < ROUNDS; r++) {
    char c = 'p';
    if (rank == 1) {
      int tag = 9;
      for (int i = 0; i < N; i++) req[i] = post_recv(&nd, l.rc, 1, &buf[i], &cap, &tag, &mh[i]);
      chan_send(pp.fd, &c, 1);
      for (int i = 0; i < N; i++) {
        int got = -1;
        eg_wait(&nd, req[i], &got, "a small receive");
        eg_check(buf[i], got, sizes[i], cap, (uint32_t)(r * N + i), "a message among padded ones");
      }
    } else {
      chan_recv(pp.fd, &c, 1);
      for (int i = 0; i < N; i++) {
        fill(buf[i], sizes[i], msg_id(0, (uint32_t)(r * N + i)));
        req[i] = eg_send(&nd, l.sc, buf[i], sizes[i], 9, mh[i], "its receive is posted");
      }
      for (int i = 0; i < N; i++) eg_wait(&nd, req[i], NULL, "a small send");
    }
    for (int i = 0; i < N; i++) {
      bare += HDR + sizes[i];
      padded += HDR + sizes[i] < pad ? pad : HDR + sizes[i];
    }
  }
  if (rank == 1) {
    unsigned long long got = eg_tcp_max_received();
    if (pad > 0 && got < padded)
      abi_fail("the control socket received %llu bytes; padded to %zu the messages are %llu", got, pad, padded);
    if (pad == 0 && got >= bare + 4096)
      abi_fail("MPLANE_SOCKET_PAD_BYTES=0, yet the control socket received %llu bytes for %llu of messages", got, bare);
    abi_note("%d messages of 0 B .. 1000 B intact; the control socket received %llu bytes (padded to %zu: %llu, "
             "unpadded: %llu)", ROUNDS * N, got, pad, padded, bare);
  }
  eg_free(&nd, comm, buf, mh, N);
  return eg_down(&pp, rank, &nd, &l);
}
