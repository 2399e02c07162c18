/* mplane RMA hostile-peer tests: the plugin (dlopened, ncclRmaPlugin_v14, socket transport) is rank
 * 0 of a two-rank group whose rank 1 is a raw-socket peer in a child process, which speaks the wire
 * (net/socket/socket_rma.h) as a careless, dying or hostile peer would. Each scenario is a defect
 * that once hung, grew without bound or touched freed memory; each fails on the code before its fix.
 *
 *   rma-hostile --plugin PATH SCENARIO
 *
 *   strangers       an HTTP request and a silent socket on the group's listener, an HTTP request and
 *                   a hello of another version on the context's listener, before the real peer:
 *                   connect and createContext go on, and the peer's put and signal land
 *   badhandle       (no peer) rank 0's handle names a UNIX socket, then an IPv4 address with addrlen
 *                   128: connect refuses each (ncclInvalidArgument) and never reaches either listener
 *   partialget-die  the peer answers a get with its header and half the bytes, then exits: test()
 *                   ends the get with an error
 *   partialget-stall the same, but the peer stays alive and silent: the get fails once
 *                   MPLANE_CONNECT_TIMEOUT (3 s here) has passed
 *   noread          the peer sends 400k gets and reads no answer: the plugin's memory grows by less
 *                   than 48 MiB and the connection is cut, with a WARN naming the peer, after the timeout
 *   dereg-put       half of a put's bytes have landed when the window is deregistered and its pages
 *                   made inaccessible: the rest is dropped, the put is refused, its signal not applied
 *   dereg-get       1500 gets of 64 KiB are queued, their answers unsent (the peer reads nothing yet),
 *                   when the window is deregistered and made inaccessible: every answer the peer then
 *                   reads is whole and right, or a refusal; some are refusals
 *   stopread-get    the peer asks for a 32 MiB get, reads nothing (the writer blocks mid-answer), then
 *                   sends a record without the magic: the connection fails, deregMrSym returns, the
 *                   window is overwritten; every byte the peer then reads is the window's old content
 *   stopread-put    the same for a 32 MiB put of ours: test() fails it, deregMrSym returns, the window
 *                   is overwritten; no overwritten byte reaches the peer */
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/nccl/rma_v14.h"
#include "net/socket/socket_rma.h"

#define WIN (1u << 20)
#define BIGWIN (32u << 20) /* stopread-*: the window of the op the peer stops reading */
#define DEADLINE_S 20

static size_t g_win = WIN; /* rank 0's data window, as both processes register it */

static const ncclRma_v14_t *rma;
static const char *who = "rank 0";
static char g_warns[8192];
static size_t g_warns_len;

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "%s: FAIL: ", who);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  _exit(1);
}

#define CHECK(call)                                                               \
  do {                                                                            \
    ncclResult_t r_ = (call);                                                     \
    if (r_ != ncclSuccess) die("%s returned %d (line %d)", #call, r_, __LINE__); \
  } while (0)

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec / 1e9;
}

static void logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  char buf[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_WARN) {
    fprintf(stderr, "%s: WARN %s:%d %s\n", who, file, line, buf);
    size_t n = strlen(buf);
    if (g_warns_len + n + 2 < sizeof(g_warns)) {
      memcpy(g_warns + g_warns_len, buf, n);
      g_warns_len += n;
      g_warns[g_warns_len++] = '\n';
      g_warns[g_warns_len] = 0;
    }
  } else if (level == NCCL_LOG_INFO && getenv("HOSTILE_INFO")) {
    fprintf(stderr, "%s: INFO %s\n", who, buf);
  }
}

static uint8_t pat(uint64_t off) { return (uint8_t)(off * 7 + (off >> 12) + 3); }

/* ---- the raw peer (rank 1, a child process) ---- */
static int to_child[2], to_parent[2];

static void say(int fd, char c) {
  if (write(fd, &c, 1) != 1) die("pipe write: %s", strerror(errno));
}
static char hear(int fd) {
  char c;
  if (read(fd, &c, 1) != 1) die("pipe read: the other process is gone");
  return c;
}

