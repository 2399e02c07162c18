/* fakecuda: a CPU stand-in for the CUDA driver; the model and the environment it reads are in
 * fake_cuda.h. Every exported function has the signature of the driver's entry point of that
 * name, because callers find them with dlsym and call them through the driver's prototypes. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "fake_cuda.h"

#include "../../common/cuda_lane_ring.h"

#define FC_EXPORT __attribute__((visibility("default")))
#define FC_CTX_MAGIC 0x46434358u
#define FC_EVENT_MAGIC 0x46434556u
#define FC_DEFAULT_DELAY_US 20
#define FC_PIECE 4096 /* a copy lands in pieces of this size, last piece first */

/* The driver's special stream handles: the legacy stream and the per-thread default stream. */
#define FC_STREAM_LEGACY ((CUstream)0x1)
#define FC_STREAM_PER_THREAD ((CUstream)0x2)

/* ================================================================ devices and contexts */

struct CUctx_st {
  uint32_t magic;
  int dev;
  unsigned peers; /* bit d: peer access to device d's memory enabled (atomic) */
};

static struct {
  pthread_once_t once;
  int ready;          /* cuInit ran */
  int ndev;
  long fail_copy;     /* MPLANE_FAKE_CUDA_FAIL=copy:N, 0: none */
  long copies;        /* asynchronous copies submitted so far (atomic) */
  struct CUctx_st ctx[FAKE_CUDA_MAX_DEVICES];
} fc = {.once = PTHREAD_ONCE_INIT};

/* The context current on this thread, as cuCtxSetCurrent left it. */
static __thread struct CUctx_st *fc_current;

static long env_long(const char *name, long dflt, long lo, long hi) {
  const char *v = getenv(name);
  if (!v || !*v) return dflt;
  char *end = NULL;
  errno = 0;
  long x = strtol(v, &end, 10);
  if (errno || *end || x < lo || x > hi) {
    fprintf(stderr, "fakecuda: %s=%s is not a number in [%ld, %ld]; using %ld\n", name, v, lo, hi, dflt);
    return dflt;
  }
  return x;
}

/* MPLANE_FAKE_CUDA_FAIL=copy:N; anything else is refused loudly, so a typo cannot pass a fault
 * test that injected nothing. */
static long parse_fail(void) {
  const char *v = getenv("MPLANE_FAKE_CUDA_FAIL");
  if (!v || !*v) return 0;
  char *end = NULL;
  long n = strncmp(v, "copy:", 5) == 0 ? strtol(v + 5, &end, 10) : 0;
  if (n <= 0 || !end || *end) {
    fprintf(stderr, "fakecuda: MPLANE_FAKE_CUDA_FAIL=%s: expected copy:N with N >= 1\n", v);
    abort();
  }
  return n;
}

/* Faults of the lane kernel: see lane_kernel_run. */
static int sms_held;          /* fake_cuda_hold_sms; MPLANE_FAKE_CUDA_LANE=nostart holds them for good */
static long lane_stall_after; /* MPLANE_FAKE_CUDA_LANE=stall:N: the kernels stop after N ops in all */
static long lane_ops_run;

/* MPLANE_FAKE_CUDA_LANE=nostart|stall:N; anything else is refused loudly, as MPLANE_FAKE_CUDA_FAIL. */
static void parse_lane_fault(void) {
  const char *v = getenv("MPLANE_FAKE_CUDA_LANE");
  if (!v || !*v) return;
  char *end = NULL;
  if (strcmp(v, "nostart") == 0) sms_held = 1;
  else if (strncmp(v, "stall:", 6) == 0 && (lane_stall_after = strtol(v + 6, &end, 10)) > 0 && !*end) {
  } else {
    fprintf(stderr, "fakecuda: MPLANE_FAKE_CUDA_LANE=%s: expected nostart or stall:N with N >= 1\n", v);
    abort();
  }
}

static void fc_init_once(void) {
  parse_lane_fault();
  fc.ndev = (int)env_long("MPLANE_FAKE_CUDA_DEVICES", 1, 0, FAKE_CUDA_MAX_DEVICES);
  fc.fail_copy = parse_fail();
  for (int d = 0; d < fc.ndev; d++) fc.ctx[d] = (struct CUctx_st){.magic = FC_CTX_MAGIC, .dev = d};
  __atomic_store_n(&fc.ready, 1, __ATOMIC_RELEASE);
}

static int fc_ready(void) { return __atomic_load_n(&fc.ready, __ATOMIC_ACQUIRE); }

static int dev_ok(CUdevice d) { return d >= 0 && d < fc.ndev; }

static int ctx_ok(CUcontext c) {
  for (int d = 0; d < fc.ndev; d++)
    if (c == &fc.ctx[d]) return 1;
  return 0;
}

