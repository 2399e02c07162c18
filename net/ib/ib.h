/* mplane: the InfiniBand / RoCE transport's shared state (net/ib/).
 *
 * Devices. Every active port (IB or RoCE) of the HCAs MPLANE_IB_HCA selects is one NCCL device,
 * and one network plane. libibverbs is opened with dlopen (MPLANE_IBVERBS_LIB, default
 * libibverbs.so.1) through the table in ib_verbs.c, so the plugin loads where rdma-core is absent.
 *
 * Connections. A connection has MPLANE_IB_QPS reliable-connected QPs on each side, one CQ per comm,
 * and a TCP socket used to exchange QP numbers, addresses and keys (the listen handle carries its
 * address) and, afterwards, only to notice that the peer process is gone.
 *
 * Data (receiver driven, as on sockets). Each irecv of n <= 8 buffers writes one FIFO slot of n
 * 64-byte elements {addr, rkey, size, tag, n, seq} into the sender's memory with an RDMA write; the
 * sender only ever writes where a slot says, so a short receive buffer is caught before a byte moves. A send
 * matched to entry e of slot k is cut into chunks striped over the QPs, each an RDMA write with
 * immediate (imm = slot, entry, chunk, chunk count, seq); the receiver counts chunks and bytes from
 * its completions. A send whose tag the oldest slot does not offer (untaken) waits with a NULL
 * request: a later group's send on a shared comm (net/tag_wait.h). With adaptive routing (per
 * connection, mpib_ar_choose) a chunk of a message above MPLANE_IB_AR_THRESHOLD is a plain RDMA write
 * followed by an 8-byte write with immediate carrying the chunk's length, as packets may then arrive
 * out of order. MPLANE_IB_SPLIT_DATA_ON_QPS=0 sends each message whole on one QP, round-robin.
 * A message that does not fit sends only an immediate with the TRUNC bit: both sides fail with
 * ncclInvalidUsage and nothing is written. */
#ifndef MPLANE_NET_IB_H
#define MPLANE_NET_IB_H

#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "../../common/config.h"
#include "../handle.h"
#include "../stats.h"
#include "../tag_wait.h"
#include "../transport.h"
#include "../transport_base.h"

#define MPIB_MAX_DEVS 64
#define MPIB_MAX_QPS 16
#define MPIB_MAX_RECVS 8
#define MPIB_MAX_REQS NCCL_NET_MAX_REQUESTS          /* receive groups (FIFO slots) in flight */
#define MPIB_MAX_SENDS (MPIB_MAX_REQS * MPIB_MAX_RECVS) /* send requests in flight */
#define MPIB_MAX_FLUSHES MPIB_MAX_SENDS                 /* iflush requests in flight: more than NCCL can have */
#define MPIB_CHUNK_MIN (64 * 1024)                      /* smaller messages ride one QP */
/* The largest message: NCCL's maxP2pBytes and maxCollBytes, and ConnectX's max_msg_sz (a longer
 * work request ends in a local length error), so every chunk fits one work request. */
#define MPIB_MAX_MSG (1UL << 30)
/* Queue depths per role, for what each QP really posts (NCCL's net_ib sizes them the same way):
 * a sender's QP writes at most a chunk and an AR length record per send in flight and receives
 * nothing; a receiver's QP writes FIFO slots and takes one receive per chunk or record it is sent;
 * the flush QP reads, one per flush in flight. */
#define MPIB_SEND_SQ (2 * MPIB_MAX_SENDS + 8)
#define MPIB_RECV_SQ (MPIB_MAX_REQS + 8)
#define MPIB_FIFO_SIGNAL_EVERY 16 /* one FIFO write in this many per QP asks for a completion */
#define MPIB_RQ_DEPTH (2 * MPIB_MAX_SENDS + 16)
#define MPIB_FLUSH_SQ (MPIB_MAX_FLUSHES + 8)
#define MPIB_INLINE 16 /* the AR length record (8 bytes) goes inline; nothing else does */

