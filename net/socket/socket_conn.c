/* mplane: socket connection establishment. connect and accept never block: each call advances a
 * small state machine and returns a NULL comm until the connection is whole. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <dirent.h>
#include <sys/epoll.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <unistd.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../transport_base.h"
#include "../tc.h"
#include "socket.h"

#define MPS_PENDING_MAX 64          /* half-open incoming sockets per listen comm */
#define MPS_HELLO_TIMEOUT_S 30      /* an incoming socket must say hello within this */
#define MPS_SILENT_TIMEOUT_S 10     /* ... and its first byte within this (a connector writes it at once) */
#define MPS_EVICT_AFTER_S 1.0       /* with the table full, a socket without its whole hello this long makes room */
#define MPS_STAGE_OFFSET 120        /* where connect keeps its state inside NCCL's handle buffer */

static int set_nonblocking(int fd, int on) {
  int fl = fcntl(fd, F_GETFL);
  if (fl < 0) return -1;
  return fcntl(fd, F_SETFL, on ? (fl | O_NONBLOCK) : (fl & ~O_NONBLOCK));
}

/* Options every mplane TCP socket carries: no Nagle, and keepalives so a peer host that vanishes
 * without a FIN is noticed in about a minute instead of never. */
static void tune_socket(int fd) {
  int one = 1, idle = 30, intvl = 5, cnt = 6;
  unsigned user_timeout_ms = 60000;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &one, sizeof(one));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &idle, sizeof(idle));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &intvl, sizeof(intvl));
  setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &cnt, sizeof(cnt));
  setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof(user_timeout_ms));
}

/* Leave from this device's own address, so the bytes stay on its plane, but take no port yet:
 * IP_BIND_ADDRESS_NO_PORT lets connect() pick the port by the whole 4-tuple, so thousands of
 * outgoing sockets do not each hold an ephemeral port of their own (set-up time grew with N as
 * they filled, and sockets in TIME_WAIT from an earlier job made bind fail with EADDRINUSE). */
int mps_bind_source(int fd, const struct mps_dev *d) {
  int one = 1;
  struct mps_dev src = *d;
  if (src.addr.sa.sa_family == AF_INET) src.addr.sin.sin_port = 0;
  else src.addr.sin6.sin6_port = 0;
  setsockopt(fd, IPPROTO_IP, IP_BIND_ADDRESS_NO_PORT, &one, sizeof(one)); /* Linux >= 4.2; else bind takes a port */
  return bind(fd, &src.addr.sa, d->addrlen);
}

/* Out of file descriptors (EMFILE, ENFILE): one WARN that says what could not be opened, how many
 * the process holds, its limit, and what lowers the need. */
void mps_warn_fds(const char *what, const char *peer) {
  struct rlimit rl = {0};
  getrlimit(RLIMIT_NOFILE, &rl);
  int open_fds = 1; /* the directory's own, taken off below; none left to read it: all of them */
  DIR *d = opendir("/proc/self/fd");
  for (struct dirent *e; d && (e = readdir(d));) open_fds += e->d_name[0] != '.';
  if (d) closedir(d);
  else open_fds = (int)rl.rlim_cur + 1;
  MP_WARN("socket: out of file descriptors: cannot open %s%s%s (%s; %d open, limit %ld): raise the limit (ulimit "
          "-n), or lower what each peer holds: MPLANE_SOCKET_STREAMS (data streams per connection), "
          "MPLANE_SOCKET_INLINE_BYTES higher (messages up to it need no stream)", what, peer ? " to/from peer " : "",
          peer ? peer : "", strerror(errno), open_fds - 1, (long)rl.rlim_cur);
}

/* Out of local ports (EADDRNOTAVAIL at connect): the same, with the port range. */
void mps_warn_ports(const char *what, const char *peer) {
  char range[64] = "?";
  FILE *f = fopen("/proc/sys/net/ipv4/ip_local_port_range", "r");
  if (f) {
    unsigned lo = 0, hi = 0;
    if (fscanf(f, "%u %u", &lo, &hi) == 2) snprintf(range, sizeof(range), "%u-%u, %u ports", lo, hi, hi - lo + 1);
    fclose(f);
  }
  MP_WARN("socket: out of local ports: cannot open %s to peer %s (net.ipv4.ip_local_port_range %s, each shared "
          "by every peer address): widen the range, or lower MPLANE_SOCKET_STREAMS", what, peer, range);
}

/* ------------------------------------------------------------------ listen */

struct mps_pending {
  int fd;
  double since;
  struct mps_hello hello;
  size_t have;
  char peer[80];
};

struct mps_listen_comm {
  int fd;
  int dev;
  int npending;
  struct mps_pending pending[MPS_PENDING_MAX];
};

