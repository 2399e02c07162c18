/* mplane: plane-aware connect and the CUDA relay copy engine (see relay.h). */
#include "relay.h"

#include <arpa/inet.h>
#include <dlfcn.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/config.h" /* enum mplane_relay_mode, mplane_planes_parse */
#include "../common/clock.h"
#include "../common/log.h"

/* ================================================================ planes of devices */

int mplane_plane_from_fabric_ip(const struct sockaddr *addr) {
  if (!addr || addr->sa_family != AF_INET) return -1;
  const uint8_t *a = (const uint8_t *)&((const struct sockaddr_in *)addr)->sin_addr;
  if (a[0] == 198 && a[1] == 18 && a[2] < 128) return a[2];
  return -1;
}

struct subnet {
  int family;
  uint8_t net[16];
};

static int subnet_of(const struct sockaddr *addr, const struct sockaddr *mask, struct subnet *out) {
  memset(out, 0, sizeof(*out));
  if (!addr || !mask || addr->sa_family != mask->sa_family) return -1;
  const uint8_t *a, *m;
  int len;
  if (addr->sa_family == AF_INET) {
    a = (const uint8_t *)&((const struct sockaddr_in *)addr)->sin_addr;
    m = (const uint8_t *)&((const struct sockaddr_in *)mask)->sin_addr;
    len = 4;
  } else if (addr->sa_family == AF_INET6) {
    a = (const uint8_t *)&((const struct sockaddr_in6 *)addr)->sin6_addr;
    m = (const uint8_t *)&((const struct sockaddr_in6 *)mask)->sin6_addr;
    len = 16;
  } else {
    return -1;
  }
  out->family = addr->sa_family;
  for (int i = 0; i < len; i++) out->net[i] = a[i] & m[i];
  return 0;
}

static int subnet_cmp(const struct subnet *x, const struct subnet *y) {
  if (x->family != y->family) return x->family < y->family ? -1 : 1;
  return memcmp(x->net, y->net, sizeof(x->net));
}

void mplane_planes_from_subnets(int n, const struct sockaddr *const *addrs, const struct sockaddr *const *masks,
                                int *planes) {
  struct subnet nets[256];
  int ok[256];
  if (n > 256) n = 256;
  int ndistinct = 0;
  for (int i = 0; i < n; i++) {
    planes[i] = mplane_plane_from_fabric_ip(addrs[i]);
    ok[i] = subnet_of(addrs[i], masks ? masks[i] : NULL, &nets[i]) == 0;
    if (!ok[i]) continue;
    int seen = 0;
    for (int j = 0; j < i; j++) seen |= ok[j] && subnet_cmp(&nets[i], &nets[j]) == 0;
    ndistinct += !seen;
  }
  if (ndistinct < 2) return; /* one subnet for all: the subnets say nothing */
  for (int i = 0; i < n; i++) {
    if (planes[i] >= 0 || !ok[i]) continue;
    /* rank = distinct subnets sorted before this one */
    int rank = 0;
    for (int j = 0; j < n; j++) {
      if (!ok[j] || subnet_cmp(&nets[j], &nets[i]) >= 0) continue;
      int dup = 0;
      for (int k = 0; k < j; k++) dup |= ok[k] && subnet_cmp(&nets[k], &nets[j]) == 0;
      rank += !dup;
    }
    planes[i] = rank;
  }
}

static int name_matches(const char *entry, size_t len, const char *devname) {
  size_t dl = strlen(devname);
  if (dl == len && strncmp(entry, devname, len) == 0) return 1;
  /* "mlx5_0" names every port of mlx5_0 ("mlx5_0:1") */
  return dl > len && devname[len] == ':' && strncmp(entry, devname, len) == 0;
}

int mplane_planes_apply(const char *spec, struct mplane_dev_props *props, int ndev, char *why, size_t whylen) {
  struct mplane_planes_spec parsed;
  if (mplane_planes_parse(spec, &parsed, why, whylen) != 0) return -1; /* common/config.c: the one grammar */
  for (int i = 0; i < parsed.n; i++) {
    size_t len = strlen(parsed.entry[i].nic);
    for (int d = 0; d < ndev; d++)
      if (name_matches(parsed.entry[i].nic, len, props[d].name)) props[d].plane = parsed.entry[i].plane;
  }
  return 0;
}

/* ================================================================ the relay decision */

ncclResult_t mplane_relay_pick(const struct mplane_dev_props *props, int ndev, int dev, int peer_plane,
                               int relay_mode, struct mplane_relay_choice *out) {
  int local = props[dev].plane;
  *out = (struct mplane_relay_choice){.dev = dev, .relayed = 0, .local_plane = local, .peer_plane = peer_plane};
  if (local < 0 || peer_plane < 0 || local == peer_plane) return ncclSuccess;
  if (relay_mode == MPLANE_RELAY_OFF) {
    MP_WARN("connect from %s (plane %d) to a peer listening on plane %d crosses planes, and MPLANE_RELAY=off: "
            "planes share no switch, so this connection cannot be made. Unset MPLANE_RELAY (or set "
            "MPLANE_RELAY=auto) to carry it on this node's plane-%d NIC, or keep NCCL on one rail with "
            "NCCL_CROSS_NIC=0", props[dev].name, local, peer_plane, peer_plane);
    return ncclInvalidUsage;
  }
  for (int d = 0; d < ndev; d++) {
    if (props[d].plane != peer_plane) continue;
    out->dev = d;
    out->relayed = 1;
    return ncclSuccess;
  }
  char have[256] = "";
  size_t o = 0;
  for (int d = 0; d < ndev && o < sizeof(have) - 32; d++)
    o += (size_t)snprintf(have + o, sizeof(have) - o, "%s%s=%d", d ? "," : "", props[d].name, props[d].plane);
  MP_WARN("connect from %s (plane %d) to a peer listening on plane %d crosses planes, and this node has no NIC on "
          "plane %d to relay through (local NICs: %s): check MPLANE_PLANES on both nodes",
          props[dev].name, local, peer_plane, peer_plane, have);
  return ncclInvalidUsage;
}

