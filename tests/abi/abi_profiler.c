/* mplane ABI harness: NCCL's profiler events from the net plugin (net v10 and later), on any transport.
 *
 *   profiler   a profiler callback handed to init, a pHandle with every isend and with every buffer
 *              of every irecv: each buffer's transfer reports at least one Start carrying its own
 *              pHandle, in the transport's NCCL descriptor (socket: fd, op, length; IB: QP, work
 *              request, length), and a Stop for each Start by the time test() says done; with the
 *              callback but no pHandles, nothing. Both ranks check their own side.
 *
 * Run it with the transport's eager messages off (MPLANE_SOCKET_EAGER_BYTES=0): a message that
 * reaches the receiver before its irecv is held there and moves again by a copy, not on a stream,
 * so its receive has no event of its own. */
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "abi_harness.h"
#include "common/nccl/profiler_net.h"

#define PF_TOKENS 4096
#define PF_EVENTS 65536

/* One pHandle: a buffer of one exchange, on one side. */
struct pf_token {
  const void *data;
  size_t size;
  int is_send;
  int starts, stops;
};

/* One event NCCL's profiler would hold: what the plugin gets back as eHandle. */
struct pf_event {
  struct pf_token *token;
  int stopped;
};

static struct {
  pthread_mutex_t lock;
  struct pf_token tokens[PF_TOKENS];
  int ntokens;
  struct pf_event events[PF_EVENTS];
  int nevents;
  unsigned expect_type; /* NCCL_PROFILER_NET_TYPE_IB or _SOCK */
  char bad[256];        /* the first thing wrong (callbacks run on the plugin's threads: reported later) */
} pf = {.lock = PTHREAD_MUTEX_INITIALIZER};

static void pf_bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void pf_bad(const char *fmt, ...) {
  if (pf.bad[0]) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(pf.bad, sizeof(pf.bad), fmt, ap);
  va_end(ap);
}

/* The same buffer asked again (a NULL request retried) gets the same pHandle. */
static void *pf_phandle_of(const void *data, size_t size, int is_send) {
  pthread_mutex_lock(&pf.lock);
  struct pf_token *t = NULL;
  for (int i = 0; i < pf.ntokens && !t; i++)
    if (pf.tokens[i].data == data && pf.tokens[i].is_send == is_send) t = &pf.tokens[i];
  if (!t && pf.ntokens < PF_TOKENS) {
    t = &pf.tokens[pf.ntokens++];
    *t = (struct pf_token){.data = data, .size = size, .is_send = is_send};
  }
  pthread_mutex_unlock(&pf.lock);
  if (!t) abi_fail("more than %d buffers in one exchange", PF_TOKENS);
  return t;
}

static struct pf_token *pf_token_of(void *phandle) {
  struct pf_token *t = phandle;
  if (t < pf.tokens || t >= pf.tokens + pf.ntokens) return NULL;
  return t;
}

/* What the descriptor must say for this token. NULL if right, else what is wrong. */
static const char *pf_descr_wrong(int64_t plugin_id, const void *descr, const struct pf_token *t, char *why,
                                  size_t len) {
  unsigned type = (unsigned)plugin_id & NCCL_PROFILER_NET_TYPE_MASK, ver = (unsigned)plugin_id & NCCL_PROFILER_NET_VER_MASK;
  if (type != pf.expect_type || ver != 1) {
    snprintf(why, len, "plugin id 0x%llx: type 0x%x version %u, expected type 0x%x version 1",
             (unsigned long long)plugin_id, type, ver, pf.expect_type);
    return why;
  }
  if (!descr) return "no descriptor";
  if (type == NCCL_PROFILER_NET_TYPE_SOCK) {
    const ncclProfilerNetSockDescr_v1_t *d = descr;
    int op = t->is_send ? NCCL_PROFILER_SOCKET_SEND : NCCL_PROFILER_SOCKET_RECV;
    if (d->type != ncclProfileSocket || d->sock.fd < 0 || d->sock.op != op || d->sock.length > t->size) {
      snprintf(why, len, "socket descriptor type %u fd %d op %d length %zu for a %s of %zu bytes", d->type, d->sock.fd,
               d->sock.op, d->sock.length, t->is_send ? "send" : "receive", t->size);
      return why;
    }
  } else {
    const ncclProfilerNetIbDescr_v1_t *d = descr;
    if (d->type != ncclProfileQp || d->qp.qpNum <= 0 || d->qp.device < 0 || d->qp.length > t->size) {
      snprintf(why, len, "IB descriptor type %u device %d QP %d length %zu for a %s of %zu bytes", d->type,
               d->qp.device, d->qp.qpNum, d->qp.length, t->is_send ? "send" : "receive", t->size);
      return why;
    }
  }
  return NULL;
}

