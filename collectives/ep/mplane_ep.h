/* libmplane-ep: the node-limited MoE all-to-all of DeepSeek-V3 (dispatch in FP8, combine in BF16)
 * over NCCL, so that its network phase runs through whatever net plugin NCCL uses.
 *
 * A token crosses the network at most once per destination node, to the GPU with the same local
 * index (the same plane); that GPU forwards it over NVLink to the other target GPUs of its node.
 * Combine runs the same path backwards, summing inside the destination node before the single
 * network send back. docs/moe-alltoall.md has the algorithm, the number formats, the tolerance and
 * how to run the tests and the benchmark.
 *
 * Conventions: every pointer named d_* or documented "device" is GPU memory (16-byte aligned);
 * every call takes a CUDA stream and only enqueues work on it (plus, in normal mode, one host wait
 * for the exchanged counts inside mplane_ep_get_layout). Calls return 0 (MPLANE_EP_OK) or an
 * MPLANE_EP_ERR_* code; mplane_ep_last_error() says what and where. A context is used by one
 * thread at a time and runs one layout/dispatch/combine sequence at a time in stream order (its
 * staging buffers are shared); use two contexts on one communicator to overlap two micro-batches,
 * issuing their calls in the same order on every rank. */
#ifndef MPLANE_EP_H
#define MPLANE_EP_H

#include <stdint.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MPLANE_EP_ABI_VERSION 2 /* 2: config.token_rows and the recv token fields */
#define MPLANE_EP_TILE 128 /* values per FP8 scale (one float32 scale per 1x128 tile) */

enum {
  MPLANE_EP_FMT_FP8 = 0, /* dispatch on the wire as FP8 e4m3 + float32 scales */
  MPLANE_EP_FMT_BF16 = 1 /* dispatch as BF16 */
};

enum {
  MPLANE_EP_OK = 0,
  MPLANE_EP_ERR_INVALID = 1,  /* a bad argument or configuration */
  MPLANE_EP_ERR_CUDA = 2,     /* a CUDA call failed */
  MPLANE_EP_ERR_NCCL = 3,     /* an NCCL call failed */
  MPLANE_EP_ERR_NOMEM = 4,    /* device or host memory */
  MPLANE_EP_ERR_CAPACITY = 5, /* more expert rows arrive than max_recv_rows */
  MPLANE_EP_ERR_INTERNAL = 6  /* GPU and host planner disagree (a bug: please report) */
};

typedef struct mplane_ep_ctx mplane_ep_ctx;
typedef struct mplane_ep_layout mplane_ep_layout;

/* Shape of a context; every buffer is sized once from it. */
typedef struct mplane_ep_config {
  int gpus_per_node; /* 0: as NCCL sees hosts (NCCL_HOSTID, else host name + boot id) */
  int num_experts;   /* E, a multiple of the rank count; expert e lives on rank e / (E / nranks) */
  int hidden;        /* H, a multiple of 128 */
  int topk;          /* K, 1..32 */
  int max_tokens;    /* tokens per rank per call, at most */
  int max_recv_rows; /* expert-output rows a rank can receive; 0: the worst case, nranks * max_tokens * min(K, E / nranks) */
  int worst_case;    /* 1: worst-case sizes and no host synchronisation, capturable in a CUDA graph */
  int flat;          /* 1: plain all-to-all, one copy per (token, expert), no forwarding (the baseline) */
  int num_sms;       /* blocks (one per SM) of the data kernels; 0: every SM of the device */
  int nvlink_direct; /* 1: dispatch writes phase-2 rows straight into the same-node peers' receive
                      * buffers (CUDA IPC, handles exchanged at create) instead of NCCL send/recv; on
                      * one node dispatch is one kernel synchronised by per-row ready flags
                      * (MPLANE_EP_LINK_SMS / MPLANE_EP_RECV_SMS: its blocks that copy to the
                      * peers / unpack), and so is combine (expert sums written straight into the
                      * source GPU's rows; MPLANE_EP_SEND_SMS: its blocks that send, default a third);
                      * 0 (default): the NCCL path. Ignored in flat mode and with one GPU a node. */
  int token_rows;    /* 1: dispatch leaves each received token once in a token row (as DeepEP's
                      * normal mode does) and each expert row names its token row (recv.row_token)
                      * instead of holding a copy: 1 payload write per (token, GPU) instead of one
                      * per (token, expert). recv.x / recv.scales are then not written.
                      * 0 (default): payload copies in expert rows. Not with flat. */
} mplane_ep_config;

