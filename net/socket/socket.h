/* mplane: the TCP transport's shared state (net/socket/).
 *
 * A connection is one control socket plus up to MPLANE_SOCKET_STREAMS data streams, matched by a
 * 64-bit nonce. The receiver drives: each irecv posts its buffers into slots and
 * sends a clear-to-send (CTS) record on the control socket naming slot, tag and size; the sender
 * only writes to a slot it was offered, so a short receive buffer is caught before any byte moves.
 * A send takes the first untaken entry of its tag in the oldest offered group, or waits (a NULL
 * request) when that group has none: a later group's send on a shared comm (net/tag_wait.h).
 * Data travels in self-describing chunks (slot, offset, length, total) on any stream, written
 * straight into the posted buffer at the receiver. A connection may have 8 streams on links of
 * 100 Gb/s or more in a process with 16 CPUs or more, else 4 (MPLANE_SOCKET_STREAMS); a message of
 * MPLANE_SOCKET_SPLIT_BYTES or more is cut into as many chunks as there are streams open, none under
 * MPLANE_SOCKET_CHUNK_BYTES (chunk_size in socket_data.c).
 *
 * The I/O engine (socket_engine.c): no thread belongs to a connection. One pool of I/O threads per
 * process (MPLANE_SOCKET_THREADS; the usable CPUs, at most two per stream) moves the data streams of
 * every connection, both directions: each stream is given to one pool thread, which waits in epoll
 * on its non-blocking streams and on an eventfd the proxy thread writes when it queues chunks for a
 * sleeping thread, and holds a few splice pipes. A send stream's thread writes the queued chunks
 * (send_chunk_start / send_chunk_end in socket_data.c: where one chunk's transfer starts and ends)
 * and reads the acks of spliced ones; a receive stream's thread parses chunks into their slots
 * (recv_chunk_start / recv_chunk_end) and writes the acks.
 *
 * Lazy streams (MPS_HELLO_LAZY): a connection is its control socket alone until a message that
 * does not go on it (bigger than MPLANE_SOCKET_INLINE_BYTES, or the control socket busy while the
 * process has many sends in flight) needs a data stream; then the first stream opens, and one more
 * each time a message finds every open stream busy, up to the connection's count. They connect
 * (IP_BIND_ADDRESS_NO_PORT: no port held before connect) to the acceptor process's stream listener,
 * one per device and service level (an accepted socket keeps its listener's DSCP and priority from
 * the SYN-ACK on), whose port the ACK names (NCCL closes the listen comm once it accepted), and say
 * a hello with the connection's nonce and their index; the listener's pool thread (thread 0) gives
 * each to the receive comm that nonce names. A stream's pool thread finishes its connect and writes
 * the hello before the chunks queued on it meanwhile, so isend never waits for a stream. A hello
 * without MPS_HELLO_LAZY brings all its streams with the control socket to the listening port, and
 * the acceptor waits for the set (a connector that is not this library's may do so).
 *
 * Small messages (MPLANE_SOCKET_INLINE_BYTES; above MPS_INLINE_ALWAYS only while the process has
 * fewer than MPLANE_SOCKET_INLINE_BUSY sends in flight) skip the I/O threads at both ends: the sender's proxy thread writes the
 * chunk on the control socket itself (without blocking; a partial write is finished by later
 * isend/test calls, and other messages take the data streams meanwhile), and
 * the receiver's test() reads the control socket and lands the chunk in its slot, with the same
 * checks as a data stream's. The control socket thus carries CTS records one way and chunks the
 * other, each direction written and read by one proxy thread only.
 *
 * Eager messages (up to the size the receiver's ACK names, MPLANE_SOCKET_EAGER_BYTES) do not wait
 * for a CTS: when every receive group the sender has read is already taken, it writes the message
 * on the control socket with its tag instead of a slot, and the number of groups it had read
 * (`base`). At most MPS_EAGER_MAX such messages, of MPS_EAGER_HOLD bytes together, are unmatched
 * at a time: the sender counts the ones whose group it has not read yet, and beyond that waits
 * for a CTS as before. Both ends match an eager message the same way, so the sender's later
 * sends know which buffers are taken: to the first entry of its tag, in groups numbered `base` or
 * later, that no earlier eager message took; the sender does this when it reads each CTS, the
 * receiver when the message arrives (or, if that group is not posted yet, holds the message,
 * within the same bounds, and matches it when irecv posts one). A message that does not fit its buffer lands nowhere and fails both sides with
 * ncclInvalidUsage, as a too-big CTS-driven send does.
 *
 * While messages arrive eagerly their CTS records are mostly not needed, so the receiver holds them
 * back and writes them in batches (after MPS_EAGER_MAX / 2 eager messages or MPS_EAGER_HOLD / 2
 * bytes of them, which keeps the sender below the bounds: a CTS record write per 16 small messages,
 * where one per message costs about as much as the message's own write). A sender that cannot go
 * on without a CTS (a message too big to go eagerly, the bound reached, a tag no group it has read offers) says so once with a
 * WANT_CTS chunk on a data stream (opening one if none is), where the receiver's I/O threads read it even while its proxy
 * thread calls nothing; that thread then writes what the receiver holds (cts_lock), and each CTS
 * goes at once until messages arrive eagerly again.
 *
 * Spliced chunks: a data-stream chunk of MPLANE_SOCKET_SPLICE_BYTES or more leaves without the
 * sender's copy (socket_splice.c): its pages go to the kernel by vmsplice and splice, flagged
 * MPS_CHUNK_ACK. The socket then refers to NCCL's buffer, so the send completes only when the
 * receiver's I/O thread, having read the payload, answers with an mps_ack on the same stream.
 *
 * Filler: a control-socket chunk whose header and payload are shorter than MPLANE_SOCKET_PAD_BYTES
 * (544) is followed by zero bytes up to that size, their count in the header's flag bits above
 * MPS_CHUNK_FLAG_BITS; the receiver reads and drops them. Why: Linux takes a segment shorter than
 * its estimate of the peer's MSS (536 bytes at first) as a small "pushed" one and, from the second
 * such segment on, sends a bare ACK from inside the reader's recv(), which on the critical path of
 * every small message costs about 1 us each way (mplane-netbench --pingpong,
 * docs/results/2026-12-01-padded-small-messages.md).
 * Segments of at least 536 bytes and one size become that estimate, and are ACKed every second
 * segment from the receive softirq or ride the CTS records. */