/* ---- the dlopen'ed libibverbs ---- */
struct mpib_verbs {
  void *lib;
  struct ibv_device **(*get_device_list)(int *);
  void (*free_device_list)(struct ibv_device **);
  const char *(*get_device_name)(struct ibv_device *);
  struct ibv_context *(*open_device)(struct ibv_device *);
  int (*close_device)(struct ibv_context *);
  int (*query_device)(struct ibv_context *, struct ibv_device_attr *);
  int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
  int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);
  int (*query_gid_ex)(struct ibv_context *, uint32_t, uint32_t, struct ibv_gid_entry *, uint32_t, size_t); /* opt */
  struct ibv_pd *(*alloc_pd)(struct ibv_context *);
  int (*dealloc_pd)(struct ibv_pd *);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
  struct ibv_mr *(*reg_dmabuf_mr)(struct ibv_pd *, uint64_t, size_t, uint64_t, int, int); /* optional */
  struct ibv_mr *(*reg_mr_iova2)(struct ibv_pd *, void *, size_t, uint64_t, unsigned int);  /* optional */
  int (*dereg_mr)(struct ibv_mr *);
  struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
  int (*destroy_cq)(struct ibv_cq *);
  struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
  int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
  int (*destroy_qp)(struct ibv_qp *);
  int (*query_ece)(struct ibv_qp *, struct ibv_ece *); /* optional (rdma-core >= 31) */
  int (*set_ece)(struct ibv_qp *, struct ibv_ece *);   /* optional */
  int (*fork_init)(void); /* optional */
  int (*get_async_event)(struct ibv_context *, struct ibv_async_event *);
  void (*ack_async_event)(struct ibv_async_event *);
};
extern struct mpib_verbs mpib_v;

/* A port's attributes with room for fields newer rdma-core appends: rdma-core >= 48 adds
 * active_speed_ex after port_cap_flags2 (XDR and later speeds do not fit active_speed's 8 bits; the
 * kernel then leaves active_speed 0). The headers we build with may predate it, so it is read at its
 * offset, and a library that does not know it leaves it 0. */
#define MPIB_PORT_SPEED_EX_OFFSET 52
_Static_assert(offsetof(struct ibv_port_attr, port_cap_flags2) + sizeof(uint16_t) <= MPIB_PORT_SPEED_EX_OFFSET,
               "active_speed_ex follows port_cap_flags2");
struct mpib_port_attr {
  union {
    struct ibv_port_attr a;
    unsigned char raw[128];
  };
};
/* ibv_query_port as rdma-core's verbs.h does it: through the context's size-aware query_port where
 * the library has an extended context (it fills what both it and we know, zeroes the rest), else the
 * exported ibv_query_port (which fills only the original fields, up to `flags`). 0 on success. */
int mpib_query_port(struct ibv_context *ctx, int port, struct mpib_port_attr *out);
/* active_speed_ex, 0 when the library did not report it. */
uint32_t mpib_port_speed_ex(const struct mpib_port_attr *pa);
/* A port's rate in Mb/s from active_speed, active_speed_ex (preferred when not 0) and
 * active_width, as IB encodes them (speed: one bit per lane rate, SDR 1 .. XDR 256). */
int mpib_port_speed_mbps(unsigned active_speed, uint32_t active_speed_ex, unsigned active_width);
/* 0 on success; else a reason in why (library missing, symbol missing). */
int mpib_verbs_load(const char *libname, char *why, size_t whylen);
const char *mpib_wc_status_str(int status);
const char *mpib_event_str(int type);

/* ---- errors shared by a comm's users (proxy thread, async thread): the transport base's slot
 * (net/transport_base.h) ---- */
#define mpib_error_set mplane_error_set
/* The error (with a WARN the first time) or ncclSuccess; a message being written reads ncclSuccess
 * until it is (the callers look again on their next call). */
static inline ncclResult_t mpib_error_check(struct mplane_error *e) { return mplane_error_peek(e, "NET/IB"); }

/* ---- devices ---- */
struct mpib_hca { /* one opened HCA, shared by its ports */
  char name[64];
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_device_attr attr;
  pthread_t async_thread;
  int async_started;
  int async_broken;       /* ibv_get_async_event failures (async thread only) */
  int dmabuf;             /* its verbs take dma-buf registrations (probed once) */
};

