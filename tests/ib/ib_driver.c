/* mplane IB tests that are IB-specific (the generic ones are the ABI harness, run over softverbs by
 * tests/ib/meson.build). One scenario per process: the scenario sets the environment (softverbs
 * devices, faults, record file, MPLANE_*) before the plugin core reads it, then drives the core
 * (plugin/net_core.h, as NCCL's calls arrive there) with both ends in this process. Attributes the
 * QPs really got are read back from the softverbs record file.
 *
 *   ib_driver SCENARIO      exit 0 pass, 1 fail (77 never: softverbs is always there)
 */
#include <dlfcn.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <ifaddrs.h>
#include <netinet/in.h>
#include <time.h>
#include <unistd.h>

#include "common/nccl/rma.h"
#include "net/ib/ib.h"
#include "net/tc.h"
#include "plugin/net_core.h"
#include "plugin/topo_bind.h"
#include "topo/topo.h"

static const char *scenario = "?";
static char record_path[256];

static void fail(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "ib[%s]: FAIL: ", scenario);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
  exit(1);
}

/* A variable's value for a failure message, "" where it is unset. */
static const char *env_text(const char *name) { return getenv(name) ? getenv(name) : ""; }

static void note(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  fprintf(stderr, "ib[%s]: ", scenario);
  vfprintf(stderr, fmt, ap);
  fprintf(stderr, "\n");
  va_end(ap);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ------------------------------------------------------------------ environment and records */
static void env_base(const char *devices) {
  snprintf(record_path, sizeof(record_path), "/tmp/mplane-ib-%s-%d.rec", scenario, (int)getpid());
  unlink(record_path);
  setenv("SOFTVERBS_RECORD", record_path, 1);
  setenv("SOFTVERBS_DEVICES", devices, 1);
  char ns[64];
  snprintf(ns, sizeof(ns), "ibtest%d", (int)getpid());
  setenv("SOFTVERBS_NS", ns, 1);
  setenv("MPLANE_TRANSPORT", "ib", 0);
  setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
  if (!getenv("MPLANE_IBVERBS_LIB")) fail("MPLANE_IBVERBS_LIB must name libsoftverbs.so");
}

struct rec {
  char line[1024];
};

/* Lines of the record file containing every given key=value (NULL-terminated list). */
static int rec_find(struct rec *out, int max, ...) {
  FILE *f = fopen(record_path, "r");
  if (!f) return 0;
  int n = 0;
  char line[1024];
  while (fgets(line, sizeof(line), f)) {
    va_list ap;
    va_start(ap, max);
    int ok = 1;
    for (const char *kv = va_arg(ap, const char *); kv; kv = va_arg(ap, const char *)) {
      char pat[128];
      snprintf(pat, sizeof(pat), " %s ", kv);
      char padded[1100];
      snprintf(padded, sizeof(padded), " %s", line);
      padded[strcspn(padded, "\n")] = ' ';
      if (!strstr(padded, pat)) ok = 0;
    }
    va_end(ap);
    if (ok && n < max) snprintf(out[n++].line, sizeof(out->line), "%s", line);
  }
  fclose(f);
  return n;
}

static long rec_val(const struct rec *r, const char *key) {
  char pat[64];
  snprintf(pat, sizeof(pat), " %s=", key);
  char padded[1100];
  snprintf(padded, sizeof(padded), " %s", r->line);
  const char *p = strstr(padded, pat);
  return p ? strtol(p + strlen(pat), NULL, 10) : -1;
}

/* ------------------------------------------------------------------ plugin helpers */
struct pair {
  struct mplane_net_ctx *ctx;
  void *lc, *sc, *rc;
};

/* What the plugin logs, as NCCL's logger would get it (WARNs also on stderr, for the test's log). */
static char logged[1 << 16];
static void capture_log(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags, (void)file, (void)line;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  size_t used = strlen(logged);
  snprintf(logged + used, sizeof(logged) - used, "%s\n", msg);
  if (level == NCCL_LOG_WARN) fprintf(stderr, "WARN %s\n", msg);
}

/* How many logged lines hold text. */
static int log_count(const char *text) {
  int n = 0;
  for (const char *p = logged; (p = strstr(p, text)) != NULL; p += strlen(text)) n++;
  return n;
}

static void up(void) {
  if (mplane_net_global_init(capture_log) != ncclSuccess) fail("plugin init failed");
  if (strcmp(mplane_net_transport()->name, "ib") != 0) fail("transport is %s, not ib", mplane_net_transport()->name);
}

static void pair_open(struct pair *p, int traffic_class, const ncclNetAttr_v11_t *attr, int ldev, int cdev) {
  memset(p, 0, sizeof(*p));
  if (mplane_net_ctx_create(1, traffic_class, &p->ctx) != ncclSuccess) fail("ctx");
  if (attr && mplane_net_set_attr(p->ctx, attr) != ncclSuccess) fail("setNetAttr");
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  if (mplane_net_listen(p->ctx, ldev, handle, &p->lc) != ncclSuccess) fail("listen");
  double t0 = now();
  while (!p->sc || !p->rc) {
    if (!p->sc && mplane_net_connect(p->ctx, NCCL_NET_TRAFFIC_CLASS_UNDEF, cdev, handle, &p->sc) != ncclSuccess)
      fail("connect");
    if (!p->rc && mplane_net_accept(p->lc, &p->rc) != ncclSuccess) fail("accept");
    if (now() - t0 > 20) fail("no connection in 20 s");
  }
}

static void pair_close(struct pair *p) {
  mplane_net_close_send(p->sc);
  mplane_net_close_recv(p->rc);
  mplane_net_close_listen(p->lc);
  mplane_net_ctx_destroy(p->ctx);
}

/* One message of `size` bytes from sc to rc; returns the first error (ncclSuccess when checked). */
static ncclResult_t transfer(struct pair *p, size_t size, double limit_s, int expect_ok) {
  char *s = malloc(size + 1), *r = malloc(size + 1);
  for (size_t i = 0; i < size; i++) s[i] = (char)(i * 7 + 3);
  memset(r, 0, size + 1);
  void *smh = NULL, *rmh = NULL;
  if (mplane_net_reg_mr(p->sc, s, size + 1, NCCL_PTR_HOST, &smh) != ncclSuccess) fail("regMr send");
  if (mplane_net_reg_mr(p->rc, r, size + 1, NCCL_PTR_HOST, &rmh) != ncclSuccess) fail("regMr recv");
  void *sreq = NULL, *rreq = NULL;
  int sdone = 0, rdone = 0, tag = 7;
  size_t rsize = size;
  void *rdata = r;
  double t0 = now();
  ncclResult_t res = ncclSuccess;
  while ((!sdone || !rdone) && res == ncclSuccess) {
    if (now() - t0 > limit_s) fail("transfer of %zu bytes neither finished nor failed in %.0f s: a hang", size, limit_s);
    if (!rreq) res = mplane_net_irecv(p->rc, 1, &rdata, &rsize, &tag, &rmh, &rreq);
    if (res == ncclSuccess && !sreq) res = mplane_net_isend(p->sc, s, size, tag, smh, &sreq);
    int sz[1] = {0};
    if (res == ncclSuccess && sreq && !sdone) res = mplane_net_test(sreq, &sdone, sz);
    if (res == ncclSuccess && rreq && !rdone) {
      res = mplane_net_test(rreq, &rdone, sz);
      if (res == ncclSuccess && rdone && (size_t)sz[0] != size) fail("received %d bytes, expected %zu", sz[0], size);
    }
  }
  if (res == ncclSuccess && memcmp(s, r, size) != 0) fail("data of %zu bytes differs", size);
  if (expect_ok && res != ncclSuccess) fail("transfer failed with %d", res);
  mplane_net_dereg_mr(p->sc, smh);
  mplane_net_dereg_mr(p->rc, rmh);
  free(s);
  free(r);
  return res;
}

/* ------------------------------------------------------------------ scenarios */
/* Large messages go out on every QP; small ones on one. */
static int sc_striping(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_IB_QPS", "4", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 8 << 20, 20, 1);
  pair_close(&p);
  struct rec r[64];
  int n = rec_find(r, 64, "event=destroy", NULL);
  int used = 0, qps = 0;
  for (int i = 0; i < n; i++) {
    if (rec_val(&r[i], "write_imms") > 0) used++;
    qps++;
  }
  /* 4 sender QPs each carried a chunk with immediate; the receiver's QPs carried FIFO writes only */
  if (used != 4) fail("%d of %d QPs carried data with immediate; expected all 4 sender QPs", used, qps);
  note("8 MiB striped over 4 QPs (%d QPs recorded)", qps);
  return 0;
}

static int sl_of_conn(int traffic_class, const ncclNetAttr_v11_t *attr, int *tclass, long *writes) {
  unlink(record_path);
  struct pair p;
  pair_open(&p, traffic_class, attr, 0, 0);
  transfer(&p, 1 << 20, 20, 1);
  pair_close(&p);
  struct rec r[64];
  int n = rec_find(r, 64, "event=modify", "state=RTR", NULL);
  if (n < 2) fail("only %d QPs reached RTR", n);
  long sl = rec_val(&r[0], "sl");
  for (int i = 1; i < n; i++)
    if (rec_val(&r[i], "sl") != sl) fail("QPs of one connection have SLs %ld and %ld", sl, rec_val(&r[i], "sl"));
  if (tclass) *tclass = (int)rec_val(&r[0], "traffic_class");
  if (writes) {
    *writes = 0;
    int m = rec_find(r, 64, "event=destroy", NULL);
    for (int i = 0; i < m; i++) *writes += rec_val(&r[i], "writes");
  }
  return (int)sl;
}

/* Each communicator's trafficClass lands on its QPs (both sides) as the mapped SL. */
static int sc_sl_class(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_TC_MAP", "default=1,collective=2,alltoall=3,lowlat=5:ar,storage=6", 1);
  up();
  const int want[5] = {1, 2, 3, 5, 6};
  for (int cls = 0; cls < 5; cls++) {
    long writes = 0;
    int sl = sl_of_conn(cls, NULL, NULL, &writes);
    if (sl != want[cls]) fail("trafficClass %d (%s): QPs got SL %d, expected %d", cls, mplane_tc_class_name(cls), sl, want[cls]);
    /* adaptive routing (lowlat): data as plain writes, then a write with immediate; without it the
     * only plain write is the receiver's one FIFO write */
    if ((cls == MPLANE_TC_LOWLAT) != (writes > 1))
      fail("class %s: %ld plain RDMA writes; adaptive routing is %s for it", mplane_tc_class_name(cls), writes,
           cls == MPLANE_TC_LOWLAT ? "on" : "off");
    note("trafficClass %d (%s) -> SL %d, %s", cls, mplane_tc_class_name(cls), sl, writes > 1 ? "adaptive routing" : "in order");
  }
  int sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, NULL, NULL);
  if (sl != 1) fail("no class: SL %d, expected default's 1", sl);
  return 0;
}

