/* softverbs: a software libibverbs for tests (see softverbs.h for the environment it reads).
 *
 * Model. Each process that loads it has one "NIC" thread. Every RC QP owns an abstract Unix socket
 * named after its QP number; a requester QP connects to its peer's socket and streams requests
 * (RDMA write, write with immediate, read, send, 8-byte fetch-and-add) that the responder's NIC thread
 * executes against its own registered memory, answering each with a response (ACK, NAK with a work-completion status,
 * or read data). So registered memory is "shared" between processes the way a NIC shares it: the
 * responder's NIC thread writes into it. The NIC thread only does non-blocking I/O.
 *
 * What is checked like real verbs: QP state transitions and their required attribute masks; posting
 * on a QP that is not RTS (send) / still RESET (recv) fails with EINVAL; local keys and bounds
 * (IBV_WC_LOC_PROT_ERR); remote keys, access rights and bounds (IBV_WC_REM_ACCESS_ERR on the
 * requester); address checks (dest QPN, LID/GID, subnet) - a mismatch is a silent drop on real
 * fabrics, so it ends in IBV_WC_RETRY_EXC_ERR; a dead peer also ends in IBV_WC_RETRY_EXC_ERR (for the
 * requests it leaves unanswered: a peer that goes away while nothing is outstanding is noticed only at
 * the next request, and never fails receives or completions already delivered); after
 * an error the QP is in ERR and everything else is flushed (IBV_WC_WR_FLUSH_ERR).
 * What real hardware does and a lenient double would hide: a send-queue entry is free again only when
 * a completion is polled - a signaled WR's own, or for an unsignaled WR a later signaled one of its
 * QP (the responder's ACK alone frees nothing); a full CQ is fatal (IBV_EVENT_CQ_ERR, then every QP
 * on it goes to ERR with IBV_EVENT_QP_FATAL); a WR longer than the port's max_msg_sz (1 GiB) ends
 * in IBV_WC_LOC_LEN_ERR; and an RDMA write is not placed in address order: a small write (up to
 * 4 KiB) lands in 64-byte lines from its last line to its first, each line whole (the unit PCIe
 * writes arrive in), so a reader may see the end of a write before its start.
 * GPU memory (an MR registered through a dma-buf): a completion seen by the CPU does not mean the
 * GPU sees the bytes. The data of an RDMA READ that lands in such an MR is held back (the GPU, and
 * the CPU's view of the memfd, still show the old bytes) until the device that placed it reads
 * GPU memory itself - a READ it answers from a dma-buf MR, which is what a flush through a
 * loopback QP is - or places a later write or atomic there (PCIe keeps one device's writes in
 * order). Holding is per device: a flush through another HCA does not release it.
 */
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <arpa/inet.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "softverbs.h"

/* verbs.h wraps these exported names in macros; we define the exported functions themselves. */
#undef ibv_query_port
#undef ibv_reg_mr
#undef ibv_reg_mr_iova

#define SV_EXPORT __attribute__((visibility("default")))
#define SV_MAX_DEVS 32
#define SV_MAX_PORTS 4
#define SV_PKEY_TABLE 128 /* P_Key table entries per port */
#define SV_MAGIC 0x53565842u
#define SV_SMALL 4096
#define SV_MAX_SGE 16
#define SV_MAX_INLINE 256
#define SV_MAX_MSG (1u << 30) /* max_msg_sz of every port, as ConnectX reports */

/* ------------------------------------------------------------------ wire */
enum sv_op { SV_OP_WRITE = 1, SV_OP_WRITE_IMM, SV_OP_READ, SV_OP_SEND, SV_OP_FETCH_ADD };
/* Ops whose response carries data into the requester's SGEs (a read's bytes, an atomic's old value). */
#define SV_OP_READS(op) ((op) == SV_OP_READ || (op) == SV_OP_FETCH_ADD)

struct sv_hello {
  uint32_t magic, src_qpn, dst_qpn, is_global;
  uint32_t src_lid, dst_lid;
  int32_t src_fabric, pad;
  uint8_t src_gid[16], dst_gid[16];
};
struct sv_req {
  uint32_t op, seq;
  uint64_t len, raddr;
  uint32_t rkey, imm;
  uint64_t add; /* FETCH_ADD: the value added */
};
struct sv_resp {
  uint32_t seq, status;
  uint64_t len;
};

/* ------------------------------------------------------------------ objects */
struct sv_dev {
  struct ibv_device ibdev;
  int index, nports, link_layer, fabric;
  int default_prefix; /* IB: GID prefix fe80:: whatever the subnet (each SM left its default) */
  int lid0, sm_lid;   /* the first port's LID (0: derived from the index) and the SM's LID (0: 1) */
  int grh_required; /* IB ports that take only global addresses (SR-IOV VFs in cloud VMs) */
  int gid_shift;    /* RoCE: entries an added IPv6 address put before the IPv4 ones (gid_move_after) */
  uint32_t ece;     /* ECE options its QPs support; 0: no ECE (ibv_query_ece/ibv_set_ece say EOPNOTSUPP) */
  uint32_t ip; /* network order, RoCE */
  uint32_t ip2;           /* RoCE: a second IPv4 address (another VLAN's), GID entries 4 and 5 */
  struct in6_addr ip6;    /* RoCE: a global IPv6 address, GID entries 6 and 7 */
  int has_ip6;
  uint32_t speed;   /* lane speed bit (SDR 1 .. HDR 64, NDR 128, XDR 256); 0: HDR */
  int verbs_version; /* the rdma-core it plays: < 48 reports no active_speed_ex (0: the newest) */
  int no_ext_ctx;    /* its context is not extended: only the exported ibv_query_port answers */
  int no_atomics;    /* atomic_cap IBV_ATOMIC_NONE: an atomic it is asked to serve is an invalid request */
  uint64_t guid;
  int port_state[SV_MAX_PORTS + 1];
};

struct sv_event {
  struct ibv_async_event ev;
  struct sv_event *next;
};

struct sv_ctx {
  /* rdma-core's extended context (its ibv_context, vctx.context, is what callers get): only the
   * size-aware query_port of its extended ops is set, the others read as absent */
  struct verbs_context vctx;
  struct sv_dev *dev;
  int pipe[2];
  struct sv_event *head, *tail;
  struct sv_ctx *next;
};

#define SV_CTX(c) ((struct sv_ctx *)(void *)((char *)(c) - offsetof(struct sv_ctx, vctx.context)))

/* READ data held back from GPU memory until its device flushes (see the model above). */
struct sv_held {
  struct sv_dev *dev; /* the device whose requester QP placed it */
  struct sv_mr *mr;
  char *dst;
  size_t len;
  struct sv_held *next;
  char data[];
};

struct sv_mr {
  struct ibv_mr mr;
  char *host;      /* where iova `mr.addr` lives in this process */
  int access, dead;
  void *map;       /* dma-buf mapping to unmap */
  size_t maplen;
  struct sv_mr *next;
};

struct sv_qp;
/* A send completion frees its QP's send-queue entries up to `upto` when it is polled. */
struct sv_cqref {
  struct sv_qp *qp; /* NULL: a receive completion, or its QP was destroyed */
  unsigned upto;
};

struct sv_cq {
  struct ibv_cq cq;
  struct ibv_wc *ring;
  struct sv_cqref *refs; /* beside ring */
  unsigned cap, head, count;
  int dead, overrun;
};

struct sv_swr {
  uint64_t wr_id;
  int op, signaled;
  uint32_t seq, imm, rkey;
  uint64_t raddr, len, add;
  int nsge;
  struct ibv_sge sge[SV_MAX_SGE];
  char *inl;
  int fault_status;
};

struct sv_rwr {
  uint64_t wr_id;
  int nsge;
  struct ibv_sge sge[SV_MAX_SGE];
};

struct sv_obuf { /* pending output on a socket: header bytes then payload segments */
  char hdr[sizeof(struct sv_hello) + sizeof(struct sv_req)];
  size_t hlen, hoff;
  const char *seg[SV_MAX_SGE];
  size_t seglen[SV_MAX_SGE];
  int nseg, cur;
  size_t segoff;
  struct sv_obuf *next;
};

struct sv_in; /* an accepted requester connection (we are the responder) */

struct sv_qp {
  struct ibv_qp qp;
  struct sv_ctx *sctx;
  int port, dead, access;
  struct ibv_qp_attr attr;
  struct ibv_qp_cap cap;
  int sq_sig_all;
  int lfd;
  /* requester */
  int ofd, oconnected, obroken;
  /* ring: [sq_free .. sq_done) done, not yet freed by a polled completion; [sq_done .. sq_sent)
   * awaiting response; [sq_sent .. sq_tail) queued */
  struct sv_swr *sq;
  unsigned sq_cap, sq_free, sq_done, sq_sent, sq_tail;
  uint32_t next_seq;
  int hello_sent;
  struct sv_obuf out;
  int out_busy;
  struct sv_resp rhdr;    /* response being read */
  size_t rhave;
  uint64_t rdata_off;     /* read response payload progress */
  int in_resp_payload;
  /* responder */
  struct sv_rwr *rq;
  unsigned rq_cap, rq_head, rq_tail;
  struct sv_in *ins;
  unsigned long n_write, n_write_imm, n_read, n_atomic, n_send, n_recv, n_signaled;
  uint32_t ece;           /* the ECE options it runs with (its device's, narrowed by ibv_set_ece) */
  struct sv_qp *next;
};

struct sv_in {
  int fd, dead, stalled, bad;
  char why[128];
  struct sv_qp *qp;
  struct sv_hello hello;
  size_t hhave;
  struct sv_req req;
  size_t qhave;
  /* payload of the current request */
  int in_payload;
  uint64_t poff;
  char *target;           /* NULL: discard */
  struct sv_rwr rwr;      /* SEND target */
  int have_rwr;
  uint32_t status;
  char small[SV_SMALL];
  struct sv_obuf *outq, *outq_tail;
  struct sv_in *next;
};

static struct {
  pthread_mutex_t lock;
  int inited;
  int ndev;
  struct sv_dev devs[SV_MAX_DEVS];
  struct ibv_device *list[SV_MAX_DEVS + 1];
  struct sv_ctx *ctxs;
  struct sv_mr *mrs;
  struct sv_qp *qps;
  pthread_t nic;
  int nic_started, wake_fd;
  char ns[64];
  /* faults */
  long err_wr, port_down_after, port_flap_after, qp_fatal_after, async_dead_after;
  int err_status;
  char fault_dev[64];
  long nwr;
  int dmabuf;
  uint32_t key_seed;
  struct sv_held *held, *held_tail; /* oldest first */
  unsigned long held_bytes, released_bytes;
} G = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void lock(void) { pthread_mutex_lock(&G.lock); }
static void unlock(void) { pthread_mutex_unlock(&G.lock); }

static void wake_nic(void) {
  if (G.wake_fd >= 0) {
    uint64_t one = 1;
    if (write(G.wake_fd, &one, sizeof(one)) < 0) {}
  }
}

static void record(const char *fmt, ...) {
  const char *path = getenv(SV_RECORD_ENV);
  if (!path || !*path) return;
  char line[1024];
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(line, sizeof(line) - 1, fmt, ap);
  va_end(ap);
  if (n < 0) return;
  if (n > (int)sizeof(line) - 2) n = (int)sizeof(line) - 2;
  line[n++] = '\n';
  int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return;
  if (write(fd, line, (size_t)n) < 0) {}
  close(fd);
}

