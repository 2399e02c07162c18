/* Fuzz target: the IB transport's side channel, as a stranger or a bad peer fills it. The plugin's
 * real code (plugin/net_core.c over net/ib/) runs on the software verbs double (tests/softverbs,
 * dlopen'ed as libibverbs: FUZZ_SOFTVERBS_LIB, else ../softverbs/libsoftverbs.so next to this
 * program) with one InfiniBand and one RoCE port, listening once on each. Each input is what one
 * TCP client writes to a listen address: a struct mpib_conn_info (168 bytes; its link_layer field
 * picks the RoCE port when it is 2), the 1-byte "ready", then anything after it.
 *
 * Properties: no crash or sanitizer report; accept never fails because of the bytes and every call
 * returns within 2 s; a whole record is answered or its socket dropped within 2 s; a record that
 * real verbs could not take (bad magic or version, QP count, MTU, SL, traffic class, adaptive
 * routing flag, class, link layer) creates no QP at all; nothing out of range reaches
 * ibv_modify_qp (checked at the verbs boundary: path MTU, SL, port, GID index, retry counts, the
 * verbs' own transitions); an answer names as many QPs as the record asked for; the ready byte
 * 0x52 after an answer yields the connection, any other byte none; and when the input is done, every
 * QP, CQ and memory registration made for it has been released.
 *
 * A flood: a record whose reserved[2] has 0xf1 in its low byte is preceded by a full table of
 * strangers (64, fuzz_flood_fill: new ones send the first 1, 1, 4 or 167 bytes of the record, bits
 * 8-9 of the same word); the record is then still answered or dropped within FLOOD_LIMIT_S:
 * strangers - silent, one byte, or a record cut short - keep no peer out. */
#include <errno.h>
#include <fcntl.h>
#include <infiniband/verbs.h>
#include <libgen.h>
#include <limits.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "net/handle.h"
#include "net/ib/ib.h"
#include "net/tc.h"
#include "plugin/net_core.h"

#define READY 0x52
#define FLOOD_LIMIT_S 4.0  /* a stranger makes room once it has waited 1 s with the table full */
static struct fuzz_flood floods[2]; /* per port; FUZZ_FLOOD: the side channel's table of pending connections (net/ib/ib_conn.c) */
_Static_assert(sizeof(struct mpib_conn_info) == 168, "the IB connection record is 168 bytes");

struct port {
  void *lc;
  struct sockaddr_storage ss;
  socklen_t len;
  int link_layer;
  int port_num;
};
static struct mplane_net_ctx *ctx;
static struct port ports[2];
static int nports;


/* softverbs keeps a destroyed CQ's or QP's struct on purpose (its NIC thread may still hold a
 * pointer); the plugin's own objects are counted at the verbs boundary below instead. */
const char *__lsan_default_suppressions(void);
const char *__lsan_default_suppressions(void) { return "leak:libsoftverbs.so\n"; }

/* ------------------------------------------------------------------ the verbs boundary */
static struct mpib_verbs real;
static long live_qps, live_cqs, live_mrs, rtr_count;

static struct ibv_qp *w_create_qp(struct ibv_pd *pd, struct ibv_qp_init_attr *ia) {
  struct ibv_qp *qp = real.create_qp(pd, ia);
  if (qp) live_qps++;
  return qp;
}
static int w_destroy_qp(struct ibv_qp *qp) {
  int rc = real.destroy_qp(qp);
  if (rc == 0) live_qps--;
  return rc;
}
static struct ibv_cq *w_create_cq(struct ibv_context *c, int n, void *x, struct ibv_comp_channel *ch, int v) {
  struct ibv_cq *cq = real.create_cq(c, n, x, ch, v);
  if (cq) live_cqs++;
  return cq;
}
static int w_destroy_cq(struct ibv_cq *cq) {
  int rc = real.destroy_cq(cq);
  if (rc == 0) live_cqs--;
  return rc;
}
static struct ibv_mr *w_reg_mr(struct ibv_pd *pd, void *a, size_t n, int acc) {
  struct ibv_mr *mr = real.reg_mr(pd, a, n, acc);
  if (mr) live_mrs++;
  return mr;
}
static struct ibv_mr *w_reg_mr_iova2(struct ibv_pd *pd, void *a, size_t n, uint64_t iova, unsigned acc) {
  struct ibv_mr *mr = real.reg_mr_iova2(pd, a, n, iova, acc);
  if (mr) live_mrs++;
  return mr;
}
static int w_dereg_mr(struct ibv_mr *mr) {
  int rc = real.dereg_mr(mr);
  if (rc == 0) live_mrs--;
  return rc;
}

