/* mplane: what both transports (net/socket, net/ib) share below their ops tables.
 *
 *   - the error slot a comm's threads share with the proxy thread: the first failure is kept with
 *     its message, every later call on the comm reports it, the WARN comes once;
 *   - the connect stage NCCL's handle buffer carries: NCCL calls connect again and again with the
 *     same handle until a comm comes back, and a transport keeps a pointer to its connect state in
 *     that buffer, past the handle's own bytes, trusted only while its stage set (stage_set.h)
 *     holds it. */
#ifndef MPLANE_NET_TRANSPORT_BASE_H
#define MPLANE_NET_TRANSPORT_BASE_H

#include <stddef.h>

#include "../common/nccl/err.h"
#include "stage_set.h"

/* ---------------------------------------------------------------- the error slot */

struct mplane_error {
  int state; /* 0 ok, -1 being written, else an ncclResult_t (atomic), set once */
  int warned;
  char msg[384];
};

/* Keep res and its message unless the slot holds an error already (any thread; exactly one writer
 * formats its message). */
void mplane_error_set(struct mplane_error *e, ncclResult_t res, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* The slot's error, with a WARN "<who>: <message>" the first time, or ncclSuccess. A message being
 * written is waited for (one vsnprintf, no lock, no I/O), so a failing comm never reads healthy. */
ncclResult_t mplane_error_check(struct mplane_error *e, const char *who);
/* The same without that wait: a message being written reads ncclSuccess until its writer is done,
 * for callers that look again on their next call. */
ncclResult_t mplane_error_peek(struct mplane_error *e, const char *who);

/* ---------------------------------------------------------------- listeners */

/* 1 if a connection waits in the backlog of listening socket fd (a full table of pending connections
 * then gives up a stranger's slot). */
int mplane_listen_backlog_waiting(int fd);

/* ---------------------------------------------------------------- the connect stage in the handle */

/* The connect state whose pointer handle holds at offset, when stages holds it; NULL otherwise
 * (none yet, or a buffer that was never ours). */
void *mplane_connect_stage_find(struct mplane_stage_set *stages, const void *handle, size_t offset);
/* Keep stage in stages and its pointer in handle at offset. 0, or -1 when out of memory (nothing
 * kept). */
int mplane_connect_stage_keep(struct mplane_stage_set *stages, void *handle, size_t offset, void *stage);
/* Forget stage: out of stages, and its pointer cleared from handle (NCCL may reuse the buffer). */
void mplane_connect_stage_drop(struct mplane_stage_set *stages, void *handle, size_t offset, void *stage);

#endif
