/* Unit tests: MPLANE_* configuration parsing (common/config.c).
 *
 * Every row of the config table is exercised: its default, values it must accept (stored exactly),
 * values it must refuse (ncclInvalidArgument with a message that names the variable, the value and
 * the accepted form). The list of rows is read back from mplane_config_describe(), so a row added
 * later is at least checked generically (default loads, an absurd value is refused with a proper
 * message) and the test prints a reminder to give it cases of its own below. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "net/socket/socket.h"
#include "common/config.h"

/* ------------------------------------------------------------------ the table, as described */

#define MAX_ROWS 128

struct described {
  char name[64];
  char dflt[1100];
  char form[512];
};

static struct described rows[MAX_ROWS];
static int nrows;

/* Copy one Markdown cell, dropping the backticks around code and the '\' before an escaped '|'. */
static const char *md_cell(const char *p, char *out, size_t outlen) {
  size_t n = 0;
  while (*p == ' ') p++;
  for (; *p && !(*p == '|' && p[-1] != '\\'); p++) {
    if (*p == '\\' && p[1] == '|') continue;
    if (*p == '`') continue;
    if (n + 1 < outlen) out[n++] = *p;
  }
  while (n > 0 && out[n - 1] == ' ') n--;
  out[n] = 0;
  return *p == '|' ? p + 1 : p;
}

static void load_described_rows(void) {
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  assert_non_null(f);
  mplane_config_describe(f, 1);
  fclose(f);
  nrows = 0;
  for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
    if (strncmp(line, "| `MPLANE_", 10) != 0) continue;
    assert_true(nrows < MAX_ROWS);
    struct described *r = &rows[nrows++];
    const char *p = md_cell(line + 1, r->name, sizeof(r->name));
    p = md_cell(p, r->dflt, sizeof(r->dflt));
    p = md_cell(p, r->form, sizeof(r->form));
    if (strcmp(r->dflt, "(unset)") == 0) r->dflt[0] = 0;
  }
  free(text);
}

static const struct described *row_named(const char *name) {
  for (int i = 0; i < nrows; i++)
    if (strcmp(rows[i].name, name) == 0) return &rows[i];
  return NULL;
}

static void clear_env(void) {
  for (int i = 0; i < nrows; i++) unsetenv(rows[i].name);
}

static int setup(void **state) {
  (void)state;
  if (nrows == 0) load_described_rows();
  clear_env();
  return 0;
}

static int teardown(void **state) {
  (void)state;
  clear_env();
  return 0;
}

/* ------------------------------------------------------------------ helpers */

static char err[8192];

/* libmplane-ep's rows (MPLANE_EP_*) are read by its own load, the plugin's load leaves them at their defaults. */
static int is_ep_row(const char *name) { return strncmp(name, "MPLANE_EP_", 10) == 0; }
/* libmplane-hfreduce's (MPLANE_HFREDUCE_*) likewise, by mplane_config_load_hfreduce. */
static int is_hfreduce_row(const char *name) { return strncmp(name, "MPLANE_HFREDUCE_", 16) == 0; }

static ncclResult_t load_with(const char *name, const char *value, struct mplane_config *cfg) {
  clear_env();
  if (value) setenv(name, value, 1);
  err[0] = 0;
  ncclResult_t res = is_ep_row(name)         ? mplane_config_load_ep(cfg, err, sizeof(err))
                     : is_hfreduce_row(name) ? mplane_config_load_hfreduce(cfg, err, sizeof(err))
                                             : mplane_config_load(cfg, err, sizeof(err));
  unsetenv(name);
  return res;
}

/* The value must be refused, and the message must name the variable, the value and the form. */
static void expect_refused(const char *name, const char *value) {
  struct mplane_config cfg;
  ncclResult_t res = load_with(name, value, &cfg);
  if (res != ncclInvalidArgument) fail_msg("%s='%s' was accepted (result %d), expected ncclInvalidArgument", name, value, res);
  const struct described *r = row_named(name);
  assert_non_null(r);
  char quoted[4200];
  snprintf(quoted, sizeof(quoted), "'%s'", value);
  if (!strstr(err, name)) fail_msg("message for %s='%s' does not name the variable: %s", name, value, err);
  if (!strstr(err, quoted)) fail_msg("message for %s='%s' does not show the value: %s", name, value, err);
  if (!strstr(err, r->form)) fail_msg("message for %s='%s' does not give the accepted form '%s': %s", name, value, r->form, err);
}

static void expect_int(const char *name, const char *value, size_t off, int want) {
  struct mplane_config cfg;
  ncclResult_t res = load_with(name, value, &cfg);
  if (res != ncclSuccess) fail_msg("%s='%s' refused: %s", name, value, err);
  int got = *(int *)((char *)&cfg + off);
  if (got != want) fail_msg("%s='%s' stored %d, expected %d", name, value, got, want);
}

static void expect_long(const char *name, const char *value, size_t off, long want) {
  struct mplane_config cfg;
  ncclResult_t res = load_with(name, value, &cfg);
  if (res != ncclSuccess) fail_msg("%s='%s' refused: %s", name, value, err);
  long got = *(long *)((char *)&cfg + off);
  if (got != want) fail_msg("%s='%s' stored %ld, expected %ld", name, value, got, want);
}

static void expect_str(const char *name, const char *value, size_t off) {
  struct mplane_config cfg;
  ncclResult_t res = load_with(name, value, &cfg);
  if (res != ncclSuccess) fail_msg("%s='%s' refused: %s", name, value, err);
  const char *got = (char *)&cfg + off;
  if (strcmp(got, value) != 0) fail_msg("%s='%s' stored '%s'", name, value, got);
}

/* ------------------------------------------------------------------ rows, by kind */

struct int_row {
  const char *name;
  size_t off;
  long lo, hi;
  long dflt;
};

#define F(f) offsetof(struct mplane_config, f)

