/* mplane topo tests: untrusted input. An hwloc XML file (MPLANE_TOPO_FILE, mplane-topo --topo) is
 * whatever a user hands us, and sysfs text is whatever a driver (or a container's fake /sys)
 * writes: discovery must end, stay in bounds and never take the process down; a file it cannot
 * use is refused with a message naming the variable and the path.
 *
 * Each case runs in a child process with a deadline (run_bounded), so that a hang or a crash is
 * reported as this test's failure instead of ending the whole test program. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "net/transport.h"
#include "common/config.h"
#include "plugin/topo_bind.h"
#include "topo/topo.h"
#include "topo/topo_internal.h"
#include "topo_test_util.h"

static char tmpdir[256];

/* One GPU and one IB NIC under a PCIe switch (0000:18:00.0 -> 0000:19:00.0 / 0000:19:01.0). */
static const char small_xml[] =
    "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
    "<!DOCTYPE topology SYSTEM \"hwloc2.dtd\">\n"
    "<topology version=\"2.0\">\n"
    "  <object type=\"Machine\" os_index=\"0\" cpuset=\"0x00000003\" complete_cpuset=\"0x00000003\" allowed_cpuset=\"0x00000003\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" allowed_nodeset=\"0x00000001\" gp_index=\"1\">\n"
    "    <info name=\"HostName\" value=\"fuzz-node\"/>\n"
    "    <info name=\"Architecture\" value=\"x86_64\"/>\n"
    "    <object type=\"Package\" os_index=\"0\" cpuset=\"0x00000003\" complete_cpuset=\"0x00000003\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"2\">\n"
    "      <info name=\"CPUVendor\" value=\"GenuineIntel\"/>\n"
    "      <info name=\"CPUFamilyNumber\" value=\"6\"/>\n"
    "      <info name=\"CPUModelNumber\" value=\"143\"/>\n"
    "      <object type=\"NUMANode\" os_index=\"0\" cpuset=\"0x00000003\" complete_cpuset=\"0x00000003\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"3\" local_memory=\"1073741824\"/>\n"
    "      <object type=\"PU\" os_index=\"0\" cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"4\"/>\n"
    "      <object type=\"PU\" os_index=\"1\" cpuset=\"0x00000002\" complete_cpuset=\"0x00000002\" nodeset=\"0x00000001\" complete_nodeset=\"0x00000001\" gp_index=\"5\"/>\n"
    "      <object type=\"Bridge\" gp_index=\"6\" bridge_type=\"0-1\" depth=\"0\" bridge_pci=\"0000:[18-1a]\">\n"
    "        <object type=\"Bridge\" gp_index=\"7\" bridge_type=\"1-1\" depth=\"0\" bridge_pci=\"0000:[19-1a]\" pci_busid=\"0000:18:00.0\" pci_type=\"0604 [1000:c030] [0000:0000] 00\">\n"
    "          <object type=\"Bridge\" gp_index=\"8\" bridge_type=\"1-1\" depth=\"1\" bridge_pci=\"0000:[1a-1a]\" pci_busid=\"0000:19:00.0\" pci_type=\"0604 [1000:c030] [0000:0000] 00\">\n"
    "            <object type=\"PCIDev\" gp_index=\"9\" pci_busid=\"0000:1a:00.0\" pci_type=\"0302 [10de:2330] [10de:16c1] a1\">\n"
    "              <info name=\"PCIDevice\" value=\"H100\"/>\n"
    "            </object>\n"
    "          </object>\n"
    "          <object type=\"Bridge\" gp_index=\"10\" bridge_type=\"1-1\" depth=\"1\" bridge_pci=\"0000:[1b-1b]\" pci_busid=\"0000:19:01.0\" pci_type=\"0604 [1000:c030] [0000:0000] 00\">\n"
    "            <object type=\"PCIDev\" gp_index=\"11\" pci_busid=\"0000:1b:00.0\" pci_type=\"0207 [15b3:1021] [15b3:0023] 00\">\n"
    "              <object type=\"OSDev\" gp_index=\"12\" name=\"mlx5_0\" osdev_type=\"3\">\n"
    "                <info name=\"NodeGUID\" value=\"a088:c203:0012:3456\"/>\n"
    "                <info name=\"Port1State\" value=\"4\"/>\n"
    "                <info name=\"Port1GID0\" value=\"fec0:0000:0000:0001:a288:c2ff:fe12:3456\"/>\n"
    "              </object>\n"
    "              <object type=\"OSDev\" gp_index=\"13\" name=\"ibp27s0\" osdev_type=\"2\">\n"
    "                <info name=\"Address\" value=\"00:00:10:29:fe:80:00:00:00:00:00:00:a0:88:c2:03:00:12:34:56\"/>\n"
    "              </object>\n"
    "            </object>\n"
    "          </object>\n"
    "        </object>\n"
    "      </object>\n"
    "    </object>\n"
    "  </object>\n"
    "</topology>\n";