ncclResult_t mps_listen(int dev, void *handle, void **listen_comm) {
  const struct mps_dev *d = mps_dev_get(dev);
  if (!d) return ncclInvalidArgument;
  int fd = socket(d->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    MP_WARN("socket: listen on %s: socket() failed: %m", d->ifname);
    return ncclSystemError;
  }
  struct mps_dev bind_addr = *d;
  if (bind_addr.addr.sa.sa_family == AF_INET) bind_addr.addr.sin.sin_port = 0;
  else bind_addr.addr.sin6.sin6_port = 0;
  char where[80];
  mps_addr_str(&d->addr.sa, where, sizeof(where));
  if (bind(fd, &bind_addr.addr.sa, d->addrlen) != 0 || listen(fd, 1024) != 0) {
    MP_WARN("socket: listen on %s (%s) failed: %m", d->ifname, where);
    close(fd);
    return ncclSystemError;
  }
  socklen_t len = d->addrlen;
  getsockname(fd, &bind_addr.addr.sa, &len);
  set_nonblocking(fd, 1);

  struct mplane_handle h = {.version = MPLANE_PROTOCOL_VERSION, .transport = MPLANE_HANDLE_SOCKET,
                            .plane = (int8_t)d->props.plane, .node_id = mplane_node_id()};
  h.payload_len = (uint8_t)len;
  memcpy(h.payload, &bind_addr.addr, len);
  ncclResult_t res = mplane_handle_encode(&h, handle);
  if (res != ncclSuccess) {
    close(fd);
    return res;
  }
  struct mps_listen_comm *lc = calloc(1, sizeof(*lc));
  if (!lc) {
    close(fd);
    return ncclSystemError;
  }
  lc->fd = fd;
  lc->dev = dev;
  *listen_comm = lc;
  mps_addr_str(&bind_addr.addr.sa, where, sizeof(where));
  MP_TRACE(NCCL_NET, "socket: listening on %s (%s)", d->ifname, where);
  return ncclSuccess;
}

ncclResult_t mps_close_listen(void *listen_comm) {
  struct mps_listen_comm *lc = listen_comm;
  if (!lc) return ncclSuccess;
  for (int i = 0; i < lc->npending; i++) close(lc->pending[i].fd);
  close(lc->fd);
  free(lc);
  return ncclSuccess;
}

/* ------------------------------------------------------------------ connect */

struct mps_connect_stage {
  int nsock;                   /* control + data streams */
  int fds[MPS_MAX_STREAMS + 1];
  int connected[MPS_MAX_STREAMS + 1];
  size_t hello_sent[MPS_MAX_STREAMS + 1];
  struct mps_hello hello;
  double deadline;
  char peer[80];
  int dev;
  struct sockaddr_storage peer_addr;
  socklen_t peer_addr_len;
};

static struct mplane_stage_set connect_stages = MPLANE_STAGE_SET_INIT;

static void stage_free(struct mps_connect_stage *st) {
  mplane_stage_remove(&connect_stages, st);
  for (int i = 0; i < st->nsock; i++)
    if (st->fds[i] >= 0) close(st->fds[i]);
  free(st);
}

int mps_streams_for(const struct mplane_config *cfg, int speed_mbps, int ncpus) {
  if (cfg->socket_streams > 0) return cfg->socket_streams;
  return speed_mbps >= MPS_FAST_LINK_MBPS && ncpus >= 2 * 8 ? 8 : 4;
}

static ncclResult_t stage_open(int dev, const struct mplane_comm_opts *opts, const struct mplane_handle *h,
                               struct mps_connect_stage **out) {
  const struct mplane_config *cfg = mps_config();
  const struct mps_dev *d = mps_dev_get(dev);
  union { struct sockaddr sa; struct sockaddr_storage ss; } peer;
  socklen_t peer_len;
  char why[160];
  if (mplane_handle_sockaddr(h, &peer.ss, &peer_len, why, sizeof(why)) != ncclSuccess) {
    MP_WARN("socket: connect: %s", why);
    return ncclInvalidUsage;
  }
  struct mps_connect_stage *st = calloc(1, sizeof(*st));
  if (!st) return ncclSystemError;
  mps_addr_str(&peer.sa, st->peer, sizeof(st->peer));
  if (peer.sa.sa_family != d->addr.sa.sa_family) {
    MP_WARN("socket: cannot connect %s (%s) to peer %s: address families differ", d->ifname,
            d->addr.sa.sa_family == AF_INET ? "IPv4" : "IPv6", st->peer);
    free(st);
    return ncclInvalidUsage;
  }
  uint64_t nonce = 0;
  if (getrandom(&nonce, sizeof(nonce), 0) != sizeof(nonce)) nonce = (uint64_t)mplane_now_s() ^ (uint64_t)(uintptr_t)st;
  int ncpus = mps_usable_cpus();
  int nstreams = mps_streams_for(cfg, d->props.speed_mbps, ncpus);
  static int said; /* once per process: what every connection of this kind opens */
  if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
    MP_INFO(NCCL_INIT | NCCL_NET, "socket: %d data streams per connection (%s; %s at %d Mb/s, %d CPUs usable)",
            nstreams,
            cfg->socket_streams ? "MPLANE_SOCKET_STREAMS" : "automatic", d->ifname, d->props.speed_mbps, ncpus);
  st->nsock = 1; /* the control socket; data streams open when a message first needs them */
  st->dev = dev;
  memcpy(&st->peer_addr, &peer.ss, peer_len);
  st->peer_addr_len = peer_len;
  st->deadline = mplane_now_s() + cfg->connect_timeout_s;
  st->hello = (struct mps_hello){.magic = MPLANE_HANDLE_MAGIC, .version = MPLANE_PROTOCOL_VERSION,
                                 .type = MPS_HELLO, .node_id = mplane_node_id(), .nonce = nonce,
                                 .plane = d->props.plane, .nstreams = (uint16_t)nstreams,
                                 .sl = (uint32_t)opts->service_level, .flags = MPS_HELLO_LAZY};
  for (int i = 0; i < st->nsock; i++) st->fds[i] = -1;
  for (int i = 0; i < st->nsock; i++) {
    int fd = socket(d->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 && (errno == EMFILE || errno == ENFILE)) {
      mps_warn_fds("a control socket", st->peer);
      stage_free(st);
      return ncclSystemError;
    }
    if (fd < 0) goto fail;
    st->fds[i] = fd;
    tune_socket(fd);
    mplane_tc_mark_socket_or_log(fd, opts->service_level, d->ifname); /* DSCP + priority of the class */
    if (mps_bind_source(fd, d) != 0) goto fail;
    set_nonblocking(fd, 1);
    if (connect(fd, &peer.sa, peer_len) != 0 && errno != EINPROGRESS) goto fail;
  }
  *out = st;
  return ncclSuccess;
fail:
  if (errno == EADDRNOTAVAIL) mps_warn_ports("a control socket", st->peer);
  else MP_WARN("socket: connect from %s to peer %s failed: %m", d->ifname, st->peer);
  stage_free(st);
  return ncclRemoteError;
}

