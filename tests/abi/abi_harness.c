/* mplane ABI harness: dlopens the built plugin and drives its ncclNet tables the way NCCL's proxy
 * thread does, between two processes over the network (loopback by default), checking every byte.
 *
 * Command line
 *
 *   abi-harness [--plugin PATH] [--version N] [--dev D] [--list] SCENARIO... | all
 *
 *   --plugin PATH   the plugin .so to dlopen (default: $MPLANE_ABI_PLUGIN, else
 *                   "libnccl-net-mplane.so" from the library search path)
 *   --version N     ncclNet table the generic scenarios drive: 8, 9, 10, 11 (default) or 12
 *   --dev D         device index to use (default: $MPLANE_ABI_DEV, else 0)
 *   --list          print the scenarios and exit
 *
 * Each scenario runs in a fresh process (the plugin's configuration is process-wide) and, where it
 * needs a peer, forks one: the 128-byte listen handles travel over a socketpair, as NCCL's
 * bootstrap would carry them. Exit status: 0 pass, 1 fail, 77 skipped (meson's skip code).
 *
 * Environment
 *
 *   MPLANE_SOCKET_IFNAME  set to "lo" unless already set (the socket transport then uses loopback)
 *   MPLANE_TRANSPORT, MPLANE_IBVERBS_LIB, ...  passed through untouched: the harness is transport
 *                         agnostic, e.g. MPLANE_TRANSPORT=ib MPLANE_IBVERBS_LIB=.../libsoftverbs.so
 *   MPLANE_ABI_PEER_ADDR  text the WARN about a dead peer must contain (default: the IP address of
 *                         the listen handle when the transport is the socket one, else "peer")
 *   MPLANE_ABI_TIMEOUT    seconds before a scenario is declared hung (default 90)
 *   MPLANE_ABI_CALL_LIMIT seconds one plugin call may take before it counts as blocking NCCL's proxy
 *                         thread (default 2; soft-RoCE on an emulated CPU needs more)
 *   MPLANE_ABI_VERBOSE=1  echo every plugin log line, not only WARNs
 *   MPLANE_ABI_RANK0_ENV, MPLANE_ABI_RANK1_ENV  "VAR=VALUE ..." set in that rank only, e.g.
 *                         MPLANE_ABI_RANK0_ENV="MPLANE_IB_HCA==rxe0" and rxe1 for rank 1: two devices
 *   MPLANE_ABI_SHARED_STEPS  steps of the shared-comms scenario (default 1000)
 *
 * Scenarios (--list prints them with one line each): props, sizes, inflight, inflight-max, multirecv,
 * shared-order, shared-wait, shared-comms (abi_shared.c), eager-early, eager-bound, eager-short, eager-then-big, eager-then-close (abi_eager.c), reconnect, kill-receiver, kill-sender, short-recv, bad-handle, bad-config, ctrl-full, ctrl-big, close-early,
 * stalled-close, abort, threads, dead-listener, v12, v10, v9, v8 drive any transport;
 * fake-peer, fake-version, connect-timeout, silent-listener and half-open speak TCP to the listen
 * address themselves and skip (77) on other transports.
 *
 * Examples
 *
 *   abi-harness --plugin build/libnccl-net-mplane.so all
 *   MPLANE_TRANSPORT=ib MPLANE_IBVERBS_LIB=build/tests/softverbs/libsoftverbs.so \
 *     abi-harness --plugin build/libnccl-net-mplane.so sizes kill-sender
 *   MPLANE_SOCKET_IFNAME=eth0 abi-harness --version 12 --dev 1 sizes multirecv
 */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "abi.h"
#include "abi_harness.h"
#include "net/handle.h"
#include "net/socket/socket.h" /* wire structs, for the fake-peer scenarios only */
#ifdef MPLANE_ABI_IB_WIRE
#include "net/ib/ib.h" /* the IB side channel's connection record, for the strangers scenario */
#endif

#define CALL_LIMIT_S 2.0  /* no call may block NCCL's proxy thread longer than this */
#define CLOSE_LIMIT_S 10.0 /* a close, which may finish sending what is in flight */


struct opts g_opts;

/* ------------------------------------------------------------------ timeouts */

static char alarm_msg[256];

static void on_alarm(int sig) {
  (void)sig;
  ssize_t w = write(2, alarm_msg, strlen(alarm_msg));
  (void)w;
  _exit(1);
}

static void arm_alarm(void) {
  const char *t = getenv("MPLANE_ABI_TIMEOUT");
  int secs = t && atoi(t) > 0 ? atoi(t) : 90;
  snprintf(alarm_msg, sizeof(alarm_msg), "abi[%s rank %d pid %d]: FAIL: timed out after %d s (a hang)\n",
           abi_scenario, abi_rank, (int)getpid(), secs);
  signal(SIGALRM, on_alarm);
  alarm((unsigned)secs);
}

/* ------------------------------------------------------------------ two processes */


/* MPLANE_ABI_RANK<r>_ENV="VAR=VALUE ...": settings for one rank only (e.g. the HCA each rank uses,
 * so that bytes cross a wire between two devices of one host). Applied before the rank's init. */
static void apply_rank_env(int rank) {
  char name[32];
  snprintf(name, sizeof(name), "MPLANE_ABI_RANK%d_ENV", rank);
  const char *spec = getenv(name);
  if (!spec) return;
  char *copy = strdup(spec), *save = NULL;
  for (char *kv = strtok_r(copy, " ", &save); kv; kv = strtok_r(NULL, " ", &save)) {
    char *eq = strchr(kv, '=');
    if (!eq || eq == kv) abi_fail("%s: '%s' is not VAR=VALUE", name, kv);
    *eq = 0;
    setenv(kv, eq + 1, 1);
  }
  free(copy);
}

/* Fork the peer with nchan extra channels. Returns this process's rank: 0 the parent, 1 the child. */
static int pair_fork_chans(struct pair *pp, int nchan) {
  int sv[2], extra[MAX_CHANS][2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) abi_fail("socketpair: %s", strerror(errno));
  for (int i = 0; i < nchan && i < MAX_CHANS; i++)
    if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, extra[i]) != 0) abi_fail("socketpair: %s", strerror(errno));
  fflush(NULL);
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) abi_fail("fork: %s", strerror(errno));
  if (pid == 0) {
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);
    close(sv[0]);
    pp->fd = sv[1];
    for (int i = 0; i < nchan && i < MAX_CHANS; i++) {
      close(extra[i][0]);
      pp->chan[i] = extra[i][1];
    }
    pp->child = 0;
    abi_rank = 1;
    arm_alarm();
    apply_rank_env(1);
    return 1;
  }
  close(sv[1]);
  pp->fd = sv[0];
  for (int i = 0; i < nchan && i < MAX_CHANS; i++) {
    close(extra[i][1]);
    pp->chan[i] = extra[i][0];
  }
  pp->child = pid;
  abi_rank = 0;
  return 0;
}

int pair_fork(struct pair *pp) { return pair_fork_chans(pp, 0); }

void chan_send(int fd, const void *buf, size_t len) {
  size_t off = 0;
  while (off < len) {
    ssize_t w = send(fd, (const char *)buf + off, len - off, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) abi_fail("peer channel: send: %s (peer process died?)", strerror(errno));
    off += (size_t)w;
  }
}

void chan_recv(int fd, void *buf, size_t len) {
  size_t off = 0;
  double deadline = abi_now() + 60;
  while (off < len) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    int r = poll(&p, 1, 1000);
    if (r < 0 && errno == EINTR) continue;
    if (abi_now() > deadline) abi_fail("peer channel: nothing from the peer in 60 s");
    if (r <= 0) continue;
    ssize_t n = recv(fd, (char *)buf + off, len - off, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) abi_fail("peer channel: the peer process went away");
    off += (size_t)n;
  }
}

void barrier(int fd) {
  char c = 'b';
  chan_send(fd, &c, 1);
  chan_recv(fd, &c, 1);
}

/* Under -Db_sanitize=address, a passing process also checks for leaks (we leave with _exit). */
extern int __lsan_do_recoverable_leak_check(void) __attribute__((weak));
static void leak_check(void) {
  if (__lsan_do_recoverable_leak_check && __lsan_do_recoverable_leak_check())
    abi_fail("memory leaked (LeakSanitizer's report is above)");
}

/* Rank 1 exits here; rank 0 collects its status. */
int pair_finish(struct pair *pp, int rank) {
  if (rank == 1) {
    leak_check();
    fflush(NULL);
    _exit(0);
  }
  int st = 0;
  while (waitpid(pp->child, &st, 0) < 0 && errno == EINTR) {}
  close(pp->fd);
  if (WIFEXITED(st) && WEXITSTATUS(st) == 0) return 0;
  if (WIFSIGNALED(st)) abi_fail("peer process died of signal %d (%s)", WTERMSIG(st), strsignal(WTERMSIG(st)));
  abi_fail("peer process failed (exit %d)", WEXITSTATUS(st));
}

/* ------------------------------------------------------------------ data pattern */

/* 8 bytes per word, a function of (offset, message): a chunk put at the wrong offset, a message
 * delivered into the wrong buffer, a stale byte or a lost tail all show. */
static inline uint64_t pattern_word(uint64_t word, uint32_t msg) {
  uint64_t x = word * 0x9E3779B97F4A7C15ull + (uint64_t)msg * 0xD6E8FEB86659FD93ull + 0x632BE59BD9B4E019ull;
  x ^= x >> 32;
  x *= 0xD6E8FEB86659FD93ull;
  x ^= x >> 29;
  return x;
}

void fill(void *buf, size_t n, uint32_t msg) {
  uint8_t *b = buf;
  size_t k = 0;
  for (; k + 8 <= n; k += 8) {
    uint64_t w = pattern_word(k / 8, msg);
    memcpy(b + k, &w, 8);
  }
  if (k < n) {
    uint64_t w = pattern_word(k / 8, msg);
    memcpy(b + k, &w, n - k);
  }
}

/* Offset of the first wrong byte, or -1. */
long check(const void *buf, size_t n, uint32_t msg) {
  const uint8_t *b = buf;
  for (size_t k = 0; k < n; k += 8) {
    uint64_t w = pattern_word(k / 8, msg);
    size_t len = n - k < 8 ? n - k : 8;
    if (memcmp(b + k, &w, len) != 0) {
      for (size_t i = 0; i < len; i++)
        if (b[k + i] != ((uint8_t *)&w)[i]) return (long)(k + i);
    }
  }
  return -1;
}


/* A page-aligned buffer of size bytes followed by guard bytes set to GUARD_BYTE. */
void *alloc_buf(size_t size, size_t guard) {
  void *p = NULL;
  if (posix_memalign(&p, 4096, size + guard + 1)) abi_fail("out of memory (%zu bytes)", size + guard);
  memset(p, GUARD_BYTE, size + guard + 1);
  return p;
}

long check_guard(const void *buf, size_t from, size_t to) {
  const uint8_t *b = buf;
  for (size_t i = from; i < to; i++)
    if (b[i] != GUARD_BYTE) return (long)i;
  return -1;
}

/* ------------------------------------------------------------------ one process's plugin */


static void check_props(const struct abi_props *p, int dev, int version) {
  if (!p->name || !*p->name) abi_fail("dev %d: empty name", dev);
  for (const char *c = p->name; *c; c++)
    if (*c < 0x20 || *c > 0x7e || c - p->name > 255) abi_fail("dev %d: name is not printable text", dev);
  if (p->pci_path && p->pci_path[0] != '/') abi_fail("dev %d: pciPath '%s' is not an absolute path", dev, p->pci_path);
  if (!(p->ptr_support & NCCL_PTR_HOST)) abi_fail("dev %d (%s): ptrSupport 0x%x lacks NCCL_PTR_HOST", dev, p->name, p->ptr_support);
  if (p->ptr_support & ~(NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF))
    abi_fail("dev %d (%s): ptrSupport 0x%x has unknown bits", dev, p->name, p->ptr_support);
  if (p->max_recvs <= 1 || p->max_recvs > 64) abi_fail("dev %d (%s): maxRecvs %d, expected 2..64", dev, p->name, p->max_recvs);
  if (p->speed <= 0 || p->speed > 100000000) abi_fail("dev %d (%s): speed %d Mb/s", dev, p->name, p->speed);
  if (p->max_comms <= 0) abi_fail("dev %d (%s): maxComms %d", dev, p->name, p->max_comms);
  if (!(p->latency >= 0 && p->latency < 1e6)) abi_fail("dev %d (%s): latency %f", dev, p->name, (double)p->latency);
  if (p->reg_is_global != 0 && p->reg_is_global != 1) abi_fail("dev %d: regIsGlobal %d", dev, p->reg_is_global);
  if (p->net_device_type != NCCL_NET_DEVICE_HOST) abi_fail("dev %d: netDeviceType %d, expected HOST", dev, p->net_device_type);
  if (p->port < 0 || p->port > 255) abi_fail("dev %d: port %d", dev, p->port);
  if (version >= 9) {
    if (p->max_p2p_bytes == 0 || p->max_coll_bytes == 0) abi_fail("dev %d: maxP2pBytes %zu maxCollBytes %zu", dev, p->max_p2p_bytes, p->max_coll_bytes);
    if (p->force_flush != 0 && p->force_flush != 1) abi_fail("dev %d: forceFlush %d", dev, p->force_flush);
    if (p->vndevs != 1 || p->vdev0 != dev) abi_fail("dev %d: vProps {%d, %d}, expected one device, itself", dev, p->vndevs, p->vdev0);
  }
  if (version >= 11 && (p->max_multi_request_size < 1 || p->max_multi_request_size > 64))
    abi_fail("dev %d: maxMultiRequestSize %d", dev, p->max_multi_request_size);
  if (version >= 12) {
    if (p->plane_id < -1 || p->plane_id > 127) abi_fail("dev %d: planeId %d, expected -1 (unknown) or 0..127", dev, p->plane_id);
    if (p->rail_id < -1 || p->rail_id > 127) abi_fail("dev %d: railId %d, expected -1 (unknown) or 0..127", dev, p->rail_id);
  }
}

static void node_open(struct node *nd, int version) {
  memset(nd, 0, sizeof(*nd));
  abi_net_open(&nd->net, g_opts.plugin, version);
}

void node_up(struct node *nd, int version) {
  node_open(nd, version);
  size_t mark = abi_log_mark();
  ncclResult_t res = abi_init(&nd->net, 0x1234 + (uint64_t)abi_rank, NCCL_NET_TRAFFIC_CLASS_UNDEF, &nd->ctx);
  if (res != ncclSuccess) {
    abi_log_dump(mark, "init failed");
    abi_fail("v%d init failed (%d): is MPLANE_SOCKET_IFNAME/MPLANE_TRANSPORT right for this machine?", version, res);
  }
  if (abi_devices(&nd->net, &nd->ndev) != ncclSuccess || nd->ndev < 1) abi_fail("devices: %d devices", nd->ndev);
  if (g_opts.dev >= nd->ndev) abi_fail("--dev %d but the plugin has %d devices", g_opts.dev, nd->ndev);
  nd->dev = g_opts.dev;
  if (abi_get_props(&nd->net, nd->dev, &nd->props) != ncclSuccess) abi_fail("getProperties(%d) failed", nd->dev);
  check_props(&nd->props, nd->dev, version);
}

void node_down(struct node *nd) {
  if (abi_finalize(&nd->net, nd->ctx) != ncclSuccess) abi_fail("finalize failed");
}

/* ------------------------------------------------------------------ connections, as the proxy makes them */


void timed(double t0, const char *what) {
  /* closes may drain what is in flight: they get more time, but still a bound */
  static double call_limit;
  if (call_limit == 0) {
    const char *e = getenv("MPLANE_ABI_CALL_LIMIT");
    call_limit = e && atof(e) > 0 ? atof(e) : CALL_LIMIT_S;
  }
  double limit = strncmp(what, "close", 5) == 0 ? (call_limit > CLOSE_LIMIT_S ? call_limit : CLOSE_LIMIT_S) : call_limit;
  double dt = abi_now() - t0;
  if (dt > limit) abi_fail("%s took %.2f s (limit %.0f s): it blocks the proxy thread", what, dt, limit);
}

/* Both directions at once, in one thread, calling connect and accept in turn until both are done,
 * as NCCL's proxy progresses its connections. */
static void link_up_with(struct node *nd, void *ctx, int fd, struct link *l) {
  memset(l, 0, sizeof(*l));
  memset(l->handle, 0, sizeof(l->handle));
  ncclResult_t res = abi_listen(&nd->net, ctx, nd->dev, l->handle, &l->lc);
  if (res != ncclSuccess || !l->lc) abi_fail("listen on dev %d failed (%d)", nd->dev, res);
  chan_send(fd, l->handle, HANDLE_SIZE);
  chan_recv(fd, l->peer_handle, HANDLE_SIZE);
  double deadline = abi_now() + 30;
  while (!l->sc || !l->rc) {
    double t0;
    if (!l->sc) {
      t0 = abi_now();
      res = abi_connect(&nd->net, ctx, nd->dev, l->peer_handle, &l->sc);
      timed(t0, "connect");
      if (res != ncclSuccess) abi_fail("connect failed (%d)", res);
      if (!l->sc) l->connect_nulls++;
    }
    if (!l->rc) {
      t0 = abi_now();
      res = abi_accept(&nd->net, l->lc, &l->rc);
      timed(t0, "accept");
      if (res != ncclSuccess) abi_fail("accept failed (%d)", res);
      if (!l->rc) l->accept_nulls++;
    }
    if (abi_now() > deadline) abi_fail("no connection after 30 s (connect %s, accept %s)", l->sc ? "done" : "pending", l->rc ? "done" : "pending");
    if (!l->sc || !l->rc) sched_yield();
  }
}

