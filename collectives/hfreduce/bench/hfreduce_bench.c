/* mplane-hfreduce-bench: HFReduce's numbers on one host (docs/hfreduce.md, scripts/hfreduce-bench.sh).
 *
 *   mplane-hfreduce-bench reduce [--mib M] [--rounds R] [--sources S] [--dtype NAME|all] [--op sum|max|min|all]
 *       the CPU reduce rate of every dtype (S inputs folded into one output, the node's reduce-scatter
 *       step on one core) beside a STREAM triad (a = b + s * c, doubles) on arrays of the same size,
 *       alternated round by round (this host is shared: a paired baseline); GB/s of memory traffic
 *       (reduce: (S + 1) x bytes; triad: 3 x bytes), the median of the rounds; and the kernel's time
 *       per element in cache (4096 elements a source, 10 ms of the thread's CPU time, the median of the rounds).
 *       By default every dtype, sum.
 *   mplane-hfreduce-bench allreduce [--nodes N] [--per-node L] [--min 1M] [--max 512M] [--iters I]
 *                                   [--dtype bfloat16]
 *       forks N x L ranks (nodes told apart by NCCL_HOSTID, over the transport MPLANE_TRANSPORT and
 *       MPLANE_SOCKET_IFNAME choose), then one all-reduce per size, doubling: time and busbw
 *       (2 (n-1)/n x bytes / time, as nccl-tests counts it), the last call checked; --gpu 1: the
 *       buffers on GPU rank % GPUs (the CUDA driver through mplane's shim), copies on the copy engine */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/cuda.h"
#include "hfr_reduce.h"
#include "mplane_hfreduce.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof(double), cmp_double);
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

static long parse_size(const char *s) {
  char *end;
  long v = strtol(s, &end, 10);
  if (*end == 'K' || *end == 'k') v <<= 10;
  else if (*end == 'M' || *end == 'm') v <<= 20;
  else if (*end == 'G' || *end == 'g') v <<= 30;
  return v;
}

static double triad(double *a, const double *b, const double *c, size_t n) {
  double t0 = now_s();
  for (size_t i = 0; i < n; i++) a[i] = b[i] + 3.0 * c[i];
  return now_s() - t0;
}

static double thread_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ns per element of one reduce call on n elements (in cache after the first), repeated for 10 ms of
 * this thread's CPU time (a shared host's other work does not count) */
static double in_cache_ns(int isa, int dtype, int op, void *dst, void *const *src, int nsrc, size_t n) {
  long reps = 0;
  double t0 = thread_cpu_s(), t;
  do {
    for (int k = 0; k < 64; k++, reps++)
      mp_hfr_reduce_isa(isa, dtype, op, dst, (const void *const *)src, nsrc, n);
    t = thread_cpu_s() - t0;
  } while (t < 0.01);
  return t / (double)reps / (double)n * 1e9;
}

/* only_dtype -1: every dtype; only_op -1: sum, -2: every op */
static int bench_reduce(size_t mib, int rounds, int nsrc, int only_dtype, int only_op) {
  size_t bytes = mib << 20;
  double *ta = malloc(bytes), *tb = malloc(bytes), *tc = malloc(bytes);
  void *src[16], *dst = malloc(bytes);
  if (!ta || !tb || !tc || !dst || nsrc < 1 || nsrc > 16) return 1;
  for (size_t i = 0; i < bytes / 8; i++) ta[i] = 0, tb[i] = (double)i, tc[i] = 1.0;
  for (int k = 0; k < nsrc; k++) {
    src[k] = malloc(bytes);
    if (!src[k]) return 1;
    for (size_t i = 0; i < bytes / 2; i++) ((uint16_t *)src[k])[i] = (uint16_t)(0x3f80 + (i + (size_t)k) % 64);
  }
  memset(dst, 0, bytes);
  int isa = mp_hfr_isa_best();
  printf("# reduce vs triad: %zu MiB arrays, %d sources, one core, %s kernels, median of %d alternated rounds\n",
         mib, nsrc, mp_hfr_isa_name(isa), rounds);
  printf("%-10s %-6s %10s %10s %8s %12s\n", "dtype", "op", "reduce", "triad", "ratio", "in cache");
  for (int dtype = 0; dtype < MPLANE_HFREDUCE_NDTYPES; dtype++)
    for (int op = 0; op < MPLANE_HFREDUCE_NOPS; op++) {
      if ((only_dtype >= 0 && dtype != only_dtype) || (only_op != -2 && op != (only_op >= 0 ? only_op : MPLANE_HFREDUCE_SUM)))
        continue;
      size_t n = bytes / mp_hfr_dtype_size(dtype);
      double r[64], t[64], ratio[64], c[64];
      for (int k = 0; k < rounds && k < 64; k++) {
        double tt = triad(ta, tb, tc, bytes / 8);
        double t0 = now_s();
        mp_hfr_reduce_isa(isa, dtype, op, dst, (const void *const *)src, nsrc, n);
        double tr = now_s() - t0;
        t[k] = 3.0 * (double)bytes / tt / 1e9;
        r[k] = (double)(nsrc + 1) * (double)bytes / tr / 1e9;
        ratio[k] = r[k] / t[k];
        c[k] = in_cache_ns(isa, dtype, op, dst, src, nsrc, 4096);
      }
      int m = rounds < 64 ? rounds : 64;
      printf("%-10s %-6s %8.2f GB/s %6.2f GB/s %7.0f%% %7.3f ns/el\n", mp_hfr_dtype_name(dtype), mp_hfr_op_name(op),
             median(r, m), median(t, m), 100.0 * median(ratio, m), median(c, m));
    }
  fflush(stdout);
  return 0;
}

