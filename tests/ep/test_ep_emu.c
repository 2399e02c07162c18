/* libmplane-ep's real host code (collectives/ep/ep_host.c) and real kernels (ep_kernels.cu, built as
 * C++ against tests/ep/emu: every CUDA thread an OS thread, barriers and warp shuffles emulated)
 * over an emulated NCCL (ranks are threads; a receive whose size differs from the send fails),
 * checked against the reference model: dispatch rows, combine outputs bit for bit, token-in-rank
 * flags, gating, and no device memory left behind. It proves the GPU code paths on a CPU, short of
 * what only hardware shows (timing, the memory model, the hardware FP8 conversion: the GPU test). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <pthread.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ep_check.h"
#include "ep_model.h"
#include "ep_num.h"
#include "ep_plan.h"
#include "ep_ref.h"
#include "mplane_ep.h"

typedef struct emu_case {
  const char *name;
  int R, G, E, K, H, T;
  int kind, fmt, worst, flat, auto_topo;
  int direct; /* nvlink_direct: one node = the fused kernel, several = rows written then a barrier */
  int tokens; /* token_rows: expert rows name their token row instead of holding a copy */
  int fp8_in; /* the tokens go in already quantised (mplane_ep_dispatch_fp8) */
} emu_case;

typedef struct rank_out {
  int rc;
  char err[512];
  int nrows, status[2], nodes, gpn;
  int *off;
  uint8_t *x;
  float *scale, *w;
  int *src;
  uint16_t *out;
  uint8_t *flags;
  mplane_ep_layout_info li;
} rank_out;

/* Token rows: each expert row's payload and scales from the token row it names, so that the
 * expert-row checks apply as they are. Fails on an expert row naming no token row or one past
 * the token rows, and (normal mode) when the token-row count is not the layout's arrivals. */
static int gather_token_rows(const emu_case *c, const mplane_ep_recv *recv, const mplane_ep_layout_info *li, int n,
                             uint8_t *x, float *scale, char *err, size_t errlen) {
  const int H = c->H, nt = H / 128;
  const long elem = c->fmt == MP_EP_FMT_FP8 ? 1 : 2, stride = (long)recv->token_stride;
  if (!c->worst && recv->num_tokens != li->num_recv_tokens) {
    snprintf(err, errlen, "token rows %d, layout arrivals %d", recv->num_tokens, li->num_recv_tokens);
    return 1;
  }
  if (stride < H * elem || !recv->tokens || !recv->row_token) {
    snprintf(err, errlen, "token rows not reported (stride %lld)", recv->token_stride);
    return 1;
  }
  int32_t *rt = malloc(sizeof(int32_t) * (size_t)(n + 1));
  int ntok = 0, rc = 0;
  cudaMemcpy(rt, recv->row_token, sizeof(int32_t) * (size_t)n, cudaMemcpyDeviceToHost);
  for (int r = 0; r < n; r++) ntok = rt[r] + 1 > ntok ? rt[r] + 1 : ntok;
  uint8_t *tok = malloc((size_t)stride * (size_t)(ntok + 1));
  cudaMemcpy(tok, recv->tokens, (size_t)stride * (size_t)ntok, cudaMemcpyDeviceToHost);
  for (int r = 0; r < n && !rc; r++) {
    if (rt[r] < 0 || (recv->num_tokens >= 0 && rt[r] >= recv->num_tokens)) {
      snprintf(err, errlen, "expert row %d names token row %d (of %d)", r, rt[r], recv->num_tokens);
      rc = 1;
      break;
    }
    memcpy(x + (long)r * H * elem, tok + (long)rt[r] * stride, (size_t)(H * elem));
    if (c->fmt == MP_EP_FMT_FP8) memcpy(scale + (long)r * nt, tok + (long)rt[r] * stride + H, sizeof(float) * (size_t)nt);
  }
  free(rt);
  free(tok);
  return rc;
}

typedef struct shared_in {
  const emu_case *c;
  ncclComm_t comms[8];
  int T[8];
  int32_t *idx[8];
  float *w[8];
  uint16_t *x[8];
  rank_out res[8];
  int rank;
} shared_in;

typedef struct rank_arg {
  shared_in *s;
  int rank;
} rank_arg;

