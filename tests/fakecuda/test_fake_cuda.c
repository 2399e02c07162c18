/* The CUDA stand-in, proven on its own: the plugin's GPU tests are only as good as the stand-in's
 * asynchrony and checks, so each property they rely on is tested here (fake_cuda.h has the model).
 *
 *   test-fake-cuda          the model (run with MPLANE_FAKE_CUDA_DEVICES=2)
 *   test-fake-cuda fail     fault injection (run with MPLANE_FAKE_CUDA_FAIL=copy:2)
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cmocka.h>

#include "fake_cuda.h"

#define SLOW_US 200000 /* long enough that nothing a test does in between can outlast it */

static CUcontext ctx[2];

static uint64_t now_us(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000u + (uint64_t)t.tv_nsec / 1000u;
}

/* A stream whose every op waits delay_us (the delay is read when the stream is made). */
static CUstream stream_with_delay(long delay_us, unsigned flags) {
  char v[32];
  snprintf(v, sizeof(v), "%ld", delay_us);
  setenv("MPLANE_FAKE_CUDA_DELAY_US", v, 1);
  CUstream s = NULL;
  assert_int_equal(cuStreamCreate(&s, flags), CUDA_SUCCESS);
  unsetenv("MPLANE_FAKE_CUDA_DELAY_US");
  return s;
}

static void *dev_alloc(size_t n) {
  CUdeviceptr p = 0;
  assert_int_equal(cuMemAlloc_v2(&p, n), CUDA_SUCCESS);
  assert_int_equal(cuMemsetD8_v2(p, 0, n), CUDA_SUCCESS);
  return (void *)(uintptr_t)p;
}

static CUdeviceptr dp(const void *p) { return (CUdeviceptr)(uintptr_t)p; }

static int setup(void **state) {
  int n = 0;
  assert_int_equal(cuInit(0), CUDA_SUCCESS);
  assert_int_equal(cuDeviceGetCount(&n), CUDA_SUCCESS);
  for (int d = 0; d < 2 && d < n; d++) assert_int_equal(cuDevicePrimaryCtxRetain(&ctx[d], d), CUDA_SUCCESS);
  return cuCtxSetCurrent(ctx[0]) == CUDA_SUCCESS ? 0 : -1;
}

static void test_devices(void **state) {
  int n = 0, can = -1;
  assert_int_equal(cuDeviceGetCount(&n), CUDA_SUCCESS);
  assert_int_equal(n, 2); /* MPLANE_FAKE_CUDA_DEVICES=2 */
  CUdevice d = -1;
  assert_int_equal(cuDeviceGet(&d, 1), CUDA_SUCCESS);
  assert_int_equal(d, 1);
  assert_int_equal(cuDeviceGet(&d, 2), CUDA_ERROR_INVALID_DEVICE);
  char a[32], b[32];
  assert_int_equal(cuDeviceGetPCIBusId(a, sizeof(a), 0), CUDA_SUCCESS);
  assert_int_equal(cuDeviceGetPCIBusId(b, sizeof(b), 1), CUDA_SUCCESS);
  assert_string_not_equal(a, b);
  assert_int_equal(cuDeviceCanAccessPeer(&can, 0, 1), CUDA_SUCCESS);
  assert_int_equal(can, 1);
  assert_int_equal(cuDeviceCanAccessPeer(&can, 0, 0), CUDA_SUCCESS);
  assert_int_equal(can, 0);
  assert_int_equal(cuCtxEnablePeerAccess(ctx[1], 0), CUDA_SUCCESS);
  assert_int_equal(cuCtxEnablePeerAccess(ctx[1], 0), CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED);
  const char *s = NULL;
  assert_int_equal(cuGetErrorString(CUDA_ERROR_NOT_READY, &s), CUDA_SUCCESS);
  assert_non_null(s);
  assert_int_equal(cuGetErrorString(12345, &s), CUDA_ERROR_INVALID_VALUE);
  assert_null(s);
}

static void expect_device(const void *p, int ord) {
  unsigned type = 0;
  int o = -1;
  assert_int_equal(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp(p)), CUDA_SUCCESS);
  assert_int_equal(type, CU_MEMORYTYPE_DEVICE);
  assert_int_equal(cuPointerGetAttribute(&o, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dp(p)), CUDA_SUCCESS);
  assert_int_equal(o, ord);
}

