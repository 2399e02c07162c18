/* mplane: the GPU lane (see cuda.h): one ordered queue per GPU of the copies and signal writes the
 * socket RMA target makes into GPU memory, and of its copies out of it. */
#include "cuda.h"
#include "cuda_driver.h"

#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "config.h"
#include "cuda_lane_ring.h"
#include "log.h"

extern const char mplane_lane_ptx[]; /* cuda_lane_ptx.c, made by scripts/gen-lane-ptx.sh */

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
#define CU_STREAM_MEM_OP_WAIT_VALUE_64 4 /* flags 0: wait until the word >= value */
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
  uint64_t seq; /* under lock; stores atomic: klanes_kick reads it without the lock */
  /* MPLANE_GIN_LANE=kernel: ops go to the lane kernel's ring (cuda_lane_ring.h) instead, seq counts
   * them and done points at the ring's done word. Big copies still go to the stream (the copy
   * engine), bracketed by a wait for the ring and a write of ce_done that a WAIT op in the ring
   * waits for, so the order of everything stays one. */
  int kernel;
  struct mplane_lane_ctl *ctl;
  CUstream kstream;  /* the kernel's own: work queued behind it would wait for it to exit */
  CUfunction fn;
  uint64_t launched; /* epochs launched (stores atomic: klanes_kick reads it unlocked); ctl->exited == launched: none live */
  uint64_t ce_seq;
  size_t kmax; /* bigger copies go to the copy engine */
  /* The fallback (klane_fallback): where the kernel makes no progress for stall_ns with ops waiting,
   * they go to a fresh stream (spare: the lane's own may wait for the ring) and the lane stays in
   * stream mode, its done word sdone. watch_*: the ring's done when last seen moving, and when. */
  int gpu;
  CUstream spare;
  volatile uint64_t *sdone;
  uint64_t stall_ns, watch_done, watch_ns;
};
static struct cu_signal_lane signal_lanes[64];
static pthread_mutex_t signal_lanes_init = PTHREAD_MUTEX_INITIALIZER;

/* With TRACE on (MPLANE_DEBUG=2): how long a driver call that queues work on a lane took, when it
 * took longer than 100 us. Such a call runs on NCCL's GIN progress thread; while the driver holds it
 * nothing else is served, so these lines show where a one-sided op's latency goes. */
static uint64_t driver_t0(void) { return mplane_log_tracing() ? mplane_now_ns() : 0; }

static void driver_took(uint64_t t0, const char *what, size_t n) {
  if (!t0) return;
  uint64_t us = (mplane_now_ns() - t0) / 1000;
  if (us > 100) MP_TRACE(NCCL_NET, "CUDA %s (%zu) took %llu us", what, n, (unsigned long long)us);
}

/* ---------------------------------------------------------------- the lane kernel */

static int klane_gpus[64], klane_count; /* lanes in kernel mode, for the kick in signal_flush */
static void klane_watchdog_start(void);
static pthread_once_t klane_watchdog_once = PTHREAD_ONCE_INIT;
static uint64_t klane_watchdog_ns = 1000000000ull; /* the smallest stall bound / 4 (klane_init) */

