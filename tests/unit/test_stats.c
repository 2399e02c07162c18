/* cmocka tests of the traffic counters (net/stats.c): what they count per plane, class and comm, and
 * that a request's path (start, done) neither allocates nor takes a lock. This file is linked with
 * malloc, calloc, realloc and pthread_mutex_lock wrapped, so the test counts the calls, and with
 * clock_gettime wrapped, so request times can come from a clock the test sets. */
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

#include "net/stats.h"
#include "net/tc.h"

static int counting;
static long allocs, locks;

void *__real_malloc(size_t n);
void *__real_calloc(size_t n, size_t m);
void *__real_realloc(void *p, size_t n);
int __real_pthread_mutex_lock(pthread_mutex_t *m);
void *__wrap_malloc(size_t n) {
  if (counting) allocs++;
  return __real_malloc(n);
}
void *__wrap_calloc(size_t n, size_t m) {
  if (counting) allocs++;
  return __real_calloc(n, m);
}
void *__wrap_realloc(void *p, size_t n) {
  if (counting) allocs++;
  return __real_realloc(p, n);
}
int __wrap_pthread_mutex_lock(pthread_mutex_t *m) {
  if (counting) locks++;
  return __real_pthread_mutex_lock(m);
}

/* While fake_clock is set, every clock reads fake_ns: request times are then exactly what the test
 * says, whatever the machine's load (a preempted test must not look like a slow request). */
static int fake_clock;
static uint64_t fake_ns;
int __real_clock_gettime(clockid_t id, struct timespec *ts);
int __wrap_clock_gettime(clockid_t id, struct timespec *ts) {
  if (!fake_clock) return __real_clock_gettime(id, ts);
  ts->tv_sec = (time_t)(fake_ns / 1000000000u);
  ts->tv_nsec = (long)(fake_ns % 1000000000u);
  return 0;
}

static void test_stats(void **state) {
  (void)state;
  struct mplane_stats_comm comm_a, comm_b;
  struct mplane_stats_req req1, req2, req3, req_none;
  struct mplane_stats_totals t0, t1;
  mplane_stats_snapshot(&t0);
  struct mplane_stats_comm_info si = {.is_send = 1, .dev = 3, .dev_name = "veth3", .plane = 3, .from_plane = 0,
                                      .cls = MPLANE_TC_ALLTOALL, .sl = 3, .relayed = 1, .peer = "peer-a"};
  mplane_stats_comm_open(&comm_a, &si);
  struct mplane_stats_comm_info ri = {.is_send = 0, .dev = 1, .dev_name = "veth1", .plane = 1, .from_plane = 1,
                                      .cls = MPLANE_TC_DEFAULT};
  mplane_stats_comm_open(&comm_b, &ri);
  mplane_stats_request(&comm_a, &req1, 1000, 0);
  mplane_stats_request(&comm_a, &req2, 24, 0);
  mplane_stats_request(&comm_b, &req3, 0, 2);
  mplane_stats_request_done(&req1, NULL);
  int sizes[2] = {300, 44};
  mplane_stats_request_done(&req3, sizes);
  mplane_stats_request_done(&req3, sizes); /* twice: counted once */
  mplane_stats_request(&comm_a, NULL, 5, 0); /* no request record: nothing */
  mplane_stats_request(NULL, &req_none, 5, 0); /* a comm the transport keeps no record of */
  mplane_stats_request_done(&req_none, NULL);
  /* live comms: the snapshot adds their counters */
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane[3].tx_bytes - t0.plane[3].tx_bytes, 1000);
  assert_int_equal(t1.plane[3].relayed_bytes - t0.plane[3].relayed_bytes, 1000);
  assert_int_equal(t1.plane[3].tx_msgs - t0.plane[3].tx_msgs, 1);
  assert_int_equal(t1.cls[MPLANE_TC_ALLTOALL].tx_bytes - t0.cls[MPLANE_TC_ALLTOALL].tx_bytes, 1000);
  assert_int_equal(t1.plane[1].rx_bytes - t0.plane[1].rx_bytes, 344);
  assert_int_equal(t1.plane[1].rx_msgs - t0.plane[1].rx_msgs, 2);
  assert_int_equal(t1.plane[1].relayed_bytes - t0.plane[1].relayed_bytes, 0);
  assert_int_equal(t1.comms_opened - t0.comms_opened, 2);
  assert_int_equal(comm_a.c.tx_bytes, 1000);
  /* close drops the pending req2; its completion afterwards counts nothing; the closed comms' counts
   * stay in the totals, once */
  mplane_stats_comm_close(&comm_a);
  mplane_stats_request_done(&req2, NULL);
  mplane_stats_comm_close(&comm_b);
  mplane_stats_comm_close(&comm_b); /* not open any more: harmless */
  mplane_stats_comm_close(NULL);
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane[3].tx_bytes - t0.plane[3].tx_bytes, 1000);
  assert_int_equal(t1.plane[1].rx_bytes - t0.plane[1].rx_bytes, 344);
  assert_int_equal(t1.comms_closed - t0.comms_closed, 2);

  int dev = -1, cls = -1, listen;
  mplane_stats_listen(&listen, 2, MPLANE_TC_LOWLAT);
  assert_int_equal(mplane_stats_listen_get(&listen, &dev, &cls), 0);
  assert_int_equal(dev, 2);
  assert_int_equal(cls, MPLANE_TC_LOWLAT);
  mplane_stats_listen_close(&listen);
  assert_int_not_equal(mplane_stats_listen_get(&listen, &dev, &cls), 0);

  char path[256];
  assert_int_equal(mplane_stats_expand_path("/tmp/s-%p-%%.json", path, sizeof(path)), 0);
  char want[256];
  snprintf(want, sizeof(want), "/tmp/s-%d-%%.json", (int)getpid());
  assert_string_equal(path, want);
  assert_int_not_equal(mplane_stats_expand_path("/tmp/%p", path, 6), 0);

  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  mplane_stats_write_json(f);
  fclose(f);
  assert_non_null(strstr(buf, "\"plane\": 3, \"tx_bytes\": 1000"));
  assert_non_null(strstr(buf, "\"relayed_bytes\": 1000"));
  assert_non_null(strstr(buf, "\"class\": \"alltoall\", \"sl\": 3"));
  free(buf);
}

