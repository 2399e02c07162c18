/* The software verbs double's own semantics, checked through dlopen as the transport uses it: QP
 * state rules, RDMA write/read/write-with-immediate/send/fetch-and-add, rkey and bounds checks, flushes, send-queue
 * credit, CQ overrun, max_msg_sz, write placement, port attributes by struct size. One process, two QPs connected to each other. */
#include <arpa/inet.h>
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>
#include <infiniband/verbs.h>

#undef ibv_query_port
#undef ibv_reg_mr

static struct {
  void *lib;
  struct ibv_device **(*get_device_list)(int *);
  struct ibv_context *(*open_device)(struct ibv_device *);
  int (*query_port)(struct ibv_context *, uint8_t, struct ibv_port_attr *);
  struct ibv_pd *(*alloc_pd)(struct ibv_context *);
  struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
  struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
  struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
  int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
  int (*destroy_qp)(struct ibv_qp *);
  int (*query_qp)(struct ibv_qp *, struct ibv_qp_attr *, int, struct ibv_qp_init_attr *);
  int (*get_async_event)(struct ibv_context *, struct ibv_async_event *);
  struct ibv_context *ctx;
  struct ibv_pd *pd;
  struct ibv_cq *cq;
  uint16_t lid;
} V;

static void load(void) {
  if (V.lib) return;
  V.lib = dlopen(getenv("SOFTVERBS_LIB"), RTLD_NOW);
  assert_non_null(V.lib);
  *(void **)&V.get_device_list = dlsym(V.lib, "ibv_get_device_list");
  *(void **)&V.open_device = dlsym(V.lib, "ibv_open_device");
  *(void **)&V.query_port = dlsym(V.lib, "ibv_query_port");
  *(void **)&V.alloc_pd = dlsym(V.lib, "ibv_alloc_pd");
  *(void **)&V.reg_mr = dlsym(V.lib, "ibv_reg_mr");
  *(void **)&V.create_cq = dlsym(V.lib, "ibv_create_cq");
  *(void **)&V.create_qp = dlsym(V.lib, "ibv_create_qp");
  *(void **)&V.modify_qp = dlsym(V.lib, "ibv_modify_qp");
  *(void **)&V.destroy_qp = dlsym(V.lib, "ibv_destroy_qp");
  *(void **)&V.query_qp = dlsym(V.lib, "ibv_query_qp");
  *(void **)&V.get_async_event = dlsym(V.lib, "ibv_get_async_event");
  int n = 0;
  struct ibv_device **l = V.get_device_list(&n);
  assert_true(n >= 1);
  V.ctx = V.open_device(l[0]);
  struct ibv_port_attr pa;
  memset(&pa, 0, sizeof(pa));
  assert_int_equal(V.query_port(V.ctx, 1, &pa), 0);
  assert_int_equal(pa.state, IBV_PORT_ACTIVE);
  V.lid = pa.lid;
  V.pd = V.alloc_pd(V.ctx);
  V.cq = V.create_cq(V.ctx, 1024, NULL, NULL, 0);
}

static struct ibv_qp *qp_new_on(struct ibv_cq *cq, unsigned send_wr) {
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof(ia));
  ia.send_cq = ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = send_wr;
  ia.cap.max_recv_wr = 64;
  ia.cap.max_send_sge = ia.cap.max_recv_sge = 1;
  struct ibv_qp *qp = V.create_qp(V.pd, &ia);
  assert_non_null(qp);
  return qp;
}

static struct ibv_qp *qp_new(void) { return qp_new_on(V.cq, 64); }

static int to_init(struct ibv_qp *qp, int access) {
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access};
  return V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS);
}

static int to_rts(struct ibv_qp *qp, uint32_t dqpn, uint16_t dlid) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = IBV_MTU_4096;
  a.dest_qp_num = dqpn;
  a.ah_attr.dlid = dlid;
  a.ah_attr.port_num = 1;
  int rc = V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER);
  if (rc) return rc;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.timeout = 14;
  a.retry_cnt = 7;
  a.rnr_retry = 7;
  return V.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY | IBV_QP_SQ_PSN |
                                 IBV_QP_MAX_QP_RD_ATOMIC);
}

/* a and b connected to each other, both RTS */
static void qp_pair(struct ibv_qp *a, struct ibv_qp *b) {
  int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  assert_int_equal(to_init(a, rw), 0);
  assert_int_equal(to_init(b, rw), 0);
  assert_int_equal(to_rts(a, b->qp_num, V.lid), 0);
  assert_int_equal(to_rts(b, a->qp_num, V.lid), 0);
}

