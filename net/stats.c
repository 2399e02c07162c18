/* mplane: traffic counters (see stats.h). */
#include "stats.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../common/clock.h"
#include "../common/config.h"
#include "../common/log.h"
#include "handle.h"
#include "tc.h"

#define ADD(p, v) __atomic_add_fetch((p), (v), __ATOMIC_RELAXED)
#define LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

/* ---- a small pointer-keyed hash map (linear probing, backward-shift delete) for listen comms, under
 * the lock (connection setup only, never the data path) ---- */
struct pmap_ent {
  void *key;
  void *val;
};
struct pmap {
  struct pmap_ent *e;
  size_t cap, n;
};

static size_t ptr_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return (size_t)x;
}

static int pmap_grow(struct pmap *m) {
  size_t ncap = m->cap ? m->cap * 2 : 256;
  struct pmap_ent *ne = calloc(ncap, sizeof(*ne));
  if (!ne) return -1;
  for (size_t i = 0; i < m->cap; i++) {
    if (!m->e[i].key) continue;
    size_t j = ptr_hash(m->e[i].key) & (ncap - 1);
    while (ne[j].key) j = (j + 1) & (ncap - 1);
    ne[j] = m->e[i];
  }
  free(m->e);
  m->e = ne;
  m->cap = ncap;
  return 0;
}

static int pmap_put(struct pmap *m, void *key, void *val) {
  if ((m->n + 1) * 2 > m->cap && pmap_grow(m) != 0) return -1;
  size_t j = ptr_hash(key) & (m->cap - 1);
  while (m->e[j].key && m->e[j].key != key) j = (j + 1) & (m->cap - 1);
  if (!m->e[j].key) m->n++;
  m->e[j].key = key;
  m->e[j].val = val;
  return 0;
}

static void *pmap_get(struct pmap *m, void *key) {
  if (!m->cap) return NULL;
  size_t j = ptr_hash(key) & (m->cap - 1);
  while (m->e[j].key) {
    if (m->e[j].key == key) return m->e[j].val;
    j = (j + 1) & (m->cap - 1);
  }
  return NULL;
}

static void *pmap_del(struct pmap *m, void *key) {
  if (!m->cap) return NULL;
  size_t mask = m->cap - 1, j = ptr_hash(key) & mask;
  while (m->e[j].key && m->e[j].key != key) j = (j + 1) & mask;
  if (!m->e[j].key) return NULL;
  void *val = m->e[j].val;
  m->e[j].key = NULL;
  m->n--;
  /* Backward shift: move later entries of the cluster into the hole when that brings them closer. */
  size_t hole = j, k = (j + 1) & mask;
  while (m->e[k].key) {
    size_t home = ptr_hash(m->e[k].key) & mask;
    if (((k - home) & mask) >= ((k - hole) & mask)) {
      m->e[hole] = m->e[k];
      m->e[k].key = NULL;
      hole = k;
    }
    k = (k + 1) & mask;
  }
  return val;
}

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static struct pmap listens;
static struct mplane_stats_totals totals; /* closed comms' counters, and comms opened/closed */
static struct mplane_stats_comm *live;     /* open comms, whose counters a snapshot adds */

struct listen_rec {
  int dev, cls;
};

/* Bytes on a device with no plane (loopback, a NIC topo/ left out) still count: under plane -1. */
static struct mplane_stats_counters *plane_ctr(struct mplane_stats_totals *t, int plane) {
  if (plane < 0 || plane >= MPLANE_STATS_MAX_PLANES) return &t->plane_unknown;
  return &t->plane[plane];
}

static struct mplane_stats_counters *class_ctr(struct mplane_stats_totals *t, int cls) {
  if (cls < 0 || cls >= MPLANE_TC_NCLASSES) cls = MPLANE_TC_DEFAULT;
  return &t->cls[cls];
}

/* ---- reconnects: the (peer host, device, direction) of the comms that closed, newest first kept ---- */
#define PAST_COMMS 1024
static uint64_t past[PAST_COMMS]; /* under the lock */
static unsigned npast;