static const struct int_row int_rows[] = {
    {"MPLANE_SOCKET_STREAMS", F(socket_streams), 0, 16, 0},
    {"MPLANE_SOCKET_THREADS", F(socket_threads), 0, 64, 0},
    {"MPLANE_CONNECT_TIMEOUT", F(connect_timeout_s), 1, 3600, 120},
    {"MPLANE_STATS_INTERVAL", F(stats_interval_s), 0, 86400, 15},
    {"MPLANE_IB_GID_INDEX", F(ib_gid_index), -1, 255, -1},
    {"MPLANE_IB_SL", F(ib_sl), 0, 15, 0},
    {"MPLANE_IB_TIMEOUT", F(ib_timeout), 1, 31, 20},
    {"MPLANE_IB_RETRY_CNT", F(ib_retry_cnt), 0, 7, 7},
    {"MPLANE_IB_QPS", F(ib_qps), 1, 16, 1},
    {"MPLANE_IB_TC", F(ib_tc), -1, 255, -1},
    {"MPLANE_GIN_IB_TC", F(gin_ib_tc), -1, 255, -1},
    {"MPLANE_IB_PKEY", F(ib_pkey), 0, 65535, 0},
    {"MPLANE_IB_FIFO_TC", F(ib_fifo_tc), -1, 255, -1},
    {"MPLANE_IB_DEVICE_PCI_ORDER", F(ib_device_pci_order), 0, 1, 1},
    {"MPLANE_IB_ADAPTIVE_ROUTING", F(ib_adaptive_routing), -1, 1, -1},
    {"MPLANE_DEBUG", F(debug), 0, 2, 0},
    {"MPLANE_SOCKET_SPIN_US", F(socket_spin_us), 0, 10000, 0},
    {"MPLANE_SOCKET_INLINE_BUSY", F(socket_inline_busy), 0, 1024, 2},
    {"MPLANE_SOCKET_SPEED", F(socket_speed_mbps), -1, 10000000, -1},
    /* booleans are integers 0..1 */
    {"MPLANE_NCCL_TOPO", F(nccl_topo), 0, 1, 1},
    {"MPLANE_NCCL_DEFAULTS", F(nccl_defaults), 0, 1, 1},
    {"MPLANE_IB_ECE", F(ib_ece), 0, 1, 1},
    {"MPLANE_IB_SUBNET_PROBE", F(ib_subnet_probe), 0, 1, 1},
    {"MPLANE_IB_SPLIT_DATA_ON_QPS", F(ib_split_data_on_qps), 0, 1, 1},
    /* libmplane-ep's; -1 is the automatic count (create bounds them again by the device's blocks) */
    {"MPLANE_EP_LINK_SMS", F(ep_link_sms), -1, 1024, -1},
    {"MPLANE_EP_RECV_SMS", F(ep_recv_sms), -1, 1024, -1},
    {"MPLANE_EP_SEND_SMS", F(ep_send_sms), -1, 1024, -1},
    /* libmplane-hfreduce's */
    {"MPLANE_HFREDUCE_SLOTS", F(hfreduce_slots), 2, 16, 4},
};

struct str_row {
  const char *name;
  size_t off, cap;
  const char *dflt;
  const char *good;
  int grammar; /* a validate callback may refuse "aaa...": its own cases are in a test of its own */
};

#define S(f) F(f), sizeof(((struct mplane_config *)0)->f)

static const struct str_row str_rows[] = {
    {"MPLANE_SOCKET_IFNAME", S(socket_ifname), "", "^docker,=eth0,ib", 1},
    {"MPLANE_PLANES", S(planes), "", "mlx5_0=0,mlx5_1=1,mlx5_2=2", 1},
    {"MPLANE_TOPO_FILE", S(topo_file), "", "/tmp/node.xml"},
    {"MPLANE_TC_MAP", S(tc_map), "default=0,collective=0,alltoall=3,lowlat=5,storage=1", "default=1,alltoall=4", 1},
    {"MPLANE_STATS_FILE", S(stats_file), "", "/tmp/mplane-%p.json"},
    {"MPLANE_IB_HCA", S(ib_hca), "", "mlx5_0:1,mlx5_1", 1},
    {"MPLANE_IB_SOCKET_IFNAME", S(ib_socket_ifname), "", "^docker,=ib0", 1},
    {"MPLANE_IBVERBS_LIB", S(ibverbs_lib), "libibverbs.so.1", "/opt/softverbs/libibverbs.so"},
    {"MPLANE_TUNER_CONFIG", S(tuner_config), "", "/etc/mplane/tuner.csv"},
    {"MPLANE_EP_LIB", S(ep_lib), "", "/opt/mplane/lib/libmplane-ep.so"},
    {"MPLANE_EP_NCCL_LIB", S(ep_nccl_lib), "", "libnccl.so.2"},
};

struct enum_row {
  const char *name;
  size_t off;
  const char *choices[8]; /* index = stored value */
};

static const struct enum_row enum_rows[] = {
    {"MPLANE_TRANSPORT", F(transport), {"auto", "ib", "socket"}},
    {"MPLANE_RELAY", F(relay), {"auto", "nvlink", "pcie", "host", "off"}},
    {"MPLANE_STATS_FORMAT", F(stats_format), {"json", "prometheus", "both"}},
};

static const char *size_rows[] = {"MPLANE_SOCKET_SPLIT_BYTES", "MPLANE_SOCKET_INLINE_BYTES", "MPLANE_SOCKET_EAGER_BYTES",
                                  "MPLANE_IB_AR_THRESHOLD", "MPLANE_HFREDUCE_CHUNK_BYTES"};

static int known_row(const char *name) {
  for (size_t i = 0; i < sizeof(int_rows) / sizeof(int_rows[0]); i++)
    if (!strcmp(int_rows[i].name, name)) return 1;
  for (size_t i = 0; i < sizeof(str_rows) / sizeof(str_rows[0]); i++)
    if (!strcmp(str_rows[i].name, name)) return 1;
  for (size_t i = 0; i < sizeof(enum_rows) / sizeof(enum_rows[0]); i++)
    if (!strcmp(enum_rows[i].name, name)) return 1;
  for (size_t i = 0; i < sizeof(size_rows) / sizeof(size_rows[0]); i++)
    if (!strcmp(size_rows[i], name)) return 1;
  return 0;
}

/* ------------------------------------------------------------------ tests */

static void test_table_is_described(void **state) {
  (void)state;
  assert_true(nrows >= 20);
  for (int i = 0; i < nrows; i++) {
    assert_true(strlen(rows[i].form) > 0);
    for (int j = 0; j < i; j++)
      if (!strcmp(rows[i].name, rows[j].name)) fail_msg("%s appears twice in the config table", rows[i].name);
  }
  /* Every row this file knows must still exist (a renamed variable breaks users). */
  for (size_t i = 0; i < sizeof(int_rows) / sizeof(int_rows[0]); i++)
    if (!row_named(int_rows[i].name)) fail_msg("%s is no longer in the config table", int_rows[i].name);
  for (size_t i = 0; i < sizeof(str_rows) / sizeof(str_rows[0]); i++)
    if (!row_named(str_rows[i].name)) fail_msg("%s is no longer in the config table", str_rows[i].name);
  for (size_t i = 0; i < sizeof(enum_rows) / sizeof(enum_rows[0]); i++)
    if (!row_named(enum_rows[i].name)) fail_msg("%s is no longer in the config table", enum_rows[i].name);
  for (int i = 0; i < nrows; i++)
    if (!known_row(rows[i].name))
      print_message("note: %s has only generic checks; add its cases to tests/unit/test_config.c\n", rows[i].name);
}

