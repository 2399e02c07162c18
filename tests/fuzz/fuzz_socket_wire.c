/* Fuzz target: what a stranger on the socket transport's listening port, or a bad peer, can send.
 * The plugin's real code (plugin/net_core.c over net/socket/) listens once on loopback; each input
 * opens TCP sockets to the listen address, says hello on them (valid hellos built here, or the
 * input's raw bytes), and, once accept returned the connection, posts one or two irecvs, reads the
 * ACK and CTS records and writes the input's chunks (struct mps_chunk headers and payloads) on the
 * control socket and the data streams, while accept, irecv and test are called in a bounded loop.
 *
 * Properties: no crash or sanitizer report; accept never fails because of a peer's bytes (a bad
 * hello costs only its socket) and a well-formed connection is still accepted after any earlier
 * input; every plugin call returns within 2 s; traffic the plugin's own sender could have sent
 * (whole chunks tiling each buffer's message, at most one per data stream, or the whole message
 * on the control socket) completes within 2 s of its last byte; any other receive either fails or
 * completes, and once every socket is closed it does one or the other within 3 s; a completed
 * receive reports at most its buffer's size, every byte up to the size is one that a chunk of that
 * size sent to that slot put there, and nothing at or past the size (nor in the guard bytes past
 * the buffer) was written; strangers that fill the listener's table - silent, one byte, or a hello
 * cut short - keep no well-formed connection out. FUZZ_TRACE=1 prints what became of each input.
 *
 * Input:
 *   [0] bits 0-3: nstreams - 1 (valid hellos) or sockets - 1 (raw hellos); bit 4: raw hellos;
 *       bits 5-6: how the sockets close (0 FIN, 1 RST, 2 data FIN + control RST, 3 data RST +
 *       control FIN); bit 7: two receives
 *   [1] bits 0-1: silent sockets opened first and kept open; bits 2-3: bytes each sends (0, 1, 4,
 *       all of a hello but its last); bit 4: write in small pieces, calling the plugin in between;
 *       bits 5-7: a hello field to spoil (valid hellos: 1 version, 2 type, 3 nstreams, 4 stream,
 *       5 nonce, 6 magic, 7 sl), followed by [socket, value lo, value hi]
 *   [2] bits 0-2: buffers of the first receive - 1; bits 3-5: of the second; bit 6 (valid hellos):
 *       lazy streams: the control hello says MPS_HELLO_LAZY and comes alone, the data streams connect
 *       once accept returned, to the stream listener the ACK names (spoils 3-5 then spoil nothing);
 *       bit 7: a flood - the listener's whole table of pending sockets (64) full of strangers before
 *       the connection is made (fuzz_flood_fill: new ones send what the silent ones send, [1] bits 2-3,
 *       one byte where that is none), and a well-formed connection must still be accepted, within
 *       FLOOD_LIMIT_S
 *   then 2 bytes (little endian) per buffer: its size
 *   raw hellos: a struct mps_hello (56 bytes) per socket
 *   then chunks: [c0][struct mps_chunk, 32 bytes][payload]. c0 bits 0-4: socket (0 = control);
 *       bit 5: the header's slot indexes the CTS entries; bit 6: offset, length and total are
 *       reduced into the entry's size; bit 7: the payload is generated, not taken from the input.
 *       A payload follows unless the header says MPS_CHUNK_TRUNCATED; one the input cannot fill
 *       ends what is written on its socket. On the control socket the filler the header's flag
 *       bits count (up to MPS_PAD_MAX) follows the payload, zeros, as the plugin's sender writes it. */
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "fuzz_util.h"
#include "net/handle.h"
#include "net/socket/socket.h"
#include "net/tc.h"
#include "plugin/net_core.h"

#define MAX_SOCKS (MPS_MAX_STREAMS + 1)
#define MAX_SILENT 3
#define MAX_CHUNKS 256
#define GEN_MAX (1u << 17)     /* generated payload bytes per chunk */
#define GEN_TOTAL (1u << 20)   /* ... per input */
#define GUARD 64
#define FILL 0xa5
#define DATA_LIMIT_S 0.05
#define QUIET_S 0.005
#define RESOLVE_LIMIT_S 3.0
#define HONEST_LIMIT_S 2.0
#define HANDSHAKE_LIMIT_S 2.0
#define FLOOD_LIMIT_S 4.0   /* a stranger makes room once it has waited 1 s with the table full */
static struct fuzz_flood flood; /* FUZZ_FLOOD: the listener's table of pending sockets (net/socket/socket_conn.c) */