/* The peer's host (its address text without ":port"), device and direction, hashed. */
static uint64_t peer_key(const struct mplane_stats_comm *s) {
  size_t n = strlen(s->peer);
  const char *colon = strrchr(s->peer, ':');
  if (colon && colon[1] && strspn(colon + 1, "0123456789") == strlen(colon + 1)) n = (size_t)(colon - s->peer);
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ (unsigned char)s->peer[i]) * 1099511628211ull;
  return (h ^ ((uint64_t)(unsigned)s->info.dev << 1) ^ (uint64_t)(s->info.is_send != 0)) | 1; /* 0: empty */
}

static int seen_before(uint64_t key) {
  unsigned n = npast < PAST_COMMS ? npast : PAST_COMMS;
  for (unsigned i = 0; i < n; i++)
    if (past[i] == key) return 1;
  return 0;
}

static void writer_start(void);

void mplane_stats_comm_open(struct mplane_stats_comm *s, const struct mplane_stats_comm_info *info) {
  if (!s || !info) return;
  memset(s, 0, sizeof(*s));
  s->info = *info;
  snprintf(s->dev_name, sizeof(s->dev_name), "%s", info->dev_name ? info->dev_name : "?");
  snprintf(s->peer, sizeof(s->peer), "%s", info->peer ? info->peer : "");
  s->info.dev_name = s->dev_name;
  s->info.peer = s->peer;
  s->open = 1;
  pthread_mutex_lock(&lock);
  s->next = live;
  if (live) live->prev = s;
  live = s;
  totals.comms_opened++;
  if (s->peer[0] && seen_before(peer_key(s))) totals.reconnects++;
  pthread_mutex_unlock(&lock);
  writer_start();
}

/* Bucket 0: under 1 us; then 4 per doubling: bucket 1 + 4*e + f holds [2^e, 2^(e+1)) us, quarter f. */
static int time_bucket(uint64_t ns) {
  uint64_t us = ns / 1000;
  if (us == 0) return 0;
  int e = 63 - __builtin_clzll(us);
  int f = e >= 2 ? (int)((us >> (e - 2)) & 3) : (int)((us << (2 - e)) & 3);
  int b = 1 + 4 * e + f;
  return b < MPLANE_STATS_TIME_BUCKETS ? b : MPLANE_STATS_TIME_BUCKETS - 1;
}

/* The upper edge of bucket b, in us. */
static double bucket_top_us(int b) {
  if (b == 0) return 1;
  int e = (b - 1) / 4, f = (b - 1) % 4;
  return (double)(1ull << e) * (1.0 + (f + 1) / 4.0);
}

double mplane_stats_time_quantile(const struct mplane_stats_comm *s, double q) {
  uint64_t n = 0, seen = 0;
  for (int b = 0; b < MPLANE_STATS_TIME_BUCKETS; b++) n += LOAD(&s->time_us[b]);
  if (n == 0) return 0;
  uint64_t want = (uint64_t)(q * (double)n + 0.999999);
  if (want < 1) want = 1;
  for (int b = 0; b < MPLANE_STATS_TIME_BUCKETS; b++) {
    seen += LOAD(&s->time_us[b]);
    if (seen >= want) return bucket_top_us(b);
  }
  return bucket_top_us(MPLANE_STATS_TIME_BUCKETS - 1);
}

void mplane_stats_request(struct mplane_stats_comm *s, struct mplane_stats_req *r, size_t send_bytes, int nrecv) {
  if (!r) return;
  r->comm = s && s->open ? s : NULL;
  r->send_bytes = send_bytes;
  r->nrecv = nrecv;
  r->start_ns = r->comm ? mplane_now_ns() : 0;
}

void mplane_stats_request_done(struct mplane_stats_req *r, const int *sizes) {
  if (!r || !r->comm) return;
  struct mplane_stats_comm *c = r->comm;
  r->comm = NULL;
  if (!c->open) return;
  ADD(&c->time_us[time_bucket(mplane_now_ns() - r->start_ns)], 1);
  struct mplane_stats_counters *k = &c->c;
  if (c->info.is_send) {
    ADD(&k->tx_bytes, r->send_bytes);
    ADD(&k->tx_msgs, 1);
    if (c->info.relayed) ADD(&k->relayed_bytes, r->send_bytes);
    return;
  }
  uint64_t bytes = 0;
  for (int i = 0; sizes && i < r->nrecv; i++) bytes += (uint64_t)(sizes[i] > 0 ? sizes[i] : 0);
  ADD(&k->rx_bytes, bytes);
  ADD(&k->rx_msgs, (uint64_t)r->nrecv);
}