static void test_defaults(void **state) {
  (void)state;
  struct mplane_config cfg;
  clear_env();
  memset(&cfg, 0x5a, sizeof(cfg));
  if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) fail_msg("defaults do not load: %s", err);
  assert_int_equal(cfg.transport, MPLANE_TRANSPORT_AUTO);
  assert_int_equal(cfg.relay, MPLANE_RELAY_AUTO);
  assert_int_equal(cfg.socket_split_bytes, 256 * 1024);
  assert_int_equal(cfg.socket_inline_bytes, 128 * 1024);
  assert_int_equal(cfg.socket_eager_bytes, 64 * 1024);
  for (size_t i = 0; i < sizeof(int_rows) / sizeof(int_rows[0]); i++) {
    int got = *(int *)((char *)&cfg + int_rows[i].off);
    if (got != int_rows[i].dflt) fail_msg("%s default is %d, expected %ld", int_rows[i].name, got, int_rows[i].dflt);
  }
  for (size_t i = 0; i < sizeof(str_rows) / sizeof(str_rows[0]); i++) {
    const char *got = (char *)&cfg + str_rows[i].off;
    if (strcmp(got, str_rows[i].dflt)) fail_msg("%s default is '%s', expected '%s'", str_rows[i].name, got, str_rows[i].dflt);
  }
}

/* The documented default (what the README shows) is what an empty environment gives, and it
 * parses when given explicitly. */
static void test_described_defaults_parse(void **state) {
  (void)state;
  for (int i = 0; i < nrows; i++) {
    struct mplane_config a, b;
    clear_env();
    assert_int_equal(mplane_config_load(&a, err, sizeof(err)), ncclSuccess);
    if (load_with(rows[i].name, rows[i].dflt, &b) != ncclSuccess)
      fail_msg("%s: its documented default '%s' is refused: %s", rows[i].name, rows[i].dflt, err);
    if (memcmp(&a, &b, sizeof(a)) != 0)
      fail_msg("%s='%s' (the documented default) differs from leaving it unset", rows[i].name, rows[i].dflt);
  }
}

/* Any row, even one added after this file: an absurd value is refused with a full message. */
static void test_every_row_refuses_garbage(void **state) {
  (void)state;
  char big[4000];
  memset(big, 'z', sizeof(big) - 1);
  big[sizeof(big) - 1] = 0;
  for (int i = 0; i < nrows; i++) expect_refused(rows[i].name, big);
}

static void test_int_rows(void **state) {
  (void)state;
  char v[64];
  for (size_t i = 0; i < sizeof(int_rows) / sizeof(int_rows[0]); i++) {
    const struct int_row *r = &int_rows[i];
    snprintf(v, sizeof(v), "%ld", r->lo);
    expect_int(r->name, v, r->off, (int)r->lo);
    snprintf(v, sizeof(v), "%ld", r->hi);
    expect_int(r->name, v, r->off, (int)r->hi);
    snprintf(v, sizeof(v), "%ld", (r->lo + r->hi) / 2);
    expect_int(r->name, v, r->off, (int)((r->lo + r->hi) / 2));
    snprintf(v, sizeof(v), "%ld", r->lo - 1);
    expect_refused(r->name, v);
    snprintf(v, sizeof(v), "%ld", r->hi + 1);
    expect_refused(r->name, v);
    const char *bad[] = {"abc", " ", "1.5", "4x", "0x1", "1e1", "99999999999999999999", "-99999999999999999999",
                         "yes", "true", "4 "};
    for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) expect_refused(r->name, bad[b]);
  }
}

/* MPLANE_SOCKET_SPEED: -1 (automatic) or 1..10000000; 0 lies inside the range but is no speed. */
static void test_socket_speed_refuses_zero(void **state) {
  (void)state;
  size_t off = F(socket_speed_mbps);
  const char *zeros[] = {"0", "00", "-0", "+0"};
  for (size_t i = 0; i < sizeof(zeros) / sizeof(zeros[0]); i++) {
    expect_refused("MPLANE_SOCKET_SPEED", zeros[i]);
    assert_non_null(strstr(err, "-1 (automatic) or Mb/s from 1 to 10000000"));
  }
  expect_int("MPLANE_SOCKET_SPEED", "-1", off, -1);
  expect_int("MPLANE_SOCKET_SPEED", "1", off, 1);
  expect_int("MPLANE_SOCKET_SPEED", "400000", off, 400000);
}

/* NCCL treats NAME= like an unset variable; so does every row here: the default, not a failed init.
 * Anything else still has to parse (a lone space is not empty). */
static void test_empty_is_unset(void **state) {
  (void)state;
  struct mplane_config unset, empty;
  clear_env();
  assert_int_equal(mplane_config_load(&unset, err, sizeof(err)), ncclSuccess);
  for (int i = 0; i < nrows; i++) {
    memset(&empty, 0x5a, sizeof(empty));
    if (load_with(rows[i].name, "", &empty) != ncclSuccess) fail_msg("%s='' is refused: %s", rows[i].name, err);
    if (memcmp(&unset, &empty, sizeof(unset)) != 0) fail_msg("%s='' differs from leaving it unset", rows[i].name);
  }
  /* all at once, too */
  clear_env();
  for (int i = 0; i < nrows; i++) setenv(rows[i].name, "", 1);
  memset(&empty, 0x5a, sizeof(empty));
  assert_int_equal(mplane_config_load(&empty, err, sizeof(err)), ncclSuccess);
  assert_memory_equal(&unset, &empty, sizeof(unset));
  expect_refused("MPLANE_SOCKET_STREAMS", " ");
  expect_refused("MPLANE_TRANSPORT", " ");
  expect_refused("MPLANE_SOCKET_SPLIT_BYTES", " ");
}

static void test_streams_form_is_explicit(void **state) {
  (void)state;
  /* The brief's example, word for word: the WARN a user sees. */
  expect_refused("MPLANE_SOCKET_STREAMS", "abc");
  assert_non_null(strstr(err, "MPLANE_SOCKET_STREAMS"));
  assert_non_null(strstr(err, "'abc'"));
  assert_non_null(strstr(err, "an integer from 1 to 16"));
}

static void test_size_row(void **state) {
  (void)state;
  const char *n = "MPLANE_SOCKET_SPLIT_BYTES";
  size_t off = F(socket_split_bytes);
  expect_long(n, "1", off, 1);
  expect_long(n, "4096", off, 4096);
  expect_long(n, "4K", off, 4096);
  expect_long(n, "4k", off, 4096);
  expect_long(n, "3M", off, 3L << 20);
  expect_long(n, "3m", off, 3L << 20);
  expect_long(n, "1G", off, 1L << 30);
  expect_long(n, "1g", off, 1L << 30);
  expect_long(n, "1024M", off, 1L << 30);
  expect_long(n, "1073741824", off, 1L << 30);
  const char *bad[] = {"0", "0K", "2G", "1025M", "1073741825", "1T", "4KB", "4 K", "K", "-1", "-4K", "1.5M", " ",
                       "abc", "4KK", "99999999999999999999G", "9223372036854775807K"};
  for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) expect_refused(n, bad[b]);
  /* the AR threshold takes 0 (every message in the AR form) up to 1 GiB, NCCL's plain byte counts too */
  const char *ar = "MPLANE_IB_AR_THRESHOLD";
  expect_long(ar, "0", F(ib_ar_threshold), 0);
  expect_long(ar, "8192", F(ib_ar_threshold), 8192);
  expect_long(ar, "1G", F(ib_ar_threshold), 1L << 30);
  expect_refused(ar, "-1");
  expect_refused(ar, "2G");
}

