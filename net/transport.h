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
#include "../topo/planes.h" /* enum mplane_subnet_kind */

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
  char near_gpu[16];     /* PCI bus id of a GPU paired with this NIC ("0000:19:00.0"), "" none: where
                          * a relayed connection carried by this NIC stages GPU buffers */
  /* The subnet the transport found the device on (an IB port's GID prefix; where every port keeps
   * the default prefix, what the subnet probe found): a fact for topo/ to place planes by
   * (topo/planes.c), used where the node's files show none. Devices with equal (subnet_kind,
   * subnet_key) share a subnet. */
  int subnet_kind;       /* enum mplane_subnet_kind (topo/planes.h); MPLANE_SUBNET_NONE: none found */
  uint64_t subnet_key;
  char subnet[48];       /* how INFO lines name it */
};

/* Per-communicator settings (net v10+ init/connect config, v11 setNetAttr). */
struct mplane_comm_opts {
  int traffic_class; /* NCCL_NET_TRAFFIC_CLASS_UNDEF or the communicator's class */
  int service_level; /* resolved SL / DSCP class index (0..15) */
  int tc_class;      /* resolved mplane class (common/tc_map.h enum mplane_tc_class) */
  int comm_tclass;   /* RoCE traffic class the communicator asked for (net/tc.h), -1 none */
  int adaptive_routing; /* the class's adaptive-routing flag (MPLANE_TC_MAP ":ar") */
  int relayed;       /* 1: carried by the relay NIC (net/relay.h); a transport that takes GPU buffers
                      * stages them through the relay's copier into memory beside that NIC */
  char staging_gpu[16]; /* relayed: the relay NIC's near_gpu, the GPU whose memory holds the staging */
};

/* One-sided (RMA) ops, what NCCL's GIN proxy drives through ncclRmaPlugin_v14/v15/v16 (plugin/rma_plugin.c).
 * A group is nranks processes that connected together; a context set is create_context's
 * connections; windows are registered symmetrically (every rank, same order) and named by the
 * caller's own handle. listen/connect/create_context are collective and may block, each bounded by
 * MPLANE_CONNECT_TIMEOUT; the ops never block; test only polls. An op the target refuses (a range
 * outside its window, an unknown signal op) or a dead peer ends in an error from test and
 * query_last_error naming the peer and the window, and nothing is written out of bounds. */
struct mplane_rma_ctx_opts {
  int ncontexts;
  int rank_stride;   /* connect ranks rank +- k*stride only; nranks % stride == 0 */
  int service_level; /* from the class (net/tc.h), like two-sided comms */
  int tc_class;
  int comm_tclass;   /* RoCE traffic class the communicator asked for (net/tc.h), -1 none */
};

struct mplane_rma_signal {
  uint64_t off;      /* byte offset of a 64-bit word in the signal window */
  void *mhandle;     /* the signal window (the caller's handle) */
  uint64_t value;    /* added for NCCL_NET_SIGNAL_OP_ADD */
  uint32_t op;       /* NCCL_NET_SIGNAL_OP_INC / _ADD; anything else is refused */
};

/* A transport's RMA handle leaves the last bytes of NCCL's handle free: the plugin keeps the plane of
 * the listening device there (plugin/rma_plugin.c). */
#define MPLANE_RMA_HANDLE_MAX (NCCL_NET_HANDLE_MAXSIZE - 8)

/* The planes of a group, as the plugin resolved them (MPLANE_PLANES, the topology, the handles'
 * plane tags), for a transport that carries cross-plane connections through the relay (net/relay.h). */
struct mplane_rma_route {
  const struct mplane_dev_props *devs; /* this node's devices, the plugin's view (lives as long as it) */
  int ndev;
  int dev;                /* the group's own device, the one it listened on */
  const int *rank_plane;  /* [nranks]: plane of each rank's listening device, -1 unknown (copied) */
  int relay_mode;         /* MPLANE_RELAY (enum mplane_relay_mode) */
};

