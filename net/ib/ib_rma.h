/* mplane: one-sided ops over InfiniBand / RoCE verbs, shared by the two halves of the IB RMA
 * backend (private to net/ib/): ib_rma.c (groups, windows, contexts, ops and completions) over
 * ib_rma_stage.c (the staging ring for this rank's GPU windows in ops to cross-plane peers) over
 * ib_rma_req.c (failing requests and connections, posting work requests). */
#ifndef MPLANE_NET_IB_RMA_H
#define MPLANE_NET_IB_RMA_H

#include <stddef.h>
#include <stdint.h>

#include "../../common/clock.h"
#include "../../common/nccl/err.h"
#include "../relay.h"
#include "../transport.h"
#include "ib.h"

#define IBR_MAGIC 0x49425241u /* "IBRA" */
#define IBR_VERSION 3 /* 3: a cross-plane pair has a QP per direction; only own-device keys */
#define IBR_REQ_MAGIC 0x49425251u
#define IBR_SQ 1024            /* work requests in flight per QP */
#define IBR_CQ_MAX (1 << 16)   /* per context; bounds what may be in flight on one context */
#define IBR_WR_MAX MPIB_MAX_MSG /* the longest work request (max_msg_sz); longer puts and gets are split */
#define IBR_ACCESS (IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC)
#define IBR_PEEK_EVERY_S 0.001 /* how often test looks at a silent peer's control socket */
#define IBR_CAR_MAX 8 /* devices a group's connections leave from: its own, then relay devices */

/* ---- wire ---- */
struct ibr_handle {
  uint32_t magic;
  uint16_t version, addrlen;
  union {
    struct sockaddr sa;
    struct sockaddr_in sin;
    struct sockaddr_in6 sin6;
  } addr;
};
_Static_assert(sizeof(struct ibr_handle) <= MPLANE_RMA_HANDLE_MAX, "RMA handle fits NCCL's handle");

struct ibr_hello {
  uint32_t magic, version;
  int32_t rank, nranks;
};

struct ibr_win_rec { /* one rank's view of a window, allgathered at regMrSym */
  uint64_t addr, size;
  uint32_t rkey, id; /* rkey: on the rank's own device, where every peer's op on it lands */
  uint32_t gpu;      /* GPU memory: registered on the own device only */
  uint32_t reserved;
};

struct ibr_peer_addr { /* where one rank's end of its connections with one peer is */
  int32_t link_layer;
  uint32_t lid, mtu;
  uint8_t gid[16];
};

struct ibr_addr_rec { /* one rank's QP addresses, allgathered at createContext */
  uint32_t magic;     /* 0: this rank could not make its connections (its WARN says why) */
  int32_t plane;
  struct ibr_peer_addr own; /* its own device: where its target QPs of cross-plane pairs are */
  /* then struct ibr_peer_addr addr[nranks]: its initiating end for each peer (the device its own
   * ops to that peer leave from), then uint32_t qpn[ncontexts][nranks]: that end's QP of (context,
   * peer), then uint32_t tqpn[ncontexts][nranks]: its target QP of (context, peer), 0 on one plane */
};

/* ---- local state ---- */
struct ibr_win {
  uint32_t id;
  char *base;
  size_t size;
  int type;
  struct ibv_mr *mr[IBR_CAR_MAX]; /* per carrier of the group; NULL where not registered (GPU memory on a relay device) */
  struct ibr_win_rec *peers; /* [nranks] */
};

struct ibr_listen {
  int fd, dev;
};

/* A device the group's connections leave from: car[0] is the group's own, the others carry its
 * connections to ranks on other planes (net/relay.h). */
struct ibr_carrier {
  int dev;
  struct mpib_dev *d;
  int plane;
  struct ibv_mr *scratch_mr; /* the atomics' fetched values, registered on this device */
  char near_gpu[16];         /* PCI bus id of the GPU beside it (where staging lives), "" unknown */
};

struct ibr_group {
  int rank, nranks, dev;
  struct mpib_dev *d;
  struct ibr_carrier car[IBR_CAR_MAX];
  int ncar;
  int *plane;       /* [nranks] plane of each rank's device, -1 unknown (route) */
  int *car_of;      /* [nranks] the carrier of this rank's connections, -1: none can carry them */
  int *ctrl;        /* control socket per peer, -1 for itself */
  int *gone;        /* atomic: the peer's control socket closed */
  double *peeked;   /* when test last looked at a peer's socket */
  pthread_mutex_t lock;
  struct ibr_win **wins;
  uint32_t nwins, cap;
  uint64_t *scratch; /* the atomics' fetched values land here (never read) */
};

struct ibr_ctxset;

struct ibr_cx { /* one context on one carrier: its CQ, its QPs */
  struct ibr_ctxset *set;
  int index, car;
  struct mpib_comm_base b; /* dev, CQ, SL and GID for the QP helpers of ib_conn.c */
  pthread_mutex_t lock;
  int outstanding, cq_depth;
  struct ibr_stage *stage; /* relay carriers: the staging ring of this rank's GPU windows */
  struct ibv_qp *flush_qp; /* relay carriers: connected to itself, reads a slot a get filled before it is copied */
};

