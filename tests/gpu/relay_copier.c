/* mplane GPU test: the relay's copier (net/relay_copier.c, CUDA path) driven the way the IB staging
 * ring drives it (net/ib/ib_stage.c), on real GPUs.
 *
 *   relay_copier [--iters K] [--min-ratio R] [--min-gbps G] [--max-bytes N]
 *
 * The copier is created for a buffer on GPU 0 with the PCI bus id of the staging GPU (GPU 1 when
 * there are two or more, else GPU 0 itself), and its staging memory is cut into a ring of 4 slots
 * of 4 MiB (MPIB_STAGE_SLOTS, MPIB_STAGE_SLOT_BYTES; MPLANE_TEST_RELAY_SLOT_BYTES changes the slot
 * size as it does for the IB transport). Messages of 4 KiB .. 256 MiB are cut into pieces as
 * ib_stage.c cuts them (never across a wire chunk of 2 QPs, never more than a slot), up to 4 copies
 * in flight, the oldest polled first from one thread, as the proxy thread polls; small messages
 * go in bursts so several are in flight at once.
 *
 * Bytes: every landed slot is copied back with the CUDA driver and compared with what its piece must
 * hold. The source is refilled before each checked pass with a pattern of (pass, position), so a
 * slot reported done before its copy landed still holds an earlier piece's bytes and fails.
 * Rate: GB/s of the copier through the ring beside cudaMemcpyPeerAsync (libcudart, dlopened;
 * cuMemcpyPeerAsync of the driver when there is no runtime) of the same bytes from the same source
 * into the same staging memory, one copy per message, medians of K iterations, in the same run.
 * Refusal: a host-memory source must make mplane_relay_copier_create fail with a WARN naming it.
 *
 * Exit 0: bytes right, refusal right, and at every size >= 16 MiB: with two GPUs the copier >= R x
 * cudaMemcpyPeer; with one GPU (the copy stays inside one GPU's memory, at a rate no NIC drains)
 * the copier >= --min-gbps G (default 100 GB/s, twice what a 400 Gb/s NIC carries), the ratio
 * printed for information.
 * 1: a check failed. 2: bad arguments. 77: no CUDA driver or no GPU (meson's "skipped").
 * No kernel is launched; nothing here links CUDA.
 *
 * Builds without meson where hwloc/cmocka are absent (the GPU machine):
 *   gcc -O2 -D_GNU_SOURCE -I. tests/gpu/relay_copier.c net/relay_copier.c net/relay.c common/log.c common/config.c common/tc_map.c -ldl -lpthread -o relay_copier */
#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#define GPU_TEST_NAME "relay_copier"
#include "gpu_test.h"
#include "common/cuda.h"
#include "net/relay.h"

#define RING_SLOTS 4                  /* MPIB_STAGE_SLOTS (net/ib/ib.h) */
#define RING_SLOT_BYTES (4u << 20)    /* MPIB_STAGE_SLOT_BYTES */
#define WIRE_QPS 2                    /* MPLANE_IB_QPS's default: a message is at most 2 wire chunks */
#define WIRE_CHUNK_MIN (64u << 10)    /* MPIB_CHUNK_MIN: smaller messages are one chunk */
#define BURST_BYTES (16u << 20)       /* small messages go in bursts of about this many bytes */
#define BURST_MAX 256                 /* at most this many messages per burst */
#define RATED_BYTES (16u << 20)       /* the rate is judged from this size up */
#define BURST_TIMEOUT_S 10.0          /* a burst that has not landed by then is a failure, not a hang */



/* ---------------------------------------------------------------- WARNs, captured */

/* The plugin's WARNs come here (as they would go to NCCL's logger), so a test can read the last. */
static char last_warn[1024];

static void capture_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line,
                           const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof(msg), fmt, ap);
  va_end(ap);
  if (level != NCCL_LOG_WARN) return;
  snprintf(last_warn, sizeof(last_warn), "%s", msg);
  fprintf(stderr, "%s WARN %s\n", file, msg);
}