/* ------------------------------------------------------------------ configuration */
static uint32_t speed_bit(const char *name) {
  static const char *names[] = {"sdr", "ddr", "qdr", "fdr10", "fdr", "edr", "hdr", "ndr", "xdr"};
  for (unsigned i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (!strcmp(name, names[i])) return 1u << i;
  return 0;
}

/* ip6= takes '-' for ':', which separates a device's fields: 2001-db8--5 is 2001:db8::5. */
static int parse_ip6(const char *text, struct in6_addr *out) {
  char buf[64];
  snprintf(buf, sizeof(buf), "%s", text);
  for (char *p = buf; *p; p++)
    if (*p == '-') *p = ':';
  return inet_pton(AF_INET6, buf, out) == 1;
}

static void parse_devices(void) {
  const char *spec = getenv(SV_DEVICES_ENV);
  if (!spec || !*spec) spec = "mlx5_0:ib,mlx5_1:ib";
  char buf[2048];
  snprintf(buf, sizeof(buf), "%s", spec);
  char *save = NULL;
  for (char *tok = strtok_r(buf, ",", &save); tok && G.ndev < SV_MAX_DEVS; tok = strtok_r(NULL, ",", &save)) {
    struct sv_dev *d = &G.devs[G.ndev];
    memset(d, 0, sizeof(*d));
    d->index = G.ndev;
    d->nports = 1;
    d->link_layer = IBV_LINK_LAYER_INFINIBAND;
    d->fabric = G.ndev;
    int down = 0;
    char *s2 = NULL;
    char *name = strtok_r(tok, ":", &s2);
    if (!name) continue;
    for (char *f = strtok_r(NULL, ":", &s2); f; f = strtok_r(NULL, ":", &s2)) {
      if (!strcmp(f, "ib")) d->link_layer = IBV_LINK_LAYER_INFINIBAND;
      else if (!strcmp(f, "roce")) d->link_layer = IBV_LINK_LAYER_ETHERNET;
      else if (!strncmp(f, "ports=", 6)) d->nports = atoi(f + 6);
      else if (!strncmp(f, "down=", 5)) down |= 1 << atoi(f + 5);
      else if (!strncmp(f, "ip=", 3)) inet_pton(AF_INET, f + 3, &d->ip);
      else if (!strncmp(f, "ip2=", 4)) inet_pton(AF_INET, f + 4, &d->ip2);
      else if (!strncmp(f, "ip6=", 4)) d->has_ip6 = parse_ip6(f + 4, &d->ip6);
      else if (!strncmp(f, "subnet=", 7)) d->fabric = atoi(f + 7);
      else if (!strcmp(f, "grh")) d->grh_required = 1;
      else if (!strcmp(f, "defprefix")) d->default_prefix = 1;
      else if (!strncmp(f, "lid=", 4)) d->lid0 = atoi(f + 4);
      else if (!strncmp(f, "smlid=", 6)) d->sm_lid = atoi(f + 6);
      else if (!strncmp(f, "ece=", 4)) d->ece = (uint32_t)strtoul(f + 4, NULL, 16);
      else if (!strncmp(f, "speed=", 6)) d->speed = speed_bit(f + 6);
      else if (!strncmp(f, "rdma=", 5)) d->verbs_version = atoi(f + 5);
      else if (!strcmp(f, "noext")) d->no_ext_ctx = 1;
      else if (!strcmp(f, "noatomic")) d->no_atomics = 1;
    }
    if (d->nports < 1) d->nports = 1;
    if (d->nports > SV_MAX_PORTS) d->nports = SV_MAX_PORTS;
    for (int p = 1; p <= d->nports; p++) d->port_state[p] = (down & (1 << p)) ? IBV_PORT_DOWN : IBV_PORT_ACTIVE;
    snprintf(d->ibdev.name, sizeof(d->ibdev.name), "%s", name);
    snprintf(d->ibdev.dev_name, sizeof(d->ibdev.dev_name), "uverbs%d", G.ndev);
    snprintf(d->ibdev.dev_path, sizeof(d->ibdev.dev_path), "/nonexistent/softverbs/uverbs%d", G.ndev);
    snprintf(d->ibdev.ibdev_path, sizeof(d->ibdev.ibdev_path), "/nonexistent/softverbs/%s", name);
    d->ibdev.node_type = IBV_NODE_CA;
    d->ibdev.transport_type = IBV_TRANSPORT_IB;
    d->guid = 0x0002c90300000000ull | ((uint64_t)(G.ndev + 1) << 8);
    G.list[G.ndev] = &d->ibdev;
    G.ndev++;
  }
  G.list[G.ndev] = NULL;
}

static void parse_faults(void) {
  G.err_status = IBV_WC_RETRY_EXC_ERR;
  const char *spec = getenv(SV_FAULTS_ENV);
  if (!spec) return;
  char buf[512];
  snprintf(buf, sizeof(buf), "%s", spec);
  char *save = NULL;
  for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    if (!strncmp(t, "err_wr=", 7)) G.err_wr = atol(t + 7);
    else if (!strncmp(t, "err_status=", 11)) G.err_status = atoi(t + 11);
    else if (!strncmp(t, "port_down_after=", 16)) G.port_down_after = atol(t + 16);
    else if (!strncmp(t, "port_flap_after=", 16)) G.port_flap_after = atol(t + 16);
    else if (!strncmp(t, "async_dead_after=", 17)) G.async_dead_after = atol(t + 17);
    else if (!strncmp(t, "qp_fatal_after=", 15)) G.qp_fatal_after = atol(t + 15);
    else if (!strncmp(t, "dev=", 4)) snprintf(G.fault_dev, sizeof(G.fault_dev), "%s", t + 4);
  }
}

static void *nic_thread(void *arg);

static void atfork_child(void) {
  /* The NIC thread does not exist in a child: start afresh (objects of the parent are unusable). */
  pthread_mutex_init(&G.lock, NULL);
  G.nic_started = 0;
  G.wake_fd = -1;
  G.ctxs = NULL;
  G.mrs = NULL;
  G.qps = NULL;
  G.nwr = 0;
}

static void init_once(void) {
  if (G.inited) return;
  G.inited = 1;
  G.wake_fd = -1;
  parse_devices();
  parse_faults();
  const char *d = getenv("SOFTVERBS_DMABUF");
  G.dmabuf = d && atoi(d) == 1;
  const char *ns = getenv("SOFTVERBS_NS");
  if (ns && *ns) snprintf(G.ns, sizeof(G.ns), "%s", ns);
  else snprintf(G.ns, sizeof(G.ns), "u%u", (unsigned)getuid());
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  G.key_seed = (uint32_t)(ts.tv_nsec ^ (getpid() << 12));
  pthread_atfork(NULL, NULL, atfork_child);
}

static int start_nic(void) {
  if (G.nic_started) return 0;
  G.wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (G.wake_fd < 0) return -1;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&G.nic, &a, nic_thread, NULL) != 0) return -1;
  G.nic_started = 1;
  return 0;
}

static uint32_t new_key(void) {
  /* xorshift: keys look random so that a stale or foreign key is caught */
  uint32_t x = G.key_seed;
  do {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
  } while (x == 0);
  G.key_seed = x;
  return x;
}

/* ------------------------------------------------------------------ addressing */
static uint16_t port_lid(const struct sv_dev *d, int port) {
  return (uint16_t)(d->lid0 ? d->lid0 + port - 1 : 1 + d->index * 8 + port);
}

/* Fill gid for (dev, port, index); returns gid type, or -1 for an empty/invalid entry. */
/* ::ffff:a.b.c.d, the GID of an IPv4 address (ip in network order). */
static void ipv4_mapped_gid(union ibv_gid *gid, uint32_t ip) {
  gid->raw[10] = 0xff;
  gid->raw[11] = 0xff;
  memcpy(gid->raw + 12, &ip, 4);
}

static int port_gid(const struct sv_dev *d, int port, int index, union ibv_gid *gid) {
  memset(gid, 0, sizeof(*gid));
  uint64_t prefix = 0xfe80000000000000ull | (d->default_prefix ? 0 : (uint64_t)(unsigned)d->fabric);
  uint64_t iid = d->guid + (uint64_t)port;
  if (d->link_layer == IBV_LINK_LAYER_INFINIBAND) {
    if (index != 0) return -1;
    gid->global.subnet_prefix = htobe64(prefix);
    gid->global.interface_id = htobe64(iid);
    return IBV_GID_TYPE_IB;
  }
  if (d->gid_shift && (index == 2 || index == 3)) { /* a global IPv6 address, 2001:db8::1 */
    gid->raw[0] = 0x20;
    gid->raw[1] = 0x01;
    gid->raw[2] = 0x0d;
    gid->raw[3] = 0xb8;
    gid->raw[15] = 1;
    return index == 2 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
  }
  if (index >= 4) index -= d->gid_shift;
  switch (index) {
    case 0:
    case 1:
      gid->global.subnet_prefix = htobe64(0xfe80000000000000ull);
      gid->global.interface_id = htobe64(iid);
      return index == 0 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    case 2:
    case 3:
      if (!d->ip) return -1;
      ipv4_mapped_gid(gid, d->ip);
      return index == 2 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    case 4:
    case 5:
      if (!d->ip2) return -1;
      ipv4_mapped_gid(gid, d->ip2);
      return index == 4 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    case 6:
    case 7:
      if (!d->has_ip6) return -1;
      memcpy(gid->raw, &d->ip6, 16);
      return index == 6 ? IBV_GID_TYPE_ROCE_V1 : IBV_GID_TYPE_ROCE_V2;
    default:
      return -1;
  }
}

static int gid_tbl_len(const struct sv_dev *d) {
  if (d->link_layer == IBV_LINK_LAYER_INFINIBAND) return 1;
  return (d->ip2 || d->has_ip6 ? 8 : 4) + d->gid_shift;
}

static void qp_sockname(uint32_t qpn, struct sockaddr_un *sa, socklen_t *len) {
  memset(sa, 0, sizeof(*sa));
  sa->sun_family = AF_UNIX;
  int n = snprintf(sa->sun_path + 1, sizeof(sa->sun_path) - 1, "softverbs.%s.qp.%06x", G.ns, qpn);
  *len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + 1 + (size_t)n);
}

/* ------------------------------------------------------------------ completions and errors */
static void cq_push(struct sv_cq *cq, const struct ibv_wc *wc, struct sv_qp *sq_of, unsigned upto) {
  if (!cq || cq->dead) return;
  if (cq->count == cq->cap) {
    if (!cq->overrun) {
      cq->overrun = 1;
      wake_nic(); /* the NIC thread fails the CQ's QPs (fail_overrun_qps) at its next turn */
      struct sv_ctx *c = SV_CTX(cq->cq.context);
      struct sv_event *e = calloc(1, sizeof(*e));
      if (e) {
        e->ev.event_type = IBV_EVENT_CQ_ERR;
        e->ev.element.cq = &cq->cq;
        if (c->tail) c->tail->next = e;
        else c->head = e;
        c->tail = e;
        char b = 1;
        if (write(c->pipe[1], &b, 1) < 0) {}
      }
    }
    return;
  }
  cq->ring[(cq->head + cq->count) % cq->cap] = *wc;
  cq->refs[(cq->head + cq->count) % cq->cap] = (struct sv_cqref){sq_of, upto};
  cq->count++;
}

static void post_event(struct sv_ctx *c, enum ibv_event_type type, void *elem, int port) {
  struct sv_event *e = calloc(1, sizeof(*e));
  if (!e) return;
  e->ev.event_type = type;
  if (type == IBV_EVENT_PORT_ERR || type == IBV_EVENT_PORT_ACTIVE || type == IBV_EVENT_GID_CHANGE)
    e->ev.element.port_num = port;
  else if (type == IBV_EVENT_CQ_ERR) e->ev.element.cq = elem;
  else e->ev.element.qp = elem;
  if (c->tail) c->tail->next = e;
  else c->head = e;
  c->tail = e;
  char b = 1;
  if (write(c->pipe[1], &b, 1) < 0) {}
}

static enum ibv_wc_opcode swr_wc_opcode(int op) {
  switch (op) {
    case SV_OP_WRITE:
    case SV_OP_WRITE_IMM: return IBV_WC_RDMA_WRITE;
    case SV_OP_READ: return IBV_WC_RDMA_READ;
    case SV_OP_FETCH_ADD: return IBV_WC_FETCH_ADD;
    default: return IBV_WC_SEND;
  }
}

