/* mplane: the control sockets of a one-sided group (see rma_ctrl.h). */
#include "rma_ctrl.h"

#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>
#include <sys/time.h>

#include "../common/log.h"

int mplane_rma_timeout_ms(const struct mplane_config *cfg) {
  int s = cfg && cfg->connect_timeout_s > 0 ? cfg->connect_timeout_s : 60;
  return s * 1000;
}

int mplane_rma_write_all(int fd, const void *buf, size_t n) {
  const char *p = buf;
  while (n) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) return -1;
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

int mplane_rma_read_all(int fd, void *buf, size_t n) {
  char *p = buf;
  size_t got = 0;
  while (got < n) {
    ssize_t r = recv(fd, p + got, n - got, 0);
    if (r < 0 && errno == EINTR) continue;
    if (r == 0) return got == 0 ? 1 : -1;
    if (r < 0) return -1;
    got += (size_t)r;
  }
  return 0;
}

int mplane_rma_listen_any_port(struct sockaddr_storage *sa, socklen_t *len) {
  if (sa->ss_family == AF_INET) ((struct sockaddr_in *)sa)->sin_port = 0;
  else ((struct sockaddr_in6 *)sa)->sin6_port = 0;
  int fd = socket(sa->ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  if (bind(fd, (struct sockaddr *)sa, *len) != 0 || listen(fd, 1024) != 0 ||
      getsockname(fd, (struct sockaddr *)sa, len) != 0) {
    int e = errno;
    close(fd);
    errno = e;
    return -1;
  }
  return fd;
}

void mplane_rma_set_timeouts(int fd, int ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
}

ncclResult_t mplane_rma_allgather(const int *ctrl, int rank, int nranks, const void *mine, void *all, size_t len,
                                  int timeout_ms, const char *what) {
  memcpy((char *)all + (size_t)rank * len, mine, len);
  for (int j = 0; j < nranks; j++)
    if (j != rank && mplane_rma_write_all(ctrl[j], mine, len) != 0) {
      MP_WARN("RMA %s: rank %d could not reach rank %d on the group's control socket: %s", what, rank, j,
              strerror(errno));
      return ncclRemoteError;
    }
  for (int j = 0; j < nranks; j++)
    if (j != rank && mplane_rma_read_all(ctrl[j], (char *)all + (size_t)j * len, len) != 0) {
      MP_WARN("RMA %s: rank %d heard nothing from rank %d on the group's control socket within %d s", what, rank,
              j, timeout_ms / 1000);
      return ncclRemoteError;
    }
  return ncclSuccess;
}

int mplane_rma_peer_connected(int rank, int nranks, int stride, int p) {
  return ((p - rank + nranks) % nranks) % stride == 0;
}
