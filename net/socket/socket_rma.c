/* mplane: one-sided ops (net/transport.h's mplane_rma_ops) over TCP, for NCCL 2.30's GIN proxy:
 * groups, windows, contexts and the ops NCCL calls. A connection's I/O is socket_rma_conn.c.
 *
 * The target writes its own memory: a put travels as a header and its bytes on the connection of
 * its (context, peer); the target checks the header against the window it names, lands the bytes
 * (host memory directly, GPU memory through the CUDA driver on the process's one non-blocking
 * stream for that GPU, asynchronously, the signal's write queued behind the data on that stream),
 * then applies the signal, then acknowledges. An op unanswered
 * for MPLANE_CONNECT_TIMEOUT fails its connection. One reader per connection at a time, in order, so
 * a signal is applied only after its data and after every earlier put of that context to that rank
 * is in place. A get is a request the target answers with the bytes.
 *
 * Connections: connect() builds a control mesh (lower rank dials, higher rank accepts) used only
 * by the collective calls; create_context() exchanges a fresh listener's address over it and
 * builds one full-duplex connection per context and connected pair (ranks rank +- k*stride). */
#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../common/log.h"
#include "../../common/nccl/rma.h"
#include "../../common/cuda.h"
#include "../relay.h"
#include "../rma_ctrl.h"
#include "../tc.h"
#include "socket.h"
#include "socket_rma.h"

/* The group's all-gather and its peers of a context (net/rma_ctrl.h). */
static ncclResult_t ctrl_allgather(struct mpr_group *g, const void *mine, void *all, size_t len, const char *what) {
  return mplane_rma_allgather(g->ctrl, g->rank, g->nranks, mine, all, len, mpr_timeout_ms(), what);
}

static int is_connected_peer(const struct mpr_group *g, int stride, int p) {
  return mplane_rma_peer_connected(g->rank, g->nranks, stride, p);
}





static ncclResult_t open_listener(int dev, struct mpr_handle *h, int *out_fd) {
  const struct mps_dev *d = mps_dev_get(dev);
  if (!d) {
    MP_WARN("RMA listen: device %d does not exist (%d devices)", dev, mps_dev_count());
    return ncclInvalidArgument;
  }
  char where[96];
  mps_addr_str(&d->addr.sa, where, sizeof(where));
  struct sockaddr_storage sa;
  memcpy(&sa, &d->addr, d->addrlen);
  socklen_t len = d->addrlen;
  int fd = mplane_rma_listen_any_port(&sa, &len);
  if (fd < 0 || len > sizeof(h->addr)) {
    MP_WARN("RMA listen on %s (%s): %s", d->ifname, where, fd < 0 ? strerror(errno) : "an address of another family");
    if (fd >= 0) close(fd);
    return ncclSystemError;
  }
  memset(h, 0, sizeof(*h));
  h->magic = MPR_MAGIC;
  h->version = MPR_VERSION;
  h->addrlen = (uint16_t)len;
  memcpy(&h->addr, &sa, len);
  *out_fd = fd;
  return ncclSuccess;
}

static int dial(const struct mpr_handle *h, const struct mpr_hello *hello, int sl, char *why, size_t whylen) {
  char bad[160];
  if (h->magic != MPR_MAGIC || h->version != MPR_VERSION) {
    snprintf(why, whylen, "its handle is not an mplane RMA handle of version %d", MPR_VERSION);
    errno = EINVAL;
    return -2;
  }
  if (mplane_rma_addr_check(&h->addr.sa, h->addrlen, bad, sizeof(bad)) != 0) {
    snprintf(why, whylen, "its handle is refused: %s", bad);
    errno = EINVAL;
    return -2;
  }
  int fd = socket(h->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    snprintf(why, whylen, "socket: %s", strerror(errno));
    return -1;
  }
  mplane_rma_set_timeouts(fd, mpr_timeout_ms());
  if (sl >= 0) mplane_tc_mark_socket_or_log(fd, sl, "rma");
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  if (connect(fd, &h->addr.sa, h->addrlen) != 0 || mplane_rma_write_all(fd, hello, sizeof(*hello)) != 0) {
    snprintf(why, whylen, "connect: %s", strerror(errno));
    close(fd);
    return -1;
  }
  return fd;
}

