/* libmplane-hfreduce across processes: fork `nodes x per_node` ranks over loopback (each node its
 * own NCCL_HOSTID), then one scenario:
 *   ok        every dtype and op against a reference, odd counts, chunk boundaries, 0 elements,
 *             in place and not, several calls on one communicator
 *   big MiB   one float32 sum of MiB mebibytes (the 8-rank 256 MiB run), checked
 *   kill      the last rank dies (SIGKILL) in the middle of a long run of calls: every other rank
 *             must fail within MPLANE_CONNECT_TIMEOUT, naming it
 *   stop      the same with the last rank stopped (SIGSTOP), not dead
 *   gpu       as ok, on device buffers (the CUDA stand-in tests/fakecuda through MPLANE_CUDA_LIB):
 *             the copies go through the driver shim's asynchronous copy lane
 *   mismatch  rank 1 passes another count: every rank fails, one naming the count
 *   badconfig rank 1 has another MPLANE_HFREDUCE_CHUNK_BYTES: comm_init fails on every rank, naming it
 *   uneven    the last node has one rank fewer: comm_init fails on every rank, naming both hosts
 *   badplanes MPLANE_PLANES (set by the caller) names a NIC the node lacks: comm_init fails on every
 *             rank, naming MPLANE_PLANES, as the plugin's init would
 * Usage: hfreduce-ranks NODES PER_NODE SCENARIO [MiB]. Exit 0 when the scenario holds.
 * With HFR_EXPECT_SL=N and SOFTVERBS_RECORD=FILE (the IB transport on the verbs double), every QP the
 * ranks brought up must carry service level N: the traffic class hfreduce of MPLANE_TC_MAP.
 * With HFR_EXPECT_DEVS=D0,D1,... and SOFTVERBS_RECORD=FILE, every QP of a rank of local index l must be
 * on device Dl: the device of plane l as topo/ resolves it (MPLANE_PLANES), not the transport's order. */
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
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

static int nodes, per_node, nranks;
static const char *scenario;

#define CHECK(cond, ...)                                        \
  do {                                                          \
    if (!(cond)) {                                              \
      fprintf(stderr, "rank %d: FAIL: ", my_rank);              \
      fprintf(stderr, __VA_ARGS__);                             \
      fprintf(stderr, "\n");                                    \
      return 1;                                                 \
    }                                                           \
  } while (0)

static int my_rank = -1;

/* Rank r's element i: for sums small integers (every partial sum exact in every type, so any order of
 * folding gives the reference's bits); for max and min a wider spread. */
static float value(int r, size_t i, int op) {
  if (op == MPLANE_HFREDUCE_SUM) return (float)((int)((r * 7 + i * 13 + (i >> 5)) % 3) - 1);
  return (float)((int)((r * 31 + i * 17 + (i >> 3)) % 29) - 14) * 0.5f;
}

static void fill(void *buf, int dtype, int op, int r, size_t n) {
  for (size_t i = 0; i < n; i++) mp_hfr_store_f32(dtype, buf, i, value(r, i, op));
}

/* The reference: each rank's stored value, folded over the ranks in float, stored once. */
static void reference(void *out, int dtype, int op, size_t n) {
  for (size_t i = 0; i < n; i++) {
    float acc = 0;
    for (int r = 0; r < nranks; r++) {
      unsigned char tmp[4];
      mp_hfr_store_f32(dtype, tmp, 0, value(r, i, op));
      float v = mp_hfr_load_f32(dtype, tmp, 0);
      acc = r == 0 ? v : op == MPLANE_HFREDUCE_SUM ? acc + v : op == MPLANE_HFREDUCE_MAX ? (acc > v ? acc : v)
                                                                                          : (acc < v ? acc : v);
    }
    mp_hfr_store_f32(dtype, out, i, acc);
  }
}

static int on_gpu;