/* small_xml with every occurrence of from replaced by to, written to tmpdir/name. */
static const char *write_variant(const char *name, const char *from, const char *to) {
  static char paths[8][512];
  static int next;
  char *path = paths[next++ % 8];
  snprintf(path, 512, "%s/%s", tmpdir, name);
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  size_t fl = from ? strlen(from) : 0;
  for (const char *p = small_xml; *p;) {
    const char *hit = fl ? strstr(p, from) : NULL;
    if (!hit) {
      fputs(p, f);
      break;
    }
    fwrite(p, 1, (size_t)(hit - p), f);
    fputs(to, f);
    p = hit + fl;
  }
  fclose(f);
  return path;
}

/* ------------------------------------------------------------------ a child with a deadline */

struct outcome {
  int finished;  /* the case returned (set by run_bounded) */
  int res;       /* what the case reports, usually an ncclResult_t */
  int walks_end; /* every PCI parent walk of the model ended */
  int ngpus, nnics, nnuma, speed;
  char text[2048]; /* an error message, an affinity, ... */
  char text2[256];
};

typedef void (*bounded_fn)(const void *arg, struct outcome *o);

/* Run fn in a child; fail the test if it does not return within seconds or dies of a signal. */
static void run_bounded(const char *what, bounded_fn fn, const void *arg, int seconds, struct outcome *out) {
  struct outcome *o = mmap(NULL, sizeof(*o), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
  assert_true(o != MAP_FAILED);
  memset(o, 0, sizeof(*o));
  fflush(stdout);
  fflush(stderr);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    /* a crash ends the child (cmocka's handlers would carry on with the next test in it) */
    const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
    for (size_t i = 0; i < sizeof(fatal) / sizeof(fatal[0]); i++) signal(fatal[i], SIG_DFL);
    fn(arg, o);
    o->finished = 1;
    _exit(0);
  }
  int status = 0, done = 0;
  for (int i = 0; i < seconds * 100 && !done; i++) {
    done = waitpid(pid, &status, WNOHANG) == pid;
    if (!done) usleep(10000);
  }
  if (!done) {
    kill(pid, SIGKILL);
    waitpid(pid, &status, 0);
    munmap(o, sizeof(*o));
    fail_msg("%s: did not finish within %d s (killed)", what, seconds);
  }
  if (WIFSIGNALED(status)) {
    munmap(o, sizeof(*o));
    fail_msg("%s: the process died of signal %d (%s)", what, WTERMSIG(status), strsignal(WTERMSIG(status)));
  }
  *out = *o;
  munmap(o, sizeof(*o));
  assert_true(out->finished);
}

/* Every parent walk ends: following parent from any PCI node reaches -1 within npci steps. */
static int parent_walks_end(const struct mplane_topo *t) {
  for (int i = 0; i < t->npci; i++) {
    int b = i, steps = 0;
    while (b >= 0 && steps <= t->npci) {
      if (b >= t->npci) return 0;
      b = t->pci[b].parent;
      steps++;
    }
    if (b >= 0) return 0;
  }
  return 1;
}

