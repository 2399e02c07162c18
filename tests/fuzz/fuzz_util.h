/* mplane fuzz targets: what every harness shares. Each target is a libFuzzer program
 * (LLVMFuzzerTestOneInput) over one parser surface; tests/fuzz/meson.build builds them with clang
 * and runs each for a few seconds on its seed corpus (tests/fuzz/corpus/<target>/). A property a
 * parser must keep is checked with FUZZ_REQUIRE: a violation aborts, and libFuzzer saves the input. */
#ifndef MPLANE_FUZZ_UTIL_H
#define MPLANE_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "plugin/log.h"

#define FUZZ_REQUIRE(cond, ...)                                          \
  do {                                                                   \
    if (!(cond)) {                                                       \
      fprintf(stderr, "fuzz: %s:%d: %s does not hold: ", __FILE__, __LINE__, #cond); \
      fprintf(stderr, __VA_ARGS__);                                      \
      fputc('\n', stderr);                                               \
      abort();                                                           \
    }                                                                    \
  } while (0)

static inline double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Targets that drive the plugin: every call must come back within CALL_LIMIT_S, as the plugin never
 * blocks NCCL's proxy thread (2 s: a call that waits on the network waits far longer; the rest is
 * room for a loaded host). */
#define CALL_LIMIT_S 2.0
#define TIMED(what, call)                                                                  \
  ({                                                                                       \
    double t0_ = now_s();                                                                  \
    ncclResult_t r_ = (call);                                                              \
    double dt_ = now_s() - t0_;                                                            \
    FUZZ_REQUIRE(dt_ < CALL_LIMIT_S, "%s took %.3f s", what, dt_);                         \
    r_;                                                                                    \
  })

/* WARNs go nowhere (as under NCCL's logger at its default level): millions of them would only slow
 * the run down. */
static void fuzz_quiet_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                              const char *fmt, ...) {
  (void)level, (void)flags, (void)file, (void)line, (void)fmt;
}

static inline void fuzz_quiet(void) { mplane_log_set_logger(fuzz_quiet_logger); }

/* The input as a C string (bytes after a NUL are dropped: no environment value or file line of
 * ours can hold one); free() it. */
static inline char *fuzz_cstr(const uint8_t *data, size_t size) {
  char *s = malloc(size + 1);
  if (!s) abort();
  memcpy(s, data, size);
  s[size] = '\0';
  return s;
}

#endif