#ifndef MPLANE_NET_SOCKET_H
#define MPLANE_NET_SOCKET_H

#include <errno.h>
#include <sys/uio.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdint.h>
#include <sys/socket.h>

#include "../../common/config.h"
#include "../handle.h"
#include "../stats.h"
#include "../tag_wait.h"
#include "../transport.h"
#include "../transport_base.h"

#define MPS_MAX_STREAMS 16
#define MPS_MAX_RECVS 8
#define MPS_MAX_GROUPS NCCL_NET_MAX_REQUESTS             /* receive requests in flight */
#define MPS_MAX_SLOTS (MPS_MAX_GROUPS * MPS_MAX_RECVS)   /* = sends in flight */
#define MPS_MAX_DEVS 32
#define MPS_CTRL_STAGE 16384 /* receiver: bytes of the control stream read in one call */
#define MPS_INLINE_ALWAYS 16384 /* inline up to this size even while other sends are in flight */
#define MPS_CTRL_POLL_NS 1000 /* test() reads the control socket at most this often */
#define MPS_CTRL_GRACE_NS 1000000000ull /* streams all closed, control open: a receive waits this long */
#define MPS_EAGER_MAX 32 /* eager messages a receiver holds unmatched per comm, ... */
#define MPS_EAGER_HOLD (512u << 10) /* ... and their bytes at most (8 of the largest, 64K) */

/* ---- wire formats (little endian; both ends are x86-64/arm64 little endian hosts) ---- */
enum mps_msg_type { MPS_HELLO = 1, MPS_ACK = 2, MPS_NACK = 3, MPS_CTS = 4 };

