/* mplane topo tests: what the plugin does with the topology at init. Each scenario runs init in a
 * child process of its own (init runs once a process), with its own environment:
 *   - the transport's devices get planes from topo/ (a loopback device on a GPU node is on none;
 *     MPLANE_PLANES can put it on one);
 *   - NCCL_TOPO_FILE points at a memfd with the node's NCCL topology, unless the user set it,
 *     MPLANE_NCCL_TOPO=0, or the node has no GPU; an inherited stale /proc/self/fd value is replaced;
 *   - bad MPLANE_PLANES / MPLANE_TOPO_FILE fail init with a WARN that names them. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net/transport.h"
#include "plugin/net_core.h"
#include "plugin/topo_bind.h"
#include "topo/topo.h"
#include "topo_test_util.h"

#define CHECK(c)                                                        \
  do {                                                                  \
    if (!(c)) {                                                         \
      fprintf(stderr, "CHECK failed %s:%d: %s\n", __FILE__, __LINE__, #c); \
      _exit(1);                                                         \
    }                                                                   \
  } while (0)

static char tmpdir[256];

/* Run body in a child with env (NAME=VALUE strings, NULL-ended) applied; its stderr lands in
 * *log. Returns the child's exit code. */
static int in_child(const char *const *env, void (*body)(void), char **log) {
  char path[600];
  snprintf(path, sizeof(path), "%s/child-stderr.txt", tmpdir);
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0) _exit(3);
    dup2(fd, 2);
    close(fd);
    unsetenv("NCCL_TOPO_FILE");
    unsetenv("MPLANE_PLANES");
    unsetenv("MPLANE_NCCL_TOPO");
    unsetenv("CUDA_VISIBLE_DEVICES");
    setenv("MPLANE_TRANSPORT", "socket", 1);
    setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
    for (const char *const *e = env; e && *e; e++) putenv((char *)*e);
    body();
    _exit(0);
  }
  int st = 0;
  waitpid(pid, &st, 0);
  *log = slurp(path);
  if (!*log) *log = strdup("");
  int rc = WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
  if (rc != 0 && rc != 42) fprintf(stderr, "child exited %d, its stderr:\n%s\n", rc, *log);
  return rc;
}

static struct xt_node *topo_file_tree(void) {
  const char *path = getenv("NCCL_TOPO_FILE");
  CHECK(path != NULL);
  CHECK(strncmp(path, "/proc/self/fd/", 14) == 0);
  char *text = slurp(path);
  CHECK(text != NULL);
  char why[256];
  struct xt_node *root = xt_parse(text, why, sizeof(why));
  if (!root) fprintf(stderr, "%s\n%s", why, text);
  CHECK(root != NULL);
  free(text);
  return root;
}

static void body_memfd(void) {
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  int n = 0;
  CHECK(mplane_net_devices(&n) == ncclSuccess && n == 1);
  const struct mplane_dev_props *p;
  CHECK(mplane_net_get_properties(0, &p) == ncclSuccess);
  CHECK(strcmp(p->name, "lo") == 0);
  CHECK(p->plane == -1); /* a GPU node: loopback carries no GPU's traffic */
  CHECK(p->rail == -1);
  const struct mplane_topo *t = mplane_topo_node();
  CHECK(t != NULL && t->ngpus == 8);
  struct xt_node *root = topo_file_tree();
  struct xt_node *lo = xt_find(root, "net", "name", "lo");
  CHECK(lo != NULL);
  CHECK(strcmp(xt_attr(lo, "dev"), "0") == 0);
  CHECK(xt_attr(lo, "plane") == NULL);
  struct xt_node *m0 = xt_find(root, "net", "name", "mlx5_0");
  CHECK(m0 != NULL && strcmp(xt_attr(m0, "plane"), "0") == 0);
  struct xt_node *gpu = xt_find(root, "pci", "busid", "0000:1a:00.0");
  CHECK(gpu != NULL && gpu->parent == m0->parent->parent->parent);
  CHECK(xt_count(root, "net") == 10);
  xt_free(root);
}

static void body_planes(void) {
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  const struct mplane_dev_props *p;
  CHECK(mplane_net_get_properties(0, &p) == ncclSuccess);
  CHECK(p->plane == 4);
  CHECK(p->rail == 0);
  struct xt_node *root = topo_file_tree();
  struct xt_node *lo = xt_find(root, "net", "name", "lo");
  CHECK(lo && strcmp(xt_attr(lo, "plane"), "4") == 0 && strcmp(xt_attr(lo, "rail"), "0") == 0);
  struct xt_node *m0 = xt_find(root, "net", "name", "mlx5_0");
  CHECK(m0 && xt_attr(m0, "plane") == NULL); /* left out by MPLANE_PLANES */
  xt_free(root);
}

static void body_no_file(void) {
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  CHECK(getenv("NCCL_TOPO_FILE") == NULL);
}

static void body_user_file(void) {
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  CHECK(strcmp(getenv("NCCL_TOPO_FILE"), "/etc/my-topology.xml") == 0);
}

static void body_stale(void) {
  /* a value inherited from a parent: fd 9 here is /dev/null, not mplane's memfd */
  int fd = open("/dev/null", O_RDONLY);
  CHECK(fd >= 0);
  CHECK(dup2(fd, 9) == 9);
  setenv("NCCL_TOPO_FILE", "/proc/self/fd/9", 1);
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  CHECK(strcmp(getenv("NCCL_TOPO_FILE"), "/proc/self/fd/9") != 0);
  struct xt_node *root = topo_file_tree();
  CHECK(xt_find(root, "net", "name", "lo") != NULL);
  xt_free(root);
}