#define TRY(call)                                                                    \
  do {                                                                               \
    int e_ = (call);                                                                 \
    if (e_) {                                                                        \
      snprintf(o->err, sizeof(o->err), "%s: %s", #call, mplane_ep_last_error(ctx));  \
      o->rc = e_;                                                                    \
      goto out;                                                                      \
    }                                                                                \
  } while (0)

static void *rank_main(void *p) {
  rank_arg *a = p;
  shared_in *s = a->s;
  const emu_case *c = s->c;
  int me = a->rank, H = c->H, K = c->K, T = s->T[me];
  rank_out *o = &s->res[me];
  mplane_ep_ctx *ctx = NULL;
  mplane_ep_layout *lo = NULL;
  void *d_x = NULL, *d_y = NULL, *d_out = NULL, *d_xq = NULL, *d_xs = NULL;
  int32_t *d_idx = NULL;
  float *d_w = NULL;
  uint8_t *d_flags = NULL;
  cudaStream_t st = NULL;
  mplane_ep_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gpus_per_node = c->auto_topo ? 0 : c->G;
  cfg.num_experts = c->E;
  cfg.hidden = H;
  cfg.topk = K;
  cfg.max_tokens = c->T;
  cfg.worst_case = c->worst;
  cfg.flat = c->flat;
  cfg.nvlink_direct = c->direct;
  cfg.token_rows = c->tokens;
  if (mplane_ep_create(&ctx, s->comms[me], &cfg, st)) {
    snprintf(o->err, sizeof(o->err), "create: %s", mplane_ep_last_error(NULL));
    o->rc = 1;
    return NULL;
  }
  mplane_ep_info info;
  mplane_ep_get_info(ctx, &info);
  o->nodes = info.nodes;
  o->gpn = info.gpus_per_node;
  cudaMalloc(&d_x, 2 * (size_t)c->T * H + 16);
  cudaMalloc((void **)&d_idx, 4 * (size_t)c->T * K + 16);
  cudaMalloc((void **)&d_w, 4 * (size_t)c->T * K + 16);
  cudaMalloc(&d_y, 2 * (size_t)info.max_recv_rows * H + 16);
  cudaMalloc(&d_out, 2 * (size_t)c->T * H + 16);
  cudaMalloc((void **)&d_flags, (size_t)c->T * c->R + 16);
  cudaMemcpy(d_x, s->x[me], 2 * (size_t)T * H, cudaMemcpyHostToDevice);
  cudaMemcpy(d_idx, s->idx[me], 4 * (size_t)T * K, cudaMemcpyHostToDevice);
  cudaMemcpy(d_w, s->w[me], 4 * (size_t)T * K, cudaMemcpyHostToDevice);
  if (c->fp8_in) { /* quantised by the CPU twin of pack's rule: the rows must come out the same */
    uint8_t *q = malloc((size_t)T * H + 1);
    float *qs = malloc(sizeof(float) * ((size_t)T * (H / 128) + 1));
    mp_ep_quantize_rows(s->x[me], T, H, q, qs);
    cudaMalloc(&d_xq, (size_t)c->T * H + 16);
    cudaMalloc(&d_xs, sizeof(float) * (size_t)c->T * (H / 128) + 16);
    cudaMemcpy(d_xq, q, (size_t)T * H, cudaMemcpyHostToDevice);
    cudaMemcpy(d_xs, qs, sizeof(float) * (size_t)T * (H / 128), cudaMemcpyHostToDevice);
    free(q);
    free(qs);
  }
  TRY(mplane_ep_layout_create(ctx, &lo));
  mplane_ep_recv recv;
  memset(&recv, 0, sizeof(recv));
  /* twice: a handle and its buffers are reused by the next step */
  for (int rep = 0; rep < 2; rep++) {
    TRY(mplane_ep_get_layout(ctx, d_idx, T, lo, st));
    if (c->fp8_in) TRY(mplane_ep_dispatch_fp8(ctx, lo, d_xq, (const float *)d_xs, d_w, &recv, st));
    else TRY(mplane_ep_dispatch(ctx, lo, d_x, d_w, c->fmt, &recv, st));
    /* a combine of whatever y holds first: a second combine of one dispatch must still be exact */
    if (rep == 0) TRY(mplane_ep_combine(ctx, lo, d_y, d_out, st));
    TRY(mplane_ep_dequant(ctx, lo, &recv, d_y, st));
    TRY(mplane_ep_combine(ctx, lo, d_y, d_out, st));
  }
  TRY(mplane_ep_token_in_rank(ctx, lo, d_flags, st));
  mplane_ep_layout_get_info(lo, &o->li);
  cudaMemcpy(o->status, o->li.d_status, sizeof(o->status), cudaMemcpyDeviceToHost);
  o->nrows = o->status[0];
  if (!c->worst && recv.num_rows != o->nrows) {
    snprintf(o->err, sizeof(o->err), "num_rows %d, status %d", recv.num_rows, o->nrows);
    o->rc = 1;
    goto out;
  }
  {
    int Er = c->E / c->R, n = o->nrows, nt = H / 128;
    long elem = c->fmt == MP_EP_FMT_FP8 ? 1 : 2;
    o->off = malloc(sizeof(int) * (size_t)(Er + 1));
    o->x = malloc((size_t)(n + 1) * H * elem);
    o->scale = malloc(sizeof(float) * (size_t)(n + 1) * nt);
    o->w = malloc(sizeof(float) * (size_t)(n + 1));
    o->src = malloc(sizeof(int) * 2 * (size_t)(n + 1));
    o->out = malloc(2 * (size_t)(T + 1) * H);
    o->flags = malloc((size_t)(T + 1) * c->R);
    cudaMemcpy(o->off, recv.expert_offsets, sizeof(int) * (size_t)(Er + 1), cudaMemcpyDeviceToHost);
    if (c->tokens) {
      if (gather_token_rows(c, &recv, &o->li, n, o->x, o->scale, o->err, sizeof(o->err))) {
        o->rc = 1;
        goto out;
      }
    } else {
      cudaMemcpy(o->x, recv.x, (size_t)n * H * elem, cudaMemcpyDeviceToHost);
      if (c->fmt == MP_EP_FMT_FP8) cudaMemcpy(o->scale, recv.scales, sizeof(float) * (size_t)n * nt, cudaMemcpyDeviceToHost);
    }
    cudaMemcpy(o->w, recv.weights, sizeof(float) * (size_t)n, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->src, recv.src, sizeof(int) * 2 * (size_t)n, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->out, d_out, 2 * (size_t)T * H, cudaMemcpyDeviceToHost);
    cudaMemcpy(o->flags, d_flags, (size_t)T * c->R, cudaMemcpyDeviceToHost);
  }
out:
  mplane_ep_layout_destroy(lo);
  mplane_ep_destroy(ctx);
  cudaFree(d_x);
  cudaFree(d_xq);
  cudaFree(d_xs);
  cudaFree(d_idx);
  cudaFree(d_w);
  cudaFree(d_y);
  cudaFree(d_out);
  cudaFree(d_flags);
  return NULL;
}

static void run_case(const emu_case *c) {
  shared_in s;
  memset(&s, 0, sizeof(s));
  s.c = c;
  int R = c->R;
  emu_nccl_world_create(R, s.comms);
  for (int r = 0; r < R; r++) {
    s.T[r] = c->T - (r * 5) % (c->T / 2 + 1);
    s.idx[r] = malloc(4 * (size_t)c->T * c->K);
    s.w[r] = malloc(4 * (size_t)c->T * c->K);
    s.x[r] = malloc(2 * (size_t)c->T * c->H);
    mp_ep_gen_routing(c->kind, 9, r, R, c->G, c->E, c->K, s.T[r], s.idx[r], s.w[r]);
    mp_ep_gen_tokens(9, r, s.T[r], c->H, s.x[r]);
  }
  pthread_t th[8];
  rank_arg args[8];
  for (int r = 0; r < R; r++) {
    args[r].s = &s;
    args[r].rank = r;
    pthread_create(&th[r], NULL, rank_main, &args[r]);
  }
  for (int r = 0; r < R; r++) pthread_join(th[r], NULL);
  for (int r = 0; r < R; r++)
    if (s.res[r].rc) fail_msg("%s: rank %d: %s", c->name, r, s.res[r].err);
  int G = c->auto_topo ? R : c->G;
  for (int r = 0; r < R; r++) {
    assert_int_equal(s.res[r].nodes, c->flat ? R : R / G);
    assert_int_equal(s.res[r].status[1], 0);
  }
  mp_ep_model_cfg mc = {R, G, NULL, NULL, c->E, c->K, c->H, c->fmt, c->flat};
  mp_ep_model *m = mp_ep_model_run(&mc, s.T, (const int32_t *const *)s.idx, (const float *const *)s.w,
                                   (const uint16_t *const *)s.x);
  assert_non_null(m);
  uint16_t *y[8], *want[8];
  for (int d = 0; d < R; d++) {
    y[d] = malloc(2 * ((size_t)mp_ep_model_rank_out(m, d)->nrows + 1) * c->H);
    want[d] = malloc(2 * ((size_t)s.T[d] + 1) * c->H);
    mp_ep_model_identity(m, d, y[d]);
  }
  mp_ep_model_combine(m, (const uint16_t *const *)y, want);
  mp_ep_model_bytes b;
  long txd[8], txc[8];
  mp_ep_model_count(&mc, s.T, (const int32_t *const *)s.idx, &b, txd, txc);
  for (int r = 0; r < R; r++) {
    rank_out *o = &s.res[r];
    char msg[512] = "";
    long bad = mp_ep_check_dispatch(m, r, c->fmt, c->H, o->nrows, o->off, c->E / R, o->x, o->scale, o->w, o->src, msg,
                                    sizeof(msg));
    if (bad) fail_msg("%s: rank %d dispatch: %ld fields differ: %s", c->name, r, bad, msg);
    bad = mp_ep_check_exact(o->out, want[r], (long)s.T[r] * c->H, msg, sizeof(msg));
    if (bad) fail_msg("%s: rank %d combine: %ld values differ: %s", c->name, r, bad, msg);
    double ratio;
    bad = mp_ep_check_tolerance(c->fmt, s.T[r], c->H, c->K, c->E, s.x[r], s.idx[r], s.w[r], o->out, &ratio, msg,
                                sizeof(msg));
    if (bad) fail_msg("%s: rank %d tolerance: %s", c->name, r, msg);
    /* token-in-rank flags from the routing */
    for (int t = 0; t < s.T[r]; t++)
      for (int d = 0; d < R; d++) {
        int want_f = 0;
        for (int k = 0; k < c->K; k++) {
          int e = s.idx[r][t * c->K + k];
          if (e >= 0 && e < c->E && e / (c->E / R) == d) want_f = 1;
        }
        if (o->flags[t * R + d] != want_f) fail_msg("%s: rank %d token %d rank %d: flag %d", c->name, r, t, d, o->flags[t * R + d]);
      }
    /* normal mode: the library's byte counts are the model's, and the emulated NCCL moved them */
    if (!c->worst) {
      long long net = o->li.dispatch_net_bytes + o->li.combine_net_bytes;
      if (net != (long long)(txd[r] + txc[r]))
        fail_msg("%s: rank %d network bytes %lld, model %ld", c->name, r, net, txd[r] + txc[r]);
    }
  }
  if (!c->worst) {
    /* bytes actually handed to (emulated) NCCL: two rounds of layout + dispatch + combine, and the
     * first round's extra combine */
    long long sent = 0, want_b = 0;
    for (int r = 0; r < R; r++) {
      for (int p = 0; p < R; p++)
        if (p != r) sent += emu_nccl_sent(s.comms[r], p);
      const mplane_ep_layout_info *li = &s.res[r].li;
      want_b += 2 * (li->dispatch_net_bytes + li->dispatch_nvl_bytes + li->counts_net_bytes + li->counts_nvl_bytes) +
                3 * (li->combine_net_bytes + li->combine_nvl_bytes);
      /* nvlink_direct: dispatch's NVLink rows went through the peers' mapped memory, not NCCL;
       * on one node combine's too (the fused combine) */
      if (c->direct) want_b -= 2 * li->dispatch_nvl_bytes;
      if (c->direct && s.res[r].nodes == 1) want_b -= 3 * li->combine_nvl_bytes;
    }
    if (c->auto_topo) want_b += 0; /* the host-identity all-gather is not a send */
    assert_true(sent == want_b);
  }
  for (int d = 0; d < R; d++) {
    free(y[d]);
    free(want[d]);
    rank_out *o = &s.res[d];
    free(o->off);
    free(o->x);
    free(o->scale);
    free(o->w);
    free(o->src);
    free(o->out);
    free(o->flags);
    free(s.idx[d]);
    free(s.w[d]);
    free(s.x[d]);
  }
  mp_ep_model_free(m);
  emu_nccl_world_free(s.comms, R);
  assert_int_equal(emu_cuda_live_allocations(), 0);
  printf("emu %-22s R=%d G=%d E=%d K=%d H=%d: dispatch and combine match the model\n", c->name, R, G, c->E, c->K, c->H);
}

static const emu_case cases[] = {
    {"one-gpu", 1, 1, 8, 4, 256, 12, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 0, 0},
    {"node-of-2-uniform", 2, 2, 16, 4, 256, 20, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 0, 0},
    {"node-of-2-mixed-bf16", 2, 2, 16, 5, 128, 17, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 0, 1},
    {"2-nodes-gated", 2, 1, 16, 4, 256, 20, MP_EP_ROUTE_GATED, MP_EP_FMT_FP8, 0, 0, 0},
    {"2-nodes-one-node-bf16", 2, 1, 16, 4, 128, 16, MP_EP_ROUTE_ONE_NODE, MP_EP_FMT_BF16, 0, 0, 0},
    {"2-nodes-worst-case", 2, 1, 16, 4, 256, 15, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 1, 0, 0},
    {"2-nodes-flat", 2, 1, 16, 4, 128, 15, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 1, 0},
    {"2x2-all-nodes", 4, 2, 16, 4, 128, 14, MP_EP_ROUTE_ALL_NODES, MP_EP_FMT_FP8, 0, 0, 0},
    {"2x2-mixed-bf16", 4, 2, 32, 6, 128, 13, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 0, 0},
    {"2x2-worst-case-bf16", 4, 2, 16, 4, 128, 11, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 1, 0, 0},
    {"2x2-flat-worst-case", 4, 2, 16, 3, 128, 9, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_BF16, 1, 1, 0},
    /* long enough that every warp loops over several items, wide enough for the unrolled copies */
    {"2-nodes-long-fp8", 2, 1, 16, 6, 1024, 120, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 0, 0},
    {"node-of-2-long-bf16", 2, 2, 16, 6, 1024, 100, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 0, 0},
    /* nvlink_direct: the fused pack/unpack kernel on one node (ready flags), the barrier path on two */
    {"node-of-2-direct-long", 2, 2, 16, 6, 1024, 100, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0, 0, 1},
    {"node-of-4-direct-bf16", 4, 4, 32, 6, 256, 30, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_BF16, 0, 0, 0, 1},
    {"node-of-2-direct-worst", 2, 2, 16, 4, 256, 20, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 1, 0, 0, 1},
    {"2x2-direct", 4, 2, 16, 4, 256, 14, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0, 0, 1},
    /* token rows: the fused kernel, the NCCL path with forwarding, the direct barrier path in a graph */
    {"node-of-2-direct-tokens", 2, 2, 16, 6, 512, 60, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0, 0, 1, 1},
    {"2x2-tokens-bf16", 4, 2, 16, 4, 128, 13, MP_EP_ROUTE_MIXED, MP_EP_FMT_BF16, 0, 0, 0, 0, 1},
    {"2-nodes-tokens", 2, 1, 16, 4, 256, 17, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 0, 0, 0, 0, 1},
    {"2x2-direct-tokens-worst", 4, 2, 16, 4, 256, 12, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 1, 0, 0, 1, 1},
    /* tokens already in FP8 (mplane_ep_dispatch_fp8): fused kernel, NCCL path with forwarding, graph */
    {"node-of-2-direct-tokens-fp8in", 2, 2, 16, 6, 512, 40, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0, 0, 1, 1, 1},
    {"2x2-fp8in", 4, 2, 16, 4, 256, 13, MP_EP_ROUTE_MIXED, MP_EP_FMT_FP8, 0, 0, 0, 0, 0, 1},
    {"2-nodes-fp8in-worst", 2, 1, 16, 4, 256, 15, MP_EP_ROUTE_UNIFORM, MP_EP_FMT_FP8, 1, 0, 0, 0, 0, 1},
};

static void test_emulated_gpu(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) run_case(&cases[i]);
}