/* w is the WR at ring position idx: its completion, when polled, frees the entries up to and including it. */
static void complete_swr(struct sv_qp *q, struct sv_swr *w, unsigned idx, int status, uint32_t byte_len) {
  if (status == IBV_WC_SUCCESS && !w->signaled) goto out;
  struct ibv_wc wc;
  memset(&wc, 0, sizeof(wc));
  wc.wr_id = w->wr_id;
  wc.status = status;
  wc.opcode = swr_wc_opcode(w->op);
  wc.byte_len = byte_len;
  wc.qp_num = q->qp.qp_num;
  wc.vendor_err = status ? 0x81 : 0;
  cq_push((struct sv_cq *)q->qp.send_cq, &wc, q, idx + 1);
out:
  free(w->inl);
  w->inl = NULL;
}

static void close_in(struct sv_in *in) {
  if (in->fd >= 0) close(in->fd);
  in->fd = -1;
  in->dead = 1;
  while (in->outq) {
    struct sv_obuf *o = in->outq;
    in->outq = o->next;
    free(o);
  }
  in->outq_tail = NULL;
}

/* Move q to ERR: the first outstanding send WR gets `status`, the rest and all receives are flushed. */
static void qp_fail(struct sv_qp *q, int status) {
  int first = 1;
  for (unsigned i = q->sq_done; i != q->sq_tail; i++) {
    complete_swr(q, &q->sq[i % q->sq_cap], i, first ? status : IBV_WC_WR_FLUSH_ERR, 0);
    first = 0;
  }
  q->sq_done = q->sq_sent = q->sq_tail;
  for (unsigned i = q->rq_head; i != q->rq_tail; i++) {
    struct ibv_wc wc;
    memset(&wc, 0, sizeof(wc));
    wc.wr_id = q->rq[i % q->rq_cap].wr_id;
    wc.status = IBV_WC_WR_FLUSH_ERR;
    wc.opcode = IBV_WC_RECV;
    wc.qp_num = q->qp.qp_num;
    cq_push((struct sv_cq *)q->qp.recv_cq, &wc, NULL, 0);
  }
  q->rq_head = q->rq_tail;
  q->qp.state = IBV_QPS_ERR;
  if (q->ofd >= 0) close(q->ofd);
  q->ofd = -1;
  q->obroken = 1;
  q->out_busy = 0;
  q->rhave = 0;
  q->in_resp_payload = 0;
}

static void port_down(struct sv_dev *d, int port) {
  if (d->port_state[port] == IBV_PORT_DOWN) return;
  d->port_state[port] = IBV_PORT_DOWN;
  record("event=port_down pid=%d dev=%s port=%d", (int)getpid(), d->ibdev.name, port);
  for (struct sv_qp *q = G.qps; q; q = q->next) {
    if (q->dead || q->sctx->dev != d || q->port != port) continue;
    qp_fail(q, IBV_WC_RETRY_EXC_ERR);
    for (struct sv_in *in = q->ins; in; in = in->next) close_in(in);
    if (q->lfd >= 0) close(q->lfd); /* the port is gone: nobody can reach this QP any more */
    q->lfd = -1;
  }
  for (struct sv_ctx *c = G.ctxs; c; c = c->next)
    if (c->dev == d) post_event(c, IBV_EVENT_PORT_ERR, NULL, port);
}

/* A test's hand on the interface: an IPv6 address is added to a RoCE device's interface; its GIDs
 * take indices 2 and 3 and the IPv4 ones move to 4 and 5, and the port reports IBV_EVENT_GID_CHANGE.
 * 0, or -1 if there is no such RoCE device. */
SV_EXPORT int softverbs_gid_move(const char *dev) {
  lock();
  init_once();
  int rc = -1;
  for (int i = 0; i < G.ndev; i++) {
    struct sv_dev *d = &G.devs[i];
    if (strcmp(d->ibdev.name, dev) || d->link_layer != IBV_LINK_LAYER_ETHERNET) continue;
    d->gid_shift = 2;
    record("event=gid_move pid=%d dev=%s", (int)getpid(), d->ibdev.name);
    for (struct sv_ctx *c = G.ctxs; c; c = c->next)
      if (c->dev == d) post_event(c, IBV_EVENT_GID_CHANGE, NULL, 1);
    rc = 0;
  }
  unlock();
  return rc;
}

/* ------------------------------------------------------------------ exported: devices */
static int fork_init_called, device_list_called;

SV_EXPORT struct ibv_device **ibv_get_device_list(int *num) {
  lock();
  init_once();
  device_list_called = 1;
  struct ibv_device **l = calloc((size_t)G.ndev + 1, sizeof(*l));
  if (l) memcpy(l, G.list, sizeof(*l) * ((size_t)G.ndev + 1));
  if (num) *num = l ? G.ndev : 0;
  unlock();
  if (!l) errno = ENOMEM;
  return l;
}

SV_EXPORT void ibv_free_device_list(struct ibv_device **list) { free(list); }
SV_EXPORT const char *ibv_get_device_name(struct ibv_device *device) { return device->name; }
SV_EXPORT __be64 ibv_get_device_guid(struct ibv_device *device) {
  return htobe64(((struct sv_dev *)device)->guid);
}
/* Recorded, with whether it came before the device list (rdma-core wants it before anything else). */
SV_EXPORT int ibv_fork_init(void) {
  lock();
  fork_init_called++;
  record("event=fork_init calls=%d before_device_list=%d", fork_init_called, !device_list_called);
  unlock();
  return 0;
}

SV_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device);
SV_EXPORT int ibv_close_device(struct ibv_context *context);

static int sv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc);
static int sv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad);
static int sv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad);
static int sv_query_port_ext(struct ibv_context *context, uint8_t port, struct ibv_port_attr *a, size_t len);

SV_EXPORT struct ibv_context *ibv_open_device(struct ibv_device *device) {
  struct sv_ctx *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  if (pipe2(c->pipe, O_CLOEXEC) != 0) {
    free(c);
    return NULL;
  }
  c->dev = (struct sv_dev *)device;
  c->vctx.context.device = device;
  c->vctx.context.ops.poll_cq = sv_poll_cq;
  c->vctx.context.ops.post_send = sv_post_send;
  c->vctx.context.ops.post_recv = sv_post_recv;
  c->vctx.context.cmd_fd = -1;
  c->vctx.context.async_fd = c->pipe[0];
  c->vctx.context.num_comp_vectors = 1;
  pthread_mutex_init(&c->vctx.context.mutex, NULL);
  if (!c->dev->no_ext_ctx) {
    c->vctx.sz = sizeof(c->vctx);
    c->vctx.query_port = sv_query_port_ext;
    c->vctx.context.abi_compat = __VERBS_ABI_IS_EXTENDED;
  }
  lock();
  c->next = G.ctxs;
  G.ctxs = c;
  unlock();
  return &c->vctx.context;
}

SV_EXPORT int ibv_close_device(struct ibv_context *context) {
  struct sv_ctx *c = SV_CTX(context);
  lock();
  for (struct sv_ctx **p = &G.ctxs; *p; p = &(*p)->next)
    if (*p == c) {
      *p = c->next;
      break;
    }
  unlock();
  close(c->pipe[0]);
  close(c->pipe[1]);
  while (c->head) {
    struct sv_event *e = c->head;
    c->head = e->next;
    free(e);
  }
  free(c);
  return 0;
}

SV_EXPORT int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *a) {
  struct sv_dev *d = SV_CTX(context)->dev;
  memset(a, 0, sizeof(*a));
  snprintf(a->fw_ver, sizeof(a->fw_ver), "softverbs-1.0");
  a->node_guid = htobe64(d->guid);
  a->sys_image_guid = htobe64(d->guid);
  a->max_mr_size = 1ull << 40;
  a->page_size_cap = 4096;
  a->vendor_id = 0x02c9;
  a->vendor_part_id = 4129;
  a->max_qp = 65536;
  a->max_qp_wr = 16384;
  a->max_sge = SV_MAX_SGE;
  a->max_cq = 65536;
  a->max_cqe = 1 << 22;
  a->max_mr = 1 << 20;
  a->max_pd = 1 << 16;
  a->max_qp_rd_atom = 16;
  a->max_qp_init_rd_atom = 16;
  a->atomic_cap = d->no_atomics ? IBV_ATOMIC_NONE : IBV_ATOMIC_HCA;
  a->phys_port_cnt = (uint8_t)d->nports;
  return 0;
}

/* rdma-core >= 48's struct ibv_port_attr: active_speed_ex follows port_cap_flags2 (offset 52). */
#define SV_PORT_ATTR_LEN 56
#define SV_PORT_ATTR_LEN_OLD 52 /* rdma-core < 48 */
#define SV_SPEED_EX_OFFSET 52

/* What the library's provider fills: the whole struct of the rdma-core played. */
static int port_fill(struct sv_dev *d, uint8_t port, unsigned char *buf) {
  if (port < 1 || port > d->nports) return EINVAL;
  memset(buf, 0, SV_PORT_ATTR_LEN);
  struct ibv_port_attr *a = (struct ibv_port_attr *)buf;
  lock();
  a->state = d->port_state[port];
  unlock();
  a->max_mtu = IBV_MTU_4096;
  a->active_mtu = IBV_MTU_4096;
  a->gid_tbl_len = gid_tbl_len(d);
  a->max_msg_sz = SV_MAX_MSG;
  a->lid = d->link_layer == IBV_LINK_LAYER_INFINIBAND ? port_lid(d, port) : 0;
  a->sm_lid = (uint16_t)(d->sm_lid ? d->sm_lid : 1);
  a->max_vl_num = 4;
  a->active_width = 2; /* 4x */
  /* the kernel's speed, HDR by default; one beyond 8 bits (XDR) leaves active_speed 0 */
  uint32_t speed = d->speed ? d->speed : 64;
  a->active_speed = speed <= 0xff ? (uint8_t)speed : 0;
  a->phys_state = a->state == IBV_PORT_ACTIVE ? 5 : 3;
  a->link_layer = (uint8_t)d->link_layer;
  a->flags = d->grh_required ? IBV_QPF_GRH_REQUIRED : 0;
  if (d->verbs_version == 0 || d->verbs_version >= 48) memcpy(buf + SV_SPEED_EX_OFFSET, &speed, sizeof(speed));
  return 0;
}

static size_t port_attr_len(const struct sv_dev *d) {
  return d->verbs_version == 0 || d->verbs_version >= 48 ? SV_PORT_ATTR_LEN : SV_PORT_ATTR_LEN_OLD;
}

/* The extended context's query_port: as rdma-core, it fills at most len bytes and zeroes what it
 * does not know of a longer caller's struct. */
static int sv_query_port_ext(struct ibv_context *context, uint8_t port, struct ibv_port_attr *a, size_t len) {
  struct sv_dev *d = SV_CTX(context)->dev;
  unsigned char buf[SV_PORT_ATTR_LEN];
  int rc = port_fill(d, port, buf);
  if (rc) return rc;
  size_t known = port_attr_len(d);
  memset(a, 0, len);
  memcpy(a, buf, len < known ? len : known);
  return 0;
}

/* The exported ibv_query_port: as rdma-core, only the original struct's fields (up to `flags`),
 * whatever the caller's struct holds. */
SV_EXPORT int ibv_query_port(struct ibv_context *context, uint8_t port, struct _compat_ibv_port_attr *compat) {
  struct ibv_port_attr *a = (struct ibv_port_attr *)compat;
  struct sv_dev *d = SV_CTX(context)->dev;
  unsigned char buf[SV_PORT_ATTR_LEN];
  int rc = port_fill(d, port, buf);
  if (rc) return rc;
  memcpy(a, buf, offsetof(struct ibv_port_attr, flags) + sizeof(a->flags));
  return 0;
}

SV_EXPORT int ibv_query_gid(struct ibv_context *context, uint8_t port, int index, union ibv_gid *gid) {
  struct sv_dev *d = SV_CTX(context)->dev;
  if (port < 1 || port > d->nports || index < 0 || index >= gid_tbl_len(d)) return -1;
  port_gid(d, port, index, gid); /* an empty entry reads as zeros, as in sysfs */
  return 0;
}