static void body_expect_fail(void) {
  ncclResult_t r = mplane_net_global_init(NULL);
  CHECK(r == ncclInvalidArgument);
  int n = -1;
  CHECK(mplane_net_devices(&n) == ncclSuccess && n == 0);
  CHECK(getenv("NCCL_TOPO_FILE") == NULL);
  _exit(42);
}

static void body_live(void) {
  /* this machine: whatever it has, init works and the device gets a plane (no GPU: all compute) */
  CHECK(mplane_net_global_init(NULL) == ncclSuccess);
  const struct mplane_dev_props *p;
  CHECK(mplane_net_get_properties(0, &p) == ncclSuccess);
  const struct mplane_topo *t = mplane_topo_node();
  CHECK(t != NULL);
  if (t->ngpus == 0) {
    CHECK(p->plane >= 0);
    CHECK(getenv("NCCL_TOPO_FILE") == NULL);
  }
}

static char fixture_env[1200];

static void test_plugin_memfd(void **state) {
  (void)state;
  const char *env[] = {fixture_env, NULL};
  char *log;
  assert_int_equal(in_child(env, body_memfd, &log), 0);
  free(log);
}

static void test_plugin_planes(void **state) {
  (void)state;
  const char *env[] = {fixture_env, "MPLANE_PLANES=lo=4", NULL};
  char *log;
  assert_int_equal(in_child(env, body_planes, &log), 0);
  free(log);
}

/* The value mplane-config --check accepts is the value init accepts: blanks around an entry are
 * part of MPLANE_PLANES' grammar (init once refused 'lo=4 ' after --check had passed it). */
static void test_plugin_planes_blanks(void **state) {
  (void)state;
  const char *values[] = {"MPLANE_PLANES=lo=4 ", "MPLANE_PLANES= lo = 4", "MPLANE_PLANES=lo=4\t"};
  for (size_t i = 0; i < sizeof(values) / sizeof(values[0]); i++) {
    const char *env[] = {fixture_env, values[i], NULL};
    char *log;
    if (in_child(env, body_planes, &log) != 0) fail_msg("%s: init failed: %s", values[i], log);
    free(log);
  }
}

static void test_plugin_nccl_topo_off(void **state) {
  (void)state;
  const char *env[] = {fixture_env, "MPLANE_NCCL_TOPO=0", NULL};
  char *log;
  assert_int_equal(in_child(env, body_no_file, &log), 0);
  free(log);
  const char *env2[] = {fixture_env, "NCCL_TOPO_FILE=/etc/my-topology.xml", "MPLANE_DEBUG=1", NULL};
  assert_int_equal(in_child(env2, body_user_file, &log), 0);
  assert_non_null(strstr(log, "NCCL_TOPO_FILE=/etc/my-topology.xml is set; mplane leaves it"));
  free(log);
  const char *env3[] = {fixture_env, NULL};
  assert_int_equal(in_child(env3, body_stale, &log), 0);
  free(log);
}

static void test_plugin_bad_input(void **state) {
  (void)state;
  char *log;
  const char *env[] = {fixture_env, "MPLANE_PLANES=lo=0,mlx5_42=1", NULL};
  assert_int_equal(in_child(env, body_expect_fail, &log), 42);
  assert_non_null(strstr(log, "WARN"));
  assert_non_null(strstr(log, "MPLANE_PLANES='lo=0,mlx5_42=1' names NIC 'mlx5_42', which this node does not have"));
  free(log);
  const char *env2[] = {"MPLANE_TOPO_FILE=/nonexistent/topo.xml", NULL};
  assert_int_equal(in_child(env2, body_expect_fail, &log), 42);
  assert_non_null(strstr(log, "MPLANE_TOPO_FILE='/nonexistent/topo.xml' cannot be read"));
  free(log);
  const char *env3[] = {fixture_env, "MPLANE_PLANES=lo=0,lo:1=2", NULL};
  assert_int_equal(in_child(env3, body_expect_fail, &log), 42);
  assert_non_null(strstr(log, "names NIC lo twice"));
  free(log);
}

static void test_plugin_live(void **state) {
  (void)state;
  char *log;
  const char *env[] = {"MPLANE_DEBUG=1", NULL};
  assert_int_equal(in_child(env, body_live, &log), 0);
  assert_non_null(strstr(log, "topo: "));
  free(log);
}

static int setup(void **state) {
  (void)state;
  snprintf(fixture_env, sizeof(fixture_env), "MPLANE_TOPO_FILE=%s", fixture("h800-8gpu-8nic.xml"));
  return tmpdir_make(tmpdir, sizeof(tmpdir), "mplane-topo-plugin");
}

static int teardown(void **state) {
  (void)state;
  return tmpdir_remove(tmpdir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_plugin_memfd),         cmocka_unit_test(test_plugin_planes),
      cmocka_unit_test(test_plugin_planes_blanks), cmocka_unit_test(test_plugin_nccl_topo_off),
      cmocka_unit_test(test_plugin_bad_input),
      cmocka_unit_test(test_plugin_live),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
