/* mplane ABI harness: a peer that fails, on any transport.
 *
 *   kill-receiver, kill-sender  the peer is SIGKILLed mid-transfer: the survivor gets an error within
 *                               10 s with a WARN naming the peer, and its closes neither hang nor crash
 *   short-recv    a message bigger than the receive buffer: ncclInvalidUsage on both sides, nothing
 *                 written past the buffer
 *   bad-handle    handles that are not ours (magic, version, transport, lengths, garbage): connect fails
 *                 at once with a WARN; a good handle still connects afterwards */
#include <signal.h>
#include <sys/wait.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"
#include "net/handle.h"

/* One side streams big messages to the other; the survivor kills the peer (SIGKILL) once the first
 * message is through and keeps driving its requests: it must get an error within 10 s, with a
 * WARN that names the peer. victim_sends: the killed process is the sender. */
static int kill_scenario(int victim_sends) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
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

int sc_kill_receiver(void) { return kill_scenario(0); }
int sc_kill_sender(void) { return kill_scenario(1); }

/* A receive buffer smaller than the message: ncclInvalidUsage on both sides, nothing written past
 * the buffer. Rank 1 receives, rank 0 sends. */
int sc_short_recv(void) {
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
int sc_bad_handle(void) {
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