struct mpib_dev { /* one port = one NCCL device */
  struct mpib_hca *hca;
  int port;
  int link_layer;         /* IBV_LINK_LAYER_* */
  int grh_required;       /* IB port that takes only global addresses (IBV_QPF_GRH_REQUIRED: SR-IOV VFs) */
  uint16_t lid;
  uint16_t sm_lid;        /* IB: the LID of the subnet manager that manages the port */
  int gid_index;          /* RoCE: the GID index last resolved (atomic: connections resolve it anew); IB: 0 */
  union ibv_gid gid;
  enum ibv_mtu mtu;
  struct sockaddr_storage oob;  /* address of the TCP side channel */
  socklen_t ooblen;
  struct mplane_dev_props props;
};

/* Which of the n IB ports devs share a subnet, from their LIDs, SM LIDs and a probe
 * (an RC write with a GRH from each port to each other one, within a deadline): group[i] is port i's
 * subnet, numbered by first port; returns the number of subnets, or -1 (undecided) with why. */
/* NCCL's device order: PCI paths compared by their last component's bus id, unknown ("") last. */
int mpib_pci_order_cmp(const char *a, const char *b);
int mpib_subnet_groups(struct mpib_dev *devs, int n, int *group, char *why, size_t whylen);

int mpib_dev_count(void);
struct mpib_dev *mpib_dev_get(int dev);
ncclResult_t mpib_discover(const struct mplane_config *cfg);
const struct mplane_config *mpib_config(void);
void mpib_shutdown(void);
/* 1 if an NCCL_IB_HCA-style spec selects (name, port). Exposed for unit tests. */
int mpib_hca_match(const char *spec, const char *name, int port);
/* How good an interface is for the side channel when nothing names one: 0 IPoIB (ib*), 1 another,
 * -1 never (docker*, loopback), as NCCL's default. */
int mpib_oob_rank(const char *ifname, int loopback);
/* How good an address is for the side channel under MPLANE_IB_SOCKET_FAMILY (family): 0 IPv4, 1 IPv6,
 * -1 never (the other family, link-local IPv6, neither). */
int mpib_oob_family_rank(const struct sockaddr *sa, int family);
/* The side channel's address of d, as text. */
void mpib_oob_str(const struct mpib_dev *d, char *buf, size_t len);
/* maxComms of a port: every connection is nqps QPs on each side, plus the receiver's flush QP, and
 * its own CQ; the HCA's max_qp and max_cq are shared by its nports ports (NCCL reports max_qp). */
int mpib_max_comms(int max_qp, int max_cq, int nports, int nqps);
/* ptrSupport from what the node has: the NVIDIA driver, nvidia-peermem, an HCA that takes dma-bufs. */
int mpib_ptr_support(int nvidia, int peermem, int dmabuf);
/* Pick the RoCE GID: RoCE v2 IPv4-mapped first, then RoCE v2, then any; -1 if none. types[i]: 1 = v2. */
int mpib_pick_gid(int n, const union ibv_gid *gids, const int *types, const int *valid);
/* What a site asks of a RoCE GID (MPLANE_IB_ROCE_VERSION_NUM, _ADDR_FAMILY, _ADDR_RANGE and their
 * NCCL_IB_* twins): version 0 any, else 1 or 2; family enum mplane_ib_socket_family (IPv4-mapped
 * GIDs are AF_INET); a range of that family. */
struct mpib_gid_want {
  int version;
  int family;
  int has_range;
  struct mplane_cidr range;
};
/* 1 if GID g (RoCE v2 when v2) is what w asks; w NULL asks nothing. */
int mpib_gid_wanted(const union ibv_gid *g, int v2, const struct mpib_gid_want *w);
/* mpib_pick_gid among the GIDs want accepts. */
int mpib_pick_gid_want(int n, const union ibv_gid *gids, const int *types, const int *valid,
                       const struct mpib_gid_want *want);

/* ---- comms ---- */
struct mpib_reg;
struct mpib_mr {
  struct ibv_mr *mr;
  int type;
  void *addr;
  size_t size;
  struct mpib_reg *cached; /* the registration cache's entry it shares (plain registrations), or NULL */
};

/* The FIFO on the wire: per receive, one 64-byte element per buffer, written by the receiver into
 * the sender's memory with one RDMA write. Each element carries the slot's sequence number itself,
 * as NCCL's net_ib does: a sender takes a slot only once every one of its n elements shows the
 * sequence, so no ordering inside the write is assumed (PCIe may deliver an element before the one
 * before it; an aligned 64-byte element arrives as a whole). The FIFO's memory is never registered
 * with relaxed ordering. */