static ncclResult_t pf_callback(void **ehandle, int type, void *phandle, int64_t plugin_id, void *descr) {
  pthread_mutex_lock(&pf.lock);
  if (type == ncclProfilerNetEventStart) {
    struct pf_token *t = pf_token_of(phandle);
    char why[200];
    const char *wrong = t ? pf_descr_wrong(plugin_id, descr, t, why, sizeof(why)) : NULL;
    *ehandle = NULL;
    if (!t) pf_bad("a Start with pHandle %p, which no isend or irecv passed", phandle);
    else if (wrong) pf_bad("a Start for a %s buffer: %s", t->is_send ? "send" : "receive", wrong);
    else if (pf.nevents == PF_EVENTS) pf_bad("more than %d events", PF_EVENTS);
    else {
      t->starts++;
      pf.events[pf.nevents] = (struct pf_event){.token = t};
      *ehandle = &pf.events[pf.nevents++];
    }
  } else if (type == ncclProfilerNetEventStop) {
    struct pf_event *e = ehandle ? *ehandle : NULL;
    if (!e || e < pf.events || e >= pf.events + pf.nevents) pf_bad("a Stop of event %p, which no Start gave", (void *)e);
    else if (e->stopped) pf_bad("a second Stop of one event");
    else {
      e->stopped = 1;
      e->token->stops++;
    }
  } else {
    pf_bad("a callback of type %d (only Start and Stop are used)", type);
  }
  pthread_mutex_unlock(&pf.lock);
  return ncclSuccess;
}

static void pf_reset(void) {
  pthread_mutex_lock(&pf.lock);
  pf.ntokens = 0;
  pf.nevents = 0;
  pthread_mutex_unlock(&pf.lock);
}

/* Every buffer of the exchange reported its transfer, every Start was stopped. Returns the events. */
static int pf_check(const char *what) {
  pthread_mutex_lock(&pf.lock);
  if (pf.bad[0]) abi_fail("%s: %s", what, pf.bad);
  int sends = 0, recvs = 0;
  for (int i = 0; i < pf.ntokens; i++) {
    const struct pf_token *t = &pf.tokens[i];
    if (t->starts == 0)
      abi_fail("%s: no Start for the %s of %zu bytes at %p (its pHandle)", what, t->is_send ? "send" : "receive",
               t->size, t->data);
    if (t->stops != t->starts)
      abi_fail("%s: the %s of %zu bytes had %d Starts and %d Stops once test() said done", what,
               t->is_send ? "send" : "receive", t->size, t->starts, t->stops);
    if (t->is_send) sends++;
    else recvs++;
  }
  int n = pf.nevents;
  pthread_mutex_unlock(&pf.lock);
  abi_note("%s: %d events for %d send and %d receive buffers, each stopped", what, n, sends, recvs);
  return n;
}

int sc_profiler(void) {
  const char *transport = getenv("MPLANE_TRANSPORT");
  pf.expect_type = transport && !strcmp(transport, "ib") ? NCCL_PROFILER_NET_TYPE_IB : NCCL_PROFILER_NET_TYPE_SOCK;
  if (g_opts.version < 10) abi_fail("the profiler callback comes with net v10 and later, not v%d", g_opts.version);
  abi_prof_callback = pf_callback;
  abi_phandle_of = pf_phandle_of;
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  /* 8 x 1 MiB (the data streams, several chunks each on sockets, one per QP on IB), then sizes
   * that take the other paths: empty, inline on the control socket, one chunk, many */
  size_t big[8], mixed[8] = {0, 1, 4095, 65536, 200000, (1 << 20) + 3, 3 << 20, 17};
  for (int i = 0; i < 8; i++) big[i] = 1 << 20;
  struct xfer_spec x1 = {.sizes = big, .count = 8, .group = 1, .seed = 81};
  pf_reset();
  exchange(&nd, &l, rank, pp.fd, &x1, "8 x 1 MiB with pHandles");
  pf_check("8 x 1 MiB");
  int group = recv_group(&nd);
  struct xfer_spec x2 = {.sizes = mixed, .count = 8, .slack = 100, .group = 8 % group ? 1 : group, .seed = 82};
  pf_reset();
  exchange(&nd, &l, rank, pp.fd, &x2, "mixed sizes, multi-buffer receives");
  pf_check("mixed sizes");
  /* NCCL's profiler follows nothing: no pHandles, no events, even with the callback */
  abi_phandle_of = NULL;
  pf_reset();
  exchange(&nd, &l, rank, pp.fd, &x1, "8 x 1 MiB without pHandles");
  if (pf_check("no pHandles") != 0) abi_fail("events were reported for requests that carried no pHandle");
  barrier(pp.fd);
  return pair_down(&pp, rank, &nd, &l);
}
