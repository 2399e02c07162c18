/* HFReduce's bootstrap: a unique id names a root (a TCP listener and a thread in the process that
 * made the id); every rank sends the root its record and gets every rank's back. The id travels out
 * of band, as NCCL's ncclUniqueId does (a file, an MPI broadcast, torch.distributed). */
#include "hfr.h"

#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/log.h"

#define HFR_ID_MAGIC 0x4846526564756365ull /* "HFReduce" */

struct hfr_id {
  uint64_t id_magic;
  uint64_t magic;                  /* this communicator's: the records and shared memory carry it */
  struct sockaddr_in root;      /* IPv4: the bootstrap needs one address every node reaches */
};
_Static_assert(sizeof(struct hfr_id) <= MPLANE_HFREDUCE_UNIQUE_ID_BYTES, "unique id too small");

/* The root's answer before the records: 0, or a reason the communicator cannot be made. */
struct hfr_boot_status {
  int32_t status;
  char msg[256];
};

static int send_all(int fd, const void *buf, size_t len, uint64_t deadline) {
  const char *p = buf;
  while (len) {
    ssize_t n = send(fd, p, len, MSG_NOSIGNAL);
    if (n > 0) {
      p += n;
      len -= (size_t)n;
      continue;
    }
    if (n < 0 && errno != EAGAIN && errno != EINTR) return -1;
    if (mplane_now_ns() > deadline) return -1;
    struct pollfd pfd = {.fd = fd, .events = POLLOUT};
    poll(&pfd, 1, 100);
  }
  return 0;
}