struct mpib_fifo_elem {
  uint64_t addr;
  uint64_t size;
  uint32_t rkey;
  int32_t tag;
  uint32_t nreqs;         /* buffers in this receive, the same in each element */
  uint32_t rec_rkey;      /* receiver's length records (adaptive routing) */
  uint64_t rec_addr;
  uint64_t seq;           /* request sequence + 1; 0 = never written */
  uint64_t reserved[2];
} __attribute__((aligned(64)));
_Static_assert(sizeof(struct mpib_fifo_elem) == 64, "a FIFO element is one 64-byte line");
struct mpib_fifo_wire {
  struct mpib_fifo_elem e[MPIB_MAX_RECVS];
};

/* A receive as the sender took it from the FIFO. */
struct mpib_fifo_entry {
  uint64_t addr;
  uint64_t size;
  uint32_t rkey;
  int32_t tag;
};
struct mpib_fifo_slot {
  struct mpib_fifo_entry e[MPIB_MAX_RECVS];
  uint32_t n;
  uint32_t rec_rkey;
  uint64_t rec_addr;
};

/* Take FIFO slot `w` for request `seq`: 1 when all its elements have landed (out filled), 0 when
 * not yet, -1 when they disagree or name an impossible count (a peer's protocol error). */
int mpib_fifo_take(const struct mpib_fifo_wire *w, uint64_t seq, struct mpib_fifo_slot *out);

/* What each side tells the other on the side channel. */
#define MPIB_MAGIC 0x4d504942u /* "MPIB" */
struct mpib_conn_info {
  uint32_t magic;
  uint16_t version;
  uint16_t nqps;
  uint64_t node_id;
  int32_t plane;
  int32_t link_layer;
  uint32_t lid;
  uint32_t mtu;
  uint8_t gid[16];
  uint32_t qpn[MPIB_MAX_QPS];
  uint64_t fifo_addr;     /* sender -> receiver: where FIFO slots go */
  uint32_t fifo_rkey;
  int32_t sl;             /* sender -> receiver: the class's SL, traffic class and AR for both sides */
  int32_t tclass;
  int32_t ar;
  int32_t tc_class;
  /* ECE (enhanced connection establishment): the sender's offer, the receiver's answer; ece_valid 0
   * means none (no ibv_query_ece, a provider without it, MPLANE_IB_ECE=0, or an older peer) */
  uint32_t ece_vendor_id, ece_options, ece_comp_mask, ece_valid;
  uint32_t reserved[3];
};

struct mpib_comm_base {
  uint32_t kind;          /* MPIB_SEND_COMM / MPIB_RECV_COMM */
  struct mpib_dev *dev;
  int devindex;
  int fd;                 /* side channel, kept to notice a dead peer */
  char peer[96];
  struct ibv_cq *cq;
  int nqps;
  struct ibv_qp *qps[MPIB_MAX_QPS];
  struct mplane_error err;
  int sl, tclass, ar, tc_class;
  int gid_index;          /* this connection's GID, read from the port's table when it was made */
  int ece;                /* 1: the QPs run with the ECE both sides agreed on */
  uint32_t ece_options;
  union ibv_gid gid;
  unsigned live_polls;
  struct mpib_comm_base *next_live; /* registry for the async thread */
  struct mplane_stats_comm stats;   /* plugin/'s counters of this comm (net/stats.h) */
};
#define MPIB_SEND_COMM 0x49425343u
#define MPIB_RECV_COMM 0x49425243u

#define MPIB_REQ_SEND 0x49425351u
#define MPIB_REQ_RECV 0x49425251u
#define MPIB_REQ_FLUSH 0x49424651u

struct mpib_send_comm;
struct mpib_recv_comm;

