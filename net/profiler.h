/* mplane: network events for NCCL's profiler, the same for every transport.
 *
 * NCCL (net v10 and later) hands init a callback; plugin/ gives it to mplane_prof_set_callback. A
 * transport then reports each unit of work as NCCL's own transports do: IB one event per QP work
 * request (mplane_prof_ib_start at the post, mplane_prof_stop at its completion), sockets one per
 * transfer on one stream (mplane_prof_sock_start when a chunk starts moving on it, mplane_prof_stop
 * when it has moved), each with the pHandle NCCL passed with the request.
 *
 * Nothing is reported without a callback or without a pHandle (NCCL passes one only where its
 * profiler follows the request). Off, a start is one load and a branch and stores NULL in the event
 * slot; a stop is a test of that slot. The slot (void *) lives wherever the transport keeps the work:
 * a request's array, a helper thread's stack. Callable from any thread; a slot belongs to one. */
#ifndef MPLANE_NET_PROFILER_H
#define MPLANE_NET_PROFILER_H

#include <stddef.h>
#include <stdint.h>

#include "../common/nccl/common.h"
#include "../common/nccl/profiler_net.h"

/* The callback NCCL gave init, NULL when none. Read through mplane_prof_active. */
extern ncclProfilerCallback_t mplane_prof_callback;

/* The first non-NULL callback stays (NCCL passes the same one to every init); NULL changes nothing. */
void mplane_prof_set_callback(ncclProfilerCallback_t cb);

static inline int mplane_prof_active(const void *phandle) {
  return __builtin_expect(phandle != NULL && __atomic_load_n(&mplane_prof_callback, __ATOMIC_RELAXED) != NULL, 0);
}

void mplane_prof_ib_start_now(void **event, void *phandle, int dev, uint64_t wr_id, int opcode, uint32_t qpn,
                              size_t length);
void mplane_prof_sock_start_now(void **event, void *phandle, int fd, int op, size_t length);
void mplane_prof_stop_now(void **event);

/* One QP work request starts: *event gets NCCL's handle for it, or NULL (nothing to stop). */
static inline void mplane_prof_ib_start(void **event, void *phandle, int dev, uint64_t wr_id, int opcode,
                                        uint32_t qpn, size_t length) {
  *event = NULL;
  if (mplane_prof_active(phandle)) mplane_prof_ib_start_now(event, phandle, dev, wr_id, opcode, qpn, length);
}

/* One transfer on socket fd starts (op NCCL_PROFILER_SOCKET_SEND or _RECV). */
static inline void mplane_prof_sock_start(void **event, void *phandle, int fd, int op, size_t length) {
  *event = NULL;
  if (mplane_prof_active(phandle)) mplane_prof_sock_start_now(event, phandle, fd, op, length);
}

/* The work of *event has ended (done or failed); *event becomes NULL, so a second stop does nothing. */
static inline void mplane_prof_stop(void **event) {
  if (__builtin_expect(*event != NULL, 0)) mplane_prof_stop_now(event);
}

/* Stop every event of n slots (a request that failed: its work will never complete). */
static inline void mplane_prof_stop_all(void **events, int n) {
  for (int i = 0; i < n; i++) mplane_prof_stop(&events[i]);
}

#endif