struct ar_opts {
  int nodes, per_node, iters, dtype, gpu;
  long min, max;
};

static int rank_main(int rank, int nranks, const struct ar_opts *o, const mplane_hfreduce_unique_id *id) {
  char host[32];
  snprintf(host, sizeof(host), "bench-node-%d", rank / o->per_node);
  setenv("NCCL_HOSTID", host, 1);
  mplane_hfreduce_comm_t comm;
  if (mplane_hfreduce_comm_init(&comm, nranks, id, rank) != 0) {
    fprintf(stderr, "rank %d: comm_init: %s\n", rank, mplane_hfreduce_last_error());
    return 1;
  }
  size_t es = mp_hfr_dtype_size(o->dtype);
  char *buf = malloc((size_t)o->max), *dev = NULL;
  int gpu = -1;
  if (o->gpu) {
    char why[256];
    int ngpu = mplane_cuda_load(why, sizeof(why));
    if (ngpu <= 0) {
      fprintf(stderr, "rank %d: --gpu 1: no GPU (%s)\n", rank, why);
      return 1;
    }
    gpu = rank % ngpu;
    dev = mplane_cuda_alloc(gpu, (size_t)o->max);
  }
  if (!buf || (o->gpu && !dev)) return 1;
  if (rank == 0)
    printf("# allreduce: %d ranks (%d nodes x %d), %s sum, %s buffers, best of %d iterations per size after one "
           "warm-up\n"
           "%12s %12s %12s %12s %6s\n", nranks, o->nodes, o->per_node, mp_hfr_dtype_name(o->dtype),
           o->gpu ? "GPU" : "host", o->iters,
           "bytes", "time_us", "algbw_GB/s", "busbw_GB/s", "check");
  for (long bytes = o->min; bytes <= o->max; bytes *= 2) {
    size_t n = (size_t)bytes / es;
    double best = 1e30;
    int ok = 1;
    for (int it = -1; it < o->iters; it++) {
      for (size_t i = 0; i < n; i++) mp_hfr_store_f32(o->dtype, buf, i, 1.0f); /* outside the clock */
      if (dev) mplane_cuda_memcpy_htod(gpu, dev, buf, (size_t)bytes);
      double t0 = now_s();
      if (mplane_hfreduce_allreduce(comm, dev ? dev : buf, dev ? dev : buf, n, o->dtype, MPLANE_HFREDUCE_SUM, NULL) != 0) {
        fprintf(stderr, "rank %d: allreduce: %s\n", rank, mplane_hfreduce_last_error());
        return 1;
      }
      double t = now_s() - t0;
      if (it >= 0 && t < best) best = t;
      if (dev) mplane_cuda_memcpy_dtoh(gpu, buf, dev, (size_t)bytes);
    }
    /* the sum of nranks ones, as the type holds it */
    unsigned char tmp[4];
    mp_hfr_store_f32(o->dtype, tmp, 0, (float)nranks);
    float want = mp_hfr_load_f32(o->dtype, tmp, 0);
    for (size_t i = 0; i < n; i += 997) ok &= mp_hfr_load_f32(o->dtype, buf, i) == want;
    double alg = (double)bytes / best / 1e9;
    if (rank == 0)
      printf("%12ld %12.0f %12.3f %12.3f %6s\n", bytes, best * 1e6, alg, alg * 2.0 * (nranks - 1) / nranks,
             ok ? "ok" : "WRONG");
    fflush(stdout);
    if (!ok) return 1;
  }
  mplane_hfreduce_comm_destroy(comm);
  return 0;
}

