/* mplane: calls shared by several ncclNet_vN tables (same signature in those versions). */
#ifndef MPLANE_PLUGIN_NET_ADAPTERS_H
#define MPLANE_PLUGIN_NET_ADAPTERS_H

#include "../common/nccl/net.h"

#define MPLANE_ADAPTER_MAX_RECVS 8

/* v11/v12: per-communicator init and the calls that take its context. */
ncclResult_t mplane_adapter_init_ctx(void **ctx, uint64_t comm_id, ncclNetCommConfig_v11_t *config,
                                     ncclDebugLogger_t logger, ncclProfilerCallback_t prof);
ncclResult_t mplane_adapter_listen_ctx(void *ctx, int dev, void *handle, void **listen_comm);
ncclResult_t mplane_adapter_connect_ctx(void *ctx, int dev, void *handle, void **send_comm,
                                        ncclNetDeviceHandle_v11_t **dev_comm);
ncclResult_t mplane_adapter_finalize(void *ctx);
ncclResult_t mplane_adapter_set_attr(void *ctx, ncclNetAttr_v11_t *attr);
/* v8+: accept without device offload. */
ncclResult_t mplane_adapter_accept(void *listen_comm, void **recv_comm, ncclNetDeviceHandle_v8_t **dev_comm);
/* v10+: isend/irecv with profiler handles (the transports' events carry them, net/profiler.h). */
ncclResult_t mplane_adapter_isend_ph(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                                     void **request);
ncclResult_t mplane_adapter_irecv_ph(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                                     void **phandles, void **request);

#endif