void link_up(struct node *nd, int fd, struct link *l) { link_up_with(nd, nd->ctx, fd, l); }

void link_down(struct node *nd, struct link *l) {
  double t0 = abi_now();
  if (l->sc && abi_close_send(&nd->net, l->sc) != ncclSuccess) abi_fail("closeSend failed");
  if (l->rc && abi_close_recv(&nd->net, l->rc) != ncclSuccess) abi_fail("closeRecv failed");
  if (l->lc && abi_close_listen(&nd->net, l->lc) != ncclSuccess) abi_fail("closeListen failed");
  timed(t0, "close");
  l->sc = l->rc = l->lc = NULL;
}

/* ------------------------------------------------------------------ the request engine */

#define OP_BUFS 8

struct op {
  int send;
  int n;
  void *data[OP_BUFS];
  size_t size[OP_BUFS]; /* send: bytes to send; recv: buffer capacity */
  int tag[OP_BUFS];
  void *mh[OP_BUFS];
  size_t expect[OP_BUFS]; /* recv: size test() must report */
  uint32_t msg[OP_BUFS];  /* pattern id of the message in each buffer */
  void *req;
  int posted, done;
  int got[OP_BUFS];
};

enum { RUN_POST_ALL_FIRST = 1 };

struct run_stats {
  int null_posts;   /* isend/irecv calls that returned no request (retried, as NCCL does) */
  int max_sends, max_recvs;
  ncclResult_t err; /* first error returned by isend/irecv/test */
  int err_op;
  double err_time;
};

/* Post ops in order (sends in order on the send comm, receives in order on the receive comm), at
 * most NCCL_NET_MAX_REQUESTS receive requests and NCCL_NET_MAX_REQUESTS x maxRecvs send requests in
 * flight, testing what is posted. With RUN_POST_ALL_FIRST nothing is tested until every op is
 * posted (so all of them are in flight at once). Returns 0 when all are done; on the first error
 * returns 1 with st->err set (the caller decides whether that was expected). */
static int run_ops(struct node *nd, void *sc, void *rc, struct op *ops, int nops, int flags, double timeout_s,
                   struct run_stats *st) {
  memset(st, 0, sizeof(*st));
  int send_cap = MAX_INFLIGHT * nd->props.max_recvs, recv_cap = MAX_INFLIGHT;
  int inflight_send = 0, inflight_recv = 0, ndone = 0, nposted = 0;
  double deadline = abi_now() + timeout_s;
  while (ndone < nops) {
    int progress = 0, send_blocked = 0, recv_blocked = 0, cap_blocked = 0;
    for (int i = 0; i < nops; i++) {
      struct op *o = &ops[i];
      if (o->posted) continue;
      if (o->send ? send_blocked : recv_blocked) continue;
      if (o->send ? inflight_send >= send_cap : inflight_recv >= recv_cap) {
        cap_blocked = 1;
        if (o->send) send_blocked = 1;
        else recv_blocked = 1;
        continue;
      }
      double t0 = abi_now();
      ncclResult_t res = o->send ? abi_isend(&nd->net, sc, o->data[0], o->size[0], o->tag[0], o->mh[0], &o->req)
                                 : abi_irecv(&nd->net, rc, o->n, o->data, o->size, o->tag, o->mh, &o->req);
      timed(t0, o->send ? "isend" : "irecv");
      if (res != ncclSuccess) {
        st->err = res;
        st->err_op = i;
        st->err_time = abi_now();
        return 1;
      }
      if (!o->req) {
        st->null_posts++;
        if (o->send) send_blocked = 1;
        else recv_blocked = 1;
        continue;
      }
      o->posted = 1;
      nposted++;
      progress = 1;
      if (o->send) {
        if (++inflight_send > st->max_sends) st->max_sends = inflight_send;
      } else if (++inflight_recv > st->max_recvs) {
        st->max_recvs = inflight_recv;
      }
    }
    if (!(flags & RUN_POST_ALL_FIRST) || nposted == nops || cap_blocked) {
      for (int i = 0; i < nops; i++) {
        struct op *o = &ops[i];
        if (!o->posted || o->done) continue;
        int done = 0;
        for (int k = 0; k < OP_BUFS; k++) o->got[k] = -1;
        double t0 = abi_now();
        ncclResult_t res = abi_test(&nd->net, o->req, &done, o->got);
        timed(t0, "test");
        if (res != ncclSuccess) {
          st->err = res;
          st->err_op = i;
          st->err_time = abi_now();
          return 1;
        }
        if (!done) continue;
        o->done = 1;
        ndone++;
        progress = 1;
        if (o->send) inflight_send--;
        else inflight_recv--;
      }
    }
    if (abi_now() > deadline) {
      int first = -1;
      for (int i = 0; i < nops && first < 0; i++)
        if (!ops[i].done) first = i;
      abi_fail("requests not done after %.0f s: %d of %d done, %d posted; first pending: op %d (%s, %s)", timeout_s,
               ndone, nops, nposted, first, ops[first].send ? "send" : "recv", ops[first].posted ? "posted" : "not posted");
    }
    if (!progress) sched_yield();
  }
  return 0;
}

/* After a successful run: every receive reported the sent sizes and holds the right bytes; the
 * rest of each buffer and the guard behind it are untouched. */
static void verify_recvs(struct op *ops, int nops, size_t guard) {
  for (int i = 0; i < nops; i++) {
    struct op *o = &ops[i];
    if (o->send) continue;
    for (int b = 0; b < o->n; b++) {
      if (o->got[b] != (int)o->expect[b])
        abi_fail("receive %d buffer %d (tag %d): test() reported %d bytes, %zu were sent", i, b, o->tag[b], o->got[b],
                 o->expect[b]);
      long bad = check(o->data[b], o->expect[b], o->msg[b]);
      if (bad >= 0)
        abi_fail("receive %d buffer %d (tag %d, %zu bytes): wrong byte at offset %ld (0x%02x)", i, b, o->tag[b],
                 o->expect[b], bad, ((uint8_t *)o->data[b])[bad]);
      bad = check_guard(o->data[b], o->expect[b], o->size[b] + guard);
      if (bad >= 0)
        abi_fail("receive %d buffer %d: byte %ld written past the %zu-byte message (buffer %zu + guard %zu)", i, b,
                 bad, o->expect[b], o->size[b], guard);
    }
  }
}

static void fail_run(const char *what, struct run_stats *st, struct op *ops, size_t mark) {
  abi_log_dump(mark, "the run failed");
  abi_fail("%s: op %d (%s) failed with result %d", what, st->err_op, ops[st->err_op].send ? "send" : "recv", st->err);
}

/* Message ids: sender rank in the top bits, so the two directions never look alike. */
uint32_t msg_id(int sender, uint32_t index) { return ((uint32_t)sender << 28) ^ index; }

/* A simple deterministic generator for sizes and shuffles (both ranks compute the same). */
static __thread uint64_t rng_state;
void rng_seed(uint64_t s) { rng_state = s * 2 + 1; }
uint32_t rng(void) {
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng_state >> 33);
}
void shuffle(int *v, int n) {
  for (int i = n - 1; i > 0; i--) {
    int j = (int)(rng() % (uint32_t)(i + 1));
    int t = v[i];
    v[i] = v[j];
    v[j] = t;
  }
}

void reg(struct node *nd, void *comm, void *data, size_t size, void **mh) {
  *mh = NULL;
  ncclResult_t res = abi_reg_mr(&nd->net, comm, data, size, NCCL_PTR_HOST, mh);
  if (res != ncclSuccess) abi_fail("regMr(%zu bytes, HOST) failed (%d)", size, res);
}

void dereg(struct node *nd, void *comm, void *mh) {
  if (abi_dereg_mr(&nd->net, comm, mh) != ncclSuccess) abi_fail("deregMr failed");
}

/* ------------------------------------------------------------------ a generic exchange */

/* One message each way per entry of sizes[] (a receive of n=1 per message, buffer = size + slack),
 * sent in order; or, with group > 1, receives of `group` buffers with distinct tags whose sends are
 * issued in a shuffled tag order within each group. Both ranks run the same call. */
struct xfer_spec {
  const size_t *sizes;
  int count;
  size_t slack;  /* extra receive capacity beyond the message */
  int group;     /* buffers per receive (1 = plain) */
  int flags;     /* RUN_* */
  int iflush;    /* call iflush on every completed receive, as NCCL does when forceFlush/GDR */
  int late_recv; /* rank 1 posts its receives 300 ms late: the peer's sends may get NULL and are retried */
  uint32_t seed;
};

static void exchange(struct node *nd, struct link *l, int rank, int fd, const struct xfer_spec *x, const char *what) {
  int nsend = x->count, group = x->group > 0 ? x->group : 1;
  if (nsend % group) abi_fail("internal: %d messages in groups of %d", nsend, group);
  int nrecv = nsend / group, nops = nsend + nrecv;
  struct op *ops = calloc((size_t)nops, sizeof(*ops));
  void **sbuf = calloc((size_t)nsend, sizeof(void *)), **rbuf = calloc((size_t)nsend, sizeof(void *));
  void **smh = calloc((size_t)nsend, sizeof(void *)), **rmh = calloc((size_t)nsend, sizeof(void *));
  const size_t guard = 64;
  /* Tags: distinct within a group, not in order, not small integers only. */
  int *tag = calloc((size_t)nsend, sizeof(int)), *order = calloc((size_t)nsend, sizeof(int));
  rng_seed(x->seed);
  for (int m = 0; m < nsend; m++) tag[m] = group > 1 ? (int)((m % group) * 7919 + 3) ^ (m / group % 5) : m;
  for (int g = 0; g < nrecv; g++) {
    for (int k = 0; k < group; k++) order[g * group + k] = g * group + k;
    if (group > 1) shuffle(order + g * group, group);
  }
  for (int m = 0; m < nsend; m++) {
    size_t sz = x->sizes[m];
    sbuf[m] = alloc_buf(sz, guard);
    rbuf[m] = alloc_buf(sz + x->slack, guard);
    fill(sbuf[m], sz, msg_id(rank, (uint32_t)m));
    reg(nd, l->sc, sbuf[m], sz ? sz : 1, &smh[m]);
    reg(nd, l->rc, rbuf[m], sz + x->slack ? sz + x->slack : 1, &rmh[m]);
  }
  /* receives first in the list (each group is one request), then the sends in issue order */
  int k = 0;
  for (int g = 0; g < nrecv; g++) {
    struct op *o = &ops[k++];
    o->n = group;
    for (int b = 0; b < group; b++) {
      int m = g * group + b;
      o->data[b] = rbuf[m];
      o->size[b] = x->sizes[m] + x->slack;
      o->tag[b] = tag[m];
      o->mh[b] = rmh[m];
      o->expect[b] = x->sizes[m];
      o->msg[b] = msg_id(1 - rank, (uint32_t)m);
    }
  }
  for (int s = 0; s < nsend; s++) {
    int m = order[s];
    struct op *o = &ops[k++];
    o->send = 1;
    o->n = 1;
    o->data[0] = sbuf[m];
    o->size[0] = x->sizes[m];
    o->tag[0] = tag[m];
    o->mh[0] = smh[m];
  }
  barrier(fd);
  size_t mark = abi_log_mark();
  struct run_stats st;
  int rc;
  /* a late receiver: the peer's sends find nothing posted for a while and must be retried */
  if (x->late_recv && rank == 1) usleep(300000);
  rc = run_ops(nd, l->sc, l->rc, ops, nops, x->flags, 60, &st);
  if (rc) fail_run(what, &st, ops, mark);
  verify_recvs(ops, nops, guard);
  if (x->flags & RUN_POST_ALL_FIRST) {
    if (st.max_recvs != nrecv || st.max_sends != nsend)
      abi_fail("%s: only %d receives and %d sends were in flight at once, expected %d and %d", what, st.max_recvs,
               st.max_sends, nrecv, nsend);
  }
  if (x->iflush) {
    for (int i = 0; i < nrecv; i++) {
      struct op *o = &ops[i];
      int isz[OP_BUFS];
      for (int b = 0; b < o->n; b++) isz[b] = o->got[b];
      void *req = NULL;
      if (abi_iflush(&nd->net, l->rc, o->n, o->data, isz, o->mh, &req) != ncclSuccess) abi_fail("iflush failed");
      double deadline = abi_now() + 10;
      for (int done = 0; req && !done;) {
        if (abi_test(&nd->net, req, &done, NULL) != ncclSuccess) abi_fail("test of an iflush request failed");
        if (abi_now() > deadline) abi_fail("iflush request not done in 10 s");
      }
    }
  }
  abi_note("%s: %d messages each way, %d NULL posts retried, up to %d sends / %d receives in flight", what, nsend,
           st.null_posts, st.max_sends, st.max_recvs);
  barrier(fd); /* the peer has checked its bytes too before buffers go */
  for (int m = 0; m < nsend; m++) {
    dereg(nd, l->sc, smh[m]);
    dereg(nd, l->rc, rmh[m]);
    free(sbuf[m]);
    free(rbuf[m]);
  }
  free(ops); free(sbuf); free(rbuf); free(smh); free(rmh); free(tag); free(order);
}

/* ------------------------------------------------------------------ scenarios */

static int sc_props(void) {
  struct node nd;
  node_open(&nd, 11);
  void *ctx1 = NULL, *ctx2 = NULL;
  ncclNetCommConfig_v11_t cfg = {.trafficClass = 3};
  (void)cfg;
  if (abi_init(&nd.net, 0xabc1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx1) != ncclSuccess) abi_fail("init (comm 1) failed");
  if (abi_init(&nd.net, 0xabc2, 3, &ctx2) != ncclSuccess) abi_fail("init (comm 2, traffic class 3) failed");
  int n1 = 0, n2 = 0;
  if (abi_devices(&nd.net, &n1) != ncclSuccess || n1 < 1) abi_fail("devices: %d", n1);
  if (abi_devices(&nd.net, &n2) != ncclSuccess || n2 != n1) abi_fail("devices changed: %d then %d", n1, n2);
  for (int d = 0; d < n1; d++) {
    struct abi_props p, q;
    if (abi_get_props(&nd.net, d, &p) != ncclSuccess) abi_fail("getProperties(%d) failed", d);
    check_props(&p, d, 11);
    char name[256];
    snprintf(name, sizeof(name), "%s", p.name);
    if (abi_get_props(&nd.net, d, &q) != ncclSuccess) abi_fail("getProperties(%d) failed the second time", d);
    if (strcmp(p.name, name) || strcmp(q.name, name) || p.guid != q.guid || p.speed != q.speed)
      abi_fail("dev %d: properties differ between two calls", d);
    for (int e = 0; e < d; e++) {
      struct abi_props o;
      abi_get_props(&nd.net, e, &o);
      if (!strcmp(o.name, p.name)) abi_fail("devs %d and %d have the same name %s", e, d, p.name);
    }
    abi_note("dev %d: %s speed %d Mb/s ptr 0x%x maxRecvs %d maxComms %d maxP2pBytes %zu pci %s", d, p.name, p.speed,
             p.ptr_support, p.max_recvs, p.max_comms, p.max_p2p_bytes, p.pci_path ? p.pci_path : "(none)");
  }
  /* a device that does not exist is an error, not a crash */
  size_t mark = abi_log_mark();
  struct abi_props bad;
  if (abi_get_props(&nd.net, n1, &bad) == ncclSuccess) abi_fail("getProperties(%d) of %d devices succeeded", n1, n1);
  if (abi_get_props(&nd.net, -1, &bad) == ncclSuccess) abi_fail("getProperties(-1) succeeded");
  unsigned char h[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, ctx1, n1, h, &lc) == ncclSuccess) abi_fail("listen on device %d of %d succeeded", n1, n1);
  if (!abi_log_warn_has(mark, "device", NULL)) abi_fail("no WARN about the device that does not exist");
  /* two communicators listen at once, on their own contexts */
  unsigned char h1[HANDLE_SIZE], h2[HANDLE_SIZE];
  void *lc1 = NULL, *lc2 = NULL;
  if (abi_listen(&nd.net, ctx1, 0, h1, &lc1) != ncclSuccess || !lc1) abi_fail("listen (comm 1) failed");
  if (abi_listen(&nd.net, ctx2, 0, h2, &lc2) != ncclSuccess || !lc2) abi_fail("listen (comm 2) failed");
  if (!memcmp(h1, h2, HANDLE_SIZE)) abi_fail("two listens gave the same handle");
  abi_close_listen(&nd.net, lc1);
  abi_close_listen(&nd.net, lc2);
  if (abi_finalize(&nd.net, ctx1) != ncclSuccess || abi_finalize(&nd.net, ctx2) != ncclSuccess)
    abi_fail("finalize failed");
  return 0;
}