/* Who may come in on a listener: a hello of this version, of the kind asked for, from a rank that
 * should connect here and has not yet (a second hello for a place already taken is dropped). */
struct hello_want {
  const struct mpr_group *g;
  int kind, ncontexts, stride;
  struct mpr_conn *const *conns; /* createContext: the places taken so far */
};

static int hello_check(const void *p, void *arg, char *why, size_t whylen) {
  const struct mpr_hello *h = p;
  const struct hello_want *w = arg;
  const struct mpr_group *g = w->g;
  if (h->version != MPR_VERSION) {
    snprintf(why, whylen, "an mplane RMA peer of version %u (this is %d)", h->version, MPR_VERSION);
    return -1;
  }
  if (h->kind != w->kind || h->nranks != g->nranks || h->rank <= g->rank || h->rank >= g->nranks) {
    snprintf(why, whylen, "it says it is rank %d of %d (connection kind %u); rank %d of %d takes ranks %d..%d here",
             h->rank, h->nranks, h->kind, g->rank, g->nranks, g->rank + 1, g->nranks - 1);
    return -1;
  }
  if (w->kind == 0 ? g->ctrl[h->rank] >= 0 : (h->context < 0 || h->context >= w->ncontexts ||
                                               !is_connected_peer(g, w->stride, h->rank) ||
                                               w->conns[h->context * g->nranks + h->rank] != NULL)) {
    snprintf(why, whylen, "rank %d, context %d: not a place this rank connects, or taken already", h->rank,
             h->context);
    return -1;
  }
  return 0;
}

/* ---- listen / connect (the control mesh) ---- */
static ncclResult_t rma_listen(int dev, void *handle, void **listen_comm) {
  struct mpr_listen *l = calloc(1, sizeof(*l));
  if (!l) return ncclSystemError;
  struct mpr_handle h;
  ncclResult_t res = open_listener(dev, &h, &l->fd);
  if (res != ncclSuccess) {
    free(l);
    return res;
  }
  l->dev = dev;
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *listen_comm = l;
  return ncclSuccess;
}

static ncclResult_t rma_close_listen(void *listen_comm) {
  struct mpr_listen *l = listen_comm;
  if (!l) return ncclSuccess;
  close(l->fd);
  free(l);
  return ncclSuccess;
}

static void group_free(struct mpr_group *g) {
  if (!g) return;
  for (int i = 0; g->ctrl && i < g->nranks; i++)
    if (g->ctrl[i] >= 0) close(g->ctrl[i]);
  free(g->ctrl);
  for (uint32_t i = 0; g->wins && i < g->nwins; i++) free(g->wins[i].shadow);
  free(g->wins);
  free(g->sets);
  pthread_rwlock_destroy(&g->win_lock);
  pthread_mutex_destroy(&g->sets_lock);
  free(g);
}