/* ================================================================ CUDA, through dlopen */

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;
#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600
#define CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED 704
#define CU_STREAM_NON_BLOCKING 0x1
#define CU_EVENT_DISABLE_TIMING 0x2
#define CU_POINTER_ATTRIBUTE_MEMORY_TYPE 2
#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9
#define CU_MEMORYTYPE_DEVICE 2

static struct {
  void *lib;
  int ngpu;
  char why[256];
  CUresult (*cuInit)(unsigned);
  CUresult (*cuDeviceGetCount)(int *);
  CUresult (*cuDeviceGet)(CUdevice *, int);
  CUresult (*cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
  CUresult (*cuCtxSetCurrent)(CUcontext);
  CUresult (*cuCtxEnablePeerAccess)(CUcontext, unsigned);
  CUresult (*cuDeviceCanAccessPeer)(int *, CUdevice, CUdevice);
  CUresult (*cuMemAlloc)(CUdeviceptr *, size_t);
  CUresult (*cuMemFree)(CUdeviceptr);
  CUresult (*cuStreamCreate)(CUstream *, unsigned);
  CUresult (*cuStreamDestroy)(CUstream);
  CUresult (*cuStreamSynchronize)(CUstream);
  CUresult (*cuStreamQuery)(CUstream);
  CUresult (*cuEventCreate)(CUevent *, unsigned);
  CUresult (*cuEventDestroy)(CUevent);
  CUresult (*cuEventRecord)(CUevent, CUstream);
  CUresult (*cuEventQuery)(CUevent);
  CUresult (*cuMemcpyPeerAsync)(CUdeviceptr, CUcontext, CUdeviceptr, CUcontext, size_t, CUstream);
  CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void *, size_t);
  CUresult (*cuMemcpyDtoH)(void *, CUdeviceptr, size_t);
  CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void *, size_t, CUstream);
  CUresult (*cuMemcpyDtoHAsync)(void *, CUdeviceptr, size_t, CUstream);
  CUresult (*cuMemsetD8)(CUdeviceptr, unsigned char, size_t);
  CUresult (*cuPointerGetAttribute)(void *, int, CUdeviceptr);
  CUresult (*cuDeviceGetPCIBusId)(char *, int, CUdevice);
  CUresult (*cuGetErrorString)(CUresult, const char **);
  /* optional: the signal path's fast way (mplane_cuda_signal_add); without them it reads and writes */
  CUresult (*cuMemHostAlloc)(void **, size_t, unsigned);
  CUresult (*cuMemFreeHost)(void *);
  CUresult (*cuStreamWriteValue64)(CUstream, CUdeviceptr, uint64_t, unsigned);
  CUresult (*cuStreamBatchMemOp)(CUstream, unsigned, void *, unsigned);
  CUresult (*cuMemGetHandleForAddressRange)(void *, CUdeviceptr, size_t, int, unsigned long long);
  CUcontext ctx[64];
} cu;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;

static const char *cu_err(CUresult r) {
  const char *s = NULL;
  if (cu.cuGetErrorString && cu.cuGetErrorString(r, &s) == CUDA_SUCCESS && s) return s;
  return "unknown CUDA error";
}

#define CU_LOAD(field, sym)                                            \
  do {                                                                 \
    *(void **)&cu.field = dlsym(cu.lib, sym);                          \
    if (!cu.field) {                                                   \
      snprintf(cu.why, sizeof(cu.why), "%s lacks %s", libname, sym);   \
      goto fail;                                                       \
    }                                                                  \
  } while (0)