/* First bytes on every new socket, connector -> acceptor. */
struct mps_hello {
  uint32_t magic;
  uint16_t version;
  uint16_t type;         /* MPS_HELLO */
  uint64_t node_id;
  uint64_t nonce;        /* same for the sockets of one connection */
  int32_t plane;
  uint16_t stream;       /* 0 = control, 1.. = data stream index + 1 */
  uint16_t nstreams;     /* data streams the connection opens at most */
  uint32_t sl;           /* service level / DSCP class requested */
  uint32_t flags;        /* MPS_HELLO_LAZY */
  uint32_t reserved[4];
};
/* Control hello: the data streams come later, each when a message first needs it, to the port the
 * ACK names (the process's stream listener), not with the control socket to the listening port.
 * Without it the acceptor waits for the whole set (all nstreams streams with the control socket).
 * A data stream's hello to the stream listener carries it too. */
#define MPS_HELLO_LAZY 0x1u

/* Control records, receiver -> sender, fixed size. */
struct mps_ctrl {
  uint32_t magic;
  uint16_t version;
  uint16_t type;         /* MPS_ACK, MPS_NACK, MPS_CTS */
  uint32_t n;            /* CTS: entries used; ACK: eager messages the receiver holds (0: none) */
  uint32_t eager_bytes;  /* ACK: the largest eager message */
  union {
    uint64_t seq;        /* CTS: receive sequence number */
    uint64_t hold;       /* ACK: bytes of unmatched eager messages the receiver holds at most */
  };
  union {
    struct {
      uint32_t slot;
      int32_t tag;
      uint64_t size;
    } e[MPS_MAX_RECVS];  /* CTS */
    struct {
      uint32_t stream_port; /* ACK: the port (host order) lazy data streams connect to; 0: none */
    } ack;
  };
};

#define MPS_CHUNK_TRUNCATED 0x1 /* sender's message does not fit: no payload follows */
#define MPS_CHUNK_EAGER 0x2     /* a whole message sent before its CTS (control socket only) */
#define MPS_CHUNK_WANT_CTS 0x4  /* no payload: the sender waits for a CTS the receiver holds back */
#define MPS_CHUNK_ACK 0x8       /* data stream: the payload was spliced; answer with an mps_ack once read */
#define MPS_CHUNK_FLAG_BITS 0xffffu /* the flags proper; on the control socket the bits above count */
#define MPS_CHUNK_PAD_SHIFT 16      /* ... the filler bytes that follow the payload (socket.h, top) */
#define MPS_PAD_MAX 4096            /* the most filler one chunk carries */

/* Header of every data chunk; payload of `len` bytes follows. */
struct mps_chunk {
  union {
    uint32_t slot;
    int32_t tag;   /* MPS_CHUNK_EAGER: the message's tag */
  };
  uint32_t flags;
  union {
    uint64_t offset;
    uint64_t base; /* MPS_CHUNK_EAGER: CTS groups the sender had read (the message goes to a later one) */
  };
  uint64_t len;
  uint64_t total;
};

/* Receiver -> sender on a data stream, one per MPS_CHUNK_ACK chunk, in the chunks' order. */
struct mps_ack {
  uint32_t magic; /* MPS_ACK_MAGIC */
  uint32_t slot;  /* the chunk's slot: a check on the order */
};
#define MPS_ACK_MAGIC 0x4b43414du

/* ---- devices ---- */
struct mps_dev {
  char ifname[64];
  union {
    struct sockaddr sa;
    struct sockaddr_in sin;
    struct sockaddr_in6 sin6;
  } addr;
  socklen_t addrlen;
  struct mplane_dev_props props;
};

int mps_dev_count(void);
/* What a link is decides the defaults (streams, NCCL's buffers and channels, tuner rows), the same
 * rule on every kind: its rate, from the driver where it has one; a host-copied link (loopback, a
 * veth pair: no device of their own, every byte copied by the host's cores, veth's 10 Gb/s is a
 * constant of its driver) moves MPS_HOST_LINK_MBPS_PER_CPU per usable CPU, at most
 * MPS_HOST_LINK_MBPS_MAX; MPLANE_SOCKET_SPEED replaces the rate of both kinds that report none. */