static ncclResult_t rma_connect(void *handles[], int nranks, int rank, void *listen_comm, void **out) {
  struct mpr_listen *l = listen_comm;
  *out = NULL;
  if (!l || nranks < 1 || rank < 0 || rank >= nranks) {
    MP_WARN("RMA connect: rank %d of %d is not a valid position in the group", rank, nranks);
    return ncclInvalidArgument;
  }
  struct mpr_group *g = calloc(1, sizeof(*g));
  if (!g || !(g->ctrl = malloc(sizeof(int) * (size_t)nranks))) {
    free(g);
    return ncclSystemError;
  }
  g->rank = rank;
  g->nranks = nranks;
  g->dev = l->dev;
  /* Writers first: a deregMrSym is not kept waiting behind a stream of landings. */
  pthread_rwlockattr_t ra;
  pthread_rwlockattr_init(&ra);
  pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  pthread_rwlock_init(&g->win_lock, &ra);
  pthread_rwlockattr_destroy(&ra);
  pthread_mutex_init(&g->sets_lock, NULL);
  for (int i = 0; i < nranks; i++) g->ctrl[i] = -1;
  char why[256];
  struct mpr_hello hello = {.magic = MPR_MAGIC, .version = MPR_VERSION, .kind = 0, .rank = rank,
                            .nranks = nranks, .context = -1};
  for (int j = 0; j < rank; j++) { /* lower ranks accept: their listeners exist before handles travel */
    int fd = dial(handles[j], &hello, -1, why, sizeof(why));
    if (fd < 0) {
      MP_WARN("RMA connect: rank %d to rank %d: %s", rank, j, why);
      group_free(g);
      return fd == -2 ? ncclInvalidArgument : ncclRemoteError;
    }
    g->ctrl[j] = fd;
  }
  struct mplane_rma_gate gate;
  struct hello_want want = {.g = g, .kind = 0};
  mplane_rma_gate_init(&gate, l->fd, MPR_MAGIC, sizeof(struct mpr_hello), "RMA connect");
  for (int n = rank + 1; n < nranks; n++) {
    struct mpr_hello ph;
    int fd = mplane_rma_gate_take(&gate, &ph, hello_check, &want, mpr_timeout_ms(), why, sizeof(why));
    if (fd < 0) {
      MP_WARN("RMA connect: rank %d of %d waiting for rank %d and up: %s", rank, nranks, rank + 1, why);
      mplane_rma_gate_close(&gate);
      group_free(g);
      return ncclRemoteError;
    }
    mplane_rma_set_timeouts(fd, mpr_timeout_ms());
    g->ctrl[ph.rank] = fd;
  }
  mplane_rma_gate_close(&gate);
  MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d of %d connected its group on %s", rank, nranks,
          mps_dev_get(l->dev)->ifname);
  *out = g;
  return ncclSuccess;
}

static ncclResult_t rma_close_group(void *group) {
  group_free(group);
  return ncclSuccess;
}


/* ---- windows ---- */
#define MPR_SHADOW_MAX (1u << 20) /* signal windows are small: nSignals x contexts x 8 bytes */

/* The host copy of a GPU signal window, read once: from here on only this process writes it. */
static uint64_t *shadow_new(int gpu, void *data, size_t size) {
  if (size == 0 || size > MPR_SHADOW_MAX || size % 8 || (uintptr_t)data % 8) return NULL;
  uint64_t *s = malloc(size);
  if (s && mplane_cuda_memcpy_dtoh(gpu, s, data, size) != 0) {
    free(s);
    s = NULL;
  }
  return s;
}

/* regMrSym is collective: every rank must be registering its window of the same index, or puts
 * would land in another window than the one named. One all-gather of (index, size) per window. */
static ncclResult_t check_same_order(struct mpr_group *g, uint32_t id, size_t size) {
  struct { uint32_t id, pad; uint64_t size; } mine = {.id = id, .size = size}, all[g->nranks];
  ncclResult_t res = ctrl_allgather(g, &mine, all, sizeof(mine), "regMrSym");
  if (res != ncclSuccess) return res;
  for (int p = 0; p < g->nranks; p++) {
    if (all[p].id != id) {
      if (id != UINT32_MAX && all[p].id == UINT32_MAX)
        MP_WARN("RMA regMrSym: rank %d's registration of window %u failed, so it fails here too", p, id);
      else if (id != UINT32_MAX)
        MP_WARN("RMA regMrSym: rank %d registers its window %u while rank %d registers its window %u: windows must "
                "be registered in the same order on every rank", g->rank, id, p, all[p].id);
      return ncclInvalidUsage;
    }
    if (all[p].size != size)
      MP_INFO(NCCL_NET, "RMA regMrSym: window %u is %zu bytes here and %llu bytes on rank %d (each target checks "
              "ops against its own size)", id, size, (unsigned long long)all[p].size, p);
  }
  return ncclSuccess;
}

/* Which GPU owns data (-1 host memory); an error names what is wrong with the memory. */
static ncclResult_t win_memory(void *data, size_t size, int type, int *gpu) {
  *gpu = -1;
  if (type == NCCL_PTR_CUDA) {
    char why[256] = "";
    if (mplane_cuda_load(why, sizeof(why)) <= 0 || (*gpu = mplane_cuda_pointer_device(data)) < 0) {
      MP_WARN("RMA regMrSym: %p (%zu bytes) is said to be GPU memory, but %s", data, size,
              why[0] ? why : "the CUDA driver does not know it");
      return ncclInvalidUsage;
    }
  } else if (type != NCCL_PTR_HOST) {
    MP_WARN("RMA regMrSym: memory type %d; expected NCCL_PTR_HOST (1) or NCCL_PTR_CUDA (2)", type);
    return ncclInvalidArgument;
  }
  return ncclSuccess;
}