/* Load arg (an XML path) the way the plugin does; report the model's shape or the error. */
static void load_file_case(const void *arg, struct outcome *o) {
  struct mplane_topo_options opts = {.xml_path = arg, .xml_input = "MPLANE_TOPO_FILE"};
  struct mplane_topo *t = NULL;
  o->res = mplane_topo_load(&opts, &t, o->text, sizeof(o->text));
  if (o->res != ncclSuccess) return;
  o->walks_end = parent_walks_end(t);
  o->ngpus = t->ngpus;
  o->nnics = t->nnics;
  o->nnuma = t->nnuma;
  snprintf(o->text2, sizeof(o->text2), "%s", t->all_cpus);
  /* what the plugin and mplane-topo do next: link classes, the NCCL XML, the reports */
  if (t->ngpus > 0 && t->nnics > 0) mplane_topo_gpu_nic_link(t, 0, 0);
  FILE *devnull = fopen("/dev/null", "w");
  if (devnull) {
    mplane_topo_write_nccl_xml(t, devnull);
    mplane_topo_print_table(t, devnull);
    mplane_topo_print_picture(t, devnull);
    fclose(devnull);
  }
  mplane_topo_free(t);
}

/* ------------------------------------------------------------------ hwloc XML */

static void test_small_node(void **state) {
  (void)state;
  struct outcome o;
  run_bounded("small node", load_file_case, write_variant("small.xml", NULL, NULL), 20, &o);
  if (o.res != ncclSuccess) fail_msg("%s", o.text);
  assert_int_equal(o.ngpus, 1);
  assert_int_equal(o.nnics, 1);
  assert_true(o.walks_end);
  assert_string_equal(o.text2, "00000003");
}

/* D2: a bridge listing its parent's bus id made itself its own parent, and the parent walk (NCCL
 * XML, link classes) never ended. */
static void test_repeated_busid_ends(void **state) {
  (void)state;
  struct outcome o;
  const char *cases[][2] = {
      {"pci_busid=\"0000:19:00.0\"", "pci_busid=\"0000:18:00.0\""}, /* child bridge = its parent */
      {"pci_busid=\"0000:1a:00.0\"", "pci_busid=\"0000:19:00.0\""}, /* GPU = the bridge above it */
      {"pci_busid=\"0000:19:01.0\"", "pci_busid=\"0000:19:00.0\""}, /* two sibling bridges */
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *path = write_variant("repeated-busid.xml", cases[i][0], cases[i][1]);
    run_bounded(cases[i][1], load_file_case, path, 20, &o);
    if (o.res != ncclSuccess) fail_msg("%s -> %s: %s", cases[i][0], cases[i][1], o.text);
    assert_true(o.walks_end);
    assert_int_equal(o.nnics, 1);
  }
}

/* D3: an infinite cpuset ("0xf...f") asserted in hwloc_bitmap_foreach (debug builds) or walked
 * 2^32 CPUs (release builds). */
static void test_infinite_cpuset(void **state) {
  (void)state;
  struct outcome o;
  run_bounded("infinite cpusets", load_file_case, write_variant("infinite.xml", "cpuset=\"0x00000003\"",
                                                                "cpuset=\"0xf...f\""),
              20, &o);
  if (o.res != ncclSuccess) fail_msg("%s", o.text);
  assert_int_equal(o.ngpus, 1);
  assert_true(strlen(o.text2) > 0 && strlen(o.text2) < 256);
}

/* D4: malformed cpuset attributes crash hwloc 2.9 itself: a NULL dereference (a Machine without
 * complete_cpuset), a failed assertion in hwloc_bitmap_sscanf (allowed_cpuset=",1"), a read past
 * the end of an empty one (cpuset=""). A bitmap attribute lstopo would not write is refused before
 * hwloc sees it; whatever else crashes hwloc does so in a check process, and the file is refused;
 * this process lives on either way. */
