/* mplane: MPLANE_* environment parsing (see config.h). */
#include "config.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "log.h"
#include "../net/tc.h"
#include "../topo/topo.h"

enum kind { K_INT, K_SIZE, K_BOOL, K_ENUM, K_STR };

struct row {
  const char *name;
  enum kind kind;
  size_t offset;
  size_t str_len;      /* K_STR: capacity of the field */
  const char *dflt;    /* textual default, parsed like a user value */
  long lo, hi;         /* K_INT / K_SIZE bounds */
  const char *choices; /* K_ENUM: '|'-separated, index = stored value */
  const char *form;    /* accepted form, for errors and docs */
  const char *meaning; /* one line for docs */
  /* Optional deeper check of a K_STR grammar (tc map, planes): 0 if valid, else writes why. */
  int (*validate)(const char *value, char *why, size_t whylen);
};

/* MPLANE_SOCKET_SPEED: the range check allows -1..10000000; 0 is in it but is no speed. */
static int speed_validate(const char *value, char *why, size_t whylen) {
  long v;
  if (mplane_parse_long(value, -1, 10000000, &v) == 0 && v == 0) {
    snprintf(why, whylen, "0 Mb/s is no speed (-1 asks for the automatic one)");
    return -1;
  }
  return 0;
}

#define OFF(f) offsetof(struct mplane_config, f)
#define STR(f) OFF(f), sizeof(((struct mplane_config *)0)->f)

