/* libmplane-ep planner, host side: buffer sizes, the view of one rank, and the NCCL schedule
 * (which peer gets which bytes of which buffer in each exchange). Plain C, used by the library
 * (collectives/ep/ep_host.c) and by the CPU simulation that CI checks (ep_sim.c). */
#ifndef MPLANE_EP_SCHED_H
#define MPLANE_EP_SCHED_H

#include "ep_plan.h"

/* The exchanges, in the order they run. A, B: counts; D1, D2: dispatch network and NVLink
 * phases; C2, C1: combine, NVLink then network (the reverse paths). */
enum { MP_EP_STEP_A = 0, MP_EP_STEP_B, MP_EP_STEP_D1, MP_EP_STEP_D2, MP_EP_STEP_C2, MP_EP_STEP_C1, MP_EP_NSTEPS };

typedef struct mp_ep_xfer {
  int peer;
  int net; /* 1: peer on another node (network), 0: same node (NVLink / intra-node) */
  int send_buf;
  long send_off, send_bytes;
  int recv_buf;
  long recv_off, recv_bytes;
} mp_ep_xfer;

/* Shape of one context (the view's constant part). */
typedef struct mp_ep_shape {
  int R, N, G, me;
  int E, K, H, Tmax; /* K, Tmax as the planner sees them (flat: 1 and Tmax * topk) */
  int expand;        /* 1, or topk in flat mode */
  int graph;
  int cap_rows;      /* 0 = worst case */
} mp_ep_shape;

typedef struct mp_ep_rows {
  long p1s, p1r, p2s, p2r; /* rows of each staging buffer */
  long cap_rows;           /* expert-output rows */
  long row_bytes;          /* bytes per staging row: max(dispatch BF16 row, combine row) */
} mp_ep_rows;

/* Staging and output sizes for a shape. */
void mp_ep_shape_rows(const mp_ep_shape *s, mp_ep_rows *out);

/* The constant part of a rank's view: topology pointers and sizes (buffers left NULL). Returns 0,
 * or -1 with a message in err if the shape is not supported. */
int mp_ep_view_init(mp_ep_view *v, const mp_ep_shape *s, const int *node_of, const int *local_of,
                    const int *rank_of, char *err, size_t errlen);

/* Topology from one key per rank (NCCL's host identity): ranks with the same key share a node,
 * nodes are numbered by their lowest rank, locals by rank order. gpus_per_node > 0 checks the
 * count instead of deriving it. Fills node_of/local_of [R] and rank_of [N*G]. Returns 0, or -1
 * with a message (nodes of unequal size, a given count that does not match). */
int mp_ep_topology_from_keys(int R, const uint64_t *keys, int gpus_per_node, int *N, int *G, int *node_of,
                             int *local_of, int *rank_of, char *err, size_t errlen);
/* Contiguous topology: rank r = node r / G, local r % G. */
void mp_ep_topology_contiguous(int R, int G, int *node_of, int *local_of, int *rank_of);

/* The transfers of one step for this rank, from a host copy of the counts block c whose offsets
 * are filled (mp_ep_offsets). phys_node_of (may be NULL) classifies network vs NVLink when the
 * planner's node view differs from the machine (flat mode). x needs room for max(N, G) entries.
 * Transfers with nothing to send and nothing to receive are left out. Returns the count. */
int mp_ep_schedule(const mp_ep_view *v, const int *c, const int *phys_node_of, int step, mp_ep_xfer *x);

/* Bytes a step sends, split by network / intra-node. */
void mp_ep_step_bytes(const mp_ep_view *v, const int *c, const int *phys_node_of, int step, long *net, long *nvl);

#endif