/* Many comms open at once and many requests in flight on each: every one counted once, whichever
 * order they open, complete and close in. */
static void test_stats_many(void **state) {
  (void)state;
  enum { NCOMMS = 64, NREQ = 200 };
  static struct mplane_stats_comm comms[NCOMMS];
  static struct mplane_stats_req reqs[NCOMMS][NREQ];
  struct mplane_stats_comm_info si = {.is_send = 1, .plane = 2, .from_plane = 2, .cls = MPLANE_TC_STORAGE};
  struct mplane_stats_totals t0, t1;
  mplane_stats_snapshot(&t0);
  for (int c = 0; c < NCOMMS; c++) mplane_stats_comm_open(&comms[c], &si);
  for (int c = 0; c < NCOMMS; c++)
    for (int i = 0; i < NREQ; i++) mplane_stats_request(&comms[c], &reqs[c][i], 1, 0);
  for (int c = 0; c < NCOMMS; c++)
    for (int i = 0; i < NREQ; i += 2) mplane_stats_request_done(&reqs[c][i], NULL);
  for (int c = 0; c < NCOMMS; c += 2) mplane_stats_comm_close(&comms[c]); /* their odd requests die */
  for (int c = 1; c < NCOMMS; c += 2)
    for (int i = 1; i < NREQ; i += 2) mplane_stats_request_done(&reqs[c][i], NULL);
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane[2].tx_bytes - t0.plane[2].tx_bytes, NCOMMS * NREQ / 2 + NCOMMS / 2 * NREQ / 2);
  for (int c = 1; c < NCOMMS; c += 2) mplane_stats_comm_close(&comms[c]);
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane[2].tx_bytes - t0.plane[2].tx_bytes, NCOMMS * NREQ / 2 + NCOMMS / 2 * NREQ / 2);
  assert_int_equal(t1.cls[MPLANE_TC_STORAGE].tx_msgs - t0.cls[MPLANE_TC_STORAGE].tx_msgs,
                   NCOMMS * NREQ / 2 + NCOMMS / 2 * NREQ / 2);
  assert_int_equal(t1.comms_closed - t0.comms_closed, NCOMMS);
}

/* A device with no plane (loopback under emulated nodes) still counts, as plane -1 in the JSON: the
 * all-to-all's byte check sums the planes and read 0 when such traffic was dropped. */
