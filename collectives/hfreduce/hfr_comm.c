/* HFReduce's communicator: bootstrap, the node's shared memory, the tree links (docs/hfreduce.md). */
#include "hfr.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "common/clock.h"
#include "common/cuda.h"
#include "common/log.h"
#include "common/tc_map.h"
#include "net/dev_planes.h"
#include "net/tc.h"

static __thread char last_error[1024];

const char *mplane_hfreduce_last_error(void) { return last_error; }
int mplane_hfreduce_abi_version(void) { return MPLANE_HFREDUCE_ABI_VERSION; }

int hfr_fail(int res, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  va_end(ap);
  MP_WARN("%s", last_error);
  return res;
}

int hfr_fail_comm(struct mplane_hfreduce_comm *c, int res, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof(last_error), fmt, ap);
  va_end(ap);
  MP_WARN("%s", last_error);
  c->failed = 1;
  if (c->shm && !__atomic_load_n(&c->shm->abort, __ATOMIC_ACQUIRE)) {
    snprintf(c->shm->abort_msg, sizeof(c->shm->abort_msg), "%s", last_error);
    c->shm->abort_culprit = c->culprit >= 0 ? c->culprit : c->rank;
    c->shm->abort_sure = c->culprit_sure;
    __atomic_store_n(&c->shm->abort, 1, __ATOMIC_RELEASE);
  }
  return res;
}

const char *hfr_rank_name(struct mplane_hfreduce_comm *c, int rank, char *buf, size_t len) {
  snprintf(buf, len, "rank %d (node %d, host %s, pid %d)", rank, c->node_of[rank], c->recs[rank].host,
           c->recs[rank].pid);
  return buf;
}

/* ---- the transport, once per process ---- */

static pthread_once_t transport_once = PTHREAD_ONCE_INIT;
static const struct mplane_transport_ops *transport;
static int transport_ndev;
static struct mplane_dev_props *transport_props;

static char transport_error[1536]; /* why the devices' planes could not be resolved: bad input */

/* 0: the transport is up and its devices' planes resolved; -1: no usable device; -2: bad input
 * (MPLANE_PLANES, MPLANE_TOPO_FILE), said in transport_error: no other transport is tried. */
static int try_transport(const struct mplane_transport_ops *ops, const struct mplane_config *cfg) {
  if (!ops->init || ops->init(cfg) != ncclSuccess) return -1;
  int n = 0;
  if (ops->devices(&n) != ncclSuccess || n <= 0) {
    if (ops->finalize) ops->finalize();
    return -1;
  }
  transport_props = calloc((size_t)n, sizeof(*transport_props));
  if (!transport_props) return -1;
  for (int d = 0; d < n; d++) ops->get_properties(d, &transport_props[d]);
  /* The planes topo/ resolves from these facts, the node and MPLANE_PLANES, by the same call as the
   * plugin's: a transport's raw plane can differ, and a slice whose NIC is on another plane than its
   * peers' would need the relay, which hfreduce does not do. */
  if (mplane_topo_resolve_planes(transport_props, n, cfg, NULL, transport_error, sizeof(transport_error)) !=
      ncclSuccess) {
    if (ops->finalize) ops->finalize();
    free(transport_props);
    transport_props = NULL;
    return -2;
  }
  transport = ops;
  transport_ndev = n;
  return 0;
}

static void transport_init_once(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg) return;
  if (cfg->transport == MPLANE_TRANSPORT_IB || cfg->transport == MPLANE_TRANSPORT_AUTO) {
    int res = try_transport(&mplane_ib_ops, cfg);
    if (res == 0 || res == -2) return;
  }
  if (cfg->transport != MPLANE_TRANSPORT_IB) try_transport(&mplane_socket_ops, cfg);
}

/* Devices in plane order, rails within a plane, planes unknown last, a tie by index. */
static int before_in_plane_order(int a, int b) {
  const struct mplane_dev_props *x = &transport_props[a], *y = &transport_props[b];
  int px = x->plane < 0 ? INT_MAX : x->plane, py = y->plane < 0 ? INT_MAX : y->plane;
  if (px != py) return px < py;
  if (x->rail != y->rail) return x->rail < y->rail;
  return a < b;
}