/* Append a live window; its index is *id. */
static ncclResult_t win_add(struct mpr_group *g, void *data, size_t size, int gpu, uint64_t *shadow, uint32_t *id) {
  pthread_rwlock_wrlock(&g->win_lock);
  if (g->nwins == g->cap) {
    uint32_t cap = g->cap ? g->cap * 2 : 16;
    struct mpr_win *w = realloc(g->wins, sizeof(*w) * cap);
    if (!w) {
      pthread_rwlock_unlock(&g->win_lock);
      return ncclSystemError;
    }
    g->wins = w;
    g->cap = cap;
  }
  *id = g->nwins;
  g->wins[g->nwins++] = (struct mpr_win){.id = *id, .live = 1, .base = data, .size = size, .gpu = gpu,
                                          .shadow = shadow};
  pthread_rwlock_unlock(&g->win_lock);
  return ncclSuccess;
}

/* Symmetric registration: the n-th window of every rank is the same window, so its index is its
 * name on the wire; the order check is collective, so a rank whose registration failed still takes
 * part (as index UINT32_MAX) and the others fail with it instead of waiting. */
static ncclResult_t rma_reg_mr_sym(void *group, void *data, size_t size, int type, uint64_t flags, void **mhandle) {
  struct mpr_group *g = group;
  /* FORCE_SO: every signal is applied after its data anyway. */
  *mhandle = NULL;
  int gpu = -1;
  uint64_t *shadow = NULL;
  uint32_t *id = malloc(sizeof(*id));
  ncclResult_t res = id ? win_memory(data, size, type, &gpu) : ncclSystemError;
  if (res == ncclSuccess && gpu >= 0 && (flags & NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET))
    shadow = shadow_new(gpu, data, size);
  if (res == ncclSuccess) res = win_add(g, data, size, gpu, shadow, id);
  ncclResult_t ores = check_same_order(g, res == ncclSuccess ? *id : UINT32_MAX, size);
  if (res == ncclSuccess && ores != ncclSuccess) {
    pthread_rwlock_wrlock(&g->win_lock);
    g->wins[*id].live = 0; /* the index stays taken (the shadow is freed with the group) */
    pthread_rwlock_unlock(&g->win_lock);
    res = ores;
  } else if (res != ncclSuccess) {
    free(shadow);
  }
  if (res != ncclSuccess) {
    free(id);
    return res;
  }
  MP_TRACE(NCCL_NET, "RMA: window %u = %p, %zu bytes, %s%s", *id, data, size, gpu < 0 ? "host" : "GPU",
           shadow ? ", signals kept on the host too (NCCL never writes them)" : "");
  *mhandle = id;
  return ncclSuccess;
}

/* After deregMrSym returns, its memory may be freed: no op of a peer may still write it or read it.
 * Taking it out of service under the write lock waits for every landing or signal step under way
 * and stops new ones (they are refused); answers still queued that would read it become refusals;
 * writes under way end (within the timeout, or their connection is cut); copies the GPU was given
 * for it complete. */
static void win_quiesce(struct mpr_group *g, const struct mpr_win *w) {
  uint64_t deadline = mplane_now_ns() + (uint64_t)mpr_timeout_ms() * 1000000ull;
  pthread_mutex_lock(&g->sets_lock);
  for (int k = 0; k < g->nsets; k++) {
    struct mpr_ctxset *s = g->sets[k];
    for (int i = 0; i < s->ncontexts * g->nranks; i++) mpr_conn_forget_win(s->conns[i], w->id, w->base, deadline);
    for (int i = 0; i < s->ncontexts; i++) mpr_conn_forget_win(s->mirrors[i], w->id, w->base, deadline);
  }
  pthread_mutex_unlock(&g->sets_lock);
  if (w->gpu >= 0 && mplane_cuda_lane_wait(w->gpu, mplane_cuda_lane_issued(w->gpu), mpr_timeout_ms()) != 0)
    MP_WARN("RMA deregMrSym: window %u: the GPU did not complete the copies given for it within %d s", w->id,
            mpr_timeout_ms() / 1000);
}