static void test_hwloc_crash_refused(void **state) {
  (void)state;
  const char *cases[][2] = {
      {" complete_cpuset=\"0x00000003\" allowed_cpuset", " allowed_cpuset"},
      {"allowed_cpuset=\"0x00000003\"", "allowed_cpuset=\",1\""},
      {"cpuset=\"0x00000002\" complete_cpuset=\"0x00000002\"", "cpuset=\",,ffffffff \" complete_cpuset=\"0x2\""},
      {"cpuset=\"0x00000001\" complete_cpuset=\"0x00000001\"", "cpuset=\"\" complete_cpuset=\"0x00000001\""},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    const char *path = write_variant("crashes-hwloc.xml", cases[i][0], cases[i][1]);
    struct outcome o;
    run_bounded(cases[i][1], load_file_case, path, 30, &o);
    if (o.res != ncclInvalidArgument) fail_msg("%s: result %d (%s), expected ncclInvalidArgument", cases[i][1], o.res, o.text);
    char want[600];
    snprintf(want, sizeof(want), "MPLANE_TOPO_FILE='%s'", path);
    if (!strstr(o.text, want)) fail_msg("message does not name the variable and the file: %s", o.text);
    if (i > 0 && !strstr(o.text, "is not a bitmap as lstopo writes one")) fail_msg("not refused by form: %s", o.text);
    print_message("refused: %s\n", o.text);
  }
}

/* The check process names a crash of hwloc (where this hwloc crashes on the file at all). */
static void test_check_process_names_crash(void **state) {
  (void)state;
  const char *path = write_variant("crashes-hwloc.xml", " complete_cpuset=\"0x00000003\" allowed_cpuset", " allowed_cpuset");
  char *text = slurp(path);
  assert_non_null(text);
  char why[256] = "";
  int rc = mplane_topo_xml_check(text, strlen(text), 10000, 0, why, sizeof(why));
  if (rc < 0) {
    assert_non_null(strstr(why, "crashed hwloc (signal"));
    struct outcome o;
    run_bounded("crashing file", load_file_case, path, 30, &o);
    assert_int_equal(o.res, ncclInvalidArgument);
    assert_non_null(strstr(o.text, "was refused: loading it crashed hwloc (signal"));
  } else {
    print_message("this hwloc does not crash on the file (check: %d)\n", rc);
  }
  free(text);
}

/* The plugin's init says so in a WARN and fails (NCCL falls back), naming the variable and path. */
static void plugin_init_case(const void *arg, struct outcome *o) {
  char errpath[600];
  snprintf(errpath, sizeof(errpath), "%s/plugin-stderr.txt", tmpdir);
  int fd = open(errpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) return;
  dup2(fd, 2);
  close(fd);
  struct mplane_config cfg;
  char err[512];
  unsetenv("MPLANE_TOPO_FILE");
  if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) return;
  snprintf(cfg.topo_file, sizeof(cfg.topo_file), "%s", (const char *)arg);
  cfg.nccl_topo = 0;
  struct mplane_dev_props props = {.name = "mlx5_0:1", .plane = -1};
  o->res = mplane_topo_plugin_init(&cfg, &props, 1);
  fflush(stderr);
  char *said = slurp(errpath);
  if (said) snprintf(o->text, sizeof(o->text), "%s", said);
  free(said);
}

static void test_plugin_warns_refused_file(void **state) {
  (void)state;
  const char *path = write_variant("plugin-crashes-hwloc.xml", " complete_cpuset=\"0x00000003\" allowed_cpuset",
                                   " allowed_cpuset");
  struct outcome o;
  run_bounded("plugin init", plugin_init_case, path, 30, &o);
  assert_int_equal(o.res, ncclInvalidArgument);
  char want[700];
  snprintf(want, sizeof(want), "WARN MPLANE_TOPO_FILE='%s' was refused", path);
  if (!strstr(o.text, want)) fail_msg("no WARN '%s' in: %s", want, o.text);
}

