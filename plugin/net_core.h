/* mplane: the plugin's version-independent core. Every exported ncclNet_vN table is a thin
 * adapter over these functions (net_v8.c ... net_v12.c). */
#ifndef MPLANE_PLUGIN_NET_CORE_H
#define MPLANE_PLUGIN_NET_CORE_H

#include "../net/transport.h"
#include "../common/nccl/net.h"

/* One per NCCL communicator (net v11+ init), or one shared for older NCCLs. */
struct mplane_net_ctx {
  uint64_t comm_id;
  int traffic_class;      /* from ncclConfig_t.trafficClass, or UNDEF */
  ncclNetAttr_v11_t attr; /* latest setNetAttr hints */
  int has_attr;
};

/* Process-wide init (config, transport, devices) once; later calls return the first result. */
ncclResult_t mplane_net_global_init(ncclDebugLogger_t logger);
const struct mplane_transport_ops *mplane_net_transport(void);

ncclResult_t mplane_net_ctx_create(uint64_t comm_id, int traffic_class, struct mplane_net_ctx **out);
ncclResult_t mplane_net_ctx_destroy(struct mplane_net_ctx *ctx);
/* The context pre-v11 NCCLs get: one for the process, class from connect config. */
struct mplane_net_ctx *mplane_net_default_ctx(void);

ncclResult_t mplane_net_devices(int *ndev);
/* Points into storage that lives as long as the process (NCCL keeps name and pciPath). */
ncclResult_t mplane_net_get_properties(int dev, const struct mplane_dev_props **props);
/* Every device's properties (*ndev of them), the same storage: what a relay choice picks from. */
const struct mplane_dev_props *mplane_net_props(int *ndev);
ncclResult_t mplane_net_listen(struct mplane_net_ctx *ctx, int dev, void *handle, void **listen_comm);
ncclResult_t mplane_net_connect(struct mplane_net_ctx *ctx, int traffic_class, int dev, void *handle,
                                void **send_comm);
ncclResult_t mplane_net_accept(void *listen_comm, void **recv_comm);
ncclResult_t mplane_net_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle);
ncclResult_t mplane_net_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                      void **mhandle);
ncclResult_t mplane_net_dereg_mr(void *comm, void *mhandle);
ncclResult_t mplane_net_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void **request);
ncclResult_t mplane_net_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                              void **request);
/* The same with NCCL's profiler handles (net v10+; NULL: none): the transport reports the request's
 * events with them (net/profiler.h). */
ncclResult_t mplane_net_isend_ph(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                                 void **request);
ncclResult_t mplane_net_irecv_ph(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                                 void **phandles, void **request);
ncclResult_t mplane_net_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request);
ncclResult_t mplane_net_test(void *request, int *done, int *sizes);
ncclResult_t mplane_net_close_send(void *send_comm);
ncclResult_t mplane_net_close_recv(void *recv_comm);
ncclResult_t mplane_net_close_listen(void *listen_comm);
ncclResult_t mplane_net_set_attr(struct mplane_net_ctx *ctx, const ncclNetAttr_v11_t *attr);

/* Fill the common part of any props version from ours (name/pciPath point into static storage). */
#define MPLANE_FILL_PROPS_COMMON(out, p)        \
  do {                                          \
    (out)->name = (char *)(p)->name;                  \
    (out)->pciPath = (p)->pci_path[0] ? (char *)(p)->pci_path : NULL; \
    (out)->guid = (p)->guid;                    \
    (out)->ptrSupport = (p)->ptr_support;       \
    (out)->regIsGlobal = (p)->reg_is_global;    \
    (out)->speed = (p)->speed_mbps;             \
    (out)->port = (p)->port;                    \
    (out)->latency = (p)->latency_us;           \
    (out)->maxComms = (p)->max_comms;           \
    (out)->maxRecvs = (p)->max_recvs;           \
    (out)->netDeviceType = NCCL_NET_DEVICE_HOST; \
    (out)->netDeviceVersion = 0;                \
  } while (0)

/* The fields v9 added (forced flush, one-NIC vNIC, transfer limits), shared by v9..v12. */
#define MPLANE_FILL_PROPS_V9(out, p, dev)       \
  do {                                          \
    (out)->forceFlush = (p)->force_flush;       \
    (out)->vProps.ndevs = 1;                    \
    (out)->vProps.devs[0] = (dev);              \
    (out)->maxP2pBytes = (p)->max_p2p_bytes;    \
    (out)->maxCollBytes = (p)->max_coll_bytes;  \
  } while (0)

#endif
