/* mplane fabric test driver: one end of a connection through the plugin's ncclNet_v11 table, the
 * way NCCL's proxy drives it (non-blocking connect/accept loops, isend/irecv/test polling), run
 * inside a node namespace of scripts/fabric.sh.
 *
 *   fabric_peer listen  --plugin SO --dev NAME --handle FILE [--bytes N] [--iters K] [--tc C]
 *   fabric_peer connect --plugin SO --dev NAME --handle FILE [--bytes N] [--iters K] [--tc C]
 *                       [--attr-op MASK] [--attr-proto MASK] [--expect-tos T] [--expect-prio P]
 *                       [--expect-fail TEXT] [--no-check]
 *
 * listen writes its handle to FILE (atomically) and receives K messages of N bytes, checking every
 * byte; connect reads FILE, connects from device NAME and sends them. With --expect-tos/-prio,
 * connect checks IP_TOS and SO_PRIORITY (getsockopt) on every TCP socket it holds to the peer.
 * With --expect-fail, connect must fail within the timeout and a WARN must contain TEXT.
 * Prints "bandwidth: X MB/s" (connect: send side, from the first isend to the last completion).
 * Exit 0 on success, 1 on a failed check, 2 on usage errors. */
#include <arpa/inet.h>
#include <dirent.h>
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/nccl/net.h"

static const char *role = "?";
static char warns[64][1024];
static int nwarns;

static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "fabric_peer %s: FAIL: ", role);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_WARN) {
    if (nwarns < 64) snprintf(warns[nwarns++], sizeof(warns[0]), "%s", msg);
    fprintf(stderr, "[%s] WARN %s:%d %s\n", role, file, line, msg);
  } else if (level == NCCL_LOG_INFO && getenv("FABRIC_VERBOSE")) {
    fprintf(stderr, "[%s] INFO %s\n", role, msg);
  } else if (level == NCCL_LOG_INFO && strstr(msg, "stats:")) {
    fprintf(stderr, "[%s] INFO %s\n", role, msg); /* the per-comm summary line is part of the product */
  } else if (level == NCCL_LOG_INFO && strstr(msg, "relay NIC")) {
    fprintf(stderr, "[%s] INFO %s\n", role, msg);
  }
}

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}