static void expect_unknown(const void *p) {
  unsigned type = 0;
  int o = -1;
  assert_int_equal(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp(p)), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuPointerGetAttribute(&o, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, dp(p)), CUDA_ERROR_INVALID_VALUE);
}

/* The plugin decides "GPU window or not" from these answers alone. */
static void test_pointer_attributes(void **state) {
  char *d0 = dev_alloc(1000);
  expect_device(d0, 0);
  expect_device(d0 + 999, 0);
  expect_unknown(d0 + 1000); /* one past the end */
  assert_int_equal(cuCtxSetCurrent(ctx[1]), CUDA_SUCCESS);
  char *d1 = dev_alloc(64);
  assert_int_equal(cuCtxSetCurrent(ctx[0]), CUDA_SUCCESS);
  expect_device(d1 + 8, 1);
  char *heap = malloc(64);
  expect_unknown(heap);
  free(heap);
  void *pinned = NULL;
  unsigned type = 0;
  assert_int_equal(cuMemHostAlloc(&pinned, 64, 0), CUDA_SUCCESS);
  assert_int_equal(cuPointerGetAttribute(&type, CU_POINTER_ATTRIBUTE_MEMORY_TYPE, dp(pinned)), CUDA_SUCCESS);
  assert_int_equal(type, CU_MEMORYTYPE_HOST);
  assert_int_equal(cuMemFreeHost(pinned), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(d0)), CUDA_SUCCESS);
  expect_unknown(d0); /* freed memory is no longer the driver's */
  assert_int_equal(cuMemFree_v2(dp(d0)), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemFree_v2(dp(d1)), CUDA_SUCCESS);
}

/* The property the plugin's GPU tests stand on: an async copy has not landed when its call returns,
 * only once the stream says so, and a synchronous copy does not wait for a non-blocking stream. */
static void test_async_copy_lands_later(void **state) {
  enum { N = 256 << 10 };
  CUstream s = stream_with_delay(SLOW_US, CU_STREAM_NON_BLOCKING);
  char *dev = dev_alloc(N), *host = malloc(N), *back = calloc(1, N), *zero = calloc(1, N);
  memset(host, 0x5a, N);
  uint64_t t0 = now_us();
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev), host, N, s), CUDA_SUCCESS);
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_NOT_READY);
  assert_memory_equal(dev, zero, N);
  assert_int_equal(cuMemcpyDtoH_v2(back, dp(dev), N), CUDA_SUCCESS);
  assert_memory_equal(back, zero, N);
  assert_int_equal(cuStreamSynchronize(s), CUDA_SUCCESS);
  assert_true(now_us() - t0 >= SLOW_US);
  assert_int_equal(cuStreamQuery(s), CUDA_SUCCESS);
  assert_memory_equal(dev, host, N);
  /* and back out: the host buffer is written only by the stream */
  assert_int_equal(cuMemcpyDtoHAsync_v2(back, dp(dev), N, s), CUDA_SUCCESS);
  assert_memory_equal(back, zero, N);
  assert_int_equal(cuStreamSynchronize(s), CUDA_SUCCESS);
  assert_memory_equal(back, host, N);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
  free(host);
  free(back);
  free(zero);
}

/* A blocking stream is drained by a synchronous copy (the legacy stream's implicit barrier). */
static void test_blocking_stream_drained_by_sync_copy(void **state) {
  CUstream s = stream_with_delay(SLOW_US / 4, CU_STREAM_DEFAULT);
  uint64_t *dev = dev_alloc(8), got = 0;
  assert_int_equal(cuStreamWriteValue64_v2(s, dp(dev), 77, 0), CUDA_SUCCESS);
  assert_int_equal(cuMemcpyDtoH_v2(&got, dp(dev), 8), CUDA_SUCCESS);
  assert_int_equal(got, 77);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
}

/* Copy then value write on one stream: whoever sees the value sees the whole copy. Many rounds are
 * queued at once, and the flag is polled while they land (through cuMemcpyDtoH, as the RMA harness
 * polls its GPU signal words). */
