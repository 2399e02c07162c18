/* mplane ABI harness: the basics, on any transport. Rank 0 and rank 1 run the same code unless said.
 *
 *   props         init per communicator, devices, getProperties twice alike, bad device numbers
 *   sizes         0 B .. 64 MiB each way into exact and bigger buffers, a late receiver, iflush
 *   inflight      32 requests in flight each way, all posted before any test
 *   inflight-max  32 x maxRecvs sends in flight against 32 multi-buffer receives
 *   multirecv     tagged multi-recv: distinct tags, sends in shuffled tag order
 *   reload        3 x (dlopen, init, data, finalize, dlclose), as NCCL 2.28 reloads its net plugin
 *   reconnect     50 x (init, connect both ways, data, close, finalize): no fd or thread leaks */
#include <dirent.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"

int sc_props(void) {
  struct node nd;
  node_open(&nd, 11);
  void *ctx1 = NULL, *ctx2 = NULL;
  ncclNetCommConfig_v11_t cfg = {.trafficClass = 3};
  (void)cfg;
  if (abi_init(&nd.net, 0xabc1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx1) != ncclSuccess) abi_fail("init (comm 1) failed");
  if (abi_init(&nd.net, 0xabc2, 3, &ctx2) != ncclSuccess) abi_fail("init (comm 2, traffic class 3) failed");
  int n1 = 0, n2 = 0;
  if (abi_devices(&nd.net, &n1) != ncclSuccess || n1 < 1) abi_fail("devices: %d", n1);
  if (abi_devices(&nd.net, &n2) != ncclSuccess || n2 != n1) abi_fail("devices changed: %d then %d", n1, n2);
  for (int d = 0; d < n1; d++) {
    struct abi_props p, q;
    if (abi_get_props(&nd.net, d, &p) != ncclSuccess) abi_fail("getProperties(%d) failed", d);
    check_props(&p, d, 11);
    char name[256];
    snprintf(name, sizeof(name), "%s", p.name);
    if (abi_get_props(&nd.net, d, &q) != ncclSuccess) abi_fail("getProperties(%d) failed the second time", d);
    if (strcmp(p.name, name) || strcmp(q.name, name) || p.guid != q.guid || p.speed != q.speed)
      abi_fail("dev %d: properties differ between two calls", d);
    for (int e = 0; e < d; e++) {
      struct abi_props o;
      abi_get_props(&nd.net, e, &o);
      if (!strcmp(o.name, p.name)) abi_fail("devs %d and %d have the same name %s", e, d, p.name);
    }
    abi_note("dev %d: %s speed %d Mb/s ptr 0x%x maxRecvs %d maxComms %d maxP2pBytes %zu pci %s", d, p.name, p.speed,
             p.ptr_support, p.max_recvs, p.max_comms, p.max_p2p_bytes, p.pci_path ? p.pci_path : "(none)");
  }
  /* a device that does not exist is an error, not a crash */
  size_t mark = abi_log_mark();
  struct abi_props bad;
  if (abi_get_props(&nd.net, n1, &bad) == ncclSuccess) abi_fail("getProperties(%d) of %d devices succeeded", n1, n1);
  if (abi_get_props(&nd.net, -1, &bad) == ncclSuccess) abi_fail("getProperties(-1) succeeded");
  unsigned char h[HANDLE_SIZE];
  void *lc = NULL;
  if (abi_listen(&nd.net, ctx1, n1, h, &lc) == ncclSuccess) abi_fail("listen on device %d of %d succeeded", n1, n1);
  if (!abi_log_warn_has(mark, "device", NULL)) abi_fail("no WARN about the device that does not exist");
  /* two communicators listen at once, on their own contexts */
  unsigned char h1[HANDLE_SIZE], h2[HANDLE_SIZE];
  void *lc1 = NULL, *lc2 = NULL;
  if (abi_listen(&nd.net, ctx1, 0, h1, &lc1) != ncclSuccess || !lc1) abi_fail("listen (comm 1) failed");
  if (abi_listen(&nd.net, ctx2, 0, h2, &lc2) != ncclSuccess || !lc2) abi_fail("listen (comm 2) failed");
  if (!memcmp(h1, h2, HANDLE_SIZE)) abi_fail("two listens gave the same handle");
  abi_close_listen(&nd.net, lc1);
  abi_close_listen(&nd.net, lc2);
  if (abi_finalize(&nd.net, ctx1) != ncclSuccess || abi_finalize(&nd.net, ctx2) != ncclSuccess)
    abi_fail("finalize failed");
  return 0;
}