static struct ibv_wc wait_wc(void) {
  struct ibv_wc wc;
  time_t t0 = time(NULL);
  for (;;) {
    int n = ibv_poll_cq(V.cq, 1, &wc);
    if (n == 1) return wc;
    assert_true(time(NULL) - t0 < 10);
    usleep(100);
  }
}

static int post_write_flags(struct ibv_qp *qp, enum ibv_wr_opcode op, void *src, size_t len, uint32_t lkey,
                            uint64_t raddr, uint32_t rkey, uint64_t id, int flags) {
  struct ibv_sge sge = {.addr = (uintptr_t)src, .length = (uint32_t)len, .lkey = lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = id;
  wr.opcode = op;
  wr.send_flags = (unsigned)flags;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.imm_data = htonl(0xabcd);
  wr.wr.rdma.remote_addr = raddr;
  wr.wr.rdma.rkey = rkey;
  return ibv_post_send(qp, &wr, &bad);
}

static int post_write(struct ibv_qp *qp, enum ibv_wr_opcode op, void *src, size_t len, uint32_t lkey,
                      uint64_t raddr, uint32_t rkey, uint64_t id) {
  return post_write_flags(qp, op, src, len, lkey, raddr, rkey, id, IBV_SEND_SIGNALED);
}

/* Port attributes as rdma-core gives them: the exported ibv_query_port fills only the original
 * fields (up to `flags`); the extended context's size-aware query_port fills what both sides know
 * (active_speed_ex at 52, rdma-core >= 48) and zeroes the rest of a longer struct, never past len. */
static void test_query_port_sizes(void **state) {
  (void)state;
  load();
  unsigned char buf[128];
  size_t orig = offsetof(struct ibv_port_attr, flags) + 1;
  memset(buf, 0xaa, sizeof(buf));
  assert_int_equal(V.query_port(V.ctx, 1, (struct ibv_port_attr *)(void *)buf), 0);
  assert_int_equal(buf[orig], 0xaa);
  assert_int_equal(buf[52], 0xaa);
  struct verbs_context *vctx = verbs_get_ctx_op(V.ctx, query_port);
  assert_non_null(vctx);
  memset(buf, 0xaa, sizeof(buf));
  assert_int_equal(vctx->query_port(V.ctx, 1, (struct ibv_port_attr *)(void *)buf, sizeof(buf)), 0);
  uint32_t speed_ex;
  memcpy(&speed_ex, buf + 52, sizeof(speed_ex));
  assert_int_equal(speed_ex, 64); /* HDR */
  for (size_t i = 56; i < sizeof(buf); i++) assert_int_equal(buf[i], 0);
  memset(buf, 0xaa, sizeof(buf));
  assert_int_equal(vctx->query_port(V.ctx, 1, (struct ibv_port_attr *)(void *)buf, 40), 0);
  assert_int_equal(buf[40], 0xaa);
  assert_int_equal(((struct ibv_port_attr *)(void *)buf)->state, IBV_PORT_ACTIVE);
}

static void test_state_rules(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new();
  char buf[64];
  struct ibv_mr *mr = V.reg_mr(V.pd, buf, sizeof(buf), IBV_ACCESS_LOCAL_WRITE);
  /* posting before RTS fails like real verbs */
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, 0, 0, 1), EINVAL);
  /* RESET -> RTR is not a transition; INIT without its required mask is refused */
  struct ibv_qp_attr at = {.qp_state = IBV_QPS_RTR};
  assert_int_not_equal(V.modify_qp(a, &at, IBV_QP_STATE), 0);
  at.qp_state = IBV_QPS_INIT;
  assert_int_not_equal(V.modify_qp(a, &at, IBV_QP_STATE), 0);
  assert_int_equal(to_init(a, 0), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, buf, 8, mr->lkey, 0, 0, 1), EINVAL);
  V.destroy_qp(a);
}

