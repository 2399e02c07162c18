/* mplane: libibverbs opened at run time (see ib.h). Only exported entry points are looked up;
 * post_send, post_recv and poll_cq are static inline in verbs.h and go through context->ops. */
#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "ib.h"

struct mpib_verbs mpib_v;

#define LOAD(field, sym, required)                                                 \
  do {                                                                             \
    *(void **)&mpib_v.field = dlsym(lib, sym);                                     \
    if (!mpib_v.field && (required)) {                                             \
      snprintf(why, whylen, "%s has no symbol %s (rdma-core too old?)", libname, sym); \
      goto fail;                                                                   \
    }                                                                              \
  } while (0)

int mpib_verbs_load(const char *libname, char *why, size_t whylen) {
  if (mpib_v.lib) return 0;
  void *lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    snprintf(why, whylen, "cannot load %s: %s", libname, dlerror());
    return -1;
  }
  LOAD(fork_init, "ibv_fork_init", 0);
  LOAD(get_device_list, "ibv_get_device_list", 1);
  LOAD(free_device_list, "ibv_free_device_list", 1);
  LOAD(get_device_name, "ibv_get_device_name", 1);
  LOAD(open_device, "ibv_open_device", 1);
  LOAD(close_device, "ibv_close_device", 1);
  LOAD(query_device, "ibv_query_device", 1);
  LOAD(query_port, "ibv_query_port", 1);
  LOAD(query_gid, "ibv_query_gid", 1);
  LOAD(query_gid_ex, "_ibv_query_gid_ex", 0);
  LOAD(alloc_pd, "ibv_alloc_pd", 1);
  LOAD(dealloc_pd, "ibv_dealloc_pd", 1);
  LOAD(reg_mr, "ibv_reg_mr", 1);
  LOAD(reg_dmabuf_mr, "ibv_reg_dmabuf_mr", 0);
  LOAD(reg_mr_iova2, "ibv_reg_mr_iova2", 0);
  LOAD(dereg_mr, "ibv_dereg_mr", 1);
  LOAD(create_cq, "ibv_create_cq", 1);
  LOAD(destroy_cq, "ibv_destroy_cq", 1);
  LOAD(create_qp, "ibv_create_qp", 1);
  LOAD(modify_qp, "ibv_modify_qp", 1);
  LOAD(destroy_qp, "ibv_destroy_qp", 1);
  LOAD(query_ece, "ibv_query_ece", 0);
  LOAD(set_ece, "ibv_set_ece", 0);
  LOAD(get_async_event, "ibv_get_async_event", 1);
  LOAD(ack_async_event, "ibv_ack_async_event", 1);
  mpib_v.lib = lib;
  return 0;
fail:
  memset(&mpib_v, 0, sizeof(mpib_v));
  dlclose(lib);
  return -1;
}

const char *mpib_wc_status_str(int status) {
  switch (status) {
    case IBV_WC_SUCCESS: return "success";
    case IBV_WC_LOC_LEN_ERR: return "local length error";
    case IBV_WC_LOC_QP_OP_ERR: return "local QP operation error";
    case IBV_WC_LOC_PROT_ERR: return "local protection error";
    case IBV_WC_WR_FLUSH_ERR: return "work request flushed";
    case IBV_WC_REM_INV_REQ_ERR: return "remote invalid request";
    case IBV_WC_REM_ACCESS_ERR: return "remote access error (bad rkey or bounds)";
    case IBV_WC_REM_OP_ERR: return "remote operation error";
    case IBV_WC_RETRY_EXC_ERR: return "transport retry counter exceeded (peer unreachable or dead)";
    case IBV_WC_RNR_RETRY_EXC_ERR: return "RNR retry counter exceeded";
    case IBV_WC_FATAL_ERR: return "fatal error";
    case IBV_WC_GENERAL_ERR: return "general error";
    default: return "error";
  }
}

const char *mpib_event_str(int type) {
  switch (type) {
    case IBV_EVENT_CQ_ERR: return "CQ error";
    case IBV_EVENT_QP_FATAL: return "QP fatal error";
    case IBV_EVENT_QP_REQ_ERR: return "QP invalid request error";
    case IBV_EVENT_QP_ACCESS_ERR: return "QP access error";
    case IBV_EVENT_PORT_ACTIVE: return "port active";
    case IBV_EVENT_PORT_ERR: return "port down";
    case IBV_EVENT_DEVICE_FATAL: return "device fatal error";
    case IBV_EVENT_LID_CHANGE: return "LID change";
    case IBV_EVENT_GID_CHANGE: return "GID change";
    case IBV_EVENT_SM_CHANGE: return "SM change";
    default: return "event";
  }
}

int mpib_query_port(struct ibv_context *ctx, int port, struct mpib_port_attr *out) {
  memset(out, 0, sizeof(*out));
  struct verbs_context *vctx = verbs_get_ctx_op(ctx, query_port);
  if (vctx) return vctx->query_port(ctx, (uint8_t)port, &out->a, sizeof(out->raw));
  return mpib_v.query_port(ctx, (uint8_t)port, &out->a);
}

uint32_t mpib_port_speed_ex(const struct mpib_port_attr *pa) {
  uint32_t v;
  memcpy(&v, pa->raw + MPIB_PORT_SPEED_EX_OFFSET, sizeof(v));
  return v;
}

/* Post a list of work requests on QP q of a comm; a refusal is the comm's error (kept, reported by
 * every later call). Here, below the data path and the staging ring that both post. */
ncclResult_t mpib_post(struct mpib_comm_base *b, int q, struct ibv_send_wr *wr) {
  struct ibv_send_wr *bad = NULL;
  int rc = ibv_post_send(b->qps[q], wr, &bad);
  if (rc) {
    mpib_error_set(&b->err, ncclSystemError, "%s port %d: ibv_post_send on QP %u failed: %s (peer %s)",
                   b->dev->hca->name, b->dev->port, b->qps[q]->qp_num, strerror(rc), b->peer);
    return mpib_error_check(&b->err);
  }
  return ncclSuccess;
}
