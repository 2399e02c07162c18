/* mplane-ep-bench, one rank: correctness against the CPU reference model, network bytes from the
 * plugin's counters against the model, and the DeepSeek-V3-shaped benchmark beside the flat
 * all-to-all baseline. Every rank generates every rank's inputs from the seed (or all-gathers
 * them), so each can run the whole reference model and check its own share. */

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "bench.h"
#include "ep_check.h"
#include "ep_kernels.h"
#include "ep_model.h"
#include "ep_num.h"
#include "ep_plan.h"
#include "ep_ref.h"
#include "mplane_ep.h"

static __thread int g_rank; /* thread-local: the CPU emulator runs ranks as threads */

static void say(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void say(const char *fmt, ...) {
  char buf[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  printf("[rank %d] %s\n", g_rank, buf);
}

#define CUDA_OR(call, ret)                                                                              \
  do {                                                                                                  \
    cudaError_t e_ = (call);                                                                            \
    if (e_ != cudaSuccess) {                                                                            \
      say("%s failed: %s (%s:%d)", #call, cudaGetErrorString(e_), __FILE__, __LINE__);                  \
      return ret;                                                                                       \
    }                                                                                                   \
  } while (0)
#define NCCL_OR(call, ret)                                                                              \
  do {                                                                                                  \
    ncclResult_t r_ = (call);                                                                           \
    if (r_ != ncclSuccess) {                                                                            \
      say("%s failed: %s (%s:%d)", #call, ncclGetErrorString(r_), __FILE__, __LINE__);                  \
      return ret;                                                                                       \
    }                                                                                                   \
  } while (0)
#define EP_OR(ctx, call, ret)                                                                           \
  do {                                                                                                  \
    int e_ = (call);                                                                                    \
    if (e_ != MPLANE_EP_OK) {                                                                           \
      say("%s failed (%d): %s", #call, e_, mplane_ep_last_error(ctx));                                  \
      return ret;                                                                                       \
    }                                                                                                   \
  } while (0)

static int read_full(int fd, void *buf, size_t n) {
  char *p = buf;
  while (n) {
    ssize_t r = read(fd, p, n);
    if (r <= 0) return -1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

/* A new communicator over all ranks: rank 0 makes the id, the launcher relays it. */
static int new_comm(rank_env *env, ncclComm_t *comm) {
  ncclUniqueId id;
  if (env->rank == 0) {
    NCCL_OR(ncclGetUniqueId(&id), -1);
    if (write(env->up_fd, &id, sizeof(id)) != (ssize_t)sizeof(id)) {
      say("cannot hand the NCCL unique id to the launcher");
      return -1;
    }
  }
  if (read_full(env->down_fd, &id, sizeof(id))) {
    say("no NCCL unique id from the launcher");
    return -1;
  }
  NCCL_OR(ncclCommInitRank(comm, env->nranks, id, env->rank), -1);
  return 0;
}

/* Host to device, complete when it returns. A plain cudaMemcpy runs on the legacy default stream,
 * which a cudaStreamNonBlocking stream (the ranks' `st`) does not wait for, and a copy from pageable
 * memory may still be in flight when cudaMemcpy returns: wait for the device before a kernel on st
 * reads the data. */
static cudaError_t h2d(void *dst, const void *src, size_t bytes) {
  cudaError_t e = cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice);
  return e != cudaSuccess ? e : cudaDeviceSynchronize();
}

static int allreduce(ncclComm_t comm, cudaStream_t s, double *v, int n, ncclRedOp_t op) {
  double *d = NULL;
  CUDA_OR(cudaMalloc((void **)&d, sizeof(double) * (size_t)n), -1);
  CUDA_OR(h2d(d, v, sizeof(double) * (size_t)n), -1);
  NCCL_OR(ncclAllReduce(d, d, (size_t)n, ncclDouble, op, comm, s), -1);
  CUDA_OR(cudaStreamSynchronize(s), -1);
  CUDA_OR(cudaMemcpy(v, d, sizeof(double) * (size_t)n, cudaMemcpyDeviceToHost), -1);
  cudaFree(d);
  return 0;
}

static void *dalloc(size_t bytes) {
  void *p = NULL;
  if (cudaMalloc(&p, bytes ? bytes : 16) != cudaSuccess) return NULL;
  return p;
}

static mplane_ep_config make_cfg(int gpn, int E, int H, int K, int T, int worst, int flat, int sms) {
  mplane_ep_config c;
  memset(&c, 0, sizeof(c));
  c.gpus_per_node = gpn;
  c.num_experts = E;
  c.hidden = H;
  c.topk = K;
  c.max_tokens = T;
  c.worst_case = worst;
  c.flat = flat;
  c.num_sms = sms;
  return c;
}

/* ---------------- check ---------------- */

typedef struct ck_case {
  const char *name;
  int E, K, H, T;
  int kind; /* MP_EP_ROUTE_*, or -1: DeepSeek-V3 gating on the GPU (mplane_ep_route), all-gathered */
  int fmt, worst, flat;
} ck_case;

static const ck_case cases[] = {
    {"v3-gated-fp8", 256, 8, 7168, 512, -1, MP_EP_FMT_FP8, 0, 0},
    {"v3-gated-bf16", 256, 8, 7168, 512, -1, MP_EP_FMT_BF16, 0, 0},
    {"uniform-fp8", 64, 6, 1024, 300, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 0},
    {"uniform-bf16", 64, 6, 1024, 300, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_BF16, 0, 0},
    {"one-node-fp8", 64, 6, 1024, 300, MP_EP_ROUTE_ONE_NODE, MP_EP_FMT_FP8, 0, 0},
    {"all-nodes-bf16", 64, 6, 1024, 300, MP_EP_ROUTE_ALL_NODES, MP_EP_FMT_BF16, 0, 0},
    {"mixed-drops-fp8", 64, 6, 1024, 300, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0},
    {"mixed-drops-bf16", 64, 8, 512, 257, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 0},
    {"graph-uniform-fp8", 64, 6, 1024, 300, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 1, 0},
    {"graph-mixed-bf16", 64, 8, 512, 257, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 1, 0},
    {"graph-v3-gated-fp8", 256, 8, 7168, 128, -1, MP_EP_FMT_FP8, 1, 0},
    {"flat-uniform-fp8", 64, 6, 1024, 300, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 1},
    {"flat-mixed-bf16", 64, 8, 512, 257, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 1},
};

typedef struct inputs {
  int R, K, H, E;
  int *T;
  int32_t **idx;
  float **w;
  uint16_t **x;
} inputs;

static void free_inputs(inputs *in) {
  for (int s = 0; s < in->R; s++) {
    free(in->idx[s]);
    free(in->w[s]);
    free(in->x[s]);
  }
  free(in->T);
  free(in->idx);
  free(in->w);
  free(in->x);
}

static int alloc_inputs(inputs *in, int R, int K, int H, int E, int Tmax) {
  memset(in, 0, sizeof(*in));
  in->R = R;
  in->K = K;
  in->H = H;
  in->E = E;
  in->T = calloc((size_t)R, sizeof(int));
  in->idx = calloc((size_t)R, sizeof(int32_t *));
  in->w = calloc((size_t)R, sizeof(float *));
  in->x = calloc((size_t)R, sizeof(uint16_t *));
  if (!in->T || !in->idx || !in->w || !in->x) return -1;
  for (int s = 0; s < R; s++) {
    in->idx[s] = malloc(sizeof(int32_t) * (size_t)Tmax * K + 4);
    in->w[s] = malloc(sizeof(float) * (size_t)Tmax * K + 4);
    in->x[s] = malloc(2 * (size_t)Tmax * H + 4);
    if (!in->idx[s] || !in->w[s] || !in->x[s]) return -1;
  }
  return 0;
}

/* Random logits of one rank's tokens (the same on every process for that rank). */
static void gen_logits(uint64_t seed, int rank, int T, int E, float *lg, float *bias) {
  uint64_t rs = seed * 0x9E3779B97F4A7C15ull + (uint64_t)rank * 1315423911ull + 99;
  for (long i = 0; i < (long)T * E; i++) lg[i] = (float)(mp_ep_rand_unit(&rs) * 6.0 - 3.0);
  uint64_t bs = seed + 4242;
  for (int e = 0; e < E; e++) bias[e] = (float)(mp_ep_rand_unit(&bs) * 0.1 - 0.05);
}

/* GPU gating vs the CPU reference, on this rank's logits. Returns mismatching tokens (-1 error). */
static long route_gpu(const bench_opts *o, mplane_ep_ctx *ctx, cudaStream_t st, int T, int E, int K, int32_t *idx,
                      float *w, int compare, double *wdiff) {
  float *lg = malloc(sizeof(float) * (size_t)T * E), *bias = malloc(sizeof(float) * (size_t)E);
  int32_t *ridx = malloc(sizeof(int32_t) * (size_t)T * K);
  float *rw = malloc(sizeof(float) * (size_t)T * K);
  float *d_lg = dalloc(sizeof(float) * (size_t)T * E), *d_bias = dalloc(sizeof(float) * (size_t)E);
  int32_t *d_idx = dalloc(sizeof(int32_t) * (size_t)T * K);
  float *d_w = dalloc(sizeof(float) * (size_t)T * K);
  long bad = -1;
  if (!lg || !bias || !ridx || !rw || !d_lg || !d_bias || !d_idx || !d_w) goto out;
  gen_logits(o->seed, g_rank, T, E, lg, bias);
  if (h2d(d_lg, lg, sizeof(float) * (size_t)T * E) != cudaSuccess ||
      h2d(d_bias, bias, sizeof(float) * (size_t)E) != cudaSuccess)
    goto out;
  if (mplane_ep_route(ctx, d_lg, d_bias, T, o->groups, o->topk_groups, o->scaling, 1, d_idx, d_w, st) != MPLANE_EP_OK) {
    say("mplane_ep_route: %s", mplane_ep_last_error(ctx));
    goto out;
  }
  if (cudaStreamSynchronize(st) != cudaSuccess ||
      cudaMemcpy(idx, d_idx, sizeof(int32_t) * (size_t)T * K, cudaMemcpyDeviceToHost) != cudaSuccess ||
      cudaMemcpy(w, d_w, sizeof(float) * (size_t)T * K, cudaMemcpyDeviceToHost) != cudaSuccess)
    goto out;
  bad = 0;
  *wdiff = 0;
  if (compare) {
    mp_ep_route_ref(lg, bias, T, E, K, o->groups, o->topk_groups, o->scaling, 1, ridx, rw);
    for (int t = 0; t < T; t++) {
      if (memcmp(idx + (long)t * K, ridx + (long)t * K, sizeof(int32_t) * (size_t)K)) {
        bad++;
        continue;
      }
      for (int k = 0; k < K; k++) {
        double d = fabs((double)w[(long)t * K + k] - rw[(long)t * K + k]);
        if (d > *wdiff) *wdiff = d;
      }
    }
  }
out:
  free(lg);
  free(bias);
  free(ridx);
  free(rw);
  cudaFree(d_lg);
  cudaFree(d_bias);
  cudaFree(d_idx);
  cudaFree(d_w);
  return bad;
}

/* The T BF16 tokens x [T][H] as an FP8 input for mplane_ep_dispatch_fp8, quantised on the host by
 * the CPU twin of pack's rule, in new device buffers of cap rows. 0 on success. */
static int fp8_input(const uint16_t *x, int T, int cap, int H, void **d_xq, float **d_xs) {
  const size_t ntile = (size_t)H / 128;
  uint8_t *q = malloc((size_t)cap * H + 1);
  float *qs = malloc(sizeof(float) * ((size_t)cap * ntile + 1));
  *d_xq = dalloc((size_t)cap * H + 16);
  *d_xs = dalloc(sizeof(float) * (size_t)cap * ntile + 16);
  int rc = !q || !qs || !*d_xq || !*d_xs;
  if (!rc) {
    mp_ep_quantize_rows(x, T, H, q, qs);
    rc = h2d(*d_xq, q, (size_t)T * H) != cudaSuccess || h2d(*d_xs, qs, sizeof(float) * (size_t)T * ntile) != cudaSuccess;
  }
  free(q);
  free(qs);
  return rc;
}

/* One dispatch: from BF16 x, or (xq not NULL) from the same tokens already in FP8. */
static int dispatch_one(mplane_ep_ctx *ctx, mplane_ep_layout *lo, const void *d_x, const void *d_xq, const float *d_xs,
                        const float *d_w, int fmt, mplane_ep_recv *recv, cudaStream_t st) {
  return d_xq ? mplane_ep_dispatch_fp8(ctx, lo, d_xq, d_xs, d_w, recv, st)
              : mplane_ep_dispatch(ctx, lo, d_x, d_w, fmt, recv, st);
}

/* Token rows: rebuild each expert row (payload and FP8 scales) on the host from the token row it
 * names, so that the expert-row checks below apply unchanged. An expert row that names no token
 * row, or one past the token rows, is an error. 0 when all named rows exist. */
static int expert_rows_from_tokens(const ck_case *c, const mplane_ep_recv *recv, int nrows, int H, uint8_t *hx,
                                   float *hs) {
  const long elem = c->fmt == MP_EP_FMT_FP8 ? 1 : 2, ntile = H / 128, stride = (long)recv->token_stride;
  int rc = 0, ntok = 0;
  int32_t *rt = malloc(sizeof(int32_t) * (size_t)(nrows + 1));
  uint8_t *tok = NULL;
  if (!rt || cudaMemcpy(rt, recv->row_token, sizeof(int32_t) * (size_t)nrows, cudaMemcpyDeviceToHost) != cudaSuccess) {
    say("%s: FAIL: reading row_token", c->name);
    rc = 1;
    goto out;
  }
  for (int r = 0; r < nrows; r++) ntok = rt[r] + 1 > ntok ? rt[r] + 1 : ntok;
  if (recv->num_tokens >= 0 && ntok > recv->num_tokens) {
    say("%s: FAIL: an expert row names token row %d of %d", c->name, ntok - 1, recv->num_tokens);
    rc = 1;
    goto out;
  }
  tok = malloc((size_t)stride * (size_t)(ntok + 1));
  if (!tok || cudaMemcpy(tok, recv->tokens, (size_t)stride * (size_t)ntok, cudaMemcpyDeviceToHost) != cudaSuccess) {
    say("%s: FAIL: reading the token rows", c->name);
    rc = 1;
    goto out;
  }
  for (int r = 0; r < nrows; r++) {
    if (rt[r] < 0) {
      say("%s: FAIL: expert row %d names no token row", c->name, r);
      rc = 1;
      goto out;
    }
    const uint8_t *row = tok + (long)rt[r] * stride;
    memcpy(hx + (long)r * H * elem, row, (size_t)(H * elem));
    if (c->fmt == MP_EP_FMT_FP8) memcpy(hs + (long)r * ntile, row + H, sizeof(float) * (size_t)ntile);
  }
out:
  free(rt);
  free(tok);
  return rc;
}

/* One correctness case on this rank: 0 pass, 1 fail, 2 could not run. */
static int run_case(const bench_opts *o, ncclComm_t comm, cudaStream_t st, const ck_case *c) {
  int R = o->gpus, me = g_rank, K = c->K, H = c->H, E = c->E, Tmax = c->T;
  int fail = 0, rc = 2;
  inputs in;
  mplane_ep_ctx *ctx = NULL;
  mplane_ep_layout *lo = NULL;
  mp_ep_model *m = NULL;
  void *d_x = NULL, *d_y = NULL, *d_out = NULL, *d_xq = NULL;
  float *d_xs = NULL;
  const int fp8in = o->fp8_in && c->fmt == MP_EP_FMT_FP8 && !c->flat;
  int32_t *d_idx = NULL;
  float *d_w = NULL;
  uint16_t **yall = NULL, **want = NULL;
  uint8_t *hx = NULL;
  float *hs = NULL, *hw = NULL;
  int *hsrc = NULL, *hoff = NULL;
  uint16_t *hout = NULL;
  cudaGraph_t graph = NULL;
  cudaGraphExec_t gexec = NULL;
  char msg[1024] = "";
  if (alloc_inputs(&in, R, K, H, E, Tmax)) {
    say("%s: out of host memory", c->name);
    goto out;
  }
  mplane_ep_config cfg = make_cfg(0, E, H, K, Tmax, c->worst, c->flat, 0);
  cfg.nvlink_direct = o->nvlink_direct;
  cfg.token_rows = o->token_rows && !c->flat;
  if (mplane_ep_create(&ctx, comm, &cfg, st) != MPLANE_EP_OK) {
    say("%s: mplane_ep_create: %s", c->name, mplane_ep_last_error(NULL));
    goto out;
  }
  mplane_ep_info info;
  mplane_ep_get_info(ctx, &info);
  int want_nodes = c->flat ? R : o->nodes;
  if (info.nodes != want_nodes) {
    say("%s: FAIL: the context sees %d nodes of %d GPUs, the launcher made %d (NCCL_HOSTID per emulated node)", c->name,
        info.nodes, info.gpus_per_node, want_nodes);
    fail = 1;
  }
  /* inputs of every rank */
  for (int s = 0; s < R; s++) {
    in.T[s] = c->kind < 0 ? Tmax : Tmax - (s * 37) % (Tmax / 3 + 1);
    mp_ep_gen_tokens(o->seed + 11, s, in.T[s], H, in.x[s]);
    if (c->kind >= 0)
      mp_ep_gen_routing(c->kind, o->seed + 5, s, R, o->per_node, E, K, in.T[s], in.idx[s], in.w[s]);
  }
  if (c->kind < 0) {
    /* DeepSeek-V3 gating on the GPU, then every rank's routing to every rank */
    double wd = 0;
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)Tmax * K);
    float *w = malloc(sizeof(float) * (size_t)Tmax * K);
    int32_t *d_all_i = dalloc(sizeof(int32_t) * (size_t)Tmax * K * R);
    float *d_all_w = dalloc(sizeof(float) * (size_t)Tmax * K * R);
    int ok = idx && w && d_all_i && d_all_w && route_gpu(o, ctx, st, Tmax, E, K, idx, w, 0, &wd) >= 0;
    if (ok) {
      int32_t *d_i = dalloc(sizeof(int32_t) * (size_t)Tmax * K);
      float *d_ww = dalloc(sizeof(float) * (size_t)Tmax * K);
      ok = d_i && d_ww && h2d(d_i, idx, sizeof(int32_t) * (size_t)Tmax * K) == cudaSuccess &&
           h2d(d_ww, w, sizeof(float) * (size_t)Tmax * K) == cudaSuccess &&
           ncclAllGather(d_i, d_all_i, (size_t)Tmax * K, ncclInt32, comm, st) == ncclSuccess &&
           ncclAllGather(d_ww, d_all_w, (size_t)Tmax * K, ncclFloat32, comm, st) == ncclSuccess &&
           cudaStreamSynchronize(st) == cudaSuccess;
      for (int s = 0; ok && s < R; s++)
        ok = cudaMemcpy(in.idx[s], d_all_i + (size_t)s * Tmax * K, sizeof(int32_t) * (size_t)Tmax * K,
                        cudaMemcpyDeviceToHost) == cudaSuccess &&
             cudaMemcpy(in.w[s], d_all_w + (size_t)s * Tmax * K, sizeof(float) * (size_t)Tmax * K,
                        cudaMemcpyDeviceToHost) == cudaSuccess;
      cudaFree(d_i);
      cudaFree(d_ww);
    }
    free(idx);
    free(w);
    cudaFree(d_all_i);
    cudaFree(d_all_w);
    if (!ok) {
      say("%s: gating and all-gather of the routing failed", c->name);
      goto out;
    }
  }
  int T = in.T[me];
  long cap = info.max_recv_rows;
  d_x = dalloc(2 * (size_t)Tmax * H);
  d_idx = dalloc(sizeof(int32_t) * (size_t)Tmax * K);
  d_w = dalloc(sizeof(float) * (size_t)Tmax * K);
  d_y = dalloc(2 * (size_t)cap * H);
  d_out = dalloc(2 * (size_t)Tmax * H);
  if (!d_x || !d_idx || !d_w || !d_y || !d_out) {
    say("%s: cudaMalloc failed", c->name);
    goto out;
  }
  CUDA_OR(h2d(d_x, in.x[me], 2 * (size_t)T * H), 2);
  if (fp8in && fp8_input(in.x[me], T, Tmax, H, &d_xq, &d_xs)) {
    say("%s: could not make the FP8 input", c->name);
    goto out;
  }
  CUDA_OR(h2d(d_idx, in.idx[me], sizeof(int32_t) * (size_t)T * K), 2);
  CUDA_OR(h2d(d_w, in.w[me], sizeof(float) * (size_t)T * K), 2);
  CUDA_OR(cudaMemsetAsync(d_out, 0xff, 2 * (size_t)Tmax * H, st), 2);
  EP_OR(ctx, mplane_ep_layout_create(ctx, &lo), 2);
  mplane_ep_recv recv;
  memset(&recv, 0, sizeof(recv));
  if (!c->worst) {
    EP_OR(ctx, mplane_ep_get_layout(ctx, d_idx, T, lo, st), 2);
    EP_OR(ctx, dispatch_one(ctx, lo, d_x, d_xq, d_xs, d_w, c->fmt, &recv, st), 2);
    EP_OR(ctx, mplane_ep_dequant(ctx, lo, &recv, d_y, st), 2);
    EP_OR(ctx, mplane_ep_combine(ctx, lo, d_y, d_out, st), 2);
    CUDA_OR(cudaStreamSynchronize(st), 2);
  } else {
    /* the whole step in one CUDA graph, replayed twice */
    CUDA_OR(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), 2);
    int r1 = mplane_ep_get_layout(ctx, d_idx, T, lo, st);
    int r2 = r1 ? r1 : dispatch_one(ctx, lo, d_x, d_xq, d_xs, d_w, c->fmt, &recv, st);
    int r3 = r2 ? r2 : mplane_ep_dequant(ctx, lo, &recv, d_y, st);
    int r4 = r3 ? r3 : mplane_ep_combine(ctx, lo, d_y, d_out, st);
    cudaError_t ce = cudaStreamEndCapture(st, &graph);
    if (r4 || ce != cudaSuccess) {
      say("%s: capture failed: %s / %s", c->name, r4 ? mplane_ep_last_error(ctx) : "ok", cudaGetErrorString(ce));
      goto out;
    }
    CUDA_OR(cudaGraphInstantiate(&gexec, graph, 0), 2);
    CUDA_OR(cudaGraphLaunch(gexec, st), 2);
    CUDA_OR(cudaGraphLaunch(gexec, st), 2);
    CUDA_OR(cudaStreamSynchronize(st), 2);
  }
  /* what arrived here */
  mplane_ep_layout_info li;
  mplane_ep_layout_get_info(lo, &li);
  int status[2];
  CUDA_OR(cudaMemcpy(status, li.d_status, sizeof(status), cudaMemcpyDeviceToHost), 2);
  int nrows = status[0];
  if (!c->worst && recv.num_rows != nrows) {
    say("%s: FAIL: dispatch says %d rows, the status word %d", c->name, recv.num_rows, nrows);
    fail = 1;
  }
  if (status[1] || nrows > cap) {
    say("%s: FAIL: %d rows overflow the %ld-row capacity", c->name, nrows, cap);
    fail = 1;
    nrows = (int)cap;
  }
  long elem = c->fmt == MP_EP_FMT_FP8 ? 1 : 2;
  int Er = E / R, ntile = H / 128;
  hx = malloc((size_t)(nrows + 1) * H * elem);
  hs = malloc(sizeof(float) * (size_t)(nrows + 1) * ntile);
  hw = malloc(sizeof(float) * (size_t)(nrows + 1));
  hsrc = malloc(sizeof(int) * 2 * (size_t)(nrows + 1));
  hoff = malloc(sizeof(int) * (size_t)(Er + 1));
  hout = malloc(2 * (size_t)(T + 1) * H);
  if (!hx || !hs || !hw || !hsrc || !hoff || !hout) goto out;
  if (cfg.token_rows) {
    if (expert_rows_from_tokens(c, &recv, nrows, H, hx, hs)) fail = 1;
  } else {
    CUDA_OR(cudaMemcpy(hx, recv.x, (size_t)nrows * H * elem, cudaMemcpyDeviceToHost), 2);
    if (c->fmt == MP_EP_FMT_FP8) CUDA_OR(cudaMemcpy(hs, recv.scales, sizeof(float) * (size_t)nrows * ntile, cudaMemcpyDeviceToHost), 2);
  }
  CUDA_OR(cudaMemcpy(hw, recv.weights, sizeof(float) * (size_t)nrows, cudaMemcpyDeviceToHost), 2);
  CUDA_OR(cudaMemcpy(hsrc, recv.src, sizeof(int) * 2 * (size_t)nrows, cudaMemcpyDeviceToHost), 2);
  CUDA_OR(cudaMemcpy(hoff, recv.expert_offsets, sizeof(int) * (size_t)(Er + 1), cudaMemcpyDeviceToHost), 2);
  CUDA_OR(cudaMemcpy(hout, d_out, 2 * (size_t)T * H, cudaMemcpyDeviceToHost), 2);
  /* the reference */
  mp_ep_model_cfg mc = {R, o->per_node, NULL, NULL, E, K, H, c->fmt, c->flat};
  m = mp_ep_model_run(&mc, in.T, (const int32_t *const *)in.idx, (const float *const *)in.w,
                      (const uint16_t *const *)in.x);
  if (!m) {
    say("%s: the reference model failed (memory?)", c->name);
    goto out;
  }
  long bad = mp_ep_check_dispatch(m, me, c->fmt, H, nrows, hoff, Er, hx, hs, hw, hsrc, msg, sizeof(msg));
  if (bad) {
    say("%s: FAIL dispatch: %ld fields differ from the model; first: %s", c->name, bad, msg);
    fail = 1;
  }
  yall = calloc((size_t)R, sizeof(uint16_t *));
  want = calloc((size_t)R, sizeof(uint16_t *));
  if (!yall || !want) goto out;
  for (int d = 0; d < R; d++) {
    yall[d] = malloc(2 * ((size_t)mp_ep_model_rank_out(m, d)->nrows + 1) * H);
    want[d] = malloc(2 * ((size_t)in.T[d] + 1) * H);
    if (!yall[d] || !want[d]) goto out;
    mp_ep_model_identity(m, d, yall[d]);
  }
  mp_ep_model_combine(m, (const uint16_t *const *)yall, want);
  long cbad = mp_ep_check_exact(hout, want[me], (long)T * H, msg, sizeof(msg));
  if (cbad) {
    say("%s: FAIL combine: %ld of %ld values differ from the model (bit for bit); first: %s", c->name, cbad,
        (long)T * H, msg);
    fail = 1;
  }
  double ratio = 0;
  long tbad = mp_ep_check_tolerance(c->fmt, T, H, K, E, in.x[me], in.idx[me], in.w[me], hout, &ratio, msg, sizeof(msg));
  if (tbad) {
    say("%s: FAIL tolerance: %ld values outside the documented bound; first: %s", c->name, tbad, msg);
    fail = 1;
  }
  say("check %-20s %s%s%s%s: %d tokens out, %d expert rows in, dispatch %s, combine %s, worst error %.2f of the %s tolerance",
      c->name, cfg.nvlink_direct && !c->flat ? "[nvlink-direct] " : "", cfg.token_rows ? "[token-rows] " : "", fp8in ? "[fp8-in] " : "", fail ? "FAIL" : "PASS", T, nrows, bad ? "DIFFERS" : "bit-exact", cbad ? "DIFFERS" : "bit-exact", ratio,
      c->fmt == MP_EP_FMT_FP8 ? "FP8" : "BF16");
  rc = fail;
out:
  if (gexec) cudaGraphExecDestroy(gexec);
  if (graph) cudaGraphDestroy(graph);
  if (yall)
    for (int d = 0; d < R; d++) free(yall[d]);
  if (want)
    for (int d = 0; d < R; d++) free(want[d]);
  free(yall);
  free(want);
  free(hx);
  free(hs);
  free(hw);
  free(hsrc);
  free(hoff);
  free(hout);
  mp_ep_model_free(m);
  mplane_ep_layout_destroy(lo);
  mplane_ep_destroy(ctx);
  cudaFree(d_x);
  cudaFree(d_xq);
  cudaFree(d_xs);
  cudaFree(d_idx);
  cudaFree(d_w);
  cudaFree(d_y);
  cudaFree(d_out);
  free_inputs(&in);
  return rc;
}

/* Hardware FP8 conversion vs the CPU twin on values around every binade, ties included. */
static long fp8_probe(cudaStream_t st, long *n_out) {
  long n = 1L << 22;
  float *h = malloc(sizeof(float) * (size_t)n);
  uint8_t *q = malloc((size_t)n);
  float *d_in = dalloc(sizeof(float) * (size_t)n);
  uint8_t *d_q = dalloc((size_t)n);
  long bad = -1;
  if (!h || !q || !d_in || !d_q) goto out;
  uint64_t rs = 2024;
  for (long i = 0; i < n; i++) {
    if (i < 256) {
      h[i] = mp_e4m3_to_f32((uint8_t)i);
      continue;
    }
    if (i < 512) { /* midpoints between neighbouring codes */
      int c = (int)(i - 256) & 0x7d;
      h[i] = (mp_e4m3_to_f32((uint8_t)c) + mp_e4m3_to_f32((uint8_t)(c + 1))) * 0.5f;
      continue;
    }
    double mag = ldexp(mp_ep_rand_unit(&rs) * 2.0, (int)(mp_ep_rand_next(&rs) % 30) - 18);
    h[i] = (float)((mp_ep_rand_next(&rs) & 1) ? -mag : mag);
  }
  if (h2d(d_in, h, sizeof(float) * (size_t)n) != cudaSuccess) goto out;
  if (mp_ep_launch_fp8_probe(d_in, 1.0f, d_q, n, st) != 0) goto out;
  if (cudaStreamSynchronize(st) != cudaSuccess || cudaMemcpy(q, d_q, (size_t)n, cudaMemcpyDeviceToHost) != cudaSuccess)
    goto out;
  bad = 0;
  for (long i = 0; i < n; i++) {
    uint8_t want = mp_ep_quant(h[i], 1.0f);
    if (q[i] != want && !((want & 0x7f) == 0x7f && (q[i] & 0x7f) == 0x7f)) {
      if (bad < 3) say("fp8: %.9g -> GPU 0x%02x, CPU twin 0x%02x", (double)h[i], q[i], want);
      bad++;
    }
  }
  *n_out = n;
out:
  free(h);
  free(q);
  cudaFree(d_in);
  cudaFree(d_q);
  return bad;
}

static int mode_check(const bench_opts *o, rank_env *env, cudaStream_t st) {
  ncclComm_t comm;
  if (new_comm(env, &comm)) return 2;
  int fails = 0, errors = 0;
  long n = 0, fbad = fp8_probe(st, &n);
  if (fbad != 0) fails++;
  say("check fp8-conversion     %s: %ld of %ld hardware conversions differ from the CPU twin", fbad ? "FAIL" : "PASS",
      fbad, n);
  /* gating: GPU vs CPU on the benchmark's token count */
  {
    mplane_ep_config cfg = make_cfg(0, o->experts, 128, o->topk, 16, 0, 0, 0);
    mplane_ep_ctx *ctx = NULL;
    if (mplane_ep_create(&ctx, comm, &cfg, st) == MPLANE_EP_OK) {
      int T = o->tokens, K = o->topk;
      int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * K);
      float *w = malloc(sizeof(float) * (size_t)T * K);
      double wd = 0;
      long bad = idx && w ? route_gpu(o, ctx, st, T, o->experts, K, idx, w, 1, &wd) : -1;
      /* near-ties may flip with the GPU's expf (a few ulp off the CPU's): allow 0.1% of tokens */
      int pass = bad >= 0 && bad * 1000 <= T && wd <= 1e-5 * o->scaling;
      if (!pass) fails++;
      say("check gating             %s: %d tokens, %ld choose other experts than the CPU reference, weights within %.2g",
          pass ? "PASS" : "FAIL", T, bad, wd);
      free(idx);
      free(w);
      mplane_ep_destroy(ctx);
    } else {
      say("gating: mplane_ep_create: %s", mplane_ep_last_error(NULL));
      errors++;
    }
  }
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    if (cases[i].E % o->gpus) continue;
    int rc = run_case(o, comm, st, &cases[i]);
    if (rc == 1) fails++;
    if (rc == 2) errors++;
    if (rc == 2) break; /* the ranks may be out of step now */
  }
  double v[2] = {fails, errors};
  if (allreduce(comm, st, v, 2, ncclSum) == 0 && g_rank == 0)
    bench_report(o, "check summary (%d ranks, %d node(s)): %s: %.0f failed checks, %.0f errors\n", o->gpus, o->nodes,
                 v[0] + v[1] == 0 ? "PASS" : "FAIL", v[0], v[1]);
  ncclCommDestroy(comm);
  return errors ? 2 : fails ? 1 : 0;
}

/* ---------------- bytes (plugin counters) ---------------- */

static void expand_pattern(const char *pat, char *out, size_t len) {
  size_t o = 0;
  for (const char *p = pat; *p && o + 16 < len; p++) {
    if (p[0] == '%' && p[1] == 'p') {
      o += (size_t)snprintf(out + o, len - o, "%d", (int)getpid());
      p++;
    } else if (p[0] == '%' && p[1] == '%') {
      out[o++] = '%';
      p++;
    } else {
      out[o++] = *p;
    }
  }
  out[o] = 0;
}

/* Sum of tx_bytes over the plugin's planes; -1 if the file is not there. */
static long long stats_tx(const char *path, long long *closed) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t cap = 1 << 16;
  char *buf = malloc(cap);
  if (!buf) {
    fclose(f);
    return -1;
  }
  size_t n = fread(buf, 1, cap - 1, f);
  fclose(f);
  buf[n] = 0;
  long long tx = mp_ep_stats_tx_bytes(buf, closed);
  free(buf);
  return tx;
}