static void cu_load_once(void) {
  const char *libname = getenv("MPLANE_CUDA_LIB"); /* test hook, not a user setting */
  if (!libname || !*libname) libname = "libcuda.so.1";
  cu.lib = dlopen(libname, RTLD_NOW | RTLD_LOCAL);
  if (!cu.lib) {
    snprintf(cu.why, sizeof(cu.why), "no CUDA driver (%s): %s", libname, dlerror());
    return;
  }
  CU_LOAD(cuInit, "cuInit");
  CU_LOAD(cuDeviceGetCount, "cuDeviceGetCount");
  CU_LOAD(cuDeviceGet, "cuDeviceGet");
  CU_LOAD(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain");
  CU_LOAD(cuCtxSetCurrent, "cuCtxSetCurrent");
  CU_LOAD(cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess");
  CU_LOAD(cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer");
  CU_LOAD(cuMemAlloc, "cuMemAlloc_v2");
  CU_LOAD(cuMemFree, "cuMemFree_v2");
  CU_LOAD(cuStreamCreate, "cuStreamCreate");
  CU_LOAD(cuStreamDestroy, "cuStreamDestroy_v2");
  CU_LOAD(cuStreamSynchronize, "cuStreamSynchronize");
  CU_LOAD(cuEventCreate, "cuEventCreate");
  CU_LOAD(cuEventDestroy, "cuEventDestroy_v2");
  CU_LOAD(cuEventRecord, "cuEventRecord");
  CU_LOAD(cuEventQuery, "cuEventQuery");
  CU_LOAD(cuStreamQuery, "cuStreamQuery");
  CU_LOAD(cuMemcpyPeerAsync, "cuMemcpyPeerAsync");
  CU_LOAD(cuMemcpyHtoD, "cuMemcpyHtoD_v2");
  CU_LOAD(cuMemcpyDtoH, "cuMemcpyDtoH_v2");
  CU_LOAD(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2");
  CU_LOAD(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
  CU_LOAD(cuMemsetD8, "cuMemsetD8_v2");
  CU_LOAD(cuPointerGetAttribute, "cuPointerGetAttribute");
  CU_LOAD(cuDeviceGetPCIBusId, "cuDeviceGetPCIBusId");
  CU_LOAD(cuGetErrorString, "cuGetErrorString");
  *(void **)&cu.cuMemHostAlloc = dlsym(cu.lib, "cuMemHostAlloc");
  *(void **)&cu.cuMemFreeHost = dlsym(cu.lib, "cuMemFreeHost");
  *(void **)&cu.cuStreamWriteValue64 = dlsym(cu.lib, "cuStreamWriteValue64_v2");
  *(void **)&cu.cuStreamBatchMemOp = dlsym(cu.lib, "cuStreamBatchMemOp_v2");
  *(void **)&cu.cuMemGetHandleForAddressRange = dlsym(cu.lib, "cuMemGetHandleForAddressRange");
  CUresult r = cu.cuInit(0);
  if (r != CUDA_SUCCESS) {
    snprintf(cu.why, sizeof(cu.why), "cuInit failed: %s (%d)", cu_err(r), r);
    goto fail;
  }
  int n = 0;
  r = cu.cuDeviceGetCount(&n);
  if (r != CUDA_SUCCESS || n <= 0) {
    snprintf(cu.why, sizeof(cu.why), "no GPU (cuDeviceGetCount: %d devices, result %d)", n, r);
    goto fail;
  }
  cu.ngpu = n > 64 ? 64 : n;
  return;
fail:
  if (cu.lib) dlclose(cu.lib);
  cu.lib = NULL;
  cu.ngpu = 0;
}

int mplane_cuda_load(char *why, size_t whylen) {
  pthread_once(&cu_once, cu_load_once);
  if (cu.ngpu == 0 && why) snprintf(why, whylen, "%s", cu.why);
  return cu.ngpu;
}

/* Make gpu's primary context current on this thread. */
static int cu_use(int gpu) {
  if (mplane_cuda_load(NULL, 0) <= gpu || gpu < 0) return -1;
  if (!cu.ctx[gpu]) {
    CUdevice d;
    CUcontext c;
    if (cu.cuDeviceGet(&d, gpu) != CUDA_SUCCESS || cu.cuDevicePrimaryCtxRetain(&c, d) != CUDA_SUCCESS) return -1;
    /* Two threads may race here: both retain, one pointer wins; primary contexts are shared. */
    __atomic_store_n(&cu.ctx[gpu], c, __ATOMIC_RELEASE);
  }
  return cu.cuCtxSetCurrent(cu.ctx[gpu]) == CUDA_SUCCESS ? 0 : -1;
}

int mplane_cuda_pointer_device(const void *ptr) {
  if (mplane_cuda_load(NULL, 0) <= 0 || !ptr) return -1;
  unsigned int type = 0;
  if (cu.cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS ||
      type != CU_MEMORYTYPE_DEVICE)
    return -1;
  int ord = -1;
  if (cu.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (CUdeviceptr)(uintptr_t)ptr) != CUDA_SUCCESS)
    return -1;
  return ord;
}

void *mplane_cuda_alloc(int gpu, size_t bytes) {
  CUdeviceptr p = 0;
  if (cu_use(gpu) != 0 || cu.cuMemAlloc(&p, bytes) != CUDA_SUCCESS) return NULL;
  return (void *)(uintptr_t)p;
}

void mplane_cuda_free(int gpu, void *ptr) {
  if (ptr && cu_use(gpu) == 0) cu.cuMemFree((CUdeviceptr)(uintptr_t)ptr);
}

int mplane_cuda_memcpy_htod(int gpu, void *dst, const void *src, size_t bytes) {
  return cu_use(gpu) == 0 && cu.cuMemcpyHtoD((CUdeviceptr)(uintptr_t)dst, src, bytes) == CUDA_SUCCESS ? 0 : -1;
}

int mplane_cuda_memcpy_dtoh(int gpu, void *dst, const void *src, size_t bytes) {
  return cu_use(gpu) == 0 && cu.cuMemcpyDtoH(dst, (CUdeviceptr)(uintptr_t)src, bytes) == CUDA_SUCCESS ? 0 : -1;
}

/* One 64-bit write of a cuStreamBatchMemOp (the driver's CUstreamBatchMemOpParams, 48 bytes:
 * operation, address, value, flags, alias). */
struct cu_write_op {
  int operation; /* CU_STREAM_MEM_OP_WRITE_VALUE_64 */
  int pad0;
  CUdeviceptr address;
  uint64_t value;
  unsigned flags;
  unsigned pad1;
  CUdeviceptr alias;
  uint64_t pad2;
};
_Static_assert(sizeof(struct cu_write_op) == 48, "CUstreamBatchMemOpParams is 48 bytes");
#define CU_STREAM_MEM_OP_WRITE_VALUE_64 5
#define LANE_BATCH 128

/* The lane: one non-blocking stream per GPU for the whole process, for every copy and signal the
 * socket RMA target makes into GPU memory. Non-blocking: a copy never waits for a kernel on the
 * legacy stream's implicit barrier, so a kernel spinning on a signal cannot hold up the copy that
 * sets it. One stream, not one per thread: the driver spreads streams over a few hardware queues
 * (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default), and a stream that shares its queue with the
 * application's can sit behind a kernel launch queued after the very kernel that waits for this
 * copy; every extra stream makes that likelier.
 * Signals: the read of the word is ordered after the previous add's write on the lane, so adds from
 * any thread never lose one another (one lock); the write is left in flight
 * (cuStreamWriteValue64), and the caller's data, synchronised before it asks, lands first. */
struct cu_signal_lane {
  pthread_mutex_t lock;
  CUstream stream;
  uint64_t *word; /* pinned host memory: the read lands here */
  int ready, fast;
  /* Owned-signal writes not yet given to the driver, in the order their values were set; one
   * cuStreamBatchMemOp submits them all (mplane_cuda_signal_flush). */
  struct cu_write_op pending[LANE_BATCH];
  int npending; /* atomic for the lock-free check in flush */
  /* Asynchronous copies (mplane_cuda_copy_async): each is followed on the stream by a write of
   * ++seq into *done, pinned host memory the GPU writes and the CPU polls. */
  volatile uint64_t *done;
  uint64_t seq;
};
static struct cu_signal_lane signal_lanes[64];
static pthread_mutex_t signal_lanes_init = PTHREAD_MUTEX_INITIALIZER;

static struct cu_signal_lane *signal_lane(int gpu) {
  struct cu_signal_lane *l = &signal_lanes[gpu];
  if (__atomic_load_n(&l->ready, __ATOMIC_ACQUIRE)) return l;
  pthread_mutex_lock(&signal_lanes_init);
  if (!l->ready && cu.cuStreamCreate(&l->stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
    pthread_mutex_init(&l->lock, NULL);
    void *w = NULL;
    l->fast = cu.cuMemHostAlloc && cu.cuStreamWriteValue64 && cu.cuMemHostAlloc(&w, 64, 0) == CUDA_SUCCESS;
    l->word = l->fast ? w : malloc(sizeof(uint64_t));
    void *d = NULL; /* mapped: the stream writes it; under unified addressing its host address is its device address */
    if (l->fast && cu.cuStreamBatchMemOp && cu.cuMemHostAlloc(&d, 64, 0x03 /* PORTABLE | DEVICEMAP */) == CUDA_SUCCESS) {
      memset(d, 0, 64);
      l->done = d;
    }
    if (l->word) __atomic_store_n(&l->ready, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&signal_lanes_init);
  return l->ready ? l : NULL;
}

static CUstream cu_copy_stream(int gpu) {
  if (gpu < 0 || gpu >= 64) return NULL;
  struct cu_signal_lane *l = signal_lane(gpu);
  return l ? l->stream : NULL;
}

/* Wait for the lane by polling it: cuStreamSynchronize may sleep until an interrupt, and on a host
 * whose cores are busy with spinning threads the wake-up costs far more than a small copy. */
static int lane_wait(CUstream s) {
  for (;;) {
    CUresult r = cu.cuStreamQuery(s);
    if (r == CUDA_SUCCESS) return 0;
    if (r != CUDA_ERROR_NOT_READY) return -1;
    sched_yield();
  }
}

int mplane_cuda_memcpy_htod_nb(int gpu, void *dst, const void *src, size_t bytes) {
  if (cu_use(gpu) != 0) return -1;
  CUstream s = cu_copy_stream(gpu);
  if (!s) return -1;
  if (cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, s) != CUDA_SUCCESS) return -1;
  return lane_wait(s);
}

int mplane_cuda_memcpy_dtoh_nb(int gpu, void *dst, const void *src, size_t bytes) {
  if (cu_use(gpu) != 0) return -1;
  CUstream s = cu_copy_stream(gpu);
  if (!s) return -1;
  if (cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, s) != CUDA_SUCCESS) return -1;
  return lane_wait(s);
}

/* Write v to the word on the lane, in order after what is queued there (lock held): in flight with
 * cuStreamWriteValue64, else through the pinned word and waited for. 0 ok, -1 CUDA failed. */
static int lane_write(struct cu_signal_lane *l, CUdeviceptr p, uint64_t v) {
  if (l->fast) return cu.cuStreamWriteValue64(l->stream, p, v, 0) == CUDA_SUCCESS ? 0 : -1;
  *l->word = v;
  return cu.cuMemcpyHtoDAsync(p, l->word, sizeof(uint64_t), l->stream) == CUDA_SUCCESS &&
                 cu.cuStreamSynchronize(l->stream) == CUDA_SUCCESS
             ? 0
             : -1;
}

static struct cu_signal_lane *lane_of(int gpu) {
  return gpu >= 0 && gpu < 64 && cu_use(gpu) == 0 ? signal_lane(gpu) : NULL;
}

/* Lanes holding writes not yet given to the driver: flush, called after every pass of a reader,
 * returns at once while there are none (host windows only, or nothing new). */
static int lanes_pending;

/* With TRACE on (MPLANE_DEBUG=2): how long a driver call that queues work on a lane took, when it
 * took longer than 100 us. Such a call runs on NCCL's GIN progress thread; while the driver holds it
 * nothing else is served, so these lines show where a one-sided op's latency goes. */
static uint64_t driver_t0(void) { return mplane_log_tracing() ? mplane_now_ns() : 0; }

static void driver_took(uint64_t t0, const char *what, size_t n) {
  if (!t0) return;
  uint64_t us = (mplane_now_ns() - t0) / 1000;
  if (us > 100) MP_TRACE(NCCL_NET, "CUDA %s (%zu) took %llu us", what, n, (unsigned long long)us);
}

/* Give the lane's pending writes to the driver in one call, in order (lock held). */
static int lane_submit(struct cu_signal_lane *l) {
  int n = l->npending;
  if (n == 0) return 0;
  __atomic_store_n(&l->npending, 0, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&lanes_pending, 1, __ATOMIC_RELAXED);
  uint64_t t0 = driver_t0();
  int rc = cu.cuStreamBatchMemOp(l->stream, (unsigned)n, l->pending, 0) == CUDA_SUCCESS ? 0 : -1;
  driver_took(t0, "cuStreamBatchMemOp, writes", (size_t)n);
  return rc;
}

int mplane_cuda_signal_add(int gpu, void *word, uint64_t add, uint64_t *now) {
  struct cu_signal_lane *l = lane_of(gpu);
  if (!l) return -1;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)word;
  pthread_mutex_lock(&l->lock);
  int rc = -1;
  if (lane_submit(l) == 0 && cu.cuMemcpyDtoHAsync(l->word, p, sizeof(uint64_t), l->stream) == CUDA_SUCCESS &&
      cu.cuStreamSynchronize(l->stream) == CUDA_SUCCESS) {
    *now = *l->word + add;
    rc = lane_write(l, p, *now);
  }
  pthread_mutex_unlock(&l->lock);
  return rc;
}

int mplane_cuda_signal_add_owned(int gpu, void *word, uint64_t *shadow, uint64_t add, uint64_t *now) {
  struct cu_signal_lane *l = lane_of(gpu);
  if (!l) return -1;
  pthread_mutex_lock(&l->lock);
  *now = *shadow + add;
  int rc = 0;
  if (l->fast && cu.cuStreamBatchMemOp) {
    if (l->npending == LANE_BATCH) rc = lane_submit(l);
    if (rc == 0) { /* a write the driver refused must not leave this one pending beyond the shadow */
      if (l->npending == 0) __atomic_add_fetch(&lanes_pending, 1, __ATOMIC_RELAXED);
      l->pending[l->npending] = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                                     .address = (CUdeviceptr)(uintptr_t)word, .value = *now};
      __atomic_store_n(&l->npending, l->npending + 1, __ATOMIC_RELAXED);
    }
  } else rc = lane_write(l, (CUdeviceptr)(uintptr_t)word, *now);
  if (rc == 0) *shadow = *now;
  pthread_mutex_unlock(&l->lock);
  return rc;
}

int mplane_cuda_signal_flush(void) {
  int rc = 0;
  if (!__atomic_load_n(&lanes_pending, __ATOMIC_RELAXED)) return 0;
  for (int g = 0; g < 64; g++) {
    struct cu_signal_lane *l = &signal_lanes[g];
    if (!__atomic_load_n(&l->ready, __ATOMIC_ACQUIRE) || !__atomic_load_n(&l->npending, __ATOMIC_RELAXED)) continue;
    if (cu_use(g) != 0) {
      rc = -1;
      continue;
    }
    pthread_mutex_lock(&l->lock);
    if (lane_submit(l) != 0) rc = -1;
    pthread_mutex_unlock(&l->lock);
  }
  return rc;
}

/* Queue the write of v into pinned host word p behind what the stream holds (lock held). */
static int lane_mark(struct cu_signal_lane *l, uint64_t v) {
  if (l->npending == LANE_BATCH && lane_submit(l) != 0) return -1;
  if (l->npending == 0) __atomic_add_fetch(&lanes_pending, 1, __ATOMIC_RELAXED);
  l->pending[l->npending] = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                                 .address = (CUdeviceptr)(uintptr_t)l->done, .value = v};
  __atomic_store_n(&l->npending, l->npending + 1, __ATOMIC_RELAXED);
  return 0;
}

int mplane_cuda_async_ok(int gpu) {
  /* Asked for every piece and record: once the lane is made, its answer needs no driver call. */
  if (gpu >= 0 && gpu < 64 && __atomic_load_n(&signal_lanes[gpu].ready, __ATOMIC_ACQUIRE)) return signal_lanes[gpu].done != NULL;
  struct cu_signal_lane *l = lane_of(gpu);
  return l && l->done;
}

uint64_t mplane_cuda_copy_async(int gpu, void *dst, const void *src, size_t bytes, int to_gpu) {
  struct cu_signal_lane *l = lane_of(gpu);
  if (!l || !l->done) return 0;
  pthread_mutex_lock(&l->lock);
  uint64_t t0 = driver_t0();
  CUresult r = to_gpu ? cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, l->stream)
                      : cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, l->stream);
  driver_took(t0, to_gpu ? "cuMemcpyHtoDAsync, bytes" : "cuMemcpyDtoHAsync, bytes", bytes);
  uint64_t seq = 0;
  if (r == CUDA_SUCCESS && lane_mark(l, l->seq + 1) == 0) seq = ++l->seq;
  pthread_mutex_unlock(&l->lock);
  return seq;
}

