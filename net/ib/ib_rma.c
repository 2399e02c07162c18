/* mplane: one-sided ops (net/transport.h's mplane_rma_ops) over InfiniBand / RoCE verbs, for NCCL
 * 2.30's GIN proxy. The target is passive: its HCA places the bytes.
 *
 *   iput        RDMA WRITE into the peer's window
 *   iputSignal  RDMA WRITE, then an 8-byte ATOMIC FETCH_AND_ADD on the signal word, same RC QP
 *   iget        RDMA READ from the peer's window
 *   iflush      after gets into GPU memory: a 1-byte RDMA READ of a GPU window through the rank's QP
 *               to itself (the NIC reading that GPU's memory pushes its earlier writes there first,
 *               so the GPU sees the gets' bytes once it completes, as NCCL's GPUDirect flush); a
 *               NULL request (done) where every get into GPU memory had completed before the last
 *               flush was posted (a get in flight then is covered by the next one), or
 *               where MPLANE_IB_GDR_FLUSH_DISABLE says the platform needs none
 *   test        polls the context's CQ; every work request is signaled, a request is done when all
 *               of its work requests completed
 *
 * Adaptive routing: none of these ops has a form that survives packets of one QP arriving out of
 * order (a signal's atomic follows its put in arrival order), so the one-sided QPs keep static
 * routes whatever MPLANE_IB_ADAPTIVE_ROUTING says; only two-sided data takes the AR form.
 *
 * Why an atomic for the signal, not a write with immediate: an RC responder executes the requests
 * of one QP in order, and an atomic is a read-modify-write the HCA issues after the earlier write's
 * data was placed (PCIe reads do not pass posted writes; data windows take relaxed ordering, as in
 * NCCL's GIN, but signal windows - NCCL_NET_MR_FLAG_FORCE_SO - never do, and a strongly ordered
 * access does not pass the relaxed writes before it). The signal therefore never becomes visible
 * before its data, nor before any earlier put of the same context to the same rank: every signal is
 * a strong signal, with no target-side thread, receive queue or progress call. A write with
 * immediate would need the target's CPU to poll a CQ and apply the add.
 *
 * Group and windows. connect() builds a TCP control mesh (lower rank dials, higher accepts) over
 * the device's side-channel address, used by the collective calls and, afterwards, to notice a
 * dead peer (its socket closes). regMrSym registers the window and allgathers {address, size,
 * rkey, window index} over that mesh, as NCCL's own IB backend exchanges its rkeys, so a put's
 * remote range is checked against the target's real window before anything is posted: a bad
 * range is a request that fails from test, naming the peer and the window, with nothing sent.
 *
 * Contexts. create_context makes, per context, one CQ and one RC QP per connected peer (ranks
 * rank +- k*rankStride); a rank's ops to itself go through a QP connected to a second QP of its
 * own. A completion error (the QP goes to ERR, later ops of that QP are flushed) or a peer whose
 * control socket closed ends every request on that QP with ncclRemoteError, and
 * query_last_error reports it; later ops to that peer in any context fail at once.
 *
 * Planes. The plugin gives the group its ranks' planes (route). A pair of ranks on different planes
 * has one QP per direction and context, as NCCL's PXN sends: a rank's own ops to the peer leave
 * from its node's device on the peer's plane (net/relay.h's choice, the relay device) and land on
 * the peer's own device, through a target QP there that is never posted on. So the target end of
 * every op is the target's own NIC, the one beside its GPU: its GPU windows are reached as on one
 * plane, and the exchange carries only own-device keys. Each context has a CQ per device it uses;
 * host windows are also registered on each relay device (as sources, and as get destinations). A
 * rank's own GPU windows are not: its ops from or into them go through a staging ring beside the
 * relay device (below: "staging"). A same-plane pair keeps one QP shared by both directions. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "../../common/log.h"
#include "../../common/nccl/rma.h"
#include "../relay.h"
#include "../rma_ctrl.h"
#include "../tc.h"
#include "ib.h"
#include "ib_rma.h"

/* The group's all-gather and its peers of a context (net/rma_ctrl.h). */
static ncclResult_t ctrl_allgather(struct ibr_group *g, const void *mine, void *all, size_t len, const char *what) {
  return mplane_rma_allgather(g->ctrl, g->rank, g->nranks, mine, all, len, ibr_timeout_ms(), what);
}

static int is_connected_peer(const struct ibr_group *g, int stride, int p) {
  return mplane_rma_peer_connected(g->rank, g->nranks, stride, p);
}

