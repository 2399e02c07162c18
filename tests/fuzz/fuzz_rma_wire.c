/* Fuzz target: what a peer can write on a one-sided (RMA) connection of the socket transport.
 * The plugin's real record parser and target side (net/socket/socket_rma_conn.c) serve one
 * connection of a context whose group has two registered host windows (a 4 KiB data window and a
 * 256-byte signal window, each between guard bytes); each input is written to the peer's end of a
 * socket pair, in pieces the input chooses, while rmaProgress is called (as NCCL's progress thread
 * calls it), and the answers the plugin writes back are drained.
 *
 * Properties: no crash or sanitizer report; nothing outside the two windows is written (the guards
 * keep their pattern); a window byte changes only where some record of the input was a put that
 * covered it; the connection either keeps up (every whole record taken) or fails, within a bounded
 * number of rmaProgress calls; tearing it down returns; once a window is deregistered (deregMrSym,
 * racing the records) not one of its bytes changes again, and (built records) not one byte of it
 * leaves in an answer: it is overwritten with POISON at once, as a caller that reuses it would, and
 * no run of 8 POISON bytes may reach the peer - also when the peer had stopped reading mid-answer
 * and the connection failed under the writer; a deregMrSym on a failed connection returns within
 * CALL_LIMIT_S. FUZZ_TRACE=1 prints what became of each input.
 *
 * Input:
 *   [0] bit 0: the records are built here from 8-byte descriptors (else the bytes are the wire
 *       stream as they are); bits 1-3: piece size (0: 1 byte, calling rmaProgress after each; k:
 *       up to 16^k/16 bytes); bit 4: close the peer's end after the last byte; bit 5: the
 *       connection's reader and writer threads run, and its socket buffers are small (a few answers
 *       fill them: the writer thread blocks mid-answer while the peer reads nothing)
 *   descriptors: [type][window][signal window][signal op][off lo][off hi][size lo][size hi]
 *       window / signal window: 0 data, 1 signal, 2 a window never registered, 3 none (MPR_NO_WIN);
 *       size is capped at 8 KiB, its data follows as a pattern (a descriptor with type & 0x80: the
 *       header says size bytes but only half follow, and the input ends there); type 0x40: no
 *       record - deregMrSym of window ([1] & 1) once the stream has been written up to ([2],[3]) & 0x3fff
 *       bytes before here (so inside an earlier record); type 0x41: no record - the peer stops
 *       reading here (it reads again only where a deregMrSym would otherwise wait for a connection
 *       that has not failed, and once the input is written); type 0x42: a record without the magic
 *       (the connection fails) */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "net/socket/socket.h"
#include "net/socket/socket_rma.h"

#define GUARD 256
#define DATA_SIZE 4096
#define SIG_SIZE 256
#define GUARD_BYTE 0x5a
#define MAX_STREAM (128u << 10)
#define POISON 0xee /* what a deregistered window holds: built records never put 8 of it in a row */

static char data_mem[GUARD + DATA_SIZE + GUARD], sig_mem[GUARD + SIG_SIZE + GUARD];
static unsigned char may_change[DATA_SIZE + SIG_SIZE]; /* 1 where a put of this input could land */
static struct mpr_win wins[2];
static struct mpr_group group;
static int tracing;
#define MAX_DEREG 4
static struct { size_t at; uint32_t win; } deregs[MAX_DEREG]; /* deregistrations of this input */
static int nderegs;
static char dead_copy[2][DATA_SIZE]; /* a window's bytes at its deregistration */
static int dead[2];
#define MAX_STOPS 4
static size_t stops[MAX_STOPS]; /* where in the stream the peer stops reading */
static int nstops;
static int poison_check;  /* built records: a run of 8 POISON bytes in what the peer reads is a leak */
static int peer_reads;    /* atomic: the peer drains what the plugin writes */
static int poison_run;    /* POISON bytes in a row so far, across reads */
static size_t leaked_at;  /* 0, or 1 + where in the peer's stream a run of 8 POISON bytes ended */
static size_t peer_got;   /* bytes the peer has read */

static void setup_once(void) {
  static int done;
  if (done) return;
  done = 1;
  tracing = getenv("FUZZ_TRACE") != NULL;
  group = (struct mpr_group){.rank = 0, .nranks = 2, .wins = wins, .nwins = 2, .cap = 2};
  pthread_rwlock_init(&group.win_lock, NULL);
  pthread_mutex_init(&group.sets_lock, NULL);
  wins[0] = (struct mpr_win){.id = 0, .live = 1, .base = data_mem + GUARD, .size = DATA_SIZE, .gpu = -1};
  wins[1] = (struct mpr_win){.id = 1, .live = 1, .base = sig_mem + GUARD, .size = SIG_SIZE, .gpu = -1};
}