/* ---------------------------------------------------------------- the ring, as ib_stage.c drives it */

struct ring_slot {
  int busy;
  uint64_t ticket;
  size_t src_off, len; /* the piece: bytes [src_off, src_off + len) of the source */
};

struct ring {
  struct mplane_relay_copier *copier;
  char *mem; /* staging memory: the ring is its first RING_SLOTS slots */
  int gpu;
  size_t slot_bytes;
  struct ring_slot s[RING_SLOTS];
  uint64_t fill, post; /* next slot to fill, next to land (monotonic; slot j is s[j % RING_SLOTS]) */
};

/* The wire chunk of a message of size bytes (net/ib/ib_data.c): 2 chunks from 64 KiB up, 4 KiB aligned. */
static size_t wire_chunk(size_t size) {
  if (size <= WIRE_CHUNK_MIN) return size;
  size_t nch = (size + WIRE_CHUNK_MIN - 1) / WIRE_CHUNK_MIN;
  if (nch > WIRE_QPS) nch = WIRE_QPS;
  size_t per = (size + nch - 1) / nch;
  return (per + 4095) & ~(size_t)4095;
}

/* A landed slot against the host copy of the source: the first wrong byte fails the test. */
static void verify_slot(struct ring *r, unsigned idx, const uint8_t *expect, uint8_t *scratch, const char *what) {
  struct ring_slot *s = &r->s[idx];
  char *slot = r->mem + (size_t)idx * r->slot_bytes;
  CHECK(mplane_cuda_memcpy_dtoh(r->gpu, scratch, slot, s->len) == 0, "copying slot %u (%zu bytes) back", idx, s->len);
  if (memcmp(scratch, expect + s->src_off, s->len) == 0) return;
  size_t i = 0;
  while (scratch[i] == expect[s->src_off + i]) i++;
  CHECK(0, "%s: slot %u holds a wrong byte at %zu of its %zu-byte piece (source offset %zu): 0x%02x, expected "
        "0x%02x (a stale slot or a misplaced copy)", what, idx, i, s->len, s->src_off, scratch[i],
        expect[s->src_off + i]);
}

/* Land slots in ring order: a slot is sent only after every earlier one (a chunk's write with
 * immediate follows its pieces on the QP). Here a landed slot is free again at once, as if the
 * NIC had sent it; with expect, its bytes are checked first. */
static void land(struct ring *r, const uint8_t *expect, uint8_t *scratch, const char *what) {
  while (r->post < r->fill) {
    unsigned idx = (unsigned)(r->post % RING_SLOTS);
    int done = 0;
    ncclResult_t res = mplane_relay_copier_poll(r->copier, r->s[idx].ticket, &done);
    CHECK(res == ncclSuccess, "%s: polling the copy into slot %u failed (%d)", what, idx, res);
    if (!done) return;
    if (expect) verify_slot(r, idx, expect, scratch, what);
    r->s[idx].busy = 0;
    r->post++;
  }
}

/* Stage nmsg messages of size bytes, message m from src_off + m * size of the source, through the
 * ring; returns the seconds it took. expect (the source's bytes on the host) checks every slot. */