/* Advance every socket: finish the TCP connect, then write its hello. 1 when all are done. */
static ncclResult_t stage_progress(struct mps_connect_stage *st, int *all_done) {
  int done = 0;
  for (int i = 0; i < st->nsock; i++) {
    int fd = st->fds[i];
    if (!st->connected[i]) {
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      if (poll(&p, 1, 0) <= 0) continue;
      int soerr = 0;
      socklen_t len = sizeof(soerr);
      getsockopt(fd, SOL_SOCKET, SO_ERROR, &soerr, &len);
      if (soerr != 0) {
        MP_WARN("socket: connect to peer %s failed: %s", st->peer, strerror(soerr));
        return ncclRemoteError;
      }
      st->connected[i] = 1;
    }
    if (st->hello_sent[i] < sizeof(struct mps_hello)) {
      struct mps_hello hello = st->hello;
      hello.stream = (uint16_t)i;
      ssize_t w = send(fd, (char *)&hello + st->hello_sent[i], sizeof(hello) - st->hello_sent[i], MSG_NOSIGNAL);
      if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
        MP_WARN("socket: handshake with peer %s failed: %m", st->peer);
        return ncclRemoteError;
      }
      if (w > 0) st->hello_sent[i] += (size_t)w;
    }
    if (st->hello_sent[i] == sizeof(struct mps_hello)) done++;
  }
  *all_done = done == st->nsock;
  return ncclSuccess;
}

ncclResult_t mps_connect(int dev, const struct mplane_comm_opts *opts, void *handle, void **send_comm) {
  *send_comm = NULL;
  /* Check the handle before trusting the stage pointer we keep in it: a handle that is not ours
   * (another plugin's, garbage) has arbitrary bytes there; only a stage we made is followed. */
  struct mplane_handle h;
  char why[256];
  ncclResult_t dres = mplane_handle_decode(handle, &h, why, sizeof(why));
  if (dres != ncclSuccess) {
    MP_WARN("socket: connect: %s", why);
    return dres;
  }
  struct mps_connect_stage *st = mplane_connect_stage_find(&connect_stages, handle, MPS_STAGE_OFFSET);
  if (!st) {
    if (h.transport != MPLANE_HANDLE_SOCKET) {
      MP_WARN("socket: connect: peer listens on the IB transport, this rank runs sockets: set the same "
              "MPLANE_TRANSPORT on every node");
      return ncclInvalidUsage;
    }
    if (!mps_dev_get(dev)) return ncclInvalidArgument;
    MP_CHECK(stage_open(dev, opts, &h, &st));
    if (mplane_connect_stage_keep(&connect_stages, handle, MPS_STAGE_OFFSET, st) != 0) {
      stage_free(st);
      return ncclSystemError;
    }
  }
  int all_done = 0;
  ncclResult_t res = stage_progress(st, &all_done);
  if (res == ncclSuccess && !all_done && mplane_now_s() > st->deadline) {
    MP_WARN("socket: no connection to peer %s within %d s (MPLANE_CONNECT_TIMEOUT): is it reachable from this "
            "interface, and on the same plane?", st->peer, mps_config()->connect_timeout_s);
    res = ncclRemoteError;
  }
  if (res != ncclSuccess || !all_done) {
    if (res != ncclSuccess) {
      mplane_connect_stage_drop(&connect_stages, handle, MPS_STAGE_OFFSET, st);
      stage_free(st);
    }
    return res;
  }
  /* Whole: hand the sockets to a send comm. */
  struct mps_send_comm *c = calloc(1, sizeof(*c));
  if (!c) return ncclSystemError;
  c->ctrl_fd = st->fds[0];
  c->nstreams = st->hello.nstreams;
  c->nopen = st->nsock - 1;
  c->dev = st->dev;
  memcpy(&c->peer_addr, &st->peer_addr, st->peer_addr_len);
  c->peer_addr_len = st->peer_addr_len;
  c->hello = st->hello;
  snprintf(c->peer, sizeof(c->peer), "%s", st->peer);
  mplane_connect_stage_drop(&connect_stages, handle, MPS_STAGE_OFFSET, st);
  res = mps_send_comm_start(c, mps_config(), st->fds + 1);
  free(st); /* fds now belong to c */
  if (res != ncclSuccess) {
    mps_close_send(c);
    return res;
  }
  *send_comm = c;
  return ncclSuccess;
}