static void test_data_and_keys(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new(), *b = qp_new();
  assert_int_equal(to_init(a, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ), 0);
  assert_int_equal(to_init(b, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ), 0);
  assert_int_equal(to_rts(a, b->qp_num, V.lid), 0);
  assert_int_equal(to_rts(b, a->qp_num, V.lid), 0);
  char *src = malloc(1 << 20), *dst = calloc(1, 1 << 20);
  for (int i = 0; i < 1 << 20; i++) src[i] = (char)(i * 13);
  int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
  struct ibv_mr *smr = V.reg_mr(V.pd, src, 1 << 20, rw), *dmr = V.reg_mr(V.pd, dst, 1 << 20, rw);
  /* write with immediate: one receive consumed, byte_len and imm reported */
  struct ibv_recv_wr rwr, *rbad = NULL;
  memset(&rwr, 0, sizeof(rwr));
  rwr.wr_id = 77;
  assert_int_equal(ibv_post_recv(b, &rwr, &rbad), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE_WITH_IMM, src, 1 << 20, smr->lkey, (uintptr_t)dst, dmr->rkey, 5), 0);
  int seen_send = 0, seen_recv = 0;
  for (int i = 0; i < 2; i++) {
    struct ibv_wc wc = wait_wc();
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    if (wc.wr_id == 5) seen_send = 1;
    if (wc.wr_id == 77) {
      seen_recv = 1;
      assert_int_equal(wc.opcode, IBV_WC_RECV_RDMA_WITH_IMM);
      assert_int_equal(wc.byte_len, 1 << 20);
      assert_int_equal(ntohl(wc.imm_data), 0xabcd);
    }
  }
  assert_true(seen_send && seen_recv);
  assert_memory_equal(src, dst, 1 << 20);
  /* RDMA read back into src from dst */
  memset(src, 0, 4096);
  assert_int_equal(post_write(a, IBV_WR_RDMA_READ, src, 4096, smr->lkey, (uintptr_t)dst, dmr->rkey, 6), 0);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_SUCCESS);
  assert_int_equal(wc.opcode, IBV_WC_RDMA_READ);
  assert_memory_equal(src, dst, 4096);
  /* out of bounds: remote access error on the requester, then the QP is in error: flushed */
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, src, 64, smr->lkey, (uintptr_t)dst + (1 << 20) - 8, dmr->rkey, 8), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, src, 64, smr->lkey, (uintptr_t)dst, dmr->rkey, 9), 0);
  wc = wait_wc();
  assert_int_equal(wc.wr_id, 8);
  assert_int_equal(wc.status, IBV_WC_REM_ACCESS_ERR);
  wc = wait_wc();
  assert_int_equal(wc.wr_id, 9);
  assert_int_equal(wc.status, IBV_WC_WR_FLUSH_ERR);
  V.destroy_qp(a);
  V.destroy_qp(b);
  free(src);
  free(dst);
}

static void test_bad_rkey(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new(), *b = qp_new();
  to_init(a, IBV_ACCESS_REMOTE_WRITE);
  to_init(b, IBV_ACCESS_REMOTE_WRITE);
  assert_int_equal(to_rts(a, b->qp_num, V.lid), 0);
  assert_int_equal(to_rts(b, a->qp_num, V.lid), 0);
  char s[64], d[64];
  struct ibv_mr *smr = V.reg_mr(V.pd, s, 64, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, d, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 64, smr->lkey, (uintptr_t)d, dmr->rkey ^ 0x5a5a, 3), 0);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_REM_ACCESS_ERR);
  /* a wrong destination LID is a silent drop on a fabric: transport retries exhausted */
  struct ibv_qp *c = qp_new(), *e = qp_new();
  to_init(c, IBV_ACCESS_REMOTE_WRITE);
  to_init(e, IBV_ACCESS_REMOTE_WRITE);
  assert_int_equal(to_rts(c, e->qp_num, (uint16_t)(V.lid + 100)), 0);
  assert_int_equal(to_rts(e, c->qp_num, V.lid), 0);
  assert_int_equal(post_write(c, IBV_WR_RDMA_WRITE, s, 64, smr->lkey, (uintptr_t)d, dmr->rkey, 4), 0);
  wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_RETRY_EXC_ERR);
  V.destroy_qp(a);
  V.destroy_qp(b);
  V.destroy_qp(c);
  V.destroy_qp(e);
}

