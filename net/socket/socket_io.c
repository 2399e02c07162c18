/* mplane: blocking sends on a socket transport stream, what the data path (socket_data.c), the
 * splicer (socket_splice.c) and the one-sided connections (socket_rma_conn.c) write with. */
#include <errno.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include "socket.h"

int mps_sendv_all(int fd, struct iovec *iov, int n) { return mps_sendv_flags(fd, iov, n, 0); }

int mps_sendv_flags(int fd, struct iovec *iov, int n, int flags) {
  while (n > 0) {
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)n};
    ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | flags);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) return -1;
    while (n > 0 && (size_t)w >= iov->iov_len) {
      w -= (ssize_t)iov->iov_len;
      iov++;
      n--;
    }
    if (n > 0) {
      iov->iov_base = (char *)iov->iov_base + w;
      iov->iov_len -= (size_t)w;
    }
  }
  return 0;
}