/* ------------------------------------------------------------------ accept */

static void pending_drop(struct mps_listen_comm *lc, int i) {
  close(lc->pending[i].fd);
  lc->pending[i] = lc->pending[--lc->npending];
}

/* An ACK offers eager messages (socket.h): how many this side holds and how big, from
 * MPLANE_SOCKET_EAGER_BYTES (mps_recv_comm_start reads the same value). */
static void send_ctrl_now(int fd, uint16_t type, int stream_port) {
  struct mps_ctrl m = {.magic = MPLANE_HANDLE_MAGIC, .version = MPLANE_PROTOCOL_VERSION, .type = type};
  m.ack.stream_port = type == MPS_ACK ? (uint32_t)stream_port : 0;
  long eager = mps_config()->socket_eager_bytes;
  if (type == MPS_ACK && eager > 0) {
    m.n = MPS_EAGER_MAX;
    m.eager_bytes = (uint32_t)eager;
    m.hold = MPS_EAGER_HOLD;
  }
  /* Tiny and first on a fresh socket: fits in the send buffer, so this never blocks. */
  if (send(fd, &m, sizeof(m), MSG_NOSIGNAL | MSG_DONTWAIT) != (ssize_t)sizeof(m))
    MP_TRACE(NCCL_NET, "socket: could not send control record %u", type);
}

/* 1, with the reason in why, if a complete hello is not one this library takes. */
static int hello_refused(const struct mps_hello *h, char *why, size_t whylen) {
  if (h->version != MPLANE_PROTOCOL_VERSION)
    snprintf(why, whylen, "it speaks mplane protocol version %u, this library speaks %u: use the same mplane "
             "build on every node", h->version, MPLANE_PROTOCOL_VERSION);
  else if (h->type != MPS_HELLO || h->nstreams < 1 || h->nstreams > MPS_MAX_STREAMS || h->stream > h->nstreams)
    snprintf(why, whylen, "a malformed hello (type %u, stream %u of %u; 1..%d streams)", h->type, h->stream,
             h->nstreams, MPS_MAX_STREAMS);
  else if (h->flags & ~MPS_HELLO_LAZY)
    snprintf(why, whylen, "a hello with unknown flags 0x%x", h->flags);
  else if (h->sl > MPLANE_TC_SL_MAX)
    snprintf(why, whylen, "it asks for service level %u (0..%d)", h->sl, MPLANE_TC_SL_MAX);
  else
    return 0;
  return 1;
}

/* How long a pending socket may hold its slot at one step of its handshake (own_s) - never longer
 * than a connector waits for its connection (MPLANE_CONNECT_TIMEOUT), and a socket that sent part
 * of its hello (a real connector writes the whole of it at once) at most half of that, so a
 * connector that waits behind a stranger's slot still gets in within its own deadline. */
static double pending_limit_s(double own_s, int partial) {
  double deadline = (double)mps_config()->connect_timeout_s;
  if (partial) deadline /= 2;
  return own_s < deadline ? own_s : deadline;
}

