/* mplane ABI harness: fake peers, plain TCP clients at the listen address that speak our socket
 * protocol badly or not at all (socket transport only: elsewhere they skip, 77).
 *
 *   fake-peer     HTTP-looking garbage, a hang-up, three bytes then silence, silence, random bytes: each
 *                 refused with a WARN naming its port, and a real peer still gets through
 *   fake-chunks   a fake sender's overlapping, overlong and inconsistent chunks, and eager messages past
 *                 what the receiver offered: the receive fails with a WARN, never completes
 *   fake-version  a hello of another protocol version or service level: a WARN and a NACK */
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"
#include "net/handle.h"
#include "net/socket/socket.h" /* the wire structs a fake speaks */

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

int sc_fake_peer(void) {
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
  hello_init(&hello);
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

/* One process, its plugin listening at a TCP address (ss); 0 when the transport is not socket. */
static int fake_listener_up(struct node *nd, void **lc, struct sockaddr_storage *ss, socklen_t *sl) {
  node_up(nd, g_opts.version);
  unsigned char handle[HANDLE_SIZE];
  *lc = NULL;
  return listen_tcp(nd, NULL, handle, lc, ss, sl);
}

int sc_fake_chunks(void) {
  struct node nd;
  void *lc;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!fake_listener_up(&nd, &lc, &ss, &sl)) return 77;
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
  hello_init(&hello);
  hello.version = version;
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

int sc_fake_version(void) {
  struct node nd;
  void *lc;
  struct sockaddr_storage ss;
  socklen_t sl;
  if (!fake_listener_up(&nd, &lc, &ss, &sl)) return 77;
  fake_hello_refused(&nd, lc, &ss, sl, 99, 0, "a hello of protocol version 99", "version 99");
  fake_hello_refused(&nd, lc, &ss, sl, MPLANE_PROTOCOL_VERSION, 200, "a hello asking for service level 200",
                     "service level 200");
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