FC_EXPORT CUresult cuInit(unsigned int flags) {
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  pthread_once(&fc.once, fc_init_once);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGetCount(int *count) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!count) return CUDA_ERROR_INVALID_VALUE;
  *count = fc.ndev;
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!device) return CUDA_ERROR_INVALID_VALUE;
  if (!dev_ok(ordinal)) return CUDA_ERROR_INVALID_DEVICE;
  *device = ordinal;
  return CUDA_SUCCESS;
}

/* One primary context per device for the whole process, as the driver keeps it. */
FC_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!pctx) return CUDA_ERROR_INVALID_VALUE;
  if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
  *pctx = &fc.ctx[dev];
  return CUDA_SUCCESS;
}

/* The primary context stays for the whole process: releasing it only checks the device. */
FC_EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  return dev_ok(dev) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

FC_EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (ctx && !ctx_ok(ctx)) return CUDA_ERROR_INVALID_CONTEXT;
  fc_current = ctx;
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuDeviceCanAccessPeer(int *canAccessPeer, CUdevice dev, CUdevice peerDev) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!canAccessPeer) return CUDA_ERROR_INVALID_VALUE;
  if (!dev_ok(dev) || !dev_ok(peerDev)) return CUDA_ERROR_INVALID_DEVICE;
  *canAccessPeer = dev != peerDev; /* the driver says 0 for a device and itself */
  return CUDA_SUCCESS;
}

/* Enables the current context's access to peerContext's memory; a second call says so, as the
 * driver does (callers are expected to take CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED as success). */
FC_EXPORT CUresult cuCtxEnablePeerAccess(CUcontext peerContext, unsigned int flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct CUctx_st *cur = fc_current;
  if (!cur || !ctx_ok(peerContext)) return CUDA_ERROR_INVALID_CONTEXT;
  if (peerContext == cur) return CUDA_ERROR_INVALID_DEVICE;
  unsigned bit = 1u << peerContext->dev;
  unsigned was = __atomic_fetch_or(&cur->peers, bit, __ATOMIC_ACQ_REL);
  return was & bit ? CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED : CUDA_SUCCESS;
}

/* A made-up bus id per device, in the driver's form (domain:bus:device.function, hex). */
FC_EXPORT CUresult cuDeviceGetPCIBusId(char *pciBusId, int len, CUdevice dev) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!dev_ok(dev)) return CUDA_ERROR_INVALID_DEVICE;
  if (!pciBusId || len < 13) return CUDA_ERROR_INVALID_VALUE;
  snprintf(pciBusId, (size_t)len, "0000:%02X:00.0", 0xE0 + dev);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuGetErrorString(CUresult error, const char **pStr) {
  static const struct {
    CUresult code;
    const char *str;
  } names[] = {
      {CUDA_SUCCESS, "no error"},
      {CUDA_ERROR_INVALID_VALUE, "invalid argument"},
      {CUDA_ERROR_OUT_OF_MEMORY, "out of memory"},
      {CUDA_ERROR_NOT_INITIALIZED, "initialization error"},
      {CUDA_ERROR_INVALID_DEVICE, "invalid device ordinal"},
      {CUDA_ERROR_INVALID_CONTEXT, "invalid device context"},
      {CUDA_ERROR_INVALID_HANDLE, "invalid resource handle"},
      {CUDA_ERROR_NOT_READY, "device not ready"},
      {CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED, "peer access is already enabled"},
      {CUDA_ERROR_NOT_SUPPORTED, "operation not supported"},
      {CUDA_ERROR_UNKNOWN, "unknown error"},
  };
  if (!pStr) return CUDA_ERROR_INVALID_VALUE;
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
    if (names[i].code == error) {
      *pStr = names[i].str;
      return CUDA_SUCCESS;
    }
  *pStr = NULL; /* what the driver does for a code it does not know */
  return CUDA_ERROR_INVALID_VALUE;
}

/* ================================================================ memory regions */

enum { FC_MEM_DEVICE, FC_MEM_HOST };

struct region {
  uintptr_t base;
  size_t size;   /* what was asked for: a range past it is refused */
  size_t mapped; /* size rounded to pages, plus the guard page */
  int kind, dev;
};

static struct {
  pthread_mutex_t lock;
  struct region *r;
  size_t n, cap;
} regions = {.lock = PTHREAD_MUTEX_INITIALIZER};

static int region_add(struct region nr) {
  pthread_mutex_lock(&regions.lock);
  if (regions.n == regions.cap) {
    size_t cap = regions.cap ? regions.cap * 2 : 64;
    struct region *r = realloc(regions.r, cap * sizeof(*r));
    if (!r) {
      pthread_mutex_unlock(&regions.lock);
      return -1;
    }
    regions.r = r;
    regions.cap = cap;
  }
  regions.r[regions.n++] = nr;
  pthread_mutex_unlock(&regions.lock);
  return 0;
}