typedef struct routing_all {
  int R, T, K, E;
  int *Ts;
  int32_t **idx;
  float **w;
} routing_all;

/* DeepSeek-V3 gating on the CPU for every rank's tokens: every process knows the whole routing. */
static int routing_cpu(const bench_opts *o, routing_all *ra) {
  int R = o->gpus, T = o->tokens, K = o->topk, E = o->experts;
  ra->R = R;
  ra->T = T;
  ra->K = K;
  ra->E = E;
  ra->Ts = malloc(sizeof(int) * (size_t)R);
  ra->idx = calloc((size_t)R, sizeof(int32_t *));
  ra->w = calloc((size_t)R, sizeof(float *));
  float *lg = malloc(sizeof(float) * (size_t)T * E), *bias = malloc(sizeof(float) * (size_t)E);
  if (!ra->Ts || !ra->idx || !ra->w || !lg || !bias) return -1;
  for (int s = 0; s < R; s++) {
    ra->Ts[s] = T;
    ra->idx[s] = malloc(sizeof(int32_t) * (size_t)T * K);
    ra->w[s] = malloc(sizeof(float) * (size_t)T * K);
    if (!ra->idx[s] || !ra->w[s]) return -1;
    gen_logits(o->seed, s, T, E, lg, bias);
    mp_ep_route_ref(lg, bias, T, E, K, o->groups, o->topk_groups, o->scaling, 1, ra->idx[s], ra->w[s]);
  }
  free(lg);
  free(bias);
  return 0;
}