static void put_all(int fd, const void *p, size_t n) {
  const char *b = p;
  while (n) {
    ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) die("send: %s", strerror(errno));
    b += w;
    n -= (size_t)w;
  }
}

static int get_all(int fd, void *p, size_t n) {
  char *b = p;
  while (n) {
    ssize_t r = recv(fd, b, n, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    b += r;
    n -= (size_t)r;
  }
  return 0;
}

static int dial_to(const struct mpr_handle *h, int rcvbuf) {
  int fd = socket(h->addr.sa.sa_family, SOCK_STREAM, 0);
  if (fd < 0) die("socket: %s", strerror(errno));
  if (rcvbuf) setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &rcvbuf, sizeof(rcvbuf));
  if (connect(fd, &h->addr.sa, h->addrlen) != 0) die("connect to rank 0: %s", strerror(errno));
  return fd;
}

static int stranger(const struct mpr_handle *h, const char *says) {
  int fd = dial_to(h, 0);
  if (says) put_all(fd, says, strlen(says));
  return fd;
}

static const char http[] = "GET / HTTP/1.0\r\n\r\n";

/* Rank 1's half of connect, two regMrSym and createContext(1 context): the data connection's fd. */
static int peer_join(const struct mpr_handle *h0, int strangers, int rcvbuf) {
  if (strangers) {
    stranger(h0, http);
    stranger(h0, NULL); /* says nothing, stays open */
  }
  int ctrl = dial_to(h0, 0);
  struct mpr_hello hello = {.magic = MPR_MAGIC, .version = MPR_VERSION, .kind = 0, .rank = 1, .nranks = 2,
                            .context = -1};
  put_all(ctrl, &hello, sizeof(hello));
  for (uint32_t id = 0; id < 2; id++) { /* regMrSym's order check */
    struct { uint32_t id, pad; uint64_t size; } theirs, mine = {.id = id, .size = id ? 64 : g_win};
    put_all(ctrl, &mine, sizeof(mine));
    if (get_all(ctrl, &theirs, sizeof(theirs)) != 0 || theirs.id != id) die("regMrSym %u: rank 0 said otherwise", id);
  }
  struct mpr_handle ch;
  if (get_all(ctrl, &ch, sizeof(ch)) != 0) die("createContext: no handle from rank 0");
  put_all(ctrl, &ch, sizeof(ch)); /* rank 0 never dials rank 1: any valid handle will do */
  if (strangers) {
    stranger(&ch, http);
    int s = stranger(&ch, NULL);
    struct mpr_hello old = hello;
    old.version = MPR_VERSION + 7;
    old.kind = 1;
    old.context = 0;
    put_all(s, &old, sizeof(old));
  }
  int fd = dial_to(&ch, rcvbuf);
  hello.kind = 1;
  hello.context = 0;
  put_all(fd, &hello, sizeof(hello));
  return fd;
}

static struct mpr_msg rec(uint16_t type, uint32_t win, uint64_t off, uint64_t size, uint64_t id) {
  return (struct mpr_msg){.magic = MPR_MAGIC, .type = type, .win = win, .sig_win = MPR_NO_WIN, .off = off,
                          .size = size, .id = id};
}

/* The next record of a type, skipping nothing else (the plugin sends rank 1 only what it is asked). */
static void expect_rec(int fd, uint16_t type, struct mpr_msg *m) {
  if (get_all(fd, m, sizeof(*m)) != 0) die("the connection closed before a record of type %u", type);
  if (m->magic != MPR_MAGIC || m->type != type) die("a record of type %u, not %u", m->type, type);
}

static void send_pattern(int fd, uint64_t off, uint64_t n) {
  static char buf[64 << 10];
  while (n) {
    size_t k = n < sizeof(buf) ? n : sizeof(buf);
    for (size_t i = 0; i < k; i++) buf[i] = (char)pat(off + i);
    put_all(fd, buf, k);
    off += k;
    n -= k;
  }
}

/* stopread-*: the rest of what arrives after a record of `type` (rank 0's get answer or put), read
 * to the end of the connection: every data byte must be the window's content from before
 * deregMrSym (pat), never what rank 0 wrote into the window after it returned (pat ^ 0xff). */