/* The region of this kind that holds [p, p + n) whole (n 0: holds p); 0 found, -1 none. */
static int region_find(uintptr_t p, size_t n, int kind, struct region *out) {
  int rc = -1;
  pthread_mutex_lock(&regions.lock);
  for (size_t i = 0; i < regions.n; i++) {
    struct region *r = &regions.r[i];
    if (r->kind != kind || p < r->base || p - r->base >= r->size) continue;
    if (n > r->size - (p - r->base)) break; /* starts inside, runs past the end */
    if (out) *out = *r;
    rc = 0;
    break;
  }
  pthread_mutex_unlock(&regions.lock);
  return rc;
}

/* Removes the region that starts exactly at base (the driver frees only what it handed out). */
static int region_take(uintptr_t base, int kind, struct region *out) {
  int rc = -1;
  pthread_mutex_lock(&regions.lock);
  for (size_t i = 0; i < regions.n; i++) {
    if (regions.r[i].base != base || regions.r[i].kind != kind) continue;
    *out = regions.r[i];
    regions.r[i] = regions.r[--regions.n];
    rc = 0;
    break;
  }
  pthread_mutex_unlock(&regions.lock);
  return rc;
}

/* Pages for size bytes plus a PROT_NONE page after them, so an overrun faults at once. */
static void *map_region(size_t size, size_t *mapped) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE);
  size_t body = (size + page - 1) / page * page;
  char *p = mmap(NULL, body + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  mprotect(p + body, page, PROT_NONE);
  *mapped = body + page;
  return p;
}

static CUresult alloc_region(void **out, size_t size, int kind) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!out || size == 0) return CUDA_ERROR_INVALID_VALUE;
  struct CUctx_st *cur = fc_current;
  if (!cur) return CUDA_ERROR_INVALID_CONTEXT;
  size_t mapped = 0;
  void *p = map_region(size, &mapped);
  if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
  struct region r = {.base = (uintptr_t)p, .size = size, .mapped = mapped, .kind = kind, .dev = cur->dev};
  if (region_add(r) != 0) {
    munmap(p, mapped);
    return CUDA_ERROR_OUT_OF_MEMORY;
  }
  *out = p;
  return CUDA_SUCCESS;
}

static CUresult free_region(uintptr_t base, int kind) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!base) return CUDA_SUCCESS;
  struct region r;
  if (region_take(base, kind, &r) != 0) return CUDA_ERROR_INVALID_VALUE;
  munmap((void *)r.base, r.mapped);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize) {
  void *p = NULL;
  CUresult r = dptr ? alloc_region(&p, bytesize, FC_MEM_DEVICE) : CUDA_ERROR_INVALID_VALUE;
  if (r == CUDA_SUCCESS) *dptr = (CUdeviceptr)(uintptr_t)p;
  return r;
}

FC_EXPORT CUresult cuMemFree_v2(CUdeviceptr dptr) { return free_region((uintptr_t)dptr, FC_MEM_DEVICE); }

/* Pinned host memory: plain memory here, tracked so pointer attributes call it host memory and a
 * stream may write a value into it. */
FC_EXPORT CUresult cuMemHostAlloc(void **pp, size_t bytesize, unsigned int Flags) {
  return alloc_region(pp, bytesize, FC_MEM_HOST);
}

FC_EXPORT CUresult cuMemFreeHost(void *p) { return free_region((uintptr_t)p, FC_MEM_HOST); }

/* Page-locking the caller's memory: nothing to lock here; the arguments are checked as the driver
 * checks them, and the count of live registrations is kept so a test can see them
 * (fake_cuda_host_registered). */
static int host_registered;
FC_EXPORT CUresult cuMemHostRegister_v2(void *p, size_t bytesize, unsigned int Flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!p || bytesize == 0 || (Flags & ~0x0fu)) return CUDA_ERROR_INVALID_VALUE;
  __atomic_add_fetch(&host_registered, 1, __ATOMIC_RELAXED);
  return CUDA_SUCCESS;
}
FC_EXPORT CUresult cuMemHostUnregister(void *p) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  __atomic_sub_fetch(&host_registered, 1, __ATOMIC_RELAXED);
  return CUDA_SUCCESS;
}
FC_EXPORT int fake_cuda_host_registered(void) { return __atomic_load_n(&host_registered, __ATOMIC_RELAXED); }

FC_EXPORT CUresult cuPointerGetAttribute(void *data, int attribute, CUdeviceptr ptr) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!data) return CUDA_ERROR_INVALID_VALUE;
  struct region r;
  if (region_find((uintptr_t)ptr, 0, FC_MEM_DEVICE, &r) != 0 && region_find((uintptr_t)ptr, 0, FC_MEM_HOST, &r) != 0)
    return CUDA_ERROR_INVALID_VALUE; /* memory the driver does not know */
  switch (attribute) {
  case CU_POINTER_ATTRIBUTE_MEMORY_TYPE:
    *(unsigned int *)data = r.kind == FC_MEM_DEVICE ? CU_MEMORYTYPE_DEVICE : CU_MEMORYTYPE_HOST;
    return CUDA_SUCCESS;
  case CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL:
    *(int *)data = r.dev;
    return CUDA_SUCCESS;
  default:
    return CUDA_ERROR_INVALID_VALUE;
  }
}

