/* mplane GPU test: the cross-plane relay copy engine (net/relay.c) on real GPUs.
 *
 *   relay_copy [--bytes N] [--chunk N] [--iters K] [--min-ratio 0.85]
 *
 * Moves a buffer from GPU 0 into the relay staging buffer on GPU 1 and back into a staging buffer
 * on GPU 0, checks every byte, and measures the relay copy (chunked cuMemcpyPeerAsync + one event
 * per chunk on the engine's own stream, polled the way the plugin's proxy thread polls) against one
 * plain peer copy of the whole buffer, in the same run, both directions. Only copy-engine calls
 * are made: no kernel is launched (the plugin has no device code at all). CUDA is opened with dlopen
 * exactly as in the plugin; nothing here links CUDA.
 *
 * Exit 0: bytes right and relay >= min-ratio x plain in both directions. 1: a check failed.
 * 77: no CUDA driver, no GPU, or fewer than 2 GPUs (meson's "skipped").
 *
 * Builds without meson where hwloc/cmocka are absent (the GPU machine):
 *   gcc -O2 -D_GNU_SOURCE -I. tests/gpu/relay_copy.c net/relay.c common/log.c common/config.c common/tc_map.c -ldl -lpthread -o relay_copy */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define GPU_TEST_NAME "relay_copy"
#include "gpu_test.h"
#include "common/cuda.h"
#include "net/relay.h"


static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024;
  return (size_t)v;
}


/* One relay copy, polled to completion; returns seconds. */
static double relay_once(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes, int staged) {
  uint64_t ticket = 0;
  double t0 = gpu_test_now();
  while (ticket == 0) {
    ncclResult_t r = staged ? mplane_relay_copy_start(e, 0, src, bytes, &ticket)
                            : mplane_relay_copy_start_ptr(e, dst, src, bytes, &ticket);
    CHECK(r == ncclSuccess, "relay copy start failed (%d)", r);
  }
  size_t ready = 0, last = 0;
  int done = 0;
  while (!done) {
    CHECK(mplane_relay_copy_poll(e, ticket, &ready, &done) == ncclSuccess, "relay copy poll failed");
    CHECK(ready >= last && ready <= bytes, "ready went from %zu to %zu (of %zu)", last, ready, bytes);
    last = ready;
  }
  CHECK(ready == bytes, "copy done with %zu of %zu bytes ready", ready, bytes);
  return gpu_test_now() - t0;
}

static double plain_once(struct mplane_relay_engine *e, void *dst, const void *src, size_t bytes) {
  double t0 = gpu_test_now();
  CHECK(mplane_relay_plain_copy(e, dst, src, bytes) == ncclSuccess, "plain cuMemcpyPeerAsync failed");
  CHECK(mplane_relay_engine_sync(e) == ncclSuccess, "stream sync failed");
  return gpu_test_now() - t0;
}

/* cudaMemcpyPeerAsync itself, when a CUDA runtime can be opened (same primary contexts): gpu_test.h. */

static double cudart_once(struct cudart *c, void *dst, int dg, const void *src, int sg, size_t bytes) {
  double t0 = gpu_test_now();
  CHECK(c->peerAsync(dst, dg, src, sg, bytes, c->stream) == 0, "cudaMemcpyPeerAsync failed");
  CHECK(c->streamSync(c->stream) == 0, "cudaStreamSynchronize failed");
  return gpu_test_now() - t0;
}

static double best(double *t, int n) {
  double b = t[0];
  for (int i = 1; i < n; i++) b = t[i] < b ? t[i] : b;
  return b;
}