/* Load the kernel and its ring; on any failure the lane stays on stream ops, saying why (once). */
static void klane_init(struct cu_signal_lane *l, int gpu, const struct mplane_config *cfg) {
  const char *why = NULL;
  CUmodule mod = NULL;
  void *ctl = NULL;
  if (!mplane_cu.cuModuleLoadData || !mplane_cu.cuModuleGetFunction || !mplane_cu.cuLaunchKernel)
    why = "the driver lacks cuModuleLoadData/cuLaunchKernel";
  else if (mplane_cu.cuModuleLoadData(&mod, mplane_lane_ptx) != CUDA_SUCCESS)
    why = "the driver could not load its PTX (a driver older than CUDA 13?)";
  else if (mplane_cu.cuModuleGetFunction(&l->fn, mod, MPLANE_LANE_KERNEL) != CUDA_SUCCESS)
    why = "its PTX has no " MPLANE_LANE_KERNEL;
  else if (mplane_cu.cuStreamCreate(&l->kstream, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS ||
           mplane_cu.cuStreamCreate(&l->spare, CU_STREAM_NON_BLOCKING) != CUDA_SUCCESS)
    why = "no stream for it";
  else if (mplane_cu.cuMemHostAlloc(&ctl, sizeof(struct mplane_lane_ctl), 0x03 /* PORTABLE | DEVICEMAP */) !=
           CUDA_SUCCESS)
    why = "no pinned memory for its ring";
  if (why) {
    MP_WARN("MPLANE_GIN_LANE=kernel: GPU %d's lane kernel is unavailable (%s); one-sided ops into its memory "
            "use stream ops", gpu, why);
    return;
  }
  memset(ctl, 0, sizeof(struct mplane_lane_ctl));
  l->ctl = ctl;
  l->ctl->idle_ns = (uint64_t)cfg->gin_lane_idle_us * 1000;
  l->kmax = (size_t)cfg->gin_lane_kernel_max;
  l->stall_ns = (uint64_t)cfg->gin_lane_stall_ms * 1000000;
  l->gpu = gpu;
  l->sdone = l->done; /* the stream's done word: the ring's takes its place until a fallback */
  __atomic_store_n(&l->done, &l->ctl->done, __ATOMIC_RELEASE);
  l->kernel = 1;
  klane_gpus[klane_count] = gpu;
  __atomic_store_n(&klane_count, klane_count + 1, __ATOMIC_RELEASE);
  uint64_t tick = l->stall_ns / 4 ? l->stall_ns / 4 : 1;
  if (tick < __atomic_load_n(&klane_watchdog_ns, __ATOMIC_RELAXED)) __atomic_store_n(&klane_watchdog_ns, tick, __ATOMIC_RELAXED);
  pthread_once(&klane_watchdog_once, klane_watchdog_start);
  MP_INFO(NCCL_NET, "GPU %d: one-sided ops into GPU memory go through the lane kernel (one block; exits after "
          "%d us idle; copies up to %d bytes, larger ones by the copy engine; stream ops after %d ms without "
          "progress)", gpu, cfg->gin_lane_idle_us, cfg->gin_lane_kernel_max, cfg->gin_lane_stall_ms);
}

/* ---- the fallback: ops never wait on a kernel that cannot start or stopped making progress */

static int klane_fallback_warned; /* one WARN per process; later lanes say it at INFO */

/* One ring op (seq s) on the lane's stream, then its completion in both done words: the ring's, for
 * big copies queued on the old stream behind a wait for it, and sdone, the lane's from now on. */
static int klane_replay(struct cu_signal_lane *l, uint64_t s) {
  struct mplane_lane_cmd *k = &l->ctl->ring[s % MPLANE_LANE_SLOTS];
  struct cu_write_op w[3];
  unsigned n = 0;
  if (k->op == MPLANE_LANE_COPY) {
    CUresult r = k->to_gpu ? mplane_cu.cuMemcpyHtoDAsync(k->dst, (const void *)(uintptr_t)k->src, k->bytes, l->stream)
                           : mplane_cu.cuMemcpyDtoHAsync((void *)(uintptr_t)k->dst, k->src, k->bytes, l->stream);
    if (r != CUDA_SUCCESS) return -1;
  } else if (k->op == MPLANE_LANE_WRITE64 || k->op == MPLANE_LANE_WAIT) {
    int wait = k->op == MPLANE_LANE_WAIT;
    w[n++] = (struct cu_write_op){.operation = wait ? CU_STREAM_MEM_OP_WAIT_VALUE_64 : CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                  .address = wait ? k->src : k->dst, .value = k->value};
  }
  w[n++] = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                .address = (CUdeviceptr)(uintptr_t)&l->ctl->done, .value = s};
  w[n++] = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                .address = (CUdeviceptr)(uintptr_t)l->sdone, .value = s};
  return mplane_cu.cuStreamBatchMemOp(l->stream, n, w, 0) == CUDA_SUCCESS ? 0 : -1;
}

