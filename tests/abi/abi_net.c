/* mplane ABI harness: the plugin behind one calling convention, whatever table version is driven,
 * and the logger handed to init (its text is what the fault scenarios check). */
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "abi.h"
#include "../test_hooks_check.h"

const char *abi_scenario = "?";
int abi_rank = 0;

double abi_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

void abi_fail(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "abi[%s rank %d pid %d]: FAIL: %s\n", abi_scenario, abi_rank, (int)getpid(), msg);
  fflush(stderr);
  _exit(1);
}

void abi_note(const char *fmt, ...) {
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  fprintf(stderr, "abi[%s rank %d]: %s\n", abi_scenario, abi_rank, msg);
}

/* ------------------------------------------------------------------ logger */

static pthread_mutex_t log_lock = PTHREAD_MUTEX_INITIALIZER;
static char *log_text;      /* every line: "<level> <message>\n" */
static size_t log_len, log_cap;

void abi_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  char msg[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  const char *lv = level == NCCL_LOG_WARN ? "WARN" : level == NCCL_LOG_INFO ? "INFO" : "TRACE";
  char rec[2200];
  int n = snprintf(rec, sizeof(rec), "%s %s\n", lv, msg);
  if (n < 0) return;
  if ((size_t)n >= sizeof(rec)) n = (int)sizeof(rec) - 1;
  pthread_mutex_lock(&log_lock);
  if (log_len + (size_t)n + 1 > log_cap) {
    size_t cap = log_cap ? log_cap * 2 : 65536;
    while (cap < log_len + (size_t)n + 1) cap *= 2;
    char *p = realloc(log_text, cap);
    if (p) {
      log_text = p;
      log_cap = cap;
    }
  }
  if (log_len + (size_t)n + 1 <= log_cap) {
    memcpy(log_text + log_len, rec, (size_t)n);
    log_len += (size_t)n;
    log_text[log_len] = 0;
  }
  pthread_mutex_unlock(&log_lock);
  const char *verbose = getenv("MPLANE_ABI_VERBOSE");
  if (level == NCCL_LOG_WARN || (verbose && *verbose && strcmp(verbose, "0") != 0))
    fprintf(stderr, "abi[%s rank %d] %s %s:%d %s\n", abi_scenario, abi_rank, lv, file ? file : "?", line, msg);
}

size_t abi_log_mark(void) {
  pthread_mutex_lock(&log_lock);
  size_t m = log_len;
  pthread_mutex_unlock(&log_lock);
  return m;
}

int abi_log_warn_has(size_t mark, const char *s1, ...) {
  const char *want[16];
  int nwant = 0;
  va_list ap;
  va_start(ap, s1);
  for (const char *s = s1; s && nwant < 16; s = va_arg(ap, const char *)) want[nwant++] = s;
  va_end(ap);
  int found = 0;
  pthread_mutex_lock(&log_lock);
  for (const char *l = log_text ? log_text + mark : ""; *l && !found;) {
    const char *end = strchr(l, '\n');
    size_t len = end ? (size_t)(end - l) : strlen(l);
    if (len > 5 && strncmp(l, "WARN ", 5) == 0) {
      char *copy = strndup(l, len);
      int all = copy != NULL;
      for (int i = 0; i < nwant && all; i++) all = strstr(copy, want[i]) != NULL;
      found = all;
      free(copy);
    }
    l += len + (end ? 1 : 0);
  }
  pthread_mutex_unlock(&log_lock);
  return found;
}

int abi_log_has(size_t mark, const char *s) {
  pthread_mutex_lock(&log_lock);
  int found = log_text && strstr(log_text + mark, s) != NULL;
  pthread_mutex_unlock(&log_lock);
  return found;
}

void abi_log_dump(size_t mark, const char *why) {
  pthread_mutex_lock(&log_lock);
  fprintf(stderr, "abi[%s rank %d]: %s; plugin log since then:\n%s--\n", abi_scenario, abi_rank, why,
          log_text ? log_text + mark : "");
  pthread_mutex_unlock(&log_lock);
}

/* ------------------------------------------------------------------ loading */