static const struct row rows[] = {
    {"MPLANE_TRANSPORT", K_ENUM, OFF(transport), 0, "auto", 0, 0, "auto|ib|socket", "auto, ib or socket",
     "transport: auto picks InfiniBand/RoCE where an active port exists, else TCP sockets"},
    {"MPLANE_SOCKET_IFNAME", K_STR, STR(socket_ifname), "", 0, 0, NULL,
     "NCCL_SOCKET_IFNAME grammar: prefixes, ^ to exclude, = for exact names, comma separated",
     "interfaces the socket transport uses (default: every up, non-loopback interface)"},
    {"MPLANE_SOCKET_STREAMS", K_INT, OFF(socket_streams), 0, "4", 1, 16, NULL, "an integer from 1 to 16",
     "TCP data streams per connection"},
    {"MPLANE_SOCKET_THREADS", K_INT, OFF(socket_threads), 0, "4", 1, 16, NULL, "an integer from 1 to 16",
     "helper threads per connection that move the data streams"},
    {"MPLANE_SOCKET_SPLIT_BYTES", K_SIZE, OFF(socket_split_bytes), 0, "256K", 1, 1L << 30, NULL,
     "a size in bytes, K/M/G suffixes allowed, from 1 to 1G",
     "messages at least this big are split across the streams; smaller ones ride one stream"},
    {"MPLANE_SOCKET_SPEED", K_INT, OFF(socket_speed_mbps), 0, "-1", -1, 10000000, NULL,
     "-1 (automatic) or Mb/s from 1 to 10000000",
     "speed reported where the driver reports none; NCCL sizes its channels by it (automatic: loopback "
     "400000, since it has no link and moves bytes at memory speed; other interfaces 10000, NCCL's own guess)",
     speed_validate},
    {"MPLANE_SOCKET_SPIN_US", K_INT, OFF(socket_spin_us), 0, "0", 0, 10000, NULL,
     "microseconds, an integer from 0 to 10000",
     "how long a helper thread polls for the next message before it sleeps (0: sleep at once)"},
    {"MPLANE_NCCL_DEFAULTS", K_BOOL, OFF(nccl_defaults), 0, "1", 0, 1, NULL, "0 or 1",
     "set NCCL tuning variables the user left unset to values suited to the transport (logged at INFO)"},
    {"MPLANE_CONNECT_TIMEOUT", K_INT, OFF(connect_timeout_s), 0, "120", 1, 3600, NULL,
     "seconds, an integer from 1 to 3600", "deadline for a connection handshake before it fails"},
    {"MPLANE_PLANES", K_STR, STR(planes), "", 0, 0, NULL, "NIC=plane pairs, e.g. mlx5_0=0,mlx5_1=1",
     "plane of each NIC (default: from the fabric, then PCI order)", mplane_topo_planes_validate},
    {"MPLANE_TOPO_FILE", K_STR, STR(topo_file), "", 0, 0, NULL, "a path to an hwloc XML file",
     "discover the node from this hwloc XML instead of the live machine"},
    {"MPLANE_NCCL_TOPO", K_BOOL, OFF(nccl_topo), 0, "1", 0, 1, NULL, "0 or 1",
     "write the node's NCCL topology (with NIC planes) and point NCCL_TOPO_FILE at it"},
    {"MPLANE_RELAY", K_ENUM, OFF(relay), 0, "auto", 0, 0, "auto|nvlink|pcie|host|off",
     "auto, nvlink, pcie, host or off", "how cross-plane connections are relayed (off: they fail)"},
    {"MPLANE_TC_MAP", K_STR, STR(tc_map), "default=0,collective=0,alltoall=3,lowlat=5,storage=1", 0, 0, NULL,
     "class=SL pairs, classes default|collective|alltoall|lowlat|storage, SL 0..15",
     "traffic class to service level (IB SL, RoCE/IP traffic class)", mplane_tc_validate},
    {"MPLANE_STATS_FILE", K_STR, STR(stats_file), "", 0, 0, NULL, "a path; %p expands to the process id",
     "write per-plane and per-class counters as JSON at close"},
    {"MPLANE_IB_HCA", K_STR, STR(ib_hca), "", 0, 0, NULL, "NCCL_IB_HCA grammar, e.g. mlx5_0:1,mlx5_1",
     "HCAs and ports the IB transport uses (default: every active port)"},
    {"MPLANE_IB_GID_INDEX", K_INT, OFF(ib_gid_index), 0, "-1", -1, 255, NULL, "-1 (automatic) or 0..255",
     "RoCE GID index (automatic: RoCE v2, IPv4-mapped first)"},
    {"MPLANE_IB_SL", K_INT, OFF(ib_sl), 0, "0", 0, 15, NULL, "an integer from 0 to 15",
     "service level for traffic with no class"},
    {"MPLANE_IB_TIMEOUT", K_INT, OFF(ib_timeout), 0, "20", 1, 31, NULL, "an integer from 1 to 31",
     "IB local ACK timeout exponent (4.096us * 2^n)"},
    {"MPLANE_IB_RETRY_CNT", K_INT, OFF(ib_retry_cnt), 0, "7", 0, 7, NULL, "an integer from 0 to 7",
     "IB transport retry count"},
    {"MPLANE_IB_QPS", K_INT, OFF(ib_qps), 0, "2", 1, 16, NULL, "an integer from 1 to 16",
     "queue pairs per connection; large messages are striped across them"},
    {"MPLANE_IBVERBS_LIB", K_STR, STR(ibverbs_lib), "libibverbs.so.1", 0, 0, NULL, "a library name or path",
     "the libibverbs to dlopen (tests point it at the software verbs double)"},
    {"MPLANE_DEBUG", K_INT, OFF(debug), 0, "0", 0, 2, NULL, "0, 1 (INFO) or 2 (INFO and TRACE)",
     "mplane's own messages on stderr when NCCL's logger is not in use (tools, tests)"},
    {"MPLANE_TUNER_CONFIG", K_STR, STR(tuner_config), "", 0, 0, NULL, "a path to a CSV tuner table",
     "tuner table; without one the tuner changes nothing"},
};