uint64_t mplane_cuda_lane_done(int gpu) {
  if (gpu < 0 || gpu >= 64 || !__atomic_load_n(&signal_lanes[gpu].ready, __ATOMIC_ACQUIRE)) return 0;
  const volatile uint64_t *d = signal_lanes[gpu].done;
  return d ? __atomic_load_n(d, __ATOMIC_ACQUIRE) : 0;
}

uint64_t mplane_cuda_lane_issued(int gpu) {
  if (gpu < 0 || gpu >= 64 || !__atomic_load_n(&signal_lanes[gpu].ready, __ATOMIC_ACQUIRE)) return 0;
  struct cu_signal_lane *l = &signal_lanes[gpu];
  pthread_mutex_lock(&l->lock);
  uint64_t seq = l->seq;
  pthread_mutex_unlock(&l->lock);
  return seq;
}

int mplane_cuda_lane_wait(int gpu, uint64_t seq, int timeout_ms) {
  if (mplane_cuda_lane_done(gpu) >= seq) return 0;
  if (mplane_cuda_signal_flush() != 0) return -1; /* the mark may still be pending */
  uint64_t t0 = mplane_now_ns();
  while (mplane_cuda_lane_done(gpu) < seq) {
    if ((mplane_now_ns() - t0) / 1000000 > (uint64_t)timeout_ms) return -1;
    sched_yield();
  }
  return 0;
}

