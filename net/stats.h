/* mplane: per-plane and per-class traffic counters.
 *
 * plugin/net_core.c tells this module about every comm it opens (plane, class, SL, relayed or not),
 * every request it starts, every request that completes and every comm it closes. Counters are
 * per process, by plane and by class: bytes and messages sent and received, and bytes sent through
 * a relay NIC (a cross-plane connection). Each comm's own totals go to one INFO line when it
 * closes; with MPLANE_STATS_FILE set, the process totals are (re)written there as JSON at every
 * close ("%p" in the path becomes the process id). Thread-safe: NCCL may run several proxy
 * threads, and counters are atomics. */
#ifndef MPLANE_NET_STATS_H
#define MPLANE_NET_STATS_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define MPLANE_STATS_MAX_PLANES 64

struct mplane_stats_counters {
  uint64_t tx_bytes, tx_msgs, rx_bytes, rx_msgs, relayed_bytes;
};

struct mplane_stats_totals {
  struct mplane_stats_counters plane[MPLANE_STATS_MAX_PLANES];
  struct mplane_stats_counters plane_unknown; /* devices no plane was assigned to (e.g. loopback) */
  struct mplane_stats_counters cls[8];
  uint64_t comms_opened, comms_closed;
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

void mplane_stats_comm_open(void *comm, const struct mplane_stats_comm_info *info);
/* A request started on comm: a send of send_bytes, or a receive of nrecv buffers (bytes are counted
 * at completion, from the sizes test() reports). */
void mplane_stats_request(void *comm, void *request, size_t send_bytes, int nrecv);
/* test() said done: for a receive, sizes holds the nrecv received sizes (NULL: counted as 0 bytes). */
void mplane_stats_request_done(void *request, const int *sizes);
/* INFO summary of the comm, JSON file rewritten when configured. Safe on unknown comms. */
void mplane_stats_comm_close(void *comm);

/* Remember which device and class a listen comm has, for the comms it accepts. */
void mplane_stats_listen(void *listen_comm, int dev, int cls);
/* Device/class remembered for listen_comm; 0 if known. */
int mplane_stats_listen_get(void *listen_comm, int *dev, int *cls);
void mplane_stats_listen_close(void *listen_comm);

void mplane_stats_snapshot(struct mplane_stats_totals *out);
/* Write the totals as JSON to f. */
void mplane_stats_write_json(FILE *f);
/* Expand %p (pid) and %% in a MPLANE_STATS_FILE pattern. 0 on success. */
int mplane_stats_expand_path(const char *pattern, char *out, size_t outlen);
/* Write the JSON file now if MPLANE_STATS_FILE is set (atomically: temp file + rename). */
void mplane_stats_flush(void);

#endif
