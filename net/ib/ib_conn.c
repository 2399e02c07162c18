/* mplane: IB connection setup. connect and accept never block: each call advances a small state
 * machine over the TCP side channel and returns a NULL comm until the QPs are connected.
 *
 *   connect                                 accept
 *   TCP connect, create CQ, QPs (INIT), FIFO
 *   send info (QPNs, LID/GID, FIFO, SL)  -> read info, create CQ, QPs -> RTR -> RTS, post receives
 *                                        <- send info (QPNs, LID/GID)
 *   QPs -> RTR -> RTS, send "ready"      -> read "ready": the recv comm is returned
 *   the send comm is returned
 * The receiver only writes FIFO slots after "ready", when the sender's QPs are ready to take them. */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../transport_base.h"
#include "../tc.h"
#include "ib.h"

#define MPIB_STAGE_OFFSET 120
#define MPIB_PENDING_MAX 64
#define MPIB_EVICT_AFTER_S 1.0  /* with the table full, a side channel without its whole record this long makes room */
#define MPIB_READY 0x52

static void addr_str(const struct sockaddr *sa, char *buf, size_t len) {
  char ip[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    inet_ntop(AF_INET, &((const struct sockaddr_in *)sa)->sin_addr, ip, sizeof(ip));
    port = ntohs(((const struct sockaddr_in *)sa)->sin_port);
  } else if (sa->sa_family == AF_INET6) {
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)sa)->sin6_addr, ip, sizeof(ip));
    port = ntohs(((const struct sockaddr_in6 *)sa)->sin6_port);
  }
  snprintf(buf, len, "%s<%d>", ip, port);
}

/* Read/write as much as is ready. 1 when the whole buffer moved, 0 not yet, -1 peer gone. */
static int io_some(int fd, void *buf, size_t len, size_t *done, int wr) {
  while (*done < len) {
    ssize_t r = wr ? send(fd, (char *)buf + *done, len - *done, MSG_NOSIGNAL | MSG_DONTWAIT)
                   : recv(fd, (char *)buf + *done, len - *done, MSG_DONTWAIT);
    if (r == 0 && !wr) return -1;
    if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    *done += (size_t)r;
  }
  return 1;
}

/* ------------------------------------------------------------------ QPs */
ncclResult_t mpib_create_qp(struct mpib_comm_base *b, int access, int send_wr, int recv_wr, int inline_bytes,
                            struct ibv_qp **out) {
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof(ia));
  ia.send_cq = b->cq;
  ia.recv_cq = b->cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = (uint32_t)send_wr;
  ia.cap.max_recv_wr = (uint32_t)recv_wr;
  ia.cap.max_send_sge = 1;
  ia.cap.max_recv_sge = recv_wr ? 1 : 0;
  ia.cap.max_inline_data = (uint32_t)inline_bytes;
  struct ibv_qp *qp = mpib_v.create_qp(b->dev->hca->pd, &ia);
  if (!qp) {
    MP_WARN("NET/IB: %s: ibv_create_qp failed: %s", b->dev->props.name, strerror(errno));
    return ncclSystemError;
  }
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = (uint16_t)mpib_config()->ib_pkey;
  a.port_num = (uint8_t)b->dev->port;
  a.qp_access_flags = access;
  int rc = mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
  if (rc != 0) {
    MP_WARN("NET/IB: %s: QP %u to INIT failed: %s", b->dev->props.name, qp->qp_num, strerror(rc));
    mpib_v.destroy_qp(qp);
    return ncclSystemError;
  }
  *out = qp;
  return ncclSuccess;
}

int mpib_needs_grh(const struct mpib_comm_base *b, const uint8_t *rgid) {
  const struct mpib_dev *d = b->dev;
  return d->link_layer == IBV_LINK_LAYER_ETHERNET || d->grh_required || memcmp(rgid, b->gid.raw, 8) != 0;
}

/* Adaptive routing is decided per path from its ordering facts. A two-sided message in the AR form
 * completes through a separate write with immediate, which the QP orders after the data write, so
 * packets that take different routes cannot show the receiver a message before its bytes: this path
 * may take adaptive routes, as NCCL's net_ib does (on for IB, off for RoCE). One-sided ops (ib_rma.c)
 * have no such form - a signal's atomic follows its put in arrival order - and never ask for it.
 * Strongest first: MPLANE_IB_ADAPTIVE_ROUTING by its own name; an explicit MPLANE_TC_MAP (the class's
 * ":ar"/":noar", else on for lowlat only); NCCL_IB_ADAPTIVE_ROUTING; the link layer. */
int mpib_ar_choose(int link_layer, int class_ar, const char **why) {
  const struct mplane_config *cfg = mpib_config();
  const char *from = mplane_config_source("MPLANE_IB_ADAPTIVE_ROUTING");
  int own = from && !strcmp(from, "MPLANE_IB_ADAPTIVE_ROUTING");
  if (!own && mplane_config_source("MPLANE_TC_MAP")) {
    *why = "MPLANE_TC_MAP";
    return class_ar != 0;
  }
  if (from && cfg->ib_adaptive_routing >= 0) {
    *why = from;
    return cfg->ib_adaptive_routing;
  }
  *why = link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE link" : "IB link";
  return link_layer != IBV_LINK_LAYER_ETHERNET;
}

