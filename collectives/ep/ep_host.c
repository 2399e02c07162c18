/* libmplane-ep host code: contexts, layouts, and the sequence of kernels and grouped NCCL
 * send/receive steps of route, layout, dispatch and combine (docs/moe-alltoall.md).
 *
 * layout:   sanitize -> scan -> A message -> [NCCL A: to (n', my local)] -> B message ->
 *           [NCCL B: to (my node, j)] -> offsets -> (normal mode) one copy of the counts to the
 *           host and a wait, checked against the host planner
 * dispatch: pack -> [NCCL D1: network phase, same plane] -> forward -> [NCCL D2: NVLink phase] -> unpack
 * combine:  expert sums -> [NCCL C2: back over NVLink] -> node sums -> [NCCL C1: back over the
 *           network] -> token sums
 * Which bytes go to which peer is mp_ep_schedule (ep_sched.c), the code CI runs in ep_sim.c. */
#include "mplane_ep.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ep_env.h"
#include "ep_kernels.h"
#include "ep_sched.h"

struct mplane_ep_ctx {
  ncclComm_t comm;
  int R, me, device, num_sms;
  mplane_ep_config cfg;
  int phys_N, phys_G;                       /* the machine: nodes as NCCL sees hosts */
  int *phys_node, *phys_local;              /* host [R] */
  int *node_of, *local_of, *rank_of;        /* host, the planner's view (one node per rank in flat mode) */
  int *d_topo;                              /* device copies of the three view arrays */
  mp_ep_shape shape;
  mp_ep_rows rows;
  mp_ep_view base;                          /* device pointers; per-layout arrays unset */
  char *p1s, *p1r, *p2s, *p2r;
  uint8_t *ex_x;
  float *ex_scale, *ex_w;
  int *ex_src;
  int32_t *row_token; /* token_rows: [cap_rows] */
  char *p2c;          /* token_rows: combine's phase-2 rows (p2r holds the token rows until the next dispatch) */
  mp_ep_xfer *xfer;
  int direct;                               /* nvlink_direct in effect (same-node peers mapped) */
  char *peer_p2r[MP_EP_MAX_GPN];            /* IPC mappings of the same-node peers' p2r; own: NULL */
  char *peer_p2s[MP_EP_MAX_GPN];            /* one node: the same for their p2s (the fused combine writes there) */
  int *d_cepoch;                            /* device: the fused combine's epoch (worst-case mode) */
  int host_cepoch;                          /* fused combines so far (normal mode) */
  int *p2r_flag;                            /* device [p2r rows]: ready flags of the fused dispatch */
  int *peer_flag[MP_EP_MAX_GPN];            /* IPC mappings of the peers' p2r_flag */
  int *d_epoch;                             /* device: the fused dispatch's epoch */
  int link_blocks, recv_blocks;             /* fused dispatch: blocks that copy to the peers / unpack (the rest pack) */
  int send_blocks;                          /* fused combine: blocks that send the expert sums (the rest sum) */
  int *p2s_flag;                            /* device [p2s rows]: staged-row flags of the fused dispatch */
  int host_epoch;                           /* fused dispatches so far (normal mode; worst-case mode counts on the GPU) */
  int *d_peer_off;                          /* device [R][G+1]: every rank's p2r segment starts */
  int *d_bar;                               /* device [R]: the barrier's tiny all-gather */
  int prof_on;
  cudaEvent_t prof_ev[3][6]; /* layout, dispatch, combine: an event before each of 5 steps and one after */
  int prof_valid[3];
  char err[1024];
};

enum { PROF_LAYOUT = 0, PROF_DISPATCH = 1, PROF_COMBINE = 2 };
static const char *prof_names[MPLANE_EP_PROFILE_STEPS] = {
    "layout.scan",      "layout.count_net",  "layout.count_nvlink", "layout.offsets", "layout.host_wait",
    "dispatch.pack",    "dispatch.network",  "dispatch.forward",    "dispatch.nvlink", "dispatch.unpack",
    "combine.experts",  "combine.nvlink",    "combine.node_sum",    "combine.network", "combine.token_sum"};

/* Event i of operation op, when profiling (never inside a capture: the caller turns it off). */
static void prof_mark(mplane_ep_ctx *ctx, int op, int i, cudaStream_t stream) {
  if (!ctx->prof_on) return;
  if (cudaEventRecord(ctx->prof_ev[op][i], stream) != cudaSuccess) ctx->prof_on = 0;
  if (i == 5) ctx->prof_valid[op] = 1;
}

struct mplane_ep_layout {
  mplane_ep_ctx *ctx;
  int *d_cnt, *h_cnt, *h_check;
  int32_t *d_topk;
  int *d_nslot, *d_rrank, *d_erank, *d_fwd, *d_dest;
  mp_ep_view view;
  int num_tokens;
  int ready, dispatched;
};

static __thread char tls_err[1024];

static int ep_fail(mplane_ep_ctx *ctx, int code, const char *file, int line, const char *fmt, ...) {
  char msg[900];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char *base = strrchr(file, '/');
  snprintf(tls_err, sizeof(tls_err), "libmplane-ep: %s (%s:%d)", msg, base ? base + 1 : file, line);
  if (ctx) memcpy(ctx->err, tls_err, sizeof(ctx->err));
  return code;
}

#define EP_FAIL(ctx, code, ...) ep_fail((ctx), (code), __FILE__, __LINE__, __VA_ARGS__)
#define CUDA_TRY(ctx, call)                                                                              \
  do {                                                                                                   \
    cudaError_t e_ = (call);                                                                             \
    if (e_ != cudaSuccess) return EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "%s: %s", #call, cudaGetErrorString(e_)); \
  } while (0)
#define KERNEL_TRY(ctx, call)                                                                                  \
  do {                                                                                                         \
    int e_ = (call);                                                                                           \
    if (e_) return EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "%s: %s", #call, cudaGetErrorString((cudaError_t)e_));     \
  } while (0)
#define NCCL_TRY(ctx, call)                                                                                      \
  do {                                                                                                           \
    ncclResult_t r_ = (call);                                                                                    \
    if (r_ != ncclSuccess)                                                                                       \
      return EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "%s: %s (%s)", #call, ncclGetErrorString(r_),                     \
                     ncclGetLastError((ctx) ? (ctx)->comm : NULL));                                              \
  } while (0)

int mplane_ep_abi_version(void) { return MPLANE_EP_ABI_VERSION; }

const char *mplane_ep_last_error(const mplane_ep_ctx *ctx) { return ctx ? ctx->err : tls_err; }

/* ---------- topology ---------- */

static uint64_t fnv1a(const char *s, uint64_t h) {
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 0x100000001b3ull;
  }
  return h;
}

/* tests/ep/emu defines this to give each emulated rank (a thread) its own host; absent here. */
extern const char *mp_ep_emu_hostid(void) __attribute__((weak));

/* The identity NCCL gives this host: NCCL_HOSTID when set, else host name and boot id. */
static uint64_t host_key(void) {
  uint64_t h = 0xcbf29ce484222325ull;
  const char *id = mp_ep_emu_hostid ? mp_ep_emu_hostid() : NULL;
  if (!id) id = getenv("NCCL_HOSTID");
  if (id && *id) return fnv1a(id, fnv1a("hostid:", h));
  char name[256] = "";
  if (gethostname(name, sizeof(name) - 1) != 0) snprintf(name, sizeof(name), "unknown");
  h = fnv1a(name, h);
  FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
  if (f) {
    char boot[128] = "";
    if (fgets(boot, sizeof(boot), f)) h = fnv1a(boot, h);
    fclose(f);
  }
  return h;
}