static const size_t k_sizes[] = {0, 1, 4095, 4096, (1 << 20) + 3, 64 << 20};

static int sc_sizes(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  /* each size twice: into a buffer of exactly its size, then into a bigger one */
  size_t n = sizeof(k_sizes) / sizeof(k_sizes[0]);
  size_t sizes[2 * sizeof(k_sizes) / sizeof(k_sizes[0])];
  for (size_t i = 0; i < n; i++) sizes[i] = sizes[n + i] = k_sizes[i];
  struct xfer_spec exact = {.sizes = sizes, .count = (int)n, .slack = 0, .group = 1, .iflush = 1, .seed = 1};
  exchange(&nd, &l, rank, pp.fd, &exact, "sizes, exact buffers");
  struct xfer_spec roomy = {.sizes = sizes + n, .count = (int)n, .slack = 4099, .group = 1, .seed = 2};
  exchange(&nd, &l, rank, pp.fd, &roomy, "sizes, bigger buffers");
  struct xfer_spec late = {.sizes = sizes, .count = (int)n, .slack = 0, .group = 1, .late_recv = 1, .seed = 3};
  exchange(&nd, &l, rank, pp.fd, &late, "sizes, receiver posts late");
  /* memory the transport cannot take is refused at regMr, not discovered later */
  if (!(nd.props.ptr_support & NCCL_PTR_CUDA)) {
    char buf[64];
    void *mh = NULL;
    if (abi_reg_mr(&nd.net, l.sc, buf, sizeof(buf), NCCL_PTR_CUDA, &mh) == ncclSuccess)
      abi_fail("regMr of CUDA memory succeeded on a device without NCCL_PTR_CUDA");
  }
  barrier(pp.fd);
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

static int sc_inflight(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  size_t sizes[MAX_INFLIGHT];
  rng_seed(11);
  for (int i = 0; i < MAX_INFLIGHT; i++) sizes[i] = i % 4 == 3 ? (size_t)(rng() % (3 << 20)) : rng() % 70000;
  sizes[0] = 0;
  struct xfer_spec x = {.sizes = sizes, .count = MAX_INFLIGHT, .slack = 17, .group = 1, .flags = RUN_POST_ALL_FIRST, .seed = 12};
  for (int round = 0; round < 3; round++) exchange(&nd, &l, rank, pp.fd, &x, "32 requests in flight");
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

static int sc_inflight_max(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  int group = nd.props.max_recvs < OP_BUFS ? nd.props.max_recvs : OP_BUFS;
  int count = MAX_INFLIGHT * group;
  size_t *sizes = calloc((size_t)count, sizeof(size_t));
  rng_seed(21);
  for (int i = 0; i < count; i++) sizes[i] = i % 37 == 5 ? 300000 + rng() % 100000 : rng() % 9000;
  struct xfer_spec x = {.sizes = sizes, .count = count, .slack = 0, .group = group, .flags = RUN_POST_ALL_FIRST, .seed = 22};
  char what[96];
  snprintf(what, sizeof(what), "%d sends in flight against %d receives of %d buffers", count, MAX_INFLIGHT, group);
  exchange(&nd, &l, rank, pp.fd, &x, what);
  exchange(&nd, &l, rank, pp.fd, &x, what);
  free(sizes);
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

static int sc_multirecv(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  int group = nd.props.max_recvs < OP_BUFS ? nd.props.max_recvs : OP_BUFS;
  if (group < 8) abi_note("maxRecvs is %d: groups of %d", nd.props.max_recvs, group);
  int groups = 24, count = groups * group;
  size_t *sizes = calloc((size_t)count, sizeof(size_t));
  rng_seed(31);
  for (int i = 0; i < count; i++) {
    int t = i % group;
    sizes[i] = t == 0 ? 0 : t == 1 ? 1 : t == 2 ? (size_t)(300000 + rng() % 2000000) : rng() % 50000;
  }
  struct xfer_spec x = {.sizes = sizes, .count = count, .slack = 100, .group = group, .seed = 32};
  exchange(&nd, &l, rank, pp.fd, &x, "tagged multi-recv, shuffled tags");
  x.flags = RUN_POST_ALL_FIRST;
  x.seed = 33;
  exchange(&nd, &l, rank, pp.fd, &x, "tagged multi-recv, all posted first");
  free(sizes);
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* NCCL 2.28 dlcloses a net plugin once its last communicator is gone and may dlopen it again for
 * a later one. The plugin's threads (IB async events, socket helpers) must not run unmapped code
 * after that, and a second open must work: three rounds of open, init, connect both ways, data,
 * close, finalize, dlclose, with a pause after each dlclose for any stray thread to wake. */
static int sc_reload(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  for (int round = 0; round < 3; round++) {
    struct node nd;
    node_up(&nd, g_opts.version);
    struct link l;
    link_up(&nd, pp.fd, &l);
    size_t sizes[3] = {0, 4096, (1 << 20) + 5};
    struct xfer_spec x = {.sizes = sizes, .count = 3, .slack = 64, .group = 1, .seed = 40u + (unsigned)round};
    exchange(&nd, &l, rank, pp.fd, &x, "data after a reload");
    link_down(&nd, &l);
    node_down(&nd);
    abi_net_close(&nd.net);
    usleep(300000); /* a thread of the plugin still running would crash here */
    barrier(pp.fd);
  }
  abi_note("3 rounds of dlopen, init, data, finalize, dlclose");
  return pair_finish(&pp, rank);
}

static int count_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

static int sc_reconnect(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  const int iters = 50;
  int fds0 = -1, threads0 = -1;
  for (int it = 0; it < iters; it++) {
    /* a communicator per iteration: init, connect both ways, move bytes, close, finalize */
    void *ctx = NULL;
    if (abi_init(&nd.net, 0x5000 + (uint64_t)it, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) != ncclSuccess) abi_fail("init %d failed", it);
    struct link l;
    link_up_with(&nd, ctx, pp.fd, &l);
    size_t sizes[2] = {1000 + (size_t)it, it % 5 == 0 ? (size_t)(1 << 20) + (size_t)it : 5};
    struct xfer_spec x = {.sizes = sizes, .count = 2, .group = 1, .seed = 100 + (uint32_t)it};
    exchange(&nd, &l, rank, pp.fd, &x, "reconnect");
    if (it % 10 == 9) {
      /* NCCL may close with a receive still posted (abort): close must not hang or crash */
      char buf[256];
      size_t sz = sizeof(buf);
      int tag = 77;
      void *data = buf, *mh = NULL, *req = NULL;
      reg(&nd, l.rc, buf, sizeof(buf), &mh);
      double deadline = abi_now() + 10;
      while (!req) {
        if (abi_irecv(&nd.net, l.rc, 1, &data, &sz, &tag, &mh, &req) != ncclSuccess) abi_fail("irecv failed");
        if (abi_now() > deadline) abi_fail("irecv gave no request in 10 s");
      }
      int done = 0;
      if (abi_test(&nd.net, req, &done, NULL) != ncclSuccess || done) abi_fail("a receive nobody sends to completed");
      barrier(pp.fd);
      dereg(&nd, l.rc, mh);
    }
    link_down(&nd, &l);
    if (abi_finalize(&nd.net, ctx) != ncclSuccess) abi_fail("finalize %d failed", it);
    barrier(pp.fd);
    if (it == 0) {
      fds0 = count_dir("/proc/self/fd");
      threads0 = count_dir("/proc/self/task");
    }
  }
  /* the peer may still be tearing down its side: give sockets/threads a moment */
  int fds = 0, threads = 0;
  for (int i = 0; i < 50; i++) {
    fds = count_dir("/proc/self/fd");
    threads = count_dir("/proc/self/task");
    if (fds <= fds0 && threads <= threads0) break;
    usleep(20000);
  }
  if (fds > fds0) abi_fail("%d open file descriptors after %d connect/close rounds, %d after the first: a leak", fds, iters, fds0);
  if (threads > threads0) abi_fail("%d threads after %d connect/close rounds, %d after the first: a leak", threads, iters, threads0);
  abi_note("%d connect/close rounds; %d fds and %d threads before and after", iters, fds0, threads0);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* What a WARN about the dead peer must name. */
static void peer_addr_text(const unsigned char *handle, char *out, size_t len) {
  const char *env = getenv("MPLANE_ABI_PEER_ADDR");
  if (env && *env) {
    snprintf(out, len, "%s", env);
    return;
  }
  snprintf(out, len, "peer");
  struct mplane_handle h;
  char why[256];
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess || h.transport != MPLANE_HANDLE_SOCKET) return;
  struct sockaddr_storage ss;
  memset(&ss, 0, sizeof(ss));
  memcpy(&ss, h.payload, h.payload_len < sizeof(ss) ? h.payload_len : sizeof(ss));
  if (ss.ss_family == AF_INET) inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, out, (socklen_t)len);
  else if (ss.ss_family == AF_INET6) inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, out, (socklen_t)len);
}

/* One side streams big messages to the other; the survivor kills the peer (SIGKILL) once the first
 * message is through and keeps driving its requests: it must get an error within 10 s, with a
 * WARN that names the peer. victim_sends: the killed process is the sender. */
static int kill_scenario(int victim_sends) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  int survivor = rank == 0, sending = survivor ? !victim_sends : victim_sends;
  char addr[128];
  peer_addr_text(l.peer_handle, addr, sizeof(addr));
  enum { DEPTH = 4 };
  const size_t size = 16u << 20;
  void *buf[DEPTH], *mh[DEPTH], *req[DEPTH] = {0};
  void *comm = sending ? l.sc : l.rc;
  for (int i = 0; i < DEPTH; i++) {
    buf[i] = alloc_buf(size, 0);
    reg(&nd, comm, buf[i], size, &mh[i]);
  }
  barrier(pp.fd);
  uint32_t posted = 0, completed = 0;
  double t_kill = 0, deadline = abi_now() + 60;
  size_t mark = abi_log_mark();
  ncclResult_t err = ncclSuccess;
  while (err == ncclSuccess) {
    for (int i = 0; i < DEPTH && err == ncclSuccess; i++) {
      if (req[i]) continue;
      if (sending) fill(buf[i], 64, msg_id(rank, posted)); /* the head is enough to tell messages apart */
      int tag = 1;
      size_t sz = size;
      err = sending ? abi_isend(&nd.net, l.sc, buf[i], size, tag, mh[i], &req[i])
                    : abi_irecv(&nd.net, l.rc, 1, &buf[i], &sz, &tag, &mh[i], &req[i]);
      if (req[i]) posted++;
    }
    for (int i = 0; i < DEPTH && err == ncclSuccess; i++) {
      if (!req[i]) continue;
      int done = 0, got = -1;
      err = abi_test(&nd.net, req[i], &done, &got);
      if (err != ncclSuccess || !done) continue;
      if (!sending && got != (int)size) abi_fail("received %d bytes, %zu were sent", got, size);
      req[i] = NULL;
      completed++;
    }
    if (survivor && !t_kill && completed >= 1) {
      if (kill(pp.child, SIGKILL) != 0) abi_fail("kill: %s", strerror(errno));
      t_kill = abi_now();
      mark = abi_log_mark();
      abi_note("killed the %s (pid %d) after %u messages; %u requests posted", victim_sends ? "sender" : "receiver",
               (int)pp.child, completed, posted);
    }
    if (t_kill && abi_now() - t_kill > 10) break;
    if (abi_now() > deadline) abi_fail("no message completed in 60 s");
    sched_yield();
  }
  if (!survivor) abi_fail("the victim outlived its SIGKILL (error %d)", err); /* never reached normally */
  double dt = abi_now() - t_kill;
  if (err == ncclSuccess) abi_fail("the peer was killed %.1f s ago and %s still reports no error", dt, sending ? "isend/test" : "irecv/test");
  abi_note("the survivor saw result %d %.3f s after the kill", err, dt);
  if (!abi_log_warn_has(mark, addr, NULL)) {
    abi_log_dump(mark, "no WARN names the peer");
    abi_fail("no WARN after the kill names the peer's address '%s'", addr);
  }
  int st = 0;
  waitpid(pp.child, &st, 0);
  if (!WIFSIGNALED(st) || WTERMSIG(st) != SIGKILL) abi_fail("the victim did not die of SIGKILL (status 0x%x)", st);
  /* deregistering and closing comms that failed must neither hang nor crash */
  for (int i = 0; i < DEPTH; i++) abi_dereg_mr(&nd.net, comm, mh[i]);
  double t0 = abi_now();
  if (l.sc) abi_close_send(&nd.net, l.sc);
  if (l.rc) abi_close_recv(&nd.net, l.rc);
  abi_close_listen(&nd.net, l.lc);
  timed(t0, "close after the peer died");
  for (int i = 0; i < DEPTH; i++) free(buf[i]);
  node_down(&nd);
  close(pp.fd);
  return 0;
}

static int sc_kill_receiver(void) { return kill_scenario(0); }
static int sc_kill_sender(void) { return kill_scenario(1); }

/* A receive buffer smaller than the message: ncclInvalidUsage on both sides, nothing written past
 * the buffer. Rank 1 receives, rank 0 sends. */
static int sc_short_recv(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  const struct { size_t cap, send; } cases[] = {{4096, (1 << 20) + 3}, {4096, 4097}, {0, 1}, {1000, 64 << 20}};
  const size_t guard = 1 << 16;
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    struct link l;
    link_up(&nd, pp.fd, &l);
    size_t mark = abi_log_mark();
    ncclResult_t err = ncclSuccess;
    double t0 = abi_now();
    if (rank == 1) {
      uint8_t *buf = alloc_buf(cases[c].cap, guard);
      void *mh, *req = NULL, *data = buf;
      size_t sz = cases[c].cap;
      int tag = 5, done = 0;
      reg(&nd, l.rc, buf, cases[c].cap + guard, &mh);
      while (!req && err == ncclSuccess) err = abi_irecv(&nd.net, l.rc, 1, &data, &sz, &tag, &mh, &req);
      while (err == ncclSuccess && !done && abi_now() - t0 < 10) err = abi_test(&nd.net, req, &done, NULL);
      if (done) abi_fail("a %zu-byte message into a %zu-byte buffer completed", cases[c].send, cases[c].cap);
      if (err != ncclInvalidUsage) abi_fail("%zu bytes into %zu: receiver got %d, expected ncclInvalidUsage (%d)", cases[c].send, cases[c].cap, err, ncclInvalidUsage);
      long bad = check_guard(buf, cases[c].cap, cases[c].cap + guard);
      if (bad >= 0) abi_fail("%zu bytes into %zu: byte %ld past the buffer was written", cases[c].send, cases[c].cap, bad);
      if (!abi_log_warn_has(mark, NULL)) abi_fail("no WARN about the short receive");
      dereg(&nd, l.rc, mh);
      free(buf);
    } else {
      uint8_t *buf = alloc_buf(cases[c].send, 0);
      fill(buf, cases[c].send, 9);
      void *mh, *req = NULL;
      int done = 0;
      reg(&nd, l.sc, buf, cases[c].send, &mh);
      while (!req && err == ncclSuccess && abi_now() - t0 < 10) err = abi_isend(&nd.net, l.sc, buf, cases[c].send, 5, mh, &req);
      while (req && err == ncclSuccess && !done && abi_now() - t0 < 10) err = abi_test(&nd.net, req, &done, NULL);
      /* A small message may have gone before the receive was posted (socket eager sends): it then
       * completes, and the error comes on a later call on the comm, once the receiver's offer has
       * been read. Keep sending 1 byte: within a bounded number of calls the comm must fail. */
      int later = 0;
      for (; done && err == ncclSuccess && later < 64 && abi_now() - t0 < 10; later++) {
        void *r2 = NULL;
        int d2 = 0;
        while (!r2 && err == ncclSuccess && abi_now() - t0 < 10) err = abi_isend(&nd.net, l.sc, buf, 1, 5, mh, &r2);
        while (r2 && err == ncclSuccess && !d2 && abi_now() - t0 < 10) err = abi_test(&nd.net, r2, &d2, NULL);
      }
      if (err != ncclInvalidUsage)
        abi_fail("%zu bytes into %zu: sender got %d (%s), expected ncclInvalidUsage", cases[c].send, cases[c].cap, err,
                 done ? "send and 64 more completed" : "no error");
      if (later) abi_note("%zu bytes into %zu: the send completed (eager), the comm failed %d calls later", cases[c].send, cases[c].cap, later);
      dereg(&nd, l.sc, mh);
      free(buf);
    }
    abi_note("%zu bytes into a %zu-byte buffer: ncclInvalidUsage after %.3f s", cases[c].send, cases[c].cap, abi_now() - t0);
    barrier(pp.fd);
    link_down(&nd, &l);
  }
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* Handles that are not ours: connect fails at once with a WARN, never hangs or crashes, and a good
 * handle still connects afterwards (to ourselves: one process). */
static int sc_bad_handle(void) {
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char good[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, nd.ctx, nd.dev, good, &lc) != ncclSuccess) abi_fail("listen failed");
  struct {
    const char *what, *warn;
    int off, len;
    uint8_t val;
  } cases[] = {
      {"bad magic", "mplane", 0, 1, 0x00},
      {"bad magic (last byte)", "mplane", 3, 1, 0x00},
      {"another protocol version", "version", 4, 1, (uint8_t)(MPLANE_PROTOCOL_VERSION + 1)},
      {"an unknown transport", "transport", 6, 1, 0x7f},
      {"a payload length past the handle", "payload", 16, 1, 200},
      {"all 0xa5 (garbage)", "mplane", 0, HANDLE_SIZE, 0xa5},
      {"all zeros (NCCL's own socket handle shape)", "mplane", 0, HANDLE_SIZE, 0x00},
      {"all 0xff", "mplane", 0, HANDLE_SIZE, 0xff},
      {"an AF_UNIX address", "IPv4 or IPv6", 17, 1, 1},
      {"an address of 111 bytes (a sockaddr has 16 or 28)", "IPv4 or IPv6", 16, 1, 111},
  };
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    unsigned char h[HANDLE_SIZE];
    memcpy(h, good, HANDLE_SIZE);
    memset(h + cases[c].off, cases[c].val, (size_t)cases[c].len);
    if (c == 0) h[0] = (uint8_t)(good[0] ^ 0xff);
    if (c == 1) h[3] = (uint8_t)(good[3] ^ 0x01);
    size_t mark = abi_log_mark();
    void *sc = NULL;
    ncclResult_t res = ncclSuccess;
    double t0 = abi_now();
    int calls = 0;
    while (res == ncclSuccess && !sc && abi_now() - t0 < 5) {
      double t1 = abi_now();
      res = abi_connect(&nd.net, nd.ctx, nd.dev, h, &sc);
      timed(t1, "connect");
      calls++;
      /* keep the listener progressing as the proxy would */
      void *rc = NULL;
      if (abi_accept(&nd.net, lc, &rc) != ncclSuccess) abi_fail("accept failed while a bad handle was tried");
      if (rc) abi_fail("accept produced a connection from a bad handle (%s)", cases[c].what);
    }
    if (sc) abi_fail("connect with %s produced a connection", cases[c].what);
    if (res == ncclSuccess) abi_fail("connect with %s neither failed nor connected in 5 s (%d calls): a hang", cases[c].what, calls);
    if (!abi_log_warn_has(mark, cases[c].warn, NULL)) {
      abi_log_dump(mark, "WARN check");
      abi_fail("connect with %s failed (%d) without a WARN mentioning '%s'", cases[c].what, res, cases[c].warn);
    }
    abi_note("connect with %s: result %d after %d call(s)", cases[c].what, res, calls);
  }
  /* the good handle still works: connect to ourselves, move a message, close. Its last 8 bytes,
   * where connect keeps its state between calls, hold garbage first (a handle of another build):
   * that is a new connect, never a pointer followed. */
  memset(good + HANDLE_SIZE - 8, 0x41, 8);
  void *sc = NULL, *rc = NULL;
  double deadline = abi_now() + 30;
  while (!sc || !rc) {
    if (!sc && abi_connect(&nd.net, nd.ctx, nd.dev, good, &sc) != ncclSuccess) abi_fail("connect with the good handle failed");
    if (!rc && abi_accept(&nd.net, lc, &rc) != ncclSuccess) abi_fail("accept failed");
    if (abi_now() > deadline) abi_fail("no connection to ourselves in 30 s");
  }
  struct op ops[2];
  memset(ops, 0, sizeof(ops));
  size_t size = (1 << 20) + 3;
  void *sbuf = alloc_buf(size, 0), *rbuf = alloc_buf(size, 64);
  fill(sbuf, size, 42);
  ops[0] = (struct op){.send = 0, .n = 1, .data = {rbuf}, .size = {size}, .tag = {1}, .expect = {size}, .msg = {42}};
  ops[1] = (struct op){.send = 1, .n = 1, .data = {sbuf}, .size = {size}, .tag = {1}};
  reg(&nd, rc, rbuf, size, &ops[0].mh[0]);
  reg(&nd, sc, sbuf, size, &ops[1].mh[0]);
  struct run_stats st;
  size_t mark = abi_log_mark();
  if (run_ops(&nd, sc, rc, ops, 2, 0, 30, &st)) fail_run("self connection after bad handles", &st, ops, mark);
  verify_recvs(ops, 2, 64);
  dereg(&nd, rc, ops[0].mh[0]);
  dereg(&nd, sc, ops[1].mh[0]);
  abi_close_send(&nd.net, sc);
  abi_close_recv(&nd.net, rc);
  abi_close_listen(&nd.net, lc);
  free(sbuf);
  free(rbuf);
  node_down(&nd);
  return 0;
}

