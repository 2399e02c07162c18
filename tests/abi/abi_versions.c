/* mplane ABI harness: table versions and configuration, on any transport.
 *
 *   bad-config     invalid MPLANE_* values: init fails through v11, v8 and v12 with a WARN naming the
 *                  variable, the value and the accepted form
 *   v8, v9, v10, v12  another ncclNet table end to end: properties as v11's, sizes, a multi-recv group
 *                  (v12: planeId and the listen handle's plane from MPLANE_PLANES)
 *   threads        3 communicators per process, each on its own thread, concurrently */
#include <pthread.h>
#include <sys/wait.h>
#include <errno.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "abi_harness.h"
#include "net/handle.h"

/* Invalid configuration: init fails, and the WARN names the variable, the value and the accepted
 * form. Each case in its own process (configuration is read once per process), for two tables. */
int sc_bad_config(void) {
  const struct {
    const char *var, *value, *form, *extra_var, *extra_value;
  } cases[] = {
      {"MPLANE_SOCKET_STREAMS", "abc", "0 (automatic) or an integer from 1 to 16", NULL, NULL},
      {"MPLANE_SOCKET_STREAMS", "17", "0 (automatic) or an integer from 1 to 16", NULL, NULL},
      {"MPLANE_SOCKET_THREADS", "-1", "0 (automatic) or an integer from 1 to 64", NULL, NULL},
      {"MPLANE_SOCKET_CHUNK_BYTES", "1K", "from 4K to 1G", NULL, NULL},
      {"MPLANE_SOCKET_SPLIT_BYTES", "1T", "K/M/G", NULL, NULL},
      {"MPLANE_TRANSPORT", "tcp", "auto, ib or socket", NULL, NULL},
      {"MPLANE_CONNECT_TIMEOUT", "-5", "1 to 3600", NULL, NULL},
      /* no device at all: init fails too, naming the variable that selected nothing */
      {"MPLANE_SOCKET_IFNAME", "=nosuchif9", "MPLANE_SOCKET_IFNAME", "MPLANE_TRANSPORT", "socket"},
  };
  const int versions[] = {11, 8, 12};
  for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++) {
    for (size_t v = 0; v < sizeof(versions) / sizeof(versions[0]); v++) {
      fflush(NULL);
      pid_t pid = fork();
      if (pid < 0) abi_fail("fork: %s", strerror(errno));
      if (pid == 0) {
        setenv(cases[c].var, cases[c].value, 1);
        if (cases[c].extra_var) setenv(cases[c].extra_var, cases[c].extra_value, 1);
        struct node nd;
        node_open(&nd, versions[v]);
        size_t mark = abi_log_mark();
        void *ctx = NULL;
        ncclResult_t res = abi_init(&nd.net, 1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx);
        if (res == ncclSuccess) abi_fail("v%d init succeeded with %s='%s'", versions[v], cases[c].var, cases[c].value);
        if (!abi_log_warn_has(mark, cases[c].var, cases[c].value, cases[c].form, NULL)) {
          abi_log_dump(mark, "init failed, but not with the expected WARN");
          abi_fail("v%d: no WARN naming %s, '%s' and '%s'", versions[v], cases[c].var, cases[c].value, cases[c].form);
        }
        /* NCCL may try again (another communicator): still a failure, not a crash */
        if (abi_init(&nd.net, 2, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) == ncclSuccess) abi_fail("second init succeeded");
        fflush(NULL);
        _exit(0);
      }
      int st = 0;
      waitpid(pid, &st, 0);
      if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) abi_fail("case %s='%s' (v%d) failed", cases[c].var, cases[c].value, versions[v]);
    }
    abi_note("%s='%s': init fails with the WARN, through v11, v8 and v12", cases[c].var, cases[c].value);
  }
  return 0;
}

/* The name of device `dev`, from a throw-away process (this one must not init before its env is set). */
static void probe_dev_name(int dev, char *out, size_t len) {
  int pfd[2];
  if (pipe(pfd) != 0) abi_fail("pipe: %s", strerror(errno));
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    struct node nd;
    node_up(&nd, 11);
    struct abi_props p;
    abi_get_props(&nd.net, dev, &p);
    char name[256] = {0};
    snprintf(name, sizeof(name), "%s", p.name);
    ssize_t w = write(pfd[1], name, sizeof(name));
    _exit(w == (ssize_t)sizeof(name) ? 0 : 1);
  }
  close(pfd[1]);
  char name[256] = {0};
  ssize_t r = read(pfd[0], name, sizeof(name));
  close(pfd[0]);
  int st = 0;
  waitpid(pid, &st, 0);
  if (r != (ssize_t)sizeof(name) || !WIFEXITED(st) || WEXITSTATUS(st) != 0) abi_fail("could not probe the device name");
  snprintf(out, len, "%s", name);
}

/* Another table version end to end: properties agree with v11's, connect both ways, sizes, one
 * multi-recv group with shuffled tags, close. */