SV_EXPORT int _ibv_query_gid_ex(struct ibv_context *context, uint32_t port, uint32_t index,
                                struct ibv_gid_entry *entry, uint32_t flags, size_t entry_size) {
  struct sv_dev *d = SV_CTX(context)->dev;
  if (flags || entry_size < sizeof(*entry)) return EINVAL;
  if (port < 1 || (int)port > d->nports || index >= (uint32_t)gid_tbl_len(d)) return EINVAL;
  int type = port_gid(d, (int)port, (int)index, &entry->gid);
  if (type < 0) return ENODATA;
  entry->gid_index = index;
  entry->port_num = port;
  entry->gid_type = (uint32_t)type;
  entry->ndev_ifindex = 0;
  return 0;
}

/* ------------------------------------------------------------------ PD, MR */
SV_EXPORT struct ibv_pd *ibv_alloc_pd(struct ibv_context *context) {
  struct ibv_pd *pd = calloc(1, sizeof(*pd));
  if (!pd) return NULL;
  pd->context = context;
  lock();
  pd->handle = new_key();
  unlock();
  return pd;
}
SV_EXPORT int ibv_dealloc_pd(struct ibv_pd *pd) {
  free(pd);
  return 0;
}

static struct ibv_mr *reg(struct ibv_pd *pd, char *host, size_t len, uint64_t iova, int access, void *map,
                          size_t maplen) {
  if (!pd || (!host && len)) {
    errno = EINVAL;
    return NULL;
  }
  /* Remote write/atomic need local write, as in the kernel. */
  if ((access & (IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC)) && !(access & IBV_ACCESS_LOCAL_WRITE)) {
    errno = EINVAL;
    return NULL;
  }
  struct sv_mr *m = calloc(1, sizeof(*m));
  if (!m) {
    errno = ENOMEM;
    return NULL;
  }
  m->mr.context = pd->context;
  m->mr.pd = pd;
  m->mr.addr = (void *)(uintptr_t)iova;
  m->mr.length = len;
  m->host = host;
  m->access = access;
  m->map = map;
  m->maplen = maplen;
  lock();
  m->mr.lkey = new_key();
  m->mr.rkey = new_key();
  m->mr.handle = m->mr.lkey;
  m->next = G.mrs;
  G.mrs = m;
  unlock();
  record("event=reg_mr pid=%d length=%zu dmabuf=%d relaxed_ordering=%d", (int)getpid(), len, map != NULL,
         (access & IBV_ACCESS_RELAXED_ORDERING) != 0);
  return &m->mr;
}

SV_EXPORT struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access) {
  return reg(pd, addr, length, (uintptr_t)addr, access, NULL, 0);
}
SV_EXPORT struct ibv_mr *ibv_reg_mr_iova2(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                          unsigned int access) {
  return reg(pd, addr, length, iova, (int)access, NULL, 0);
}
SV_EXPORT struct ibv_mr *ibv_reg_mr_iova(struct ibv_pd *pd, void *addr, size_t length, uint64_t iova,
                                         int access) {
  return reg(pd, addr, length, iova, access, NULL, 0);
}

SV_EXPORT struct ibv_mr *ibv_reg_dmabuf_mr(struct ibv_pd *pd, uint64_t offset, size_t length, uint64_t iova,
                                           int fd, int access) {
  lock();
  init_once();
  int ok = G.dmabuf;
  unlock();
  if (!ok) {
    errno = EOPNOTSUPP;
    return NULL;
  }
  if (fd < 0) {
    errno = EBADF;
    return NULL;
  }
  long pg = sysconf(_SC_PAGESIZE);
  uint64_t base = offset & ~(uint64_t)(pg - 1);
  size_t maplen = length + (size_t)(offset - base);
  void *map = mmap(NULL, maplen, PROT_READ | PROT_WRITE, MAP_SHARED, fd, (off_t)base);
  if (map == MAP_FAILED) return NULL;
  struct ibv_mr *mr = reg(pd, (char *)map + (offset - base), length, iova, access, map, maplen);
  if (!mr) munmap(map, maplen);
  return mr;
}

SV_EXPORT int ibv_dereg_mr(struct ibv_mr *mr) {
  struct sv_mr *m = (struct sv_mr *)mr;
  record("event=dereg_mr pid=%d length=%zu", (int)getpid(), m->mr.length);
  lock();
  m->dead = 1; /* the struct stays: in-flight operations see `dead` and fail instead of touching memory */
  if (m->map) munmap(m->map, m->maplen);
  m->map = NULL;
  unlock();
  return 0;
}

/* Find the MR for [iova, iova+len) with key `key` (lkey or rkey); NULL if none or out of bounds. */
static struct sv_mr *mr_find(uint32_t key, int remote, struct ibv_pd *pd, uint64_t iova, uint64_t len, int need) {
  for (struct sv_mr *m = G.mrs; m; m = m->next) {
    if (m->dead || (remote ? m->mr.rkey : m->mr.lkey) != key) continue;
    if (pd && m->mr.pd != pd) return NULL;
    if ((m->access & need) != need) return NULL;
    uint64_t base = (uint64_t)(uintptr_t)m->mr.addr;
    if (iova < base || len > m->mr.length || iova - base > m->mr.length - len) return NULL;
    return m;
  }
  return NULL;
}

static char *mr_host(struct sv_mr *m, uint64_t iova) { return m->host + (iova - (uint64_t)(uintptr_t)m->mr.addr); }

/* GPU memory: READ data a device placed there stays invisible until that device flushes (caller
 * holds the lock). */
static int mr_is_gpu(const struct sv_mr *m) { return m && m->map != NULL; }

static void held_add(struct sv_dev *dev, struct sv_mr *m, char *dst, const char *data, size_t len) {
  struct sv_held *h = malloc(sizeof(*h) + len);
  if (!h) { /* no room to hold it: place it (a lenient double, never a crash) */
    memcpy(dst, data, len);
    return;
  }
  *h = (struct sv_held){.dev = dev, .mr = m, .dst = dst, .len = len};
  memcpy(h->data, data, len);
  if (G.held_tail) G.held_tail->next = h;
  else G.held = h;
  G.held_tail = h;
  G.held_bytes += len;
}

/* dev read or wrote GPU memory: everything it placed there before is visible now, in order. */
static void held_release(struct sv_dev *dev, const char *why) {
  struct sv_held **pp = &G.held, *prev = NULL;
  unsigned long n = 0;
  while (*pp) {
    struct sv_held *h = *pp;
    if (h->dev != dev) {
      prev = h;
      pp = &h->next;
      continue;
    }
    if (!h->mr->dead) memcpy(h->dst, h->data, h->len); /* a deregistered MR's mapping is gone */
    n += h->len;
    *pp = h->next;
    if (G.held_tail == h) G.held_tail = prev;
    free(h);
  }
  if (n) {
    G.released_bytes += n;
    record("event=gpu_flush pid=%d dev=%s bytes=%lu by=%s", (int)getpid(), dev->ibdev.name, n, why);
  }
}

/* ------------------------------------------------------------------ CQ */
SV_EXPORT struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                                       struct ibv_comp_channel *channel, int comp_vector) {
  if (cqe < 1 || cqe > (1 << 22)) {
    errno = EINVAL;
    return NULL;
  }
  struct sv_cq *c = calloc(1, sizeof(*c));
  if (!c) return NULL;
  c->cap = (unsigned)cqe;
  c->ring = calloc(c->cap, sizeof(*c->ring));
  c->refs = calloc(c->cap, sizeof(*c->refs));
  if (!c->ring || !c->refs) {
    free(c->ring);
    free(c->refs);
    free(c);
    errno = ENOMEM;
    return NULL;
  }
  c->cq.context = context;
  c->cq.channel = channel;
  c->cq.cq_context = cq_context;
  c->cq.cqe = cqe;
  pthread_mutex_init(&c->cq.mutex, NULL);
  pthread_cond_init(&c->cq.cond, NULL);
  return &c->cq;
}

SV_EXPORT int ibv_destroy_cq(struct ibv_cq *cq) {
  struct sv_cq *c = (struct sv_cq *)cq;
  lock();
  for (struct sv_qp *q = G.qps; q; q = q->next)
    if (!q->dead && (q->qp.send_cq == cq || q->qp.recv_cq == cq)) {
      unlock();
      return EBUSY;
    }
  c->dead = 1;
  free(c->ring);
  free(c->refs);
  c->ring = NULL;
  c->refs = NULL;
  unlock();
  return 0; /* the struct is kept: the NIC thread may still hold a pointer */
}

static int sv_poll_cq(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
  struct sv_cq *c = (struct sv_cq *)cq;
  lock();
  int got = 0;
  while (got < n && c->count > 0) {
    wc[got++] = c->ring[c->head];
    struct sv_cqref *ref = &c->refs[c->head];
    if (ref->qp && (int)(ref->upto - ref->qp->sq_free) > 0) ref->qp->sq_free = ref->upto; /* credit back */
    c->head = (c->head + 1) % c->cap;
    c->count--;
  }
  unlock();
  return got;
}

/* ------------------------------------------------------------------ QP */
SV_EXPORT struct ibv_qp *ibv_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *ia) {
  if (!pd || !ia || ia->qp_type != IBV_QPT_RC || !ia->send_cq || !ia->recv_cq || ia->srq) {
    errno = ia && ia->qp_type != IBV_QPT_RC ? EOPNOTSUPP : EINVAL;
    return NULL;
  }
  if (ia->cap.max_send_wr > 16384 || ia->cap.max_recv_wr > 16384 || ia->cap.max_send_sge > SV_MAX_SGE ||
      ia->cap.max_recv_sge > SV_MAX_SGE || ia->cap.max_inline_data > SV_MAX_INLINE) {
    errno = EINVAL;
    return NULL;
  }
  struct sv_qp *q = calloc(1, sizeof(*q));
  if (!q) return NULL;
  q->sq_cap = ia->cap.max_send_wr ? ia->cap.max_send_wr : 1;
  q->rq_cap = ia->cap.max_recv_wr; /* 0: no receive can be posted, as on hardware */
  q->sq = calloc(q->sq_cap, sizeof(*q->sq));
  q->rq = calloc(q->rq_cap ? q->rq_cap : 1, sizeof(*q->rq));
  if (!q->sq || !q->rq) {
    free(q->sq);
    free(q->rq);
    free(q);
    errno = ENOMEM;
    return NULL;
  }
  q->cap = ia->cap; /* inline data as asked: a post with more fails, as it may on hardware */
  q->ece = SV_CTX(pd->context)->dev->ece;
  q->sq_sig_all = ia->sq_sig_all;
  q->sctx = SV_CTX(pd->context);
  q->qp.context = pd->context;
  q->qp.qp_context = ia->qp_context;
  q->qp.pd = pd;
  q->qp.send_cq = ia->send_cq;
  q->qp.recv_cq = ia->recv_cq;
  q->qp.qp_type = IBV_QPT_RC;
  q->qp.state = IBV_QPS_RESET;
  pthread_mutex_init(&q->qp.mutex, NULL);
  pthread_cond_init(&q->qp.cond, NULL);
  q->ofd = -1;
  /* A QP number is claimed by binding its abstract socket name. */
  q->lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  lock();
  init_once();
  for (int tries = 0; q->lfd >= 0 && tries < 1000; tries++) {
    uint32_t qpn = 0x100 + (new_key() % 0xfffe00u);
    struct sockaddr_un sa;
    socklen_t len;
    qp_sockname(qpn, &sa, &len);
    if (bind(q->lfd, (struct sockaddr *)&sa, len) == 0) {
      q->qp.qp_num = qpn;
      break;
    }
  }
  if (q->lfd < 0 || q->qp.qp_num == 0 || listen(q->lfd, 64) != 0 || start_nic() != 0) {
    unlock();
    if (q->lfd >= 0) close(q->lfd);
    free(q->sq);
    free(q->rq);
    free(q);
    errno = ENOMEM;
    return NULL;
  }
  q->qp.handle = q->qp.qp_num;
  q->next = G.qps;
  G.qps = q;
  unlock();
  record("event=create_qp pid=%d qpn=%u max_send_wr=%u max_recv_wr=%u max_inline_data=%u", (int)getpid(), q->qp.qp_num,
         ia->cap.max_send_wr, ia->cap.max_recv_wr, ia->cap.max_inline_data);
  wake_nic();
  return &q->qp;
}