static int post_fetch_add(struct ibv_qp *qp, uint64_t *old, uint32_t lkey, uint64_t raddr, uint32_t rkey, uint64_t add,
                          uint64_t id) {
  struct ibv_sge sge = {.addr = (uintptr_t)old, .length = 8, .lkey = lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.wr_id = id;
  wr.opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.wr.atomic.remote_addr = raddr;
  wr.wr.atomic.rkey = rkey;
  wr.wr.atomic.compare_add = add;
  return ibv_post_send(qp, &wr, &bad);
}

/* FETCH_AND_ADD: the old value comes back, the word grows; it runs after the QP's earlier write was
 * placed (in order, as an RC responder); a word outside an atomic-enabled window is an access
 * error, a misaligned one an invalid request. */
static void test_fetch_add(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new(), *b = qp_new();
  int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_ATOMIC;
  assert_int_equal(to_init(a, acc), 0);
  assert_int_equal(to_init(b, acc), 0);
  assert_int_equal(to_rts(a, b->qp_num, V.lid), 0);
  assert_int_equal(to_rts(b, a->qp_num, V.lid), 0);
  static uint64_t word[4] __attribute__((aligned(64))), old, plain;
  static char src[8192], dst[8192];
  word[1] = 40;
  memset(src, 0x5c, sizeof(src));
  struct ibv_mr *wmr = V.reg_mr(V.pd, word, sizeof(word), acc);
  struct ibv_mr *omr = V.reg_mr(V.pd, &old, 8, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *smr = V.reg_mr(V.pd, src, sizeof(src), IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, dst, sizeof(dst), acc);
  struct ibv_mr *pmr = V.reg_mr(V.pd, &plain, 8, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  assert_non_null(wmr);
  assert_non_null(pmr);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, src, sizeof(src), smr->lkey, (uintptr_t)dst, dmr->rkey, 1), 0);
  assert_int_equal(post_fetch_add(a, &old, omr->lkey, (uintptr_t)&word[1], wmr->rkey, 2, 2), 0);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_SUCCESS);
  assert_int_equal(wc.wr_id, 1);
  wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_SUCCESS);
  assert_int_equal(wc.wr_id, 2);
  assert_int_equal(wc.opcode, IBV_WC_FETCH_ADD);
  assert_int_equal(old, 40);
  assert_int_equal(__atomic_load_n(&word[1], __ATOMIC_ACQUIRE), 42);
  assert_int_equal((unsigned char)dst[0], 0x5c); /* the write was placed before the atomic ran */
  assert_int_equal((unsigned char)dst[sizeof(dst) - 1], 0x5c);
  /* a window without REMOTE_ATOMIC: access error, nothing added */
  assert_int_equal(post_fetch_add(a, &old, omr->lkey, (uintptr_t)&plain, pmr->rkey, 1, 3), 0);
  wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_REM_ACCESS_ERR);
  assert_int_equal(plain, 0);
  struct ibv_qp *c = qp_new(), *e = qp_new();
  assert_int_equal(to_init(c, acc), 0);
  assert_int_equal(to_init(e, acc), 0);
  assert_int_equal(to_rts(c, e->qp_num, V.lid), 0);
  assert_int_equal(to_rts(e, c->qp_num, V.lid), 0);
  assert_int_equal(post_fetch_add(c, &old, omr->lkey, (uintptr_t)&word[1] + 4, wmr->rkey, 1, 4), 0);
  wc = wait_wc();
  assert_int_equal(wc.status, IBV_WC_REM_INV_REQ_ERR);
  assert_int_equal(word[1], 42);
  V.destroy_qp(a);
  V.destroy_qp(b);
  V.destroy_qp(c);
  V.destroy_qp(e);
}

/* Real RC: a peer QP that goes away leaves the local QP alone until a request of ours goes unanswered.
 * Receives already completed stay completed, posted receives are not flushed, and only the next
 * request fails (transport retries exhausted), flushing the rest. */