int mplane_cuda_dmabuf_fd(int gpu, void *ptr, size_t bytes) {
  int fd = -1;
  if (!cu.cuMemGetHandleForAddressRange || cu_use(gpu) != 0) return -1;
  if (cu.cuMemGetHandleForAddressRange(&fd, (CUdeviceptr)(uintptr_t)ptr, bytes, 1 /* DMA_BUF_FD */, 0) !=
      CUDA_SUCCESS)
    return -1;
  return fd;
}

void *mplane_cuda_host_alloc(int gpu, size_t bytes) {
  void *p = NULL;
  if (cu_use(gpu) != 0 || !cu.cuMemHostAlloc || !cu.cuMemFreeHost ||
      cu.cuMemHostAlloc(&p, bytes, 0x01 /* CU_MEMHOSTALLOC_PORTABLE */) != CUDA_SUCCESS)
    return NULL;
  return p;
}

void mplane_cuda_host_free(void *ptr) {
  if (ptr && cu.cuMemFreeHost) cu.cuMemFreeHost(ptr);
}

int mplane_cuda_memset(int gpu, void *dst, int value, size_t bytes) {
  return cu_use(gpu) == 0 && cu.cuMemsetD8((CUdeviceptr)(uintptr_t)dst, (unsigned char)value, bytes) == CUDA_SUCCESS
             ? 0
             : -1;
}

