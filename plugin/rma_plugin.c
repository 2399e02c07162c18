/* mplane: ncclRmaPlugin_v14, _v15 and _v16, the RMA backend NCCL's GIN proxy looks for in the net
 * plugin's library (NCCL 2.30 takes v14, 2.31 v15, 2.32 v16: each the newest it knows). One set of
 * functions serves the three tables; v15 adds the ops' optFlags (the aggregation hint, rma_hint.h),
 * v16 getRmaProperties. A thin adapter: the active transport's one-sided ops (net/transport.h's
 * mplane_rma_ops) do the work; a transport without them makes init fail, and NCCL goes on to its own
 * backend.
 *
 * The order NCCL's GIN proxy calls it in: init, devices, getProperties (netDeviceType GIN_PROXY),
 * per connection listen / connect (collective) / closeListen, then per device communicator
 * createContext (collective) and regMrSym for its signals, inline buffers and every window, then
 * from its progress thread iput / iputSignal / iget / iflush, test until done, queryLastError;
 * at the end destroyContext, deregMrSym, closeColl, finalize.
 *
 * The adapter wraps the transport's group and context so that each context has a traffic record
 * (net/stats.h: by plane and class, like two-sided comms) per device that carries its ops: puts count
 * as sent, gets as received, on the record of the device their connection leaves from (the relay
 * device's, marked relayed, for a peer on another plane where the transport relays).
 *
 * Planes: each handle carries its listening device's plane; a transport with a route op gets them
 * after connect, with this node's devices and MPLANE_RELAY, and carries cross-plane connections
 * through the relay (net/relay.h). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/config.h"
#include "../common/log.h"
#include "net_core.h"
#include "rma_hint.h"
#include "../common/nccl/rma_v16.h"
#include "../net/stats.h"
#include "../net/tc.h"
#include "../net/transport.h"

struct rma_plugin_ctx {
  uint64_t comm_id;
};

struct rma_group {
  void *inner; /* the transport's group */
  int dev, nranks;
  int *plane; /* [nranks]: the plane each rank's handle says, -1 unknown */
};

struct rma_context {
  void *inner; /* the transport's context set */
  struct mplane_rma_hint hint; /* the holds the aggregation hint opened (v15+) */
  int nrec, nrec_ranks;
  struct mplane_stats_comm *stats; /* [nrec]: one record per device that carries the context's ops */
  int *rec_of;                     /* [nranks]: the record of the ops to that rank */
};

/* The plane tag: the listening device's plane in the handle's last bytes (a magic, then the plane). */
#define PLANE_TAG_MAGIC 0x4d50u /* "MP" */
struct plane_tag {
  uint16_t magic;
  int16_t plane;
};
_Static_assert(MPLANE_RMA_HANDLE_MAX + sizeof(struct plane_tag) <= NCCL_NET_HANDLE_MAXSIZE, "the tag fits");

static void plane_tag_put(void *handle, int plane) {
  struct plane_tag t = {.magic = PLANE_TAG_MAGIC, .plane = (int16_t)plane};
  memcpy((char *)handle + MPLANE_RMA_HANDLE_MAX, &t, sizeof(t));
}

static int plane_tag_get(const void *handle) {
  struct plane_tag t;
  memcpy(&t, (const char *)handle + MPLANE_RMA_HANDLE_MAX, sizeof(t));
  return t.magic == PLANE_TAG_MAGIC ? t.plane : -1;
}

static int dev_plane(int dev) {
  const struct mplane_dev_props *p = NULL;
  return dev >= 0 && mplane_net_get_properties(dev, &p) == ncclSuccess ? p->plane : -1;
}

/* Say, once per group, when peers listen on other planes than this rank's device, and how such a
 * connection is carried: through the relay where the transport routes by planes, else (sockets) by
 * the plane of the address it is dialled to, through the dialling node's NIC on that plane. */
