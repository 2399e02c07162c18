/* HFReduce's all-reduce: the chunk pipeline (docs/hfreduce.md).
 *
 * A chunk of the buffer takes a slot of the node's shared memory and goes through:
 *   SLOT     the slot's previous chunk has been copied out by every local rank: copy mine in
 *            (host memcpy, or device-to-host on the copy engine) and say so (posted);
 *   POSTED   every local rank's copy is in: reduce my slice of the chunk over them (the node's
 *            reduce-scatter on the CPUs) into the slot's result;
 *   TREES    (several nodes) my slice's two halves go up tree 0 and tree 1 between the ranks of my
 *            local index on every node, over my NIC, and the sums come back down; then reduced;
 *   GATHER   every local rank's slice is final: copy the whole chunk out (consumed).
 * Up to MPLANE_HFREDUCE_SLOTS chunks are in flight, so copies, reductions and the network overlap:
 * the transports' threads (or the NIC) move bytes while this thread copies and reduces.
 *
 * Messages on a link go in one order both ends know, by (chunk, tree): the receiver posts them in
 * that order and the sender sends them in that order, so each lands in its own buffer with one
 * tag; a message only ever waits for ones of smaller keys, so the order cannot deadlock. */
#include "hfr.h"

#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/cuda.h"
#include "common/cuda_driver.h"
#include "common/log.h"
#include "hfr_reduce.h"

enum chunk_state { ST_FREE = 0, ST_SLOT, ST_COPYIN, ST_POSTED, ST_TREES, ST_GATHER, ST_COPYOUT, ST_DONE };

struct msg {
  int link, is_send, tree, up; /* up: towards the root (children's partial sums) */
  char *buf;
  size_t bytes;
  void *mh;
  void *req;
  int ready, posted, done;
};

#define MSGS_MAX 12 /* per tree: 2 children and a parent, each way */

struct chunk {
  int state;
  size_t idx;               /* chunk of this allreduce */
  uint64_t g;               /* chunk of the communicator's life (the shared counters count these) */
  int slot;
  size_t off, n;            /* elements of the buffer */
  size_t slo, sn;           /* my slice, in elements from off */
  size_t hoff[2], hn[2];    /* the halves of my slice on trees 0 and 1, from off + slo */
  struct msg msgs[MSGS_MAX];
  int nmsgs;
  int tree_stage[2];        /* 0 children's sums awaited, 1 the parent's result awaited, 2 sends out, 3 done */
  uint64_t copy_seq;        /* device copies: the lane's sequence number */
};

struct op {
  struct mplane_hfreduce_comm *c;
  const char *send;
  char *recv;
  size_t count, esize, chunk_elems, nchunks;
  int dtype, op;
  int send_gpu, recv_gpu;   /* device of the buffer, -1 host */
  struct chunk ch[HFR_MAX_SLOTS];
  size_t started, retired;
  uint64_t idle_since;
  uint64_t last_liveness;
  int wait_hops;            /* describe_wait's estimate of how far the wait is from its cause (hops) */
  int wait_peer;            /* the peer a tree step waits on, -1 none */
};

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

