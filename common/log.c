/* mplane: logging through NCCL's logger (see log.h). */
#include "log.h"

#include <stdarg.h>
#include <strings.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"

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

static int debug_level(void) {
  const char *dbg = getenv("MPLANE_DEBUG");
  return dbg && *dbg ? atoi(dbg) : 0;
}

/* -1 until first asked; the environment is read once (a benign race: every thread computes the same). */
static int tracing = -1, trace_stderr;

int mplane_log_tracing(void) {
  int t = __atomic_load_n(&tracing, __ATOMIC_RELAXED);
  if (t >= 0) return t;
  const char *nccl = getenv("NCCL_DEBUG");
  trace_stderr = debug_level() >= 2;
  t = trace_stderr || (nccl && strcasecmp(nccl, "TRACE") == 0);
  __atomic_store_n(&tracing, t, __ATOMIC_RELAXED);
  return t;
}

static void trace_to_stderr(const char *msg) {
  uint64_t ns = mplane_now_ns();
  fprintf(stderr, "NET/mplane TRACE %llu.%06llu [%d:%ld] %s\n", (unsigned long long)(ns / 1000000000u),
          (unsigned long long)(ns % 1000000000u / 1000u), (int)getpid(), (long)syscall(SYS_gettid), msg);
}

void mplane_log(ncclDebugLogLevel level, unsigned long subsys, const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level == NCCL_LOG_TRACE && mplane_log_tracing() && trace_stderr) {
    trace_to_stderr(msg);
    return;
  }
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