/* ---- fake peers: plain TCP clients at the listen address (socket transport only) ---- */

static int handle_sockaddr(const unsigned char *handle, struct sockaddr_storage *ss, socklen_t *len);

/* 1 if the handle is a socket transport one (a receiver thread gates its data) */
int handle_is_socket(const unsigned char *handle) {
  struct sockaddr_storage ss;
  socklen_t len;
  return handle_sockaddr(handle, &ss, &len);
}

static int handle_sockaddr(const unsigned char *handle, struct sockaddr_storage *ss, socklen_t *len) {
  struct mplane_handle h;
  char why[256];
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess) abi_fail("our own listen handle does not decode: %s", why);
  if (h.transport != MPLANE_HANDLE_SOCKET) return 0;
  memset(ss, 0, sizeof(*ss));
  memcpy(ss, h.payload, h.payload_len < sizeof(*ss) ? h.payload_len : sizeof(*ss));
  *len = h.payload_len;
  return 1;
}

static int tcp_client(const struct sockaddr_storage *ss, socklen_t len, int *port) {
  int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (const struct sockaddr *)ss, len) != 0) abi_fail("fake peer: connect: %s", strerror(errno));
  struct sockaddr_storage me;
  socklen_t ml = sizeof(me);
  getsockname(fd, (struct sockaddr *)&me, &ml);
  *port = ntohs(me.ss_family == AF_INET ? ((struct sockaddr_in *)&me)->sin_port : ((struct sockaddr_in6 *)&me)->sin6_port);
  return fd;
}

/* Accept for up to secs seconds (each call short, none producing a comm) until a WARN containing
 * every given string appears. Returns the result of the last accept. */
static ncclResult_t accept_until_warn(struct node *nd, void *lc, size_t mark, double secs, const char *what,
                                      const char *s1, const char *s2) {
  double t0 = abi_now();
  ncclResult_t res = ncclSuccess;
  while (abi_now() - t0 < secs) {
    void *rc = NULL;
    double t1 = abi_now();
    res = abi_accept(&nd->net, lc, &rc);
    timed(t1, "accept");
    if (rc) abi_fail("%s: accept produced a connection", what);
    if (abi_log_warn_has(mark, s1, s2, NULL)) return res;
    if (res != ncclSuccess) break;
    usleep(1000);
  }
  abi_log_dump(mark, what);
  abi_fail("%s: no WARN with '%s'%s%s within %.0f s (accept result %d)", what, s1, s2 ? " and " : "", s2 ? s2 : "", secs, res);
}

/* 1 when the fake's socket was closed by the plugin within secs. */
static int closed_by_peer(int fd, double secs) {
  double t0 = abi_now();
  char buf[512];
  while (abi_now() - t0 < secs) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) return 1;
  }
  return 0;
}

/* The real peer of the socket-only "fakes" scenarios (child side): waits for the listener's handle
 * (all zeros: the scenario skipped), connects like any rank and sends one message. */
static int real_peer_send_one(struct pair *pp, struct node *nd, size_t size, int msg, int tag, const char *what) {
  unsigned char h[HANDLE_SIZE];
  chan_recv(pp->fd, h, HANDLE_SIZE);
  if (h[0] == 0) _exit(77);
  void *sc = NULL;
  double deadline = abi_now() + 30;
  while (!sc) {
    if (abi_connect(&nd->net, nd->ctx, nd->dev, h, &sc) != ncclSuccess) abi_fail("connect %s failed", what);
    if (abi_now() > deadline) abi_fail("no connection %s in 30 s", what);
    sched_yield();
  }
  void *buf = alloc_buf(size, 0), *mh;
  fill(buf, size, msg);
  reg(nd, sc, buf, size, &mh);
  struct op op = {.send = 1, .n = 1, .data = {buf}, .size = {size}, .tag = {tag}, .mh = {mh}};
  struct run_stats st;
  if (run_ops(nd, sc, NULL, &op, 1, 0, 30, &st)) fail_run("send", &st, &op, 0);
  barrier(pp->fd);
  dereg(nd, sc, mh);
  abi_close_send(&nd->net, sc);
  free(buf);
  node_down(nd);
  return pair_finish(pp, 1);
}

/* Listen and read the TCP address out of the handle. 0 when the transport is not socket: the
 * scenario skips (and, with a child waiting in real_peer_send_one, releases it). */
static int listen_tcp(struct node *nd, struct pair *pp, unsigned char *handle, void **lc, struct sockaddr_storage *ss,
                      socklen_t *sl) {
  if (abi_listen(&nd->net, nd->ctx, nd->dev, handle, lc) != ncclSuccess) abi_fail("listen failed");
  if (handle_sockaddr(handle, ss, sl)) return 1;
  abi_note("SKIP: the listen handle is not a TCP address (transport is not socket)");
  if (pp) {
    unsigned char no[HANDLE_SIZE] = {0};
    chan_send(pp->fd, no, HANDLE_SIZE);
    int st;
    waitpid(pp->child, &st, 0);
  }
  return 0;
}

/* Listener side of real_peer_send_one: hand it the handle, accept within limit_s (why names what
 * a late accept means), receive and check its one message, then close. Seconds until accepted. */
static double accept_real_peer(struct node *nd, struct pair *pp, const unsigned char *handle, void *lc, size_t size,
                               int msg, int tag, double limit_s, const char *why) {
  chan_send(pp->fd, handle, HANDLE_SIZE);
  void *rc = NULL;
  double t0 = abi_now();
  while (!rc) {
    double t1 = abi_now();
    if (abi_accept(&nd->net, lc, &rc) != ncclSuccess) abi_fail("accept of the real peer failed");
    timed(t1, "accept");
    if (abi_now() - t0 > limit_s) abi_fail("the real peer was not accepted within %.0f s %s", limit_s, why);
    sched_yield();
  }
  double waited = abi_now() - t0;
  void *buf = alloc_buf(size, 64), *mh;
  reg(nd, rc, buf, size, &mh);
  struct op op = {.n = 1, .data = {buf}, .size = {size}, .tag = {tag}, .mh = {mh}, .expect = {size}, .msg = {msg}};
  struct run_stats st;
  size_t mark = abi_log_mark();
  if (run_ops(nd, NULL, rc, &op, 1, 0, 30, &st)) fail_run("receive from the real peer", &st, &op, mark);
  verify_recvs(&op, 1, 64);
  barrier(pp->fd);
  dereg(nd, rc, mh);
  abi_close_recv(&nd->net, rc);
  free(buf);
  return waited;
}

static int sc_fake_peer(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  /* the real peer: waits until the fakes were dealt with, then connects like any rank */
  if (rank == 1) return real_peer_send_one(&pp, &nd, 300001, 77, 3, "after the fakes");
  unsigned char handle[HANDLE_SIZE];
  void *lc = NULL;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!listen_tcp(&nd, &pp, handle, &lc, &ss, &sl)) return 77;
  char port_text[16];
  int port;
  /* 1: HTTP-looking garbage */
  size_t mark = abi_log_mark();
  int f1 = tcp_client(&ss, sl, &port);
  const char garbage[] = "GET / HTTP/1.1\r\nHost: mplane\r\nUser-Agent: not-nccl\r\n\r\n0123456789abcdef0123456789abcdef";
  if (send(f1, garbage, sizeof(garbage), MSG_NOSIGNAL) != (ssize_t)sizeof(garbage)) abi_fail("fake peer: send");
  snprintf(port_text, sizeof(port_text), ":%d", port);
  accept_until_warn(&nd, lc, mark, 5, "garbage from a plain TCP client", "not mplane", port_text);
  if (!closed_by_peer(f1, 5)) abi_fail("the plugin kept the garbage sender's connection open");
  close(f1);
  /* 2: connects and hangs up without a byte; 3: three bytes, then silence; 4: silence */
  int f2 = tcp_client(&ss, sl, &port);
  close(f2);
  int f3 = tcp_client(&ss, sl, &port);
  if (send(f3, "MPL", 3, MSG_NOSIGNAL) != 3) abi_fail("fake peer: send");
  int f4 = tcp_client(&ss, sl, &port);
  /* 5: a flood of random bytes */
  int f5 = tcp_client(&ss, sl, &port);
  char noise[65536];
  rng_seed(5);
  for (size_t i = 0; i < sizeof(noise); i++) noise[i] = (char)(rng() | 1);
  if (send(f5, noise, sizeof(noise), MSG_NOSIGNAL) < 0) abi_fail("fake peer: send");
  snprintf(port_text, sizeof(port_text), ":%d", port);
  mark = abi_log_mark();
  accept_until_warn(&nd, lc, mark, 5, "random bytes from a plain TCP client", "not mplane", port_text);
  close(f5);
  /* a real peer still gets through, with the silent fakes still pending */
  accept_real_peer(&nd, &pp, handle, lc, 300001, 77, 3, 30, "after the fakes");
  abi_close_listen(&nd.net, lc);
  close(f3);
  close(f4);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* A peer that says mplane's magic but another protocol version: a WARN naming the version, a NACK
 * back to it, and no connection. */
/* ---- a fake sender: speaks the socket protocol itself, then sends chunks a real sender never would ---- */

/* Read one control record from the fake's control socket within 5 s. */
static void fake_read_ctrl(int fd, struct mps_ctrl *m, uint16_t want) {
  size_t have = 0;
  for (double t0 = abi_now(); have < sizeof(*m);) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (abi_now() - t0 > 5) abi_fail("fake sender: no control record (type %u) in 5 s", want);
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t r = recv(fd, (char *)m + have, sizeof(*m) - have, 0);
    if (r <= 0) abi_fail("fake sender: the plugin closed the control socket");
    have += (size_t)r;
  }
  if (m->magic != MPLANE_HANDLE_MAGIC || m->type != want) abi_fail("fake sender: control record type %u, expected %u", m->type, want);
}

struct fake_chunk {
  uint64_t offset, len, total;
  uint32_t flags; /* MPS_CHUNK_TRUNCATED: a "does not fit" notice, no payload; MPS_CHUNK_ACK: spliced */
};

#define FAKE_PAYLOAD (64 << 10) /* payload bytes a fake chunk carries; past that the socket shuts */

/* The fake sender's writes, from a thread of their own: the plugin reads what the control socket
 * carries only while the main thread calls test(). */
struct fake_writer {
  int fd;
  uint32_t slot;
  const struct fake_chunk *ch;
  int nch;
};

static void *fake_write(void *arg) {
  const struct fake_writer *w = arg;
  static char payload[FAKE_PAYLOAD];
  memset(payload, 0x5a, sizeof(payload));
  for (int i = 0; i < w->nch; i++) {
    const struct fake_chunk *ch = &w->ch[i];
    struct mps_chunk h = {.slot = w->slot, .flags = ch->flags, .offset = ch->offset, .len = ch->len, .total = ch->total};
    if (h.flags & MPS_CHUNK_EAGER) h.tag = 2; /* the posted receive offers tag 1 only; offset is the base */
    size_t n = ch->len < sizeof(payload) ? ch->len : sizeof(payload);
    /* the plugin may refuse a chunk and close: later writes then fail, which is what it should do */
    if (send(w->fd, &h, sizeof(h), MSG_NOSIGNAL) != (ssize_t)sizeof(h) ||
        (n && send(w->fd, payload, n, MSG_NOSIGNAL) != (ssize_t)n))
      return NULL;
    if (n < ch->len) {
      shutdown(w->fd, SHUT_WR); /* the rest of the chunk never comes */
      return NULL;
    }
  }
  return NULL;
}

/* A fake sender's connection (control + one data stream) accepted by the plugin, and a receive of
 * cap bytes posted on it (tag 1): its fds, recv comm, buffer and request; *slot: the CTS's slot. */
struct fake_conn {
  int fds[2];
  void *rc, *buf, *mh, *req;
  uint32_t slot;
};

