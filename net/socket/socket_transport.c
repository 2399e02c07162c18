/* mplane: the socket transport's ops table (net/transport.h). */
#include <stdlib.h>
#include <string.h>

#include "../../common/log.h"
#include "socket.h"

static const struct mplane_config *socket_cfg;

static ncclResult_t socket_init(const struct mplane_config *cfg) {
  socket_cfg = cfg;
  return mps_iface_discover(cfg);
}

static ncclResult_t socket_devices(int *ndev) {
  *ndev = mps_dev_count();
  return ncclSuccess;
}

static ncclResult_t socket_get_properties(int dev, struct mplane_dev_props *props) {
  const struct mps_dev *d = mps_dev_get(dev);
  if (!d) return ncclInvalidArgument;
  *props = d->props;
  return ncclSuccess;
}

/* Host memory needs no registration for TCP; the handle only records what NCCL told us. */
struct mps_mr {
  void *data;
  size_t size;
  int type;
};

static ncclResult_t socket_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle) {
  (void)comm;
  if (type != NCCL_PTR_HOST) {
    MP_WARN("socket: regMr of memory type %d; the socket transport carries host memory only (ptrSupport HOST)",
            type);
    return ncclInvalidUsage;
  }
  struct mps_mr *mr = malloc(sizeof(*mr));
  if (!mr) return ncclSystemError;
  mr->data = data;
  mr->size = size;
  mr->type = type;
  *mhandle = mr;
  return ncclSuccess;
}

static ncclResult_t socket_dereg_mr(void *comm, void *mhandle) {
  (void)comm;
  free(mhandle);
  return ncclSuccess;
}

static ncclResult_t socket_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request) {
  /* Host memory is coherent: nothing to flush, and NCCL accepts a NULL request for that. */
  (void)recv_comm; (void)n; (void)data; (void)sizes; (void)mhandles;
  *request = NULL;
  return ncclSuccess;
}

static void socket_finalize(void) {}

const struct mplane_config *mps_config(void) { return socket_cfg; }

static struct mplane_stats_comm *socket_comm_stats(void *comm, int is_send) {
  return is_send ? &((struct mps_send_comm *)comm)->stats : &((struct mps_recv_comm *)comm)->stats;
}

/* Requests carry their kind in their first word. */
static struct mplane_stats_req *socket_req_stats(void *request) {
  switch (*(const uint32_t *)request) {
  case MPS_REQ_SEND: return &((struct mps_send_req *)request)->stats;
  case MPS_REQ_RECV: return &((struct mps_recv_req *)request)->stats;
  default: return NULL;
  }
}

/* The defaults follow what the link is (socket.h: its rate, from the driver, or the host's for a
 * host-copied link such as loopback or a veth pair), one rule for every kind of link:
 *
 * Below MPS_FAST_LINK_MBPS (a 10/25/40 GbE NIC, loopback or a veth pair on a host of fewer than
 * 4 CPUs): TCP moves each message through the kernel twice, and bigger steps amortise the per-message
 * cost. 512 KiB point-to-point chunks and 8 MiB buffers (1 MiB steps) are what NCCL's own guidance
 * and aws-ofi-nccl use for software-driven transports. */
static const char *const socket_nccl_env[] = {"NCCL_P2P_NET_CHUNKSIZE=524288", "NCCL_BUFFSIZE=8388608", NULL};

/* At MPS_FAST_LINK_MBPS or more (a 100 GbE NIC; loopback or a veth pair on 4+ CPUs, whose rate is
 * the host's) one channel's TCP streams cannot fill the link, and the host's cores at both ends
 * do: NCCL's own 4 MiB buffers (1 MiB slices) with 8 channels moved all_reduce of 32 MiB 6-16%,
 * 64 MiB 5-18% and 128 MiB 6-11% faster than 8 MiB buffers on 4 channels, in four sets of runs on
 * one H200 with 16 cores (two emulated nodes over loopback, at 400 Gb/s); 4 MiB buffers on 4 channels lose
 * 7-8% at 128 MiB, and 8 channels up to 21% from 4 to 16 MiB, so the rows below keep those sizes
 * on 4 (docs/results/2026-12-02-buffers-and-channels.md; docs/results/2026-12-02-defaults-by-link-veth.md
 * has the same choice measured on a veth pair). */
static const char *const socket_fast_env[] = {"NCCL_P2P_NET_CHUNKSIZE=524288", "NCCL_BUFFSIZE=4194304",
                                              "NCCL_MIN_NCHANNELS=8", NULL};

static const char *const *socket_env_defaults(void) { return mps_fast_links() ? socket_fast_env : socket_nccl_env; }

/* At 100 Gb/s and more NCCL runs all_reduce from 32 KiB to 1 MiB as LL on 4 channels: over TCP,
 * LL's many half-full steps cost 1.2-1.7x NCCL Socket's time, which at 10 Gb/s gets Simple on 2
 * channels from 64 KiB (one H200 with 16 cores, two emulated nodes at 400 Gb/s, nccl-tests 2.19.6 all_reduce,
 * docs/results/2026-12-01-eager-small-messages.md). These rows give those sizes Simple, on one channel up to
 * 512 KiB (each ring step then moves the whole slice in one message: 64-256 KiB took 0.75-0.80x the
 * time of 2 channels) and on 4 from 512 KiB to 1 MiB (where 2 took 20-29% longer at 512 KiB, and 1
 * took 4-5% longer at 512 KiB and 14-17% at 1 MiB), sizes above 2 MiB and below 32 MiB the 4
 * channels that double all_reduce's bandwidth there, and bigger ones all 8 that socket_fast_env
 * asks NCCL for. A table of the user's (MPLANE_TUNER_CONFIG) replaces them; without the tuner,
 * all_reduce from 2 to 32 MiB runs on 8 channels. */
static const char socket_fast_tuner[] =
    "collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks\n"
    "allreduce,32K,65535,-1,-1,2,-1,-1\n"
    "allreduce,64K,524287,ring,simple,1,-1,-1\n"
    "allreduce,512K,1M,ring,simple,4,-1,-1\n"
    "allreduce,1048577,2M,ring,simple,2,-1,-1\n"
    "allreduce,2097153,33554431,-1,-1,4,-1,-1\n";

static const char *socket_tuner_defaults(void) { return mps_fast_links() ? socket_fast_tuner : NULL; }

const struct mplane_transport_ops mplane_socket_ops = {
    .name = "socket",
    .init = socket_init,
    .devices = socket_devices,
    .get_properties = socket_get_properties,
    .listen = mps_listen,
    .connect = mps_connect,
    .accept = mps_accept,
    .reg_mr = socket_reg_mr,
    .reg_mr_dmabuf = NULL,
    .dereg_mr = socket_dereg_mr,
    .isend = mps_isend,
    .irecv = mps_irecv,
    .iflush = socket_iflush,
    .test = mps_test,
    .close_send = mps_close_send,
    .close_recv = mps_close_recv,
    .close_listen = mps_close_listen,
    .finalize = socket_finalize,
    .nccl_env_defaults = socket_env_defaults,
    .comm_stats = socket_comm_stats,
    .req_stats = socket_req_stats,
    .rma = &mps_rma_ops,
    .tuner_defaults = socket_tuner_defaults,
};