#define MPS_HOST_LINK_MBPS_PER_CPU 25000
#define MPS_HOST_LINK_MBPS_MAX 400000
int mps_host_link_mbps(int ncpus);
/* 1 if every device found runs at MPS_FAST_LINK_MBPS or more: NCCL's 4 MiB buffers on 8 channels
 * and the transport's tuner rows (net/socket/socket_transport.c says why). */
int mps_fast_links(void);
/* The CPUs this process may run on (its affinity mask): what sizes the pool of I/O threads. */
int mps_usable_cpus(void);
const struct mps_dev *mps_dev_get(int dev);
ncclResult_t mps_iface_discover(const struct mplane_config *cfg);
const struct mplane_config *mps_config(void);
/* sendmsg until every byte of iov[0..n) is out (the array is consumed): 0 ok, -1 error. */
int mps_sendv_all(int fd, struct iovec *iov, int n);
/* ... with more send flags (MSG_MORE). */
int mps_sendv_flags(int fd, struct iovec *iov, int n, int flags);

/* Data streams of a connection over a link of speed_mbps from a process that may run on ncpus CPUs
 * (MPLANE_SOCKET_STREAMS; 0: 8 on a fast link with at least 16 CPUs, else 4: one TCP stream per
 * core falls short on a fast link, and streams beyond what the pool's threads can move only
 * contend). */
int mps_streams_for(const struct mplane_config *cfg, int speed_mbps, int ncpus);
#define MPS_FAST_LINK_MBPS 100000 /* links this fast get 8 streams: one TCP stream per core falls short */

/* How long a pool thread polls before it sleeps, from MPLANE_SOCKET_SPIN_US. */
uint64_t mps_spin_ns(const struct mplane_config *cfg);
/* 1 if ifname is selected by an NCCL_SOCKET_IFNAME-style spec ("" = automatic choice). */
int mps_iface_match(const char *spec, const char *ifname, int is_loopback);
void mps_addr_str(const struct sockaddr *sa, char *buf, size_t len);
/* The WARN for running out of file descriptors (errno EMFILE/ENFILE) opening `what` (peer: or NULL). */
void mps_warn_fds(const char *what, const char *peer);
/* ... and for running out of local ports (errno EADDRNOTAVAIL at connect). */
void mps_warn_ports(const char *what, const char *peer);
/* Bind an outgoing socket to the device's address without taking a port (socket_conn.c). 0 ok. */
int mps_bind_source(int fd, const struct mps_dev *d);

/* ---- error state shared by a comm's threads and the proxy thread: the transport base's slot
 * (net/transport_base.h) ---- */
#define mps_error_set mplane_error_set
/* The error (with a WARN the first time) or ncclSuccess; a message being written is waited for. */
static inline ncclResult_t mps_error_check(struct mplane_error *e) { return mplane_error_check(e, "socket"); }

/* Requests carry a kind in their first word so test() can tell sends from receives. */
#define MPS_REQ_SEND 0x53454e44u
#define MPS_REQ_RECV 0x52454356u

/* ---- send side ---- */
struct mps_send_req;

struct mps_task {
  struct mps_send_req *req;
  int stream;
  struct mps_chunk hdr;
  const char *data;
};

/* ---- the I/O engine (socket_engine.c) ----
 * One pool of I/O threads per process moves every connection's data streams, both directions: each
 * thread waits in epoll on the non-blocking streams given to it (a stream stays on one thread), on
 * an eventfd that wakes it for new work, and owns one splice pipe. A stream is a send stream (the
 * proxy thread queues chunks, the pool thread writes them and reads the acks of spliced ones) or a
 * receive stream (the pool thread parses chunks into their slots and writes the acks). */
struct mps_pool;
enum mps_stream_kind { MPS_STREAM_SEND = 1, MPS_STREAM_RECV = 2, MPS_STREAM_LISTEN = 3, MPS_STREAM_HELLO = 4 };

struct mps_spliced {               /* a spliced chunk waiting for its ack */
  struct mps_send_req *req;
  uint32_t slot;
};