static int find_topology(mplane_ep_ctx *ctx, cudaStream_t stream) {
  int R = ctx->R;
  ctx->phys_node = malloc(sizeof(int) * (size_t)R);
  ctx->phys_local = malloc(sizeof(int) * (size_t)R);
  int *phys_rank = malloc(sizeof(int) * (size_t)R);
  uint64_t *keys = malloc(sizeof(uint64_t) * (size_t)R);
  int rc = MPLANE_EP_OK;
  uint64_t *d_keys = NULL;
  if (!ctx->phys_node || !ctx->phys_local || !phys_rank || !keys) {
    rc = EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
    goto out;
  }
  if (ctx->cfg.gpus_per_node > 0) {
    int G = ctx->cfg.gpus_per_node;
    if (R % G) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "gpus_per_node=%d does not divide the %d ranks", G, R);
      goto out;
    }
    mp_ep_topology_contiguous(R, G, ctx->phys_node, ctx->phys_local, phys_rank);
    ctx->phys_N = R / G;
    ctx->phys_G = G;
  } else {
    uint64_t mine = host_key();
    cudaError_t ce = cudaMalloc((void **)&d_keys, sizeof(uint64_t) * (size_t)R);
    if (ce == cudaSuccess)
      ce = cudaMemcpyAsync(d_keys + ctx->me, &mine, sizeof(mine), cudaMemcpyHostToDevice, stream);
    if (ce != cudaSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "host identity exchange: %s", cudaGetErrorString(ce));
      goto out;
    }
    ncclResult_t nr = ncclAllGather(d_keys + ctx->me, d_keys, 1, ncclUint64, ctx->comm, stream);
    if (nr != ncclSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "ncclAllGather of host identities: %s", ncclGetErrorString(nr));
      goto out;
    }
    ce = cudaMemcpyAsync(keys, d_keys, sizeof(uint64_t) * (size_t)R, cudaMemcpyDeviceToHost, stream);
    if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
    if (ce != cudaSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "host identity exchange: %s", cudaGetErrorString(ce));
      goto out;
    }
    char err[256];
    if (mp_ep_topology_from_keys(R, keys, 0, &ctx->phys_N, &ctx->phys_G, ctx->phys_node, ctx->phys_local, phys_rank,
                                 err, sizeof(err)) != 0) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "%s", err);
      goto out;
    }
  }
  ctx->node_of = malloc(sizeof(int) * (size_t)R);
  ctx->local_of = malloc(sizeof(int) * (size_t)R);
  ctx->rank_of = malloc(sizeof(int) * (size_t)R);
  if (!ctx->node_of || !ctx->local_of || !ctx->rank_of) {
    rc = EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
    goto out;
  }
  for (int r = 0; r < R; r++) {
    if (ctx->cfg.flat) {
      ctx->node_of[r] = r;
      ctx->local_of[r] = 0;
      ctx->rank_of[r] = r;
    } else {
      ctx->node_of[r] = ctx->phys_node[r];
      ctx->local_of[r] = ctx->phys_local[r];
      ctx->rank_of[r] = phys_rank[r];
    }
  }
out:
  cudaFree(d_keys);
  free(phys_rank);
  free(keys);
  return rc;
}

/* ---------- nvlink_direct: the same-node peers' p2r buffers through CUDA IPC ---------- */

/* blocks of the fused dispatch: one of each kind at least */
static int fused_blocks(const mplane_ep_ctx *ctx) { return ctx->num_sms < 3 ? 3 : ctx->num_sms; }
/* blocks of the fused combine: one of each kind at least */
static int combine_blocks(const mplane_ep_ctx *ctx) { return ctx->num_sms < 2 ? 2 : ctx->num_sms; }

/* What a rank publishes for nvlink_direct: its p2r rows and their ready flags. */
typedef struct {
  cudaIpcMemHandle_t rows, flags, send; /* send: p2s, one node only (the fused combine) */
} peer_handles;

/* Map local peer j's p2r and flags (from the handles it published). */
static int open_peer(mplane_ep_ctx *ctx, int j, int peer, const peer_handles *h) {
  void *p = NULL, *f = NULL;
  cudaError_t ce = cudaIpcOpenMemHandle(&p, h->rows, cudaIpcMemLazyEnablePeerAccess);
  if (ce == cudaSuccess) {
    ctx->peer_p2r[j] = p;
    ce = cudaIpcOpenMemHandle(&f, h->flags, cudaIpcMemLazyEnablePeerAccess);
  }
  if (ce == cudaSuccess) {
    ctx->peer_flag[j] = f;
    if (ctx->shape.N == 1 && ctx->p2s) {
      void *q = NULL;
      ce = cudaIpcOpenMemHandle(&q, h->send, cudaIpcMemLazyEnablePeerAccess);
      if (ce == cudaSuccess) ctx->peer_p2s[j] = q;
    }
  }
  if (ce != cudaSuccess)
    return EP_FAIL(ctx, MPLANE_EP_ERR_CUDA,
                   "nvlink_direct=1: cudaIpcOpenMemHandle of rank %d's phase-2 rows: %s (needs one process "
                   "per GPU and peer access between the GPUs; use nvlink_direct=0)",
                   peer, cudaGetErrorString(ce));
  return MPLANE_EP_OK;
}

/* Collective (every rank calls it, with or without the direct path: the all-gather is on the
 * communicator). Each rank publishes its p2r's and flags' IPC handles; the ranks of this node open
 * theirs. */
static int open_peers(mplane_ep_ctx *ctx, int want, cudaStream_t stream) {
  const int R = ctx->R, G = ctx->shape.G;
  const size_t hs = sizeof(peer_handles);
  peer_handles *h = calloc((size_t)R, hs);
  char *d_h = NULL;
  int rc = MPLANE_EP_OK;
  if (!h) return EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
  cudaError_t ce = cudaSuccess;
  if (want && ctx->p2r) ce = cudaIpcGetMemHandle(&h[ctx->me].rows, ctx->p2r);
  if (want && ce == cudaSuccess) ce = cudaIpcGetMemHandle(&h[ctx->me].flags, ctx->p2r_flag);
  if (want && ce == cudaSuccess && ctx->shape.N == 1 && ctx->p2s) ce = cudaIpcGetMemHandle(&h[ctx->me].send, ctx->p2s);
  if (ce != cudaSuccess) {
    rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "nvlink_direct=1: cudaIpcGetMemHandle of the phase-2 receive rows: %s",
                 cudaGetErrorString(ce));
    want = 0; /* still take part in the all-gather below, so the other ranks do not hang */
  }
  ce = cudaMalloc((void **)&d_h, hs * (size_t)R);
  if (ce == cudaSuccess) ce = cudaMemcpyAsync(d_h + hs * ctx->me, &h[ctx->me], hs, cudaMemcpyHostToDevice, stream);
  if (ce != cudaSuccess) {
    if (!rc) rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "nvlink_direct handle exchange: %s", cudaGetErrorString(ce));
    goto out;
  }
  {
    ncclResult_t nr = ncclAllGather(d_h + hs * ctx->me, d_h, hs, ncclUint8, ctx->comm, stream);
    if (nr != ncclSuccess) {
      if (!rc) rc = EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "ncclAllGather of the IPC handles: %s", ncclGetErrorString(nr));
      goto out;
    }
  }
  ce = cudaMemcpyAsync(h, d_h, hs * (size_t)R, cudaMemcpyDeviceToHost, stream);
  if (ce == cudaSuccess) ce = cudaStreamSynchronize(stream);
  if (ce != cudaSuccess) {
    if (!rc) rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "nvlink_direct handle exchange: %s", cudaGetErrorString(ce));
    goto out;
  }
  if (!want || rc) goto out;
  for (int j = 0; j < G; j++) {
    if (j == ctx->base.my_local) continue;
    int peer = ctx->rank_of[ctx->base.my_node * G + j];
    if (ctx->phys_node[peer] != ctx->phys_node[ctx->me]) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INTERNAL, "nvlink_direct: rank %d (local %d) is not on this host", peer, j);
      goto out;
    }
    if ((rc = open_peer(ctx, j, peer, &h[peer]))) goto out;
  }
  ctx->direct = 1;
