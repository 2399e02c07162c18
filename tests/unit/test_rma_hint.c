/* cmocka tests of NCCL's aggregation hint (plugin/rma_hint.c) and of how the RMA tables use it
 * (plugin/rma_plugin.c): over a transport double whose ops only record what they are asked, every
 * hold begun is ended, at the right place (after the op that closes a run, before an iflush, before
 * progress and destroy_context), a hint never reaches a transport without holds, and v14's ops never
 * hold. This file is linked with mplane_net_transport wrapped, so the tables run on the double. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "common/nccl/rma.h"
#include "net/transport.h"
#include "plugin/rma_hint.h"

/* ---- the double: each call appends one line to the log ---- */
static char calls[64][48];
static int ncalls;

static void record(const char *fmt, ...) {
  assert_true(ncalls < 64);
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(calls[ncalls++], sizeof(calls[0]), fmt, ap);
  va_end(ap);
}

/* The log from entry `from` on is exactly the lines given, in order. */
static void expect_calls(int from, const char *const *want, int n) {
  for (int i = 0; i < n && from + i < ncalls; i++) assert_string_equal(calls[from + i], want[i]);
  assert_int_equal(ncalls - from, n);
}

static int fake_req, fake_group, fake_ctx;
static ncclResult_t put_result = ncclSuccess;

static void d_hold(void *ctx, int context, uint32_t rank, int on) {
  assert_ptr_equal(ctx, &fake_ctx);
  record("hold %d %u %s", context, rank, on ? "on" : "off");
}
static ncclResult_t d_iput(void *ctx, int context, uint64_t so, void *smh, size_t size, uint64_t doff, void *dmh,
                           uint32_t rank, const struct mplane_rma_signal *sig, void **req) {
  assert_ptr_equal(ctx, &fake_ctx);
  record("%s %d %u %zu", sig ? "putSignal" : "put", context, rank, size);
  *req = put_result == ncclSuccess ? &fake_req : NULL;
  return put_result;
}
static ncclResult_t d_iget(void *ctx, int context, uint64_t ro, void *rmh, size_t size, uint64_t lo, void *lmh,
                           uint32_t rank, void **req) {
  record("get %d %u %zu", context, rank, size);
  *req = &fake_req;
  return ncclSuccess;
}
static ncclResult_t d_iflush(void *ctx, int context, void *mh, uint32_t rank, void **req) {
  record("flush %d %u", context, rank);
  *req = NULL;
  return ncclSuccess;
}
static ncclResult_t d_progress(void *ctx) {
  record("progress");
  return ncclSuccess;
}
static ncclResult_t d_connect(void *h[], int n, int rank, void *lc, void **group) {
  *group = &fake_group;
  return ncclSuccess;
}
static ncclResult_t d_close_group(void *group) { return ncclSuccess; }
static ncclResult_t d_create_context(void *group, const struct mplane_rma_ctx_opts *o, void **ctx) {
  *ctx = &fake_ctx;
  return ncclSuccess;
}
static ncclResult_t d_destroy_context(void *ctx) {
  record("destroy");
  return ncclSuccess;
}

static struct mplane_rma_ops d_rma = {
    .connect = d_connect, .close_group = d_close_group, .create_context = d_create_context,
    .destroy_context = d_destroy_context, .iput = d_iput, .iget = d_iget, .iflush = d_iflush,
    .progress = d_progress, .hold = d_hold};
static struct mplane_transport_ops d_transport = {.name = "double", .rma = &d_rma};

const struct mplane_transport_ops *__wrap_mplane_net_transport(void);
const struct mplane_transport_ops *__wrap_mplane_net_transport(void) { return &d_transport; }

extern const ncclRma_v14_t ncclRmaPlugin_v14;
extern const ncclRma_v15_t ncclRmaPlugin_v15;
extern const ncclRma_v16_t ncclRmaPlugin_v16;

static int reset(void **state) {
  ncalls = 0;
  put_result = ncclSuccess;
  d_rma.hold = d_hold;
  return 0;
}

/* ---- the hint alone ---- */

/* A run of hinted ops holds once, from before its first op to after the op that closes it. */
static void test_run_closed_by_unhinted_op(void **state) {
  struct mplane_rma_hint h;
  assert_int_equal(mplane_rma_hint_init(&h, &d_rma, 2, 4), ncclSuccess);
  void *req;
  for (int i = 0; i < 4; i++) {
    int agg = i < 3;
    mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 1, 3, agg);
    d_iput(&fake_ctx, 1, 0, NULL, (size_t)i, 0, NULL, 3, NULL, &req);
    mplane_rma_hint_after(&h, &d_rma, &fake_ctx, 1, 3, agg, ncclSuccess);
  }
  const char *want[] = {"hold 1 3 on", "put 1 3 0", "put 1 3 1", "put 1 3 2", "put 1 3 3", "hold 1 3 off"};
  expect_calls(0, want, 6);
  assert_int_equal(h.nheld, 0);
  mplane_rma_hint_free(&h);
}