static ncclResult_t rma_dereg_mr_sym(void *group, void *mhandle) {
  struct mpr_group *g = group;
  uint32_t *id = mhandle;
  if (!id) return ncclSuccess;
  struct mpr_win w = {0};
  pthread_rwlock_wrlock(&g->win_lock);
  int live = *id < g->nwins && g->wins[*id].live;
  if (live) {
    w = g->wins[*id];
    g->wins[*id].live = 0;
  }
  pthread_rwlock_unlock(&g->win_lock);
  if (live) win_quiesce(g, &w);
  free(id);
  return ncclSuccess;
}

/* The group's context sets, for win_quiesce. */
static int sets_add(struct mpr_group *g, struct mpr_ctxset *s) {
  pthread_mutex_lock(&g->sets_lock);
  if (g->nsets == g->sets_cap) {
    int cap = g->sets_cap ? 2 * g->sets_cap : 4;
    struct mpr_ctxset **n = realloc(g->sets, sizeof(*n) * (size_t)cap);
    if (!n) {
      pthread_mutex_unlock(&g->sets_lock);
      return -1;
    }
    g->sets = n;
    g->sets_cap = cap;
  }
  g->sets[g->nsets++] = s;
  pthread_mutex_unlock(&g->sets_lock);
  return 0;
}

static void sets_remove(struct mpr_group *g, struct mpr_ctxset *s) {
  pthread_mutex_lock(&g->sets_lock);
  for (int k = 0; k < g->nsets; k++)
    if (g->sets[k] == s) {
      g->sets[k] = g->sets[--g->nsets];
      break;
    }
  pthread_mutex_unlock(&g->sets_lock);
}

/* ---- contexts ---- */
static ncclResult_t rma_destroy_context(void *ctx) {
  struct mpr_ctxset *s = ctx;
  if (!s) return ncclSuccess;
  sets_remove(s->g, s);
  for (int i = 0; s->conns && i < s->ncontexts * s->g->nranks; i++) mpr_conn_destroy(s->conns[i]);
  for (int i = 0; s->mirrors && i < s->ncontexts; i++) mpr_conn_destroy(s->mirrors[i]);
  free(s->conns);
  free(s->mirrors);
  if (s->epfd >= 0) close(s->epfd);
  free(s);
  return ncclSuccess;
}

