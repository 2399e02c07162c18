/* mplane: ncclNet_v8 (NCCL 2.19 - 2.22): int sizes, so messages are limited to INT_MAX bytes. */
#include <limits.h>

#include "../common/log.h"
#include "net_core.h"
#include "net_adapters.h"

static ncclResult_t v8_init(ncclDebugLogger_t logger) { return mplane_net_global_init(logger); }

static ncclResult_t v8_get_properties(int dev, ncclNetProperties_v8_t *out) {
  const struct mplane_dev_props *p;
  ncclResult_t res = mplane_net_get_properties(dev, &p);
  if (res != ncclSuccess) return res;
  MPLANE_FILL_PROPS_COMMON(out, p);
  return ncclSuccess;
}

static ncclResult_t v8_listen(int dev, void *handle, void **listen_comm) {
  return mplane_net_listen(mplane_net_default_ctx(), dev, handle, listen_comm);
}

static ncclResult_t v8_connect(int dev, void *handle, void **send_comm, ncclNetDeviceHandle_v8_t **dev_comm) {
  (void)dev_comm;
  return mplane_net_connect(mplane_net_default_ctx(), NCCL_NET_TRAFFIC_CLASS_UNDEF, dev, handle, send_comm);
}

static ncclResult_t v8_isend(void *send_comm, void *data, int size, int tag, void *mhandle, void **request) {
  if (size < 0) {
    MP_WARN("isend: negative size %d", size);
    return ncclInvalidArgument;
  }
  return mplane_net_isend(send_comm, data, (size_t)size, tag, mhandle, request);
}

static ncclResult_t v8_irecv(void *recv_comm, int n, void **data, int *sizes, int *tags, void **mhandles,
                             void **request) {
  size_t wide[MPLANE_ADAPTER_MAX_RECVS];
  if (n < 1 || n > MPLANE_ADAPTER_MAX_RECVS) {
    MP_WARN("irecv: %d buffers, at most %d", n, MPLANE_ADAPTER_MAX_RECVS);
    return ncclInvalidArgument;
  }
  for (int i = 0; i < n; i++) {
    if (sizes[i] < 0) {
      MP_WARN("irecv: negative size %d", sizes[i]);
      return ncclInvalidArgument;
    }
    wide[i] = (size_t)sizes[i];
  }
  return mplane_net_irecv(recv_comm, n, data, wide, tags, mhandles, request);
}

__attribute__((visibility("default"))) const ncclNet_v8_t ncclNetPlugin_v8 = {
    .name = "mplane",
    .init = v8_init,
    .devices = mplane_net_devices,
    .getProperties = v8_get_properties,
    .listen = v8_listen,
    .connect = v8_connect,
    .accept = mplane_adapter_accept,
    .regMr = mplane_net_reg_mr,
    .regMrDmaBuf = mplane_net_reg_mr_dmabuf,
    .deregMr = mplane_net_dereg_mr,
    .isend = v8_isend,
    .irecv = v8_irecv,
    .iflush = mplane_net_iflush,
    .test = mplane_net_test,
    .closeSend = mplane_net_close_send,
    .closeRecv = mplane_net_close_recv,
    .closeListen = mplane_net_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
};
