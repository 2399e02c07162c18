/* mplane: the InfiniBand / RoCE transport's ops table (net/transport.h); see ib.h for the design. */
#include "../../common/log.h"
#include "ib.h"

static ncclResult_t ib_init(const struct mplane_config *cfg) { return mpib_discover(cfg); }

static ncclResult_t ib_devices(int *ndev) {
  *ndev = mpib_dev_count();
  return ncclSuccess;
}

static ncclResult_t ib_get_properties(int dev, struct mplane_dev_props *props) {
  struct mpib_dev *d = mpib_dev_get(dev);
  if (!d) return ncclInvalidArgument;
  *props = d->props;
  return ncclSuccess;
}

static void ib_finalize(void) { mpib_shutdown(); }

/* Send and receive comms start with their struct mpib_comm_base; requests with their kind. */
static struct mplane_stats_comm *ib_comm_stats(void *comm, int is_send) {
  (void)is_send;
  return &((struct mpib_comm_base *)comm)->stats;
}

static struct mplane_stats_req *ib_req_stats(void *request) {
  switch (*(const uint32_t *)request) {
  case MPIB_REQ_SEND: return &((struct mpib_send_req *)request)->stats;
  case MPIB_REQ_RECV: return &((struct mpib_recv_req *)request)->stats;
  default: return NULL;
  }
}

const struct mplane_transport_ops mplane_ib_ops = {
    .name = "ib",
    .init = ib_init,
    .devices = ib_devices,
    .get_properties = ib_get_properties,
    .listen = mpib_listen,
    .connect = mpib_connect,
    .accept = mpib_accept,
    .reg_mr = mpib_reg_mr,
    .reg_mr_dmabuf = mpib_reg_mr_dmabuf,
    .dereg_mr = mpib_dereg_mr,
    .isend = mpib_isend,
    .irecv = mpib_irecv,
    .iflush = mpib_iflush,
    .test = mpib_test,
    .close_send = mpib_close_send,
    .close_recv = mpib_close_recv,
    .close_listen = mpib_close_listen,
    .finalize = ib_finalize,
    .comm_stats = ib_comm_stats,
    .req_stats = ib_req_stats,
    .rma = &mpib_rma_ops,
};