static void test_peer_destroyed(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new(), *b = qp_new();
  int rw = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE;
  assert_int_equal(to_init(a, rw), 0);
  assert_int_equal(to_init(b, rw), 0);
  assert_int_equal(to_rts(a, b->qp_num, V.lid), 0);
  assert_int_equal(to_rts(b, a->qp_num, V.lid), 0);
  static char sa[64], da[64], sb[64], db[64];
  struct ibv_mr *msa = V.reg_mr(V.pd, sa, 64, rw), *mda = V.reg_mr(V.pd, da, 64, rw);
  struct ibv_mr *msb = V.reg_mr(V.pd, sb, 64, rw), *mdb = V.reg_mr(V.pd, db, 64, rw);
  /* b writes to a once, so b's requester side is connected to a */
  assert_int_equal(post_write(b, IBV_WR_RDMA_WRITE, sb, 8, msb->lkey, (uintptr_t)da, mda->rkey, 20), 0);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.wr_id, 20);
  assert_int_equal(wc.status, IBV_WC_SUCCESS);
  /* a writes with immediate to b: both complete; b keeps a second receive posted */
  struct ibv_recv_wr rwr, *rbad = NULL;
  memset(&rwr, 0, sizeof(rwr));
  rwr.wr_id = 21;
  assert_int_equal(ibv_post_recv(b, &rwr, &rbad), 0);
  rwr.wr_id = 22;
  assert_int_equal(ibv_post_recv(b, &rwr, &rbad), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE_WITH_IMM, sa, 8, msa->lkey, (uintptr_t)db, mdb->rkey, 23), 0);
  for (int i = 0; i < 2; i++) {
    wc = wait_wc();
    assert_int_equal(wc.status, IBV_WC_SUCCESS);
    assert_true(wc.wr_id == 21 || wc.wr_id == 23);
  }
  V.destroy_qp(a);
  /* nothing happens on b while it sends nothing */
  for (int i = 0; i < 50; i++) {
    assert_int_equal(ibv_poll_cq(V.cq, 1, &wc), 0);
    usleep(10000);
  }
  /* its next request finds nobody: retries exhausted, then the posted receive is flushed */
  assert_int_equal(post_write(b, IBV_WR_RDMA_WRITE, sb, 8, msb->lkey, (uintptr_t)da, mda->rkey, 24), 0);
  wc = wait_wc();
  assert_int_equal(wc.wr_id, 24);
  assert_int_equal(wc.status, IBV_WC_RETRY_EXC_ERR);
  wc = wait_wc();
  assert_int_equal(wc.wr_id, 22);
  assert_int_equal(wc.status, IBV_WC_WR_FLUSH_ERR);
  V.destroy_qp(b);
}

/* A send-queue entry comes back when a completion is polled, not when the responder acknowledged it;
 * an unsignaled WR's entry only with a later signaled completion of its QP. */
static void test_sq_credit(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new_on(V.cq, 4), *b = qp_new();
  qp_pair(a, b);
  static char s[64], d[64];
  struct ibv_mr *smr = V.reg_mr(V.pd, s, 64, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, d, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  for (int i = 0; i < 4; i++)
    assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 100 + i), 0);
  usleep(200000); /* all four acknowledged by now, their completions not polled */
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 104), ENOMEM);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.wr_id, 100);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 104), 0);
  for (int i = 1; i < 5; i++) assert_int_equal(wait_wc().wr_id, 100 + i);
  /* three unsignaled and a signaled one: full until the signaled completion is polled, then all free */
  for (int i = 0; i < 3; i++)
    assert_int_equal(post_write_flags(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 200 + i, 0), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 203), 0);
  usleep(200000);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 204), ENOMEM);
  wc = wait_wc();
  assert_int_equal(wc.wr_id, 203);
  for (int i = 0; i < 4; i++)
    assert_int_equal(post_write_flags(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 300 + i, 0), 0);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 304), ENOMEM);
  V.destroy_qp(a);
  V.destroy_qp(b);
}

/* More completions than the CQ holds: an async CQ error, and its QPs go to ERR (IBV_EVENT_QP_FATAL). */
static void test_cq_overrun(void **state) {
  (void)state;
  load();
  struct ibv_cq *cq = V.create_cq(V.ctx, 2, NULL, NULL, 0);
  assert_non_null(cq);
  struct ibv_qp *a = qp_new_on(cq, 16), *b = qp_new();
  qp_pair(a, b);
  static char s[64], d[64];
  struct ibv_mr *smr = V.reg_mr(V.pd, s, 64, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, d, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  for (int i = 0; i < 3; i++)
    assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 8, smr->lkey, (uintptr_t)d, dmr->rkey, 400 + i), 0);
  int cq_err = 0, qp_fatal = 0;
  time_t t0 = time(NULL);
  while ((!cq_err || !qp_fatal) && time(NULL) - t0 < 10) {
    struct pollfd pfd = {.fd = V.ctx->async_fd, .events = POLLIN};
    if (poll(&pfd, 1, 100) != 1) continue;
    struct ibv_async_event ev;
    assert_int_equal(V.get_async_event(V.ctx, &ev), 0);
    if (ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == cq) cq_err = 1;
    if (ev.event_type == IBV_EVENT_QP_FATAL && ev.element.qp == a) qp_fatal = 1;
  }
  assert_true(cq_err);
  assert_true(qp_fatal);
  struct ibv_qp_attr at;
  struct ibv_qp_init_attr ia;
  assert_int_equal(V.query_qp(a, &at, IBV_QP_STATE, &ia), 0);
  assert_int_equal(at.qp_state, IBV_QPS_ERR);
  V.destroy_qp(a);
  V.destroy_qp(b);
}