struct mpib_send_req {
  uint32_t kind;
  struct mpib_send_comm *comm;
  int used;
  size_t size;
  int pending;            /* signaled work requests not yet completed */
  int trunc;
  struct mplane_stats_req stats;
  void *prof[MPIB_MAX_QPS]; /* NCCL profiler events of its chunks' work requests (net/profiler.h) */
  void *phandle;            /* ... whose pHandle a staged send's later posts carry */
  /* A staged send (relayed connection, ib_stage.c): its bytes go through the staging ring. pending
   * holds one extra count until its last piece is posted, so it never completes before that. */
  int staged;
  const char *src;
  uint64_t raddr;
  uint32_t rkey, rec_rkey;
  uint64_t rec_addr;      /* the receiver's length records (the chunk's length goes there, AR form) */
  unsigned slot, entry, first;
  uint64_t seq;
  int nch;
  size_t per, started; /* wire chunk size; bytes whose copy into staging has been started */
  void *prof_stage[MPIB_MAX_QPS]; /* profiler events of its staging-slot writes, by slot (net/profiler.h) */
};

/* The staging ring of a relayed send comm (ib_stage.c): the relay's copier fills a slot, the slot
 * goes out as an RDMA write, and its completion frees it, so slot j is copied while slot j - 1 is on
 * the wire. Slots fill and post in ring order; sends queue in the order they were taken. */
#define MPIB_STAGE_SLOTS 4
_Static_assert(MPIB_STAGE_SLOTS <= MPIB_MAX_QPS, "mpib_send_req.prof_stage holds one event per staging slot");
#define MPIB_STAGE_SLOT_BYTES (4u << 20)
struct mpib_stage_slot {
  int state; /* 0 free, 1 copying, 2 on the wire */
  uint64_t ticket;
  int ri;           /* the send request */
  size_t off, len;  /* the piece of its message */
  int last;         /* last piece of its wire chunk: the chunk's write with immediate follows it */
};
struct mpib_stage {
  struct mplane_relay_copier *copier;
  char *mem;
  struct ibv_mr *mr;
  size_t slot_bytes;
  struct mpib_stage_slot s[MPIB_STAGE_SLOTS];
  uint64_t fill, post;           /* next slot to fill, next to post (monotonic; slot j is s[j % N]) */
  int queue[MPIB_MAX_SENDS];     /* staged sends not yet fully started, oldest first */
  uint64_t qhead, qtail;
};

struct mpib_send_comm {
  struct mpib_comm_base b;
  struct mpib_fifo_wire *fifo; /* registered, remote-writable */
  struct ibv_mr *fifo_mr;
  uint64_t seq;                /* next FIFO slot to consume */
  struct mpib_fifo_slot cur;   /* copy of slot `seq` once it arrived */
  int cur_valid, cur_used;
  int cur_taken[MPIB_MAX_RECVS];
  uint64_t len_rec;            /* registered source of AR length records */
  uint64_t *lens;
  struct ibv_mr *lens_mr;
  unsigned next_qp;
  size_t ar_threshold;         /* with b.ar: messages above this many bytes go in the AR form */
  int split;                   /* MPLANE_IB_SPLIT_DATA_ON_QPS: stripe large messages over the QPs */
  struct mpib_send_req reqs[MPIB_MAX_SENDS];
  int outstanding[MPIB_MAX_QPS];
  struct mplane_tag_wait tag_wait; /* sends that wait for a later receive group (shared comms) */
  int relayed;                 /* carried by the relay NIC: buffers that need it are staged */
  char staging_gpu[16];        /* PCI bus id of the GPU beside the relay NIC, "" unknown */
  struct mpib_stage *stage;    /* made at the first staged send */
};

struct mpib_recv_entry {
  uint64_t bytes;
  int chunks, nchunks, trunc;
  uint32_t chunk_mask;  /* chunk indices received (at most 16 chunks) */
  int tag;
  uint64_t cap;
  void *prof; /* NCCL profiler event: from the offer's FIFO write to the last chunk (net/profiler.h) */
};

struct mpib_recv_req {
  uint32_t kind;
  struct mpib_recv_comm *comm;
  int used;
  uint64_t seq;
  int n, done_entries;
  struct mpib_recv_entry e[MPIB_MAX_RECVS];
  struct mplane_stats_req stats;
};

struct mpib_flush_req {
  uint32_t kind;
  struct mpib_recv_comm *comm;
  int used;
  int pending;
};