/* The device of local rank `local`: the one topo/ put on plane `local` (so slice i travels on plane i
 * on every node and nothing is relayed). Where no device is on that plane (fewer planes than local
 * ranks, one plane with rails, planes with gaps), the local-th device in plane order (modulo their
 * number): the same on every node with the same planes, and ranks spread over the NICs rather than
 * doubled up on one. *by_plane says which. */
static int pick_device(int local, int *by_plane) {
  *by_plane = 1;
  for (int d = 0; d < transport_ndev; d++)
    if (transport_props[d].plane == local) return d;
  *by_plane = 0;
  int want = local % transport_ndev;
  for (int d = 0; d < transport_ndev; d++) {
    int rank_in_order = 0;
    for (int e = 0; e < transport_ndev; e++) rank_in_order += e != d && before_in_plane_order(e, d);
    if (rank_in_order == want) return d;
  }
  return want; /* not reached: the order is total */
}

/* ---- the node's shared memory ---- */

#define HFR_SHM_MAGIC 0x6866722d73686d31ull

static size_t round_up(size_t v, size_t a) { return (v + a - 1) / a * a; }

/* The NUMA node of the device's PCI function, -1 when unknown. */
static int device_numa_node(const struct mplane_dev_props *p) {
  if (!p->pci_path[0]) return -1;
  char path[300];
  snprintf(path, sizeof(path), "%s/numa_node", p->pci_path);
  FILE *f = fopen(path, "r");
  int node = -1;
  if (f) {
    if (fscanf(f, "%d", &node) != 1) node = -1;
    fclose(f);
  }
  return node;
}

/* Pages of [addr, addr + len) preferably on NUMA node `node` (the NIC's): the reduce reads and the
 * NIC's DMA then stay on its socket. Best effort: a kernel without NUMA support refuses, nothing else. */
static void place_near(void *addr, size_t len, int node) {
  if (node < 0 || node >= 64) return;
  unsigned long mask = 1ul << node;
  syscall(SYS_mbind, addr, len, 1 /* MPOL_PREFERRED */, &mask, 64ul, 0u);
}

static int shm_attach(struct mplane_hfreduce_comm *c, uint64_t magic, int numa) {
  size_t head = round_up(sizeof(struct hfr_shm_head), 4096);
  c->shm_bytes = head + (size_t)c->slots * (size_t)(c->nlocal + 1) * c->chunk_bytes;
  snprintf(c->shm_name, sizeof(c->shm_name), "/mplane-hfr-%016llx-%d", (unsigned long long)magic, c->node);
  uint64_t deadline = mplane_now_ns() + (uint64_t)c->timeout_s * 1000000000ull;
  int fd = -1;
  if (c->local == 0) {
    fd = shm_open(c->shm_name, O_CREAT | O_EXCL | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)c->shm_bytes) != 0) {
      int err = errno;
      if (fd >= 0) close(fd);
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: cannot make %zu bytes of shared memory %s: %s (/dev/shm "
                      "too small? lower MPLANE_HFREDUCE_CHUNK_BYTES or MPLANE_HFREDUCE_SLOTS)", c->rank, c->shm_bytes,
                      c->shm_name, strerror(err));
    }
  } else {
    for (;;) { /* the node's first rank makes it */
      fd = shm_open(c->shm_name, O_RDWR, 0600);
      struct stat st;
      if (fd >= 0 && fstat(fd, &st) == 0 && (size_t)st.st_size == c->shm_bytes) break;
      if (fd >= 0) close(fd);
      fd = -1;
      if (mplane_now_ns() > deadline)
        return hfr_fail(ncclSystemError, "hfreduce: rank %d: the shared memory %s of node %d (made by its rank %d) did "
                        "not appear within MPLANE_CONNECT_TIMEOUT=%d s", c->rank, c->shm_name, c->node,
                        c->column[c->node] - c->local, c->timeout_s);
      usleep(1000);
    }
  }
  void *p = mmap(NULL, c->shm_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return hfr_fail(ncclSystemError, "hfreduce: rank %d: mmap of %s failed: %s", c->rank,
                                       c->shm_name, strerror(errno));
  c->shm = p;
  c->data = (char *)p + head;
  if (c->local == 0) {
    place_near(c->data, c->shm_bytes - head, numa);
    __atomic_store_n(&c->shm->magic, HFR_SHM_MAGIC, __ATOMIC_RELEASE);
  } else {
    while (__atomic_load_n(&c->shm->magic, __ATOMIC_ACQUIRE) != HFR_SHM_MAGIC) {
      if (mplane_now_ns() > deadline) return hfr_fail(ncclSystemError, "hfreduce: rank %d: %s never got ready",
                                                      c->rank, c->shm_name);
      usleep(1000);
    }
  }
  c->shm->rank[c->local].pid = getpid();
  c->shm->rank[c->local].waits_for = -1;
  /* the last to come unlinks the name: nothing is left in /dev/shm however the ranks end */
  if (__atomic_add_fetch(&c->shm->attached, 1, __ATOMIC_ACQ_REL) == c->nlocal) {
    shm_unlink(c->shm_name);
    c->shm_unlinked = 1;
  }
  return ncclSuccess;
}