/* The gating kernel against the CPU reference (here both use the same expf: bit for bit). */
static void test_emulated_route(void **state) {
  (void)state;
  ncclComm_t comm[1];
  emu_nccl_world_create(1, comm);
  mplane_ep_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gpus_per_node = 1;
  cfg.num_experts = 64;
  cfg.hidden = 128;
  cfg.topk = 6;
  cfg.max_tokens = 40;
  mplane_ep_ctx *ctx = NULL;
  assert_int_equal(mplane_ep_create(&ctx, comm[0], &cfg, NULL), 0);
  int T = 37, E = 64, K = 6;
  float lg[37 * 64], bias[64], w[37 * 6], rw[37 * 6];
  int32_t idx[37 * 6], ridx[37 * 6];
  uint64_t rs = 5;
  for (int i = 0; i < T * E; i++) lg[i] = (float)(mp_ep_rand_unit(&rs) * 6 - 3);
  for (int e = 0; e < E; e++) bias[e] = (float)(mp_ep_rand_unit(&rs) * 0.2 - 0.1);
  lg[3 * E + 5] = lg[3 * E + 9]; /* a tie: the lower index wins */
  float *d_lg, *d_bias, *d_w;
  int32_t *d_idx;
  cudaMalloc((void **)&d_lg, sizeof(lg));
  cudaMalloc((void **)&d_bias, sizeof(bias));
  cudaMalloc((void **)&d_w, sizeof(w));
  cudaMalloc((void **)&d_idx, sizeof(idx));
  cudaMemcpy(d_lg, lg, sizeof(lg), cudaMemcpyHostToDevice);
  cudaMemcpy(d_bias, bias, sizeof(bias), cudaMemcpyHostToDevice);
  const int groups[3][2] = {{8, 3}, {4, 1}, {1, 1}};
  for (int g = 0; g < 3; g++) {
    assert_int_equal(mplane_ep_route(ctx, d_lg, g == 1 ? NULL : d_bias, T, groups[g][0], groups[g][1], 2.5f, 1, d_idx, d_w, NULL), 0);
    cudaMemcpy(idx, d_idx, sizeof(idx), cudaMemcpyDeviceToHost);
    cudaMemcpy(w, d_w, sizeof(w), cudaMemcpyDeviceToHost);
    mp_ep_route_ref(lg, g == 1 ? NULL : bias, T, E, K, groups[g][0], groups[g][1], 2.5f, 1, ridx, rw);
    assert_memory_equal(idx, ridx, sizeof(idx));
    assert_memory_equal(w, rw, sizeof(w));
    /* group-limited: every token's experts come from at most topk_groups groups */
    for (int t = 0; t < T; t++) {
      unsigned gm = 0;
      for (int k = 0; k < K; k++) gm |= 1u << (idx[t * K + k] / (E / groups[g][0]));
      assert_true(__builtin_popcount(gm) <= groups[g][1]);
    }
  }
  /* a bad group count is refused with a message */
  assert_int_equal(mplane_ep_route(ctx, d_lg, d_bias, T, 7, 2, 1.f, 1, d_idx, d_w, NULL), MPLANE_EP_ERR_INVALID);
  assert_non_null(strstr(mplane_ep_last_error(ctx), "num_groups=7"));
  cudaFree(d_lg);
  cudaFree(d_bias);
  cudaFree(d_w);
  cudaFree(d_idx);
  mplane_ep_destroy(ctx);
  emu_nccl_world_free(comm, 1);
  assert_int_equal(emu_cuda_live_allocations(), 0);
}

