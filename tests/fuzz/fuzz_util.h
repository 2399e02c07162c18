/* mplane fuzz targets: what every harness shares. Each target is a libFuzzer program
 * (LLVMFuzzerTestOneInput) over one parser surface; tests/fuzz/meson.build builds them with clang
 * and runs each for a few seconds on its seed corpus (tests/fuzz/corpus/<target>/). A property a
 * parser must keep is checked with FUZZ_REQUIRE: a violation aborts, and libFuzzer saves the input. */
#ifndef MPLANE_FUZZ_UTIL_H
#define MPLANE_FUZZ_UTIL_H

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"

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

/* libFuzzer's timeout alarm (SIGALRM, installed without SA_RESTART) interrupts a blocking call of a
 * target. A connect() cut short goes on in the kernel: wait for it and read its result; a send() cut
 * short is resumed where it stopped. Both return 0 or -1 with errno set. */
static inline int fuzz_connect(int fd, const struct sockaddr *sa, socklen_t len) {
  if (connect(fd, sa, len) == 0) return 0;
  if (errno != EINTR && errno != EINPROGRESS) return -1;
  struct pollfd p = {.fd = fd, .events = POLLOUT};
  int n;
  do n = poll(&p, 1, 5000); /* a loaded host defers loopback softirqs; a full backlog resends SYN after 1 s */
  while (n < 0 && errno == EINTR);
  if (n == 0) errno = ETIMEDOUT;
  if (n <= 0) return -1;
  int err = 0;
  socklen_t el = sizeof(err);
  if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) != 0) return -1;
  errno = err;
  return err ? -1 : 0;
}

static inline int fuzz_send_all(int fd, const void *buf, size_t len) {
  size_t done = 0;
  while (done < len) {
    ssize_t w = send(fd, (const char *)buf + done, len - done, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    done += (size_t)w;
  }
  return 0;
}

/* A flood of strangers on a listener: FUZZ_FLOOD sockets that each sent a few bytes and stay open,
 * as many as the listener's table of pending connections holds. The pool lives across inputs: a
 * listener makes room by dropping its oldest strangers (closing them), so each flooded input opens
 * only as many new ones as were dropped since, and the rest are old enough to be dropped at once -
 * an input that wants a full table then costs milliseconds, not the second a young stranger keeps
 * its slot. */
#define FUZZ_FLOOD 64
struct fuzz_flood {
  int fd[FUZZ_FLOOD];
  int n;
};

/* Close the pool's sockets the listener dropped, then open new ones up to FUZZ_FLOOD, each sending
 * the first nbytes of bytes. 0, or -1 where a connect failed (errno says why). */
static inline int fuzz_flood_fill(struct fuzz_flood *f, const struct sockaddr *sa, socklen_t len, const void *bytes,
                                  size_t nbytes) {
  for (int i = 0; i < f->n;) {
    char c;
    ssize_t r = recv(f->fd[i], &c, 1, MSG_PEEK | MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
      close(f->fd[i]);
      f->fd[i] = f->fd[--f->n];
      continue;
    }
    i++;
  }
  while (f->n < FUZZ_FLOOD) {
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0 || fuzz_connect(fd, sa, len) != 0) {
      if (fd >= 0) close(fd);
      return -1;
    }
    if (nbytes) fuzz_send_all(fd, bytes, nbytes);
    f->fd[f->n++] = fd;
  }
  return 0;
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
 * the run down. With FUZZ_TRACE set they go to stderr, beside what became of each input. */
static void fuzz_quiet_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                              const char *fmt, ...) {
  (void)flags, (void)file, (void)line;
  if (level != NCCL_LOG_WARN || !getenv("FUZZ_TRACE")) return;
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "  WARN ");
  vfprintf(stderr, fmt, ap);
  fputc('\n', stderr);
  va_end(ap);
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