static void record_qp(struct sv_qp *q, const char *state) {
  struct ibv_qp_attr *a = &q->attr;
  char dgid[INET6_ADDRSTRLEN] = "";
  inet_ntop(AF_INET6, a->ah_attr.grh.dgid.raw, dgid, sizeof(dgid));
  record("event=modify pid=%d dev=%s port=%d qpn=%u state=%s dest_qpn=%u sl=%u traffic_class=%u is_global=%u "
         "sgid_index=%u dgid=%s dlid=%u hop_limit=%u path_mtu=%d timeout=%u retry_cnt=%u rnr_retry=%u "
         "min_rnr_timer=%u max_rd_atomic=%u max_dest_rd_atomic=%u pkey_index=%u ece=%u",
         (int)getpid(), q->sctx->dev->ibdev.name, q->port, q->qp.qp_num, state, a->dest_qp_num, a->ah_attr.sl,
         a->ah_attr.grh.traffic_class, a->ah_attr.is_global, a->ah_attr.grh.sgid_index, dgid, a->ah_attr.dlid,
         a->ah_attr.grh.hop_limit, (int)a->path_mtu, a->timeout, a->retry_cnt, a->rnr_retry, a->min_rnr_timer,
         a->max_rd_atomic, a->max_dest_rd_atomic, a->pkey_index, q->ece);
}

SV_EXPORT int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask) {
  struct sv_qp *q = (struct sv_qp *)qp;
  struct sv_dev *d = q->sctx->dev;
  int rc = 0;
  lock();
  enum ibv_qp_state cur = q->qp.state;
  enum ibv_qp_state next = (mask & IBV_QP_STATE) ? attr->qp_state : cur;
  int need = 0, allowed = 0;
  if (next == IBV_QPS_RESET || next == IBV_QPS_ERR) {
    allowed = ~0;
  } else if (cur == IBV_QPS_RESET && next == IBV_QPS_INIT) {
    need = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
    allowed = need;
  } else if (cur == IBV_QPS_INIT && next == IBV_QPS_INIT) {
    allowed = IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS;
  } else if (cur == IBV_QPS_INIT && next == IBV_QPS_RTR) {
    need = IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
           IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER;
    allowed = need | IBV_QP_ACCESS_FLAGS | IBV_QP_PKEY_INDEX | IBV_QP_ALT_PATH;
  } else if (cur == IBV_QPS_RTR && next == IBV_QPS_RTS) {
    need = IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
           IBV_QP_MAX_QP_RD_ATOMIC;
    allowed = need | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH | IBV_QP_PATH_MIG_STATE;
  } else if (cur == IBV_QPS_RTS && next == IBV_QPS_RTS) {
    allowed = IBV_QP_STATE | IBV_QP_ACCESS_FLAGS | IBV_QP_MIN_RNR_TIMER | IBV_QP_ALT_PATH;
  } else {
    rc = EINVAL; /* not a transition RC QPs have */
    goto out;
  }
  if ((mask & need) != need || (mask & ~allowed)) {
    rc = EINVAL;
    goto out;
  }
  if (mask & IBV_QP_PORT) {
    if (attr->port_num < 1 || attr->port_num > d->nports) {
      rc = EINVAL;
      goto out;
    }
    q->port = attr->port_num;
  }
  if (mask & IBV_QP_ACCESS_FLAGS) q->access = attr->qp_access_flags;
  if (mask & IBV_QP_PKEY_INDEX) {
    if (attr->pkey_index >= SV_PKEY_TABLE) { /* as a port's P_Key table of SV_PKEY_TABLE entries refuses it */
      rc = EINVAL;
      goto out;
    }
    q->attr.pkey_index = attr->pkey_index;
  }
  if (mask & IBV_QP_AV) {
    const struct ibv_ah_attr *ah = &attr->ah_attr;
    if (d->link_layer == IBV_LINK_LAYER_ETHERNET) {
      union ibv_gid g;
      /* RoCE has no LIDs: the address must be global, from a valid GID entry. */
      if (!ah->is_global || ah->grh.sgid_index >= gid_tbl_len(d) || port_gid(d, q->port, ah->grh.sgid_index, &g) < 0) {
        rc = EINVAL;
        goto out;
      }
    } else if ((!ah->is_global && ah->dlid == 0) || (d->grh_required && !ah->is_global)) {
      rc = EINVAL; /* as a GRH-required port's driver refuses an address without a GRH */
      goto out;
    }
    if (ah->sl > 15) {
      rc = EINVAL;
      goto out;
    }
    q->attr.ah_attr = *ah;
  }
  if (mask & IBV_QP_PATH_MTU) q->attr.path_mtu = attr->path_mtu;
  if (mask & IBV_QP_DEST_QPN) q->attr.dest_qp_num = attr->dest_qp_num;
  if (mask & IBV_QP_RQ_PSN) q->attr.rq_psn = attr->rq_psn;
  if (mask & IBV_QP_SQ_PSN) q->attr.sq_psn = attr->sq_psn;
  if (mask & IBV_QP_MAX_DEST_RD_ATOMIC) q->attr.max_dest_rd_atomic = attr->max_dest_rd_atomic;
  if (mask & IBV_QP_MAX_QP_RD_ATOMIC) q->attr.max_rd_atomic = attr->max_rd_atomic;
  if (mask & IBV_QP_MIN_RNR_TIMER) q->attr.min_rnr_timer = attr->min_rnr_timer;
  if (mask & IBV_QP_TIMEOUT) q->attr.timeout = attr->timeout;
  if (mask & IBV_QP_RETRY_CNT) {
    if (attr->retry_cnt > 7) {
      rc = EINVAL;
      goto out;
    }
    q->attr.retry_cnt = attr->retry_cnt;
  }
  if (mask & IBV_QP_RNR_RETRY) q->attr.rnr_retry = attr->rnr_retry;
  if (next == IBV_QPS_ERR && cur != IBV_QPS_ERR) qp_fail(q, IBV_WC_WR_FLUSH_ERR);
  if (next == IBV_QPS_RESET) {
    qp_fail(q, IBV_WC_WR_FLUSH_ERR);
    q->obroken = 0;
    q->hello_sent = 0;
  }
  q->qp.state = next;
  if (next == IBV_QPS_RTR && cur != IBV_QPS_RTR) record_qp(q, "RTR");
  if (next == IBV_QPS_RTS && cur != IBV_QPS_RTS) record_qp(q, "RTS");
out:
  unlock();
  wake_nic();
  return rc;
}

SV_EXPORT int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int mask, struct ibv_qp_init_attr *init) {
  struct sv_qp *q = (struct sv_qp *)qp;
  lock();
  *attr = q->attr;
  attr->qp_state = q->qp.state;
  attr->cur_qp_state = q->qp.state;
  attr->port_num = (uint8_t)q->port;
  attr->qp_access_flags = q->access;
  attr->cap = q->cap;
  if (init) {
    memset(init, 0, sizeof(*init));
    init->send_cq = q->qp.send_cq;
    init->recv_cq = q->qp.recv_cq;
    init->cap = q->cap;
    init->qp_type = IBV_QPT_RC;
    init->sq_sig_all = q->sq_sig_all;
  }
  unlock();
  (void)mask;
  return 0;
}

/* ECE as ConnectX firmware does it: a QP offers its device's options; setting a peer's offer (before
 * RTR only) leaves what both support, which a later query reports. */
#define SV_ECE_VENDOR 0x15b3
SV_EXPORT int ibv_query_ece(struct ibv_qp *qp, struct ibv_ece *ece) {
  struct sv_qp *q = (struct sv_qp *)qp;
  if (!q->sctx->dev->ece) return EOPNOTSUPP;
  lock();
  *ece = (struct ibv_ece){.vendor_id = SV_ECE_VENDOR, .options = q->ece, .comp_mask = 0};
  unlock();
  return 0;
}

SV_EXPORT int ibv_set_ece(struct ibv_qp *qp, struct ibv_ece *ece) {
  struct sv_qp *q = (struct sv_qp *)qp;
  if (!q->sctx->dev->ece) return EOPNOTSUPP;
  lock();
  int rc = 0;
  if (q->qp.state != IBV_QPS_RESET && q->qp.state != IBV_QPS_INIT) rc = EINVAL; /* only before RTR */
  else if (ece->vendor_id != SV_ECE_VENDOR || ece->comp_mask) rc = EINVAL;
  else q->ece &= ece->options;
  unlock();
  record("event=set_ece pid=%d qpn=%u options=%u rc=%d", (int)getpid(), q->qp.qp_num, ece->options, rc);
  return rc;
}

SV_EXPORT int ibv_destroy_qp(struct ibv_qp *qp) {
  struct sv_qp *q = (struct sv_qp *)qp;
  lock();
  record("event=destroy pid=%d dev=%s port=%d qpn=%u writes=%lu write_imms=%lu reads=%lu sends=%lu recvs=%lu "
         "signaled=%lu atomics=%lu",
         (int)getpid(), q->sctx->dev->ibdev.name, q->port, q->qp.qp_num, q->n_write, q->n_write_imm, q->n_read,
         q->n_send, q->n_recv, q->n_signaled, q->n_atomic);
  for (unsigned i = q->sq_done; i != q->sq_tail; i++) free(q->sq[i % q->sq_cap].inl);
  q->sq_free = q->sq_done = q->sq_sent = q->sq_tail = 0;
  /* its completions still queued free nothing any more: the QP is about to be freed */
  struct sv_cq *scq = (struct sv_cq *)q->qp.send_cq;
  for (unsigned i = 0; scq && scq->refs && i < scq->count; i++)
    if (scq->refs[(scq->head + i) % scq->cap].qp == q) scq->refs[(scq->head + i) % scq->cap].qp = NULL;
  q->dead = 1; /* the NIC thread closes its sockets and drops it */
  unlock();
  wake_nic();
  return 0;
}

/* ------------------------------------------------------------------ async events */
SV_EXPORT int ibv_get_async_event(struct ibv_context *context, struct ibv_async_event *event) {
  struct sv_ctx *c = SV_CTX(context);
  char b;
  for (;;) {
    ssize_t r = read(c->pipe[0], &b, 1);
    if (r == 1) break;
    if (r < 0 && errno == EINTR) continue;
    return -1;
  }
  lock();
  struct sv_event *e = c->head;
  if (e) {
    c->head = e->next;
    if (!c->head) c->tail = NULL;
  }
  unlock();
  if (!e) return -1;
  *event = e->ev;
  free(e);
  return 0;
}

SV_EXPORT void ibv_ack_async_event(struct ibv_async_event *event) { (void)event; }

SV_EXPORT const char *ibv_event_type_str(enum ibv_event_type event) {
  switch (event) {
    case IBV_EVENT_CQ_ERR: return "CQ error";
    case IBV_EVENT_QP_FATAL: return "local work queue catastrophic error";
    case IBV_EVENT_QP_REQ_ERR: return "invalid request local work queue error";
    case IBV_EVENT_QP_ACCESS_ERR: return "local access violation work queue error";
    case IBV_EVENT_PORT_ACTIVE: return "port active";
    case IBV_EVENT_PORT_ERR: return "port error";
    case IBV_EVENT_DEVICE_FATAL: return "local catastrophic error";
    default: return "unknown";
  }
}

SV_EXPORT const char *ibv_wc_status_str(enum ibv_wc_status status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "Work Request Flushed Error";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    default: return "other error";
  }
}