/* Capacity: a too-small max_recv_rows is an error in normal mode, with the numbers in it. */
static void test_emulated_capacity(void **state) {
  (void)state;
  ncclComm_t comm[1];
  emu_nccl_world_create(1, comm);
  mplane_ep_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gpus_per_node = 1;
  cfg.num_experts = 8;
  cfg.hidden = 128;
  cfg.topk = 4;
  cfg.max_tokens = 10;
  cfg.max_recv_rows = 5;
  mplane_ep_ctx *ctx = NULL;
  assert_int_equal(mplane_ep_create(&ctx, comm[0], &cfg, NULL), 0);
  mplane_ep_layout *lo = NULL;
  assert_int_equal(mplane_ep_layout_create(ctx, &lo), 0);
  int32_t idx[40];
  float w[40];
  mp_ep_gen_routing(MP_EP_ROUTE_UNIFORM, 1, 0, 1, 1, 8, 4, 10, idx, w);
  int32_t *d_idx;
  cudaMalloc((void **)&d_idx, sizeof(idx));
  cudaMemcpy(d_idx, idx, sizeof(idx), cudaMemcpyHostToDevice);
  assert_int_equal(mplane_ep_get_layout(ctx, d_idx, 10, lo, NULL), MPLANE_EP_ERR_CAPACITY);
  assert_non_null(strstr(mplane_ep_last_error(ctx), "max_recv_rows is 5"));
  assert_int_equal(mplane_ep_get_layout(ctx, d_idx, 11, lo, NULL), MPLANE_EP_ERR_INVALID);
  assert_int_equal(mplane_ep_dispatch(ctx, lo, d_idx, NULL, 0, NULL, NULL), MPLANE_EP_ERR_INVALID);
  assert_int_equal(mplane_ep_dispatch_fp8(ctx, lo, d_idx, NULL, NULL, NULL, NULL), MPLANE_EP_ERR_INVALID);
  assert_non_null(strstr(mplane_ep_last_error(ctx), "mplane_ep_dispatch_fp8: needs a layout"));
  cudaFree(d_idx);
  mplane_ep_layout_destroy(lo);
  mplane_ep_destroy(ctx);
  /* configuration errors name the value */
  cfg.hidden = 100;
  assert_int_not_equal(mplane_ep_create(&ctx, comm[0], &cfg, NULL), 0);
  assert_non_null(strstr(mplane_ep_last_error(NULL), "hidden 100"));
  cfg.hidden = 128;
  cfg.flat = 1;
  cfg.token_rows = 1;
  assert_int_equal(mplane_ep_create(&ctx, comm[0], &cfg, NULL), MPLANE_EP_ERR_INVALID);
  assert_non_null(strstr(mplane_ep_last_error(NULL), "token_rows=1 needs the node-limited mode"));
  emu_nccl_world_free(comm, 1);
  assert_int_equal(emu_cuda_live_allocations(), 0);
}