/* D17: a FIFO (or any file that is not a regular one) as MPLANE_TOPO_FILE blocked init forever. */
static void test_not_regular_file_refused(void **state) {
  (void)state;
  char fifo[600], dir[600];
  snprintf(fifo, sizeof(fifo), "%s/topo.fifo", tmpdir);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  snprintf(dir, sizeof(dir), "%s/topo.dir", tmpdir);
  assert_int_equal(mkdir(dir, 0700), 0);
  const char *paths[][2] = {{fifo, "(a FIFO)"}, {dir, "(a directory)"}, {"/dev/null", "(a character device)"}};
  for (size_t i = 0; i < 3; i++) {
    struct outcome o;
    run_bounded(paths[i][0], load_file_case, paths[i][0], 10, &o);
    assert_int_equal(o.res, ncclInvalidArgument);
    char want[700];
    snprintf(want, sizeof(want), "MPLANE_TOPO_FILE='%s' is not a regular file %s", paths[i][0], paths[i][1]);
    if (!strstr(o.text, want)) fail_msg("expected '%s' in: %s", want, o.text);
  }
}

/* The check process on its own: a good buffer loads, a broken one is refused, a crash is named. */
static void test_check_process(void **state) {
  (void)state;
  char why[256];
  assert_int_equal(mplane_topo_xml_check(small_xml, strlen(small_xml), 10000, 1, why, sizeof(why)), 0);
  const char junk[] = "<?xml version=\"1.0\"?><topology version=\"2.0\"><object type=";
  assert_int_equal(mplane_topo_xml_check(junk, strlen(junk), 10000, 1, why, sizeof(why)), 1);
}

/* ------------------------------------------------------------------ sysfs text */

static void sysfs_case(const void *arg, struct outcome *o) {
  struct mplane_topo_options opts = {.sysfs_root = arg, .force_sysfs = 1};
  struct mplane_topo *t = NULL;
  o->res = mplane_topo_load(&opts, &t, o->text, sizeof(o->text));
  if (o->res != ncclSuccess) return;
  o->nnuma = t->nnuma;
  o->nnics = t->nnics;
  o->speed = t->nnics > 0 ? t->nics[0].speed_mbps : -7;
  snprintf(o->text, sizeof(o->text), "%s", t->nnuma > 0 ? t->numa[0].affinity : "(no numa)");
  snprintf(o->text2, sizeof(o->text2), "%s", t->all_cpus);
  mplane_topo_free(t);
}

/* D14: sysfs text is bounded: a cpulist of 9223372036854775807 overflowed a signed counter, and
 * an IB rate of 1e12 Gb/s overflowed the float-to-int conversion of the speed. Both are now no
 * CPU and no speed (unknown), with no undefined arithmetic. */
static const char *huge_sysfs_root(void) {
  static char root[512];
  snprintf(root, sizeof(root), "%s/sysroot-huge", tmpdir);
  if (access(root, F_OK) == 0) return root;
  mkdir(root, 0755);
  sysfs_mkfile(root, "sys/bus/pci/x", "");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0", "0x060400\n", "0x8086\n", "0\n");
  sysfs_mkpci(root, "pci0000:10/0000:10:01.0/0000:11:00.0", "0x020700\n", "0x15b3\n", "99999999999999999999\n");
  sysfs_mkfile(root, "sys/devices/pci0000:10/0000:10:01.0/0000:11:00.0/infiniband/mlx5_0/x", "");
  sysfs_mkfile(root, "sys/class/infiniband/mlx5_0/ports/1/gids/0", "fe80:0000:0000:0000:a088:c203:00aa:bb01\n");
  sysfs_mkfile(root, "sys/class/infiniband/mlx5_0/ports/1/rate", "1e12 Gb/sec (4X NDR)\n");
  sysfs_mkfile(root, "sys/devices/system/node/node0/cpulist", "9223372036854775807\n");
  sysfs_mkfile(root, "sys/devices/system/cpu/online", "0-9223372036854775807\n");
  return root;
}