static double stage(struct ring *r, const char *src, size_t src_off, size_t size, int nmsg, const uint8_t *expect,
                    uint8_t *scratch, const char *what) {
  size_t per = wire_chunk(size);
  size_t started = 0; /* of message m */
  int m = 0;
  double t0 = gpu_test_now();
  while (m < nmsg || r->post < r->fill) {
    CHECK(gpu_test_now() - t0 < BURST_TIMEOUT_S, "%s: copies did not land within %.0f s (%llu of %llu slots landed)", what,
          BURST_TIMEOUT_S, (unsigned long long)r->post, (unsigned long long)r->fill);
    land(r, expect, scratch, what);
    while (m < nmsg && !r->s[r->fill % RING_SLOTS].busy) {
      unsigned idx = (unsigned)(r->fill % RING_SLOTS);
      size_t cend = (started / per + 1) * per < size ? (started / per + 1) * per : size;
      size_t len = cend - started < r->slot_bytes ? cend - started : r->slot_bytes;
      size_t off = src_off + (size_t)m * size + started;
      uint64_t ticket = 0;
      ncclResult_t res = mplane_relay_copier_start(r->copier, r->mem + (size_t)idx * r->slot_bytes, src + off, len,
                                                   &ticket);
      CHECK(res == ncclSuccess, "%s: starting a %zu-byte copy into slot %u failed (%d)", what, len, idx, res);
      if (!ticket) break; /* the copier is full: land something first */
      r->s[idx] = (struct ring_slot){.busy = 1, .ticket = ticket, .src_off = off, .len = len};
      r->fill++;
      started += len;
      if (started == size) m++, started = 0;
    }
  }
  return gpu_test_now() - t0;
}

/* ---------------------------------------------------------------- the baseline: cudaMemcpyPeer */

struct baseline {
  struct cudart rt; /* rt.lib NULL: the driver's cuMemcpyPeerAsync through a relay engine */
  const char *name;
  struct mplane_relay_engine *engine;
  int src_gpu, dst_gpu;
};

static void baseline_open(struct baseline *b, int src_gpu, int dst_gpu) {
  memset(b, 0, sizeof(*b));
  b->src_gpu = src_gpu;
  b->dst_gpu = dst_gpu;
  /* its stream non-blocking, like the copier's own */
  if (cudart_open(&b->rt, src_gpu) == 0) {
    b->name = b->rt.name;
    return;
  }
  if (b->rt.lib) dlclose(b->rt.lib);
  b->rt.lib = NULL;
  b->name = "the driver's cuMemcpyPeerAsync (no CUDA runtime found; MPLANE_CUDART_LIB names one)";
  CHECK(mplane_relay_engine_create(src_gpu, dst_gpu, 0, 0, &b->engine) == ncclSuccess,
        "a relay engine for the driver baseline, GPU %d -> GPU %d", src_gpu, dst_gpu);
}

static void baseline_copy(struct baseline *b, void *dst, const void *src, size_t bytes) {
  if (b->rt.lib)
    CHECK(b->rt.peerAsync(dst, b->dst_gpu, src, b->src_gpu, bytes, b->rt.stream) == 0,
          "cudaMemcpyPeerAsync of %zu bytes", bytes);
  else
    CHECK(mplane_relay_plain_copy(b->engine, dst, src, bytes) == ncclSuccess, "cuMemcpyPeerAsync of %zu bytes", bytes);
}

/* The same messages as stage(): one peer copy each, into the slot the ring used for it (small
 * messages) or the staging memory from its start (a message larger than a slot), back to back on
 * one stream, then one synchronisation; returns the seconds it took. */
static double baseline_burst(struct baseline *b, const struct ring *r, const char *src, size_t size, int nmsg) {
  double t0 = gpu_test_now();
  for (int m = 0; m < nmsg; m++) {
    char *dst = size <= r->slot_bytes ? r->mem + (size_t)(m % RING_SLOTS) * r->slot_bytes : r->mem;
    baseline_copy(b, dst, src + (size_t)m * size, size);
  }
  if (b->rt.lib) CHECK(b->rt.streamSync(b->rt.stream) == 0, "cudaStreamSynchronize");
  else CHECK(mplane_relay_engine_sync(b->engine) == ncclSuccess, "cuStreamSynchronize");
  return gpu_test_now() - t0;
}