static void test_enum_rows(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof(enum_rows) / sizeof(enum_rows[0]); i++) {
    const struct enum_row *r = &enum_rows[i];
    for (int c = 0; r->choices[c]; c++) {
      char up[32], mixed[32];
      size_t len = strlen(r->choices[c]);
      for (size_t k = 0; k <= len; k++) {
        up[k] = (char)(r->choices[c][k] >= 'a' && r->choices[c][k] <= 'z' ? r->choices[c][k] - 32 : r->choices[c][k]);
        mixed[k] = k % 2 ? up[k] : r->choices[c][k];
      }
      expect_int(r->name, r->choices[c], r->off, c);
      expect_int(r->name, up, r->off, c);
      expect_int(r->name, mixed, r->off, c);
      /* a prefix or an extension of a choice is not that choice */
      char longer[40];
      snprintf(longer, sizeof(longer), "%sx", r->choices[c]);
      expect_refused(r->name, longer);
      if (len > 1) {
        char shorter[32];
        snprintf(shorter, sizeof(shorter), "%.*s", (int)(len - 1), r->choices[c]);
        int is_other_choice = 0;
        for (int o = 0; r->choices[o]; o++) is_other_choice |= !strcmp(r->choices[o], shorter);
        if (!is_other_choice) expect_refused(r->name, shorter);
      }
    }
    const char *bad[] = {" ", "tcp", "0", "1", " auto", "auto ", "auto,ib"};
    for (size_t b = 0; b < sizeof(bad) / sizeof(bad[0]); b++) expect_refused(r->name, bad[b]);
  }
}

static void test_str_rows(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof(str_rows) / sizeof(str_rows[0]); i++) {
    const struct str_row *r = &str_rows[i];
    expect_str(r->name, r->good, r->off);
    /* The longest value that fits, and one byte more. */
    char *v = malloc(r->cap + 1);
    assert_non_null(v);
    memset(v, 'a', r->cap);
    v[r->cap - 1] = 0;
    /* Rows with a grammar (a validate callback) may refuse "aaa...": their own cases are below. */
    if (!r->grammar) expect_str(r->name, v, r->off);
    v[r->cap - 1] = 'a';
    v[r->cap] = 0;
    expect_refused(r->name, v);
    free(v);
  }
}

/* MPLANE_TC_MAP's grammar is checked at load (net/tc.c validate callback). */
static void test_tc_map_grammar(void **state) {
  (void)state;
  expect_str("MPLANE_TC_MAP", "lowlat=7:ar,alltoall=3:noar", offsetof(struct mplane_config, tc_map));
  expect_refused("MPLANE_TC_MAP", "alltoall=16");
  expect_refused("MPLANE_TC_MAP", "bulk=1");
  expect_refused("MPLANE_TC_MAP", "default=0,default=1");
}

/* The first bad variable fails the load even when others are good; a good one alone still loads. */
static void test_one_bad_among_good(void **state) {
  (void)state;
  struct mplane_config cfg;
  clear_env();
  setenv("MPLANE_SOCKET_STREAMS", "8", 1);
  setenv("MPLANE_TRANSPORT", "socket", 1);
  setenv("MPLANE_IB_SL", "16", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "MPLANE_IB_SL"));
  assert_non_null(strstr(err, "'16'"));
  unsetenv("MPLANE_IB_SL");
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.socket_streams, 8);
  assert_int_equal(cfg.transport, MPLANE_TRANSPORT_SOCKET);
}

/* libmplane-ep's rows fail its own load only: a bad MPLANE_EP_* value never fails the plugin's init,
 * nor a bad plugin variable libmplane-ep's create. 0 fused blocks to unpack or send is refused. */
/* libmplane-hfreduce's rows likewise: a bad MPLANE_HFREDUCE_* value fails its comm_init, never the plugin. */
static void test_hfreduce_rows_their_own_reader(void **state) {
  (void)state;
  struct mplane_config cfg;
  clear_env();
  setenv("MPLANE_HFREDUCE_CHUNK_BYTES", "1K", 1);
  assert_int_equal(mplane_config_load_hfreduce(&cfg, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "MPLANE_HFREDUCE_CHUNK_BYTES='1K' is not valid"));
  if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) fail_msg("MPLANE_HFREDUCE_CHUNK_BYTES failed the plugin: %s", err);
  assert_int_equal(cfg.hfreduce_chunk_bytes, 2L << 20);
  setenv("MPLANE_HFREDUCE_CHUNK_BYTES", "64K", 1);
  assert_int_equal(mplane_config_load_hfreduce(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.hfreduce_chunk_bytes, 65536);
  unsetenv("MPLANE_HFREDUCE_CHUNK_BYTES");
}

static void test_ep_rows_their_own_reader(void **state) {
  (void)state;
  struct mplane_config cfg;
  clear_env();
  setenv("MPLANE_EP_LINK_SMS", "many", 1);
  setenv("MPLANE_IB_SL", "16", 1);
  assert_int_equal(mplane_config_load_ep(&cfg, err, sizeof(err)), ncclInvalidArgument);
  assert_non_null(strstr(err, "MPLANE_EP_LINK_SMS='many' is not valid: expected -1 (automatic) or an integer from 0 to 1024"));
  unsetenv("MPLANE_EP_LINK_SMS");
  if (mplane_config_load_ep(&cfg, err, sizeof(err)) != ncclSuccess) fail_msg("MPLANE_IB_SL failed libmplane-ep: %s", err);
  assert_int_equal(cfg.ep_link_sms, -1);
  unsetenv("MPLANE_IB_SL");
  setenv("MPLANE_EP_SEND_SMS", "nine", 1);
  if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) fail_msg("MPLANE_EP_SEND_SMS failed the plugin: %s", err);
  assert_int_equal(cfg.ep_send_sms, -1);
  unsetenv("MPLANE_EP_SEND_SMS");
  expect_int("MPLANE_EP_LINK_SMS", "0", F(ep_link_sms), 0);
  expect_refused("MPLANE_EP_RECV_SMS", "0");
  assert_non_null(strstr(err, "0 blocks would do none of the work"));
  expect_refused("MPLANE_EP_SEND_SMS", "0");
  expect_int("MPLANE_EP_SEND_SMS", "1", F(ep_send_sms), 1);
}