/* ---- nodes, columns, trees ---- */

static int group_nodes(struct mplane_hfreduce_comm *c) {
  int n = c->nranks;
  c->node_of = malloc(sizeof(int) * (size_t)n);
  int *count = calloc((size_t)n, sizeof(int)), *first = malloc(sizeof(int) * (size_t)n);
  if (!c->node_of || !count || !first) {
    free(count);
    free(first);
    return hfr_fail(ncclSystemError, "hfreduce: out of memory");
  }
  c->nnodes = 0;
  for (int r = 0; r < n; r++) {
    int node = -1;
    for (int k = 0; k < c->nnodes && node < 0; k++)
      if (strcmp(c->recs[first[k]].host, c->recs[r].host) == 0) node = k;
    if (node < 0) {
      node = c->nnodes++;
      first[node] = r;
    }
    c->node_of[r] = node;
    if (r == c->rank) c->local = count[node];
    count[node]++;
  }
  c->node = c->node_of[c->rank];
  c->nlocal = count[c->node];
  int bad = -1;
  for (int k = 0; k < c->nnodes; k++)
    if (count[k] != c->nlocal) bad = k;
  int res = ncclSuccess;
  if (bad >= 0)
    res = hfr_fail(ncclInvalidUsage, "hfreduce: rank %d: every node must hold the same number of ranks: host %s has "
                   "%d, host %s has %d", c->rank, c->recs[first[c->node]].host, c->nlocal, c->recs[first[bad]].host,
                   count[bad]);
  else if (c->nlocal > HFR_MAX_LOCAL)
    res = hfr_fail(ncclInvalidUsage, "hfreduce: rank %d: host %s has %d ranks; at most %d are supported", c->rank,
                   c->host, c->nlocal, HFR_MAX_LOCAL);
  if (res == ncclSuccess) {
    c->column = malloc(sizeof(int) * (size_t)c->nnodes);
    int *seen = calloc((size_t)c->nnodes, sizeof(int));
    if (!c->column || !seen) res = hfr_fail(ncclSystemError, "hfreduce: out of memory");
    for (int r = 0; res == ncclSuccess && r < n; r++)
      if (seen[c->node_of[r]]++ == c->local) c->column[c->node_of[r]] = r;
    free(seen);
  }
  free(count);
  free(first);
  return res;
}

static int link_of_node(struct mplane_hfreduce_comm *c, int node) {
  if (node < 0) return -1;
  for (int i = 0; i < c->nlinks; i++)
    if (c->links[i].node == node) return i;
  struct hfr_link *l = &c->links[c->nlinks];
  memset(l, 0, sizeof(*l));
  l->node = node;
  l->peer = c->column[node];
  return c->nlinks++;
}