static int recv_all(int fd, void *buf, size_t len, uint64_t deadline) {
  char *p = buf;
  while (len) {
    struct pollfd pfd = {.fd = fd, .events = POLLIN};
    if (poll(&pfd, 1, 100) == 0) {
      if (mplane_now_ns() > deadline) return -1;
      continue;
    }
    ssize_t n = recv(fd, p, len, 0);
    if (n == 0) return -1;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return -1;
    }
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

/* Does interface `name` pass MPLANE_SOCKET_IFNAME (prefixes; ^ excludes; = exact)? "" passes all but lo. */
static int ifname_ok(const char *spec, const char *name) {
  if (!spec[0]) return strncmp(name, "lo", 2) != 0;
  int exclude = spec[0] == '^', exact = spec[exclude] == '=';
  const char *p = spec + exclude + exact;
  int match = 0;
  while (*p) {
    const char *e = strchr(p, ',');
    size_t len = e ? (size_t)(e - p) : strlen(p);
    const char *colon = memchr(p, ':', len);
    if (colon) len = (size_t)(colon - p);
    if (exact ? (strlen(name) == len && strncmp(name, p, len) == 0) : strncmp(name, p, len) == 0) match = 1;
    p += e ? (size_t)(e - p) + 1 : strlen(p);
  }
  return exclude ? !match : match;
}

/* The root's address: the first IPv4 address of an interface MPLANE_SOCKET_IFNAME allows (the
 * socket transport's rule), else loopback. */
static void root_address(const struct mplane_config *cfg, struct sockaddr_in *out) {
  memset(out, 0, sizeof(*out));
  out->sin_family = AF_INET;
  out->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  struct ifaddrs *ifs = NULL;
  if (getifaddrs(&ifs) != 0) return;
  for (struct ifaddrs *i = ifs; i; i = i->ifa_next) {
    if (!i->ifa_addr || i->ifa_addr->sa_family != AF_INET || !(i->ifa_flags & IFF_UP)) continue;
    if (!ifname_ok(cfg ? cfg->socket_ifname : "", i->ifa_name)) continue;
    out->sin_addr = ((struct sockaddr_in *)i->ifa_addr)->sin_addr;
    break;
  }
  freeifaddrs(ifs);
}

struct root_args {
  int fd;
  uint64_t magic;
  int timeout_s;
};

static void root_reply(int *fds, int n, const struct hfr_boot_status *st, const struct hfr_boot_rec *recs,
                       int nranks, uint64_t deadline) {
  for (int i = 0; i < n; i++) {
    if (fds[i] < 0) continue;
    if (send_all(fds[i], st, sizeof(*st), deadline) == 0 && st->status == 0)
      send_all(fds[i], recs, sizeof(*recs) * (size_t)nranks, deadline);
  }
}

/* After the records, all-gathers of a block each rank names the size of (hfr_boot_allgather), until
 * the ranks close their connections (the end of comm_init) or one goes silent. */
static void serve_rounds(int *fds, int nranks, int timeout_s) {
  char *all = NULL;
  for (;;) {
    uint64_t deadline = mplane_now_ns() + (uint64_t)timeout_s * 1000000000ull;
    uint32_t size = 0;
    for (int i = 0; i < nranks; i++) {
      uint32_t s;
      if (recv_all(fds[i], &s, sizeof(s), deadline) != 0 || (i > 0 && s != size) || s > (1u << 20)) {
        free(all);
        return;
      }
      if (i == 0) {
        size = s;
        free(all);
        all = malloc((size_t)size * (size_t)nranks + 1);
        if (!all) return;
      }
      if (recv_all(fds[i], all + (size_t)i * size, size, deadline) != 0) {
        free(all);
        return;
      }
    }
    for (int i = 0; i < nranks; i++) send_all(fds[i], all, (size_t)size * (size_t)nranks, deadline);
  }
}

/* The root thread: accept every rank, check the records agree, send them all back. */
static void *root_main(void *arg) {
  struct root_args a = *(struct root_args *)arg;
  free(arg);
  uint64_t deadline = mplane_now_ns() + (uint64_t)a.timeout_s * 1000000000ull;
  int nranks = -1, got = 0, *fds = NULL;
  struct hfr_boot_rec *recs = NULL;
  struct hfr_boot_status st = {0};
  while (nranks < 0 || got < nranks) {
    struct pollfd pfd = {.fd = a.fd, .events = POLLIN};
    if (poll(&pfd, 1, 100) <= 0) {
      if (mplane_now_ns() > deadline) {
        st.status = ncclSystemError;
        snprintf(st.msg, sizeof(st.msg), "bootstrap: %d of %d ranks joined within MPLANE_CONNECT_TIMEOUT=%d s", got,
                 nranks, a.timeout_s);
        MP_WARN("hfreduce: %s", st.msg);
        break;
      }
      continue;
    }
    int fd = accept4(a.fd, NULL, NULL, SOCK_CLOEXEC);
    if (fd < 0) continue;
    struct hfr_boot_rec r;
    if (recv_all(fd, &r, sizeof(r), deadline) != 0 || r.magic != a.magic) {
      close(fd); /* not one of ours, or gone */
      continue;
    }
    if (nranks < 0) {
      if (r.nranks <= 0 || r.nranks > (1 << 20)) {
        close(fd);
        continue;
      }
      nranks = r.nranks;
      fds = malloc(sizeof(int) * (size_t)nranks);
      recs = calloc((size_t)nranks, sizeof(*recs));
      if (!fds || !recs) break;
      for (int i = 0; i < nranks; i++) fds[i] = -1;
    }
    if (r.nranks != nranks || r.rank < 0 || r.rank >= nranks || fds[r.rank] >= 0) {
      struct hfr_boot_status bad = {.status = ncclInvalidUsage};
      snprintf(bad.msg, sizeof(bad.msg), "bootstrap: rank %d of %d joined a communicator of %d ranks%s", r.rank,
               r.nranks, nranks, (r.rank >= 0 && r.rank < nranks && fds[r.rank] >= 0) ? " (that rank joined already)" : "");
      send_all(fd, &bad, sizeof(bad), deadline);
      close(fd);
      continue;
    }
    fds[r.rank] = fd;
    recs[r.rank] = r;
    got++;
  }
  if (st.status == 0 && recs) {
    for (int i = 1; i < nranks && st.status == 0; i++)
      if (recs[i].chunk_bytes != recs[0].chunk_bytes || recs[i].slots != recs[0].slots) {
        st.status = ncclInvalidUsage;
        snprintf(st.msg, sizeof(st.msg),
                 "rank %d has MPLANE_HFREDUCE_CHUNK_BYTES=%lld MPLANE_HFREDUCE_SLOTS=%d, rank 0 %lld and %d: every "
                 "rank must use the same", i, (long long)recs[i].chunk_bytes, recs[i].slots,
                 (long long)recs[0].chunk_bytes, recs[0].slots);
      }
  }
  if (fds) {
    root_reply(fds, nranks, &st, recs, nranks, deadline);
    if (st.status == 0) serve_rounds(fds, nranks, a.timeout_s);
    for (int i = 0; i < nranks; i++)
      if (fds[i] >= 0) close(fds[i]);
  }
  free(fds);
  free(recs);
  close(a.fd);
  return NULL;
}

int mplane_hfreduce_get_unique_id(mplane_hfreduce_unique_id *id) {
  if (!id) return hfr_fail(ncclInvalidArgument, "hfreduce: get_unique_id: id is NULL");
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg) return hfr_fail(ncclInvalidArgument, "hfreduce: the MPLANE_* configuration is invalid (see the WARN)");
  struct hfr_id h = {.id_magic = HFR_ID_MAGIC};
  if (getrandom(&h.magic, sizeof(h.magic), 0) != sizeof(h.magic)) h.magic = mplane_now_ns() ^ (uint64_t)getpid();
  struct sockaddr_in addr;
  root_address(cfg, &addr);
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  socklen_t len = sizeof(addr);
  if (fd < 0 || bind(fd, (struct sockaddr *)&addr, sizeof(addr)) != 0 || listen(fd, 4096) != 0 ||
      getsockname(fd, (struct sockaddr *)&addr, &len) != 0) {
    char a[64];
    inet_ntop(AF_INET, &addr.sin_addr, a, sizeof(a));
    if (fd >= 0) close(fd);
    return hfr_fail(ncclSystemError, "hfreduce: bootstrap root cannot listen on %s: %s", a, strerror(errno));
  }
  memcpy(&h.root, &addr, sizeof(addr));
  struct root_args *ra = malloc(sizeof(*ra));
  pthread_t t;
  pthread_attr_t attr;
  pthread_attr_init(&attr);
  pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
  if (!ra) {
    close(fd);
    return hfr_fail(ncclSystemError, "hfreduce: out of memory");
  }
  *ra = (struct root_args){.fd = fd, .magic = h.magic, .timeout_s = cfg->connect_timeout_s};
  if (pthread_create(&t, &attr, root_main, ra) != 0) {
    free(ra);
    close(fd);
    return hfr_fail(ncclSystemError, "hfreduce: cannot start the bootstrap root thread");
  }
  pthread_attr_destroy(&attr);
  memset(id, 0, sizeof(*id));
  memcpy(id->internal, &h, sizeof(h));
  return ncclSuccess;
}