static const size_t k_sizes[] = {0, 1, 4095, 4096, (1 << 20) + 3, 64 << 20};

int sc_sizes(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  /* each size twice: into a buffer of exactly its size, then into a bigger one */
  size_t n = sizeof(k_sizes) / sizeof(k_sizes[0]);
  size_t sizes[2 * sizeof(k_sizes) / sizeof(k_sizes[0])];
  for (size_t i = 0; i < n; i++) sizes[i] = sizes[n + i] = k_sizes[i];
  struct xfer_spec exact = {.sizes = sizes, .count = (int)n, .slack = 0, .group = 1, .iflush = 1, .seed = 1};
  exchange(&nd, &l, rank, pp.fd, &exact, "sizes, exact buffers");
  struct xfer_spec roomy = {.sizes = sizes + n, .count = (int)n, .slack = 4099, .group = 1, .seed = 2};
  exchange(&nd, &l, rank, pp.fd, &roomy, "sizes, bigger buffers");
  struct xfer_spec late = {.sizes = sizes, .count = (int)n, .slack = 0, .group = 1, .late_recv = 1, .seed = 3};
  exchange(&nd, &l, rank, pp.fd, &late, "sizes, receiver posts late");
  /* memory the transport cannot take is refused at regMr, not discovered later */
  if (!(nd.props.ptr_support & NCCL_PTR_CUDA)) {
    char buf[64];
    void *mh = NULL;
    if (abi_reg_mr(&nd.net, l.sc, buf, sizeof(buf), NCCL_PTR_CUDA, &mh) == ncclSuccess)
      abi_fail("regMr of CUDA memory succeeded on a device without NCCL_PTR_CUDA");
  }
  barrier(pp.fd);
  return pair_down(&pp, rank, &nd, &l);
}

int sc_inflight(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  size_t sizes[MAX_INFLIGHT];
  rng_seed(11);
  for (int i = 0; i < MAX_INFLIGHT; i++) sizes[i] = i % 4 == 3 ? (size_t)(rng() % (3 << 20)) : rng() % 70000;
  sizes[0] = 0;
  struct xfer_spec x = {.sizes = sizes, .count = MAX_INFLIGHT, .slack = 17, .group = 1, .flags = RUN_POST_ALL_FIRST, .seed = 12};
  for (int round = 0; round < 3; round++) exchange(&nd, &l, rank, pp.fd, &x, "32 requests in flight");
  return pair_down(&pp, rank, &nd, &l);
}

int sc_inflight_max(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  int group = recv_group(&nd);
  int count = MAX_INFLIGHT * group;
  size_t *sizes = calloc((size_t)count, sizeof(size_t));
  rng_seed(21);
  for (int i = 0; i < count; i++) sizes[i] = i % 37 == 5 ? 300000 + rng() % 100000 : rng() % 9000;
  struct xfer_spec x = {.sizes = sizes, .count = count, .slack = 0, .group = group, .flags = RUN_POST_ALL_FIRST, .seed = 22};
  char what[96];
  snprintf(what, sizeof(what), "%d sends in flight against %d receives of %d buffers", count, MAX_INFLIGHT, group);
  exchange(&nd, &l, rank, pp.fd, &x, what);
  exchange(&nd, &l, rank, pp.fd, &x, what);
  free(sizes);
  return pair_down(&pp, rank, &nd, &l);
}

int sc_multirecv(void) {
  struct pair pp;
  struct node nd;
  struct link l;
  int rank = pair_up(&pp, &nd, &l);
  int group = recv_group(&nd);
  if (group < 8) abi_note("maxRecvs is %d: groups of %d", nd.props.max_recvs, group);
  int groups = 24, count = groups * group;
  size_t *sizes = calloc((size_t)count, sizeof(size_t));
  rng_seed(31);
  for (int i = 0; i < count; i++) {
    int t = i % group;
    sizes[i] = t == 0 ? 0 : t == 1 ? 1 : t == 2 ? (size_t)(300000 + rng() % 2000000) : rng() % 50000;
  }
  struct xfer_spec x = {.sizes = sizes, .count = count, .slack = 100, .group = group, .seed = 32};
  exchange(&nd, &l, rank, pp.fd, &x, "tagged multi-recv, shuffled tags");
  x.flags = RUN_POST_ALL_FIRST;
  x.seed = 33;
  exchange(&nd, &l, rank, pp.fd, &x, "tagged multi-recv, all posted first");
  free(sizes);
  return pair_down(&pp, rank, &nd, &l);
}