/* ------------------------------------------------------------------ posting */
static int sge_total(const struct ibv_sge *s, int n, uint64_t *out) {
  uint64_t t = 0;
  for (int i = 0; i < n; i++) t += s[i].length;
  *out = t;
  return 0;
}

static void fault_count(struct sv_qp *q, struct sv_swr *w) {
  struct sv_dev *d = q->sctx->dev;
  if (G.fault_dev[0] && strcmp(G.fault_dev, d->ibdev.name) != 0) return;
  long n = ++G.nwr;
  if (G.err_wr && n == G.err_wr) {
    w->fault_status = G.err_status;
    record("event=fault pid=%d dev=%s qpn=%u wr=%ld status=%d", (int)getpid(), d->ibdev.name, q->qp.qp_num, n,
           G.err_status);
  }
}

/* A link that drops and comes back within the transport's retry time: the port reports down, then
 * active again, and no QP notices (hardware retries the packets it lost meanwhile). */
static void port_flap(struct sv_dev *d, int port) {
  record("event=port_flap pid=%d dev=%s port=%d", (int)getpid(), d->ibdev.name, port);
  for (struct sv_ctx *c = G.ctxs; c; c = c->next)
    if (c->dev == d) {
      post_event(c, IBV_EVENT_PORT_ERR, NULL, port);
      post_event(c, IBV_EVENT_PORT_ACTIVE, NULL, port);
    }
}

static void fault_after_post(struct sv_qp *q) {
  struct sv_dev *d = q->sctx->dev;
  if (G.fault_dev[0] && strcmp(G.fault_dev, d->ibdev.name) != 0) return;
  if (G.port_down_after && G.nwr == G.port_down_after) port_down(d, q->port);
  if (G.port_flap_after && G.nwr == G.port_flap_after) port_flap(d, q->port);
  if (G.async_dead_after && G.nwr == G.async_dead_after) {
    /* the device's event channel breaks (a removed device): its fd polls readable (hung up) for
     * ever and ibv_get_async_event fails every time */
    record("event=async_dead pid=%d dev=%s", (int)getpid(), d->ibdev.name);
    for (struct sv_ctx *c = G.ctxs; c; c = c->next)
      if (c->dev == d && c->pipe[1] >= 0) {
        close(c->pipe[1]);
        c->pipe[1] = -1;
      }
  }
  if (G.qp_fatal_after && G.nwr == G.qp_fatal_after) {
    record("event=qp_fatal pid=%d dev=%s qpn=%u", (int)getpid(), d->ibdev.name, q->qp.qp_num);
    qp_fail(q, IBV_WC_WR_FLUSH_ERR);
    post_event(q->sctx, IBV_EVENT_QP_FATAL, &q->qp, 0);
  }
}

static int sv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad) {
  struct sv_qp *q = (struct sv_qp *)qp;
  int rc = 0;
  lock();
  for (; wr; wr = wr->next) {
    if (q->qp.state != IBV_QPS_RTS && q->qp.state != IBV_QPS_ERR && q->qp.state != IBV_QPS_SQD) {
      rc = EINVAL; /* real providers refuse posts before RTS */
      break;
    }
    if (wr->num_sge < 0 || wr->num_sge > (int)(q->cap.max_send_sge ? q->cap.max_send_sge : 1) ||
        wr->num_sge > SV_MAX_SGE) {
      rc = EINVAL;
      break;
    }
    if (q->sq_tail - q->sq_free >= q->sq_cap) {
      rc = ENOMEM; /* full until a completion of this QP is polled */
      break;
    }
    struct sv_swr w;
    memset(&w, 0, sizeof(w));
    switch (wr->opcode) {
      case IBV_WR_RDMA_WRITE: w.op = SV_OP_WRITE; break;
      case IBV_WR_RDMA_WRITE_WITH_IMM: w.op = SV_OP_WRITE_IMM; break;
      case IBV_WR_RDMA_READ: w.op = SV_OP_READ; break;
      case IBV_WR_SEND: w.op = SV_OP_SEND; break;
      case IBV_WR_SEND_WITH_IMM: w.op = SV_OP_SEND; break;
      case IBV_WR_ATOMIC_FETCH_AND_ADD: w.op = SV_OP_FETCH_ADD; break;
      default: rc = EINVAL; break;
    }
    if (rc) break;
    w.wr_id = wr->wr_id;
    w.signaled = q->sq_sig_all || (wr->send_flags & IBV_SEND_SIGNALED);
    w.imm = wr->imm_data;
    w.raddr = wr->wr.rdma.remote_addr;
    w.rkey = wr->wr.rdma.rkey;
    if (w.op == SV_OP_FETCH_ADD) { /* wr.atomic lays its rkey out elsewhere than wr.rdma */
      w.raddr = wr->wr.atomic.remote_addr;
      w.rkey = wr->wr.atomic.rkey;
      w.add = wr->wr.atomic.compare_add;
    }
    w.nsge = wr->num_sge;
    memcpy(w.sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
    sge_total(w.sge, w.nsge, &w.len);
    if (w.op == SV_OP_FETCH_ADD && w.len != 8) { /* an atomic's local buffer is the 8-byte old value */
      rc = EINVAL;
      break;
    }
    if ((wr->send_flags & IBV_SEND_INLINE) && !SV_OP_READS(w.op)) {
      if (w.len > q->cap.max_inline_data) {
        rc = EINVAL;
        break;
      }
      w.inl = malloc(w.len ? w.len : 1);
      if (!w.inl) {
        rc = ENOMEM;
        break;
      }
      size_t off = 0;
      for (int i = 0; i < w.nsge; i++) {
        memcpy(w.inl + off, (void *)(uintptr_t)w.sge[i].addr, w.sge[i].length);
        off += w.sge[i].length;
      }
    }
    fault_count(q, &w);
    if (w.len > SV_MAX_MSG && !w.fault_status) w.fault_status = IBV_WC_LOC_LEN_ERR; /* past max_msg_sz */
    if (q->qp.state == IBV_QPS_ERR) {
      /* Posting to a QP in error is allowed; the request completes flushed. */
      q->sq[q->sq_tail % q->sq_cap] = w;
      q->sq_tail++;
      q->sq_done = q->sq_sent = q->sq_tail;
      complete_swr(q, &w, q->sq_tail - 1, IBV_WC_WR_FLUSH_ERR, 0);
    } else {
      q->sq[q->sq_tail % q->sq_cap] = w;
      q->sq_tail++;
    }
    fault_after_post(q);
  }
  if (rc && bad) *bad = wr;
  unlock();
  wake_nic();
  return rc;
}

static int sv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad) {
  struct sv_qp *q = (struct sv_qp *)qp;
  int rc = 0;
  lock();
  for (; wr; wr = wr->next) {
    if (q->qp.state == IBV_QPS_RESET) {
      rc = EINVAL;
      break;
    }
    if (wr->num_sge < 0 || wr->num_sge > SV_MAX_SGE || q->rq_tail - q->rq_head >= q->rq_cap) {
      rc = wr->num_sge > SV_MAX_SGE ? EINVAL : ENOMEM;
      break;
    }
    struct sv_rwr *r = &q->rq[q->rq_tail % q->rq_cap];
    r->wr_id = wr->wr_id;
    r->nsge = wr->num_sge;
    memcpy(r->sge, wr->sg_list, sizeof(struct ibv_sge) * (size_t)wr->num_sge);
    q->rq_tail++;
    if (q->qp.state == IBV_QPS_ERR) qp_fail(q, IBV_WC_WR_FLUSH_ERR);
  }
  if (rc && bad) *bad = wr;
  for (struct sv_in *in = q->ins; in; in = in->next) in->stalled = 0; /* a stalled write-with-imm may go on */
  unlock();
  wake_nic();
  return rc;
}

