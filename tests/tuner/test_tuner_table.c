/* mplane tests: the tuner table parser (tuner/tuner_table.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "tuner/tuner_table.h"
#include "common/log.h"

#define HEADER "collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks\n"

static struct mplane_tuner_table *parse_ok(const char *text) {
  struct mplane_tuner_table *t = NULL;
  char err[512] = "";
  ncclResult_t res = mplane_tuner_table_parse("t.csv", text, strlen(text), &t, err, sizeof(err));
  if (res != ncclSuccess) fail_msg("unexpected parse error: %s", err);
  assert_non_null(t);
  return t;
}

/* Parse text that must fail, and check the message starts with "t.csv:<where>: " and holds `what`. */
static void parse_bad(const char *text, const char *where, const char *what) {
  struct mplane_tuner_table *t = (void *)1;
  char err[512] = "";
  ncclResult_t res = mplane_tuner_table_parse("t.csv", text, strlen(text), &t, err, sizeof(err));
  assert_int_equal(res, ncclInvalidArgument);
  assert_null(t);
  char prefix[64];
  snprintf(prefix, sizeof(prefix), "t.csv:%s: ", where);
  if (strncmp(err, prefix, strlen(prefix)) != 0) fail_msg("error '%s' does not start with '%s'", err, prefix);
  if (!strstr(err, what)) fail_msg("error '%s' does not mention '%s'", err, what);
}

/* -1 (or any) for both algorithm and protocol: a row that sets only channels. */
static void test_parse_channels_only(void **state) {
  (void)state;
  struct mplane_tuner_table *t = parse_ok(HEADER "allreduce,32K,1M,-1,-1,2,-1,-1\nany,0,10,Any,ANY,4,-1,-1\n");
  assert_int_equal(t->nrows, 2);
  for (int i = 0; i < 2; i++) {
    assert_int_equal(t->rows[i].algo, MPLANE_TUNER_NCCL_CHOICE);
    assert_int_equal(t->rows[i].proto, MPLANE_TUNER_NCCL_CHOICE);
  }
  assert_int_equal(t->rows[0].channels, 2);
  assert_int_equal(t->rows[1].channels, 4);
  mplane_tuner_table_free(t);
  parse_bad(HEADER "allreduce,0,1M,-1,ll,2,-1,-1\n", "2:19", "both given or both -1");
  parse_bad(HEADER "allreduce,0,1M,ring,-1,2,-1,-1\n", "2:16", "both given or both -1");
  parse_bad(HEADER "allreduce,0,1M,-1,-1,-1,-1,-1\n", "2:22", "would change nothing");
  parse_bad(HEADER "allreduce,0,1M,-2,ll,2,-1,-1\n", "2:16", "unknown algorithm");
}

