/* mplane: the version-independent plugin core (see net_core.h). */
#include "net_core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "../tuner/tuner.h"
#include "../common/config.h"
#include "../common/log.h"
#include "../net/handle.h"
#include "../net/relay.h"
#include "../net/stats.h"
#include "../net/tc.h"
#include "topo_bind.h"

#define MPLANE_MAX_DEVS 64

static struct {
  pthread_once_t once;
  ncclResult_t init_result;
  const struct mplane_transport_ops *ops;
  int ndev;
  struct mplane_dev_props props[MPLANE_MAX_DEVS];
  struct mplane_net_ctx default_ctx;
} g = {.once = PTHREAD_ONCE_INIT, .default_ctx = {.traffic_class = NCCL_NET_TRAFFIC_CLASS_UNDEF}};

static ncclResult_t try_transport(const struct mplane_transport_ops *ops, const struct mplane_config *cfg) {
  ncclResult_t res = ops->init(cfg);
  if (res != ncclSuccess) return res;
  int n = 0;
  res = ops->devices(&n);
  if (res != ncclSuccess) return res;
  if (n <= 0) {
    if (ops->finalize) ops->finalize();
    return ncclSystemError;
  }
  if (n > MPLANE_MAX_DEVS) n = MPLANE_MAX_DEVS;
  for (int d = 0; d < n; d++) {
    res = ops->get_properties(d, &g.props[d]);
    if (res != ncclSuccess) return res;
  }
  /* Planes are topo/'s (topo/planes.c): mplane_topo_plugin_init applies MPLANE_PLANES and the fabric. */
  g.ndev = n;
  g.ops = ops;
  return ncclSuccess;
}

/* NCCL reads its tuning variables after the net plugin's init, so defaults set here take effect
 * for the job (as aws-ofi-nccl does for its platforms). The user's own settings always win. */
static void apply_nccl_env_defaults(const struct mplane_transport_ops *ops) {
  const char *const *env = ops->nccl_env_defaults ? ops->nccl_env_defaults() : NULL;
  for (const char *const *kv = env; kv && *kv; kv++) {
    const char *eq = strchr(*kv, '=');
    char name[64];
    if (!eq || (size_t)(eq - *kv) >= sizeof(name)) continue;
    memcpy(name, *kv, (size_t)(eq - *kv));
    name[eq - *kv] = '\0';
    if (getenv(name)) {
      MP_INFO(NCCL_INIT | NCCL_ENV, "%s=%s set by the user; not changed", name, getenv(name));
      continue;
    }
    setenv(name, eq + 1, 0);
    MP_INFO(NCCL_INIT | NCCL_ENV, "%s set to %s for the %s transport (MPLANE_NCCL_DEFAULTS=0 to keep NCCL's)",
            name, eq + 1, ops->name);
  }
}

static void global_init_once(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (cfg == NULL) {
    g.init_result = ncclInvalidArgument; /* the WARN naming the variable was already printed */
    return;
  }
  ncclResult_t res = ncclSystemError;
  if (cfg->transport == MPLANE_TRANSPORT_IB || cfg->transport == MPLANE_TRANSPORT_AUTO) {
    res = mplane_ib_ops.init ? try_transport(&mplane_ib_ops, cfg) : ncclSystemError;
    if (res != ncclSuccess && cfg->transport == MPLANE_TRANSPORT_IB) {
      MP_WARN("MPLANE_TRANSPORT=ib but no usable InfiniBand/RoCE port was found; unset it or use "
              "MPLANE_TRANSPORT=socket");
      g.init_result = res;
      return;
    }
  }
  if (res != ncclSuccess) res = try_transport(&mplane_socket_ops, cfg);
  if (res != ncclSuccess) {
    MP_WARN("no usable network device (MPLANE_SOCKET_IFNAME='%s'); NCCL will use its own transports",
            cfg->socket_ifname);
    g.init_result = res;
    return;
  }
  /* topo/: planes, rails, pci paths and guids from the node's topology; NCCL_TOPO_FILE for NCCL. */
  res = mplane_topo_plugin_init(cfg, g.props, g.ndev);
  if (res != ncclSuccess) { /* bad MPLANE_PLANES or MPLANE_TOPO_FILE: the WARN named it */
    if (g.ops->finalize) g.ops->finalize();
    g.ops = NULL;
    g.ndev = 0;
    g.init_result = res;
    return;
  }
  if (cfg->nccl_defaults) apply_nccl_env_defaults(g.ops);
  /* The transport's tuner rows for these devices (the tuner in this library uses them where the
   * user gives no MPLANE_TUNER_CONFIG). */
  const char *rows = cfg->nccl_defaults && g.ops->tuner_defaults ? g.ops->tuner_defaults() : NULL;
  if (rows) {
    char name[64];
    snprintf(name, sizeof(name), "the %s transport's built-in rows", g.ops->name);
    mplane_tuner_set_builtin(name, rows);
  }
  for (int d = 0; d < g.ndev; d++) {
    const struct mplane_dev_props *p = &g.props[d];
    MP_INFO(NCCL_INIT | NCCL_NET, "dev %d: %s transport %s plane %d speed %d Mbps pci %s", d, p->name,
            g.ops->name, p->plane, p->speed_mbps, p->pci_path[0] ? p->pci_path : "(none)");
  }
  g.init_result = ncclSuccess;
}

