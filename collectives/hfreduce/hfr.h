/* libmplane-hfreduce's internals: the communicator, its shared memory, its links (docs/hfreduce.md). */
#ifndef MPLANE_HFR_H
#define MPLANE_HFR_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "mplane_hfreduce.h"
#include "hfr_tree.h"
#include "common/config.h"
#include "common/nccl/err.h"
#include "net/transport.h"

#define HFR_MAX_LOCAL 32   /* ranks per node */
#define HFR_MAX_SLOTS 16   /* chunks in flight (2 messages per link each, under the 32 a comm takes) */
#define HFR_MAX_LINKS 6    /* distinct tree neighbours: a parent and two children in each tree */
#define HFR_HOST_LEN 64

/* What every rank tells the bootstrap root; the root sends every rank's record to all. */
struct hfr_boot_rec {
  uint64_t magic;
  int32_t rank, nranks, pid;
  int32_t slots;
  int64_t chunk_bytes;
  char host[HFR_HOST_LEN];         /* NCCL_HOSTID, else the host name */
};

/* One local rank's words in the node's shared memory, each on its own cache line. The counters
 * count chunks since the communicator was made (they never go back); a release store publishes
 * the data before it. */
struct hfr_shm_rank {
  _Alignas(64) uint64_t posted;    /* chunks copied in: in[slot][me] holds chunk posted-1 */
  _Alignas(64) uint64_t reduced;   /* chunks whose slice `me` is final in res[slot] */
  _Alignas(64) uint64_t consumed;  /* chunks copied out: the slot may be taken again */
  _Alignas(64) uint64_t desc_seq;  /* allreduce number of the descriptor below */
  uint64_t desc_count;
  int32_t desc_dtype, desc_op;
  int32_t pid;
  int32_t waits_for;               /* the rank this one has waited for a while (-1 none): a local rank
                                    * that times out waiting for it names that one too */
};

struct hfr_shm_head {
  uint64_t magic;
  int32_t attached;
  int32_t abort;                   /* set by a local rank that failed; abort_msg says why */
  int32_t abort_culprit;           /* the rank at fault as that rank saw it */
  int32_t abort_sure;              /* 1: it died, broke a link or passed bad arguments; 0: it was waited for too long */
  char abort_msg[512];
  struct hfr_shm_rank rank[HFR_MAX_LOCAL];
};

/* A tree neighbour (the rank of the same local index on another node), both directions. */
struct hfr_link {
  int peer;          /* global rank */
  int node;          /* its node index */
  void *send_comm, *recv_comm;
  void *send_mh_shm, *send_mh_scratch, *recv_mh_shm, *recv_mh_scratch;
  /* The next message to post each way, as (chunk of the op, tree): keys go up one by one. */
  size_t send_next, recv_next;
};

struct mplane_hfreduce_comm {
  int rank, nranks;
  int node, nnodes;
  int local, nlocal;                 /* index on the node, ranks on the node */
  int *node_of;                      /* [nranks] */
  int *column;                       /* [nnodes]: the rank of my local index on each node */
  char host[HFR_HOST_LEN];
  struct hfr_boot_rec *recs;         /* [nranks] */
  char (*handles)[NCCL_NET_HANDLE_MAXSIZE]; /* [nranks]: listen handles (second bootstrap round) */
  int boot_fd;
  int failed;                        /* a call failed: only destroy is accepted */
  int culprit;                       /* the rank a failure is blamed on (-1: this one), told to the tree neighbours */
  int culprit_sure;                  /* 0: only waited for too long (it may wait for another itself) */

  /* the transport */
  const struct mplane_transport_ops *ops;
  int dev;
  void *listen_comm;
  struct mplane_comm_opts opts;
  struct hfr_link links[HFR_MAX_LINKS];
  int nlinks;
  struct mp_hfr_tree_pos tree[2];
  int tree_link_parent[2], tree_link_child[2][2]; /* link index, -1 absent */

  /* the node's shared memory */
  char shm_name[64];
  struct hfr_shm_head *shm;
  size_t shm_bytes;
  char *data;                        /* slots: in[0..nlocal-1], res, each chunk_bytes */
  int shm_unlinked;

  /* this rank's registered scratch: descriptors, children's halves */
  char *scratch;
  size_t scratch_bytes;
  size_t child_bytes;                /* one child's half of one chunk, at most */

  size_t chunk_bytes;
  int slots;
  int timeout_s;
  uint64_t chunks_done;              /* chunks before the next allreduce (same on every local rank) */
  uint64_t op_seq;
  int pinned;                        /* the shared segment and scratch are page-locked for the copy engine */
};

/* In-slot addresses. */
static inline char *hfr_in(struct mplane_hfreduce_comm *c, int slot, int l) {
  return c->data + ((size_t)slot * (size_t)(c->nlocal + 1) + (size_t)l) * c->chunk_bytes;
}
static inline char *hfr_res(struct mplane_hfreduce_comm *c, int slot) { return hfr_in(c, slot, c->nlocal); }
static inline char *hfr_child_buf(struct mplane_hfreduce_comm *c, int slot, int tree, int k) {
  return c->scratch + 4096 + ((size_t)slot * 4 + (size_t)tree * 2 + (size_t)k) * c->child_bytes;
}
/* descriptors: mine at 0, link i's at 64 * (i + 1); the failure note at 1024 */
static inline char *hfr_desc_buf(struct mplane_hfreduce_comm *c, int i) { return c->scratch + 64 * (size_t)(i + 1); }
static inline char *hfr_note_buf(struct mplane_hfreduce_comm *c) { return c->scratch + 1024; }

/* The error of the last failing call (thread-local), written with a WARN. Returns res. */
int hfr_fail(int res, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* The same, and the node's abort flag raised so that the local ranks fail now, naming this rank. */
int hfr_fail_comm(struct mplane_hfreduce_comm *c, int res, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
/* "rank 5 (node 2, host h)" */
const char *hfr_rank_name(struct mplane_hfreduce_comm *c, int rank, char *buf, size_t len);

/* bootstrap (hfr_boot.c) */
/* Join the root of id: send mine, get every rank's records; *fd stays open for the all-gathers. */
int hfr_boot_exchange(const mplane_hfreduce_unique_id *id, struct hfr_boot_rec *mine, int nranks,
                      struct hfr_boot_rec *all, int timeout_s, int *fd);
/* Every rank's `size` bytes (the same size on all), in rank order, through the root. */
int hfr_boot_allgather(int fd, int rank, const void *mine, uint32_t size, int nranks, void *all, int timeout_s);

#endif
