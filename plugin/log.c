/* mplane: logging through NCCL's logger (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static ncclDebugLogger_t nccl_logger;

void mplane_log_set_logger(ncclDebugLogger_t logger) {
  if (logger) nccl_logger = logger;
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
  if (nccl_logger) {
    /* NCCL formats with "%s"-safe semantics only if we hand it a fixed format. */
    nccl_logger(level, subsys, file, line, "NET/mplane %s", msg);
    return;
  }
  if (stderr_wants(level)) {
    fprintf(stderr, "NET/mplane %s %s\n", level == NCCL_LOG_WARN ? "WARN" : "INFO", msg);
  }
}