struct mpib_recv_comm {
  struct mpib_comm_base b;
  uint64_t remote_fifo;
  uint32_t remote_fifo_rkey;
  struct mpib_fifo_wire *slots;  /* registered staging of the FIFO writes */
  struct ibv_mr *slots_mr;
  uint64_t *lens;                /* AR length records [slot][entry][chunk] */
  struct ibv_mr *lens_mr;
  uint64_t seq;
  /* FIFO writes are unsignaled but for one in MPIB_FIFO_SIGNAL_EVERY per QP. A send-queue entry is
   * free again only once a signaled completion of its QP, posted after it, has been polled: each QP
   * counts the writes posted, those known retired, and the count at its last signaled write. */
  uint32_t fifo_posted[MPIB_MAX_QPS], fifo_retired[MPIB_MAX_QPS], fifo_signaled[MPIB_MAX_QPS];
  struct mpib_recv_req reqs[MPIB_MAX_REQS];
  /* iflush: a QP connected to itself reads one byte back, after which the GPU sees the data */
  struct ibv_qp *flush_qp;
  char *flush_buf;
  struct ibv_mr *flush_mr;
  struct mpib_flush_req freqs[MPIB_MAX_FLUSHES];
};

/* registry (async thread) */
void mpib_comm_register(struct mpib_comm_base *c);
void mpib_comm_unregister(struct mpib_comm_base *c);

/* connection setup (ib_conn.c) */
ncclResult_t mpib_listen(int dev, void *handle, void **listen_comm);
ncclResult_t mpib_connect(int dev, const struct mplane_comm_opts *opts, void *handle, void **send_comm);
ncclResult_t mpib_accept(void *listen_comm, void **recv_comm);
ncclResult_t mpib_close_listen(void *listen_comm);
/* An RC QP on b's CQ, in INIT, with room for send_wr / recv_wr work requests and inline bytes. */
ncclResult_t mpib_create_qp(struct mpib_comm_base *b, int access, int send_wr, int recv_wr, int inline_bytes,
                            struct ibv_qp **out);
ncclResult_t mpib_qp_connect(struct mpib_comm_base *b, struct ibv_qp *qp, uint32_t rqpn, uint32_t rlid,
                             const uint8_t *rgid, int rmtu);
/* 1 if a QP of comm b to the peer's GID needs a GRH: always on RoCE; on IB when the port requires
 * one or the peer is in another subnet (its GID's 64-bit prefix differs), as NCCL's net_ib decides. */
int mpib_needs_grh(const struct mpib_comm_base *b, const uint8_t *rgid);
/* Adaptive routing of a two-sided connection on a port of this link layer whose class's map flag is
 * class_ar (ib_conn.c); *why names what decided it. */
int mpib_ar_choose(int link_layer, int class_ar, const char **why);
/* The GID index and GID a new connection of d uses, from the port's table now. 0, or -1 and why. */
int mpib_dev_resolve_gid(const struct mpib_dev *d, int *index, union ibv_gid *gid, char *why, size_t whylen);
void mpib_comm_base_destroy(struct mpib_comm_base *b);
/* A comm's own memory (ib_conn.c): its FIFO and length records set up when it is made, everything
 * freed at close. */
ncclResult_t mpib_send_comm_setup(struct mpib_send_comm *c);
ncclResult_t mpib_recv_comm_setup(struct mpib_recv_comm *c);
ncclResult_t mpib_close_send(void *send_comm);
ncclResult_t mpib_close_recv(void *recv_comm);
/* Zeroed page-aligned memory, and a registration of it on b's device for the comm's own use
 * (a WARN names what on failure). */
void *mpib_alloc_pages(size_t bytes);
struct ibv_mr *mpib_reg_local(struct mpib_comm_base *b, void *p, size_t bytes, int access, const char *what);

/* data path (ib_data.c) */
ncclResult_t mpib_reg_mr(void *comm, void *data, size_t size, int type, void **mhandle);
ncclResult_t mpib_reg_mr_dmabuf(void *comm, void *data, size_t size, int type, uint64_t offset, int fd,
                                void **mhandle);
ncclResult_t mpib_dereg_mr(void *comm, void *mhandle);
ncclResult_t mpib_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                        void **request);
ncclResult_t mpib_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                        void **phandles, void **request);
ncclResult_t mpib_iflush(void *recv_comm, int n, void **data, int *sizes, void **mhandles, void **request);
ncclResult_t mpib_test(void *request, int *done, int *sizes);
/* Post work requests on QP q of b; a refusal becomes the comm's error (ib_verbs.c). */
ncclResult_t mpib_post(struct mpib_comm_base *b, int q, struct ibv_send_wr *wr);
/* How a message of `size` bytes is cut for nqps QPs: the chunk count (at most nqps), each chunk
 * *per bytes but the last. split 0: always one chunk (whole messages, round-robin over the QPs). */