struct ibr_conn {
  struct ibr_cx *cx;
  int peer, car;
  struct ibv_qp *qp, *mirror; /* mirror: the other end of a rank's QP to itself */
  struct ibv_qp *target;      /* a cross-plane peer's: on the own device, where its ops land (never posted on) */
  int outstanding;
  int nqueued; /* its ops in its context's queue (later ones queue behind them) */
  /* gets into this rank's GPU windows (not staged): posted, completed, and the completed count when
   * the last iflush was posted (the gets it covers); a flush reads while any posted get is not
   * covered, in flight at the last flush or completed after it (atomics: test and iflush race) */
  uint64_t gpu_posted, gpu_done, gpu_covered;
  uint32_t gpu_win; /* the window of the last of them */
  int failed;
  char why[160];
};

struct ibr_ctxset {
  struct ibr_group *g;
  int ncontexts, stride, ncar;
  struct ibr_cx *cx;        /* [context * ncar + carrier]; no CQ where the carrier has no peer */
  struct ibr_conn **conns;  /* [context * nranks + peer], NULL: not connected */
  struct ibr_conn **faulted; /* [peer] atomic: its first connection the wire failed (ibr_peer_fault), NULL: none */
  int has_error;            /* atomic */
};

/* One op as work requests: the data in pieces of at most IBR_WR_MAX bytes, then, with a signal, the
 * atomic add on the signal word (same QP: after the data). */
struct ibr_op {
  int opcode; /* IBV_WR_RDMA_WRITE or IBV_WR_RDMA_READ */
  uint64_t laddr, raddr, size;
  uint32_t lkey, rkey;
  int sig;
  uint64_t saddr, add;
  uint32_t srkey;
};

struct ibr_req {
  uint32_t magic;
  struct ibr_conn *conn;
  int pending;  /* work requests not yet completed */
  int failed;
  ncclResult_t result;
  char what[16];
  uint32_t win;
  uint64_t off, size;
  char why[384];
  struct ibr_op op;     /* kept for when it leaves its context's queue */
  /* staging (a local GPU window on a relay device) and the queue behind it */
  int staged, queued;   /* queued: in its context's queue, not all posted yet */
  int gpu_get;          /* a get into a GPU window, not staged: its completion counts in conn->gpu_done */
  int copies;           /* a staged get's pieces read but not yet copied into the window */
  uint64_t started, posted; /* bytes given slots, bytes posted */
  char *lbase;          /* the local window, its index and the op's offset in it */
  uint32_t lwin;
  uint64_t loff;
  double queued_at;
  struct ibr_req *next;
};

struct ibr_stage;
struct ibr_slot;

/* ---- ib_rma_req.c ---- */
int ibr_timeout_ms(void);
/* Fail every op queued or in flight on c, once. */
void ibr_conn_fail(struct ibr_conn *c, const char *why);
void ibr_peer_fault(struct ibr_conn *c, const char *why); /* ibr_conn_fail, and the peer's ops in every context fail */
void ibr_req_fail(struct ibr_req *r, ncclResult_t res, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* Fail r because its connection failed (or is failing): the op, its rank and range, and why. */
void ibr_req_fail_conn(struct ibr_req *r, const char *why);
/* "to" for a put, "from" for a get: how r's message names its peer. */
const char *ibr_to_from(const struct ibr_req *r);
/* Finish r as refused at once (the error is in r): *request is r, test reports it. */
ncclResult_t ibr_refuse(struct ibr_req *r, void **request);
/* Work requests an op takes; whether c's QP has room for n more; post one (0 ok). */
int ibr_op_nwr(const struct ibr_op *op);
int ibr_room(struct ibr_conn *c, int n);
int ibr_post(struct ibr_conn *c, struct ibr_req *r, struct ibv_send_wr *wr);
/* The same on another QP of c's context (a flush QP); counted as c's. */
int ibr_post_on(struct ibr_conn *c, struct ibv_qp *qp, struct ibr_req *r, struct ibv_send_wr *wr);
ncclResult_t ibr_post_op_locked(struct ibr_conn *c, struct ibr_req *r, const struct ibr_op *op);

/* ---- ib_rma_stage.c: this rank's GPU windows in its ops to cross-plane peers ---- */
/* Post r now, or queue it behind the staged ops of its connection (staged: r itself is staged). */
ncclResult_t ibr_start_op(struct ibr_conn *c, struct ibr_req *r, int staged);
/* Is w a window this connection must stage (GPU memory, and c leaves from a relay device)? */
int ibr_staged_window(const struct ibr_conn *c, const struct ibr_win *w);
/* The key of window w on r's device, or r refused naming the window and planes. */
ncclResult_t ibr_local_key(struct ibr_req *r, const struct ibr_win *w, uint32_t *lkey, void **request);
void ibr_stage_progress(struct ibr_cx *x);
void ibr_stage_deadline(struct ibr_req *r);
void ibr_stage_destroy(struct ibr_cx *x);
void ibr_stage_wr_done(struct ibr_slot *sl, int ok);
/* The staging slot a work request id names, or NULL for an op's own work request. */
struct ibr_slot *ibr_wrid_slot(uint64_t id);
/* The op a staging slot is working for. */
struct ibr_req *ibr_slot_req(const struct ibr_slot *sl);

#endif