int mplane_cuda_pci_bus_id(int gpu, char *buf, int len) {
  CUdevice d;
  if (mplane_cuda_load(NULL, 0) <= gpu || gpu < 0 || cu.cuDeviceGet(&d, gpu) != CUDA_SUCCESS) return -1;
  return cu.cuDeviceGetPCIBusId(buf, len, d) == CUDA_SUCCESS ? 0 : -1;
}

/* ================================================================ the relay copy engine */

#define RELAY_EVENTS 1024 /* chunks in flight per engine */
#define RELAY_OPS 256     /* copies in flight per engine */

struct relay_op {
  uint64_t ticket;
  size_t bytes, chunk;
  uint64_t first_ev; /* index of its first chunk's event (monotonic) */
  int nchunks;
  int landed;        /* chunks known done */
};

struct mplane_relay_engine {
  int src_gpu, staging_gpu;
  CUstream stream; /* on src_gpu: the source's copy engine pushes over NVLink */
  CUdeviceptr staging;
  size_t staging_bytes, chunk;
  CUevent ev[RELAY_EVENTS];
  uint64_t ev_head, ev_tail; /* events in use: [head, tail) */
  struct relay_op ops[RELAY_OPS];
  uint64_t op_head, op_tail, next_ticket;
  pthread_mutex_t lock;
};