static void build_trees(struct mplane_hfreduce_comm *c) {
  c->nlinks = 0;
  for (int t = 0; t < 2; t++) {
    mp_hfr_tree_pos(t, c->nnodes, c->node, &c->tree[t]);
    c->tree_link_parent[t] = link_of_node(c, c->tree[t].parent);
    for (int k = 0; k < 2; k++) c->tree_link_child[t][k] = link_of_node(c, c->tree[t].child[k]);
  }
}

/* Poll a request to its end (setup messages only); the deadline names the peer. */
static int wait_req(struct mplane_hfreduce_comm *c, void *req, int peer, uint64_t deadline, const char *what) {
  char who[160];
  for (;;) {
    int done = 0;
    if (c->ops->test(req, &done, NULL) != ncclSuccess)
      return hfr_fail(ncclRemoteError, "hfreduce: rank %d: %s with %s failed", c->rank, what,
                      hfr_rank_name(c, peer, who, sizeof(who)));
    if (done) return ncclSuccess;
    if (mplane_now_ns() > deadline)
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: %s with %s took more than MPLANE_CONNECT_TIMEOUT=%d s",
                      c->rank, what, hfr_rank_name(c, peer, who, sizeof(who)), c->timeout_s);
    sched_yield();
  }
}

/* Connect a send comm to every link and accept one from each; the accepted ones say who they are
 * (their first message is the sender's rank). */
