/* mplane: ncclNet_v11 (NCCL 2.27 - 2.29, the one our machines run). Same calls as v12; the
 * properties have no planeId/railId and vNICs hold at most 4 devices. */
#include "net_core.h"
#include "net_adapters.h"

static ncclResult_t v11_get_properties(int dev, ncclNetProperties_v11_t *out) {
  const struct mplane_dev_props *p;
  ncclResult_t res = mplane_net_get_properties(dev, &p);
  if (res != ncclSuccess) return res;
  MPLANE_FILL_PROPS_COMMON(out, p);
  MPLANE_FILL_PROPS_V9(out, p, dev);
  out->maxMultiRequestSize = 1;
  return ncclSuccess;
}


__attribute__((visibility("default"))) const ncclNet_v11_t ncclNetPlugin_v11 = {
    .name = "mplane",
    .init = mplane_adapter_init_ctx,
    .devices = mplane_net_devices,
    .getProperties = v11_get_properties,
    .listen = mplane_adapter_listen_ctx,
    .connect = mplane_adapter_connect_ctx,
    .accept = mplane_adapter_accept,
    .regMr = mplane_net_reg_mr,
    .regMrDmaBuf = mplane_net_reg_mr_dmabuf,
    .deregMr = mplane_net_dereg_mr,
    .isend = mplane_adapter_isend_ph,
    .irecv = mplane_adapter_irecv_ph,
    .iflush = mplane_net_iflush,
    .test = mplane_net_test,
    .closeSend = mplane_net_close_send,
    .closeRecv = mplane_net_close_recv,
    .closeListen = mplane_net_close_listen,
    .getDeviceMr = NULL,
    .irecvConsumed = NULL,
    .makeVDevice = NULL, /* NULL: NCCL uses physical NICs; we never merge planes */
    .finalize = mplane_adapter_finalize,
    .setNetAttr = mplane_adapter_set_attr,
};