/* setNetAttr hints before connect choose the class when the communicator has none. */
static int sc_sl_hints(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_TC_MAP", "collective=2,alltoall=3,lowlat=5", 1);
  setenv("MPLANE_IB_SL", "7", 1);
  up();
  ncclNetAttr_v11_t a;
  memset(&a, 0xff, sizeof(a));
  a.proto = 1u << MPLANE_NCCL_PROTO_LL;
  int sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, &a, NULL, NULL);
  if (sl != 5) fail("proto LL hint: SL %d, expected lowlat's 5", sl);
  memset(&a, 0xff, sizeof(a));
  a.op = 1u << MPLANE_NCCL_FUNC_ALLREDUCE;
  a.proto = 1u << MPLANE_NCCL_PROTO_SIMPLE;
  if ((sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, &a, NULL, NULL)) != 2) fail("AllReduce hint: SL %d, expected 2", sl);
  memset(&a, 0xff, sizeof(a));
  a.op = 1u << MPLANE_NCCL_FUNC_SENDRECV;
  a.proto = 1u << MPLANE_NCCL_PROTO_SIMPLE;
  if ((sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, &a, NULL, NULL)) != 3) fail("SendRecv hint: SL %d, expected 3", sl);
  /* the communicator's own class wins over hints */
  if ((sl = sl_of_conn(MPLANE_TC_COLLECTIVE, &a, NULL, NULL)) != 2) fail("class collective + p2p hint: SL %d, expected 2", sl);
  /* no class, no hint: default is not in the map, so MPLANE_IB_SL */
  if ((sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, NULL, NULL)) != 7) fail("no class: SL %d, expected MPLANE_IB_SL 7", sl);
  note("hints LL->5, AllReduce->2, SendRecv->3, class wins, none->MPLANE_IB_SL 7");
  return 0;
}

/* One connection's SL and RoCE traffic class against what is expected of it. */
static void expect_sl_tc(const char *what, int traffic_class, const ncclNetAttr_v11_t *a, int want_sl, int want_tc) {
  int tclass = -1;
  int sl = sl_of_conn(traffic_class, a, &tclass, NULL);
  if (sl != want_sl || tclass != want_tc)
    fail("%s: SL %d, traffic class %d; expected SL %d, traffic class %d", what, sl, tclass, want_sl, want_tc);
}

static ncclNetAttr_v11_t hint(unsigned op, unsigned proto) {
  ncclNetAttr_v11_t a;
  memset(&a, 0xff, sizeof(a));
  if (op) a.op = op;
  if (proto) a.proto = proto;
  return a;
}

/* A site's NCCL_IB_SL, MPLANE_TC_MAP unset: every connection on that SL whatever its class or hints
 * (NCCL's net_ib never splits a job over SLs); on RoCE its DSCP too. */