static void reset_memory(void) {
  memset(data_mem, GUARD_BYTE, sizeof(data_mem));
  memset(sig_mem, GUARD_BYTE, sizeof(sig_mem));
  memset(data_mem + GUARD, 0, DATA_SIZE);
  memset(sig_mem + GUARD, 0, SIG_SIZE);
  memset(may_change, 0, sizeof(may_change));
  wins[0].live = wins[1].live = 1;
  nderegs = 0;
  dead[0] = dead[1] = 0;
  nstops = 0;
  poison_run = 0;
  leaked_at = 0;
  peer_got = 0;
  __atomic_store_n(&peer_reads, 1, __ATOMIC_RELAXED);
}

static uint32_t win_of(uint8_t sel) { return sel == 3 ? 0xffffffffu : sel; }

/* Which window bytes a header could change, if the target accepted it (over-approximated). */
static void note_header(const struct mpr_msg *m) {
  if (m->type == 1 /* put */ && m->size && m->win < 2) {
    size_t limit = m->win == 0 ? DATA_SIZE : SIG_SIZE, base = m->win == 0 ? 0 : DATA_SIZE;
    for (uint64_t o = m->off; o < limit && o - m->off < m->size; o++) may_change[base + o] = 1;
  }
  if (m->type == 1 && m->sig_win < 2) {
    size_t limit = m->sig_win == 0 ? DATA_SIZE : SIG_SIZE, base = m->sig_win == 0 ? 0 : DATA_SIZE;
    for (uint64_t o = m->sig_off; o < limit && o < m->sig_off + 8; o++) may_change[base + o] = 1;
  }
}

/* The wire stream of an input: built from descriptors, or its raw bytes (headers in it noted). */
static size_t build_stream(const uint8_t *in, size_t n, uint8_t *out, int built) {
  size_t k = 0;
  if (!built) {
    if (n > MAX_STREAM) n = MAX_STREAM;
    memcpy(out, in, n);
    for (size_t at = 0; at + sizeof(struct mpr_msg) <= n; at++) { /* any offset may be a header */
      struct mpr_msg m;
      memcpy(&m, out + at, sizeof(m));
      if (m.magic == MPR_MAGIC) note_header(&m);
    }
    return n;
  }
  for (size_t i = 0; i + 8 <= n && k + sizeof(struct mpr_msg) + 8192 <= MAX_STREAM; i += 8) {
    const uint8_t *d = in + i;
    if ((d[0] & 0x7f) == 0x40) {
      size_t back = ((size_t)d[2] | (size_t)d[3] << 8) & 0x3fff; /* inside the records before it */
      if (nderegs < MAX_DEREG) {
        deregs[nderegs].win = d[1] & 1;
        deregs[nderegs++].at = k > back ? k - back : 0;
      }
      continue;
    }
    if ((d[0] & 0x7f) == 0x41) {
      if (nstops < MAX_STOPS) stops[nstops++] = k;
      continue;
    }
    if ((d[0] & 0x7f) == 0x42) { /* a header whose magic is wrong: the connection fails on it */
      struct mpr_msg bad = {.magic = MPR_MAGIC ^ ((uint32_t)d[1] << 8 | 1), .type = 1, .id = i / 8 + 1};
      memcpy(out + k, &bad, sizeof(bad));
      k += sizeof(bad);
      continue;
    }
    struct mpr_msg m = {.magic = MPR_MAGIC, .type = (uint16_t)(d[0] & 0x7f), .win = win_of(d[1] & 3),
                        .sig_win = win_of(d[2] & 3), .sig_op = d[3] & 3,
                        .off = (uint64_t)d[4] | (uint64_t)d[5] << 8, .size = ((uint64_t)d[6] | (uint64_t)d[7] << 8) & 0x1fff,
                        .sig_off = (uint64_t)d[4] & 0xf8, .sig_val = 1, .id = i / 8 + 1};
    note_header(&m);
    memcpy(out + k, &m, sizeof(m));
    k += sizeof(m);
    size_t data = m.type == 1 ? m.size : 0;
    int truncated = d[0] & 0x80;
    if (truncated) data /= 2;
    for (size_t b = 0; b < data; b++) out[k++] = (uint8_t)(i + b * 7 + 1);
    if (truncated) break;
  }
  return k;
}

/* What the peer reads: looked through for a run of 8 POISON bytes (a deregistered window's). */
static void peer_took(const char *buf, ssize_t r) {
  for (ssize_t i = 0; i < r; i++) {
    poison_run = (uint8_t)buf[i] == POISON ? poison_run + 1 : 0;
    if (poison_run == 8 && !leaked_at) leaked_at = peer_got + (size_t)i + 1;
  }
  peer_got += (size_t)r;
}

