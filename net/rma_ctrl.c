/* mplane: the control sockets of a one-sided group (see rma_ctrl.h). */
#include "rma_ctrl.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#include "../common/log.h"

int mplane_rma_timeout_ms(const struct mplane_config *cfg) {
  int s = cfg && cfg->connect_timeout_s > 0 ? cfg->connect_timeout_s : 60;
  return s * 1000;
}

int mplane_rma_write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int mplane_rma_read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return got == 0 ? 1 : -1;
    if (r < 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

int mplane_rma_listen_any_port(struct sockaddr_storage *sa, socklen_t *len) {
  if (sa->ss_family == AF_INET) ((struct sockaddr_in *)sa)->sin_port = 0;
  else ((struct sockaddr_in6 *)sa)->sin6_port = 0;
  int fd = socket(sa->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (bind(fd, (struct sockaddr *)sa, *len) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, (struct sockaddr *)sa, len) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

void mplane_rma_set_timeouts(int fd, int ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

ncclResult_t mplane_rma_allgather(const int *ctrl, int rank, int nranks, const void *mine, void *all, size_t len,
                                  int timeout_ms, const char *what) {
  memcpy((char *)all + (size_t)rank * len, mine, len);
  for (int j = 0; j < nranks; j++)
    if (j != rank && mplane_rma_write_all(ctrl[j], mine, len) != 0) {
      MP_WARN("RMA %s: rank %d could not reach rank %d on the group's control socket: %s", what, rank, j,
              strerror(errno));
      return ncclRemoteError;
    }
  for (int j = 0; j < nranks; j++)
    if (j != rank && mplane_rma_read_all(ctrl[j], (char *)all + (size_t)j * len, len) != 0) {
      MP_WARN("RMA %s: rank %d heard nothing from rank %d on the group's control socket within %d s", what, rank,
              j, timeout_ms / 1000);
      return ncclRemoteError;
    }
  return ncclSuccess;
}

int mplane_rma_peer_connected(int rank, int nranks, int stride, int p) {
  return ((p - rank + nranks) % nranks) % stride == 0;
}

int mplane_rma_addr_check(const struct sockaddr *sa, unsigned addrlen, char *why, size_t whylen) {
  if (sa->sa_family == AF_INET && addrlen == sizeof(struct sockaddr_in)) return 0;
  if (sa->sa_family == AF_INET6 && addrlen == sizeof(struct sockaddr_in6)) return 0;
  if (sa->sa_family != AF_INET && sa->sa_family != AF_INET6)
    snprintf(why, whylen, "its address family is %u; only IPv4 (%d) and IPv6 (%d) are taken", sa->sa_family,
             AF_INET, AF_INET6);
  else
    snprintf(why, whylen, "its %s address is said to be %u bytes long; it is %zu", sa->sa_family == AF_INET ? "IPv4" : "IPv6",
             addrlen, sa->sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6));
  return -1;
}

/* ---- the incoming side of a listener: hellos read without blocking ---- */
#define GATE_HELLO_MS 30000 /* a connection must say its hello within this */

static uint64_t gate_now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

void mplane_rma_gate_init(struct mplane_rma_gate *g, int lfd, uint32_t magic, size_t hello_len, const char *what) {
  memset(g, 0, sizeof(*g));
  g->lfd = lfd;
  g->magic = magic;
  g->hello_len = hello_len < MPLANE_RMA_HELLO_MAX ? hello_len : MPLANE_RMA_HELLO_MAX;
  g->what = what;
}

static void gate_drop(struct mplane_rma_gate *g, int i, const char *why) {
  MP_INFO(NCCL_INIT | NCCL_NET, "%s: dropped a connection from %s: %s", g->what, g->p[i].peer, why);
  close(g->p[i].fd);
  g->p[i] = g->p[--g->n];
}

static void gate_accept(struct mplane_rma_gate *g) {
  struct sockaddr_storage ss;
  socklen_t sl = sizeof(ss);
  int fd = accept4(g->lfd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC | SOCK_NONBLOCK);
  if (fd < 0) return;
  if (g->n == MPLANE_RMA_GATE_MAX) gate_drop(g, 0, "too many connections waiting to say who they are; the oldest goes");
  int i = g->n++;
  g->p[i].fd = fd;
  g->p[i].have = 0;
  g->p[i].since_ms = gate_now_ms();
  char a[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (ss.ss_family == AF_INET) {
    inet_ntop(AF_INET, &((struct sockaddr_in *)&ss)->sin_addr, a, sizeof(a));
    port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
  } else if (ss.ss_family == AF_INET6) {
    inet_ntop(AF_INET6, &((struct sockaddr_in6 *)&ss)->sin6_addr, a, sizeof(a));
    port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
  }
  snprintf(g->p[i].peer, sizeof(g->p[i].peer), "%s port %d", a, port);
}

/* Read what has come of connection i's hello: 1 whole, 0 not yet, -1 dropped. */
static int gate_read(struct mplane_rma_gate *g, int i) {
  ssize_t r;
  do r = recv(g->p[i].fd, g->p[i].buf + g->p[i].have, g->hello_len - g->p[i].have, 0);
  while (r < 0 && errno == EINTR);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) {
    gate_drop(g, i, r == 0 ? "it closed before its hello was whole" : strerror(errno));
    return -1;
  }
  if (r > 0) g->p[i].have += (size_t)r;
  if (g->p[i].have >= 4) {
    uint32_t m;
    memcpy(&m, g->p[i].buf, 4);
    if (m != g->magic) {
      gate_drop(g, i, "it is not an mplane RMA peer (its first bytes are not the hello's magic)");
      return -1;
    }
  }
  return g->p[i].have == g->hello_len;
}

/* Connection i said a whole hello that check took: make it the caller's. */
static int gate_give(struct mplane_rma_gate *g, int i, void *hello) {
  int fd = g->p[i].fd, one = 1;
  memcpy(hello, g->p[i].buf, g->hello_len);
  g->p[i] = g->p[--g->n];
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  return fd;
}

int mplane_rma_gate_take(struct mplane_rma_gate *g, void *hello,
                         int (*check)(const void *hello, void *arg, char *why, size_t whylen), void *arg,
                         int timeout_ms, char *why, size_t whylen) {
  uint64_t deadline = gate_now_ms() + (uint64_t)timeout_ms;
  for (;;) {
    uint64_t now = gate_now_ms();
    for (int i = 0; i < g->n;) { /* whole hellos first: they may have come with the accept */
      int rc = gate_read(g, i);
      if (rc < 0) continue;
      if (rc == 1) {
        char reason[160] = "";
        if (check(g->p[i].buf, arg, reason, sizeof(reason)) == 0) return gate_give(g, i, hello);
        gate_drop(g, i, reason);
        continue;
      }
      if (now - g->p[i].since_ms > GATE_HELLO_MS) {
        gate_drop(g, i, "it said no whole hello within 30 s");
        continue;
      }
      i++;
    }
    if (now >= deadline) {
      snprintf(why, whylen, "no peer connected within MPLANE_CONNECT_TIMEOUT (%d s)%s", timeout_ms / 1000,
               g->n ? "; connections that said no whole hello are still waiting" : "");
      return -1;
    }
    struct pollfd pf[MPLANE_RMA_GATE_MAX + 1];
    pf[0] = (struct pollfd){.fd = g->lfd, .events = POLLIN};
    for (int i = 0; i < g->n; i++) pf[i + 1] = (struct pollfd){.fd = g->p[i].fd, .events = POLLIN};
    uint64_t wait = deadline - now < 1000 ? deadline - now : 1000; /* a second at most: silent ones age out */
    int r = poll(pf, (nfds_t)g->n + 1, (int)wait);
    if (r < 0 && errno != EINTR) {
      snprintf(why, whylen, "poll: %s", strerror(errno));
      return -1;
    }
    if (r > 0 && (pf[0].revents & POLLIN)) gate_accept(g);
  }
}

void mplane_rma_gate_close(struct mplane_rma_gate *g) {
  for (int i = 0; i < g->n; i++) close(g->p[i].fd);
  g->n = 0;
}