/* "on above 8192 B (IB link)", "off (RoCE link)" */
static const char *ar_str(int ar, size_t threshold, const char *why, char *buf, size_t len) {
  if (ar) snprintf(buf, len, "on above %zu B (%s)", threshold, why);
  else snprintf(buf, len, "off (%s)", why);
  return buf;
}

ncclResult_t mpib_qp_connect(struct mpib_comm_base *b, struct ibv_qp *qp, uint32_t rqpn, uint32_t rlid,
                             const uint8_t *rgid, int rmtu) {
  const struct mplane_config *cfg = mpib_config();
  struct mpib_dev *d = b->dev;
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = (enum ibv_mtu)(rmtu < (int)d->mtu ? rmtu : (int)d->mtu);
  a.dest_qp_num = rqpn;
  a.rq_psn = 0;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = (uint8_t)d->port;
  a.ah_attr.sl = (uint8_t)b->sl;
  if (d->link_layer != IBV_LINK_LAYER_ETHERNET) a.ah_attr.dlid = (uint16_t)rlid;
  if (mpib_needs_grh(b, rgid)) {
    a.ah_attr.is_global = 1;
    memcpy(a.ah_attr.grh.dgid.raw, rgid, 16);
    a.ah_attr.grh.sgid_index = (uint8_t)b->gid_index;
    a.ah_attr.grh.hop_limit = 255;
    a.ah_attr.grh.traffic_class = (uint8_t)b->tclass;
  }
  int rc = mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                        IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc != 0) {
    MP_WARN("NET/IB: %s: QP %u to RTR (peer %s QP %u, SL %d) failed: %s", d->props.name, qp->qp_num, b->peer, rqpn,
            b->sl, strerror(rc));
    return ncclSystemError;
  }
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.timeout = (uint8_t)cfg->ib_timeout;
  a.retry_cnt = (uint8_t)cfg->ib_retry_cnt;
  a.rnr_retry = 7;
  a.sq_psn = 0;
  a.max_rd_atomic = 1;
  rc = mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                    IBV_QP_MAX_QP_RD_ATOMIC);
  if (rc != 0) {
    MP_WARN("NET/IB: %s: QP %u to RTS failed: %s", d->props.name, qp->qp_num, strerror(rc));
    return ncclSystemError;
  }
  return ncclSuccess;
}

/* The CQ (room for every completion its QPs can have outstanding: theirs, and the receiver's flush
 * QP) and nqps QPs sized for the comm's role (ib.h). */
static ncclResult_t base_open(struct mpib_comm_base *b, int devindex, int nqps) {
  struct mpib_dev *d = mpib_dev_get(devindex);
  b->dev = d;
  b->devindex = devindex;
  b->nqps = nqps;
  char why[256];
  if (mpib_dev_resolve_gid(d, &b->gid_index, &b->gid, why, sizeof(why)) != 0) {
    MP_WARN("NET/IB: %s: no GID for a connection to peer %s: %s", d->props.name, b->peer, why);
    return ncclSystemError;
  }
  int was = __atomic_exchange_n(&d->gid_index, b->gid_index, __ATOMIC_ACQ_REL); /* the index last seen */
  if (was != b->gid_index)
    MP_INFO(NCCL_NET, "NET/IB: %s: the GID moved from index %d to %d (the interface's addresses changed); new "
            "connections use %d", d->props.name, was, b->gid_index, b->gid_index);
  int sender = b->kind == MPIB_SEND_COMM;
  int sq = sender ? MPIB_SEND_SQ : MPIB_RECV_SQ, rq = sender ? 0 : MPIB_RQ_DEPTH;
  int cqe = nqps * (sq + rq) + (sender ? 0 : MPIB_FLUSH_SQ);
  b->cq = mpib_v.create_cq(d->hca->ctx, cqe, NULL, NULL, 0);
  if (!b->cq) {
    MP_WARN("NET/IB: %s: ibv_create_cq(%d) failed: %s", d->props.name, cqe, strerror(errno));
    return ncclSystemError;
  }
  for (int i = 0; i < nqps; i++)
    MP_CHECK(mpib_create_qp(b, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_LOCAL_WRITE, sq, rq,
                            sender ? MPIB_INLINE : 0, &b->qps[i]));
  return ncclSuccess;
}

void mpib_comm_base_destroy(struct mpib_comm_base *b) {
  for (int i = 0; i < b->nqps; i++)
    if (b->qps[i]) mpib_v.destroy_qp(b->qps[i]);
  if (b->cq) mpib_v.destroy_cq(b->cq);
  if (b->fd >= 0) close(b->fd);
}