static void drain(int fd) {
  char buf[65536];
  ssize_t r;
  if (!__atomic_load_n(&peer_reads, __ATOMIC_ACQUIRE)) return;
  while ((r = recv(fd, buf, sizeof(buf), MSG_DONTWAIT)) > 0) peer_took(buf, r);
}

/* The peer reading while NCCL's thread is inside deregMrSym (a connection that has not failed: the
 * write under way is waited for, and must be able to end). */
static int drainer_fd, drainer_stop;
static void *drainer(void *arg) {
  (void)arg;
  while (!__atomic_load_n(&drainer_stop, __ATOMIC_ACQUIRE)) {
    struct pollfd p = {.fd = drainer_fd, .events = POLLIN};
    if (poll(&p, 1, 1) > 0) drain(drainer_fd);
  }
  return NULL;
}

static void drainer_start(pthread_t *t, int fd) {
  drainer_fd = fd;
  __atomic_store_n(&drainer_stop, 0, __ATOMIC_RELEASE);
  FUZZ_REQUIRE(pthread_create(t, NULL, drainer, NULL) == 0, "no thread");
}

static void drainer_end(pthread_t t) {
  __atomic_store_n(&drainer_stop, 1, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
}

/* deregMrSym of window w, through the plugin's own op, as NCCL's thread would call it; then its
 * memory is overwritten with POISON (the plugin must not read it again, nor write it). The peer
 * reads meanwhile (one that had stopped reads again) unless it stopped and the connection has
 * failed: a failed connection's writer must end by itself, and deregMrSym return within
 * CALL_LIMIT_S. */
static void dereg(uint32_t w, struct mpr_conn *c, int peer_fd) {
  if (dead[w]) return;
  uint32_t *h = malloc(sizeof(*h));
  FUZZ_REQUIRE(h != NULL, "no memory");
  *h = w;
  pthread_t t;
  int reading = __atomic_load_n(&peer_reads, __ATOMIC_ACQUIRE) || !__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE);
  if (reading) {
    __atomic_store_n(&peer_reads, 1, __ATOMIC_RELEASE);
    drainer_start(&t, peer_fd);
  }
  FUZZ_REQUIRE(TIMED("deregMrSym", mps_rma_ops.dereg_mr_sym(&group, h)) == ncclSuccess, "deregMrSym failed");
  if (reading) drainer_end(t);
  dead[w] = 1;
  char *mem = w ? sig_mem + GUARD : data_mem + GUARD;
  size_t size = w ? SIG_SIZE : DATA_SIZE;
  if (poison_check) memset(mem, POISON, size);
  memcpy(dead_copy[w], mem, size);
}

static void check_memory(void) {
  for (uint32_t w = 0; w < 2; w++)
    FUZZ_REQUIRE(!dead[w] || !memcmp(dead_copy[w], w ? sig_mem + GUARD : data_mem + GUARD, w ? SIG_SIZE : DATA_SIZE),
                 "window %u changed after its deregistration", w);
  for (size_t i = 0; i < GUARD; i++) {
    FUZZ_REQUIRE(data_mem[i] == GUARD_BYTE && data_mem[GUARD + DATA_SIZE + i] == GUARD_BYTE,
                 "a guard byte of the data window changed (%zu)", i);
    FUZZ_REQUIRE(sig_mem[i] == GUARD_BYTE && sig_mem[GUARD + SIG_SIZE + i] == GUARD_BYTE,
                 "a guard byte of the signal window changed (%zu)", i);
  }
  for (size_t i = 0; i < DATA_SIZE; i++)
    FUZZ_REQUIRE(dead[0] || data_mem[GUARD + i] == 0 || may_change[i], "data window byte %zu changed, no put covered it", i);
  for (size_t i = 0; i < SIG_SIZE; i++)
    FUZZ_REQUIRE(dead[1] || sig_mem[GUARD + i] == 0 || may_change[DATA_SIZE + i],
                 "signal window byte %zu changed, no put covered it", i);
  FUZZ_REQUIRE(!leaked_at, "the peer read a deregistered window's bytes (8 POISON bytes ending at byte %zu of what it read)",
               leaked_at - 1);
}