uint64_t hfr_id_magic(const mplane_hfreduce_unique_id *id);
uint64_t hfr_id_magic(const mplane_hfreduce_unique_id *id) {
  struct hfr_id h;
  memcpy(&h, id->internal, sizeof(h));
  return h.id_magic == HFR_ID_MAGIC ? h.magic : 0;
}

int hfr_boot_exchange(const mplane_hfreduce_unique_id *id, struct hfr_boot_rec *mine, int nranks,
                      struct hfr_boot_rec *all, int timeout_s, int *fd_out) {
  struct hfr_id h;
  memcpy(&h, id->internal, sizeof(h));
  uint64_t deadline = mplane_now_ns() + (uint64_t)timeout_s * 1000000000ull;
  char where[64] = "?";
  inet_ntop(AF_INET, &((struct sockaddr_in *)&h.root)->sin_addr, where, sizeof(where));
  int port = ntohs(((struct sockaddr_in *)&h.root)->sin_port);
  int fd = -1;
  for (;;) { /* the root listens before the id exists; retry only what a busy host refuses */
    fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd >= 0 && connect(fd, (struct sockaddr *)&h.root, sizeof(struct sockaddr_in)) == 0) break;
    int err = errno;
    if (fd >= 0) close(fd);
    fd = -1;
    if (mplane_now_ns() > deadline || (err != ECONNREFUSED && err != EAGAIN && err != EINTR && err != ETIMEDOUT))
      return hfr_fail(ncclSystemError, "hfreduce: rank %d cannot reach the bootstrap root at %s:%d: %s", mine->rank,
                      where, port, strerror(err));
    usleep(20000);
  }
  struct hfr_boot_status st;
  if (send_all(fd, mine, sizeof(*mine), deadline) != 0 || recv_all(fd, &st, sizeof(st), deadline) != 0) {
    close(fd);
    return hfr_fail(ncclSystemError,
                    "hfreduce: rank %d: the bootstrap root at %s:%d did not answer within MPLANE_CONNECT_TIMEOUT=%d s "
                    "(did every one of the %d ranks call comm_init with this id?)", mine->rank, where, port, timeout_s,
                    nranks);
  }
  if (st.status != 0) {
    close(fd);
    st.msg[sizeof(st.msg) - 1] = 0;
    return hfr_fail(st.status, "hfreduce: rank %d: %s", mine->rank, st.msg);
  }
  int rc = recv_all(fd, all, sizeof(*all) * (size_t)nranks, deadline);
  if (rc != 0) {
    close(fd);
    return hfr_fail(ncclSystemError, "hfreduce: rank %d: the bootstrap root went away", mine->rank);
  }
  *fd_out = fd;
  return ncclSuccess;
}

int hfr_boot_allgather(int fd, int rank, const void *mine, uint32_t size, int nranks, void *all, int timeout_s) {
  uint64_t deadline = mplane_now_ns() + (uint64_t)timeout_s * 1000000000ull;
  if (send_all(fd, &size, sizeof(size), deadline) != 0 || send_all(fd, mine, size, deadline) != 0 ||
      recv_all(fd, all, (size_t)size * (size_t)nranks, deadline) != 0)
    return hfr_fail(ncclSystemError, "hfreduce: rank %d: bootstrap all-gather failed: a rank left comm_init or "
                    "took more than MPLANE_CONNECT_TIMEOUT=%d s", rank, timeout_s);
  return ncclSuccess;
}