/* The call on device copies of send/recv where on_gpu, else on them. */
static int allreduce_here(mplane_hfreduce_comm_t comm, void *send, void *recv, size_t n, int dtype, int op,
                          size_t bytes, int inplace) {
  if (!on_gpu) return mplane_hfreduce_allreduce(comm, inplace ? recv : send, recv, n, dtype, op, NULL);
  char *ds = mplane_cuda_alloc(0, bytes), *dr = mplane_cuda_alloc(0, bytes);
  if (!ds || !dr) return -1;
  mplane_cuda_memcpy_htod(0, ds, inplace ? recv : send, bytes);
  mplane_cuda_memcpy_htod(0, dr, recv, bytes);
  int rc = mplane_hfreduce_allreduce(comm, inplace ? dr : ds, dr, n, dtype, op, NULL);
  mplane_cuda_memcpy_dtoh(0, recv, dr, bytes);
  mplane_cuda_free(0, ds);
  mplane_cuda_free(0, dr);
  return rc;
}

static int run_ok(mplane_hfreduce_comm_t comm) {
  /* MPLANE_HFREDUCE_CHUNK_BYTES=64K (tests/hfreduce/meson.build): 16384 float32, 65536 fp8 a chunk */
  const size_t counts[] = {1, 63, 64, 65, 1000, 16383, 16384, 16385, 3 * 32768 + 17, 0};
  int calls = 0;
  for (int dtype = 0; dtype < MPLANE_HFREDUCE_NDTYPES; dtype++)
    for (int op = 0; op < MPLANE_HFREDUCE_NOPS; op++)
      for (size_t ci = 0; ci < sizeof(counts) / sizeof(counts[0]); ci++) {
        size_t n = counts[ci], es = mp_hfr_dtype_size(dtype), bytes = n * es + 64;
        unsigned char *send = malloc(bytes), *recv = malloc(bytes), *ref = malloc(bytes);
        fill(send, dtype, op, my_rank, n);
        memset(recv, 0xa5, bytes);
        reference(ref, dtype, op, n);
        int inplace = (ci % 2) == 1;
        if (inplace) memcpy(recv, send, n * es);
        if (on_gpu && (op != MPLANE_HFREDUCE_SUM || n == 0)) {
          free(send), free(recv), free(ref);
          continue;
        }
        int rc = allreduce_here(comm, send, recv, n, dtype, op, bytes, inplace);
        CHECK(rc == 0, "allreduce %s %s count %zu%s returned %d: %s", mp_hfr_dtype_name(dtype), mp_hfr_op_name(op), n,
              inplace ? " in place" : "", rc, mplane_hfreduce_last_error());
        for (size_t i = 0; i < n * es; i++)
          CHECK(recv[i] == ref[i], "%s %s count %zu%s: byte %zu is 0x%02x, the reference 0x%02x (element %zu)",
                mp_hfr_dtype_name(dtype), mp_hfr_op_name(op), n, inplace ? " in place" : "", i, recv[i], ref[i],
                i / es);
        for (size_t i = n * es; i < bytes; i++) CHECK(recv[i] == 0xa5, "byte %zu past the %zu elements was written", i, n);
        free(send);
        free(recv);
        free(ref);
        calls++;
      }
  if (my_rank == 0) printf("hfreduce-ranks: %d ranks (%d nodes x %d): %d all-reduces%s match the reference\n", nranks,
                           nodes, per_node, calls, on_gpu ? " on device buffers" : "");
  return 0;
}

static int run_big(mplane_hfreduce_comm_t comm, size_t mib) {
  size_t n = mib * (1u << 20) / 4;
  float *buf = malloc(n * 4);
  CHECK(buf, "out of memory");
  for (size_t i = 0; i < n; i++) buf[i] = (float)((my_rank + i) % 5);
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  int rc = mplane_hfreduce_allreduce(comm, buf, buf, n, MPLANE_HFREDUCE_FLOAT32, MPLANE_HFREDUCE_SUM, NULL);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  CHECK(rc == 0, "allreduce of %zu MiB returned %d: %s", mib, rc, mplane_hfreduce_last_error());
  float want[5] = {0}; /* element i's sum depends on i % 5 only */
  for (int j = 0; j < 5; j++)
    for (int r = 0; r < nranks; r++) want[j] += (float)((r + j) % 5);
  for (size_t i = 0; i < n; i++) CHECK(buf[i] == want[i % 5], "element %zu is %g, expected %g", i, buf[i], want[i % 5]);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  if (my_rank == 0)
    printf("hfreduce-ranks: %d ranks (%d nodes x %d): %zu MiB float32 sum correct in %.2f s (algbw %.2f GB/s, busbw "
           "%.2f GB/s)\n", nranks, nodes, per_node, mib, s, (double)n * 4 / s / 1e9,
           (double)n * 4 / s / 1e9 * 2.0 * (nranks - 1) / nranks);
  free(buf);
  return 0;
}