/* What real verbs refuse (or silently misread) must not get here from a peer's record. */
static int w_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *a, int mask) {
  if ((mask & IBV_QP_STATE) && a->qp_state == IBV_QPS_RTR) {
    FUZZ_REQUIRE(a->path_mtu >= IBV_MTU_256 && a->path_mtu <= IBV_MTU_4096, "RTR with path MTU %d", (int)a->path_mtu);
    FUZZ_REQUIRE(a->ah_attr.sl <= 15, "RTR with SL %u", a->ah_attr.sl);
    int ok_port = 0;
    for (int i = 0; i < nports; i++) ok_port |= a->ah_attr.port_num == ports[i].port_num;
    FUZZ_REQUIRE(ok_port, "RTR on port %u", a->ah_attr.port_num);
    if (a->ah_attr.is_global) FUZZ_REQUIRE(a->ah_attr.grh.sgid_index < 128, "GID index %u", a->ah_attr.grh.sgid_index);
    FUZZ_REQUIRE(a->max_dest_rd_atomic <= 16 && a->min_rnr_timer <= 31, "RTR read/RNR attributes out of range");
  }
  if ((mask & IBV_QP_STATE) && a->qp_state == IBV_QPS_RTS)
    FUZZ_REQUIRE(a->timeout <= 31 && a->retry_cnt <= 7 && a->rnr_retry <= 7, "RTS with timeout %u retry %u rnr %u",
                 a->timeout, a->retry_cnt, a->rnr_retry);
  int rc = real.modify_qp(qp, a, mask);
  if (rc == 0 && (mask & IBV_QP_STATE) && a->qp_state == IBV_QPS_RTR) rtr_count++;
  return rc;
}

static void softverbs_path(char *out, size_t len) {
  const char *env = getenv("FUZZ_SOFTVERBS_LIB");
  if (env && *env) {
    snprintf(out, len, "%s", env);
    return;
  }
  char exe[PATH_MAX];
  ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
  if (n <= 0) n = 0;
  exe[n] = '\0';
  snprintf(out, len, "%s/../softverbs/libsoftverbs.so", dirname(exe));
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  char lib[PATH_MAX + 64];
  softverbs_path(lib, sizeof(lib));
  if (access(lib, R_OK) != 0) {
    fprintf(stderr, "fuzz_ib_record: no software verbs at %s (set FUZZ_SOFTVERBS_LIB)\n", lib);
    exit(1);
  }
  char ns[64];
  snprintf(ns, sizeof(ns), "fuzzib%d", (int)getpid());
  setenv("SOFTVERBS_NS", ns, 1);
  setenv("SOFTVERBS_DEVICES", "mlx5_0:ib,mlx5_1:roce", 1);
  unsetenv("SOFTVERBS_RECORD");
  unsetenv("SOFTVERBS_FAULTS");
  setenv("MPLANE_TRANSPORT", "ib", 1);
  setenv("MPLANE_IBVERBS_LIB", lib, 1);
  setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
  setenv("MPLANE_NCCL_DEFAULTS", "0", 1);
  if (!getenv("FUZZ_VERBOSE")) fuzz_quiet();
  if (mplane_net_global_init(NULL) != ncclSuccess || mplane_net_ctx_create(1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx)) {
    fprintf(stderr, "fuzz_ib_record: the IB transport does not start on %s\n", lib);
    exit(1);
  }
  real = mpib_v;
  mpib_v.create_qp = w_create_qp;
  mpib_v.destroy_qp = w_destroy_qp;
  mpib_v.create_cq = w_create_cq;
  mpib_v.destroy_cq = w_destroy_cq;
  mpib_v.reg_mr = w_reg_mr;
  if (mpib_v.reg_mr_iova2) mpib_v.reg_mr_iova2 = w_reg_mr_iova2;
  mpib_v.reg_dmabuf_mr = NULL; /* host memory only here */
  mpib_v.dereg_mr = w_dereg_mr;
  mpib_v.modify_qp = w_modify_qp;
  int ndev = 0;
  mplane_net_devices(&ndev);
  for (int d = 0; d < ndev && nports < 2; d++) {
    struct mpib_dev *dv = mpib_dev_get(d);
    struct port *p = &ports[nports];
    unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
    memset(handle, 0, sizeof(handle));
    struct mplane_handle h;
    char why[256];
    if (!dv || mplane_net_listen(ctx, d, handle, &p->lc) != ncclSuccess ||
        mplane_handle_decode(handle, &h, why, sizeof(why)) ||
        mplane_handle_sockaddr(&h, &p->ss, &p->len, why, sizeof(why))) {
      fprintf(stderr, "fuzz_ib_record: listen on device %d failed\n", d);
      exit(1);
    }
    p->link_layer = dv->link_layer;
    p->port_num = dv->port;
    nports++;
  }
  if (nports == 0) {
    fprintf(stderr, "fuzz_ib_record: no IB device\n");
    exit(1);
  }
  return 0;
}

