/* mplane: per-plane and per-class traffic counters.
 *
 * plugin/net_core.c tells this module about every comm it opens (plane, class, SL, relayed or not),
 * every request it starts, every request that completes and every comm it closes. Counters are
 * per process, by plane and by class: bytes and messages sent and received, and bytes sent through
 * a relay NIC (a cross-plane connection). Each comm also keeps how long its requests took, from
 * isend/irecv to the test() that said done, as a histogram (4 buckets per doubling, so a quantile
 * read from it is an upper bound within 25%). Each comm's own totals and its median and p99
 * request time go to one INFO line when it closes; with MPLANE_STATS_FILE set, the process totals
 * are (re)written there at every close and every MPLANE_STATS_INTERVAL seconds ("%p" in the path
 * becomes the process id), as JSON or in Prometheus' text format (MPLANE_STATS_FORMAT), for
 * node_exporter's textfile collector; each write replaces the file whole (temp file, rename).
 * Errors are requests (or posts) that returned an error to NCCL; a reconnect is a comm opened to a
 * peer host, on the same device and direction, as a comm of this process that closed before.
 * Thread-safe: NCCL may run several proxy threads; a request's path (start, done) touches only its
 * comm's counters, with relaxed atomics. */
#ifndef MPLANE_NET_STATS_H
#define MPLANE_NET_STATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MPLANE_STATS_MAX_PLANES 64
#define MPLANE_STATS_TIME_BUCKETS 100 /* request times: < 1 us, then 4 per doubling up to ~2^24 us */

struct mplane_stats_counters {
  uint64_t tx_bytes, tx_msgs, rx_bytes, rx_msgs, relayed_bytes, errors;
};

struct mplane_stats_totals {
  struct mplane_stats_counters plane[MPLANE_STATS_MAX_PLANES];
  struct mplane_stats_counters plane_unknown; /* devices no plane was assigned to (e.g. loopback) */
  struct mplane_stats_counters cls[8];
  uint64_t comms_opened, comms_closed, reconnects;
};

/* What is known of a comm when it opens. */
struct mplane_stats_comm_info {
  int is_send;
  int dev;            /* the device that carries it (the relay NIC for a cross-plane connect) */
  const char *dev_name;
  int plane;          /* plane of that device, -1 unknown */
  int from_plane;     /* the plane NCCL asked for (differs from plane when relayed) */
  int cls;            /* enum mplane_tc_class */
  int sl;
  int relayed;
  const char *peer;   /* free text for the INFO line, may be NULL */
};

/* One comm's record: lives inside the transport's comm (struct mplane_transport_ops.comm_stats), so
 * the data path finds it without a lookup. Its counters are written only by the comm's own calls
 * (relaxed atomics, no lock): the process totals are the closed comms' sums plus the live comms'
 * counters, summed when a snapshot is taken. */
struct mplane_stats_comm {
  struct mplane_stats_comm_info info;
  char dev_name[64];
  char peer[96];
  struct mplane_stats_counters c;
  uint32_t time_us[MPLANE_STATS_TIME_BUCKETS]; /* completed requests by time taken (stats.c) */
  int open;
  struct mplane_stats_comm *prev, *next; /* the live comms, under a lock taken at open/close/snapshot */
};

/* One request's record: lives inside the transport's request (mplane_transport_ops.req_stats). */
struct mplane_stats_req {
  struct mplane_stats_comm *comm; /* NULL: nothing to count (not started, or counted already) */
  uint64_t send_bytes;
  int nrecv;
  uint64_t start_ns; /* when isend/irecv returned it */
};

void mplane_stats_comm_open(struct mplane_stats_comm *s, const struct mplane_stats_comm_info *info);
/* A request started on comm s: a send of send_bytes, or a receive of nrecv buffers (bytes are counted
 * at completion, from the sizes test() reports). No lock, no allocation. */
void mplane_stats_request(struct mplane_stats_comm *s, struct mplane_stats_req *r, size_t send_bytes, int nrecv);
/* test() said done: for a receive, sizes holds the nrecv received sizes (NULL: counted as 0 bytes).
 * Counted once; nothing once the comm closed. No lock, no allocation. */
void mplane_stats_request_done(struct mplane_stats_req *r, const int *sizes);
/* An isend/irecv on comm s, or a test of request r, returned an error to NCCL: one error on the comm's
 * plane and class (a request counts once, and no more as a message). No lock, no allocation. */
void mplane_stats_comm_error(struct mplane_stats_comm *s);
void mplane_stats_request_error(struct mplane_stats_req *r);
/* The request time (us) that a fraction q (0..1) of the comm's completed requests stayed within:
 * the upper edge of its histogram bucket. 0 when none completed. */
double mplane_stats_time_quantile(const struct mplane_stats_comm *s, double q);
/* INFO summary of the comm, its counters folded into the process totals, JSON file rewritten when
 * configured. Safe on NULL and on a comm that is not open. */
void mplane_stats_comm_close(struct mplane_stats_comm *s);
/* One-sided ops (the RMA backend): a put counts its bytes as sent (and relayed, on a relayed
 * record), a get its bytes as received, when the op is posted. Called only from the thread that
 * posts (NCCL's GIN progress thread). */
void mplane_stats_rma(struct mplane_stats_comm *s, uint64_t bytes, int is_get);

/* Remember which device and class a listen comm has, for the comms it accepts. */
void mplane_stats_listen(void *listen_comm, int dev, int cls);
/* Device/class remembered for listen_comm; 0 if known. */
int mplane_stats_listen_get(void *listen_comm, int *dev, int *cls);
void mplane_stats_listen_close(void *listen_comm);

void mplane_stats_snapshot(struct mplane_stats_totals *out);
/* Write the totals as JSON to f. */
void mplane_stats_write_json(FILE *f);
/* Write the totals to f in Prometheus' text exposition format (version 0.0.4). */
void mplane_stats_write_prometheus(FILE *f);
/* Expand %p (pid) and %% in a MPLANE_STATS_FILE pattern. 0 on success. */
int mplane_stats_expand_path(const char *pattern, char *out, size_t outlen);
/* Write the counters file(s) now if MPLANE_STATS_FILE is set (each atomically: temp file + rename). */
void mplane_stats_flush(void);

#endif