static ncclResult_t cu_check(CUresult r, const char *what, int gpu) {
  if (r == CUDA_SUCCESS) return ncclSuccess;
  MP_WARN("relay: %s on GPU %d failed: %s (CUDA error %d)", what, gpu, cu_err(r), r);
  return ncclUnhandledCudaError;
}

static void enable_peer(int from, int to) {
  if (from == to) return;
  CUdevice a, b;
  int can = 0;
  if (cu.cuDeviceGet(&a, from) != CUDA_SUCCESS || cu.cuDeviceGet(&b, to) != CUDA_SUCCESS) return;
  if (cu.cuDeviceCanAccessPeer(&can, a, b) != CUDA_SUCCESS || !can) {
    MP_INFO(NCCL_NET, "relay: GPU %d cannot access GPU %d directly; copies go through host memory", from, to);
    return;
  }
  if (cu_use(to) != 0 || cu_use(from) != 0) return;
  CUresult r = cu.cuCtxEnablePeerAccess(cu.ctx[to], 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    MP_INFO(NCCL_NET, "relay: peer access GPU %d -> %d: %s", from, to, cu_err(r));
}

ncclResult_t mplane_relay_engine_create(int src_gpu, int staging_gpu, size_t staging_bytes, size_t chunk_bytes,
                                        struct mplane_relay_engine **out) {
  char why[256];
  int n = mplane_cuda_load(why, sizeof(why));
  if (n <= 0) {
    MP_WARN("relay: cannot copy GPU buffers across planes: %s", why);
    return ncclSystemError;
  }
  if (src_gpu < 0 || src_gpu >= n || staging_gpu < 0 || staging_gpu >= n) {
    MP_WARN("relay: GPU %d or %d does not exist (%d GPUs)", src_gpu, staging_gpu, n);
    return ncclInvalidArgument;
  }
  struct mplane_relay_engine *e = calloc(1, sizeof(*e));
  if (!e) return ncclSystemError;
  pthread_mutex_init(&e->lock, NULL);
  e->src_gpu = src_gpu;
  e->staging_gpu = staging_gpu;
  e->staging_bytes = staging_bytes;
  e->chunk = chunk_bytes ? chunk_bytes : MPLANE_RELAY_CHUNK_DEFAULT;
  e->next_ticket = 1;
  ncclResult_t res = ncclSuccess;
  enable_peer(src_gpu, staging_gpu);
  enable_peer(staging_gpu, src_gpu);
  if (staging_bytes) {
    if (cu_use(staging_gpu) != 0) goto cuda_fail;
    MP_CHECK_GOTO(cu_check(cu.cuMemAlloc(&e->staging, staging_bytes), "allocating the staging buffer", staging_gpu),
                  res, fail);
  }
  if (cu_use(src_gpu) != 0) goto cuda_fail;
  MP_CHECK_GOTO(cu_check(cu.cuStreamCreate(&e->stream, CU_STREAM_NON_BLOCKING), "creating the relay stream", src_gpu),
                res, fail);
  for (int i = 0; i < RELAY_EVENTS; i++)
    MP_CHECK_GOTO(cu_check(cu.cuEventCreate(&e->ev[i], CU_EVENT_DISABLE_TIMING), "creating an event", src_gpu), res,
                  fail);
  *out = e;
  return ncclSuccess;
cuda_fail:
  MP_WARN("relay: cannot make GPU %d's context current", src_gpu);
  res = ncclUnhandledCudaError;
fail:
  mplane_relay_engine_destroy(e);
  return res;
}

void *mplane_relay_engine_staging(struct mplane_relay_engine *e) { return (void *)(uintptr_t)e->staging; }
size_t mplane_relay_engine_staging_bytes(struct mplane_relay_engine *e) { return e->staging_bytes; }

static int gpu_of(CUdeviceptr p) {
  int ord = -1;
  if (cu.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS) return -1;
  return ord;
}

static ncclResult_t copy_start(struct mplane_relay_engine *e, CUdeviceptr dst, int dst_gpu, CUdeviceptr src,
                               int src_gpu, size_t bytes, uint64_t *ticket) {
  size_t chunk = e->chunk;
  int nchunks = bytes ? (int)((bytes + chunk - 1) / chunk) : 1;
  pthread_mutex_lock(&e->lock);
  if (nchunks > RELAY_EVENTS || e->ev_tail - e->ev_head + (uint64_t)nchunks > RELAY_EVENTS ||
      e->op_tail - e->op_head >= RELAY_OPS) {
    pthread_mutex_unlock(&e->lock);
    *ticket = 0; /* no room now: the caller retries later */
    return nchunks > RELAY_EVENTS ? ncclInvalidUsage : ncclSuccess;
  }
  ncclResult_t res = ncclSuccess;
  if (cu_use(e->src_gpu) != 0) {
    pthread_mutex_unlock(&e->lock);
    return ncclUnhandledCudaError;
  }
  struct relay_op *op = &e->ops[e->op_tail % RELAY_OPS];
  op->ticket = e->next_ticket++;
  op->bytes = bytes;
  op->chunk = chunk;
  op->first_ev = e->ev_tail;
  op->nchunks = nchunks;
  op->landed = 0;
  for (int i = 0; i < nchunks; i++) {
    size_t off = (size_t)i * chunk;
    size_t len = bytes - off < chunk ? bytes - off : chunk;
    if (len) {
      res = cu_check(cu.cuMemcpyPeerAsync(dst + off, cu.ctx[dst_gpu], src + off, cu.ctx[src_gpu], len, e->stream),
                     "cuMemcpyPeerAsync", e->src_gpu);
      if (res != ncclSuccess) break;
    }
    res = cu_check(cu.cuEventRecord(e->ev[(e->ev_tail + (uint64_t)i) % RELAY_EVENTS], e->stream), "cuEventRecord",
                   e->src_gpu);
    if (res != ncclSuccess) break;
  }
  if (res == ncclSuccess) {
    e->ev_tail += (uint64_t)nchunks;
    e->op_tail++;
    *ticket = op->ticket;
  }
  pthread_mutex_unlock(&e->lock);
  return res;
}

ncclResult_t mplane_relay_copy_start(struct mplane_relay_engine *e, size_t offset, const void *src, size_t bytes,
                                     uint64_t *ticket) {
  if (offset > e->staging_bytes || bytes > e->staging_bytes - offset) {
    MP_WARN("relay: copy of %zu bytes at offset %zu does not fit the %zu-byte staging buffer", bytes, offset,
            e->staging_bytes);
    return ncclInvalidUsage;
  }
  if (cu_use(e->staging_gpu) != 0 || cu_use(e->src_gpu) != 0) return ncclUnhandledCudaError;
  return copy_start(e, e->staging + offset, e->staging_gpu, (CUdeviceptr)(uintptr_t)src, e->src_gpu, bytes, ticket);
}

ncclResult_t mplane_relay_copy_start_ptr(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes,
                                         uint64_t *ticket) {
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
  int dg = gpu_of(d), sg = gpu_of(s);
  if (dg < 0 || sg < 0 || cu_use(dg) != 0 || cu_use(sg) != 0) {
    MP_WARN("relay: copy between %p and %p: both must be device memory", dst, src);
    return ncclInvalidArgument;
  }
  return copy_start(e, d, dg, s, sg, bytes, ticket);
}

ncclResult_t mplane_relay_copy_poll(struct mplane_relay_engine *e, uint64_t ticket, size_t *ready, int *done) {
  *ready = 0;
  *done = 0;
  pthread_mutex_lock(&e->lock);
  ncclResult_t res = ncclSuccess;
  struct relay_op *found = NULL;
  for (uint64_t i = e->op_head; i < e->op_tail; i++)
    if (e->ops[i % RELAY_OPS].ticket == ticket) found = &e->ops[i % RELAY_OPS];
  if (!found) {
    /* Retired: it was done and an earlier poll returned done. */
    pthread_mutex_unlock(&e->lock);
    *done = 1;
    return ncclSuccess;
  }
  while (found->landed < found->nchunks) {
    CUresult r = cu.cuEventQuery(e->ev[(found->first_ev + (uint64_t)found->landed) % RELAY_EVENTS]);
    if (r == CUDA_ERROR_NOT_READY) break;
    if (r != CUDA_SUCCESS) {
      res = cu_check(r, "cuEventQuery", e->src_gpu);
      break;
    }
    found->landed++;
  }
  size_t r = (size_t)found->landed * found->chunk;
  *ready = r > found->bytes ? found->bytes : r;
  *done = found->landed == found->nchunks;
  /* Retire finished ops from the head, in order, freeing their events. */
  while (e->op_head < e->op_tail) {
    struct relay_op *h = &e->ops[e->op_head % RELAY_OPS];
    if (h->landed < h->nchunks) break;
    e->ev_head = h->first_ev + (uint64_t)h->nchunks;
    e->op_head++;
  }
  pthread_mutex_unlock(&e->lock);
  return res;
}

ncclResult_t mplane_relay_engine_sync(struct mplane_relay_engine *e) {
  if (cu_use(e->src_gpu) != 0) return ncclUnhandledCudaError;
  return cu_check(cu.cuStreamSynchronize(e->stream), "cuStreamSynchronize", e->src_gpu);
}

ncclResult_t mplane_relay_plain_copy(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes) {
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
  int dg = gpu_of(d), sg = gpu_of(s);
  if (dg < 0 || sg < 0 || cu_use(dg) != 0 || cu_use(sg) != 0 || cu_use(e->src_gpu) != 0) return ncclInvalidArgument;
  return cu_check(cu.cuMemcpyPeerAsync(d, cu.ctx[dg], s, cu.ctx[sg], bytes, e->stream), "cuMemcpyPeerAsync",
                  e->src_gpu);
}

void mplane_relay_engine_destroy(struct mplane_relay_engine *e) {
  if (!e) return;
  if (e->stream && cu_use(e->src_gpu) == 0) {
    cu.cuStreamSynchronize(e->stream);
    for (int i = 0; i < RELAY_EVENTS; i++)
      if (e->ev[i]) cu.cuEventDestroy(e->ev[i]);
    cu.cuStreamDestroy(e->stream);
  }
  if (e->staging && cu_use(e->staging_gpu) == 0) cu.cuMemFree(e->staging);
  pthread_mutex_destroy(&e->lock);
  free(e);
}
