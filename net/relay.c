/* mplane: the relay decision and the CUDA relay copy engine (see relay.h). */
#include "relay.h"

#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/config.h" /* enum mplane_relay_mode */
#include "../common/clock.h"
#include "../common/cuda.h"
#include "../common/cuda_driver.h"
#include "../common/log.h"

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
  MP_WARN("relay: %s on GPU %d failed: %s (CUDA error %d)", what, gpu, mplane_cu_err(r), r);
  return ncclUnhandledCudaError;
}

static void enable_peer(int from, int to) {
  if (from == to) return;
  CUdevice a, b;
  int can = 0;
  if (mplane_cu.cuDeviceGet(&a, from) != CUDA_SUCCESS || mplane_cu.cuDeviceGet(&b, to) != CUDA_SUCCESS) return;
  if (mplane_cu.cuDeviceCanAccessPeer(&can, a, b) != CUDA_SUCCESS || !can) {
    MP_INFO(NCCL_NET, "relay: GPU %d cannot access GPU %d directly; copies go through host memory", from, to);
    return;
  }
  if (mplane_cu_use(to) != 0 || mplane_cu_use(from) != 0) return;
  CUresult r = mplane_cu.cuCtxEnablePeerAccess(mplane_cu.ctx[to], 0);
  if (r != CUDA_SUCCESS && r != CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED)
    MP_INFO(NCCL_NET, "relay: peer access GPU %d -> %d: %s", from, to, mplane_cu_err(r));
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
    if (mplane_cu_use(staging_gpu) != 0) goto cuda_fail;
    MP_CHECK_GOTO(cu_check(mplane_cu.cuMemAlloc(&e->staging, staging_bytes), "allocating the staging buffer", staging_gpu),
                  res, fail);
  }
  if (mplane_cu_use(src_gpu) != 0) goto cuda_fail;
  MP_CHECK_GOTO(cu_check(mplane_cu.cuStreamCreate(&e->stream, CU_STREAM_NON_BLOCKING), "creating the relay stream", src_gpu),
                res, fail);
  for (int i = 0; i < RELAY_EVENTS; i++)
    MP_CHECK_GOTO(cu_check(mplane_cu.cuEventCreate(&e->ev[i], CU_EVENT_DISABLE_TIMING), "creating an event", src_gpu), res,
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
  if (mplane_cu.cuPointerGetAttribute(&ord, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS) return -1;
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
  if (mplane_cu_use(e->src_gpu) != 0) {
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
      res = cu_check(mplane_cu.cuMemcpyPeerAsync(dst + off, mplane_cu.ctx[dst_gpu], src + off, mplane_cu.ctx[src_gpu], len, e->stream),
                     "cuMemcpyPeerAsync", e->src_gpu);
      if (res != ncclSuccess) break;
    }
    res = cu_check(mplane_cu.cuEventRecord(e->ev[(e->ev_tail + (uint64_t)i) % RELAY_EVENTS], e->stream), "cuEventRecord",
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
  if (mplane_cu_use(e->staging_gpu) != 0 || mplane_cu_use(e->src_gpu) != 0) return ncclUnhandledCudaError;
  return copy_start(e, e->staging + offset, e->staging_gpu, (CUdeviceptr)(uintptr_t)src, e->src_gpu, bytes, ticket);
}

ncclResult_t mplane_relay_copy_start_ptr(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes,
                                         uint64_t *ticket) {
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
  int dg = gpu_of(d), sg = gpu_of(s);
  if (dg < 0 || sg < 0 || mplane_cu_use(dg) != 0 || mplane_cu_use(sg) != 0) {
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
    CUresult r = mplane_cu.cuEventQuery(e->ev[(found->first_ev + (uint64_t)found->landed) % RELAY_EVENTS]);
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
  if (mplane_cu_use(e->src_gpu) != 0) return ncclUnhandledCudaError;
  return cu_check(mplane_cu.cuStreamSynchronize(e->stream), "cuStreamSynchronize", e->src_gpu);
}

ncclResult_t mplane_relay_plain_copy(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes) {
  CUdeviceptr d = (CUdeviceptr)(uintptr_t)dst, s = (CUdeviceptr)(uintptr_t)src;
  int dg = gpu_of(d), sg = gpu_of(s);
  if (dg < 0 || sg < 0 || mplane_cu_use(dg) != 0 || mplane_cu_use(sg) != 0 || mplane_cu_use(e->src_gpu) != 0) return ncclInvalidArgument;
  return cu_check(mplane_cu.cuMemcpyPeerAsync(d, mplane_cu.ctx[dg], s, mplane_cu.ctx[sg], bytes, e->stream), "cuMemcpyPeerAsync",
                  e->src_gpu);
}

void mplane_relay_engine_destroy(struct mplane_relay_engine *e) {
  if (!e) return;
  if (e->stream && mplane_cu_use(e->src_gpu) == 0) {
    mplane_cu.cuStreamSynchronize(e->stream);
    for (int i = 0; i < RELAY_EVENTS; i++)
      if (e->ev[i]) mplane_cu.cuEventDestroy(e->ev[i]);
    mplane_cu.cuStreamDestroy(e->stream);
  }
  if (e->staging && mplane_cu_use(e->staging_gpu) == 0) mplane_cu.cuMemFree(e->staging);
  pthread_mutex_destroy(&e->lock);
  free(e);
}