/* A short error buffer truncates the message but never overflows it. */
static void test_short_error_buffer(void **state) {
  (void)state;
  struct mplane_config cfg;
  char small[24];
  memset(small, 0x7f, sizeof(small));
  clear_env();
  setenv("MPLANE_SOCKET_STREAMS", "abcdefghijklmnopqrstuvwxyz", 1);
  assert_int_equal(mplane_config_load(&cfg, small, 16), ncclInvalidArgument);
  assert_int_equal(strlen(small), 15);
  for (size_t i = 16; i < sizeof(small); i++) assert_int_equal((unsigned char)small[i], 0x7f);
}

static void test_parse_long(void **state) {
  (void)state;
  long v = 0;
  assert_int_equal(mplane_parse_long("42", 0, 100, &v), 0);
  assert_int_equal(v, 42);
  assert_int_equal(mplane_parse_long("-3", -5, 5, &v), 0);
  assert_int_equal(v, -3);
  v = 7;
  assert_int_not_equal(mplane_parse_long("101", 0, 100, &v), 0);
  assert_int_not_equal(mplane_parse_long("", 0, 100, &v), 0);
  assert_int_not_equal(mplane_parse_long(NULL, 0, 100, &v), 0);
  assert_int_not_equal(mplane_parse_long("12a", 0, 100, &v), 0);
  const char *inexact[] = {"+4", " 4", "4 ", "\n4", "04", "00", "-0", "-04", "+-4", "0x4", "4.0", "-"};
  for (size_t i = 0; i < sizeof(inexact) / sizeof(inexact[0]); i++)
    if (mplane_parse_long(inexact[i], -100, 100, &v) == 0) fail_msg("mplane_parse_long('%s') accepted", inexact[i]);
  assert_int_equal(mplane_parse_long("9223372036854775807", 0, 9223372036854775807L, &v), 0);
  assert_int_not_equal(mplane_parse_long("9223372036854775808", 0, 9223372036854775807L, &v), 0);
  assert_int_equal(v, 9223372036854775807L);
  v = 7;
  assert_int_equal(mplane_parse_long("-9223372036854775807", -9223372036854775807L, 0, &v), 0);
  assert_int_equal(v, -9223372036854775807L);
  v = 7;
  assert_int_not_equal(mplane_parse_long("+4", 0, 100, &v), 0);
  assert_int_equal(v, 7); /* untouched on failure */
}

/* Numbers are accepted exactly as documented: digits, no leading zero ("0" itself excepted), a K/M/G
 * suffix on sizes, a '-' only for -1 where a row allows it. strtol's leniency (leading blanks and
 * newlines, '+', leading zeros, "-0") once let ' 4', '\n4', '+4', '04', ' 1K', '+1K', '-0', '+15',
 * 'default=+5' and 'default=\v5' through, while '1K ' and '4 ' were refused. */
static void test_numbers_exact_form(void **state) {
  (void)state;
  const char *streams_bad[] = {" 4", "\n4", "\t4", "\v4", "+4", "04", "0004", "4\n", "- 4", "--4", "+-4", "4 "};
  for (size_t i = 0; i < sizeof(streams_bad) / sizeof(streams_bad[0]); i++)
    expect_refused("MPLANE_SOCKET_STREAMS", streams_bad[i]);
  expect_int("MPLANE_SOCKET_STREAMS", "4", F(socket_streams), 4);
  expect_int("MPLANE_SOCKET_STREAMS", "10", F(socket_streams), 10);

  const char *size_bad[] = {" 1K", "+1K", "1K ", "01K", "\n1K", "\t1K", "+1024", "01024", "00K", "-0K"};
  for (size_t i = 0; i < sizeof(size_bad) / sizeof(size_bad[0]); i++)
    expect_refused("MPLANE_SOCKET_SPLIT_BYTES", size_bad[i]);
  expect_long("MPLANE_SOCKET_SPLIT_BYTES", "1K", F(socket_split_bytes), 1024);
  expect_long("MPLANE_SOCKET_SPLIT_BYTES", "10K", F(socket_split_bytes), 10240);
  /* the inline limit takes 0 (never inline) and stops at 1M */
  expect_long("MPLANE_SOCKET_INLINE_BYTES", "0", F(socket_inline_bytes), 0);
  expect_long("MPLANE_SOCKET_INLINE_BYTES", "8K", F(socket_inline_bytes), 8192);
  expect_long("MPLANE_SOCKET_INLINE_BYTES", "1M", F(socket_inline_bytes), 1L << 20);
  expect_refused("MPLANE_SOCKET_INLINE_BYTES", "1025K");
  expect_refused("MPLANE_SOCKET_INLINE_BYTES", "00");
  /* the eager limit: 0 (never eager) .. 1M, 64K by default */
  expect_long("MPLANE_SOCKET_EAGER_BYTES", "0", F(socket_eager_bytes), 0);
  expect_long("MPLANE_SOCKET_EAGER_BYTES", "1M", F(socket_eager_bytes), 1L << 20);
  expect_refused("MPLANE_SOCKET_EAGER_BYTES", "1025K");
  expect_refused("MPLANE_SOCKET_EAGER_BYTES", "-1");

  const char *sl_bad[] = {"-0", "+15", "015", " 15", "15\n", "+0", "00"};
  for (size_t i = 0; i < sizeof(sl_bad) / sizeof(sl_bad[0]); i++) expect_refused("MPLANE_IB_SL", sl_bad[i]);
  expect_int("MPLANE_IB_SL", "0", F(ib_sl), 0);
  expect_int("MPLANE_IB_SL", "15", F(ib_sl), 15);

  const char *gid_bad[] = {"-01", "+1", "- 1", "-1 ", " -1", "-+1", "+255", "0255"};
  for (size_t i = 0; i < sizeof(gid_bad) / sizeof(gid_bad[0]); i++) expect_refused("MPLANE_IB_GID_INDEX", gid_bad[i]);
  expect_int("MPLANE_IB_GID_INDEX", "-1", F(ib_gid_index), -1);
  expect_int("MPLANE_IB_GID_INDEX", "0", F(ib_gid_index), 0);

  const char *bool_bad[] = {"+1", "01", " 1", "1 ", "-0"};
  for (size_t i = 0; i < sizeof(bool_bad) / sizeof(bool_bad[0]); i++) expect_refused("MPLANE_NCCL_TOPO", bool_bad[i]);

  /* grammars built on the same number: the TC map's service levels, MPLANE_PLANES' planes */
  const char *tc_bad[] = {"default=+5", "default=\v5", "default=\f5", "default=\n5", "default=05", "default=-0",
                          "alltoall=+3,lowlat=5"};
  for (size_t i = 0; i < sizeof(tc_bad) / sizeof(tc_bad[0]); i++) expect_refused("MPLANE_TC_MAP", tc_bad[i]);
  expect_str("MPLANE_TC_MAP", "default = 5, lowlat=7:ar", F(tc_map)); /* blanks around entries: the grammar */
  const char *planes_bad[] = {"mlx5_0=+1", "mlx5_0=01", "mlx5_0=\v1", "mlx5_0=-0", "mlx5_0=\n1"};
  for (size_t i = 0; i < sizeof(planes_bad) / sizeof(planes_bad[0]); i++) expect_refused("MPLANE_PLANES", planes_bad[i]);
}