/* The payload of message k: 64-bit words of a splitmix sequence, cheap to make and to check. */
static uint64_t word(uint64_t k, uint64_t i) {
  uint64_t z = (k << 40) + i + 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

static void fill(char *buf, size_t n, uint64_t k) {
  uint64_t *w = (uint64_t *)buf;
  for (size_t i = 0; i < n / 8; i++) w[i] = word(k, i);
  for (size_t i = n & ~(size_t)7; i < n; i++) buf[i] = (char)(word(k, n) >> (8 * (i & 7)));
}

static size_t first_bad(const char *buf, size_t n, uint64_t k) {
  const uint64_t *w = (const uint64_t *)buf;
  for (size_t i = 0; i < n / 8; i++)
    if (w[i] != word(k, i)) return i * 8;
  for (size_t i = n & ~(size_t)7; i < n; i++)
    if (buf[i] != (char)(word(k, n) >> (8 * (i & 7)))) return i;
  return (size_t)-1;
}

/* Check IP_TOS / SO_PRIORITY on every TCP socket of this process connected to peer_ip. */
static int check_marks(const char *peer_ip, int want_tos, int want_prio) {
  DIR *d = opendir("/proc/self/fd");
  if (!d) die("cannot list /proc/self/fd: %s", strerror(errno));
  struct dirent *e;
  int checked = 0;
  while ((e = readdir(d))) {
    int fd = atoi(e->d_name);
    if (fd <= 2) continue;
    struct sockaddr_in sa;
    socklen_t len = sizeof(sa);
    int type = 0;
    socklen_t tl = sizeof(type);
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &tl) != 0 || type != SOCK_STREAM) continue;
    if (getpeername(fd, (struct sockaddr *)&sa, &len) != 0 || sa.sin_family != AF_INET) continue;
    char ip[64];
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
    if (strcmp(ip, peer_ip) != 0) continue;
    int tos = -1, prio = -1;
    socklen_t l1 = sizeof(tos), l2 = sizeof(prio);
    getsockopt(fd, IPPROTO_IP, IP_TOS, &tos, &l1);
    getsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, &l2);
    printf("socket fd %d to %s:%d: IP_TOS 0x%02x SO_PRIORITY %d\n", fd, ip, ntohs(sa.sin_port), tos, prio);
    if (want_tos >= 0 && tos != want_tos) die("fd %d to %s has IP_TOS 0x%02x, expected 0x%02x", fd, ip, tos, want_tos);
    if (want_prio >= 0 && prio != want_prio) die("fd %d to %s has SO_PRIORITY %d, expected %d", fd, ip, prio, want_prio);
    checked++;
  }
  closedir(d);
  return checked;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: fabric_peer listen|connect --plugin SO --dev NAME --handle FILE [options]\n");
    return 2;
  }
  role = argv[1];
  const char *plugin = NULL, *devname = NULL, *handle_path = NULL, *expect_fail = NULL;
  size_t bytes = 1 << 20;
  int iters = 4, tc = NCCL_NET_TRAFFIC_CLASS_UNDEF, want_tos = -1, want_prio = -1, check = 1;
  uint32_t attr_op = 0xffffffffu, attr_proto = 0xffffffffu;
  double timeout = 60;
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--no-check")) { check = 0; continue; }
    if (!v) { fprintf(stderr, "fabric_peer: %s needs a value\n", a); return 2; }
    i++;
    if (!strcmp(a, "--plugin")) plugin = v;
    else if (!strcmp(a, "--dev")) devname = v;
    else if (!strcmp(a, "--handle")) handle_path = v;
    else if (!strcmp(a, "--bytes")) bytes = parse_size(v);
    else if (!strcmp(a, "--iters")) iters = atoi(v);
    else if (!strcmp(a, "--tc")) tc = atoi(v);
    else if (!strcmp(a, "--attr-op")) attr_op = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(a, "--attr-proto")) attr_proto = (uint32_t)strtoul(v, NULL, 0);
    else if (!strcmp(a, "--expect-tos")) want_tos = (int)strtol(v, NULL, 0);
    else if (!strcmp(a, "--expect-prio")) want_prio = atoi(v);
    else if (!strcmp(a, "--expect-fail")) expect_fail = v;
    else if (!strcmp(a, "--timeout")) timeout = atof(v);
    else { fprintf(stderr, "fabric_peer: unknown option %s\n", a); return 2; }
  }
  int is_listen = !strcmp(role, "listen");
  if ((!is_listen && strcmp(role, "connect")) || !plugin || !devname || !handle_path) {
    fprintf(stderr, "fabric_peer: need listen|connect, --plugin, --dev and --handle\n");
    return 2;
  }

  void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("dlopen %s: %s", plugin, dlerror());
  ncclNet_v11_t *net = dlsym(lib, "ncclNetPlugin_v11");
  if (!net) die("%s exports no ncclNetPlugin_v11", plugin);
  void *ctx = NULL;
  ncclNetCommConfig_v11_t cfg = {.trafficClass = tc};
  if (net->init(&ctx, 0x1234, &cfg, logger, NULL) != ncclSuccess) die("init failed");
  if (attr_op != 0xffffffffu || attr_proto != 0xffffffffu) {
    ncclNetAttr_v11_t attr;
    memset(&attr, 0xff, sizeof(attr));
    attr.op = attr_op;
    attr.proto = attr_proto;
    if (net->setNetAttr(ctx, &attr) != ncclSuccess) die("setNetAttr failed");
  }
  int ndev = 0, dev = -1;
  net->devices(&ndev);
  for (int d = 0; d < ndev; d++) {
    ncclNetProperties_v11_t p;
    if (net->getProperties(d, &p) == ncclSuccess && p.name && !strcmp(p.name, devname)) dev = d;
  }
  if (dev < 0) die("no device named %s among %d", devname, ndev);

  char *buf = malloc(bytes ? bytes : 1);
  if (!buf) die("out of memory");
  double deadline = now() + timeout;

  if (is_listen) {
    char handle[NCCL_NET_HANDLE_MAXSIZE] = {0};
    void *lc = NULL, *rc = NULL;
    if (net->listen(ctx, dev, handle, &lc) != ncclSuccess) die("listen on %s failed", devname);
    char tmp[4096];
    snprintf(tmp, sizeof(tmp), "%s.tmp", handle_path);
    FILE *f = fopen(tmp, "wb");
    if (!f || fwrite(handle, 1, sizeof(handle), f) != sizeof(handle) || fclose(f) != 0 || rename(tmp, handle_path))
      die("cannot write %s", handle_path);
    while (!rc) {
      if (net->accept(lc, &rc, NULL) != ncclSuccess) die("accept failed");
      if (!rc && now() > deadline) die("no connection within %.0f s", timeout);
      if (!rc) usleep(200);
    }
    void *mh = NULL;
    if (net->regMr(rc, buf, bytes, NCCL_PTR_HOST, &mh) != ncclSuccess) die("regMr failed");
    for (int k = 0; k < iters; k++) {
      memset(buf, 0, bytes);
      void *req = NULL, *data = buf;
      size_t size = bytes;
      int tag = k & 0x7fff, done = 0, got = -1;
      while (!req) {
        if (net->irecv(rc, 1, &data, &size, &tag, &mh, NULL, &req) != ncclSuccess) die("irecv %d failed", k);
        if (!req && now() > deadline) die("irecv %d never started", k);
      }
      while (!done) {
        if (net->test(req, &done, &got) != ncclSuccess) die("receive %d failed", k);
        if (!done && now() > deadline) die("receive %d did not complete within %.0f s", k, timeout);
      }
      if ((size_t)got != bytes) die("message %d: received %d bytes, expected %zu", k, got, bytes);
      size_t bad = check ? first_bad(buf, bytes, (uint64_t)k) : (size_t)-1;
      if (bad != (size_t)-1) die("message %d: byte %zu differs from what was sent", k, bad);
    }
    printf("received %d x %zu bytes, every byte checked: %s\n", iters, bytes, check ? "ok" : "skipped");
    net->deregMr(rc, mh);
    net->closeRecv(rc);
    net->closeListen(lc);
  } else {
    char handle[NCCL_NET_HANDLE_MAXSIZE];
    FILE *f = NULL;
    while (!(f = fopen(handle_path, "rb"))) {
      if (now() > deadline) die("no handle at %s within %.0f s", handle_path, timeout);
      usleep(20000);
    }
    if (fread(handle, 1, sizeof(handle), f) != sizeof(handle)) die("short handle in %s", handle_path);
    fclose(f);
    /* The peer address, for the socket checks: the handle's payload is a sockaddr_in (net/handle.h). */
    struct sockaddr_in peer;
    memcpy(&peer, handle + 17, sizeof(peer));
    char peer_ip[64];
    inet_ntop(AF_INET, &peer.sin_addr, peer_ip, sizeof(peer_ip));
    void *sc = NULL;
    while (!sc) {
      ncclResult_t r = net->connect(ctx, dev, handle, &sc, NULL);
      if (r != ncclSuccess) {
        if (!expect_fail) die("connect from %s to %s failed (result %d)", devname, peer_ip, r);
        for (int i = 0; i < nwarns; i++)
          if (strstr(warns[i], expect_fail)) {
            printf("connect failed as expected (result %d): %s\n", r, warns[i]);
            return 0;
          }
        die("connect failed (result %d) but no WARN contains '%s'", r, expect_fail);
      }
      if (!sc && now() > deadline) die("connect from %s to %s did not complete within %.0f s", devname, peer_ip, timeout);
      if (!sc) usleep(200);
    }
    if (expect_fail) die("connect from %s succeeded; expected a failure naming '%s'", devname, expect_fail);
    if (want_tos >= 0 || want_prio >= 0) {
      int n = check_marks(peer_ip, want_tos, want_prio);
      if (n == 0) die("no TCP socket to %s found to check", peer_ip);
      printf("checked %d sockets to %s: marks ok\n", n, peer_ip);
    }
    void *mh = NULL;
    if (net->regMr(sc, buf, bytes, NCCL_PTR_HOST, &mh) != ncclSuccess) die("regMr failed");
    double t0 = 0;
    for (int k = 0; k < iters; k++) {
      if (check || k == 0) fill(buf, bytes, (uint64_t)k);
      void *req = NULL;
      int done = 0, got = -1;
      while (!req) {
        if (net->isend(sc, buf, bytes, k & 0x7fff, mh, NULL, &req) != ncclSuccess) die("isend %d failed", k);
        if (!req && now() > deadline) die("isend %d never started (receiver posted nothing?)", k);
      }
      if (k == 0) t0 = now();
      while (!done) {
        if (net->test(req, &done, &got) != ncclSuccess) die("send %d failed", k);
        if (!done && now() > deadline) die("send %d did not complete within %.0f s", k, timeout);
      }
    }
    double dt = now() - t0;
    printf("sent %d x %zu bytes from %s to %s\n", iters, bytes, devname, peer_ip);
    printf("bandwidth: %.1f MB/s\n", iters > 0 && dt > 0 ? (double)bytes * iters / dt / 1e6 : 0.0);
    net->deregMr(sc, mh);
    net->closeSend(sc);
  }
  if (net->finalize) net->finalize(ctx);
  free(buf);
  return 0;
}