static void free_routing(routing_all *ra) {
  for (int s = 0; s < ra->R; s++) {
    if (ra->idx) free(ra->idx[s]);
    if (ra->w) free(ra->w[s]);
  }
  free(ra->Ts);
  free(ra->idx);
  free(ra->w);
}

/* One layout + FP8 dispatch + identity experts + combine on a fresh communicator, destroyed at
 * the end so that the plugin writes its counters. expect gets this rank's bytes by the schedule. */
static int bytes_run(const bench_opts *o, rank_env *env, cudaStream_t st, const routing_all *ra, int flat,
                     double *expect_data, double *expect_counts) {
  ncclComm_t comm;
  if (new_comm(env, &comm)) return 2;
  int H = o->hidden, K = o->topk, T = ra->T;
  mplane_ep_config cfg = make_cfg(o->per_node, o->experts, H, K, T, 0, flat, 0);
  mplane_ep_ctx *ctx = NULL;
  mplane_ep_layout *lo = NULL;
  if (mplane_ep_create(&ctx, comm, &cfg, st) != MPLANE_EP_OK) {
    say("bytes: mplane_ep_create: %s", mplane_ep_last_error(NULL));
    return 2;
  }
  mplane_ep_info info;
  mplane_ep_get_info(ctx, &info);
  uint16_t *x = malloc(2 * (size_t)T * H);
  void *d_x = dalloc(2 * (size_t)T * H), *d_y = dalloc(2 * (size_t)info.max_recv_rows * H), *d_out = dalloc(2 * (size_t)T * H);
  int32_t *d_idx = dalloc(sizeof(int32_t) * (size_t)T * K);
  float *d_w = dalloc(sizeof(float) * (size_t)T * K);
  if (!x || !d_x || !d_y || !d_out || !d_idx || !d_w) return 2;
  mp_ep_gen_tokens(o->seed, g_rank, T, H, x);
  CUDA_OR(h2d(d_x, x, 2 * (size_t)T * H), 2);
  CUDA_OR(h2d(d_idx, ra->idx[g_rank], sizeof(int32_t) * (size_t)T * K), 2);
  CUDA_OR(h2d(d_w, ra->w[g_rank], sizeof(float) * (size_t)T * K), 2);
  EP_OR(ctx, mplane_ep_layout_create(ctx, &lo), 2);
  mplane_ep_recv recv;
  memset(&recv, 0, sizeof(recv));
  EP_OR(ctx, mplane_ep_get_layout(ctx, d_idx, T, lo, st), 2);
  EP_OR(ctx, mplane_ep_dispatch(ctx, lo, d_x, d_w, MPLANE_EP_FMT_FP8, &recv, st), 2);
  EP_OR(ctx, mplane_ep_dequant(ctx, lo, &recv, d_y, st), 2);
  EP_OR(ctx, mplane_ep_combine(ctx, lo, d_y, d_out, st), 2);
  CUDA_OR(cudaStreamSynchronize(st), 2);
  mplane_ep_layout_info li;
  mplane_ep_layout_get_info(lo, &li);
  *expect_data = (double)(li.dispatch_net_bytes + li.combine_net_bytes);
  *expect_counts = (double)li.counts_net_bytes;
  mplane_ep_layout_destroy(lo);
  mplane_ep_destroy(ctx);
  cudaFree(d_x);
  cudaFree(d_y);
  cudaFree(d_out);
  cudaFree(d_idx);
  cudaFree(d_w);
  free(x);
  NCCL_OR(ncclCommDestroy(comm), 2);
  return 0;
}