static int sc_sl_site(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  unsetenv("MPLANE_TC_MAP");
  unsetenv("MPLANE_IB_SL");
  setenv("NCCL_IB_SL", "4", 1);
  up();
  const int tc = mplane_tc_dscp(4) << 2;
  ncclNetAttr_v11_t ll = hint(0, 1u << MPLANE_NCCL_PROTO_LL), p2p = hint(1u << MPLANE_NCCL_FUNC_SENDRECV, 0);
  expect_sl_tc("no class", NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 4, tc);
  expect_sl_tc("proto LL hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &ll, 4, tc);
  expect_sl_tc("SendRecv hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &p2p, 4, tc);
  /* a communicator's trafficClass is NCCL's: the site's SL wins, the value is the RoCE traffic class */
  for (int v = 0; v < 5; v++) expect_sl_tc("trafficClass", v, NULL, 4, v);
  note("NCCL_IB_SL=4: every class and hint on SL 4, traffic class %d (a communicator's trafficClass its own)", tc);
  return 0;
}

/* Nothing set: hints never move a connection off the default class's SL; a communicator's own class
 * takes the built-in map's SL. */
static int sc_sl_nomap(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  unsetenv("MPLANE_TC_MAP");
  unsetenv("MPLANE_IB_SL");
  unsetenv("NCCL_IB_SL");
  unsetenv("NCCL_IB_TC");
  up();
  ncclNetAttr_v11_t ll = hint(0, 1u << MPLANE_NCCL_PROTO_LL), p2p = hint(1u << MPLANE_NCCL_FUNC_SENDRECV, 0);
  expect_sl_tc("proto LL hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &ll, 0, 0);
  expect_sl_tc("SendRecv hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &p2p, 0, 0);
  expect_sl_tc("trafficClass 2", 2, NULL, 2, 2);
  note("no map, no site SL: hints stay on SL 0; trafficClass 2 is SL 2 and traffic class 2, as in NCCL's net_ib");
  return 0;
}

/* A job moved from NCCL's net_ib keeps its SLs: without MPLANE_TC_MAP a communicator's trafficClass
 * is the SL on IB and the traffic class on RoCE (above 15 the traffic class only); NCCL_IB_SL and
 * NCCL_IB_TC win over it, as there. IB_TEST_DEVS picks the link. */
static int sc_sl_nccl(void) {
  int roce = getenv("IB_TEST_ROCE") != NULL;
  env_base(roce ? "mlx5_0:roce:ip=198.18.0.1" : "mlx5_0:ib");
  unsetenv("MPLANE_TC_MAP");
  unsetenv("MPLANE_IB_SL");
  unsetenv("MPLANE_IB_TC");
  up();
  const char *site_sl = getenv("NCCL_IB_SL"), *site_tc = getenv("NCCL_IB_TC");
  int sl_site = site_sl ? atoi(site_sl) : -1, tc_site = site_tc ? atoi(site_tc) : -1;
  const int values[] = {3, 5, 7, 15, 106};
  for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
    int v = values[i];
    int want_sl = sl_site >= 0 ? sl_site : v <= 15 ? v : 0;
    int want_tc = !roce ? 0 : tc_site >= 0 ? tc_site : v;
    char what[64];
    snprintf(what, sizeof(what), "trafficClass %d", v);
    expect_sl_tc(what, v, NULL, want_sl, want_tc);
  }
  note("trafficClass 3 -> SL %d%s", sl_site >= 0 ? sl_site : 3, roce ? ", its traffic class too" : "");
  return 0;
}

/* The user's own MPLANE_TC_MAP wins over NCCL's twins: per class and hint, its SLs and their DSCPs,
 * NCCL_IB_SL only for classes it leaves out (default named here, so none), NCCL_IB_TC not applied. */
static int sc_sl_map_wins(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  setenv("MPLANE_TC_MAP", "default=2,lowlat=5", 1);
  unsetenv("MPLANE_IB_SL");
  unsetenv("MPLANE_IB_TC");
  setenv("NCCL_IB_SL", "4", 1);
  setenv("NCCL_IB_TC", "106", 1);
  up();
  ncclNetAttr_v11_t ll = hint(0, 1u << MPLANE_NCCL_PROTO_LL);
  expect_sl_tc("proto LL hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &ll, 5, mplane_tc_dscp(5) << 2);
  expect_sl_tc("no class", NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 2, mplane_tc_dscp(2) << 2);
  note("MPLANE_TC_MAP over NCCL_IB_SL and NCCL_IB_TC");
  return 0;
}

/* MPLANE_IB_TC, mplane's own, holds with a map too. */
static int sc_sl_map_own_tc(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  setenv("MPLANE_TC_MAP", "default=2,lowlat=5", 1);
  setenv("MPLANE_IB_TC", "106", 1);
  up();
  ncclNetAttr_v11_t ll = hint(0, 1u << MPLANE_NCCL_PROTO_LL);
  expect_sl_tc("proto LL hint", NCCL_NET_TRAFFIC_CLASS_UNDEF, &ll, 5, 106);
  note("MPLANE_IB_TC=106 with a map: SL 5, traffic class 106");
  return 0;
}

/* The registration cache: the same pages registered by two comms of one HCA, and a range inside
 * them, pin them once (one ibv_reg_mr); the last deregMr releases them (one ibv_dereg_mr). */
static int sc_reg_cache(void) {
  env_base("mlx5_0:ib");
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  char *buf = aligned_alloc(4096, 4 * 4096);
  if (!buf) fail("out of memory");
  unlink(record_path);
  void *mh[3];
  if (mplane_net_reg_mr(p.sc, buf, 3 * 4096 + 100, NCCL_PTR_HOST, &mh[0]) != ncclSuccess ||
      mplane_net_reg_mr(p.rc, buf, 3 * 4096 + 100, NCCL_PTR_HOST, &mh[1]) != ncclSuccess ||
      mplane_net_reg_mr(p.sc, buf + 4096, 100, NCCL_PTR_HOST, &mh[2]) != ncclSuccess)
    fail("regMr");
  struct rec r[8];
  int n = rec_find(r, 8, "event=reg_mr", NULL);
  if (n != 1) fail("3 regMr of the same pages: %d ibv_reg_mr, expected 1 (the cache)", n);
  mplane_net_dereg_mr(p.sc, mh[0]);
  mplane_net_dereg_mr(p.rc, mh[1]);
  if ((n = rec_find(r, 8, "event=dereg_mr", NULL)) != 0) fail("%d ibv_dereg_mr while a regMr still holds the pages", n);
  mplane_net_dereg_mr(p.sc, mh[2]);
  if ((n = rec_find(r, 8, "event=dereg_mr", "length=16384", NULL)) != 1) fail("the last deregMr: %d ibv_dereg_mr, expected 1", n);
  if (mplane_net_reg_mr(p.sc, buf, 100, NCCL_PTR_HOST, &mh[0]) != ncclSuccess) fail("regMr after release");
  if ((n = rec_find(r, 8, "event=reg_mr", NULL)) != 2) fail("a regMr after the release: %d ibv_reg_mr in all, expected 2", n);
  mplane_net_dereg_mr(p.sc, mh[0]);
  pair_close(&p);
  free(buf);
  note("3 regMr of one buffer on 2 comms: 1 ibv_reg_mr, released at the last deregMr");
  return 0;
}

/* dma-buf registrations in the cache: NCCL exports a new dma-buf (a new fd) for every regMrDmaBuf of
 * a buffer. Two comms registering one buffer through two fds, and a range inside it at the same
 * place of the dma-buf, share one ibv_reg_dmabuf_mr; the last deregMr releases it, after the fds
 * are closed. The same addresses at another place of the dma-buf are another registration. */
static int sc_reg_cache_dmabuf(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_DMABUF", "1", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  const size_t len = 4 * 4096;
  int fd = memfd_create("mplane-reg-cache-dmabuf", MFD_CLOEXEC);
  if (fd < 0 || ftruncate(fd, (off_t)(2 * len)) != 0) fail("memfd: %s", strerror(errno));
  char *buf = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (buf == MAP_FAILED) fail("mmap: %s", strerror(errno));
  unlink(record_path);
  void *mh[4];
  int fd2 = dup(fd), fd3 = dup(fd);
  if (mplane_net_reg_mr_dmabuf(p.sc, buf, len, NCCL_PTR_HOST, 0, fd, &mh[0]) != ncclSuccess ||
      mplane_net_reg_mr_dmabuf(p.rc, buf, len, NCCL_PTR_HOST, 0, fd2, &mh[1]) != ncclSuccess ||
      mplane_net_reg_mr_dmabuf(p.sc, buf + 4096, 100, NCCL_PTR_HOST, 4096, fd3, &mh[2]) != ncclSuccess)
    fail("regMrDmaBuf");
  close(fd2);
  close(fd3);
  struct rec r[8];
  int n = rec_find(r, 8, "event=reg_mr", "dmabuf=1", NULL);
  if (n != 1) fail("3 regMrDmaBuf of one buffer (3 fds): %d ibv_reg_dmabuf_mr, expected 1 (the cache)", n);
  /* the same addresses, another place of the dma-buf: registered on their own */
  if (mplane_net_reg_mr_dmabuf(p.sc, buf, 4096, NCCL_PTR_HOST, len, fd, &mh[3]) != ncclSuccess) fail("regMrDmaBuf 4");
  if ((n = rec_find(r, 8, "event=reg_mr", "dmabuf=1", NULL)) != 2)
    fail("a range at another offset of the dma-buf: %d ibv_reg_dmabuf_mr in all, expected 2", n);
  mplane_net_dereg_mr(p.sc, mh[3]);
  mplane_net_dereg_mr(p.sc, mh[0]);
  mplane_net_dereg_mr(p.rc, mh[1]);
  if ((n = rec_find(r, 8, "event=dereg_mr", "length=16384", NULL)) != 0)
    fail("%d ibv_dereg_mr of the shared registration while a regMr still holds it", n);
  mplane_net_dereg_mr(p.sc, mh[2]);
  if ((n = rec_find(r, 8, "event=dereg_mr", "length=16384", NULL)) != 1)
    fail("the last deregMr: %d ibv_dereg_mr of the shared registration, expected 1", n);
  pair_close(&p);
  munmap(buf, len);
  close(fd);
  note("3 regMrDmaBuf of one buffer through 3 fds on 2 comms: 1 ibv_reg_dmabuf_mr, released at the last deregMr");
  return 0;
}

/* RoCE: RoCE v2 IPv4-mapped GID chosen; the class's DSCP in the traffic class; GID override. */
static int sc_roce(void) {
  const char *devs = getenv("IB_TEST_DEVS");
  env_base(devs ? devs : "mlx5_0:roce:ip=198.18.0.1");
  setenv("MPLANE_TC_MAP", "default=3", 1);
  if (getenv("IB_TEST_GID_INDEX")) setenv("MPLANE_IB_GID_INDEX", getenv("IB_TEST_GID_INDEX"), 1);
  up();
  int tclass = -1;
  int sl = sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, &tclass, NULL);
  struct rec r[8];
  if (rec_find(r, 8, "event=modify", "state=RTR", NULL) < 1) fail("no RTR record");
  long gidx = rec_val(&r[0], "sgid_index"), glob = rec_val(&r[0], "is_global");
  long want_idx = getenv("IB_TEST_GID_INDEX") ? atol(getenv("IB_TEST_GID_INDEX"))
                 : getenv("IB_TEST_WANT_GID")  ? atol(getenv("IB_TEST_WANT_GID"))
                                               : 3;
  const char *want_dgid = getenv("IB_TEST_WANT_DGID") ? getenv("IB_TEST_WANT_DGID") : "::ffff:198.18.0.1";
  if (glob != 1) fail("RoCE QP is not global (is_global=%ld)", glob);
  if (gidx != want_idx) fail("RoCE QP uses GID index %ld, expected %ld", gidx, want_idx);
  if (sl != 3 || tclass != (mplane_tc_dscp(3) << 2)) fail("SL %d traffic class %d, expected 3 and %d", sl, tclass, mplane_tc_dscp(3) << 2);
  char dgid_kv[96];
  snprintf(dgid_kv, sizeof(dgid_kv), "dgid=%s ", want_dgid);
  if (!getenv("IB_TEST_GID_INDEX") && want_dgid[0] && !strstr(r[0].line, dgid_kv))
    fail("destination GID is not %s: %s", want_dgid, r[0].line);
  note("RoCE: GID index %ld, SL %d, traffic class %d", gidx, sl, tclass);
  return 0;
}

/* A site's NCCL_IB_* settings hold where the MPLANE_IB_* twin is unset, and the twin wins where
 * both are set: RoCE traffic class, P_Key index, timeout from NCCL's variables, retry count from
 * mplane's. */
static int sc_nccl_vars(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  setenv("NCCL_IB_TC", "106", 1);
  setenv("NCCL_IB_PKEY", "1", 1);
  setenv("NCCL_IB_TIMEOUT", "16", 1);
  setenv("NCCL_IB_RETRY_CNT", "6", 1);
  setenv("MPLANE_IB_RETRY_CNT", "5", 1);
  up();
  int tclass = -1;
  sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, &tclass, NULL);
  struct rec r[16];
  int n = rec_find(r, 16, "event=modify", "state=RTS", NULL);
  if (n < 2) fail("only %d QPs reached RTS", n);
  for (int i = 0; i < n; i++)
    if (rec_val(&r[i], "traffic_class") != 106 || rec_val(&r[i], "pkey_index") != 1 || rec_val(&r[i], "timeout") != 16 ||
        rec_val(&r[i], "retry_cnt") != 5)
      fail("expected traffic class 106, P_Key index 1 and timeout 16 from NCCL_IB_*, retry count 5 from "
           "MPLANE_IB_RETRY_CNT: %s", r[i].line);
  note("%d QPs: NCCL_IB_TC, NCCL_IB_PKEY, NCCL_IB_TIMEOUT applied; MPLANE_IB_RETRY_CNT over NCCL_IB_RETRY_CNT", n);
  return 0;
}

/* RoCE GIDs follow the interface's addresses: an address added after init moves the IPv4 GID from
 * index 3 to 5. A connection made after that uses the index of the moment, and moves data. */
static int sc_gid_move(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  up();
  struct pair p, q;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 64 << 10, 10, 1);
  pair_close(&p);
  void *sv = dlopen(getenv("MPLANE_IBVERBS_LIB"), RTLD_NOW | RTLD_NOLOAD);
  int (*gid_move)(const char *) = sv ? (int (*)(const char *))dlsym(sv, "softverbs_gid_move") : NULL;
  if (!gid_move || gid_move("mlx5_0") != 0) fail("softverbs_gid_move not found or refused");
  struct rec r[16];
  if (rec_find(r, 16, "event=gid_move", NULL) != 1) fail("the GIDs did not move (no record)");
  unlink(record_path);
  pair_open(&q, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&q, 1 << 20, 10, 1);
  pair_close(&q);
  int n = rec_find(r, 16, "event=modify", "state=RTR", NULL);
  if (n < 2) fail("only %d QPs of the new connection reached RTR", n);
  for (int i = 0; i < n; i++)
    if (rec_val(&r[i], "sgid_index") != 5 || !strstr(r[i].line, "dgid=::ffff:198.18.0.1"))
      fail("a connection made after the GIDs moved uses a stale GID: %s", r[i].line);
  note("GIDs moved after init: %d QPs of a new connection use index 5 and the IPv4 GID", n);
  return 0;
}

/* An error completion (injected on the Nth work request) ends in an error from test(), no hang,
 * with a WARN naming device, port and peer. */
static int sc_fault_wr(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_FAULTS", "err_wr=6", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  ncclResult_t res = ncclSuccess;
  double t0 = now();
  for (int i = 0; i < 20 && res == ncclSuccess; i++) res = transfer(&p, 256 << 10, 10, 0);
  if (res == ncclSuccess) fail("20 transfers succeeded despite an injected error completion");
  note("injected error completion -> result %d after %.3f s", res, now() - t0);
  pair_close(&p);
  return 0;
}

/* The port goes down mid-run: async event -> every request on the port fails, no hang. */
static int sc_port_down(void) {
  env_base("mlx5_0:ib,mlx5_1:ib");
  setenv("SOFTVERBS_FAULTS", "port_down_after=8,dev=mlx5_0", 1);
  up();
  struct pair p, q;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  pair_open(&q, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 1, 1);
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < 20 && res == ncclSuccess; i++) res = transfer(&p, 64 << 10, 10, 0);
  if (res == ncclSuccess) fail("transfers on mlx5_0 went on after its port went down");
  /* a receive posted after the port died fails too (through the async event), not a hang */
  usleep(300 * 1000); /* let the async thread take the event */
  void *buf = malloc(4096), *mh = NULL, *req = NULL;
  size_t sz = 4096;
  int tag = 1, done = 0;
  ncclResult_t r2 = mplane_net_reg_mr(p.rc, buf, sz, NCCL_PTR_HOST, &mh);
  if (r2 == ncclSuccess) r2 = mplane_net_irecv(p.rc, 1, &buf, &sz, &tag, &mh, &req);
  double t0 = now();
  while (r2 == ncclSuccess && req && !done && now() - t0 < 10) r2 = mplane_net_test(req, &done, NULL);
  if (r2 == ncclSuccess) fail("a receive on the downed port %s", done ? "completed" : "hung for 10 s");
  /* the other plane's NIC is unaffected */
  transfer(&q, 1 << 20, 20, 1);
  note("port down: send side result %d, later receive result %d; mlx5_1 still carries data", res, r2);
  pair_close(&p);
  pair_close(&q);
  return 0;
}

/* A port that goes down and comes back within the retry time (a link flap): the connections on it
 * go on, every byte arrives (on hardware the QPs retry meanwhile; failing them all on the event
 * would end a job a flap leaves intact). */
static int sc_port_flap(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_FAULTS", "port_flap_after=8", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  for (int i = 0; i < 10; i++) transfer(&p, 64 << 10, 10, 1); /* fails the scenario if one fails */
  usleep(300 * 1000); /* the async thread has taken both events */
  struct rec r[2];
  if (rec_find(r, 2, "event=port_flap", NULL) != 1) fail("the port did not flap (no record)");
  if (transfer(&p, 1 << 20, 10, 1) != ncclSuccess) fail("the connection failed after its port flapped");
  note("port flapped after 8 work requests; the connection carried on");
  pair_close(&p);
  return 0;
}

/* The HCA's async event channel breaks (a removed device: readable for ever, no event): the async
 * thread must not spin a core; connections still work while their QPs do. */
static int sc_async_dead(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_FAULTS", "async_dead_after=4", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  for (int i = 0; i < 4; i++) transfer(&p, 64 << 10, 10, 1);
  struct rec r[2];
  if (rec_find(r, 2, "event=async_dead", NULL) != 1) fail("the event channel did not break (no record)");
  struct rusage a, b;
  getrusage(RUSAGE_SELF, &a);
  usleep(1000 * 1000);
  getrusage(RUSAGE_SELF, &b);
  double cpu = (double)(b.ru_utime.tv_sec - a.ru_utime.tv_sec + b.ru_stime.tv_sec - a.ru_stime.tv_sec) +
               (double)(b.ru_utime.tv_usec - a.ru_utime.tv_usec + b.ru_stime.tv_usec - a.ru_stime.tv_usec) / 1e6;
  if (cpu > 0.3) fail("an idle process used %.2f s of CPU in 1 s with a broken event channel: the async thread spins", cpu);
  transfer(&p, 1 << 20, 10, 1);
  note("broken event channel: %.3f s of CPU in 1 s idle; data still moves", cpu);
  pair_close(&p);
  return 0;
}