static void fake_connect(struct node *nd, void *lc, const struct sockaddr_storage *ss, socklen_t sl, size_t cap,
                         uint64_t nonce, const char *what, struct fake_conn *fc) {
  int port;
  struct mps_hello hello;
  memset(&hello, 0, sizeof(hello));
  hello.magic = MPLANE_HANDLE_MAGIC;
  hello.version = MPLANE_PROTOCOL_VERSION;
  hello.type = MPS_HELLO;
  hello.nonce = nonce;
  hello.nstreams = 1;
  for (int i = 0; i < 2; i++) {
    fc->fds[i] = tcp_client(ss, sl, &port);
    hello.stream = (uint16_t)i;
    if (send(fc->fds[i], &hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t)sizeof(hello)) abi_fail("fake sender: send");
  }
  fc->rc = NULL;
  for (double t0 = abi_now(); !fc->rc;) {
    if (abi_accept(&nd->net, lc, &fc->rc) != ncclSuccess) abi_fail("%s: accept failed", what);
    if (abi_now() - t0 > 5) abi_fail("%s: the fake sender's connection was not accepted in 5 s", what);
  }
  struct mps_ctrl m;
  fake_read_ctrl(fc->fds[0], &m, MPS_ACK);
  if (m.n != MPS_EAGER_MAX || m.eager_bytes != 64 * 1024)
    abi_fail("%s: the ACK offers %u eager messages of %u bytes, expected %d of 65536 (the default)", what, m.n,
             m.eager_bytes, MPS_EAGER_MAX);
  fc->buf = alloc_buf(cap, 64);
  reg(nd, fc->rc, fc->buf, cap, &fc->mh);
  int tag = 1;
  fc->req = NULL;
  while (!fc->req)
    if (abi_irecv(&nd->net, fc->rc, 1, &fc->buf, &cap, &tag, &fc->mh, &fc->req) != ncclSuccess)
      abi_fail("%s: irecv failed", what);
  fake_read_ctrl(fc->fds[0], &m, MPS_CTS);
  fc->slot = m.e[0].slot;
}

static void fake_close(struct node *nd, struct fake_conn *fc) {
  dereg(nd, fc->rc, fc->mh);
  abi_close_recv(&nd->net, fc->rc);
  free(fc->buf);
  close(fc->fds[0]);
  close(fc->fds[1]);
}

/* The chunks go out as given, on the data stream or (ctrl) on the control socket, where the
 * plugin's own sender puts small messages. The receive must fail within 5 s with a WARN containing
 * warn, never complete. */
static void fake_chunks_case(struct node *nd, void *lc, const struct sockaddr_storage *ss, socklen_t sl, size_t cap,
                             const struct fake_chunk *ch, int nch, int ctrl, const char *what, const char *warn) {
  struct fake_conn fc;
  fake_connect(nd, lc, ss, sl, cap, 0xfa4e0000u + (uint64_t)nch * 977 + cap + (uint64_t)ctrl * 65537, what, &fc);
  size_t mark = abi_log_mark();
  struct fake_writer w = {.fd = fc.fds[ctrl ? 0 : 1], .slot = fc.slot, .ch = ch, .nch = nch};
  pthread_t wt;
  if (pthread_create(&wt, NULL, fake_write, &w) != 0) abi_fail("fake sender: cannot start its writer");
  ncclResult_t res = ncclSuccess;
  int done = 0;
  for (double t0 = abi_now(); res == ncclSuccess && !done && abi_now() - t0 < 5;) res = abi_test(&nd->net, fc.req, &done, NULL);
  if (done) abi_fail("%s: the receive completed", what);
  if (res == ncclSuccess) abi_fail("%s: the receive neither completed nor failed in 5 s", what);
  shutdown(w.fd, SHUT_RDWR); /* a writer the plugin no longer reads from returns */
  pthread_join(wt, NULL);
  if (!abi_log_warn_has(mark, warn, NULL)) {
    abi_log_dump(mark, what);
    abi_fail("%s: the receive failed (%d) without a WARN saying '%s'", what, res, warn);
  }
  long bad = check_guard(fc.buf, cap, cap + 64);
  if (bad >= 0) abi_fail("%s: byte %ld past the buffer was written", what, bad);
  abi_note("%s: the receive failed (%d) with a WARN naming it", what, res);
  fake_close(nd, &fc);
}

/* A spliced chunk (MPS_CHUNK_ACK) from a fake sender: the receive completes with its bytes, and the
 * plugin answers on the same data stream with an mps_ack naming the chunk's slot. */
static void fake_acked_case(struct node *nd, void *lc, const struct sockaddr_storage *ss, socklen_t sl) {
  const char *what = "a spliced 1000-byte chunk";
  struct fake_conn fc;
  fake_connect(nd, lc, ss, sl, 4096, 0xacce0000u, what, &fc);
  const struct fake_chunk one[1] = {{0, 1000, 1000, MPS_CHUNK_ACK}};
  struct fake_writer w = {.fd = fc.fds[1], .slot = fc.slot, .ch = one, .nch = 1};
  fake_write(&w);
  int done = 0, size = -1;
  for (double t0 = abi_now(); !done && abi_now() - t0 < 5;)
    if (abi_test(&nd->net, fc.req, &done, &size) != ncclSuccess) abi_fail("%s: the receive failed", what);
  if (!done || size != 1000) abi_fail("%s: the receive did not complete with 1000 bytes in 5 s (%d)", what, size);
  for (int i = 0; i < 1000; i++)
    if (((unsigned char *)fc.buf)[i] != 0x5a) abi_fail("%s: byte %d of the receive is wrong", what, i);
  struct mps_ack a;
  struct timeval tv = {.tv_sec = 5};
  setsockopt(fc.fds[1], SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  if (recv(fc.fds[1], &a, sizeof(a), MSG_WAITALL) != (ssize_t)sizeof(a)) abi_fail("%s: no ack came back in 5 s", what);
  if (a.magic != MPS_ACK_MAGIC || a.slot != fc.slot)
    abi_fail("%s: the ack reads magic 0x%08x slot %u, expected 0x%08x slot %u", what, a.magic, a.slot, MPS_ACK_MAGIC,
             fc.slot);
  abi_note("%s: received, and acked on its stream", what);
  fake_close(nd, &fc);
}

static int sc_fake_chunks(void) {
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char handle[HANDLE_SIZE];
  void *lc = NULL;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!listen_tcp(&nd, NULL, handle, &lc, &ss, &sl)) return 77;
  fake_acked_case(&nd, lc, &ss, sl);
  for (int ctrl = 0; ctrl < 2; ctrl++) {
    const struct fake_chunk overlap[2] = {{0, 50, 100}, {0, 50, 100}};
    fake_chunks_case(&nd, lc, &ss, sl, 100, overlap, 2, ctrl, "two chunks over the same 50 bytes of a 100-byte message",
                     "overlaps");
    const struct fake_chunk past_end[1] = {{0, 150, 100}};
    fake_chunks_case(&nd, lc, &ss, sl, 200, past_end, 1, ctrl, "a 150-byte chunk of a 100-byte message", "past the message");
    const struct fake_chunk totals[2] = {{0, 50, 100}, {50, 50, 120}};
    fake_chunks_case(&nd, lc, &ss, sl, 200, totals, 2, ctrl, "chunks that name totals 100 and 120", "total differs");
    /* a "does not fit" notice after data for the same buffer: on two streams a chunk could then
     * complete the receive with the notice's total as its size */
    const struct fake_chunk notice_after[2] = {{0, 50, 100, 0}, {0, 0, 9000000, MPS_CHUNK_TRUNCATED}};
    fake_chunks_case(&nd, lc, &ss, sl, 100, notice_after, 2, ctrl, "a 'does not fit' notice after a chunk",
                     "notice after data");
    const struct fake_chunk notice_fits[1] = {{0, 0, 50, MPS_CHUNK_TRUNCATED}};
    fake_chunks_case(&nd, lc, &ss, sl, 100, notice_fits, 1, ctrl, "a 'does not fit' notice for 50 bytes into 100",
                     "a message that fits");
    /* a spliced "does not fit" notice: no payload, so nothing to ack; on the control socket no
     * chunk is spliced at all */
    const struct fake_chunk acked_notice[1] = {{0, 0, 500, MPS_CHUNK_TRUNCATED | MPS_CHUNK_ACK}};
    fake_chunks_case(&nd, lc, &ss, sl, 100, acked_notice, 1, ctrl, "an acked 'does not fit' notice",
                     ctrl ? "unknown flags" : "acked notice");
    const struct fake_chunk too_big[1] = {{0, 10, 300}};
    fake_chunks_case(&nd, lc, &ss, sl, 200, too_big, 1, ctrl, "a 300-byte message into 200 bytes, sent anyway",
                     "bigger than");
    /* an honest first chunk, then the rest of the message never comes: the control socket closes mid-chunk */
    const struct fake_chunk cut[1] = {{0, FAKE_PAYLOAD + 600, FAKE_PAYLOAD + 600}};
    if (ctrl)
      fake_chunks_case(&nd, lc, &ss, sl, FAKE_PAYLOAD + 1000, cut, 1, ctrl, "a control socket closed inside a chunk",
                       "mid-message");
  }
  /* eager messages (control socket only) that break what the receiver offered: one more unmatched
   * than it holds, one bigger than it takes, one after groups it never posted */
  struct fake_chunk held[MPS_EAGER_MAX + 1];
  for (int i = 0; i <= MPS_EAGER_MAX; i++) held[i] = (struct fake_chunk){0, 10, 10, MPS_CHUNK_EAGER};
  fake_chunks_case(&nd, lc, &ss, sl, 100, held, MPS_EAGER_MAX + 1, 1, "33 eager messages of a tag no receive offers",
                   "more unmatched eager messages than we hold");
  struct fake_chunk held_bytes[MPS_EAGER_HOLD / (64 << 10) + 1];
  for (int i = 0; i < (int)(sizeof(held_bytes) / sizeof(held_bytes[0])); i++)
    held_bytes[i] = (struct fake_chunk){0, 64 << 10, 64 << 10, MPS_CHUNK_EAGER};
  fake_chunks_case(&nd, lc, &ss, sl, 100, held_bytes, (int)(sizeof(held_bytes) / sizeof(held_bytes[0])), 1,
                   "9 eager messages of 64 KiB of a tag no receive offers", "more unmatched eager bytes than we hold");
  const struct fake_chunk eager_big[1] = {{0, 65537, 65537, MPS_CHUNK_EAGER}};
  fake_chunks_case(&nd, lc, &ss, sl, 100, eager_big, 1, 1, "an eager message of 64 KiB + 1", "bigger than we offered");
  const struct fake_chunk eager_base[1] = {{5, 10, 10, MPS_CHUNK_EAGER}};
  fake_chunks_case(&nd, lc, &ss, sl, 100, eager_base, 1, 1, "an eager message after group 5 of 1", "never posted");
  /* filler after a payload: control socket only, and at most MPS_PAD_MAX bytes of it */
  const struct fake_chunk filler_stream[1] = {{0, 10, 10, 100u << MPS_CHUNK_PAD_SHIFT}};
  fake_chunks_case(&nd, lc, &ss, sl, 100, filler_stream, 1, 0, "a data-stream chunk with filler", "filler");
  const struct fake_chunk filler_big[1] = {{0, 10, 10, (uint32_t)(MPS_PAD_MAX + 1) << MPS_CHUNK_PAD_SHIFT}};
  fake_chunks_case(&nd, lc, &ss, sl, 100, filler_big, 1, 1, "a chunk with more filler than a chunk may carry",
                   "filler bytes");
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

/* A fake connector sends one hello (version, sl) and reads what comes back: the plugin must WARN
 * with warn, go on accepting, and answer with a NACK. */
static void fake_hello_refused(struct node *nd, void *lc, const struct sockaddr_storage *ss, socklen_t sl,
                               uint16_t version, uint32_t service_level, const char *what, const char *warn) {
  int port;
  int fd = tcp_client(ss, sl, &port);
  struct mps_hello hello;
  memset(&hello, 0, sizeof(hello));
  hello.magic = MPLANE_HANDLE_MAGIC;
  hello.version = version;
  hello.type = MPS_HELLO;
  hello.nstreams = 1;
  hello.stream = 0;
  hello.sl = service_level;
  if (send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t)sizeof(hello)) abi_fail("fake peer: send");
  size_t mark = abi_log_mark();
  char port_text[16];
  snprintf(port_text, sizeof(port_text), ":%d", port);
  ncclResult_t res = accept_until_warn(nd, lc, mark, 5, what, warn, port_text);
  if (res != ncclSuccess)
    abi_fail("accept failed (%d) on %s: that ends NCCL's job; the socket alone must go", res, what);
  struct mps_ctrl m;
  size_t have = 0;
  double t0 = abi_now();
  while (have < sizeof(m) && abi_now() - t0 < 5) {
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 100) <= 0) continue;
    ssize_t r = recv(fd, (char *)&m + have, sizeof(m) - have, 0);
    if (r <= 0) break;
    have += (size_t)r;
  }
  if (have != sizeof(m) || m.magic != MPLANE_HANDLE_MAGIC || m.type != MPS_NACK)
    abi_fail("%s got no NACK (%zu bytes back, type %u)", what, have, have >= 8 ? m.type : 0);
  close(fd);
}

static int sc_fake_version(void) {
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char handle[HANDLE_SIZE];
  void *lc = NULL;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!listen_tcp(&nd, NULL, handle, &lc, &ss, &sl)) return 77;
  fake_hello_refused(&nd, lc, &ss, sl, 99, 0, "a hello of protocol version 99", "version 99");
  fake_hello_refused(&nd, lc, &ss, sl, MPLANE_PROTOCOL_VERSION, 200, "a hello asking for service level 200",
                     "service level 200");
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

/* Invalid configuration: init fails, and the WARN names the variable, the value and the accepted
 * form. Each case in its own process (configuration is read once per process), for two tables. */
static int sc_bad_config(void) {
  const struct {
    const char *var, *value, *form, *extra_var, *extra_value;
  } cases[] = {
      {"MPLANE_SOCKET_STREAMS", "abc", "0 (automatic) or an integer from 1 to 16", NULL, NULL},
      {"MPLANE_SOCKET_STREAMS", "17", "0 (automatic) or an integer from 1 to 16", NULL, NULL},
      {"MPLANE_SOCKET_THREADS", "-1", "0 (one per stream) or an integer from 1 to 16", NULL, NULL},
      {"MPLANE_SOCKET_CHUNK_BYTES", "1K", "from 4K to 1G", NULL, NULL},
      {"MPLANE_SOCKET_SPLIT_BYTES", "1T", "K/M/G", NULL, NULL},
      {"MPLANE_TRANSPORT", "tcp", "auto, ib or socket", NULL, NULL},
      {"MPLANE_CONNECT_TIMEOUT", "-5", "1 to 3600", NULL, NULL},
      /* no device at all: init fails too, naming the variable that selected nothing */
      {"MPLANE_SOCKET_IFNAME", "=nosuchif9", "MPLANE_SOCKET_IFNAME", "MPLANE_TRANSPORT", "socket"},
  };
  const int versions[] = {11, 8, 12};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++) {
      fflush(NULL);
      pid_t pid = fork();
      if (pid < 0) abi_fail("fork: %s", strerror(errno));
      if (pid == 0) {
        setenv(cases[c].var, cases[c].value, 1);
        if (cases[c].extra_var) setenv(cases[c].extra_var, cases[c].extra_value, 1);
        struct node nd;
        node_open(&nd, versions[v]);
        size_t mark = abi_log_mark();
        void *ctx = NULL;
        ncclResult_t res = abi_init(&nd.net, 1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx);
        if (res == ncclSuccess) abi_fail("v%d init succeeded with %s='%s'", versions[v], cases[c].var, cases[c].value);
        if (!abi_log_warn_has(mark, cases[c].var, cases[c].value, cases[c].form, NULL)) {
          abi_log_dump(mark, "init failed, but not with the expected WARN");
          abi_fail("v%d: no WARN naming %s, '%s' and '%s'", versions[v], cases[c].var, cases[c].value, cases[c].form);
        }
        /* NCCL may try again (another communicator): still a failure, not a crash */
        if (abi_init(&nd.net, 2, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) == ncclSuccess) abi_fail("second init succeeded");
        fflush(NULL);
        _exit(0);
      }
      int st = 0;
      waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) abi_fail("case %s='%s' (v%d) failed", cases[c].var, cases[c].value, versions[v]);
    }
    abi_note("%s='%s': init fails with the WARN, through v11, v8 and v12", cases[c].var, cases[c].value);
  }
  return 0;
}

/* Another table version end to end: properties agree with v11's, connect both ways, sizes, one
 * multi-recv group with shuffled tags, close. */