/* No dma-bufs here: callers must take the path that does without one. */
FC_EXPORT CUresult cuMemGetHandleForAddressRange(void *handle, CUdeviceptr dptr, size_t size, int handleType,
                                                 unsigned long long flags) {
  return fc_ready() ? CUDA_ERROR_NOT_SUPPORTED : CUDA_ERROR_NOT_INITIALIZED;
}

static int is_device(CUdeviceptr p, size_t n) { return region_find((uintptr_t)p, n, FC_MEM_DEVICE, NULL) == 0; }

/* ================================================================ streams and events */

enum { OP_COPY, OP_WRITES, OP_MARK, OP_KERNEL };

struct fc_write {
  uintptr_t addr;
  uint64_t value;
  int wide; /* 64-bit, else 32-bit */
  int wait; /* wait until the 64-bit word >= value instead */
};

struct CUevent_st {
  uint32_t magic;
  uint64_t recorded; /* generation of the latest cuEventRecord (atomic) */
  uint64_t reached;  /* highest generation a stream has run up to (atomic) */
  int refs;          /* the handle, plus one per record still queued (atomic) */
};

struct fc_op {
  struct fc_op *next;
  int kind;
  uint64_t due_ns; /* runs no earlier than this */
  void *dst;       /* OP_COPY */
  const void *src;
  size_t n;
  struct CUevent_st *ev; /* OP_MARK */
  uint64_t gen;
  struct mplane_lane_ctl *kctl; /* OP_KERNEL: the lane kernel's arguments */
  uint64_t kepoch;
  unsigned nwrites; /* OP_WRITES */
  struct fc_write writes[];
};

struct CUstream_st {
  unsigned flags;
  int dev;
  long delay_ns;
  pthread_mutex_t lock;
  pthread_cond_t work, idle;
  struct fc_op *head, *tail; /* head stays queued while it runs: it is not complete yet */
  uint64_t submitted, completed;
  int stop;
  pthread_t thread;
  struct CUstream_st *next; /* the live streams */
};

static struct {
  pthread_mutex_t lock;
  struct CUstream_st *live;
  struct CUstream_st *legacy; /* the NULL stream, made on first use */
} streams = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000ull + (uint64_t)t.tv_nsec;
}

static void sleep_until(uint64_t due_ns) {
  struct timespec t = {.tv_sec = (time_t)(due_ns / 1000000000ull), .tv_nsec = (long)(due_ns % 1000000000ull)};
  while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &t, NULL) == EINTR) {
  }
}

static void event_unref(struct CUevent_st *ev) {
  if (__atomic_sub_fetch(&ev->refs, 1, __ATOMIC_ACQ_REL) == 0) free(ev);
}

/* Copies in pieces, last piece first: a copy in flight may show its end before its start. */
static void land_copy(char *dst, const char *src, size_t n) {
  while (n) {
    size_t start = (n - 1) / FC_PIECE * FC_PIECE;
    memmove(dst + start, src + start, n - start);
    n = start;
  }
}

/* Release stores: whoever reads the value (acquire) then sees every earlier op of the stream. */
static void land_writes(const struct fc_write *w, unsigned n) {
  for (unsigned i = 0; i < n; i++) {
    if (w[i].wait)
      while (__atomic_load_n((uint64_t *)w[i].addr, __ATOMIC_ACQUIRE) < w[i].value) sched_yield();
    else if (w[i].wide) __atomic_store_n((uint64_t *)w[i].addr, w[i].value, __ATOMIC_RELEASE);
    else __atomic_store_n((uint32_t *)w[i].addr, (uint32_t)w[i].value, __ATOMIC_RELEASE);
  }
}

/* Faults of the lane kernel, for the host's fallback (cuda_lane.c): an application holding every SM
 * (no lane kernel starts while it does), and a kernel that stops for good in the middle of a burst,
 * having claimed an op it never runs. */

/* Parked for good (or while the SMs are held): sleeps, so a test's stuck kernel costs no CPU. */
static void lane_park(const int *until_clear) {
  while (!until_clear || __atomic_load_n(until_clear, __ATOMIC_ACQUIRE)) usleep(1000);
}