static struct mplane_net_ctx *ctx;
static void *lc;
static struct sockaddr_storage listen_ss;
static socklen_t listen_len;
static uint64_t input_no;
static int trace; /* FUZZ_TRACE=1 */


int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  setenv("MPLANE_TRANSPORT", "socket", 1);
  setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
  setenv("MPLANE_NCCL_DEFAULTS", "0", 1);
  if (!getenv("FUZZ_VERBOSE")) fuzz_quiet();
  trace = getenv("FUZZ_TRACE") != NULL;
  if (mplane_net_global_init(NULL) != ncclSuccess || mplane_net_ctx_create(1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx)) {
    fprintf(stderr, "fuzz_socket_wire: the socket transport does not start on lo\n");
    exit(1);
  }
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  struct mplane_handle h;
  char why[256];
  if (mplane_net_listen(ctx, 0, handle, &lc) != ncclSuccess || mplane_handle_decode(handle, &h, why, sizeof(why)) ||
      mplane_handle_sockaddr(&h, &listen_ss, &listen_len, why, sizeof(why))) {
    fprintf(stderr, "fuzz_socket_wire: listen failed\n");
    exit(1);
  }
  return 0;
}

/* ------------------------------------------------------------------ the peer's sockets */
struct sock {
  int fd;
  int dead;          /* a write failed: the plugin closed or reset it */
  int cut;           /* a chunk the input could not fill: nothing more is queued here */
  uint8_t *out;      /* bytes to write, in order */
  size_t len, done, cap;
  unsigned short port;
};

