/* The stream listener (net/socket/socket_conn.c, "lazy data streams"): data streams that connect
 * after accept, to the port the ACK names, reach their connection by the nonce of their hello;
 * anything else that connects there (bytes that are not mplane, a hello naming no connection, a
 * stream index already taken, a control hello) is dropped with a WARN and costs the connection
 * nothing. A raw TCP peer plays the sender over loopback. */
#include <arpa/inet.h>
#include <dirent.h>
#include <netinet/in.h>
#include <poll.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "net/handle.h"
#include "net/socket/socket.h"
#include "plugin/net_core.h"
#include "raw_peer.h"

struct rig {
  void *lc, *rc;
  int ctrl;
  struct sockaddr_in addr; /* the listener's; the stream listener has the same address, its own port */
  unsigned stream_port;
  struct mps_hello hello;
  char buf[8192];
  void *req;
  uint32_t slot;
};

static int tcp_to(const struct sockaddr_in *a, unsigned port) {
  struct sockaddr_in to = *a;
  to.sin_port = htons((unsigned short)port);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  assert_int_equal(connect(fd, (struct sockaddr *)&to, sizeof(to)), 0);
  return fd;
}

/* A lazy connection accepted by the plugin: its control socket alone; one 8 KiB receive posted. */
static void rig_up(struct rig *g) {
  memset(g, 0, sizeof(*g));
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  assert_int_equal(mplane_net_listen(mplane_net_default_ctx(), 0, handle, &g->lc), ncclSuccess);
  struct mplane_handle h;
  char why[256];
  assert_int_equal(mplane_handle_decode(handle, &h, why, sizeof(why)), ncclSuccess);
  memcpy(&g->addr, h.payload, sizeof(g->addr));
  g->ctrl = tcp_to(&g->addr, ntohs(g->addr.sin_port));
  g->hello = (struct mps_hello){.magic = MPLANE_HANDLE_MAGIC, .version = MPLANE_PROTOCOL_VERSION, .type = MPS_HELLO,
                                .node_id = 9, .nonce = 0x5eed0000u + (uint64_t)(uintptr_t)g, .plane = h.plane,
                                .stream = 0, .nstreams = 2, .flags = MPS_HELLO_LAZY};
  write_all(g->ctrl, &g->hello, sizeof(g->hello));
  double deadline = now() + 10;
  while (!g->rc) { /* the control socket alone makes the connection */
    assert_int_equal(mplane_net_accept(g->lc, &g->rc), ncclSuccess);
    assert_true(now() < deadline);
  }
  struct mps_ctrl m;
  read_all(g->ctrl, &m, sizeof(m));
  assert_int_equal(m.type, MPS_ACK);
  assert_true(m.ack.stream_port != 0);
  g->stream_port = m.ack.stream_port;
  void *data = g->buf;
  size_t size = sizeof(g->buf);
  int tag = 1;
  while (!g->req) {
    assert_int_equal(mplane_net_irecv(g->rc, 1, &data, &size, &tag, NULL, &g->req), ncclSuccess);
    assert_true(now() < deadline);
  }
  read_all(g->ctrl, &m, sizeof(m));
  assert_int_equal(m.type, MPS_CTS);
  g->slot = m.e[0].slot;
}

static void rig_down(struct rig *g) {
  close(g->ctrl);
  mplane_net_close_recv(g->rc);
  mplane_net_close_listen(g->lc);
}

/* The plugin closed fd within `seconds` (EOF or a reset): 1, else 0. */
static int dropped_within(int fd, double seconds) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  if (poll(&p, 1, (int)(seconds * 1000)) <= 0) return 0;
  char b;
  return recv(fd, &b, 1, MSG_DONTWAIT) <= 0;
}

/* A stream of this connection, hello said. */
static int stream_open(struct rig *g, uint16_t index, uint64_t nonce) {
  int fd = tcp_to(&g->addr, g->stream_port);
  struct mps_hello h = g->hello;
  h.stream = index;
  h.nonce = nonce;
  write_all(fd, &h, sizeof(h));
  return fd;
}

static void send_chunk(struct rig *g, int fd, uint64_t off, uint64_t len) {
  struct mps_chunk c = {.slot = g->slot, .offset = off, .len = len, .total = sizeof(g->buf)};
  char payload[4096];
  for (uint64_t i = 0; i < len; i++) payload[i] = (char)(off + i);
  write_all(fd, &c, sizeof(c));
  write_all(fd, payload, len);
}

static int test_done_within(struct rig *g, double seconds) {
  double end = now() + seconds;
  int done = 0, size = 0;
  while (now() < end) {
    if (mplane_net_test(g->req, &done, &size) != ncclSuccess) return -1;
    if (done) return 1;
    usleep(1000);
  }
  return 0;
}