int mpib_chunks(size_t size, int nqps, int split, size_t *per);
/* Data memory (NCCL's buffers, one-sided data windows) with `access`, plus PCIe relaxed ordering
 * where MPLANE_IB_PCI_RELAXED_ORDERING allows it and the verbs take it; never for memory whose
 * order a reader relies on (FIFO, length records, signal windows: register those plainly). */
struct ibv_mr *mpib_reg_data(struct ibv_pd *pd, void *addr, size_t len, int access);
struct ibv_mr *mpib_reg_data_dmabuf(struct ibv_pd *pd, uint64_t offset, size_t len, uint64_t iova, int fd, int access);

/* staging on relayed connections (ib_stage.c) */
int mpib_stage_wanted(const struct mpib_send_comm *c, const struct mpib_mr *m, size_t size);
/* Queue send request r (its fields filled) behind the staging ring and move the ring on. */
ncclResult_t mpib_stage_send(struct mpib_send_comm *c, struct mpib_send_req *r, int ri);
/* Move the ring on: land copies, post them, start copies into free slots. Errors land in c->b.err;
 * once the connection has failed, it waits (bounded) for the copies still reading send buffers. */
void mpib_stage_progress(struct mpib_send_comm *c);
/* A staging slot's write completed. */
void mpib_stage_slot_done(struct mpib_send_comm *c, unsigned slot);
void mpib_stage_destroy(struct mpib_send_comm *c);
struct mplane_relay_copier;
/* A staging ring registered with device d (its dma-buf where the verbs take one) with these access
 * rights, NULL with errno. */
struct ibv_mr *mpib_stage_ring_register(struct mpib_dev *d, struct mplane_relay_copier *copier, void *mem, int access,
                                        size_t bytes);

/* one-sided ops (ib_rma.c), net/transport.h's mplane_rma_ops */
extern const struct mplane_rma_ops mpib_rma_ops;

/* Count one chunk (or the TRUNC notice, imm's layout below) of a receive entry. Every chunk of a
 * message names the same chunk count, each index comes once, and the bytes never pass the buffer;
 * NULL when the chunk fits, else the peer's protocol error in words. Exposed for unit tests. */
const char *mpib_recv_entry_accept(const struct mpib_recv_comm *c, struct mpib_recv_entry *en, uint32_t byte_len,
                                   uint32_t imm);

/* imm layout */
#define MPIB_IMM_SLOT(x) ((x) & 31u)
#define MPIB_IMM_ENTRY(x) (((x) >> 5) & 7u)
#define MPIB_IMM_NCHUNKS(x) ((((x) >> 8) & 15u) + 1)
#define MPIB_IMM_CHUNK(x) (((x) >> 12) & 15u)
#define MPIB_IMM_AR 0x10000u
#define MPIB_IMM_TRUNC 0x20000u
#define MPIB_IMM_SEQ(x) ((x) >> 20)
static inline uint32_t mpib_imm(unsigned slot, unsigned entry, unsigned nchunks, unsigned chunk, uint32_t flags,
                                uint64_t seq) {
  return (slot & 31u) | ((entry & 7u) << 5) | (((nchunks - 1) & 15u) << 8) | ((chunk & 15u) << 12) | flags |
         ((uint32_t)(seq & 0xfffu) << 20);
}

/* wr_id layout: kind in the top byte */
#define MPIB_WR_DATA 1ull
#define MPIB_WR_FIFO 2ull
#define MPIB_WR_RECV 3ull
#define MPIB_WR_FLUSH 4ull
#define MPIB_WR_STAGE 5ull /* a staging slot's write: A = send request, B = slot */
#define MPIB_WRID(kind, a, b) (((kind) << 56) | ((uint64_t)(a) << 16) | (uint64_t)(b))
#define MPIB_WRID_KIND(w) ((w) >> 56)
#define MPIB_WRID_A(w) (((w) >> 16) & 0xffffffffffull)
#define MPIB_WRID_B(w) ((w) & 0xffffull)

#endif