/* A QP fatal async event fails the connection that owns the QP. */
static int sc_qp_fatal(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_FAULTS", "qp_fatal_after=4", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  ncclResult_t res = ncclSuccess;
  for (int i = 0; i < 20 && res == ncclSuccess; i++) {
    res = transfer(&p, 4096, 10, 0);
    usleep(20 * 1000);
  }
  if (res == ncclSuccess) fail("transfers went on after a QP fatal event");
  note("QP fatal -> result %d", res);
  pair_close(&p);
  return 0;
}

/* The flush scenarios' setup: one device, a connected pair, 64 KiB of host memory registered as host. */
static void *flush_pair_open(struct pair *p, void **mh) {
  env_base("mlx5_0:ib");
  up();
  pair_open(p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  void *buf = calloc(1, 65536);
  if (mplane_net_reg_mr(p->rc, buf, 65536, NCCL_PTR_HOST, mh) != ncclSuccess) fail("regMr");
  return buf;
}

/* QPs softverbs saw brought to RTR facing themselves: the flush QPs. */
static int loopback_qps(void) {
  struct rec m[16];
  int k = rec_find(m, 16, "event=modify", "state=RTR", NULL), loop = 0;
  for (int i = 0; i < k; i++)
    if (rec_val(&m[i], "qpn") == rec_val(&m[i], "dest_qpn")) loop++;
  return loop;
}

/* iflush: a GPU-registered buffer is flushed by an RDMA read on a loopback QP. softverbs has no GPU,
 * so the buffer is host memory registered as host and then marked as GPU memory in its handle. */
static int sc_flush(void) {
  struct pair p;
  void *mh = NULL, *req = NULL, *buf = flush_pair_open(&p, &mh);
  int size = 65536;
  if (mplane_net_iflush(p.rc, 1, &buf, &size, &mh, &req) != ncclSuccess || req)
    fail("iflush of host memory should need no request");
  ((struct mpib_mr *)mh)->type = NCCL_PTR_CUDA;
  if (mplane_net_iflush(p.rc, 1, &buf, &size, &mh, &req) != ncclSuccess || !req) fail("iflush of GPU memory gave no request");
  int done = 0;
  double t0 = now();
  while (!done) {
    if (mplane_net_test(req, &done, NULL) != ncclSuccess) fail("flush failed");
    if (now() - t0 > 10) fail("flush did not complete in 10 s");
  }
  /* flushes NCCL has not tested yet pile up: each gets a request, and when none is left that is an
   * error, never NULL (which NCCL reads as "nothing to flush": the GPU would read too early) */
  void *held[MPIB_MAX_FLUSHES];
  for (int i = 0; i < MPIB_MAX_FLUSHES; i++)
    if (mplane_net_iflush(p.rc, 1, &buf, &size, &mh, &held[i]) != ncclSuccess || !held[i])
      fail("iflush %d of %d in flight gave no request", i + 1, MPIB_MAX_FLUSHES);
  void *extra = NULL;
  if (mplane_net_iflush(p.rc, 1, &buf, &size, &mh, &extra) == ncclSuccess)
    fail("iflush %d with %d untested flushes in flight returned %s instead of an error", MPIB_MAX_FLUSHES + 1,
         MPIB_MAX_FLUSHES, extra ? "a request" : "NULL (\"nothing to flush\")");
  for (int i = 0; i < MPIB_MAX_FLUSHES; i++)
    for (int d = 0; !d;)
      if (mplane_net_test(held[i], &d, NULL) != ncclSuccess) fail("flush %d failed", i);
  mplane_net_dereg_mr(p.rc, mh);
  pair_close(&p);
  struct rec r[16];
  int n = rec_find(r, 16, "event=destroy", "reads=257", NULL), loop = loopback_qps();
  if (n != 1 || loop != 1) fail("expected one loopback QP doing 257 RDMA reads; %d read, %d loopback", n, loop);
  note("flush by RDMA read on a loopback QP; %d flushes in flight, the next one an error", MPIB_MAX_FLUSHES);
  return 0;
}

/* NCCL_GDR_FLUSH_DISABLE=1 (or its MPLANE_IB_* twin): iflush of GPU memory completes at once
 * (a NULL request), and no flush QP is made. */
static int sc_flush_disabled(void) {
  struct pair p;
  void *mh = NULL, *req = NULL, *buf = flush_pair_open(&p, &mh);
  ((struct mpib_mr *)mh)->type = NCCL_PTR_CUDA;
  int size = 65536;
  if (mplane_net_iflush(p.rc, 1, &buf, &size, &mh, &req) != ncclSuccess) fail("iflush failed");
  if (req) fail("iflush of GPU memory gave a request though GDR flushes are disabled");
  mplane_net_dereg_mr(p.rc, mh);
  pair_close(&p);
  free(buf);
  if (loopback_qps()) fail("a loopback flush QP was made though GDR flushes are disabled");
  note("GDR flush disabled: iflush of GPU memory done at once, no flush QP");
  return 0;
}

/* The sender closes as soon as its sends completed, before the receiver tested anything. The receives
 * whose data and immediates arrived must report success with their data, even after the connection
 * has failed: the receiver first notices the close on a receive that never gets data (side-channel
 * EOF) and then on one posted afterwards (its FIFO write finds no QP: retries exhausted). */
static int sc_close_complete(void) {
  env_base("mlx5_0:ib");
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  enum { N = 3, SZ = 200 << 10 };
  static char sbuf[N][SZ], rbuf[N + 2][SZ];
  void *smh[N], *rmh[N + 2], *sreq[N] = {0}, *rreq[N + 2] = {0};
  for (int i = 0; i < N; i++) {
    memset(sbuf[i], 'a' + i, SZ);
    if (mplane_net_reg_mr(p.sc, sbuf[i], SZ, NCCL_PTR_HOST, &smh[i]) != ncclSuccess) fail("regMr send");
  }
  for (int i = 0; i < N + 2; i++)
    if (mplane_net_reg_mr(p.rc, rbuf[i], SZ, NCCL_PTR_HOST, &rmh[i]) != ncclSuccess) fail("regMr recv");
  int tag = 3, sz[1];
  size_t rsz = SZ;
  /* N + 1 receives; the sender sends N and waits for them only */
  double t0 = now();
  for (int i = 0; i < N + 1; i++) {
    void *d = rbuf[i];
    while (!rreq[i]) {
      if (mplane_net_irecv(p.rc, 1, &d, &rsz, &tag, &rmh[i], &rreq[i]) != ncclSuccess) fail("irecv %d", i);
      if (now() - t0 > 20) fail("irecv %d not accepted in 20 s", i);
    }
  }
  for (int i = 0; i < N; i++) {
    int done = 0;
    while (!sreq[i]) {
      if (mplane_net_isend(p.sc, sbuf[i], SZ, tag, smh[i], &sreq[i]) != ncclSuccess) fail("isend %d", i);
      if (now() - t0 > 20) fail("isend %d not accepted in 20 s", i);
    }
    while (!done) {
      if (mplane_net_test(sreq[i], &done, sz) != ncclSuccess) fail("send %d failed", i);
      if (now() - t0 > 20) fail("send %d not done in 20 s", i);
    }
  }
  for (int i = 0; i < N; i++) mplane_net_dereg_mr(p.sc, smh[i]);
  mplane_net_close_send(p.sc);
  p.sc = NULL;
  /* the extra receive fails (peer gone), within the side channel's notice, not a hang */
  int done = 0;
  ncclResult_t res = ncclSuccess;
  t0 = now();
  while (res == ncclSuccess && !done) {
    res = mplane_net_test(rreq[N], &done, sz);
    if (now() - t0 > 10) fail("a receive with no sender left neither failed nor finished in 10 s");
  }
  if (res == ncclSuccess) fail("a receive completed though nobody sent it");
  /* a receive posted now fails as well (FIFO write to a destroyed QP, or the failed connection) */
  void *d = rbuf[N + 1];
  void *late = NULL;
  res = mplane_net_irecv(p.rc, 1, &d, &rsz, &tag, &rmh[N + 1], &late);
  done = 0;
  t0 = now();
  while (res == ncclSuccess && late && !done) {
    res = mplane_net_test(late, &done, sz);
    if (now() - t0 > 10) fail("a receive posted after the sender closed neither failed nor finished in 10 s");
  }
  if (res == ncclSuccess && done) fail("a receive posted after the sender closed completed");
  /* the receives that did get their data report it */
  for (int i = 0; i < N; i++) {
    done = 0;
    sz[0] = -1;
    res = mplane_net_test(rreq[i], &done, sz);
    if (res != ncclSuccess) fail("receive %d had all its data before the sender closed, but its test failed (%d)", i, res);
    if (!done) fail("receive %d had all its data before the sender closed, but is not done", i);
    if (sz[0] != SZ) fail("receive %d reports %d bytes, expected %d", i, sz[0], (int)SZ);
    for (int k = 0; k < SZ; k++)
      if (rbuf[i][k] != 'a' + i) fail("receive %d: byte %d is 0x%02x", i, k, (unsigned char)rbuf[i][k]);
  }
  for (int i = 0; i < N + 2; i++) mplane_net_dereg_mr(p.rc, rmh[i]);
  mplane_net_close_recv(p.rc);
  mplane_net_close_listen(p.lc);
  mplane_net_ctx_destroy(p.ctx);
  note("%d receives complete before the sender closed reported success; later ones failed", N);
  return 0;
}

/* Devices: every active port, MPLANE_IB_HCA grammar, planes from IB subnets, auto picks IB. */
static int sc_devices(void) {
  const char *devs = getenv("IB_TEST_DEVS");
  env_base(devs ? devs : "mlx5_0:ib:ports=2:down=2:subnet=4,mlx5_1:ib:subnet=9,mlx5_10:ib:subnet=6,mlx5_2:roce:ip=198.18.2.1");
  const char *hca = getenv("IB_TEST_HCA");
  if (hca) setenv("MPLANE_IB_HCA", hca, 1);
  setenv("MPLANE_TRANSPORT", "auto", 1);
  up();
  struct rec fr[2];
  if (rec_find(fr, 2, "event=fork_init", "before_device_list=1", NULL) != 1)
    fail("ibv_fork_init was not called once before the device list (a fork after init could break registered pages)");
  int n = 0;
  mplane_net_devices(&n);
  char names[512] = "";
  for (int d = 0; d < n; d++) {
    /* the transport's own plane guess (IB subnets, else discovery order); topo/ and MPLANE_PLANES may
     * override it in the plugin's view, which is theirs to test */
    struct mplane_dev_props pp;
    if (mplane_ib_ops.get_properties(d, &pp) != ncclSuccess) fail("getProperties %d", d);
    char one[96];
    if (getenv("IB_TEST_WANT_SPEED")) snprintf(one, sizeof(one), "%s%s@%d", d ? "," : "", pp.name, pp.speed_mbps);
    else snprintf(one, sizeof(one), "%s%s@%d", d ? "," : "", pp.name, pp.plane);
    strncat(names, one, sizeof(names) - strlen(names) - 1);
  }
  const char *want = getenv("IB_TEST_WANT_SPEED");
  if (!want) want = getenv("IB_TEST_WANT");
  /* named prefixes 4, 9, 6 rank 0, 2, 1; the RoCE port a plane after them (mlx5_0:2 is IB and down) */
  if (!want) want = "mlx5_0:1@0,mlx5_1:1@2,mlx5_10:1@1,mlx5_2:1@3";
  if (strcmp(names, want) != 0) fail("devices '%s', expected '%s' (MPLANE_IB_HCA='%s')", names, want, hca ? hca : "");
  /* IB_TEST_WANT_INFO: a line the plugin must log exactly once (what it found, what to set) */
  const char *info = getenv("IB_TEST_WANT_INFO");
  if (info && log_count(info) != 1) fail("'%s' logged %d times, expected once; the log:\n%s", info, log_count(info), logged);
  note("MPLANE_IB_HCA='%s' -> %s", hca ? hca : "", names);
  return 0;
}

/* A node shape on a fixture: the node's files (IB_TEST_TOPO, an hwloc XML: GPUs, NICs, PCI) and the
 * fabric as the double plays it (IB_TEST_DEVS), through the plugin's init: topo/ places the planes
 * from the transport's facts. Prints the node as mplane-topo does (table and picture) and checks
 * each device's plane in the plugin's view (IB_TEST_WANT: name@plane, -1 for none). */
static int sc_topo_shape(void) {
  env_base(getenv("IB_TEST_DEVS"));
  setenv("MPLANE_TOPO_FILE", getenv("IB_TEST_TOPO"), 1);
  setenv("MPLANE_NCCL_TOPO", "0", 1);
  up();
  const struct mplane_topo *t = mplane_topo_node();
  if (!t) fail("no node topology after init");
  mplane_topo_print_table(t, stderr);
  mplane_topo_print_picture(t, stderr);
  int n = 0;
  const struct mplane_dev_props *props = mplane_net_props(&n);
  char got[1024] = "";
  for (int d = 0; d < n; d++)
    snprintf(got + strlen(got), sizeof(got) - strlen(got), "%s%s@%d", d ? "," : "", props[d].name, props[d].plane);
  if (strcmp(got, getenv("IB_TEST_WANT")) != 0) fail("planes %s, expected %s", got, getenv("IB_TEST_WANT"));
  note("%s: %s (%d planes from %s)", getenv("IB_TEST_SHAPE") ? getenv("IB_TEST_SHAPE") : "shape", got, t->nplanes,
       mplane_topo_plane_source_name(t->plane_source));
  return 0;
}

/* Cross-plane: a connect from plane 0 to a peer on plane 1 is carried by the local plane-1 NIC;
 * softverbs drops anything sent between subnets, so only a correct relay choice moves data. */
static int sc_cross_plane(void) {
  env_base("mlx5_0:ib:subnet=0,mlx5_1:ib:subnet=1");
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 1, 0);
  transfer(&p, 1 << 20, 20, 1);
  pair_close(&p);
  struct rec r[16];
  int n = rec_find(r, 16, "event=modify", "state=RTR", "dev=mlx5_0", NULL);
  if (n != 0) fail("%d QPs on mlx5_0 (plane 0) took part in a connection to plane 1", n);
  note("plane 0 -> plane 1 carried by mlx5_1");
  return 0;
}