/* What a context resolved. */
typedef struct mplane_ep_info {
  int rank, nranks;
  int nodes, gpus_per_node; /* the node view the algorithm uses */
  int node, local;          /* this rank's node and local index (its plane) */
  int local_experts;        /* E / nranks; this rank holds experts [rank * local_experts, ...) */
  int max_recv_rows;
  int num_sms;
} mplane_ep_info;

/* Counts of one layout. Host arrays are filled in normal mode only (NULL in worst-case mode);
 * device arrays always. Valid until the next mplane_ep_get_layout on the same handle. */
typedef struct mplane_ep_layout_info {
  int num_tokens;
  int num_recv_rows;            /* expert rows this rank receives; -1 in worst-case mode */
  int num_recv_tokens;          /* (token, this rank) arrivals, own tokens included; -1 likewise */
  const int *tokens_per_rank;   /* host [nranks]: this rank's tokens with an expert on each rank */
  const int *tokens_per_node;   /* host [nodes] */
  const int *tokens_per_expert; /* host [num_experts] */
  const int *recv_expert_offsets; /* host [local_experts + 1]: rows of local expert e are [o[e], o[e+1]) */
  const int *d_tokens_per_rank, *d_tokens_per_node, *d_tokens_per_expert, *d_recv_expert_offsets;
  const int *d_status;          /* device [2]: expert rows received, 1 if more than max_recv_rows */
  /* bytes this rank sends, per phase, for the dispatch format last used (normal mode) */
  long long dispatch_net_bytes, dispatch_nvl_bytes, combine_net_bytes, combine_nvl_bytes;
  long long counts_net_bytes, counts_nvl_bytes; /* the layout's two count exchanges */
} mplane_ep_layout_info;

/* Received tokens, grouped by local expert (token_rows: by reference, see below). Pass NULL pointers to use the context's buffers
 * (sized max_recv_rows; overwritten by the next dispatch on the context); dispatch fills them in. */
typedef struct mplane_ep_recv {
  void *x;               /* device [max_recv_rows][H]: FP8 e4m3 bytes, or BF16 */
  float *scales;         /* device [max_recv_rows][H / 128] (FP8) */
  float *weights;        /* device [max_recv_rows]: the token's top-k weight for that expert */
  int32_t *src;          /* device [max_recv_rows][2]: source rank, source token index */
  const int32_t *expert_offsets; /* out: device [local_experts + 1] */
  int num_rows;          /* out: rows received (normal mode), -1 in worst-case mode */
  /* out, token_rows contexts (else NULL / 0 / -1): the received tokens, one row per (token, this
   * rank), in the context's buffer (valid until the next dispatch on the context; combine leaves them). Row
   * u is token_stride bytes at tokens + u * token_stride: H payload values (FP8 bytes or BF16),
   * then for FP8 its H / 128 float32 scales. Expert row r's token is row row_token[r] (-1: none). */
  const uint8_t *tokens;
  long long token_stride;
  const int32_t *row_token; /* device [max_recv_rows] */
  int num_tokens;           /* token rows (normal mode), -1 in worst-case mode */
} mplane_ep_recv;

int mplane_ep_abi_version(void);
/* The last error of ctx, or of the calling thread when ctx is NULL (e.g. after a failed create). */
const char *mplane_ep_last_error(const mplane_ep_ctx *ctx);

/* Context on an NCCL communicator (ranks of it own a GPU each; the current CUDA device must be the
 * communicator's). Collective: every rank calls it. gpus_per_node 0 all-gathers host identities
 * on stream. */
int mplane_ep_create(mplane_ep_ctx **ctx, ncclComm_t comm, const mplane_ep_config *cfg, cudaStream_t stream);
int mplane_ep_destroy(mplane_ep_ctx *ctx);
int mplane_ep_get_info(const mplane_ep_ctx *ctx, mplane_ep_info *info);