ncclResult_t mplane_net_global_init(ncclDebugLogger_t logger) {
  mplane_log_set_logger(logger);
  pthread_once(&g.once, global_init_once);
  return g.init_result;
}

const struct mplane_transport_ops *mplane_net_transport(void) { return g.ops; }

ncclResult_t mplane_net_ctx_create(uint64_t comm_id, int traffic_class, struct mplane_net_ctx **out) {
  struct mplane_net_ctx *ctx = calloc(1, sizeof(*ctx));
  if (!ctx) return ncclSystemError;
  ctx->comm_id = comm_id;
  ctx->traffic_class = traffic_class;
  *out = ctx;
  return ncclSuccess;
}

ncclResult_t mplane_net_ctx_destroy(struct mplane_net_ctx *ctx) {
  if (ctx && ctx != &g.default_ctx) free(ctx);
  return ncclSuccess;
}

struct mplane_net_ctx *mplane_net_default_ctx(void) { return &g.default_ctx; }

ncclResult_t mplane_net_devices(int *ndev) {
  *ndev = g.ndev;
  return ncclSuccess;
}

const struct mplane_dev_props *mplane_net_props(int *ndev) {
  *ndev = g.ndev;
  return g.props;
}

ncclResult_t mplane_net_get_properties(int dev, const struct mplane_dev_props **props) {
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("getProperties: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  *props = &g.props[dev];
  return ncclSuccess;
}

/* The transport's counter records of a comm / request (net/stats.h), NULL where it keeps none. */
static struct mplane_stats_comm *comm_stats(void *comm, int is_send) {
  return comm && g.ops->comm_stats ? g.ops->comm_stats(comm, is_send) : NULL;
}
static struct mplane_stats_req *req_stats(void *request) {
  return request && g.ops->req_stats ? g.ops->req_stats(request) : NULL;
}

ncclResult_t mplane_net_listen(struct mplane_net_ctx *ctx, int dev, void *handle, void **listen_comm) {
  (void)ctx;
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("listen: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  ncclResult_t res = g.ops->listen(dev, handle, listen_comm);
  if (res != ncclSuccess) return res;
  /* The handle carries the plane net_core resolved (MPLANE_PLANES, topo/), not only the transport's guess. */
  struct mplane_handle h;
  char why[256];
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) == ncclSuccess && h.plane != g.props[dev].plane) {
    h.plane = (int8_t)g.props[dev].plane;
    mplane_handle_encode(&h, handle);
  }
  mplane_stats_listen(*listen_comm, dev,
                      mplane_tc_resolve(ctx ? ctx->traffic_class : NCCL_NET_TRAFFIC_CLASS_UNDEF,
                                        ctx && ctx->has_attr ? &ctx->attr : NULL));
  return ncclSuccess;
}

ncclResult_t mplane_net_connect(struct mplane_net_ctx *ctx, int traffic_class, int dev, void *handle,
                                void **send_comm) {
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("connect: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  struct mplane_comm_opts opts = {.traffic_class = traffic_class, .service_level = 0};
  if (opts.traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF && ctx) opts.traffic_class = ctx->traffic_class;
  /* Traffic class and SL (net/tc.c); plane and relay NIC (net/relay.c). */
  struct mplane_tc_choice tc;
  mplane_tc_choose(opts.traffic_class, ctx && ctx->has_attr ? &ctx->attr : NULL, &tc);
  opts.tc_class = tc.cls;
  opts.service_level = tc.sl;
  opts.comm_tclass = tc.tclass;
  opts.adaptive_routing = mplane_tc_adaptive_routing(opts.tc_class);
  struct mplane_handle h;
  char why[256];
  struct mplane_relay_choice via = {.dev = dev, .local_plane = g.props[dev].plane, .peer_plane = -1};
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) == ncclSuccess)
    MP_CHECK(mplane_relay_pick(g.props, g.ndev, dev, h.plane, mplane_config_get()->relay, &via));
  opts.relayed = via.relayed || mplane_relay_test_host() == 2; /* tests: every connection as if relayed */
  if (opts.relayed) snprintf(opts.staging_gpu, sizeof(opts.staging_gpu), "%s", g.props[via.dev].near_gpu);
  ncclResult_t res = g.ops->connect(via.dev, &opts, handle, send_comm);
  if (res != ncclSuccess || *send_comm == NULL) return res;
  const struct mplane_dev_props *p = &g.props[via.dev];
  if (via.relayed)
    MP_INFO(NCCL_NET, "connect: dev %d (%s, plane %d) to a peer on plane %d is carried by dev %d (%s, plane %d), "
            "the relay NIC", dev, g.props[dev].name, via.local_plane, via.peer_plane, via.dev, p->name, p->plane);
  struct mplane_stats_comm_info si = {.is_send = 1, .dev = via.dev, .dev_name = p->name, .plane = p->plane,
                                      .from_plane = via.local_plane, .cls = opts.tc_class,
                                      .sl = opts.service_level, .relayed = via.relayed};
  mplane_stats_comm_open(comm_stats(*send_comm, 1), &si);
  return ncclSuccess;
}