static void *lib_handle;

void abi_net_close(struct abi_net *net) {
  if (!lib_handle) return;
  if (dlclose(lib_handle) != 0) abi_fail("dlclose: %s", dlerror());
  lib_handle = NULL;
  net->lib = NULL;
  net->table = NULL;
}

void abi_net_open(struct abi_net *net, const char *path, int version) {
  if (!lib_handle) {
    lib_handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!lib_handle) abi_fail("dlopen(%s): %s", path, dlerror());
    const char *hook = test_hooks_unread(lib_handle);
    if (hook) abi_fail("%s is set, but %s is built without the test hooks (load the test build)", hook, path);
  }
  char sym[32];
  snprintf(sym, sizeof(sym), "ncclNetPlugin_v%d", version);
  const void *t = dlsym(lib_handle, sym);
  if (!t) abi_fail("%s does not export %s", path, sym);
  net->version = version;
  net->lib = lib_handle;
  net->table = t;
  switch (version) {
    case 8: net->name = ((const ncclNet_v8_t *)t)->name; break;
    case 9: net->name = ((const ncclNet_v9_t *)t)->name; break;
    case 10: net->name = ((const ncclNet_v10_t *)t)->name; break;
    case 11: net->name = ((const ncclNet_v11_t *)t)->name; break;
    case 12: net->name = ((const ncclNet_v12_t *)t)->name; break;
    default: abi_fail("no ncclNet version %d", version);
  }
  if (!net->name || !*net->name) abi_fail("%s has no name", sym);
}

#define V8(n) ((const ncclNet_v8_t *)(n)->table)
#define V9(n) ((const ncclNet_v9_t *)(n)->table)
#define V10(n) ((const ncclNet_v10_t *)(n)->table)
#define V11(n) ((const ncclNet_v11_t *)(n)->table)
#define V12(n) ((const ncclNet_v12_t *)(n)->table)

/* Call the same-named member of whichever table is loaded (the calls whose signature is equal). */
#define SAME(net, call, ...)                                  \
  switch ((net)->version) {                                   \
    case 8: return V8(net)->call(__VA_ARGS__);                \
    case 9: return V9(net)->call(__VA_ARGS__);                \
    case 10: return V10(net)->call(__VA_ARGS__);              \
    case 11: return V11(net)->call(__VA_ARGS__);              \
    default: return V12(net)->call(__VA_ARGS__);              \
  }

ncclProfilerCallback_t abi_prof_callback;
void *(*abi_phandle_of)(const void *data, size_t size, int is_send);

ncclResult_t abi_init(struct abi_net *net, uint64_t comm_id, int traffic_class, void **ctx) {
  *ctx = NULL;
  ncclNetCommConfig_v11_t cfg = {.trafficClass = traffic_class};
  switch (net->version) {
    case 8: return V8(net)->init(abi_logger);
    case 9: return V9(net)->init(abi_logger);
    case 10: return V10(net)->init(abi_logger, abi_prof_callback);
    case 11: return V11(net)->init(ctx, comm_id, &cfg, abi_logger, abi_prof_callback);
    default: return V12(net)->init(ctx, comm_id, &cfg, abi_logger, abi_prof_callback);
  }
}

ncclResult_t abi_finalize(struct abi_net *net, void *ctx) {
  if (net->version == 11) return V11(net)->finalize ? V11(net)->finalize(ctx) : ncclSuccess;
  if (net->version == 12) return V12(net)->finalize ? V12(net)->finalize(ctx) : ncclSuccess;
  return ncclSuccess;
}

ncclResult_t abi_devices(struct abi_net *net, int *ndev) { SAME(net, devices, ndev); }

#define COMMON(p, s)                                 \
  do {                                               \
    (p)->name = (s).name;                            \
    (p)->pci_path = (s).pciPath;                     \
    (p)->guid = (s).guid;                            \
    (p)->ptr_support = (s).ptrSupport;               \
    (p)->reg_is_global = (s).regIsGlobal;            \
    (p)->speed = (s).speed;                          \
    (p)->port = (s).port;                            \
    (p)->latency = (s).latency;                      \
    (p)->max_comms = (s).maxComms;                   \
    (p)->max_recvs = (s).maxRecvs;                   \
    (p)->net_device_type = (int)(s).netDeviceType;   \
    (p)->net_device_version = (s).netDeviceVersion;  \
  } while (0)

