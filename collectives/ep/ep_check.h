/* libmplane-ep checks shared by the CI tests (planner simulation vs model) and the GPU launcher
 * (GPU vs model): routing and token generators, and comparisons that count mismatches and
 * describe the first one. */
#ifndef MPLANE_EP_CHECK_H
#define MPLANE_EP_CHECK_H

#include <stddef.h>
#include <stdint.h>

#include "ep_model.h"

enum {
  MP_EP_ROUTE_UNIFORM = 0, /* K distinct experts, uniformly random */
  MP_EP_ROUTE_GATED,       /* DeepSeek-V3 gating (mp_ep_route_ref) on random logits, groups = nodes */
  MP_EP_ROUTE_ONE_NODE,    /* every expert of a token on one node (often the source's own) */
  MP_EP_ROUTE_ALL_NODES,   /* a token reaches every node (min(K, N) nodes) */
  MP_EP_ROUTE_MIXED,       /* uniform plus dropped slots (-1), out-of-range ids, repeats, dropped tokens */
  MP_EP_ROUTE_KINDS
};
const char *mp_ep_route_kind_name(int kind);

/* Routing of one rank's T tokens over R ranks (G per node, contiguous nodes for ONE_NODE /
 * ALL_NODES), E experts, top-K: idx [T][K], positive weights w [T][K]. Same seed and rank give
 * the same routing on every process. */
void mp_ep_gen_routing(int kind, uint64_t seed, int rank, int R, int G, int E, int K, int T, int32_t *idx, float *w);
/* Tokens [T][H] BF16 with magnitudes varying per 128-tile (2^-8 .. 2^8), some zero tiles. */
void mp_ep_gen_tokens(uint64_t seed, int rank, int T, int H, uint16_t *x);

/* Compare rank d's dispatch output with the model's. Returns the number of mismatching fields
 * (0 = equal bit for bit) and describes the first in msg. */
long mp_ep_check_dispatch(const mp_ep_model *m, int d, int fmt, int H, int nrows, const int *expert_off, int Er,
                          const uint8_t *x, const float *scale, const float *w, const int *src, char *msg,
                          size_t msglen);
/* Bitwise comparison of n BF16 values. */
long mp_ep_check_exact(const uint16_t *got, const uint16_t *want, long n, char *msg, size_t msglen);
/* Identity experts: |out - x * W| within mp_ep_tolerance per element. max_ratio gets the worst
 * error / tolerance. */
long mp_ep_check_tolerance(int fmt, int T, int H, int K, int E, const uint16_t *x, const int32_t *idx, const float *w,
                           const uint16_t *out, double *max_ratio, char *msg, size_t msglen);

/* The plugin's counters (net/stats.c, MPLANE_STATS_FILE): the sum of "tx_bytes" over the "planes"
 * array of its JSON text, and "comms_closed" in *closed (-1 if absent). Returns -2 when the text
 * has no "planes" array. */
long long mp_ep_stats_tx_bytes(const char *json, long long *closed);

#endif