/* The lane kernel (common/cuda_lane_kernel.cu) in C: the same protocol, one thread. */
static void lane_kernel_run(struct mplane_lane_ctl *c, uint64_t epoch) {
  if (__atomic_load_n(&sms_held, __ATOMIC_ACQUIRE)) lane_park(&sms_held); /* no SM for it yet */
  __atomic_store_n(&c->started, epoch, __ATOMIC_RELEASE);
  uint64_t next = __atomic_load_n(&c->done, __ATOMIC_ACQUIRE) + 1;
  for (;;) {
    struct mplane_lane_cmd *k = &c->ring[next % MPLANE_LANE_SLOTS];
    uint64_t t0 = now_ns(), idle = __atomic_load_n(&c->idle_ns, __ATOMIC_RELAXED);
    int go = 0;
    while (!(go = __atomic_load_n(&k->seq, __ATOMIC_ACQUIRE) == next)) {
      if (__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE) || now_ns() - t0 > idle) break;
      sched_yield();
    }
    if (!go) break;
    __atomic_store_n(&c->claimed, next, __ATOMIC_SEQ_CST); /* the claim before the read of stop */
    if (__atomic_load_n(&c->stop, __ATOMIC_SEQ_CST)) break;
    if (lane_stall_after && __atomic_add_fetch(&lane_ops_run, 1, __ATOMIC_RELAXED) > lane_stall_after)
      lane_park(NULL); /* claimed, never run: stopped mid-burst */
    if (k->op == MPLANE_LANE_COPY) land_copy((char *)(uintptr_t)k->dst, (const char *)(uintptr_t)k->src, k->bytes);
    else if (k->op == MPLANE_LANE_WRITE64) __atomic_store_n((uint64_t *)(uintptr_t)k->dst, k->value, __ATOMIC_RELEASE);
    else if (k->op == MPLANE_LANE_WAIT)
      while (__atomic_load_n((uint64_t *)(uintptr_t)k->src, __ATOMIC_ACQUIRE) < k->value &&
             !__atomic_load_n(&c->stop, __ATOMIC_ACQUIRE))
        sched_yield();
    if (__atomic_load_n(&c->stop, __ATOMIC_SEQ_CST)) break; /* taken back: the host publishes it */
    __atomic_store_n(&c->done, next, __ATOMIC_RELEASE);
    next++;
  }
  __atomic_store_n(&c->exited, epoch, __ATOMIC_RELEASE);
}

static void op_run(struct fc_op *op) {
  switch (op->kind) {
  case OP_COPY:
    land_copy(op->dst, op->src, op->n);
    break;
  case OP_WRITES:
    land_writes(op->writes, op->nwrites);
    break;
  case OP_KERNEL:
    lane_kernel_run(op->kctl, op->kepoch);
    break;
  case OP_MARK: {
    uint64_t seen = __atomic_load_n(&op->ev->reached, __ATOMIC_RELAXED);
    /* A later record on a faster stream may have got there first: never move back. */
    while (seen < op->gen &&
           !__atomic_compare_exchange_n(&op->ev->reached, &seen, op->gen, 0, __ATOMIC_RELEASE, __ATOMIC_RELAXED)) {
    }
    event_unref(op->ev);
    break;
  }
  }
}

/* The stream's engine: runs each op in submission order once its delay is over. */
static void *stream_worker(void *arg) {
  struct CUstream_st *s = arg;
  pthread_mutex_lock(&s->lock);
  for (;;) {
    while (!s->head && !s->stop) pthread_cond_wait(&s->work, &s->lock);
    struct fc_op *op = s->head;
    if (!op) break; /* stopping, and drained */
    pthread_mutex_unlock(&s->lock);
    sleep_until(op->due_ns);
    op_run(op);
    pthread_mutex_lock(&s->lock);
    s->head = op->next;
    if (!s->head) s->tail = NULL;
    s->completed++;
    pthread_cond_broadcast(&s->idle);
    free(op);
  }
  pthread_mutex_unlock(&s->lock);
  return NULL;
}

static struct CUstream_st *stream_new(unsigned flags, int dev) {
  struct CUstream_st *s = calloc(1, sizeof(*s));
  if (!s) return NULL;
  s->flags = flags;
  s->dev = dev;
  s->delay_ns = env_long("MPLANE_FAKE_CUDA_DELAY_US", FC_DEFAULT_DELAY_US, 0, 10000000) * 1000;
  pthread_mutex_init(&s->lock, NULL);
  pthread_cond_init(&s->work, NULL);
  pthread_cond_init(&s->idle, NULL);
  if (pthread_create(&s->thread, NULL, stream_worker, s) != 0) {
    free(s);
    return NULL;
  }
  s->next = streams.live; /* caller holds streams.lock */
  streams.live = s;
  return s;
}

/* The stream a handle names: the legacy stream for the special handles, else a live stream. */
static struct CUstream_st *stream_of(CUstream h) {
  struct CUstream_st *found = NULL;
  pthread_mutex_lock(&streams.lock);
  if (!h || h == FC_STREAM_LEGACY || h == FC_STREAM_PER_THREAD) {
    if (!streams.legacy) streams.legacy = stream_new(CU_STREAM_DEFAULT, 0);
    found = streams.legacy;
  } else {
    for (struct CUstream_st *s = streams.live; s; s = s->next)
      if (s == h) found = s;
  }
  pthread_mutex_unlock(&streams.lock);
  return found;
}