/* NCCL reads MPLANE_SOCKET_IFNAME's grammar (NCCL_SOCKET_IFNAME) as prefix[:port] entries and
 * matches socket interfaces by the name alone; so does mplane: 'eth0:1' selects eth0, as it does in
 * NCCL, where mplane once selected nothing. */
static void test_ifname_port_suffix(void **state) {
  (void)state;
  struct {
    const char *value, *stored;
  } cases[] = {
      {"eth0:1", "eth0"},
      {"lo:0", "lo"},
      {"=eth0:1,eth1", "=eth0,eth1"},
      {"^docker:1,virbr:22", "^docker,virbr"},
      {"mlx5_0:1,ib:2,eth", "mlx5_0,ib,eth"},
      {"eth0:", "eth0"},
      {"^docker,=eth0,ib", "^docker,=eth0,ib"},
  };
  for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
    struct mplane_config cfg;
    if (load_with("MPLANE_SOCKET_IFNAME", cases[i].value, &cfg) != ncclSuccess)
      fail_msg("MPLANE_SOCKET_IFNAME='%s' refused: %s", cases[i].value, err);
    if (strcmp(cfg.socket_ifname, cases[i].stored) != 0)
      fail_msg("MPLANE_SOCKET_IFNAME='%s' stored '%s', expected '%s'", cases[i].value, cfg.socket_ifname,
               cases[i].stored);
  }
  struct mplane_config cfg;
  assert_int_equal(load_with("MPLANE_SOCKET_IFNAME", "lo:1", &cfg), ncclSuccess);
  assert_true(mps_iface_match(cfg.socket_ifname, "lo", 1));
  assert_int_equal(load_with("MPLANE_SOCKET_IFNAME", "=eth0:1", &cfg), ncclSuccess);
  assert_true(mps_iface_match(cfg.socket_ifname, "eth0", 0));
  assert_false(mps_iface_match(cfg.socket_ifname, "eth01", 0));
}

/* Files named by variables are read only when they are regular files: a FIFO would block the reader
 * (NCCL's init) forever. */
static void test_open_regular_file(void **state) {
  (void)state;
  char dir[] = "/tmp/mplane-config-test.XXXXXX";
  assert_non_null(mkdtemp(dir));
  char fifo[64], file[64];
  snprintf(fifo, sizeof(fifo), "%s/fifo", dir);
  snprintf(file, sizeof(file), "%s/file", dir);
  assert_int_equal(mkfifo(fifo, 0600), 0);
  FILE *f = fopen(file, "w");
  assert_non_null(f);
  fputs("x", f);
  fclose(f);
  char e[512] = "";
  assert_int_equal(mplane_open_regular_file("MPLANE_X", fifo, "a file", e, sizeof(e)), -2);
  assert_non_null(strstr(e, "MPLANE_X='"));
  assert_non_null(strstr(e, "' is not a regular file (a FIFO); expected a file"));
  assert_int_equal(mplane_open_regular_file("MPLANE_X", dir, "a file", e, sizeof(e)), -2);
  assert_non_null(strstr(e, "(a directory)"));
  assert_int_equal(mplane_open_regular_file("MPLANE_X", "/dev/zero", "a file", e, sizeof(e)), -2);
  assert_non_null(strstr(e, "(a character device)"));
  e[0] = '\0';
  assert_int_equal(mplane_open_regular_file("MPLANE_X", "/nonexistent/x", "a file", e, sizeof(e)), -1);
  assert_int_equal(e[0], '\0'); /* the caller words it, from errno */
  int fd = mplane_open_regular_file("MPLANE_X", file, "a file", e, sizeof(e));
  assert_true(fd >= 0);
  char c = 0;
  assert_int_equal(read(fd, &c, 1), 1);
  assert_int_equal(c, 'x');
  close(fd);
  unlink(fifo);
  unlink(file);
  rmdir(dir);
}

static void test_describe_plain(void **state) {
  (void)state;
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  mplane_config_describe(f, 0);
  fclose(f);
  for (int i = 0; i < nrows; i++)
    if (!strstr(text, rows[i].name)) fail_msg("plain description lacks %s", rows[i].name);
  free(text);
}

/* NCCL's twin of an MPLANE_IB_* variable is read when the MPLANE_* one is unset; mplane's wins when
 * both are set; a bad value is named by the variable it came from. */
static void test_nccl_twins(void **state) {
  (void)state;
  struct mplane_config cfg;
  const char *twins[] = {"NCCL_IB_HCA", "NCCL_IB_GID_INDEX", "NCCL_IB_SL", "NCCL_IB_TIMEOUT", "NCCL_IB_RETRY_CNT",
                         "NCCL_IB_TC", "NCCL_IB_PKEY", "NCCL_GIN_IB_TC", "NCCL_IB_QPS_PER_CONNECTION",
                         "NCCL_IB_ADAPTIVE_ROUTING", "NCCL_IB_AR_THRESHOLD", "NCCL_IB_SPLIT_DATA_ON_QPS"};
  for (size_t i = 0; i < sizeof(twins) / sizeof(twins[0]); i++) unsetenv(twins[i]);
  setenv("NCCL_IB_GID_INDEX", "3", 1);
  setenv("NCCL_IB_HCA", "=mlx5_2", 1);
  setenv("NCCL_IB_TC", "106", 1);
  setenv("NCCL_IB_SL", "4", 1);
  setenv("MPLANE_IB_SL", "2", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_gid_index, 3);
  assert_string_equal(cfg.ib_hca, "=mlx5_2");
  assert_int_equal(cfg.ib_tc, 106);
  assert_int_equal(cfg.ib_sl, 2); /* MPLANE_IB_SL over NCCL_IB_SL */
  /* where each value came from (net/tc.c: a site's NCCL_IB_SL/TC give way to an explicit MPLANE_TC_MAP) */
  assert_string_equal(mplane_config_source("MPLANE_IB_SL"), "MPLANE_IB_SL");
  assert_string_equal(mplane_config_source("MPLANE_IB_TC"), "NCCL_IB_TC");
  assert_null(mplane_config_source("MPLANE_GIN_IB_TC"));
  setenv("NCCL_GIN_IB_TC", "98", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.gin_ib_tc, 98);
  assert_string_equal(mplane_config_source("MPLANE_GIN_IB_TC"), "NCCL_GIN_IB_TC");
  setenv("NCCL_IB_QPS_PER_CONNECTION", "2", 1); /* NCCL's name for it */
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_qps, 2);
  /* adaptive routing, its threshold and QP splitting as NCCL's net_ib takes them */
  assert_int_equal(cfg.ib_adaptive_routing, -1);
  assert_int_equal(cfg.ib_ar_threshold, 8192);
  assert_int_equal(cfg.ib_split_data_on_qps, 1);
  setenv("NCCL_IB_ADAPTIVE_ROUTING", "0", 1);
  setenv("NCCL_IB_AR_THRESHOLD", "65536", 1);
  setenv("NCCL_IB_SPLIT_DATA_ON_QPS", "0", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_adaptive_routing, 0);
  assert_int_equal(cfg.ib_ar_threshold, 65536);
  assert_int_equal(cfg.ib_split_data_on_qps, 0);
  assert_string_equal(mplane_config_source("MPLANE_IB_ADAPTIVE_ROUTING"), "NCCL_IB_ADAPTIVE_ROUTING");
  setenv("MPLANE_IB_SPLIT_DATA_ON_QPS", "1", 1); /* mplane's own name wins */
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_split_data_on_qps, 1);
  unsetenv("MPLANE_IB_SPLIT_DATA_ON_QPS");
  unsetenv("MPLANE_IB_SL");
  setenv("NCCL_IB_TIMEOUT", "abc", 1); /* NCCL reads it as 0 (infinite), which mplane ignores: never a failed init */
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_timeout, 20);
  setenv("NCCL_IB_TIMEOUT", "", 1); /* empty is unset: the default */
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_timeout, 20);
  assert_int_equal(cfg.ib_sl, 4);
  for (size_t i = 0; i < sizeof(twins) / sizeof(twins[0]); i++) unsetenv(twins[i]);
}

