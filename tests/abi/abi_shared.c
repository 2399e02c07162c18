/* mplane ABI harness: shared comms, driven the way NCCL core drives them.
 *
 * With maxRecvs > 1 NCCL multiplexes several local ranks over one net comm (NCCL_NET_SHARED_COMMS,
 * the default with PXN). Each local rank is one tag. The receiving proxy posts grouped irecvs of
 * every tag, step after step; the sending ranks progress on their own, so a rank's send for step
 * s+1 can reach isend while group s still waits for another rank's step s. The transport then
 * returns a NULL request and NCCL calls again; it must never fail, and the k-th send of a tag must
 * land in the k-th group.
 *
 *   shared-order  the smallest case: groups {1,2} and {1,2}, tag 1 sent twice before tag 2
 *   shared-wait   a tag no posted group offers: NULL for as long as it lasts, one WARN naming it
 *   shared-comms  k = 2, 4 and 8 tags on one comm each way, each tag its own sender at its own
 *                 random pace, grouped receives of all k tags, MPLANE_ABI_SHARED_STEPS steps
 *                 (default 1000), sizes 0..4 MiB, every byte and the bytes behind it checked
 *
 * One thread drives everything, as NCCL's proxy thread does. */
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"

#define SH_MAX_TAGS 8
#define SH_MAX_BYTES ((size_t)4 << 20)
#define SH_SLACK 8192 /* a receive buffer is at most this much bigger than its message */
#define SH_GUARD 64
#define SH_STALL_S 30.0 /* no request finished for this long: a hang */
#define SH_MAX_DEPTH 8  /* receive groups in flight: NCCL_STEPS */
#define SH_MAX_WINDOW (SH_MAX_DEPTH + 2)

/* ------------------------------------------------------------------ what each step carries */

static uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

static uint64_t step_hash(int sender, int k, int t, int s, int salt) {
  return mix64(((uint64_t)sender << 56) ^ ((uint64_t)k << 48) ^ ((uint64_t)t << 40) ^ ((uint64_t)salt << 32) ^
               (uint64_t)s);
}

/* Mostly small, as LL/LL128 steps are, a third medium, 1% up to 4 MiB; 0 bytes now and then and
 * exactly 4 MiB twice per tag in 1000 steps (the bulk is kept small so that soft-RoCE under an
 * emulated CPU moves it in minutes). */
static size_t step_size(int sender, int k, int t, int s) {
  if (s % 89 == 7) return 0;
  if (s % 499 == 13 + t) return SH_MAX_BYTES;
  uint64_t h = step_hash(sender, k, t, s, 1);
  unsigned pick = (unsigned)(h % 100);
  h >>= 8;
  if (pick < 66) return (size_t)(h % 4097);
  if (pick < 99) return (size_t)(h % (128 << 10)) + 1;
  return (size_t)(h % SH_MAX_BYTES) + 1;
}

/* The receive buffer the receiver posts for it: exactly its size, or a little more. */
static size_t step_cap(int sender, int k, int t, int s) {
  uint64_t h = step_hash(sender, k, t, s, 2);
  size_t size = step_size(sender, k, t, s);
  return h % 3 == 0 ? size : size + (size_t)(h >> 8) % SH_SLACK;
}

static uint32_t step_msg(int sender, int t, int s) { return msg_id(sender, ((uint32_t)t << 20) | (uint32_t)s); }

/* NCCL's tags on a shared comm are ranks: not 0..k-1, not in order. */
static int tag_of(int t) { return 3 + 5 * t; }

/* ------------------------------------------------------------------ buffers */

/* n buffers of size bytes (guard bytes behind each), registered on comm. */
static void bufs_up(struct node *nd, void *comm, int n, size_t size, size_t guard, void **buf, void **mh) {
  for (int i = 0; i < n; i++) {
    buf[i] = alloc_buf(size, guard);
    reg(nd, comm, buf[i], size, &mh[i]);
  }
}

static void bufs_down(struct node *nd, void *comm, int n, void **buf, void **mh) {
  for (int i = 0; i < n; i++) {
    dereg(nd, comm, mh[i]);
    free(buf[i]);
  }
}

/* ------------------------------------------------------------------ calls, timed as the proxy's */

static void *post_send(struct node *nd, void *sc, void *buf, size_t size, int tag, void *mh) {
  void *req = NULL;
  double t0 = abi_now();
  ncclResult_t res = abi_isend(&nd->net, sc, buf, size, tag, mh, &req);
  timed(t0, "isend");
  if (res != ncclSuccess)
    abi_fail("isend of %zu bytes with tag %d failed (%d): on a shared comm a send the oldest posted receive "
             "cannot take yet must return a NULL request, not an error", size, tag, res);
  return req;
}

