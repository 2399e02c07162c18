/* mplane topo tests: the mplane-topo command on every fixture (table, picture, --json, --nccl-topo,
 * --nccl-env) and its errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "topo_test_util.h"

static char tmpdir[256];

/* Run mplane-topo with args (and env assignments before it); stdout+stderr in *out, exit code back. */
static int run(const char *env, const char *args, char **out) {
  const char *exe = getenv("TOPO_EXE");
  assert_non_null(exe);
  char cmd[4096];
  snprintf(cmd, sizeof(cmd), "env -u MPLANE_PLANES -u MPLANE_TOPO_FILE -u CUDA_VISIBLE_DEVICES %s '%s' %s 2>&1",
           env ? env : "", exe, args);
  FILE *p = popen(cmd, "r");
  assert_non_null(p);
  size_t cap = 65536, len = 0;
  char *buf = malloc(cap);
  size_t k;
  while ((k = fread(buf + len, 1, cap - len - 1, p)) > 0) {
    len += k;
    if (cap - len < 2) buf = realloc(buf, cap *= 2);
  }
  buf[len] = '\0';
  int st = pclose(p);
  *out = buf;
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void gpu_row(const char *out, const char *busid, const char *nic, const char *link, const char *plane) {
  char line[512], tok[16][64];
  if (!line_with(out, busid, NULL, NULL, line, sizeof(line))) fprintf(stderr, "no row for %s in:\n%s", busid, out);
  assert_true(line_with(out, busid, NULL, NULL, line, sizeof(line)));
  int n = tokens(line, tok, 16);
  assert_true(n >= 7);
  assert_string_equal(tok[n - 3], nic);
  assert_string_equal(tok[n - 2], link);
  assert_string_equal(tok[n - 1], plane);
}

static void test_cli_table_each_fixture(void **state) {
  (void)state;
  char args[1200], *out;
  snprintf(args, sizeof(args), "--topo '%s'", fixture("h800-8gpu-8nic.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  gpu_row(out, "0000:1a:00.0", "mlx5_0", "PIX", "0");
  gpu_row(out, "0000:c0:00.0", "mlx5_7", "PIX", "7");
  assert_true(line_with(out, "mlx5_8 ", "storage/front-end", NULL, NULL, 0));
  assert_true(line_with(out, "GPU3 ", "--PIX-->", "mlx5_3 ==== plane 3", NULL, 0));
  assert_non_null(strstr(out, "8 planes from PCI order"));
  free(out);

  snprintf(args, sizeof(args), "--topo '%s'", fixture("a100-8gpu-4nic.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  gpu_row(out, "0000:24:00.0", "mlx5_1", "PIX", "1");
  assert_non_null(strstr(out, "4 planes from PCI order"));
  free(out);

  snprintf(args, sizeof(args), "--topo '%s'", fixture("a100-pcie-1nic-cpu.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  gpu_row(out, "0000:43:00.0", "mlx5_0", "NODE", "0");
  gpu_row(out, "0000:a3:00.0", "mlx5_0", "SYS", "0");
  assert_non_null(strstr(out, "1 plane from PCI order"));
  free(out);

  snprintf(args, sizeof(args), "--topo '%s'", fixture("cpu-2nic-nogpu.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  assert_non_null(strstr(out, "0 GPUs, 2 NICs"));
  assert_true(line_with(out, "ens1f0 ", "ethernet", "compute", NULL, 0));
  free(out);

  /* MPLANE_TOPO_FILE works as --topo does, and MPLANE_PLANES and CUDA_VISIBLE_DEVICES reach it */
  char env[1200];
  snprintf(env, sizeof(env), "MPLANE_TOPO_FILE='%s' MPLANE_PLANES=mlx5_1=0,mlx5_0=1 CUDA_VISIBLE_DEVICES=1",
           fixture("a100-8gpu-4nic.xml"));
  assert_int_equal(run(env, "", &out), 0);
  gpu_row(out, "0000:13:00.0", "mlx5_0", "PIX", "1");
  gpu_row(out, "0000:23:00.0", "mlx5_1", "PIX", "0");
  assert_non_null(strstr(out, "2 planes from MPLANE_PLANES"));
  assert_non_null(strstr(out, "CUDA_VISIBLE_DEVICES=1"));
  free(out);
}

static void test_cli_json(void **state) {
  (void)state;
  const char *fx[4] = {"h800-8gpu-8nic.xml", "a100-8gpu-4nic.xml", "a100-pcie-1nic-cpu.xml", "cpu-2nic-nogpu.xml"};
  for (int i = 0; i < 4; i++) {
    char args[1200], *out, why[256];
    snprintf(args, sizeof(args), "--json --topo '%s'", fixture(fx[i]));
    assert_int_equal(run(NULL, args, &out), 0);
    if (json_check(out, why, sizeof(why))) fprintf(stderr, "%s: %s\n%s", fx[i], why, out);
    assert_int_equal(json_check(out, why, sizeof(why)), 0);
    assert_null(strstr(out, "Planes:")); /* JSON only */
    free(out);
  }
}

static void test_cli_nccl_topo_and_env(void **state) {
  (void)state;
  char args[1400], path[600], *out, why[256];
  snprintf(path, sizeof(path), "%s/nccl.xml", tmpdir);
  snprintf(args, sizeof(args), "--topo '%s' --nccl-topo '%s'", fixture("a100-8gpu-4nic.xml"), path);
  assert_int_equal(run(NULL, args, &out), 0);
  assert_non_null(strstr(out, "wrote"));
  assert_non_null(strstr(out, "0000:13:00.0")); /* the table still printed */
  free(out);
  char *xml = slurp(path);
  assert_non_null(xml);
  struct xt_node *root = xt_parse(xml, why, sizeof(why));
  assert_non_null(root);
  assert_int_equal(xt_count(root, "net"), 4);
  struct xt_node *gpu = xt_find(root, "pci", "busid", "0000:14:00.0");
  struct xt_node *net = xt_find(root, "net", "name", "mlx5_0");
  assert_non_null(gpu);
  assert_non_null(net);
  assert_ptr_equal(gpu->parent, net->parent->parent->parent);
  xt_free(root);
  free(xml);
  /* '-' writes it to stdout, alone */
  snprintf(args, sizeof(args), "--topo '%s' --nccl-topo -", fixture("h800-8gpu-8nic.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  root = xt_parse(out, why, sizeof(why));
  if (!root) fprintf(stderr, "%s\n%s", why, out);
  assert_non_null(root);
  assert_int_equal(xt_count(root, "net"), 9);
  xt_free(root);
  free(out);

  snprintf(args, sizeof(args), "--topo '%s' --nccl-env", fixture("h800-8gpu-8nic.xml"));
  assert_int_equal(run(NULL, args, &out), 0);
  assert_true(line_with(out, "export NCCL_CROSS_NIC=0", "#", NULL, NULL, 0));
  assert_true(line_with(out, "export NCCL_PXN_DISABLE=0", "#", NULL, NULL, 0));
  assert_true(line_with(out, "export MPLANE_PLANES=mlx5_0=0", NULL, NULL, NULL, 0));
  /* each export line says why */
  for (const char *p = out; (p = strstr(p, "\nexport ")) != NULL; p++) {
    const char *nl = strchr(p + 1, '\n');
    const char *hash = strchr(p + 1, '#');
    if (strncmp(p, "\nexport MPLANE_PLANES", 21) == 0) continue; /* its reason is the next line */
    assert_true(hash && (!nl || hash < nl));
  }
  free(out);
}

static void test_cli_errors(void **state) {
  (void)state;
  char args[1200], env[1200], *out;
  assert_int_equal(run(NULL, "--topo /nonexistent/node.xml", &out), 1);
  assert_non_null(strstr(out, "--topo='/nonexistent/node.xml' cannot be read"));
  free(out);
  assert_int_equal(run("MPLANE_TOPO_FILE=/nonexistent/x.xml", "", &out), 1);
  assert_non_null(strstr(out, "MPLANE_TOPO_FILE='/nonexistent/x.xml' cannot be read"));
  free(out);
  snprintf(args, sizeof(args), "--topo '%s'", fixture("h800-8gpu-8nic.xml"));
  assert_int_equal(run("MPLANE_PLANES=mlx5_0=0,mlx5_42=1", args, &out), 1);
  assert_non_null(strstr(out, "names NIC 'mlx5_42', which this node does not have"));
  free(out);
  assert_int_equal(run("MPLANE_PLANES=mlx5_0=0,mlx5_0=1", args, &out), 2);
  assert_non_null(strstr(out, "MPLANE_PLANES='mlx5_0=0,mlx5_0=1' is not valid"));
  free(out);
  snprintf(env, sizeof(env), "%s/garbage.xml", tmpdir);
  FILE *f = fopen(env, "w");
  fputs("<topology version=\"2.0\"><object type=\"Machine\"", f);
  fclose(f);
  snprintf(args, sizeof(args), "--topo '%s'", env);
  assert_int_equal(run(NULL, args, &out), 1);
  assert_non_null(strstr(out, "not a valid hwloc XML topology"));
  free(out);
  assert_int_equal(run(NULL, "--bogus", &out), 2);
  assert_non_null(strstr(out, "usage: mplane-topo"));
  free(out);
  assert_int_equal(run(NULL, "--help", &out), 0);
  assert_non_null(strstr(out, "--nccl-env"));
  free(out);
}

static void test_cli_live(void **state) {
  (void)state;
  /* This machine, whatever it has: the command must answer and say what it found. */
  char *out, why[256];
  assert_int_equal(run(NULL, "", &out), 0);
  assert_non_null(strstr(out, "from "));
  assert_non_null(strstr(out, "RDMA NICs:"));
  free(out);
  assert_int_equal(run(NULL, "--json", &out), 0);
  assert_int_equal(json_check(out, why, sizeof(why)), 0);
  free(out);
}

static int setup(void **state) {
  (void)state;
  return tmpdir_make(tmpdir, sizeof(tmpdir), "mplane-topo-cli");
}

static int teardown(void **state) {
  (void)state;
  return tmpdir_remove(tmpdir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cli_table_each_fixture), cmocka_unit_test(test_cli_json),
      cmocka_unit_test(test_cli_nccl_topo_and_env),  cmocka_unit_test(test_cli_errors),
      cmocka_unit_test(test_cli_live),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