/* ---------------------------------------------------------------- patterns and statistics */

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser: every bit of x moves every output bit */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* Bytes [0, bytes) of the source on the host and on its GPU: a pattern of (pass, position). Written
 * on a stream and synchronised: a plain cuMemcpyHtoD from pageable memory may return before its
 * bytes are in place, and the copier's non-blocking stream would not wait for them. */
static void fill_source(int gpu, char *src, uint8_t *host, size_t bytes, uint64_t pass) {
  uint64_t *w = (uint64_t *)host;
  for (size_t i = 0; i < bytes / 8; i++) w[i] = mix(pass << 40 ^ i);
  for (size_t i = bytes / 8 * 8; i < bytes; i++) host[i] = (uint8_t)mix(pass << 40 ^ i);
  CHECK(mplane_cuda_memcpy_htod_nb(gpu, src, host, bytes) == 0, "writing %zu pattern bytes to GPU %d", bytes, gpu);
}

/* Poison the ring so a slot no copy wrote cannot match. The memset runs on the legacy stream,
 * which the copier's non-blocking stream does not wait for: a synchronous 1-byte read-back after it
 * makes sure it is over before the next copy starts. */
static void poison_ring(struct ring *r) {
  uint8_t b;
  CHECK(mplane_cuda_memset(r->gpu, r->mem, 0xee, r->slot_bytes * RING_SLOTS) == 0, "poisoning the ring");
  CHECK(mplane_cuda_memcpy_dtoh(r->gpu, &b, r->mem, 1) == 0 && b == 0xee, "the ring's poison did not land");
}

static int burst_of(size_t size) {
  size_t n = BURST_BYTES / size;
  return n < 1 ? 1 : n > BURST_MAX ? BURST_MAX : (int)n;
}

/* ---------------------------------------------------------------- the parts of the test */

/* A host buffer is not what the CUDA copier copies: create must refuse it, naming it. */
static void check_host_source_refused(const char *busid) {
  size_t bytes = 1u << 20;
  char *host = malloc(bytes), want[32];
  CHECK(host, "out of host memory");
  snprintf(want, sizeof(want), "%p", (void *)host);
  struct mplane_relay_copier *c = NULL;
  last_warn[0] = 0;
  fprintf(stderr, "relay_copier: a host-memory source (%s) must be refused; the WARN below is expected\n", want);
  ncclResult_t res = mplane_relay_copier_create(host, busid, &c);
  CHECK(res != ncclSuccess, "mplane_relay_copier_create accepted host memory at %s", want);
  CHECK(c == NULL, "mplane_relay_copier_create failed (%d) but handed out a copier", res);
  CHECK(strstr(last_warn, want), "the WARN for host memory does not name the pointer %s: \"%s\"", want, last_warn);
  printf("refusal: host memory at %s refused with result %d and a WARN naming it\n", want, res);
  free(host);
}

/* Every size, twice with a different pattern: each landed slot is read back and compared. Plus a
 * message of an odd size from an odd offset, so a last piece is short and unaligned. */
static void check_bytes(struct ring *r, char *src, uint8_t *host, uint8_t *scratch, size_t max_bytes, uint64_t pass) {
  char what[64];
  for (size_t size = 4096; size <= max_bytes; size *= 2) {
    int nmsg = burst_of(size);
    fill_source(0, src, host, (size_t)nmsg * size, pass);
    poison_ring(r);
    snprintf(what, sizeof(what), "bytes, %zu-byte messages, pass %llu", size, (unsigned long long)pass);
    stage(r, src, 0, size, nmsg, host, scratch, what);
    pass++;
  }
  size_t odd = r->slot_bytes + r->slot_bytes / 4 + 123;
  fill_source(0, src, host, odd + 7, pass);
  poison_ring(r);
  stage(r, src, 7, odd, 1, host, scratch, "bytes, an odd-sized message at an odd offset");
}

struct rates {
  double copier, peer;
};