#define V9PLUS(p, s)                                 \
  do {                                               \
    (p)->force_flush = (s).forceFlush;               \
    (p)->vndevs = (s).vProps.ndevs;                  \
    (p)->vdev0 = (s).vProps.devs[0];                 \
    (p)->max_p2p_bytes = (s).maxP2pBytes;            \
    (p)->max_coll_bytes = (s).maxCollBytes;          \
  } while (0)

/* Fill with a byte pattern first, so a field the plugin forgets shows up as 0xa5a5... */
ncclResult_t abi_get_props(struct abi_net *net, int dev, struct abi_props *p) {
  ncclResult_t res;
  memset(p, 0, sizeof(*p));
  p->rail_id = p->plane_id = -1;
  p->vndevs = 1;
  p->vdev0 = dev;
  switch (net->version) {
    case 8: {
      ncclNetProperties_v8_t s;
      memset(&s, 0xa5, sizeof(s));
      if ((res = V8(net)->getProperties(dev, &s)) != ncclSuccess) return res;
      COMMON(p, s);
      p->max_p2p_bytes = p->max_coll_bytes = INT_MAX;
      break;
    }
    case 9: {
      ncclNetProperties_v9_t s;
      memset(&s, 0xa5, sizeof(s));
      if ((res = V9(net)->getProperties(dev, &s)) != ncclSuccess) return res;
      COMMON(p, s);
      V9PLUS(p, s);
      break;
    }
    case 10: {
      ncclNetProperties_v10_t s;
      memset(&s, 0xa5, sizeof(s));
      if ((res = V10(net)->getProperties(dev, &s)) != ncclSuccess) return res;
      COMMON(p, s);
      V9PLUS(p, s);
      break;
    }
    case 11: {
      ncclNetProperties_v11_t s;
      memset(&s, 0xa5, sizeof(s));
      if ((res = V11(net)->getProperties(dev, &s)) != ncclSuccess) return res;
      COMMON(p, s);
      V9PLUS(p, s);
      p->max_multi_request_size = s.maxMultiRequestSize;
      break;
    }
    default: {
      ncclNetProperties_v12_t s;
      memset(&s, 0xa5, sizeof(s));
      if ((res = V12(net)->getProperties(dev, &s)) != ncclSuccess) return res;
      COMMON(p, s);
      V9PLUS(p, s);
      p->max_multi_request_size = s.maxMultiRequestSize;
      p->rail_id = s.railId;
      p->plane_id = s.planeId;
      break;
    }
  }
  return ncclSuccess;
}

ncclResult_t abi_listen(struct abi_net *net, void *ctx, int dev, void *handle, void **lc) {
  switch (net->version) {
    case 8: return V8(net)->listen(dev, handle, lc);
    case 9: return V9(net)->listen(dev, handle, lc);
    case 10: return V10(net)->listen(dev, handle, lc);
    case 11: return V11(net)->listen(ctx, dev, handle, lc);
    default: return V12(net)->listen(ctx, dev, handle, lc);
  }
}

/* NCCL hands a device-handle pointer it expects a HOST plugin to leave alone. */
ncclResult_t abi_connect(struct abi_net *net, void *ctx, int dev, void *handle, void **sc) {
  ncclNetDeviceHandle_v8_t *dh = NULL;
  ncclNetCommConfig_v10_t cfg = {.trafficClass = NCCL_NET_TRAFFIC_CLASS_UNDEF};
  ncclResult_t res;
  switch (net->version) {
    case 8: res = V8(net)->connect(dev, handle, sc, &dh); break;
    case 9: res = V9(net)->connect(dev, handle, sc, &dh); break;
    case 10: res = V10(net)->connect(dev, &cfg, handle, sc, &dh); break;
    case 11: res = V11(net)->connect(ctx, dev, handle, sc, &dh); break;
    default: res = V12(net)->connect(ctx, dev, handle, sc, &dh); break;
  }
  if (dh != NULL) abi_fail("connect wrote a device handle (%p) but the plugin offers no device offload", (void *)dh);
  return res;
}