void mplane_stats_comm_error(struct mplane_stats_comm *s) {
  if (s && s->open) ADD(&s->c.errors, 1);
}

void mplane_stats_request_error(struct mplane_stats_req *r) {
  if (!r || !r->comm) return;
  struct mplane_stats_comm *c = r->comm;
  r->comm = NULL;
  mplane_stats_comm_error(c);
}

void mplane_stats_rma(struct mplane_stats_comm *c, uint64_t bytes, int is_get) {
  if (!c || !c->open) return;
  struct mplane_stats_counters *k = &c->c;
  ADD(is_get ? &k->rx_bytes : &k->tx_bytes, bytes);
  ADD(is_get ? &k->rx_msgs : &k->tx_msgs, 1);
  if (!is_get && c->info.relayed) ADD(&k->relayed_bytes, bytes);
}

static void add_ctr(struct mplane_stats_counters *d, const struct mplane_stats_counters *s) {
  d->tx_bytes += LOAD(&s->tx_bytes);
  d->tx_msgs += LOAD(&s->tx_msgs);
  d->rx_bytes += LOAD(&s->rx_bytes);
  d->rx_msgs += LOAD(&s->rx_msgs);
  d->relayed_bytes += LOAD(&s->relayed_bytes);
  d->errors += LOAD(&s->errors);
}

/* A comm's counters into its plane's and its class's (under the lock). */
static void fold(struct mplane_stats_totals *t, const struct mplane_stats_comm *c) {
  add_ctr(plane_ctr(t, c->info.plane), &c->c);
  add_ctr(class_ctr(t, c->info.cls), &c->c);
}

