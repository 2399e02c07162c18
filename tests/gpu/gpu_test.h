/* mplane GPU tests: what relay_copy and relay_copier share: CHECK, a clock, a median, and the CUDA runtime's
 * cudaMemcpyPeerAsync as a baseline, opened with dlopen (the tests link no CUDA, as the plugin links
 * none). Header-only: each test is one file plus the plugin's sources, built without meson where
 * hwloc and cmocka are absent. A test defines GPU_TEST_NAME (its name in FAIL lines) first. */
#ifndef MPLANE_TESTS_GPU_TEST_H
#define MPLANE_TESTS_GPU_TEST_H

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define CHECK(cond, ...)                              \
  do {                                                \
    if (!(cond)) {                                    \
      fprintf(stderr, GPU_TEST_NAME ": FAIL: ");      \
      fprintf(stderr, __VA_ARGS__);                   \
      fprintf(stderr, "\n");                          \
      exit(1);                                        \
    }                                                 \
  } while (0)

static inline double gpu_test_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* The median of t[0..n) (sorts t). */
static inline double gpu_test_median(double *t, int n) {
  for (int i = 1; i < n; i++)
    for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
      double x = t[j];
      t[j] = t[j - 1];
      t[j - 1] = x;
    }
  return n % 2 ? t[n / 2] : (t[n / 2 - 1] + t[n / 2]) / 2;
}

struct cudart {
  void *lib;
  const char *name; /* the library that opened */
  int (*setDevice)(int);
  int (*streamCreate)(void **, unsigned);
  int (*peerAsync)(void *, int, const void *, int, size_t, void *);
  int (*streamSync)(void *);
  void *stream; /* non-blocking (cudaStreamNonBlocking), on the GPU given to cudart_open */
};

/* 0: the runtime is open (MPLANE_CUDART_LIB first, then the usual names) with a stream on gpu. -1:
 * none, or it lacks a call; c->lib stays set when it opened but failed, for the caller to close. */
static inline int cudart_open(struct cudart *c, int gpu) {
  const char *names[] = {getenv("MPLANE_CUDART_LIB"), "libcudart.so", "libcudart.so.13", "libcudart.so.12",
                         "/usr/local/cuda/lib64/libcudart.so"};
  memset(c, 0, sizeof(*c));
  for (size_t i = 0; i < sizeof(names) / sizeof(names[0]) && !c->lib; i++)
    if (names[i] && *names[i] && (c->lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL))) c->name = names[i];
  if (!c->lib) return -1;
  *(void **)&c->setDevice = dlsym(c->lib, "cudaSetDevice");
  *(void **)&c->streamCreate = dlsym(c->lib, "cudaStreamCreateWithFlags");
  *(void **)&c->peerAsync = dlsym(c->lib, "cudaMemcpyPeerAsync");
  *(void **)&c->streamSync = dlsym(c->lib, "cudaStreamSynchronize");
  if (!c->setDevice || !c->streamCreate || !c->peerAsync || !c->streamSync) return -1;
  return c->setDevice(gpu) == 0 && c->streamCreate(&c->stream, 1) == 0 ? 0 : -1;
}

#endif