static void test_parse_full_table(void **state) {
  (void)state;
  struct mplane_tuner_table *t = parse_ok(
      "# written by hand\r\n"
      "\r\n"
      HEADER
      "allreduce,0,65536,ring,ll,-1,1,8\r\n"
      "  all_reduce , 65537 , 4M , Tree , LL128 , 16 , -1 , -1 \n"
      "   # a comment in the middle\n"
      "AllGather,1K,-1,NVLS,Simple,32,2,16\n"
      "reduce_scatter,0,1G,pat,simple,1,4,4\n"
      "broadcast,0,1T,collnet_direct,simple,-1,-1,-1\n"
      "reduce,-1,-1,CollNetChain,ll,64,1,2\n"
      "any,0,10,nvls_tree,simple,-1,-1,-1"); /* no final newline */
  assert_int_equal(t->nrows, 7);
  const struct mplane_tuner_row *r = t->rows;
  assert_int_equal(r[0].coll, ncclFuncAllReduce);
  assert_int_equal(r[0].min_bytes, 0);
  assert_int_equal(r[0].max_bytes, 65536);
  assert_int_equal(r[0].algo, NCCL_ALGO_RING);
  assert_int_equal(r[0].proto, NCCL_PROTO_LL);
  assert_int_equal(r[0].channels, MPLANE_TUNER_ANY);
  assert_int_equal(r[0].nodes, 1);
  assert_int_equal(r[0].ranks, 8);
  assert_int_equal(r[0].line, 4);
  assert_int_equal(r[1].coll, ncclFuncAllReduce);
  assert_int_equal(r[1].min_bytes, 65537);
  assert_int_equal(r[1].max_bytes, 4u << 20);
  assert_int_equal(r[1].algo, NCCL_ALGO_TREE);
  assert_int_equal(r[1].proto, NCCL_PROTO_LL128);
  assert_int_equal(r[1].channels, 16);
  assert_int_equal(r[1].nodes, MPLANE_TUNER_ANY);
  assert_int_equal(r[1].ranks, MPLANE_TUNER_ANY);
  assert_int_equal(r[1].line, 5);
  assert_int_equal(r[2].coll, ncclFuncAllGather);
  assert_int_equal(r[2].min_bytes, 1024);
  assert_true(r[2].max_bytes == MPLANE_TUNER_NO_LIMIT);
  assert_int_equal(r[2].algo, NCCL_ALGO_NVLS);
  assert_int_equal(r[2].proto, NCCL_PROTO_SIMPLE);
  assert_int_equal(r[2].line, 7);
  assert_int_equal(r[3].coll, ncclFuncReduceScatter);
  assert_int_equal(r[3].max_bytes, 1u << 30);
  assert_int_equal(r[3].algo, NCCL_ALGO_PAT);
  assert_int_equal(r[4].coll, ncclFuncBroadcast);
  assert_true(r[4].max_bytes == (1ULL << 40));
  assert_int_equal(r[4].algo, NCCL_ALGO_COLLNET_DIRECT);
  assert_int_equal(r[5].coll, ncclFuncReduce);
  assert_int_equal(r[5].min_bytes, 0);
  assert_int_equal(r[5].algo, NCCL_ALGO_COLLNET_CHAIN);
  assert_int_equal(r[5].channels, 64);
  assert_int_equal(r[6].coll, MPLANE_TUNER_ANY);
  assert_int_equal(r[6].algo, NCCL_ALGO_NVLS_TREE);
  /* Row 7 ("any", 0..10) overlaps row 1 (allreduce 0..65536, 1 node 8 ranks) on allreduce. */
  assert_int_equal(r[6].overlaps_line, 4);
  for (int i = 0; i < 6; i++) assert_int_equal(r[i].overlaps_line, 0);
  mplane_tuner_table_free(t);
}

static void test_header_any_order_and_empty_table(void **state) {
  (void)state;
  struct mplane_tuner_table *t = parse_ok("ranks,nodes,channels,protocol,algorithm,max_bytes,min_bytes,collective\n"
                                          "8,1,4,simple,ring,2048,1024,allgather\n");
  assert_int_equal(t->nrows, 1);
  assert_int_equal(t->rows[0].coll, ncclFuncAllGather);
  assert_int_equal(t->rows[0].min_bytes, 1024);
  assert_int_equal(t->rows[0].max_bytes, 2048);
  assert_int_equal(t->rows[0].channels, 4);
  assert_int_equal(t->rows[0].ranks, 8);
  mplane_tuner_table_free(t);
  t = parse_ok("# nothing measured yet\n" HEADER);
  assert_int_equal(t->nrows, 0);
  mplane_tuner_table_free(t);
}

static void test_unknown_names(void **state) {
  (void)state;
  parse_bad(HEADER "allreduce,0,10,ring,ll,-1,-1,-1\nallreduc,0,10,ring,ll,-1,-1,-1\n", "3:1",
            "unknown collective 'allreduc'");
  parse_bad(HEADER "sendrecv,0,10,ring,ll,-1,-1,-1\n", "2:1", "unknown collective 'sendrecv'");
  parse_bad(HEADER "allreduce,0,10,rung,ll,-1,-1,-1\n", "2:16", "unknown algorithm 'rung'");
  parse_bad(HEADER "allreduce, 0, 10, ring,  ll64, -1, -1, -1\n", "2:26", "unknown protocol 'll64'");
  parse_bad(HEADER "1,0,10,ring,ll,-1,-1,-1\n", "2:1", "unknown collective '1'");
}