/* NCCL 2.28 dlcloses a net plugin once its last communicator is gone and may dlopen it again for
 * a later one. The plugin's threads (IB async events, socket helpers) must not run unmapped code
 * after that, and a second open must work: three rounds of open, init, connect both ways, data,
 * close, finalize, dlclose, with a pause after each dlclose for any stray thread to wake. */
int sc_reload(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  for (int round = 0; round < 3; round++) {
    struct node nd;
    node_up(&nd, g_opts.version);
    struct link l;
    link_up(&nd, pp.fd, &l);
    size_t sizes[3] = {0, 4096, (1 << 20) + 5};
    struct xfer_spec x = {.sizes = sizes, .count = 3, .slack = 64, .group = 1, .seed = 40u + (unsigned)round};
    exchange(&nd, &l, rank, pp.fd, &x, "data after a reload");
    link_down(&nd, &l);
    node_down(&nd);
    abi_net_close(&nd.net);
    usleep(300000); /* a thread of the plugin still running would crash here */
    barrier(pp.fd);
  }
  abi_note("3 rounds of dlopen, init, data, finalize, dlclose");
  return pair_finish(&pp, rank);
}

static int count_dir(const char *path) {
  DIR *d = opendir(path);
  if (!d) return -1;
  int n = 0;
  while (readdir(d)) n++;
  closedir(d);
  return n;
}

int sc_reconnect(void) {
  struct pair pp;
  int rank = pair_fork(&pp);
  struct node nd;
  node_up(&nd, g_opts.version);
  const int iters = 50;
  int fds0 = -1, threads0 = -1;
  for (int it = 0; it < iters; it++) {
    /* a communicator per iteration: init, connect both ways, move bytes, close, finalize */
    void *ctx = NULL;
    if (abi_init(&nd.net, 0x5000 + (uint64_t)it, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) != ncclSuccess) abi_fail("init %d failed", it);
    struct link l;
    link_up_with(&nd, ctx, pp.fd, &l);
    size_t sizes[2] = {1000 + (size_t)it, it % 5 == 0 ? (size_t)(1 << 20) + (size_t)it : 5};
    struct xfer_spec x = {.sizes = sizes, .count = 2, .group = 1, .seed = 100 + (uint32_t)it};
    exchange(&nd, &l, rank, pp.fd, &x, "reconnect");
    if (it % 10 == 9) {
      /* NCCL may close with a receive still posted (abort): close must not hang or crash */
      char buf[256];
      size_t sz = sizeof(buf);
      int tag = 77;
      void *data = buf, *mh = NULL, *req = NULL;
      reg(&nd, l.rc, buf, sizeof(buf), &mh);
      req = post_recv(&nd, l.rc, 1, &data, &sz, &tag, &mh);
      int done = 0;
      if (abi_test(&nd.net, req, &done, NULL) != ncclSuccess || done) abi_fail("a receive nobody sends to completed");
      barrier(pp.fd);
      dereg(&nd, l.rc, mh);
    }
    link_down(&nd, &l);
    if (abi_finalize(&nd.net, ctx) != ncclSuccess) abi_fail("finalize %d failed", it);
    barrier(pp.fd);
    if (it == 0) {
      fds0 = count_dir("/proc/self/fd");
      threads0 = count_dir("/proc/self/task");
    }
  }
  /* the peer may still be tearing down its side: give sockets/threads a moment */
  int fds = 0, threads = 0;
  for (int i = 0; i < 50; i++) {
    fds = count_dir("/proc/self/fd");
    threads = count_dir("/proc/self/task");
    if (fds <= fds0 && threads <= threads0) break;
    usleep(20000);
  }
  if (fds > fds0) abi_fail("%d open file descriptors after %d connect/close rounds, %d after the first: a leak", fds, iters, fds0);
  if (threads > threads0) abi_fail("%d threads after %d connect/close rounds, %d after the first: a leak", threads, iters, threads0);
  abi_note("%d connect/close rounds; %d fds and %d threads before and after", iters, fds0, threads0);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

