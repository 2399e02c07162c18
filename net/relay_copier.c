/* mplane: the relay's copier, what a transport calls to move a user buffer into its staging ring on
 * a relayed connection (relay.h). Two engines behind one asynchronous interface: the CUDA relay copy
 * engine (relay.c) for GPU buffers, and a CPU stand-in (memcpy on a worker thread) that lets the
 * transports' staging state machines run, byte-checked, on machines without a GPU. */
#include "relay.h"

#include "../common/cuda.h"
#include "../common/test_hooks.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../common/log.h"

/* ---------------------------------------------------------------- test settings
 * Test hooks (common/test_hooks.h): read only in the test build; what ships answers "unset". */

int mplane_relay_test_host(void) { return mplane_test_relay_host(); }
size_t mplane_relay_test_slot_bytes(size_t dflt) { return mplane_test_relay_slot_bytes(dflt); }
int mplane_relay_test_fail_reg(void) { return mplane_test_relay_fail_reg(); }

/* ---------------------------------------------------------------- the CPU stand-in */

#define CPU_JOBS 64

struct cpu_job {
  void *dst;
  const void *src;
  size_t bytes;
  int state; /* 0 queued, 1 done, 2 failed */
};

struct mplane_relay_copier {
  int cpu;
  /* CUDA */
  struct mplane_relay_engine *engine;
  int gpu;
  /* CPU */
  pthread_t worker;
  int started, stop;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct cpu_job jobs[CPU_JOBS];
  uint64_t head, next, tail; /* [head, tail) in use; next: the worker's next job */
  unsigned long long fail_at, copies;
  int memfd;     /* the stand-in's staging memory: a memfd, mapped at map (maplen bytes) */
  void *map;
  size_t maplen;
};

static void *cpu_worker(void *arg) {
  struct mplane_relay_copier *c = arg;
  pthread_mutex_lock(&c->lock);
  for (;;) {
    while (!c->stop && c->next == c->tail) pthread_cond_wait(&c->cond, &c->lock);
    if (c->next == c->tail) break; /* stop, nothing queued */
    struct cpu_job *j = &c->jobs[c->next % CPU_JOBS];
    pthread_mutex_unlock(&c->lock);
    int fail = c->fail_at && ++c->copies == c->fail_at;
    if (!fail && j->bytes) memcpy(j->dst, j->src, j->bytes);
    pthread_mutex_lock(&c->lock);
    __atomic_store_n(&j->state, fail ? 2 : 1, __ATOMIC_RELEASE);
    c->next++;
  }
  pthread_mutex_unlock(&c->lock);
  return NULL;
}

int mplane_cuda_gpu_of_busid(const char *busid) {
  if (!busid || !*busid) return -1;
  int n = mplane_cuda_load(NULL, 0);
  for (int g = 0; g < n; g++) {
    char id[32];
    if (mplane_cuda_pci_bus_id(g, id, sizeof(id)) == 0 && strcasecmp(id, busid) == 0) return g;
  }
  return -1;
}

ncclResult_t mplane_relay_copier_create(const void *src, const char *staging_busid,
                                        struct mplane_relay_copier **out) {
  struct mplane_relay_copier *c = calloc(1, sizeof(*c));
  if (!c) return ncclSystemError;
  c->cpu = mplane_test_relay_cpu_copier();
  if (c->cpu) {
    c->fail_at = mplane_test_relay_fail_copy();
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    if (pthread_create(&c->worker, NULL, cpu_worker, c) != 0) {
      MP_WARN("relay: cannot start the CPU copier's thread");
      free(c);
      return ncclSystemError;
    }
    c->started = 1;
    *out = c;
    return ncclSuccess;
  }
  int src_gpu = mplane_cuda_pointer_device(src);
  if (src_gpu < 0) {
    MP_WARN("relay: the buffer at %p to stage is not GPU memory (the relay copy engine copies GPU buffers)", src);
    free(c);
    return ncclInvalidUsage;
  }
  c->gpu = mplane_cuda_gpu_of_busid(staging_busid);
  if (c->gpu < 0) {
    MP_INFO(NCCL_NET, "relay: no visible GPU at %s beside the relay NIC; staging on the buffer's GPU %d",
            staging_busid && *staging_busid ? staging_busid : "(unknown)", src_gpu);
    c->gpu = src_gpu;
  }
  ncclResult_t res = mplane_relay_engine_create(src_gpu, c->gpu, 0, 0, &c->engine);
  if (res != ncclSuccess) {
    free(c);
    return res;
  }
  *out = c;
  return ncclSuccess;
}