static void report_cross_plane(void *handles[], int nranks, int rank, int dev, int relays) {
  int mine = dev_plane(dev), other = 0, first = -1;
  for (int r = 0; r < nranks; r++) {
    int p = plane_tag_get(handles[r]);
    if (r != rank && p >= 0 && mine >= 0 && p != mine) {
      other++;
      if (first < 0) first = r;
    }
  }
  if (other && relays)
    MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d's device is on plane %d; %d of its %d peers listen on other planes "
            "(rank %d on plane %d first): each rank's ops to one of them leave from its node's device on that peer's "
            "plane, through the relay (MPLANE_RELAY), and land on the peer's own device",
            rank, mine, other, nranks - 1, first, plane_tag_get(handles[first]));
  else if (other)
    MP_INFO(NCCL_INIT | NCCL_NET, "RMA: rank %d's device is on plane %d; %d of its %d peers listen on other planes "
            "(rank %d on plane %d first): a connection with one of them is carried by the plane of the address it is "
            "dialled to, through this node's NIC on that plane, not by this rank's device",
            rank, mine, other, nranks - 1, first, plane_tag_get(handles[first]));
}

static void *inner_group(void *g) { return g ? ((struct rma_group *)g)->inner : NULL; }
static void *inner_ctx(void *c) { return c ? ((struct rma_context *)c)->inner : NULL; }

static const struct mplane_rma_ops *rma_ops(void) {
  const struct mplane_transport_ops *t = mplane_net_transport();
  return t ? t->rma : NULL;
}

/* version: the table NCCL took (14, 15 or 16), for the log. */
static ncclResult_t rma_init(void **ctx, uint64_t comm_id, ncclDebugLogger_t logger, int version) {
  *ctx = NULL;
  ncclResult_t res = mplane_net_global_init(logger);
  if (res != ncclSuccess) return res; /* the WARN said why */
  if (!rma_ops()) {
    MP_INFO(NCCL_INIT | NCCL_NET, "RMA: the %s transport serves no one-sided ops; NCCL uses its own RMA backend",
            mplane_net_transport()->name);
    return ncclInvalidUsage;
  }
  struct rma_plugin_ctx *c = calloc(1, sizeof(*c));
  if (!c) return ncclSystemError;
  c->comm_id = comm_id;
  *ctx = c;
  MP_INFO(NCCL_INIT | NCCL_NET, "RMA: ncclRmaPlugin_v%d served by the %s transport", version,
          mplane_net_transport()->name);
  return ncclSuccess;
}

static ncclResult_t v14_init(void **ctx, uint64_t comm_id, ncclDebugLogger_t logger) {
  return rma_init(ctx, comm_id, logger, 14);
}

static ncclResult_t v15_init(void **ctx, uint64_t comm_id, ncclDebugLogger_t logger) {
  return rma_init(ctx, comm_id, logger, 15);
}

static ncclResult_t v16_init(void **ctx, uint64_t comm_id, ncclDebugLogger_t logger) {
  return rma_init(ctx, comm_id, logger, 16);
}

static ncclResult_t rma_finalize(void *ctx) {
  free(ctx);
  return ncclSuccess;
}

/* The net device's properties, as a GIN proxy device: host and GPU windows, and dma-bufs where the
 * transport registers them and the device takes them (then NCCL's proxy hands GPU windows over as
 * dma-bufs, regMrSymDmaBuf). */
static ncclResult_t rma_get_properties(int dev, ncclNetProperties_v12_t *out) {
  const struct mplane_dev_props *p;
  ncclResult_t res = mplane_net_get_properties(dev, &p);
  if (res != ncclSuccess) return res;
  MPLANE_FILL_PROPS_COMMON(out, p);
  MPLANE_FILL_PROPS_V9(out, p, dev);
  out->ptrSupport = NCCL_PTR_HOST | NCCL_PTR_CUDA;
  if (rma_ops() && rma_ops()->reg_mr_sym_dmabuf && (p->ptr_support & NCCL_PTR_DMABUF))
    out->ptrSupport |= NCCL_PTR_DMABUF;
  out->netDeviceType = NCCL_NET_DEVICE_GIN_PROXY;
  out->netDeviceVersion = 0;
  out->maxMultiRequestSize = 1;
  out->railId = (int16_t)(p->rail >= 0 ? p->rail : NCCL_NET_ID_UNDEF);
  out->planeId = (int16_t)(p->plane >= 0 ? p->plane : NCCL_NET_ID_UNDEF);
  return ncclSuccess;
}

