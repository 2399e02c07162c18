/* mplane: the version-independent plugin core (see net_core.h). */
#include "net_core.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "config.h"
#include "log.h"

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
  g.ndev = n;
  g.ops = ops;
  return ncclSuccess;
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

ncclResult_t mplane_net_get_properties(int dev, const struct mplane_dev_props **props) {
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("getProperties: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  *props = &g.props[dev];
  return ncclSuccess;
}

ncclResult_t mplane_net_listen(struct mplane_net_ctx *ctx, int dev, void *handle, void **listen_comm) {
  (void)ctx;
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("listen: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  return g.ops->listen(dev, handle, listen_comm);
}

ncclResult_t mplane_net_connect(struct mplane_net_ctx *ctx, int traffic_class, int dev, void *handle,
                                void **send_comm) {
  if (dev < 0 || dev >= g.ndev) {
    MP_WARN("connect: device %d does not exist (%d devices)", dev, g.ndev);
    return ncclInvalidArgument;
  }
  struct mplane_comm_opts opts = {.traffic_class = traffic_class, .service_level = 0};
  if (opts.traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF && ctx) opts.traffic_class = ctx->traffic_class;
  return g.ops->connect(dev, &opts, handle, send_comm);
}

ncclResult_t mplane_net_accept(void *listen_comm, void **recv_comm) { return g.ops->accept(listen_comm, recv_comm); }

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
  return g.ops->isend(send_comm, data, size, tag, mhandle, request);
}

ncclResult_t mplane_net_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                              void **request) {
  return g.ops->irecv(recv_comm, n, data, sizes, tags, mhandles, request);
}

ncclResult_t mplane_net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request) {
  return g.ops->iflush(recv_comm, n, data, sizes, mhandles, request);
}

ncclResult_t mplane_net_test(void *request, int *done, int *sizes) { return g.ops->test(request, done, sizes); }

ncclResult_t mplane_net_close_send(void *send_comm) { return g.ops->close_send(send_comm); }
ncclResult_t mplane_net_close_recv(void *recv_comm) { return g.ops->close_recv(recv_comm); }
ncclResult_t mplane_net_close_listen(void *listen_comm) { return g.ops->close_listen(listen_comm); }

ncclResult_t mplane_net_set_attr(struct mplane_net_ctx *ctx, const ncclNetAttr_v11_t *attr) {
  if (!ctx || !attr) return ncclInvalidArgument;
  ctx->attr = *attr;
  ctx->has_attr = 1;
  return ncclSuccess;
}
