/* mplane: logging through the logger NCCL hands to init.
 *
 * Every line carries the "NET/mplane" prefix so users can grep NCCL_DEBUG=INFO output.
 * Before NCCL gives us a logger (or in our own tools and tests) WARNs go to stderr, and
 * INFO goes there too when MPLANE_DEBUG=1. MPLANE_DEBUG=2 sends TRACE lines to stderr always, with a
 * monotonic time stamp and the thread, since NCCL's release builds drop TRACE; without it a TRACE
 * costs one load of a cached flag (the RMA ops trace every request). */
#ifndef MPLANE_LOG_H
#define MPLANE_LOG_H

#include "nccl/common.h"

void mplane_log_set_logger(ncclDebugLogger_t logger);
/* Nonzero when TRACE lines go anywhere: MPLANE_DEBUG=2, or NCCL_DEBUG=TRACE (a TRACE build of NCCL). */
int mplane_log_tracing(void);
void mplane_log(ncclDebugLogLevel level, unsigned long subsys, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

#define MP_WARN(...) mplane_log(NCCL_LOG_WARN, NCCL_ALL, __FILE__, __LINE__, __VA_ARGS__)
#define MP_INFO(subsys, ...) mplane_log(NCCL_LOG_INFO, (subsys), __FILE__, __LINE__, __VA_ARGS__)
#define MP_TRACE(subsys, ...)                                                   \
  do {                                                                          \
    if (mplane_log_tracing()) mplane_log(NCCL_LOG_TRACE, (subsys), __FILE__, __LINE__, __VA_ARGS__); \
  } while (0)

/* Propagate a failing ncclResult_t, with the place of the failure in a WARN. */
#define MP_CHECK(call)                                                  \
  do {                                                                  \
    ncclResult_t mp_check_res_ = (call);                                \
    if (mp_check_res_ != ncclSuccess) {                                 \
      MP_WARN("%s failed with result %d", #call, (int)mp_check_res_);   \
      return mp_check_res_;                                             \
    }                                                                   \
  } while (0)

/* Same, jumping to a cleanup label that releases what was acquired. */
#define MP_CHECK_GOTO(call, res, label)                                 \
  do {                                                                  \
    (res) = (call);                                                     \
    if ((res) != ncclSuccess) {                                         \
      MP_WARN("%s failed with result %d", #call, (int)(res));           \
      goto label;                                                       \
    }                                                                   \
  } while (0)

#endif