static void set_timeouts(int fd) {
  mplane_rma_set_timeouts(fd, ibr_timeout_ms());
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

/* ---- listen / connect: the control mesh ---- */
static ncclResult_t rma_listen(int dev, void *handle, void **listen_comm) {
  struct mpib_dev *d = mpib_dev_get(dev);
  if (!d) {
    MP_WARN("RMA listen: IB device %d does not exist (%d devices)", dev, mpib_dev_count());
    return ncclInvalidArgument;
  }
  struct ibr_handle h = {.magic = IBR_MAGIC, .version = IBR_VERSION};
  struct sockaddr_storage sa = d->oob;
  socklen_t len = d->ooblen;
  int fd = mplane_rma_listen_any_port(&sa, &len);
  if (fd < 0) {
    MP_WARN("RMA listen on %s's side-channel address: %s (set MPLANE_SOCKET_IFNAME to an interface peers reach)",
            d->props.name, strerror(errno));
    return ncclSystemError;
  }
  struct ibr_listen *l = calloc(1, sizeof(*l));
  if (!l) {
    close(fd);
    return ncclSystemError;
  }
  l->fd = fd;
  l->dev = dev;
  if (len > sizeof(h.addr)) {
    MP_WARN("RMA listen on %s: a side-channel address of %u bytes (IPv4 or IPv6 expected)", d->props.name, len);
    close(fd);
    free(l);
    return ncclSystemError;
  }
  h.addrlen = (uint16_t)len;
  memcpy(&h.addr, &sa, len);
  memset(handle, 0, NCCL_NET_HANDLE_MAXSIZE);
  memcpy(handle, &h, sizeof(h));
  *listen_comm = l;
  return ncclSuccess;
}

static ncclResult_t rma_close_listen(void *listen_comm) {
  struct ibr_listen *l = listen_comm;
  if (!l) return ncclSuccess;
  close(l->fd);
  free(l);
  return ncclSuccess;
}

static void win_free(struct ibr_win *w) {
  if (!w) return;
  for (int k = 0; k < IBR_CAR_MAX; k++)
    if (w->mr[k]) mpib_v.dereg_mr(w->mr[k]);
  free(w->peers);
  free(w);
}

static void group_free(struct ibr_group *g) {
  if (!g) return;
  for (int i = 0; g->ctrl && i < g->nranks; i++)
    if (g->ctrl[i] >= 0) close(g->ctrl[i]);
  for (uint32_t i = 0; i < g->nwins; i++) win_free(g->wins[i]);
  for (int k = 0; k < g->ncar; k++)
    if (g->car[k].scratch_mr) mpib_v.dereg_mr(g->car[k].scratch_mr);
  free(g->scratch);
  free(g->wins);
  free(g->ctrl);
  free(g->plane);
  free(g->car_of);
  free(g->gone);
  free(g->peeked);
  pthread_mutex_destroy(&g->lock);
  free(g);
}

static int dial(const struct ibr_handle *h, const struct ibr_hello *hello) {
  char why[160];
  if (mplane_rma_addr_check(&h->addr.sa, h->addrlen, why, sizeof(why)) != 0) {
    MP_WARN("RMA connect: a peer's IB RMA handle is refused: %s", why);
    errno = EINVAL;
    return -2;
  }
  int fd = socket(h->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  set_timeouts(fd);
  if (connect(fd, &h->addr.sa, h->addrlen) != 0 || mplane_rma_write_all(fd, hello, sizeof(*hello))) {
    close(fd);
    return -1;
  }
  return fd;
}

/* Who may come in on the group's listener: a hello of this version from a higher rank of the group
 * that has not connected yet (anything else is dropped, and the real peers still get in). */
static int hello_check(const void *p, void *arg, char *why, size_t whylen) {
  const struct ibr_hello *h = p;
  const struct ibr_group *g = arg;
  if (h->version != IBR_VERSION) {
    snprintf(why, whylen, "an mplane IB RMA peer of version %u (this is %d)", h->version, IBR_VERSION);
    return -1;
  }
  if (h->nranks != g->nranks || h->rank <= g->rank || h->rank >= g->nranks || g->ctrl[h->rank] >= 0) {
    snprintf(why, whylen, "it says it is rank %d of %d; rank %d of %d takes ranks %d..%d here, each once", h->rank,
             h->nranks, g->rank, g->nranks, g->rank + 1, g->nranks - 1);
    return -1;
  }
  return 0;
}

/* Device dev as a carrier of the group (index in *k): the signals' scratch word registered on it. */
static ncclResult_t carrier_add(struct ibr_group *g, int dev, int plane, int *k) {
  for (int i = 0; i < g->ncar; i++)
    if (g->car[i].dev == dev) {
      if (k) *k = i;
      return ncclSuccess;
    }
  struct mpib_dev *d = mpib_dev_get(dev);
  if (!d || g->ncar == IBR_CAR_MAX) {
    MP_WARN("RMA connect: device %d cannot carry connections of this group (%s)", dev,
            d ? "a group's connections leave from at most 8 devices" : "no such IB device");
    return ncclInternalError;
  }
  struct ibr_carrier *c = &g->car[g->ncar];
  c->scratch_mr = mpib_v.reg_mr(d->hca->pd, g->scratch, 64, IBV_ACCESS_LOCAL_WRITE);
  if (!c->scratch_mr) {
    MP_WARN("RMA connect: %s: registering 64 bytes for the signals' fetched values failed: %s", d->props.name,
            strerror(errno));
    return ncclSystemError;
  }
  c->dev = dev;
  c->d = d;
  c->plane = plane;
  if (k) *k = g->ncar;
  g->ncar++;
  return ncclSuccess;
}

static ncclResult_t group_alloc(struct ibr_group **out, int nranks, int rank, int dev) {
  struct ibr_group *g = calloc(1, sizeof(*g));
  if (!g) return ncclSystemError;
  pthread_mutex_init(&g->lock, NULL);
  g->rank = rank;
  g->nranks = nranks;
  g->dev = dev;
  g->d = mpib_dev_get(dev);
  g->ctrl = malloc(sizeof(int) * (size_t)nranks);
  g->gone = calloc((size_t)nranks, sizeof(int));
  g->peeked = calloc((size_t)nranks, sizeof(double));
  g->plane = malloc(sizeof(int) * (size_t)nranks);
  g->car_of = calloc((size_t)nranks, sizeof(int)); /* until route says otherwise: all on the own device */
  g->scratch = aligned_alloc(64, 64);
  if (!g->ctrl || !g->gone || !g->peeked || !g->plane || !g->car_of || !g->scratch) {
    group_free(g);
    return ncclSystemError;
  }
  for (int i = 0; i < nranks; i++) g->ctrl[i] = g->plane[i] = -1;
  ncclResult_t res = carrier_add(g, dev, -1, NULL);
  if (res != ncclSuccess) {
    group_free(g);
    return res;
  }
  *out = g;
  return ncclSuccess;
}

static ncclResult_t rma_connect(void *handles[], int nranks, int rank, void *listen_comm, void **out) {
  struct ibr_listen *l = listen_comm;
  *out = NULL;
  if (!l || nranks < 1 || rank < 0 || rank >= nranks) {
    MP_WARN("RMA connect: rank %d of %d is not a valid position in the group", rank, nranks);
    return ncclInvalidArgument;
  }
  struct ibr_group *g;
  MP_CHECK(group_alloc(&g, nranks, rank, l->dev));
  struct ibr_hello hello = {.magic = IBR_MAGIC, .version = IBR_VERSION, .rank = rank, .nranks = nranks};
  for (int j = 0; j < rank; j++) { /* lower ranks accept: their listeners exist before handles travel */
    const struct ibr_handle *h = handles[j];
    if (h->magic != IBR_MAGIC || h->version != IBR_VERSION) {
      MP_WARN("RMA connect: the handle of rank %d is not an mplane IB RMA handle of version %d", j, IBR_VERSION);
      group_free(g);
      return ncclInvalidArgument;
    }
    int fd = dial(h, &hello);
    if (fd < 0) {
      if (fd == -1) MP_WARN("RMA connect: rank %d could not reach rank %d's control address: %s", rank, j, strerror(errno));
      group_free(g);
      return fd == -2 ? ncclInvalidArgument : ncclRemoteError;
    }
    g->ctrl[j] = fd;
  }
  struct mplane_rma_gate gate;
  char why[256];
  mplane_rma_gate_init(&gate, l->fd, IBR_MAGIC, sizeof(struct ibr_hello), "RMA connect");
  for (int n = rank + 1; n < nranks; n++) {
    struct ibr_hello ph;
    int fd = mplane_rma_gate_take(&gate, &ph, hello_check, g, ibr_timeout_ms(), why, sizeof(why));
    if (fd < 0) {
      MP_WARN("RMA connect: rank %d of %d waiting for rank %d and up: %s", rank, nranks, rank + 1, why);
      mplane_rma_gate_close(&gate);
      group_free(g);
      return ncclRemoteError;
    }
    set_timeouts(fd);
    g->ctrl[ph.rank] = fd;
  }
  mplane_rma_gate_close(&gate);
  MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d of %d connected its group on %s", rank, nranks, g->d->props.name);
  *out = g;
  return ncclSuccess;
}

static ncclResult_t rma_close_group(void *group) {
  group_free(group);
  return ncclSuccess;
}

/* ---- planes: which device carries the connections with each rank ---- */

/* Ranks p and this one listen on different (known) planes. */
static int crosses(const struct ibr_group *g, int p) {
  int a = g->plane[g->rank], b = g->plane[p];
  return p != g->rank && a >= 0 && b >= 0 && a != b;
}

/* Every rank's own ops to a peer on another plane leave from its node's device on that plane (the
 * relay device, once per plane), as PXN does; they land on the peer's own device. */
static ncclResult_t rma_route(void *group, const struct mplane_rma_route *r) {
  struct ibr_group *g = group;
  if (!g || !r || r->dev != g->dev || !r->devs || r->dev < 0 || r->dev >= r->ndev) {
    MP_WARN("RMA connect: the planes of the group name device %d, the group is on device %d", r ? r->dev : -1,
            g ? g->dev : -1);
    return ncclInternalError;
  }
  for (int p = 0; p < g->nranks; p++) g->plane[p] = r->rank_plane[p];
  g->car[0].plane = r->devs[g->dev].plane;
  int by_plane[MPLANE_STATS_MAX_PLANES]; /* carrier of a plane's peers; -2 not picked yet, -1 none */
  for (int i = 0; i < MPLANE_STATS_MAX_PLANES; i++) by_plane[i] = -2;
  for (int p = 0; p < g->nranks; p++) {
    g->car_of[p] = 0;
    if (!crosses(g, p)) continue; /* this rank's ops to p leave from its device on p's plane */
    int pl = g->plane[p];
    if (pl >= MPLANE_STATS_MAX_PLANES) {
      g->car_of[p] = -1;
      continue;
    }
    if (by_plane[pl] == -2) { /* once per plane: the pick WARNs where it cannot relay */
      struct mplane_relay_choice via;
      int k = -1;
      if (mplane_relay_pick(r->devs, r->ndev, g->dev, pl, r->relay_mode, &via) == ncclSuccess)
        MP_CHECK(carrier_add(g, via.dev, pl, &k));
      if (k > 0) snprintf(g->car[k].near_gpu, sizeof(g->car[k].near_gpu), "%s", r->devs[via.dev].near_gpu);
      by_plane[pl] = k;
    }
    g->car_of[p] = by_plane[pl];
  }
  return ncclSuccess;
}

static int rma_carrier(void *ctx, uint32_t rank) {
  struct ibr_ctxset *s = ctx;
  if (!s || rank >= (uint32_t)s->g->nranks || s->g->car_of[rank] < 0) return s ? s->g->dev : -1;
  return s->g->car[s->g->car_of[rank]].dev;
}


/* ---- windows ---- */
static ncclResult_t win_register_dmabuf(struct mpib_dev *d, void *data, size_t size, int type, uint64_t offset,
                                        int fd, int relaxed, struct ibv_mr **mr) {
  if (type != NCCL_PTR_HOST && type != NCCL_PTR_CUDA) {
    MP_WARN("RMA regMrSymDmaBuf: memory type %d; expected NCCL_PTR_HOST (1) or NCCL_PTR_CUDA (2)", type);
    return ncclInvalidArgument;
  }
  if (!mpib_v.reg_dmabuf_mr) {
    MP_WARN("RMA regMrSymDmaBuf: this libibverbs has no ibv_reg_dmabuf_mr (rdma-core >= 34 needed)");
    return ncclInvalidUsage;
  }
  uint64_t iova = (uint64_t)(uintptr_t)data;
  *mr = relaxed ? mpib_reg_data_dmabuf(d->hca->pd, offset, size ? size : 1, iova, fd, IBR_ACCESS)
                : mpib_v.reg_dmabuf_mr(d->hca->pd, offset, size ? size : 1, iova, fd, IBR_ACCESS);
  if (!*mr) {
    MP_WARN("RMA regMrSymDmaBuf: %s: registering %zu bytes of dma-buf %d (offset %llu) at %p failed: %s",
            d->props.name, size, fd, (unsigned long long)offset, data, strerror(errno));
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* fd >= 0: through the dma-buf (GPU memory without nvidia-peermem), addressed by data as its iova
 * so that peers name it as they name any window. relaxed: a data window, with PCIe relaxed ordering
 * where MPLANE_IB_PCI_RELAXED_ORDERING and the verbs allow it (mpib_reg_data). */
static ncclResult_t win_register_on(struct mpib_dev *d, void *data, size_t size, int type, uint64_t offset, int fd,
                                    int relaxed, struct ibv_mr **mr) {
  if (fd >= 0) return win_register_dmabuf(d, data, size, type, offset, fd, relaxed, mr);
  if (type == NCCL_PTR_CUDA && !(d->props.ptr_support & NCCL_PTR_CUDA)) {
    MP_WARN("RMA regMrSym: %p (%zu bytes) is GPU memory, but %s has no nvidia-peermem to register it with",
            data, size, d->props.name);
    return ncclInvalidUsage;
  }
  if (type != NCCL_PTR_HOST && type != NCCL_PTR_CUDA) {
    MP_WARN("RMA regMrSym: memory type %d; expected NCCL_PTR_HOST (1) or NCCL_PTR_CUDA (2)", type);
    return ncclInvalidArgument;
  }
  /* Whole pages, as the kernel pins them anyway. */
  uintptr_t start = (uintptr_t)data & ~(uintptr_t)4095;
  size_t len = (((uintptr_t)data + size + 4095) & ~(uintptr_t)4095) - start;
  if (!len) len = 4096;
  *mr = relaxed ? mpib_reg_data(d->hca->pd, (void *)start, len, IBR_ACCESS)
                : mpib_v.reg_mr(d->hca->pd, (void *)start, len, IBR_ACCESS);
  if (!*mr) {
    MP_WARN("RMA regMrSym: %s: registering %zu bytes of %s memory at %p failed: %s", d->props.name, size,
            type == NCCL_PTR_CUDA ? "GPU" : "host", data, strerror(errno));
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* On the group's own device, where every peer's op lands, and host memory also on each relay device
 * (this rank's own ops to cross-plane peers read from it or read into it there). GPU memory is not
 * registered on relay devices: the relay NIC is not the one beside its GPU, so this rank's ops from
 * or into it are staged (staged_window).
 * As NCCL's GIN does, a window with NCCL_NET_MR_FLAG_FORCE_SO (a signal window) is registered
 * strongly ordered and every other one with relaxed ordering: a signal's atomic then never passes the
 * put before it on the PCIe bus (a strongly ordered write does not pass earlier writes), while the
 * data itself may be placed in any order. */
static ncclResult_t win_register(struct ibr_group *g, void *data, size_t size, int type, uint64_t offset, int fd,
                                 uint64_t flags, struct ibr_win *w) {
  int relaxed = !(flags & NCCL_NET_MR_FLAG_FORCE_SO);
  MP_CHECK(win_register_on(g->d, data, size, type, offset, fd, relaxed, &w->mr[0]));
  w->base = data;
  w->size = size;
  w->type = type;
  for (int k = 1; k < g->ncar && type != NCCL_PTR_CUDA; k++)
    MP_CHECK(win_register_on(g->car[k].d, data, size, type, offset, fd, relaxed, &w->mr[k]));
  return ncclSuccess;
}

static ncclResult_t reg_window(struct ibr_group *g, void *data, size_t size, int type, uint64_t offset, int fd,
                               uint64_t flags, void **mhandle);

static ncclResult_t rma_reg_mr_sym(void *group, void *data, size_t size, int type, uint64_t flags, void **mhandle) {
  return reg_window(group, data, size, type, 0, -1, flags, mhandle);
}

static ncclResult_t rma_reg_mr_sym_dmabuf(void *group, void *data, size_t size, int type, uint64_t offset, int fd,
                                          uint64_t flags, void **mhandle) {
  if (fd < 0) {
    MP_WARN("RMA regMrSymDmaBuf: no dma-buf (fd %d) for the window at %p", fd, data);
    return reg_window(group, data, size, -1, 0, -1, flags, mhandle); /* collective: the others fail with it */
  }
  return reg_window(group, data, size, type, offset, fd, flags, mhandle);
}

static ncclResult_t reg_window(struct ibr_group *g, void *data, size_t size, int type, uint64_t offset, int fd,
                               uint64_t flags, void **mhandle) {
  *mhandle = NULL;
  struct ibr_win *w = calloc(1, sizeof(*w));
  if (!w || !(w->peers = calloc((size_t)g->nranks, sizeof(*w->peers)))) {
    free(w);
    return ncclSystemError;
  }
  ncclResult_t res = win_register(g, data, size, type, offset, fd, flags, w);
  pthread_mutex_lock(&g->lock);
  w->id = g->nwins;
  pthread_mutex_unlock(&g->lock);
  /* Collective, also when the registration failed here: the peers must not wait for this rank. */
  struct ibr_win_rec mine = {.addr = (uint64_t)(uintptr_t)data, .size = res == ncclSuccess ? size : 0,
                             .rkey = w->mr[0] ? w->mr[0]->rkey : 0, .id = res == ncclSuccess ? w->id : UINT32_MAX,
                             .gpu = type == NCCL_PTR_CUDA};
  ncclResult_t xres = ctrl_allgather(g, &mine, w->peers, sizeof(mine), "regMrSym");
  if (res == ncclSuccess) res = xres;
  for (int p = 0; res == ncclSuccess && p < g->nranks; p++)
    if (w->peers[p].id != w->id) {
      MP_WARN("RMA regMrSym: rank %d registers its window %u while rank %d registers %s: windows must be registered "
              "in the same order on every rank", g->rank, w->id, p,
              w->peers[p].id == UINT32_MAX ? "none (its registration failed)" : "another one");
      res = ncclInvalidUsage;
    }
  pthread_mutex_lock(&g->lock);
  if (res == ncclSuccess && g->nwins == g->cap) {
    uint32_t cap = g->cap ? g->cap * 2 : 16;
    struct ibr_win **nw = realloc(g->wins, sizeof(*nw) * cap);
    if (nw) {
      g->wins = nw;
      g->cap = cap;
    } else {
      res = ncclSystemError;
    }
  }
  if (res == ncclSuccess) g->wins[g->nwins++] = w;
  pthread_mutex_unlock(&g->lock);
  if (res != ncclSuccess) {
    win_free(w);
    return res;
  }
  MP_TRACE(NCCL_NET, "RMA: window %u = %p, %zu bytes, rkey 0x%x (on %d of %d devices)", w->id, data, size,
           w->mr[0]->rkey, type == NCCL_PTR_CUDA ? 1 : g->ncar, g->ncar);
  *mhandle = w;
  return ncclSuccess;
}

static ncclResult_t rma_dereg_mr_sym(void *group, void *mhandle) {
  struct ibr_group *g = group;
  struct ibr_win *w = mhandle;
  if (!w) return ncclSuccess;
  pthread_mutex_lock(&g->lock);
  int found = w->id < g->nwins && g->wins[w->id] == w;
  if (found) g->wins[w->id] = NULL; /* its index stays taken: the n-th window is the same everywhere */
  pthread_mutex_unlock(&g->lock);
  if (!found) {
    MP_WARN("RMA deregMrSym: %p is not a window of this group", mhandle);
    return ncclInvalidArgument;
  }
  win_free(w);
  return ncclSuccess;
}

/* off + size within [0, limit), without overflow. */
static int range_ok(uint64_t off, uint64_t size, uint64_t limit) { return off <= limit && size <= limit - off; }

/* ---- contexts ---- */
static void conn_free(struct ibr_conn *c) {
  if (!c) return;
  if (c->qp) mpib_v.destroy_qp(c->qp);
  if (c->mirror) mpib_v.destroy_qp(c->mirror);
  if (c->target) mpib_v.destroy_qp(c->target);
  free(c);
}

static ncclResult_t rma_destroy_context(void *ctx) {
  struct ibr_ctxset *s = ctx;
  if (!s) return ncclSuccess;
  for (int i = 0; s->conns && i < s->ncontexts * s->g->nranks; i++) conn_free(s->conns[i]);
  /* The QPs are gone (no work request reads or fills a slot now); copies may still run. */
  for (int c = 0; s->cx && c < s->ncontexts * s->ncar; c++) ibr_stage_destroy(&s->cx[c]);
  for (int c = 0; s->cx && c < s->ncontexts * s->ncar; c++) {
    if (s->cx[c].b.cq) mpib_v.destroy_cq(s->cx[c].b.cq);
    if (s->cx[c].set) pthread_mutex_destroy(&s->cx[c].lock);
  }
  free(s->conns);
  free(s->faulted);
  free(s->cx);
  free(s);
  return ncclSuccess;
}


/* Context c's CQ and QPs on carrier k: the initiating QPs of the connected peers that carrier takes
 * and, on the own device (k 0, opened first), the target QPs of cross-plane peers; none: nothing. */
static ncclResult_t cx_open(struct ibr_ctxset *s, int c, int k, const struct mplane_rma_ctx_opts *o) {
  struct ibr_group *g = s->g;
  struct ibr_cx *x = &s->cx[c * s->ncar + k];
  struct mpib_dev *d = g->car[k].d;
  int nconn = 0;
  for (int p = 0; p < g->nranks; p++)
    nconn += is_connected_peer(g, s->stride, p) && (g->car_of[p] == k || (k == 0 && crosses(g, p)));
  if (nconn == 0) return ncclSuccess;
  /* The signal is an RDMA atomic (above), and there is no other: an HCA without atomics would fail
   * every putSignal on the wire, so the context is refused now. IBV_ATOMIC_HCA suffices: only this
   * HCA's own atomics ever touch a signal word. */
  if (d->hca->attr.atomic_cap == IBV_ATOMIC_NONE) {
    MP_WARN("RMA createContext: %s has no RDMA atomics (atomic_cap IBV_ATOMIC_NONE), which the one-sided signals "
            "need; use NCCL's own GIN transport on it, or exclude it with MPLANE_IB_HCA", d->props.name);
    return ncclSystemError;
  }
  x->set = s;
  x->index = c;
  x->car = k;
  pthread_mutex_init(&x->lock, NULL);
  x->b.dev = d;
  x->b.devindex = g->car[k].dev;
  x->b.fd = -1;
  x->b.sl = o->service_level;
  x->b.tc_class = o->tc_class;
  /* as two-sided comms (ib_conn.c): on RoCE the class's DSCP, or the site's (NCCL_GIN_IB_TC first) */
  if (d->link_layer != IBV_LINK_LAYER_ETHERNET) x->b.tclass = 0;
  else x->b.tclass = mplane_tc_roce_tclass_of(o->service_level, 1, o->comm_tclass);
  snprintf(x->b.peer, sizeof(x->b.peer), "its RMA group");
  char why[256];
  if (mpib_dev_resolve_gid(d, &x->b.gid_index, &x->b.gid, why, sizeof(why)) != 0) {
    MP_WARN("RMA createContext: %s: no GID: %s", d->props.name, why);
    return ncclSystemError;
  }
  long depth = (long)nconn * IBR_SQ;
  x->cq_depth = (int)(depth < IBR_CQ_MAX ? depth : IBR_CQ_MAX);
  x->b.cq = mpib_v.create_cq(d->hca->ctx, x->cq_depth, NULL, NULL, 0);
  if (!x->b.cq) {
    MP_WARN("RMA createContext: %s: ibv_create_cq(%d) failed: %s", d->props.name, x->cq_depth, strerror(errno));
    return ncclSystemError;
  }
  for (int p = 0; p < g->nranks; p++) {
    if (!is_connected_peer(g, s->stride, p) || g->car_of[p] != k) continue;
    struct ibr_conn *cn = calloc(1, sizeof(*cn));
    if (!cn) return ncclSystemError;
    s->conns[c * g->nranks + p] = cn;
    cn->cx = x;
    cn->peer = p;
    cn->car = k;
    MP_CHECK(mpib_create_qp(&x->b, IBR_ACCESS, IBR_SQ, 0, 0, &cn->qp));
    if (p == g->rank) MP_CHECK(mpib_create_qp(&x->b, IBR_ACCESS, 1, 0, 0, &cn->mirror));
    if (crosses(g, p)) MP_CHECK(mpib_create_qp(&s->cx[c * s->ncar].b, IBR_ACCESS, 1, 0, 0, &cn->target));
  }
  return ncclSuccess;
}

/* Every connected peer has a device of this node to carry its connections (route found one). */
static ncclResult_t check_reachable(const struct ibr_group *g, int stride) {
  ncclResult_t res = ncclSuccess;
  for (int p = 0; p < g->nranks; p++)
    if (is_connected_peer(g, stride, p) && g->car_of[p] < 0) {
      MP_WARN("RMA createContext: rank %d (%s, plane %d) cannot reach rank %d, which listens on plane %d: no device "
              "of this node on plane %d carries the connection (MPLANE_RELAY=off, or no NIC on that plane: the WARN "
              "above says which)", g->rank, g->d->props.name, g->plane[g->rank], p, g->plane[p], g->plane[p]);
      res = ncclInvalidUsage;
    }
  return res;
}

static const struct ibr_peer_addr *rec_addr(const char *all, size_t reclen, int rank, int peer) {
  return (const struct ibr_peer_addr *)(all + (size_t)rank * reclen + sizeof(struct ibr_addr_rec)) + peer;
}

static const uint32_t *rec_qpn(const char *all, size_t reclen, int rank, int nranks) {
  return (const uint32_t *)(const void *)rec_addr(all, reclen, rank, nranks);
}

/* The record's target QPs: after the initiating ones. */
static const uint32_t *rec_tqpn(const char *all, size_t reclen, int rank, int nranks, int ncontexts) {
  return rec_qpn(all, reclen, rank, nranks) + (size_t)ncontexts * (size_t)nranks;
}

/* A cross-plane pair: this rank's initiating QP (on its relay device) to the peer's target QP on
 * the peer's own device, and this rank's target QP (own device) to the peer's initiating QP on the
 * peer's relay device. */
static ncclResult_t connect_cross(struct ibr_ctxset *s, struct ibr_conn *cn, int c, const struct ibr_addr_rec *r,
                                  const struct ibr_peer_addr *a, uint32_t qpn, uint32_t tqpn) {
  struct ibr_group *g = s->g;
  struct ibr_cx *x0 = &s->cx[c * s->ncar];
  if (tqpn == 0 || r->own.link_layer != cn->cx->b.dev->link_layer || r->own.mtu < IBV_MTU_256 ||
      r->own.mtu > IBV_MTU_4096) {
    MP_WARN("RMA createContext: rank %d (plane %d) has no valid target QP for rank %d (plane %d), context %d: is it "
            "the same mplane build, on the same fabric?", cn->peer, g->plane[cn->peer], g->rank, g->plane[g->rank], c);
    return ncclInvalidUsage;
  }
  snprintf(x0->b.peer, sizeof(x0->b.peer), "rank %d", cn->peer);
  MP_CHECK(mpib_qp_connect(&cn->cx->b, cn->qp, tqpn, r->own.lid, r->own.gid, (int)r->own.mtu));
  MP_CHECK(mpib_qp_connect(&x0->b, cn->target, qpn, a->lid, a->gid, (int)a->mtu));
  return ncclSuccess;
}

/* Connect every QP to its peer's QP for this rank, from the allgathered records. */
static ncclResult_t connect_all(struct ibr_ctxset *s, const char *all, size_t reclen) {
  struct ibr_group *g = s->g;
  for (int c = 0; c < s->ncontexts; c++)
    for (int p = 0; p < g->nranks; p++) {
      struct ibr_conn *cn = s->conns[c * g->nranks + p];
      if (!cn) continue;
      struct ibr_cx *x = cn->cx;
      const struct ibr_addr_rec *r = (const void *)(all + (size_t)p * reclen);
      if (r->magic == 0) {
        MP_WARN("RMA createContext: rank %d (plane %d) could not make its connections, so rank %d (plane %d) "
                "cannot connect to it: rank %d's WARN says why", p, r->plane, g->rank, g->plane[g->rank], p);
        return ncclRemoteError;
      }
      const struct ibr_peer_addr *a = rec_addr(all, reclen, p, g->rank);
      const uint32_t *qpn = rec_qpn(all, reclen, p, g->nranks);
      const uint32_t *tqpn = rec_tqpn(all, reclen, p, g->nranks, s->ncontexts);
      if (r->magic != IBR_MAGIC || a->link_layer != x->b.dev->link_layer || a->mtu < IBV_MTU_256 ||
          a->mtu > IBV_MTU_4096 || qpn[c * g->nranks + g->rank] == 0) {
        MP_WARN("RMA createContext: rank %d's QP record for rank %d, context %d is not valid (link layer %d, MTU %u): "
                "is it the same mplane build, on the same fabric?", p, g->rank, c, a->link_layer, a->mtu);
        return ncclInvalidUsage;
      }
      snprintf(x->b.peer, sizeof(x->b.peer), "rank %d", p);
      if (cn->target) {
        MP_CHECK(connect_cross(s, cn, c, r, a, qpn[c * g->nranks + g->rank], tqpn[c * g->nranks + g->rank]));
      } else if (p == g->rank) { /* to itself: the QP and its mirror, each the other's peer */
        MP_CHECK(mpib_qp_connect(&x->b, cn->qp, cn->mirror->qp_num, a->lid, a->gid, (int)a->mtu));
        MP_CHECK(mpib_qp_connect(&x->b, cn->mirror, cn->qp->qp_num, a->lid, a->gid, (int)a->mtu));
      } else {
        MP_CHECK(mpib_qp_connect(&x->b, cn->qp, qpn[c * g->nranks + g->rank], a->lid, a->gid, (int)a->mtu));
      }
    }
  return ncclSuccess;
}

/* This rank's record: its own device's address, per peer the address of its initiating end (the
 * carrier's port), per (context, peer) that end's QP and, across planes, its target QP. */
static void fill_record(const struct ibr_ctxset *s, char *mine) {
  const struct ibr_group *g = s->g;
  struct ibr_addr_rec *r = (void *)mine;
  r->magic = IBR_MAGIC;
  r->plane = g->plane[g->rank];
  if (s->cx[0].b.cq) { /* the own device's port (contexts share it) */
    const struct mpib_dev *d = g->car[0].d;
    r->own = (struct ibr_peer_addr){.link_layer = d->link_layer, .lid = d->lid, .mtu = d->mtu};
    memcpy(r->own.gid, s->cx[0].b.gid.raw, 16);
  }
  struct ibr_peer_addr *a = (struct ibr_peer_addr *)(r + 1);
  for (int p = 0; p < g->nranks; p++) {
    int k = g->car_of[p];
    if (k < 0 || !s->cx[k].b.cq) continue; /* not connected in any context: cx_open made nothing */
    const struct mpib_dev *d = g->car[k].d;
    a[p] = (struct ibr_peer_addr){.link_layer = d->link_layer, .lid = d->lid, .mtu = d->mtu};
    memcpy(a[p].gid, s->cx[k].b.gid.raw, 16);
  }
  uint32_t *qpn = (uint32_t *)(a + g->nranks);
  uint32_t *tqpn = qpn + s->ncontexts * g->nranks;
  for (int i = 0; i < s->ncontexts * g->nranks; i++) {
    qpn[i] = s->conns[i] ? s->conns[i]->qp->qp_num : 0;
    tqpn[i] = s->conns[i] && s->conns[i]->target ? s->conns[i]->target->qp_num : 0;
  }
}

/* Where a site asked for adaptive routing, the RMA INFO line says it is not taken here. */
static const char *ar_note(void) {
  const char *from = mplane_config_source("MPLANE_IB_ADAPTIVE_ROUTING");
  if (!from || mpib_config()->ib_adaptive_routing != 1) return "";
  return !strcmp(from, "MPLANE_IB_ADAPTIVE_ROUTING") ? "; MPLANE_IB_ADAPTIVE_ROUTING=1 applies to two-sided data only"
                                                      : "; NCCL_IB_ADAPTIVE_ROUTING=1 applies to two-sided data only";
}

static ncclResult_t rma_create_context(void *group, const struct mplane_rma_ctx_opts *o, void **out) {
  struct ibr_group *g = group;
  *out = NULL;
  if (o->ncontexts < 1 || o->rank_stride < 1 || g->nranks % o->rank_stride != 0) {
    MP_WARN("RMA createContext: %d contexts with rank stride %d in a group of %d ranks; expected at least one "
            "context and a stride that divides the group", o->ncontexts, o->rank_stride, g->nranks);
    return ncclInvalidArgument;
  }
  struct ibr_ctxset *s = calloc(1, sizeof(*s));
  size_t nconn = (size_t)o->ncontexts * (size_t)g->nranks;
  if (!s || !(s->conns = calloc(nconn, sizeof(*s->conns))) ||
      !(s->faulted = calloc((size_t)g->nranks, sizeof(*s->faulted)))) {
    if (s) free(s->conns);
    free(s);
    return ncclSystemError;
  }
  s->g = g;
  s->ncontexts = o->ncontexts;
  s->stride = o->rank_stride;
  s->ncar = g->ncar;
  if (!(s->cx = calloc((size_t)o->ncontexts * (size_t)g->ncar, sizeof(*s->cx)))) {
    free(s->conns);
    free(s->faulted);
    free(s);
    return ncclSystemError;
  }
  ncclResult_t res = check_reachable(g, o->rank_stride);
  for (int c = 0; res == ncclSuccess && c < o->ncontexts; c++)
    for (int k = 0; res == ncclSuccess && k < g->ncar; k++) res = cx_open(s, c, k, o);
  /* One record per rank: its end's address per peer and, per (context, peer), the QP that peer
   * connects to. A failed rank still sends one (magic 0), so no peer waits for it. */
  size_t reclen = sizeof(struct ibr_addr_rec) + (size_t)g->nranks * sizeof(struct ibr_peer_addr) +
                  2 * nconn * sizeof(uint32_t);
  char *mine = calloc(1, reclen), *all = calloc((size_t)g->nranks, reclen);
  if (!mine || !all) res = ncclSystemError;
  if (mine) ((struct ibr_addr_rec *)(void *)mine)->plane = g->plane[g->rank];
  if (mine && res == ncclSuccess) fill_record(s, mine);
  if (mine && all) {
    ncclResult_t x = ctrl_allgather(g, mine, all, reclen, "createContext");
    if (res == ncclSuccess) res = x;
  }
  if (res == ncclSuccess) res = connect_all(s, all, reclen);
  /* A barrier: no rank posts before every peer's QPs are ready to take its requests. */
  if (mine && all) {
    int ok = res == ncclSuccess, oks[1024], *okv = g->nranks <= 1024 ? oks : malloc(sizeof(int) * (size_t)g->nranks);
    ncclResult_t x = okv ? ctrl_allgather(g, &ok, okv, sizeof(ok), "createContext") : ncclSystemError;
    for (int p = 0; x == ncclSuccess && p < g->nranks; p++)
      if (!okv[p] && res == ncclSuccess) {
        MP_WARN("RMA createContext: rank %d could not connect its QPs", p);
        res = ncclRemoteError;
      }
    if (res == ncclSuccess) res = x;
    if (okv != oks) free(okv);
  }
  free(mine);
  free(all);
  if (res != ncclSuccess) {
    rma_destroy_context(s);
    return res;
  }
  char relays[160] = "";
  for (int k = 1, n = 0; k < g->ncar; k++)
    n += snprintf(relays + n, n < (int)sizeof(relays) ? sizeof(relays) - (size_t)n : 0, "%s%s (plane %d)",
                  k == 1 ? ", relaying through " : ", ", g->car[k].d->props.name, g->car[k].plane);
  MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d: %d context(s), rank stride %d, class %s (SL %d), over %s%s (RDMA write, "
          "atomic signal, RDMA read; static routes: a signal follows its put in arrival order%s)", g->rank,
          o->ncontexts, o->rank_stride, mplane_tc_class_name(o->tc_class), o->service_level, g->d->props.name, relays,
          ar_note());
  *out = s;
  return ncclSuccess;
}

/* ---- requests ---- */
static struct ibr_req *req_new(struct ibr_conn *c, const char *what, uint32_t win, uint64_t off, uint64_t size) {
  struct ibr_req *r = calloc(1, sizeof(*r));
  if (!r) return NULL;
  r->magic = IBR_REQ_MAGIC;
  r->conn = c;
  snprintf(r->what, sizeof(r->what), "%s", what);
  r->win = win;
  r->off = off;
  r->size = size;
  return r;
}

static ncclResult_t op_conn(struct ibr_ctxset *s, int context, uint32_t rank, const char *what,
                            struct ibr_conn **out) {
  struct ibr_group *g = s->g;
  if (context < 0 || context >= s->ncontexts || rank >= (uint32_t)g->nranks ||
      !s->conns[context * g->nranks + (int)rank]) {
    MP_WARN("RMA %s: rank %d has no QP to rank %u in context %d (%d contexts, %d ranks, rank stride %d)", what,
            g->rank, rank, context, s->ncontexts, g->nranks, s->stride);
    return ncclInvalidUsage;
  }
  struct ibr_conn *c = s->conns[context * g->nranks + (int)rank];
  /* this connection's own failure, else one the wire gave this peer in another context */
  struct ibr_conn *f =
      __atomic_load_n(&c->failed, __ATOMIC_ACQUIRE) ? c : __atomic_load_n(&s->faulted[rank], __ATOMIC_ACQUIRE);
  if (f || __atomic_load_n(&g->gone[rank], __ATOMIC_ACQUIRE)) {
    if (f && f != c)
      MP_WARN("RMA %s to rank %u (context %d): its connection in context %d failed: %s", what, rank, context,
              f->cx->index, f->why);
    else
      MP_WARN("RMA %s to rank %u (context %d): %s", what, rank, context,
              f ? f->why : "the peer is gone (its control socket closed)");
    return ncclRemoteError;
  }
  *out = c;
  return ncclSuccess;
}

static ncclResult_t local_win(struct ibr_ctxset *s, void *mh, uint64_t off, uint64_t size, const char *what,
                              uint32_t rank, struct ibr_win **out) {
  struct ibr_win *w = mh;
  if (!w || w->id >= s->g->nwins || s->g->wins[w->id] != w) {
    MP_WARN("RMA %s to rank %u: the local window handle %p is not registered on this group", what, rank, mh);
    return ncclInvalidUsage;
  }
  if (!range_ok(off, size, w->size)) {
    MP_WARN("RMA %s to rank %u: offset %llu + size %llu lies outside local window %u (%zu bytes)", what, rank,
            (unsigned long long)off, (unsigned long long)size, w->id, w->size);
    return ncclInvalidUsage;
  }
  *out = w;
  return ncclSuccess;
}

static ncclResult_t rma_iput(void *ctx, int context, uint64_t src_off, void *src_mh, size_t size, uint64_t dst_off,
                             void *dst_mh, uint32_t rank, const struct mplane_rma_signal *sig, void **request) {
  struct ibr_ctxset *s = ctx;
  struct ibr_conn *c;
  const char *what = sig ? "putSignal" : "put";
  *request = NULL;
  MP_CHECK(op_conn(s, context, rank, what, &c));
  if (sig && sig->op != NCCL_NET_SIGNAL_OP_INC && sig->op != NCCL_NET_SIGNAL_OP_ADD) {
    MP_WARN("RMA putSignal to rank %u (context %d, signal offset %llu): signal op %u is not one NCCL defines (INC 1, "
            "ADD 2)", rank, context, (unsigned long long)sig->off, sig->op);
    return ncclInvalidArgument;
  }
  struct ibr_win *src = NULL, *dst = dst_mh, *sw = sig ? sig->mhandle : NULL;
  if (size > 0) {
    MP_CHECK(local_win(s, src_mh, src_off, size, what, rank, &src));
    struct ibr_win *unused;
    if (!dst_mh || local_win(s, dst_mh, 0, 0, what, rank, &unused) != ncclSuccess) {
      MP_WARN("RMA %s of %zu bytes to rank %u: no registered destination window (%p)", what, size, rank, dst_mh);
      return ncclInvalidArgument;
    }
  }
  if (sig) {
    struct ibr_win *unused;
    if (!sw || local_win(s, sw, 0, 0, what, rank, &unused) != ncclSuccess) {
      MP_WARN("RMA putSignal to rank %u: no registered signal window (%p)", rank, sig->mhandle);
      return ncclInvalidArgument;
    }
  }
  struct ibr_req *r = req_new(c, what, size > 0 ? dst->id : (sw ? sw->id : 0), dst_off, size);
  if (!r) return ncclSystemError;
  /* The target's windows as it registered them: a range outside is refused before anything moves. */
  const struct ibr_win_rec *rw = size > 0 ? &dst->peers[rank] : NULL;
  if (rw && !range_ok(dst_off, size, rw->size)) {
    ibr_req_fail(r, ncclInvalidUsage, "RMA %s to rank %u (context %d): offset %llu + size %zu lies outside its window %u "
             "(%llu bytes); nothing was written", what, rank, context, (unsigned long long)dst_off, size, dst->id,
             (unsigned long long)rw->size);
    return ibr_refuse(r, request);
  }
  const struct ibr_win_rec *srec = sig ? &sw->peers[rank] : NULL;
  if (srec && (sig->off % 8 != 0 || !range_ok(sig->off, 8, srec->size))) {
    ibr_req_fail(r, ncclInvalidUsage, "RMA putSignal to rank %u (context %d): signal word at offset %llu %s its signal "
             "window %u (%llu bytes); nothing was written", rank, context, (unsigned long long)sig->off,
             sig->off % 8 ? "is not 8-byte aligned in" : "lies outside", sw->id, (unsigned long long)srec->size);
    return ibr_refuse(r, request);
  }
  struct ibr_op *op = &r->op;
  int staged = rw && ibr_staged_window(c, src);
  if (rw && !staged && ibr_local_key(r, src, &op->lkey, request) != ncclSuccess) return ncclSuccess; /* r failed */
  /* The peer's windows by their own-device keys: this rank's ops land on the peer's own NIC. */
  op->rkey = rw ? rw->rkey : 0;
  op->srkey = srec ? srec->rkey : 0;
  *request = r;
  if (size == 0 && !sig) return ncclSuccess; /* nothing to move: done at the first test */
  op->opcode = IBV_WR_RDMA_WRITE;
  op->size = size;
  op->laddr = src ? (uint64_t)(uintptr_t)src->base + src_off : 0;
  op->raddr = rw ? rw->addr + dst_off : 0;
  op->sig = sig != NULL;
  op->saddr = srec ? srec->addr + sig->off : 0;
  op->add = sig ? (sig->op == NCCL_NET_SIGNAL_OP_INC ? 1 : sig->value) : 0;
  if (src) {
    r->lbase = src->base;
    r->lwin = src->id;
    r->loff = src_off;
  }
  ncclResult_t res = ibr_start_op(c, r, staged);
  if (res != ncclSuccess) *request = NULL;
  return res;
}

static ncclResult_t rma_iget(void *ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                             uint64_t local_off, void *local_mh, uint32_t rank, void **request) {
  struct ibr_ctxset *s = ctx;
  struct ibr_conn *c;
  struct ibr_win *dst, *rwin = remote_mh, *unused;
  *request = NULL;
  MP_CHECK(op_conn(s, context, rank, "get", &c));
  MP_CHECK(local_win(s, local_mh, local_off, size, "get", rank, &dst));
  if (!rwin || local_win(s, rwin, 0, 0, "get", rank, &unused) != ncclSuccess) {
    MP_WARN("RMA get from rank %u: no registered remote window (%p)", rank, remote_mh);
    return ncclInvalidArgument;
  }
  struct ibr_req *r = req_new(c, "get", rwin->id, remote_off, size);
  if (!r) return ncclSystemError;
  const struct ibr_win_rec *rw = &rwin->peers[rank];
  if (!range_ok(remote_off, size, rw->size)) {
    ibr_req_fail(r, ncclInvalidUsage, "RMA get from rank %u (context %d): offset %llu + size %zu lies outside its window "
             "%u (%llu bytes); nothing was read", rank, context, (unsigned long long)remote_off, size, rwin->id,
             (unsigned long long)rw->size);
    return ibr_refuse(r, request);
  }
  struct ibr_op *op = &r->op;
  int staged = size > 0 && ibr_staged_window(c, dst);
  if (size > 0 && !staged && ibr_local_key(r, dst, &op->lkey, request) != ncclSuccess) return ncclSuccess; /* r failed */
  op->rkey = rw->rkey; /* the peer's own-device key: the read is answered by the peer's own NIC */
  *request = r;
  if (size == 0) return ncclSuccess;
  *op = (struct ibr_op){.opcode = IBV_WR_RDMA_READ, .size = size, .laddr = (uint64_t)(uintptr_t)dst->base + local_off,
                        .lkey = op->lkey, .raddr = rw->addr + remote_off, .rkey = op->rkey};
  r->lbase = dst->base;
  r->lwin = dst->id;
  r->loff = local_off;
  if (!staged && dst->type == NCCL_PTR_CUDA) { /* the GPU sees it only after a flush (rma_iflush) */
    __atomic_store_n(&c->gpu_win, dst->id, __ATOMIC_RELAXED);
    r->gpu_get = 1;
    __atomic_add_fetch(&c->gpu_posted, 1, __ATOMIC_ACQ_REL);
  }
  ncclResult_t res = ibr_start_op(c, r, staged);
  if (res != ncclSuccess) *request = NULL;
  return res;
}

/* The GPU window a flush reads: the one NCCL names (its GPU signal window), else the last window a
 * get of c filled; NULL if neither is a GPU window registered on the own device. */
static struct ibr_win *flush_window(struct ibr_group *g, struct ibr_conn *c, void *mhandle) {
  struct ibr_win *w = mhandle;
  pthread_mutex_lock(&g->lock);
  int ok = w && w->id < g->nwins && g->wins[w->id] == w && w->type == NCCL_PTR_CUDA && w->mr[0] && w->size > 0;
  if (!ok) {
    uint32_t id = __atomic_load_n(&c->gpu_win, __ATOMIC_RELAXED);
    w = id < g->nwins ? g->wins[id] : NULL;
    ok = w && w->type == NCCL_PTR_CUDA && w->mr[0] && w->size > 0;
  }
  pthread_mutex_unlock(&g->lock);
  return ok ? w : NULL;
}

/* A get's READ completion, seen by the CPU, does not mean the GPU sees its bytes: after gets into
 * GPU memory (not staged: a staged get's slot is flushed before its copy), NCCL's GIN proxy asks for
 * a flush (ncclGinProxyOpFlush) and the GPU reads the bytes once it is done. The flush covers the
 * gets that completed before it was asked for, as NCCL's own; NCCL posts its read on every flush,
 * and so does mplane while any get is not covered yet. MPLANE_IB_GDR_FLUSH_DISABLE=1 (or
 * NCCL_GDR_FLUSH_DISABLE) says the platform makes the NIC's writes visible to the GPU by itself:
 * no read, done at once, as for two-sided receives (NCCL's GIN reads through the flush QP of its
 * receive comm, which that variable leaves unmade). */
static ncclResult_t rma_iflush(void *ctx, int context, void *mhandle, uint32_t rank, void **request) {
  struct ibr_ctxset *s = ctx;
  struct ibr_group *g = s->g;
  *request = NULL;
  if (context < 0 || context >= s->ncontexts || rank >= (uint32_t)g->nranks ||
      !s->conns[context * g->nranks + (int)rank]) {
    MP_WARN("RMA flush: rank %d has no QP to rank %u in context %d", g->rank, rank, context);
    return ncclInvalidUsage;
  }
  struct ibr_conn *c = s->conns[context * g->nranks + (int)rank];
  if (mpib_config()->ib_gdr_flush_disable) return ncclSuccess;
  /* host memory is coherent; gets into GPU memory all covered by an earlier flush need none. A get
   * still in flight when a flush is posted is not covered by it: the next flush reads again. */
  uint64_t done = __atomic_load_n(&c->gpu_done, __ATOMIC_ACQUIRE);
  if (__atomic_load_n(&c->gpu_posted, __ATOMIC_ACQUIRE) == __atomic_load_n(&c->gpu_covered, __ATOMIC_ACQUIRE))
    return ncclSuccess;
  struct ibr_conn *self = s->conns[context * g->nranks + g->rank]; /* on the own device, beside the GPU */
  struct ibr_win *w = flush_window(g, c, mhandle);
  if (!self || !w) {
    MP_WARN("RMA flush to rank %u (context %d): %s; the GPU may not see the gets' bytes", rank, context,
            !self ? "this rank has no QP to itself in that context" : "no GPU window to read back is registered");
    return ncclInternalError;
  }
  struct ibr_req *r = req_new(self, "flush", w->id, 0, 1);
  if (!r) return ncclSystemError;
  struct ibr_cx *x = self->cx;
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)g->scratch, .length = 1, .lkey = g->car[self->car].scratch_mr->lkey};
  struct ibv_send_wr wr = {.wr_id = (uint64_t)(uintptr_t)r, .sg_list = &sge, .num_sge = 1,
                           .opcode = IBV_WR_RDMA_READ, .send_flags = IBV_SEND_SIGNALED};
  wr.wr.rdma.remote_addr = w->peers[g->rank].addr; /* as its peers reach it: through the own device */
  wr.wr.rdma.rkey = w->peers[g->rank].rkey;
  pthread_mutex_lock(&x->lock);
  ncclResult_t res = ncclSuccess;
  if (self->failed) {
    ibr_req_fail_conn(r, self->why);
  } else if (!ibr_room(self, 1)) {
    MP_WARN("RMA flush to rank %u (context %d): %d work requests in flight on the QP to itself: more than it holds (%d)",
            rank, context, self->outstanding, IBR_SQ);
    res = ncclInternalError;
  } else {
    __atomic_store_n(&c->gpu_covered, done, __ATOMIC_RELEASE); /* the gets completed before it */
    ibr_post(self, r, &wr); /* a failed post fails r */
  }
  pthread_mutex_unlock(&x->lock);
  if (res != ncclSuccess) {
    free(r);
    return res;
  }
  *request = r;
  return ncclSuccess;
}

static void poll_cx(struct ibr_cx *x) {
  struct ibv_wc wc[16];
  for (;;) {
    int n = ibv_poll_cq(x->b.cq, 16, wc);
    if (n < 0) {
      MP_WARN("RMA: ibv_poll_cq failed on context %d", x->index);
      return;
    }
    for (int i = 0; i < n; i++) {
      struct ibr_slot *sl = ibr_wrid_slot(wc[i].wr_id);
      struct ibr_req *r = sl ? ibr_slot_req(sl) : (struct ibr_req *)(uintptr_t)wc[i].wr_id;
      struct ibr_conn *c = r->conn;
      if (sl) ibr_stage_wr_done(sl, wc[i].status == IBV_WC_SUCCESS);
      r->pending--;
      if (r->gpu_get && r->pending == 0 && !r->queued) { /* counted once, when its last piece is back */
        r->gpu_get = 0;
        __atomic_add_fetch(&c->gpu_done, 1, __ATOMIC_ACQ_REL);
      }
      c->outstanding--;
      x->outstanding--;
      if (wc[i].status != IBV_WC_SUCCESS) {
        char why[160];
        snprintf(why, sizeof(why), "a completion in error: %s (status %d)", mpib_wc_status_str(wc[i].status),
                 wc[i].status);
        ibr_req_fail_conn(r, c->failed ? c->why : why);
        if (!c->failed && wc[i].status != IBV_WC_WR_FLUSH_ERR) ibr_peer_fault(c, why);
        else ibr_conn_fail(c, why);
      }
    }
    if (n < 16) return;
  }
}

/* A peer whose control socket reached its end is gone (it never writes there outside the
 * collective calls, and it closes it only in closeColl, after its own ops are done). */
static void check_peer(struct ibr_group *g, struct ibr_conn *c) {
  int p = c->peer;
  if (p == g->rank || __atomic_load_n(&g->gone[p], __ATOMIC_ACQUIRE)) {
    if (p != g->rank && !c->failed) ibr_conn_fail(c, "the peer is gone (its control socket closed)");
    return;
  }
  double t = mplane_now_s();
  if (t - g->peeked[p] < IBR_PEEK_EVERY_S) return;
  g->peeked[p] = t;
  char b;
  ssize_t r = recv(g->ctrl[p], &b, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
    __atomic_store_n(&g->gone[p], 1, __ATOMIC_RELEASE);
    ibr_conn_fail(c, "the peer is gone (its control socket closed: is the process alive?)");
  }
}

static ncclResult_t rma_test(void *group, void *request, int *done) {
  struct ibr_group *g = group;
  struct ibr_req *r = request;
  *done = 0;
  if (!r || r->magic != IBR_REQ_MAGIC) {
    MP_WARN("RMA test: %p is not a request of this plugin", request);
    return ncclInvalidArgument;
  }
  struct ibr_cx *x = r->conn->cx;
  pthread_mutex_lock(&x->lock);
  int busy = r->pending || r->queued || r->copies;
  if (busy) poll_cx(x);
  if (x->stage) {
    ibr_stage_progress(x);
    if (r->queued && !r->failed) ibr_stage_deadline(r);
  }
  busy = r->pending || r->queued || r->copies;
  if (busy && !r->failed) check_peer(g, r->conn);
  if (busy && r->conn->failed && !r->failed)
    ibr_req_fail_conn(r, r->conn->why);
  if (busy && x->stage) ibr_stage_progress(x); /* a failed connection's queue is dropped */
  int pending = r->pending || r->queued || r->copies;
  pthread_mutex_unlock(&x->lock);
  if (pending) return ncclSuccess; /* a failed request is released once its flushed work requests are back */
  ncclResult_t res = r->failed ? r->result : ncclSuccess;
  if (r->failed) MP_WARN("%s", r->why);
  r->magic = 0;
  free(r);
  *done = 1;
  return res;
}

/* rmaProgress: NCCL's GIN progress thread moves every context's staging ring on (test moves only
 * its request's). */
static ncclResult_t rma_progress(void *ctx) {
  struct ibr_ctxset *s = ctx;
  for (int i = 0; s && i < s->ncontexts * s->ncar; i++) {
    struct ibr_cx *x = &s->cx[i];
    if (!x->set || !__atomic_load_n(&x->stage, __ATOMIC_ACQUIRE)) continue;
    pthread_mutex_lock(&x->lock);
    poll_cx(x);
    ibr_stage_progress(x);
    pthread_mutex_unlock(&x->lock);
  }
  return ncclSuccess;
}

static ncclResult_t rma_query_last_error(void *ctx, int *has_error) {
  struct ibr_ctxset *s = ctx;
  *has_error = s ? __atomic_load_n(&s->has_error, __ATOMIC_ACQUIRE) : 0;
  return ncclSuccess;
}

const struct mplane_rma_ops mpib_rma_ops = {
    .listen = rma_listen,
    .close_listen = rma_close_listen,
    .connect = rma_connect,
    .close_group = rma_close_group,
    .create_context = rma_create_context,
    .destroy_context = rma_destroy_context,
    .reg_mr_sym = rma_reg_mr_sym,
    .reg_mr_sym_dmabuf = rma_reg_mr_sym_dmabuf,
    .dereg_mr_sym = rma_dereg_mr_sym,
    .iput = rma_iput,
    .iget = rma_iget,
    .iflush = rma_iflush,
    .test = rma_test,
    .progress = rma_progress,
    .query_last_error = rma_query_last_error,
    .route = rma_route,
    .carrier = rma_carrier,
};