static void stream_push(struct CUstream_st *s, struct fc_op *op) {
  op->due_ns = now_ns() + (uint64_t)s->delay_ns;
  pthread_mutex_lock(&s->lock);
  if (s->tail) s->tail->next = op;
  else s->head = op;
  s->tail = op;
  s->submitted++;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->lock);
}

static void stream_drain(struct CUstream_st *s) {
  pthread_mutex_lock(&s->lock);
  uint64_t target = s->submitted;
  while (s->completed < target) pthread_cond_wait(&s->idle, &s->lock);
  pthread_mutex_unlock(&s->lock);
}

/* What the legacy stream waits for before a synchronous call: every blocking stream. */
static void drain_blocking(void) {
  pthread_mutex_lock(&streams.lock);
  for (struct CUstream_st *s = streams.live; s; s = s->next)
    if (!(s->flags & CU_STREAM_NON_BLOCKING)) stream_drain(s);
  pthread_mutex_unlock(&streams.lock);
}

FC_EXPORT CUresult cuStreamCreate(CUstream *phStream, unsigned int Flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!phStream || (Flags & ~(unsigned)CU_STREAM_NON_BLOCKING)) return CUDA_ERROR_INVALID_VALUE;
  struct CUctx_st *cur = fc_current;
  if (!cur) return CUDA_ERROR_INVALID_CONTEXT;
  pthread_mutex_lock(&streams.lock);
  struct CUstream_st *s = stream_new(Flags, cur->dev);
  pthread_mutex_unlock(&streams.lock);
  if (!s) return CUDA_ERROR_OUT_OF_MEMORY;
  *phStream = s;
  return CUDA_SUCCESS;
}

/* Drains the stream before it goes: work given to a stream is never lost. */
FC_EXPORT CUresult cuStreamDestroy_v2(CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  pthread_mutex_lock(&streams.lock);
  struct CUstream_st **pp = &streams.live;
  while (*pp && *pp != hStream) pp = &(*pp)->next;
  struct CUstream_st *s = *pp;
  if (s && s != streams.legacy) *pp = s->next;
  pthread_mutex_unlock(&streams.lock);
  if (!s || s == streams.legacy) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&s->lock);
  s->stop = 1;
  pthread_cond_signal(&s->work);
  pthread_mutex_unlock(&s->lock);
  pthread_join(s->thread, NULL);
  pthread_mutex_destroy(&s->lock);
  pthread_cond_destroy(&s->work);
  pthread_cond_destroy(&s->idle);
  free(s);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuStreamSynchronize(CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  struct CUstream_st *s = stream_of(hStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  stream_drain(s);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuStreamQuery(CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  struct CUstream_st *s = stream_of(hStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  pthread_mutex_lock(&s->lock);
  int done = s->completed == s->submitted;
  pthread_mutex_unlock(&s->lock);
  return done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

FC_EXPORT CUresult cuEventCreate(CUevent *phEvent, unsigned int Flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!phEvent) return CUDA_ERROR_INVALID_VALUE;
  if (!fc_current) return CUDA_ERROR_INVALID_CONTEXT;
  struct CUevent_st *ev = calloc(1, sizeof(*ev));
  if (!ev) return CUDA_ERROR_OUT_OF_MEMORY;
  ev->magic = FC_EVENT_MAGIC;
  ev->refs = 1;
  *phEvent = ev;
  return CUDA_SUCCESS;
}

static int event_ok(CUevent e) { return e && __atomic_load_n(&e->magic, __ATOMIC_RELAXED) == FC_EVENT_MAGIC; }

/* The handle goes at once; a record still queued keeps the memory until it has run, as the
 * driver releases a pending event's resources once it completes. */
FC_EXPORT CUresult cuEventDestroy_v2(CUevent hEvent) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  __atomic_store_n(&hEvent->magic, 0, __ATOMIC_RELAXED);
  event_unref(hEvent);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuEventRecord(CUevent hEvent, CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  struct CUstream_st *s = stream_of(hStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  struct fc_op *op = calloc(1, sizeof(*op));
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = OP_MARK;
  op->ev = hEvent;
  op->gen = __atomic_add_fetch(&hEvent->recorded, 1, __ATOMIC_ACQ_REL);
  __atomic_add_fetch(&hEvent->refs, 1, __ATOMIC_ACQ_REL);
  stream_push(s, op);
  return CUDA_SUCCESS;
}

/* Done once the stream ran past the latest record (an event never recorded is done). */
FC_EXPORT CUresult cuEventQuery(CUevent hEvent) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!event_ok(hEvent)) return CUDA_ERROR_INVALID_HANDLE;
  uint64_t want = __atomic_load_n(&hEvent->recorded, __ATOMIC_ACQUIRE);
  return __atomic_load_n(&hEvent->reached, __ATOMIC_ACQUIRE) >= want ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

/* ================================================================ copies and memory operations */

/* MPLANE_FAKE_CUDA_FAIL=copy:N: is this asynchronous copy the N-th? */
static int copy_fails(void) {
  long n = __atomic_add_fetch(&fc.copies, 1, __ATOMIC_RELAXED);
  if (fc.fail_copy == 0 || n != fc.fail_copy) return 0;
  fprintf(stderr, "fakecuda: asynchronous copy #%ld fails (MPLANE_FAKE_CUDA_FAIL=copy:%ld)\n", n, fc.fail_copy);
  return 1;
}

static CUresult copy_async(void *dst, const void *src, size_t n, CUstream hStream) {
  struct CUstream_st *s = stream_of(hStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  if (copy_fails()) return CUDA_ERROR_UNKNOWN;
  struct fc_op *op = calloc(1, sizeof(*op));
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = OP_COPY;
  op->dst = dst;
  op->src = src;
  op->n = n;
  stream_push(s, op);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount,
                                        CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(dstDevice, ByteCount) || (!srcHost && ByteCount)) return CUDA_ERROR_INVALID_VALUE;
  return copy_async((void *)(uintptr_t)dstDevice, srcHost, ByteCount, hStream);
}

FC_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount, CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(srcDevice, ByteCount) || (!dstHost && ByteCount)) return CUDA_ERROR_INVALID_VALUE;
  return copy_async(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount, hStream);
}

/* Each side's memory must belong to the context named with it: a caller that mixes up the two
 * contexts gets an error here rather than a copy that works by accident. */
FC_EXPORT CUresult cuMemcpyPeerAsync(CUdeviceptr dstDevice, CUcontext dstContext, CUdeviceptr srcDevice,
                                     CUcontext srcContext, size_t ByteCount, CUstream hStream) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!ctx_ok(dstContext) || !ctx_ok(srcContext)) return CUDA_ERROR_INVALID_CONTEXT;
  struct region d, s;
  if (region_find((uintptr_t)dstDevice, ByteCount, FC_MEM_DEVICE, &d) != 0 ||
      region_find((uintptr_t)srcDevice, ByteCount, FC_MEM_DEVICE, &s) != 0 || d.dev != dstContext->dev ||
      s.dev != srcContext->dev)
    return CUDA_ERROR_INVALID_VALUE;
  return copy_async((void *)(uintptr_t)dstDevice, (const void *)(uintptr_t)srcDevice, ByteCount, hStream);
}