static void info_fill(struct mpib_conn_info *ci, struct mpib_comm_base *b) {
  memset(ci, 0, sizeof(*ci));
  ci->magic = MPIB_MAGIC;
  ci->version = MPLANE_PROTOCOL_VERSION;
  ci->nqps = (uint16_t)b->nqps;
  ci->node_id = mplane_node_id();
  ci->plane = b->dev->props.plane;
  ci->link_layer = b->dev->link_layer;
  ci->lid = b->dev->lid;
  ci->mtu = b->dev->mtu;
  memcpy(ci->gid, b->gid.raw, 16);
  for (int i = 0; i < b->nqps; i++) ci->qpn[i] = b->qps[i]->qp_num;
}

/* ---- ECE (enhanced connection establishment), as NCCL's NCCL_IB_ECE_ENABLE: the sender offers what
 * its QPs support, the receiver sets the offer on its QPs before RTR and answers with what they then
 * run, the sender sets that answer on its own. Off where libibverbs has no ibv_query_ece, the
 * provider says EOPNOTSUPP (rxe, older firmware), MPLANE_IB_ECE=0, or the peer offers nothing. */
static int ece_on(void) { return mpib_v.query_ece && mpib_v.set_ece && mpib_config()->ib_ece; }

/* For the connection's INFO line. */
static const char *ece_str(const struct mpib_comm_base *b) {
  static __thread char s[32];
  if (!b->ece) return "no ECE";
  snprintf(s, sizeof(s), "ECE 0x%08x", b->ece_options);
  return s;
}

/* What b's QPs run with now, into ci (ece_valid stays 0 when there is nothing to say). */
static void ece_offer(struct mpib_comm_base *b, struct mpib_conn_info *ci) {
  if (!ece_on()) return;
  struct ibv_ece ece;
  memset(&ece, 0, sizeof(ece));
  int rc = mpib_v.query_ece(b->qps[0], &ece);
  if (rc != 0) {
    if (rc != EOPNOTSUPP && rc != ENOSYS)
      MP_INFO(NCCL_NET, "NET/IB: %s: ibv_query_ece failed (%s); connecting without ECE", b->dev->props.name,
              strerror(rc));
    return;
  }
  ci->ece_vendor_id = ece.vendor_id;
  ci->ece_options = ece.options;
  ci->ece_comp_mask = ece.comp_mask;
  ci->ece_valid = 1;
}

/* The peer's ECE on every QP of b (in INIT, before RTR). A provider that refuses it is not an error:
 * the connection runs without, as NCCL's. */
static ncclResult_t ece_apply(struct mpib_comm_base *b, const struct mpib_conn_info *peer) {
  if (!ece_on() || peer->ece_valid != 1) return ncclSuccess;
  struct ibv_ece ece = {.vendor_id = peer->ece_vendor_id, .options = peer->ece_options,
                        .comp_mask = peer->ece_comp_mask};
  for (int i = 0; i < b->nqps; i++) {
    int rc = mpib_v.set_ece(b->qps[i], &ece);
    if (rc == EOPNOTSUPP || rc == ENOSYS) return ncclSuccess;
    if (rc != 0) {
      MP_WARN("NET/IB: %s: ibv_set_ece(vendor 0x%x, options 0x%x) on QP %u for peer %s failed: %s",
              b->dev->props.name, ece.vendor_id, ece.options, b->qps[i]->qp_num, b->peer, strerror(rc));
      return ncclSystemError;
    }
  }
  b->ece = 1;
  b->ece_options = ece.options;
  return ncclSuccess;
}

static ncclResult_t info_check(const struct mpib_conn_info *ci, struct mpib_comm_base *b) {
  if (ci->magic != MPIB_MAGIC || ci->version != MPLANE_PROTOCOL_VERSION) {
    MP_WARN("NET/IB: peer %s speaks mplane IB protocol %u (magic 0x%08x), this library speaks %u: use the same "
            "mplane build on every node", b->peer, ci->version, ci->magic, MPLANE_PROTOCOL_VERSION);
    return ncclInvalidUsage;
  }
  if (ci->nqps < 1 || ci->nqps > MPIB_MAX_QPS) {
    MP_WARN("NET/IB: peer %s asks for %u QPs (1..%d)", b->peer, ci->nqps, MPIB_MAX_QPS);
    return ncclInvalidUsage;
  }
  /* the rest reaches ibv_modify_qp: only values the verbs accept */
  if (ci->mtu < IBV_MTU_256 || ci->mtu > IBV_MTU_4096 || ci->sl < 0 || ci->sl > MPLANE_TC_SL_MAX || ci->tclass < 0 ||
      ci->tclass > 255 || (ci->ar != 0 && ci->ar != 1) || ci->tc_class < 0 || ci->tc_class >= MPLANE_TC_NCLASSES) {
    MP_WARN("NET/IB: peer %s sent an invalid connection record (MTU %u, SL %d, traffic class %d, adaptive routing "
            "%d, class %d): not an mplane rank of this build", b->peer, ci->mtu, ci->sl, ci->tclass, ci->ar,
            ci->tc_class);
    return ncclInvalidUsage;
  }
  if (ci->link_layer != b->dev->link_layer) {
    MP_WARN("NET/IB: %s is %s but peer %s is %s: both ends of a connection must be on the same fabric",
            b->dev->props.name, b->dev->link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "RoCE", b->peer,
            ci->link_layer == IBV_LINK_LAYER_INFINIBAND ? "InfiniBand" : "RoCE");
    return ncclInvalidUsage;
  }
  return ncclSuccess;
}