int mplane_parse_long(const char *s, long lo, long hi, long *out) {
  if (!s || !*s) return -1;
  char *end = NULL;
  errno = 0;
  long v = strtol(s, &end, 10);
  if (errno || *end != '\0' || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

static int parse_size(const char *s, long lo, long hi, long *out) {
  if (!s || !*s) return -1;
  char *end = NULL;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || end == s || v < 0) return -1;
  long long mult = 1;
  if (*end) {
    switch (*end) {
      case 'k': case 'K': mult = 1LL << 10; break;
      case 'm': case 'M': mult = 1LL << 20; break;
      case 'g': case 'G': mult = 1LL << 30; break;
      default: return -1;
    }
    if (end[1] != '\0') return -1;
  }
  if (v > hi / mult) return -1;
  v *= mult;
  if (v < lo || v > hi) return -1;
  *out = (long)v;
  return 0;
}

static int parse_enum(const char *s, const char *choices, int *out) {
  int idx = 0;
  size_t n = strlen(s);
  for (const char *p = choices; *p; idx++) {
    const char *bar = strchr(p, '|');
    size_t len = bar ? (size_t)(bar - p) : strlen(p);
    if (len == n && strncasecmp(p, s, n) == 0) {
      *out = idx;
      return 0;
    }
    if (!bar) break;
    p = bar + 1;
  }
  return -1;
}

static int parse_row(const struct row *r, const char *value, struct mplane_config *cfg) {
  char *field = (char *)cfg + r->offset;
  long v;
  switch (r->kind) {
    case K_INT:
      if (mplane_parse_long(value, r->lo, r->hi, &v)) return -1;
      *(int *)field = (int)v;
      return 0;
    case K_SIZE:
      if (parse_size(value, r->lo, r->hi, &v)) return -1;
      *(long *)field = v;
      return 0;
    case K_BOOL:
      if (mplane_parse_long(value, 0, 1, &v)) return -1;
      *(int *)field = (int)v;
      return 0;
    case K_ENUM:
      return parse_enum(value, r->choices, (int *)field);
    case K_STR:
      if (strlen(value) >= r->str_len) return -1;
      strcpy(field, value);
      return 0;
  }
  return -1;
}

ncclResult_t mplane_config_load(struct mplane_config *cfg, char *err, size_t errlen) {
  memset(cfg, 0, sizeof(*cfg));
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    const struct row *r = &rows[i];
    if (parse_row(r, r->dflt, cfg) != 0) {
      snprintf(err, errlen, "internal: default of %s does not parse", r->name);
      return ncclInternalError;
    }
    const char *value = getenv(r->name);
    if (value == NULL || value[0] == '\0') continue; /* empty is unset, as NCCL reads its variables */
    if (parse_row(r, value, cfg) != 0) {
      snprintf(err, errlen, "%s='%s' is not valid: expected %s", r->name, value, r->form);
      return ncclInvalidArgument;
    }
    char why[256] = "";
    if (r->validate && r->validate(value, why, sizeof(why)) != 0) {
      snprintf(err, errlen, "%s='%s' is not valid: %s; expected %s", r->name, value, why, r->form);
      return ncclInvalidArgument;
    }
  }
  return ncclSuccess;
}

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static struct mplane_config global_config;
static int global_config_ok;

static void load_global(void) {
  char err[512];
  if (mplane_config_load(&global_config, err, sizeof(err)) != ncclSuccess) {
    MP_WARN("%s", err);
    return;
  }
  global_config_ok = 1;
}

const struct mplane_config *mplane_config_get(void) {
  pthread_once(&config_once, load_global);
  return global_config_ok ? &global_config : NULL;
}

/* A Markdown table cell: '|' would end the cell, so it is escaped. */
static void md_cell(FILE *out, const char *text) {
  for (const char *c = text; *c; c++) {
    if (*c == '|') fputc('\\', out);
    fputc(*c, out);
  }
}

void mplane_config_describe(FILE *out, int markdown) {
  if (markdown) fprintf(out, "| variable | default | accepted | meaning |\n| --- | --- | --- | --- |\n");
  for (size_t i = 0; i < sizeof(rows) / sizeof(rows[0]); i++) {
    const struct row *r = &rows[i];
    const char *d = *r->dflt ? r->dflt : "(unset)";
    if (markdown) {
      fprintf(out, "| `%s` | `%s` | ", r->name, d);
      md_cell(out, r->form);
      fputs(" | ", out);
      md_cell(out, r->meaning);
      fputs(" |\n", out);
    } else
      fprintf(out, "%-26s default %-12s %s\n%26s accepted: %s\n", r->name, d, r->meaning, "", r->form);
  }
}
