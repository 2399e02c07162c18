/* mplane ABI harness: dlopens the built plugin and drives its ncclNet tables the way NCCL's proxy
 * thread does, between two processes over the network (loopback by default), checking every byte.
 *
 * This file is the core: the command line and the scenario table, two processes with one plugin
 * each, links as the proxy makes them, the data pattern, the request engine, the generic exchange and
 * plain TCP peers. The scenarios live in one file per family; abi_harness.h lists them.
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
#include <sys/wait.h>
#include <unistd.h>

#include "abi.h"
#include "abi_harness.h"
#include "net/handle.h"
#include "net/socket/socket.h" /* the hello of plain TCP peers */

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
int pair_fork_chans(struct pair *pp, int nchan) {
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


void check_props(const struct abi_props *p, int dev, int version) {
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

void node_open(struct node *nd, int version) {
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


static double call_limit;
static void call_limit_init(void) {
  const char *e = getenv("MPLANE_ABI_CALL_LIMIT");
  call_limit = e && atof(e) > 0 ? atof(e) : CALL_LIMIT_S;
}

void timed(double t0, const char *what) {
  /* closes may drain what is in flight: they get more time, but still a bound. Once: the `threads`
   * scenario times calls from several threads (a lazy static was a data race under TSan) */
  static pthread_once_t once = PTHREAD_ONCE_INIT;
  pthread_once(&once, call_limit_init);
  double limit = strncmp(what, "close", 5) == 0 ? (call_limit > CLOSE_LIMIT_S ? call_limit : CLOSE_LIMIT_S) : call_limit;
  double dt = abi_now() - t0;
  if (dt > limit) abi_fail("%s took %.2f s (limit %.0f s): it blocks the proxy thread", what, dt, limit);
}

/* Both directions at once, in one thread, calling connect and accept in turn until both are done,
 * as NCCL's proxy progresses its connections. */
void link_up_with(struct node *nd, void *ctx, int fd, struct link *l) {
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

int pair_up(struct pair *pp, struct node *nd, struct link *l) {
  int rank = pair_fork(pp);
  node_up(nd, g_opts.version);
  link_up(nd, pp->fd, l);
  return rank;
}

int pair_down(struct pair *pp, int rank, struct node *nd, struct link *l) {
  link_down(nd, l);
  node_down(nd);
  return pair_finish(pp, rank);
}

/* ------------------------------------------------------------------ the request engine */

/* Post ops in order (sends in order on the send comm, receives in order on the receive comm), at
 * most NCCL_NET_MAX_REQUESTS receive requests and NCCL_NET_MAX_REQUESTS x maxRecvs send requests in
 * flight, testing what is posted. With RUN_POST_ALL_FIRST nothing is tested until every op is
 * posted (so all of them are in flight at once). Returns 0 when all are done; on the first error
 * returns 1 with st->err set (the caller decides whether that was expected). */
int run_ops(struct node *nd, void *sc, void *rc, struct op *ops, int nops, int flags, double timeout_s,
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
void verify_recvs(struct op *ops, int nops, size_t guard) {
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

void fail_run(const char *what, struct run_stats *st, struct op *ops, size_t mark) {
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

void *post_recv(struct node *nd, void *rc, int n, void **data, size_t *sizes, int *tags, void **mh) {
  void *req = NULL;
  for (double deadline = abi_now() + 10; !req;) {
    double t0 = abi_now();
    if (abi_irecv(&nd->net, rc, n, data, sizes, tags, mh, &req) != ncclSuccess) abi_fail("irecv of %d buffers failed", n);
    timed(t0, "irecv");
    if (!req && abi_now() > deadline) abi_fail("irecv of %d buffers gave no request in 10 s", n);
  }
  return req;
}

int recv_group(const struct node *nd) { return nd->props.max_recvs < OP_BUFS ? nd->props.max_recvs : OP_BUFS; }

/* ------------------------------------------------------------------ a generic exchange */

/* One message each way per entry of sizes[] (a receive of n=1 per message, buffer = size + slack),
 * sent in order; or, with group > 1, receives of `group` buffers with distinct tags whose sends are
 * issued in a shuffled tag order within each group. Both ranks run the same call. */
void exchange(struct node *nd, struct link *l, int rank, int fd, const struct xfer_spec *x, const char *what) {
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

void peer_addr_text(const unsigned char *handle, char *out, size_t len) {
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

/* ------------------------------------------------------------------ plain TCP peers at our listen address */

int handle_sockaddr(const unsigned char *handle, struct sockaddr_storage *ss, socklen_t *len) {
  struct mplane_handle h;
  char why[256];
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess) abi_fail("our own listen handle does not decode: %s", why);
  if (h.transport != MPLANE_HANDLE_SOCKET) return 0;
  memset(ss, 0, sizeof(*ss));
  memcpy(ss, h.payload, h.payload_len < sizeof(*ss) ? h.payload_len : sizeof(*ss));
  *len = h.payload_len;
  return 1;
}

/* 1 if the handle is a socket transport one (a receiver thread gates its data) */
int handle_is_socket(const unsigned char *handle) {
  struct sockaddr_storage ss;
  socklen_t len;
  return handle_sockaddr(handle, &ss, &len);
}

int sockaddr_port(const struct sockaddr_storage *ss) {
  return ntohs(ss->ss_family == AF_INET ? ((const struct sockaddr_in *)ss)->sin_port
                                        : ((const struct sockaddr_in6 *)ss)->sin6_port);
}

int tcp_client(const struct sockaddr_storage *ss, socklen_t len, int *port) {
  int fd = socket(ss->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0 || connect(fd, (const struct sockaddr *)ss, len) != 0) abi_fail("fake peer: connect: %s", strerror(errno));
  struct sockaddr_storage me;
  socklen_t ml = sizeof(me);
  getsockname(fd, (struct sockaddr *)&me, &ml);
  *port = sockaddr_port(&me);
  return fd;
}

void hello_init(struct mps_hello *hello) {
  memset(hello, 0, sizeof(*hello));
  hello->magic = MPLANE_HANDLE_MAGIC;
  hello->version = MPLANE_PROTOCOL_VERSION;
  hello->type = MPS_HELLO;
}

/* The real peer of the socket-only "fakes" scenarios (child side): waits for the listener's handle
 * (all zeros: the scenario skipped), connects like any rank and sends one message. */
int real_peer_send_one(struct pair *pp, struct node *nd, size_t size, int msg, int tag, const char *what) {
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
int listen_tcp(struct node *nd, struct pair *pp, unsigned char *handle, void **lc, struct sockaddr_storage *ss,
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
double accept_real_peer(struct node *nd, struct pair *pp, const unsigned char *handle, void *lc, size_t size,
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
    {"profiler", sc_profiler, "a profiler callback and pHandles (v10+): a Start with each buffer's pHandle, a Stop for each"},
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
    {"byte-strangers", sc_byte_strangers, "64 sockets that send one byte each fill the pending table: a real peer gets in within 3 s"},
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