static int connect_links(struct mplane_hfreduce_comm *c) {
  uint64_t deadline = mplane_now_ns() + (uint64_t)c->timeout_s * 1000000000ull;
  char handles[HFR_MAX_LINKS][NCCL_NET_HANDLE_MAXSIZE];
  void *accepted[HFR_MAX_LINKS] = {0};
  int nacc = 0, nconn = 0;
  char who[160];
  for (int i = 0; i < c->nlinks; i++) memcpy(handles[i], c->handles[c->links[i].peer], NCCL_NET_HANDLE_MAXSIZE);
  while (nconn < c->nlinks || nacc < c->nlinks) {
    for (int i = 0; i < c->nlinks; i++) {
      if (c->links[i].send_comm) continue;
      if (c->ops->connect(c->dev, &c->opts, handles[i], &c->links[i].send_comm) != ncclSuccess)
        return hfr_fail(ncclSystemError, "hfreduce: rank %d: connecting to %s failed", c->rank,
                        hfr_rank_name(c, c->links[i].peer, who, sizeof(who)));
      if (c->links[i].send_comm) nconn++;
    }
    if (nacc < c->nlinks) {
      if (c->ops->accept(c->listen_comm, &accepted[nacc]) != ncclSuccess)
        return hfr_fail(ncclSystemError, "hfreduce: rank %d: accept failed", c->rank);
      if (accepted[nacc]) nacc++;
    }
    if (mplane_now_ns() > deadline) {
      int missing = -1;
      for (int i = 0; i < c->nlinks && missing < 0; i++)
        if (!c->links[i].send_comm) missing = c->links[i].peer;
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: connections to its tree neighbours not made within "
                      "MPLANE_CONNECT_TIMEOUT=%d s (%d of %d out, %d of %d in%s%s)", c->rank, c->timeout_s, nconn,
                      c->nlinks, nacc, c->nlinks, missing >= 0 ? "; waiting for " : "",
                      missing >= 0 ? hfr_rank_name(c, missing, who, sizeof(who)) : "");
    }
    if (nconn < c->nlinks || nacc < c->nlinks) usleep(100);
  }
  /* who is who: each side sends its rank on its send comm */
  int32_t *mine = (int32_t *)hfr_desc_buf(c, -1), *theirs[HFR_MAX_LINKS];
  *mine = c->rank;
  void *sreq[HFR_MAX_LINKS] = {0}, *rreq[HFR_MAX_LINKS] = {0}, *rmh[HFR_MAX_LINKS] = {0};
  for (int i = 0; i < c->nlinks; i++) {
    if (c->ops->reg_mr(accepted[i], c->scratch, c->scratch_bytes, NCCL_PTR_HOST, &rmh[i]) != ncclSuccess)
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: registering its buffers failed", c->rank);
    theirs[i] = (int32_t *)hfr_desc_buf(c, i);
    *theirs[i] = -1;
  }
  for (int i = 0; i < c->nlinks; i++)
    if (c->ops->reg_mr(c->links[i].send_comm, c->scratch, c->scratch_bytes, NCCL_PTR_HOST,
                       &c->links[i].send_mh_scratch) != ncclSuccess ||
        c->ops->reg_mr(c->links[i].send_comm, c->shm, c->shm_bytes, NCCL_PTR_HOST, &c->links[i].send_mh_shm) !=
            ncclSuccess)
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: registering its buffers failed", c->rank);
  for (int i = 0; i < c->nlinks; i++) {
    while (!rreq[i]) {
      void *data = theirs[i];
      size_t size = 64;
      int tag = 0;
      if (c->ops->irecv(accepted[i], 1, &data, &size, &tag, &rmh[i], NULL, &rreq[i]) != ncclSuccess)
        return hfr_fail(ncclSystemError, "hfreduce: rank %d: irecv failed during setup", c->rank);
    }
    while (!sreq[i])
      if (c->ops->isend(c->links[i].send_comm, mine, 64, 0, c->links[i].send_mh_scratch, NULL, &sreq[i]) != ncclSuccess)
        return hfr_fail(ncclSystemError, "hfreduce: rank %d: isend failed during setup", c->rank);
  }
  for (int i = 0; i < c->nlinks; i++) {
    int res = wait_req(c, sreq[i], c->links[i].peer, deadline, "introduction");
    if (res == ncclSuccess) res = wait_req(c, rreq[i], c->links[i].peer, deadline, "introduction");
    if (res != ncclSuccess) return res;
  }
  for (int i = 0; i < c->nlinks; i++) {
    int j = 0;
    while (j < c->nlinks && c->links[j].peer != *theirs[i]) j++;
    if (j == c->nlinks || c->links[j].recv_comm)
      return hfr_fail(ncclInternalError, "hfreduce: rank %d: rank %d connected to it, which is no tree neighbour",
                      c->rank, *theirs[i]);
    c->links[j].recv_comm = accepted[i];
    c->links[j].recv_mh_scratch = rmh[i];
    if (c->ops->reg_mr(accepted[i], c->shm, c->shm_bytes, NCCL_PTR_HOST, &c->links[j].recv_mh_shm) != ncclSuccess)
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: registering its buffers failed", c->rank);
  }
  return ncclSuccess;
}

