/* libmplane-ep CPU reference model: what the node-limited all-to-all must produce and move,
 * computed the plain way (per token, per expert, sorted lists), independently of the planner.
 * CI checks the planner's simulation against it; the GPU test checks the GPU against it.
 *
 * Routing: per source rank s, T[s] tokens, top-k expert ids idx[s][t*K + k] (ids outside [0, E)
 * and repeats within a token are dropped), weights w[s][t*K + k]. Expert e lives on rank e / (E/R).
 *
 * Dispatch output at rank d: for each local expert, its rows ordered by (source local index,
 * source node, source token) - in flat mode by (source rank, token*K + k). Each row: the token
 * (FP8 e4m3 with one float scale per 128 values, or BF16), its top-k weight, its source rank and
 * token.
 *
 * Combine (expert outputs y given per destination row): FP32 accumulation with the rounding
 * points of the algorithm, which make the result exact:
 *   p(s,t,d) = bf16( fma-sum over k ascending with expert on d of w_k * y )   at the expert's rank
 *   q(s,t,n) = bf16( sum over target ranks (n, j), j ascending, of p )        at the forwarder
 *   out(s,t) = bf16( sum over target nodes n ascending of q )                 at the source
 * Flat mode: out = bf16( sum over k ascending of bf16(w_k * y_k) ). */
#ifndef MPLANE_EP_MODEL_H
#define MPLANE_EP_MODEL_H

#include <stdint.h>

typedef struct mp_ep_model_cfg {
  int R, G;                      /* ranks, GPUs per node */
  const int *node_of, *local_of; /* [R]; NULL: contiguous (node r / G, local r % G) */
  int E, K, H;
  int fmt;  /* MP_EP_FMT_FP8 or MP_EP_FMT_BF16 (ep_plan.h) */
  int flat; /* plain all-to-all: one copy per (token, expert), no forwarding */
} mp_ep_model_cfg;

typedef struct mp_ep_model_row {
  int src_rank, src_token, k, expert;
  float w;
} mp_ep_model_row;

typedef struct mp_ep_model_rank {
  int nrows;
  int *expert_off;       /* [Er + 1] */
  mp_ep_model_row *rows; /* [nrows] */
  uint8_t *x;            /* [nrows][H] FP8 bytes, or [nrows][H] BF16 (2 bytes each) */
  float *scale;          /* [nrows][H / 128], FP8 only */
} mp_ep_model_rank;

/* Rows and bytes each phase moves, summed over all ranks. */
typedef struct mp_ep_model_bytes {
  long tokens;            /* tokens with at least one expert */
  long pairs;             /* valid (token, expert) pairs */
  long remote_nodes;      /* sum over tokens of M = distinct remote nodes */
  long net_rows, nvl_rows;           /* node-limited dispatch copies (combine moves the same rows back) */
  long d_net_bytes, d_nvl_bytes;     /* x dispatch row stride (payload, scales, meta, padding) */
  long d_net_payload, d_nvl_payload; /* x payload only: H*(1 + 4/128) FP8, 2H BF16 */
  long c_net_bytes, c_nvl_bytes;     /* x 2H */
  long flat_net_rows, flat_nvl_rows; /* plain all-to-all, one copy per (token, expert), self excluded */
  long flat_d_net_bytes, flat_c_net_bytes, flat_d_nvl_bytes, flat_c_nvl_bytes;
  long recv_entries;      /* (token, rank) arrivals counted once per rank, self included (DeepEP's count) */
} mp_ep_model_bytes;

typedef struct mp_ep_model mp_ep_model;

/* Bytes and rows for a routing (no payload). Per-rank network bytes sent, dispatch and combine,
 * go to net_tx_d / net_tx_c [R] when not NULL (node-limited; flat_* when cfg->flat). */
void mp_ep_model_count(const mp_ep_model_cfg *cfg, const int *T, const int32_t *const *idx, mp_ep_model_bytes *b,
                       long *net_tx_d, long *net_tx_c);

/* Dispatch: x[s] is [T[s]][H] BF16 (bits); w[s] as idx. NULL on bad input / no memory. */
/* The dispatch's FP8 quantisation of T rows of H BF16 values: e4m3 bytes q [T][H] and one scale per
 * 1x128 tile, scales [T][H / 128] (what pack puts on the wire; also an FP8 input for
 * mplane_ep_dispatch_fp8 that gives the same rows). */
void mp_ep_quantize_rows(const uint16_t *x, long T, int H, uint8_t *q, float *scales);
mp_ep_model *mp_ep_model_run(const mp_ep_model_cfg *cfg, const int *T, const int32_t *const *idx,
                             const float *const *w, const uint16_t *const *x);
const mp_ep_model_rank *mp_ep_model_rank_out(const mp_ep_model *m, int d);
/* Identity expert: y = the dispatched row, dequantised to BF16 ([nrows][H]). */
void mp_ep_model_identity(const mp_ep_model *m, int d, uint16_t *y);
/* Combine: y[d] is [nrows(d)][H] BF16; out[s] is [T[s]][H] BF16. */
void mp_ep_model_combine(const mp_ep_model *m, const uint16_t *const *y, uint16_t *const *out);
void mp_ep_model_free(mp_ep_model *m);

/* Documented tolerance of dispatch + identity experts + combine against x * sum(w), per element,
 * for nonnegative weights W = sum of the token's kept weights, amax = its tile's max |x|:
 *   FP8:  W * (|x| / 16 + amax / 448 / 1024) * (1 + 2^-8)^4 + W * |x| * 4 * 2^-9
 *   BF16: W * |x| * 4 * 2^-9 */
double mp_ep_tolerance(int fmt, double x, double W, double tile_amax);

#endif