static ncclResult_t rma_listen(void *ctx, int dev, void *handle, void **listen_comm) {
  (void)ctx;
  int ndev = 0;
  mplane_net_devices(&ndev);
  if (dev < 0 || dev >= ndev) {
    MP_WARN("RMA listen: device %d does not exist (%d devices)", dev, ndev);
    return ncclInvalidArgument;
  }
  ncclResult_t res = rma_ops()->listen(dev, handle, listen_comm);
  if (res != ncclSuccess) return res;
  mplane_stats_listen(*listen_comm, dev, 0); /* connect learns the device from it */
  plane_tag_put(handle, dev_plane(dev));
  return ncclSuccess;
}

/* NCCL passes its net context or its RMA context here depending on the caller: neither is used. */
static ncclResult_t rma_connect(void *ctx, void *handles[], int nranks, int rank, void *listen_comm,
                                void **coll_comm) {
  (void)ctx;
  *coll_comm = NULL;
  struct rma_group *g = calloc(1, sizeof(*g));
  if (!g || nranks < 1 || !(g->plane = calloc((size_t)nranks, sizeof(int)))) {
    free(g);
    return nranks < 1 ? ncclInvalidArgument : ncclSystemError;
  }
  int cls = 0;
  g->dev = -1;
  g->nranks = nranks;
  mplane_stats_listen_get(listen_comm, &g->dev, &cls);
  const struct mplane_rma_ops *o = rma_ops();
  report_cross_plane(handles, nranks, rank, g->dev, o->route != NULL);
  for (int r = 0; r < nranks; r++) g->plane[r] = plane_tag_get(handles[r]);
  ncclResult_t res = o->connect(handles, nranks, rank, listen_comm, &g->inner);
  if (res == ncclSuccess && o->route) {
    struct mplane_rma_route rt = {.dev = g->dev, .rank_plane = g->plane, .relay_mode = mplane_config_get()->relay};
    rt.devs = mplane_net_props(&rt.ndev);
    res = o->route(g->inner, &rt);
    if (res != ncclSuccess) o->close_group(g->inner);
  }
  if (res != ncclSuccess) {
    free(g->plane);
    free(g);
    return res;
  }
  *coll_comm = g;
  return ncclSuccess;
}

static void context_stats_free(struct rma_context *c) {
  for (int i = 0; i < c->nrec; i++) mplane_stats_comm_close(&c->stats[i]);
  free(c->stats);
  free(c->rec_of);
}

/* One record per device that carries ops of the context (the transport's carrier, else the group's
 * device): a relay device's record says its plane, relayed from the group device's plane. */
static ncclResult_t context_stats_open(struct rma_context *c, const struct rma_group *g, int cls, int sl) {
  const struct mplane_rma_ops *o = rma_ops();
  int devs[64], ndev = 0;
  c->stats = calloc(sizeof(devs) / sizeof(devs[0]), sizeof(*c->stats));
  c->rec_of = calloc((size_t)g->nranks, sizeof(int));
  if (!c->stats || !c->rec_of) return ncclSystemError;
  for (int r = 0; r < g->nranks; r++) {
    int d = o->carrier ? o->carrier(c->inner, (uint32_t)r) : g->dev, k = 0;
    while (k < ndev && devs[k] != d) k++;
    if (k == ndev && ndev < (int)(sizeof(devs) / sizeof(devs[0]))) devs[ndev++] = d;
    c->rec_of[r] = k < ndev ? k : 0;
  }
  int from = dev_plane(g->dev);
  for (int k = 0; k < ndev; k++) {
    const struct mplane_dev_props *p = NULL;
    int plane = devs[k] >= 0 && mplane_net_get_properties(devs[k], &p) == ncclSuccess ? p->plane : -1, n = 0;
    for (int r = 0; r < g->nranks; r++) n += c->rec_of[r] == k;
    char peer[64];
    snprintf(peer, sizeof(peer), "%d of an RMA group of %d ranks", n, g->nranks);
    struct mplane_stats_comm_info si = {.is_send = 1, .dev = devs[k], .dev_name = p ? p->name : "?",
                                        .plane = plane, .from_plane = from, .cls = cls, .sl = sl,
                                        .relayed = devs[k] != g->dev, .peer = peer};
    mplane_stats_comm_open(&c->stats[k], &si);
  }
  c->nrec = ndev;
  c->nrec_ranks = g->nranks;
  return ncclSuccess;
}

