/* mplane: the one monotonic clock every layer times with (deadlines, timeouts, request times).
 * clock_gettime(CLOCK_MONOTONIC) goes through the vDSO: no system call, so it may sit on a data path. */
#ifndef MPLANE_COMMON_CLOCK_H
#define MPLANE_COMMON_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline uint64_t mplane_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static inline double mplane_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

#endif