static void test_sysfs_cpulist_bounded(void **state) {
  (void)state;
  struct outcome o;
  run_bounded("huge sysfs cpulists", sysfs_case, huge_sysfs_root(), 20, &o);
  if (o.res != ncclSuccess) fail_msg("%s", o.text);
  assert_int_equal(o.nnuma, 1);
  assert_string_equal(o.text, "00000000");  /* node0: no CPU it can trust */
  assert_string_equal(o.text2, "00000000"); /* online: likewise */
}

static void test_sysfs_ib_rate_bounded(void **state) {
  (void)state;
  struct outcome o;
  run_bounded("huge IB rate", sysfs_case, huge_sysfs_root(), 20, &o);
  if (o.res != ncclSuccess) fail_msg("%s", o.text);
  assert_int_equal(o.nnics, 1);
  assert_int_equal(o.speed, 0); /* unknown, not INT_MIN */
}

static void test_cpulist_parser(void **state) {
  (void)state;
  static int cpus[8192];
  struct {
    const char *text;
    int n, first, last;
  } cases[] = {
      {"0-3,8,10-11", 7, 0, 11},
      {"5", 1, 5, 5},
      {"0-65535", 8192, 0, 8191}, /* capped at the caller's room */
      {"", 0, 0, 0},
      {"9223372036854775807", 0, 0, 0},
      {"0-9223372036854775807", 0, 0, 0},
      {"65536", 0, 0, 0},
      {"3-1", 0, 0, 0},
      {"-1", 0, 0, 0},
      {"1,", 0, 0, 0},
      {"1,,2", 0, 0, 0},
      {"1-", 0, 0, 0},
      {"+1", 0, 0, 0},
      {" 1", 0, 0, 0},
      {"1 2", 0, 0, 0},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    int n = mplane_topo_parse_cpulist(cases[i].text, cpus, 8192);
    if (n != cases[i].n) fail_msg("cpulist '%s': %d CPUs, expected %d", cases[i].text, n, cases[i].n);
    if (n > 0) {
      assert_int_equal(cpus[0], cases[i].first);
      assert_int_equal(cpus[n - 1], cases[i].last);
    }
  }
}

static void test_ib_rate_parser(void **state) {
  (void)state;
  struct {
    const char *text;
    int mbps;
  } cases[] = {
      {"400 Gb/sec (4X NDR)", 400000},
      {"2.5 Gb/sec (1X SDR)", 2500},
      {"53.125 Gb/sec (1X HDR)", 53125},
      {"14.0625 Gb/sec (1X FDR)", 14062},
      {"10000 Gb/sec", 10000000},
      {"10001 Gb/sec", 0},
      {"1e12 Gb/sec", 0},
      {"1000000000000 Gb/sec", 0},
      {"99999999999999999999999", 0},
      {"nan Gb/sec", 0},
      {"inf", 0},
      {"-5 Gb/sec", 0},
      {"0 Gb/sec", 0},
      {"0x10 Gb/sec", 0},
      {"", 0},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    int v = mplane_topo_parse_ib_rate(cases[i].text);
    if (v != cases[i].mbps) fail_msg("rate '%s': %d Mb/s, expected %d", cases[i].text, v, cases[i].mbps);
  }
}

static int setup(void **state) {
  (void)state;
  return tmpdir_make(tmpdir, sizeof(tmpdir), "mplane-topo-input");
}

static int teardown(void **state) {
  (void)state;
  return tmpdir_remove(tmpdir);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_small_node),
      cmocka_unit_test(test_repeated_busid_ends),
      cmocka_unit_test(test_infinite_cpuset),
      cmocka_unit_test(test_hwloc_crash_refused),
      cmocka_unit_test(test_check_process_names_crash),
      cmocka_unit_test(test_plugin_warns_refused_file),
      cmocka_unit_test(test_not_regular_file_refused),
      cmocka_unit_test(test_check_process),
      cmocka_unit_test(test_sysfs_cpulist_bounded),
      cmocka_unit_test(test_sysfs_ib_rate_bounded),
      cmocka_unit_test(test_cpulist_parser),
      cmocka_unit_test(test_ib_rate_parser),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