static void test_copy_then_write_is_ordered(void **state) {
  enum { ROUNDS = 24, N = 64 << 10 };
  CUstream s = stream_with_delay(SLOW_US / 4, CU_STREAM_NON_BLOCKING);
  char *dev = dev_alloc((size_t)ROUNDS * N), *host = malloc((size_t)ROUNDS * N);
  uint64_t *flag = dev_alloc(16);
  for (int r = 0; r < ROUNDS; r++) {
    memset(host + (size_t)r * N, r + 1, N);
    assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev + (size_t)r * N), host + (size_t)r * N, N, s), CUDA_SUCCESS);
    if (r % 2) {
      assert_int_equal(cuStreamWriteValue64_v2(s, dp(flag), (uint64_t)r + 1, 0), CUDA_SUCCESS);
    } else { /* the batched form, with a second word after it */
      CUstreamBatchMemOpParams ops[2];
      memset(ops, 0, sizeof(ops));
      ops[0].writeValue.operation = ops[1].writeValue.operation = CU_STREAM_MEM_OP_WRITE_VALUE_64;
      ops[0].writeValue.address = dp(flag);
      ops[0].writeValue.value64 = (uint64_t)r + 1;
      ops[1].writeValue.address = dp(flag + 1);
      ops[1].writeValue.value64 = 1000 + (uint64_t)r;
      assert_int_equal(cuStreamBatchMemOp_v2(s, 2, ops, 0), CUDA_SUCCESS);
      memset(ops, 0xee, sizeof(ops)); /* the driver copied the array: reusing it changes nothing */
    }
  }
  assert_true(__atomic_load_n(flag, __ATOMIC_ACQUIRE) < ROUNDS);
  uint64_t seen = 0;
  while (seen < ROUNDS) {
    uint64_t v = 0;
    assert_int_equal(cuMemcpyDtoH_v2(&v, dp(flag), 8), CUDA_SUCCESS);
    assert_true(v >= seen);
    for (uint64_t r = seen; r < v; r++) assert_memory_equal(dev + r * N, host + r * N, N);
    seen = v;
  }
  assert_int_equal(cuStreamSynchronize(s), CUDA_SUCCESS);
  assert_int_equal(flag[1], 1000 + ROUNDS - 2);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(flag)), CUDA_SUCCESS);
  free(host);
}

/* Events: done when the stream ran past the record, without a synchronize; an event destroyed
 * with its record queued is safe; one never recorded is done. */
static void test_events(void **state) {
  enum { N = 4096 };
  CUstream s = stream_with_delay(SLOW_US / 4, CU_STREAM_NON_BLOCKING);
  char *dev = dev_alloc(N), host[N];
  memset(host, 3, N);
  CUevent ev, gone;
  assert_int_equal(cuEventCreate(&ev, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  assert_int_equal(cuEventCreate(&gone, CU_EVENT_DISABLE_TIMING), CUDA_SUCCESS);
  assert_int_equal(cuEventQuery(ev), CUDA_SUCCESS);
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev), host, N, s), CUDA_SUCCESS);
  assert_int_equal(cuEventRecord(ev, s), CUDA_SUCCESS);
  assert_int_equal(cuEventRecord(gone, s), CUDA_SUCCESS);
  assert_int_equal(cuEventDestroy_v2(gone), CUDA_SUCCESS);
  /* `gone` is not queried after its destroy: once its record has run the stream frees it, so the
   * query read freed memory whenever the stream got there first (ThreadSanitizer saw the race). */
  assert_int_equal(cuEventQuery(ev), CUDA_ERROR_NOT_READY);
  while (cuEventQuery(ev) == CUDA_ERROR_NOT_READY) {
  }
  assert_int_equal(cuEventQuery(ev), CUDA_SUCCESS);
  assert_memory_equal(dev, host, N);
  assert_int_equal(cuEventDestroy_v2(ev), CUDA_SUCCESS);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
}

/* Work given to a stream is done by the time cuStreamDestroy returns; a peer copy moves bytes
 * between two devices' memory, each named with its own context. */