void *mplane_relay_copier_alloc(struct mplane_relay_copier *c, size_t bytes) {
  if (!c->cpu) return mplane_cuda_alloc(c->gpu, bytes);
  if (c->map) return NULL; /* one staging buffer per copier */
  int fd = memfd_create("mplane-relay-staging", MFD_CLOEXEC);
  if (fd < 0) return NULL;
  void *p = ftruncate(fd, (off_t)bytes) == 0 ? mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
  if (p == MAP_FAILED) {
    close(fd);
    return NULL;
  }
  c->memfd = fd;
  c->map = p;
  c->maplen = bytes;
  return p;
}

int mplane_relay_copier_dmabuf_fd(struct mplane_relay_copier *c, void *mem, size_t bytes) {
  if (!c->cpu) return mplane_cuda_dmabuf_fd(c->gpu, mem, bytes);
  return c->map && mem == c->map && bytes <= c->maplen ? dup(c->memfd) : -1;
}

ncclResult_t mplane_relay_copier_start(struct mplane_relay_copier *c, void *dst, const void *src, size_t bytes,
                                       uint64_t *ticket) {
  *ticket = 0;
  if (!c->cpu) return mplane_relay_copy_start_ptr(c->engine, dst, src, bytes, ticket);
  pthread_mutex_lock(&c->lock);
  if (c->tail - c->head < CPU_JOBS) {
    struct cpu_job *j = &c->jobs[c->tail % CPU_JOBS];
    *j = (struct cpu_job){.dst = dst, .src = src, .bytes = bytes, .state = 0};
    *ticket = ++c->tail; /* ticket t is job t - 1 */
    pthread_cond_signal(&c->cond);
  }
  pthread_mutex_unlock(&c->lock);
  return ncclSuccess; /* ticket 0: no room now, the caller retries */
}

ncclResult_t mplane_relay_copier_poll(struct mplane_relay_copier *c, uint64_t ticket, int *done) {
  *done = 0;
  if (!c->cpu) {
    size_t ready;
    return mplane_relay_copy_poll(c->engine, ticket, &ready, done);
  }
  pthread_mutex_lock(&c->lock);
  ncclResult_t res = ncclSuccess;
  if (ticket <= c->head) {
    *done = 1; /* retired: an earlier poll saw it done */
  } else {
    int st = __atomic_load_n(&c->jobs[(ticket - 1) % CPU_JOBS].state, __ATOMIC_ACQUIRE);
    if (st == 2) {
      MP_WARN("relay: the CPU copier failed copy %llu, as the test hook asked", (unsigned long long)ticket);
      res = ncclSystemError;
    }
    *done = st == 1;
  }
  /* jobs finish in order (one worker): retire every finished one from the head */
  while (c->head < c->next && c->jobs[c->head % CPU_JOBS].state == 1) c->head++;
  pthread_mutex_unlock(&c->lock);
  return res;
}

void mplane_relay_copier_destroy(struct mplane_relay_copier *c, void *staging) {
  if (!c) return;
  if (c->cpu && c->started) {
    pthread_mutex_lock(&c->lock);
    c->stop = 1;
    pthread_cond_signal(&c->cond);
    pthread_mutex_unlock(&c->lock);
    pthread_join(c->worker, NULL); /* a copy under way ends first: the caller's buffer is still alive */
    pthread_mutex_destroy(&c->lock);
    pthread_cond_destroy(&c->cond);
  }
  if (c->engine) mplane_relay_engine_destroy(c->engine); /* syncs its stream first */
  if (staging && c->cpu && staging == c->map) {
    munmap(c->map, c->maplen);
    close(c->memfd);
  } else if (staging && !c->cpu) {
    mplane_cuda_free(c->gpu, staging);
  }
  free(c);
}