/* The fused dispatch's block split comes from MPLANE_EP_LINK_SMS / MPLANE_EP_RECV_SMS, the fused
 * combine's from MPLANE_EP_SEND_SMS, read through the config table: a value that does not parse
 * (the table's message, with its accepted form), or leaves no block of another kind, fails create on
 * every rank (all read the same environment, so none waits in a collective for the others) and
 * names the variable; -1 is the automatic count. */
typedef struct split_arg {
  ncclComm_t comm;
  pthread_barrier_t *created; /* no rank frees its buffers while a peer still maps them */
  int rc;
  char err[512];
} split_arg;

static void *split_rank(void *p) {
  split_arg *a = p;
  mplane_ep_config cfg;
  memset(&cfg, 0, sizeof(cfg));
  cfg.gpus_per_node = 2;
  cfg.num_experts = 8;
  cfg.hidden = 128;
  cfg.topk = 2;
  cfg.max_tokens = 8;
  cfg.nvlink_direct = 1;
  cfg.token_rows = 1;
  cfg.num_sms = 4;
  mplane_ep_ctx *ctx = NULL;
  a->rc = mplane_ep_create(&ctx, a->comm, &cfg, NULL);
  snprintf(a->err, sizeof(a->err), "%s", a->rc ? mplane_ep_last_error(NULL) : "");
  pthread_barrier_wait(a->created);
  if (!a->rc) mplane_ep_destroy(ctx);
  return NULL;
}