/* A work request longer than the port's max_msg_sz (1 GiB, as ConnectX) ends in a local length error. */
static void test_max_msg(void **state) {
  (void)state;
  load();
  struct ibv_port_attr pa;
  memset(&pa, 0, sizeof(pa));
  assert_int_equal(V.query_port(V.ctx, 1, &pa), 0);
  assert_int_equal(pa.max_msg_sz, 1u << 30);
  struct ibv_qp *a = qp_new(), *b = qp_new();
  qp_pair(a, b);
  static char s[64], d[64];
  struct ibv_mr *smr = V.reg_mr(V.pd, s, 64, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, d, 64, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, (1u << 30) + 1, smr->lkey, (uintptr_t)d, dmr->rkey, 500), 0);
  struct ibv_wc wc = wait_wc();
  assert_int_equal(wc.wr_id, 500);
  assert_int_equal(wc.status, IBV_WC_LOC_LEN_ERR);
  V.destroy_qp(a);
  V.destroy_qp(b);
}

/* Small writes land last line first: a reader that sees a write's first line new sees its last one new
 * too (in address order it could see the first line alone). */
static struct {
  volatile uint64_t *dst;
  int started, stop, seen_first_only, seen;
} P;

/* Reads while the writes land, and once more after the last (a busy host may run it late). */
static void *placement_reader(void *arg) {
  (void)arg;
  __atomic_store_n(&P.started, 1, __ATOMIC_RELEASE);
  int stop;
  do {
    stop = __atomic_load_n(&P.stop, __ATOMIC_ACQUIRE);
    uint64_t first = __atomic_load_n(&P.dst[0], __ATOMIC_ACQUIRE);
    uint64_t last = __atomic_load_n(&P.dst[4096 / 8 - 1], __ATOMIC_ACQUIRE);
    if (first && last < first) P.seen_first_only++;
    if (first) P.seen++;
  } while (!stop);
  return NULL;
}

static void test_placement(void **state) {
  (void)state;
  load();
  struct ibv_qp *a = qp_new(), *b = qp_new();
  qp_pair(a, b);
  uint64_t *s = aligned_alloc(4096, 4096), *d = aligned_alloc(4096, 4096);
  memset(d, 0, 4096);
  struct ibv_mr *smr = V.reg_mr(V.pd, s, 4096, IBV_ACCESS_LOCAL_WRITE);
  struct ibv_mr *dmr = V.reg_mr(V.pd, d, 4096, IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  P.dst = d;
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, placement_reader, NULL), 0);
  while (!__atomic_load_n(&P.started, __ATOMIC_ACQUIRE)) sched_yield(); /* it reads while we write */
  for (uint64_t k = 1; k <= 200; k++) {
    for (int i = 0; i < 4096 / 8; i++) s[i] = k;
    assert_int_equal(post_write(a, IBV_WR_RDMA_WRITE, s, 4096, smr->lkey, (uintptr_t)d, dmr->rkey, 600 + k), 0);
    assert_int_equal(wait_wc().status, IBV_WC_SUCCESS);
  }
  __atomic_store_n(&P.stop, 1, __ATOMIC_RELEASE);
  pthread_join(t, NULL);
  assert_true(P.seen > 0);
  assert_int_equal(P.seen_first_only, 0);
  assert_int_equal(d[0], 200);
  V.destroy_qp(a);
  V.destroy_qp(b);
  free(s);
  free(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_query_port_sizes),
      cmocka_unit_test(test_state_rules),
      cmocka_unit_test(test_data_and_keys),
      cmocka_unit_test(test_bad_rkey),
      cmocka_unit_test(test_fetch_add),
      cmocka_unit_test(test_peer_destroyed),
      cmocka_unit_test(test_sq_credit),
      cmocka_unit_test(test_cq_overrun),
      cmocka_unit_test(test_max_msg),
      cmocka_unit_test(test_placement),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