/* Take the ring's ops back from the kernel and run them on a stream, and every later op too (lock
 * held): the protocol in cuda_lane_ring.h says which ops the kernel can no longer run. 0, or -1
 * when the driver refused a replayed op (its caller's op then fails, with a WARN). */
static int klane_fallback(struct cu_signal_lane *l, const char *why) {
  volatile struct mplane_lane_ctl *c = l->ctl;
  __atomic_store_n(&c->stop, 1, __ATOMIC_SEQ_CST);
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
  uint64_t claimed = __atomic_load_n(&c->claimed, __ATOMIC_SEQ_CST);
  uint64_t done = __atomic_load_n(&c->done, __ATOMIC_SEQ_CST), waiting = l->seq - done;
  *l->sdone = done;
  l->stream = l->spare;
  int rc = 0;
  for (uint64_t s = done + 1; s <= l->seq && rc == 0; s++) rc = klane_replay(l, s);
  __atomic_store_n(&l->kernel, 0, __ATOMIC_RELEASE);
  __atomic_store_n(&l->done, l->sdone, __ATOMIC_RELEASE);
  char begun[64] = "";
  if (claimed > done) snprintf(begun, sizeof(begun), " (#%llu begun by the kernel: run again)", (unsigned long long)claimed);
  if (!__atomic_exchange_n(&klane_fallback_warned, 1, __ATOMIC_RELAXED))
    MP_WARN("MPLANE_GIN_LANE=kernel: GPU %d's lane kernel %s; its %llu waiting ops%s and every later one-sided op "
            "into its memory go through stream ops from now on (MPLANE_GIN_LANE_STALL_MS=%llu)",
            l->gpu, why, (unsigned long long)waiting, begun, (unsigned long long)(l->stall_ns / 1000000));
  else
    MP_INFO(NCCL_NET, "GPU %d's lane kernel %s: its ops go through stream ops from now on", l->gpu, why);
  if (rc != 0) MP_WARN("GPU %d: a waiting op of the lane kernel could not be given to a stream", l->gpu);
  return rc;
}

/* Ops wait (the caller saw it): has the ring's done stayed put for stall_ns? The clock starts when
 * ops are first seen waiting at a done value (klane_push clears it when the ring was empty). No lock:
 * signal_flush asks on every pass; two threads racing here at worst restart the clock. */
static int klane_overdue(struct cu_signal_lane *l, uint64_t now) {
  uint64_t done = __atomic_load_n(&l->ctl->done, __ATOMIC_ACQUIRE), since = __atomic_load_n(&l->watch_ns, __ATOMIC_RELAXED);
  if (!since || done != __atomic_load_n(&l->watch_done, __ATOMIC_RELAXED)) {
    __atomic_store_n(&l->watch_done, done, __ATOMIC_RELAXED);
    __atomic_store_n(&l->watch_ns, now, __ATOMIC_RELAXED);
    return 0;
  }
  return now - since >= l->stall_ns;
}

/* Ops wait and the ring's done has not moved for stall_ns: fall back (lock held). 1 fell back, 0 not,
 * -1 fell back and failed. */
static int klane_watch(struct cu_signal_lane *l) {
  volatile struct mplane_lane_ctl *c = l->ctl;
  uint64_t now = mplane_now_ns();
  if (!klane_overdue(l, now)) return 0;
  uint64_t ms = (now - __atomic_load_n(&l->watch_ns, __ATOMIC_RELAXED)) / 1000000;
  char why[96];
  if (__atomic_load_n(&c->started, __ATOMIC_ACQUIRE) != l->launched)
    snprintf(why, sizeof(why), "launched %llu ms ago has not started (every SM busy?)", (unsigned long long)ms);
  else
    snprintf(why, sizeof(why), "made no progress for %llu ms (stopped after op #%llu)", (unsigned long long)ms,
             (unsigned long long)__atomic_load_n(&c->done, __ATOMIC_ACQUIRE));
  return klane_fallback(l, why) == 0 ? 1 : -1;
}

