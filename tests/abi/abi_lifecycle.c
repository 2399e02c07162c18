/* mplane ABI harness: a connection's life, from connect to close, and what can go wrong in it.
 *
 *   dead-listener    connect to a closed listener: an error within 10 s, a WARN naming the peer
 *   connect-timeout  TCP handshakes that never complete: MPLANE_CONNECT_TIMEOUT ends connect (socket only)
 *   silent-listener  a TCP listener that accepts and never answers: isend fails after
 *                    MPLANE_CONNECT_TIMEOUT (socket only)
 *   half-open        abandoned and inconsistent handshakes do not clog the listener (socket only)
 *   strangers        64 silent sockets, an HTTP request, a bad IB record on the port: accept goes on
 *   byte-strangers   64 sockets that each send one byte (the first of the magic) fill the pending
 *                    table: a real peer still gets in within 3 s
 *   abort            comms closed with large sends and receives in flight on both sides
 *   close-early      the sender closes right after its sends complete: every byte still arrives
 *   ctrl-full, ctrl-big  small messages read late: control-socket writes in pieces, all intact
 *   stalled-close    a receiver closes with full socket buffers: the blocked sender ends fast */
#include <dirent.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"
#include "net/handle.h"
#include "net/socket/socket.h" /* the hello and stream count of the half-open and silent-listener fakes */
#ifdef MPLANE_ABI_IB_WIRE
#include "net/ib/ib.h" /* the IB side channel's connection record, for the strangers scenario */
#endif