int main(int argc, char **argv) {
  size_t bytes = 256u << 20, chunk = 0;
  int iters = 20;
  double min_ratio = 0.85;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!strcmp(argv[i], "--bytes")) bytes = parse_size(argv[i + 1]);
    else if (!strcmp(argv[i], "--chunk")) chunk = parse_size(argv[i + 1]);
    else if (!strcmp(argv[i], "--iters")) iters = atoi(argv[i + 1]);
    else if (!strcmp(argv[i], "--min-ratio")) min_ratio = atof(argv[i + 1]);
    else {
      fprintf(stderr, "usage: relay_copy [--bytes N] [--chunk N] [--iters K] [--min-ratio R]\n");
      return 2;
    }
  }
  if (iters < 1 || iters > 1000) iters = 20;
  char why[256] = "";
  int ngpu = mplane_cuda_load(why, sizeof(why));
  if (ngpu == 0) {
    printf("SKIP: no GPU: %s\n", why);
    return 77;
  }
  if (ngpu < 2) {
    printf("SKIP: the relay copy needs 2 GPUs, this machine has %d\n", ngpu);
    return 77;
  }
  char bus0[32] = "?", bus1[32] = "?";
  mplane_cuda_pci_bus_id(0, bus0, sizeof(bus0));
  mplane_cuda_pci_bus_id(1, bus1, sizeof(bus1));
  printf("relay_copy: %d GPUs; GPU 0 (%s) -> relay staging on GPU 1 (%s) and back; %zu MiB, %d iterations\n", ngpu,
         bus0, bus1, bytes >> 20, iters);

  /* GPU 0 -> staging on GPU 1 (the relay direction), and GPU 1 -> staging on GPU 0 (back). */
  struct mplane_relay_engine *fwd = NULL, *back = NULL;
  CHECK(mplane_relay_engine_create(0, 1, bytes, chunk, &fwd) == ncclSuccess, "engine GPU 0 -> GPU 1");
  CHECK(mplane_relay_engine_create(1, 0, bytes, chunk, &back) == ncclSuccess, "engine GPU 1 -> GPU 0");
  void *src = mplane_cuda_alloc(0, bytes);
  CHECK(src, "cannot allocate %zu bytes on GPU 0", bytes);
  void *stage1 = mplane_relay_engine_staging(fwd), *stage0 = mplane_relay_engine_staging(back);
  size_t chunk_used = chunk ? chunk : MPLANE_RELAY_CHUNK_DEFAULT;
  printf("staging: %p on GPU 1, %p on GPU 0; chunk %zu MiB (%zu chunks per copy)\n", stage1, stage0,
         chunk_used >> 20, (bytes + chunk_used - 1) / chunk_used);
  CHECK(mplane_cuda_pointer_device(src) == 0 && mplane_cuda_pointer_device(stage1) == 1 &&
            mplane_cuda_pointer_device(stage0) == 0 && mplane_cuda_pointer_device(&bytes) == -1,
        "pointer attributes do not give the expected GPUs");

  /* ---- bytes: host pattern -> GPU 0 -> (relay) GPU 1 staging -> (relay) GPU 0 staging -> host ---- */
  uint64_t *host = malloc(bytes), *back_host = malloc(bytes);
  CHECK(host && back_host, "out of host memory");
  for (size_t i = 0; i < bytes / 8; i++) host[i] = (i * 0x9e3779b97f4a7c15ull) ^ (i >> 7);
  CHECK(mplane_cuda_memcpy_htod(0, src, host, bytes) == 0, "HtoD");
  CHECK(mplane_cuda_memset(1, stage1, 0xa5, bytes) == 0 && mplane_cuda_memset(0, stage0, 0x5a, bytes) == 0, "memset");
  relay_once(fwd, NULL, src, bytes, 1);
  relay_once(back, NULL, stage1, bytes, 1);
  CHECK(mplane_cuda_memcpy_dtoh(1, back_host, stage1, bytes) == 0, "DtoH staging 1");
  CHECK(memcmp(host, back_host, bytes) == 0, "staging on GPU 1 differs from the GPU 0 source");
  CHECK(mplane_cuda_memcpy_dtoh(0, back_host, stage0, bytes) == 0, "DtoH staging 0");
  CHECK(memcmp(host, back_host, bytes) == 0, "the round trip GPU 0 -> GPU 1 -> GPU 0 changed bytes");
  /* An odd size and offset: the last chunk is partial. */
  size_t odd = bytes - 4093;
  relay_once(fwd, NULL, (char *)src + 3, odd, 1);
  CHECK(mplane_cuda_memcpy_dtoh(1, back_host, stage1, odd) == 0, "DtoH odd");
  CHECK(memcmp((char *)host + 3, back_host, odd) == 0, "odd-sized relay copy differs");
  printf("bytes: GPU 0 -> GPU 1 staging -> GPU 0 staging, %zu bytes, and an odd %zu-byte copy: identical\n", bytes,
         odd);

  /* ---- bandwidth, same run: relay engine vs one plain peer copy, both directions ---- */
  struct cudart rt;
  int have_rt = cudart_open(&rt, 0) == 0;
  double *t = calloc((size_t)iters, sizeof(double));
  int ok = 1;
  for (int dir = 0; dir < 2; dir++) {
    struct mplane_relay_engine *e = dir ? back : fwd;
    void *from = dir ? stage1 : src, *to = dir ? stage0 : stage1;
    int fg = dir ? 1 : 0, tg = dir ? 0 : 1;
    for (int w = 0; w < 3; w++) relay_once(e, NULL, from, bytes, 1), plain_once(e, to, from, bytes);
    double relay_med, plain_med, rt_med = 0, relay_best, plain_best;
    for (int i = 0; i < iters; i++) t[i] = relay_once(e, NULL, from, bytes, 1);
    relay_best = best(t, iters);
    relay_med = gpu_test_median(t, iters);
    for (int i = 0; i < iters; i++) t[i] = plain_once(e, to, from, bytes);
    plain_best = best(t, iters);
    plain_med = gpu_test_median(t, iters);
    if (have_rt) {
      for (int w = 0; w < 3; w++) cudart_once(&rt, to, tg, from, fg, bytes);
      for (int i = 0; i < iters; i++) t[i] = cudart_once(&rt, to, tg, from, fg, bytes);
      rt_med = gpu_test_median(t, iters);
    }
    double gb = (double)bytes / 1e9;
    double ratio = plain_med / relay_med;
    printf("GPU %d -> GPU %d: relay copy %.1f GB/s (best %.1f), plain cuMemcpyPeerAsync %.1f GB/s (best %.1f)", fg,
           tg, gb / relay_med, gb / relay_best, gb / plain_med, gb / plain_best);
    if (have_rt) printf(", cudaMemcpyPeerAsync %.1f GB/s", gb / rt_med);
    printf(": relay reaches %.1f%% of plain\n", 100 * ratio);
    if (ratio < min_ratio) ok = 0;
  }
  if (!have_rt) printf("(no CUDA runtime library found: cudaMemcpyPeerAsync is the runtime's wrapper of the "
                       "driver's cuMemcpyPeerAsync measured above; set MPLANE_CUDART_LIB to measure it too)\n");
  mplane_cuda_free(0, src);
  mplane_relay_engine_destroy(fwd);
  mplane_relay_engine_destroy(back);
  free(host);
  free(back_host);
  free(t);
  if (!ok) {
    printf("FAIL: the relay copy is below %.0f%% of a plain peer copy\n", 100 * min_ratio);
    return 1;
  }
  printf("PASS: relay copy bytes identical, bandwidth >= %.0f%% of plain peer copy, copy engines only (no kernel)\n",
         100 * min_ratio);
  return 0;
}
