/* mplane: one-sided ops over TCP, shared by the two halves of the socket RMA backend (private to
 * net/socket/): socket_rma.c (groups, windows, contexts and the ops NCCL calls) over
 * socket_rma_conn.c (a connection's I/O: sending, the record parser that serves the peer, the
 * connection threads and rmaProgress). */
#ifndef MPLANE_NET_SOCKET_RMA_H
#define MPLANE_NET_SOCKET_RMA_H

#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/socket.h>

#include "../../common/clock.h"
#include "../../common/nccl/err.h"
#include "../transport.h"

#define MPR_MAGIC 0x4d505241u /* "MPRA" */
#define MPR_VERSION 1
#define MPR_NO_WIN 0xffffffffu
#define MPR_STAGE (4u << 20) /* GPU windows move through host staging in steps of this size */
#define MPR_REQ_MAGIC 0x52514d41u
#define MPR_RBUF (64u << 10) /* the reader's receive buffer */

/* ---- wire (little endian hosts) ---- */
struct mpr_handle {
  uint32_t magic;
  uint16_t version;
  uint16_t addrlen;
  uint64_t node_id;
  union {
    struct sockaddr sa;
    struct sockaddr_in sin;
    struct sockaddr_in6 sin6;
  } addr;
};
_Static_assert(sizeof(struct mpr_handle) <= MPLANE_RMA_HANDLE_MAX, "RMA handle fits NCCL's handle");

struct mpr_hello {
  uint32_t magic;
  uint16_t version;
  uint16_t kind; /* 0 control, 1 data */
  int32_t rank, nranks, context, reserved;
};

enum mpr_type { MPR_PUT = 1, MPR_GET = 2, MPR_ACK = 3, MPR_GET_RESP = 4, MPR_BYE = 5 };
enum mpr_status { MPR_OK = 0, MPR_BAD_WIN, MPR_BAD_RANGE, MPR_BAD_SIG_WIN, MPR_BAD_SIG_RANGE, MPR_BAD_SIG_OP,
                  MPR_GPU_COPY };

struct mpr_msg {
  uint32_t magic;
  uint16_t type;
  uint16_t status;  /* responses: enum mpr_status */
  uint32_t win;     /* put: destination; get: source (target's window) */
  uint32_t sig_win; /* MPR_NO_WIN: no signal */
  uint64_t off, size;
  uint64_t sig_off, sig_val;
  uint64_t id;
  uint32_t sig_op, reserved;
  uint64_t limit;   /* a refusal: the size of the window it names */
};

/* ---- local state ---- */
struct mpr_win {
  uint32_t id;
  int live;
  char *base;
  size_t size;
  int gpu; /* -1 host memory, else the CUDA device that owns it */
  uint64_t *shadow; /* a GPU signal window NCCL never writes (SIGNAL_NEVER_RESET): its words as this
                       process set them, so an add need not read the GPU; freed with the group */
};

struct mpr_listen {
  int fd;
  int dev;
};

struct mpr_ctxset;

struct mpr_group {
  int rank, nranks, dev;
  int *ctrl; /* control socket per peer, -1 for self */
  /* Windows: read-held by every thread that touches a window's memory for a peer (a landing, a
   * signal, a look-up), for that step only; write-held to add one and to take one out of service,
   * so once deregMrSym holds it no such step is under way and none starts on that window again. */
  pthread_rwlock_t win_lock;
  struct mpr_win *wins;
  uint32_t nwins, cap;
  /* The group's context sets, so deregMrSym can find the answers still queued from a window. */
  pthread_mutex_t sets_lock;
  struct mpr_ctxset **sets;
  int nsets, sets_cap;
};

struct mpr_req;

/* Host memory GPU data moves through: pinned where the driver gives it (real DMA, no copy through a
 * driver buffer), else plain. */
struct mpr_stage {
  char *p;
  int pinned;
};

/* Pinned host memory that asynchronous GPU copies fill or read (NCCL's progress thread never waits
 * for such a copy): space is taken in order and given back in order, a landing piece once its copy
 * into GPU memory completed, a send's once its bytes were sent. */
#define MPR_RING_ENTRIES 256
#define MPR_PIECE (512u << 10)  /* at most, a landing copy into GPU memory: pieces of a large put overlap */
/* A connection's pinned rings and writer stage: the most each may take, and the least. A context
 * set with many connections (NCCL EP asks for 128 contexts) shares out a budget instead, so the
 * pinned memory of a process stays bounded (mpr_ctxset's sizes). */