/* ------------------------------------------------------------------ NIC thread: output */
/* Write what we can of o; 1 when finished, 0 when the socket is full, -1 on error. */
static int obuf_write(int fd, struct sv_obuf *o) {
  while (o->hoff < o->hlen) {
    ssize_t w = send(fd, o->hdr + o->hoff, o->hlen - o->hoff, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    o->hoff += (size_t)w;
  }
  while (o->cur < o->nseg) {
    if (o->segoff == o->seglen[o->cur]) {
      o->cur++;
      o->segoff = 0;
      continue;
    }
    size_t n = o->seglen[o->cur] - o->segoff;
    if (n > (1 << 20)) n = 1 << 20;
    ssize_t w = send(fd, o->seg[o->cur] + o->segoff, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    o->segoff += (size_t)w;
  }
  return 1;
}

static void gid_of(struct sv_qp *q, int index, uint8_t *out) {
  union ibv_gid g;
  port_gid(q->sctx->dev, q->port, index, &g);
  memcpy(out, g.raw, 16);
}

/* Start the next queued WR on q's outgoing stream: header (after the hello) and payload. */
static void req_start(struct sv_qp *q) {
  struct sv_swr *w = &q->sq[q->sq_sent % q->sq_cap];
  struct sv_obuf *o = &q->out;
  memset(o, 0, sizeof(*o));
  if (w->fault_status) {
    qp_fail(q, w->fault_status);
    return;
  }
  w->seq = q->next_seq++;
  struct sv_req r = {.op = (uint32_t)w->op, .seq = w->seq, .len = w->len, .raddr = w->raddr, .rkey = w->rkey,
                     .imm = w->imm, .add = w->add};
  size_t off = 0;
  int sent_hello = 0;
  if (!q->hello_sent) {
    struct sv_hello h = {.magic = SV_MAGIC, .src_qpn = q->qp.qp_num, .dst_qpn = q->attr.dest_qp_num,
                         .is_global = q->attr.ah_attr.is_global, .src_fabric = q->sctx->dev->fabric};
    struct sv_dev *d = q->sctx->dev;
    h.src_lid = d->link_layer == IBV_LINK_LAYER_INFINIBAND ? port_lid(d, q->port) : 0;
    h.dst_lid = q->attr.ah_attr.dlid;
    gid_of(q, q->attr.ah_attr.is_global ? q->attr.ah_attr.grh.sgid_index : 0, h.src_gid);
    memcpy(h.dst_gid, q->attr.ah_attr.grh.dgid.raw, 16);
    memcpy(o->hdr, &h, sizeof(h));
    off = sizeof(h);
    sent_hello = 1;
  }
  memcpy(o->hdr + off, &r, sizeof(r));
  o->hlen = off + sizeof(r);
  if (!SV_OP_READS(w->op)) {
    if (w->inl) {
      o->seg[o->nseg] = w->inl;
      o->seglen[o->nseg++] = w->len;
    } else {
      for (int i = 0; i < w->nsge; i++) {
        if (!w->sge[i].length) continue;
        struct sv_mr *m = mr_find(w->sge[i].lkey, 0, q->qp.pd, w->sge[i].addr, w->sge[i].length, 0);
        if (!m) {
          /* the WR fails locally: nothing went on the wire */
          memset(o, 0, sizeof(*o));
          q->next_seq--;
          qp_fail(q, IBV_WC_LOC_PROT_ERR);
          return;
        }
        o->seg[o->nseg] = mr_host(m, w->sge[i].addr);
        o->seglen[o->nseg++] = w->sge[i].length;
      }
    }
  }
  if (sent_hello) q->hello_sent = 1;
  q->out_busy = 1;
  switch (w->op) {
    case SV_OP_WRITE: q->n_write++; break;
    case SV_OP_WRITE_IMM: q->n_write_imm++; break;
    case SV_OP_READ: q->n_read++; break;
    case SV_OP_FETCH_ADD: q->n_atomic++; break;
    default: q->n_send++; break;
  }
  if (w->signaled) q->n_signaled++;
}

static void qp_output(struct sv_qp *q) {
  if (q->dead || q->qp.state != IBV_QPS_RTS) return;
  for (;;) {
    if (!q->out_busy) {
      if (q->sq_sent == q->sq_tail) return;
      if (q->ofd < 0) {
        if (q->obroken) {
          qp_fail(q, IBV_WC_RETRY_EXC_ERR);
          return;
        }
        struct sockaddr_un sa;
        socklen_t len;
        qp_sockname(q->attr.dest_qp_num, &sa, &len);
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0 || connect(fd, (struct sockaddr *)&sa, len) != 0) {
          if (fd >= 0) close(fd);
          record("event=unreachable pid=%d qpn=%u dest_qpn=%u", (int)getpid(), q->qp.qp_num, q->attr.dest_qp_num);
          qp_fail(q, IBV_WC_RETRY_EXC_ERR); /* nobody answers at that address */
          return;
        }
        q->ofd = fd;
        q->hello_sent = 0;
      }
      req_start(q);
      if (!q->out_busy) return;
    }
    int r = obuf_write(q->ofd, &q->out);
    if (r < 0) {
      qp_fail(q, IBV_WC_RETRY_EXC_ERR);
      return;
    }
    if (r == 0) return;
    q->out_busy = 0;
    q->sq_sent++;
  }
}

/* ------------------------------------------------------------------ NIC thread: responses (requester) */
/* Scatter `n` bytes arriving from fd into the read WR's local SGEs at offset `off`. */
static ssize_t read_into_sges(int fd, struct sv_qp *q, struct sv_swr *w, uint64_t off, uint64_t n, int *bad) {
  uint64_t pos = 0;
  for (int i = 0; i < w->nsge; i++) {
    uint64_t l = w->sge[i].length;
    if (off >= pos + l) {
      pos += l;
      continue;
    }
    uint64_t in = off - pos, take = l - in;
    if (take > n) take = n;
    struct sv_mr *m = mr_find(w->sge[i].lkey, 0, q->qp.pd, w->sge[i].addr, l, IBV_ACCESS_LOCAL_WRITE);
    if (!m) {
      *bad = 1;
      char sink[4096];
      return recv(fd, sink, take < sizeof(sink) ? take : sizeof(sink), MSG_DONTWAIT);
    }
    if (w->op == SV_OP_READ && mr_is_gpu(m)) { /* held until the device flushes */
      static char hold[1 << 20];
      ssize_t r = recv(fd, hold, take < sizeof(hold) ? take : sizeof(hold), MSG_DONTWAIT);
      if (r > 0) held_add(q->sctx->dev, m, mr_host(m, w->sge[i].addr) + in, hold, (size_t)r);
      return r;
    }
    return recv(fd, mr_host(m, w->sge[i].addr) + in, take, MSG_DONTWAIT);
  }
  return 0;
}

static void qp_input(struct sv_qp *q) {
  for (;;) {
    if (q->ofd < 0) return;
    if (q->rhave < sizeof(q->rhdr)) {
      ssize_t r = recv(q->ofd, (char *)&q->rhdr + q->rhave, sizeof(q->rhdr) - q->rhave, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        /* The responder vanished (process died, QP destroyed, port down). Real RC notices only
         * when a request goes unanswered: with nothing awaiting a response the QP stays in RTS
         * (posted receives and completed work untouched) and the next request ends in
         * IBV_WC_RETRY_EXC_ERR (qp_output, obroken). */
        if (q->rhave == 0 && q->sq_done == q->sq_sent && !q->out_busy) {
          close(q->ofd);
          q->ofd = -1;
          q->obroken = 1;
          return;
        }
        qp_fail(q, IBV_WC_RETRY_EXC_ERR);
        return;
      }
      if (r < 0) return;
      q->rhave += (size_t)r;
      if (q->rhave < sizeof(q->rhdr)) continue;
      q->rdata_off = 0;
    }
    if (q->sq_done == q->sq_sent) {
      qp_fail(q, IBV_WC_GENERAL_ERR); /* a response for nothing: protocol error */
      return;
    }
    struct sv_swr *w = &q->sq[q->sq_done % q->sq_cap];
    if (q->rhdr.seq != w->seq) {
      qp_fail(q, IBV_WC_GENERAL_ERR);
      return;
    }
    if (q->rhdr.status == IBV_WC_SUCCESS && SV_OP_READS(w->op) && q->rdata_off < q->rhdr.len) {
      int bad = 0;
      ssize_t r = read_into_sges(q->ofd, q, w, q->rdata_off, q->rhdr.len - q->rdata_off, &bad);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        qp_fail(q, IBV_WC_RETRY_EXC_ERR);
        return;
      }
      if (r < 0) return;
      q->rdata_off += (uint64_t)r;
      if (bad) w->fault_status = IBV_WC_LOC_PROT_ERR;
      if (q->rdata_off < q->rhdr.len) continue;
    }
    q->rhave = 0;
    int status = (int)q->rhdr.status;
    if (status == IBV_WC_SUCCESS && w->fault_status) status = w->fault_status;
    if (status != IBV_WC_SUCCESS) {
      qp_fail(q, status);
      return;
    }
    complete_swr(q, w, q->sq_done, IBV_WC_SUCCESS, (uint32_t)w->len);
    q->sq_done++;
  }
}

/* ------------------------------------------------------------------ NIC thread: requests (responder) */
static void in_respond(struct sv_in *in, uint32_t seq, uint32_t status, const char *data, uint64_t len) {
  struct sv_obuf *o = calloc(1, sizeof(*o));
  if (!o) {
    close_in(in);
    return;
  }
  struct sv_resp r = {.seq = seq, .status = status, .len = data ? len : 0};
  memcpy(o->hdr, &r, sizeof(r));
  o->hlen = sizeof(r);
  if (data && len) {
    o->seg[0] = data;
    o->seglen[0] = len;
    o->nseg = 1;
  }
  if (in->outq_tail) in->outq_tail->next = o;
  else in->outq = o;
  in->outq_tail = o;
}

/* An atomic runs here, after every earlier request of this stream was placed (the responder serves a
 * QP in order, as an RC responder does), and atomically against the other QPs' atomics. A word
 * outside a window that allows remote atomics is an access error, a word not 8-byte aligned an
 * invalid request, as on real HCAs, and so is any atomic on a device without atomics. The response
 * carries the old value. */
static void in_fetch_add(struct sv_in *in) {
  struct sv_qp *q = in->qp;
  struct sv_req *r = &in->req;
  struct sv_mr *m = mr_find(r->rkey, 1, q->qp.pd, r->raddr, 8, IBV_ACCESS_REMOTE_ATOMIC);
  uint32_t status = IBV_WC_SUCCESS;
  if (r->len != 8 || (r->raddr & 7) || q->sctx->dev->no_atomics) status = IBV_WC_REM_INV_REQ_ERR;
  else if (!m || !(q->access & IBV_ACCESS_REMOTE_ATOMIC)) status = IBV_WC_REM_ACCESS_ERR;
  uint64_t old = 0;
  if (status == IBV_WC_SUCCESS && mr_is_gpu(m)) held_release(q->sctx->dev, "atomic");
  if (status == IBV_WC_SUCCESS) old = __atomic_fetch_add((uint64_t *)mr_host(m, r->raddr), r->add, __ATOMIC_SEQ_CST);
  else
    record("event=atomic_err pid=%d qpn=%u rkey=0x%x addr=0x%llx status=%u", (int)getpid(), q->qp.qp_num, r->rkey,
           (unsigned long long)r->raddr, status);
  in_respond(in, r->seq, status, NULL, 0);
  if (status != IBV_WC_SUCCESS) return;
  /* the old value rides in the response's own buffer: the word itself may change before it is sent */
  struct sv_obuf *o = in->outq_tail;
  struct sv_resp *resp = (struct sv_resp *)o->hdr;
  resp->len = 8;
  memcpy(o->hdr + o->hlen, &old, 8);
  o->hlen += 8;
}

static int hello_ok(struct sv_in *in) {
  struct sv_qp *q = in->qp;
  struct sv_dev *d = q->sctx->dev;
  struct sv_hello *h = &in->hello;
  if (h->magic != SV_MAGIC) return snprintf(in->why, sizeof(in->why), "bad magic"), 0;
  if (h->src_fabric != d->fabric)
    return snprintf(in->why, sizeof(in->why), "subnet %d cannot reach subnet %d", h->src_fabric, d->fabric), 0;
  if (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS)
    return snprintf(in->why, sizeof(in->why), "responder QP not ready (state %d)", q->qp.state), 0;
  if (h->src_qpn != q->attr.dest_qp_num)
    return snprintf(in->why, sizeof(in->why), "source QPN %u, responder expects %u", h->src_qpn, q->attr.dest_qp_num), 0;
  if (d->link_layer == IBV_LINK_LAYER_INFINIBAND && !h->is_global) {
    if (h->dst_lid != port_lid(d, q->port))
      return snprintf(in->why, sizeof(in->why), "DLID %u is not this port's LID %u", h->dst_lid, port_lid(d, q->port)), 0;
    if (!q->attr.ah_attr.is_global && q->attr.ah_attr.dlid != h->src_lid)
      return snprintf(in->why, sizeof(in->why), "responder's DLID %u is not the requester's LID %u",
                      q->attr.ah_attr.dlid, h->src_lid), 0;
  } else {
    int found = 0;
    for (int i = 0; i < gid_tbl_len(d) && !found; i++) {
      union ibv_gid g;
      if (port_gid(d, q->port, i, &g) >= 0 && !memcmp(g.raw, h->dst_gid, 16)) found = 1;
    }
    if (!found) return snprintf(in->why, sizeof(in->why), "DGID is not one of this port's GIDs"), 0;
    if (memcmp(q->attr.ah_attr.grh.dgid.raw, h->src_gid, 16))
      return snprintf(in->why, sizeof(in->why), "responder's DGID is not the requester's GID"), 0;
  }
  return 1;
}

/* Decide where the current request's payload goes; respond to READs. */
static void in_begin(struct sv_in *in) {
  struct sv_qp *q = in->qp;
  struct sv_req *r = &in->req;
  in->target = NULL;
  in->status = IBV_WC_SUCCESS;
  in->poff = 0;
  in->have_rwr = 0;
  if (in->bad || (q->qp.state != IBV_QPS_RTR && q->qp.state != IBV_QPS_RTS)) {
    in->status = IBV_WC_RETRY_EXC_ERR; /* a real responder drops it; the requester times out */
    if (!in->bad) snprintf(in->why, sizeof(in->why), "responder QP not ready (state %d)", q->qp.state);
    record("event=drop pid=%d qpn=%u reason=%s", (int)getpid(), q->qp.qp_num, in->why);
  } else if (r->op == SV_OP_WRITE || r->op == SV_OP_WRITE_IMM) {
    struct sv_mr *m = r->len ? mr_find(r->rkey, 1, q->qp.pd, r->raddr, r->len, IBV_ACCESS_REMOTE_WRITE) : NULL;
    if (r->len && (!m || !(q->access & IBV_ACCESS_REMOTE_WRITE))) {
      in->status = IBV_WC_REM_ACCESS_ERR;
      record("event=rem_access_err pid=%d qpn=%u rkey=0x%x addr=0x%llx len=%llu", (int)getpid(), q->qp.qp_num,
             r->rkey, (unsigned long long)r->raddr, (unsigned long long)r->len);
    } else if (m) {
      if (mr_is_gpu(m)) held_release(q->sctx->dev, "write");
      in->target = mr_host(m, r->raddr);
    }
  } else if (r->op == SV_OP_READ) {
    struct sv_mr *m = r->len ? mr_find(r->rkey, 1, q->qp.pd, r->raddr, r->len, IBV_ACCESS_REMOTE_READ) : NULL;
    if (r->len && (!m || !(q->access & IBV_ACCESS_REMOTE_READ))) {
      in->status = IBV_WC_REM_ACCESS_ERR;
      in_respond(in, r->seq, in->status, NULL, 0);
    } else {
      if (mr_is_gpu(m)) held_release(q->sctx->dev, "read");
      in_respond(in, r->seq, IBV_WC_SUCCESS, m ? mr_host(m, r->raddr) : NULL, r->len);
    }
    in->qhave = 0;
    return;
  } else if (r->op == SV_OP_FETCH_ADD) {
    in_fetch_add(in);
    in->qhave = 0;
    return;
  }
  in->in_payload = 1;
}