/* Read what has arrived of each pending socket's hello; refuse strangers. */
static ncclResult_t pending_progress(struct mps_listen_comm *lc) {
  double now = mplane_now_s();
  const double silent_s = pending_limit_s(MPS_SILENT_TIMEOUT_S, 0), partial_s = pending_limit_s(MPS_HELLO_TIMEOUT_S, 1),
               streams_s = pending_limit_s(MPS_HELLO_TIMEOUT_S, 0);
  for (int i = 0; i < lc->npending;) {
    struct mps_pending *p = &lc->pending[i];
    if (p->have < sizeof(p->hello)) {
      ssize_t r = recv(p->fd, (char *)&p->hello + p->have, sizeof(p->hello) - p->have, MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        MP_INFO(NCCL_NET, "socket: connection from %s closed before its handshake", p->peer);
        pending_drop(lc, i);
        continue;
      }
      if (r > 0) p->have += (size_t)r;
      if (p->have >= sizeof(p->hello.magic) && p->hello.magic != MPLANE_HANDLE_MAGIC) {
        MP_WARN("socket: connection from %s is not mplane (first bytes 0x%08x); dropped", p->peer, p->hello.magic);
        pending_drop(lc, i);
        continue;
      }
      if (p->have < sizeof(p->hello)) {
        if (p->have == 0 && now - p->since > silent_s) {
          MP_WARN("socket: connection from %s sent nothing in %.1f s; dropped", p->peer, silent_s);
          pending_drop(lc, i);
          continue;
        }
        if (p->have > 0 && now - p->since > partial_s) {
          MP_WARN("socket: connection from %s sent %zu bytes of a %zu-byte handshake in %.1f s; dropped", p->peer,
                  p->have, sizeof(p->hello), partial_s);
          pending_drop(lc, i);
          continue;
        }
        i++;
        continue;
      }
      char why[160];
      if (hello_refused(&p->hello, why, sizeof(why))) {
        MP_WARN("socket: connection from %s refused: %s", p->peer, why);
        /* The connector fails on the NACK; this listener goes on accepting (a stranger on the port
         * must not end the job). */
        send_ctrl_now(p->fd, MPS_NACK, 0);
        pending_drop(lc, i);
        continue;
      }
    } else {
      /* Said hello, waiting for the rest of its connection: drop it if its peer hung up (an aborted
       * connect) or the rest never comes, or such sockets fill the table and nothing is accepted. */
      char byte;
      ssize_t r = recv(p->fd, &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
        MP_INFO(NCCL_NET, "socket: connection from %s closed before the rest of its streams arrived", p->peer);
        pending_drop(lc, i);
        continue;
      }
      if (now - p->since > streams_s) {
        MP_WARN("socket: connection from %s (stream %u of %u) was not joined by its other streams in %.1f s; dropped",
                p->peer, p->hello.stream, p->hello.nstreams, streams_s);
        pending_drop(lc, i);
        continue;
      }
    }
    i++;
  }
  return ncclSuccess;
}

/* If every socket of one connection (same nonce) has said hello, build its recv comm. */
static ncclResult_t pending_assemble(struct mps_listen_comm *lc, struct mps_recv_comm **out, int *fds) {
  for (int i = 0; i < lc->npending; i++) {
    struct mps_pending *ctrl = &lc->pending[i];
    if (ctrl->have < sizeof(ctrl->hello) || ctrl->hello.stream != 0) continue;
    /* lazy: the control socket alone; its streams come to the stream listener (socket.h) */
    int lazy = (ctrl->hello.flags & MPS_HELLO_LAZY) != 0;
    int n = lazy ? 0 : ctrl->hello.nstreams, found = 0;
    int idx[MPS_MAX_STREAMS + 1];
    for (int s = 0; s <= n; s++) idx[s] = -1;
    for (int j = 0; j < lc->npending; j++) {
      struct mps_pending *p = &lc->pending[j];
      /* same nonce and same stream count: a stream index beyond n would read idx[] past what was set */
      if (p->have == sizeof(p->hello) && p->hello.nonce == ctrl->hello.nonce &&
          p->hello.nstreams == ctrl->hello.nstreams && p->hello.stream <= n && idx[p->hello.stream] < 0) {
        idx[p->hello.stream] = j;
        found++;
      }
    }
    if (found != n + 1) continue;
    struct mps_recv_comm *c = calloc(1, sizeof(*c));
    if (!c) return ncclSystemError;
    c->nstreams = ctrl->hello.nstreams;
    c->nopen = n;
    c->nonce = ctrl->hello.nonce;
    c->node_id = ctrl->hello.node_id;
    c->sl = ctrl->hello.sl;
    c->ctrl_fd = lc->pending[idx[0]].fd;
    for (int s = 0; s < n; s++) fds[s] = lc->pending[idx[s + 1]].fd;
    snprintf(c->peer, sizeof(c->peer), "%s", ctrl->peer);
    /* Our side of the connection (ACKs, CTS) rides the class the connector asked for. */
    mplane_tc_mark_socket_or_log(c->ctrl_fd, (int)ctrl->hello.sl, c->peer);
    for (int s = 0; s < n; s++) mplane_tc_mark_socket_or_log(fds[s], (int)ctrl->hello.sl, c->peer);
    /* Keep the pending sockets that belong to other connections. */
    int used[MPS_PENDING_MAX] = {0};
    for (int s = 0; s <= n; s++) used[idx[s]] = 1;
    int kept = 0;
    for (int j = 0; j < lc->npending; j++)
      if (!used[j]) lc->pending[kept++] = lc->pending[j];
    lc->npending = kept;
    *out = c;
    return ncclSuccess;
  }
  return ncclSuccess;
}

/* The table is full and another connection waits: drop the oldest socket whose hello is not whole
 * after MPS_EVICT_AFTER_S, whatever part of it it sent (a real connector writes all of it at once),
 * so that strangers - silent, or one byte each - cannot keep real peers out. A socket whose hello
 * was whole and valid waits for its other streams, and keeps its slot. 1 if one was dropped. */