#define MPR_LRING_MAX (2u << 20)   /* landing ring */
#define MPR_SRING_MAX (1u << 20)   /* GPU data sent from NCCL's thread (records of up to 64 KiB) */
#define MPR_RING_MIN (256u << 10)
#define MPR_WSTAGE_MIN (512u << 10)
#define MPR_RING_BUDGET (64u << 20) /* per context set, for each of landing rings and writer stages; half for send rings */
struct mpr_ring {
  char *p;
  size_t size;
  int gpu;             /* the GPU whose stream copies it */
  uint64_t head, tail; /* bytes taken and given back, counted from the start */
  struct {
    uint64_t end, seq; /* where a piece's space ends (head after it), the copy that uses it */
  } e[MPR_RING_ENTRIES];
  unsigned eh, et;     /* entries taken and given back */
};

/* Where the reader is in the incoming stream. Records are parsed as bytes arrive, by whichever
 * thread holds the connection's rlock (NCCL's progress thread in rmaProgress, else the
 * connection's reader thread), so a record may be taken in several pieces. */
enum mpr_rd_phase { MPR_RD_HDR = 0, MPR_RD_DATA };
struct mpr_rd {
  int phase;
  struct mpr_msg m;    /* the record being read */
  size_t hgot;         /* header bytes in m so far */
  /* MPR_RD_DATA: the bytes after the header */
  struct mpr_req *r;   /* a get's answer: the get it answers; NULL: a put */
  struct mpr_win w;    /* where they land */
  int land;            /* 0: dropped (a refused put) */
  uint64_t off, left;  /* window offset of the next byte, bytes still to come */
  size_t sfill;        /* GPU windows: bytes in the stage, landing at off - sfill */
  char *sbuf;          /* asynchronous landing: the piece's space in the landing ring (NULL: none yet) */
  size_t scap;         /* its size */
  uint64_t last_seq;   /* the last asynchronous copy of this record (0: none) */
  int cuda_bad;        /* a copy into GPU memory failed: the rest is read and dropped */
  int gone;            /* the window was deregistered under the op: the rest is read and dropped */
  uint16_t st;         /* a put: its status so far */
  uint64_t limit;
  struct mpr_win sig;  /* a put: its checked signal window */
};

struct mpr_conn {
  struct mpr_ctxset *set;
  int peer, context, fd;
  char peer_str[96];
  pthread_t rd, wr;
  int threads;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct mpr_req *q_head, *q_tail;     /* to write */
  struct mpr_req *p_head, *p_tail;     /* written, awaiting a response */
  uint64_t next_id;
  int failed, stop;
  int peer_closed; /* the peer destroyed its context in order (a BYE): not an error by itself */
  int wbusy;                           /* a thread is writing: MPR_W_WRITER, or MPR_W_NOW (sent at once) */
  /* Records NCCL's progress thread queued without waking the writer: rmaProgress sends them in one
   * sendmsg once a pass added no op to them (a burst is over) or the oldest has waited long enough. */
  int deferred;                        /* queued records wait for rmaProgress (under lock; stores atomic: read unlocked) */
  uint64_t deferred_ns;                /* when the oldest of them was queued */
  uint64_t ops_added, ops_seen;        /* ops deferred so far; as of the previous rmaProgress */
  int held;                            /* NCCL's aggregation hint: a run of ops is being posted */
  /* Answers to the peer's ops, queued and not yet taken for writing. A peer that sends ops and
   * reads no answers would grow this without end: at MPR_ANSWERS_MAX the reader stops taking its
   * records (backpressure); still there after the timeout, the connection is cut, naming the peer. */
  int answers;                         /* lock; read without it for the reader's check */
  uint64_t full_since_ns;              /* rlock holder: when the reader last found the answers full */
  int drain_waiters;                   /* deregMrSym waits for the write under way (write_done wakes it) */
  pthread_mutex_t rlock;               /* held by whichever thread advances the reader below */
  pthread_cond_t rcond;                /* the reader thread rests on it while rmaProgress reads */
  struct mpr_rd in;                    /* the reader: where it is in the incoming stream */
  int rd_over;                         /* atomic: the reader has stopped (a BYE, a failure, a close) */
  struct mpr_stage stage;              /* the reader's GPU staging; the writer has its own */
  char *rbuf;                          /* the reader's receive buffer: [rpos, rlen) not yet taken */
  size_t rpos, rlen;
  struct mpr_stage wstage;
  struct mpr_stage istage;             /* GPU data of a record sent at once (wbusy holder only) */
  struct mpr_ring lring;               /* the reader's asynchronous landings (rlock holder only) */
  struct mpr_ring sring;               /* GPU data copied out for sending from NCCL's thread (lock) */
};

