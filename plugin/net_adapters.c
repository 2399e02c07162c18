/* mplane: calls shared by several ncclNet_vN tables (see net_adapters.h). */
#include "net_adapters.h"

#include "../common/log.h"
#include "../net/profiler.h"
#include "net_core.h"

ncclResult_t mplane_adapter_init_ctx(void **ctx, uint64_t comm_id, ncclNetCommConfig_v11_t *config,
                                     ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = mplane_net_global_init(logger);
  if (res != ncclSuccess) return res;
  mplane_prof_set_callback(prof); /* NULL: no events (net/profiler.h) */
  int tc = config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return mplane_net_ctx_create(comm_id, tc, (struct mplane_net_ctx **)ctx);
}

ncclResult_t mplane_adapter_listen_ctx(void *ctx, int dev, void *handle, void **listen_comm) {
  return mplane_net_listen(ctx, dev, handle, listen_comm);
}

ncclResult_t mplane_adapter_connect_ctx(void *ctx, int dev, void *handle, void **send_comm,
                                        ncclNetDeviceHandle_v11_t **dev_comm) {
  (void)dev_comm; /* no device offload: NCCL's proxy moves the data */
  return mplane_net_connect(ctx, NCCL_NET_TRAFFIC_CLASS_UNDEF, dev, handle, send_comm);
}

ncclResult_t mplane_adapter_finalize(void *ctx) { return mplane_net_ctx_destroy(ctx); }

ncclResult_t mplane_adapter_set_attr(void *ctx, ncclNetAttr_v11_t *attr) { return mplane_net_set_attr(ctx, attr); }

ncclResult_t mplane_adapter_accept(void *listen_comm, void **recv_comm, ncclNetDeviceHandle_v8_t **dev_comm) {
  (void)dev_comm;
  return mplane_net_accept(listen_comm, recv_comm);
}

ncclResult_t mplane_adapter_isend_ph(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                                     void **request) {
  return mplane_net_isend_ph(send_comm, data, size, tag, mhandle, phandle, request);
}

ncclResult_t mplane_adapter_irecv_ph(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                                     void **phandles, void **request) {
  return mplane_net_irecv_ph(recv_comm, n, data, sizes, tags, mhandles, phandles, request);
}