struct mps_ack_out {               /* an ack not yet written, and the chunk it completes after */
  struct mps_ack a;
  struct mps_slot *slot;
  uint64_t len, total;
};

struct mps_stream {
  int fd;
  int kind;                        /* enum mps_stream_kind */
  int index;                       /* in its comm's streams */
  void *comm;                      /* struct mps_send_comm or mps_recv_comm */
  struct mps_pool *pool;
  uint32_t armed;                  /* epoll events asked for (pool thread, and attach) */
  int finished;                    /* pool thread: no more I/O on it (closed by the peer or failed) */
  int detached;                    /* under the pool's lock: the pool thread let go of it */
  struct mps_stream *next;         /* on the pool's ready or detach list (under its lock) */
  int listed;                      /* on the ready list */
  int inflight;                    /* send: chunks queued and not yet all in the socket (atomic) */
  int connecting;                  /* send, lazy: the pool thread finishes its connect and writes its hello first */
  size_t hello_sent;
  /* send: chunks queued by the proxy thread, under the pool's lock (a ring that grows) */
  struct mps_task *tasks;
  unsigned cap, head, tail;
  struct {                         /* the chunk being written (pool thread) */
    int active, spliced;
    struct mps_task t;
    struct mps_chunk hdr;          /* as it goes on the wire (MPS_CHUNK_ACK when spliced) */
    size_t done;                   /* bytes of header + payload on the socket */
    void *prof;                    /* its profiler event (net/profiler.h), or NULL */
  } cur;
  struct mps_spliced *acks;        /* spliced chunks waiting for their ack, oldest first (pool thread) */
  unsigned acap, ahead, atail;
  char carry[sizeof(struct mps_ack)];
  unsigned ncarry;
  /* receive: the chunk being parsed (pool thread) */
  struct mps_chunk h;
  size_t hhave;
  int in_payload;
  struct mps_slot *slot;
  char *dst;
  uint64_t rem;
  void *prof;                      /* the payload's profiler event (net/profiler.h), or NULL */
  struct mps_ack_out ackq[8];      /* acks not yet written (the socket's buffer was full) */
  unsigned nackq;
  size_t ackq_done;                /* bytes of ackq[0] written */
  /* an accepted stream saying hello (pool thread 0), or the stream listener */
  struct mps_hello hello;
  double since;
  int dev;
  char peer[80];
};

/* Threads of the pool for a process on ncpus CPUs whose connections have nstreams streams
 * (MPLANE_SOCKET_THREADS; 0: the usable CPUs, at most two per stream, one per direction). */
int mps_pool_size_for(const struct mplane_config *cfg, int nstreams, int ncpus);
/* Give a stream to a pool thread (started if it is the first): 0, or -1 after a WARN. With first,
 * to thread 0 (the stream listener's). */
int mps_engine_attach(struct mps_stream *st);
int mps_engine_attach_first(struct mps_stream *st);
/* The pool thread that holds st lets go of it at once (it is that thread): no more events. */
void mps_engine_forget(struct mps_stream *st);
/* Take it back: returns once its pool thread no longer touches it (the fd stays open). */
void mps_engine_detach(struct mps_stream *st);
/* Pool thread: take the next chunk queued on st into *t. 0: none. */
int mps_engine_take(struct mps_stream *st, struct mps_task *t);
/* Proxy thread: queue a chunk on a send stream. 0, or -1 with no memory (after a WARN). */
int mps_engine_push(struct mps_stream *st, const struct mps_task *t);
/* Pool threads started so far (tests, the scale harness). */
int mps_engine_threads(void);
/* Pool thread: arm exactly these epoll events on st. */
void mps_engine_arm(struct mps_stream *st, uint32_t events);
/* Pool thread: a splice pipe of st's thread for st (the one holding its bytes, else a free one);
 * NULL: copy (all busy, or no more can be made). */
int *mps_engine_pipe(struct mps_stream *st);
/* Pool thread: that pipe holds bytes of st's chunk (bytes > 0; no other stream takes it), or is empty. */
void mps_engine_pipe_hold(struct mps_stream *st, const int *pipe, size_t bytes);
size_t mps_engine_pipe_bytes(struct mps_stream *st, const int *pipe);
/* Grow a ring of elsize-byte entries [*head, *tail) that is full (or has none yet) to twice its
 * capacity (16 at first), entries kept in order from index 0. 0, or -1 with no memory (unchanged). */