/* ------------------------------------------------------------------ listen */
struct mpib_pending {
  int fd;
  int stage;                   /* 0 read info, 1 write info, 2 read ready */
  double since;
  char peer[96];
  struct mpib_conn_info in, out;
  size_t done;
  struct mpib_recv_comm *comm;
};

struct mpib_listen_comm {
  int fd;
  int dev;
  int npending;
  struct mpib_pending pending[MPIB_PENDING_MAX];
};

ncclResult_t mpib_listen(int dev, void *handle, void **listen_comm) {
  struct mpib_dev *d = mpib_dev_get(dev);
  if (!d) return ncclInvalidArgument;
  int fd = socket(d->oob.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_storage sa = d->oob;
  if (sa.ss_family == AF_INET6) ((struct sockaddr_in6 *)&sa)->sin6_port = 0;
  else ((struct sockaddr_in *)&sa)->sin_port = 0;
  char where[96];
  addr_str((struct sockaddr *)&d->oob, where, sizeof(where));
  if (fd < 0 || bind(fd, (struct sockaddr *)&sa, d->ooblen) != 0 || listen(fd, 1024) != 0) {
    MP_WARN("NET/IB: %s: cannot listen on side-channel address %s: %s (set MPLANE_SOCKET_IFNAME to an interface "
            "peers can reach)", d->props.name, where, strerror(errno));
    if (fd >= 0) close(fd);
    return ncclSystemError;
  }
  socklen_t len = sizeof(sa);
  getsockname(fd, (struct sockaddr *)&sa, &len);
  struct mplane_handle h = {.version = MPLANE_PROTOCOL_VERSION, .transport = MPLANE_HANDLE_IB,
                            .plane = (int8_t)d->props.plane, .node_id = mplane_node_id()};
  h.payload_len = (uint8_t)len;
  memcpy(h.payload, &sa, len);
  ncclResult_t res = mplane_handle_encode(&h, handle);
  struct mpib_listen_comm *lc = res == ncclSuccess ? calloc(1, sizeof(*lc)) : NULL;
  if (!lc) {
    close(fd);
    return res != ncclSuccess ? res : ncclSystemError;
  }
  lc->fd = fd;
  lc->dev = dev;
  *listen_comm = lc;
  return ncclSuccess;
}

static void pending_drop(struct mpib_listen_comm *lc, int i) {
  struct mpib_pending *p = &lc->pending[i];
  if (p->comm) {
    p->comm->b.fd = p->fd;
    mpib_close_recv(p->comm);
  } else {
    close(p->fd);
  }
  lc->pending[i] = lc->pending[--lc->npending];
}

ncclResult_t mpib_close_listen(void *listen_comm) {
  struct mpib_listen_comm *lc = listen_comm;
  if (!lc) return ncclSuccess;
  while (lc->npending > 0) pending_drop(lc, 0);
  close(lc->fd);
  free(lc);
  return ncclSuccess;
}

/* The sender said who it is: build the receive side and its QPs, ready to receive. */
static ncclResult_t accept_build(struct mpib_listen_comm *lc, struct mpib_pending *p) {
  struct mpib_recv_comm *c = calloc(1, sizeof(*c));
  if (!c) return ncclSystemError;
  c->b.kind = MPIB_RECV_COMM;
  c->b.fd = -1;
  snprintf(c->b.peer, sizeof(c->b.peer), "%s", p->peer);
  p->comm = c;
  c->b.dev = mpib_dev_get(lc->dev);
  ncclResult_t res = info_check(&p->in, &c->b);
  if (res != ncclSuccess) return res;
  c->b.sl = p->in.sl;
  c->b.tclass = p->in.tclass;
  /* the receiver's QPs carry its FIFO writes (clear-to-send records): MPLANE_IB_FIFO_TC /
   * NCCL_IB_FIFO_TC puts them on a queue of their own, as NCCL's net_ib does on RoCE */
  if (c->b.dev && c->b.dev->link_layer == IBV_LINK_LAYER_ETHERNET && mpib_config()->ib_fifo_tc >= 0)
    c->b.tclass = mpib_config()->ib_fifo_tc;
  c->b.ar = p->in.ar;
  c->b.tc_class = p->in.tc_class;
  MP_CHECK(base_open(&c->b, lc->dev, p->in.nqps));
  c->remote_fifo = p->in.fifo_addr;
  c->remote_fifo_rkey = p->in.fifo_rkey;
  MP_CHECK(mpib_recv_comm_setup(c));
  MP_CHECK(ece_apply(&c->b, &p->in));
  for (int i = 0; i < c->b.nqps; i++)
    MP_CHECK(mpib_qp_connect(&c->b, c->b.qps[i], p->in.qpn[i], p->in.lid, p->in.gid, (int)p->in.mtu));
  /* receives for the writes with immediate, before the sender can send */
  for (int i = 0; i < c->b.nqps; i++) {
    for (int k = 0; k < MPIB_RQ_DEPTH; k++) {
      struct ibv_recv_wr wr, *bad = NULL;
      memset(&wr, 0, sizeof(wr));
      wr.wr_id = MPIB_WRID(MPIB_WR_RECV, i, 0);
      int rc = ibv_post_recv(c->b.qps[i], &wr, &bad);
      if (rc != 0) {
        MP_WARN("NET/IB: %s: posting receives on QP %u failed: %s", c->b.dev->props.name, c->b.qps[i]->qp_num,
                strerror(rc));
        return ncclSystemError;
      }
    }
  }
  info_fill(&p->out, &c->b);
  if (c->b.ece) ece_offer(&c->b, &p->out); /* the answer: what the QPs run after the offer was set */
  return ncclSuccess;
}

/* The table is full and another connection waits: drop the oldest side channel whose connection
 * record is not whole after MPIB_EVICT_AFTER_S, whatever part of it it sent, so that strangers -
 * silent, or one byte each - cannot keep real peers out. One whose record was whole and valid has
 * its QPs and keeps its slot. 1 if one was dropped. */
static int pending_evict_unfinished(struct mpib_listen_comm *lc) {
  int oldest = -1;
  double now = mplane_now_s();
  for (int i = 0; i < lc->npending; i++)
    if (lc->pending[i].stage == 0 && now - lc->pending[i].since > MPIB_EVICT_AFTER_S &&
        (oldest < 0 || lc->pending[i].since < lc->pending[oldest].since))
      oldest = i;
  if (oldest < 0) return 0;
  MP_WARN("NET/IB: %d connections wait for their setup; dropped the one from %s, %zu of %zu bytes of its record in "
          "%.0f s", lc->npending, lc->pending[oldest].peer, lc->pending[oldest].done, sizeof(lc->pending[oldest].in),
          now - lc->pending[oldest].since);
  pending_drop(lc, oldest);
  return 1;
}

ncclResult_t mpib_accept(void *listen_comm, void **recv_comm) {
  struct mpib_listen_comm *lc = listen_comm;
  *recv_comm = NULL;
  while (lc->npending < MPIB_PENDING_MAX || (mplane_listen_backlog_waiting(lc->fd) && pending_evict_unfinished(lc))) {
    struct sockaddr_storage from;
    socklen_t len = sizeof(from);
    int fd = accept4(lc->fd, (struct sockaddr *)&from, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      MP_WARN("NET/IB: accept on the side channel failed: %s", strerror(errno));
      return ncclSystemError;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
    struct mpib_pending *p = &lc->pending[lc->npending++];
    memset(p, 0, sizeof(*p));
    p->fd = fd;
    p->since = mplane_now_s();
    addr_str((struct sockaddr *)&from, p->peer, sizeof(p->peer));
  }
  const struct mplane_config *cfg = mpib_config();
  for (int i = 0; i < lc->npending;) {
    struct mpib_pending *p = &lc->pending[i];
    int r = 1;
    if (p->stage == 0) {
      r = io_some(p->fd, &p->in, sizeof(p->in), &p->done, 0);
      if (r == 0 && p->done >= sizeof(p->in.magic) && p->in.magic != MPIB_MAGIC) {
        MP_WARN("NET/IB: connection from %s is not mplane (first bytes 0x%08x); dropped", p->peer, p->in.magic);
        pending_drop(lc, i);
        continue;
      }
      if (r == 1) {
        /* Refused (a stranger, another build, a record out of range): the connector sees its side
         * channel close and fails; this listener goes on accepting. */
        if (accept_build(lc, p) != ncclSuccess) {
          MP_WARN("NET/IB: cannot accept the connection from peer %s; dropped", p->peer);
          pending_drop(lc, i);
          continue;
        }
        p->stage = 1;
        p->done = 0;
      }
    }
    if (r == 1 && p->stage == 1) {
      r = io_some(p->fd, &p->out, sizeof(p->out), &p->done, 1);
      if (r == 1) {
        p->stage = 2;
        p->done = 0;
      }
    }
    if (r == 1 && p->stage == 2) {
      unsigned char ready = 0;
      r = io_some(p->fd, &ready, 1, &p->done, 0);
      if (r == 1 && ready != MPIB_READY) r = -1;
      if (r == 1) {
        struct mpib_recv_comm *c = p->comm;
        c->b.fd = p->fd;
        mpib_comm_register(&c->b);
        lc->pending[i] = lc->pending[--lc->npending];
        MP_INFO(NCCL_NET, "NET/IB: %s accepted peer %s: %d QPs, SL %d, traffic class %d, adaptive routing %s, %s",
                c->b.dev->props.name, c->b.peer, c->b.nqps, c->b.sl, c->b.tclass, c->b.ar ? "on" : "off",
                ece_str(&c->b));
        *recv_comm = c;
        return ncclSuccess;
      }
    }
    if (r < 0) {
      MP_INFO(NCCL_NET, "NET/IB: connection from %s closed during setup", p->peer);
      pending_drop(lc, i);
      continue;
    }
    /* A silent side channel has the whole handshake deadline: at scale a peer busy with thousands
     * of QP setups may call again long after its TCP connect. Only a full table
     * (pending_evict_unfinished) drops a silent one sooner. */
    if (p->stage == 0 && p->done == 0 && mplane_now_s() - p->since > cfg->connect_timeout_s) {
      MP_WARN("NET/IB: connection from peer %s sent nothing in %d s (MPLANE_CONNECT_TIMEOUT); dropped", p->peer,
              cfg->connect_timeout_s);
      pending_drop(lc, i);
      continue;
    }
    /* Part of a record: a real connector writes all of it at once, so this is a stranger or a peer
     * that died mid-write. Its slot is held half the connector's deadline, so a connector that waits
     * behind it still gets in within its own. */
    if (p->stage == 0 && p->done > 0 && mplane_now_s() - p->since > cfg->connect_timeout_s / 2.0) {
      MP_WARN("NET/IB: connection from %s sent %zu of the %zu bytes of a connection record in %.1f s (half of "
              "MPLANE_CONNECT_TIMEOUT); dropped", p->peer, p->done, sizeof(p->in), cfg->connect_timeout_s / 2.0);
      pending_drop(lc, i);
      continue;
    }
    if (mplane_now_s() - p->since > cfg->connect_timeout_s) {
      MP_WARN("NET/IB: connection from peer %s did not finish its setup within %d s (MPLANE_CONNECT_TIMEOUT); dropped",
              p->peer, cfg->connect_timeout_s);
      pending_drop(lc, i);
      continue;
    }
    i++;
  }
  return ncclSuccess;
}

/* ------------------------------------------------------------------ connect */
struct mpib_connect_stage {
  int stage; /* 0 TCP connecting, 1 write info, 2 read info, 3 write ready */
  double deadline;
  struct mpib_send_comm *comm;
  struct mpib_conn_info out, in;
  size_t done;
  const char *ar_why; /* what decided adaptive routing (mpib_ar_choose), for the INFO line */
};

/* Connect keeps a pointer to its state in NCCL's handle buffer (past our header): see
 * net/transport_base.h. */
static struct mplane_stage_set connect_stages = MPLANE_STAGE_SET_INIT;

static void stage_free(struct mpib_connect_stage *st) {
  mplane_stage_remove(&connect_stages, st);
  if (st->comm) mpib_close_send(st->comm);
  free(st);
}

static ncclResult_t stage_open(int dev, const struct mplane_comm_opts *opts, const struct mplane_handle *h,
                               struct mpib_connect_stage **out) {
  const struct mplane_config *cfg = mpib_config();
  struct mpib_dev *d = mpib_dev_get(dev);
  struct mpib_connect_stage *st = calloc(1, sizeof(*st));
  struct mpib_send_comm *c = calloc(1, sizeof(*c));
  if (!st || !c) {
    free(st);
    free(c);
    return ncclSystemError;
  }
  st->comm = c;
  c->b.kind = MPIB_SEND_COMM;
  c->b.fd = -1;
  c->b.dev = d;
  struct sockaddr_storage peer;
  socklen_t peer_len;
  char why[160];
  if (mplane_handle_sockaddr(h, &peer, &peer_len, why, sizeof(why)) != ncclSuccess) {
    MP_WARN("NET/IB: connect: %s", why);
    free(st);
    free(c);
    return ncclInvalidUsage;
  }
  addr_str((struct sockaddr *)&peer, c->b.peer, sizeof(c->b.peer));
  st->deadline = mplane_now_s() + cfg->connect_timeout_s;
  c->b.sl = opts->service_level;
  c->b.tc_class = opts->tc_class;
  c->b.ar = mpib_ar_choose(d->link_layer, opts->adaptive_routing, &st->ar_why);
  c->ar_threshold = (size_t)cfg->ib_ar_threshold;
  c->split = cfg->ib_split_data_on_qps;
  c->relayed = opts->relayed;
  snprintf(c->staging_gpu, sizeof(c->staging_gpu), "%s", opts->staging_gpu);
  /* RoCE: the class's DSCP in the IP header's traffic-class byte (DSCP << 2, ECN bits left 0), or
   * the site's one value (MPLANE_IB_TC / NCCL_IB_TC: its lossless queue with PFC) */
  if (d->link_layer != IBV_LINK_LAYER_ETHERNET) c->b.tclass = 0;
  else c->b.tclass = mplane_tc_roce_tclass_of(c->b.sl, 0, opts->comm_tclass);
  int fd = socket(peer.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) goto fail;
  c->b.fd = fd;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  if (connect(fd, (struct sockaddr *)&peer, peer_len) != 0 && errno != EINPROGRESS) goto fail;
  *out = st;
  return ncclSuccess;
fail:
  MP_WARN("NET/IB: %s: connecting to peer %s failed: %s", d->props.name, c->b.peer, strerror(errno));
  stage_free(st);
  return ncclRemoteError;
}

static ncclResult_t stage_progress(struct mpib_connect_stage *st, int *done) {
  struct mpib_send_comm *c = st->comm;
  int fd = c->b.fd;
  *done = 0;
  if (st->stage == 0) {
    struct pollfd p = {.fd = fd, .events = POLLOUT};
    if (poll(&p, 1, 0) <= 0) return ncclSuccess;
    int soerr = 0;
    socklen_t len = sizeof(soerr);
    getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
    if (soerr) {
      MP_WARN("NET/IB: %s: connecting to peer %s failed: %s", c->b.dev->props.name, c->b.peer, strerror(soerr));
      return ncclRemoteError;
    }
    MP_CHECK(base_open(&c->b, c->b.devindex, mpib_config()->ib_qps));
    MP_CHECK(mpib_send_comm_setup(c));
    info_fill(&st->out, &c->b);
    ece_offer(&c->b, &st->out);
    st->out.fifo_addr = (uint64_t)(uintptr_t)c->fifo;
    st->out.fifo_rkey = c->fifo_mr->rkey;
    st->out.sl = c->b.sl;
    st->out.tclass = c->b.tclass;
    st->out.ar = c->b.ar;
    st->out.tc_class = c->b.tc_class;
    st->stage = 1;
    st->done = 0;
  }
  int r = 1;
  if (st->stage == 1 && (r = io_some(fd, &st->out, sizeof(st->out), &st->done, 1)) == 1) {
    st->stage = 2;
    st->done = 0;
  }
  if (r == 1 && st->stage == 2 && (r = io_some(fd, &st->in, sizeof(st->in), &st->done, 0)) == 1) {
    MP_CHECK(info_check(&st->in, &c->b));
    if (st->in.nqps != c->b.nqps) {
      MP_WARN("NET/IB: peer %s answered with %u QPs, we have %d", c->b.peer, st->in.nqps, c->b.nqps);
      return ncclInvalidUsage;
    }
    MP_CHECK(ece_apply(&c->b, &st->in));
    for (int i = 0; i < c->b.nqps; i++)
      MP_CHECK(mpib_qp_connect(&c->b, c->b.qps[i], st->in.qpn[i], st->in.lid, st->in.gid, (int)st->in.mtu));
    st->stage = 3;
    st->done = 0;
  }
  if (r == 1 && st->stage == 3) {
    unsigned char ready = MPIB_READY;
    if ((r = io_some(fd, &ready, 1, &st->done, 1)) == 1) *done = 1;
  }
  if (r < 0) {
    MP_WARN("NET/IB: %s: peer %s closed the side channel during setup (peer process exited, or it refused us: see "
            "its log)", c->b.dev->props.name, c->b.peer);
    return ncclRemoteError;
  }
  return ncclSuccess;
}

ncclResult_t mpib_connect(int dev, const struct mplane_comm_opts *opts, void *handle, void **send_comm) {
  *send_comm = NULL;
  struct mpib_connect_stage *st = mplane_connect_stage_find(&connect_stages, handle, MPIB_STAGE_OFFSET);
  if (!st) {
    struct mplane_handle h;
    char why[256];
    ncclResult_t res = mplane_handle_decode(handle, &h, why, sizeof(why));
    if (res != ncclSuccess) {
      MP_WARN("NET/IB: connect: %s", why);
      return res;
    }
    if (h.transport != MPLANE_HANDLE_IB) {
      MP_WARN("NET/IB: connect: the peer listens on the socket transport, this rank runs InfiniBand: set the same "
              "MPLANE_TRANSPORT on every node");
      return ncclInvalidUsage;
    }
    if (!mpib_dev_get(dev)) return ncclInvalidArgument;
    MP_CHECK(stage_open(dev, opts, &h, &st));
    st->comm->b.devindex = dev;
    if (mplane_connect_stage_keep(&connect_stages, handle, MPIB_STAGE_OFFSET, st) != 0) {
      stage_free(st);
      return ncclSystemError;
    }
  }
  int done = 0;
  ncclResult_t res = stage_progress(st, &done);
  if (res == ncclSuccess && !done && mplane_now_s() > st->deadline) {
    MP_WARN("NET/IB: no connection to peer %s within %d s (MPLANE_CONNECT_TIMEOUT): is its side channel reachable?",
            st->comm->b.peer, mpib_config()->connect_timeout_s);
    res = ncclRemoteError;
  }
  if (res != ncclSuccess) {
    mplane_connect_stage_drop(&connect_stages, handle, MPIB_STAGE_OFFSET, st);
    stage_free(st);
    return res;
  }
  if (!done) return ncclSuccess;
  struct mpib_send_comm *c = st->comm;
  const char *ar_why = st->ar_why;
  st->comm = NULL;
  mplane_connect_stage_drop(&connect_stages, handle, MPIB_STAGE_OFFSET, st);
  stage_free(st);
  mpib_comm_register(&c->b);
  char ar[96];
  MP_INFO(NCCL_NET, "NET/IB: %s connected to peer %s: %d QPs (%s), SL %d, traffic class %d, adaptive routing %s, %s",
          c->b.dev->props.name, c->b.peer, c->b.nqps, c->split ? "large messages striped" : "whole messages, round-robin",
          c->b.sl, c->b.tclass, ar_str(c->b.ar, c->ar_threshold, ar_why, ar, sizeof(ar)), ece_str(&c->b));
  *send_comm = c;
  return ncclSuccess;
}

/* ------------------------------------------------------------------ a comm's own memory, set up and closed */
void *mpib_alloc_pages(size_t bytes) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, (bytes + 4095) & ~(size_t)4095) != 0) return NULL;
  memset(p, 0, bytes);
  return p;
}