/* Without the hint nothing is held; a run's end comes once (a second end finds nothing). */
static void test_end_once(void **state) {
  struct mplane_rma_hint h;
  assert_int_equal(mplane_rma_hint_init(&h, &d_rma, 1, 2), ncclSuccess);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 0, 1, 0);
  mplane_rma_hint_after(&h, &d_rma, &fake_ctx, 0, 1, 0, ncclSuccess);
  assert_int_equal(ncalls, 0);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 0, 1, 1);
  mplane_rma_hint_after(&h, &d_rma, &fake_ctx, 0, 1, 1, ncclSuccess);
  mplane_rma_hint_end(&h, &d_rma, &fake_ctx, 0, 1);
  mplane_rma_hint_end(&h, &d_rma, &fake_ctx, 0, 1);
  mplane_rma_hint_end_all(&h, &d_rma, &fake_ctx);
  const char *want[] = {"hold 0 1 on", "hold 0 1 off"};
  expect_calls(0, want, 2);
  mplane_rma_hint_free(&h);
}

/* Holds of several (context, rank) at once all end at end_all; a failed hinted op ends its own. */
static void test_end_all_and_failure(void **state) {
  struct mplane_rma_hint h;
  assert_int_equal(mplane_rma_hint_init(&h, &d_rma, 3, 3), ncclSuccess);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 2, 0, 1);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 0, 2, 1);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 1, 1, 1);
  mplane_rma_hint_after(&h, &d_rma, &fake_ctx, 1, 1, 1, ncclRemoteError);
  assert_int_equal(h.nheld, 2);
  mplane_rma_hint_end_all(&h, &d_rma, &fake_ctx);
  assert_int_equal(h.nheld, 0);
  const char *want[] = {"hold 2 0 on", "hold 0 2 on", "hold 1 1 on", "hold 1 1 off", "hold 0 2 off", "hold 2 0 off"};
  expect_calls(0, want, 6);
  mplane_rma_hint_free(&h);
}

/* An op naming no connection (context or rank past the set) holds nothing: the transport refuses it. */
static void test_out_of_range(void **state) {
  struct mplane_rma_hint h;
  assert_int_equal(mplane_rma_hint_init(&h, &d_rma, 2, 2), ncclSuccess);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 2, 0, 1);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, -1, 0, 1);
  mplane_rma_hint_before(&h, &d_rma, &fake_ctx, 0, 2, 1);
  assert_int_equal(ncalls, 0);
  assert_int_equal(h.nheld, 0);
  mplane_rma_hint_free(&h);
}

/* A transport without holds: no state, and every call is a no-op. */
static void test_no_holds(void **state) {
  struct mplane_rma_ops bare = {0};
  struct mplane_rma_hint h;
  assert_int_equal(mplane_rma_hint_init(&h, &bare, 2, 2), ncclSuccess);
  assert_null(h.held);
  mplane_rma_hint_before(&h, &bare, &fake_ctx, 0, 1, 1);
  mplane_rma_hint_after(&h, &bare, &fake_ctx, 0, 1, 1, ncclSuccess);
  mplane_rma_hint_end_all(&h, &bare, &fake_ctx);
  assert_int_equal(h.nheld, 0);
  mplane_rma_hint_free(&h);
}

/* ---- the tables over the double ---- */
struct opened {
  void *cc, *rc;
};

static struct opened open_v15(void) {
  char handles[2][NCCL_NET_HANDLE_MAXSIZE] = {{0}};
  void *h[2] = {handles[0], handles[1]};
  struct opened o = {0};
  assert_int_equal(ncclRmaPlugin_v15.connect(NULL, h, 2, 0, NULL, &o.cc), ncclSuccess);
  ncclRmaConfig_v15_t cfg = {.nContexts = 2, .trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF, .rankStride = 1};
  assert_int_equal(ncclRmaPlugin_v15.createContext(o.cc, &cfg, &o.rc), ncclSuccess);
  return o;
}

static void close_v15(struct opened *o) {
  assert_int_equal(ncclRmaPlugin_v15.destroyContext(o->rc), ncclSuccess);
  assert_int_equal(ncclRmaPlugin_v15.closeColl(o->cc), ncclSuccess);
}

/* What NCCL's GIN proxy posts in one pass to rank 1 on context 1: hinted puts, a hinted signal, the
 * closing put without the hint; then on context 0 a hinted get that an iflush closes; then a hinted
 * put that only rmaProgress ends. */
