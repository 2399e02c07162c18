/* The lane kernel never hangs an op (common/cuda_lane.c, klane_fallback): against the CUDA
 * stand-in's lane-kernel faults, every op given to a lane whose kernel cannot start or stops making
 * progress completes through stream ops within MPLANE_GIN_LANE_STALL_MS (plus the replay), with the
 * right bytes and signal values, the lane stays on stream ops afterwards, and one WARN says so for
 * the whole process (the second GPU's fallback says it at INFO).
 *
 *   test-cuda-lane-fallback nostart    MPLANE_FAKE_CUDA_LANE=nostart: no lane kernel ever starts
 *   test-cuda-lane-fallback stall      MPLANE_FAKE_CUDA_LANE=stall:N: the kernel stops mid-burst,
 *                                      one op claimed and never run
 *   test-cuda-lane-fallback stallfull  the same with 3000 ops queued without a wait: the ring fills
 *                                      (1024 slots) behind the stopped kernel
 *   test-cuda-lane-fallback held       an application kernel holds every SM until it sees the
 *                                      lane's signal write: without the fallback, a deadlock */
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/cuda.h"
#include "common/log.h"

static int (*launches)(void);
static void (*hold_sms)(int);
static const char *scenario;
static uint64_t stall_ms;
static int warns_lane; /* WARNs about the lane kernel's fallback */

static void capture(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags, (void)file, (void)line;
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level != NCCL_LOG_WARN) return;
  fprintf(stderr, "WARN %s\n", msg);
  if (strstr(msg, "lane kernel") && strstr(msg, "go through stream ops")) __atomic_add_fetch(&warns_lane, 1, __ATOMIC_RELAXED);
}

static uint64_t now_ms(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000 + (uint64_t)t.tv_nsec / 1000000;
}

static int setup(void **state) {
  (void)state;
  mplane_log_set_logger(capture);
  const char *lib = getenv("MPLANE_CUDA_LIB"), *ms = getenv("MPLANE_GIN_LANE_STALL_MS");
  void *h = lib ? dlopen(lib, RTLD_NOW) : NULL; /* the same library the shim opens */
  if (!h || !ms || mplane_cuda_load(NULL, 0) < 2) return -1;
  stall_ms = strtoull(ms, NULL, 10);
  *(void **)&launches = dlsym(h, "fake_cuda_kernel_launches");
  *(void **)&hold_sms = dlsym(h, "fake_cuda_hold_sms");
  return launches && hold_sms ? 0 : -1;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed * 131u + i * 7u);
}

struct burst {
  int gpu;
  size_t chunk;
  int chunks;
  unsigned char *h, *back, *g;
  uint64_t *word, shadow;
};

static void burst_init(struct burst *b, int gpu, size_t chunk, int chunks) {
  *b = (struct burst){.gpu = gpu, .chunk = chunk, .chunks = chunks};
  size_t n = chunk * (size_t)chunks;
  b->h = mplane_cuda_host_alloc(gpu, n), b->back = mplane_cuda_host_alloc(gpu, n);
  b->g = mplane_cuda_alloc(gpu, n), b->word = mplane_cuda_alloc(gpu, 8);
  assert_non_null(b->h), assert_non_null(b->back), assert_non_null(b->g), assert_non_null(b->word);
  assert_int_equal(mplane_cuda_memset(gpu, b->word, 0, 8), 0);
}

/* Chunks into GPU memory, each followed by a signal add (NCCL's putSignal), then all back out in
 * one copy; returns how long until that last copy completed, in ms. Bytes and signal checked. */
static uint64_t burst_run(struct burst *b, unsigned seed) {
  size_t n = b->chunk * (size_t)b->chunks;
  uint64_t now = 0, got = 0, t0 = now_ms();
  fill(b->h, n, seed);
  memset(b->back, 0, n);
  for (int i = 0; i < b->chunks; i++) {
    assert_true(mplane_cuda_copy_async(b->gpu, b->g + i * b->chunk, b->h + i * b->chunk, b->chunk, 1) > 0);
    assert_int_equal(mplane_cuda_signal_add_owned(b->gpu, b->word, &b->shadow, 1, &now), 0);
  }
  uint64_t out = mplane_cuda_copy_async(b->gpu, b->back, b->g, n, 0);
  assert_true(out > 0);
  assert_int_equal(mplane_cuda_signal_flush(), 0);
  assert_int_equal(mplane_cuda_lane_wait(b->gpu, out, 30000), 0);
  uint64_t took = now_ms() - t0;
  assert_memory_equal(b->back, b->h, n);
  assert_int_equal(mplane_cuda_memcpy_dtoh_nb(b->gpu, &got, b->word, 8), 0);
  assert_int_equal(got, b->shadow);
  return took;
}

/* The bound: the fallback comes after stall_ms without progress, and the replay is quick. */
static void assert_within_bound(uint64_t took, const char *what) {
  fprintf(stderr, "%s: %llu ms (MPLANE_GIN_LANE_STALL_MS=%llu)\n", what, (unsigned long long)took,
          (unsigned long long)stall_ms);
  assert_true(took <= stall_ms + 3000); /* the replay is quick; the slack is for a loaded machine */
}