int LLVMFuzzerTestOneInput(const uint8_t *in, size_t n) {
  setup_once();
  if (n < 1) return 0;
  static uint8_t stream[MAX_STREAM];
  reset_memory();
  poison_check = in[0] & 1;
  size_t len = build_stream(in + 1, n - 1, stream, in[0] & 1);
  size_t piece = ((in[0] >> 1) & 7) == 0 ? 1 : (size_t)1 << (4 * ((in[0] >> 1) & 7) - 4);
  if (piece == 0) piece = 1;

  struct mpr_conn *conns[2] = {0};
  struct mpr_ctxset s = {.g = &group, .ncontexts = 1, .conns = conns, .mirrors = NULL, .epfd = epoll_create1(0)};
  struct mpr_conn *mirrors[1] = {0};
  s.mirrors = mirrors;
  int sv[2];
  FUZZ_REQUIRE(s.epfd >= 0 && socketpair(AF_UNIX, SOCK_STREAM, 0, sv) == 0, "epoll / socketpair: %s", strerror(errno));
  fcntl(sv[1], F_SETFL, O_NONBLOCK);
  if (in[0] & 0x20) { /* a few answers fill them */
    int small = 4096;
    setsockopt(sv[0], SOL_SOCKET, SO_SNDBUF, &small, sizeof(small));
    setsockopt(sv[1], SOL_SOCKET, SO_RCVBUF, &small, sizeof(small));
  }
  struct mpr_conn *c = mpr_conn_new(&s, 0, 1, sv[0]);
  FUZZ_REQUIRE(c != NULL, "no connection");
  conns[1] = c;
  if (in[0] & 0x20) { /* with its reader and writer threads, as createContext starts them */
    FUZZ_REQUIRE(mpr_conn_start(c) == ncclSuccess, "the connection's threads did not start");
  } else {
    struct epoll_event ev = {.events = EPOLLIN, .data.ptr = c};
    FUZZ_REQUIRE(epoll_ctl(s.epfd, EPOLL_CTL_ADD, sv[0], &ev) == 0, "epoll_ctl: %s", strerror(errno));
  }

  struct mpr_ctxset *sets[1] = {&s};
  group.sets = sets;
  group.nsets = 1;
  size_t sent = 0;
  int calls = 0, next_dereg = 0, next_stop = 0;
  while (sent < len && !__atomic_load_n(&c->rd_over, __ATOMIC_ACQUIRE) && calls < 20000) {
    while (next_stop < nstops && stops[next_stop] <= sent) {
      __atomic_store_n(&peer_reads, 0, __ATOMIC_RELEASE);
      next_stop++;
    }
    while (next_dereg < nderegs && deregs[next_dereg].at <= sent) dereg(deregs[next_dereg++].win, c, sv[1]);
    size_t k = len - sent < piece ? len - sent : piece;
    if (next_dereg < nderegs && deregs[next_dereg].at - sent < k) k = deregs[next_dereg].at - sent;
    if (next_stop < nstops && stops[next_stop] - sent < k) k = stops[next_stop] - sent;
    if (k == 0) k = 1;
    ssize_t w = send(sv[1], stream + sent, k, MSG_DONTWAIT | MSG_NOSIGNAL);
    if (w > 0) sent += (size_t)w;
    mpr_progress(&s);
    drain(sv[1]);
    calls++;
  }
  while (next_dereg < nderegs) dereg(deregs[next_dereg++].win, c, sv[1]);
  __atomic_store_n(&peer_reads, 1, __ATOMIC_RELEASE); /* the peer reads what is left */
  if (in[0] & 0x10) shutdown(sv[1], SHUT_WR);
  /* Everything written is taken within a bounded number of calls (the parser never waits for a
   * byte that has arrived). */
  for (int i = 0; i < 64; i++) {
    mpr_progress(&s);
    drain(sv[1]);
  }
  char probe;
  int pending = recv(sv[0], &probe, 1, MSG_PEEK | MSG_DONTWAIT) > 0 && c->rpos == c->rlen;
  int over = __atomic_load_n(&c->rd_over, __ATOMIC_ACQUIRE);
  FUZZ_REQUIRE(over || !pending || c->in.phase == MPR_RD_DATA,
               "bytes wait on the socket after 64 rmaProgress calls and the reader is not over");
  if (tracing)
    fprintf(stderr, "fuzz_rma_wire: %zu of %zu bytes written in pieces of %zu; reader %s, connection %s; the peer "
            "read %zu bytes\n", sent, len, piece, over ? "over" : "waiting", c->failed ? "failed" : "alive", peer_got);
  check_memory();
  pthread_t t; /* the peer reads through the teardown: the writer sends what is queued, then the BYE */
  drainer_start(&t, sv[1]);
  mpr_conn_destroy(c);
  drainer_end(t);
  drain(sv[1]);
  close(sv[1]);
  close(s.epfd);
  check_memory();
  group.sets = NULL;
  group.nsets = 0;
  return 0;
}