static uint64_t load_acq(const uint64_t *p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
static void store_rel(uint64_t *p, uint64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

/* Slices: the chunk's elements split over the local ranks in pieces of 64 elements (so every slice
 * starts on a cache line), halves likewise; empty pieces are allowed (short last chunk). */
static void chunk_layout(struct op *o, struct chunk *k) {
  struct mplane_hfreduce_comm *c = o->c;
  k->off = k->idx * o->chunk_elems;
  k->n = o->count - k->off < o->chunk_elems ? o->count - k->off : o->chunk_elems;
  size_t q = round_up((k->n + (size_t)c->nlocal - 1) / (size_t)c->nlocal, 64);
  size_t lo = q * (size_t)c->local;
  k->slo = lo < k->n ? lo : k->n;
  k->sn = k->n - k->slo < q ? k->n - k->slo : q;
  size_t h = round_up((k->sn + 1) / 2, 64);
  if (h > k->sn) h = k->sn;
  k->hoff[0] = 0;
  k->hn[0] = h;
  k->hoff[1] = h;
  k->hn[1] = k->sn - h;
}

static void add_msg(struct op *o, struct chunk *k, int link, int is_send, int tree, int up, char *buf, void *mh) {
  struct msg *m = &k->msgs[k->nmsgs++];
  memset(m, 0, sizeof(*m));
  m->link = link;
  m->is_send = is_send;
  m->tree = tree;
  m->up = up;
  m->buf = buf;
  m->bytes = k->hn[tree] * o->esize;
  m->mh = mh;
}

/* The chunk's messages on both trees (none for an empty half). */
static void chunk_msgs(struct op *o, struct chunk *k) {
  struct mplane_hfreduce_comm *c = o->c;
  k->nmsgs = 0;
  for (int t = 0; t < 2; t++) {
    k->tree_stage[t] = k->hn[t] && c->nnodes > 1 ? 0 : 3;
    if (k->tree_stage[t] == 3) continue;
    char *half = hfr_res(c, k->slot) + (k->slo + k->hoff[t]) * o->esize;
    for (int j = 0; j < 2; j++) {
      int l = c->tree_link_child[t][j];
      if (l < 0) continue;
      add_msg(o, k, l, 0, t, 1, hfr_child_buf(c, k->slot, t, j), c->links[l].recv_mh_scratch);
      add_msg(o, k, l, 1, t, 0, half, c->links[l].send_mh_shm);
    }
    int p = c->tree_link_parent[t];
    if (p >= 0) {
      add_msg(o, k, p, 1, t, 1, half, c->links[p].send_mh_shm);
      add_msg(o, k, p, 0, t, 0, half, c->links[p].recv_mh_shm);
    }
  }
}

static int all_local_at_least(struct mplane_hfreduce_comm *c, size_t field, uint64_t v, int *late) {
  for (int l = 0; l < c->nlocal; l++) {
    const uint64_t *w = (const uint64_t *)((const char *)&c->shm->rank[l] + field);
    if (load_acq(w) < v) {
      if (late) *late = l;
      return 0;
    }
  }
  return 1;
}

/* Copies between the user's buffer and the slot: host memcpy, or the copy engine (asynchronous:
 * the lane's sequence number says when it is done). 1 done now, 0 issued, -1 failed. */
static int copy_start(struct op *o, struct chunk *k, int to_user) {
  struct mplane_hfreduce_comm *c = o->c;
  size_t bytes = k->n * o->esize, at = k->off * o->esize;
  char *slot = to_user ? hfr_res(c, k->slot) : hfr_in(c, k->slot, c->local);
  int gpu = to_user ? o->recv_gpu : o->send_gpu;
  if (gpu < 0) {
    if (to_user) memcpy(o->recv + at, slot, bytes);
    else memcpy(slot, o->send + at, bytes);
    return 1;
  }
  if (!mplane_cuda_async_ok(gpu)) { /* a driver without stream memory operations: synchronous copies */
    int rc = to_user ? mplane_cuda_memcpy_htod(gpu, o->recv + at, slot, bytes)
                     : mplane_cuda_memcpy_dtoh(gpu, slot, o->send + at, bytes);
    return rc == 0 ? 1 : -1;
  }
  k->copy_seq = to_user ? mplane_cuda_copy_async(gpu, o->recv + at, slot, bytes, 1)
                        : mplane_cuda_copy_async(gpu, slot, o->send + at, bytes, 0);
  if (k->copy_seq == 0) return -1;
  return mplane_cuda_signal_flush() == 0 ? 0 : -1;
}

static int copy_done(struct op *o, struct chunk *k, int to_user) {
  int gpu = to_user ? o->recv_gpu : o->send_gpu;
  return gpu < 0 || mplane_cuda_lane_done(gpu) >= k->copy_seq;
}

static int fail_copy(struct op *o, struct chunk *k, int to_user) {
  return hfr_fail_comm(o->c, ncclUnhandledCudaError, "hfreduce: rank %d: the %s copy of chunk %zu failed on GPU %d",
                       o->c->rank, to_user ? "host-to-device" : "device-to-host", k->idx,
                       to_user ? o->recv_gpu : o->send_gpu);
}

/* The tree work of one half after the local reduction: fold in the children's sums, send up,
 * take the result from the parent, send it down. */
static int tree_step(struct op *o, struct chunk *k, int t) {
  struct mplane_hfreduce_comm *c = o->c;
  int moved = 0;
  if (k->tree_stage[t] == 0) {
    const void *src[3];
    int ns = 0;
    char *half = hfr_res(c, k->slot) + (k->slo + k->hoff[t]) * o->esize;
    src[ns++] = half;
    for (int i = 0; i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (m->tree != t || m->is_send || !m->up) continue;
      if (!m->done) return 0;
      src[ns++] = m->buf;
    }
    if (ns > 1) mp_hfr_reduce(o->dtype, o->op, half, src, ns, k->hn[t]);
    int root = c->tree_link_parent[t] < 0;
    for (int i = 0; i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (m->tree == t && m->is_send && (root ? !m->up : m->up)) m->ready = 1;
    }
    k->tree_stage[t] = root ? 2 : 1;
    moved = 1;
  }
  if (k->tree_stage[t] == 1) {
    for (int i = 0; i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (m->tree == t && !m->is_send && !m->up && !m->done) return moved;
    }
    for (int i = 0; i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (m->tree == t && m->is_send && !m->up) m->ready = 1;
    }
    k->tree_stage[t] = 2;
    moved = 1;
  }
  if (k->tree_stage[t] == 2) {
    for (int i = 0; i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (m->tree == t && m->is_send && !m->done) return moved;
    }
    k->tree_stage[t] = 3;
    moved = 1;
  }
  return moved;
}

/* A counter says "every chunk before this one": a chunk publishes only after the one before it
 * (a chunk whose slice is empty passes its trees at once, ahead of a busy one). */
static int in_turn(const uint64_t *counter, const struct chunk *k) {
  return __atomic_load_n(counter, __ATOMIC_RELAXED) == k->g;
}

/* Move one chunk as far as it can go now. 1 if anything moved, 0 if not, -(error code) on failure. */
static int chunk_step(struct op *o, struct chunk *k) {
  struct mplane_hfreduce_comm *c = o->c;
  struct hfr_shm_rank *me = &c->shm->rank[c->local];
  int moved = 0, r;
  for (;;) {
    switch (k->state) {
      case ST_SLOT:
        if (k->g >= (uint64_t)c->slots &&
            !all_local_at_least(c, offsetof(struct hfr_shm_rank, consumed), k->g + 1 - (uint64_t)c->slots, NULL))
          return moved;
        r = copy_start(o, k, 0);
        if (r < 0) return -fail_copy(o, k, 0);
        k->state = ST_COPYIN;
        break;
      case ST_COPYIN:
        if (!copy_done(o, k, 0) || !in_turn(&me->posted, k)) return moved;
        store_rel(&me->posted, k->g + 1);
        k->state = ST_POSTED;
        break;
      case ST_POSTED: {
        if (!all_local_at_least(c, offsetof(struct hfr_shm_rank, posted), k->g + 1, NULL)) return moved;
        const void *src[HFR_MAX_LOCAL];
        for (int l = 0; l < c->nlocal; l++) src[l] = hfr_in(c, k->slot, l) + k->slo * o->esize;
        mp_hfr_reduce(o->dtype, o->op, hfr_res(c, k->slot) + k->slo * o->esize, src, c->nlocal, k->sn);
        k->state = ST_TREES;
        break;
      }
      case ST_TREES:
        for (int t = 0; t < 2; t++) moved |= tree_step(o, k, t);
        if (k->tree_stage[0] != 3 || k->tree_stage[1] != 3 || !in_turn(&me->reduced, k)) return moved;
        store_rel(&me->reduced, k->g + 1);
        k->state = ST_GATHER;
        break;
      case ST_GATHER:
        if (!all_local_at_least(c, offsetof(struct hfr_shm_rank, reduced), k->g + 1, NULL)) return moved;
        r = copy_start(o, k, 1);
        if (r < 0) return -fail_copy(o, k, 1);
        k->state = ST_COPYOUT;
        break;
      case ST_COPYOUT:
        if (!copy_done(o, k, 1) || !in_turn(&me->consumed, k)) return moved;
        store_rel(&me->consumed, k->g + 1);
        k->state = ST_DONE;
        break;
      default:
        return moved;
    }
    moved = 1;
  }
}

static struct chunk *chunk_of(struct op *o, size_t idx) {
  if (idx < o->retired || idx >= o->started) return NULL;
  struct chunk *k = &o->ch[idx % (size_t)o->c->slots];
  return k->idx == idx ? k : NULL;
}

static int check_stall(struct op *o);
static int describe_wait(struct op *o, char *buf, size_t len);

static int link_fail(struct op *o, int link, const char *what) {
  char who[160], waited[320] = "";
  struct mplane_hfreduce_comm *c = o->c;
  /* Already stuck a while before the link broke: say on what, since the peer's going is often the
   * echo of that (a stalled node-mate makes the other nodes give up and leave). */
  uint64_t idle = mplane_now_ns() - o->idle_since;
  if (idle > 500000000ull) {
    char what_wait[256];
    describe_wait(o, what_wait, sizeof(what_wait));
    snprintf(waited, sizeof(waited), ", after %.1f s waiting for %s", (double)idle * 1e-9, what_wait);
  }
  /* A peer's connection often breaks because a rank of this node died first (its peers fail and
   * leave): name that one, the cause, where it is so. */
  o->last_liveness = 0;
  o->idle_since = mplane_now_ns();
  int res = check_stall(o);
  if (res != ncclSuccess) return res;
  c->culprit = c->links[link].peer;
  return hfr_fail_comm(c, ncclRemoteError, "hfreduce: rank %d: allreduce #%llu: %s %s failed (the peer died or "
                       "its connection broke)%s", c->rank, (unsigned long long)c->op_seq, what,
                       hfr_rank_name(c, c->links[link].peer, who, sizeof(who)), waited);
}

/* A failing rank tells its tree neighbours whom it blames, so ranks further away name the same rank:
 * a note of HFR_NOTE_BYTES goes out as the next message on each link. Both ends know every message's
 * size, so the receiver tells a note from data by its size (a link whose next message is that size,
 * or smaller than a note, gets none) and its magic. */
#define HFR_NOTE_BYTES 48
struct hfr_note {
  char magic[8];
  int32_t culprit, origin;
  uint64_t op_seq;
  int32_t sure; /* the origin knows (a death, a broken link, bad arguments), or it only waited too long */
  char pad[HFR_NOTE_BYTES - 28];
};
_Static_assert(sizeof(struct hfr_note) == HFR_NOTE_BYTES, "note size");
static const char note_magic[8] = {'H', 'F', 'R', 'N', 'O', 'T', 'E', '1'};

static int is_note(const void *buf) { return memcmp(buf, note_magic, sizeof(note_magic)) == 0; }

/* A neighbour's note ends the call here, its blame taken over and passed on. */
static int note_fail(struct op *o, const void *buf, int link, int chunks) {
  struct mplane_hfreduce_comm *c = o->c;
  struct hfr_note note;
  char who[160], who2[160], mine[320] = "", what[256];
  memcpy(&note, buf, sizeof(note));
  int told = note.culprit >= 0 && note.culprit < c->nranks ? note.culprit : c->links[link].peer;
  c->culprit = told;
  c->culprit_sure = note.sure != 0;
  /* A note that comes before this rank's own deadline comes from a wait that gave up earlier, so one
   * nearer the cause (wait_deadline_ns): its blame is taken over and passed on; what this rank itself
   * waited on is said beside it. */
  uint64_t idle = mplane_now_ns() - o->idle_since;
  if (!note.sure && chunks && idle > 500000000ull && describe_wait(o, what, sizeof(what)) >= 0)
    snprintf(mine, sizeof(mine), "; this rank had waited %.1f s for %s", (double)idle * 1e-9, what);
  return hfr_fail_comm(c, ncclRemoteError, "hfreduce: rank %d: allreduce #%llu: %s %s (as %s told its tree "
                       "neighbours)%s", c->rank, (unsigned long long)c->op_seq, hfr_rank_name(c, told, who, sizeof(who)),
                       note.sure ? "failed" : "was waited for too long", hfr_rank_name(c, c->links[link].peer, who2,
                       sizeof(who2)), mine);
}

/* The message at a link's send cursor, if its chunk is in flight. */
static struct msg *next_send(struct op *o, int li) {
  struct hfr_link *l = &o->c->links[li];
  for (size_t key = l->send_next; key / 2 < o->nchunks; key++) {
    struct chunk *k = chunk_of(o, key / 2);
    if (!k) return NULL;
    for (int i = 0; i < k->nmsgs; i++)
      if (k->msgs[i].link == li && k->msgs[i].is_send && k->msgs[i].tree == (int)(key % 2)) return &k->msgs[i];
  }
  return NULL;
}

/* Best effort, bounded (0.2 s): the comm has failed, the caller returns its error next. in_desc: the
 * failure came before this rank sent its descriptor, so the note takes the descriptor's place. */
static void tell_neighbours(struct op *o, int in_desc) {
  struct mplane_hfreduce_comm *c = o->c;
  struct hfr_note *note = (struct hfr_note *)hfr_note_buf(c);
  memset(note, 0, sizeof(*note));
  memcpy(note->magic, note_magic, sizeof(note_magic));
  note->culprit = c->culprit >= 0 ? c->culprit : c->rank;
  note->origin = c->rank;
  note->op_seq = c->op_seq;
  note->sure = c->culprit_sure;
  void *req[HFR_MAX_LINKS] = {0};
  int want[HFR_MAX_LINKS] = {0};
  for (int li = 0; li < c->nlinks; li++) {
    struct msg *m = in_desc ? NULL : next_send(o, li);
    want[li] = (in_desc || (m && m->bytes > HFR_NOTE_BYTES)) && c->links[li].peer != note->culprit;
  }
  uint64_t deadline = mplane_now_ns() + 200000000ull;
  int left = 1;
  while (left && mplane_now_ns() < deadline) {
    left = 0;
    for (int li = 0; li < c->nlinks; li++) {
      if (!want[li]) continue;
      int done = 0;
      if (!req[li] && c->ops->isend(c->links[li].send_comm, note, HFR_NOTE_BYTES, 0, c->links[li].send_mh_scratch,
                                     NULL, &req[li]) != ncclSuccess)
        want[li] = 0;
      else if (req[li] && (c->ops->test(req[li], &done, NULL) != ncclSuccess || done))
        want[li] = 0;
      left |= want[li];
    }
    if (left) sched_yield();
  }
}

/* Post what each link may take next, in key order (chunk, tree); then test what is out. 1 if anything
 * moved, 0 if not, -(error code) on failure. */
static int network_step(struct op *o) {
  struct mplane_hfreduce_comm *c = o->c;
  int moved = 0;
  for (int li = 0; li < c->nlinks; li++) {
    struct hfr_link *l = &c->links[li];
    for (int dir = 0; dir < 2; dir++) {
      size_t *next = dir ? &l->send_next : &l->recv_next;
      while (*next / 2 < o->nchunks) {
        struct chunk *k = chunk_of(o, *next / 2);
        if (!k || k->state < ST_SLOT) break;
        struct msg *m = NULL;
        for (int i = 0; i < k->nmsgs && !m; i++)
          if (k->msgs[i].link == li && k->msgs[i].is_send == dir && k->msgs[i].tree == (int)(*next % 2))
            m = &k->msgs[i];
        if (!m) {
          (*next)++;
          continue;
        }
        if (dir && !m->ready) break;
        ncclResult_t res;
        if (dir) {
          res = c->ops->isend(l->send_comm, m->buf, m->bytes, 0, m->mh, NULL, &m->req);
        } else {
          void *data = m->buf;
          size_t size = m->bytes;
          int tag = 0;
          res = c->ops->irecv(l->recv_comm, 1, &data, &size, &tag, &m->mh, NULL, &m->req);
        }
        if (res != ncclSuccess) return -link_fail(o, li, dir ? "sending to" : "receiving from");
        if (!m->req) break;
        m->posted = 1;
        (*next)++;
        moved = 1;
      }
    }
  }
  for (size_t idx = o->retired; idx < o->started; idx++) {
    struct chunk *k = chunk_of(o, idx);
    for (int i = 0; k && i < k->nmsgs; i++) {
      struct msg *m = &k->msgs[i];
      if (!m->posted || m->done) continue;
      int done = 0, sizes[1] = {0};
      if (c->ops->test(m->req, &done, m->is_send ? NULL : sizes) != ncclSuccess)
        return -link_fail(o, m->link, m->is_send ? "sending to" : "receiving from");
      if (done && !m->is_send && (size_t)sizes[0] == HFR_NOTE_BYTES && m->bytes != HFR_NOTE_BYTES && is_note(m->buf)) {
        return -note_fail(o, m->buf, m->link, 1);
      }
      if (done && !m->is_send && (size_t)sizes[0] != m->bytes) {
        char who[160];
        return -hfr_fail_comm(c, ncclInvalidUsage, "hfreduce: rank %d: allreduce #%llu: %s sent %d bytes where %zu "
                             "were due: the ranks disagree on count or dtype", c->rank, (unsigned long long)c->op_seq,
                             hfr_rank_name(c, c->links[m->link].peer, who, sizeof(who)), sizes[0], m->bytes);
      }
      if (done) {
        m->done = 1;
        moved = 1;
      }
    }
  }
  return moved;
}

/* Stalls come in chains (a rank waits for its parent, which waits for its own...). Each wait gives up
 * after a share of MPLANE_CONNECT_TIMEOUT that grows with its distance from where the chain can start:
 * a child waiting for its parent's result is as many hops from the top as its depth, a parent waiting
 * for a child's sum as the child's height plus one, a wait in the node the most. The rank next to the
 * culprit gives up first, blames it and tells its neighbours; those that waited on it take that over
 * (note_fail) well before their own, later, deadline. Every wait still ends within the timeout. */
static int tree_pos(struct mplane_hfreduce_comm *c, int t, int node) { return t == 0 ? node : c->nnodes - 1 - node; }
static int tree_depth(struct mplane_hfreduce_comm *c, int t) {
  int d = 0;
  for (int p = tree_pos(c, t, c->node); p > 0; p = (p - 1) / 2) d++;
  return d;
}
static int tree_height(struct mplane_hfreduce_comm *c, int t, int node) {
  int h = 0;
  for (int p = tree_pos(c, t, node); 2 * p + 1 < c->nnodes; p = 2 * p + 1) h++;
  return h;
}
static int max_hops(struct mplane_hfreduce_comm *c) {
  int d = 0;
  for (int n = c->nnodes; n > 1; n /= 2) d++;
  return d + 2;
}
/* The deadline of a wait `hops` from its cause: from half the timeout (1 hop) to all of it. */
static uint64_t wait_deadline_ns(struct mplane_hfreduce_comm *c, double hops) {
  double m = max_hops(c);
  return (uint64_t)((double)c->timeout_s * 1e9 * (m + hops) / (2.0 * m));
}

/* What the oldest chunk waits for, for the error that ends a stall: written into buf, and the rank
 * returned (-1 none). A local rank that itself waits for another rank says so (waits_for). */
static int describe_wait(struct op *o, char *buf, size_t len) {
  struct mplane_hfreduce_comm *c = o->c;
  struct chunk *k = chunk_of(o, o->retired);
  char who[160], who2[160];
  int late = -1;
  snprintf(buf, len, "nothing");
  o->wait_hops = max_hops(c); /* a wait in the node, or none found: the last to give up */
  o->wait_peer = -1;
  if (!k) return -1;
  switch (k->state) {
    case ST_SLOT:
      all_local_at_least(c, offsetof(struct hfr_shm_rank, consumed), k->g + 1 - (uint64_t)c->slots, &late);
      break;
    case ST_POSTED: all_local_at_least(c, offsetof(struct hfr_shm_rank, posted), k->g + 1, &late); break;
    case ST_GATHER: all_local_at_least(c, offsetof(struct hfr_shm_rank, reduced), k->g + 1, &late); break;
    case ST_TREES:
      /* what the tree step waits on: a child's sum (stage 0), the parent's result (1), a send the peer
       * has not taken (2); a send not yet due waits on one of those, so it is never the answer */
      for (int t = 0; t < 2; t++)
        for (int i = 0; i < k->nmsgs; i++) {
          struct msg *m = &k->msgs[i];
          if (m->tree != t || m->done) continue;
          int stage = k->tree_stage[t];
          int blocking = (stage == 0 && !m->is_send && m->up) || (stage == 1 && !m->is_send && !m->up) ||
                         (stage == 2 && m->is_send && m->posted);
          if (!blocking) continue;
          int peer = c->links[m->link].peer;
          snprintf(buf, len, "%s (tree %d %s of chunk %zu)", hfr_rank_name(c, peer, who, sizeof(who)), m->tree,
                   m->up ? "reduce" : "broadcast", k->idx);
          o->wait_peer = peer;
          o->wait_hops = stage == 0 ? tree_height(c, t, c->node_of[peer]) + 1 : stage == 1 ? tree_depth(c, t) : 1;
          return peer;
        }
      break;
    default:
      snprintf(buf, len, "GPU %d's copy engine (chunk %zu)", o->send_gpu >= 0 ? o->send_gpu : o->recv_gpu, k->idx);
      return -1;
  }
  if (late < 0) return -1;
  static const char *const what[] = {"", "copied out its previous chunk in this slot", "", "copied in",
                                     "", "reduced its slice"};
  int rank = c->column[c->node] - c->local + late;
  int next = __atomic_load_n(&c->shm->rank[late].waits_for, __ATOMIC_RELAXED);
  snprintf(buf, len, "%s on this node, which has not %s (chunk %zu)%s%s", hfr_rank_name(c, rank, who, sizeof(who)),
           what[k->state], k->idx, next >= 0 && next != c->rank ? " and itself waits for " : "",
           next >= 0 && next != c->rank ? hfr_rank_name(c, next, who2, sizeof(who2)) : "");
  return next >= 0 && next != c->rank ? next : rank;
}

/* Stalled: a local rank that is gone fails us at once; otherwise MPLANE_CONNECT_TIMEOUT does. */
static int check_stall(struct op *o) {
  struct mplane_hfreduce_comm *c = o->c;
  char who[160], what[256];
  if (__atomic_load_n(&c->shm->abort, __ATOMIC_ACQUIRE)) {
    char msg[600];
    snprintf(msg, sizeof(msg), "%s", c->shm->abort_msg);
    c->culprit = c->shm->abort_culprit;
    c->culprit_sure = c->shm->abort_sure;
    return hfr_fail_comm(c, ncclRemoteError, "hfreduce: rank %d: allreduce #%llu stopped: a rank of this node failed: %s",
                         c->rank, (unsigned long long)c->op_seq, msg);
  }
  uint64_t now = mplane_now_ns();
  if (now - o->last_liveness > 100000000ull) {
    o->last_liveness = now;
    for (int l = 0; l < c->nlocal; l++) {
      int pid = c->shm->rank[l].pid;
      if (l != c->local && pid > 0 && kill(pid, 0) != 0 && errno == ESRCH && (c->culprit = c->column[c->node] - c->local + l) >= 0)
        return hfr_fail_comm(c, ncclRemoteError, "hfreduce: rank %d: allreduce #%llu: %s has died", c->rank,
                             (unsigned long long)c->op_seq,
                             hfr_rank_name(c, c->column[c->node] - c->local + l, who, sizeof(who)));
    }
  }
  struct hfr_shm_rank *me = &c->shm->rank[c->local];
  if (now - o->idle_since > 500000000ull) /* half a second: say whom, for the node's ranks that wait on us */
    __atomic_store_n(&me->waits_for, describe_wait(o, what, sizeof(what)), __ATOMIC_RELAXED);
  else
    o->wait_hops = max_hops(c);
  if (now - o->idle_since > wait_deadline_ns(c, o->wait_hops)) {
    c->culprit = describe_wait(o, what, sizeof(what));
    c->culprit_sure = 0;
    return hfr_fail_comm(c, ncclSystemError, "hfreduce: rank %d: allreduce #%llu made no progress for %.1f s "
                         "(MPLANE_CONNECT_TIMEOUT=%d s), waiting for %s", c->rank, (unsigned long long)c->op_seq,
                         (double)(now - o->idle_since) * 1e-9, c->timeout_s, what);
  }
  return ncclSuccess;
}

/* Idle passes give the CPU away, more and more: ranks share cores with the reducing ones. */
static void back_off(unsigned idle) {
  if (idle < 64) return;
  if (idle < 4096) sched_yield();
  else usleep(100);
}

static int fail_and_tell(struct op *o, int res) {
  if (o->c->nnodes > 1) tell_neighbours(o, 0);
  return res;
}

static int pipeline(struct op *o) {
  struct mplane_hfreduce_comm *c = o->c;
  for (int li = 0; li < c->nlinks; li++) c->links[li].send_next = c->links[li].recv_next = 0;
  o->idle_since = o->last_liveness = mplane_now_ns();
  unsigned idle = 0;
  while (o->retired < o->nchunks) {
    int moved = 0;
    while (o->started < o->nchunks && o->started < o->retired + (size_t)c->slots) {
      struct chunk *k = &o->ch[o->started % (size_t)c->slots];
      memset(k, 0, sizeof(*k));
      k->idx = o->started;
      k->g = c->chunks_done + o->started;
      k->slot = (int)(k->g % (uint64_t)c->slots);
      chunk_layout(o, k);
      chunk_msgs(o, k);
      k->state = ST_SLOT;
      o->started++;
      moved = 1;
    }
    for (size_t idx = o->retired; idx < o->started; idx++) {
      int r = chunk_step(o, chunk_of(o, idx));
      if (r < 0) return fail_and_tell(o, -r);
      moved |= r;
    }
    if (c->nnodes > 1) {
      int r = network_step(o);
      if (r < 0) return fail_and_tell(o, -r);
      moved |= r;
    }
    while (o->retired < o->started && chunk_of(o, o->retired)->state == ST_DONE) o->retired++;
    if (moved) {
      idle = 0;
      o->idle_since = mplane_now_ns();
      if (c->shm->rank[c->local].waits_for >= 0) __atomic_store_n(&c->shm->rank[c->local].waits_for, -1, __ATOMIC_RELAXED);
      continue;
    }
    int r = check_stall(o);
    if (r != ncclSuccess) return fail_and_tell(o, r);
    back_off(++idle);
  }
  c->chunks_done += o->nchunks;
  return ncclSuccess;
}

/* ---- the descriptor check: every rank passes the same count, dtype and op ---- */

struct desc {
  uint64_t seq, count;
  int32_t dtype, op, rank, pad;
};

static int local_desc_check(struct op *o) {
  struct mplane_hfreduce_comm *c = o->c;
  struct hfr_shm_rank *me = &c->shm->rank[c->local];
  me->desc_count = o->count;
  me->desc_dtype = o->dtype;
  me->desc_op = o->op;
  store_rel(&me->desc_seq, c->op_seq);
  o->idle_since = o->last_liveness = mplane_now_ns();
  unsigned idle = 0;
  char who[160];
  for (int l = 0; l < c->nlocal; l++) {
    struct hfr_shm_rank *r = &c->shm->rank[l];
    while (load_acq(&r->desc_seq) < c->op_seq) {
      if (mplane_now_ns() - o->idle_since > wait_deadline_ns(c, max_hops(c) - 0.5) &&
          (c->culprit = c->column[c->node] - c->local + l) >= 0 && !(c->culprit_sure = 0))
        return hfr_fail_comm(c, ncclSystemError, "hfreduce: rank %d: allreduce #%llu: %s did not start it within "
                             "MPLANE_CONNECT_TIMEOUT=%d s", c->rank, (unsigned long long)c->op_seq,
                             hfr_rank_name(c, c->column[c->node] - c->local + l, who, sizeof(who)), c->timeout_s);
      int res = check_stall(o); /* a dead local rank or an abort fails at once */
      if (res != ncclSuccess) return res;
      back_off(++idle);
    }
    if ((r->desc_count != o->count || r->desc_dtype != o->dtype || r->desc_op != o->op) &&
        (c->culprit = c->column[c->node] - c->local + l) >= 0)
      return hfr_fail_comm(c, ncclInvalidUsage, "hfreduce: rank %d: allreduce #%llu: %s passed count %llu, dtype %s, "
                           "op %s; this rank count %zu, dtype %s, op %s", c->rank, (unsigned long long)c->op_seq,
                           hfr_rank_name(c, c->column[c->node] - c->local + l, who, sizeof(who)),
                           (unsigned long long)r->desc_count, mp_hfr_dtype_name(r->desc_dtype),
                           mp_hfr_op_name(r->desc_op), o->count, mp_hfr_dtype_name(o->dtype), mp_hfr_op_name(o->op));
  }
  return ncclSuccess;
}

/* Between nodes: each link carries the descriptor before the chunks (the first key of the op). */
static int remote_desc_check(struct op *o) {
  struct mplane_hfreduce_comm *c = o->c;
  struct desc *mine = (struct desc *)hfr_desc_buf(c, -1);
  *mine = (struct desc){.seq = c->op_seq, .count = o->count, .dtype = o->dtype, .op = o->op, .rank = c->rank};
  void *sreq[HFR_MAX_LINKS] = {0}, *rreq[HFR_MAX_LINKS] = {0};
  int sdone[HFR_MAX_LINKS] = {0}, rdone[HFR_MAX_LINKS] = {0}, left = 2 * c->nlinks;
  o->idle_since = o->last_liveness = mplane_now_ns();
  unsigned idle = 0;
  char who[160];
  while (left) {
    int moved = 0;
    for (int i = 0; i < c->nlinks; i++) {
      struct hfr_link *l = &c->links[i];
      if (!rreq[i]) {
        void *data = hfr_desc_buf(c, i);
        size_t size = 64; /* a descriptor, or a neighbour's failure note in its place */
        int tag = 0;
        if (c->ops->irecv(l->recv_comm, 1, &data, &size, &tag, &l->recv_mh_scratch, NULL, &rreq[i]) != ncclSuccess)
          return link_fail(o, i, "receiving from");
      }
      if (!sreq[i] && c->ops->isend(l->send_comm, mine, sizeof(*mine), 0, l->send_mh_scratch, NULL, &sreq[i]) != ncclSuccess)
        return link_fail(o, i, "sending to");
      int done;
      if (sreq[i] && !sdone[i]) {
        if (c->ops->test(sreq[i], &done, NULL) != ncclSuccess) return link_fail(o, i, "sending to");
        if (done) sdone[i] = 1, left--, moved = 1;
      }
      if (rreq[i] && !rdone[i]) {
        int got[1] = {0};
        if (c->ops->test(rreq[i], &done, got) != ncclSuccess) return link_fail(o, i, "receiving from");
        if (done && got[0] == HFR_NOTE_BYTES && is_note(hfr_desc_buf(c, i))) {
          return note_fail(o, hfr_desc_buf(c, i), i, 0);
        }
        if (done && got[0] != (int)sizeof(struct desc))
          return hfr_fail_comm(c, ncclInvalidUsage, "hfreduce: rank %d: allreduce #%llu: %s sent %d bytes for its "
                               "descriptor, not %zu", c->rank, (unsigned long long)c->op_seq,
                               hfr_rank_name(c, l->peer, who, sizeof(who)), got[0], sizeof(struct desc));
        if (done) rdone[i] = 1, left--, moved = 1;
      }
    }
    if (moved) {
      idle = 0;
      o->idle_since = mplane_now_ns();
      continue;
    }
    if (mplane_now_ns() - o->idle_since > (uint64_t)c->timeout_s * 1000000000ull) {
      int i = 0;
      while (i < c->nlinks && rdone[i] && sdone[i]) i++;
      c->culprit = c->links[i < c->nlinks ? i : 0].peer;
      c->culprit_sure = 0;
      return hfr_fail_comm(c, ncclSystemError, "hfreduce: rank %d: allreduce #%llu: %s did not start it within "
                           "MPLANE_CONNECT_TIMEOUT=%d s", c->rank, (unsigned long long)c->op_seq,
                           hfr_rank_name(c, c->links[i < c->nlinks ? i : 0].peer, who, sizeof(who)), c->timeout_s);
    }
    int r = check_stall(o);
    if (r != ncclSuccess) return r;
    back_off(++idle);
  }
  for (int i = 0; i < c->nlinks; i++) {
    const struct desc *d = (const struct desc *)hfr_desc_buf(c, i);
    if (d->seq != c->op_seq || d->count != o->count || d->dtype != o->dtype || d->op != o->op)
      return hfr_fail_comm(c, ncclInvalidUsage, "hfreduce: rank %d: allreduce #%llu: %s passed count %llu, dtype %s, "
                           "op %s (its allreduce #%llu); this rank count %zu, dtype %s, op %s", c->rank,
                           (unsigned long long)c->op_seq, hfr_rank_name(c, c->links[i].peer, who, sizeof(who)),
                           (unsigned long long)d->count, mp_hfr_dtype_name(d->dtype), mp_hfr_op_name(d->op),
                           (unsigned long long)d->seq, o->count, mp_hfr_dtype_name(o->dtype), mp_hfr_op_name(o->op));
  }
  return ncclSuccess;
}

/* ---- device buffers ---- */

static int buffer_gpu(const void *p) {
  static int loaded = -1;
  if (loaded < 0) {
    char why[256];
    loaded = mplane_cuda_load(why, sizeof(why)) > 0;
  }
  return loaded ? mplane_cuda_pointer_device(p) : -1;
}

/* The first call on device buffers page-locks the shared segment (and the scratch), so the copy
 * engine moves chunks by DMA instead of staging them through the driver's own buffer. Where the
 * driver refuses, the copies still work, staged: one INFO says so. */
static void pin_for_gpu(struct mplane_hfreduce_comm *c, int gpu) {
  if (c->pinned || gpu < 0) return;
  c->pinned = 1;
  size_t head = (size_t)(c->data - (char *)c->shm);
  if (mplane_cuda_host_register(gpu, c->data, c->shm_bytes - head) != 0) {
    MP_INFO(NCCL_INIT, "hfreduce: rank %d: the driver would not page-lock the shared segment: copies are staged", c->rank);
    c->pinned = 0;
    return;
  }
  if (mplane_cuda_host_register(gpu, c->scratch, c->scratch_bytes) != 0) {
    mplane_cuda_host_unregister(c->data);
    c->pinned = 0;
  }
}

static int wait_stream(struct mplane_hfreduce_comm *c, int gpu, void *stream) {
  if (!stream || gpu < 0) return ncclSuccess;
  if (mplane_cu_use(gpu) != 0 || !mplane_cu.cuStreamSynchronize ||
      mplane_cu.cuStreamSynchronize((CUstream)stream) != CUDA_SUCCESS)
    return hfr_fail(ncclUnhandledCudaError, "hfreduce: rank %d: waiting for the caller's stream on GPU %d failed",
                    c->rank, gpu);
  return ncclSuccess;
}

int mplane_hfreduce_allreduce(mplane_hfreduce_comm_t c, const void *send, void *recv, size_t count, int dtype, int op,
                              void *stream) {
  if (!c) return hfr_fail(ncclInvalidArgument, "hfreduce: allreduce: comm is NULL");
  if (c->failed)
    return hfr_fail(ncclInvalidUsage, "hfreduce: rank %d: allreduce on a communicator that failed before; destroy it",
                    c->rank);
  if (dtype < 0 || dtype >= MPLANE_HFREDUCE_NDTYPES)
    return hfr_fail(ncclInvalidArgument, "hfreduce: rank %d: allreduce: dtype %d is none of 0..%d (float32, float16, "
                    "bfloat16, fp8_e4m3, fp8_e5m2)", c->rank, dtype, MPLANE_HFREDUCE_NDTYPES - 1);
  if (op < 0 || op >= MPLANE_HFREDUCE_NOPS)
    return hfr_fail(ncclInvalidArgument, "hfreduce: rank %d: allreduce: op %d is none of 0..%d (sum, max, min)",
                    c->rank, op, MPLANE_HFREDUCE_NOPS - 1);
  if (count == 0) return ncclSuccess; /* as NCCL: nothing to do, nothing exchanged */
  if (!send || !recv) return hfr_fail(ncclInvalidArgument, "hfreduce: rank %d: allreduce: send or recv is NULL", c->rank);
  struct op *o = calloc(1, sizeof(*o));
  if (!o) return hfr_fail(ncclSystemError, "hfreduce: out of memory");
  o->c = c;
  o->send = send;
  o->recv = recv;
  o->count = count;
  o->dtype = dtype;
  o->op = op;
  o->esize = mp_hfr_dtype_size(dtype);
  o->chunk_elems = c->chunk_bytes / o->esize;
  o->nchunks = (count + o->chunk_elems - 1) / o->chunk_elems;
  o->send_gpu = buffer_gpu(send);
  o->recv_gpu = buffer_gpu(recv);
  c->op_seq++;
  pin_for_gpu(c, o->send_gpu >= 0 ? o->send_gpu : o->recv_gpu);
  int res = wait_stream(c, o->send_gpu >= 0 ? o->send_gpu : o->recv_gpu, stream);
  if (res == ncclSuccess) {
    res = local_desc_check(o);
    if (res != ncclSuccess && c->nnodes > 1) tell_neighbours(o, 1);
  }
  if (res == ncclSuccess && c->nnodes > 1) res = remote_desc_check(o);
  if (res == ncclSuccess) res = pipeline(o);
  free(o);
  return res;
}