static int scratch_alloc(struct mplane_hfreduce_comm *c, int numa) {
  /* a child's half of my slice of a chunk, for the widest type (4 bytes): slices and halves are
   * rounded up to 64 elements (hfr_allreduce.c) */
  size_t elems = c->chunk_bytes / 4;
  size_t slice = round_up((elems + (size_t)c->nlocal - 1) / (size_t)c->nlocal, 64);
  c->child_bytes = round_up((slice + 1) / 2, 64) * 4;
  c->scratch_bytes = round_up(4096 + (size_t)c->slots * 4 * c->child_bytes, 4096);
  void *p = mmap(NULL, c->scratch_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return hfr_fail(ncclSystemError, "hfreduce: out of memory (%zu bytes)", c->scratch_bytes);
  place_near(p, c->scratch_bytes, numa);
  c->scratch = p;
  return ncclSuccess;
}

static void host_id(char *out, size_t len) {
  const char *id = getenv("NCCL_HOSTID"); /* NCCL's own variable: ranks that share it share a node */
  if (id && id[0]) {
    snprintf(out, len, "%s", id);
    return;
  }
  if (gethostname(out, len) != 0) snprintf(out, len, "localhost");
  out[len - 1] = 0;
}

uint64_t hfr_id_magic(const mplane_hfreduce_unique_id *id);

static int comm_setup(struct mplane_hfreduce_comm *c, const mplane_hfreduce_unique_id *id) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg) return hfr_fail(ncclInvalidArgument, "hfreduce: the MPLANE_* configuration is invalid (see the WARN)");
  struct mplane_config own;
  char err[512];
  if (mplane_config_load_hfreduce(&own, err, sizeof(err)) != ncclSuccess)
    return hfr_fail(ncclInvalidArgument, "hfreduce: %s", err);
  c->timeout_s = cfg->connect_timeout_s;
  c->chunk_bytes = (size_t)own.hfreduce_chunk_bytes / 4096 * 4096;
  c->slots = own.hfreduce_slots;
  uint64_t magic = hfr_id_magic(id);
  if (!magic) return hfr_fail(ncclInvalidArgument, "hfreduce: rank %d: the unique id was not made by "
                              "mplane_hfreduce_get_unique_id", c->rank);
  pthread_once(&transport_once, transport_init_once);
  if (!transport && transport_error[0]) return hfr_fail(ncclInvalidArgument, "hfreduce: %s", transport_error);
  if (!transport) return hfr_fail(ncclSystemError, "hfreduce: no usable network device (MPLANE_TRANSPORT, "
                                  "MPLANE_SOCKET_IFNAME='%s')", cfg->socket_ifname);
  c->ops = transport;

  struct hfr_boot_rec mine = {.magic = magic, .rank = c->rank, .nranks = c->nranks, .pid = getpid(),
                              .slots = c->slots, .chunk_bytes = (int64_t)c->chunk_bytes};
  host_id(mine.host, sizeof(mine.host));
  snprintf(c->host, sizeof(c->host), "%s", mine.host);
  c->recs = calloc((size_t)c->nranks, sizeof(*c->recs));
  c->handles = calloc((size_t)c->nranks, sizeof(*c->handles));
  if (!c->recs || !c->handles) return hfr_fail(ncclSystemError, "hfreduce: out of memory");
  /* round one: who is where; the device follows from the node's ranks, round two carries its handle */
  int res = hfr_boot_exchange(id, &mine, c->nranks, c->recs, c->timeout_s, &c->boot_fd);
  if (res != ncclSuccess) return res;
  res = group_nodes(c);
  if (res != ncclSuccess) return res;
  int by_plane;
  c->dev = pick_device(c->local, &by_plane);
  MP_INFO(NCCL_INIT | NCCL_NET, "hfreduce: rank %d (local %d): device %d (%s), plane %d rail %d, %s", c->rank,
          c->local, c->dev, transport_props[c->dev].name, transport_props[c->dev].plane, transport_props[c->dev].rail,
          by_plane ? "the device of its plane" : "no device on its plane: the local-th device in plane order");
  c->opts.traffic_class = MPLANE_TC_HFREDUCE;
  c->opts.tc_class = MPLANE_TC_HFREDUCE;
  c->opts.service_level = mplane_tc_sl(MPLANE_TC_HFREDUCE);
  c->opts.adaptive_routing = mplane_tc_adaptive_routing(MPLANE_TC_HFREDUCE);
  int numa = device_numa_node(&transport_props[c->dev]);
  res = shm_attach(c, magic, numa);
  if (res == ncclSuccess) res = scratch_alloc(c, numa);
  if (res != ncclSuccess) return res;
  char handle[NCCL_NET_HANDLE_MAXSIZE] = {0};
  if (c->nnodes > 1) {
    build_trees(c);
    if (c->ops->listen(c->dev, handle, &c->listen_comm) != ncclSuccess)
      return hfr_fail(ncclSystemError, "hfreduce: rank %d: listen on device %d (%s) failed", c->rank, c->dev,
                      transport_props[c->dev].name);
  }
  /* every rank takes part in round two (it also tells that all made their shared memory) */
  return hfr_boot_allgather(c->boot_fd, c->rank, handle, sizeof(handle), c->nranks, c->handles, c->timeout_s);
}