/* Relayed connections stage their buffers (host buffers here, as if they were GPU buffers: the test
 * switches of net/relay.h, with the CPU stand-in for the copy engine and 64 KiB slots): a
 * same-plane connection registers no staging ring, a relayed one registers one (4 x 64 KiB) and every
 * byte arrives, across sizes that fill less than a slot, whole slots, and many slots per chunk. */
#define STAGE_RING_BYTES (4 * 65536)
static void stage_env(void) {
  env_base("mlx5_0:ib:subnet=0,mlx5_1:ib:subnet=1");
  setenv("MPLANE_TEST_RELAY_HOST", "1", 1);
  setenv("MPLANE_TEST_RELAY_COPIER", "cpu", 1);
  setenv("MPLANE_TEST_RELAY_SLOT_BYTES", "65536", 1);
}

static int staging_rings(void) {
  char want[64];
  snprintf(want, sizeof(want), "length=%d", STAGE_RING_BYTES);
  struct rec r[16];
  return rec_find(r, 16, "event=reg_mr", want, NULL);
}

static int sc_cross_plane_staged(void) {
  stage_env();
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 1 << 20, 20, 1);
  pair_close(&p);
  if (staging_rings() != 0) fail("a same-plane connection registered a staging ring");
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 1, 0);
  static const size_t sizes[] = {0, 1, 4095, 65536, 65537, (1 << 20) + 3, (8 << 20) + 5};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) transfer(&p, sizes[i], 20, 1);
  pair_close(&p);
  int n = staging_rings();
  if (n != 1) fail("%d staging rings registered for one relayed connection, expected 1", n);
  note("relayed connection: %zu sizes through a 4 x 64 KiB staging ring, every byte checked",
       sizeof(sizes) / sizeof(sizes[0]));
  return 0;
}

/* Where the NIC's verbs take dma-bufs, the staging ring is registered through its dma-buf (no
 * nvidia-peermem needed for a GPU ring; the stand-in's ring is a memfd), and the bytes still arrive. */
static int sc_cross_plane_staged_dmabuf(void) {
  stage_env();
  setenv("SOFTVERBS_DMABUF", "1", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 1, 0);
  static const size_t sizes[] = {1, 65537, (1 << 20) + 3, (8 << 20) + 5};
  for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) transfer(&p, sizes[i], 20, 1);
  pair_close(&p);
  char want[64];
  snprintf(want, sizeof(want), "length=%d", STAGE_RING_BYTES);
  struct rec r[16];
  int n = rec_find(r, 16, "event=reg_mr", want, "dmabuf=1", NULL);
  if (n != 1) fail("%d staging rings registered through a dma-buf, expected 1 (%d plainly)", n, staging_rings() - n);
  note("relayed connection: the staging ring registered through its dma-buf, %zu sizes, every byte checked",
       sizeof(sizes) / sizeof(sizes[0]));
  return 0;
}

/* A copy into staging that fails (MPLANE_TEST_RELAY_FAIL=copy:N) or a staging ring that cannot be
 * registered (=reg) fails the send with an error NCCL can report, within the transfer's limit. */
static int sc_cross_plane_stage_fault(void) {
  stage_env();
  const char *what = getenv("IB_TEST_RELAY_FAIL") ? getenv("IB_TEST_RELAY_FAIL") : "copy:3";
  setenv("MPLANE_TEST_RELAY_FAIL", what, 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 1, 0);
  ncclResult_t res = transfer(&p, (1 << 20) + 3, 20, 0);
  pair_close(&p);
  if (res == ncclSuccess) fail("MPLANE_TEST_RELAY_FAIL=%s, but the relayed send succeeded", what);
  note("MPLANE_TEST_RELAY_FAIL=%s: the relayed send failed with %d", what, (int)res);
  return 0;
}

/* The QP attributes of MPLANE_IB_TIMEOUT / MPLANE_IB_RETRY_CNT reach the QPs. */
/* A port that requires a GRH (IB SR-IOV VFs in cloud VMs): every QP gets a global address, the
 * data moves; a plain IB port in one subnet uses LIDs only. */
static int sc_grh(void) {
  env_base(getenv("IB_TEST_DEVS") ? getenv("IB_TEST_DEVS") : "mlx5_0:ib:grh");
  up();
  sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, NULL, NULL); /* 1 MiB x 20, bytes checked */
  long want = getenv("IB_TEST_WANT") ? atol(getenv("IB_TEST_WANT")) : 1;
  struct rec r[16];
  int n = rec_find(r, 16, "event=modify", "state=RTR", NULL);
  for (int i = 0; i < n; i++)
    if (rec_val(&r[i], "is_global") != want) fail("a QP reached RTR with is_global %ld, expected %ld: %s",
                                                   rec_val(&r[i], "is_global"), want, r[i].line);
  note("%d QPs at RTR, all with is_global=%ld", n, want);
  return 0;
}

/* NCCL's buffers are registered with relaxed ordering, the FIFO and the length records never. */
static int sc_relaxed_ordering(void) {
  env_base("mlx5_0:ib");
  up();
  unlink(record_path);
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 1 << 20, 10, 1);
  pair_close(&p);
  struct rec r[64];
  int n = rec_find(r, 64, "event=reg_mr", NULL), data_ro = 0;
  for (int i = 0; i < n; i++) {
    long len = rec_val(&r[i], "length"), ro = rec_val(&r[i], "relaxed_ordering");
    int fifo = len == (long)(sizeof(struct mpib_fifo_wire) * MPIB_MAX_REQS);
    int lens = len == (long)(sizeof(uint64_t) * MPIB_MAX_REQS * MPIB_MAX_RECVS * MPIB_MAX_QPS);
    if ((fifo || lens) && ro) fail("the %s was registered with relaxed ordering: %s", fifo ? "FIFO" : "length records", r[i].line);
    if (len >= (1 << 20) && ro) data_ro++;
  }
  const char *wr = getenv("IB_TEST_WANT_RO");
  int want = wr ? atoi(wr) : 2;
  if (data_ro != want)
    fail("%d of the 2 data buffers (send and receive) were registered with relaxed ordering, expected %d "
         "(MPLANE_IB_PCI_RELAXED_ORDERING='%s', NCCL_IB_PCI_RELAXED_ORDERING='%s')", data_ro, want,
         env_text("MPLANE_IB_PCI_RELAXED_ORDERING"),
         env_text("NCCL_IB_PCI_RELAXED_ORDERING"));
  note("%d registrations: %d data buffers relaxed ordering, FIFO and length records strict", n, data_ro);
  return 0;
}

/* ------------------------------------------------------------------ adaptive routing, QP splitting */
/* "1M" -> 1048576; "4K", "100" */
static size_t size_arg(const char *s, char **end) {
  size_t v = strtoul(s, end, 10);
  if (**end == 'K') v <<= 10, (*end)++;
  else if (**end == 'M') v <<= 20, (*end)++;
  return v;
}

/* One message of `size` bytes on a new connection of class cls: 1 if its data went in the AR form
 * (a plain RDMA write before its write with immediate), 0 if as one write with immediate. The only
 * other plain write of the connection is the receiver's FIFO write. */
static int ar_form_used(int cls, size_t size) {
  unlink(record_path);
  struct pair p;
  pair_open(&p, cls, NULL, 0, 0);
  transfer(&p, size, 20, 1);
  pair_close(&p);
  struct rec r[64];
  int n = rec_find(r, 64, "event=destroy", NULL);
  long writes = 0;
  for (int i = 0; i < n; i++) writes += rec_val(&r[i], "writes");
  return writes > 1;
}