static ncclResult_t rma_create_context(void *group, const struct mplane_rma_ctx_opts *o, void **out) {
  struct mpr_group *g = group;
  *out = NULL;
  if (o->ncontexts < 1 || o->rank_stride < 1 || g->nranks % o->rank_stride != 0) {
    MP_WARN("RMA createContext: %d contexts with rank stride %d in a group of %d ranks; expected at least one "
            "context and a stride that divides the group", o->ncontexts, o->rank_stride, g->nranks);
    return ncclInvalidArgument;
  }
  struct mpr_ctxset *s = calloc(1, sizeof(*s));
  size_t nconn = (size_t)o->ncontexts * (size_t)g->nranks;
  if (!s || !(s->conns = calloc(nconn, sizeof(*s->conns))) ||
      !(s->mirrors = calloc((size_t)o->ncontexts, sizeof(*s->mirrors)))) {
    if (s) free(s->conns);
    free(s);
    return ncclSystemError;
  }
  s->g = g;
  s->ncontexts = o->ncontexts;
  size_t peers = 0;
  for (int p = 0; p < g->nranks; p++) peers += p != g->rank && is_connected_peer(g, o->rank_stride, p);
  mpr_ctxset_size_rings(s, (size_t)o->ncontexts * (peers + 2)); /* + the rank's own pair */
  s->epfd = epoll_create1(EPOLL_CLOEXEC);
  ncclResult_t res = s->epfd >= 0 && sets_add(g, s) == 0 ? ncclSuccess : ncclSystemError;
  struct mpr_handle mine, *all = calloc((size_t)g->nranks, sizeof(*all));
  int lfd = -1;
  char why[256];
  if (!all) res = ncclSystemError;
  if (res == ncclSuccess) res = open_listener(g->dev, &mine, &lfd);
  if (res == ncclSuccess) res = ctrl_allgather(g, &mine, all, sizeof(mine), "createContext");
  for (int c = 0; res == ncclSuccess && c < o->ncontexts; c++) { /* to itself: a socket pair, both ends served */
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) {
      MP_WARN("RMA createContext: rank %d, context %d: socketpair: %s", g->rank, c, strerror(errno));
      res = ncclSystemError;
      break;
    }
    s->conns[c * g->nranks + g->rank] = mpr_conn_new(s, c, g->rank, sv[0]);
    s->mirrors[c] = mpr_conn_new(s, c, g->rank, sv[1]);
    if (!s->conns[c * g->nranks + g->rank] || !s->mirrors[c]) {
      if (!s->conns[c * g->nranks + g->rank]) close(sv[0]);
      if (!s->mirrors[c]) close(sv[1]);
      res = ncclSystemError;
    }
  }
  for (int c = 0; res == ncclSuccess && c < o->ncontexts; c++) /* dial the lower ranks ... */
    for (int p = 0; res == ncclSuccess && p < g->rank; p++) {
      if (!is_connected_peer(g, o->rank_stride, p)) continue;
      struct mpr_hello h = {.magic = MPR_MAGIC, .version = MPR_VERSION, .kind = 1, .rank = g->rank,
                            .nranks = g->nranks, .context = c};
      int fd = dial(&all[p], &h, o->service_level, why, sizeof(why));
      if (fd < 0 || !(s->conns[c * g->nranks + p] = mpr_conn_new(s, c, p, fd))) {
        MP_WARN("RMA createContext: rank %d, context %d, to rank %d: %s", g->rank, c, p, fd < 0 ? why : "no memory");
        if (fd >= 0) close(fd);
        res = fd == -2 ? ncclInvalidArgument : ncclRemoteError;
      }
    }
  struct mplane_rma_gate gate;
  struct hello_want want = {.g = g, .kind = 1, .ncontexts = o->ncontexts, .stride = o->rank_stride, .conns = s->conns};
  mplane_rma_gate_init(&gate, lfd, MPR_MAGIC, sizeof(struct mpr_hello), "RMA createContext");
  for (int c = 0; res == ncclSuccess && c < o->ncontexts; c++) /* ... and take the higher ones */
    for (int p = g->rank + 1; res == ncclSuccess && p < g->nranks; p++) {
      if (!is_connected_peer(g, o->rank_stride, p)) continue;
      struct mpr_hello h;
      int fd = mplane_rma_gate_take(&gate, &h, hello_check, &want, mpr_timeout_ms(), why, sizeof(why));
      int ok = fd >= 0;
      if (ok) {
        mplane_tc_mark_socket_or_log(fd, o->service_level, "rma");
        ok = (s->conns[h.context * g->nranks + h.rank] = mpr_conn_new(s, h.context, h.rank, fd)) != NULL;
        if (!ok) snprintf(why, sizeof(why), "no memory");
      }
      if (!ok) {
        MP_WARN("RMA createContext: rank %d waiting for its peers' connections: %s", g->rank, why);
        if (fd >= 0) close(fd);
        res = ncclRemoteError;
      }
    }
  mplane_rma_gate_close(&gate);
  for (size_t i = 0; res == ncclSuccess && i < nconn + (size_t)o->ncontexts; i++) {
    struct mpr_conn *c = i < nconn ? s->conns[i] : s->mirrors[i - nconn];
    if (c) res = mpr_conn_start(c);
  }
  if (lfd >= 0) close(lfd);
  free(all);
  if (res != ncclSuccess) {
    rma_destroy_context(s);
    return res;
  }
  MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d: %d context(s), rank stride %d, class %s (SL %d), over TCP",
          g->rank, o->ncontexts, o->rank_stride, mplane_tc_class_name(o->tc_class), o->service_level);
  *out = s;
  return ncclSuccess;
}

/* ---- the ops NCCL's proxy calls: queue and return ---- */
static ncclResult_t op_conn(struct mpr_ctxset *s, int context, uint32_t rank, const char *what,
                            struct mpr_conn **out) {
  struct mpr_group *g = s->g;
  if (context < 0 || context >= s->ncontexts || rank >= (uint32_t)g->nranks ||
      !s->conns[context * g->nranks + (int)rank]) {
    MP_WARN("RMA %s: rank %d has no connection to rank %u in context %d (%d contexts, %d ranks)", what, g->rank,
            rank, context, s->ncontexts, g->nranks);
    return ncclInvalidUsage;
  }
  *out = s->conns[context * g->nranks + (int)rank];
  return ncclSuccess;
}