/* Launch a kernel where ops wait and none is live (lock held). A kernel that exits idle while an op
 * is being queued leaves it waiting: every signal_flush and lane_wait kicks again. A kernel that
 * cannot be launched, or (watch: the callers that wait, and signal_flush) cannot start or stops
 * making progress hands its ops to the stream (klane_watch): afterwards l->kernel is 0, and the
 * caller goes the stream way. The kick after each queued op does not watch: a clock read per op
 * cost 2 us per burst of 65 ops on the stand-in, and the waiters and the watchdog look anyway. */
static int klane_kick(struct cu_signal_lane *l, int watch) {
  volatile struct mplane_lane_ctl *c = l->ctl;
  if (!l->kernel) return 0; /* fell back already (another thread, between its look and the lock) */
  if (l->seq <= __atomic_load_n(&c->done, __ATOMIC_ACQUIRE)) return 0;
  int w = watch ? klane_watch(l) : 0;
  if (w) return w < 0 ? -1 : 0;
  if (__atomic_load_n(&c->exited, __ATOMIC_ACQUIRE) != l->launched) return 0;
  struct mplane_lane_ctl *arg0 = l->ctl;
  unsigned long long arg1 = l->launched + 1;
  void *args[] = {&arg0, &arg1};
  uint64_t t0 = driver_t0();
  CUresult r = mplane_cu.cuLaunchKernel(l->fn, 1, 1, 1, MPLANE_LANE_THREADS, 1, 1, 0, l->kstream, args, NULL);
  driver_took(t0, "cuLaunchKernel, lane", 1);
  if (r != CUDA_SUCCESS) {
    char why[96];
    snprintf(why, sizeof(why), "could not be launched: %s (CUDA error %d)", mplane_cu_err(r), r);
    return klane_fallback(l, why);
  }
  __atomic_store_n(&l->launched, l->launched + 1, __ATOMIC_RELAXED); /* klanes_kick reads it without the lock */
  return 0;
}

/* Queue one op; its seq, or 0 when the ring stays full past 10 s or the fallback failed (lock held).
 * 0 with l->kernel 0: the lane fell back while this op waited for room; it is not queued. */
static uint64_t klane_push(struct cu_signal_lane *l, uint32_t op, uint64_t dst, uint64_t src, uint64_t bytes,
                           uint64_t value, int to_gpu) {
  uint64_t t0 = 0;
  while (l->seq - __atomic_load_n(&l->ctl->done, __ATOMIC_ACQUIRE) >= MPLANE_LANE_SLOTS) {
    if (klane_kick(l, 1) != 0 || !l->kernel) return 0;
    if (!t0) t0 = mplane_now_ns();
    else if (mplane_now_ns() - t0 > 10000000000ull) return 0;
    sched_yield();
  }
  if (l->seq == __atomic_load_n(&l->ctl->done, __ATOMIC_ACQUIRE))
    __atomic_store_n(&l->watch_ns, 0, __ATOMIC_RELAXED); /* the ring was empty: a stall is timed from now */
  uint64_t seq = l->seq + 1;
  struct mplane_lane_cmd *c = &l->ctl->ring[seq % MPLANE_LANE_SLOTS];
  c->op = op, c->to_gpu = (uint32_t)to_gpu, c->dst = dst, c->src = src, c->bytes = bytes, c->value = value;
  __atomic_store_n(&c->seq, seq, __ATOMIC_RELEASE);
  __atomic_store_n(&l->seq, seq, __ATOMIC_RELAXED); /* klanes_kick reads it without the lock */
  return klane_kick(l, 0) == 0 ? seq : 0;
}

/* Everything queued on the ring done (lock held): before an op that goes to the stream and is
 * waited for there. 0 (done, or the lane fell back: the ring's ops are on l->stream ahead of what
 * comes next), or -1 after timeout_ms. */
static int klane_drain(struct cu_signal_lane *l, int timeout_ms) {
  uint64_t t0 = mplane_now_ns();
  while (l->kernel && __atomic_load_n(&l->ctl->done, __ATOMIC_ACQUIRE) < l->seq) {
    if (klane_kick(l, 1) != 0 || (mplane_now_ns() - t0) / 1000000 > (uint64_t)timeout_ms) return -1;
    sched_yield();
  }
  return 0;
}