static int test_done(struct node *nd, void *req, int *sizes, const char *what) {
  int done = 0;
  double t0 = abi_now();
  ncclResult_t res = abi_test(&nd->net, req, &done, sizes);
  timed(t0, "test");
  if (res != ncclSuccess) abi_fail("test of %s failed (%d)", what, res);
  return done;
}

/* The receive of message `msg` (`expect` bytes into a `cap`-byte buffer) holds it, and nothing more. */
static void check_entry(const void *buf, int got, size_t expect, size_t cap, uint32_t msg, const char *what) {
  if (got != (int)expect) abi_fail("%s: test() reported %d bytes, %zu were sent", what, got, expect);
  long bad = check(buf, expect, msg);
  if (bad >= 0)
    abi_fail("%s: wrong byte at offset %ld of %zu (a message landed in the wrong group or buffer?)", what, bad, expect);
  bad = check_guard(buf, expect, cap + SH_GUARD);
  if (bad >= 0) abi_fail("%s: byte %ld written past the %zu-byte message (buffer %zu)", what, bad, expect, cap);
}

/* ------------------------------------------------------------------ shared-order */

int sc_shared_order(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  enum { SZ = 4096 };
  const int tags[2] = {1, 2};
  void *buf[4], *mh[4];
  void *comm = rank == 0 ? l.sc : l.rc;
  bufs_up(&nd, comm, 4, SZ, SH_GUARD, buf, mh);
  char c;
  if (rank == 1) {
    /* two groups {1,2} and {1,2}; buffer i of group g is buf[2g+i] */
    void *req[2];
    for (int g = 0; g < 2; g++) {
      size_t sizes[2] = {SZ, SZ};
      int tg[2] = {tags[0], tags[1]};
      req[g] = post_recv(&nd, l.rc, 2, &buf[2 * g], sizes, tg, &mh[2 * g]);
    }
    c = 'r';
    chan_send(pp.fd, &c, 1);
    int got[2][2];
    double deadline = abi_now() + 20;
    for (int g = 0, done = 0; g < 2; g += done, done = 0) {
      done = test_done(&nd, req[g], got[g], "a receive group");
      if (abi_now() > deadline) abi_fail("receive group %d not done in 20 s", g);
    }
    /* message m of tag i is msg_id(0, 2m+i): group g must hold message g of each tag */
    for (int g = 0; g < 2; g++)
      for (int i = 0; i < 2; i++) {
        char what[96];
        snprintf(what, sizeof(what), "group %d, tag %d (send %d of that tag)", g, tags[i], g);
        check_entry(buf[2 * g + i], got[g][i], SZ - 100 * (size_t)(2 * g + i), SZ, msg_id(0, (uint32_t)(2 * g + i)), what);
      }
    abi_note("groups {1,2},{1,2}: each holds the sends of its turn");
  } else {
    chan_recv(pp.fd, &c, 1);
    usleep(200000); /* both groups' offers have reached this side */
    /* the order that broke shared comms: tag 1, tag 1 again, then tag 2, tag 2 */
    const int order[4][2] = {{0, 0}, {1, 0}, {0, 1}, {1, 1}}; /* {message of the tag, tag index} */
    void *req[4] = {0};
    int nulls_second = 0;
    for (int j = 0; j < 4; j++) {
      int m = order[j][0], i = order[j][1], b = 2 * m + i;
      size_t size = SZ - 100 * (size_t)b;
      fill(buf[b], size, msg_id(0, (uint32_t)b));
      double deadline = abi_now() + 10;
      if (j == 1) {
        /* group 0 still waits for tag 2: the second tag-1 send may wait (NULL), never fail */
        for (double until = abi_now() + 0.3; !req[b] && abi_now() < until;) {
          req[b] = post_send(&nd, l.sc, buf[b], size, tags[i], mh[b]);
          nulls_second += !req[b];
        }
        if (!req[b]) continue; /* retried after tag 2's send, below */
      }
      while (!req[b]) {
        req[b] = post_send(&nd, l.sc, buf[b], size, tags[i], mh[b]);
        if (abi_now() > deadline) abi_fail("isend of send %d of tag %d gave no request in 10 s", m, tags[i]);
      }
      if (j == 2 && !req[2]) { /* the second tag-1 send, now that group 0 is full */
        for (double dl = abi_now() + 10; !req[2];) {
          req[2] = post_send(&nd, l.sc, buf[2], SZ - 200, tags[0], mh[2]);
          if (abi_now() > dl) abi_fail("the second tag-1 send got no request in 10 s after tag 2 filled group 0");
        }
      }
    }
    double deadline = abi_now() + 20;
    for (int b = 0, done = 0; b < 4; b += done, done = 0) {
      done = test_done(&nd, req[b], NULL, "a send");
      if (abi_now() > deadline) abi_fail("send %d not done in 20 s", b);
    }
    abi_note("the second tag-1 send waited (NULL request) %d times while group 0 lacked tag 2", nulls_second);
  }
  barrier(pp.fd);
  bufs_down(&nd, comm, 4, buf, mh);
  return pair_down(&pp, rank, &nd, &l);
}