int mps_ring_grow(void **ring, size_t elsize, unsigned *cap, unsigned *head, unsigned *tail);
/* socket_data.c: what the pool thread runs for a stream: epoll events (0: chunks were queued). */
void mps_stream_io(struct mps_stream *st, uint32_t events);
/* socket_data.c: copy more of st's current chunk (header, then payload, from st->cur.done) into its
 * socket without blocking. 1 all out, 0 the socket is full, -1 error (errno). */
int mps_send_copy_step(struct mps_stream *st);
/* A non-blocking call that did nothing for now (call again), not a failure. */
static inline int mps_would_block(void) { return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR; }

struct mps_send_comm;
struct mps_recv_comm;

struct mps_send_req {
  uint32_t kind; /* MPS_REQ_SEND */
  struct mps_send_comm *comm;
  int used;
  size_t size;
  int nchunks;
  int chunks_done; /* atomic */
  int counted;     /* in the process's count of sends in flight */
  struct mplane_stats_req stats;
  void *phandle;   /* NCCL's profiler handle of the send: its chunks' events carry it (net/profiler.h) */
};

struct mps_cts_group {
  uint64_t seq;
  int n, used;
  struct {
    uint32_t slot;
    int32_t tag;
    uint64_t size;
    int taken;
  } e[MPS_MAX_RECVS];
};

struct mps_send_comm {
  int ctrl_fd;
  int nstreams;                    /* data streams the connection opens at most */
  int nopen;                       /* ... opened so far: streams[0..nopen) */
  struct mps_stream *streams[MPS_MAX_STREAMS];
  char peer[80];
  int acked;                       /* the acceptor's ACK (or a CTS, which follows it) has arrived */
  uint64_t ack_deadline_ns;        /* isend fails if no ACK by then (MPLANE_CONNECT_TIMEOUT after connect) */
  size_t split_bytes;
  size_t chunk_bytes;              /* a split message's chunks are at least this big */
  size_t splice_bytes;             /* data-stream chunks this big are spliced (0: never) */
  unsigned rr;                     /* stream of the next unsplit message */
  struct mps_cts_group cts[MPS_MAX_GROUPS];
  uint64_t cts_head, cts_tail;     /* ring of offered receive groups; cts_tail: groups read so far */
  char ctrl_buf[MPS_MAX_GROUPS * sizeof(struct mps_ctrl)]; /* control records read, not yet whole */
  size_t ctrl_have;
  struct mps_send_req reqs[MPS_MAX_SLOTS];
  struct mps_send_req trunc_req; /* owner of "does not fit" notices: never handed to NCCL or reused */
  int stop;
  struct mplane_error err;
  struct mplane_tag_wait tag_wait; /* sends that wait for a later receive group (shared comms) */
  struct mplane_stats_comm stats;  /* plugin/'s counters of this comm (net/stats.h) */
  size_t inline_bytes;             /* messages up to this size go on the control socket */
  int inline_busy;                 /* ... above MPS_INLINE_ALWAYS only with fewer sends in flight (0: always) */
  uint32_t eager_max;              /* from the receiver's ACK: eager messages it holds (0: no eager) */
  uint64_t eager_bytes;            /* ... and their largest size */
  struct {                         /* eager messages sent whose group this side has not read yet */
    int32_t tag;
    uint64_t size;
  } eager[MPS_EAGER_MAX];
  unsigned neager;
  uint64_t eager_hold;             /* from the ACK: their bytes at most */
  uint64_t eager_unmatched;        /* bytes of the eager[] messages */
  int nudged;                      /* a WANT_CTS chunk went since the last CTS */
  int nudges;                      /* WANT_CTS chunks pushed (one in a queue at a time) */
  struct mps_send_req nudge_req;   /* owner of WANT_CTS chunks: never handed to NCCL */
  struct {                         /* the inline chunk being written on the control socket */
    struct mps_send_req *req;      /* NULL: the control socket is idle */
    struct mps_chunk hdr;
    const char *data;
    size_t pad;                    /* filler bytes after the data */
    size_t done;                   /* bytes of hdr + data + filler written so far */
    void *prof;                    /* its NCCL profiler event (net/profiler.h) */
  } inl;
  uint32_t pad_to;                 /* control-socket chunks shorter than this are padded to it */
  /* lazy data streams (socket.h, MPS_HELLO_LAZY): opened when a message first needs them */
  int dev;                         /* our device: streams leave from its address */
  union {
    struct sockaddr sa;
    struct sockaddr_in sin;
    struct sockaddr_in6 sin6;
  } peer_addr;                     /* the acceptor's address; the ACK names the port */
  socklen_t peer_addr_len;
  uint32_t stream_port;            /* from the ACK; 0: none offered */
  struct mps_hello hello;          /* the control socket's hello: streams say the same, with their index */
  int nstarted;                    /* streams ever started: the next one's index */
  int trunc_pending;               /* a "does not fit" notice waits for the control socket (trunc_hdr) */
  struct mps_chunk trunc_hdr;
};