/* Connect to a handle whose listener is gone: an error within 10 s, with a WARN naming the peer. */
int sc_dead_listener(void) {
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

/* A plain TCP listener beside the plugin's own (*lc), on its address, and a copy of the plugin's listen
 * handle that points at it. 0 (after a note: the scenario skips) when the transport is not socket. */
struct plain_listener {
  int fd;
  struct sockaddr_storage la;
  socklen_t sl;
  unsigned char handle[HANDLE_SIZE]; /* the plugin's handle, the plain listener's address in it */
  char port_text[16];                /* ":port", what a WARN about it names */
};

static int plain_listener_up(struct node *nd, void **lc, int sock_flags, int backlog, struct plain_listener *pl) {
  unsigned char h[HANDLE_SIZE];
  if (abi_listen(&nd->net, nd->ctx, nd->dev, h, lc) != ncclSuccess) abi_fail("listen failed");
  struct sockaddr_storage ss;
  if (!handle_sockaddr(h, &ss, &pl->sl)) {
    abi_note("SKIP: the listen handle is not a TCP address (transport is not socket)");
    return 0;
  }
  pl->fd = socket(ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC | sock_flags, 0);
  pl->la = ss;
  if (pl->la.ss_family == AF_INET) ((struct sockaddr_in *)&pl->la)->sin_port = 0;
  else ((struct sockaddr_in6 *)&pl->la)->sin6_port = 0;
  if (pl->fd < 0 || bind(pl->fd, (struct sockaddr *)&pl->la, pl->sl) != 0 || listen(pl->fd, backlog) != 0)
    abi_fail("plain listener: %s", strerror(errno));
  socklen_t ll = pl->sl;
  getsockname(pl->fd, (struct sockaddr *)&pl->la, &ll);
  struct mplane_handle mh;
  char why[256];
  mplane_handle_decode(h, &mh, why, sizeof(why));
  memcpy(mh.payload, &pl->la, pl->sl);
  if (mplane_handle_encode(&mh, pl->handle) != ncclSuccess) abi_fail("encode");
  snprintf(pl->port_text, sizeof(pl->port_text), ":%d", sockaddr_port(&pl->la));
  return 1;
}

/* A listener whose accept queue is full never completes the TCP handshakes: connect must give up
 * after MPLANE_CONNECT_TIMEOUT (2 s here) with a WARN, not spin forever (socket only). */
int sc_connect_timeout(void) {
  setenv("MPLANE_CONNECT_TIMEOUT", "2", 1);
  struct node nd;
  node_up(&nd, g_opts.version);
  void *lc = NULL;
  /* a plain listener with a backlog of 0 that never accepts, filled by one idle connection */
  struct plain_listener pl;
  if (!plain_listener_up(&nd, &lc, 0, 0, &pl)) return 77;
  int filler[4];
  for (int i = 0; i < 4; i++) {
    filler[i] = socket(pl.la.ss_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (connect(filler[i], (struct sockaddr *)&pl.la, pl.sl) != 0 && errno != EINPROGRESS)
      abi_fail("filler connect: %s", strerror(errno));
  }
  usleep(100000);
  size_t mark = abi_log_mark();
  void *sc = NULL;
  ncclResult_t res = ncclSuccess;
  double t0 = abi_now();
  while (res == ncclSuccess && !sc && abi_now() - t0 < 8) {
    double t1 = abi_now();
    res = abi_connect(&nd.net, nd.ctx, nd.dev, pl.handle, &sc);
    timed(t1, "connect");
    usleep(1000);
  }
  double dt = abi_now() - t0;
  if (sc) {
    abi_note("connect completed anyway (the kernel accepted more than the backlog): nothing to check");
  } else {
    if (res == ncclSuccess) abi_fail("connect still pending after %.1f s with MPLANE_CONNECT_TIMEOUT=2", dt);
    if (dt < 1.5) abi_note("connect failed after %.2f s, before the deadline (result %d)", dt, res);
    if (!abi_log_warn_has(mark, pl.port_text, NULL)) {
      abi_log_dump(mark, "WARN check");
      abi_fail("no WARN names the unreachable peer (%s)", pl.port_text);
    }
    abi_note("connect gave up after %.2f s with result %d", dt, res);
  }
  if (sc) abi_close_send(&nd.net, sc);
  for (int i = 0; i < 4; i++) close(filler[i]);
  close(pl.fd);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return 0;
}

/* A plain TCP listener that accepts every connection and never says a word (not mplane, or an
 * mplane rank that never calls accept): connect completes (our hellos fit in the kernel), but the
 * acceptor's ACK never comes, so isend must fail - with a WARN naming the peer and the variable -
 * about MPLANE_CONNECT_TIMEOUT (2 s here) after connect, never block, never return NULL forever
 * (socket only). */
int sc_silent_listener(void) {
  setenv("MPLANE_CONNECT_TIMEOUT", "2", 1);
  struct node nd;
  node_up(&nd, g_opts.version);
  void *lc = NULL;
  struct plain_listener pl;
  if (!plain_listener_up(&nd, &lc, SOCK_NONBLOCK, 64, &pl)) return 77;
  int lfd = pl.fd;
  int acc[MPS_MAX_STREAMS + 1], nacc = 0;
  size_t mark = abi_log_mark();
  void *sc = NULL;
  double t0 = abi_now();
  while (!sc) {
    double t1 = abi_now();
    if (abi_connect(&nd.net, nd.ctx, nd.dev, pl.handle, &sc) != ncclSuccess) abi_fail("connect to a listening port failed");
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
  if (!abi_log_warn_has(mark, pl.port_text, "no mplane handshake within 2 s (MPLANE_CONNECT_TIMEOUT)", NULL)) {
    abi_log_dump(mark, "WARN check");
    abi_fail("no WARN names the silent peer (%s) and MPLANE_CONNECT_TIMEOUT", pl.port_text);
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
int sc_half_open(void) {
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
  hello_init(&hello);
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
int sc_strangers(void) {
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

/* 64 strangers that each send one byte - the first byte of the handshake's magic, so that no check
 * of what they sent can tell them from a real connector - fill the listener's table of 64 pending
 * connections. A real peer must still be accepted promptly: a full table makes room by dropping the
 * oldest connection whose handshake is not whole, whatever it sent (before, only a silent one was
 * dropped, and a one-byte stranger kept its slot 30 s on sockets, MPLANE_CONNECT_TIMEOUT on IB). */
int sc_byte_strangers(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  if (rank == 1) return real_peer_send_one(&pp, &nd, 60013, 93, 6, "after the one-byte strangers");
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
  uint32_t magic = MPLANE_HANDLE_MAGIC; /* the socket transport's hello */
#ifdef MPLANE_ABI_IB_WIRE
  if (h.transport == MPLANE_HANDLE_IB) magic = MPIB_MAGIC; /* the IB side channel's connection record */
#endif
  const unsigned char first = (unsigned char)(magic & 0xff); /* little endian: the byte a peer sends first */
  enum { NSTRANGERS = 64 };
  int strangers[NSTRANGERS], port;
  for (int i = 0; i < NSTRANGERS; i++) {
    strangers[i] = tcp_client(&ss, sl, &port);
    if (send(strangers[i], &first, 1, MSG_NOSIGNAL) != 1) abi_fail("send");
  }
  /* Accept for 1.5 s: the strangers take the table and their byte is read. */
  for (double t0 = abi_now(); abi_now() - t0 < 1.5;) {
    void *rc = NULL;
    if (abi_accept(&nd.net, lc, &rc) != ncclSuccess) abi_fail("accept failed because of one-byte strangers on the port");
    if (rc) abi_fail("a one-byte stranger became a connection");
    usleep(2000);
  }
  double waited = accept_real_peer(&nd, &pp, handle, lc, 60013, 93, 6, 3,
                                   "with 64 one-byte strangers on the port: they keep real peers out");
  abi_note("the real peer was accepted %.3f s after 64 one-byte strangers", waited);
  for (int i = 0; i < NSTRANGERS; i++) close(strangers[i]);
  abi_close_listen(&nd.net, lc);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

/* NCCL aborting a communicator: comms closed with sends and receives still in flight, large ones,
 * on both sides. Every close returns promptly, nothing crashes, and the next connection is clean. */
int sc_abort(void) {
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
int sc_close_early(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
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
        ops[i].req = post_recv(&nd, l.rc, 1, ops[i].data, ops[i].size, ops[i].tag, ops[i].mh);
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
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  int group = recv_group(&nd);
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
        ops[i].req = post_recv(&nd, l.rc, ops[i].n, ops[i].data, ops[i].size, ops[i].tag, ops[i].mh);
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
  return pair_down(&pp, rank, &nd, &l);
}

int sc_ctrl_full(void) {
  setenv("MPLANE_SOCKET_INLINE_BYTES", "64K", 1);
  setenv("MPLANE_SOCKET_INLINE_BUSY", "0", 1); /* inline with every send in flight, so the socket fills */
  static const size_t pick[] = {65536, 1, 65536, 40000, 65536 + 1, 65536, 0, 65536, 65535};
  return ctrl_rounds(pick, sizeof(pick) / sizeof(pick[0]), OP_BUFS, "around the inline limit");
}

/* The same with MPLANE_SOCKET_INLINE_BYTES=1M: every message rides the control socket and most are
 * bigger than its buffers, so each is written and landed in many pieces. (Both scenarios lift
 * MPLANE_SOCKET_INLINE_BUSY, which by default sends mid-sized messages through helper threads
 * while others are in flight.) */
int sc_ctrl_big(void) {
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

int sc_stalled_close(void) {
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
        req[i] = post_recv(&nd, l.rc, 1, &buf[i], &sz, &tag, &mh[i]);
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