/* Two GPUs: each lane falls back once, one WARN in all; later bursts run on stream ops, fast. */
static void test_fallback_two_gpus(void **state) {
  (void)state;
  struct burst b[2];
  for (int gpu = 0; gpu < 2; gpu++) {
    burst_init(&b[gpu], gpu, 4096, 24);
    uint64_t took = burst_run(&b[gpu], 1 + (unsigned)gpu);
    assert_within_bound(took, "first burst, through the fallback");
    if (!strcmp(scenario, "nostart")) assert_true(took >= stall_ms); /* the kernel had its chance */
    assert_int_equal(mplane_cuda_lane_kernel(gpu), 0);
  }
  int before = launches();
  for (int gpu = 0; gpu < 2; gpu++)
    for (unsigned r = 0; r < 3; r++) assert_true(burst_run(&b[gpu], 10 + r) < stall_ms);
  assert_int_equal(launches(), before); /* stream ops: no kernel launched again */
  assert_int_equal(warns_lane, 1);
}

/* 3000 signal writes without a wait behind a kernel stopped after a few: the ring fills, the ops
 * waiting for room go the stream way after the fallback, none lost, none twice. */
static void test_fallback_ring_full(void **state) {
  (void)state;
  uint64_t *word = mplane_cuda_alloc(0, 8), shadow = 0, now = 0, got = 0, t0 = now_ms();
  assert_int_equal(mplane_cuda_memset(0, word, 0, 8), 0);
  for (int i = 0; i < 3000; i++) assert_int_equal(mplane_cuda_signal_add_owned(0, word, &shadow, 1, &now), 0);
  assert_int_equal(mplane_cuda_lane_wait(0, mplane_cuda_lane_issued(0), 30000), 0);
  assert_within_bound(now_ms() - t0, "3000 signals behind a stopped kernel");
  assert_int_equal(mplane_cuda_memcpy_dtoh_nb(0, &got, word, 8), 0);
  assert_int_equal(got, 3000);
  assert_int_equal(mplane_cuda_lane_kernel(0), 0);
  assert_int_equal(warns_lane, 1);
}

/* The application's kernel: holds every SM until the lane's signal reaches `want`. */
struct app {
  uint64_t *word, want, seen;
};

static void *app_kernel(void *arg) {
  struct app *a = arg;
  uint64_t t0 = now_ms();
  while (a->seen < a->want && now_ms() - t0 < 30000) {
    mplane_cuda_memcpy_dtoh(0, &a->seen, a->word, 8);
    usleep(1000);
  }
  hold_sms(0);
  return NULL;
}

/* The deadlock the fallback exists for: the lane kernel cannot start until the application's kernel
 * ends, which waits for the lane's writes. They reach it through the fallback; the lane kernel that
 * starts at last runs nothing (its ops were taken back), so nothing is written twice or late. */
static void test_fallback_app_holds_sms(void **state) {
  (void)state;
  struct burst b;
  burst_init(&b, 0, 4096, 16);
  struct app a = {.word = b.word, .want = 16};
  hold_sms(1);
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, app_kernel, &a), 0);
  uint64_t took = burst_run(&b, 7);
  pthread_join(t, NULL);
  assert_int_equal(a.seen, 16);
  assert_within_bound(took, "burst while the application holds every SM");
  assert_int_equal(launches(), 1);
  usleep(50000); /* the lane kernel starts now that SMs are free, and must leave everything alone */
  uint64_t got = 0;
  memset(b.back, 0, 16 * 4096);
  assert_int_equal(mplane_cuda_memcpy_dtoh_nb(0, b.back, b.g, 16 * 4096), 0);
  assert_memory_equal(b.back, b.h, 16 * 4096);
  assert_int_equal(mplane_cuda_memcpy_dtoh_nb(0, &got, b.word, 8), 0);
  assert_int_equal(got, 16);
  assert_true(burst_run(&b, 8) < stall_ms);
  assert_int_equal(warns_lane, 1);
}

int main(int argc, char **argv) {
  scenario = argc > 1 ? argv[1] : "";
  const struct CMUnitTest two[] = {cmocka_unit_test(test_fallback_two_gpus)};
  const struct CMUnitTest full[] = {cmocka_unit_test(test_fallback_ring_full)};
  const struct CMUnitTest held[] = {cmocka_unit_test(test_fallback_app_holds_sms)};
  if (!strcmp(scenario, "nostart") || !strcmp(scenario, "stall")) return cmocka_run_group_tests(two, setup, NULL);
  if (!strcmp(scenario, "stallfull")) return cmocka_run_group_tests(full, setup, NULL);
  if (!strcmp(scenario, "held")) return cmocka_run_group_tests(held, setup, NULL);
  fprintf(stderr, "usage: test-cuda-lane-fallback nostart|stall|stallfull|held\n");
  return 2;
}