static ncclResult_t rma_create_context(void *coll_comm, ncclRmaConfig_v14_t *config, void **rma_ctx) {
  if (!config) return ncclInvalidArgument;
  struct mplane_rma_ctx_opts o = {.ncontexts = config->nContexts, .rank_stride = config->rankStride};
  /* net/tc.c, as two-sided comms (an invalid class is WARNed there, once, and becomes default) */
  struct mplane_tc_choice tc;
  mplane_tc_choose(config->trafficClass, NULL, &tc);
  o.tc_class = tc.cls;
  o.service_level = tc.sl;
  o.comm_tclass = tc.tclass;
  *rma_ctx = NULL;
  struct rma_group *g = coll_comm;
  struct rma_context *c = calloc(1, sizeof(*c));
  if (!g || !c) {
    free(c);
    return g ? ncclSystemError : ncclInvalidArgument;
  }
  ncclResult_t res = rma_ops()->create_context(g->inner, &o, &c->inner);
  if (res != ncclSuccess) {
    free(c);
    return res;
  }
  res = context_stats_open(c, g, o.tc_class, o.service_level);
  if (res == ncclSuccess) res = mplane_rma_hint_init(&c->hint, rma_ops(), config->nContexts, g->nranks);
  if (res != ncclSuccess) {
    context_stats_free(c);
    rma_ops()->destroy_context(c->inner);
    free(c);
    return res;
  }
  *rma_ctx = c;
  return ncclSuccess;
}

static ncclResult_t rma_reg_mr_sym(void *coll_comm, void *data, size_t size, int type, uint64_t flags,
                                   void **mhandle) {
  return rma_ops()->reg_mr_sym(inner_group(coll_comm), data, size, type, flags, mhandle);
}

/* The IB transport registers the dma-buf (GPU windows without nvidia-peermem); the socket
 * transport reaches the bytes by address, so the descriptor adds nothing there. */
static ncclResult_t rma_reg_mr_sym_dmabuf(void *coll_comm, void *data, size_t size, int type, uint64_t offset,
                                          int fd, uint64_t flags, void **mhandle) {
  const struct mplane_rma_ops *o = rma_ops();
  if (o->reg_mr_sym_dmabuf)
    return o->reg_mr_sym_dmabuf(inner_group(coll_comm), data, size, type, offset, fd, flags, mhandle);
  return o->reg_mr_sym(inner_group(coll_comm), data, size, type, flags, mhandle);
}

static ncclResult_t rma_dereg_mr_sym(void *coll_comm, void *mhandle) {
  return rma_ops()->dereg_mr_sym(inner_group(coll_comm), mhandle);
}

static ncclResult_t rma_destroy_context(void *rma_ctx) {
  struct rma_context *c = rma_ctx;
  if (!c) return ncclSuccess;
  mplane_rma_hint_end_all(&c->hint, rma_ops(), c->inner); /* nothing stays held past the context set */
  ncclResult_t res = rma_ops()->destroy_context(c->inner);
  mplane_rma_hint_free(&c->hint);
  context_stats_free(c);
  free(c);
  return res;
}

static ncclResult_t rma_close_coll(void *coll_comm) {
  ncclResult_t res = rma_ops()->close_group(inner_group(coll_comm));
  if (coll_comm) free(((struct rma_group *)coll_comm)->plane);
  free(coll_comm);
  return res;
}

static ncclResult_t rma_close_listen(void *listen_comm) {
  mplane_stats_listen_close(listen_comm);
  return rma_ops()->close_listen(listen_comm);
}

/* Count a posted op in the record of the device that carries it to rank (NULL request: not posted,
 * nothing counted). */
static ncclResult_t counted(ncclResult_t res, void *rma_ctx, void **request, uint64_t bytes, int is_get,
                            uint32_t rank) {
  struct rma_context *c = rma_ctx;
  if (res != ncclSuccess || !*request || !c->nrec) return res;
  /* rank past the group: the transport refused the op already (no request); record 0 otherwise */
  mplane_stats_rma(&c->stats[c->rec_of && rank < (uint32_t)c->nrec_ranks ? c->rec_of[rank] : 0], bytes, is_get);
  return res;
}

/* The ops post inside the hint's holds (rma_hint.h): aggregate is NCCL's v15+ hint, 0 from v14. */
static struct mplane_rma_hint *hint_of(void *rma_ctx) {
  return rma_ctx ? &((struct rma_context *)rma_ctx)->hint : NULL;
}