int mplane_hfreduce_comm_init(mplane_hfreduce_comm_t *out, int nranks, const mplane_hfreduce_unique_id *id, int rank) {
  if (!out || !id) return hfr_fail(ncclInvalidArgument, "hfreduce: comm_init: comm or id is NULL");
  *out = NULL;
  if (nranks <= 0 || rank < 0 || rank >= nranks)
    return hfr_fail(ncclInvalidArgument, "hfreduce: comm_init: rank %d of nranks %d (0 <= rank < nranks)", rank,
                    nranks);
  struct mplane_hfreduce_comm *c = calloc(1, sizeof(*c));
  if (!c) return hfr_fail(ncclSystemError, "hfreduce: out of memory");
  c->rank = rank;
  c->nranks = nranks;
  c->culprit = -1;
  c->culprit_sure = 1;
  c->boot_fd = -1;
  int res = comm_setup(c, id);
  if (res == ncclSuccess && c->nnodes > 1) res = connect_links(c);
  if (c->boot_fd >= 0) close(c->boot_fd); /* the root ends when every rank has closed */
  c->boot_fd = -1;
  if (res != ncclSuccess) {
    mplane_hfreduce_comm_destroy(c);
    return res;
  }
  MP_INFO(NCCL_INIT, "hfreduce: rank %d of %d: node %d of %d, local %d of %d, device %d (%s) plane %d, %d links, "
          "chunk %zu, %d slots", rank, nranks, c->node, c->nnodes, c->local, c->nlocal, c->dev,
          transport_props[c->dev].name, transport_props[c->dev].plane, c->nlinks, c->chunk_bytes, c->slots);
  *out = c;
  return ncclSuccess;
}

int mplane_hfreduce_comm_destroy(mplane_hfreduce_comm_t c) {
  if (!c) return ncclSuccess;
  for (int i = 0; i < c->nlinks; i++) {
    struct hfr_link *l = &c->links[i];
    if (l->send_comm) {
      if (l->send_mh_shm) c->ops->dereg_mr(l->send_comm, l->send_mh_shm);
      if (l->send_mh_scratch) c->ops->dereg_mr(l->send_comm, l->send_mh_scratch);
      c->ops->close_send(l->send_comm);
    }
    if (l->recv_comm) {
      if (l->recv_mh_shm) c->ops->dereg_mr(l->recv_comm, l->recv_mh_shm);
      if (l->recv_mh_scratch) c->ops->dereg_mr(l->recv_comm, l->recv_mh_scratch);
      c->ops->close_recv(l->recv_comm);
    }
  }
  if (c->listen_comm) c->ops->close_listen(c->listen_comm);
  if (c->pinned) {
    mplane_cuda_host_unregister(c->data);
    mplane_cuda_host_unregister(c->scratch);
  }
  if (c->shm) {
    if (!c->shm_unlinked && c->local == 0) shm_unlink(c->shm_name); /* a rank never came */
    munmap(c->shm, c->shm_bytes);
  }
  if (c->scratch) munmap(c->scratch, c->scratch_bytes);
  if (c->boot_fd >= 0) close(c->boot_fd);
  free(c->recs);
  free(c->handles);
  free(c->node_of);
  free(c->column);
  free(c);
  return ncclSuccess;
}

int mplane_hfreduce_comm_info(mplane_hfreduce_comm_t c, int *rank, int *nranks, int *node, int *nnodes, int *local,
                              int *nlocal) {
  if (!c) return hfr_fail(ncclInvalidArgument, "hfreduce: comm_info: comm is NULL");
  if (rank) *rank = c->rank;
  if (nranks) *nranks = c->nranks;
  if (node) *node = c->node;
  if (nnodes) *nnodes = c->nnodes;
  if (local) *local = c->local;
  if (nlocal) *nlocal = c->nlocal;
  return ncclSuccess;
}
