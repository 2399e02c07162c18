/* What the unit tests that play a raw TCP peer of the socket transport share: a clock, and whole
 * writes and reads that fail the test (cmocka) on an error or an early close. Include after
 * <cmocka.h>. */
#ifndef MPLANE_TESTS_UNIT_RAW_PEER_H
#define MPLANE_TESTS_UNIT_RAW_PEER_H

#include <stddef.h>
#include <sys/socket.h>
#include <time.h>

static inline double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static inline void write_all(int fd, const void *p, size_t n) {
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    assert_true(w > 0);
    p = (const char *)p + w;
    n -= (size_t)w;
  }
}

static inline void read_all(int fd, void *p, size_t n) {
  while (n) {
    ssize_t r = recv(fd, p, n, 0);
    assert_true(r > 0);
    p = (char *)p + r;
    n -= (size_t)r;
  }
}

#endif