/* Adaptive routing per two-sided connection: IB_TEST_AR lists CLASS:SIZE:WANT cases (class a name or
 * "none", WANT 1 for the AR form), under whatever MPLANE_* / NCCL_IB_* the test sets. */
static int sc_ar(void) {
  const char *devs = getenv("IB_TEST_DEVS");
  env_base(devs ? devs : "mlx5_0:ib");
  up();
  const char *cases = getenv("IB_TEST_AR");
  if (!cases) fail("IB_TEST_AR is unset");
  for (const char *c = cases; *c;) {
    const char *colon = strchr(c, ':');
    if (!colon) fail("IB_TEST_AR '%s': expected CLASS:SIZE:WANT", c);
    int cls = strncmp(c, "none", 4) == 0 ? NCCL_NET_TRAFFIC_CLASS_UNDEF : mplane_tc_class_by_name(c, (size_t)(colon - c));
    if (cls < 0 && cls != NCCL_NET_TRAFFIC_CLASS_UNDEF) fail("IB_TEST_AR: unknown class in '%s'", c);
    char *end;
    size_t size = size_arg(colon + 1, &end);
    if (*end != ':') fail("IB_TEST_AR '%s': expected CLASS:SIZE:WANT", c);
    int want = end[1] == '1';
    int got = ar_form_used(cls, size);
    if (got != want)
      fail("class %s, %zu bytes: data %s the AR form (write, then write with immediate); expected %s "
           "(MPLANE_TC_MAP='%s' MPLANE_IB_ADAPTIVE_ROUTING='%s' NCCL_IB_ADAPTIVE_ROUTING='%s' NCCL_IB_AR_THRESHOLD='%s')",
           cls < 0 ? "none" : mplane_tc_class_name(cls), size, got ? "went in" : "did not go in", want ? "it" : "one write with immediate",
           env_text("MPLANE_TC_MAP"), env_text("MPLANE_IB_ADAPTIVE_ROUTING"),
           env_text("NCCL_IB_ADAPTIVE_ROUTING"),
           env_text("NCCL_IB_AR_THRESHOLD"));
    note("class %s, %zu bytes: %s", cls < 0 ? "none" : mplane_tc_class_name(cls), size,
         got ? "AR form" : "one write with immediate");
    c = end + 2;
    if (*c == ',') c++;
  }
  return 0;
}

/* MPLANE_IB_QPS=4: four 1 MiB messages. Striped (MPLANE_IB_SPLIT_DATA_ON_QPS=1, the default), each
 * sender QP carries a chunk of each; split off (0, or NCCL_IB_SPLIT_DATA_ON_QPS=0), each message goes
 * whole on one QP, round-robin: one write with immediate per QP. IB_TEST_WANT_IMMS: per QP. */
static int sc_split(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_IB_QPS", "4", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  for (int i = 0; i < 4; i++) transfer(&p, 1 << 20, 20, 1);
  pair_close(&p);
  long want = getenv("IB_TEST_WANT_IMMS") ? atol(getenv("IB_TEST_WANT_IMMS")) : 4;
  struct rec r[64];
  int n = rec_find(r, 64, "event=destroy", NULL), senders = 0;
  for (int i = 0; i < n; i++) {
    long imms = rec_val(&r[i], "write_imms");
    if (imms <= 0) continue;
    senders++;
    if (imms != want)
      fail("a sender QP carried %ld writes with immediate for four 1 MiB messages, expected %ld (%s) "
           "(MPLANE_IB_SPLIT_DATA_ON_QPS='%s' NCCL_IB_SPLIT_DATA_ON_QPS='%s')", imms, want,
           want == 1 ? "whole messages, round-robin" : "each striped over every QP",
           env_text("MPLANE_IB_SPLIT_DATA_ON_QPS"),
           env_text("NCCL_IB_SPLIT_DATA_ON_QPS"));
  }
  if (senders != 4) fail("%d sender QPs carried data, expected all 4", senders);
  note("four 1 MiB messages on 4 QPs: %ld write(s) with immediate on each", want);
  return 0;
}

/* ------------------------------------------------------------------ one-sided ops in one process */
/* A group of one rank on device 0: its ops to itself go through its QP to its mirror, as any rank's. */
struct rma1 {
  void *lc, *group, *ctx;
};

static void rma1_open(struct rma1 *m) {
  const struct mplane_rma_ops *o = &mpib_rma_ops;
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  if (o->listen(0, handle, &m->lc) != ncclSuccess) fail("RMA listen");
  void *handles[1] = {handle};
  if (o->connect(handles, 1, 0, m->lc, &m->group) != ncclSuccess) fail("RMA connect");
  struct mplane_rma_ctx_opts co = {.ncontexts = 1, .rank_stride = 1, .comm_tclass = -1};
  if (o->create_context(m->group, &co, &m->ctx) != ncclSuccess) fail("RMA createContext");
}

static void rma1_close(struct rma1 *m) {
  mpib_rma_ops.destroy_context(m->ctx);
  mpib_rma_ops.close_group(m->group);
  mpib_rma_ops.close_listen(m->lc);
}

static void rma1_wait(struct rma1 *m, void *req, const char *what) {
  double t0 = now();
  for (int done = 0; !done;) {
    if (mpib_rma_ops.test(m->group, req, &done) != ncclSuccess) fail("%s failed", what);
    if (now() - t0 > 10) fail("%s did not complete in 10 s", what);
  }
}

/* A window of `bytes` in a memfd registered as GPU memory through its dma-buf (the double's GPU memory). */
static char *fake_gpu_window(struct rma1 *m, size_t bytes, uint64_t flags, void **mh) {
  int fd = memfd_create("mplane-ib-gpu", 0);
  if (fd < 0 || ftruncate(fd, (off_t)bytes) != 0) fail("memfd: %s", strerror(errno));
  char *w = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (w == MAP_FAILED) fail("mmap: %s", strerror(errno));
  if (mpib_rma_ops.reg_mr_sym_dmabuf(m->group, w, bytes, NCCL_PTR_CUDA, 0, fd, flags, mh) != ncclSuccess)
    fail("regMrSymDmaBuf of %zu bytes", bytes);
  close(fd);
  return w;
}

static char *host_window(struct rma1 *m, size_t bytes, uint64_t flags, void **mh) {
  char *w = NULL;
  if (posix_memalign((void **)&w, 4096, bytes) != 0) fail("out of memory");
  memset(w, 0, bytes);
  if (mpib_rma_ops.reg_mr_sym(m->group, w, bytes, NCCL_PTR_HOST, flags, mh) != ncclSuccess)
    fail("regMrSym of %zu bytes", bytes);
  return w;
}

/* The relaxed-ordering bit of the one registration of `length` bytes (dmabuf 0/1), -1 if none. */
static int reg_relaxed(long length, int dmabuf) {
  char len_kv[48], dmabuf_kv[16];
  snprintf(len_kv, sizeof(len_kv), "length=%ld", length);
  snprintf(dmabuf_kv, sizeof(dmabuf_kv), "dmabuf=%d", dmabuf);
  struct rec r[4];
  int n = rec_find(r, 4, "event=reg_mr", len_kv, dmabuf_kv, NULL);
  if (n != 1) fail("%d registrations of %ld bytes (dmabuf %d), expected 1", n, length, dmabuf);
  return (int)rec_val(&r[0], "relaxed_ordering");
}

/* One-sided windows as NCCL's GIN registers them: data windows (host and GPU) with PCIe relaxed
 * ordering where MPLANE_IB_PCI_RELAXED_ORDERING allows it (IB_TEST_WANT_RO), signal windows
 * (NCCL_NET_MR_FLAG_FORCE_SO) never; a put with its signal still lands, data before signal. Window
 * sizes differ so that the double's record tells them apart. */
static int sc_rma_relaxed_ordering(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_DMABUF", "1", 1);
  up();
  struct rma1 m;
  rma1_open(&m);
  void *mh_dst, *mh_src, *mh_sig, *mh_gdst, *mh_gsig;
  char *dst = host_window(&m, 3 * 4096, 0, &mh_dst);
  char *src = host_window(&m, 5 * 4096, 0, &mh_src);
  uint64_t *sig = (uint64_t *)host_window(&m, 2 * 4096, NCCL_NET_MR_FLAG_FORCE_SO, &mh_sig);
  char *gdst = fake_gpu_window(&m, 7 * 4096, 0, &mh_gdst);
  fake_gpu_window(&m, 6 * 4096, NCCL_NET_MR_FLAG_FORCE_SO, &mh_gsig);
  for (int i = 0; i < 4096; i++) src[i] = (char)(i * 13 + 1);
  struct mplane_rma_signal s = {.off = 8, .mhandle = mh_sig, .op = NCCL_NET_SIGNAL_OP_INC};
  void *req = NULL;
  if (mpib_rma_ops.iput(m.ctx, 0, 0, mh_src, 4096, 4096, mh_dst, 0, &s, &req) != ncclSuccess || !req) fail("putSignal");
  rma1_wait(&m, req, "putSignal into a relaxed data window");
  if (memcmp(dst + 4096, src, 4096) != 0 || sig[1] != 1) fail("the put (or its signal, %llu) did not land", (unsigned long long)sig[1]);
  if (mpib_rma_ops.iput(m.ctx, 0, 0, mh_src, 4096, 0, mh_gdst, 0, NULL, &req) != ncclSuccess || !req) fail("put");
  rma1_wait(&m, req, "put into a GPU data window");
  (void)gdst;
  int want = getenv("IB_TEST_WANT_RO") ? atoi(getenv("IB_TEST_WANT_RO")) : 1;
  struct { const char *what; long len; int dmabuf, want; } w[] = {
      {"host data window", 3 * 4096, 0, want}, {"host source window", 5 * 4096, 0, want},
      {"host signal window", 2 * 4096, 0, 0},  {"GPU data window", 7 * 4096, 1, want},
      {"GPU signal window", 6 * 4096, 1, 0}};
  for (size_t i = 0; i < sizeof(w) / sizeof(w[0]); i++) {
    int ro = reg_relaxed(w[i].len, w[i].dmabuf);
    if (ro != w[i].want)
      fail("the %s was registered %s relaxed ordering, expected %s (MPLANE_IB_PCI_RELAXED_ORDERING='%s')", w[i].what,
           ro ? "with" : "without", w[i].want ? "with" : "without",
           env_text("MPLANE_IB_PCI_RELAXED_ORDERING"));
  }
  rma1_close(&m);
  note("data windows %s relaxed ordering, signal windows strict; putSignal landed in order", want ? "with" : "without");
  return 0;
}

/* A get into a GPU window, then iflush. Flushes on (IB_TEST_WANT_FLUSH=1): a request, one flush read
 * of GPU memory (the double's event=gpu_flush), and the bytes visible after it. MPLANE_IB_GDR_FLUSH_DISABLE=1
 * (or NCCL's twin): NULL (done), and no read, as for two-sided receives. */