static void test_bad_numbers(void **state) {
  (void)state;
  parse_bad(HEADER "allreduce,12x,100,ring,ll,-1,-1,-1\n", "2:11", "min_bytes '12x' is not a number");
  parse_bad(HEADER "allreduce,0,,ring,ll,-1,-1,-1\n", "2:13", "empty max_bytes");
  parse_bad(HEADER "allreduce,0,100,ring,ll,eight,-1,-1\n", "2:25", "channels 'eight' is not a number");
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-5,-1\n", "2:28", "nodes '-5' is not a number");
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-1,1.5\n", "2:31", "ranks '1.5' is not a number");
  parse_bad(HEADER "allreduce,0,99999999999999999999999,ring,ll,-1,-1,-1\n", "2:13", "too large");
  parse_bad(HEADER "allreduce,0,16E,ring,ll,-1,-1,-1\n", "2:13", "max_bytes '16E' is not a number");
  parse_bad(HEADER "allreduce,0,100,ring,ll,65,-1,-1\n", "2:25", "channels '65' is too large");
  parse_bad(HEADER "allreduce,0,100,ring,ll,0,-1,-1\n", "2:25", "channels 0");
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,0,-1\n", "2:28", "nodes 0");
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-1,8M\n", "2:31", "ranks '8M' is not a number");
}

static void test_min_greater_than_max(void **state) {
  (void)state;
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-1,-1\nallreduce,4096,1K,ring,ll,-1,-1,-1\n", "3:11",
            "min_bytes 4096 is greater than max_bytes 1024");
}

static void test_field_counts(void **state) {
  (void)state;
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-1\n", "2:30", "7 fields where the header has 8");
  parse_bad(HEADER "allreduce,0,100,ring,ll,-1,-1,-1,extra\n", "2:34", "more than 8 fields");
}

static void test_bad_headers(void **state) {
  (void)state;
  parse_bad("collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes\nallreduce,0,1,ring,ll,-1,-1\n", "1",
            "lacks column 'ranks'");
  parse_bad("collective,min_bytes,max_bytes,algo,protocol,channels,nodes,ranks\n", "1:32", "unknown column 'algo'");
  parse_bad("collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks,nodes\n", "1:72",
            "column 'nodes' appears twice");
  parse_bad("", "1", "no header line");
  parse_bad("# only a comment\n\n", "2", "no header line");
  /* A data row where the header should be is an unknown column, named at its place. */
  parse_bad("allreduce,0,10,ring,ll,-1,-1,-1\n", "1:1", "unknown column 'allreduce'");
}

static void test_nul_byte(void **state) {
  (void)state;
  const char text[] = HEADER "allreduce,0,1\0,ring,ll,-1,-1,-1\n";
  struct mplane_tuner_table *t = NULL;
  char err[256];
  assert_int_equal(mplane_tuner_table_parse("t.csv", text, sizeof(text) - 1, &t, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "t.csv:2:14: NUL byte"));
}

static char logged[4096];
static int warn_count;
static void capture(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt, ...) {
  (void)flags;
  (void)file;
  (void)line;
  if (level == NCCL_LOG_WARN) warn_count++;
  va_list ap;
  va_start(ap, fmt);
  size_t used = strlen(logged);
  vsnprintf(logged + used, sizeof(logged) - used, fmt, ap);
  va_end(ap);
  used = strlen(logged);
  if (used + 1 < sizeof(logged)) strcat(logged, "\n");
}

