/* Regression test: a sender may close its comm as soon as its last send completes (bytes in its
 * kernel), while the end of a message is still in flight on another stream. The receiver must not
 * fail on the orderly close of the first stream; it fails only if every stream closed with a receive
 * still waiting. A raw TCP peer plays the sender over loopback, speaking the wire format of
 * net/socket/socket.h, so the order of closes is exact. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "net/handle.h"
#include "net/socket/socket.h"
#include "plugin/net_core.h"
#include "raw_peer.h"

struct rig {
  void *lc, *rc;
  int fds[3]; /* control, data 0, data 1 */
  char buf[8192];
  void *req;
  uint32_t slot;
};

/* Listen through the plugin, connect 1 control + 2 data streams by hand, post one 8 KiB receive and
 * read its CTS (slot). */
static void rig_up(struct rig *g) {
  memset(g, 0, sizeof(*g));
  char handle[NCCL_NET_HANDLE_MAXSIZE];
  assert_int_equal(mplane_net_listen(mplane_net_default_ctx(), 0, handle, &g->lc), ncclSuccess);
  struct mplane_handle h;
  char why[256];
  assert_int_equal(mplane_handle_decode(handle, &h, why, sizeof(why)), ncclSuccess);
  struct sockaddr_in peer;
  memcpy(&peer, h.payload, sizeof(peer));
  for (int i = 0; i < 3; i++) {
    g->fds[i] = socket(AF_INET, SOCK_STREAM, 0);
    assert_int_equal(connect(g->fds[i], (struct sockaddr *)&peer, sizeof(peer)), 0);
    struct mps_hello hello = {.magic = MPLANE_HANDLE_MAGIC, .version = MPLANE_PROTOCOL_VERSION, .type = MPS_HELLO,
                              .node_id = 7, .nonce = 0x1234 + (uint64_t)(uintptr_t)g, .plane = h.plane,
                              .stream = (uint16_t)i, .nstreams = 2};
    write_all(g->fds[i], &hello, sizeof(hello));
  }
  double deadline = now() + 10;
  while (!g->rc) {
    assert_int_equal(mplane_net_accept(g->lc, &g->rc), ncclSuccess);
    assert_true(now() < deadline);
  }
  void *data = g->buf;
  size_t size = sizeof(g->buf);
  int tag = 1;
  while (!g->req) {
    assert_int_equal(mplane_net_irecv(g->rc, 1, &data, &size, &tag, NULL, &g->req), ncclSuccess);
    assert_true(now() < deadline);
  }
  struct mps_ctrl m;
  read_all(g->fds[0], &m, sizeof(m));
  assert_int_equal(m.type, MPS_ACK);
  read_all(g->fds[0], &m, sizeof(m));
  assert_int_equal(m.type, MPS_CTS);
  g->slot = m.e[0].slot;
}

static void send_chunk(struct rig *g, int fd, uint64_t off, uint64_t len) {
  struct mps_chunk c = {.slot = g->slot, .offset = off, .len = len, .total = sizeof(g->buf)};
  char payload[4096];
  for (uint64_t i = 0; i < len; i++) payload[i] = (char)(off + i);
  write_all(fd, &c, sizeof(c));
  write_all(fd, payload, len);
}

/* Poll test() for `seconds`: returns 1 if it completed, 0 if still pending, -1 on an error. */
static int poll_for(struct rig *g, double seconds) {
  double end = now() + seconds;
  int done = 0, size = 0;
  while (now() < end) {
    if (mplane_net_test(g->req, &done, &size) != ncclSuccess) return -1;
    if (done) return 1;
    usleep(1000);
  }
  return 0;
}

static void test_first_stream_closes_early(void **state) {
  (void)state;
  struct rig g;
  rig_up(&g);
  send_chunk(&g, g.fds[1], 0, 4096);
  close(g.fds[1]); /* this stream is finished: orderly FIN at a chunk boundary */
  assert_int_equal(poll_for(&g, 0.3), 0); /* old behaviour: an error here */
  send_chunk(&g, g.fds[2], 4096, 4096);
  close(g.fds[2]);
  close(g.fds[0]);
  assert_int_equal(poll_for(&g, 5), 1);
  for (int i = 0; i < 8192; i++) assert_int_equal((unsigned char)g.buf[i], (unsigned char)i);
  mplane_net_close_recv(g.rc);
  mplane_net_close_listen(g.lc);
}

static void test_all_streams_close_with_receive_pending(void **state) {
  (void)state;
  struct rig g;
  rig_up(&g);
  send_chunk(&g, g.fds[1], 0, 4096);
  close(g.fds[1]);
  close(g.fds[2]); /* the second half never comes */
  assert_int_equal(poll_for(&g, 5), -1);
  close(g.fds[0]);
  mplane_net_close_recv(g.rc);
  mplane_net_close_listen(g.lc);
}

int main(void) {
  setenv("MPLANE_TRANSPORT", "socket", 1);
  setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
  if (mplane_net_global_init(NULL) != ncclSuccess) return 1;
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_first_stream_closes_early),
      cmocka_unit_test(test_all_streams_close_with_receive_pending),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