/* One NCCL_* value and what the MPLANE_* row must hold after it (NCCL's meaning), or the row's
 * default (DFLT: NCCL's "unset", or a value mplane ignores with a WARN). */
#define DFLT (-999999L)
struct twin_case {
  const char *nccl, *value;
  long want;
};

static const struct twin_case twin_cases[] = {
    /* NCCL's own defaults */
    {"NCCL_IB_GID_INDEX", "-1", -1}, {"NCCL_IB_SL", "-1", DFLT}, {"NCCL_IB_TC", "-1", DFLT},
    {"NCCL_GIN_IB_TC", "-1", DFLT}, {"NCCL_IB_FIFO_TC", "-1", DFLT}, {"NCCL_IB_TIMEOUT", "20", 20},
    {"NCCL_IB_RETRY_CNT", "7", 7}, {"NCCL_IB_PKEY", "0", 0}, {"NCCL_IB_QPS_PER_CONNECTION", "1", 1},
    {"NCCL_IB_ECE_ENABLE", "1", 1}, {"NCCL_IB_PCI_RELAXED_ORDERING", "2", 2}, {"NCCL_IB_ROCE_VERSION_NUM", "2", 2},
    {"NCCL_GDR_FLUSH_DISABLE", "0", 0}, {"NCCL_IB_ADAPTIVE_ROUTING", "-2", -1}, {"NCCL_IB_AR_THRESHOLD", "-2", DFLT},
    {"NCCL_IB_SPLIT_DATA_ON_QPS", "0", 0}, {"NCCL_IB_DEVICE_PCI_ORDER", "1", 1},
    /* NCCL's grammar: strtoll, base 0; text after the number ignored */
    {"NCCL_IB_TIMEOUT", "022", 18}, {"NCCL_IB_TIMEOUT", "0x10", 16}, {"NCCL_IB_TIMEOUT", "18 ", 18},
    {"NCCL_IB_SL", "+3", 3}, {"NCCL_IB_TC", "0x6a", 106}, {"NCCL_IB_AR_THRESHOLD", "64K", 64},
    {"NCCL_IB_TIMEOUT", "99999999999999999999", DFLT},
    /* edges NCCL accepts */
    {"NCCL_IB_QPS_PER_CONNECTION", "17", 16}, {"NCCL_IB_QPS_PER_CONNECTION", "128", 16},
    {"NCCL_IB_QPS_PER_CONNECTION", "0", DFLT}, {"NCCL_IB_QPS_PER_CONNECTION", "129", DFLT},
    {"NCCL_IB_AR_THRESHOLD", "2147483648", 1L << 30}, {"NCCL_IB_AR_THRESHOLD", "-1", 0},
    {"NCCL_IB_AR_THRESHOLD", "0", 0}, {"NCCL_IB_ADAPTIVE_ROUTING", "-1", 1}, {"NCCL_IB_ADAPTIVE_ROUTING", "2", 1},
    {"NCCL_IB_ADAPTIVE_ROUTING", "0", 0}, {"NCCL_IB_SL", "15", 15}, {"NCCL_IB_SL", "16", DFLT},
    {"NCCL_IB_TC", "255", 255}, {"NCCL_IB_TC", "256", DFLT}, {"NCCL_IB_FIFO_TC", "184", 184},
    {"NCCL_IB_TIMEOUT", "0", DFLT}, {"NCCL_IB_TIMEOUT", "31", 31}, {"NCCL_IB_TIMEOUT", "32", DFLT},
    {"NCCL_IB_RETRY_CNT", "8", DFLT}, {"NCCL_IB_PKEY", "65536", DFLT}, {"NCCL_IB_GID_INDEX", "-2", DFLT},
    {"NCCL_IB_ECE_ENABLE", "5", 1}, {"NCCL_GDR_FLUSH_DISABLE", "2", 1}, {"NCCL_IB_SPLIT_DATA_ON_QPS", "-1", 1},
    {"NCCL_IB_PCI_RELAXED_ORDERING", "3", 0}, {"NCCL_IB_ROCE_VERSION_NUM", "3", DFLT},
    {"NCCL_IB_DEVICE_PCI_ORDER", "0", 0}, {"NCCL_IB_SL", "abc", 0},
    /* text twins: a value mplane cannot use is ignored, never an error */
    {"NCCL_IB_ADDR_RANGE", "not-a-range", DFLT}, {"NCCL_IB_ADDR_FAMILY", "AF_UNIX", DFLT},
    {"NCCL_SOCKET_FAMILY", "AF_INET7", DFLT}, {"NCCL_IB_ADDR_FAMILY", "AF_INET6", 2}, {"NCCL_SOCKET_FAMILY", "AF_INET", 1},
};

/* The value of an int, bool, size or enum row of cfg by its name; 0 when unknown here. */
static int row_number(const struct mplane_config *cfg, const char *name, long *v) {
  for (size_t i = 0; i < sizeof(int_rows) / sizeof(int_rows[0]); i++)
    if (!strcmp(int_rows[i].name, name)) return *v = *(const int *)((const char *)cfg + int_rows[i].off), 1;
  if (!strcmp(name, "MPLANE_IB_AR_THRESHOLD")) return *v = cfg->ib_ar_threshold, 1;
  if (!strcmp(name, "MPLANE_IB_ECE")) return *v = cfg->ib_ece, 1;
  if (!strcmp(name, "MPLANE_IB_SPLIT_DATA_ON_QPS")) return *v = cfg->ib_split_data_on_qps, 1;
  if (!strcmp(name, "MPLANE_IB_GDR_FLUSH_DISABLE")) return *v = cfg->ib_gdr_flush_disable, 1;
  if (!strcmp(name, "MPLANE_IB_PCI_RELAXED_ORDERING")) return *v = cfg->ib_relaxed_ordering, 1;
  if (!strcmp(name, "MPLANE_IB_ROCE_VERSION_NUM")) return *v = cfg->ib_roce_version, 1;
  if (!strcmp(name, "MPLANE_IB_ADDR_FAMILY")) return *v = cfg->ib_addr_family, 1;
  if (!strcmp(name, "MPLANE_IB_SOCKET_FAMILY")) return *v = cfg->ib_socket_family, 1;
  if (!strcmp(name, "MPLANE_IB_ADDR_RANGE")) return *v = cfg->ib_addr_range[0] ? 1 : DFLT, 1;
  return 0;
}

