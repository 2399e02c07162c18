/* mplane: what both transports share below their ops tables (see transport_base.h). */
#include "transport_base.h"

#include <poll.h>
#include <sched.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "../common/log.h"

/* ---------------------------------------------------------------- the error slot */

void mplane_error_set(struct mplane_error *e, ncclResult_t res, const char *fmt, ...) {
  int expected = 0;
  /* Claim the slot first so exactly one thread writes the message. */
  if (!__atomic_compare_exchange_n(&e->state, &expected, -1, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(e->msg, sizeof(e->msg), fmt, ap);
  va_end(ap);
  __atomic_store_n(&e->state, (int)res, __ATOMIC_RELEASE);
}

static ncclResult_t report(struct mplane_error *e, int st, const char *who) {
  if (st <= 0) return ncclSuccess;
  if (!__atomic_exchange_n(&e->warned, 1, __ATOMIC_ACQ_REL)) MP_WARN("%s: %s", who, e->msg);
  return (ncclResult_t)st;
}

ncclResult_t mplane_error_check(struct mplane_error *e, const char *who) {
  int st = __atomic_load_n(&e->state, __ATOMIC_ACQUIRE);
  /* -1: another thread claimed the slot and is formatting its message; it stores the result right
   * after, so wait for it rather than call a failing comm healthy. */
  while (st == -1) {
    sched_yield();
    st = __atomic_load_n(&e->state, __ATOMIC_ACQUIRE);
  }
  return report(e, st, who);
}

ncclResult_t mplane_error_peek(struct mplane_error *e, const char *who) {
  return report(e, __atomic_load_n(&e->state, __ATOMIC_ACQUIRE), who);
}

/* ---------------------------------------------------------------- the connect stage in the handle */

void *mplane_connect_stage_find(struct mplane_stage_set *stages, const void *handle, size_t offset) {
  void *stage = NULL;
  memcpy(&stage, (const char *)handle + offset, sizeof(stage));
  return mplane_stage_live(stages, stage) ? stage : NULL;
}

int mplane_connect_stage_keep(struct mplane_stage_set *stages, void *handle, size_t offset, void *stage) {
  if (mplane_stage_add(stages, stage) != 0) return -1;
  memcpy((char *)handle + offset, &stage, sizeof(stage));
  return 0;
}

void mplane_connect_stage_drop(struct mplane_stage_set *stages, void *handle, size_t offset, void *stage) {
  mplane_stage_remove(stages, stage);
  memset((char *)handle + offset, 0, sizeof(stage));
}

/* ---------------------------------------------------------------- listeners */

int mplane_listen_backlog_waiting(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, 0) == 1 && (p.revents & POLLIN);
}