static void human(uint64_t b, char *buf, size_t len) {
  const char *u[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = (double)b;
  int i = 0;
  while (v >= 1024 && i < 4) {
    v /= 1024;
    i++;
  }
  snprintf(buf, len, i ? "%.1f %s" : "%.0f %s", v, u[i]);
}

void mplane_stats_comm_close(struct mplane_stats_comm *c) {
  if (!c || !c->open) return;
  pthread_mutex_lock(&lock);
  c->open = 0;
  if (c->prev) c->prev->next = c->next;
  else live = c->next;
  if (c->next) c->next->prev = c->prev;
  c->prev = c->next = NULL;
  fold(&totals, c);
  totals.comms_closed++;
  if (c->peer[0] && !seen_before(peer_key(c))) past[npast++ % PAST_COMMS] = peer_key(c);
  pthread_mutex_unlock(&lock);
  char bytes[32], rel[64] = "";
  const struct mplane_stats_counters *k = &c->c;
  human(c->info.is_send ? k->tx_bytes : k->rx_bytes, bytes, sizeof(bytes));
  if (c->info.relayed) {
    char rb[32];
    human(k->relayed_bytes, rb, sizeof(rb));
    snprintf(rel, sizeof(rel), " (relayed from plane %d: %s)", c->info.from_plane, rb);
  }
  char times[96] = "";
  if (mplane_stats_time_quantile(c, 1) > 0)
    snprintf(times, sizeof(times), "; %s to done: median <= %.0f us, p99 <= %.0f us",
             c->info.is_send ? "isend" : "irecv", mplane_stats_time_quantile(c, 0.5), mplane_stats_time_quantile(c, 0.99));
  MP_INFO(NCCL_NET, "stats: %s comm %s %s via %s plane %d class %s SL %d: %llu messages, %s%s%s",
          c->info.is_send ? "send" : "recv", c->info.is_send ? "to" : "from", c->peer[0] ? c->peer : "peer",
          c->dev_name, c->info.plane, mplane_tc_class_name(c->info.cls), c->info.sl,
          (unsigned long long)(c->info.is_send ? k->tx_msgs : k->rx_msgs), bytes, rel, times);
  mplane_stats_flush();
}

void mplane_stats_listen(void *listen_comm, int dev, int cls) {
  if (!listen_comm) return;
  struct listen_rec *l = malloc(sizeof(*l));
  if (!l) return;
  l->dev = dev;
  l->cls = cls;
  pthread_mutex_lock(&lock);
  struct listen_rec *old = pmap_get(&listens, listen_comm);
  if (pmap_put(&listens, listen_comm, l) != 0) free(l);
  else free(old);
  pthread_mutex_unlock(&lock);
}

int mplane_stats_listen_get(void *listen_comm, int *dev, int *cls) {
  pthread_mutex_lock(&lock);
  struct listen_rec *l = pmap_get(&listens, listen_comm);
  if (l) {
    *dev = l->dev;
    *cls = l->cls;
  }
  pthread_mutex_unlock(&lock);
  return l ? 0 : -1;
}

void mplane_stats_listen_close(void *listen_comm) {
  pthread_mutex_lock(&lock);
  free(pmap_del(&listens, listen_comm));
  pthread_mutex_unlock(&lock);
}

void mplane_stats_snapshot(struct mplane_stats_totals *out) {
  pthread_mutex_lock(&lock);
  *out = totals;
  for (const struct mplane_stats_comm *c = live; c; c = c->next) fold(out, c);
  pthread_mutex_unlock(&lock);
}

static void json_ctr(FILE *f, const struct mplane_stats_counters *k) {
  fprintf(f, "\"tx_bytes\": %llu, \"tx_msgs\": %llu, \"rx_bytes\": %llu, \"rx_msgs\": %llu, \"relayed_bytes\": %llu, "
          "\"errors\": %llu", (unsigned long long)k->tx_bytes, (unsigned long long)k->tx_msgs,
          (unsigned long long)k->rx_bytes, (unsigned long long)k->rx_msgs, (unsigned long long)k->relayed_bytes,
          (unsigned long long)k->errors);
}

static int ctr_zero(const struct mplane_stats_counters *k) {
  return !k->tx_bytes && !k->tx_msgs && !k->rx_bytes && !k->rx_msgs && !k->relayed_bytes && !k->errors;
}

void mplane_stats_write_json(FILE *f) {
  struct mplane_stats_totals t;
  mplane_stats_snapshot(&t);
  fprintf(f, "{\n  \"pid\": %d,\n  \"node_id\": \"%016llx\",\n  \"comms_opened\": %llu,\n  \"comms_closed\": %llu,\n"
          "  \"reconnects\": %llu,\n", (int)getpid(), (unsigned long long)mplane_node_id(),
          (unsigned long long)t.comms_opened, (unsigned long long)t.comms_closed, (unsigned long long)t.reconnects);
  fprintf(f, "  \"planes\": [");
  int first = 1;
  for (int p = -1; p < MPLANE_STATS_MAX_PLANES; p++) {
    const struct mplane_stats_counters *k = p < 0 ? &t.plane_unknown : &t.plane[p];
    if (ctr_zero(k)) continue;
    fprintf(f, "%s\n    {\"plane\": %d, ", first ? "" : ",", p);
    json_ctr(f, k);
    fprintf(f, "}");
    first = 0;
  }
  fprintf(f, "%s],\n  \"classes\": [", first ? "" : "\n  ");
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++) {
    fprintf(f, "%s\n    {\"class\": \"%s\", \"sl\": %d, ", c ? "," : "", mplane_tc_class_name(c), mplane_tc_sl(c));
    json_ctr(f, &t.cls[c]);
    fprintf(f, "}");
  }
  fprintf(f, "\n  ]\n}\n");
}

int mplane_stats_expand_path(const char *pattern, char *out, size_t outlen) {
  size_t o = 0;
  for (const char *p = pattern; *p; p++) {
    char tmp[32];
    const char *ins = NULL;
    char one[2] = {*p, 0};
    if (*p == '%' && p[1] == 'p') {
      snprintf(tmp, sizeof(tmp), "%d", (int)getpid());
      ins = tmp;
      p++;
    } else if (*p == '%' && p[1] == '%') {
      ins = "%";
      p++;
    } else {
      ins = one;
    }
    size_t l = strlen(ins);
    if (o + l >= outlen) return -1;
    memcpy(out + o, ins, l);
    o += l;
  }
  out[o] = 0;
  return 0;
}

