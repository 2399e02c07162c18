/* mplane: the one seam between the NCCL-facing plugin layer and a transport.
 *
 * plugin/ speaks every ncclNet version NCCL may ask for and turns each call into a call of the
 * active transport's ops table. A transport (net/socket, net/ib) implements the table and nothing
 * else is shared by name: no "if (ib) ... else ..." outside this file's users.
 *
 * Contract, the same as NCCL's for its plugins: connect/accept never block (they return a NULL
 * comm until ready), isend/irecv may return a NULL request when they cannot start yet, test only
 * polls. Every wait ends in an error within a bounded time. */
#ifndef MPLANE_NET_TRANSPORT_H
#define MPLANE_NET_TRANSPORT_H

#include <stddef.h>
#include <stdint.h>
#include "../common/nccl/net.h"

struct mplane_config;
struct mplane_stats_comm;
struct mplane_stats_req;

/* What a transport knows of one of its devices; plugin/ turns it into every props version. */
struct mplane_dev_props {
  char name[64];         /* "eth0", "mlx5_0:1" */
  char pci_path[256];    /* /sys/devices/... real path, or "" when the NIC has none */
  uint64_t guid;         /* distinct per physical NIC */
  int ptr_support;       /* NCCL_PTR_* */
  int reg_is_global;
  int force_flush;
  int speed_mbps;
  int port;
  float latency_us;
  int max_comms;
  int max_recvs;
  size_t max_p2p_bytes;
  size_t max_coll_bytes;
  int plane;             /* network plane, -1 unknown */
  int rail;              /* rail id (= local NIC index on its plane), -1 unknown */
};

/* Per-communicator settings (net v10+ init/connect config, v11 setNetAttr). */
struct mplane_comm_opts {
  int traffic_class; /* NCCL_NET_TRAFFIC_CLASS_UNDEF or the communicator's class */
  int service_level; /* resolved SL / DSCP class index (0..15) */
  int tc_class;      /* resolved mplane class (common/tc_map.h enum mplane_tc_class) */
  int adaptive_routing; /* the class's adaptive-routing flag (MPLANE_TC_MAP ":ar") */
};

struct mplane_transport_ops {
  const char *name;
  /* Discover devices. Returns an error if the transport cannot run here (NCCL then falls back). */
  ncclResult_t (*init)(const struct mplane_config *cfg);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*get_properties)(int dev, struct mplane_dev_props *props);
  ncclResult_t (*listen)(int dev, void *handle, void **listen_comm);
  ncclResult_t (*connect)(int dev, const struct mplane_comm_opts *opts, void *handle, void **send_comm);
  ncclResult_t (*accept)(void *listen_comm, void **recv_comm);
  ncclResult_t (*reg_mr)(void *comm, void *data, size_t size, int type, void **mhandle);
  ncclResult_t (*reg_mr_dmabuf)(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                void **mhandle);
  ncclResult_t (*dereg_mr)(void *comm, void *mhandle);
  ncclResult_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle, void **request);
  ncclResult_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                        void **request);
  ncclResult_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request);
  /* sizes: n entries for a receive of n buffers, 1 for a send; may be NULL. */
  ncclResult_t (*test)(void *request, int *done, int *sizes);
  ncclResult_t (*close_send)(void *send_comm);
  ncclResult_t (*close_recv)(void *recv_comm);
  ncclResult_t (*close_listen)(void *listen_comm);
  void (*finalize)(void);
  /* NCCL variables this transport runs best with, as "NAME=value" strings ending in NULL; set at
   * init only where the user left them unset (MPLANE_NCCL_DEFAULTS=0 turns this off). May be NULL. */
  const char *const *nccl_env_defaults;
  /* The counters record (net/stats.h) inside a send (is_send 1) or receive (0) comm, and inside a send or receive
   * request (NULL for others, e.g. a flush): plugin/ counts each request through them without a
   * lookup, a lock or an allocation. Either may be NULL in the table: then nothing is counted. */
  struct mplane_stats_comm *(*comm_stats)(void *comm, int is_send);
  struct mplane_stats_req *(*req_stats)(void *request);
};

extern const struct mplane_transport_ops mplane_socket_ops;
extern const struct mplane_transport_ops mplane_ib_ops;

#endif