static int version_scenario(int version) {
  /* v12 reports planes: name one with MPLANE_PLANES (unless the user did) and check it comes back in
   * planeId and in the listen handle */
  int want_plane = version == 12 && !getenv("MPLANE_PLANES") ? 5 : -2;
  struct pair pp;
  int rank = pair_fork(&pp);
  if (want_plane != -2) {
    /* each rank names its own device: the two may differ (MPLANE_ABI_RANK<r>_ENV) */
    char name[256], spec[300];
    probe_dev_name(g_opts.dev, name, sizeof(name));
    snprintf(spec, sizeof(spec), "%s=%d", name, want_plane);
    setenv("MPLANE_PLANES", spec, 1);
  }
  struct node nd;
  node_up(&nd, version);
  if (want_plane != -2) {
    if (nd.props.plane_id != want_plane)
      abi_fail("MPLANE_PLANES=%s but v12 getProperties says planeId %d", getenv("MPLANE_PLANES"), nd.props.plane_id);
    unsigned char h[HANDLE_SIZE];
    void *lc = NULL;
    struct mplane_handle mh;
    char why[256];
    if (abi_listen(&nd.net, nd.ctx, nd.dev, h, &lc) != ncclSuccess) abi_fail("listen failed");
    if (mplane_handle_decode(h, &mh, why, sizeof(why)) != ncclSuccess) abi_fail("our listen handle: %s", why);
    if (mh.plane != want_plane) abi_fail("MPLANE_PLANES=%s but the listen handle carries plane %d", getenv("MPLANE_PLANES"), mh.plane);
    abi_close_listen(&nd.net, lc);
  }
  struct abi_net v11;
  abi_net_open(&v11, g_opts.plugin, 11);
  for (int d = 0; d < nd.ndev; d++) {
    struct abi_props p, q;
    if (abi_get_props(&nd.net, d, &p) != ncclSuccess || abi_get_props(&v11, d, &q) != ncclSuccess) abi_fail("getProperties(%d)", d);
    check_props(&p, d, version);
    if (strcmp(p.name, q.name) || p.guid != q.guid || p.ptr_support != q.ptr_support || p.speed != q.speed ||
        p.port != q.port || p.max_comms != q.max_comms || p.max_recvs != q.max_recvs ||
        p.reg_is_global != q.reg_is_global || p.latency != q.latency ||
        (p.pci_path == NULL) != (q.pci_path == NULL) || (p.pci_path && strcmp(p.pci_path, q.pci_path)))
      abi_fail("dev %d: v%d properties differ from v11's", d, version);
    if (version >= 9 && (p.max_p2p_bytes != q.max_p2p_bytes || p.max_coll_bytes != q.max_coll_bytes || p.force_flush != q.force_flush))
      abi_fail("dev %d: v%d size limits differ from v11's", d, version);
    if (version == 12) abi_note("dev %d (%s): planeId %d railId %d", d, p.name, p.plane_id, p.rail_id);
  }
  struct link l;
  link_up(&nd, pp.fd, &l);
  size_t sizes[] = {0, 1, 4095, 4096, (1 << 20) + 3, 8 << 20};
  struct xfer_spec x = {.sizes = sizes, .count = 6, .slack = 5, .group = 1, .seed = 50 + (uint32_t)version};
  exchange(&nd, &l, rank, pp.fd, &x, "sizes");
  int group = recv_group(&nd);
  size_t gs[OP_BUFS * 2];
  for (int i = 0; i < 2 * group; i++) gs[i] = i == 1 ? 600000 : (size_t)(i * 1001);
  struct xfer_spec g = {.sizes = gs, .count = 2 * group, .slack = 0, .group = group, .seed = 60 + (uint32_t)version};
  exchange(&nd, &l, rank, pp.fd, &g, "multi-recv");
  link_down(&nd, &l);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

int sc_v8(void) { return version_scenario(8); }
int sc_v9(void) { return version_scenario(9); }
int sc_v10(void) { return version_scenario(10); }
int sc_v12(void) { return version_scenario(12); }

/* Several communicators in one process, each driven by its own thread at the same time, as NCCL
 * runs one proxy thread per communicator: init, connect both ways, sizes, a multi-recv group,
 * close, finalize, concurrently. */
#define NTHREADS 3

struct thread_arg {
  struct node *nd;
  int rank, fd, index;
  pthread_t tid;
};

static void *comm_thread(void *p) {
  struct thread_arg *a = p;
  struct node *nd = a->nd;
  void *ctx = NULL;
  if (abi_init(&nd->net, 0x7000 + (uint64_t)a->index, a->index, &ctx) != ncclSuccess) abi_fail("thread %d: init failed", a->index);
  for (int round = 0; round < 3; round++) {
    struct link l;
    link_up_with(nd, ctx, a->fd, &l);
    size_t sizes[] = {0, 4096, (1 << 20) + 3 + (size_t)a->index, (6 << 20) + (size_t)round};
    struct xfer_spec x = {.sizes = sizes, .count = 4, .slack = 1, .group = 1, .seed = 400 + (uint32_t)(a->index * 10 + round)};
    char what[64];
    snprintf(what, sizeof(what), "thread %d round %d", a->index, round);
    exchange(nd, &l, a->rank, a->fd, &x, what);
    int group = recv_group(nd);
    size_t gs[OP_BUFS];
    for (int i = 0; i < group; i++) gs[i] = (size_t)(i * 3000 + a->index);
    struct xfer_spec g = {.sizes = gs, .count = group, .group = group, .seed = 500 + (uint32_t)(a->index * 10 + round)};
    exchange(nd, &l, a->rank, a->fd, &g, what);
    link_down(nd, &l);
  }
  if (abi_finalize(&nd->net, ctx) != ncclSuccess) abi_fail("thread %d: finalize failed", a->index);
  return NULL;
}

int sc_threads(void) {
  struct pair pp;
  int rank = pair_fork_chans(&pp, NTHREADS);
  struct node nd;
  node_up(&nd, g_opts.version);
  struct thread_arg args[NTHREADS];
  for (int t = 0; t < NTHREADS; t++) {
    args[t] = (struct thread_arg){.nd = &nd, .rank = rank, .fd = pp.chan[t], .index = t};
    if (pthread_create(&args[t].tid, NULL, comm_thread, &args[t]) != 0) abi_fail("pthread_create");
  }
  for (int t = 0; t < NTHREADS; t++) pthread_join(args[t].tid, NULL);
  barrier(pp.fd);
  node_down(&nd);
  return pair_finish(&pp, rank);
}