static int mode_bytes(const bench_opts *o, rank_env *env, cudaStream_t st) {
  routing_all ra;
  memset(&ra, 0, sizeof(ra));
  if (routing_cpu(o, &ra)) {
    say("bytes: out of host memory");
    return 2;
  }
  char path[600] = "";
  if (o->stats[0]) expand_pattern(o->stats, path, sizeof(path));
  long long closed = 0, before = o->stats[0] ? stats_tx(path, &closed) : -1;
  if (before < 0) before = 0;
  double e_data[2], e_cnt[2], meas[2] = {-1, -1};
  for (int flat = 0; flat < 2; flat++) {
    int rc = bytes_run(o, env, st, &ra, flat, &e_data[flat], &e_cnt[flat]);
    if (rc) {
      free_routing(&ra);
      return rc;
    }
    /* The plugin rewrites its file at every connection close, and NCCL's proxy closes them one by
     * one: wait until the file shows new closes and then stops changing (on the H200 the first
     * close was enough to stop the old loop, and the flat run read as 0 bytes). */
    long long closed_before = closed, after = -1, last_after = -2, last_closed = -2;
    for (int tries = 0; o->stats[0] && tries < 60; tries++) {
      after = stats_tx(path, &closed);
      if (after >= 0 && closed > closed_before && after == last_after && closed == last_closed) break;
      last_after = after;
      last_closed = closed;
      usleep(200000);
    }
    if (after >= 0) {
      meas[flat] = (double)(after - before);
      before = after;
    }
  }
  /* the model, for every rank */
  mp_ep_model_cfg mc = {o->gpus, o->per_node, NULL, NULL, o->experts, o->topk, o->hidden, MP_EP_FMT_FP8, 0};
  mp_ep_model_bytes b, bf;
  long *txd = calloc((size_t)o->gpus, sizeof(long)), *txc = calloc((size_t)o->gpus, sizeof(long));
  long *ftxd = calloc((size_t)o->gpus, sizeof(long)), *ftxc = calloc((size_t)o->gpus, sizeof(long));
  mp_ep_model_count(&mc, ra.Ts, (const int32_t *const *)ra.idx, &b, txd, txc);
  mc.flat = 1;
  mp_ep_model_count(&mc, ra.Ts, (const int32_t *const *)ra.idx, &bf, ftxd, ftxc);
  double model_me[2] = {(double)(txd[g_rank] + txc[g_rank]), (double)(ftxd[g_rank] + ftxc[g_rank])};
  for (int f = 0; f < 2; f++) {
    const char *nm = f ? "flat baseline" : "node-limited";
    if (meas[f] < 0)
      say("bytes %-13s: plugin counters UNAVAILABLE (%s): expected %.0f network bytes from this rank (model %.0f data + %.0f count messages)",
          nm, o->stats[0] ? "the stats file was not written: NET/mplane not in use, or a plugin without MPLANE_STATS_FILE" : "no --stats-file",
          e_data[f] + e_cnt[f], model_me[f], e_cnt[f]);
    else
      say("bytes %-13s: plugin counted %.0f bytes sent; schedule %.0f (data %.0f = model %.0f, counts %.0f); measured/expected %.4f",
          nm, meas[f], e_data[f] + e_cnt[f], e_data[f], model_me[f], e_cnt[f], meas[f] / (e_data[f] + e_cnt[f]));
    if (e_data[f] != model_me[f]) say("bytes %-13s: FAIL: the schedule's data bytes differ from the model", nm);
  }
  /* rank 0 summarises over all ranks (a communicator made after the measured ones) */
  ncclComm_t comm;
  int rc = 0;
  if (new_comm(env, &comm)) {
    rc = 2;
  } else {
    double v[8] = {meas[0] < 0 ? 0 : meas[0], meas[1] < 0 ? 0 : meas[1], e_data[0] + e_cnt[0], e_data[1] + e_cnt[1],
                   meas[0] < 0 ? 1 : 0, meas[1] < 0 ? 1 : 0, e_data[0] == model_me[0] ? 0 : 1, e_data[1] == model_me[1] ? 0 : 1};
    if (allreduce(comm, st, v, 8, ncclSum)) rc = 2;
    else if (g_rank == 0) {
      double tok = (double)b.tokens, H = o->hidden;
      double M = tok > 0 ? (double)b.remote_nodes / tok : 0;
      bench_report(o, "\nnetwork bytes per token per layer (%d ranks as %d node(s), %d tokens/GPU, top-%d of %d, %d of %d groups):\n",
                   o->gpus, o->nodes, o->tokens, o->topk, o->experts, o->topk_groups, o->groups);
      bench_report(o, "  M (distinct remote nodes per token): %.3f; formula M*H*(1+4/128) + M*H*2 = %.0f B/token (dispatch %.0f + combine %.0f)\n",
                   M, (b.d_net_payload + b.c_net_bytes) / tok, b.d_net_payload / tok, b.c_net_bytes / tok);
      bench_report(o, "  with row metadata (node-limited, as sent): model %.0f B/token; plain all-to-all sending all %d copies: %.0f B/token; "
                      "remote copies only (flat baseline): model %.0f B/token\n",
                   (b.d_net_bytes + b.c_net_bytes) / tok, o->topk, o->topk * (H * 132.0 / 128.0 + 2 * H),
                   (bf.flat_d_net_bytes + bf.flat_c_net_bytes) / tok);
      if (v[4] > 0 || v[5] > 0) {
        bench_report(o, "  plugin counters: UNAVAILABLE (%.0f of %d measurements) - %s\n", v[4] + v[5], 2 * o->gpus,
                     o->stats[0] ? "no stats file was written (is NET/mplane loaded? does the plugin have MPLANE_STATS_FILE?)"
                                 : "run with --stats-file");
      } else {
        double tol0 = 0.01 * v[2] + 65536.0 * o->gpus, tol1 = 0.01 * v[3] + 65536.0 * o->gpus;
        int ok0 = fabs(v[0] - v[2]) <= tol0, ok1 = fabs(v[1] - v[3]) <= tol1;
        bench_report(o, "  plugin counters, node-limited: %.0f B/token measured vs %.0f expected: %s\n", v[0] / tok, v[2] / tok,
                     ok0 ? "MATCH (within 1%)" : "MISMATCH");
        bench_report(o, "  plugin counters, flat baseline: %.0f B/token measured vs %.0f expected: %s; node-limited sends %.2fx fewer\n",
                     v[1] / tok, v[3] / tok, ok1 ? "MATCH (within 1%)" : "MISMATCH", v[0] > 0 ? v[1] / v[0] : 0);
        if (!ok0 || !ok1) rc = 1;
      }
      if (v[6] + v[7] > 0) rc = 1;
    }
    ncclCommDestroy(comm);
  }
  free(txd);
  free(txc);
  free(ftxd);
  free(ftxc);
  free_routing(&ra);
  return rc;
}