static void *die_later(void *arg) {
  usleep(300000);
  kill(getpid(), arg ? SIGSTOP : SIGKILL);
  return NULL;
}

/* Exit codes of the kill scenario's survivors: 0 failed naming the victim, 3 failed naming another. */
static int run_kill(mplane_hfreduce_comm_t comm, int stop) {
  int victim = nranks - 1;
  size_t n = 1 << 20;
  float *buf = calloc(n, 4);
  if (my_rank == victim) {
    pthread_t t;
    pthread_create(&t, NULL, die_later, stop ? &t : NULL);
  }
  for (int i = 0; i < 1000000; i++) {
    int rc = mplane_hfreduce_allreduce(comm, buf, buf, n, MPLANE_HFREDUCE_FLOAT32, MPLANE_HFREDUCE_SUM, NULL);
    if (rc != 0) {
      char name[32];
      snprintf(name, sizeof(name), "rank %d ", victim);
      const char *e = mplane_hfreduce_last_error();
      fprintf(stderr, "rank %d: call %d failed as it should: %s\n", my_rank, i, e);
      fflush(stderr);
      return strstr(e, name) ? 0 : 3;
    }
  }
  CHECK(0, "a million calls went through with rank %d dead", victim);
}

static int run_mismatch(mplane_hfreduce_comm_t comm) {
  size_t n = my_rank == 1 ? 1001 : 1000;
  float *buf = calloc(2000, 4);
  int rc = mplane_hfreduce_allreduce(comm, buf, buf, n, MPLANE_HFREDUCE_FLOAT32, MPLANE_HFREDUCE_SUM, NULL);
  CHECK(rc != 0, "count %zu against 1000 on the others went through", n);
  fprintf(stderr, "rank %d: failed as it should: %s\n", my_rank, mplane_hfreduce_last_error());
  return strstr(mplane_hfreduce_last_error(), "count") ? 0 : 3;
}

/* comm_init must fail, its error holding `want`. */
static int expect_init_fails(const mplane_hfreduce_unique_id *id, const char *want) {
  mplane_hfreduce_comm_t comm;
  int rc = mplane_hfreduce_comm_init(&comm, nranks, id, my_rank);
  CHECK(rc != 0, "comm_init went through");
  CHECK(strstr(mplane_hfreduce_last_error(), want), "comm_init failed without naming '%s': %s", want,
        mplane_hfreduce_last_error());
  fprintf(stderr, "rank %d: comm_init failed as it should: %s\n", my_rank, mplane_hfreduce_last_error());
  return 0;
}