ncclResult_t mplane_net_accept(void *listen_comm, void **recv_comm) {
  ncclResult_t res = g.ops->accept(listen_comm, recv_comm);
  int dev = -1, cls = MPLANE_TC_DEFAULT;
  if (res != ncclSuccess || *recv_comm == NULL || mplane_stats_listen_get(listen_comm, &dev, &cls) != 0) return res;
  struct mplane_stats_comm_info si = {.is_send = 0, .dev = dev, .dev_name = g.props[dev].name,
                                      .plane = g.props[dev].plane, .from_plane = g.props[dev].plane, .cls = cls,
                                      .sl = mplane_tc_sl(cls)};
  mplane_stats_comm_open(comm_stats(*recv_comm, 0), &si);
  return ncclSuccess;
}

ncclResult_t mplane_net_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  return g.ops->reg_mr(comm, data, size, type, mhandle);
}

ncclResult_t mplane_net_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                      void **mhandle) {
  if (!g.ops->reg_mr_dmabuf) {
    MP_WARN("regMrDmaBuf: transport %s does not take dma-buf memory", g.ops->name);
    return ncclInvalidUsage;
  }
  return g.ops->reg_mr_dmabuf(comm, data, size, type, offset, fd, mhandle);
}

ncclResult_t mplane_net_dereg_mr(void *comm, void *mhandle) { return g.ops->dereg_mr(comm, mhandle); }

ncclResult_t mplane_net_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void **request) {
  return mplane_net_isend_ph(send_comm, data, size, tag, mhandle, NULL, request);
}

ncclResult_t mplane_net_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                              void **request) {
  return mplane_net_irecv_ph(recv_comm, n, data, sizes, tags, mhandles, NULL, request);
}

ncclResult_t mplane_net_isend_ph(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                                 void **request) {
  ncclResult_t res = g.ops->isend(send_comm, data, size, tag, mhandle, phandle, request);
  if (res == ncclSuccess && *request) mplane_stats_request(comm_stats(send_comm, 1), req_stats(*request), size, 0);
  else if (res != ncclSuccess) mplane_stats_comm_error(comm_stats(send_comm, 1));
  return res;
}

ncclResult_t mplane_net_irecv_ph(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                                 void **phandles, void **request) {
  ncclResult_t res = g.ops->irecv(recv_comm, n, data, sizes, tags, mhandles, phandles, request);
  if (res == ncclSuccess && *request) mplane_stats_request(comm_stats(recv_comm, 0), req_stats(*request), 0, n);
  else if (res != ncclSuccess) mplane_stats_comm_error(comm_stats(recv_comm, 0));
  return res;
}

ncclResult_t mplane_net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request) {
  return g.ops->iflush(recv_comm, n, data, sizes, mhandles, request);
}

ncclResult_t mplane_net_test(void *request, int *done, int *sizes) {
  int local[NCCL_NET_MAX_REQUESTS];
  int *s = sizes ? sizes : local;
  ncclResult_t res = g.ops->test(request, done, s);
  if (res == ncclSuccess && *done) mplane_stats_request_done(req_stats(request), s); /* net/stats.c */
  else if (res != ncclSuccess) mplane_stats_request_error(req_stats(request));
  return res;
}

ncclResult_t mplane_net_close_send(void *send_comm) {
  mplane_stats_comm_close(comm_stats(send_comm, 1));
  return g.ops->close_send(send_comm);
}
ncclResult_t mplane_net_close_recv(void *recv_comm) {
  mplane_stats_comm_close(comm_stats(recv_comm, 0));
  return g.ops->close_recv(recv_comm);
}
ncclResult_t mplane_net_close_listen(void *listen_comm) {
  mplane_stats_listen_close(listen_comm);
  return g.ops->close_listen(listen_comm);
}

ncclResult_t mplane_net_set_attr(struct mplane_net_ctx *ctx, const ncclNetAttr_v11_t *attr) {
  if (!ctx || !attr) return ncclInvalidArgument;
  ctx->attr = *attr;
  ctx->has_attr = 1;
  return ncclSuccess;
}