/* ---------------- bench ---------------- */

typedef struct timing {
  double layout, dispatch, combine; /* microseconds, averaged */
  double dispatch_cold; /* the dispatch launched onto an idle stream (the host's launch latency in it) */
  double steps[MPLANE_EP_PROFILE_STEPS]; /* one profiled iteration */
  double d_net, d_nvl, c_net, c_nvl, counts; /* bytes this rank sends */
  double recv_tokens;
} timing;

static int measure(const bench_opts *o, ncclComm_t comm, cudaStream_t st, mplane_ep_ctx *ctx, const void *d_x,
                   const void *d_xq, const float *d_xs, const int32_t *d_idx, const float *d_w, int T, int fmt,
                   void *d_y, void *d_out, timing *tm) {
  mplane_ep_layout *lo = NULL;
  EP_OR(ctx, mplane_ep_layout_create(ctx, &lo), -1);
  /* ev: 0 start, 1 layout done, 2 dispatch done, 3 combine start, 4 combine done, 5 dispatch start.
   * Normal mode's layout waits on the host for the counts, so the stream is idle when the dispatch
   * is launched. Every other round queues a memset behind the layout first, so that the dispatch
   * is already queued when the stream reaches it (5 -> 2: the GPU's time, as kernel timings such as
   * DeepEP's count it); the other rounds time it from the idle stream (1 -> 2: + launch latency). */
  cudaEvent_t ev[6];
  for (int i = 0; i < 6; i++) CUDA_OR(cudaEventCreate(&ev[i]), -1);
  const size_t busy_bytes = 64u << 20; /* ~30 us of memset: longer than a launch takes on the host */
  int *d_bar = dalloc(sizeof(int));
  void *d_busy = dalloc(busy_bytes);
  if (!d_bar || !d_busy) return -1;
  int nq = 0, nc = 0;
  CUDA_OR(cudaMemsetAsync(d_bar, 0, sizeof(int), st), -1);
  mplane_ep_recv recv;
  memset(&recv, 0, sizeof(recv));
  memset(tm, 0, sizeof(*tm));
  for (int it = 0; it < o->warmup + o->iters; it++) {
    /* line the ranks up, then layout (it waits on the host for the counts), dispatch, combine */
    NCCL_OR(ncclAllReduce(d_bar, d_bar, 1, ncclInt32, ncclSum, comm, st), -1);
    CUDA_OR(cudaStreamSynchronize(st), -1);
    CUDA_OR(cudaEventRecord(ev[0], st), -1);
    EP_OR(ctx, mplane_ep_get_layout(ctx, d_idx, T, lo, st), -1);
    CUDA_OR(cudaEventRecord(ev[1], st), -1);
    const int queued = (it - o->warmup) % 2 == 0;
    if (queued) CUDA_OR(cudaMemsetAsync(d_busy, 0, busy_bytes, st), -1);
    CUDA_OR(cudaEventRecord(ev[5], st), -1);
    EP_OR(ctx, dispatch_one(ctx, lo, d_x, d_xq, d_xs, d_w, fmt, &recv, st), -1);
    CUDA_OR(cudaEventRecord(ev[2], st), -1);
    if (it == 0) EP_OR(ctx, mplane_ep_dequant(ctx, lo, &recv, d_y, st), -1); /* identity experts, once */
    CUDA_OR(cudaEventRecord(ev[3], st), -1);
    EP_OR(ctx, mplane_ep_combine(ctx, lo, d_y, d_out, st), -1);
    CUDA_OR(cudaEventRecord(ev[4], st), -1);
    CUDA_OR(cudaStreamSynchronize(st), -1);
    if (it < o->warmup) continue;
    float a, b, c;
    CUDA_OR(cudaEventElapsedTime(&a, ev[0], ev[1]), -1);
    CUDA_OR(cudaEventElapsedTime(&b, ev[5], ev[2]), -1);
    CUDA_OR(cudaEventElapsedTime(&c, ev[3], ev[4]), -1);
    tm->layout += a * 1000.0;
    if (queued) tm->dispatch += b * 1000.0, nq++;
    else tm->dispatch_cold += b * 1000.0, nc++;
    tm->combine += c * 1000.0;
  }
  tm->layout /= o->iters;
  tm->dispatch /= nq > 0 ? nq : 1;
  tm->dispatch_cold /= nc > 0 ? nc : 1;
  if (nc == 0) tm->dispatch_cold = tm->dispatch; /* one round only */
  tm->combine /= o->iters;
  /* one more round with the library's per-step events, to see where the time goes */
  EP_OR(ctx, mplane_ep_set_profiling(ctx, 1), -1);
  NCCL_OR(ncclAllReduce(d_bar, d_bar, 1, ncclInt32, ncclSum, comm, st), -1);
  CUDA_OR(cudaStreamSynchronize(st), -1);
  EP_OR(ctx, mplane_ep_get_layout(ctx, d_idx, T, lo, st), -1);
  EP_OR(ctx, dispatch_one(ctx, lo, d_x, d_xq, d_xs, d_w, fmt, &recv, st), -1);
  EP_OR(ctx, mplane_ep_combine(ctx, lo, d_y, d_out, st), -1);
  CUDA_OR(cudaStreamSynchronize(st), -1);
  float us[MPLANE_EP_PROFILE_STEPS];
  EP_OR(ctx, mplane_ep_get_profile(ctx, us), -1);
  EP_OR(ctx, mplane_ep_set_profiling(ctx, 0), -1);
  for (int i = 0; i < MPLANE_EP_PROFILE_STEPS; i++) tm->steps[i] = us[i];
  mplane_ep_layout_info li;
  mplane_ep_layout_get_info(lo, &li);
  tm->d_net = (double)li.dispatch_net_bytes;
  tm->d_nvl = (double)li.dispatch_nvl_bytes;
  tm->c_net = (double)li.combine_net_bytes;
  tm->c_nvl = (double)li.combine_nvl_bytes;
  tm->counts = (double)(li.counts_net_bytes + li.counts_nvl_bytes);
  tm->recv_tokens = li.num_recv_tokens;
  for (int i = 0; i < 6; i++) cudaEventDestroy(ev[i]);
  cudaFree(d_bar);
  cudaFree(d_busy);
  mplane_ep_layout_destroy(lo);
  return 0;
}