/* A word a stream may write: device memory or pinned host memory, aligned to its size. */
static int word_ok(CUdeviceptr addr, size_t size) {
  if (addr % size) return 0;
  return is_device(addr, size) || region_find((uintptr_t)addr, size, FC_MEM_HOST, NULL) == 0;
}

static CUresult writes_push(CUstream hStream, struct fc_op *op) {
  struct CUstream_st *s = stream_of(hStream);
  if (!s) {
    free(op);
    return CUDA_ERROR_INVALID_HANDLE;
  }
  op->kind = OP_WRITES;
  stream_push(s, op);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuStreamWriteValue64_v2(CUstream stream, CUdeviceptr addr, uint64_t value, unsigned int flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!word_ok(addr, sizeof(uint64_t))) return CUDA_ERROR_INVALID_VALUE;
  struct fc_op *op = calloc(1, sizeof(*op) + sizeof(struct fc_write));
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->nwrites = 1;
  op->writes[0] = (struct fc_write){.addr = (uintptr_t)addr, .value = value, .wide = 1};
  return writes_push(stream, op);
}

/* Value writes only (the kinds the plugin submits); the array is copied, as the driver does, so
 * the caller may reuse it as soon as the call returns. */
FC_EXPORT CUresult cuStreamBatchMemOp_v2(CUstream stream, unsigned int count, CUstreamBatchMemOpParams *paramArray,
                                         unsigned int flags) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (count == 0 || !paramArray || flags != 0) return CUDA_ERROR_INVALID_VALUE;
  struct fc_op *op = calloc(1, sizeof(*op) + count * sizeof(struct fc_write));
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  for (unsigned i = 0; i < count; i++) {
    const CUstreamBatchMemOpParams *p = &paramArray[i];
    int wait = p->operation == CU_STREAM_MEM_OP_WAIT_VALUE_64;
    int wide = wait || p->operation == CU_STREAM_MEM_OP_WRITE_VALUE_64;
    CUresult bad = CUDA_SUCCESS;
    if (!wide && p->operation != CU_STREAM_MEM_OP_WRITE_VALUE_32) bad = CUDA_ERROR_NOT_SUPPORTED;
    else if (wait && p->writeValue.flags != 0) bad = CUDA_ERROR_NOT_SUPPORTED; /* GEQ only */
    else if (!word_ok(p->writeValue.address, wide ? 8 : 4)) bad = CUDA_ERROR_INVALID_VALUE;
    if (bad != CUDA_SUCCESS) {
      free(op);
      return bad;
    }
    op->writes[i] = (struct fc_write){.addr = (uintptr_t)p->writeValue.address,
                                      .value = wide ? p->writeValue.value64 : p->writeValue.value, .wide = wide,
                                      .wait = wait};
  }
  op->nwrites = count;
  return writes_push(stream, op);
}