static int pending_evict_unfinished(struct mps_listen_comm *lc) {
  int oldest = -1;
  double now = mplane_now_s();
  for (int i = 0; i < lc->npending; i++)
    if (lc->pending[i].have < sizeof(lc->pending[i].hello) && now - lc->pending[i].since > MPS_EVICT_AFTER_S &&
        (oldest < 0 || lc->pending[i].since < lc->pending[oldest].since))
      oldest = i;
  if (oldest < 0) return 0;
  MP_WARN("socket: %d connections wait for their handshake; dropped the one from %s, %zu of %zu bytes in %.0f s",
          lc->npending, lc->pending[oldest].peer, lc->pending[oldest].have, sizeof(lc->pending[oldest].hello),
          now - lc->pending[oldest].since);
  pending_drop(lc, oldest);
  return 1;
}

ncclResult_t mps_accept(void *listen_comm, void **recv_comm) {
  struct mps_listen_comm *lc = listen_comm;
  *recv_comm = NULL;
  while (lc->npending < MPS_PENDING_MAX || (mplane_listen_backlog_waiting(lc->fd) && pending_evict_unfinished(lc))) {
    union { struct sockaddr sa; struct sockaddr_in6 sin6; } from;
    socklen_t len = sizeof(from);
    int fd = accept4(lc->fd, &from.sa, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) break;
      if (errno == EMFILE || errno == ENFILE) mps_warn_fds("an incoming control socket", NULL);
      else MP_WARN("socket: accept failed: %m");
      return ncclSystemError;
    }
    tune_socket(fd);
    struct mps_pending *p = &lc->pending[lc->npending++];
    memset(p, 0, sizeof(*p));
    p->fd = fd;
    p->since = mplane_now_s();
    mps_addr_str(&from.sa, p->peer, sizeof(p->peer));
  }
  MP_CHECK(pending_progress(lc));
  struct mps_recv_comm *c = NULL;
  int fds[MPS_MAX_STREAMS];
  MP_CHECK(pending_assemble(lc, &c, fds));
  if (!c) return ncclSuccess;
  ncclResult_t res = mps_recv_comm_start(c, fds);
  if (res == ncclSuccess) {
    mps_recv_register(c); /* before the ACK: a stream may follow it at once */
    send_ctrl_now(c->ctrl_fd, MPS_ACK, mps_stream_listener_port(lc->dev, (int)c->sl));
  }
  if (res != ncclSuccess) {
    mps_close_recv(c);
    return res;
  }
  *recv_comm = c;
  return ncclSuccess;
}

/* ------------------------------------------------------------------ lazy data streams
 *
 * A connection's data streams open when a message first needs them (socket.h, MPS_HELLO_LAZY),
 * long after NCCL closed the listen comm its control socket came through. So they connect to the
 * process's stream listener instead (one per device and service level, its port in every ACK), whose
 * thread (pool thread 0) accepts them, reads their hellos without blocking, and gives each to the recv
 * comm its nonce names, from the table below. One per service level because an accepted socket takes
 * its listener's marks (IP_TOS / IPV6_TCLASS, SO_PRIORITY) from the SYN-ACK on: the acks of the first
 * chunks, which the kernel sends before the stream's hello has been read, carry the connection's class. */

#define MPS_REG_BUCKETS 4096
#define MPS_HELLOS_MAX 1024 /* accepted streams that have not said hello yet, at most */

static struct {
  pthread_mutex_t lock;
  struct mps_recv_comm *bucket[MPS_REG_BUCKETS];
} g_reg = {.lock = PTHREAD_MUTEX_INITIALIZER};

static unsigned reg_hash(uint64_t nonce) { return (unsigned)((nonce * 0x9e3779b97f4a7c15ull) >> 52); }

void mps_recv_register(struct mps_recv_comm *c) {
  pthread_mutex_lock(&g_reg.lock);
  struct mps_recv_comm **b = &g_reg.bucket[reg_hash(c->nonce)];
  c->reg_next = *b;
  *b = c;
  c->registered = 1;
  pthread_mutex_unlock(&g_reg.lock);
}

void mps_recv_unregister(struct mps_recv_comm *c) {
  pthread_mutex_lock(&g_reg.lock);
  if (c->registered) {
    struct mps_recv_comm **pp = &g_reg.bucket[reg_hash(c->nonce)];
    while (*pp && *pp != c) pp = &(*pp)->reg_next;
    if (*pp) *pp = c->reg_next;
    c->registered = 0;
  }
  pthread_mutex_unlock(&g_reg.lock);
}

/* The stream listeners, by device and service level; touched under g_reg.lock (made by the proxy
 * thread, read by pool thread 0). */
#define MPS_LISTEN_SLS (MPLANE_TC_SL_MAX + 1)
static struct mps_stream *g_listeners[MPS_MAX_DEVS][MPS_LISTEN_SLS];
static int g_listener_ports[MPS_MAX_DEVS][MPS_LISTEN_SLS];

/* Accepted streams saying hello (pool thread 0 only): a list to time out the silent ones. */
static struct mps_stream *g_hellos[MPS_HELLOS_MAX];
static int g_nhellos;