static int tcp_open(unsigned short *port) {
  int fd = socket(listen_ss.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  FUZZ_REQUIRE(fd >= 0, "socket: %s", strerror(errno));
  /* loopback: connect completes at once (the listener's backlog is 1024) */
  if (fuzz_connect(fd, (struct sockaddr *)&listen_ss, listen_len) != 0) {
    FUZZ_REQUIRE(0, "connect to the plugin's listen address: %s", strerror(errno));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  struct sockaddr_storage me;
  socklen_t ml = sizeof(me);
  getsockname(fd, (struct sockaddr *)&me, &ml);
  *port = ntohs(((struct sockaddr_in *)&me)->sin_port);
  return fd;
}

/* A data stream to the plugin's stream listener (the port its ACK names), as a lazy sender opens it. */
static int tcp_open_port(unsigned port_to, unsigned short *port) {
  struct sockaddr_storage to = listen_ss;
  ((struct sockaddr_in *)&to)->sin_port = htons((unsigned short)port_to); /* same offset in sockaddr_in6 */
  int fd = socket(to.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  FUZZ_REQUIRE(fd >= 0, "socket: %s", strerror(errno));
  if (fuzz_connect(fd, (struct sockaddr *)&to, listen_len) != 0)
    FUZZ_REQUIRE(0, "connect to the plugin's stream listener (port %u): %s", port_to, strerror(errno));
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
  struct sockaddr_storage me;
  socklen_t ml = sizeof(me);
  getsockname(fd, (struct sockaddr *)&me, &ml);
  *port = ntohs(((struct sockaddr_in *)&me)->sin_port);
  return fd;
}

static void close_fd(int fd, int rst) {
  if (rst) {
    struct linger l = {.l_onoff = 1, .l_linger = 0};
    setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
  }
  close(fd);
}

static void queue(struct sock *s, const void *p, size_t n) {
  if (n == 0) return;
  if (s->len + n > s->cap) {
    size_t c = s->cap ? s->cap : 256;
    while (c < s->len + n) c *= 2;
    s->out = realloc(s->out, c);
    FUZZ_REQUIRE(s->out != NULL, "out of memory");
    s->cap = c;
  }
  memcpy(s->out + s->len, p, n);
  s->len += n;
}

/* Write what the socket takes now, at most `limit` bytes (0: no limit); never blocks. */
static int write_some(struct sock *s, size_t limit) {
  if (s->dead || s->done == s->len) return 0;
  size_t n = s->len - s->done;
  if (limit && n > limit) n = limit;
  ssize_t w = send(s->fd, s->out + s->done, n, MSG_NOSIGNAL | MSG_DONTWAIT);
  if (w < 0) {
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) s->dead = 1;
    return 0;
  }
  s->done += (size_t)w;
  return w > 0;
}

/* ------------------------------------------------------------------ the chunks, as sent */
struct chunk {
  struct mps_chunk h;
  const uint8_t *payload; /* from the input, or NULL: generated */
  unsigned idx;
  int sock;
  size_t end;             /* offset in its socket's stream just past it */
};

static uint8_t gen_byte(unsigned idx, uint64_t k) { return (uint8_t)(k * 131u + (k >> 8) + idx * 29u + 7u); }
static uint8_t payload_byte(const struct chunk *c, uint64_t k) {
  return c->payload ? c->payload[k] : gen_byte(c->idx, k);
}

/* A completed buffer: size within the buffer, every byte below it put there by a whole chunk of
 * that slot naming that total (or a whole eager message of the buffer's tag on the control socket,
 * which names no slot), nothing written at or past it. */
static void check_completed(uint32_t slot, int tag, const uint8_t *buf, size_t cap, int size, const struct chunk *ch,
                            int nch, const struct sock *socks, int ctrl_sock) {
  FUZZ_REQUIRE(size >= 0 && (size_t)size <= cap, "slot %u completed with %d bytes into a %zu-byte buffer", slot, size,
               cap);
  uint64_t sz = (uint64_t)size;
  uint8_t *ok = calloc(sz + 1, 1);
  FUZZ_REQUIRE(ok != NULL, "out of memory");
  int named = 0;
  for (int i = 0; i < nch; i++) {
    const struct chunk *c = &ch[i];
    int eager = (c->h.flags & MPS_CHUNK_FLAG_BITS) == MPS_CHUNK_EAGER && c->sock == ctrl_sock;
    uint64_t off = eager ? 0 : c->h.offset;
    if ((eager ? c->h.tag != tag || c->h.len != c->h.total : c->h.slot != slot) ||
        (c->h.flags & MPS_CHUNK_TRUNCATED) || c->h.total != sz || off > sz || c->h.len > sz - off ||
        socks[c->sock].done < c->end)
      continue;
    named = 1;
    for (uint64_t k = 0; k < c->h.len; k++)
      if (buf[off + k] == payload_byte(c, k)) ok[off + k] = 1;
  }
  FUZZ_REQUIRE(named, "slot %u completed with %d bytes, but no whole chunk sent to it names that total", slot, size);
  for (uint64_t p = 0; p < sz; p++)
    FUZZ_REQUIRE(ok[p], "slot %u (%d bytes): byte %llu is 0x%02x, which no chunk of that message put there", slot,
                 size, (unsigned long long)p, buf[p]);
  free(ok);
  for (size_t p = sz; p < cap; p++)
    FUZZ_REQUIRE(buf[p] == FILL, "slot %u completed with %d bytes, but byte %zu of its %zu-byte buffer was written",
                 slot, size, p, cap);
}

/* Traffic the plugin's own sender could have produced: every chunk whole, of a posted slot, inside
 * its message and buffer; each slot's chunks agree on the total and tile it exactly, at most one
 * per data stream, or the whole message as one chunk on the control socket; every buffer of every
 * receive gets its message; nothing cut short, nothing left over. Such a receive must complete. */
static int honest(const struct chunk *ch, int nch, const struct sock *socks, int nsock, int ctrl_sock, int nstreams,
                  const uint32_t *ent_slot, const size_t *ent_cap, int nent) {
  for (int i = 0; i < nsock; i++)
    if (socks[i].cut || socks[i].dead) return 0;
  int used[2 * MPS_MAX_RECVS] = {0};
  for (int i = 0; i < nch; i++) {
    const struct mps_chunk *h = &ch[i].h;
    int e = -1;
    for (int k = 0; k < nent; k++)
      if (ent_slot[k] == h->slot) e = k;
    /* filler after the payload is the sender's on the control socket (socket.h); a spliced chunk
     * (ACK) comes on a data stream, and the receiver's ack waits, unread, in this socket's buffer */
    uint32_t pad = h->flags >> MPS_CHUNK_PAD_SHIFT, flags = h->flags & MPS_CHUNK_FLAG_BITS;
    int bad_flags = (flags && (flags != MPS_CHUNK_ACK || ch[i].sock == ctrl_sock)) ||
                    (pad && (ch[i].sock != ctrl_sock || pad > MPS_PAD_MAX));
    if (e < 0 || bad_flags || h->total > ent_cap[e] || h->offset > h->total ||
        h->len > h->total - h->offset || (h->len == 0 && h->total != 0) || ch[i].end == SIZE_MAX)
      return 0;
    used[e]++;
  }
  for (int e = 0; e < nent; e++) {
    if (used[e] == 0 || used[e] > nstreams) return 0;
    uint64_t sum = 0, total = 0;
    int first = 1, on_ctrl = 0;
    for (int i = 0; i < nch; i++) {
      const struct mps_chunk *h = &ch[i].h;
      if (h->slot != ent_slot[e]) continue;
      if (!first && h->total != total) return 0;
      total = h->total, first = 0;
      sum += h->len;
      on_ctrl |= ch[i].sock == ctrl_sock;
      for (int j = 0; j < i; j++) {
        const struct mps_chunk *g = &ch[j].h;
        if (g->slot == h->slot && h->offset < g->offset + g->len && g->offset < h->offset + h->len) return 0;
      }
    }
    /* an empty message is one empty chunk (a second would be "the one empty chunk came twice") */
    if (sum != total || (on_ctrl && used[e] != 1) || (total == 0 && used[e] != 1)) return 0;
  }
  return 1;
}

/* ------------------------------------------------------------------ one input */
struct input {
  const uint8_t *d;
  size_t n, pos;
};
static int take(struct input *in, void *dst, size_t len) {
  if (in->pos + len > in->n) return 0;
  memcpy(dst, in->d + in->pos, len);
  in->pos += len;
  return 1;
}
static unsigned take_byte(struct input *in, unsigned dflt) { return in->pos < in->n ? in->d[in->pos++] : dflt; }

/* Our socket whose address the plugin's socket fd is connected to, or -1. */
static int sock_of_fd(int fd, const struct sock *socks, int nsock) {
  struct sockaddr_storage peer;
  socklen_t pl = sizeof(peer);
  if (getpeername(fd, (struct sockaddr *)&peer, &pl) != 0) return -1;
  unsigned short port = ntohs(((struct sockaddr_in *)&peer)->sin_port);
  for (int i = 0; i < nsock; i++)
    if (socks[i].port == port) return i;
  return -1;
}

/* Read one control record from the plugin within HANDSHAKE_LIMIT_S; 0 if none came. */
static int read_ctrl(int fd, struct mps_ctrl *m) {
  size_t have = 0;
  double t0 = now_s();
  while (have < sizeof(*m)) {
    if (now_s() - t0 > HANDSHAKE_LIMIT_S) return 0;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    if (poll(&p, 1, 10) <= 0) continue;
    ssize_t r = recv(fd, (char *)m + have, sizeof(*m) - have, MSG_DONTWAIT);
    if (r == 0) return 0;
    if (r < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return 0;
    }
    have += (size_t)r;
  }
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct input in = {data, size, 0};
  unsigned mode = take_byte(&in, 0), extra = take_byte(&in, 0), shape = take_byte(&in, 0);
  int raw = (mode >> 4) & 1, close_style = (mode >> 5) & 3, two = (mode >> 7) & 1;
  int nstreams = (int)(mode & 15) + 1;
  int nsock = raw ? nstreams : nstreams + 1;
  /* lazy: the control hello says MPS_HELLO_LAZY and comes alone; the data streams connect after its
   * ACK, to the port it names (the hello fields spoiled are then the control socket's own) */
  int lazy = !raw && ((shape >> 6) & 1);
  int nsilent = extra & 3, silent_bytes = (int[]){0, 1, 4, sizeof(struct mps_hello) - 1}[(extra >> 2) & 3];
  int split = (extra >> 4) & 1, spoil = (extra >> 5) & 7;
  unsigned spoil_sock = 0, spoil_val = 0;
  if (lazy && (spoil == 3 || spoil == 4 || spoil == 5)) spoil = 0; /* stream set fields: none to spoil */
  if (!raw && spoil) {
    spoil_sock = take_byte(&in, 0) % (unsigned)nsock;
    if (lazy) spoil_sock = 0;
    spoil_val = take_byte(&in, 0);
    spoil_val |= take_byte(&in, 0) << 8;
  }
  int nreq = two ? 2 : 1;
  int nbuf[2] = {(int)(shape & 7) + 1, (int)((shape >> 3) & 7) + 1};
  size_t caps[2][MPS_MAX_RECVS];
  for (int r = 0; r < nreq; r++)
    for (int i = 0; i < nbuf[r]; i++) {
      uint16_t c = 0;
      take(&in, &c, sizeof(c));
      caps[r][i] = c;
    }
  input_no++;

  /* silent strangers first: they stay open (and pending) while the real connection is made */
  struct sock silent[MAX_SILENT];
  static const char junk[sizeof(struct mps_hello)] =
      "MPLN" "\x02\x00\x01\x00" "a silent stranger, or a hello cut short";
  for (int i = 0; i < nsilent; i++) {
    silent[i].fd = tcp_open(&silent[i].port);
    if (silent_bytes) send(silent[i].fd, junk, (size_t)silent_bytes, MSG_NOSIGNAL);
  }
  /* a flood: the listener's table full of strangers, each one already accepted by the plugin */
  int nflood = (shape >> 7) & 1;
  if (nflood)
    FUZZ_REQUIRE(fuzz_flood_fill(&flood, (struct sockaddr *)&listen_ss, listen_len, junk,
                                 silent_bytes ? (size_t)silent_bytes : 1) == 0,
                 "connect to the plugin's listen address: %s", strerror(errno));
  for (int i = 0; nflood && i < 3; i++) {
    void *x = NULL;
    FUZZ_REQUIRE(TIMED("accept", mplane_net_accept(lc, &x)) == ncclSuccess, "accept failed under a flood of strangers");
    if (x) mplane_net_close_recv(x); /* a comm of an earlier input's sockets */
  }

  struct sock socks[MAX_SOCKS];
  memset(socks, 0, sizeof(socks));
  int nsock_now = lazy ? 1 : nsock; /* the sockets open so far */
  for (int i = 0; i < nsock; i++) socks[i].fd = -1;
  for (int i = 0; i < nsock_now; i++) socks[i].fd = tcp_open(&socks[i].port);
  /* a hello's service level is only checked for range (0..15): that spoil alone keeps the connection */
  int expect_accept = !raw && (spoil == 0 || (spoil == 7 && spoil_val <= MPLANE_TC_SL_MAX));
  struct mps_hello lazy_hello; /* what the lazy streams say, once they open */
  for (int i = 0; i < nsock; i++) {
    struct mps_hello hl;
    memset(&hl, 0, sizeof(hl));
    if (raw) {
      size_t n = in.n - in.pos < sizeof(hl) ? in.n - in.pos : sizeof(hl);
      memcpy(&hl, in.d + in.pos, n);
      in.pos += n;
      queue(&socks[i], &hl, n);
      continue;
    }
    hl.magic = MPLANE_HANDLE_MAGIC;
    hl.version = MPLANE_PROTOCOL_VERSION;
    hl.type = MPS_HELLO;
    hl.node_id = 0xf022;
    hl.nonce = 0xf0220000000000ull ^ ((uint64_t)getpid() << 24) ^ input_no;
    hl.stream = (uint16_t)i;
    hl.nstreams = (uint16_t)nstreams;
    hl.flags = lazy ? MPS_HELLO_LAZY : 0;
    if (lazy && i > 0) {
      lazy_hello = hl;
      continue;
    }
    if (spoil && (unsigned)i == spoil_sock) {
      switch (spoil) {
        case 1: hl.version = (uint16_t)spoil_val; break;
        case 2: hl.type = (uint16_t)spoil_val; break;
        case 3: hl.nstreams = (uint16_t)spoil_val; break;
        case 4: hl.stream = (uint16_t)spoil_val; break;
        case 5: hl.nonce ^= spoil_val; break;
        case 6: hl.magic ^= spoil_val; break;
        case 7: hl.sl = spoil_val; break;
      }
      /* a "spoiled" value that happens to be the right one spoils nothing */
      if ((spoil == 1 && hl.version == MPLANE_PROTOCOL_VERSION) || (spoil == 2 && hl.type == MPS_HELLO) ||
          (spoil == 3 && hl.nstreams == nstreams) || (spoil == 4 && hl.stream == i) || (spoil == 5 && spoil_val == 0) ||
          (spoil == 6 && spoil_val == 0))
        expect_accept = 1;
    }
    queue(&socks[i], &hl, sizeof(hl));
  }

  /* hellos out (in two pieces when split), accept until the connection is whole */
  void *rc = NULL;
  for (int i = 0; i < nsock_now; i++) write_some(&socks[i], split ? 5 : 0);
  if (split) {
    void *x = NULL;
    FUZZ_REQUIRE(TIMED("accept", mplane_net_accept(lc, &x)) == ncclSuccess, "accept failed on half a hello");
    if (x) mplane_net_close_recv(x); /* a comm of an earlier input's sockets */
  }
  for (int i = 0; i < nsock_now; i++) write_some(&socks[i], 0);
  int ctrl_sock = -1, stream_sock[MPS_MAX_STREAMS];
  double t0 = now_s();
  for (int calls = 0;; calls++) {
    void *x = NULL;
    ncclResult_t res = TIMED("accept", mplane_net_accept(lc, &x));
    FUZZ_REQUIRE(res == ncclSuccess, "accept returned %d because of a peer's bytes", res);
    if (x) {
      struct mps_recv_comm *c = x;
      int ok = (ctrl_sock = sock_of_fd(c->ctrl_fd, socks, nsock)) >= 0;
      for (int s = 0; s < c->nstreams && ok && !lazy; s++)
        ok = (stream_sock[s] = sock_of_fd(c->streams[s]->fd, socks, nsock)) >= 0;
      if (!ok) {
        mplane_net_close_recv(x); /* assembled from an earlier input's sockets: not ours */
        continue;
      }
      rc = x;
      break;
    }
    double dt = now_s() - t0;
    if (expect_accept ? dt > (nflood ? FLOOD_LIMIT_S : HANDSHAKE_LIMIT_S) : (calls >= 3 && dt > 0.002)) break;
    if (calls >= 3) usleep(nflood ? 2000 : 100);
  }
  if (expect_accept)
    FUZZ_REQUIRE(rc != NULL, "a well-formed connection of %d streams was not accepted within %.0f s%s", nstreams,
                 nflood ? FLOOD_LIMIT_S : HANDSHAKE_LIMIT_S, nflood ? " behind a flood of strangers" : "");

  struct chunk *ch = NULL;
  int nch = 0;
  uint8_t *bufs[2][MPS_MAX_RECVS] = {{0}};
  void *mh[2][MPS_MAX_RECVS] = {{0}};
  void *req[2] = {0};
  int resolved[2] = {1, 1}, completed[2] = {0, 0};
  int sizes[2][MPS_MAX_RECVS];
  uint32_t ent_slot[2 * MPS_MAX_RECVS];
  size_t ent_cap[2 * MPS_MAX_RECVS];
  int nent = 0;
  if (rc) {
    struct mps_recv_comm *c = rc;
    int rnstreams = c->nstreams;
    struct mps_ctrl m;
    FUZZ_REQUIRE(read_ctrl(socks[ctrl_sock].fd, &m), "no ACK within %.0f s of accept", HANDSHAKE_LIMIT_S);
    FUZZ_REQUIRE(m.magic == MPLANE_HANDLE_MAGIC && m.type == MPS_ACK, "the first control record is type %u", m.type);
    if (lazy) { /* the streams open now, to the stream listener, their hellos first on them */
      FUZZ_REQUIRE(m.ack.stream_port != 0, "the ACK names no stream listener");
      for (int i = 1; i < nsock; i++) {
        socks[i].fd = tcp_open_port(m.ack.stream_port, &socks[i].port);
        lazy_hello.stream = (uint16_t)i;
        queue(&socks[i], &lazy_hello, sizeof(lazy_hello));
        stream_sock[i - 1] = i;
      }
      nsock_now = nsock;
    }
    for (int r = 0; r < nreq; r++) {
      void *dptr[MPS_MAX_RECVS];
      int tags[MPS_MAX_RECVS];
      for (int i = 0; i < nbuf[r]; i++) {
        bufs[r][i] = malloc(caps[r][i] + GUARD);
        FUZZ_REQUIRE(bufs[r][i] != NULL, "out of memory");
        memset(bufs[r][i], FILL, caps[r][i] + GUARD);
        FUZZ_REQUIRE(mplane_net_reg_mr(rc, bufs[r][i], caps[r][i] + GUARD, NCCL_PTR_HOST, &mh[r][i]) == ncclSuccess,
                     "regMr");
        dptr[i] = bufs[r][i];
        tags[i] = 100 * r + i;
      }
      ncclResult_t res = TIMED("irecv", mplane_net_irecv(rc, nbuf[r], dptr, caps[r], tags, mh[r], &req[r]));
      FUZZ_REQUIRE(res == ncclSuccess && req[r] != NULL, "irecv %d on a fresh connection: %d, request %p", r, res,
                   req[r]);
      resolved[r] = 0;
      FUZZ_REQUIRE(read_ctrl(socks[ctrl_sock].fd, &m), "no CTS within %.0f s of irecv", HANDSHAKE_LIMIT_S);
      FUZZ_REQUIRE(m.magic == MPLANE_HANDLE_MAGIC && m.type == MPS_CTS && m.n == (uint32_t)nbuf[r],
                   "CTS: type %u, %u entries for an irecv of %d", m.type, m.n, nbuf[r]);
      for (int i = 0; i < nbuf[r]; i++) {
        FUZZ_REQUIRE(m.e[i].slot < MPS_MAX_SLOTS && m.e[i].size == caps[r][i] && m.e[i].tag == tags[i],
                     "CTS entry %d: slot %u size %llu tag %d", i, m.e[i].slot, (unsigned long long)m.e[i].size,
                     m.e[i].tag);
        ent_slot[nent] = m.e[i].slot;
        ent_cap[nent++] = caps[r][i];
      }
    }

    /* the chunks, queued on their sockets */
    ch = calloc(MAX_CHUNKS, sizeof(*ch));
    FUZZ_REQUIRE(ch != NULL, "out of memory");
    size_t gen_total = 0;
    static uint8_t genbuf[GEN_MAX];
    while (in.pos < in.n && nch < MAX_CHUNKS) {
      unsigned c0 = take_byte(&in, 0);
      int si = (int)(c0 & 31) % (rnstreams + 1);
      int sock = si == 0 ? ctrl_sock : stream_sock[si - 1];
      struct sock *s = &socks[sock];
      struct mps_chunk h;
      if (!take(&in, &h, sizeof(h))) {
        if (!s->cut) queue(s, in.d + in.pos, in.n - in.pos); /* half a header, then the close */
        s->cut = 1;
        break;
      }
      size_t cap = 65535;
      if (c0 & 0x20) {
        int e = (int)(h.slot % (uint32_t)nent);
        h.slot = ent_slot[e];
        cap = ent_cap[e];
      }
      if (c0 & 0x40) {
        h.total %= cap + 1;
        h.offset %= h.total + 1;
        h.len %= h.total - h.offset + 1;
      }
      struct chunk *k = &ch[nch];
      k->h = h;
      k->idx = (unsigned)nch;
      k->sock = sock;
      uint64_t plen = 0;
      int whole = 1;
      if (!(h.flags & MPS_CHUNK_TRUNCATED)) {
        if (c0 & 0x80) {
          plen = h.len < GEN_MAX ? h.len : GEN_MAX;
          if (gen_total + plen > GEN_TOTAL) plen = GEN_TOTAL - gen_total;
          gen_total += plen;
          k->payload = NULL;
        } else {
          plen = h.len < in.n - in.pos ? h.len : in.n - in.pos;
          k->payload = in.d + in.pos;
          in.pos += plen;
        }
        whole = plen == h.len;
      }
      if (s->cut) continue; /* what follows a chunk cut short is never framed as a chunk */
      queue(s, &h, sizeof(h));
      if (k->payload) {
        queue(s, k->payload, plen);
      } else {
        for (uint64_t j = 0; j < plen; j++) genbuf[j] = gen_byte(k->idx, j);
        queue(s, genbuf, plen);
      }
      k->end = whole ? s->len : SIZE_MAX; /* the payload's end: a receive may complete before the filler */
      if (!whole) s->cut = 1;
      /* the filler the header counts, as the plugin's sender writes it (control socket only; more
       * than MPS_PAD_MAX is refused at the header) */
      uint32_t pad = h.flags >> MPS_CHUNK_PAD_SHIFT;
      if (whole && sock == ctrl_sock && pad && pad <= MPS_PAD_MAX && !(h.flags & MPS_CHUNK_TRUNCATED)) {
        static const uint8_t zeros[MPS_PAD_MAX];
        queue(s, zeros, pad);
      }
      nch++;
    }

    /* write and poll, bounded; honest traffic must complete, and within HONEST_LIMIT_S */
    int fair = honest(ch, nch, socks, nsock, ctrl_sock, rnstreams, ent_slot, ent_cap, nent);
    if (trace)
      fprintf(stderr, "fuzz_socket_wire: %d chunks an honest sender %s have sent\n", nch, fair ? "could" : "could not");
    double start = now_s(), all_written = 0;
    for (;;) {
      int moved = 0, pending = 0;
      for (int i = 0; i < nsock; i++) {
        moved |= write_some(&socks[i], split ? 37 : 0);
        pending |= !socks[i].dead && socks[i].done < socks[i].len;
      }
      for (int r = 0; r < nreq; r++) {
        if (resolved[r]) continue;
        int done = 0;
        ncclResult_t res = TIMED("test", mplane_net_test(req[r], &done, sizes[r]));
        if (res != ncclSuccess || done) resolved[r] = 1, completed[r] = res == ncclSuccess;
      }
      if (resolved[0] && resolved[1]) break;
      double t = now_s();
      if (!pending && all_written == 0) all_written = t;
      if (fair ? all_written > 0 && t - all_written > HONEST_LIMIT_S
               : (all_written > 0 && t - all_written > QUIET_S) || t - start > DATA_LIMIT_S)
        break;
      if (split || (fair && all_written > 0)) usleep(50);
      else if (!moved) sched_yield();
    }
    if (fair)
      for (int r = 0; r < nreq; r++)
        FUZZ_REQUIRE(completed[r], "receive %d of traffic an honest sender could send %s", r,
                     resolved[r] ? "failed" : "did not complete within 2 s of its last byte");
  }

  /* the peer goes away; a receive still open must end now, one way or the other */
  for (int i = 0; i < nsock; i++) {
    int is_ctrl = i == ctrl_sock || (ctrl_sock < 0 && i == 0);
    int rst = close_style == 1 || (close_style == 2 && is_ctrl) || (close_style == 3 && !is_ctrl);
    close_fd(socks[i].fd, rst);
  }
  if (trace && !rc) fprintf(stderr, "fuzz_socket_wire: no connection\n");
  if (rc) {
    double t1 = now_s();
    while (!resolved[0] || !resolved[1]) {
      FUZZ_REQUIRE(now_s() - t1 < RESOLVE_LIMIT_S,
                   "a receive neither completed nor failed within %.0f s of the peer closing every socket",
                   RESOLVE_LIMIT_S);
      for (int r = 0; r < nreq; r++) {
        if (resolved[r]) continue;
        int done = 0;
        ncclResult_t res = TIMED("test", mplane_net_test(req[r], &done, sizes[r]));
        if (res != ncclSuccess || done) resolved[r] = 1, completed[r] = res == ncclSuccess;
      }
      usleep(100);
    }
    if (trace) {
      struct mps_recv_comm *c = rc;
      for (int e = 0; e < nent; e++) {
        struct mps_slot *sl = &c->slots[ent_slot[e]];
        fprintf(stderr, "  slot %u: state %d received %llu total %llu ranges %d\n", ent_slot[e], sl->state,
                (unsigned long long)sl->received, (unsigned long long)sl->total, sl->nranges);
      }
      for (int i = 0; i < nsock; i++)
        fprintf(stderr, "  sock %d: %zu of %zu written%s\n", i, socks[i].done, socks[i].len,
                socks[i].dead ? " (dead)" : "");
      fprintf(stderr, "fuzz_socket_wire: %d streams, %d chunks; receive 0 %s, receive 1 %s (%.1f ms after close)\n",
              ((struct mps_recv_comm *)rc)->nstreams, nch, completed[0] ? "completed" : "failed",
              nreq < 2 ? "-" : completed[1] ? "completed" : "failed", (now_s() - t1) * 1e3);
    }
    for (int r = 0; r < nreq; r++)
      for (int i = 0; i < nbuf[r]; i++) mplane_net_dereg_mr(rc, mh[r][i]);
    FUZZ_REQUIRE(TIMED("closeRecv", mplane_net_close_recv(rc)) == ncclSuccess, "closeRecv failed");
    /* no thread of the plugin writes any more: check what landed */
    int e = 0;
    for (int r = 0; r < nreq; r++)
      for (int i = 0; i < nbuf[r]; i++, e++) {
        if (completed[r])
          check_completed(ent_slot[e], 100 * r + i, bufs[r][i], caps[r][i], sizes[r][i], ch, nch, socks, ctrl_sock);
        for (size_t p = caps[r][i]; p < caps[r][i] + GUARD; p++)
          FUZZ_REQUIRE(bufs[r][i][p] == FILL, "byte %zu past a %zu-byte receive buffer was written", p - caps[r][i],
                       caps[r][i]);
        free(bufs[r][i]);
      }
  }
  for (int i = 0; i < nsilent; i++) close_fd(silent[i].fd, 1);
  /* let the listener drop what this input left pending, so the next input starts clean */
  for (int i = 0; i < 3; i++) {
    void *x = NULL;
    FUZZ_REQUIRE(TIMED("accept", mplane_net_accept(lc, &x)) == ncclSuccess, "accept failed after the peer closed");
    if (x) mplane_net_close_recv(x);
  }
  for (int i = 0; i < nsock; i++) free(socks[i].out);
  free(ch);
  return 0;
}