out:
  cudaFree(d_h);
  free(h);
  return rc;
}

/* Blocks of the fused dispatch, max(num_sms, 3) in all: link blocks copy the staged rows to the
 * peers (MPLANE_EP_LINK_SMS; default 32 with token rows - 2x H200, FP8: 16 -> 142 us, 32 -> 139,
 * 48 -> 139 - and 0 with expert rows, where the pack blocks write to the peers themselves:
 * measured faster, see k_dispatch_fused), unpack blocks take the peers' rows
 * (MPLANE_EP_RECV_SMS; default with token rows, where unpacking only writes indices, a third of
 * what the link leaves, at most 32 - 2x H200, FP8, 32 link blocks: 16 -> 137 us, 32 -> 128, 48 ->
 * 136, 64 -> 150, 2026-11-30 - else half of it), the rest pack. The variables are read through the
 * config table (ep_env.c; -1 or unset: the count here); a value that does not parse, or leaves no
 * block of another kind, fails create, naming it. */
static int env_blocks(mplane_ep_ctx *ctx, const char *name, int set, int lo, int hi, int dflt, const char *what,
                      int *out) {
  *out = dflt;
  if (set < 0) return MPLANE_EP_OK;
  if (set < lo || set > hi)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "%s=%d: expected an integer %d..%d (%s)", name, set, lo, hi, what);
  *out = set;
  return MPLANE_EP_OK;
}

static int fused_split(mplane_ep_ctx *ctx) {
  struct mplane_ep_env env;
  char err[512];
  if (mplane_ep_env_load(&env, err, sizeof(err))) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "%s", err);
  const int blocks = fused_blocks(ctx);
  const int link_dflt = !ctx->cfg.token_rows ? 0 : blocks - 2 < 64 ? (blocks - 2) / 4 + 1 : 32;
  static const char *blk = "blocks of the fused dispatch";
  int rc = env_blocks(ctx, "MPLANE_EP_LINK_SMS", env.link_sms, 0, blocks - 2, link_dflt, blk, &ctx->link_blocks);
  if (rc) return rc;
  const int left = blocks - ctx->link_blocks, dflt = ctx->cfg.token_rows ? (left / 3 < 32 ? left / 3 : 32) : left / 2;
  rc = env_blocks(ctx, "MPLANE_EP_RECV_SMS", env.recv_sms, 1, left - 1, dflt < 1 ? 1 : dflt, blk, &ctx->recv_blocks);
  if (rc) return rc;
  const int cblocks = combine_blocks(ctx);
  /* a third: the summing side has the own tokens' expert sums to compute too (2x H200, 132 SMs,
   * 2026-11-30: 16 -> 645 us, 24 -> 491, 32 -> 414, 44 -> 416, 66 -> 506, 88 -> 730) */
  return env_blocks(ctx, "MPLANE_EP_SEND_SMS", env.send_sms, 1, cblocks - 1, cblocks / 3 < 1 ? 1 : cblocks / 3,
                    "blocks of the fused combine that send the expert sums to the peers", &ctx->send_blocks);
}

/* Stream-ordered barrier of all ranks (a one-int all-gather): once it completes on this rank,
 * every rank's earlier work on its stream (kernels writing into this rank's p2r) has completed. */
static int direct_barrier(mplane_ep_ctx *ctx, cudaStream_t stream) {
  NCCL_TRY(ctx, ncclAllGather(ctx->d_bar + ctx->me, ctx->d_bar, 1, ncclInt32, ctx->comm, stream));
  return MPLANE_EP_OK;
}

/* ---------- context ---------- */

int mplane_ep_destroy(mplane_ep_ctx *ctx) {
  if (!ctx) return MPLANE_EP_OK;
  if (ctx->prof_ev[0][0])
    for (int o = 0; o < 3; o++)
      for (int i = 0; i < 6; i++) cudaEventDestroy(ctx->prof_ev[o][i]);
  for (int j = 0; j < MP_EP_MAX_GPN; j++) {
    if (ctx->peer_p2r[j]) cudaIpcCloseMemHandle(ctx->peer_p2r[j]);
    if (ctx->peer_flag[j]) cudaIpcCloseMemHandle(ctx->peer_flag[j]);
    if (ctx->peer_p2s[j]) cudaIpcCloseMemHandle(ctx->peer_p2s[j]);
  }
  cudaFree(ctx->p2r_flag);
  cudaFree(ctx->p2s_flag);
  cudaFree(ctx->d_epoch);
  cudaFree(ctx->d_cepoch);
  cudaFree(ctx->d_peer_off);
  cudaFree(ctx->d_bar);
  cudaFree(ctx->d_topo);
  cudaFree(ctx->p1s);
  cudaFree(ctx->p1r);
  cudaFree(ctx->p2s);
  cudaFree(ctx->p2r);
  cudaFree(ctx->ex_x);
  cudaFree(ctx->ex_scale);
  cudaFree(ctx->ex_w);
  cudaFree(ctx->ex_src);
  cudaFree(ctx->row_token);
  cudaFree(ctx->p2c);
  free(ctx->phys_node);
  free(ctx->phys_local);
  free(ctx->node_of);
  free(ctx->local_of);
  free(ctx->rank_of);
  free(ctx->xfer);
  free(ctx);
  return MPLANE_EP_OK;
}

static int dmalloc(mplane_ep_ctx *ctx, void **p, long bytes, const char *what) {
  *p = NULL;
  if (bytes <= 0) return MPLANE_EP_OK;
  cudaError_t e = cudaMalloc(p, (size_t)bytes);
  if (e != cudaSuccess) {
    *p = NULL;
    return EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "cudaMalloc of %ld bytes for %s: %s", bytes, what, cudaGetErrorString(e));
  }
  return MPLANE_EP_OK;
}

