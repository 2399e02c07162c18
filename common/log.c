/* mplane: logging through NCCL's logger (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ncclDebugLogger_t nccl_logger;

/* Atomic: communicators are initialized concurrently from several threads (one per GPU), each
 * handing us the logger, while helper threads may be logging. */
void mplane_log_set_logger(ncclDebugLogger_t logger) {
  if (logger) __atomic_store_n(&nccl_logger, logger, __ATOMIC_RELEASE);
}

static int stderr_wants(ncclDebugLogLevel level) {
  if (level == NCCL_LOG_WARN) return 1;
  const char *dbg = getenv("MPLANE_DEBUG");
  if (!dbg || !*dbg || strcmp(dbg, "0") == 0) return 0;
  return level == NCCL_LOG_INFO || strcmp(dbg, "2") == 0;
}

void mplane_log(ncclDebugLogLevel level, unsigned long subsys, const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  ncclDebugLogger_t logger = __atomic_load_n(&nccl_logger, __ATOMIC_ACQUIRE);
  if (logger) {
    /* NCCL formats with "%s"-safe semantics only if we hand it a fixed format. */
    logger(level, subsys, file, line, "NET/mplane %s", msg);
    return;
  }
  if (stderr_wants(level)) {
    fprintf(stderr, "NET/mplane %s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
  }
}