/* ------------------------------------------------------------------ one input */
static int record_ok(const struct mpib_conn_info *ci, int link_layer) {
  return ci->magic == MPIB_MAGIC && ci->version == MPLANE_PROTOCOL_VERSION && ci->nqps >= 1 &&
         ci->nqps <= MPIB_MAX_QPS && ci->mtu >= IBV_MTU_256 && ci->mtu <= IBV_MTU_4096 && ci->sl >= 0 &&
         ci->sl <= MPLANE_TC_SL_MAX && ci->tclass >= 0 && ci->tclass <= 255 && (ci->ar == 0 || ci->ar == 1) &&
         ci->tc_class >= 0 && ci->tc_class < MPLANE_TC_NCLASSES && ci->link_layer == link_layer;
}

static unsigned short local_port(int fd) {
  struct sockaddr_storage me;
  socklen_t ml = sizeof(me);
  getsockname(fd, (struct sockaddr *)&me, &ml);
  return ntohs(((struct sockaddr_in *)&me)->sin_port);
}

static unsigned short peer_port(int fd) {
  struct sockaddr_storage peer;
  socklen_t pl = sizeof(peer);
  if (getpeername(fd, (struct sockaddr *)&peer, &pl) != 0) return 0;
  return ntohs(((struct sockaddr_in *)&peer)->sin_port);
}

/* Call accept until it hands over a comm of ours (returned in *mine), our socket is closed by the
 * plugin (1), or `secs` pass (0). The answer's bytes are read into ans as they come. */
struct peer {
  int fd;
  unsigned short port;
  struct mpib_conn_info ans;
  size_t ans_have;
  int eof;
};