static int create_pair(const char *var, const char *val, split_arg *args) {
  ncclComm_t comm[2];
  pthread_t th[2];
  pthread_barrier_t created;
  pthread_barrier_init(&created, NULL, 2);
  emu_nccl_world_create(2, comm);
  setenv(var, val, 1);
  for (int r = 0; r < 2; r++) {
    args[r].comm = comm[r];
    args[r].created = &created;
    pthread_create(&th[r], NULL, split_rank, &args[r]);
  }
  for (int r = 0; r < 2; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&created);
  unsetenv(var);
  emu_nccl_world_free(comm, 2);
  return args[0].rc;
}

static void test_emulated_fused_split_env(void **state) {
  (void)state;
  split_arg a[2];
  /* the kernel's blocks: num_sms (4) or the device's SMs if fewer, at least 3 */
  int sms = 0;
  assert_int_equal(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  const int blocks = sms < 4 ? (sms < 3 ? 3 : sms) : 4;
  char over[96], link[16], recv_over[96], recv[16];
  snprintf(link, sizeof(link), "%d", blocks - 1);
  snprintf(over, sizeof(over), "MPLANE_EP_LINK_SMS=%d: expected an integer 0..%d", blocks - 1, blocks - 2);
  snprintf(recv, sizeof(recv), "%d", blocks);
  snprintf(recv_over, sizeof(recv_over), "MPLANE_EP_RECV_SMS=%d: expected an integer 1..", blocks);
  const struct {
    const char *var, *val, *want;
  } bad[] = {
      {"MPLANE_EP_LINK_SMS", "many",
       "MPLANE_EP_LINK_SMS='many' is not valid: expected -1 (automatic) or an integer from 0 to 1024"},
      {"MPLANE_EP_LINK_SMS", "+1", "MPLANE_EP_LINK_SMS='+1' is not valid: expected"},
      {"MPLANE_EP_LINK_SMS", "-2", "MPLANE_EP_LINK_SMS='-2' is not valid: expected"},
      {"MPLANE_EP_LINK_SMS", link, over},
      {"MPLANE_EP_RECV_SMS", "0", "MPLANE_EP_RECV_SMS='0' is not valid: 0 blocks would do none of the work"},
      {"MPLANE_EP_RECV_SMS", recv, recv_over},
      {"MPLANE_EP_SEND_SMS", "0", "MPLANE_EP_SEND_SMS='0' is not valid: 0 blocks would do none of the work"},
      {"MPLANE_EP_SEND_SMS", "1025", "MPLANE_EP_SEND_SMS='1025' is not valid: expected -1 (automatic) or an integer "
                                     "from 1 to 1024"},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    create_pair(bad[i].var, bad[i].val, a);
    for (int r = 0; r < 2; r++) {
      assert_int_equal(a[r].rc, MPLANE_EP_ERR_INVALID);
      if (!strstr(a[r].err, bad[i].want)) fail_msg("rank %d: %s, expected it to contain %s", r, a[r].err, bad[i].want);
    }
  }
  /* a good value creates */
  create_pair("MPLANE_EP_LINK_SMS", "1", a);
  if (a[0].rc || a[1].rc) fail_msg("MPLANE_EP_LINK_SMS=1: %s / %s", a[0].err, a[1].err);
  /* -1: the automatic count, as unset */
  create_pair("MPLANE_EP_RECV_SMS", "-1", a);
  if (a[0].rc || a[1].rc) fail_msg("MPLANE_EP_RECV_SMS=-1: %s / %s", a[0].err, a[1].err);
  assert_int_equal(emu_cuda_live_allocations(), 0);
}

/* The emulator keeps host code out of device memory as a GPU does: a host read of a cudaMalloc
 * pointer dies of SIGSEGV (in a child), copies must name the right kind, NCCL takes device
 * buffers only. This is what makes a host-side dereference of a device pointer in ep_host.c (the
 * bug where the host planner read the device copy of rank_of, a SIGSEGV on the H200s) fail here:
 * every multi-rank case of test_emulated_gpu and tests ep_bench_emu_* would crash on it. */
static void test_emulated_device_memory_is_not_host_memory(void **state) {
  (void)state;
  int *d = NULL;
  assert_int_equal(cudaMalloc((void **)&d, 64), cudaSuccess);
  assert_true(emu_cuda_is_device_pointer(d));
  int h[16] = {0}, back[16] = {0};
  for (int i = 0; i < 16; i++) h[i] = i * 3;
  assert_int_equal(cudaMemcpy(d, h, sizeof(h), cudaMemcpyHostToDevice), cudaSuccess);
  assert_int_equal(cudaMemcpy(back, d, sizeof(back), cudaMemcpyDeviceToHost), cudaSuccess);
  assert_memory_equal(h, back, sizeof(h));
  if (emu_cuda_devmem_mode() == 0) {
    cudaFree(d);
    fail_msg("EMU_DEVMEM_OPEN=1: device memory is host-readable, this test cannot run (unset it)");
  }
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    signal(SIGSEGV, SIG_DFL); /* neither cmocka's handler nor the emulator's message here */
    volatile int v = d[5]; /* what run_step's planner did with the view's rank_of */
    (void)v;
    _exit(0);
  }
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  assert_true(WIFSIGNALED(st));
  assert_int_equal(WTERMSIG(st), SIGSEGV);
  /* wrong kinds, ranges past the allocation, host buffers to NCCL */
  assert_int_not_equal(cudaMemcpy(d, h, sizeof(h), cudaMemcpyDeviceToHost), cudaSuccess);
  assert_int_not_equal(cudaMemcpy(back, d, sizeof(back), cudaMemcpyHostToDevice), cudaSuccess);
  assert_int_not_equal(cudaMemcpy(back, h, sizeof(h), cudaMemcpyHostToDevice), cudaSuccess);
  assert_int_not_equal(cudaMemcpy(back, d + 8, 4096, cudaMemcpyDeviceToHost), cudaSuccess);
  assert_int_not_equal(cudaMemset(h, 0, sizeof(h)), cudaSuccess);
  assert_int_equal(cudaMemcpy(back, d, sizeof(back), cudaMemcpyDefault), cudaSuccess);
  ncclComm_t comm[2];
  emu_nccl_world_create(2, comm);
  assert_int_not_equal(ncclSend(h, 4, ncclInt32, 1, comm[0], NULL), ncclSuccess);
  assert_non_null(strstr(ncclGetLastError(comm[0]), "not (all) device memory"));
  emu_nccl_world_free(comm, 2);
  cudaFree(d);
  assert_int_equal(emu_cuda_live_allocations(), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_emulated_device_memory_is_not_host_memory),
      cmocka_unit_test(test_emulated_route),
      cmocka_unit_test(test_emulated_capacity),
      cmocka_unit_test(test_emulated_fused_split_env),
      cmocka_unit_test(test_emulated_gpu),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