struct mpr_ctxset {
  struct mpr_group *g;
  int ncontexts;
  struct mpr_conn **conns; /* [context * nranks + peer], NULL: not connected */
  struct mpr_conn **mirrors; /* [context]: the target side of this rank's ops to itself */
  int has_error;           /* atomic: a connection failed or an op was refused */
  int epfd;                /* every connection's socket, for rmaProgress to find the readable ones */
  uint64_t progress_ns;    /* atomic: the last rmaProgress call (0: never) */
  size_t lring_size, sring_size, wstage_size; /* each connection's (mpr_ctxset_size_rings) */
};

enum mpr_req_kind { MPR_K_PUT = 1, MPR_K_GET, MPR_K_ACK, MPR_K_GET_RESP, MPR_K_BYE,
                    MPR_K_RAW /* the unsent tail of a record sent at once, for the writer to finish */ };

struct mpr_req {
  uint32_t magic;
  int kind;
  struct mpr_req *next;
  struct mpr_conn *conn;
  struct mpr_msg m;
  struct mpr_win src;  /* put: where the bytes come from (local window, at m.off's counterpart) */
  uint64_t src_off;
  struct mpr_win dst;  /* get: where the answer lands */
  uint64_t dst_off;
  int done;            /* atomic */
  uint64_t t0_ns;      /* queued at (monotonic): an answer later than the timeout fails the connection */
  ncclResult_t result;
  char *staged;        /* GPU data copied out asynchronously into the connection's sring: sent from here */
  uint64_t stage_seq;  /* ... once that copy has completed */
  uint64_t stage_end;  /* its space in the sring ends here (given back once sent) */
  char *raw;           /* MPR_K_RAW: the bytes, owned */
  size_t raw_len;
  char why[320];
};

#define MPR_ANSWERS_MAX 2048

/* ---- socket_rma_conn.c: windows and timeouts ---- */
int mpr_timeout_ms(void);
/* Window id -> a copy of its record; 0 if it is not registered. */
int mpr_win_get(struct mpr_group *g, uint32_t id, struct mpr_win *out);
int mpr_range_ok(const struct mpr_win *w, uint64_t off, uint64_t size);
/* Copy between a window and host memory; GPU windows through the CUDA driver, synchronised. 0 ok. */
int mpr_win_write(const struct mpr_win *w, uint64_t off, const void *src, size_t n);
int mpr_win_read(const struct mpr_win *w, uint64_t off, void *dst, size_t n);

/* ---- socket_rma_conn.c: connections ---- */
/* Share the pinned-memory budget among a context set's nconn connections. */
void mpr_ctxset_size_rings(struct mpr_ctxset *s, size_t nconn);
struct mpr_conn *mpr_conn_new(struct mpr_ctxset *s, int context, int peer, int fd);
/* Watch it for rmaProgress and start its reader and writer threads. */
ncclResult_t mpr_conn_start(struct mpr_conn *c);
/* Say BYE, drain, join the threads (a peer that stopped reading is cut after the timeout), free. */
void mpr_conn_destroy(struct mpr_conn *c);
/* Send r (a request or a response) in order; ncclRemoteError if the connection has failed. */
ncclResult_t mpr_conn_send(struct mpr_conn *c, struct mpr_req *r);
/* Fail everything queued or pending on c, once, and shut its socket down (a writer blocked inside a
 * record returns; abort shuts it down again where it had failed already). */
void mpr_conn_fail(struct mpr_conn *c, const char *why);
void mpr_conn_abort(struct mpr_conn *c, const char *why);
/* A window is being deregistered: queued answers that would read it become refusals, queued puts of
 * ours from it fail, and the write under way ends first, on a failed connection too (the connection
 * is cut if the peer takes nothing until deadline_ns). */
void mpr_conn_forget_win(struct mpr_conn *c, uint32_t win, const char *base, uint64_t deadline_ns);
/* NCCL's aggregation hint: a run of ops to c begins (on) or ends (off: its records go out now). */
void mpr_conn_hold(struct mpr_conn *c, int on);
/* test() of a request still waiting: hands deferred records to the writer if rmaProgress stopped. */
void mpr_conn_kick(struct mpr_conn *c);
void mpr_req_finish(struct mpr_req *r, ncclResult_t res, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "put", "get", "ack", "bye", "get answer", "rest of a record": a request kind for the log. */
const char *mpr_kind_name(int kind);
/* rmaProgress: serve every connection with bytes waiting, send what waits for it. */
ncclResult_t mpr_progress(void *ctx);

#endif