static int peer_read_rest(int fd, uint16_t type) {
  struct mpr_msg m;
  expect_rec(fd, type, &m);
  if (m.size != BIGWIN) die("a record of %llu bytes, not %u", (unsigned long long)m.size, BIGWIN);
  static char buf[64 << 10];
  uint64_t got = 0;
  for (;;) {
    ssize_t r = recv(fd, buf, sizeof(buf), 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) break;
    for (ssize_t k = 0; k < r; k++)
      if ((uint8_t)buf[k] != pat(got + (uint64_t)k))
        die("byte %llu of the %s's data is 0x%02x, written into the window after deregMrSym returned (it was "
            "0x%02x before)", (unsigned long long)(got + (uint64_t)k), type == MPR_PUT ? "put" : "get answer",
            (uint8_t)buf[k], pat(got + (uint64_t)k));
    got += (uint64_t)r;
  }
  fprintf(stderr, "%s: %llu of the %u bytes came, none read after deregMrSym returned\n", who,
          (unsigned long long)got, BIGWIN);
  if (got >= BIGWIN) die("all of the data came: the connection was not cut when it failed");
  return 0;
}

static int peer_main(const char *sc, const struct mpr_handle *h0) {
  who = "rank 1 (raw peer)";
  int rcvbuf = !strcmp(sc, "dereg-get") || !strncmp(sc, "stopread", 8) ? 4096 : 0;
  int fd = peer_join(h0, !strcmp(sc, "strangers"), rcvbuf);
  struct mpr_msg m;
  if (!strcmp(sc, "strangers")) {
    struct mpr_msg p = rec(MPR_PUT, 0, 4096, 4096, 1);
    p.sig_win = 1;
    p.sig_off = 0;
    p.sig_op = NCCL_NET_SIGNAL_OP_INC;
    put_all(fd, &p, sizeof(p));
    send_pattern(fd, 4096, 4096);
    expect_rec(fd, MPR_ACK, &m);
    if (m.status != MPR_OK) die("the put was refused (status %u)", m.status);
    hear(to_child[0]);
    return 0;
  }
  if (!strncmp(sc, "partialget", 10)) {
    expect_rec(fd, MPR_GET, &m);
    struct mpr_msg a = rec(MPR_GET_RESP, m.win, m.off, m.size, m.id);
    put_all(fd, &a, sizeof(a));
    send_pattern(fd, 0, m.size / 2);
    if (!strcmp(sc, "partialget-die")) _exit(0); /* as a crash would: the socket closes */
    hear(to_child[0]);                           /* alive, silent, until rank 0 is done */
    return 0;
  }
  if (!strcmp(sc, "noread")) {
    static struct mpr_msg batch[1024];
    for (int i = 0; i < 1024; i++) batch[i] = rec(MPR_GET, 0, 0, 1, 0);
    for (int k = 0; k < 400; k++) {
      for (int i = 0; i < 1024; i++) batch[i].id = (uint64_t)k * 1024 + (uint64_t)i + 1;
      const char *b = (const char *)batch;
      size_t n = sizeof(batch);
      while (n) {
        ssize_t w = send(fd, b, n, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return 0; /* cut by rank 0: what this scenario expects */
        b += w;
        n -= (size_t)w;
      }
    }
    hear(to_child[0]);
    return 0;
  }
  if (!strcmp(sc, "dereg-put")) {
    struct mpr_msg p = rec(MPR_PUT, 0, 0, 256 << 10, 1);
    p.sig_win = 1;
    p.sig_off = 8;
    p.sig_op = NCCL_NET_SIGNAL_OP_INC;
    put_all(fd, &p, sizeof(p));
    send_pattern(fd, 0, 64 << 10);
    say(to_parent[1], 'h');
    if (hear(to_child[0]) != 'd') die("no word of the deregistration");
    send_pattern(fd, 64 << 10, 192 << 10);
    expect_rec(fd, MPR_ACK, &m);
    if (m.status != MPR_BAD_WIN) die("a put into a window deregistered under it was answered with status %u, not a "
                                     "refusal (%d)", m.status, MPR_BAD_WIN);
    hear(to_child[0]);
    return 0;
  }
  if (!strcmp(sc, "dereg-get")) {
    enum { N = 1500, SZ = 64 << 10 };
    for (int i = 0; i < N; i++) {
      struct mpr_msg g = rec(MPR_GET, 0, (uint64_t)(i % 16) * SZ, SZ, (uint64_t)i + 1);
      put_all(fd, &g, sizeof(g));
    }
    say(to_parent[1], 's');
    if (hear(to_child[0]) != 'g') die("no word of the deregistration");
    usleep(100000);
    static char buf[SZ];
    int ok = 0, refused = 0;
    for (int i = 0; i < N; i++) {
      expect_rec(fd, MPR_GET_RESP, &m);
      if (m.id != (uint64_t)i + 1) die("answer %d has id %llu", i, (unsigned long long)m.id);
      if (m.status == MPR_BAD_WIN && m.size == 0) {
        refused++;
        continue;
      }
      if (m.status != MPR_OK || m.size != SZ) die("answer %d: status %u, %llu bytes", i, m.status, (unsigned long long)m.size);
      if (get_all(fd, buf, SZ) != 0) die("answer %d: the connection closed inside its bytes", i);
      for (size_t k = 0; k < SZ; k++)
        if ((uint8_t)buf[k] != pat((uint64_t)(i % 16) * SZ + k)) die("answer %d: byte %zu is wrong", i, k);
      ok++;
    }
    fprintf(stderr, "%s: %d answers whole and right, %d refused\n", who, ok, refused);
    if (!refused) die("no answer was refused: the deregistration came too late to test anything");
    say(to_parent[1], 'k');
    hear(to_child[0]);
    return 0;
  }
  if (!strncmp(sc, "stopread", 8)) {
    int get = !strcmp(sc, "stopread-get");
    if (get) {
      struct mpr_msg g = rec(MPR_GET, 0, 0, BIGWIN, 1);
      put_all(fd, &g, sizeof(g));
    }
    if (hear(to_child[0]) != 'b') die("rank 0 did not say its writer is under way");
    struct mpr_msg bad = rec(MPR_PUT, 0, 0, 0, 7);
    bad.magic = 0xbadc0de;
    put_all(fd, &bad, sizeof(bad));
    if (hear(to_child[0]) != 'r') die("no word of the deregistration");
    peer_read_rest(fd, get ? MPR_GET_RESP : MPR_PUT);
    hear(to_child[0]);
    return 0;
  }
  die("unknown scenario %s", sc);
}

/* ---- rank 0: the plugin ---- */
struct rank0 {
  void *ctx, *cc, *rc, *mh_data, *mh_sig;
  char *data;
  uint64_t *sig;
};

static void progress(struct rank0 *e) {
  if (e->rc && rma->rmaProgress) rma->rmaProgress(e->rc);
}

static long rss_kib(void) {
  long pages = 0, res = 0;
  FILE *f = fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (fscanf(f, "%ld %ld", &pages, &res) != 2) res = 0;
  fclose(f);
  return res * (sysconf(_SC_PAGESIZE) / 1024);
}

/* Wait for req: 1 done with success, -1 done with an error, 0 not within secs. */
static int wait_req(struct rank0 *e, void *req, double secs) {
  double t0 = now_s();
  while (now_s() - t0 < secs) {
    int done = 0;
    ncclResult_t r = rma->test(e->cc, req, &done);
    if (done || r != ncclSuccess) return r == ncclSuccess ? 1 : -1;
    progress(e);
    sched_yield();
  }
  return 0;
}

/* zero_head: the first 256 KiB start zeroed (dereg-put watches the peer's bytes arrive there). */
static void rank0_setup(struct rank0 *e, void *lc, char handles[2][NCCL_NET_HANDLE_MAXSIZE], int zero_head) {
  void *h[2] = {handles[0], handles[1]};
  CHECK(rma->connect(e->ctx, h, 2, 0, lc, &e->cc));
  e->data = mmap(NULL, g_win, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  e->sig = calloc(8, sizeof(uint64_t));
  if (e->data == MAP_FAILED || !e->sig) die("out of memory");
  for (uint64_t o = 0; o < g_win; o++) e->data[o] = (char)pat(o);
  if (zero_head) memset(e->data, 0, 256 << 10);
  CHECK(rma->regMrSym(e->cc, e->data, g_win, NCCL_PTR_HOST, 0, &e->mh_data));
  CHECK(rma->regMrSym(e->cc, e->sig, 64, NCCL_PTR_HOST, NCCL_NET_MR_FLAG_FORCE_SO, &e->mh_sig));
  ncclRmaConfig_v14_t cfg = {.nContexts = 1, .trafficClass = 2, .rankStride = 1};
  CHECK(rma->createContext(e->cc, &cfg, &e->rc));
}

/* A scenario that must leave no error: checked before the peer is let go (its exit closes the
 * connection, which is an error of its own). */
static void release_peer(struct rank0 *e, int want_error) {
  bool err = false;
  CHECK(rma->queryLastError(e->rc, &err));
  if (!want_error && err) die("queryLastError reports an error");
  say(to_child[1], 'x');
}

static void make_inaccessible(struct rank0 *e) {
  if (mprotect(e->data, g_win, PROT_NONE) != 0) die("mprotect: %s", strerror(errno));
}

static int child_status(pid_t pid, double secs) {
  double t0 = now_s();
  int st;
  while (now_s() - t0 < secs) {
    pid_t r = waitpid(pid, &st, WNOHANG);
    if (r == pid) return WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    usleep(10000);
  }
  kill(pid, SIGKILL);
  waitpid(pid, &st, 0);
  return -1;
}

static void progress_for(struct rank0 *e, double secs) {
  double t0 = now_s();
  while (now_s() - t0 < secs) {
    progress(e);
    usleep(100);
  }
}

/* stopread-*: the writer thread is inside a 32 MiB record from the window (the peer reads nothing)
 * when the peer's record without the magic fails the connection; then deregMrSym, and the window is
 * overwritten at once, as a caller that frees or reuses it would. */
static void scenario_stopread(struct rank0 *e, int get) {
  void *req = NULL;
  if (!get) CHECK(rma->iput(e->rc, 0, 0, e->mh_data, BIGWIN, 0, e->mh_data, 1, &req));
  progress_for(e, 0.3); /* the get served, the writer blocked in its answer (or in our put) */
  say(to_child[1], 'b');
  double t0 = now_s();
  bool err = false;
  while (!err && now_s() - t0 < DEADLINE_S) {
    progress_for(e, 0.01);
    CHECK(rma->queryLastError(e->rc, &err));
  }
  if (!err) die("a record without the magic did not fail the connection within %d s", DEADLINE_S);
  if (req && wait_req(e, req, DEADLINE_S) != -1) die("the put on a failed connection did not end in an error");
  t0 = now_s();
  CHECK(rma->deregMrSym(e->cc, e->mh_data));
  e->mh_data = NULL;
  double dt = now_s() - t0;
  for (uint64_t o = 0; o < g_win; o++) e->data[o] = (char)(pat(o) ^ 0xff);
  fprintf(stderr, "rank 0: deregMrSym returned after %.3f s; the window is overwritten\n", dt);
  say(to_child[1], 'r');
  progress_for(e, 0.5);
  release_peer(e, 1);
}

static int bad_handle_refused(void *ctx, void *lc, struct mpr_handle *bad, int listener, const char *what) {
  char handles[2][NCCL_NET_HANDLE_MAXSIZE] = {{0}};
  memcpy(handles[0], bad, sizeof(*bad));
  void *h[2] = {handles[0], handles[1]}, *cc = NULL;
  ncclResult_t r = rma->connect(ctx, h, 2, 1, lc, &cc);
  if (r == ncclSuccess) die("connect took a handle with %s", what);
  if (r != ncclInvalidArgument) die("connect refused a handle with %s with %d, not ncclInvalidArgument (%d)", what, r,
                                    ncclInvalidArgument);
  struct pollfd p = {.fd = listener, .events = POLLIN};
  if (poll(&p, 1, 200) > 0) die("connect refused a handle with %s but reached its address first", what);
  fprintf(stderr, "rank 1: a handle with %s: refused, nothing reached\n", what);
  return 0;
}

static int scenario_badhandle(void *ctx, void *lc) {
  /* A UNIX socket the handle names. */
  struct mpr_handle bad = {.magic = MPR_MAGIC, .version = MPR_VERSION};
  char path[24];
  snprintf(path, sizeof(path), "/tmp/mph-%d", (int)getpid() % 100000);
  unlink(path);
  struct sockaddr_un ua = {.sun_family = AF_UNIX};
  memcpy(ua.sun_path, path, strlen(path) + 1);
  bad.addrlen = (uint16_t)(offsetof(struct sockaddr_un, sun_path) + strlen(path) + 1); /* fits the handle */
  memcpy(&bad.addr, &ua, bad.addrlen);
  int ul = socket(AF_UNIX, SOCK_STREAM, 0);
  if (ul < 0 || bind(ul, (struct sockaddr *)&ua, sizeof(ua)) != 0 || listen(ul, 4) != 0) die("a UNIX listener: %s", strerror(errno));
  bad_handle_refused(ctx, lc, &bad, ul, "a UNIX socket address");
  close(ul);
  unlink(path);
  /* An IPv4 listener the handle names, with an address length past the handle's end. */
  int tl = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in ta = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t tlen = sizeof(ta);
  if (tl < 0 || bind(tl, (struct sockaddr *)&ta, sizeof(ta)) != 0 || listen(tl, 4) != 0 ||
      getsockname(tl, (struct sockaddr *)&ta, &tlen) != 0)
    die("an IPv4 listener: %s", strerror(errno));
  memset(&bad, 0, sizeof(bad));
  bad.magic = MPR_MAGIC;
  bad.version = MPR_VERSION;
  bad.addr.sin = ta;
  bad.addrlen = 128;
  bad_handle_refused(ctx, lc, &bad, tl, "addrlen 128");
  close(tl);
  return 0;
}

int main(int argc, char **argv) {
  const char *plugin = NULL, *sc = NULL;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--plugin") && i + 1 < argc) plugin = argv[++i];
    else sc = argv[i];
  }
  if (!plugin || !sc) die("usage: rma-hostile --plugin PATH SCENARIO");
  void *lib = dlopen(plugin, RTLD_NOW | RTLD_LOCAL);
  if (!lib) die("dlopen %s: %s", plugin, dlerror());
  if (!(rma = dlsym(lib, "ncclRmaPlugin_v14"))) die("%s exports no ncclRmaPlugin_v14", plugin);
  struct rank0 e = {0};
  CHECK(rma->init(&e.ctx, 0x5eed, logger));
  int ndev = 0;
  CHECK(rma->devices(&ndev));
  if (ndev < 1) die("no device");
  char handles[2][NCCL_NET_HANDLE_MAXSIZE] = {{0}};
  void *lc;
  CHECK(rma->listen(e.ctx, 0, handles[0], &lc));
  if (!strcmp(sc, "badhandle")) {
    who = "rank 1";
    scenario_badhandle(e.ctx, lc);
    CHECK(rma->closeListen(lc));
    CHECK(rma->finalize(e.ctx));
    printf("rma-hostile %s: ok\n", sc);
    return 0;
  }
  if (!strncmp(sc, "stopread", 8)) g_win = BIGWIN;
  if (pipe(to_child) != 0 || pipe(to_parent) != 0) die("pipe: %s", strerror(errno));
  pid_t pid = fork();
  if (pid == 0) _exit(peer_main(sc, (const struct mpr_handle *)handles[0]));
  rank0_setup(&e, lc, handles, !strcmp(sc, "dereg-put"));
  CHECK(rma->closeListen(lc));

  if (!strcmp(sc, "strangers")) {
    double t0 = now_s();
    while (__atomic_load_n(&e.sig[0], __ATOMIC_ACQUIRE) != 1 && now_s() - t0 < DEADLINE_S) progress(&e);
    if (e.sig[0] != 1) die("the peer's signal never came");
    for (uint64_t o = 4096; o < 8192; o++)
      if ((uint8_t)e.data[o] != pat(o)) die("byte %llu of the peer's put is wrong", (unsigned long long)o);
    release_peer(&e, 0);
  } else if (!strncmp(sc, "partialget", 10)) {
    void *req;
    memset(e.data + (512 << 10), 0, 64 << 10);
    CHECK(rma->iget(e.rc, 0, 0, e.mh_data, 64 << 10, 512 << 10, e.mh_data, 1, &req));
    double t0 = now_s();
    int rc = wait_req(&e, req, DEADLINE_S);
    if (rc == 0) die("a get answered in part by a peer that then %s was still open after %d s",
                     strcmp(sc, "partialget-die") ? "went silent" : "died", DEADLINE_S);
    if (rc > 0) die("a get answered with half its bytes succeeded");
    fprintf(stderr, "rank 0: the get failed after %.1f s\n", now_s() - t0);
    release_peer(&e, 1);
  } else if (!strcmp(sc, "noread")) {
    long base = rss_kib(), peak = base;
    double t0 = now_s();
    bool err = false;
    while (!err && now_s() - t0 < DEADLINE_S) {
      progress_for(&e, 0.05);
      long r = rss_kib();
      if (r > peak) peak = r;
      CHECK(rma->queryLastError(e.rc, &err));
    }
    fprintf(stderr, "rank 0: resident grew by %ld KiB; error %s after %.1f s\n", peak - base, err ? "reported" : "not reported",
            now_s() - t0);
    if (peak - base > 48 * 1024) die("a peer that reads nothing grew this process by %ld KiB", peak - base);
    if (!err) die("a peer that reads nothing was not cut within %d s", DEADLINE_S);
    if (!strstr(g_warns, "has taken none of the")) die("no WARN says the peer takes no answers");
    kill(pid, SIGKILL); /* it may still be blocked sending into the socket that nobody reads now */
    waitpid(pid, NULL, 0);
    pid = 0;
  } else if (!strcmp(sc, "dereg-put")) {
    if (hear(to_parent[0]) != 'h') die("the peer did not start its put");
    double t0 = now_s();
    while ((uint8_t)e.data[65535] != pat(65535) && now_s() - t0 < DEADLINE_S) progress(&e);
    if ((uint8_t)e.data[65535] != pat(65535)) die("the first half of the peer's put never landed");
    CHECK(rma->deregMrSym(e.cc, e.mh_data));
    e.mh_data = NULL;
    make_inaccessible(&e);
    say(to_child[1], 'd');
    progress_for(&e, 1.0);
    if (e.sig[1] != 0) die("the signal of a put refused after its window went was applied (%llu)",
                           (unsigned long long)e.sig[1]);
    release_peer(&e, 0);
  } else if (!strcmp(sc, "dereg-get")) {
    if (hear(to_parent[0]) != 's') die("the peer did not send its gets");
    progress_for(&e, 0.3);
    say(to_child[1], 'g');
    double t0 = now_s();
    CHECK(rma->deregMrSym(e.cc, e.mh_data));
    e.mh_data = NULL;
    fprintf(stderr, "rank 0: deregMrSym returned after %.2f s\n", now_s() - t0);
    make_inaccessible(&e);
    t0 = now_s();
    struct pollfd p = {.fd = to_parent[0], .events = POLLIN};
    while (poll(&p, 1, 0) == 0 && now_s() - t0 < DEADLINE_S) progress(&e);
    if (hear(to_parent[0]) != 'k') die("the peer did not read its answers");
    release_peer(&e, 0);
  } else if (!strncmp(sc, "stopread", 8)) {
    scenario_stopread(&e, !strcmp(sc, "stopread-get"));
  } else {
    die("unknown scenario %s", sc);
  }
  int st = pid ? child_status(pid, DEADLINE_S) : 0;
  if (st != 0) die("the raw peer ended with status %d", st);
  if (e.mh_data) CHECK(rma->deregMrSym(e.cc, e.mh_data));
  CHECK(rma->deregMrSym(e.cc, e.mh_sig));
  double t0 = now_s();
  CHECK(rma->destroyContext(e.rc));
  if (now_s() - t0 > DEADLINE_S) die("destroyContext took %.1f s", now_s() - t0);
  CHECK(rma->closeColl(e.cc));
  CHECK(rma->finalize(e.ctx));
  free(e.sig); /* LeakSanitizer runs this test (tests/abi/sanitize.sh) */
  munmap(e.data, g_win);
  printf("rma-hostile %s: ok\n", sc);
  return 0;
}