static void test_overlap_warns_once_naming_both_lines(void **state) {
  (void)state;
  struct mplane_tuner_table *t = parse_ok(HEADER
                                          "allreduce,0,4096,ring,ll,-1,1,8\n"       /* line 2 */
                                          "allreduce,8192,16384,ring,ll128,-1,1,8\n" /* line 3 */
                                          "allreduce,1024,8192,tree,ll,-1,-1,8\n"   /* line 4: overlaps 2 (and 3) */
                                          "allgather,0,4096,ring,ll,-1,1,8\n"       /* line 5: other collective */
                                          "allreduce,0,4096,ring,simple,-1,2,16\n"  /* line 6: other shape */
                                          "any,20000,30000,ring,simple,-1,-1,-1\n"  /* line 7: no size overlap */
                                          "broadcast,0,10000,ring,simple,-1,-1,-1\n"); /* line 8 */
  assert_int_equal(t->rows[2].overlaps_line, 2);
  assert_int_equal(t->rows[1].overlaps_line, 0);
  assert_int_equal(t->rows[3].overlaps_line, 0);
  assert_int_equal(t->rows[4].overlaps_line, 0);
  assert_int_equal(t->rows[5].overlaps_line, 0);
  assert_int_equal(t->rows[6].overlaps_line, 0);
  logged[0] = '\0';
  warn_count = 0;
  mplane_log_set_logger(capture);
  assert_int_equal(mplane_tuner_table_warn_overlaps(t), 1);
  assert_int_equal(warn_count, 1);
  assert_non_null(strstr(logged, "t.csv: line 4 overlaps line 2 (allreduce, 1024..4096 bytes); line 2 wins"));
  mplane_tuner_table_free(t);
}

static void test_load_file(void **state) {
  (void)state;
  struct mplane_tuner_table *t = NULL;
  char err[512] = "";
  assert_int_equal(mplane_tuner_table_load("/nonexistent/mplane-tuner.csv", &t, err, sizeof(err)), ncclInvalidArgument);
  assert_null(t);
  assert_non_null(strstr(err, "MPLANE_TUNER_CONFIG='/nonexistent/mplane-tuner.csv': cannot open"));

  char path[] = "/tmp/mplane-tuner-test-XXXXXX";
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  const char *text = HEADER "allreduce,0,1M,ring,simple,-1,-1,-1\nallreduce,2M,1M,ring,simple,-1,-1,-1\n";
  assert_int_equal(write(fd, text, strlen(text)), (ssize_t)strlen(text));
  close(fd);
  assert_int_equal(mplane_tuner_table_load(path, &t, err, sizeof(err)), ncclInvalidArgument);
  char want[128];
  snprintf(want, sizeof(want), "%s:3:11: min_bytes 2097152 is greater than max_bytes 1048576", path);
  if (strcmp(err, want) != 0) fail_msg("got '%s', want '%s'", err, want);
  unlink(path);
}

/* A FIFO (or a directory, a device) as MPLANE_TUNER_CONFIG blocked NCCL's init forever in fopen
 * (or read a device for nothing): only a regular file is read. The load runs in a child with a
 * deadline so that a hang fails this test instead of stalling it. */
static void load_expect_refused(const char *path, const char *kind) {
  int fds[2];
  assert_int_equal(pipe(fds), 0);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    signal(SIGSEGV, SIG_DFL); /* a crash ends the child, not cmocka's next test in it */
    signal(SIGABRT, SIG_DFL);
    struct mplane_tuner_table *t = NULL;
    char err[512] = "";
    ncclResult_t res = mplane_tuner_table_load(path, &t, err, sizeof(err));
    char msg[600];
    int n = snprintf(msg, sizeof(msg), "%d %s", (int)res, err);
    if (write(fds[1], msg, (size_t)n) < 0) _exit(2);
    _exit(0);
  }
  close(fds[1]);
  struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
  int ready = poll(&pfd, 1, 5000);
  char got[600] = "";
  if (ready > 0) {
    ssize_t k = read(fds[0], got, sizeof(got) - 1);
    got[k > 0 ? k : 0] = '\0';
  }
  close(fds[0]);
  if (ready <= 0) kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  if (ready <= 0) fail_msg("MPLANE_TUNER_CONFIG='%s' (%s): the load did not return within 5 s", path, kind);
  char want[700];
  snprintf(want, sizeof(want), "%d MPLANE_TUNER_CONFIG='%s' is not a regular file (%s)", (int)ncclInvalidArgument, path,
           kind);
  if (strncmp(got, want, strlen(want)) != 0) fail_msg("got '%s', want '%s...'", got, want);
}