/* The synchronous calls run on the legacy stream: after the blocking streams, done on return. An
 * aligned 8-byte copy is one atomic access (acquire out, release in), so a caller polling a signal
 * word through it sees the data the stream wrote before the signal. */
static void copy_now(void *dst, const void *src, size_t n) {
  drain_blocking();
  if (n == 8 && (uintptr_t)src % 8 == 0 && (uintptr_t)dst % 8 == 0)
    __atomic_store_n((uint64_t *)dst, __atomic_load_n((const uint64_t *)src, __ATOMIC_ACQUIRE), __ATOMIC_RELEASE);
  else {
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    memmove(dst, src, n);
  }
}

FC_EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dstDevice, const void *srcHost, size_t ByteCount) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(dstDevice, ByteCount) || (!srcHost && ByteCount)) return CUDA_ERROR_INVALID_VALUE;
  copy_now((void *)(uintptr_t)dstDevice, srcHost, ByteCount);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemcpyDtoH_v2(void *dstHost, CUdeviceptr srcDevice, size_t ByteCount) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(srcDevice, ByteCount) || (!dstHost && ByteCount)) return CUDA_ERROR_INVALID_VALUE;
  copy_now(dstHost, (const void *)(uintptr_t)srcDevice, ByteCount);
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dstDevice, unsigned char uc, size_t N) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!is_device(dstDevice, N)) return CUDA_ERROR_INVALID_VALUE;
  drain_blocking();
  memset((void *)(uintptr_t)dstDevice, uc, N);
  return CUDA_SUCCESS;
}

/* ---------------------------------------------------------------- the lane kernel */

static struct CUmod_st {
  int magic;
} lane_module = {1};
static struct CUfunc_st {
  int magic;
} lane_function = {2};
static int kernel_launches;

/* For tests: how many kernels were launched in this process. */
FC_EXPORT int fake_cuda_kernel_launches(void) { return __atomic_load_n(&kernel_launches, __ATOMIC_RELAXED); }

/* For tests: an application kernel takes every SM (held 1) or gives them back (0). */
FC_EXPORT void fake_cuda_hold_sms(int held) { __atomic_store_n(&sms_held, held, __ATOMIC_RELEASE); }

/* Any image that declares the lane kernel's entry loads; anything else is not PTX we can run. */
FC_EXPORT CUresult cuModuleLoadData(CUmodule *module, const void *image) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!module || !image) return CUDA_ERROR_INVALID_VALUE;
  if (!strstr(image, ".entry " MPLANE_LANE_KERNEL "(")) return CUDA_ERROR_INVALID_PTX;
  *module = &lane_module;
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (!hfunc || hmod != &lane_module || !name) return CUDA_ERROR_INVALID_VALUE;
  if (strcmp(name, MPLANE_LANE_KERNEL) != 0) return CUDA_ERROR_NOT_FOUND;
  *hfunc = &lane_function;
  return CUDA_SUCCESS;
}

FC_EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned gridDimX, unsigned gridDimY, unsigned gridDimZ,
                                  unsigned blockDimX, unsigned blockDimY, unsigned blockDimZ, unsigned sharedMemBytes,
                                  CUstream hStream, void **kernelParams, void **extra) {
  (void)blockDimX, (void)blockDimY, (void)blockDimZ, (void)sharedMemBytes;
  if (!fc_ready()) return CUDA_ERROR_NOT_INITIALIZED;
  if (f != &lane_function || !kernelParams || extra || gridDimX * gridDimY * gridDimZ != 1)
    return CUDA_ERROR_INVALID_VALUE;
  struct CUstream_st *s = stream_of(hStream);
  if (!s) return CUDA_ERROR_INVALID_HANDLE;
  struct mplane_lane_ctl *ctl = *(struct mplane_lane_ctl **)kernelParams[0];
  if (region_find((uintptr_t)ctl, sizeof(*ctl), FC_MEM_HOST, NULL) != 0) return CUDA_ERROR_INVALID_VALUE;
  struct fc_op *op = calloc(1, sizeof(*op));
  if (!op) return CUDA_ERROR_OUT_OF_MEMORY;
  op->kind = OP_KERNEL;
  op->kctl = ctl;
  op->kepoch = *(unsigned long long *)kernelParams[1];
  __atomic_add_fetch(&kernel_launches, 1, __ATOMIC_RELAXED);
  stream_push(s, op);
  return CUDA_SUCCESS;
}