int mplane_ep_create(mplane_ep_ctx **out, ncclComm_t comm, const mplane_ep_config *cfg, cudaStream_t stream) {
  if (!out || !comm || !cfg) return EP_FAIL(NULL, MPLANE_EP_ERR_INVALID, "mplane_ep_create: ctx, comm and cfg must be given");
  *out = NULL;
  mplane_ep_ctx *ctx = calloc(1, sizeof(*ctx));
  if (!ctx) return EP_FAIL(NULL, MPLANE_EP_ERR_NOMEM, "out of host memory");
  ctx->comm = comm;
  ctx->cfg = *cfg;
  int rc;
#define CREATE_TRY(x)          \
  do {                         \
    rc = (x);                  \
    if (rc) goto fail;         \
  } while (0)
  {
    ncclResult_t nr = ncclCommCount(comm, &ctx->R);
    if (nr == ncclSuccess) nr = ncclCommUserRank(comm, &ctx->me);
    int comm_dev = -1;
    if (nr == ncclSuccess) nr = ncclCommCuDevice(comm, &comm_dev);
    if (nr != ncclSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "querying the communicator: %s", ncclGetErrorString(nr));
      goto fail;
    }
    if (cudaGetDevice(&ctx->device) != cudaSuccess || ctx->device != comm_dev) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "the current CUDA device is %d, the communicator's is %d: cudaSetDevice(%d) first",
                   ctx->device, comm_dev, comm_dev);
      goto fail;
    }
  }
  if (cfg->token_rows && cfg->flat) {
    rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "config: token_rows=1 needs the node-limited mode (flat=0): the flat baseline has no token rows");
    goto fail;
  }
  if (cfg->topk < 1 || cfg->topk > MP_EP_MAX_TOPK || cfg->max_tokens < 1 || cfg->num_experts < 1 || cfg->hidden < 1) {
    rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID,
                 "config: topk=%d (1..%d), max_tokens=%d, num_experts=%d, hidden=%d must all be positive", cfg->topk,
                 MP_EP_MAX_TOPK, cfg->max_tokens, cfg->num_experts, cfg->hidden);
    goto fail;
  }
  CREATE_TRY(find_topology(ctx, stream));
  {
    int N = cfg->flat ? ctx->R : ctx->phys_N, G = cfg->flat ? 1 : ctx->phys_G;
    mp_ep_shape sh = {ctx->R, N, G, ctx->me, cfg->num_experts, cfg->flat ? 1 : cfg->topk, cfg->hidden,
                      cfg->flat ? cfg->max_tokens * cfg->topk : cfg->max_tokens, cfg->flat ? cfg->topk : 1,
                      cfg->worst_case ? 1 : 0, cfg->max_recv_rows};
    char err[256];
    if (mp_ep_view_init(&ctx->base, &sh, ctx->node_of, ctx->local_of, ctx->rank_of, err, sizeof(err)) != 0) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "config: %s", err);
      goto fail;
    }
    ctx->shape = sh;
    mp_ep_shape_rows(&sh, &ctx->rows);
    ctx->xfer = malloc(sizeof(mp_ep_xfer) * (size_t)(N > G ? N : G));
    if (!ctx->xfer) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
      goto fail;
    }
  }
  {
    int sms = 0;
    if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, ctx->device) != cudaSuccess || sms < 1) sms = 1;
    ctx->num_sms = cfg->num_sms > 0 && cfg->num_sms < sms ? cfg->num_sms : sms;
  }
  {
    const mp_ep_rows *rw = &ctx->rows;
    int R = ctx->R, H = cfg->hidden;
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->d_topo, 4L * 3 * R, "topology"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->p1s, rw->p1s * rw->row_bytes, "phase-1 send rows"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->p1r, rw->p1r * rw->row_bytes, "phase-1 receive rows"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->p2s, rw->p2s * rw->row_bytes, "phase-2 send rows"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->p2r, rw->p2r * rw->row_bytes, "phase-2 receive rows"));
    if (cfg->token_rows) { /* the payloads stay in p2r; expert rows only name their token row */
      CREATE_TRY(dmalloc(ctx, (void **)&ctx->row_token, rw->cap_rows * 4L, "expert rows' token rows"));
      /* -1 until named; a dispatch names every row it fills (rows are dense: prefix sums of arrivals) */
      if (cudaMemsetAsync(ctx->row_token, 0xff, (size_t)rw->cap_rows * 4, stream) != cudaSuccess) { /* waited for below */
        rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "clearing the expert rows' token rows");
        goto fail;
      }
      /* the staged combine's rows; one node with nvlink_direct combines in one kernel without them */
      const int fused_combine = cfg->nvlink_direct && !cfg->flat && ctx->shape.G > 1 && ctx->shape.N == 1;
      if (!fused_combine) CREATE_TRY(dmalloc(ctx, (void **)&ctx->p2c, rw->p2r * mp_ep_cstride(H), "combine phase-2 rows"));
    } else {
      CREATE_TRY(dmalloc(ctx, (void **)&ctx->ex_x, rw->cap_rows * 2L * H, "expert rows"));
      CREATE_TRY(dmalloc(ctx, (void **)&ctx->ex_scale, rw->cap_rows * 4L * (H / MP_EP_TILE), "expert scales"));
    }
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->ex_w, rw->cap_rows * 4L, "expert weights"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->ex_src, rw->cap_rows * 8L, "expert sources"));
    int *h = malloc(4L * 3 * (size_t)R);
    if (!h) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
      goto fail;
    }
    memcpy(h, ctx->node_of, 4L * (size_t)R);
    memcpy(h + R, ctx->local_of, 4L * (size_t)R);
    memcpy(h + 2 * R, ctx->rank_of, 4L * (size_t)R);
    /* on the context's stream (which may be a non-blocking one) and waited for: the kernels that
     * read the topology run on that stream */
    cudaError_t e = cudaMemcpyAsync(ctx->d_topo, h, 4L * 3 * (size_t)R, cudaMemcpyHostToDevice, stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
    free(h);
    if (e != cudaSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "copying the topology: %s", cudaGetErrorString(e));
      goto fail;
    }
    mp_ep_view *v = &ctx->base;
    v->node_of = ctx->d_topo;
    v->local_of = ctx->d_topo + R;
    v->rank_of = ctx->d_topo + 2 * R;
    v->p1s = ctx->p1s;
    v->p1r = ctx->p1r;
    v->p2s = ctx->p2s;
    v->p2r = ctx->p2r;
    v->ex_x = ctx->ex_x;
    v->ex_scale = ctx->ex_scale;
    v->ex_w = ctx->ex_w;
    v->ex_src = ctx->ex_src;
    v->token_rows = cfg->token_rows ? 1 : 0;
    v->row_token = ctx->row_token;
  }
  /* every rank decides the same way (same config, same topology), so the all-gathers match */
  if (cfg->nvlink_direct && !cfg->flat && ctx->shape.G > 1) {
    const int R = ctx->R, G = ctx->shape.G;
    if (G > MP_EP_MAX_GPN) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "nvlink_direct=1: %d GPUs a node, at most %d", G, MP_EP_MAX_GPN);
      goto fail;
    }
    /* one node: the fused dispatch and combine (row flags, then every rank's dispatch start flag,
     * p2r and p2s segment starts, every rank's combine start flag, the combine's flags per p2s
     * row; and the staged-row flags); several: segment starts and a barrier word all-gathered */
    const int fused = ctx->shape.N == 1;
    if (!fused) {
      CREATE_TRY(dmalloc(ctx, (void **)&ctx->d_peer_off, 4L * R * (G + 1), "nvlink_direct segment starts"));
      CREATE_TRY(dmalloc(ctx, (void **)&ctx->d_bar, 4L * R, "nvlink_direct barrier"));
    }
    const long cflag_off = ctx->rows.p2r + (long)R + 2L * R * (G + 1) + R;
    const long flag_ints = fused ? cflag_off + ctx->rows.p2s : ctx->rows.p2r;
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->p2r_flag, 4L * flag_ints, "nvlink_direct row flags"));
    if (fused) CREATE_TRY(dmalloc(ctx, (void **)&ctx->p2s_flag, 4L * ctx->rows.p2s, "nvlink_direct staged-row flags"));
    CREATE_TRY(dmalloc(ctx, (void **)&ctx->d_epoch, 4L, "nvlink_direct epoch"));
    if (fused) CREATE_TRY(dmalloc(ctx, (void **)&ctx->d_cepoch, 4L, "nvlink_direct combine epoch"));
    /* flags start below every epoch (epochs start at 1) */
    if ((ctx->d_bar && cudaMemsetAsync(ctx->d_bar, 0, 4L * R, stream) != cudaSuccess) ||
        (ctx->p2r_flag && cudaMemsetAsync(ctx->p2r_flag, 0, 4L * flag_ints, stream) != cudaSuccess) ||
        (ctx->p2s_flag && cudaMemsetAsync(ctx->p2s_flag, 0, 4L * ctx->rows.p2s, stream) != cudaSuccess) ||
        cudaMemsetAsync(ctx->d_epoch, 0, 4L, stream) != cudaSuccess ||
        (ctx->d_cepoch && cudaMemsetAsync(ctx->d_cepoch, 0, 4L, stream) != cudaSuccess) ||
        cudaStreamSynchronize(stream) != cudaSuccess) {
      rc = EP_FAIL(ctx, MPLANE_EP_ERR_CUDA, "nvlink_direct: clearing the barrier word, flags and epoch");
      goto fail;
    }
    CREATE_TRY(fused_split(ctx));
    CREATE_TRY(open_peers(ctx, 1, stream));
    mp_ep_view *v = &ctx->base;
    v->direct = 1;
    for (int j = 0; j < G; j++) {
      v->peer_p2r[j] = ctx->peer_p2r[j];
      v->peer_flag[j] = ctx->peer_flag[j];
      v->peer_p2s[j] = ctx->peer_p2s[j];
    }
    v->peer_off = ctx->d_peer_off;
    if (fused) { /* the ranks say where their segments start in-kernel */
      v->start_off = ctx->rows.p2r;
      v->peer_off = ctx->p2r_flag + ctx->rows.p2r + R;
      v->cflag_off = cflag_off;
      v->cepoch = ctx->d_cepoch;
    }
    v->p2r_flag = ctx->p2r_flag;
    v->p2s_flag = ctx->p2s_flag;
    v->epoch = ctx->d_epoch;
  }
  *out = ctx;
  return MPLANE_EP_OK;