/* ---- receive side ---- */
enum mps_slot_state { MPS_SLOT_FREE = 0, MPS_SLOT_POSTED, MPS_SLOT_DONE, MPS_SLOT_TRUNCATED, MPS_SLOT_BAD };

/* A posted buffer. Chunks of one message arrive on several streams, so on several I/O threads
 * at once: each chunk claims its byte range under `lock` first, and a range that overlaps one
 * already claimed, lies past the message's total, or names another total is the peer's error. */
struct mps_slot {
  char *buf;
  uint64_t cap;
  uint64_t received; /* atomic */
  uint64_t total;    /* atomic, from the first chunk */
  int state;         /* atomic, enum mps_slot_state */
  int lock;          /* atomic spin lock over nranges/ranges (chunks of one message only) */
  int nranges;       /* under lock; atomic stores: recv_test reads it without the lock */
  struct { uint64_t off, len; } ranges[MPS_MAX_STREAMS]; /* claimed by the chunks so far */
  void *phandle;     /* NCCL's profiler handle of this buffer's receive (net/profiler.h) */
};

struct mps_recv_req {
  uint32_t kind; /* MPS_REQ_RECV */
  struct mps_recv_comm *comm;
  int used;
  int n;
  uint64_t seq;     /* the group's number in the CTS records */
  unsigned eager;   /* bit i: entry i was taken by an eager message */
  uint32_t slots[MPS_MAX_RECVS];
  int tags[MPS_MAX_RECVS];
  struct mplane_stats_req stats;
};