int mps_stream_listener_port(int dev, int sl) {
  if (dev < 0 || dev >= MPS_MAX_DEVS) return 0;
  if (sl < 0 || sl >= MPS_LISTEN_SLS) sl = 0;
  pthread_mutex_lock(&g_reg.lock);
  int port = g_listener_ports[dev][sl];
  if (port || g_listeners[dev][sl]) { /* made (or failed, port 0, WARNed once) */
    pthread_mutex_unlock(&g_reg.lock);
    return port;
  }
  const struct mps_dev *d = mps_dev_get(dev);
  struct mps_stream *st = calloc(1, sizeof(*st));
  int fd = d && st ? socket(d->addr.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0) : -1;
  struct mps_dev a = d ? *d : (struct mps_dev){0};
  if (a.addr.sa.sa_family == AF_INET) a.addr.sin.sin_port = 0;
  else a.addr.sin6.sin6_port = 0;
  socklen_t len = a.addrlen;
  if (fd >= 0) mplane_tc_mark_socket_or_log(fd, sl, d->ifname); /* what its accepted streams start with */
  if (fd < 0 || bind(fd, &a.addr.sa, a.addrlen) != 0 || listen(fd, 4096) != 0 ||
      getsockname(fd, &a.addr.sa, &len) != 0) {
    MP_WARN("socket: cannot open the stream listener on %s: %s; connections to this process can carry no "
            "message bigger than MPLANE_SOCKET_INLINE_BYTES", d ? d->ifname : "?", strerror(errno));
    if (fd >= 0) close(fd);
    if (st) {
      st->fd = -1;
      g_listeners[dev][sl] = st; /* said once */
    }
    pthread_mutex_unlock(&g_reg.lock);
    return 0;
  }
  st->fd = fd;
  st->kind = MPS_STREAM_LISTEN;
  st->dev = dev;
  port = a.addr.sa.sa_family == AF_INET ? ntohs(a.addr.sin.sin_port) : ntohs(a.addr.sin6.sin6_port);
  g_listeners[dev][sl] = st;
  if (mps_engine_attach_first(st) != 0) {
    close(fd);
    st->fd = -1;
    port = 0;
  }
  g_listener_ports[dev][sl] = port;
  pthread_mutex_unlock(&g_reg.lock);
  return port;
}

/* Dropped streams whose memory waits for the next sweep (pool thread 0 only). listener_io drops the
 * oldest stream to make room while thread 0 may still hold an event of it from the same epoll_wait:
 * that event then finds it off g_hellos (hello_io), not freed memory. The sweep runs before the next
 * wait, once every event of the last one was handled. */
static struct mps_stream *g_dropped;

static void hello_drop(int i, const char *why) {
  struct mps_stream *st = g_hellos[i];
  if (why) MP_WARN("socket: data stream from %s %s; dropped", st->peer, why);
  mps_engine_forget(st);
  close(st->fd);
  st->fd = -1;
  st->next = g_dropped;
  g_dropped = st;
  g_hellos[i] = g_hellos[--g_nhellos];
}

int mps_stream_hellos_sweep(void) {
  while (g_dropped) {
    struct mps_stream *st = g_dropped;
    g_dropped = st->next;
    free(st);
  }
  if (!g_nhellos) return -1;
  double now = mplane_now_s();
  for (int i = 0; i < g_nhellos;) {
    if (now - g_hellos[i]->since > MPS_SILENT_TIMEOUT_S) hello_drop(i, "sent no handshake in time");
    else i++;
  }
  return g_nhellos ? 1000 : -1;
}

/* A descriptor kept in reserve (pool thread 0): with none left, the stream listener gives it up to
 * accept one waiting stream and reset it at once, so that its sender fails (and says why) instead of
 * waiting on a stream nobody reads, and the level-triggered listener does not spin. 1 if one went. */
static int g_reserve_fd = -1;

static int refuse_one(int lfd) {
  if (g_reserve_fd < 0) return 0;
  close(g_reserve_fd);
  int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
  if (fd >= 0) {
    struct linger abort_close = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &abort_close, sizeof(abort_close));
    close(fd);
  }
  g_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  return fd >= 0;
}

static void listener_io(struct mps_stream *l) {
  if (g_reserve_fd < 0) g_reserve_fd = open("/dev/null", O_RDONLY | O_CLOEXEC);
  for (;;) {
    union { struct sockaddr sa; struct sockaddr_in6 sin6; } from;
    socklen_t len = sizeof(from);
    int fd = accept4(l->fd, &from.sa, &len, SOCK_CLOEXEC | SOCK_NONBLOCK);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) {
        static int said; /* the connector's stream fails too, and says so */
        if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED)) mps_warn_fds("an incoming data stream", NULL);
        if (refuse_one(l->fd)) continue;
      }
      return; /* EAGAIN, or an error the next connection may not have */
    }
    if (g_nhellos == MPS_HELLOS_MAX) hello_drop(0, "waited for its handshake while the table was full");
    struct mps_stream *st = calloc(1, sizeof(*st));
    if (!st) {
      close(fd);
      continue;
    }
    tune_socket(fd);
    st->fd = fd;
    st->kind = MPS_STREAM_HELLO;
    st->dev = l->dev;
    st->since = mplane_now_s();
    mps_addr_str(&from.sa, st->peer, sizeof(st->peer));
    if (mps_engine_attach_first(st) != 0) {
      close(fd);
      free(st);
      continue;
    }
    g_hellos[g_nhellos++] = st;
    mps_stream_accept_io(st, EPOLLIN); /* its hello is often there already */
  }
}