static ncclResult_t hinted_put(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                               uint64_t dst_off, void *dst_mh, uint32_t rank, const struct mplane_rma_signal *sig,
                               int aggregate, void **request) {
  const struct mplane_rma_ops *o = rma_ops();
  struct mplane_rma_hint *h = hint_of(rma_ctx);
  if (h) mplane_rma_hint_before(h, o, inner_ctx(rma_ctx), context, rank, aggregate);
  ncclResult_t res = counted(o->iput(inner_ctx(rma_ctx), context, src_off, src_mh, size, dst_off, dst_mh, rank, sig,
                                     request),
                             rma_ctx, request, size, 0, rank);
  if (h) mplane_rma_hint_after(h, o, inner_ctx(rma_ctx), context, rank, aggregate, res);
  return res;
}

/* isStrongSignal: every signal is strong here (applied after its data and the earlier ops of its
 * context to that rank), which also serves a weak one. */
static ncclResult_t hinted_put_signal(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                                      uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t signal_off,
                                      void *signal_mh, uint64_t signal_value, uint32_t signal_op, int aggregate,
                                      void **request) {
  struct mplane_rma_signal sig = {.off = signal_off, .mhandle = signal_mh, .value = signal_value, .op = signal_op};
  if (!dst_mh) size = 0; /* NCCL's VA signal: no data, the signal alone */
  return hinted_put(rma_ctx, context, src_off, src_mh, size, dst_off, dst_mh, rank, &sig, aggregate, request);
}

static ncclResult_t hinted_get(void *rma_ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                               uint64_t local_off, void *local_mh, uint32_t rank, int aggregate, void **request) {
  const struct mplane_rma_ops *o = rma_ops();
  struct mplane_rma_hint *h = hint_of(rma_ctx);
  if (h) mplane_rma_hint_before(h, o, inner_ctx(rma_ctx), context, rank, aggregate);
  ncclResult_t res = counted(o->iget(inner_ctx(rma_ctx), context, remote_off, remote_mh, size, local_off, local_mh,
                                     rank, request),
                             rma_ctx, request, size, 1, rank);
  if (h) mplane_rma_hint_after(h, o, inner_ctx(rma_ctx), context, rank, aggregate, res);
  return res;
}

static ncclResult_t v14_iput(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                             uint64_t dst_off, void *dst_mh, uint32_t rank, void **request) {
  return hinted_put(rma_ctx, context, src_off, src_mh, size, dst_off, dst_mh, rank, NULL, 0, request);
}

static ncclResult_t v14_iput_signal(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                                    uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t signal_off,
                                    void *signal_mh, uint64_t signal_value, uint32_t signal_op, bool strong,
                                    void **request) {
  (void)strong;
  return hinted_put_signal(rma_ctx, context, src_off, src_mh, size, dst_off, dst_mh, rank, signal_off, signal_mh,
                           signal_value, signal_op, 0, request);
}

static ncclResult_t v14_iget(void *rma_ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                             uint64_t local_off, void *local_mh, uint32_t rank, void **request) {
  return hinted_get(rma_ctx, context, remote_off, remote_mh, size, local_off, local_mh, rank, 0, request);
}

/* v15 and v16: optFlags bits other than the hint are NCCL's to define later; a hint never changes
 * what an op does, so an unknown bit is ignored. */
static int aggregates(uint32_t opt_flags) { return (opt_flags & ncclRmaOptFlagsAggregateRequests) != 0; }

static ncclResult_t v15_iput(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                             uint64_t dst_off, void *dst_mh, uint32_t rank, uint32_t opt_flags, void **request) {
  return hinted_put(rma_ctx, context, src_off, src_mh, size, dst_off, dst_mh, rank, NULL, aggregates(opt_flags),
                    request);
}

static ncclResult_t v15_iput_signal(void *rma_ctx, int context, uint64_t src_off, void *src_mh, size_t size,
                                    uint64_t dst_off, void *dst_mh, uint32_t rank, uint64_t signal_off,
                                    void *signal_mh, uint64_t signal_value, uint32_t signal_op, bool strong,
                                    uint32_t opt_flags, void **request) {
  (void)strong;
  return hinted_put_signal(rma_ctx, context, src_off, src_mh, size, dst_off, dst_mh, rank, signal_off, signal_mh,
                           signal_value, signal_op, aggregates(opt_flags), request);
}