/* ------------------------------------------------------------------ shared-wait */

/* A send with a tag no posted group offers waits for ever in NCCL too; here every call returns
 * NULL, never an error, and one WARN names the tag once it waited MPLANE_CONNECT_TIMEOUT (2 s). */
int sc_shared_wait(void) {
  setenv("MPLANE_CONNECT_TIMEOUT", "2", 1);
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  enum { SZ = 1000 };
  int tags[2] = {1, 2};
  void *buf[2], *mh[2];
  void *comm = rank == 0 ? l.sc : l.rc;
  bufs_up(&nd, comm, 2, SZ, SH_GUARD, buf, mh);
  char c;
  if (rank == 1) {
    size_t sizes[2] = {SZ, SZ};
    void *req = post_recv(&nd, l.rc, 2, buf, sizes, tags, mh);
    c = 'r';
    chan_send(pp.fd, &c, 1);
    int got[2];
    for (double deadline = abi_now() + 20; !test_done(&nd, req, got, "the receive group");)
      if (abi_now() > deadline) abi_fail("the receive group {1,2} not done in 20 s");
    for (int i = 0; i < 2; i++) check_entry(buf[i], got[i], SZ - (size_t)i, SZ, msg_id(0, (uint32_t)i), "group {1,2}");
  } else {
    chan_recv(pp.fd, &c, 1);
    usleep(200000);
    size_t mark = abi_log_mark();
    fill(buf[0], SZ, 0x777);
    long tries = 0;
    for (double until = abi_now() + 3; abi_now() < until; tries++)
      if (post_send(&nd, l.sc, buf[0], SZ, 7, mh[0]))
        abi_fail("a send with tag 7 was taken by a receive group that offers tags 1 and 2 only");
    if (!abi_log_warn_has(mark, "tag 7", "waits for tags 1,2", "still waiting", NULL)) {
      abi_log_dump(mark, "no WARN");
      abi_fail("a send with tag 7 waited 3 s (MPLANE_CONNECT_TIMEOUT 2 s) and no WARN named it");
    }
    abi_note("a send with tag 7 waited (NULL) %ld times in 3 s and a WARN named it", tries);
    void *req[2] = {0};
    for (int i = 0; i < 2; i++) {
      fill(buf[i], SZ - (size_t)i, msg_id(0, (uint32_t)i));
      for (double deadline = abi_now() + 10; !req[i];) {
        req[i] = post_send(&nd, l.sc, buf[i], SZ - (size_t)i, tags[i], mh[i]);
        if (abi_now() > deadline) abi_fail("the send with tag %d gave no request in 10 s", tags[i]);
      }
    }
    for (int i = 0; i < 2; i++)
      for (double deadline = abi_now() + 20; !test_done(&nd, req[i], NULL, "a send");)
        if (abi_now() > deadline) abi_fail("the send with tag %d not done in 20 s", tags[i]);
  }
  barrier(pp.fd);
  bufs_down(&nd, comm, 2, buf, mh);
  return pair_down(&pp, rank, &nd, &l);
}

/* ------------------------------------------------------------------ shared-comms */

/* One local rank of the sending node: its own steps, its own pace, its own buffers. */
struct sh_sender {
  int tag_index;
  int next, done, filled; /* steps posted, finished (tested in order) and written into a buffer */
  double pace;            /* chance that a turn tries the next step */
  int pause;              /* turns left to sit out */
  long nulls;
  void *req[SH_MAX_WINDOW], *buf[SH_MAX_WINDOW], *mh[SH_MAX_WINDOW]; /* ring by step */
};