/* Every NCCL twin of the config table, with NCCL's own default and edge values: each is read with
 * NCCL's grammar and meaning, and none makes the configuration fail (as it did for
 * NCCL_IB_ADAPTIVE_ROUTING=-2, NCCL_IB_SL=-1, NCCL_IB_QPS_PER_CONNECTION=17, NCCL_IB_AR_THRESHOLD
 * above 1 GiB, NCCL_IB_TIMEOUT=022). */
static void test_nccl_twins_nccl_values(void **state) {
  (void)state;
  const char *names[64], *nccl[64];
  int n = mplane_config_nccl_twins(names, nccl, 64);
  assert_true(n > 0 && n <= 64);
  int walked[64] = {0};
  struct mplane_config dflt, cfg;
  for (int t = 0; t < n; t++) unsetenv(nccl[t]), unsetenv(names[t]);
  assert_int_equal(mplane_config_load(&dflt, err, sizeof(err)), ncclSuccess);
  for (size_t c = 0; c < sizeof(twin_cases) / sizeof(twin_cases[0]); c++) {
    const struct twin_case *tc = &twin_cases[c];
    int t = 0;
    while (t < n && strcmp(nccl[t], tc->nccl) != 0) t++;
    if (t == n) fail_msg("%s is not a twin of the config table", tc->nccl);
    walked[t] = 1;
    setenv(tc->nccl, tc->value, 1);
    if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess)
      fail_msg("%s='%s' (a value NCCL accepts) failed the configuration: %s", tc->nccl, tc->value, err);
    long got = 0, base = 0;
    if (row_number(&cfg, names[t], &got)) {
      row_number(&dflt, names[t], &base);
      long want = tc->want == DFLT ? base : tc->want;
      if (tc->want == DFLT && !strcmp(names[t], "MPLANE_IB_ADDR_RANGE")) want = DFLT;
      if (got != want) fail_msg("%s='%s': %s is %ld, expected %ld", tc->nccl, tc->value, names[t], got, want);
    }
    unsetenv(tc->nccl);
  }
  /* the text twins and the rest: NCCL's examples */
  setenv("NCCL_IB_HCA", "^=mlx5_3:1", 1);
  setenv("NCCL_SOCKET_IFNAME", "=eth0:1,ib", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_string_equal(cfg.ib_hca, "^=mlx5_3:1");
  assert_string_equal(cfg.ib_socket_ifname, "=eth0,ib");
  assert_string_equal(cfg.socket_ifname, ""); /* the socket transport's own interfaces are mplane's to say */
  unsetenv("NCCL_IB_HCA");
  unsetenv("NCCL_SOCKET_IFNAME");
  for (int t = 0; t < n; t++)
    if (!walked[t] && strcmp(nccl[t], "NCCL_IB_HCA") && strcmp(nccl[t], "NCCL_SOCKET_IFNAME"))
      fail_msg("twin %s (of %s) has no NCCL value walked here", nccl[t], names[t]);
  /* NCCL's "unset" values leave the variable unset for those who ask where a value came from */
  setenv("NCCL_IB_SL", "-1", 1);
  assert_null(mplane_config_source("MPLANE_IB_SL"));
  setenv("NCCL_IB_SL", "3", 1);
  assert_string_equal(mplane_config_source("MPLANE_IB_SL"), "NCCL_IB_SL");
  unsetenv("NCCL_IB_SL");
  /* the old, non-NCCL name is not read */
  setenv("NCCL_IB_GDR_FLUSH_DISABLE", "1", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_gdr_flush_disable, 0);
  unsetenv("NCCL_IB_GDR_FLUSH_DISABLE");
  setenv("NCCL_GDR_FLUSH_DISABLE", "1", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclSuccess);
  assert_int_equal(cfg.ib_gdr_flush_disable, 1);
  unsetenv("NCCL_GDR_FLUSH_DISABLE");
  /* mplane's own grammar stays strict for its own names */
  setenv("MPLANE_IB_TIMEOUT", "022", 1);
  assert_int_equal(mplane_config_load(&cfg, err, sizeof(err)), ncclInvalidArgument);
  unsetenv("MPLANE_IB_TIMEOUT");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(test_table_is_described, setup, teardown),
      cmocka_unit_test_setup_teardown(test_defaults, setup, teardown),
      cmocka_unit_test_setup_teardown(test_described_defaults_parse, setup, teardown),
      cmocka_unit_test_setup_teardown(test_every_row_refuses_garbage, setup, teardown),
      cmocka_unit_test_setup_teardown(test_int_rows, setup, teardown),
      cmocka_unit_test_setup_teardown(test_socket_speed_refuses_zero, setup, teardown),
      cmocka_unit_test_setup_teardown(test_empty_is_unset, setup, teardown),
      cmocka_unit_test_setup_teardown(test_streams_form_is_explicit, setup, teardown),
      cmocka_unit_test_setup_teardown(test_size_row, setup, teardown),
      cmocka_unit_test_setup_teardown(test_enum_rows, setup, teardown),
      cmocka_unit_test_setup_teardown(test_str_rows, setup, teardown),
      cmocka_unit_test_setup_teardown(test_tc_map_grammar, setup, teardown),
      cmocka_unit_test_setup_teardown(test_one_bad_among_good, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ep_rows_their_own_reader, setup, teardown),
      cmocka_unit_test_setup_teardown(test_hfreduce_rows_their_own_reader, setup, teardown),
      cmocka_unit_test_setup_teardown(test_nccl_twins_nccl_values, setup, teardown),
      cmocka_unit_test_setup_teardown(test_short_error_buffer, setup, teardown),
      cmocka_unit_test_setup_teardown(test_parse_long, setup, teardown),
      cmocka_unit_test_setup_teardown(test_numbers_exact_form, setup, teardown),
      cmocka_unit_test_setup_teardown(test_ifname_port_suffix, setup, teardown),
      cmocka_unit_test_setup_teardown(test_open_regular_file, setup, teardown),
      cmocka_unit_test_setup_teardown(test_describe_plain, setup, teardown),
      cmocka_unit_test_setup_teardown(test_nccl_twins, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