static int rank_main(int rank, const mplane_hfreduce_unique_id *id, size_t mib) {
  my_rank = rank;
  char host[32];
  int host_node = rank / per_node;
  if (!strcmp(scenario, "uneven") && rank == nranks - 1) host_node = 0; /* the last node is one short */
  snprintf(host, sizeof(host), "hfr-node-%d", host_node);
  setenv("NCCL_HOSTID", host, 1);
  if (!strcmp(scenario, "uneven")) return expect_init_fails(id, "every node must hold the same number of ranks");
  if (!strcmp(scenario, "badplanes")) return expect_init_fails(id, "MPLANE_PLANES");
  if (!strcmp(scenario, "badconfig")) {
    if (rank == 1) setenv("MPLANE_HFREDUCE_CHUNK_BYTES", "128K", 1);
    return expect_init_fails(id, "MPLANE_HFREDUCE_CHUNK_BYTES");
  }
  mplane_hfreduce_comm_t comm;
  int rc = mplane_hfreduce_comm_init(&comm, nranks, id, rank);
  CHECK(rc == 0, "comm_init returned %d: %s", rc, mplane_hfreduce_last_error());
  int node, nn, local, nlocal;
  mplane_hfreduce_comm_info(comm, NULL, NULL, &node, &nn, &local, &nlocal);
  CHECK(node == rank / per_node && nn == nodes && local == rank % per_node && nlocal == per_node,
        "placed at node %d of %d, local %d of %d", node, nn, local, nlocal);
  if (!strcmp(scenario, "gpu")) {
    char why[256];
    CHECK(mplane_cuda_load(why, sizeof(why)) > 0, "no CUDA (MPLANE_CUDA_LIB): %s", why);
    on_gpu = 1;
    rc = run_ok(comm);
    /* the shared segment and the scratch were page-locked for the copy engine, and stay so until destroy */
    void *fake = dlopen(getenv("MPLANE_CUDA_LIB"), RTLD_NOW | RTLD_NOLOAD);
    int (*registered)(void) = fake ? (int (*)(void))dlsym(fake, "fake_cuda_host_registered") : NULL;
    CHECK(registered && registered() == 2, "%d regions page-locked, expected 2", registered ? registered() : -1);
    mplane_hfreduce_comm_destroy(comm);
    CHECK(registered() == 0, "%d regions still page-locked after destroy", registered());
    return rc;
  } else if (!strcmp(scenario, "ok")) rc = run_ok(comm);
  else if (!strcmp(scenario, "big")) rc = run_big(comm, mib);
  else if (!strcmp(scenario, "kill")) return run_kill(comm, 0); /* no destroy: peers are gone */
  else if (!strcmp(scenario, "stop")) return run_kill(comm, 1);
  else if (!strcmp(scenario, "mismatch")) return run_mismatch(comm);
  mplane_hfreduce_comm_destroy(comm);
  return rc;
}

/* Every "sl=" of the verbs double's record equals want, and there is one at least. */
static int check_record_sl(const char *path, int want) {
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "FAIL: no record %s\n", path);
    return 1;
  }
  char line[1024];
  int seen = 0, bad = 0;
  while (fgets(line, sizeof(line), f)) {
    const char *p = strstr(line, " sl=");
    if (!p) continue;
    seen++;
    if (atoi(p + 4) != want) bad++;
  }
  fclose(f);
  printf("hfreduce-ranks: %d QP transitions recorded, %d with a service level other than %d\n", seen, bad, want);
  return seen == 0 || bad != 0;
}

/* Every QP a rank brought up ("event=modify pid=P dev=D") is on the device its local index expects
 * (want: comma separated, one per local rank), and each rank brought up one at least. */
static int check_record_devs(const char *path, const char *want, const pid_t *pids) {
  char devs[16][64];
  int ndevs = 0;
  char buf[1024];
  snprintf(buf, sizeof(buf), "%s", want);
  char *save = NULL;
  for (char *d = strtok_r(buf, ",", &save); d && ndevs < 16; d = strtok_r(NULL, ",", &save))
    snprintf(devs[ndevs++], sizeof(devs[0]), "%s", d);
  if (ndevs != per_node) {
    fprintf(stderr, "FAIL: HFR_EXPECT_DEVS='%s' names %d devices for %d ranks per node\n", want, ndevs, per_node);
    return 1;
  }
  FILE *f = fopen(path, "r");
  if (!f) {
    fprintf(stderr, "FAIL: no record %s\n", path);
    return 1;
  }
  int seen[64] = {0}, bad = 0;
  char line[1024];
  while (fgets(line, sizeof(line), f)) {
    const char *p = strstr(line, "event=modify pid="), *d = strstr(line, " dev=");
    if (!p || !d) continue;
    int pid = atoi(p + strlen("event=modify pid="));
    char dev[64];
    if (sscanf(d + 5, "%63s", dev) != 1) continue;
    int r = 0;
    while (r < nranks && pids[r] != pid) r++;
    if (r == nranks) continue;
    seen[r]++;
    if (strcmp(dev, devs[r % per_node]) != 0) {
      if (!bad) fprintf(stderr, "FAIL: rank %d (local %d) brought up a QP on %s, not %s\n", r, r % per_node, dev,
                        devs[r % per_node]);
      bad++;
    }
  }
  fclose(f);
  int idle = 0;
  for (int r = 0; r < nranks; r++) idle += seen[r] == 0;
  printf("hfreduce-ranks: QPs on the device of each rank's plane (%s): %d off it, %d ranks without a QP\n", want, bad,
         idle);
  return bad != 0 || idle != 0;
}

