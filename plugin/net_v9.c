/* mplane: ncclNet_v9 (NCCL 2.23): no profiler handles, no traffic class. */
#include "net_core.h"
#include "net_adapters.h"

static ncclResult_t v9_init(ncclDebugLogger_t logger) { return mplane_net_global_init(logger); }

static ncclResult_t v9_get_properties(int dev, ncclNetProperties_v9_t *out) {
  const struct mplane_dev_props *p;
  ncclResult_t res = mplane_net_get_properties(dev, &p);
  if (res != ncclSuccess) return res;
  MPLANE_FILL_PROPS_COMMON(out, p);
  MPLANE_FILL_PROPS_V9(out, p, dev);
  return ncclSuccess;
}

static ncclResult_t v9_listen(int dev, void *handle, void **listen_comm) {
  return mplane_net_listen(mplane_net_default_ctx(), dev, handle, listen_comm);
}

static ncclResult_t v9_connect(int dev, void *handle, void **send_comm, ncclNetDeviceHandle_v9_t **dev_comm) {
  (void)dev_comm;
  return mplane_net_connect(mplane_net_default_ctx(), NCCL_NET_TRAFFIC_CLASS_UNDEF, dev, handle, send_comm);
}

static ncclResult_t v9_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void **request) {
  return mplane_net_isend(send_comm, data, size, tag, mhandle, request);
}

static ncclResult_t v9_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                             void **request) {
  return mplane_net_irecv(recv_comm, n, data, sizes, tags, mhandles, request);
}


__attribute__((visibility("default"))) const ncclNet_v9_t ncclNetPlugin_v9 = {
    .name = "mplane",
    .init = v9_init,
    .devices = mplane_net_devices,
    .getProperties = v9_get_properties,
    .listen = v9_listen,
    .connect = v9_connect,
    .accept = mplane_adapter_accept,
    .regMr = mplane_net_reg_mr,
    .regMrDmaBuf = mplane_net_reg_mr_dmabuf,
    .deregMr = mplane_net_dereg_mr,
    .isend = v9_isend,
    .irecv = v9_irecv,
    .iflush = mplane_net_iflush,
    .test = mplane_net_test,
    .closeSend = mplane_net_close_send,
    .closeRecv = mplane_net_close_recv,
    .closeListen = mplane_net_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL, /* NULL: NCCL uses physical NICs; we never merge planes */
};