/* The receiving proxy: groups of all k tags, posted in order, tested in order. */
struct sh_receiver {
  int next, done, prepared;
  int order[SH_MAX_DEPTH][SH_MAX_TAGS]; /* per ring slot: tag index of each entry, shuffled */
  void *req[SH_MAX_DEPTH];
  void *buf[SH_MAX_DEPTH][SH_MAX_TAGS], *mh[SH_MAX_DEPTH][SH_MAX_TAGS]; /* ring slot x tag index */
  long nulls;
};

struct sh_run {
  struct node *nd;
  struct link *l;
  int rank, k, steps;
  int depth;  /* receive groups in flight: NCCL's min(NCCL_STEPS, NCCL_SHARED_STEPS / k) */
  int window; /* steps a sender may have posted ahead of its finished ones */
  struct sh_sender snd[SH_MAX_TAGS];
  struct sh_receiver rcv;
  double last_progress;
};

static void sh_alloc(struct sh_run *r) {
  for (int t = 0; t < r->k; t++) {
    struct sh_sender *s = &r->snd[t];
    memset(s, 0, sizeof(*s));
    s->tag_index = t;
    s->filled = -1;
    s->pace = 0.1 + 0.1 * (double)(rng() % 10);
    bufs_up(r->nd, r->l->sc, r->window, SH_MAX_BYTES, 0, s->buf, s->mh);
  }
  memset(&r->rcv, 0, sizeof(r->rcv));
  r->rcv.prepared = -1;
  for (int d = 0; d < r->depth; d++)
    bufs_up(r->nd, r->l->rc, r->k, SH_MAX_BYTES + SH_SLACK, SH_GUARD, r->rcv.buf[d], r->rcv.mh[d]);
}

static void sh_free(struct sh_run *r) {
  for (int t = 0; t < r->k; t++) bufs_down(r->nd, r->l->sc, r->window, r->snd[t].buf, r->snd[t].mh);
  for (int d = 0; d < r->depth; d++) bufs_down(r->nd, r->l->rc, r->k, r->rcv.buf[d], r->rcv.mh[d]);
}

/* One turn of a sending rank: maybe sit out, maybe try its next step, test its oldest. */
static int sh_sender_turn(struct sh_run *r, struct sh_sender *s) {
  int progress = 0, t = s->tag_index;
  if (s->done < s->next && test_done(r->nd, s->req[s->done % r->window], NULL, "a send")) {
    s->done++;
    progress = 1;
  }
  if (s->pause > 0) {
    s->pause--;
    return progress;
  }
  if (rng() % 400 == 0) s->pause = (int)(rng() % 300); /* a rank that falls behind for a while */
  if (s->next >= r->steps || s->next - s->done >= r->window || (double)(rng() % 1000) >= s->pace * 1000) return progress;
  int w = s->next % r->window;
  size_t size = step_size(r->rank, r->k, t, s->next);
  if (s->filled != s->next) {
    fill(s->buf[w], size, step_msg(r->rank, t, s->next));
    s->filled = s->next;
  }
  void *req = post_send(r->nd, r->l->sc, s->buf[w], size, tag_of(t), s->mh[w]);
  if (!req) {
    s->nulls++;
    return progress;
  }
  s->req[w] = req;
  s->next++;
  return 1;
}

/* The receiver's turn: post the next group while the depth allows, test the oldest. */
static int sh_receiver_turn(struct sh_run *r) {
  struct sh_receiver *v = &r->rcv;
  int progress = 0, peer = 1 - r->rank;
  if (v->next < r->steps && v->next - v->done < r->depth) {
    int d = v->next % r->depth;
    void *data[SH_MAX_TAGS], *mh[SH_MAX_TAGS];
    size_t sizes[SH_MAX_TAGS];
    int tags[SH_MAX_TAGS];
    if (v->prepared != v->next) {
      for (int i = 0; i < r->k; i++) v->order[d][i] = i;
      shuffle(v->order[d], r->k);
      for (int t = 0; t < r->k; t++)
        memset(v->buf[d][t], GUARD_BYTE, step_cap(peer, r->k, t, v->next) + SH_GUARD);
      v->prepared = v->next;
    }
    for (int i = 0; i < r->k; i++) {
      int t = v->order[d][i];
      data[i] = v->buf[d][t];
      sizes[i] = step_cap(peer, r->k, t, v->next);
      tags[i] = tag_of(t);
      mh[i] = v->mh[d][t];
    }
    void *req = NULL;
    double t0 = abi_now();
    if (abi_irecv(&r->nd->net, r->l->rc, r->k, data, sizes, tags, mh, &req) != ncclSuccess)
      abi_fail("irecv of group %d (%d tags) failed", v->next, r->k);
    timed(t0, "irecv");
    if (req) {
      v->req[d] = req;
      v->next++;
      progress = 1;
    } else {
      v->nulls++;
    }
  }
  if (v->done < v->next) {
    int d = v->done % r->depth, got[SH_MAX_TAGS];
    if (test_done(r->nd, v->req[d], got, "a receive group")) {
      for (int i = 0; i < r->k; i++) {
        int t = v->order[d][i];
        char what[128];
        snprintf(what, sizeof(what), "k=%d group %d entry %d (tag %d)", r->k, v->done, i, tag_of(t));
        check_entry(v->buf[d][t], got[i], step_size(peer, r->k, t, v->done), step_cap(peer, r->k, t, v->done),
                    step_msg(peer, t, v->done), what);
      }
      v->done++;
      progress = 1;
    }
  }
  return progress;
}