fail:
  memcpy(tls_err, ctx->err, sizeof(tls_err));
  mplane_ep_destroy(ctx);
  return rc;
#undef CREATE_TRY
}

int mplane_ep_get_info(const mplane_ep_ctx *ctx, mplane_ep_info *info) {
  if (!ctx || !info) return EP_FAIL(NULL, MPLANE_EP_ERR_INVALID, "mplane_ep_get_info: NULL argument");
  info->rank = ctx->me;
  info->nranks = ctx->R;
  info->nodes = ctx->shape.N;
  info->gpus_per_node = ctx->shape.G;
  info->node = ctx->base.my_node;
  info->local = ctx->base.my_local;
  info->local_experts = ctx->base.Er;
  info->max_recv_rows = ctx->base.cap_rows;
  info->num_sms = ctx->num_sms;
  return MPLANE_EP_OK;
}

/* ---------- NCCL steps ---------- */

static char *step_buf(mplane_ep_ctx *ctx, mplane_ep_layout *lo, int step, int b) {
  /* token rows: combine stages its phase-2 rows apart, so the token rows outlive it */
  if (b == MP_EP_BUF_P2R && ctx->p2c && (step == MP_EP_STEP_C1 || step == MP_EP_STEP_C2)) return ctx->p2c;
  switch (b) {
  case MP_EP_BUF_CNT: return (char *)lo->d_cnt;
  case MP_EP_BUF_P1S: return ctx->p1s;
  case MP_EP_BUF_P1R: return ctx->p1r;
  case MP_EP_BUF_P2S: return ctx->p2s;
  case MP_EP_BUF_P2R: return ctx->p2r;
  }
  return NULL;
}

/* The view with the host's copies of the topology arrays: a view's node_of/local_of/rank_of are
 * device pointers (for the kernels), and the host planner (mp_ep_schedule, mp_ep_offsets) must
 * never read through them - on a GPU that is a SIGSEGV (the CPU emulator makes it one too). */
static mp_ep_view host_view(const mplane_ep_ctx *ctx, const mp_ep_view *v) {
  mp_ep_view hv = *v;
  hv.node_of = ctx->node_of;
  hv.local_of = ctx->local_of;
  hv.rank_of = ctx->rank_of;
  return hv;
}

static int run_step(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const mp_ep_view *v, int step, cudaStream_t stream) {
  mp_ep_xfer *x = ctx->xfer;
  const mp_ep_view hv = host_view(ctx, v);
  int n = mp_ep_schedule(&hv, lo->h_cnt, ctx->phys_node, step, x);
  if (n == 0) return MPLANE_EP_OK;
  ncclResult_t first = ncclSuccess;
  const char *what = "";
  NCCL_TRY(ctx, ncclGroupStart());
  for (int i = 0; i < n && first == ncclSuccess; i++) {
    ncclResult_t r = ncclSuccess;
    if (x[i].send_bytes > 0) {
      r = ncclSend(step_buf(ctx, lo, step, x[i].send_buf) + x[i].send_off, (size_t)x[i].send_bytes, ncclUint8, x[i].peer,
                   ctx->comm, stream);
      what = "ncclSend";
    }
    if (r == ncclSuccess && x[i].recv_bytes > 0) {
      r = ncclRecv(step_buf(ctx, lo, step, x[i].recv_buf) + x[i].recv_off, (size_t)x[i].recv_bytes, ncclUint8, x[i].peer,
                   ctx->comm, stream);
      what = "ncclRecv";
    }
    first = r;
  }
  ncclResult_t end = ncclGroupEnd();
  if (first != ncclSuccess)
    return EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "%s in step %d: %s (%s)", what, step, ncclGetErrorString(first),
                   ncclGetLastError(ctx->comm));
  if (end != ncclSuccess)
    return EP_FAIL(ctx, MPLANE_EP_ERR_NCCL, "ncclGroupEnd of step %d: %s (%s)", step, ncclGetErrorString(end),
                   ncclGetLastError(ctx->comm));
  return MPLANE_EP_OK;
}

/* ---------- layout ---------- */

int mplane_ep_layout_destroy(mplane_ep_layout *lo) {
  if (!lo) return MPLANE_EP_OK;
  cudaFree(lo->d_cnt);
  cudaFreeHost(lo->h_cnt);
  free(lo->h_check);
  cudaFree(lo->d_topk);
  cudaFree(lo->d_nslot);
  cudaFree(lo->d_rrank);
  cudaFree(lo->d_erank);
  cudaFree(lo->d_fwd);
  cudaFree(lo->d_dest);
  free(lo);
  return MPLANE_EP_OK;
}

