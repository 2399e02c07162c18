/* The GPU lane in kernel mode (MPLANE_GIN_LANE=kernel, common/cuda_lane.c) against the CUDA
 * stand-in, whose lane kernel runs the ring's protocol on a stream thread: copies in both
 * directions land byte for byte, a signal written after a copy is never seen before the copy's
 * bytes, a copy too big for the kernel goes through the copy engine and stays in order, the ring
 * wraps, and a kernel that exited idle is launched again for the next op. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "common/cuda.h"

static int (*launches)(void);

static int setup(void **state) {
  (void)state;
  const char *lib = getenv("MPLANE_CUDA_LIB");
  void *h = lib ? dlopen(lib, RTLD_NOW) : NULL; /* the same library the shim opens */
  if (!h || mplane_cuda_load(NULL, 0) < 1) return -1;
  *(void **)&launches = dlsym(h, "fake_cuda_kernel_launches");
  return launches ? 0 : -1;
}

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(seed * 131u + i * 7u);
}

/* To GPU memory and back, small (the kernel copies) and big (the copy engine), then a signal. */
static void round_trip(size_t n, unsigned seed) {
  unsigned char *h = mplane_cuda_host_alloc(0, n), *back = mplane_cuda_host_alloc(0, n);
  void *g = mplane_cuda_alloc(0, n);
  uint64_t *word = mplane_cuda_alloc(0, 8), shadow = 0, now = 0, got = 0;
  assert_non_null(h), assert_non_null(back), assert_non_null(g), assert_non_null(word);
  assert_int_equal(mplane_cuda_memset(0, word, 0, 8), 0);
  fill(h, n, seed);
  memset(back, 0, n);
  uint64_t in = mplane_cuda_copy_async(0, g, h, n, 1);
  assert_true(in > 0);
  assert_int_equal(mplane_cuda_signal_add_owned(0, word, &shadow, 5, &now), 0);
  assert_int_equal(now, 5);
  uint64_t out = mplane_cuda_copy_async(0, back, g, n, 0);
  assert_true(out > in);
  assert_int_equal(mplane_cuda_lane_wait(0, out, 10000), 0);
  assert_true(mplane_cuda_lane_done(0) >= out);
  assert_memory_equal(back, h, n);
  assert_int_equal(mplane_cuda_memcpy_dtoh_nb(0, &got, word, 8), 0); /* waits for the ring first */
  assert_int_equal(got, 5);
  mplane_cuda_free(0, word);
  mplane_cuda_free(0, g);
  mplane_cuda_host_free(h);
  mplane_cuda_host_free(back);
}

static void test_small_and_big(void **state) {
  (void)state;
  int before = launches();
  round_trip(24, 1);          /* not a multiple of 16 */
  round_trip(4096, 2);        /* the kernel's 16-byte path */
  round_trip(1 << 20, 3);     /* > MPLANE_GIN_LANE_KERNEL_MAX: the copy engine, a WAIT in the ring */
  assert_true(launches() > before);
}

/* A signal must never be seen before the data queued ahead of it: poll the signal word from the
 * host (through the stand-in's synchronous copy) while a copy and its signal are in flight. */
static void test_signal_after_data(void **state) {
  (void)state;
  const size_t n = 64 << 10;
  unsigned char *h = mplane_cuda_host_alloc(0, n), *back = malloc(n);
  unsigned char *g = mplane_cuda_alloc(0, n);
  uint64_t *word = mplane_cuda_alloc(0, 8), shadow = 0, now = 0;
  assert_int_equal(mplane_cuda_memset(0, word, 0, 8), 0);
  for (unsigned r = 1; r <= 20; r++) {
    fill(h, n, r);
    assert_true(mplane_cuda_copy_async(0, g, h, n, 1) > 0);
    assert_int_equal(mplane_cuda_signal_add_owned(0, word, &shadow, 1, &now), 0);
    assert_int_equal(mplane_cuda_signal_flush(), 0);
    uint64_t seen = 0;
    for (int spins = 0; seen < r && spins < 10000000; spins++) {
      assert_int_equal(mplane_cuda_memcpy_dtoh(0, &seen, word, 8), 0);
      if (seen < r) mplane_cuda_signal_flush();
    }
    assert_int_equal(seen, r);
    assert_int_equal(mplane_cuda_memcpy_dtoh(0, back, g, n), 0);
    assert_memory_equal(back, h, n); /* the signal came after every byte */
  }
  free(back);
}

/* More ops than the ring has slots, without waiting in between: the queue waits for room. */
static void test_ring_wraps(void **state) {
  (void)state;
  uint64_t *word = mplane_cuda_alloc(0, 8), shadow = 0, now = 0, got = 0;
  assert_int_equal(mplane_cuda_memset(0, word, 0, 8), 0);
  for (int i = 0; i < 5000; i++) assert_int_equal(mplane_cuda_signal_add_owned(0, word, &shadow, 1, &now), 0);
  assert_int_equal(mplane_cuda_lane_wait(0, mplane_cuda_lane_issued(0), 10000), 0);
  assert_int_equal(mplane_cuda_memcpy_dtoh(0, &got, word, 8), 0);
  assert_int_equal(got, 5000);
}

/* After MPLANE_GIN_LANE_IDLE_US with nothing to do the kernel exits; the next op launches another. */
static void test_relaunch_after_idle(void **state) {
  (void)state;
  uint64_t *word = mplane_cuda_alloc(0, 8), shadow = 0, now = 0, got = 0;
  assert_int_equal(mplane_cuda_memset(0, word, 0, 8), 0);
  for (int i = 1; i <= 3; i++) {
    int before = launches();
    usleep(50000); /* ten times the idle time the test sets */
    assert_int_equal(mplane_cuda_signal_add_owned(0, word, &shadow, 1, &now), 0);
    assert_int_equal(mplane_cuda_lane_wait(0, mplane_cuda_lane_issued(0), 10000), 0);
    assert_int_equal(launches(), before + 1);
    assert_int_equal(mplane_cuda_memcpy_dtoh(0, &got, word, 8), 0);
    assert_int_equal(got, (uint64_t)i);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_small_and_big),
      cmocka_unit_test(test_signal_after_data),
      cmocka_unit_test(test_ring_wraps),
      cmocka_unit_test(test_relaunch_after_idle),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