struct mplane_rma_ops {
  ncclResult_t (*listen)(int dev, void *handle, void **listen_comm);
  ncclResult_t (*close_listen)(void *listen_comm);
  ncclResult_t (*connect)(void *handles[], int nranks, int rank, void *listen_comm, void **group);
  ncclResult_t (*close_group)(void *group);
  ncclResult_t (*create_context)(void *group, const struct mplane_rma_ctx_opts *opts, void **ctx);
  ncclResult_t (*destroy_context)(void *ctx);
  ncclResult_t (*reg_mr_sym)(void *group, void *data, size_t size, int type, uint64_t flags, void **mhandle);
  /* May be NULL (the transport reaches the bytes by address). Else the window [data, data + size) is
   * registered through the dma-buf fd (offset into it); the fd is the caller's, closed after. */
  ncclResult_t (*reg_mr_sym_dmabuf)(void *group, void *data, size_t size, int type, uint64_t offset, int fd,
                                    uint64_t flags, void **mhandle);
  ncclResult_t (*dereg_mr_sym)(void *group, void *mhandle);
  /* sig NULL: a plain put; size 0 with sig: the signal alone (src/dst handles may be NULL). */
  ncclResult_t (*iput)(void *ctx, int context, uint64_t src_off, void *src_mh, size_t size, uint64_t dst_off,
                       void *dst_mh, uint32_t rank, const struct mplane_rma_signal *sig, void **request);
  ncclResult_t (*iget)(void *ctx, int context, uint64_t remote_off, void *remote_mh, size_t size,
                       uint64_t local_off, void *local_mh, uint32_t rank, void **request);
  /* *request NULL: nothing to flush (completed gets are already visible). */
  ncclResult_t (*iflush)(void *ctx, int context, void *mhandle, uint32_t rank, void **request);
  ncclResult_t (*test)(void *group, void *request, int *done);
  ncclResult_t (*progress)(void *ctx); /* may be NULL: the transport's threads move the data */
  ncclResult_t (*query_last_error)(void *ctx, int *has_error);
  /* May be NULL: the transport reaches every rank by its address. Else called once right after
   * connect, before anything else on the group: a connection to a rank on another plane is then
   * carried by a device of this node on that plane (or by the peer's device on this one). */
  ncclResult_t (*route)(void *group, const struct mplane_rma_route *route);
  /* May be NULL (then: the group's device). The local device that carries ctx's ops to rank. */
  int (*carrier)(void *ctx, uint32_t rank);
  /* May be NULL (then every op goes out as it is posted). NCCL's aggregation hint (RMA v15+,
   * plugin/rma_hint.h): hold(ctx, context, rank, 1) comes before an op that another op of the same
   * context to the same rank follows at once; from then on the transport may keep what those ops
   * send back, to send it together (one sendmsg, one chained ibv_post_send), until
   * hold(ctx, context, rank, 0), which sends it. The plugin ends every hold it begins: after the op
   * posted without the hint, before an iflush or progress on ctx, and before destroy_context. Ops
   * keep their order and meaning; a request being tested must not stay held (test sends it). */
  void (*hold)(void *ctx, int context, uint32_t rank, int on);
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
  /* phandle / phandles[i]: NCCL's profiler handles for the request's events (net/profiler.h), or NULL
   * (phandles may be NULL too). */
  ncclResult_t (*isend)(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                        void **request);
  ncclResult_t (*irecv)(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                        void **phandles, void **request);
  ncclResult_t (*iflush)(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request);
  /* sizes: n entries for a receive of n buffers, 1 for a send; may be NULL. */
  ncclResult_t (*test)(void *request, int *done, int *sizes);
  ncclResult_t (*close_send)(void *send_comm);
  ncclResult_t (*close_recv)(void *recv_comm);
  ncclResult_t (*close_listen)(void *listen_comm);
  void (*finalize)(void);
  /* NCCL variables this transport runs best with on the devices init found, as "NAME=value"
   * strings ending in NULL; set at init only where the user left them unset (MPLANE_NCCL_DEFAULTS=0
   * turns this off). NULL or a NULL function: none. */
  const char *const *(*nccl_env_defaults)(void);
  /* The counters record (net/stats.h) inside a send (is_send 1) or receive (0) comm, and inside a send or receive
   * request (NULL for others, e.g. a flush): plugin/ counts each request through them without a
   * lookup, a lock or an allocation. Either may be NULL in the table: then nothing is counted. */
  struct mplane_stats_comm *(*comm_stats)(void *comm, int is_send);
  struct mplane_stats_req *(*req_stats)(void *request);
  /* One-sided ops; NULL: this transport serves none (the ncclRmaPlugin tables' init then fails and NCCL
   * uses its own RMA backend). */
  const struct mplane_rma_ops *rma;
  /* Tuner rows (the MPLANE_TUNER_CONFIG format, docs/tuner.md) this transport runs best with on
   * the devices init found, for communicators of several nodes; used where the user gives no table
   * (MPLANE_NCCL_DEFAULTS=0 turns this off). NULL or a NULL function: none. */
  const char *(*tuner_defaults)(void);
};

extern const struct mplane_transport_ops mplane_socket_ops;
extern const struct mplane_transport_ops mplane_ib_ops;

#endif