static int bench_allreduce(const struct ar_opts *o) {
  int nranks = o->nodes * o->per_node;
  mplane_hfreduce_unique_id id;
  if (mplane_hfreduce_get_unique_id(&id) != 0) {
    fprintf(stderr, "get_unique_id: %s\n", mplane_hfreduce_last_error());
    return 1;
  }
  pid_t pids[256];
  for (int r = 0; r < nranks; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = rank_main(r, nranks, o, &id);
      fflush(stdout);
      _exit(rc);
    }
  }
  int failed = 0;
  for (int r = 0; r < nranks; r++) {
    int st;
    waitpid(pids[r], &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) failed = 1;
  }
  return failed;
}

int main(int argc, char **argv) {
  if (argc < 2 || (strcmp(argv[1], "reduce") && strcmp(argv[1], "allreduce"))) {
    fprintf(stderr, "usage: %s reduce [--mib M] [--rounds R] [--sources S] [--dtype NAME|all] [--op sum|max|min|all]\n"
                    "       %s allreduce [--nodes N] [--per-node L] [--min SIZE] [--max SIZE] [--iters I] [--dtype NAME] "
                    "[--gpu 0|1]\n",
            argv[0], argv[0]);
    return 2;
  }
  size_t mib = 64;
  int rounds = 7, nsrc = 4, reduce_dtype = -1, reduce_op = -1;
  struct ar_opts o = {.nodes = 2, .per_node = 4, .iters = 3, .dtype = MPLANE_HFREDUCE_BFLOAT16, .min = 1 << 20,
                      .max = 512L << 20};
  for (int i = 2; i + 1 < argc; i += 2) {
    const char *k = argv[i], *v = argv[i + 1];
    if (!strcmp(k, "--mib")) mib = (size_t)atol(v);
    else if (!strcmp(k, "--rounds")) rounds = atoi(v);
    else if (!strcmp(k, "--sources")) nsrc = atoi(v);
    else if (!strcmp(k, "--nodes")) o.nodes = atoi(v);
    else if (!strcmp(k, "--per-node")) o.per_node = atoi(v);
    else if (!strcmp(k, "--min")) o.min = parse_size(v);
    else if (!strcmp(k, "--max")) o.max = parse_size(v);
    else if (!strcmp(k, "--iters")) o.iters = atoi(v);
    else if (!strcmp(k, "--gpu")) o.gpu = atoi(v);
    else if (!strcmp(k, "--op")) {
      reduce_op = -2; /* all */
      for (int op = 0; op < MPLANE_HFREDUCE_NOPS; op++)
        if (!strcmp(v, mp_hfr_op_name(op))) reduce_op = op;
      if (reduce_op == -2 && strcmp(v, "all")) {
        fprintf(stderr, "--op %s: expected sum, max, min or all\n", v);
        return 2;
      }
    } else if (!strcmp(k, "--dtype") && !strcmp(v, "all")) {
      reduce_dtype = -1;
    } else if (!strcmp(k, "--dtype")) {
      o.dtype = -1;
      for (int d = 0; d < MPLANE_HFREDUCE_NDTYPES; d++)
        if (!strcmp(v, mp_hfr_dtype_name(d))) o.dtype = d;
      if (o.dtype < 0) {
        fprintf(stderr, "--dtype %s: expected float32, float16, bfloat16, fp8_e4m3 or fp8_e5m2\n", v);
        return 2;
      }
      reduce_dtype = o.dtype;
    } else {
      fprintf(stderr, "unknown option %s\n", k);
      return 2;
    }
  }
  if (!strcmp(argv[1], "reduce")) return bench_reduce(mib, rounds, nsrc, reduce_dtype, reduce_op);
  if (o.nodes < 1 || o.per_node < 1 || o.nodes * o.per_node > 256 || o.min <= 0 || o.max < o.min) {
    fprintf(stderr, "allreduce: bad shape or sizes\n");
    return 2;
  }
  return bench_allreduce(&o);
}