static int lane_mark(struct cu_signal_lane *l, uint64_t v);

/* A copy too big for the kernel: on the copy engine, after the ring's ops, and a WAIT op in the ring
 * for it, so what is queued later waits for it (lock held). Its seq, 0 on failure. */
static uint64_t klane_copy_engine(struct cu_signal_lane *l, void *dst, const void *src, size_t bytes, int to_gpu) {
  struct cu_write_op w = {.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64,
                          .address = (CUdeviceptr)(uintptr_t)&l->ctl->done, .value = l->seq};
  if (mplane_cu.cuStreamBatchMemOp(l->stream, 1, &w, 0) != CUDA_SUCCESS) return 0;
  CUresult r = to_gpu ? mplane_cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, l->stream)
                      : mplane_cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, l->stream);
  if (r != CUDA_SUCCESS) return 0;
  w = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                           .address = (CUdeviceptr)(uintptr_t)&l->ctl->ce_done, .value = ++l->ce_seq};
  if (mplane_cu.cuStreamBatchMemOp(l->stream, 1, &w, 0) != CUDA_SUCCESS) return 0;
  uint64_t seq = klane_push(l, MPLANE_LANE_WAIT, 0, (uint64_t)(uintptr_t)&l->ctl->ce_done, 0, l->ce_seq, 0);
  if (seq || l->kernel) return seq;
  /* fell back while the ring was full: the copy's completion on the lane's new stream */
  w = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WAIT_VALUE_64,
                           .address = (CUdeviceptr)(uintptr_t)&l->ctl->ce_done, .value = l->ce_seq};
  if (mplane_cu.cuStreamBatchMemOp(l->stream, 1, &w, 0) != CUDA_SUCCESS || lane_mark(l, l->seq + 1) != 0) return 0;
  __atomic_store_n(&l->seq, l->seq + 1, __ATOMIC_RELAXED); /* klanes_kick reads it without the lock */
  return l->seq;
}