static struct rates measure(struct ring *r, struct baseline *b, const char *src, size_t size, int iters, double *t) {
  int nmsg = burst_of(size);
  double gb = (double)nmsg * (double)size / 1e9;
  struct rates out;
  for (int w = 0; w < 2; w++) stage(r, src, 0, size, nmsg, NULL, NULL, "rate (warm-up)");
  for (int i = 0; i < iters; i++) t[i] = stage(r, src, 0, size, nmsg, NULL, NULL, "rate");
  out.copier = gb / gpu_test_median(t, iters);
  for (int w = 0; w < 2; w++) baseline_burst(b, r, src, size, nmsg);
  for (int i = 0; i < iters; i++) t[i] = baseline_burst(b, r, src, size, nmsg);
  out.peer = gb / gpu_test_median(t, iters);
  return out;
}

static size_t parse_size(const char *s) {
  char *end;
  double v = strtod(s, &end);
  if (*end == 'K' || *end == 'k') v *= 1024, end++;
  else if (*end == 'M' || *end == 'm') v *= 1024 * 1024, end++;
  else if (*end == 'G' || *end == 'g') v *= 1024.0 * 1024 * 1024, end++;
  return *end || v < 0 ? 0 : (size_t)v;
}

static int usage(const char *bad) {
  fprintf(stderr, "relay_copier: bad argument '%s'\nusage: relay_copier [--iters K (10..1000, default 20)] "
          "[--min-ratio R (default 0.8)] [--min-gbps G (default 100)] [--max-bytes N (4K..1G, default 256M)]\n", bad);
  return 2;
}