/* A whole hello: give the stream to the recv comm its nonce names, under g_reg.lock. NULL, or why not. */
static const char *hello_attach(struct mps_stream *st) {
  const struct mps_hello *h = &st->hello;
  static char why[160];
  if (hello_refused(h, why, sizeof(why))) return why;
  if (!(h->flags & MPS_HELLO_LAZY) || h->stream < 1) return "is not a lazy data stream's";
  struct mps_recv_comm *c = g_reg.bucket[reg_hash(h->nonce)];
  while (c && (c->nonce != h->nonce || c->node_id != h->node_id)) c = c->reg_next;
  if (!c) return "names no connection of this process (closed, or never made)";
  if (h->nstreams != c->nstreams || c->streams[h->stream - 1])
    return "does not fit its connection (another stream count, or a stream index taken)";
  mps_engine_forget(st); /* off thread 0's hello watch, onto a pool thread of its own */
  st->kind = MPS_STREAM_RECV;
  st->comm = c;
  st->index = h->stream - 1;
  st->hhave = 0; /* it counted the hello's bytes; now a chunk header's */
  mplane_tc_mark_socket_or_log(st->fd, (int)c->sl, c->peer);
  if (mps_engine_attach(st) != 0) return "could not be given to an I/O thread";
  c->streams[st->index] = st; /* its first chunk, if it came with the hello, wakes its new thread */
  __atomic_add_fetch(&c->nopen, 1, __ATOMIC_ACQ_REL);
  return NULL;
}

static void hello_io(struct mps_stream *st) {
  int i = 0;
  while (i < g_nhellos && g_hellos[i] != st) i++;
  if (i == g_nhellos) return; /* not one of ours (cannot happen: dropped ones are off the epoll) */
  ssize_t r = recv(st->fd, (char *)&st->hello + st->hhave, sizeof(st->hello) - st->hhave, MSG_DONTWAIT);
  if (r < 0 && mps_would_block()) return;
  if (r <= 0) return hello_drop(i, NULL); /* closed before its hello: an aborted connect */
  st->hhave += (size_t)r;
  if (st->hhave >= sizeof(st->hello.magic) && st->hello.magic != MPLANE_HANDLE_MAGIC)
    return hello_drop(i, "is not mplane");
  if (st->hhave < sizeof(st->hello)) return;
  pthread_mutex_lock(&g_reg.lock);
  int fd = st->fd;
  const char *why = hello_attach(st);
  pthread_mutex_unlock(&g_reg.lock);
  if (!why) {
    g_hellos[i] = g_hellos[--g_nhellos];
    return;
  }
  if (st->kind == MPS_STREAM_HELLO) return hello_drop(i, why);
  MP_WARN("socket: data stream from %s %s; dropped", st->peer, why); /* forgotten already */
  close(fd);
  free(st);
  g_hellos[i] = g_hellos[--g_nhellos];
}

void mps_stream_accept_io(struct mps_stream *st, uint32_t events) {
  (void)events;
  if (st->kind == MPS_STREAM_LISTEN) listener_io(st);
  else hello_io(st);
}

/* ---- the sender's side: open one more stream ---- */

int mps_stream_connect(struct mps_send_comm *c, int *out) {
  const struct mps_dev *d = mps_dev_get(c->dev);
  union { struct sockaddr sa; struct sockaddr_storage ss; struct sockaddr_in sin; struct sockaddr_in6 sin6; } to;
  memcpy(&to, &c->peer_addr, c->peer_addr_len);
  if (to.sa.sa_family == AF_INET) to.sin.sin_port = htons((uint16_t)c->stream_port);
  else to.sin6.sin6_port = htons((uint16_t)c->stream_port);
  int fd = socket(to.sa.sa_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    if (errno == EMFILE || errno == ENFILE) mps_warn_fds("a data stream", c->peer);
    else MP_WARN("socket: cannot open a data stream to peer %s: %m", c->peer);
    return -1;
  }
  tune_socket(fd);
  mplane_tc_mark_socket_or_log(fd, (int)c->hello.sl, d ? d->ifname : "?");
  if ((d && mps_bind_source(fd, d) != 0) ||
      (connect(fd, &to.sa, c->peer_addr_len) != 0 && errno != EINPROGRESS)) {
    if (errno == EADDRNOTAVAIL) mps_warn_ports("a data stream", c->peer);
    else MP_WARN("socket: cannot open data stream %d of %d to peer %s (port %u): %m", c->nstarted + 1, c->nstreams,
                 c->peer, c->stream_port);
    close(fd);
    return -1;
  }
  *out = fd;
  return 0;
}