static void test_v15_pass(void **state) {
  struct opened o = open_v15();
  const ncclRma_v15_t *t = &ncclRmaPlugin_v15;
  uint32_t agg = ncclRmaOptFlagsAggregateRequests;
  int mh = 0;
  void *req;
  assert_int_equal(t->iput(o.rc, 1, 0, &mh, 8, 0, &mh, 1, agg, &req), ncclSuccess);
  assert_int_equal(t->iput(o.rc, 1, 0, &mh, 16, 0, &mh, 1, agg, &req), ncclSuccess);
  assert_int_equal(t->iputSignal(o.rc, 1, 0, NULL, 0, 0, NULL, 1, 0, &mh, 1, NCCL_NET_SIGNAL_OP_INC, false, agg, &req),
                   ncclSuccess);
  assert_int_equal(t->iput(o.rc, 1, 0, &mh, 32, 0, &mh, 1, ncclRmaOptFlagsDefault, &req), ncclSuccess);
  assert_int_equal(t->iget(o.rc, 0, 0, &mh, 64, 0, &mh, 1, agg, &req), ncclSuccess);
  assert_int_equal(t->iflush(o.rc, 0, &mh, 1, &req), ncclSuccess);
  assert_int_equal(t->iput(o.rc, 0, 0, &mh, 4, 0, &mh, 0, agg, &req), ncclSuccess);
  assert_int_equal(t->rmaProgress(o.rc), ncclSuccess);
  const char *want[] = {"hold 1 1 on", "put 1 1 8", "put 1 1 16", "putSignal 1 1 0", "put 1 1 32", "hold 1 1 off",
                        "hold 0 1 on", "get 0 1 64", "hold 0 1 off", "flush 0 1",
                        "hold 0 0 on", "put 0 0 4", "hold 0 0 off", "progress"};
  expect_calls(0, want, (int)(sizeof(want) / sizeof(want[0])));
  close_v15(&o);
}

/* v16 posts through the same ops; a hold left open when the context set goes ends before it goes. */
static void test_v16_destroy_ends_hold(void **state) {
  struct opened o = open_v15();
  int mh = 0;
  void *req;
  assert_int_equal(ncclRmaPlugin_v16.iput(o.rc, 1, 0, &mh, 8, 0, &mh, 0, ncclRmaOptFlagsAggregateRequests, &req),
                   ncclSuccess);
  ncclRmaProperties_v16_t props = {.flushesAllPutsOnAnySignal = true};
  assert_int_equal(ncclRmaPlugin_v16.getRmaProperties(o.cc, &props), ncclSuccess);
  assert_false(props.flushesAllPutsOnAnySignal);
  close_v15(&o);
  const char *want[] = {"hold 1 0 on", "put 1 0 8", "hold 1 0 off", "destroy"};
  expect_calls(0, want, 4);
}

/* v14 has no hint: the same ops never hold. */
static void test_v14_never_holds(void **state) {
  struct opened o = open_v15();
  int mh = 0;
  void *req;
  assert_int_equal(ncclRmaPlugin_v14.iput(o.rc, 1, 0, &mh, 8, 0, &mh, 1, &req), ncclSuccess);
  assert_int_equal(ncclRmaPlugin_v14.iget(o.rc, 1, 0, &mh, 8, 0, &mh, 1, &req), ncclSuccess);
  close_v15(&o);
  const char *want[] = {"put 1 1 8", "get 1 1 8", "destroy"};
  expect_calls(0, want, 3);
}

/* Without holds in the transport the hint changes nothing: ops go straight to it. */
static void test_v15_transport_without_holds(void **state) {
  d_rma.hold = NULL;
  struct opened o = open_v15();
  int mh = 0;
  void *req;
  assert_int_equal(ncclRmaPlugin_v15.iput(o.rc, 1, 0, &mh, 8, 0, &mh, 1, ncclRmaOptFlagsAggregateRequests, &req),
                   ncclSuccess);
  assert_int_equal(ncclRmaPlugin_v15.rmaProgress(o.rc), ncclSuccess);
  close_v15(&o);
  const char *want[] = {"put 1 1 8", "progress", "destroy"};
  expect_calls(0, want, 3);
}

/* A refused hinted op (the transport's error) ends the hold it began. */
static void test_v15_refused_op_ends_hold(void **state) {
  struct opened o = open_v15();
  int mh = 0;
  void *req;
  put_result = ncclInvalidArgument;
  assert_int_equal(ncclRmaPlugin_v15.iput(o.rc, 0, 0, &mh, 8, 0, &mh, 1, ncclRmaOptFlagsAggregateRequests, &req),
                   ncclInvalidArgument);
  put_result = ncclSuccess;
  close_v15(&o);
  const char *want[] = {"hold 0 1 on", "put 0 1 8", "hold 0 1 off", "destroy"};
  expect_calls(0, want, 4);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup(test_run_closed_by_unhinted_op, reset),
      cmocka_unit_test_setup(test_end_once, reset),
      cmocka_unit_test_setup(test_end_all_and_failure, reset),
      cmocka_unit_test_setup(test_out_of_range, reset),
      cmocka_unit_test_setup(test_no_holds, reset),
      cmocka_unit_test_setup(test_v15_pass, reset),
      cmocka_unit_test_setup(test_v16_destroy_ends_hold, reset),
      cmocka_unit_test_setup(test_v14_never_holds, reset),
      cmocka_unit_test_setup(test_v15_transport_without_holds, reset),
      cmocka_unit_test_setup(test_v15_refused_op_ends_hold, reset),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