static struct cu_signal_lane *signal_lane(int gpu) {
  struct cu_signal_lane *l = &signal_lanes[gpu];
  if (__atomic_load_n(&l->ready, __ATOMIC_ACQUIRE)) return l;
  pthread_mutex_lock(&signal_lanes_init);
  if (!l->ready && mplane_cu.cuStreamCreate(&l->stream, CU_STREAM_NON_BLOCKING) == CUDA_SUCCESS) {
    pthread_mutex_init(&l->lock, NULL);
    void *w = NULL;
    l->fast = mplane_cu.cuMemHostAlloc && mplane_cu.cuStreamWriteValue64 && mplane_cu.cuMemHostAlloc(&w, 64, 0) == CUDA_SUCCESS;
    l->word = l->fast ? w : malloc(sizeof(uint64_t));
    void *d = NULL; /* mapped: the stream writes it; under unified addressing its host address is its device address */
    if (l->fast && mplane_cu.cuStreamBatchMemOp && mplane_cu.cuMemHostAlloc(&d, 64, 0x03 /* PORTABLE | DEVICEMAP */) == CUDA_SUCCESS) {
      memset(d, 0, 64);
      l->done = d;
    }
    const struct mplane_config *cfg = mplane_config_get();
    if (l->done && cfg && cfg->gin_lane == MPLANE_GIN_LANE_KERNEL) klane_init(l, gpu, cfg);
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

/* Before a stream op that is waited for: the lane kernel's queued ops first (kernel mode). */
static int lane_drain_ring(int gpu) {
  struct cu_signal_lane *l = signal_lane(gpu);
  if (!l || !l->kernel) return 0;
  pthread_mutex_lock(&l->lock);
  int rc = klane_drain(l, 10000);
  pthread_mutex_unlock(&l->lock);
  return rc;
}

/* Wait for the lane by polling it: cuStreamSynchronize may sleep until an interrupt, and on a host
 * whose cores are busy with spinning threads the wake-up costs far more than a small copy. */
static int lane_wait(CUstream s) {
  for (;;) {
    CUresult r = mplane_cu.cuStreamQuery(s);
    if (r == CUDA_SUCCESS) return 0;
    if (r != CUDA_ERROR_NOT_READY) return -1;
    sched_yield();
  }
}

int mplane_cuda_memcpy_htod_nb(int gpu, void *dst, const void *src, size_t bytes) {
  if (mplane_cu_use(gpu) != 0 || !cu_copy_stream(gpu)) return -1;
  if (lane_drain_ring(gpu) != 0) return -1;
  CUstream s = cu_copy_stream(gpu); /* after the drain: a fallback there gives the lane a new stream */
  if (mplane_cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, s) != CUDA_SUCCESS) return -1;
  return lane_wait(s);
}

/* Write v to the word on the lane, in order after what is queued there (lock held): in flight with
 * cuStreamWriteValue64, else through the pinned word and waited for. 0 ok, -1 CUDA failed. */
static int lane_write(struct cu_signal_lane *l, CUdeviceptr p, uint64_t v) {
  if (l->fast) return mplane_cu.cuStreamWriteValue64(l->stream, p, v, 0) == CUDA_SUCCESS ? 0 : -1;
  *l->word = v;
  return mplane_cu.cuMemcpyHtoDAsync(p, l->word, sizeof(uint64_t), l->stream) == CUDA_SUCCESS &&
                 mplane_cu.cuStreamSynchronize(l->stream) == CUDA_SUCCESS
             ? 0
             : -1;
}

static struct cu_signal_lane *lane_of(int gpu) {
  return gpu >= 0 && gpu < 64 && mplane_cu_use(gpu) == 0 ? signal_lane(gpu) : NULL;
}

/* Lanes holding writes not yet given to the driver: flush, called after every pass of a reader,
 * returns at once while there are none (host windows only, or nothing new). */
static int lanes_pending;

/* Give the lane's pending writes to the driver in one call, in order (lock held). */
static int lane_submit(struct cu_signal_lane *l) {
  int n = l->npending;
  if (n == 0) return 0;
  __atomic_store_n(&l->npending, 0, __ATOMIC_RELAXED);
  __atomic_sub_fetch(&lanes_pending, 1, __ATOMIC_RELAXED);
  uint64_t t0 = driver_t0();
  int rc = mplane_cu.cuStreamBatchMemOp(l->stream, (unsigned)n, l->pending, 0) == CUDA_SUCCESS ? 0 : -1;
  driver_took(t0, "cuStreamBatchMemOp, writes", (size_t)n);
  return rc;
}

/* The lane's one ordering rule for what reads GPU memory: a read queued now comes after every write
 * given to the lane before it, so it sees them (a get of a signal word right behind the putSignal
 * that set it). Stream mode: the signal writes still waiting in the batch are submitted first (a
 * copy queued on the stream now would run before them). Kernel mode: a read that goes to the stream
 * waits for the ring's ops (on_stream); one that goes into the ring is behind them already. Lock
 * held. 0, or -1 when the driver refused or the ring did not drain. */
static int lane_before_read(struct cu_signal_lane *l, int on_stream) {
  if (l->kernel) return on_stream ? klane_drain(l, 10000) : 0;
  return lane_submit(l);
}

int mplane_cuda_memcpy_dtoh_nb(int gpu, void *dst, const void *src, size_t bytes) {
  struct cu_signal_lane *l = lane_of(gpu);
  if (!l) return -1;
  pthread_mutex_lock(&l->lock);
  int rc = lane_before_read(l, 1) == 0 &&
                   mplane_cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, l->stream) == CUDA_SUCCESS
               ? 0
               : -1;
  pthread_mutex_unlock(&l->lock);
  return rc == 0 ? lane_wait(l->stream) : -1;
}

