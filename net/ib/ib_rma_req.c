/* mplane: the IB RMA backend's requests on the wire (ib_rma.h): failing a request or a connection,
 * posting an op's work requests. Shared by ib_rma.c (the ops NCCL calls) and ib_rma_stage.c. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "../rma_ctrl.h"
#include "ib.h"
#include "ib_rma.h"

int ibr_timeout_ms(void) { return mplane_rma_timeout_ms(mpib_config()); }

void ibr_req_fail(struct ibr_req *r, ncclResult_t res, const char *fmt, ...) {
  __atomic_store_n(&r->conn->cx->set->has_error, 1, __ATOMIC_RELEASE);
  if (r->failed) return;
  r->failed = 1;
  r->result = res;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->why, sizeof(r->why), fmt, ap);
  va_end(ap);
}

const char *ibr_to_from(const struct ibr_req *r) { return strcmp(r->what, "get") ? "to" : "from"; }

void ibr_req_fail_conn(struct ibr_req *r, const char *why) {
  ibr_req_fail(r, ncclRemoteError, "RMA %s %s rank %d (context %d, window %u, offset %llu, size %llu): %s", r->what,
               ibr_to_from(r), r->conn->peer, r->conn->cx->index, r->win, (unsigned long long)r->off,
               (unsigned long long)r->size, why);
}

/* A refused op: a request that fails from test, nothing posted. */
ncclResult_t ibr_refuse(struct ibr_req *r, void **request) {
  *request = r;
  return ncclSuccess;
}

/* Room for n more work requests on c's QP and its context's CQ (caller holds the context's lock). */
int ibr_room(struct ibr_conn *c, int n) {
  return c->outstanding + n <= IBR_SQ && c->cx->outstanding + n <= c->cx->cq_depth;
}

int ibr_post(struct ibr_conn *c, struct ibr_req *r, struct ibv_send_wr *wr) { return ibr_post_on(c, c->qp, r, wr); }

int ibr_post_on(struct ibr_conn *c, struct ibv_qp *qp, struct ibr_req *r, struct ibv_send_wr *wr) {
  struct ibv_send_wr *bad = NULL;
  int n = 0;
  for (struct ibv_send_wr *w = wr; w; w = w->next) n++;
  int rc = ibv_post_send(qp, wr, &bad);
  if (rc != 0) {
    int posted = 0;
    for (struct ibv_send_wr *w = wr; w && w != bad; w = w->next) posted++;
    n = posted;
    ibr_req_fail(r, ncclSystemError, "RMA %s to rank %d (context %d): ibv_post_send failed: %s", r->what, c->peer,
             c->cx->index, strerror(rc));
  }
  r->pending += n;
  c->outstanding += n;
  c->cx->outstanding += n;
  return rc;
}

int ibr_op_nwr(const struct ibr_op *op) { return (int)((op->size + IBR_WR_MAX - 1) / IBR_WR_MAX) + (op->sig ? 1 : 0); }

/* Post op whole on c (caller holds the context's lock and checked room). A failed post fails r. */
ncclResult_t ibr_post_op_locked(struct ibr_conn *c, struct ibr_req *r, const struct ibr_op *op) {
  int nwr = ibr_op_nwr(op);
  struct ibr_group *g = c->cx->set->g;
  struct ibv_send_wr wrs[8], *wrv = nwr <= 8 ? wrs : calloc((size_t)nwr, sizeof(*wrv));
  struct ibv_sge sges[8], *sgv = nwr <= 8 ? sges : calloc((size_t)nwr, sizeof(*sgv));
  if (!wrv || !sgv) {
    if (wrv != wrs) free(wrv);
    if (sgv != sges) free(sgv);
    return ncclSystemError;
  }
  memset(wrv, 0, sizeof(*wrv) * (size_t)nwr);
  int i = 0;
  for (uint64_t done = 0; done < op->size; done += IBR_WR_MAX, i++) {
    uint64_t len = op->size - done < IBR_WR_MAX ? op->size - done : IBR_WR_MAX;
    sgv[i] = (struct ibv_sge){.addr = op->laddr + done, .length = (uint32_t)len, .lkey = op->lkey};
    wrv[i].opcode = (enum ibv_wr_opcode)op->opcode;
    wrv[i].wr.rdma.remote_addr = op->raddr + done;
    wrv[i].wr.rdma.rkey = op->rkey;
  }
  if (op->sig) {
    sgv[i] = (struct ibv_sge){.addr = (uint64_t)(uintptr_t)g->scratch, .length = 8,
                              .lkey = g->car[c->car].scratch_mr->lkey};
    wrv[i].opcode = IBV_WR_ATOMIC_FETCH_AND_ADD;
    wrv[i].wr.atomic.remote_addr = op->saddr;
    wrv[i].wr.atomic.rkey = op->srkey;
    wrv[i].wr.atomic.compare_add = op->add;
  }
  for (int k = 0; k < nwr; k++) {
    wrv[k].wr_id = (uint64_t)(uintptr_t)r;
    wrv[k].sg_list = &sgv[k];
    wrv[k].num_sge = 1;
    wrv[k].send_flags = IBV_SEND_SIGNALED;
    wrv[k].next = k + 1 < nwr ? &wrv[k + 1] : NULL;
  }
  ibr_post(c, r, wrv);
  if (wrv != wrs) free(wrv);
  if (sgv != sges) free(sgv);
  return ncclSuccess;
}

/* ---- completions ---- */
/* The wire refused an op of c (a completion in error that is not a flush of an already failed QP):
 * the fault is the peer's in every context. A dying process still takes writes on its other QPs
 * while its memory is torn down piece by piece, and such a write must not count as delivered.
 * Local faults (a failed copy or post) stay the connection's: the peer is not to blame. */
void ibr_peer_fault(struct ibr_conn *c, const char *why) {
  ibr_conn_fail(c, why);
  struct ibr_conn *none = NULL;
  __atomic_compare_exchange_n(&c->cx->set->faulted[c->peer], &none, c, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
}

void ibr_conn_fail(struct ibr_conn *c, const char *why) {
  if (__atomic_load_n(&c->failed, __ATOMIC_ACQUIRE)) return;
  snprintf(c->why, sizeof(c->why), "%s", why);
  __atomic_store_n(&c->failed, 1, __ATOMIC_RELEASE);
  __atomic_store_n(&c->cx->set->has_error, 1, __ATOMIC_RELEASE);
  /* ERR flushes whatever is still posted, so every request on it completes (in error) soon. */
  struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
  mpib_v.modify_qp(c->qp, &a, IBV_QP_STATE);
}