int main(int argc, char **argv) {
  int iters = 20;
  double min_ratio = 0.8, min_gbps = 100;
  size_t max_bytes = 256u << 20;
  for (int i = 1; i < argc; i += 2) {
    const char *v = i + 1 < argc ? argv[i + 1] : "";
    char *end;
    if (!strcmp(argv[i], "--iters")) {
      iters = (int)strtol(v, &end, 10);
      if (*end || !*v || iters < 10 || iters > 1000) return usage(v);
    } else if (!strcmp(argv[i], "--min-ratio")) {
      min_ratio = strtod(v, &end);
      if (*end || !*v || min_ratio < 0) return usage(v);
    } else if (!strcmp(argv[i], "--min-gbps")) {
      min_gbps = strtod(v, &end);
      if (*end || !*v || min_gbps < 0) return usage(v);
    } else if (!strcmp(argv[i], "--max-bytes")) {
      max_bytes = parse_size(v);
      if (max_bytes < 4096 || max_bytes > (1u << 30)) return usage(v);
    } else {
      return usage(argv[i]);
    }
  }
  setvbuf(stdout, NULL, _IOLBF, 0); /* its lines and the WARNs on stderr stay in order */
  unsetenv("MPLANE_TEST_RELAY_COPIER"); /* the CUDA copier is the subject, never the CPU stand-in */
  mplane_log_set_logger(capture_logger);

  char why[256] = "";
  int ngpu = mplane_cuda_load(why, sizeof(why));
  if (ngpu == 0) {
    printf("SKIP: no GPU: %s\n", why);
    return 77;
  }
  int stg_gpu = ngpu >= 2 ? 1 : 0;
  char busid[32] = "";
  CHECK(mplane_cuda_pci_bus_id(stg_gpu, busid, sizeof(busid)) == 0, "no PCI bus id for GPU %d", stg_gpu);
  CHECK(mplane_cuda_gpu_of_busid(busid) == stg_gpu, "bus id %s does not lead back to GPU %d", busid, stg_gpu);
  check_host_source_refused(busid);

  /* The source: room for the largest message (and a burst of small ones, and the odd one). */
  struct ring r = {.gpu = stg_gpu, .slot_bytes = mplane_relay_test_slot_bytes(RING_SLOT_BYTES)};
  size_t src_bytes = max_bytes > BURST_BYTES ? max_bytes : BURST_BYTES;
  if (src_bytes < r.slot_bytes * 2) src_bytes = r.slot_bytes * 2;
  char *src = mplane_cuda_alloc(0, src_bytes);
  CHECK(src, "cannot allocate %zu bytes on GPU 0", src_bytes);
  CHECK(mplane_relay_copier_create(src, busid, &r.copier) == ncclSuccess, "creating the copier for GPU 0's buffer, "
        "staging at %s", busid);
  /* One allocation holds the ring at its start and, for the baseline, the largest message. */
  size_t stg_bytes = r.slot_bytes * RING_SLOTS > max_bytes ? r.slot_bytes * RING_SLOTS : max_bytes;
  r.mem = mplane_relay_copier_alloc(r.copier, stg_bytes);
  CHECK(r.mem, "the copier cannot allocate %zu bytes of staging", stg_bytes);
  CHECK(mplane_cuda_pointer_device(src) == 0 && mplane_cuda_pointer_device(r.mem) == stg_gpu,
        "the source is on GPU %d and the staging on GPU %d, expected 0 and %d", mplane_cuda_pointer_device(src),
        mplane_cuda_pointer_device(r.mem), stg_gpu);
  printf("relay_copier: %d GPU(s); GPU 0 -> staging ring on GPU %d (%s): %d slots of %zu KiB; 4 KiB .. %zu MiB, "
         "median of %d iterations\n", ngpu, stg_gpu, busid, RING_SLOTS, r.slot_bytes >> 10, max_bytes >> 20, iters);

  uint8_t *host = malloc(src_bytes), *scratch = malloc(r.slot_bytes);
  double *t = calloc((size_t)iters, sizeof(double));
  CHECK(host && scratch && t, "out of host memory");
  check_bytes(&r, src, host, scratch, max_bytes, 1);
  printf("bytes: every slot of every size, patterns of passes 1 on: identical\n");

  struct baseline b;
  baseline_open(&b, 0, stg_gpu);
  printf("baseline: cudaMemcpyPeerAsync via %s, one copy per message, one stream\n", b.rt.lib ? b.name : "-");
  if (!b.rt.lib) printf("baseline: %s\n", b.name);
  printf("%12s %6s %14s %20s %7s\n", "bytes", "msgs", "copier GB/s", "cudaMemcpyPeer GB/s", "ratio");
  int slow = 0;
  for (size_t size = 4096; size <= max_bytes; size *= 2) {
    struct rates x = measure(&r, &b, src, size, iters, t);
    int judged = size >= RATED_BYTES;
    int bad = judged && (stg_gpu ? x.copier < min_ratio * x.peer : x.copier < min_gbps);
    slow |= bad;
    printf("%12zu %6d %14.1f %20.1f %7.2f%s\n", size, burst_of(size), x.copier, x.peer, x.copier / x.peer,
           bad ? (stg_gpu ? "  < min-ratio" : "  < min-gbps") : "");
  }
  check_bytes(&r, src, host, scratch, max_bytes, 1000);
  printf("bytes: every slot of every size again after the rate runs, patterns of passes 1000 on: identical\n");

  if (b.engine) mplane_relay_engine_destroy(b.engine);
  mplane_relay_copier_destroy(r.copier, r.mem);
  mplane_cuda_free(0, src);
  free(host);
  free(scratch);
  free(t);
  char rule[96];
  if (stg_gpu) snprintf(rule, sizeof(rule), "%.2f x cudaMemcpyPeer", min_ratio);
  else snprintf(rule, sizeof(rule), "%.0f GB/s (one GPU: the ratio is not judged)", min_gbps);
  if (slow) {
    printf("FAIL: the copier is below %s at some size >= %u MiB\n", rule, RATED_BYTES >> 20);
    return 1;
  }
  printf("PASS: copier bytes identical, host memory refused, copier >= %s from %u MiB up\n", rule, RATED_BYTES >> 20);
  return 0;
}