static int sc_rma_flush(void) {
  env_base("mlx5_0:ib");
  setenv("SOFTVERBS_DMABUF", "1", 1);
  up();
  struct rma1 m;
  rma1_open(&m);
  void *mh_src, *mh_gpu;
  char *src = host_window(&m, 4096, 0, &mh_src);
  char *gpu = fake_gpu_window(&m, 4096, 0, &mh_gpu);
  memset(src, 0x5a, 256);
  void *req = NULL;
  if (mpib_rma_ops.iget(m.ctx, 0, 0, mh_src, 256, 0, mh_gpu, 0, &req) != ncclSuccess || !req) fail("get");
  rma1_wait(&m, req, "get into a GPU window");
  req = NULL;
  if (mpib_rma_ops.iflush(m.ctx, 0, mh_gpu, 0, &req) != ncclSuccess) fail("iflush failed");
  int want = getenv("IB_TEST_WANT_FLUSH") ? atoi(getenv("IB_TEST_WANT_FLUSH")) : 1;
  if (!want && req)
    fail("iflush after a get into GPU memory gave a request though GDR flushes are disabled "
         "(MPLANE_IB_GDR_FLUSH_DISABLE='%s', NCCL_GDR_FLUSH_DISABLE='%s')",
         env_text("MPLANE_IB_GDR_FLUSH_DISABLE"),
         env_text("NCCL_GDR_FLUSH_DISABLE"));
  if (want && !req) fail("iflush after a get into GPU memory gave no request");
  if (req) rma1_wait(&m, req, "flush");
  if (want && gpu[0] != 0x5a) fail("the get's bytes are not visible in GPU memory after the flush");
  rma1_close(&m);
  struct rec r[4];
  int reads = rec_find(r, 4, "event=gpu_flush", NULL);
  if (want != (reads > 0)) fail("%d flush reads of GPU memory, expected %s", reads, want ? "one" : "none");
  note("iflush after a get into GPU memory: %s", want ? "one flush read, bytes visible" : "done at once, no read");
  return 0;
}

/* QPs sized for their role, as NCCL's net_ib: a sender's QPs take no receives and keep a little
 * inline room (the AR length record), a receiver's QPs a small send queue (FIFO writes) and the
 * receives, the flush QP reads only; data still moves, with adaptive routing too (two WRs a chunk). */
static int sc_qp_sizes(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_TC_MAP", "default=0:ar", 1);
  setenv("MPLANE_IB_QPS", "2", 1);
  up();
  unlink(record_path);
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  for (int i = 0; i < 4; i++) transfer(&p, 1 << 20, 10, 1);
  pair_close(&p);
  struct rec r[16];
  int n = rec_find(r, 16, "event=create_qp", NULL), send = 0, recv = 0;
  for (int i = 0; i < n; i++) {
    long sq = rec_val(&r[i], "max_send_wr"), rq = rec_val(&r[i], "max_recv_wr"), inl = rec_val(&r[i], "max_inline_data");
    if (rq == 0 && sq == MPIB_SEND_SQ && inl == MPIB_INLINE) send++;
    else if (rq == MPIB_RQ_DEPTH && sq == MPIB_RECV_SQ && inl == 0) recv++;
    else fail("a QP of neither role's size: %s", r[i].line);
  }
  if (send != 2 || recv != 2) fail("%d sender and %d receiver QPs, expected 2 and 2 (MPLANE_IB_QPS=2)", send, recv);
  note("2 sender QPs (%d send WRs, no receives, %d B inline), 2 receiver QPs (%d send WRs, %d receives)", MPIB_SEND_SQ,
       MPIB_INLINE, MPIB_RECV_SQ, MPIB_RQ_DEPTH);
  return 0;
}

/* Small messages: the receiver's FIFO writes ask for a completion once in MPIB_FIFO_SIGNAL_EVERY per
 * QP, not each (every irecv posted a signaled write before), and nothing stalls on the send queue. */
static int sc_fifo_unsignaled(void) {
  env_base("mlx5_0:ib");
  up();
  unlink(record_path);
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  enum { N = 200 };
  for (int i = 0; i < N; i++) transfer(&p, 8, 10, 1);
  pair_close(&p);
  struct rec c[16], d[16];
  int nc = rec_find(c, 16, "event=create_qp", NULL), nd = rec_find(d, 16, "event=destroy", NULL);
  long fifo = 0, signaled = 0;
  for (int i = 0; i < nc; i++) {
    if (rec_val(&c[i], "max_recv_wr") != MPIB_RQ_DEPTH) continue; /* a receiver's QP: it writes the FIFO */
    for (int j = 0; j < nd; j++)
      if (rec_val(&d[j], "qpn") == rec_val(&c[i], "qpn")) {
        fifo += rec_val(&d[j], "writes");
        signaled += rec_val(&d[j], "signaled");
      }
  }
  if (fifo != N) fail("the receiver's QPs wrote %ld FIFO slots for %d receives", fifo, N);
  if (signaled > N / MPIB_FIFO_SIGNAL_EVERY + 2)
    fail("%ld of %ld FIFO writes were signaled; expected about one in %d per QP", signaled, fifo,
         MPIB_FIFO_SIGNAL_EVERY);
  note("%ld FIFO writes, %ld signaled", fifo, signaled);
  return 0;
}

/* A message past maxP2pBytes (1 GiB, ConnectX's max_msg_sz) is refused by isend with a WARN; it was
 * posted, and the HCA fails such a work request (softverbs: a local length error at test). */
static int sc_max_msg(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_IB_QPS", "1", 1);
  up();
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  const struct mplane_dev_props *props = NULL;
  if (mplane_net_get_properties(0, &props) != ncclSuccess || props->max_p2p_bytes != (1UL << 30))
    fail("maxP2pBytes is not 1 GiB");
  static char buf[8192];
  void *smh = NULL, *rmh = NULL, *rreq = NULL, *sreq = NULL;
  if (mplane_net_reg_mr(p.sc, buf, sizeof(buf), NCCL_PTR_HOST, &smh) != ncclSuccess) fail("regMr send");
  if (mplane_net_reg_mr(p.rc, buf, sizeof(buf), NCCL_PTR_HOST, &rmh) != ncclSuccess) fail("regMr recv");
  size_t rsize = (1UL << 30) + 4096;
  void *rdata = buf;
  int tag = 1;
  if (mplane_net_irecv(p.rc, 1, &rdata, &rsize, &tag, &rmh, &rreq) != ncclSuccess || !rreq) fail("irecv");
  ncclResult_t res = ncclSuccess;
  double t0 = now();
  while (res == ncclSuccess && !sreq && now() - t0 < 10) res = mplane_net_isend(p.sc, buf, (1UL << 30) + 1, tag, smh, &sreq);
  if (res != ncclInvalidArgument) fail("isend of 1 GiB + 1 byte gave %d (request %p), expected ncclInvalidArgument", res, sreq);
  mplane_net_dereg_mr(p.sc, smh);
  mplane_net_dereg_mr(p.rc, rmh);
  pair_close(&p);
  note("isend of 1 GiB + 1 refused: ncclInvalidArgument");
  return 0;
}

/* maxComms counts the QPs a connection takes: MPLANE_IB_QPS=4 is 5 QPs (with the flush QP) of the
 * double's 65536 (it said 65536 whatever the count). */
static int sc_max_comms(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_IB_QPS", "4", 1);
  up();
  const struct mplane_dev_props *props = NULL;
  if (mplane_net_get_properties(0, &props) != ncclSuccess) fail("getProperties");
  if (props->max_comms != 65536 / 5) fail("maxComms %d with 4 QPs per connection, expected %d", props->max_comms, 65536 / 5);
  note("maxComms %d (65536 QPs / 5 per connection)", props->max_comms);
  return 0;
}

/* ECE (NCCL_IB_ECE_ENABLE): the receiver sets the sender's offer on its QPs before RTR, the sender the
 * receiver's answer on its own; the data path works with it; MPLANE_IB_ECE=0 (or NCCL_IB_ECE_ENABLE=0)
 * and a device without ECE (rxe: EOPNOTSUPP) connect without it. */
static int ece_run(const char *devspec, int *set_ok, int *rtr_with) {
  env_base(devspec);
  up();
  unlink(record_path);
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 1 << 20, 10, 1);
  transfer(&p, 8, 10, 1);
  pair_close(&p);
  struct rec r[32];
  int n = rec_find(r, 32, "event=set_ece", "rc=0", NULL);
  *set_ok = n;
  n = rec_find(r, 32, "event=modify", "state=RTR", NULL);
  *rtr_with = 0;
  for (int i = 0; i < n; i++)
    if (rec_val(&r[i], "ece") == 0x5) (*rtr_with)++;
  return 0;
}

static int sc_ece(void) {
  int set, rtr;
  setenv("MPLANE_IB_QPS", "2", 1);
  ece_run("mlx5_0:ib:ece=5", &set, &rtr);
  /* 2 receiver QPs take the offer, 2 sender QPs the answer; all 4 reach RTR with it (not the flush QP) */
  if (set != 4 || rtr != 4) fail("ECE: %d QPs set, %d reached RTR with options 0x5; expected 4 and 4", set, rtr);
  note("ECE 0x5 set on 4 QPs before RTR");
  return 0;
}

static int sc_ece_off(void) {
  int set, rtr;
  setenv("NCCL_IB_ECE_ENABLE", "0", 1); /* MPLANE_IB_ECE's NCCL twin */
  ece_run("mlx5_0:ib:ece=5", &set, &rtr);
  if (set != 0) fail("NCCL_IB_ECE_ENABLE=0 but %d QPs were set", set);
  note("NCCL_IB_ECE_ENABLE=0: no QP set, data moves");
  return 0;
}

static int sc_ece_none(void) {
  int set, rtr;
  ece_run("mlx5_0:ib", &set, &rtr);
  if (set != 0 || rtr != 0) fail("a device without ECE: %d QPs set", set);
  note("a device without ECE (EOPNOTSUPP, as rxe): none set, data moves");
  return 0;
}

static int sc_qp_attrs(void) {
  env_base("mlx5_0:ib");
  setenv("MPLANE_IB_TIMEOUT", "17", 1);
  setenv("MPLANE_IB_RETRY_CNT", "5", 1);
  up();
  sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, NULL, NULL);
  struct rec r[16];
  int n = rec_find(r, 16, "event=modify", "state=RTS", NULL);
  if (n < 2) fail("only %d QPs reached RTS", n);
  for (int i = 0; i < n; i++)
    if (rec_val(&r[i], "timeout") != 17 || rec_val(&r[i], "retry_cnt") != 5 || rec_val(&r[i], "rnr_retry") != 7)
      fail("QP attributes: %s", r[i].line);
  note("%d QPs with timeout 17, retry_cnt 5, rnr_retry 7", n);
  return 0;
}

/* 1 if the listener closed our end's peer. */
static int fd_dropped(int fd) {
  char byte;
  ssize_t r = recv(fd, &byte, 1, MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK);
}

