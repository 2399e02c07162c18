/* mplane: network events for NCCL's profiler (see profiler.h). */
#include "profiler.h"

#include <errno.h>
#include <string.h>

ncclProfilerCallback_t mplane_prof_callback;

void mplane_prof_set_callback(ncclProfilerCallback_t cb) {
  ncclProfilerCallback_t none = NULL;
  if (cb) __atomic_compare_exchange_n(&mplane_prof_callback, &none, cb, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED);
}

/* A failed start leaves no event: NCCL keeps nothing to stop. errno is kept: the call sites sit beside
 * I/O whose failure is reported from it. */
static void start(void **event, void *phandle, int64_t plugin_id, void *descr) {
  ncclProfilerCallback_t cb = __atomic_load_n(&mplane_prof_callback, __ATOMIC_ACQUIRE);
  *event = NULL;
  if (!cb) return;
  int saved = errno;
  if (cb(event, ncclProfilerNetEventStart, phandle, plugin_id, descr) != ncclSuccess) *event = NULL;
  errno = saved;
}

void mplane_prof_ib_start_now(void **event, void *phandle, int dev, uint64_t wr_id, int opcode, uint32_t qpn,
                              size_t length) {
  ncclProfilerNetIbDescr_v1_t d;
  memset(&d, 0, sizeof(d));
  d.type = ncclProfileQp;
  d.qp.device = dev;
  d.qp.wr_id = wr_id;
  d.qp.opcode = opcode;
  d.qp.qpNum = (int)qpn;
  d.qp.length = length;
  start(event, phandle, (int64_t)(NCCL_PROFILER_NET_TYPE_IB | NCCL_PROFILER_NET_IB_VER), &d);
}

void mplane_prof_sock_start_now(void **event, void *phandle, int fd, int op, size_t length) {
  ncclProfilerNetSockDescr_v1_t d;
  memset(&d, 0, sizeof(d));
  d.type = ncclProfileSocket;
  d.sock.fd = fd;
  d.sock.op = op;
  d.sock.length = length;
  start(event, phandle, (int64_t)(NCCL_PROFILER_NET_TYPE_SOCK | NCCL_PROFILER_NET_SOCKET_VER), &d);
}

void mplane_prof_stop_now(void **event) {
  ncclProfilerCallback_t cb = __atomic_load_n(&mplane_prof_callback, __ATOMIC_ACQUIRE);
  int saved = errno;
  if (cb) cb(event, ncclProfilerNetEventStop, NULL, 0, NULL);
  errno = saved;
  *event = NULL;
}