/* Times: max over ranks; bytes: mean over ranks. */
static int reduce_timing(ncclComm_t comm, cudaStream_t st, timing *tm, int R) {
  double t[4] = {tm->layout, tm->dispatch, tm->combine, tm->dispatch_cold};
  double b[6] = {tm->d_net, tm->d_nvl, tm->c_net, tm->c_nvl, tm->counts, tm->recv_tokens};
  if (allreduce(comm, st, t, 4, ncclMax) || allreduce(comm, st, b, 6, ncclSum) ||
      allreduce(comm, st, tm->steps, MPLANE_EP_PROFILE_STEPS, ncclMax))
    return -1;
  tm->layout = t[0];
  tm->dispatch = t[1];
  tm->combine = t[2];
  tm->dispatch_cold = t[3];
  tm->d_net = b[0] / R;
  tm->d_nvl = b[1] / R;
  tm->c_net = b[2] / R;
  tm->c_nvl = b[3] / R;
  tm->counts = b[4] / R;
  tm->recv_tokens = b[5] / R;
  return 0;
}

static int mode_bench(const bench_opts *o, rank_env *env, cudaStream_t st) {
  ncclComm_t comm;
  if (new_comm(env, &comm)) return 2;
  int R = o->gpus, T = o->tokens, H = o->hidden, K = o->topk, E = o->experts;
  if (E % R) {
    say("bench: %d experts do not split over %d ranks", E, R);
    return 2;
  }
  uint16_t *x = malloc(2 * (size_t)T * H);
  int32_t *idx = malloc(sizeof(int32_t) * (size_t)T * K);
  float *w = malloc(sizeof(float) * (size_t)T * K);
  void *d_x = dalloc(2 * (size_t)T * H), *d_out = dalloc(2 * (size_t)T * H);
  int32_t *d_idx = dalloc(sizeof(int32_t) * (size_t)T * K);
  float *d_w = dalloc(sizeof(float) * (size_t)T * K);
  if (!x || !idx || !w || !d_x || !d_out || !d_idx || !d_w) {
    say("bench: out of memory");
    return 2;
  }
  mp_ep_gen_tokens(o->seed, g_rank, T, H, x);
  CUDA_OR(h2d(d_x, x, 2 * (size_t)T * H), 2);
  /* routing: DeepSeek-V3 gating on the GPU; timed on its own */
  double route_us = 0;
  {
    mplane_ep_config cfg = make_cfg(0, E, 128, K, 1, 0, 0, 0); /* gating needs E and K only */
    mplane_ep_ctx *ctx = NULL;
    EP_OR(NULL, mplane_ep_create(&ctx, comm, &cfg, st), 2);
    double wd;
    if (route_gpu(o, ctx, st, T, E, K, idx, w, 0, &wd) < 0) return 2;
    float *lg = malloc(sizeof(float) * (size_t)T * E), *bias = malloc(sizeof(float) * (size_t)E);
    float *d_lg = dalloc(sizeof(float) * (size_t)T * E), *d_bias = dalloc(sizeof(float) * (size_t)E);
    gen_logits(o->seed, g_rank, T, E, lg, bias);
    h2d(d_lg, lg, sizeof(float) * (size_t)T * E);
    h2d(d_bias, bias, sizeof(float) * (size_t)E);
    cudaEvent_t a, b;
    cudaEventCreate(&a);
    cudaEventCreate(&b);
    cudaEventRecord(a, st);
    for (int i = 0; i < 10; i++)
      mplane_ep_route(ctx, d_lg, d_bias, T, o->groups, o->topk_groups, o->scaling, 1, d_idx, d_w, st);
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    route_us = ms * 100.0;
    cudaEventDestroy(a);
    cudaEventDestroy(b);
    free(lg);
    free(bias);
    cudaFree(d_lg);
    cudaFree(d_bias);
    mplane_ep_destroy(ctx);
  }
  CUDA_OR(h2d(d_idx, idx, sizeof(int32_t) * (size_t)T * K), 2);
  CUDA_OR(h2d(d_w, w, sizeof(float) * (size_t)T * K), 2);
  double fp8_row = H + H / 128.0 * 4, bf16_row = 2.0 * H;
  if (g_rank == 0) {
    bench_report(o, "\n## libmplane-ep benchmark: %d GPU(s) as %d node(s) x %d, %d tokens/GPU, hidden %d, top-%d of %d experts, %d groups, top-%d groups\n",
                 R, o->nodes, o->per_node, T, H, K, E, o->groups, o->topk_groups);
    bench_report(o, "gating (route kernel): %.1f us for %d tokens\n", route_us, T);
    if (o->ceil_uni > 0)
      bench_report(o, "cudaMemcpyPeer ceiling GPU0->GPU1: %.1f GB/s one way, %.1f GB/s each way when both copy; local copy %.1f GB/s\n",
                   o->ceil_uni, o->ceil_bi, o->ceil_local);
    bench_report(o, "| variant | fmt | SMs | layout us | dispatch us | combine us | dispatch wire GB/s (net+nvl) | dispatch DeepEP GB/s | combine wire GB/s | combine DeepEP GB/s | dispatch us, launched onto an idle stream |\n");
    bench_report(o, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
  }
  int rc = 0;
  double ours_total = 0, base_total = 0, ours_nvl_gbs = 0, direct_nvl_gbs = 0, logical_fp8 = 0, logical_bf16c = 0;
  struct variant {
    const char *name;
    int flat, sms, fmt, direct, tokens, fp8in;
  } vars[16];
  int nv = 0;
  for (int i = 0; i < o->n_sms && nv < 6; i++) vars[nv++] = (struct variant){"node-limited", 0, o->sms[i], MPLANE_EP_FMT_FP8, 0, 0};
  vars[nv++] = (struct variant){"node-limited", 0, o->sms[0], MPLANE_EP_FMT_BF16, 0, 0};
  vars[nv++] = (struct variant){"flat all-to-all (baseline)", 1, 0, MPLANE_EP_FMT_FP8, 0, 0};
  if (o->nvlink_direct) { /* the direct intranode path, beside the NCCL path above */
    vars[nv++] = (struct variant){"node-limited nvlink-direct", 0, o->sms[0], MPLANE_EP_FMT_FP8, 1, 0};
    vars[nv++] = (struct variant){"node-limited nvlink-direct", 0, o->sms[0], MPLANE_EP_FMT_BF16, 1, 0};
  }
  if (o->token_rows) { /* one row per received token instead of one per expert row */
    vars[nv++] = (struct variant){"node-limited token-rows", 0, o->sms[0], MPLANE_EP_FMT_FP8, 0, 1};
    if (o->nvlink_direct) {
      vars[nv++] = (struct variant){"node-limited nvlink-direct token-rows", 0, o->sms[0], MPLANE_EP_FMT_FP8, 1, 1};
      vars[nv++] = (struct variant){"node-limited nvlink-direct token-rows", 0, o->sms[0], MPLANE_EP_FMT_BF16, 1, 1};
    }
  }
  if (o->fp8_in) { /* the tokens already in FP8 (mplane_ep_dispatch_fp8), as DeepEP takes them */
    vars[nv++] = (struct variant){"node-limited FP8-in", 0, o->sms[0], MPLANE_EP_FMT_FP8, o->nvlink_direct, 0, 1};
    if (o->token_rows)
      vars[nv++] = (struct variant){"node-limited token-rows FP8-in", 0, o->sms[0], MPLANE_EP_FMT_FP8, o->nvlink_direct, 1, 1};
  }
  double direct_tok_gbs = 0, fp8in_gbs = 0;
  void *d_xq = NULL;
  float *d_xs = NULL;
  if (o->fp8_in && fp8_input(x, T, T, H, &d_xq, &d_xs)) {
    say("bench: could not make the FP8 input");
    return 2;
  }
  for (int i = 0; i < nv; i++) {
    mplane_ep_config cfg = make_cfg(0, E, H, K, T, 0, vars[i].flat, vars[i].sms);
    cfg.nvlink_direct = vars[i].direct;
    cfg.token_rows = vars[i].tokens;
    mplane_ep_ctx *ctx = NULL;
    if (mplane_ep_create(&ctx, comm, &cfg, st) != MPLANE_EP_OK) {
      say("bench: mplane_ep_create: %s", mplane_ep_last_error(NULL));
      rc = 2;
      break;
    }
    mplane_ep_info info;
    mplane_ep_get_info(ctx, &info);
    void *d_y = dalloc(2 * (size_t)info.max_recv_rows * H);
    timing tm;
    if (!d_y ||
        measure(o, comm, st, ctx, d_x, vars[i].fp8in ? d_xq : NULL, d_xs, d_idx, d_w, T, vars[i].fmt, d_y, d_out, &tm) ||
        reduce_timing(comm, st, &tm, R)) {
      rc = 2;
      cudaFree(d_y);
      mplane_ep_destroy(ctx);
      break;
    }
    /* DeepEP's logical bytes: tokens received (once per rank, own included) x row; the flat
     * baseline moves the same useful data, so it is credited with the node-limited count */
    if (!vars[i].flat && i == 0) {
      logical_fp8 = tm.recv_tokens * fp8_row;
      logical_bf16c = tm.recv_tokens * bf16_row;
    }
    double drow = vars[i].fmt == MPLANE_EP_FMT_FP8 ? fp8_row : bf16_row;
    double dlog = vars[i].flat ? logical_fp8 : tm.recv_tokens * drow, clog = vars[i].flat ? logical_bf16c : tm.recv_tokens * bf16_row;
    double dwire = (tm.d_net + tm.d_nvl) / (tm.dispatch * 1e3), cwire = (tm.c_net + tm.c_nvl) / (tm.combine * 1e3);
    if (g_rank == 0)
      bench_report(o, "| %s | %s | %d | %.0f | %.0f | %.0f | %.1f (%.1f+%.1f) | %.1f | %.1f | %.1f | %.0f |\n", vars[i].name,
                   vars[i].fmt == MPLANE_EP_FMT_FP8 ? "FP8" : "BF16", info.num_sms, tm.layout, tm.dispatch, tm.combine, dwire,
                   tm.d_net / (tm.dispatch * 1e3), tm.d_nvl / (tm.dispatch * 1e3), dlog / (tm.dispatch * 1e3), cwire,
                   clog / (tm.combine * 1e3), tm.dispatch_cold);
    if (g_rank == 0) {
      char line[1024];
      int off = snprintf(line, sizeof(line), "  steps of one profiled round, us (max over ranks):");
      for (int k = 0; k < MPLANE_EP_PROFILE_STEPS && off < (int)sizeof(line) - 40; k++)
        off += snprintf(line + off, sizeof(line) - (size_t)off, " %s %.0f", mplane_ep_profile_name(k), tm.steps[k]);
      bench_report(o, "%s\n", line);
    }
    double total = tm.layout + tm.dispatch + tm.combine;
    if (i == 0) {
      ours_total = total;
      ours_nvl_gbs = tm.d_nvl / (tm.dispatch * 1e3);
    }
    const double nvl_gbs = tm.d_nvl / (tm.dispatch * 1e3);
    if (vars[i].direct && vars[i].fmt == MPLANE_EP_FMT_FP8 && !vars[i].tokens && !vars[i].fp8in) direct_nvl_gbs = nvl_gbs;
    if (vars[i].direct && vars[i].fmt == MPLANE_EP_FMT_FP8 && vars[i].tokens && !vars[i].fp8in) direct_tok_gbs = nvl_gbs;
    if (vars[i].fp8in && nvl_gbs > fp8in_gbs) fp8in_gbs = nvl_gbs;
    if (vars[i].flat) base_total = total;
    cudaFree(d_y);
    mplane_ep_destroy(ctx);
  }
  if (rc == 0 && g_rank == 0) {
    bench_report(o, "speedup over the flat all-to-all baseline (layout + dispatch + combine, FP8 dispatch): %.2fx (%.0f us vs %.0f us)%s\n",
                 base_total / ours_total, ours_total, base_total, o->nodes > 1 ? " [target >= 1.5x on two emulated nodes]" : "");
    if (o->ceil_uni > 0 && o->nodes == 1 && R > 1)
      bench_report(o, "intranode dispatch wire rate %.1f GB/s = %.0f%% of the one-way peer-copy ceiling, %.0f%% of the each-way ceiling [target >= 60%%]\n",
                   ours_nvl_gbs, 100 * ours_nvl_gbs / o->ceil_uni, o->ceil_bi > 0 ? 100 * ours_nvl_gbs / o->ceil_bi : 0);
    if (o->ceil_uni > 0 && o->nodes == 1 && R > 1 && direct_nvl_gbs > 0)
      bench_report(o, "intranode dispatch wire rate, nvlink-direct FP8: %.1f GB/s = %.0f%% of the one-way peer-copy ceiling [target >= 60%%]\n",
                   direct_nvl_gbs, 100 * direct_nvl_gbs / o->ceil_uni);
    if (o->ceil_uni > 0 && o->nodes == 1 && R > 1 && direct_tok_gbs > 0)
      bench_report(o, "intranode dispatch wire rate, nvlink-direct FP8 token rows: %.1f GB/s = %.0f%% of the one-way peer-copy ceiling [target >= 60%%]\n",
                   direct_tok_gbs, 100 * direct_tok_gbs / o->ceil_uni);
    if (o->ceil_uni > 0 && o->nodes == 1 && R > 1 && fp8in_gbs > 0)
      bench_report(o, "intranode dispatch wire rate, FP8 in (tokens quantised before dispatch, as DeepEP times it), best variant: %.1f GB/s = %.0f%% of the one-way peer-copy ceiling\n",
                   fp8in_gbs, 100 * fp8in_gbs / o->ceil_uni);
    bench_report(o, "dispatch us: the stream reaches a dispatch already queued behind the layout (the GPU's time, as kernel "
                    "timings count it; GB/s from it); last column: launched after the layout's host wait onto an idle "
                    "stream, the host's launch latency included (the rounds alternate)\n");
    bench_report(o, "data kernels: one block per SM (%d threads; pack and the fused direct dispatch %d), SMs as in the table; NCCL's own kernels run between them\n",
                 MP_EP_BLOCK, MP_EP_PACK_BLOCK);
  }
  free(x);
  free(idx);
  free(w);
  cudaFree(d_xq);
  cudaFree(d_xs);
  cudaFree(d_x);
  cudaFree(d_out);
  cudaFree(d_idx);
  cudaFree(d_w);
  ncclCommDestroy(comm);
  return rc;
}

int bench_rank_main(const bench_opts *o, rank_env *env) {
  g_rank = env->rank;
  cudaError_t e = cudaSetDevice(env->device);
  if (e != cudaSuccess) {
    say("cudaSetDevice(%d): %s", env->device, cudaGetErrorString(e));
    return 2;
  }
  cudaStream_t st;
  CUDA_OR(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), 2);
  int worst = 0, rc;
  if (env->rank == 0) {
    int v = 0;
    ncclGetVersion(&v);
    say("NCCL %d, device %d, NCCL_HOSTID=%s, NCCL_NET_PLUGIN=%s", v, env->device,
        getenv("NCCL_HOSTID") ? getenv("NCCL_HOSTID") : "(unset)",
        getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN") : "(unset)");
  }
  /* NCCL 2.28 unloads a net plugin when the last communicator using it is destroyed, and its reload
   * then fails (the library's name was cleared with its state), so every later communicator falls
   * back silently to NCCL's Socket transport: on the H200 only the first mode's communicator ran
   * through mplane. An idle communicator held for the whole run keeps the plugin loaded; it makes
   * no connection (NCCL connects when a communicator is first used). */
  ncclComm_t anchor = NULL;
  if (new_comm(env, &anchor)) {
    cudaStreamDestroy(st);
    return 2;
  }
  /* bytes first: the plugin's counters are per process, and nothing may have used the network yet */
  if ((o->modes & MODE_BYTES) && o->nodes < 2) {
    if (env->rank == 0) say("bytes: one node - nothing crosses the network (run with --nodes 2 for the counter check)");
  } else if (o->modes & MODE_BYTES) {
    rc = mode_bytes(o, env, st);
    if (rc > worst) worst = rc;
    if (rc == 2) goto done;
  }
  if (o->modes & MODE_CHECK) {
    rc = mode_check(o, env, st);
    if (rc > worst) worst = rc;
    if (rc == 2) goto done;
  }
  if (o->modes & MODE_BENCH) {
    rc = mode_bench(o, env, st);
    if (rc > worst) worst = rc;
  }
done:
  ncclCommDestroy(anchor);
  if (env->up_fd >= 0) close(env->up_fd);
  cudaStreamDestroy(st);
  return worst;
}

/* ---------------- the peer-copy ceiling ---------------- */

int bench_ceiling_main(const bench_opts *o, int fd) {
  double res[3] = {0, 0, 0};
  size_t bytes = 256u << 20;
  int iters = 10, can01 = 0, can10 = 0;
  void *a0 = NULL, *b0 = NULL, *a1 = NULL, *b1 = NULL;
  cudaStream_t s0, s1;
  cudaEvent_t e0, e1;
  g_rank = -1;
  CUDA_OR(cudaDeviceCanAccessPeer(&can01, 0, 1), 2);
  CUDA_OR(cudaDeviceCanAccessPeer(&can10, 1, 0), 2);
  CUDA_OR(cudaSetDevice(1), 2);
  if (can10) cudaDeviceEnablePeerAccess(0, 0);
  CUDA_OR(cudaMalloc(&a1, bytes), 2);
  CUDA_OR(cudaMalloc(&b1, bytes), 2);
  CUDA_OR(cudaStreamCreate(&s1), 2);
  CUDA_OR(cudaSetDevice(0), 2);
  if (can01) cudaDeviceEnablePeerAccess(1, 0);
  CUDA_OR(cudaMalloc(&a0, bytes), 2);
  CUDA_OR(cudaMalloc(&b0, bytes), 2);
  CUDA_OR(cudaStreamCreate(&s0), 2);
  CUDA_OR(cudaEventCreate(&e0), 2);
  CUDA_OR(cudaEventCreate(&e1), 2);
  for (int i = 0; i < 2; i++) CUDA_OR(cudaMemcpyPeerAsync(a1, 1, a0, 0, bytes, s0), 2);
  CUDA_OR(cudaStreamSynchronize(s0), 2);
  float ms;
  CUDA_OR(cudaEventRecord(e0, s0), 2);
  for (int i = 0; i < iters; i++) CUDA_OR(cudaMemcpyPeerAsync(a1, 1, a0, 0, bytes, s0), 2);
  CUDA_OR(cudaEventRecord(e1, s0), 2);
  CUDA_OR(cudaEventSynchronize(e1), 2);
  CUDA_OR(cudaEventElapsedTime(&ms, e0, e1), 2);
  res[0] = (double)bytes * iters / (ms * 1e6);
  /* both directions at once */
  struct timespec t0, t1;
  CUDA_OR(cudaDeviceSynchronize(), 2);
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int i = 0; i < iters; i++) {
    CUDA_OR(cudaMemcpyPeerAsync(a1, 1, a0, 0, bytes, s0), 2);
    CUDA_OR(cudaMemcpyPeerAsync(b0, 0, b1, 1, bytes, s1), 2);
  }
  CUDA_OR(cudaStreamSynchronize(s0), 2);
  CUDA_OR(cudaStreamSynchronize(s1), 2);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double sec = (t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) * 1e-9;
  res[1] = (double)bytes * iters / sec / 1e9;
  CUDA_OR(cudaEventRecord(e0, s0), 2);
  for (int i = 0; i < iters; i++) CUDA_OR(cudaMemcpyAsync(b0, a0, bytes, cudaMemcpyDeviceToDevice, s0), 2);
  CUDA_OR(cudaEventRecord(e1, s0), 2);
  CUDA_OR(cudaEventSynchronize(e1), 2);
  CUDA_OR(cudaEventElapsedTime(&ms, e0, e1), 2);
  res[2] = (double)bytes * iters / (ms * 1e6);
  bench_report(o, "ceiling: cudaMemcpyPeer GPU0->GPU1 %.1f GB/s, both directions at once %.1f GB/s each way, local copy %.1f GB/s (peer access %s) [256 MiB x %d]\n",
               res[0], res[1], res[2], can01 && can10 ? "on" : "OFF: copies go through the host", iters);
  if (write(fd, res, sizeof(res)) != (ssize_t)sizeof(res)) return 2;
  return 0;
}

/* A line of the report: to stdout, and appended to --out's file when one is named. */
void bench_report(const bench_opts *o, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vprintf(fmt, ap);
  va_end(ap);
  if (o->out[0]) {
    FILE *f = fopen(o->out, "a");
    if (f) {
      va_start(ap, fmt);
      vfprintf(f, fmt, ap);
      va_end(ap);
      fclose(f);
    }
  }
}