/* The request's payload is all here: consume a receive if needed, complete, respond. */
static int in_finish(struct sv_in *in) {
  struct sv_qp *q = in->qp;
  struct sv_req *r = &in->req;
  if (in->status == IBV_WC_SUCCESS && (r->op == SV_OP_WRITE_IMM || r->op == SV_OP_SEND)) {
    if (!in->have_rwr) {
      if (q->rq_head == q->rq_tail) {
        in->stalled = 1; /* RNR: wait for a receive to be posted */
        return 0;
      }
      in->rwr = q->rq[q->rq_head % q->rq_cap];
      q->rq_head++;
      in->have_rwr = 1;
    }
    struct ibv_wc wc;
    memset(&wc, 0, sizeof(wc));
    wc.wr_id = in->rwr.wr_id;
    wc.status = IBV_WC_SUCCESS;
    wc.opcode = r->op == SV_OP_SEND ? IBV_WC_RECV : IBV_WC_RECV_RDMA_WITH_IMM;
    wc.byte_len = (uint32_t)r->len;
    wc.qp_num = q->qp.qp_num;
    wc.src_qp = q->attr.dest_qp_num;
    if (r->op == SV_OP_WRITE_IMM) {
      wc.wc_flags = IBV_WC_WITH_IMM;
      wc.imm_data = r->imm;
    }
    q->n_recv++;
    cq_push((struct sv_cq *)q->qp.recv_cq, &wc, NULL, 0);
  }
  in_respond(in, r->seq, in->status, NULL, 0);
  in->in_payload = 0;
  in->qhave = 0;
  return 1;
}

/* SEND payload goes into the receive WR's SGEs; take the receive now. */
static int send_target(struct sv_in *in) {
  struct sv_qp *q = in->qp;
  if (!in->have_rwr) {
    if (q->rq_head == q->rq_tail) return 0;
    in->rwr = q->rq[q->rq_head % q->rq_cap];
    q->rq_head++;
    in->have_rwr = 1;
    uint64_t cap;
    sge_total(in->rwr.sge, in->rwr.nsge, &cap);
    if (cap < in->req.len) in->status = IBV_WC_REM_INV_REQ_ERR;
  }
  return 1;
}

/* Land a small write the way PCIe may: in whole 64-byte lines (aligned in the target's address space),
 * the last line first, each made visible before the one below it, so a reader that polls the start of
 * a write may find its end there already and its start not yet. */
static void place_descending(char *dst, const char *src, size_t n) {
  size_t end = n;
  while (end > 0) {
    uintptr_t a = (uintptr_t)(dst + end - 1) & ~(uintptr_t)63;
    size_t start = a > (uintptr_t)dst ? (size_t)(a - (uintptr_t)dst) : 0;
    memcpy(dst + start, src + start, end - start);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    end = start;
  }
}

static void in_input(struct sv_in *in) {
  for (;;) {
    if (in->dead || in->stalled) return;
    if (in->hhave < sizeof(in->hello)) {
      ssize_t r = recv(in->fd, (char *)&in->hello + in->hhave, sizeof(in->hello) - in->hhave, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_in(in);
        return;
      }
      if (r < 0) return;
      in->hhave += (size_t)r;
      if (in->hhave < sizeof(in->hello)) continue;
      if (!hello_ok(in)) {
        in->bad = 1;
        record("event=drop pid=%d qpn=%u reason=%s", (int)getpid(), in->qp->qp.qp_num, in->why);
      }
      continue;
    }
    if (!in->in_payload) {
      ssize_t r = recv(in->fd, (char *)&in->req + in->qhave, sizeof(in->req) - in->qhave, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_in(in);
        return;
      }
      if (r < 0) return;
      in->qhave += (size_t)r;
      if (in->qhave < sizeof(in->req)) continue;
      in_begin(in);
      continue;
    }
    struct sv_req *rq = &in->req;
    if (rq->op == SV_OP_SEND && in->status == IBV_WC_SUCCESS && !send_target(in)) {
      in->stalled = 1;
      return;
    }
    if (in->poff < rq->len) {
      uint64_t left = rq->len - in->poff;
      ssize_t r;
      if (in->status != IBV_WC_SUCCESS) {
        char sink[8192];
        r = recv(in->fd, sink, left < sizeof(sink) ? left : sizeof(sink), MSG_DONTWAIT);
      } else if (rq->op == SV_OP_SEND) {
        /* scatter into the receive SGEs */
        uint64_t pos = 0;
        r = 0;
        for (int i = 0; i < in->rwr.nsge; i++) {
          uint64_t l = in->rwr.sge[i].length;
          if (in->poff >= pos + l) {
            pos += l;
            continue;
          }
          uint64_t off = in->poff - pos, take = l - off;
          if (take > left) take = left;
          struct sv_mr *m = mr_find(in->rwr.sge[i].lkey, 0, in->qp->qp.pd, in->rwr.sge[i].addr, l, IBV_ACCESS_LOCAL_WRITE);
          if (!m) {
            in->status = IBV_WC_REM_OP_ERR;
            r = 0;
            break;
          }
          r = recv(in->fd, mr_host(m, in->rwr.sge[i].addr) + off, take, MSG_DONTWAIT);
          break;
        }
        if (in->status != IBV_WC_SUCCESS) continue;
      } else if (rq->len <= SV_SMALL) {
        r = recv(in->fd, in->small + in->poff, left, MSG_DONTWAIT);
      } else {
        r = recv(in->fd, in->target + in->poff, left > (1 << 20) ? (1 << 20) : left, MSG_DONTWAIT);
      }
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        close_in(in);
        return;
      }
      if (r < 0) return;
      in->poff += (uint64_t)r;
      if (in->poff < rq->len) continue;
      if (in->status == IBV_WC_SUCCESS && rq->op != SV_OP_SEND && rq->len && rq->len <= SV_SMALL)
        place_descending(in->target, in->small, (size_t)rq->len);
    }
    if (!in_finish(in)) return;
  }
}

static int in_output(struct sv_in *in) {
  while (in->outq) {
    int r = obuf_write(in->fd, in->outq);
    if (r < 0) {
      close_in(in);
      return -1;
    }
    if (r == 0) return 0;
    struct sv_obuf *o = in->outq;
    in->outq = o->next;
    if (!in->outq) in->outq_tail = NULL;
    free(o);
  }
  return 1;
}

/* ------------------------------------------------------------------ NIC thread: loop */
enum { PF_WAKE, PF_LISTEN, PF_OUT, PF_IN };
struct pf_ref {
  int kind;
  void *obj;
};

static void reap(void) {
  for (struct sv_qp **pq = &G.qps; *pq;) {
    struct sv_qp *q = *pq;
    if (!q->dead) {
      for (struct sv_in **pi = &q->ins; *pi;) {
        struct sv_in *in = *pi;
        if (in->dead && in->fd < 0) {
          *pi = in->next;
          free(in);
        } else {
          pi = &in->next;
        }
      }
      pq = &q->next;
      continue;
    }
    *pq = q->next;
    if (q->lfd >= 0) close(q->lfd);
    if (q->ofd >= 0) close(q->ofd);
    while (q->ins) {
      struct sv_in *in = q->ins;
      q->ins = in->next;
      close_in(in);
      free(in);
    }
    free(q->sq);
    free(q->rq);
    free(q); /* nothing else points at a QP once ibv_destroy_qp returned */
  }
}

/* A CQ that overran is fatal to the QPs on it, as on hardware: each goes to ERR with an async
 * IBV_EVENT_QP_FATAL (after the IBV_EVENT_CQ_ERR cq_push posted). Done here, at a point where no
 * QP is in the middle of an update, rather than inside cq_push. */
static void fail_overrun_qps(void) {
  for (struct sv_qp *q = G.qps; q; q = q->next) {
    if (q->dead || q->qp.state == IBV_QPS_ERR || q->qp.state == IBV_QPS_RESET) continue;
    struct sv_cq *s = (struct sv_cq *)q->qp.send_cq, *r = (struct sv_cq *)q->qp.recv_cq;
    if (!s->overrun && !r->overrun) continue;
    record("event=cq_overrun pid=%d qpn=%u", (int)getpid(), q->qp.qp_num);
    qp_fail(q, IBV_WC_WR_FLUSH_ERR);
    post_event(q->sctx, IBV_EVENT_QP_FATAL, &q->qp, 0);
  }
}

static void *nic_thread(void *arg) {
  (void)arg;
  size_t cap = 64;
  struct pollfd *pfds = malloc(cap * sizeof(*pfds));
  struct pf_ref *refs = malloc(cap * sizeof(*refs));
  for (;;) {
    lock();
    reap();
    fail_overrun_qps();
    for (struct sv_qp *q = G.qps; q; q = q->next) {
      qp_output(q);
      for (struct sv_in *in = q->ins; in; in = in->next) {
        in_input(in);
        if (!in->dead) in_output(in);
      }
    }
    size_t n = 0;
    size_t need = 1;
    for (struct sv_qp *q = G.qps; q; q = q->next) {
      need += 2;
      for (struct sv_in *in = q->ins; in; in = in->next) need++;
    }
    if (need > cap) {
      while (cap < need) cap *= 2;
      pfds = realloc(pfds, cap * sizeof(*pfds));
      refs = realloc(refs, cap * sizeof(*refs));
    }
    pfds[n] = (struct pollfd){.fd = G.wake_fd, .events = POLLIN};
    refs[n++] = (struct pf_ref){PF_WAKE, NULL};
    for (struct sv_qp *q = G.qps; q; q = q->next) {
      if (q->lfd >= 0) {
        pfds[n] = (struct pollfd){.fd = q->lfd, .events = POLLIN};
        refs[n++] = (struct pf_ref){PF_LISTEN, q};
      }
      if (q->ofd >= 0) {
        short ev = POLLIN;
        if (q->out_busy) ev |= POLLOUT;
        pfds[n] = (struct pollfd){.fd = q->ofd, .events = ev};
        refs[n++] = (struct pf_ref){PF_OUT, q};
      }
      for (struct sv_in *in = q->ins; in; in = in->next) {
        if (in->fd < 0) continue;
        short ev = in->stalled ? 0 : POLLIN;
        if (in->outq) ev |= POLLOUT;
        pfds[n] = (struct pollfd){.fd = in->fd, .events = ev};
        refs[n++] = (struct pf_ref){PF_IN, in};
      }
    }
    unlock();
    int r = poll(pfds, n, 1000);
    if (r < 0 && errno != EINTR) continue;
    lock();
    for (size_t i = 0; i < n && r > 0; i++) {
      if (!pfds[i].revents) continue;
      switch (refs[i].kind) {
        case PF_WAKE: {
          uint64_t v;
          if (read(G.wake_fd, &v, sizeof(v)) < 0) {}
          break;
        }
        case PF_LISTEN: {
          struct sv_qp *q = refs[i].obj;
          if (q->dead || q->lfd < 0) break;
          for (;;) {
            int fd = accept4(q->lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
            if (fd < 0) break;
            struct sv_in *in = calloc(1, sizeof(*in));
            if (!in) {
              close(fd);
              break;
            }
            in->fd = fd;
            in->qp = q;
            in->next = q->ins;
            q->ins = in;
          }
          break;
        }
        case PF_OUT: {
          struct sv_qp *q = refs[i].obj;
          if (q->dead || q->ofd != pfds[i].fd) break;
          qp_input(q);
          qp_output(q);
          break;
        }
        case PF_IN: {
          struct sv_in *in = refs[i].obj;
          if (in->dead || in->qp->dead || in->fd != pfds[i].fd) break;
          in_input(in);
          if (!in->dead) in_output(in);
          break;
        }
      }
    }
    unlock();
  }
  return NULL;
}