/* A peer that opens the side channel and then stays silent (a rank busy with thousands of QP
 * setups) keeps its connection until MPLANE_CONNECT_TIMEOUT, not a fixed 10 s; past it the
 * listener drops it. IB_TEST_SILENT_S: how long the peer stays silent; IB_TEST_SILENT_DROP: 1 if the
 * listener must have dropped it by then. */
static int sc_silent_peer(void) {
  env_base("mlx5_0:ib");
  up();
  const char *w = getenv("IB_TEST_SILENT_S"), *dr = getenv("IB_TEST_SILENT_DROP");
  double wait_s = w ? atof(w) : 11.5;
  int want_drop = dr ? atoi(dr) : 0;
  struct mplane_net_ctx *ctx = NULL;
  if (mplane_net_ctx_create(1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) != ncclSuccess) fail("ctx");
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  memset(handle, 0, sizeof(handle));
  void *lc = NULL, *rc = NULL;
  if (mplane_net_listen(ctx, 0, handle, &lc) != ncclSuccess) fail("listen");
  struct mplane_handle h;
  char why[256];
  struct sockaddr_storage ss;
  socklen_t len = 0;
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess) fail("handle: %s", why);
  if (mplane_handle_sockaddr(&h, &ss, &len, why, sizeof(why)) != ncclSuccess) fail("handle address: %s", why);
  /* IB_TEST_SILENT_N peers at once: a full table of pending side channels (64) drops none of them
   * while nobody else waits */
  const char *ns = getenv("IB_TEST_SILENT_N");
  int npeers = ns ? atoi(ns) : 1, fds[64];
  if (npeers < 1 || npeers > 64) fail("IB_TEST_SILENT_N=%d: 1 to 64", npeers);
  for (int i = 0; i < npeers; i++) {
    fds[i] = socket(ss.ss_family, SOCK_STREAM, 0);
    if (fds[i] < 0 || connect(fds[i], (struct sockaddr *)&ss, len) != 0)
      fail("TCP connect %d to the listener: %s", i, strerror(errno));
  }
  int fd = fds[0];
  double t0 = now();
  while (now() - t0 < wait_s) {
    if (mplane_net_accept(lc, &rc) != ncclSuccess) fail("accept");
    if (rc) fail("a silent peer was accepted");
    usleep(10000);
  }
  int dropped = fd_dropped(fd);
  if (dropped != want_drop)
    fail("after %.1f s of silence with MPLANE_CONNECT_TIMEOUT=%s the listener %s the connection", wait_s,
         getenv("MPLANE_CONNECT_TIMEOUT"), dropped ? "dropped" : "kept");
  int ndropped = 0;
  for (int i = 0; i < npeers; i++) ndropped += fd_dropped(fds[i]);
  if (ndropped != (want_drop ? npeers : 0))
    fail("%d of %d silent peers dropped after %.1f s, expected %d", ndropped, npeers, wait_s, want_drop ? npeers : 0);
  note("%d silent %.1f s, MPLANE_CONNECT_TIMEOUT=%s: %s", npeers, wait_s, getenv("MPLANE_CONNECT_TIMEOUT"),
       dropped ? "dropped" : "kept");
  for (int i = 0; i < npeers; i++) close(fds[i]);
  mplane_net_close_listen(lc);
  mplane_net_ctx_destroy(ctx);
  return 0;
}

/* The side channel over IPv6 (MPLANE_IB_SOCKET_FAMILY=AF_INET6 on lo, ::1): the handle carries an
 * IPv6 address and a connection is made and carries data. Skipped where lo has no IPv6. */
static int lo_has_ipv6(void) {
  struct ifaddrs *ifas = NULL;
  int found = 0;
  if (getifaddrs(&ifas) != 0) return 0;
  for (struct ifaddrs *ifa = ifas; ifa; ifa = ifa->ifa_next)
    found |= ifa->ifa_addr && ifa->ifa_addr->sa_family == AF_INET6 && !strcmp(ifa->ifa_name, "lo");
  freeifaddrs(ifas);
  return found;
}

static int sc_side_ipv6(void) {
  env_base("mlx5_0:ib");
  if (!lo_has_ipv6()) {
    note("SKIP: lo has no IPv6 address");
    exit(77);
  }
  setenv("MPLANE_IB_SOCKET_FAMILY", "AF_INET6", 1);
  up();
  struct mpib_dev *d = mpib_dev_get(0);
  if (!d || d->oob.ss_family != AF_INET6) fail("the side channel is not IPv6 (family %d)", d ? d->oob.ss_family : -1);
  struct mplane_net_ctx *ctx = NULL;
  if (mplane_net_ctx_create(1, NCCL_NET_TRAFFIC_CLASS_UNDEF, &ctx) != ncclSuccess) fail("ctx");
  unsigned char handle[NCCL_NET_HANDLE_MAXSIZE];
  void *lc = NULL;
  if (mplane_net_listen(ctx, 0, handle, &lc) != ncclSuccess) fail("listen on ::1");
  struct mplane_handle h;
  char why[256];
  struct sockaddr_storage ss;
  socklen_t len = 0;
  if (mplane_handle_decode(handle, &h, why, sizeof(why)) != ncclSuccess) fail("handle: %s", why);
  if (mplane_handle_sockaddr(&h, &ss, &len, why, sizeof(why)) != ncclSuccess) fail("handle address: %s", why);
  if (ss.ss_family != AF_INET6) fail("the handle carries family %d, not AF_INET6", ss.ss_family);
  mplane_net_close_listen(lc);
  mplane_net_ctx_destroy(ctx);
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 1 << 20, 10, 1);
  pair_close(&p);
  note("side channel on ::1: connected, 1 MiB checked");
  return 0;
}

/* The side channel takes the interfaces NCCL_SOCKET_IFNAME names, as NCCL's out-of-band does (and
 * MPLANE_IB_SOCKET_IFNAME over it), before the port's own interface or the first usable one: here
 * lo, where MPLANE_SOCKET_IFNAME would exclude it. It connects and moves data there. */
static int sc_side_ifname(void) {
  env_base("mlx5_0:ib");
  const char *want = getenv("IB_TEST_WANT_OOB") ? getenv("IB_TEST_WANT_OOB") : "127.0.0.1";
  setenv("MPLANE_SOCKET_IFNAME", "^lo", 1);
  up();
  struct mpib_dev *d = mpib_dev_get(0);
  char where[64];
  if (!d) fail("no device");
  mpib_oob_str(d, where, sizeof(where));
  if (strcmp(where, want) != 0)
    fail("side channel on %s, expected %s (NCCL_SOCKET_IFNAME='%s', MPLANE_IB_SOCKET_IFNAME='%s')", where, want,
         env_text("NCCL_SOCKET_IFNAME"), env_text("MPLANE_IB_SOCKET_IFNAME"));
  struct pair p;
  pair_open(&p, NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, 0, 0);
  transfer(&p, 1 << 20, 5, 1);
  pair_close(&p);
  note("side channel on %s as NCCL_SOCKET_IFNAME / MPLANE_IB_SOCKET_IFNAME say; 1 MiB checked", where);
  return 0;
}

/* MPLANE_IB_FIFO_TC / NCCL_IB_FIFO_TC on RoCE: the receiver's QPs (its FIFO writes) on that traffic
 * class, the sender's on the connection's (NCCL_IB_TC here). */
static int sc_fifo_tc(void) {
  env_base("mlx5_0:roce:ip=198.18.0.1");
  setenv("NCCL_IB_TC", "106", 1);
  setenv("NCCL_IB_FIFO_TC", "184", 1);
  up();
  sl_of_conn(NCCL_NET_TRAFFIC_CLASS_UNDEF, NULL, NULL, NULL);
  struct rec r[32];
  int n = rec_find(r, 32, "event=modify", "state=RTR", NULL), data = 0, fifo = 0;
  for (int i = 0; i < n; i++) {
    long tc = rec_val(&r[i], "traffic_class");
    if (tc == 106) data++;
    else if (tc == 184) fifo++;
    else fail("a QP on traffic class %ld: %s", tc, r[i].line);
  }
  if (!data || !fifo) fail("%d QPs on the data's traffic class 106 and %d on the FIFO's 184: expected both", data, fifo);
  note("%d QPs on NCCL_IB_TC=106, %d (the receiver's) on NCCL_IB_FIFO_TC=184", data, fifo);
  return 0;
}

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: ib_driver SCENARIO\n");
    return 2;
  }
  scenario = argv[1];
  alarm(100); /* a hang anywhere fails the test instead of stalling CI */
  struct {
    const char *name;
    int (*fn)(void);
  } all[] = {{"striping", sc_striping}, {"sl-class", sc_sl_class}, {"sl-hints", sc_sl_hints}, {"reg-cache", sc_reg_cache}, {"reg-cache-dmabuf", sc_reg_cache_dmabuf}, {"sl-site", sc_sl_site}, {"sl-nomap", sc_sl_nomap}, {"sl-nccl", sc_sl_nccl}, {"sl-map-wins", sc_sl_map_wins},
                 {"sl-map-own-tc", sc_sl_map_own_tc}, {"roce", sc_roce},
             {"fault-wr", sc_fault_wr}, {"port-down", sc_port_down}, {"port-flap", sc_port_flap}, {"async-dead", sc_async_dead}, {"qp-fatal", sc_qp_fatal}, {"flush", sc_flush},
             {"devices", sc_devices}, {"topo-shape", sc_topo_shape}, {"cross-plane", sc_cross_plane}, {"cross-plane-staged", sc_cross_plane_staged},
             {"cross-plane-staged-dmabuf", sc_cross_plane_staged_dmabuf},
             {"cross-plane-stage-fault", sc_cross_plane_stage_fault}, {"qp-attrs", sc_qp_attrs},
             {"grh", sc_grh}, {"gid-move", sc_gid_move}, {"qp-sizes", sc_qp_sizes}, {"fifo-unsignaled", sc_fifo_unsignaled}, {"max-msg", sc_max_msg}, {"max-comms", sc_max_comms}, {"ece", sc_ece}, {"ece-off", sc_ece_off}, {"ece-none", sc_ece_none}, {"nccl-vars", sc_nccl_vars}, {"relaxed-ordering", sc_relaxed_ordering},
             {"close-complete", sc_close_complete}, {"silent-peer", sc_silent_peer}, {"side-ipv6", sc_side_ipv6}, {"side-ifname", sc_side_ifname}, {"fifo-tc", sc_fifo_tc}, {"flush-disabled", sc_flush_disabled},
             {"ar", sc_ar}, {"split", sc_split}, {"rma-relaxed-ordering", sc_rma_relaxed_ordering}, {"rma-flush", sc_rma_flush}};
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
    if (strcmp(all[i].name, scenario) == 0) {
      int rc = all[i].fn();
      if (rc == 0) {
        fprintf(stderr, "ib[%s]: PASS\n", scenario);
        unlink(record_path);
      }
      return rc;
    }
  fprintf(stderr, "ib_driver: unknown scenario %s\n", scenario);
  return 2;
}