static void sh_stall(struct sh_run *r) {
  char line[512];
  size_t n = (size_t)snprintf(line, sizeof(line), "receiver posted %d done %d; senders (posted/done):", r->rcv.next,
                              r->rcv.done);
  for (int t = 0; t < r->k && n < sizeof(line); t++)
    n += (size_t)snprintf(line + n, sizeof(line) - n, " tag %d %d/%d", tag_of(t), r->snd[t].next, r->snd[t].done);
  abi_fail("k=%d: nothing finished for %.0f s: %s", r->k, SH_STALL_S, line);
}

static int sh_finished(const struct sh_run *r) {
  if (r->rcv.done < r->steps) return 0;
  for (int t = 0; t < r->k; t++)
    if (r->snd[t].done < r->steps) return 0;
  return 1;
}

static void shared_run(struct node *nd, struct link *l, int rank, int fd, int k, int steps) {
  struct sh_run *r = calloc(1, sizeof(*r));
  if (!r) abi_fail("out of memory");
  r->nd = nd;
  r->l = l;
  r->rank = rank;
  r->k = k;
  r->steps = steps;
  r->depth = 16 / k < SH_MAX_DEPTH ? 16 / k : SH_MAX_DEPTH; /* NCCL_SHARED_STEPS = 16 */
  r->window = r->depth + 2;
  rng_seed(1000u * (unsigned)k + (unsigned)rank);
  sh_alloc(r);
  barrier(fd);
  double t0 = abi_now();
  r->last_progress = t0;
  int order[SH_MAX_TAGS];
  while (!sh_finished(r)) {
    int progress = sh_receiver_turn(r);
    for (int i = 0; i < k; i++) order[i] = i;
    shuffle(order, k); /* the proxy visits its sub-connections in no fixed order */
    for (int i = 0; i < k; i++) progress |= sh_sender_turn(r, &r->snd[order[i]]);
    if (progress) r->last_progress = abi_now();
    else if (abi_now() - r->last_progress > SH_STALL_S) sh_stall(r);
    else sched_yield();
  }
  long nulls = 0, bytes = 0;
  for (int t = 0; t < k; t++) {
    nulls += r->snd[t].nulls;
    for (int s = 0; s < steps; s++) bytes += (long)step_size(rank, k, t, s);
  }
  double dt = abi_now() - t0;
  abi_note("k=%d: %d steps x %d tags each way, %.1f MB sent in %.2f s; sends waited (NULL) %ld times, receives %ld",
           k, steps, k, (double)bytes / 1e6, dt, nulls, r->rcv.nulls);
  /* senders that run ahead of the oldest group are the point of the scenario: it must have happened */
  if (nulls == 0) abi_fail("k=%d: no send ever waited: the senders never ran ahead of the receiver's groups", k);
  barrier(fd); /* the peer has checked its bytes before buffers go */
  sh_free(r);
  free(r);
}

int sc_shared_comms(void) {
  const char *e = getenv("MPLANE_ABI_SHARED_STEPS");
  int steps = e && atoi(e) > 0 ? atoi(e) : 1000;
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  if (nd.props.max_recvs < SH_MAX_TAGS) abi_fail("maxRecvs %d: NCCL puts up to 8 local ranks on a comm", nd.props.max_recvs);
  struct link l;
  link_up(&nd, pp.fd, &l);
  for (int k = 2; k <= SH_MAX_TAGS; k *= 2) shared_run(&nd, &l, rank, pp.fd, k, steps);
  return pair_down(&pp, rank, &nd, &l);
}