struct ibv_mr *mpib_reg_local(struct mpib_comm_base *b, void *p, size_t bytes, int access, const char *what) {
  struct ibv_mr *mr = mpib_v.reg_mr(b->dev->hca->pd, p, bytes, access);
  if (!mr) MP_WARN("NET/IB: %s: registering the %s (%zu bytes) failed: %s", b->dev->props.name, what, bytes,
                   strerror(errno));
  return mr;
}

ncclResult_t mpib_send_comm_setup(struct mpib_send_comm *c) {
  c->fifo = mpib_alloc_pages(sizeof(struct mpib_fifo_wire) * MPIB_MAX_REQS);
  if (!c->fifo) return ncclSystemError;
  c->fifo_mr = mpib_reg_local(&c->b, c->fifo, sizeof(struct mpib_fifo_wire) * MPIB_MAX_REQS,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "send FIFO");
  if (!c->fifo_mr) return ncclSystemError;
  for (int i = 0; i < MPIB_MAX_SENDS; i++) {
    c->reqs[i].kind = MPIB_REQ_SEND;
    c->reqs[i].comm = c;
  }
  return ncclSuccess;
}

#define MPIB_LENS (MPIB_MAX_REQS * MPIB_MAX_RECVS * MPIB_MAX_QPS)

ncclResult_t mpib_recv_comm_setup(struct mpib_recv_comm *c) {
  c->slots = mpib_alloc_pages(sizeof(struct mpib_fifo_wire) * MPIB_MAX_REQS);
  c->lens = mpib_alloc_pages(sizeof(uint64_t) * MPIB_LENS);
  if (!c->slots || !c->lens) return ncclSystemError;
  c->slots_mr = mpib_reg_local(&c->b, c->slots, sizeof(struct mpib_fifo_wire) * MPIB_MAX_REQS, IBV_ACCESS_LOCAL_WRITE,
                          "FIFO staging");
  c->lens_mr = mpib_reg_local(&c->b, c->lens, sizeof(uint64_t) * MPIB_LENS,
                         IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE, "length records");
  if (!c->slots_mr || !c->lens_mr) return ncclSystemError;
  for (int i = 0; i < MPIB_MAX_REQS; i++) {
    c->reqs[i].kind = MPIB_REQ_RECV;
    c->reqs[i].comm = c;
  }
  for (int i = 0; i < MPIB_MAX_FLUSHES; i++) {
    c->freqs[i].kind = MPIB_REQ_FLUSH;
    c->freqs[i].comm = c;
  }
  return ncclSuccess;
}

/* ------------------------------------------------------------------ close */
ncclResult_t mpib_close_send(void *send_comm) {
  struct mpib_send_comm *c = send_comm;
  if (!c) return ncclSuccess;
  mpib_comm_unregister(&c->b);
  mpib_comm_base_destroy(&c->b);
  mpib_stage_destroy(c);
  if (c->fifo_mr) mpib_v.dereg_mr(c->fifo_mr);
  free(c->fifo);
  free(c);
  return ncclSuccess;
}

ncclResult_t mpib_close_recv(void *recv_comm) {
  struct mpib_recv_comm *c = recv_comm;
  if (!c) return ncclSuccess;
  mpib_comm_unregister(&c->b);
  if (c->flush_qp) mpib_v.destroy_qp(c->flush_qp);
  mpib_comm_base_destroy(&c->b);
  if (c->slots_mr) mpib_v.dereg_mr(c->slots_mr);
  if (c->lens_mr) mpib_v.dereg_mr(c->lens_mr);
  if (c->flush_mr) mpib_v.dereg_mr(c->flush_mr);
  free(c->slots);
  free(c->lens);
  free(c->flush_buf);
  free(c);
  return ncclSuccess;
}
