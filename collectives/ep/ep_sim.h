/* libmplane-ep planner simulation: the whole distributed algorithm for R ranks in one process, on
 * the CPU, through exactly the planner code the GPU build uses (ep_plan.h per-token plans and
 * offsets, ep_sched.c NCCL schedule). Each kernel becomes a loop; each grouped ncclSend/ncclRecv
 * becomes a memcpy between the ranks' buffers, after checking that the sender's byte count equals
 * the receiver's (NCCL would hang or truncate otherwise). CI compares its results with the
 * reference model (ep_model.h). */
#ifndef MPLANE_EP_SIM_H
#define MPLANE_EP_SIM_H

#include <stddef.h>
#include <stdint.h>

#include "ep_sched.h"

typedef struct mp_ep_sim_cfg {
  int R, G;                      /* ranks, GPUs per node */
  const int *node_of, *local_of; /* [R]; NULL: contiguous */
  int E, K, H, Tmax;
  int graph;    /* worst-case (CUDA-graph) mode */
  int flat;     /* baseline: one copy per (token, expert), no forwarding */
  int cap_rows; /* expert-output rows per rank; 0 = worst case */
} mp_ep_sim_cfg;

typedef struct mp_ep_sim_result {
  int nrows;             /* valid expert-output rows */
  const int *expert_off; /* [Er + 1] (from the counts block) */
  const uint8_t *x;      /* [rows][H] FP8 or BF16 */
  const float *scale;    /* [rows][H / 128] */
  const float *w;        /* [rows] */
  const int *src;        /* [rows][2] */
  int overflow;
} mp_ep_sim_result;

typedef struct mp_ep_sim mp_ep_sim;

mp_ep_sim *mp_ep_sim_create(const mp_ep_sim_cfg *cfg, char *err, size_t errlen);
void mp_ep_sim_free(mp_ep_sim *s);
/* Each returns 0, or -1 with a message (mp_ep_sim_error) - e.g. mismatched transfer sizes. */
int mp_ep_sim_layout(mp_ep_sim *s, const int *T, const int32_t *const *idx);
/* Uses the expert ids given to the layout; x[r] is [T][H] BF16, w[r] is [T][K]. */
int mp_ep_sim_dispatch(mp_ep_sim *s, int fmt, const uint16_t *const *x, const float *const *w);
int mp_ep_sim_combine(mp_ep_sim *s, const uint16_t *const *y, uint16_t *const *out);
const char *mp_ep_sim_error(const mp_ep_sim *s);

void mp_ep_sim_result_of(const mp_ep_sim *s, int d, mp_ep_sim_result *r);
/* Bytes rank r sent in each step of the last layout / dispatch / combine, network and intra-node. */
void mp_ep_sim_bytes(const mp_ep_sim *s, int r, long net[MP_EP_NSTEPS], long nvl[MP_EP_NSTEPS]);
/* The rank's view and counts block (for tests that look inside). */
const mp_ep_view *mp_ep_sim_view(const mp_ep_sim *s, int r);

#endif