int mplane_cuda_signal_add(int gpu, void *word, uint64_t add, uint64_t *now) {
  struct cu_signal_lane *l = lane_of(gpu);
  if (!l) return -1;
  CUdeviceptr p = (CUdeviceptr)(uintptr_t)word;
  pthread_mutex_lock(&l->lock);
  int rc = -1;
  if (lane_before_read(l, 1) == 0 && mplane_cu.cuMemcpyDtoHAsync(l->word, p, sizeof(uint64_t), l->stream) == CUDA_SUCCESS &&
      mplane_cu.cuStreamSynchronize(l->stream) == CUDA_SUCCESS) {
    *now = *l->word + add;
    rc = lane_write(l, p, *now);
    /* kernel mode: the ring's later ops do not wait for the stream, so this write must be in first */
    if (rc == 0 && l->kernel) rc = lane_wait(l->stream);
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
  if (l->kernel) {
    rc = klane_push(l, MPLANE_LANE_WRITE64, (uint64_t)(uintptr_t)word, 0, 0, *now, 1) ? 0 : -1;
    if (rc != 0 && !l->kernel) rc = 0; /* fell back before it was queued: the stream way below */
    else goto out;
  }
  if (l->fast && mplane_cu.cuStreamBatchMemOp) {
    if (l->npending == LANE_BATCH) rc = lane_submit(l);
    if (rc == 0) { /* a write the driver refused must not leave this one pending beyond the shadow */
      if (l->npending == 0) __atomic_add_fetch(&lanes_pending, 1, __ATOMIC_RELAXED);
      l->pending[l->npending] = (struct cu_write_op){.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64,
                                                     .address = (CUdeviceptr)(uintptr_t)word, .value = *now};
      __atomic_store_n(&l->npending, l->npending + 1, __ATOMIC_RELAXED);
    }
  } else rc = lane_write(l, (CUdeviceptr)(uintptr_t)word, *now);
out:
  if (rc == 0) *shadow = *now;
  pthread_mutex_unlock(&l->lock);
  return rc;
}

/* The watchdog: a thread that looks at every kernel-mode lane each quarter of its stall bound, so
 * the bound holds when nothing else polls (a target whose reader threads sleep in poll() while its
 * last ops wait in the ring, behind a kernel that never started). klanes_kick does the looking. */
static int klanes_kick(void);

static void *klane_watchdog(void *arg) {
  (void)arg;
  for (;;) {
    uint64_t ns = __atomic_load_n(&klane_watchdog_ns, __ATOMIC_RELAXED);
    struct timespec t = {.tv_sec = (time_t)(ns / 1000000000ull), .tv_nsec = (long)(ns % 1000000000ull)};
    nanosleep(&t, NULL);
    klanes_kick(); /* a failed fallback fails the ops' callers; nothing to do here */
  }
  return NULL;
}

static void klane_watchdog_start(void) {
  pthread_t t;
  pthread_attr_t a;
  pthread_attr_init(&a);
  pthread_attr_setdetachstate(&a, PTHREAD_CREATE_DETACHED);
  if (pthread_create(&t, &a, klane_watchdog, NULL) != 0)
    MP_WARN("MPLANE_GIN_LANE=kernel: no watchdog thread for the lane kernel; a stalled kernel is seen only "
            "when ops are polled");
  pthread_attr_destroy(&a);
}

/* Lanes in kernel mode with ops queued and no kernel live get one (see klane_kick). */
static int klanes_kick(void) {
  int rc = 0, n = __atomic_load_n(&klane_count, __ATOMIC_ACQUIRE);
  for (int i = 0; i < n; i++) {
    struct cu_signal_lane *l = &signal_lanes[klane_gpus[i]];
    volatile struct mplane_lane_ctl *c = l->ctl;
    if (!__atomic_load_n(&l->kernel, __ATOMIC_RELAXED) ||
        __atomic_load_n(&l->seq, __ATOMIC_RELAXED) <= __atomic_load_n(&c->done, __ATOMIC_ACQUIRE))
      continue; /* fell back, or nothing waits: loads, no lock */
    if (__atomic_load_n(&c->exited, __ATOMIC_ACQUIRE) != __atomic_load_n(&l->launched, __ATOMIC_RELAXED) &&
        !klane_overdue(l, mplane_now_ns()))
      continue; /* a kernel is live and moving (or not for long) */
    if (mplane_cu_use(klane_gpus[i]) != 0) return -1;
    pthread_mutex_lock(&l->lock);
    if (klane_kick(l, 1) != 0) rc = -1;
    pthread_mutex_unlock(&l->lock);
  }
  return rc;
}

int mplane_cuda_signal_flush(void) {
  int rc = 0;
  if (__atomic_load_n(&klane_count, __ATOMIC_RELAXED) && klanes_kick() != 0) rc = -1;
  if (!__atomic_load_n(&lanes_pending, __ATOMIC_RELAXED)) return rc;
  for (int g = 0; g < 64; g++) {
    struct cu_signal_lane *l = &signal_lanes[g];
    if (!__atomic_load_n(&l->ready, __ATOMIC_ACQUIRE) || !__atomic_load_n(&l->npending, __ATOMIC_RELAXED)) continue;
    if (mplane_cu_use(g) != 0) {
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
  if (l->kernel) {
    uint64_t seq = bytes <= l->kmax ? klane_push(l, MPLANE_LANE_COPY, (uint64_t)(uintptr_t)dst,
                                                 (uint64_t)(uintptr_t)src, bytes, 0, to_gpu)
                                    : klane_copy_engine(l, dst, src, bytes, to_gpu);
    if (seq || l->kernel) {
      pthread_mutex_unlock(&l->lock);
      return seq;
    } /* fell back before it was queued: the stream way below */
  }
  if (!to_gpu && lane_before_read(l, 1) != 0) {
    pthread_mutex_unlock(&l->lock);
    return 0;
  }
  uint64_t t0 = driver_t0();
  CUresult r = to_gpu ? mplane_cu.cuMemcpyHtoDAsync((CUdeviceptr)(uintptr_t)dst, src, bytes, l->stream)
                      : mplane_cu.cuMemcpyDtoHAsync(dst, (CUdeviceptr)(uintptr_t)src, bytes, l->stream);
  driver_took(t0, to_gpu ? "cuMemcpyHtoDAsync, bytes" : "cuMemcpyDtoHAsync, bytes", bytes);
  uint64_t seq = 0;
  if (r == CUDA_SUCCESS && lane_mark(l, l->seq + 1) == 0) {
    seq = l->seq + 1;
    __atomic_store_n(&l->seq, seq, __ATOMIC_RELAXED); /* klanes_kick reads it without the lock */
  }
  pthread_mutex_unlock(&l->lock);
  return seq;
}

uint64_t mplane_cuda_lane_done(int gpu) {
  if (gpu < 0 || gpu >= 64 || !__atomic_load_n(&signal_lanes[gpu].ready, __ATOMIC_ACQUIRE)) return 0;
  const volatile uint64_t *d = __atomic_load_n(&signal_lanes[gpu].done, __ATOMIC_ACQUIRE);
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

int mplane_cuda_lane_kernel(int gpu) {
  return gpu >= 0 && gpu < 64 && __atomic_load_n(&signal_lanes[gpu].ready, __ATOMIC_ACQUIRE) &&
         __atomic_load_n(&signal_lanes[gpu].kernel, __ATOMIC_ACQUIRE);
}

int mplane_cuda_lane_wait(int gpu, uint64_t seq, int timeout_ms) {
  if (mplane_cuda_lane_done(gpu) >= seq) return 0;
  if (mplane_cuda_signal_flush() != 0) return -1; /* the mark may still be pending */
  uint64_t t0 = mplane_now_ns();
  while (mplane_cuda_lane_done(gpu) < seq) {
    if ((mplane_now_ns() - t0) / 1000000 > (uint64_t)timeout_ms) return -1;
    /* its kernel may have exited (a kick), or stopped making progress (the fallback) */
    if (__atomic_load_n(&signal_lanes[gpu].kernel, __ATOMIC_RELAXED) && mplane_cuda_signal_flush() != 0) return -1;
    sched_yield();
  }
  return 0;
}