static void test_stats_no_plane(void **state) {
  (void)state;
  struct mplane_stats_comm comm;
  struct mplane_stats_req req;
  struct mplane_stats_comm_info si = {.is_send = 1, .dev_name = "lo", .plane = -1, .from_plane = -1,
                                      .cls = MPLANE_TC_DEFAULT};
  struct mplane_stats_totals t0, t1;
  mplane_stats_snapshot(&t0);
  mplane_stats_comm_open(&comm, &si);
  mplane_stats_request(&comm, &req, 4242, 0);
  mplane_stats_request_done(&req, NULL);
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane_unknown.tx_bytes - t0.plane_unknown.tx_bytes, 4242);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  mplane_stats_write_json(f);
  fclose(f);
  assert_non_null(strstr(buf, "\"plane\": -1, \"tx_bytes\": "));
  free(buf);
  mplane_stats_comm_close(&comm);
}

/* Errors count on the comm's plane and class, a failed request once and never as a message; a comm
 * opened again to a peer host (any port) on the same device and direction counts as a reconnect; and
 * the Prometheus text holds both, with the pid label. */
static void test_stats_errors_reconnects(void **state) {
  (void)state;
  struct mplane_stats_comm comm, again, other;
  struct mplane_stats_req req, ok;
  struct mplane_stats_comm_info si = {.is_send = 1, .dev = 5, .dev_name = "mlx5_5", .plane = 5, .from_plane = 5,
                                      .cls = MPLANE_TC_LOWLAT, .sl = 5, .peer = "198.18.5.2:40001"};
  struct mplane_stats_totals t0, t1;
  mplane_stats_snapshot(&t0);
  mplane_stats_comm_open(&comm, &si);
  mplane_stats_request(&comm, &req, 100, 0);
  mplane_stats_request(&comm, &ok, 7, 0);
  mplane_stats_request_error(&req);
  mplane_stats_request_error(&req);    /* tested again: still one */
  mplane_stats_request_done(&req, NULL); /* and never a message */
  mplane_stats_request_done(&ok, NULL);
  mplane_stats_comm_error(&comm);      /* an isend that failed */
  mplane_stats_comm_close(&comm);
  si.peer = "198.18.5.2:40777"; /* the same host, another port: NCCL's new communicator */
  mplane_stats_comm_open(&again, &si);
  si.peer = "198.18.5.3:40001"; /* another host: not a reconnect */
  mplane_stats_comm_open(&other, &si);
  mplane_stats_snapshot(&t1);
  assert_int_equal(t1.plane[5].errors - t0.plane[5].errors, 2);
  assert_int_equal(t1.cls[MPLANE_TC_LOWLAT].errors - t0.cls[MPLANE_TC_LOWLAT].errors, 2);
  assert_int_equal(t1.plane[5].tx_msgs - t0.plane[5].tx_msgs, 1);
  assert_int_equal(t1.plane[5].tx_bytes - t0.plane[5].tx_bytes, 7);
  assert_int_equal(t1.reconnects - t0.reconnects, 1);
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  mplane_stats_write_prometheus(f);
  fclose(f);
  char want[128];
  snprintf(want, sizeof(want), "mplane_plane_errors_total{pid=\"%d\",plane=\"5\"} %llu\n", (int)getpid(),
           (unsigned long long)t1.plane[5].errors);
  assert_non_null(strstr(buf, want));
  snprintf(want, sizeof(want), "mplane_reconnects_total{pid=\"%d\"} %llu\n", (int)getpid(),
           (unsigned long long)t1.reconnects);
  assert_non_null(strstr(buf, want));
  assert_non_null(strstr(buf, "# TYPE mplane_class_bytes_total counter\n"));
  assert_non_null(strstr(buf, "class=\"lowlat\",sl=\"5\",direction=\"send\"} "));
  free(buf);
  mplane_stats_comm_close(&again);
  mplane_stats_comm_close(&other);
}

/* The data path (a request started, then done) allocates nothing and takes no lock: it was a global
 * mutex, a malloc and a hash insert per isend/irecv and per completed test. */