/* The name of device `dev`, from a throw-away process (this one must not init before its env is set). */
static void probe_dev_name(int dev, char *out, size_t len) {
  int pfd[2];
  if (pipe(pfd) != 0) abi_fail("pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    struct node nd;
    node_up(&nd, 11);
    struct abi_props p;
    abi_get_props(&nd.net, dev, &p);
    char name[256] = {0};
    snprintf(name, sizeof(name), "%s", p.name);
    ssize_t w = write(pfd[1], name, sizeof(name));
    _exit(w == (ssize_t)sizeof(name) ? 0 : 1);
  }
  close(pfd[1]);
  char name[256] = {0};
  ssize_t r = read(pfd[0], name, sizeof(name));
  close(pfd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (r != (ssize_t)sizeof(name) || !WIFEXITED(st) || WEXITSTATUS(st) != 0) abi_fail("could not probe the device name");
  snprintf(out, len, "%s", name);
}

static int version_scenario(int version) {
  /* v12 reports planes: name one with MPLANE_PLANES (unless the user did) and check it comes back in
   * planeId and in the listen handle */
  int want_plane = version == 12 && !getenv("MPLANE_PLANES") ? 5 : -2;
  struct pair pp;
  int rank = pair_fork(&pp);
  if (want_plane != -2) {
    /* each rank names its own device: the two may differ (MPLANE_ABI_RANK<r>_ENV) */
    char name[256], spec[300];
    probe_dev_name(g_opts.dev, name, sizeof(name));
    snprintf(spec, sizeof(spec), "%s=%d", name, want_plane);
    setenv("MPLANE_PLANES", spec, 1);
  }
  struct node nd;
  node_up(&nd, version);
  if (want_plane != -2) {
    if (nd.props.plane_id != want_plane)
      abi_fail("MPLANE_PLANES=%s but v12 getProperties says planeId %d", getenv("MPLANE_PLANES"), nd.props.plane_id);
    unsigned char h[HANDLE_SIZE];
    void *lc = NULL;
    struct mplane_handle mh;
    char why[256];
    if (abi_listen(&nd.net, nd.ctx, nd.dev, h, &lc) != ncclSuccess) abi_fail("listen failed");
    if (mplane_handle_decode(h, &mh, why, sizeof(why)) != ncclSuccess) abi_fail("our listen handle: %s", why);
    if (mh.plane != want_plane) abi_fail("MPLANE_PLANES=%s but the listen handle carries plane %d", getenv("MPLANE_PLANES"), mh.plane);
    abi_close_listen(&nd.net, lc);
  }
  struct abi_net v11;
  abi_net_open(&v11, g_opts.plugin, 11);
  for (int d = 0; d < nd.ndev; d++) {
    struct abi_props p, q;
    if (abi_get_props(&nd.net, d, &p) != ncclSuccess || abi_get_props(&v11, d, &q) != ncclSuccess) abi_fail("getProperties(%d)", d);
    check_props(&p, d, version);
    if (strcmp(p.name, q.name) || p.guid != q.guid || p.ptr_support != q.ptr_support || p.speed != q.speed ||
        p.port != q.port || p.max_comms != q.max_comms || p.max_recvs != q.max_recvs ||
        p.reg_is_global != q.reg_is_global || p.latency != q.latency ||
        (p.pci_path == NULL) != (q.pci_path == NULL) || (p.pci_path && strcmp(p.pci_path, q.pci_path)))
      abi_fail("dev %d: v%d properties differ from v11's", d, version);
    if (version >= 9 && (p.max_p2p_bytes != q.max_p2p_bytes || p.max_coll_bytes != q.max_coll_bytes || p.force_flush != q.force_flush))
      abi_fail("dev %d: v%d size limits differ from v11's", d, version);
    if (version == 12) abi_note("dev %d (%s): planeId %d railId %d", d, p.name, p.plane_id, p.rail_id);
  }
  struct link l;
  link_up(&nd, pp.fd, &l);
  size_t sizes[] = {0, 1, 4095, 4096, (1 << 20) + 3, 8 << 20};
  struct xfer_spec x = {.sizes = sizes, .count = 6, .slack = 5, .group = 1, .seed = 50 + (uint32_t)version};
  exchange(&nd, &l, rank, pp.fd, &x, "sizes");
  int group = nd.props.max_recvs < OP_BUFS ? nd.props.max_recvs : OP_BUFS;
  size_t gs[OP_BUFS * 2];
  for (int i = 0; i < 2 * group; i++) gs[i] = i == 1 ? 600000 : (size_t)(i * 1001);
  struct xfer_spec g = {.sizes = gs, .count = 2 * group, .slack = 0, .group = group, .seed = 60 + (uint32_t)version};
  exchange(&nd, &l, rank, pp.fd, &g, "multi-recv");
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

static int sc_v8(void) { return version_scenario(8); }
static int sc_v9(void) { return version_scenario(9); }
static int sc_v10(void) { return version_scenario(10); }
static int sc_v12(void) { return version_scenario(12); }

/* Several communicators in one process, each driven by its own thread at the same time, as NCCL
 * runs one proxy thread per communicator: init, connect both ways, sizes, a multi-recv group,
 * close, finalize, concurrently. */
#define NTHREADS 3

struct thread_arg {
  struct node *nd;
  int rank, fd, index;
  pthread_t tid;
};

static void *comm_thread(void *p) {
  struct thread_arg *a = p;
  struct node *nd = a->nd;
  void *ctx = NULL;
  if (abi_init(&nd->net, 0x7000 + (uint64_t)a->index, a->index, &ctx) != ncclSuccess) abi_fail("thread %d: init failed", a->index);
  for (int round = 0; round < 3; round++) {
    struct link l;
    link_up_with(nd, ctx, a->fd, &l);
    size_t sizes[] = {0, 4096, (1 << 20) + 3 + (size_t)a->index, (6 << 20) + (size_t)round};
    struct xfer_spec x = {.sizes = sizes, .count = 4, .slack = 1, .group = 1, .seed = 400 + (uint32_t)(a->index * 10 + round)};
    char what[64];
    snprintf(what, sizeof(what), "thread %d round %d", a->index, round);
    exchange(nd, &l, a->rank, a->fd, &x, what);
    int group = nd->props.max_recvs < OP_BUFS ? nd->props.max_recvs : OP_BUFS;
    size_t gs[OP_BUFS];
    for (int i = 0; i < group; i++) gs[i] = (size_t)(i * 3000 + a->index);
    struct xfer_spec g = {.sizes = gs, .count = group, .group = group, .seed = 500 + (uint32_t)(a->index * 10 + round)};
    exchange(nd, &l, a->rank, a->fd, &g, what);
    link_down(nd, &l);
  }
  if (abi_finalize(&nd->net, ctx) != ncclSuccess) abi_fail("thread %d: finalize failed", a->index);
  return NULL;
}

static int sc_threads(void) {
  struct pair pp;
  int rank = pair_fork_chans(&pp, NTHREADS);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct thread_arg args[NTHREADS];
  for (int t = 0; t < NTHREADS; t++) {
    args[t] = (struct thread_arg){.nd = &nd, .rank = rank, .fd = pp.chan[t], .index = t};
    if (pthread_create(&args[t].tid, NULL, comm_thread, &args[t]) != 0) abi_fail("pthread_create");
  }
  for (int t = 0; t < NTHREADS; t++) pthread_join(args[t].tid, NULL);
  barrier(pp.fd);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* Connect to a handle whose listener is gone: an error within 10 s, with a WARN naming the peer. */
static int sc_dead_listener(void) {
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char h[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, nd.ctx, nd.dev, h, &lc) != ncclSuccess) abi_fail("listen failed");
  if (abi_close_listen(&nd.net, lc) != ncclSuccess) abi_fail("closeListen failed");
  char addr[128];
  peer_addr_text(h, addr, sizeof(addr));
  size_t mark = abi_log_mark();
  void *sc = NULL, *req = NULL;
  ncclResult_t res = ncclSuccess;
  double t0 = abi_now();
  char buf[16] = {0};
  void *mh = NULL;
  /* connect may fail at once, or hand out a comm whose first send fails: either is fine, a hang is not */
  while (res == ncclSuccess && abi_now() - t0 < 10) {
    double t1 = abi_now();
    if (!sc) res = abi_connect(&nd.net, nd.ctx, nd.dev, h, &sc);
    else if (!mh) res = abi_reg_mr(&nd.net, sc, buf, sizeof(buf), NCCL_PTR_HOST, &mh);
    else if (!req) res = abi_isend(&nd.net, sc, buf, sizeof(buf), 1, mh, &req);
    else {
      int done = 0;
      res = abi_test(&nd.net, req, &done, NULL);
      if (done) abi_fail("a send to a closed listener completed");
    }
    timed(t1, "connect, isend or test");
    sched_yield();
  }
  if (res == ncclSuccess) abi_fail("connecting to a closed listener gave no error in 10 s (%s)", sc ? "connect succeeded" : "connect pending");
  if (!abi_log_warn_has(mark, addr, NULL)) {
    abi_log_dump(mark, "WARN check");
    abi_fail("no WARN names the peer '%s'", addr);
  }
  abi_note("connect to a closed listener: result %d after %.3f s (%s)", res, abi_now() - t0, sc ? "at the first send" : "at connect");
  if (mh) abi_dereg_mr(&nd.net, sc, mh);
  if (sc) abi_close_send(&nd.net, sc);
  node_down(&nd);
  return 0;
}

/* A listener whose accept queue is full never completes the TCP handshakes: connect must give up
 * after MPLANE_CONNECT_TIMEOUT (2 s here) with a WARN, not spin forever (socket only). */
static int sc_connect_timeout(void) {
  setenv("MPLANE_CONNECT_TIMEOUT", "2", 1);
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char h[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, nd.ctx, nd.dev, h, &lc) != ncclSuccess) abi_fail("listen failed");
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!handle_sockaddr(h, &ss, &sl)) {
    abi_note("SKIP: the listen handle is not a TCP address (transport is not socket)");
    return 77;
  }
  /* a plain listener with a backlog of 0 that never accepts, filled by one idle connection */
  int lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_storage la = ss;
  if (la.ss_family == AF_INET) ((struct sockaddr_in *)&la)->sin_port = 0;
  else ((struct sockaddr_in6 *)&la)->sin6_port = 0;
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&la, sl) != 0 || listen(lfd, 0) != 0) abi_fail("plain listener: %s", strerror(errno));
  socklen_t ll = sl;
  getsockname(lfd, (struct sockaddr *)&la, &ll);
  int port;
  int filler[4];
  for (int i = 0; i < 4; i++) {
    filler[i] = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (connect(filler[i], (struct sockaddr *)&la, sl) != 0 && errno != EINPROGRESS) abi_fail("filler connect: %s", strerror(errno));
  }
  usleep(100000);
  /* the same handle, pointing at that listener */
  struct mplane_handle mh;
  char why[256];
  mplane_handle_decode(h, &mh, why, sizeof(why));
  memcpy(mh.payload, &la, sl);
  unsigned char fake[HANDLE_SIZE];
  if (mplane_handle_encode(&mh, fake) != ncclSuccess) abi_fail("encode");
  port = ntohs(la.ss_family == AF_INET ? ((struct sockaddr_in *)&la)->sin_port : ((struct sockaddr_in6 *)&la)->sin6_port);
  char port_text[16];
  snprintf(port_text, sizeof(port_text), ":%d", port);
  size_t mark = abi_log_mark();
  void *sc = NULL;
  ncclResult_t res = ncclSuccess;
  double t0 = abi_now();
  while (res == ncclSuccess && !sc && abi_now() - t0 < 8) {
    double t1 = abi_now();
    res = abi_connect(&nd.net, nd.ctx, nd.dev, fake, &sc);
    timed(t1, "connect");
    usleep(1000);
  }
  double dt = abi_now() - t0;
  if (sc) {
    abi_note("connect completed anyway (the kernel accepted more than the backlog): nothing to check");
  } else {
    if (res == ncclSuccess) abi_fail("connect still pending after %.1f s with MPLANE_CONNECT_TIMEOUT=2", dt);
    if (dt < 1.5) abi_note("connect failed after %.2f s, before the deadline (result %d)", dt, res);
    if (!abi_log_warn_has(mark, port_text, NULL)) {
      abi_log_dump(mark, "WARN check");
      abi_fail("no WARN names the unreachable peer (%s)", port_text);
    }
    abi_note("connect gave up after %.2f s with result %d", dt, res);
  }
  if (sc) abi_close_send(&nd.net, sc);
  for (int i = 0; i < 4; i++) close(filler[i]);
  close(lfd);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

/* A plain TCP listener that accepts every connection and never says a word (not mplane, or an
 * mplane rank that never calls accept): connect completes (our hellos fit in the kernel), but the
 * acceptor's ACK never comes, so isend must fail - with a WARN naming the peer and the variable -
 * about MPLANE_CONNECT_TIMEOUT (2 s here) after connect, never block, never return NULL forever
 * (socket only). */
static int sc_silent_listener(void) {
  setenv("MPLANE_CONNECT_TIMEOUT", "2", 1);
  struct node nd;
  node_up(&nd, g_opts.version);
  unsigned char h[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, nd.ctx, nd.dev, h, &lc) != ncclSuccess) abi_fail("listen failed");
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!handle_sockaddr(h, &ss, &sl)) {
    abi_note("SKIP: the listen handle is not a TCP address (transport is not socket)");
    return 77;
  }
  int lfd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  struct sockaddr_storage la = ss;
  if (la.ss_family == AF_INET) ((struct sockaddr_in *)&la)->sin_port = 0;
  else ((struct sockaddr_in6 *)&la)->sin6_port = 0;
  if (lfd < 0 || bind(lfd, (struct sockaddr *)&la, sl) != 0 || listen(lfd, 64) != 0)
    abi_fail("plain listener: %s", strerror(errno));
  socklen_t ll = sl;
  getsockname(lfd, (struct sockaddr *)&la, &ll);
  /* the same handle, pointing at that listener */
  struct mplane_handle mh;
  char why[256];
  mplane_handle_decode(h, &mh, why, sizeof(why));
  memcpy(mh.payload, &la, sl);
  unsigned char fake[HANDLE_SIZE];
  if (mplane_handle_encode(&mh, fake) != ncclSuccess) abi_fail("encode");
  int port = ntohs(la.ss_family == AF_INET ? ((struct sockaddr_in *)&la)->sin_port : ((struct sockaddr_in6 *)&la)->sin6_port);
  char port_text[16];
  snprintf(port_text, sizeof(port_text), ":%d", port);
  int acc[MPS_MAX_STREAMS + 1], nacc = 0;
  size_t mark = abi_log_mark();
  void *sc = NULL;
  double t0 = abi_now();
  while (!sc) {
    double t1 = abi_now();
    if (abi_connect(&nd.net, nd.ctx, nd.dev, fake, &sc) != ncclSuccess) abi_fail("connect to a listening port failed");
    timed(t1, "connect");
    int fd;
    while (nacc < (int)(sizeof(acc) / sizeof(acc[0])) && (fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) >= 0) acc[nacc++] = fd;
    if (abi_now() - t0 > 10) abi_fail("connect to a silent listener neither completed nor failed in 10 s");
    usleep(1000);
  }
  double connected = abi_now();
  char buf[64] = {0};
  void *bmh = NULL, *req = NULL;
  reg(&nd, sc, buf, sizeof(buf), &bmh);
  ncclResult_t res = ncclSuccess;
  long calls = 0;
  while (res == ncclSuccess) {
    double t1 = abi_now();
    res = abi_isend(&nd.net, sc, buf, sizeof(buf), 1, bmh, &req);
    timed(t1, "isend");
    calls++;
    if (res == ncclSuccess && req) abi_fail("isend to a listener that never offered a receive returned a request");
    int fd;
    while (nacc < (int)(sizeof(acc) / sizeof(acc[0])) && (fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC)) >= 0) acc[nacc++] = fd;
    if (abi_now() - connected > 8)
      abi_fail("isend to a silent listener still returns NULL requests %.1f s after connect (MPLANE_CONNECT_TIMEOUT=2, %ld calls)",
               abi_now() - connected, calls);
    usleep(1000);
  }
  double dt = abi_now() - connected;
  if (dt < 1.9) abi_fail("isend failed %.2f s after connect, before MPLANE_CONNECT_TIMEOUT=2 ran out (result %d)", dt, res);
  if (!abi_log_warn_has(mark, port_text, "no mplane handshake within 2 s (MPLANE_CONNECT_TIMEOUT)", NULL)) {
    abi_log_dump(mark, "WARN check");
    abi_fail("no WARN names the silent peer (%s) and MPLANE_CONNECT_TIMEOUT", port_text);
  }
  /* and it stays failed */
  if (abi_isend(&nd.net, sc, buf, sizeof(buf), 1, bmh, &req) == ncclSuccess) abi_fail("a later isend succeeded");
  abi_note("isend failed %.2f s after connect with result %d (%d sockets accepted by the silent listener)", dt, res, nacc);
  dereg(&nd, sc, bmh);
  double t1 = abi_now();
  abi_close_send(&nd.net, sc);
  timed(t1, "close");
  for (int i = 0; i < nacc; i++) close(acc[i]);
  close(lfd);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

/* Connections that said a valid hello and then went away, or never completed their set of
 * streams, must not pile up until the listener stops accepting; a stream set that does not add up
 * must never become a connection (socket only). */
