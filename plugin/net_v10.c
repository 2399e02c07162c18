/* mplane: ncclNet_v10 (NCCL 2.24 - 2.26): one process-wide init, traffic class given per connect. */
#include "net_core.h"
#include "net_adapters.h"
#include "../net/profiler.h"

static ncclResult_t v10_init(ncclDebugLogger_t logger, ncclProfilerCallback_t prof) {
  ncclResult_t res = mplane_net_global_init(logger);
  if (res == ncclSuccess) mplane_prof_set_callback(prof);
  return res;
}

static ncclResult_t v10_get_properties(int dev, ncclNetProperties_v10_t *out) {
  const struct mplane_dev_props *p;
  ncclResult_t res = mplane_net_get_properties(dev, &p);
  if (res != ncclSuccess) return res;
  MPLANE_FILL_PROPS_COMMON(out, p);
  MPLANE_FILL_PROPS_V9(out, p, dev);
  return ncclSuccess;
}

static ncclResult_t v10_listen(int dev, void *handle, void **listen_comm) {
  return mplane_net_listen(mplane_net_default_ctx(), dev, handle, listen_comm);
}

static ncclResult_t v10_connect(int dev, ncclNetCommConfig_v10_t *config, void *handle, void **send_comm,
                                ncclNetDeviceHandle_v10_t **dev_comm) {
  (void)dev_comm;
  int tc = config ? config->trafficClass : NCCL_NET_TRAFFIC_CLASS_UNDEF;
  return mplane_net_connect(mplane_net_default_ctx(), tc, dev, handle, send_comm);
}


__attribute__((visibility("default"))) const ncclNet_v10_t ncclNetPlugin_v10 = {
    .name = "mplane",
    .init = v10_init,
    .devices = mplane_net_devices,
    .getProperties = v10_get_properties,
    .listen = v10_listen,
    .connect = v10_connect,
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
};