int mplane_ep_layout_create(mplane_ep_ctx *ctx, mplane_ep_layout **out) {
  if (!ctx || !out) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_layout_create: NULL argument");
  *out = NULL;
  mplane_ep_layout *lo = calloc(1, sizeof(*lo));
  if (!lo) return EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "out of host memory");
  lo->ctx = ctx;
  lo->view = ctx->base;
  mp_ep_view *v = &lo->view;
  long words = v->cl.total, tk = (long)v->Tmax * v->K;
  int rc;
  if ((rc = dmalloc(ctx, (void **)&lo->d_cnt, 4L * words, "counts")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_topk, 4L * tk, "expert ids")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_nslot, 4L * tk, "node slots")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_rrank, 4L * tk, "rank slots")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_erank, 4L * tk, "expert slots")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_fwd, 4L * ctx->rows.p1r * v->G, "forwarding positions")) ||
      (rc = dmalloc(ctx, (void **)&lo->d_dest, 4L * ctx->rows.p2r * v->K, "arrival rows"))) {
    mplane_ep_layout_destroy(lo);
    return rc;
  }
  lo->h_check = malloc(4L * (size_t)words);
  if (cudaMallocHost((void **)&lo->h_cnt, 4L * (size_t)words) != cudaSuccess || !lo->h_check) {
    lo->h_cnt = NULL;
    mplane_ep_layout_destroy(lo);
    return EP_FAIL(ctx, MPLANE_EP_ERR_NOMEM, "pinned host memory for the counts (%ld bytes)", 4L * words);
  }
  memset(lo->h_cnt, 0, 4L * (size_t)words);
  /* worst-case mode: the host's copy only ever holds the fixed segment grid */
  if (v->graph) {
    mp_ep_view hv = host_view(ctx, v);
    mp_ep_offsets(&hv, lo->h_cnt);
  }
  v->cnt = lo->d_cnt;
  v->topk = lo->d_topk;
  v->nslot_k = lo->d_nslot;
  v->rrank_k = lo->d_rrank;
  v->erank_k = lo->d_erank;
  v->fwd_pos = lo->d_fwd;
  v->dest_rows = lo->d_dest;
  *out = lo;
  return MPLANE_EP_OK;
}

/* The host's planner over the counts the GPU exchanged: the offsets must come out the same. */
static int check_offsets(mplane_ep_ctx *ctx, mplane_ep_layout *lo) {
  mp_ep_view hv = host_view(ctx, &lo->view);
  long words = hv.cl.total;
  memcpy(lo->h_check, lo->h_cnt, 4L * (size_t)words);
  mp_ep_offsets(&hv, lo->h_check);
  for (long i = hv.cl.off1s; i < words; i++)
    if (lo->h_check[i] != lo->h_cnt[i])
      return EP_FAIL(ctx, MPLANE_EP_ERR_INTERNAL, "counts word %ld: GPU offsets %d, host planner %d", i, lo->h_cnt[i],
                     lo->h_check[i]);
  return MPLANE_EP_OK;
}

int mplane_ep_get_layout(mplane_ep_ctx *ctx, const int32_t *topk_idx, int num_tokens, mplane_ep_layout *lo,
                         cudaStream_t stream) {
  if (!ctx || !lo || lo->ctx != ctx) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_get_layout: layout of another context");
  if (num_tokens < 0 || num_tokens > ctx->cfg.max_tokens)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "num_tokens=%d: expected 0..max_tokens=%d", num_tokens, ctx->cfg.max_tokens);
  if (num_tokens > 0 && !topk_idx) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "topk_idx is NULL");
  mp_ep_view *v = &lo->view;
  lo->ready = lo->dispatched = 0;
  lo->num_tokens = num_tokens;
  v->T = num_tokens * v->expand;
  ctx->prof_valid[PROF_LAYOUT] = 0;
  prof_mark(ctx, PROF_LAYOUT, 0, stream);
  if (num_tokens > 0) KERNEL_TRY(ctx, mp_ep_launch_sanitize(v, topk_idx, num_tokens, stream));
  KERNEL_TRY(ctx, mp_ep_launch_scan(v, stream));
  KERNEL_TRY(ctx, mp_ep_launch_msg_a(v, stream));
  prof_mark(ctx, PROF_LAYOUT, 1, stream);
  int rc = run_step(ctx, lo, v, MP_EP_STEP_A, stream);
  if (rc) return rc;
  prof_mark(ctx, PROF_LAYOUT, 2, stream);
  KERNEL_TRY(ctx, mp_ep_launch_msg_b(v, stream));
  if ((rc = run_step(ctx, lo, v, MP_EP_STEP_B, stream))) return rc;
  prof_mark(ctx, PROF_LAYOUT, 3, stream);
  KERNEL_TRY(ctx, mp_ep_launch_offsets(v, stream));
  prof_mark(ctx, PROF_LAYOUT, 4, stream);
  if (!v->graph) {
    CUDA_TRY(ctx, cudaMemcpyAsync(lo->h_cnt, lo->d_cnt, 4L * (size_t)v->cl.total, cudaMemcpyDeviceToHost, stream));
    CUDA_TRY(ctx, cudaStreamSynchronize(stream));
    prof_mark(ctx, PROF_LAYOUT, 5, stream);
    if ((rc = check_offsets(ctx, lo))) return rc;
    if (lo->h_cnt[v->cl.status + MP_EP_ST_OVERFLOW])
      return EP_FAIL(ctx, MPLANE_EP_ERR_CAPACITY, "rank %d would receive %d expert rows, max_recv_rows is %d: raise it (0 = worst case)",
                     ctx->me, lo->h_cnt[v->cl.status + MP_EP_ST_EXTOTAL], v->cap_rows);
  }
  lo->ready = 1;
  return MPLANE_EP_OK;
}

int mplane_ep_layout_get_info(const mplane_ep_layout *lo, mplane_ep_layout_info *info) {
  if (!lo || !info) return EP_FAIL(NULL, MPLANE_EP_ERR_INVALID, "mplane_ep_layout_get_info: NULL argument");
  mplane_ep_ctx *ctx = lo->ctx;
  const mp_ep_view *v = &lo->view;
  const mp_ep_cnt_layout *L = &v->cl;
  memset(info, 0, sizeof(*info));
  info->num_tokens = lo->num_tokens;
  info->d_tokens_per_rank = lo->d_cnt + L->cnt_rank;
  info->d_tokens_per_node = lo->d_cnt + L->cnt_node;
  info->d_tokens_per_expert = lo->d_cnt + L->cnt_exp;
  info->d_recv_expert_offsets = lo->d_cnt + L->ex_off;
  info->d_status = lo->d_cnt + L->status;
  if (v->graph || !lo->ready) {
    info->num_recv_rows = info->num_recv_tokens = -1;
    return MPLANE_EP_OK;
  }
  const int *c = lo->h_cnt;
  info->num_recv_rows = c[L->status + MP_EP_ST_EXTOTAL];
  info->num_recv_tokens = c[L->off2r + v->G];
  info->tokens_per_rank = c + L->cnt_rank;
  info->tokens_per_node = c + L->cnt_node;
  info->tokens_per_expert = c + L->cnt_exp;
  info->recv_expert_offsets = c + L->ex_off;
  mp_ep_view hv = host_view(ctx, v);
  if (!lo->dispatched) {
    hv.dstride = mp_ep_dstride(MP_EP_FMT_FP8, v->H, v->K, v->G);
  }
  long net, nvl, net2, nvl2;
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_D1, &net, &nvl);
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_D2, &net2, &nvl2);
  info->dispatch_net_bytes = net + net2;
  info->dispatch_nvl_bytes = nvl + nvl2;
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_C1, &net, &nvl);
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_C2, &net2, &nvl2);
  info->combine_net_bytes = net + net2;
  info->combine_nvl_bytes = nvl + nvl2;
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_A, &net, &nvl);
  mp_ep_step_bytes(&hv, c, ctx->phys_node, MP_EP_STEP_B, &net2, &nvl2);
  info->counts_net_bytes = net + net2;
  info->counts_nvl_bytes = nvl + nvl2;
  return MPLANE_EP_OK;
}