static void test_load_refuses_non_regular_files(void **state) {
  (void)state;
  char dir[] = "/tmp/mplane-tuner-test-XXXXXX";
  assert_non_null(mkdtemp(dir));
  char fifo[64];
  snprintf(fifo, sizeof(fifo), "%s/table.fifo", dir);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  load_expect_refused(fifo, "a FIFO");
  load_expect_refused(dir, "a directory");
  load_expect_refused("/dev/zero", "a character device");
  unlink(fifo);
  rmdir(dir);
}

/* A spreadsheet's CSV export starts with a UTF-8 byte order mark: it is skipped, not read as part
 * of the first column's name ("unknown column"). Only at the very start of the file. */
static void test_utf8_bom(void **state) {
  (void)state;
  struct mplane_tuner_table *t = parse_ok("\xEF\xBB\xBF" HEADER "allreduce,0,1M,ring,simple,-1,-1,-1\n");
  assert_int_equal(t->nrows, 1);
  assert_int_equal(t->rows[0].line, 2);
  mplane_tuner_table_free(t);
  t = parse_ok("\xEF\xBB\xBF# exported\n" HEADER);
  assert_int_equal(t->nrows, 0);
  mplane_tuner_table_free(t);
  parse_bad(HEADER "\xEF\xBB\xBF" "allreduce,0,1M,ring,simple,-1,-1,-1\n", "2:1", "unknown collective");
  parse_bad("\xEF\xBB\xBF\xEF\xBB\xBF" HEADER, "1:1", "unknown column");
}

static void test_names(void **state) {
  (void)state;
  assert_string_equal(mplane_tuner_coll_name(ncclFuncAllReduce), "allreduce");
  assert_string_equal(mplane_tuner_coll_name(MPLANE_TUNER_ANY), "any");
  assert_string_equal(mplane_tuner_coll_name(7), "?");
  assert_string_equal(mplane_tuner_algo_name(NCCL_ALGO_NVLS_TREE), "nvls_tree");
  assert_string_equal(mplane_tuner_algo_name(7), "?");
  assert_string_equal(mplane_tuner_proto_name(NCCL_PROTO_LL128), "ll128");
  assert_string_equal(mplane_tuner_proto_name(-2), "?");
  assert_string_equal(mplane_tuner_proto_name(MPLANE_TUNER_NCCL_CHOICE), "NCCL's");
  assert_string_equal(mplane_tuner_algo_name(MPLANE_TUNER_NCCL_CHOICE), "NCCL's");
}

static void test_row_limit(void **state) {
  (void)state;
  size_t cap = strlen(HEADER) + (size_t)(MPLANE_TUNER_MAX_ROWS + 1) * 48;
  char *text = malloc(cap);
  assert_non_null(text);
  size_t off = (size_t)sprintf(text, HEADER);
  for (int i = 0; i <= MPLANE_TUNER_MAX_ROWS; i++)
    off += (size_t)sprintf(text + off, "allreduce,%d,%d,ring,ll,-1,-1,-1\n", i * 10, i * 10 + 9);
  struct mplane_tuner_table *t = NULL;
  char err[256];
  assert_int_equal(mplane_tuner_table_parse("t.csv", text, off, &t, err, sizeof(err)), ncclInvalidArgument);
  char want[64];
  snprintf(want, sizeof(want), "t.csv:%d: more than %d rows", MPLANE_TUNER_MAX_ROWS + 2, MPLANE_TUNER_MAX_ROWS);
  assert_string_equal(err, want);
  free(text);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_parse_channels_only),
      cmocka_unit_test(test_parse_full_table),
      cmocka_unit_test(test_header_any_order_and_empty_table),
      cmocka_unit_test(test_unknown_names),
      cmocka_unit_test(test_bad_numbers),
      cmocka_unit_test(test_min_greater_than_max),
      cmocka_unit_test(test_field_counts),
      cmocka_unit_test(test_bad_headers),
      cmocka_unit_test(test_nul_byte),
      cmocka_unit_test(test_overlap_warns_once_naming_both_lines),
      cmocka_unit_test(test_load_file),
      cmocka_unit_test(test_load_refuses_non_regular_files),
      cmocka_unit_test(test_utf8_bom),
      cmocka_unit_test(test_names),
      cmocka_unit_test(test_row_limit),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
