/* mplane: traffic counters (see stats.h). */
#include "stats.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
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
  pthread_mutex_unlock(&lock);
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
  fprintf(f, "\"tx_bytes\": %llu, \"tx_msgs\": %llu, \"rx_bytes\": %llu, \"rx_msgs\": %llu, \"relayed_bytes\": %llu",
          (unsigned long long)k->tx_bytes, (unsigned long long)k->tx_msgs, (unsigned long long)k->rx_bytes,
          (unsigned long long)k->rx_msgs, (unsigned long long)k->relayed_bytes);
}

static int ctr_zero(const struct mplane_stats_counters *k) {
  return !k->tx_bytes && !k->tx_msgs && !k->rx_bytes && !k->rx_msgs && !k->relayed_bytes;
}

void mplane_stats_write_json(FILE *f) {
  struct mplane_stats_totals t;
  mplane_stats_snapshot(&t);
  fprintf(f, "{\n  \"pid\": %d,\n  \"node_id\": \"%016llx\",\n  \"comms_opened\": %llu,\n  \"comms_closed\": %llu,\n",
          (int)getpid(), (unsigned long long)mplane_node_id(), (unsigned long long)t.comms_opened,
          (unsigned long long)t.comms_closed);
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

void mplane_stats_flush(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg || !cfg->stats_file[0]) return;
  char path[4096], tmp[4200];
  if (mplane_stats_expand_path(cfg->stats_file, path, sizeof(path)) != 0) return;
  snprintf(tmp, sizeof(tmp), "%s.tmp.%d", path, (int)getpid());
  static pthread_mutex_t file_lock = PTHREAD_MUTEX_INITIALIZER;
  pthread_mutex_lock(&file_lock);
  FILE *f = fopen(tmp, "w");
  if (!f) {
    static int warned;
    if (!warned++) MP_WARN("MPLANE_STATS_FILE='%s': cannot write %s: %s", cfg->stats_file, tmp, strerror(errno));
    pthread_mutex_unlock(&file_lock);
    return;
  }
  mplane_stats_write_json(f);
  int bad = ferror(f);
  if (fclose(f) != 0 || bad || rename(tmp, path) != 0) {
    MP_WARN("MPLANE_STATS_FILE='%s': writing %s failed: %s", cfg->stats_file, path, strerror(errno));
    unlink(tmp);
  }
  pthread_mutex_unlock(&file_lock);
}