static void test_strangers_dropped_streams_land(void **state) {
  (void)state;
  struct rig g;
  rig_up(&g);
  int junk = tcp_to(&g.addr, g.stream_port);
  write_all(junk, "GET / HTTP/1.0\r\n\r\n", 18); /* not mplane */
  int unknown = stream_open(&g, 1, g.hello.nonce ^ 0xdead); /* names no connection */
  int ctrl_like = stream_open(&g, 0, g.hello.nonce);         /* a control hello: not a stream's */
  assert_true(dropped_within(junk, 5));
  assert_true(dropped_within(unknown, 5));
  assert_true(dropped_within(ctrl_like, 5));
  /* the real streams still come through, in any order, and carry the message */
  int s2 = stream_open(&g, 2, g.hello.nonce);
  int s1 = stream_open(&g, 1, g.hello.nonce);
  int twin = stream_open(&g, 1, g.hello.nonce); /* index 1 again */
  assert_true(dropped_within(twin, 5));
  send_chunk(&g, s2, 4096, 4096);
  send_chunk(&g, s1, 0, 4096);
  assert_int_equal(test_done_within(&g, 5), 1);
  for (int i = 0; i < 8192; i++) assert_int_equal((unsigned char)g.buf[i], (unsigned char)i);
  int late = stream_open(&g, 1, g.hello.nonce); /* after close: the connection is gone from the table */
  rig_down(&g);
  int gone = stream_open(&g, 2, g.hello.nonce);
  assert_true(dropped_within(gone, 5));
  close(late);
  close(gone);
  close(junk);
  close(unknown);
  close(ctrl_like);
  close(twin);
  close(s1);
  close(s2);
}

/* ---- a full hello table (1024 streams that have not said hello) ---- */

static void pause_handler(int sig) {
  (void)sig;
  struct timespec t = {0, 100 * 1000 * 1000};
  nanosleep(&t, NULL);
}

/* The kernel id of the pool's thread 0 (the stream listener's, named mplane-io0), or -1. */
static pid_t io0_tid(void) {
  DIR *d = opendir("/proc/self/task");
  pid_t tid = -1;
  for (struct dirent *e; d && (e = readdir(d)) && tid < 0;) {
    char path[300], name[32] = "";
    snprintf(path, sizeof(path), "/proc/self/task/%s/comm", e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (fgets(name, sizeof(name), f) && strncmp(name, "mplane-io0\n", 11) == 0) tid = (pid_t)atoi(e->d_name);
    fclose(f);
  }
  if (d) closedir(d);
  return tid;
}

static int open_fds(void) {
  DIR *d = opendir("/proc/self/fd");
  int n = 0;
  while (d && readdir(d)) n++;
  if (d) closedir(d);
  return n;
}

#define HELLOS_MAX 1024 /* MPS_HELLOS_MAX in socket_conn.c */

/* The table full, one more stream comes and the oldest silent one is dropped, while thread 0 holds
 * an event of that oldest one from the same wait: thread 0 is held in a signal handler while the new
 * stream connects and then the oldest sends a byte, so that one epoll_wait returns the listener's
 * event first and the dropped stream's after it. Its memory must still be there then (it was freed
 * at once: AddressSanitizer's heap-use-after-free in hello_io); and the listener goes on. */
static void test_full_hello_table_drops_oldest(void **state) {
  (void)state;
  struct rlimit rl;
  getrlimit(RLIMIT_NOFILE, &rl);
  if (rl.rlim_max < 2 * HELLOS_MAX + 200) skip();
  rl.rlim_cur = rl.rlim_max;
  setrlimit(RLIMIT_NOFILE, &rl);
  struct rig g;
  rig_up(&g);
  pid_t io0 = io0_tid();
  assert_true(io0 > 0);
  static int silent[HELLOS_MAX];
  int fds0 = open_fds();
  for (int i = 0; i < HELLOS_MAX; i++) silent[i] = tcp_to(&g.addr, g.stream_port);
  double deadline = now() + 20;
  while (open_fds() < fds0 + 2 * HELLOS_MAX) { /* every one accepted: the table is full */
    assert_true(now() < deadline);
    usleep(1000);
  }
  struct sigaction sa = {.sa_handler = pause_handler}, old;
  sigaction(SIGUSR1, &sa, &old);
  assert_int_equal(syscall(SYS_tgkill, getpid(), io0, SIGUSR1), 0);
  usleep(20 * 1000); /* it is in the handler now */
  int extra = tcp_to(&g.addr, g.stream_port);     /* the listener's event first ... */
  const unsigned char first = (unsigned char)(MPLANE_HANDLE_MAGIC & 0xff);
  write_all(silent[0], &first, 1);                  /* ... then the oldest one's */
  assert_true(dropped_within(silent[0], 5));        /* made room for `extra` */
  /* and the stream listener still serves the connection */
  int s1 = stream_open(&g, 1, g.hello.nonce), s2 = stream_open(&g, 2, g.hello.nonce);
  send_chunk(&g, s1, 0, 4096);
  send_chunk(&g, s2, 4096, 4096);
  assert_int_equal(test_done_within(&g, 10), 1);
  sigaction(SIGUSR1, &old, NULL);
  rig_down(&g);
  for (int i = 0; i < HELLOS_MAX; i++) close(silent[i]);
  close(extra);
  close(s1);
  close(s2);
}

int main(void) {
  setenv("MPLANE_TRANSPORT", "socket", 1);
  setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
  if (mplane_net_global_init(NULL) != ncclSuccess) return 1;
  const struct CMUnitTest tests[] = {cmocka_unit_test(test_strangers_dropped_streams_land),
                                     cmocka_unit_test(test_full_hello_table_drops_oldest)};
  return cmocka_run_group_tests(tests, NULL, NULL);
}