int mplane_ep_token_in_rank(mplane_ep_ctx *ctx, const mplane_ep_layout *lo, uint8_t *flags, cudaStream_t stream) {
  if (!ctx || !lo || !lo->ready || !flags) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_token_in_rank: needs a layout and flags");
  if (lo->num_tokens == 0) return MPLANE_EP_OK;
  KERNEL_TRY(ctx, mp_ep_launch_token_in_rank(&lo->view, flags, stream));
  return MPLANE_EP_OK;
}

/* ---------- route ---------- */

int mplane_ep_route(mplane_ep_ctx *ctx, const float *logits, const float *bias, int num_tokens, int num_groups,
                    int topk_groups, float scaling, int normalize, int32_t *topk_idx, float *topk_weights,
                    cudaStream_t stream) {
  if (!ctx) return EP_FAIL(NULL, MPLANE_EP_ERR_INVALID, "mplane_ep_route: ctx is NULL");
  int E = ctx->cfg.num_experts, K = ctx->cfg.topk;
  if (num_tokens < 0 || (num_tokens > 0 && (!logits || !topk_idx || !topk_weights)))
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_route: num_tokens=%d with NULL buffers", num_tokens);
  if (num_groups < 1 || E % num_groups || topk_groups < 1 || topk_groups > num_groups)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_route: num_groups=%d must divide num_experts=%d, topk_groups=%d in 1..num_groups",
                   num_groups, E, topk_groups);
  if (num_tokens == 0) return MPLANE_EP_OK;
  KERNEL_TRY(ctx, mp_ep_launch_route(logits, bias, num_tokens, E, K, num_groups, topk_groups, scaling, normalize,
                                     topk_idx, topk_weights, stream));
  return MPLANE_EP_OK;
}

/* ---------- dispatch / combine ---------- */

static void use_recv(mplane_ep_ctx *ctx, mp_ep_view *v, const mplane_ep_recv *recv) {
  const int tok = ctx->cfg.token_rows; /* no expert-row payloads: x and scales are not written */
  v->ex_x = !tok && recv && recv->x ? (uint8_t *)recv->x : ctx->ex_x;
  v->ex_scale = !tok && recv && recv->scales ? recv->scales : ctx->ex_scale;
  v->ex_w = recv && recv->weights ? recv->weights : ctx->ex_w;
  v->ex_src = recv && recv->src ? recv->src : ctx->ex_src;
}

/* A dispatch was issued: tell the caller where its rows are. */
static void dispatch_done(mplane_ep_layout *lo, mplane_ep_recv *recv) {
  const mp_ep_view *v = &lo->view;
  if (recv) {
    recv->x = v->ex_x;
    recv->scales = v->ex_scale;
    recv->weights = v->ex_w;
    recv->src = v->ex_src;
    recv->expert_offsets = lo->d_cnt + v->cl.ex_off;
    recv->num_rows = v->graph ? -1 : lo->h_cnt[v->cl.status + MP_EP_ST_EXTOTAL];
    recv->tokens = v->token_rows ? (const uint8_t *)v->p2r : NULL;
    recv->token_stride = v->token_rows ? v->dstride : 0;
    recv->row_token = v->row_token;
    recv->num_tokens = v->token_rows && !v->graph ? lo->h_cnt[v->cl.off2r + v->G] : -1;
  }
  lo->dispatched = 1;
}

/* One node with nvlink_direct: no network phase and no forwarding, so pack and unpack run as one
 * kernel that overlaps the NVLink writes with the unpacking of the peers' rows (ready flags instead
 * of a barrier). The profile shows it all as dispatch.pack. */
static int dispatch_fused(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *x, const float *w,
                          mplane_ep_recv *recv, cudaStream_t stream) {
  const mp_ep_view *v = &lo->view;
  const int blocks = fused_blocks(ctx);
  /* the epoch: counted here in normal mode (one launch fewer), on the GPU in worst-case mode */
  int host_epoch = 0;
  if (!v->graph) host_epoch = ctx->host_epoch = mp_ep_next_epoch(ctx->host_epoch);
  KERNEL_TRY(ctx, mp_ep_launch_dispatch_fused(v, (const uint16_t *)x, w, blocks - ctx->link_blocks - ctx->recv_blocks,
                                              ctx->link_blocks, blocks, host_epoch, stream));
  for (int i = 1; i <= 5; i++) prof_mark(ctx, PROF_DISPATCH, i, stream);
  dispatch_done(lo, recv);
  return MPLANE_EP_OK;
}

/* Both dispatch entries: x BF16 (xq NULL), or xq / xq_scale already FP8. */
static int dispatch(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *x, const uint8_t *xq, const float *xq_scale,
                    const float *topk_weights, int fmt, mplane_ep_recv *recv, cudaStream_t stream) {
  mp_ep_view *v = &lo->view;
  v->fmt = fmt;
  v->xq = xq;
  v->xq_scale = xq_scale;
  v->dstride = mp_ep_dstride(fmt, v->H, v->K, v->G);
  v->meta_off = mp_ep_payload_bytes(fmt, v->H);
  use_recv(ctx, v, recv);
  int blocks = ctx->num_sms, rc;
  int pack_blocks = (v->T + MP_EP_PACK_BLOCK / 32 - 1) / (MP_EP_PACK_BLOCK / 32);
  if (pack_blocks > blocks) pack_blocks = blocks;
  if (pack_blocks < 1) pack_blocks = 1;
  ctx->prof_valid[PROF_DISPATCH] = 0;
  prof_mark(ctx, PROF_DISPATCH, 0, stream);
  if (v->direct && v->N > 1) {
    /* every rank's p2r segment starts (where this rank's rows land at each peer); also a barrier:
     * no peer still reads its p2r (previous unpack / combine) when the pack writes into it. The
     * fused dispatch (one node) does both in-kernel (announce_start in ep_kernels.cu). */
    const int G1 = v->G + 1;
    NCCL_TRY(ctx, ncclAllGather(lo->d_cnt + v->cl.off2r, ctx->d_peer_off, (size_t)G1, ncclInt32,
                                ctx->comm, stream));
  }
  if (v->direct && v->N == 1) return dispatch_fused(ctx, lo, x, topk_weights, recv, stream);
  KERNEL_TRY(ctx, mp_ep_launch_pack(v, (const uint16_t *)x, topk_weights, pack_blocks, stream));
  prof_mark(ctx, PROF_DISPATCH, 1, stream);
  if ((rc = run_step(ctx, lo, v, MP_EP_STEP_D1, stream))) return rc;
  prof_mark(ctx, PROF_DISPATCH, 2, stream);
  /* normal mode knows when there is nothing to forward (one node) or to unpack (one GPU a node) */
  if (v->graph || v->N > 1) KERNEL_TRY(ctx, mp_ep_launch_forward(v, blocks, stream));
  prof_mark(ctx, PROF_DISPATCH, 3, stream);
  if (v->direct) {
    /* the rows are already in place (written by the peers' pack / forward): wait for them */
    if ((rc = direct_barrier(ctx, stream))) return rc;
  } else if ((rc = run_step(ctx, lo, v, MP_EP_STEP_D2, stream))) {
    return rc;
  }
  prof_mark(ctx, PROF_DISPATCH, 4, stream);
  if (v->graph || v->G > 1) KERNEL_TRY(ctx, mp_ep_launch_unpack(v, blocks, stream));
  prof_mark(ctx, PROF_DISPATCH, 5, stream);
  dispatch_done(lo, recv);
  return MPLANE_EP_OK;
}