static ncclResult_t v15_iget(void *rma_ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                             uint64_t local_off, void *local_mh, uint32_t rank, uint32_t opt_flags, void **request) {
  return hinted_get(rma_ctx, context, remote_off, remote_mh, size, local_off, local_mh, rank, aggregates(opt_flags),
                    request);
}

/* A flush waits for the gets before it, so a run held for that rank goes first. */
static ncclResult_t rma_iflush(void *rma_ctx, int context, void *mhandle, uint32_t rank, void **request) {
  struct mplane_rma_hint *h = hint_of(rma_ctx);
  if (h) mplane_rma_hint_end(h, rma_ops(), inner_ctx(rma_ctx), context, rank);
  return rma_ops()->iflush(inner_ctx(rma_ctx), context, mhandle, rank, request);
}

static ncclResult_t rma_test(void *coll_comm, void *request, int *done) {
  return rma_ops()->test(inner_group(coll_comm), request, done);
}

/* NCCL calls this after each pass over its queues: whatever a pass left held goes now. */
static ncclResult_t rma_progress(void *rma_ctx) {
  const struct mplane_rma_ops *o = rma_ops();
  struct mplane_rma_hint *h = hint_of(rma_ctx);
  if (h) mplane_rma_hint_end_all(h, o, inner_ctx(rma_ctx));
  return o->progress ? o->progress(inner_ctx(rma_ctx)) : ncclSuccess;
}

static ncclResult_t rma_query_last_error(void *rma_ctx, bool *has_error) {
  int e = 0;
  ncclResult_t res = rma_ops()->query_last_error(inner_ctx(rma_ctx), &e);
  *has_error = e != 0;
  return res;
}

/* v16: what a signal guarantees, per group. Both transports apply a signal after the earlier puts of
 * its own context from the same sender (one ordered connection: TCP stream, RC QP), but nothing
 * orders it with puts from other ranks or other contexts, which travel on other connections: so a
 * signal does not flush every put the group received, and NCCL keeps its flush per peer. */
static ncclResult_t v16_get_rma_properties(void *coll_comm, ncclRmaProperties_v16_t *props) {
  if (!coll_comm || !props) return ncclInvalidArgument;
  props->flushesAllPutsOnAnySignal = false;
  return ncclSuccess;
}

/* The entries of the same type in every version: named, so each lands in its own table's slot. */
#define MPLANE_RMA_COMMON_ENTRIES                     \
  .name = "mplane",                                   \
  .devices = mplane_net_devices,                      \
  .getProperties = rma_get_properties,                \
  .listen = rma_listen,                               \
  .connect = rma_connect,                             \
  .createContext = rma_create_context,                \
  .regMrSym = rma_reg_mr_sym,                         \
  .regMrSymDmaBuf = rma_reg_mr_sym_dmabuf,            \
  .deregMrSym = rma_dereg_mr_sym,                     \
  .destroyContext = rma_destroy_context,              \
  .closeColl = rma_close_coll,                        \
  .closeListen = rma_close_listen,                    \
  .iflush = rma_iflush,                               \
  .test = rma_test,                                   \
  .rmaProgress = rma_progress,                        \
  .queryLastError = rma_query_last_error,             \
  .finalize = rma_finalize

/* NCCL 2.30 */
__attribute__((visibility("default"))) const ncclRma_v14_t ncclRmaPlugin_v14 = {
    MPLANE_RMA_COMMON_ENTRIES,
    .init = v14_init,
    .iput = v14_iput,
    .iputSignal = v14_iput_signal,
    .iget = v14_iget,
};

/* NCCL 2.31: the ops take optFlags */
__attribute__((visibility("default"))) const ncclRma_v15_t ncclRmaPlugin_v15 = {
    MPLANE_RMA_COMMON_ENTRIES,
    .init = v15_init,
    .iput = v15_iput,
    .iputSignal = v15_iput_signal,
    .iget = v15_iget,
};

/* NCCL 2.32: and getRmaProperties */
__attribute__((visibility("default"))) const ncclRma_v16_t ncclRmaPlugin_v16 = {
    MPLANE_RMA_COMMON_ENTRIES,
    .init = v16_init,
    .getRmaProperties = v16_get_rma_properties,
    .iput = v15_iput,
    .iputSignal = v15_iput_signal,
    .iget = v15_iget,
};