ncclResult_t abi_accept(struct abi_net *net, void *lc, void **rc) {
  ncclNetDeviceHandle_v8_t *dh = NULL;
  ncclResult_t res;
  switch (net->version) {
    case 8: res = V8(net)->accept(lc, rc, &dh); break;
    case 9: res = V9(net)->accept(lc, rc, &dh); break;
    case 10: res = V10(net)->accept(lc, rc, &dh); break;
    case 11: res = V11(net)->accept(lc, rc, &dh); break;
    default: res = V12(net)->accept(lc, rc, &dh); break;
  }
  if (dh != NULL) abi_fail("accept wrote a device handle (%p) but the plugin offers no device offload", (void *)dh);
  return res;
}

ncclResult_t abi_reg_mr(struct abi_net *net, void *comm, void *data, size_t size, int type, void **mh) {
  if (net->version == 8 && size > INT_MAX) abi_fail("v8 cannot register %zu bytes", size);
  SAME(net, regMr, comm, data, size, type, mh);
}

ncclResult_t abi_dereg_mr(struct abi_net *net, void *comm, void *mh) { SAME(net, deregMr, comm, mh); }

static void *send_phandle(void *data, size_t size) { return abi_phandle_of ? abi_phandle_of(data, size, 1) : NULL; }

ncclResult_t abi_isend(struct abi_net *net, void *sc, void *data, size_t size, int tag, void *mh, void **req) {
  switch (net->version) {
    case 8:
      if (size > INT_MAX) abi_fail("v8 cannot send %zu bytes", size);
      return V8(net)->isend(sc, data, (int)size, tag, mh, req);
    case 9: return V9(net)->isend(sc, data, size, tag, mh, req);
    case 10: return V10(net)->isend(sc, data, size, tag, mh, send_phandle(data, size), req);
    case 11: return V11(net)->isend(sc, data, size, tag, mh, send_phandle(data, size), req);
    default: return V12(net)->isend(sc, data, size, tag, mh, send_phandle(data, size), req);
  }
}

ncclResult_t abi_irecv(struct abi_net *net, void *rc, int n, void **data, size_t *sizes, int *tags, void **mh,
                       void **req) {
  void *ph[64] = {0};
  for (int i = 0; abi_phandle_of && i < n && i < 64; i++) ph[i] = abi_phandle_of(data[i], sizes[i], 0);
  switch (net->version) {
    case 8: {
      int isz[64];
      if (n > 64) abi_fail("irecv of %d buffers", n);
      for (int i = 0; i < n; i++) {
        if (sizes[i] > INT_MAX) abi_fail("v8 cannot receive %zu bytes", sizes[i]);
        isz[i] = (int)sizes[i];
      }
      return V8(net)->irecv(rc, n, data, isz, tags, mh, req);
    }
    case 9: return V9(net)->irecv(rc, n, data, sizes, tags, mh, req);
    case 10: return V10(net)->irecv(rc, n, data, sizes, tags, mh, ph, req);
    case 11: return V11(net)->irecv(rc, n, data, sizes, tags, mh, ph, req);
    default: return V12(net)->irecv(rc, n, data, sizes, tags, mh, ph, req);
  }
}

ncclResult_t abi_iflush(struct abi_net *net, void *rc, int n, void **data, int *sizes, void **mh, void **req) {
  SAME(net, iflush, rc, n, data, sizes, mh, req);
}

ncclResult_t abi_test(struct abi_net *net, void *req, int *done, int *sizes) { SAME(net, test, req, done, sizes); }
ncclResult_t abi_close_send(struct abi_net *net, void *sc) { SAME(net, closeSend, sc); }
ncclResult_t abi_close_recv(struct abi_net *net, void *rc) { SAME(net, closeRecv, rc); }
ncclResult_t abi_close_listen(struct abi_net *net, void *lc) { SAME(net, closeListen, lc); }