static int dispatch_check(mplane_ep_ctx *ctx, const mplane_ep_layout *lo, const char *fn) {
  if (!ctx || !lo || lo->ctx != ctx || !lo->ready)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "%s: needs a layout from mplane_ep_get_layout on this context", fn);
  return MPLANE_EP_OK;
}

int mplane_ep_dispatch(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *x, const float *topk_weights, int fmt,
                       mplane_ep_recv *recv, cudaStream_t stream) {
  int rc = dispatch_check(ctx, lo, "mplane_ep_dispatch");
  if (rc) return rc;
  if (fmt != MPLANE_EP_FMT_FP8 && fmt != MPLANE_EP_FMT_BF16)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_dispatch: fmt=%d, expected MPLANE_EP_FMT_FP8 (0) or MPLANE_EP_FMT_BF16 (1)", fmt);
  if (lo->num_tokens > 0 && (!x || !topk_weights))
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_dispatch: x and topk_weights must be given");
  return dispatch(ctx, lo, x, NULL, NULL, topk_weights, fmt, recv, stream);
}

int mplane_ep_dispatch_fp8(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *x_fp8, const float *x_scales,
                           const float *topk_weights, mplane_ep_recv *recv, cudaStream_t stream) {
  int rc = dispatch_check(ctx, lo, "mplane_ep_dispatch_fp8");
  if (rc) return rc;
  if (lo->num_tokens > 0 && (!x_fp8 || !x_scales || !topk_weights))
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_dispatch_fp8: x_fp8, x_scales and topk_weights must be given");
  return dispatch(ctx, lo, NULL, (const uint8_t *)x_fp8, x_scales, topk_weights, MPLANE_EP_FMT_FP8, recv, stream);
}

/* One node with nvlink_direct: the whole combine is one kernel (k_combine_fused): some blocks
 * (MPLANE_EP_SEND_SMS, default a third) send the expert sums straight into the peers' rows, the rest
 * sum the own tokens. */
static int combine_fused(mplane_ep_ctx *ctx, const mp_ep_view *v, const void *y, void *out, cudaStream_t stream) {
  const int blocks = combine_blocks(ctx);
  int host_cepoch = 0, host_depoch = 0;
  if (!v->graph) { /* normal mode counts on the host (one launch fewer), worst-case mode on the GPU */
    host_cepoch = ctx->host_cepoch = mp_ep_next_epoch(ctx->host_cepoch);
    host_depoch = ctx->host_epoch;
  }
  KERNEL_TRY(ctx, mp_ep_launch_combine_fused(v, (const uint16_t *)y, (uint16_t *)out, ctx->send_blocks, blocks,
                                             host_depoch, host_cepoch, stream));
  for (int i = 1; i <= 5; i++) prof_mark(ctx, PROF_COMBINE, i, stream);
  return MPLANE_EP_OK;
}

int mplane_ep_combine(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *y, void *out, cudaStream_t stream) {
  if (!ctx || !lo || lo->ctx != ctx || !lo->dispatched)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_combine: needs a layout that was dispatched on this context");
  if (lo->num_tokens > 0 && !out) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_combine: out is NULL");
  mp_ep_view cv = lo->view, *v = &cv;
  int blocks = ctx->num_sms, rc;
  ctx->prof_valid[PROF_COMBINE] = 0;
  prof_mark(ctx, PROF_COMBINE, 0, stream);
  if (v->cflag_off) return combine_fused(ctx, v, y, out, stream);
  if (ctx->p2c) v->p2r = ctx->p2c; /* token rows: leave them in place */
  KERNEL_TRY(ctx, mp_ep_launch_combine_expert(v, (const uint16_t *)y, blocks, stream));
  prof_mark(ctx, PROF_COMBINE, 1, stream);
  if ((rc = run_step(ctx, lo, v, MP_EP_STEP_C2, stream))) return rc;
  prof_mark(ctx, PROF_COMBINE, 2, stream);
  KERNEL_TRY(ctx, mp_ep_launch_combine_node(v, blocks, stream));
  prof_mark(ctx, PROF_COMBINE, 3, stream);
  if ((rc = run_step(ctx, lo, v, MP_EP_STEP_C1, stream))) return rc;
  prof_mark(ctx, PROF_COMBINE, 4, stream);
  if (lo->num_tokens > 0) {
    int ob = (lo->num_tokens + MP_EP_BLOCK / 32 - 1) / (MP_EP_BLOCK / 32);
    if (ob > blocks) ob = blocks;
    KERNEL_TRY(ctx, mp_ep_launch_combine_out(v, (uint16_t *)out, ob, stream));
  }
  prof_mark(ctx, PROF_COMBINE, 5, stream);
  return MPLANE_EP_OK;
}

int mplane_ep_dequant(mplane_ep_ctx *ctx, const mplane_ep_layout *lo, const mplane_ep_recv *recv, void *y,
                      cudaStream_t stream) {
  if (!ctx || !lo || !lo->dispatched || !y)
    return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_dequant: needs a dispatched layout and y");
  mp_ep_view v = lo->view;
  if (recv) use_recv(ctx, &v, recv);
  KERNEL_TRY(ctx, mp_ep_launch_dequant(&v, (uint16_t *)y, ctx->num_sms, stream));
  return MPLANE_EP_OK;
}

/* ---------- diagnostics ---------- */

int mplane_ep_set_profiling(mplane_ep_ctx *ctx, int on) {
  if (!ctx) return EP_FAIL(NULL, MPLANE_EP_ERR_INVALID, "mplane_ep_set_profiling: ctx is NULL");
  if (on && !ctx->prof_ev[0][0])
    for (int o = 0; o < 3; o++)
      for (int i = 0; i < 6; i++) CUDA_TRY(ctx, cudaEventCreate(&ctx->prof_ev[o][i]));
  ctx->prof_on = on ? 1 : 0;
  memset(ctx->prof_valid, 0, sizeof(ctx->prof_valid));
  return MPLANE_EP_OK;
}

int mplane_ep_get_profile(mplane_ep_ctx *ctx, float *us) {
  if (!ctx || !us) return EP_FAIL(ctx, MPLANE_EP_ERR_INVALID, "mplane_ep_get_profile: NULL argument");
  for (int o = 0; o < 3; o++)
    for (int i = 0; i < 5; i++) {
      float ms = -1.f;
      if (ctx->prof_valid[o]) {
        CUDA_TRY(ctx, cudaEventSynchronize(ctx->prof_ev[o][5]));
        CUDA_TRY(ctx, cudaEventElapsedTime(&ms, ctx->prof_ev[o][i], ctx->prof_ev[o][i + 1]));
        ms *= 1000.f;
      }
      us[o * 5 + i] = ms;
    }
  return MPLANE_EP_OK;
}

const char *mplane_ep_profile_name(int step) {
  return step >= 0 && step < MPLANE_EP_PROFILE_STEPS ? prof_names[step] : "?";
}