/* ---- Prometheus text format: one family per counter, labels by Prometheus' conventions ---- */
static void prom_family(FILE *f, const char *name, const char *help) {
  fprintf(f, "# HELP %s %s\n# TYPE %s counter\n", name, help, name);
}

static void prom_plane_label(char *out, size_t len, int p) {
  if (p < 0) snprintf(out, len, "unknown");
  else snprintf(out, len, "%d", p);
}

/* Value of one counter of k: 0 tx_bytes, 1 tx_msgs, 2 rx_bytes, 3 rx_msgs, 4 relayed_bytes, 5 errors. */
static uint64_t ctr_field(const struct mplane_stats_counters *k, int field) {
  const uint64_t v[] = {k->tx_bytes, k->tx_msgs, k->rx_bytes, k->rx_msgs, k->relayed_bytes, k->errors};
  return v[field];
}

/* Per plane and per class: a family for bytes and one for messages (direction send/receive), relayed
 * bytes, errors. Planes with nothing counted are left out, as in the JSON; every class is written. */
static void prom_counters(FILE *f, const struct mplane_stats_totals *t, int pid) {
  static const struct {
    const char *name, *help;
    int tx, rx; /* ctr_field of the send and receive direction; rx -1: no direction label */
  } fam[] = {
      {"bytes_total", "Bytes moved through mplane", 0, 2},
      {"messages_total", "Messages moved through mplane (a receive counts each buffer)", 1, 3},
      {"relayed_bytes_total", "Bytes sent through a relay NIC on a cross-plane connection", 4, -1},
      {"errors_total", "Requests and posts that returned an error to NCCL", 5, -1},
  };
  for (int by_class = 0; by_class < 2; by_class++) {
    for (size_t m = 0; m < sizeof(fam) / sizeof(fam[0]); m++) {
      char name[96], help[192];
      snprintf(name, sizeof(name), "mplane_%s_%s", by_class ? "class" : "plane", fam[m].name);
      snprintf(help, sizeof(help), "%s, per %s%s.", fam[m].help, by_class ? "traffic class (with its service level)" : "network plane",
               fam[m].rx < 0 ? "" : " and direction");
      prom_family(f, name, help);
      int n = by_class ? MPLANE_TC_NCLASSES : MPLANE_STATS_MAX_PLANES + 1;
      for (int i = 0; i < n; i++) {
        const struct mplane_stats_counters *k = by_class ? &t->cls[i] : i == 0 ? &t->plane_unknown : &t->plane[i - 1];
        if (!by_class && ctr_zero(k)) continue;
        char who[96];
        if (by_class)
          snprintf(who, sizeof(who), "class=\"%s\",sl=\"%d\"", mplane_tc_class_name(i), mplane_tc_sl(i));
        else {
          char pl[16];
          prom_plane_label(pl, sizeof(pl), i - 1);
          snprintf(who, sizeof(who), "plane=\"%s\"", pl);
        }
        if (fam[m].rx < 0) {
          fprintf(f, "%s{pid=\"%d\",%s} %llu\n", name, pid, who, (unsigned long long)ctr_field(k, fam[m].tx));
          continue;
        }
        fprintf(f, "%s{pid=\"%d\",%s,direction=\"send\"} %llu\n", name, pid, who,
                (unsigned long long)ctr_field(k, fam[m].tx));
        fprintf(f, "%s{pid=\"%d\",%s,direction=\"receive\"} %llu\n", name, pid, who,
                (unsigned long long)ctr_field(k, fam[m].rx));
      }
    }
  }
}

void mplane_stats_write_prometheus(FILE *f) {
  struct mplane_stats_totals t;
  mplane_stats_snapshot(&t);
  int pid = (int)getpid();
  prom_counters(f, &t, pid);
  prom_family(f, "mplane_comms_opened_total", "Send and receive comms opened.");
  fprintf(f, "mplane_comms_opened_total{pid=\"%d\"} %llu\n", pid, (unsigned long long)t.comms_opened);
  prom_family(f, "mplane_comms_closed_total", "Send and receive comms closed.");
  fprintf(f, "mplane_comms_closed_total{pid=\"%d\"} %llu\n", pid, (unsigned long long)t.comms_closed);
  prom_family(f, "mplane_reconnects_total",
              "Comms opened to a peer host, on a device and direction, that a closed comm of this process served.");
  fprintf(f, "mplane_reconnects_total{pid=\"%d\"} %llu\n", pid, (unsigned long long)t.reconnects);
}