static ncclResult_t local_win(struct mpr_group *g, void *mh, uint64_t off, uint64_t size, const char *what,
                              uint32_t rank, struct mpr_win *w) {
  if (!mh || !mpr_win_get(g, *(uint32_t *)mh, w)) {
    MP_WARN("RMA %s to rank %u: the local window handle %p is not registered on this group", what, rank, mh);
    return ncclInvalidUsage;
  }
  if (!mpr_range_ok(w, off, size)) {
    MP_WARN("RMA %s to rank %u: offset %llu + size %llu lies outside local window %u (%zu bytes)", what, rank,
            (unsigned long long)off, (unsigned long long)size, w->id, w->size);
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

static struct mpr_req *req_new(struct mpr_conn *c, int kind) {
  struct mpr_req *r = calloc(1, sizeof(*r));
  if (!r) return NULL;
  r->magic = MPR_REQ_MAGIC;
  r->kind = kind;
  r->conn = c;
  r->m.magic = MPR_MAGIC;
  r->m.sig_win = MPR_NO_WIN;
  return r;
}

static ncclResult_t queue_or_fail(struct mpr_conn *c, struct mpr_req *r, void **request) {
  if (mpr_conn_send(c, r) != ncclSuccess) {
    MP_WARN("RMA %s to %s (context %d): the connection has failed", mpr_kind_name(r->kind), c->peer_str, c->context);
    free(r);
    return ncclRemoteError;
  }
  *request = r;
  return ncclSuccess;
}

static ncclResult_t rma_iput(void *ctx, int context, uint64_t src_off, void *src_mh, size_t size, uint64_t dst_off,
                             void *dst_mh, uint32_t rank, const struct mplane_rma_signal *sig, void **request) {
  struct mpr_ctxset *s = ctx;
  struct mpr_conn *c;
  const char *what = sig ? "putSignal" : "put";
  *request = NULL;
  MP_CHECK(op_conn(s, context, rank, what, &c));
  if (sig && sig->op != NCCL_NET_SIGNAL_OP_INC && sig->op != NCCL_NET_SIGNAL_OP_ADD) {
    MP_WARN("RMA putSignal to %s (context %d, signal offset %llu): signal op %u is not one NCCL defines (INC 1, "
            "ADD 2)", c->peer_str, context, (unsigned long long)sig->off, sig->op);
    return ncclInvalidArgument;
  }
  struct mpr_win src = {0};
  if (size > 0) {
    MP_CHECK(local_win(s->g, src_mh, src_off, size, what, rank, &src));
    if (!dst_mh) {
      MP_WARN("RMA %s of %zu bytes to %s: no destination window", what, size, c->peer_str);
      return ncclInvalidArgument;
    }
  }
  if (sig && !sig->mhandle) {
    MP_WARN("RMA putSignal to %s: no signal window", c->peer_str);
    return ncclInvalidArgument;
  }
  struct mpr_req *r = req_new(c, MPR_K_PUT);
  if (!r) return ncclSystemError;
  r->src = src;
  r->src_off = src_off;
  r->m.type = MPR_PUT;
  r->m.win = size > 0 ? *(uint32_t *)dst_mh : MPR_NO_WIN;
  r->m.off = dst_off;
  r->m.size = size;
  if (sig) {
    r->m.sig_win = *(uint32_t *)sig->mhandle;
    r->m.sig_off = sig->off;
    r->m.sig_val = sig->value;
    r->m.sig_op = sig->op;
  }
  return queue_or_fail(c, r, request);
}

static ncclResult_t rma_iget(void *ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                             uint64_t local_off, void *local_mh, uint32_t rank, void **request) {
  struct mpr_ctxset *s = ctx;
  struct mpr_conn *c;
  *request = NULL;
  MP_CHECK(op_conn(s, context, rank, "get", &c));
  struct mpr_win dst = {0};
  MP_CHECK(local_win(s->g, local_mh, local_off, size, "get", rank, &dst));
  if (!remote_mh) {
    MP_WARN("RMA get from %s: no remote window", c->peer_str);
    return ncclInvalidArgument;
  }
  struct mpr_req *r = req_new(c, MPR_K_GET);
  if (!r) return ncclSystemError;
  r->dst = dst;
  r->dst_off = local_off;
  r->m.type = MPR_GET;
  r->m.win = *(uint32_t *)remote_mh;
  r->m.off = remote_off;
  r->m.size = size;
  return queue_or_fail(c, r, request);
}

/* A get is done only once its bytes are in place (GPU copies synchronised), so there is nothing
 * left to flush: NCCL's proxy takes the NULL request as a finished flush. */
static ncclResult_t rma_iflush(void *ctx, int context, void *mhandle, uint32_t rank, void **request) {
  struct mpr_ctxset *s = ctx;
  struct mpr_conn *c;
  (void)mhandle;
  *request = NULL;
  MP_TRACE(NCCL_NET, "RMA flush (context %d, rank %u): nothing in flight to wait for", context, rank);
  return op_conn(s, context, rank, "flush", &c);
}

static ncclResult_t rma_test(void *group, void *request, int *done) {
  (void)group;
  struct mpr_req *r = request;
  *done = 0;
  if (!r || r->magic != MPR_REQ_MAGIC) {
    MP_WARN("RMA test: %p is not a request of this plugin", request);
    return ncclInvalidArgument;
  }
  if (!__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) {
    /* NCCL's loop tests every open request on every pass: the clock (for the kick and the timeout,
     * both counted in milliseconds) is read on one call in 64, not on each. */
    static __thread unsigned tick;
    if (++tick % 64) return ncclSuccess;
    mpr_conn_kick(r->conn);
    uint64_t waited_ms = (mplane_now_ns() - r->t0_ns) / 1000000;
    if (waited_ms <= (uint64_t)mpr_timeout_ms()) return ncclSuccess;
    char why[200];
    snprintf(why, sizeof(why), "no answer to %s #%llu (window %u, offset %llu, %llu bytes) within %llu ms "
             "(MPLANE_CONNECT_TIMEOUT): the peer is stalled or gone", mpr_kind_name(r->kind), (unsigned long long)r->m.id,
             r->m.win, (unsigned long long)r->m.off, (unsigned long long)r->m.size, (unsigned long long)waited_ms);
    mpr_conn_abort(r->conn, why); /* finishes r, and everything else on the connection, with the error */
    if (!__atomic_load_n(&r->done, __ATOMIC_ACQUIRE)) return ncclSuccess;
  }
  ncclResult_t res = r->result;
  if (res != ncclSuccess) MP_WARN("%s", r->why);
  MP_TRACE(NCCL_NET, "RMA test: %s #%llu to %s done, result %d", mpr_kind_name(r->kind), (unsigned long long)r->m.id,
           r->conn->peer_str, res);
  r->magic = 0;
  free(r);
  *done = 1;
  return res;
}

static void rma_hold(void *ctx, int context, uint32_t rank, int on) {
  struct mpr_ctxset *s = ctx;
  if (s && context >= 0 && context < s->ncontexts && rank < (uint32_t)s->g->nranks &&
      s->conns[context * s->g->nranks + (int)rank])
    mpr_conn_hold(s->conns[context * s->g->nranks + (int)rank], on);
}

static ncclResult_t rma_query_last_error(void *ctx, int *has_error) {
  struct mpr_ctxset *s = ctx;
  *has_error = s ? __atomic_load_n(&s->has_error, __ATOMIC_ACQUIRE) : 0;
  return ncclSuccess;
}

const struct mplane_rma_ops mps_rma_ops = {
    .listen = rma_listen,
    .close_listen = rma_close_listen,
    .connect = rma_connect,
    .close_group = rma_close_group,
    .create_context = rma_create_context,
    .destroy_context = rma_destroy_context,
    .reg_mr_sym = rma_reg_mr_sym,
    .dereg_mr_sym = rma_dereg_mr_sym,
    .iput = rma_iput,
    .iget = rma_iget,
    .iflush = rma_iflush,
    .test = rma_test,
    .progress = mpr_progress,
    .query_last_error = rma_query_last_error,
    .hold = rma_hold,
};