static int sc_half_open(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  if (rank == 1) return real_peer_send_one(&pp, &nd, 100003, 88, 4, "after the half-open sockets");
  unsigned char handle[HANDLE_SIZE];
  void *lc = NULL;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!listen_tcp(&nd, &pp, handle, &lc, &ss, &sl)) return 77;
  struct mps_hello hello;
  memset(&hello, 0, sizeof(hello));
  hello.magic = MPLANE_HANDLE_MAGIC;
  hello.version = MPLANE_PROTOCOL_VERSION;
  hello.type = MPS_HELLO;
  int port;
  /* 1: stream sets that do not add up: one nonce, sockets that disagree on the stream count
   *    (streams 0,1 of 2 with stream 2 of 3; streams 0,1 of 2 with stream 9 of 16) */
  enum { NODD = 6 };
  int odd[NODD];
  const uint16_t odd_stream[NODD] = {0, 1, 2, 0, 1, 9}, odd_n[NODD] = {2, 2, 3, 2, 2, 16};
  for (int i = 0; i < NODD; i++) {
    odd[i] = tcp_client(&ss, sl, &port);
    hello.nonce = i < 3 ? 0x0dd0dd : 0x0dd0de;
    hello.stream = odd_stream[i];
    hello.nstreams = odd_n[i];
    if (send(odd[i], &hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t)sizeof(hello)) abi_fail("send");
  }
  for (double t0 = abi_now(); abi_now() - t0 < 0.5;) {
    void *rc = NULL;
    if (abi_accept(&nd.net, lc, &rc) != ncclSuccess) abi_fail("accept failed on an incomplete stream set");
    if (rc) abi_fail("sockets that disagree on the number of streams became a connection");
    usleep(2000);
  }
  for (int i = 0; i < NODD; i++) close(odd[i]);
  /* 2: 80 connections that said a complete, valid control hello (4 data streams announced) and
   *    then hung up: an aborted connect, 80 times */
  for (int i = 0; i < 80; i++) {
    int fd = tcp_client(&ss, sl, &port);
    hello.nonce = 0x1000 + (uint64_t)i;
    hello.stream = 0;
    hello.nstreams = 4;
    if (send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t)sizeof(hello)) abi_fail("send");
    if (i % 8 == 7) {
      void *rc = NULL;
      if (abi_accept(&nd.net, lc, &rc) != ncclSuccess || rc) abi_fail("accept of a half-open connection");
    }
    close(fd);
  }
  /* a real peer must still get through, promptly */
  double waited = accept_real_peer(&nd, &pp, handle, lc, 100003, 88, 4, 10,
                                   "after 80 abandoned handshakes: the listener is clogged");
  abi_note("the real peer was accepted %.3f s after 80 abandoned handshakes", waited);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* Strangers on the listen port, on any transport: 64 sockets that connect and say nothing, one
 * that sends an HTTP request, and (IB) one connection record of the right magic whose MTU and SL
 * are out of range. accept() must go on without an error and a real peer must get through at
 * once: silent sockets make room when the table is full, a bad record drops only its socket. */
static int sc_strangers(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  if (rank == 1) return real_peer_send_one(&pp, &nd, 70001, 91, 5, "after the strangers");
  unsigned char handle[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, nd.ctx, nd.dev, handle, &lc) != ncclSuccess) abi_fail("listen failed");
  struct mplane_handle h;
  char why[256];
  struct sockaddr_storage ss;
  socklen_t sl;
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess ||
      mplane_handle_sockaddr(&h, &ss, &sl, why, sizeof(why)) != ncclSuccess)
    abi_fail("our own listen handle: %s", why);
  enum { NSILENT = 64 };
  int silent[NSILENT], port;
  size_t mark = abi_log_mark();
  for (int i = 0; i < NSILENT; i++) silent[i] = tcp_client(&ss, sl, &port);
  int http = tcp_client(&ss, sl, &port);
  char req[300];
  memset(req, ' ', sizeof(req));
  const char *get = "GET / HTTP/1.1\r\nHost: mplane\r\n";
  memcpy(req, get, strlen(get));
  if (send(http, req, sizeof(req), MSG_NOSIGNAL) != (ssize_t)sizeof(req)) abi_fail("send");
  int bad_record = -1;
#ifdef MPLANE_ABI_IB_WIRE
  if (h.transport == MPLANE_HANDLE_IB) {
    struct mpib_conn_info ci;
    memset(&ci, 0, sizeof(ci));
    ci.magic = MPIB_MAGIC;
    ci.version = MPLANE_PROTOCOL_VERSION;
    ci.nqps = 1;
    ci.mtu = 0;  /* no such MTU */
    ci.sl = 200; /* SLs are 0..15 */
    bad_record = tcp_client(&ss, sl, &port);
    if (send(bad_record, &ci, sizeof(ci), MSG_NOSIGNAL) != (ssize_t)sizeof(ci)) abi_fail("send");
  }
#endif
  /* Accept for 1.5 s at least, and on until the bad record's WARN came (at most 30 s): on an emulated
   * CPU under load the listener may take longer than 1.5 s to read 66 strangers. */
  for (double t0 = abi_now();;) {
    void *rc = NULL;
    double t1 = abi_now();
    ncclResult_t res = abi_accept(&nd.net, lc, &rc);
    timed(t1, "accept");
    if (res != ncclSuccess) abi_fail("accept failed (%d) because of strangers on the port: that ends NCCL's job", res);
    if (rc) abi_fail("a stranger became a connection");
    double dt = abi_now() - t0;
    if (dt > 30 || (dt >= 1.5 && (bad_record < 0 || abi_log_warn_has(mark, "invalid connection record", NULL)))) break;
    usleep(2000);
  }
  if (bad_record >= 0 && !abi_log_warn_has(mark, "invalid connection record", NULL)) {
    abi_log_dump(mark, "no WARN");
    abi_fail("a connection record with MTU 0 and SL 200 was not refused with a WARN");
  }
  double waited = accept_real_peer(&nd, &pp, handle, lc, 70001, 91, 5, 5,
                                   "with 64 silent sockets on the port: they keep real peers out");
  abi_note("the real peer was accepted %.3f s after 64 silent sockets, an HTTP request%s", waited,
           bad_record >= 0 ? " and a bad IB record" : "");
  for (int i = 0; i < NSILENT; i++) close(silent[i]);
  close(http);
  if (bad_record >= 0) close(bad_record);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* NCCL aborting a communicator: comms closed with sends and receives still in flight, large ones,
 * on both sides. Every close returns promptly, nothing crashes, and the next connection is clean. */