/* Write one counters file whole: a temp file beside it, renamed over it (readers never see half). */
static void write_file(const char *path, int prometheus) {
  char tmp[4200];
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  FILE *f = fopen(tmp, "w");
  if (!f) {
    static int warned;
    if (!warned++) MP_WARN("MPLANE_STATS_FILE: cannot write %s: %s", tmp, strerror(errno));
    return;
  }
  if (prometheus) mplane_stats_write_prometheus(f);
  else mplane_stats_write_json(f);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
    MP_WARN("MPLANE_STATS_FILE: writing %s failed: %s", path, strerror(errno));
    unlink(tmp);
  }
}

void mplane_stats_flush(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg || !cfg->stats_file[0]) return;
  char path[4096], prom[4100];
  if (mplane_stats_expand_path(cfg->stats_file, path, sizeof(path)) != 0) return;
  static pthread_mutex_t file_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&file_lock);
  if (cfg->stats_format != MPLANE_STATS_PROMETHEUS) write_file(path, 0);
  if (cfg->stats_format == MPLANE_STATS_PROMETHEUS) write_file(path, 1);
  if (cfg->stats_format == MPLANE_STATS_BOTH) {
    snprintf(prom, sizeof(prom), "%s.prom", path);
    write_file(prom, 1);
  }
  pthread_mutex_unlock(&file_lock);
}

/* ---- the writer: rewrites the file every MPLANE_STATS_INTERVAL seconds once a comm has opened. One
 * thread per process, started off the data path; stopped when the library unloads (NCCL dlcloses its
 * net plugin) or the process exits, and forgotten in a forked child (which has no such thread). */
static struct {
  pthread_mutex_t lock;
  pthread_cond_t cond;
  pthread_t thread;
  int running, stop, interval_s;
} writer = {.lock = PTHREAD_MUTEX_INITIALIZER, .cond = PTHREAD_COND_INITIALIZER};

static void *writer_main(void *arg) {
  (void)arg;
  pthread_setname_np(pthread_self(), "mplane-stats");
  pthread_mutex_lock(&writer.lock);
  while (!writer.stop) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += writer.interval_s;
    while (!writer.stop && pthread_cond_timedwait(&writer.cond, &writer.lock, &ts) == 0) {}
    if (writer.stop) break;
    pthread_mutex_unlock(&writer.lock);
    mplane_stats_flush();
    pthread_mutex_lock(&writer.lock);
  }
  pthread_mutex_unlock(&writer.lock);
  return NULL;
}

static void writer_forget_in_child(void) {
  pthread_mutex_init(&writer.lock, NULL); /* the parent's writer may have held it */
  writer.running = 0;
  writer.stop = 0;
}

static void writer_atfork(void) { pthread_atfork(NULL, NULL, writer_forget_in_child); }

static void writer_start(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg || !cfg->stats_file[0] || cfg->stats_interval_s <= 0 || __atomic_load_n(&writer.running, __ATOMIC_ACQUIRE))
    return;
  static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;
  pthread_mutex_lock(&writer.lock);
  if (!writer.running) {
    pthread_once(&atfork_once, writer_atfork);
    writer.interval_s = cfg->stats_interval_s;
    writer.stop = 0;
    if (pthread_create(&writer.thread, NULL, writer_main, NULL) == 0) __atomic_store_n(&writer.running, 1, __ATOMIC_RELEASE);
    else MP_WARN("MPLANE_STATS_INTERVAL=%d: no thread to rewrite %s (it is written when comms close)",
                 cfg->stats_interval_s, cfg->stats_file);
  }
  pthread_mutex_unlock(&writer.lock);
}

__attribute__((destructor)) static void writer_stop(void) {
  pthread_mutex_lock(&writer.lock);
  int running = writer.running;
  writer.stop = 1;
  pthread_cond_signal(&writer.cond);
  pthread_mutex_unlock(&writer.lock);
  if (running) pthread_join(writer.thread, NULL);
  writer.running = 0;
}