static void test_stats_hot_path(void **state) {
  (void)state;
  enum { N = 1000 };
  struct mplane_stats_comm tx, rx;
  static struct mplane_stats_req reqs[N];
  struct mplane_stats_comm_info si = {.is_send = 1, .plane = 4, .from_plane = 4, .cls = MPLANE_TC_DEFAULT};
  struct mplane_stats_comm_info ri = {.is_send = 0, .plane = 4, .from_plane = 4, .cls = MPLANE_TC_DEFAULT};
  mplane_stats_comm_open(&tx, &si);
  mplane_stats_comm_open(&rx, &ri);
  int sizes[2] = {8, 8};
  allocs = locks = 0;
  counting = 1;
  for (int i = 0; i < N; i++) mplane_stats_request(i & 1 ? &rx : &tx, &reqs[i], 8, 2);
  for (int i = 0; i < N; i++) mplane_stats_request_done(&reqs[i], sizes);
  counting = 0;
  assert_int_equal(allocs, 0);
  assert_int_equal(locks, 0);
  assert_int_equal(tx.c.tx_bytes, 8 * N / 2);
  assert_int_equal(rx.c.rx_bytes, 16 * N / 2);
  assert_int_equal(rx.c.rx_msgs, N);
  /* the wrapping itself works: opening a comm takes the lock */
  counting = 1;
  struct mplane_stats_comm other;
  mplane_stats_comm_open(&other, &si);
  counting = 0;
  assert_true(locks > 0);
  mplane_stats_comm_close(&other);
  mplane_stats_comm_close(&tx);
  mplane_stats_comm_close(&rx);
}

/* A send comm on plane 2, for the request-time tests. */
static void open_timed_comm(struct mplane_stats_comm *tx) {
  struct mplane_stats_comm_info si = {.is_send = 1, .plane = 2, .from_plane = 2, .cls = MPLANE_TC_DEFAULT};
  mplane_stats_comm_open(tx, &si);
}

/* Request times: the histogram's quantiles bracket what the requests took (a bucket's upper edge is
 * at most 25% above any time in it). The times come from the test's clock. */
static void test_stats_times(void **state) {
  (void)state;
  struct mplane_stats_comm tx;
  open_timed_comm(&tx);
  assert_true(mplane_stats_time_quantile(&tx, 0.5) == 0); /* nothing completed yet */
  static struct mplane_stats_req reqs[100];
  /* 2 requests of 3 ms, 98 of 5 us */
  fake_clock = 1;
  fake_ns = 1000000000u;
  for (int i = 0; i < 2; i++) mplane_stats_request(&tx, &reqs[i], 8, 0);
  fake_ns += 3000000;
  for (int i = 0; i < 2; i++) mplane_stats_request_done(&reqs[i], NULL);
  for (int i = 2; i < 100; i++) {
    mplane_stats_request(&tx, &reqs[i], 8, 0);
    fake_ns += 5000;
    mplane_stats_request_done(&reqs[i], NULL);
  }
  fake_clock = 0;
  double med = mplane_stats_time_quantile(&tx, 0.5), p99 = mplane_stats_time_quantile(&tx, 0.99);
  double q98 = mplane_stats_time_quantile(&tx, 0.98), all = mplane_stats_time_quantile(&tx, 1);
  if (med < 5 || med > 5 * 1.25) fail_msg("median %.1f us; 98 of 100 requests took 5 us", med);
  if (q98 != med) fail_msg("98th percentile %.1f us, the median %.1f: the 98th of 100 is a 5 us one", q98, med);
  if (p99 < 3000 || p99 > 3000 * 1.25) fail_msg("p99 %.0f us; the 2 slow requests took 3000 us", p99);
  if (all != p99) fail_msg("max %.0f us, p99 %.0f us: both are a 3000 us request", all, p99);
  mplane_stats_comm_close(&tx);
}

/* The real clock: a request that spans a sleep takes at least the sleep (sleeping may overshoot, never
 * undershoot), whatever else the machine does. */
static void test_stats_times_real_clock(void **state) {
  (void)state;
  struct mplane_stats_comm tx;
  open_timed_comm(&tx);
  struct mplane_stats_req req;
  mplane_stats_request(&tx, &req, 8, 0);
  usleep(3000);
  mplane_stats_request_done(&req, NULL);
  double t = mplane_stats_time_quantile(&tx, 1);
  if (t < 3000) fail_msg("a request across a 3 ms sleep timed at %.0f us", t);
  mplane_stats_comm_close(&tx);
}

int main(void) {
  setenv("MPLANE_TC_MAP", "default=0,collective=0,alltoall=3,lowlat=5,storage=1", 1);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_stats),
      cmocka_unit_test(test_stats_no_plane),
      cmocka_unit_test(test_stats_errors_reconnects),
      cmocka_unit_test(test_stats_many),
      cmocka_unit_test(test_stats_hot_path),
      cmocka_unit_test(test_stats_times),
      cmocka_unit_test(test_stats_times_real_clock),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