static int sc_abort(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  enum { N = 6 };
  const size_t size = 16u << 20;
  void *sbuf[N], *rbuf[N];
  for (int i = 0; i < N; i++) {
    sbuf[i] = alloc_buf(size, 0);
    rbuf[i] = alloc_buf(size, 0);
    fill(sbuf[i], size, msg_id(rank, (uint32_t)i));
  }
  for (int round = 0; round < 4; round++) {
    struct link l;
    link_up(&nd, pp.fd, &l);
    void *smh[N], *rmh[N], *sreq[N] = {0}, *rreq[N] = {0};
    for (int i = 0; i < N; i++) {
      reg(&nd, l.sc, sbuf[i], size, &smh[i]);
      reg(&nd, l.rc, rbuf[i], size, &rmh[i]);
    }
    barrier(pp.fd);
    /* post everything; stop at a point that differs per round and per side */
    double t0 = abi_now(), stop_after = 0.005 * (round + 1) * (rank + 1);
    int nsent = 0, nrecv = 0, tag = 1, errors = 0;
    while (!errors && (abi_now() - t0 < stop_after || (nsent == 0 && abi_now() - t0 < 5))) {
      /* the peer may abort first: then an error here is the right answer, and we abort too */
      size_t sz = size;
      if (nrecv < N && abi_irecv(&nd.net, l.rc, 1, &rbuf[nrecv], &sz, &tag, &rmh[nrecv], &rreq[nrecv]) != ncclSuccess) errors++;
      if (nrecv < N && rreq[nrecv]) nrecv++;
      if (nsent < N && abi_isend(&nd.net, l.sc, sbuf[nsent], size, tag, smh[nsent], &sreq[nsent]) != ncclSuccess) errors++;
      if (nsent < N && sreq[nsent]) nsent++;
      int done;
      if (nsent && round % 2 && abi_test(&nd.net, sreq[0], &done, NULL) != ncclSuccess) errors++; /* a little progress */
    }
    /* abort: deregister and close with requests in flight (the peer may already be gone too) */
    double t1 = abi_now();
    for (int i = 0; i < N; i++) {
      abi_dereg_mr(&nd.net, l.sc, smh[i]);
      abi_dereg_mr(&nd.net, l.rc, rmh[i]);
    }
    if (round % 2) {
      abi_close_recv(&nd.net, l.rc);
      abi_close_send(&nd.net, l.sc);
    } else {
      abi_close_send(&nd.net, l.sc);
      abi_close_recv(&nd.net, l.rc);
    }
    abi_close_listen(&nd.net, l.lc);
    timed(t1, "close with requests in flight");
    abi_note("round %d: closed with %d sends and %d receives posted in %.3f s", round, nsent, nrecv, abi_now() - t1);
    barrier(pp.fd);
  }
  /* and the plugin still works */
  struct link l;
  link_up(&nd, pp.fd, &l);
  size_t sizes[] = {1, (1 << 20) + 3};
  struct xfer_spec x = {.sizes = sizes, .count = 2, .group = 1, .seed = 700};
  exchange(&nd, &l, rank, pp.fd, &x, "after the aborts");
  link_down(&nd, &l);
  for (int i = 0; i < N; i++) {
    free(sbuf[i]);
    free(rbuf[i]);
  }
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* A sender that closes its comm (and exits) as soon as its sends report done, before the receiver
 * has even tested: every byte still arrives and the receives complete without an error. */
static int sc_close_early(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  size_t sizes[] = {0, 1, 4096, (1 << 20) + 3, (8 << 20) + 5, 3 << 20, 16 << 20};
  enum { N = sizeof(sizes) / sizeof(sizes[0]) };
  for (int round = 0; round < 12; round++) {
    struct op ops[N];
    void *bufs[N];
    memset(ops, 0, sizeof(ops));
    for (int i = 0; i < N; i++) {
      struct op *o = &ops[i];
      o->n = 1;
      o->tag[0] = i;
      o->send = rank == 0;
      bufs[i] = alloc_buf(sizes[i], 64);
      o->data[0] = bufs[i];
      o->size[0] = sizes[i];
      if (o->send) fill(bufs[i], sizes[i], msg_id(0, (uint32_t)(round * N + i)));
      o->expect[0] = sizes[i];
      o->msg[0] = msg_id(0, (uint32_t)(round * N + i));
      reg(&nd, o->send ? l.sc : l.rc, bufs[i], sizes[i] ? sizes[i] : 1, &o->mh[0]);
    }
    struct run_stats st;
    size_t mark = abi_log_mark();
    if (rank == 1) {
      /* post every receive, then look away while the sender finishes and closes */
      for (int i = 0; i < N; i++) {
        double deadline = abi_now() + 10;
        while (!ops[i].req) {
          if (abi_irecv(&nd.net, l.rc, 1, ops[i].data, ops[i].size, ops[i].tag, ops[i].mh, &ops[i].req) != ncclSuccess) abi_fail("irecv");
          if (abi_now() > deadline) abi_fail("irecv gave no request in 10 s");
        }
        ops[i].posted = 1;
      }
      if (round == 0) {
        char c;
        chan_recv(pp.fd, &c, 1); /* the sender has closed */
        usleep(100000);
      } /* other rounds: test all along, while the sender's close overtakes its last chunks */
      if (run_ops(&nd, NULL, l.rc, ops, N, 0, 30, &st)) fail_run("receives after the sender closed", &st, ops, mark);
      verify_recvs(ops, N, 64);
      for (int i = 0; i < N; i++) dereg(&nd, l.rc, ops[i].mh[0]);
      abi_close_recv(&nd.net, l.rc);
      l.rc = NULL;
    } else {
      if (run_ops(&nd, l.sc, NULL, ops, N, 0, 30, &st)) fail_run("sends", &st, ops, mark);
      for (int i = 0; i < N; i++) dereg(&nd, l.sc, ops[i].mh[0]);
      abi_close_send(&nd.net, l.sc); /* at once: the receiver has not tested anything yet */
      l.sc = NULL;
      char c = 'c';
      if (round == 0) chan_send(pp.fd, &c, 1);
    }
    for (int i = 0; i < N; i++) free(bufs[i]);
    barrier(pp.fd);
    /* next round on a fresh pair of comms */
    link_down(&nd, &l);
    if (round < 11) link_up(&nd, pp.fd, &l);
  }
  abi_note("12 rounds: the sender closed right after its sends completed; every receive completed intact");
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* Small messages the receiver does not read for a while: on sockets they ride the control socket,
 * written by the proxy thread without blocking, so its buffers fill and a message goes out in
 * pieces over several isend/test calls while the messages behind it take the data streams. Every
 * message still arrives intact, in its own buffer, and no call blocks. Rank 0 sends, rank 1 posts
 * every receive group (maxRecvs buffers, one tag each) and tests: late and all of them in the first
 * round; at once and only the oldest, as NCCL does, in the second; late and only the oldest in the
 * third. Sizes alternate around the inline limit (64 KiB) and below it, 16 MiB in flight in all. */
static int ctrl_rounds(const size_t *pick, int npick, int max_group, const char *what) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct link l;
  link_up(&nd, pp.fd, &l);
  int group = nd.props.max_recvs < OP_BUFS ? nd.props.max_recvs : OP_BUFS;
  if (group > max_group) group = max_group;
  int ngroups = MAX_INFLIGHT, nmsg = ngroups * group, nops = rank == 0 ? nmsg : ngroups;
  struct op *ops = calloc((size_t)nops, sizeof(*ops));
  void **bufs = calloc((size_t)nmsg, sizeof(void *));
  for (int round = 0; round < 3; round++) {
    memset(ops, 0, sizeof(*ops) * (size_t)nops);
    for (int m = 0; m < nmsg; m++) {
      size_t sz = pick[(m + round) % npick];
      struct op *o = rank == 0 ? &ops[m] : &ops[m / group];
      int b = rank == 0 ? 0 : m % group;
      o->n = b + 1;
      o->send = rank == 0;
      o->tag[b] = m % group;
      bufs[m] = alloc_buf(sz, 64);
      o->data[b] = bufs[m];
      o->size[b] = sz;
      o->expect[b] = sz;
      o->msg[b] = msg_id(0, (uint32_t)(round * nmsg + m));
      if (o->send) fill(bufs[m], sz, o->msg[b]);
      reg(&nd, o->send ? l.sc : l.rc, bufs[m], sz ? sz : 1, &o->mh[b]);
    }
    struct run_stats st;
    size_t mark = abi_log_mark();
    if (rank == 1) {
      for (int i = 0; i < nops; i++) {
        double deadline = abi_now() + 10;
        while (!ops[i].req) {
          if (abi_irecv(&nd.net, l.rc, ops[i].n, ops[i].data, ops[i].size, ops[i].tag, ops[i].mh, &ops[i].req) != ncclSuccess)
            abi_fail("irecv");
          if (abi_now() > deadline) abi_fail("irecv gave no request in 10 s");
        }
        ops[i].posted = 1;
      }
      /* rounds 0 and 2: the sender posts everything meanwhile, nobody reads the control socket;
       * round 1: the receiver reads as the bytes come, so it catches up inside messages */
      if (round != 1) usleep(300000);
      if (round == 0) {
        if (run_ops(&nd, NULL, l.rc, ops, nops, 0, 30, &st)) fail_run("receives", &st, ops, mark);
      } else {
        /* as NCCL's proxy does: test only the oldest receive, so no other request's test reads the
         * control socket on its behalf while its message lands in pieces */
        for (int i = 0; i < nops; i++) {
          double deadline = abi_now() + 10;
          for (int done = 0; !done;) {
            for (int k = 0; k < OP_BUFS; k++) ops[i].got[k] = -1;
            double t0 = abi_now();
            if (abi_test(&nd.net, ops[i].req, &done, ops[i].got) != ncclSuccess) abi_fail("test of receive %d failed", i);
            timed(t0, "test");
            if (abi_now() > deadline) abi_fail("receive %d (the oldest, tested alone) did not complete in 10 s", i);
            if (!done) sched_yield();
          }
          ops[i].done = 1;
        }
      }
      verify_recvs(ops, nops, 64);
    } else {
      if (run_ops(&nd, l.sc, NULL, ops, nops, RUN_POST_ALL_FIRST, 30, &st)) fail_run("sends", &st, ops, mark);
    }
    for (int i = 0; i < nops; i++)
      for (int b = 0; b < ops[i].n; b++) dereg(&nd, rank == 0 ? l.sc : l.rc, ops[i].mh[b]);
    for (int m = 0; m < nmsg; m++) free(bufs[m]);
    barrier(pp.fd);
  }
  abi_note("3 rounds of %d messages %s in groups of %d, the receiver late or not to read: all intact", nmsg, what, group);
  free(ops);
  free(bufs);
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

static int sc_ctrl_full(void) {
  setenv("MPLANE_SOCKET_INLINE_BYTES", "64K", 1);
  setenv("MPLANE_SOCKET_INLINE_BUSY", "0", 1); /* inline with every send in flight, so the socket fills */
  static const size_t pick[] = {65536, 1, 65536, 40000, 65536 + 1, 65536, 0, 65536, 65535};
  return ctrl_rounds(pick, sizeof(pick) / sizeof(pick[0]), OP_BUFS, "around the inline limit");
}

/* The same with MPLANE_SOCKET_INLINE_BYTES=1M: every message rides the control socket and most are
 * bigger than its buffers, so each is written and landed in many pieces. (Both scenarios lift
 * MPLANE_SOCKET_INLINE_BUSY, which by default sends mid-sized messages through helper threads
 * while others are in flight.) */
static int sc_ctrl_big(void) {
  setenv("MPLANE_SOCKET_INLINE_BYTES", "1M", 1);
  setenv("MPLANE_SOCKET_INLINE_BUSY", "0", 1);
  static const size_t pick[] = {1 << 20, 300000, 1, (1 << 20) - 1, 0, 700001};
  return ctrl_rounds(pick, sizeof(pick) / sizeof(pick[0]), 1, "of up to 1 MiB, all inline");
}

/* A receiver whose helper threads fell behind (its socket buffers full, the sender blocked on a
 * zero window) closes its comm: the sender's close, test or isend must then end promptly, not after
 * the kernel's FIN timeout. The receiver's non-main threads are held in a signal handler to make
 * "fell behind" deterministic. Rank 0 sends, rank 1 receives.
 * On RDMA the NIC places the data, not a receiver thread, so a send may also complete before the
 * close: what holds on every transport is that each send ends (done or an error) within a bound and
 * that nothing lands in the receive buffers after the close. Where a receiver thread gates the
 * data (sockets) the sends cannot have completed and must fail. */
static int g_hold; /* atomic: read by every held thread, cleared by release_later */
static void hold_handler(int sig) {
  (void)sig;
  struct timespec ts = {0, 1000000};
  while (__atomic_load_n(&g_hold, __ATOMIC_ACQUIRE)) nanosleep(&ts, NULL);
}

static int hold_other_threads(void) {
  struct sigaction sa;
  memset(&sa, 0, sizeof(sa));
  sa.sa_handler = hold_handler;
  sa.sa_flags = SA_RESTART;
  sigaction(SIGUSR1, &sa, NULL);
  __atomic_store_n(&g_hold, 1, __ATOMIC_RELEASE);
  pid_t me = (pid_t)syscall(SYS_gettid);
  int n = 0;
  DIR *d = opendir("/proc/self/task");
  for (struct dirent *e; d && (e = readdir(d));) {
    pid_t tid = (pid_t)atoi(e->d_name);
    if (tid <= 0 || tid == me) continue;
    if (syscall(SYS_tgkill, getpid(), tid, SIGUSR1) == 0) n++;
  }
  if (d) closedir(d);
  return n;
}

static void *release_later(void *arg) {
  (void)arg;
  usleep(300000);
  __atomic_store_n(&g_hold, 0, __ATOMIC_RELEASE);
  return NULL;
}

static void *close_watchdog(void *arg) {
  double limit = *(double *)arg;
  usleep((useconds_t)(limit * 1e6));
  abi_fail("a close/test after the peer closed is still blocked after %.0f s (a sender stuck on a zero window "
           "until the kernel gives up?)", limit);
}

static uint64_t buf_hash(const void *buf, size_t n) {
  const uint64_t *w = buf;
  uint64_t h = 0xcbf29ce484222325ull;
  for (size_t i = 0; i < n / 8; i++) h = (h ^ w[i]) * 0x100000001b3ull;
  return h;
}

/* Rank 0's side of round 0: test every send until it is done or fails. Returns how many failed. */
static int stalled_sends_end(struct node *nd, void **req, int n, double limit) {
  int failed = 0;
  double t0 = abi_now();
  for (int i = 0; i < n; i++) {
    ncclResult_t res = ncclSuccess;
    for (int done = 0; res == ncclSuccess && !done;) {
      res = abi_test(&nd->net, req[i], &done, NULL);
      if (abi_now() - t0 > limit)
        abi_fail("send %d of %d neither completed nor failed %.0f s after the receiver closed", i, n, limit);
    }
    failed += res != ncclSuccess;
    if (res != ncclSuccess) break; /* the comm has failed: NCCL tests no further */
  }
  return failed;
}

static int sc_stalled_close(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  enum { N = 4 };
  const size_t size = 48u << 20;
  /* round 0: the receiver closes, the sender tests; round 1: the receiver closes, the sender closes;
   * round 2: the receiver stays, stalled (alive, reading nothing), and the sender closes */
  for (int round = 0; round < 3; round++) {
    struct link l;
    link_up(&nd, pp.fd, &l);
    void *buf[N], *mh[N], *req[N] = {0};
    void *comm = rank == 0 ? l.sc : l.rc;
    for (int i = 0; i < N; i++) {
      buf[i] = alloc_buf(size, 0);
      reg(&nd, comm, buf[i], size, &mh[i]);
    }
    char c;
    if (rank == 1) {
      int tag = 1;
      for (int i = 0; i < N; i++) {
        size_t sz = size;
        double deadline = abi_now() + 10;
        while (!req[i]) {
          if (abi_irecv(&nd.net, l.rc, 1, &buf[i], &sz, &tag, &mh[i], &req[i]) != ncclSuccess) abi_fail("irecv");
          if (abi_now() > deadline) abi_fail("irecv gave no request in 10 s");
        }
      }
      c = 'r';
      chan_send(pp.fd, &c, 1);
      chan_recv(pp.fd, &c, 1); /* the sender has its requests: the data is on its way */
      int held = hold_other_threads();
      c = 'h';
      chan_send(pp.fd, &c, 1);
      chan_recv(pp.fd, &c, 1); /* the sender is blocked now */
      if (round == 2) {
        c = 'w';
        chan_send(pp.fd, &c, 1);
        chan_recv(pp.fd, &c, 1); /* the sender has closed while this side read nothing */
        __atomic_store_n(&g_hold, 0, __ATOMIC_RELEASE);
        for (int i = 0; i < N; i++) abi_dereg_mr(&nd.net, l.rc, mh[i]);
        abi_close_recv(&nd.net, l.rc);
        l.rc = NULL;
        barrier(pp.fd);
        link_down(&nd, &l);
        for (int i = 0; i < N; i++) free(buf[i]);
        continue;
      }
      pthread_t rel;
      pthread_create(&rel, NULL, release_later, NULL);
      for (int i = 0; i < N; i++) abi_dereg_mr(&nd.net, l.rc, mh[i]);
      double t0 = abi_now();
      abi_close_recv(&nd.net, l.rc); /* its threads are released while it waits for them */
      timed(t0 + 0.3, "closeRecv");
      pthread_join(rel, NULL);
      l.rc = NULL;
      abi_note("round %d: closed the receive comm with %d threads held and its buffers full", round, held);
      uint64_t after_close[N];
      for (int i = 0; i < N; i++) after_close[i] = buf_hash(buf[i], size);
      c = 'c';
      chan_send(pp.fd, &c, 1);
      chan_recv(pp.fd, &c, 1); /* the sender's requests have ended and its comm is closed */
      for (int i = 0; i < N; i++)
        if (buf_hash(buf[i], size) != after_close[i])
          abi_fail("round %d: receive buffer %d changed after closeRecv returned", round, i);
    } else {
      chan_recv(pp.fd, &c, 1); /* the receives are posted */
      for (int i = 0; i < N; i++) {
        fill(buf[i], 64, (uint32_t)i);
        double deadline = abi_now() + 10;
        while (!req[i]) {
          if (abi_isend(&nd.net, l.sc, buf[i], size, 1, mh[i], &req[i]) != ncclSuccess) abi_fail("isend");
          if (abi_now() > deadline) abi_fail("isend gave no request in 10 s");
        }
      }
      c = 'p';
      chan_send(pp.fd, &c, 1);
      chan_recv(pp.fd, &c, 1); /* the receiver's threads are held */
      usleep(300000); /* the send side fills the socket buffers and blocks */
      c = 's';
      chan_send(pp.fd, &c, 1);
      chan_recv(pp.fd, &c, 1); /* the receiver has closed (rounds 0, 1) or stays stalled (round 2) */
      double limit = 10;
      pthread_t wd;
      pthread_create(&wd, NULL, close_watchdog, &limit);
      double t0 = abi_now();
      int failed = -1;
      if (round == 0) {
        /* NCCL tests its requests: each ends, none spins */
        failed = stalled_sends_end(&nd, req, N, limit);
        if (handle_is_socket(l.peer_handle) && failed == 0)
          abi_fail("every send into a receive comm closed with its threads held completed: the bytes had "
                   "nowhere to go");
      }
      for (int i = 0; i < N; i++) abi_dereg_mr(&nd.net, l.sc, mh[i]);
      abi_close_send(&nd.net, l.sc);
      l.sc = NULL;
      pthread_cancel(wd);
      pthread_join(wd, NULL);
      c = 'e';
      chan_send(pp.fd, &c, 1);
      if (round == 0)
        abi_note("round 0: every send ended (%s) and closeSend returned %.3f s after the receiver closed",
                 failed ? "a test failed" : "all completed: the data was placed before the close", abi_now() - t0);
      else
        abi_note("round %d: closeSend returned %.3f s after the receiver %s", round, abi_now() - t0,
                 round == 1 ? "closed" : "stopped reading (alive)");
    }
    barrier(pp.fd);
    link_down(&nd, &l);
    for (int i = 0; i < N; i++) free(buf[i]);
  }
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* ------------------------------------------------------------------ main */

static const struct {
  const char *name;
  int (*fn)(void);
  const char *what;
} scenarios[] = {
    {"props", sc_props, "init per communicator, devices, getProperties sanity, bad device numbers"},
    {"sizes", sc_sizes, "0, 1, 4095, 4096, 1 MiB+3, 64 MiB each way; exact and bigger buffers; late receiver; iflush"},
    {"inflight", sc_inflight, "32 requests in flight each way, all posted before any test"},
    {"inflight-max", sc_inflight_max, "32 x maxRecvs sends in flight against 32 multi-buffer receives"},
    {"multirecv", sc_multirecv, "tagged multi-recv, distinct tags, sends in shuffled tag order"},
    {"shared-order", sc_shared_order, "shared comm: groups {1,2},{1,2}, tag 1 sent twice before tag 2: a wait, never an error"},
    {"shared-wait", sc_shared_wait, "shared comm: a tag no posted group offers waits (NULL, never an error), one WARN names it"},
    {"eager-early", sc_eager_early, "small sends of two tags complete before any receive is posted; late groups hold them in turn (socket only)"},
    {"eager-bound", sc_eager_bound, "32 small sends (or 512 KiB) complete with nothing posted, the next and a bigger one wait for their receives (socket only)"},
    {"eager-short", sc_eager_short, "a small send completed before a shorter receive: ncclInvalidUsage, nothing written, the sender fails soon (socket only)"},
    {"eager-then-big", sc_eager_then_big, "after an eager message, a 1 MiB send gets its CTS while the receiver calls nothing (socket only)"},
    {"eager-then-close", sc_eager_then_close, "eager messages are received intact after their sender closed its comm (socket only)"},
    {"filler", sc_filler, "small messages padded to MPLANE_SOCKET_PAD_BYTES on the control socket land intact; 0 pads nothing (socket only)"},
    {"shared-comms", sc_shared_comms, "shared comm as NCCL drives it: k=2,4,8 tags, each its own sender and pace, 1000 steps"},
    {"reload", sc_reload, "3 x (dlopen, init, data both ways, finalize, dlclose), as NCCL 2.28 reloads its net plugin"},
    {"reconnect", sc_reconnect, "50 x (init, connect/accept both ways, data, close, finalize); no fd/thread leak"},
    {"kill-receiver", sc_kill_receiver, "receiver SIGKILLed mid-transfer: sender errors within 10 s, WARN names peer"},
    {"kill-sender", sc_kill_sender, "sender SIGKILLed mid-transfer: receiver errors within 10 s, WARN names peer"},
    {"short-recv", sc_short_recv, "message bigger than the receive buffer: ncclInvalidUsage, guard untouched"},
    {"bad-handle", sc_bad_handle, "non-mplane / other-version / garbage handles: connect fails, no hang"},
    {"fake-peer", sc_fake_peer, "plain TCP clients sending garbage to the listen address (socket only)"},
    {"fake-chunks", sc_fake_chunks, "a fake sender's overlapping, overlong and inconsistent chunks, and eager messages past what the receiver offered, fail the receive (socket only)"},
    {"fake-version", sc_fake_version, "a peer of another protocol version: WARN and NACK (socket only)"},
    {"bad-config", sc_bad_config, "invalid MPLANE_* values make init fail with a WARN naming them"},
    {"ctrl-full", sc_ctrl_full, "small messages the receiver reads late: partial control-socket writes, all intact"},
    {"ctrl-big", sc_ctrl_big, "inline limit 1M: messages written and landed in pieces, the oldest tested alone"},
    {"close-early", sc_close_early, "sender closes right after its sends complete: the receiver still gets every byte"},
    {"stalled-close", sc_stalled_close, "receiver closes with full socket buffers: the blocked sender fails fast"},
    {"strangers", sc_strangers, "64 silent sockets, an HTTP request, a bad IB record on the port: accept goes on, a real peer gets in"},
    {"abort", sc_abort, "comms closed with large sends/receives in flight on both sides: prompt, no crash"},
    {"threads", sc_threads, "3 communicators per process, each on its own thread, concurrently"},
    {"dead-listener", sc_dead_listener, "connect to a closed listener: error within 10 s, WARN names peer"},
    {"connect-timeout", sc_connect_timeout, "TCP handshakes that never complete: MPLANE_CONNECT_TIMEOUT ends connect (socket only)"},
    {"silent-listener", sc_silent_listener, "a TCP listener that accepts and never answers: isend fails after MPLANE_CONNECT_TIMEOUT (socket only)"},
    {"half-open", sc_half_open, "abandoned and inconsistent handshakes do not clog the listener (socket only)"},
    {"v12", sc_v12, "ncclNet_v12 round trip, planeId/railId"},
    {"v10", sc_v10, "ncclNet_v10 round trip"},
    {"v9", sc_v9, "ncclNet_v9 round trip"},
    {"v8", sc_v8, "ncclNet_v8 round trip (int sizes)"},
};
#define NSCENARIOS (sizeof(scenarios) / sizeof(scenarios[0]))

static int run_one(size_t i) {
  fflush(NULL);
  pid_t pid = fork();
  if (pid < 0) abi_fail("fork: %s", strerror(errno));
  if (pid == 0) {
    abi_scenario = scenarios[i].name;
    abi_rank = 0;
    arm_alarm();
    apply_rank_env(0);
    double t0 = abi_now();
    int rc = scenarios[i].fn();
    if (rc == 0) leak_check();
    if (rc == 0) fprintf(stderr, "abi[%s]: PASS in %.2f s\n", abi_scenario, abi_now() - t0);
    fflush(NULL);
    _exit(rc);
  }
  int st = 0;
  while (waitpid(pid, &st, 0) < 0 && errno == EINTR) {}
  if (WIFEXITED(st)) return WEXITSTATUS(st);
  fprintf(stderr, "abi[%s]: FAIL: died of signal %d (%s)\n", scenarios[i].name, WTERMSIG(st), strsignal(WTERMSIG(st)));
  return 1;
}

static void usage(FILE *f) {
  fprintf(f, "usage: abi-harness [--plugin PATH] [--version 8|9|10|11|12] [--dev D] [--list] SCENARIO... | all\n");
}

int main(int argc, char **argv) {
  g_opts.plugin = getenv("MPLANE_ABI_PLUGIN") && *getenv("MPLANE_ABI_PLUGIN") ? getenv("MPLANE_ABI_PLUGIN") : "libnccl-net-mplane.so";
  g_opts.version = 11;
  g_opts.dev = getenv("MPLANE_ABI_DEV") ? atoi(getenv("MPLANE_ABI_DEV")) : 0;
  const char *names[64];
  int nnames = 0;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--plugin") && i + 1 < argc) g_opts.plugin = argv[++i];
    else if (!strcmp(argv[i], "--version") && i + 1 < argc) g_opts.version = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--dev") && i + 1 < argc) g_opts.dev = atoi(argv[++i]);
    else if (!strcmp(argv[i], "--list")) {
      for (size_t s = 0; s < NSCENARIOS; s++) printf("%-14s %s\n", scenarios[s].name, scenarios[s].what);
      return 0;
    } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
      usage(stdout);
      return 0;
    } else if (argv[i][0] == '-') {
      usage(stderr);
      return 2;
    } else if (nnames < 64) {
      names[nnames++] = argv[i];
    }
  }
  if (nnames == 0 || g_opts.version < 8 || g_opts.version > 12 || g_opts.dev < 0) {
    usage(stderr);
    return 2;
  }
  setenv("MPLANE_SOCKET_IFNAME", "lo", 0);
  int failed = 0, skipped = 0, ran = 0;
  for (int n = 0; n < nnames; n++) {
    int all = !strcmp(names[n], "all"), found = 0;
    for (size_t s = 0; s < NSCENARIOS; s++) {
      if (!all && strcmp(names[n], scenarios[s].name)) continue;
      found = 1;
      ran++;
      int rc = run_one(s);
      if (rc == 77) skipped++;
      else if (rc != 0) failed++;
    }
    if (!found) {
      fprintf(stderr, "abi-harness: no scenario '%s' (--list shows them)\n", names[n]);
      return 2;
    }
  }
  if (failed) return 1;
  if (skipped == ran) return 77;
  return 0;
}