static void accept_step(struct port *p, struct peer *pe, void **mine) {
  void *x = NULL;
  ncclResult_t res = TIMED("accept", mplane_net_accept(p->lc, &x));
  FUZZ_REQUIRE(res == ncclSuccess, "accept returned %d because of a peer's bytes", res);
  if (x) {
    struct mpib_recv_comm *c = x;
    if (pe && peer_port(c->b.fd) == pe->port) {
      FUZZ_REQUIRE(*mine == NULL, "accept handed over one connection twice");
      *mine = x;
    } else {
      mplane_net_close_recv(x); /* an earlier input's */
    }
  }
  if (!pe || pe->eof) return;
  for (;;) {
    char scratch[256];
    char *dst = pe->ans_have < sizeof(pe->ans) ? (char *)&pe->ans + pe->ans_have : scratch;
    size_t want = pe->ans_have < sizeof(pe->ans) ? sizeof(pe->ans) - pe->ans_have : sizeof(scratch);
    ssize_t r = recv(pe->fd, dst, want, MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      pe->eof = 1;
      return;
    }
    if (r < 0) return;
    FUZZ_REQUIRE(pe->ans_have < sizeof(pe->ans), "the acceptor wrote %zd bytes past its connection record", r);
    pe->ans_have += (size_t)r;
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mpib_conn_info ci;
  memset(&ci, 0, sizeof(ci));
  size_t nrec = size < sizeof(ci) ? size : sizeof(ci);
  memcpy(&ci, data, nrec);
  struct port *p = &ports[0];
  for (int i = 0; i < nports; i++)
    if (ports[i].link_layer == ci.link_layer) p = &ports[i];
  int ok = nrec == sizeof(ci) && record_ok(&ci, p->link_layer);
  long qps0 = live_qps, cqs0 = live_cqs, mrs0 = live_mrs, rtr0 = rtr_count;

  /* a flood first: the listener's table full of strangers, each one already taken by accept */
  int nflood = nrec == sizeof(ci) && (ci.reserved[2] & 0xff) == 0xf1;
  if (nflood) {
    size_t flood_bytes = (size_t[]){1, 1, 4, sizeof(ci) - 1}[(ci.reserved[2] >> 8) & 3];
    FUZZ_REQUIRE(fuzz_flood_fill(&floods[p - ports], (struct sockaddr *)&p->ss, p->len, data, flood_bytes) == 0,
                 "connect: %s", strerror(errno));
    for (int i = 0; i < 3; i++) accept_step(p, NULL, NULL);
  }
  const double limit_s = nflood ? FLOOD_LIMIT_S : CALL_LIMIT_S;

  struct peer pe = {.fd = socket(p->ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0)};
  FUZZ_REQUIRE(pe.fd >= 0, "socket: %s", strerror(errno));
  FUZZ_REQUIRE(fuzz_connect(pe.fd, (struct sockaddr *)&p->ss, p->len) == 0, "connect: %s", strerror(errno));
  pe.port = local_port(pe.fd);
  if (nrec) FUZZ_REQUIRE(fuzz_send_all(pe.fd, data, nrec) == 0, "send: %s", strerror(errno));

  void *rc = NULL;
  double t0 = now_s();
  if (nrec < sizeof(ci)) {
    /* half a record: the acceptor waits for the rest (or drops a stranger at its magic) */
    for (int i = 0; i < 3; i++) accept_step(p, &pe, &rc);
  } else {
    while (!pe.eof && pe.ans_have < sizeof(pe.ans)) {
      FUZZ_REQUIRE(now_s() - t0 < limit_s, "a whole connection record was neither answered nor dropped in %.0f s "
                   "(%zu bytes of the answer)%s", limit_s, pe.ans_have, nflood ? " behind a flood of strangers" : "");
      accept_step(p, &pe, &rc);
      if (!pe.eof && pe.ans_have < sizeof(pe.ans)) usleep(20);
    }
  }
  FUZZ_REQUIRE(rc == NULL, "a connection was accepted before its ready byte");
  if (!ok) {
    FUZZ_REQUIRE(live_qps == qps0 && rtr_count == rtr0,
                 "a record real verbs cannot take (nqps %u, mtu %u, sl %d, tclass %d, ar %d, class %d, link %d) made "
                 "%ld QPs, %ld at RTR", ci.nqps, ci.mtu, ci.sl, ci.tclass, ci.ar, ci.tc_class, ci.link_layer,
                 live_qps - qps0, rtr_count - rtr0);
    FUZZ_REQUIRE(pe.ans_have == 0, "a refused record was answered");
  }
  int answered = pe.ans_have == sizeof(pe.ans);
  if (answered) {
    FUZZ_REQUIRE(ok, "a record the acceptor must refuse was answered");
    FUZZ_REQUIRE(pe.ans.magic == MPIB_MAGIC && pe.ans.version == MPLANE_PROTOCOL_VERSION && pe.ans.nqps == ci.nqps &&
                     pe.ans.link_layer == p->link_layer,
                 "the answer: magic 0x%08x version %u, %u QPs for %u asked", pe.ans.magic, pe.ans.version,
                 pe.ans.nqps, ci.nqps);
    FUZZ_REQUIRE(rtr_count - rtr0 == ci.nqps, "%ld QPs at RTR for %u asked", rtr_count - rtr0, ci.nqps);
  }

  if (size > sizeof(ci)) {
    size_t rest = size - sizeof(ci);
    ssize_t w = send(pe.fd, data + sizeof(ci), rest, MSG_NOSIGNAL | MSG_DONTWAIT);
    (void)w; /* the acceptor may have dropped us already */
    if (answered) {
      t0 = now_s();
      while (!rc && !pe.eof) {
        FUZZ_REQUIRE(now_s() - t0 < CALL_LIMIT_S, "the ready byte 0x%02x was neither taken nor refused in 2 s",
                     data[sizeof(ci)]);
        accept_step(p, &pe, &rc);
        if (!rc && !pe.eof) usleep(20);
      }
      if (data[sizeof(ci)] == READY) {
        FUZZ_REQUIRE(rc != NULL, "answered, then the ready byte: no connection");
        struct mpib_recv_comm *c = rc;
        FUZZ_REQUIRE(c->b.nqps == ci.nqps && c->b.sl == ci.sl && c->b.tclass == ci.tclass && c->b.ar == ci.ar,
                     "the connection has %d QPs SL %d tclass %d ar %d for a record of %u, %d, %d, %d", c->b.nqps,
                     c->b.sl, c->b.tclass, c->b.ar, ci.nqps, ci.sl, ci.tclass, ci.ar);
      } else {
        FUZZ_REQUIRE(rc == NULL, "the ready byte 0x%02x, not 0x%02x, gave a connection", data[sizeof(ci)], READY);
      }
    }
  }
  if (rc) FUZZ_REQUIRE(TIMED("closeRecv", mplane_net_close_recv(rc)) == ncclSuccess, "closeRecv");
  close(pe.fd);
  /* the listener drops what is left of this input */
  for (int i = 0; i < 3 && (live_qps != qps0 || live_cqs != cqs0 || live_mrs != mrs0 || i == 0); i++) {
    if (i) usleep(100);
    accept_step(p, NULL, &rc);
  }
  FUZZ_REQUIRE(live_qps == qps0 && live_cqs == cqs0 && live_mrs == mrs0,
               "after the input: %ld QPs, %ld CQs, %ld memory registrations not released", live_qps - qps0,
               live_cqs - cqs0, live_mrs - mrs0);
  return 0;
}