/* DeepSeek-V3 group-limited gating on the GPU, for logits [T][E] (float32):
 *   s = sigmoid(logit); b = s + bias (bias [E] or NULL) chooses, s weighs;
 *   group score = sum of the two largest b of each of num_groups groups; keep the topk_groups best
 *   (= nodes when one group lives on one node), then the top-K experts of those by b;
 *   weight = s, divided by the sum over the K when normalize, times scaling.
 * Writes topk_idx [T][K] (int32, descending b; -1 if fewer than K experts remain) and
 * topk_weights [T][K] (float32). Ties go to the lower index. */
int mplane_ep_route(mplane_ep_ctx *ctx, const float *logits, const float *bias, int num_tokens, int num_groups,
                    int topk_groups, float scaling, int normalize, int32_t *topk_idx, float *topk_weights,
                    cudaStream_t stream);

/* Layout handles: the counts and positions of one routing, reused by its dispatch and combine. */
int mplane_ep_layout_create(mplane_ep_ctx *ctx, mplane_ep_layout **layout);
int mplane_ep_layout_destroy(mplane_ep_layout *layout);
/* Collective. topk_idx [T][K] int32 (device); ids outside [0, E) and repeats within a token are
 * dropped. Exchanges the counts (NCCL) and, in normal mode, waits for them on the host. */
int mplane_ep_get_layout(mplane_ep_ctx *ctx, const int32_t *topk_idx, int num_tokens, mplane_ep_layout *layout,
                         cudaStream_t stream);
int mplane_ep_layout_get_info(const mplane_ep_layout *layout, mplane_ep_layout_info *info);
/* flags [T][nranks] (device uint8): 1 where the token has an expert on that rank. */
int mplane_ep_token_in_rank(mplane_ep_ctx *ctx, const mplane_ep_layout *layout, uint8_t *flags, cudaStream_t stream);

/* Collective. x [T][H] BF16 (device) and topk_weights [T][K] float32 of the layout's tokens. */
int mplane_ep_dispatch(mplane_ep_ctx *ctx, mplane_ep_layout *layout, const void *x, const float *topk_weights, int fmt,
                       mplane_ep_recv *recv, cudaStream_t stream);
/* Collective. The same with the tokens already in FP8, as DeepEP's dispatch takes them (e.g.
 * quantised by the kernel that produced them): x_fp8 [T][H] e4m3 bytes and x_scales [T][H / 128]
 * float32, one scale per 1x128 tile (value = byte * scale). Sent as they are; the received rows
 * are FP8. Quantised with libmplane-ep's rule (scale = amax / 448, see docs/moe-alltoall.md), the
 * rows equal mplane_ep_dispatch's FP8 rows bit for bit. */
int mplane_ep_dispatch_fp8(mplane_ep_ctx *ctx, mplane_ep_layout *layout, const void *x_fp8, const float *x_scales,
                           const float *topk_weights, mplane_ep_recv *recv, cudaStream_t stream);
/* Collective. y [rows][H] BF16: the experts' outputs, one per row of the layout's last dispatch,
 * same order. out [T][H] BF16 at the tokens' origin: sum over the token's experts of weight * y,
 * accumulated in float32 (rounded to BF16 once per rank, node and token). */
int mplane_ep_combine(mplane_ep_ctx *ctx, mplane_ep_layout *layout, const void *y, void *out, cudaStream_t stream);

/* Identity expert / helper: y [rows][H] BF16 = the dispatched rows (FP8 rows dequantised); with
 * token_rows, each expert row's token row. */
int mplane_ep_dequant(mplane_ep_ctx *ctx, const mplane_ep_layout *layout, const mplane_ep_recv *recv, void *y,
                      cudaStream_t stream);

/* Diagnostics: with profiling on (not while capturing a graph), each layout, dispatch and combine
 * records CUDA events between its steps; mplane_ep_get_profile waits for them and gives the GPU time
 * of each step of the last call of each kind, in microseconds, MPLANE_EP_PROFILE_STEPS values named
 * by mplane_ep_profile_name (e.g. "dispatch.pack", "dispatch.nvlink"). */
#define MPLANE_EP_PROFILE_STEPS 15
int mplane_ep_set_profiling(mplane_ep_ctx *ctx, int on);
int mplane_ep_get_profile(mplane_ep_ctx *ctx, float *us);
const char *mplane_ep_profile_name(int step);

#ifdef __cplusplus
}
#endif

#endif