struct mps_recv_comm {
  int ctrl_fd;
  int nstreams;                    /* data streams the sender opens at most */
  int nopen;                       /* ... attached so far: streams[0..nopen) */
  struct mps_stream *streams[MPS_MAX_STREAMS];
  char peer[80];
  uint64_t seq;
  struct mps_slot slots[MPS_MAX_SLOTS];
  uint32_t free_slots[MPS_MAX_SLOTS];
  int nfree;
  struct mps_recv_req reqs[MPS_MAX_GROUPS];
  char out_buf[MPS_MAX_GROUPS * sizeof(struct mps_ctrl)]; /* CTS records not yet written */
  size_t out_len;
  int stop; /* atomic */
  int streams_closed; /* atomic: data streams the peer closed in order (FIN at a chunk boundary) */
  uint64_t streams_closed_ns; /* when test() first saw them all closed with a receive waiting */
  uint64_t eager_bytes;          /* what our ACK offered: the largest eager message */
  struct mps_eager_held {        /* eager messages read before their group was posted, in arrival order */
    int32_t tag;
    uint64_t base, size;
    char *data;
    int whole;                   /* its payload has all arrived */
  } held[MPS_EAGER_MAX];
  int nheld;
  uint64_t held_bytes;           /* their sizes */
  int cts_defer;                 /* messages come eagerly: CTS records wait for a batch (or WANT_CTS) */
  unsigned eager_since_flush;    /* eager messages since CTS records were last written */
  uint64_t eager_bytes_since_flush; /* ... and their bytes */
  int cts_wanted;                /* a WANT_CTS came: the next CTS record goes at once */
  int ctrl_gone;                 /* the sender closed its control socket: CTS records are dropped */
  pthread_mutex_t cts_lock;      /* out_buf, out_len and the four above: proxy and I/O threads */
  struct mps_ctrl_rx { /* the control socket's incoming chunks (inline messages); proxy thread only */
    size_t have, pos;            /* stage[pos..have) read but not consumed */
    struct mps_chunk h;
    size_t hhave;                /* header bytes collected */
    int in_payload;              /* inside h's payload */
    struct mps_slot *slot;       /* ... which lands in this slot (chunk_end when whole), */
    struct mps_eager_held *held; /* ... or is held, or with neither is dropped (a message too big) */
    char *dst;                   /* where the payload's next byte goes (NULL: dropped) */
    uint64_t rem;                /* payload bytes left */
    uint32_t pad;                /* filler bytes after this payload, dropped */
    void *prof;                  /* the payload's NCCL profiler event, when it lands in a slot */
    int closed;                  /* the peer closed it at a chunk boundary */
    uint64_t empty_ns;           /* when test() last read it */
    char stage[MPS_CTRL_STAGE];
  } rx;
  struct mplane_error err;
  struct mplane_stats_comm stats;  /* plugin/'s counters of this comm (net/stats.h) */
  uint64_t nonce, node_id;         /* the connection's, from its hello: lazy streams find it by them */
  uint32_t sl;                     /* the class the connector asked for (our side's sockets too) */
  struct mps_recv_comm *reg_next;  /* in the process's table of comms that take lazy streams */
  int registered;
};

/* ---- connection establishment (socket_conn.c) ---- */
/* The recv comms that take lazy data streams (socket_conn.c): a stream's hello names its nonce. */
void mps_recv_register(struct mps_recv_comm *c);
void mps_recv_unregister(struct mps_recv_comm *c);
/* The process's stream listener on device dev for connections of service level sl (made at the first
 * call, its socket marked with sl): its port, 0 after a WARN. */
int mps_stream_listener_port(int dev, int sl);
/* Pool thread 0: the stream listener and the hellos of streams it accepted (kinds LISTEN, HELLO). */
void mps_stream_accept_io(struct mps_stream *st, uint32_t events);
/* Pool thread 0, each turn: drop accepted streams silent too long; the wait (ms) until next due, -1 none. */
int mps_stream_hellos_sweep(void);
/* Proxy thread: open a data stream of send comm c (non-blocking connect + hello); 0, or -1 after a WARN. */
int mps_stream_connect(struct mps_send_comm *c, int *fd);
ncclResult_t mps_listen(int dev, void *handle, void **listen_comm);
ncclResult_t mps_connect(int dev, const struct mplane_comm_opts *opts, void *handle, void **send_comm);
ncclResult_t mps_accept(void *listen_comm, void **recv_comm);
ncclResult_t mps_close_listen(void *listen_comm);

/* ---- data path (socket_data.c) ---- */
/* Start a comm whose first nopen data streams are fds[] (they become the comm's, closed on failure). */
ncclResult_t mps_send_comm_start(struct mps_send_comm *c, const struct mplane_config *cfg, const int *fds);
ncclResult_t mps_recv_comm_start(struct mps_recv_comm *c, const int *fds);
ncclResult_t mps_isend(void *send_comm, void *data, size_t size, int tag, void *mhandle, void *phandle,
                       void **request);
ncclResult_t mps_irecv(void *recv_comm, int n, void **data, size_t *sizes, int *tags, void **mhandles,
                       void **phandles, void **request);
ncclResult_t mps_test(void *request, int *done, int *sizes);
ncclResult_t mps_close_send(void *send_comm);
ncclResult_t mps_close_recv(void *recv_comm);

/* ---- one-sided ops (socket_rma.c) ---- */
extern const struct mplane_rma_ops mps_rma_ops;

#endif