int main(int argc, char **argv) {
  if (argc < 4) {
    fprintf(stderr, "usage: %s NODES PER_NODE ok|gpu|big|kill|stop|mismatch|badconfig|uneven|badplanes [MiB]\n", argv[0]);
    return 2;
  }
  nodes = atoi(argv[1]);
  per_node = atoi(argv[2]);
  scenario = argv[3];
  size_t mib = argc > 4 ? (size_t)atol(argv[4]) : 16;
  nranks = nodes * per_node;
  if ((getenv("HFR_EXPECT_SL") || getenv("HFR_EXPECT_DEVS")) && getenv("SOFTVERBS_RECORD"))
    unlink(getenv("SOFTVERBS_RECORD")); /* this run's only */
  if (!strcmp(scenario, "gpu")) { /* no GPU, no test: 77 (a child asks: CUDA does not survive a fork) */
    pid_t probe = fork();
    if (probe == 0) {
      char why[256];
      int n = mplane_cuda_load(why, sizeof(why));
      if (n <= 0) printf("hfreduce-ranks: gpu: SKIP: %s\n", why);
      fflush(stdout);
      _exit(n > 0 ? 0 : 77);
    }
    int st;
    waitpid(probe, &st, 0);
    if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return WIFEXITED(st) ? WEXITSTATUS(st) : 1;
  }
  mplane_hfreduce_unique_id id;
  if (mplane_hfreduce_get_unique_id(&id) != 0) {
    fprintf(stderr, "FAIL: get_unique_id: %s\n", mplane_hfreduce_last_error());
    return 1;
  }
  pid_t pids[64];
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int r = 0; r < nranks; r++) {
    pids[r] = fork();
    if (pids[r] == 0) {
      int rc = rank_main(r, &id, mib);
      fflush(stdout);
      _exit(rc);
    }
  }
  int failed = 0, named = 0, survivors = 0, victim_fault = !strcmp(scenario, "kill") || !strcmp(scenario, "stop");
  for (int left = nranks; left > 0; left--) {
    if (!strcmp(scenario, "stop") && left == 1) kill(pids[nranks - 1], SIGKILL); /* the others are out */
    int st;
    pid_t p = wait(&st);
    int r = 0;
    while (r < nranks && pids[r] != p) r++;
    int killed = WIFSIGNALED(st), code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    if (victim_fault && r == nranks - 1) {
      if (!killed) {
        fprintf(stderr, "FAIL: the victim (rank %d) was not killed (status 0x%x)\n", r, st);
        failed = 1;
      }
      continue;
    }
    survivors++;
    if (code == 0) named++;
    if (victim_fault && code != 0) {
      fprintf(stderr, "FAIL: rank %d did not name the rank at fault\n", r);
      failed = 1;
    }
    if (killed || (code != 0 && code != 3) || (code == 3 && !victim_fault && strcmp(scenario, "mismatch"))) {
      fprintf(stderr, "FAIL: rank %d ended with status 0x%x\n", r, st);
      failed = 1;
    }
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double s = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) * 1e-9;
  if (victim_fault || !strcmp(scenario, "mismatch")) {
    /* a dead or stopped rank: every other fails naming it (directly, through the node's abort message,
     * or through a neighbour's failure note); a bad count: the ranks that compare name it */
    if (named == 0) {
      fprintf(stderr, "FAIL: %d of %d ranks' errors named the %s\n", named, survivors,
              !strcmp(scenario, "mismatch") ? "count" : "rank at fault");
      failed = 1;
    }
    printf("hfreduce-ranks: %s: all %d other ranks failed within %.1f s, %d of them naming the %s\n", scenario,
           survivors, s, named, !strcmp(scenario, "mismatch") ? "count" : "rank at fault");
  }
  const char *want_sl = getenv("HFR_EXPECT_SL"), *record = getenv("SOFTVERBS_RECORD");
  if (want_sl && record) failed |= check_record_sl(record, atoi(want_sl));
  const char *want_devs = getenv("HFR_EXPECT_DEVS");
  if (want_devs && record) failed |= check_record_devs(record, want_devs, pids);
  return failed;
}