static void test_destroy_drains_and_peer_copy(void **state) {
  enum { N = 10000 };
  CUstream s = stream_with_delay(SLOW_US / 4, CU_STREAM_NON_BLOCKING);
  char *src = dev_alloc(N);
  assert_int_equal(cuCtxSetCurrent(ctx[1]), CUDA_SUCCESS);
  char *dst = dev_alloc(N);
  assert_int_equal(cuCtxSetCurrent(ctx[0]), CUDA_SUCCESS);
  memset(src, 9, N);
  assert_int_equal(cuMemcpyPeerAsync(dp(dst), ctx[0], dp(src), ctx[0], N, s), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemcpyPeerAsync(dp(dst), ctx[1], dp(src), ctx[0], N, s), CUDA_SUCCESS);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_memory_equal(dst, src, N);
  assert_int_equal(cuStreamQuery(s), CUDA_ERROR_INVALID_HANDLE);
  assert_int_equal(cuMemFree_v2(dp(src)), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dst)), CUDA_SUCCESS);
}

/* What the driver refuses, the stand-in refuses: a plugin bug must not pass here and fail on a GPU. */
static void test_refusals(void **state) {
  CUstream s = stream_with_delay(0, CU_STREAM_NON_BLOCKING);
  char *dev = dev_alloc(64), host[128] = {0};
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(host), host, 8, s), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev + 32), host, 64, s), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemcpyDtoH_v2(host, dp(dev), 65), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev), host, 8, (CUstream)host), CUDA_ERROR_INVALID_HANDLE);
  assert_int_equal(cuStreamWriteValue64_v2(s, dp(dev + 4), 1, 0), CUDA_ERROR_INVALID_VALUE);
  assert_int_equal(cuStreamWriteValue64_v2(s, dp(host), 1, 0), CUDA_ERROR_INVALID_VALUE);
  CUstreamBatchMemOpParams op;
  memset(&op, 0, sizeof(op));
  op.operation = 1; /* CU_STREAM_MEM_OP_WAIT_VALUE_32: not modelled */
  op.writeValue.address = dp(dev);
  assert_int_equal(cuStreamBatchMemOp_v2(s, 1, &op, 0), CUDA_ERROR_NOT_SUPPORTED);
  int fd = -1;
  assert_int_equal(cuMemGetHandleForAddressRange(&fd, dp(dev), 64, 1, 0), CUDA_ERROR_NOT_SUPPORTED);
  assert_int_equal(cuCtxSetCurrent(NULL), CUDA_SUCCESS);
  CUdeviceptr p = 0;
  assert_int_equal(cuMemAlloc_v2(&p, 64), CUDA_ERROR_INVALID_CONTEXT); /* no current context */
  assert_int_equal(cuCtxSetCurrent(ctx[0]), CUDA_SUCCESS);
  assert_int_equal(cuStreamSynchronize(s), CUDA_SUCCESS);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
}

/* MPLANE_FAKE_CUDA_FAIL=copy:2: the second async copy of the process fails at submission, and
 * only that one; the stream goes on working. */
static void test_injected_copy_failure(void **state) {
  CUstream s = stream_with_delay(0, CU_STREAM_NON_BLOCKING);
  char *dev = dev_alloc(64), host[64];
  memset(host, 1, sizeof(host));
  assert_int_equal(cuMemcpyHtoDAsync_v2(dp(dev), host, 64, s), CUDA_SUCCESS);
  assert_int_equal(cuMemcpyDtoHAsync_v2(host, dp(dev), 64, s), CUDA_ERROR_UNKNOWN);
  assert_int_equal(cuMemcpyDtoHAsync_v2(host, dp(dev), 64, s), CUDA_SUCCESS);
  assert_int_equal(cuStreamSynchronize(s), CUDA_SUCCESS);
  assert_int_equal(cuStreamDestroy_v2(s), CUDA_SUCCESS);
  assert_int_equal(cuMemFree_v2(dp(dev)), CUDA_SUCCESS);
}

int main(int argc, char **argv) {
  if (argc > 1 && !strcmp(argv[1], "fail")) {
    const struct CMUnitTest fail[] = {cmocka_unit_test(test_injected_copy_failure)};
    return cmocka_run_group_tests(fail, setup, NULL);
  }
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_devices),
      cmocka_unit_test(test_pointer_attributes),
      cmocka_unit_test(test_async_copy_lands_later),
      cmocka_unit_test(test_blocking_stream_drained_by_sync_copy),
      cmocka_unit_test(test_copy_then_write_is_ordered),
      cmocka_unit_test(test_events),
      cmocka_unit_test(test_destroy_drains_and_peer_copy),
      cmocka_unit_test(test_refusals),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}
