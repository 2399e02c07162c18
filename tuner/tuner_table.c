/* mplane: tuner table parser (see tuner_table.h). */
#include "tuner_table.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "common/config.h"
#include "common/log.h"

#define TRY(call)                            \
  do {                                       \
    ncclResult_t try_res_ = (call);          \
    if (try_res_ != ncclSuccess) return try_res_; \
  } while (0)

/* Accepted spellings: compared after lower-casing and dropping '_', '-' and ' '. Index = NCCL value. */
static const char *const coll_names[MPLANE_NCCL_NUM_COLL_FUNCS] = {"broadcast", "reduce", "allgather",
                                                                   "reducescatter", "allreduce"};
static const char *const coll_display[MPLANE_NCCL_NUM_COLL_FUNCS] = {"broadcast", "reduce", "allgather",
                                                                     "reducescatter", "allreduce"};
#define NUM_ALGOS 7
static const char *const algo_names[NUM_ALGOS] = {"tree", "ring", "collnetdirect", "collnetchain",
                                                  "nvls", "nvlstree", "pat"};
static const char *const algo_display[NUM_ALGOS] = {"tree", "ring", "collnet_direct", "collnet_chain",
                                                    "nvls", "nvls_tree", "pat"};
#define NUM_PROTOS 3
static const char *const proto_names[NUM_PROTOS] = {"ll", "ll128", "simple"};

const char *mplane_tuner_coll_name(int coll) {
  if (coll == MPLANE_TUNER_ANY) return "any";
  return coll >= 0 && coll < MPLANE_NCCL_NUM_COLL_FUNCS ? coll_display[coll] : "?";
}
const char *mplane_tuner_algo_name(int algo) {
  return algo == MPLANE_TUNER_NCCL_CHOICE ? "NCCL's" : algo >= 0 && algo < NUM_ALGOS ? algo_display[algo] : "?";
}
const char *mplane_tuner_proto_name(int proto) {
  return proto == MPLANE_TUNER_NCCL_CHOICE ? "NCCL's" : proto >= 0 && proto < NUM_PROTOS ? proto_names[proto] : "?";
}

enum column { COL_COLL, COL_MIN, COL_MAX, COL_ALGO, COL_PROTO, COL_CHANNELS, COL_NODES, COL_RANKS, NUM_COLS };
static const char *const column_names[NUM_COLS] = {"collective", "min_bytes", "max_bytes", "algorithm",
                                                   "protocol", "channels", "nodes", "ranks"};

/* A field of the current line: [start, start+len) after trimming, col is 1-based. */
struct field {
  const char *start;
  size_t len;
  int col;
};

struct parser {
  const char *name;
  char *err;
  size_t errlen;
  int line;
};

__attribute__((format(printf, 3, 4))) static ncclResult_t fail(struct parser *p, int col, const char *fmt, ...) {
  char why[384];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof(why), fmt, ap);
  va_end(ap);
  if (col > 0)
    snprintf(p->err, p->errlen, "%s:%d:%d: %s", p->name, p->line, col, why);
  else
    snprintf(p->err, p->errlen, "%s:%d: %s", p->name, p->line, why);
  return ncclInvalidArgument;
}

/* Lower-case s[0..n) without '_', '-', ' ' into buf. Returns 0 if it fit. */
static int normalize(const char *s, size_t n, char *buf, size_t buflen) {
  size_t o = 0;
  for (size_t i = 0; i < n; i++) {
    char c = s[i];
    if (c == '_' || c == '-' || c == ' ') continue;
    if (o + 1 >= buflen) return -1;
    buf[o++] = (char)tolower((unsigned char)c);
  }
  buf[o] = '\0';
  return 0;
}

static int lookup(const struct field *f, const char *const *names, int n) {
  char buf[32];
  if (normalize(f->start, f->len, buf, sizeof(buf)) != 0) return -1;
  for (int i = 0; i < n; i++)
    if (strcmp(buf, names[i]) == 0) return i;
  return -1;
}

/* 1 if the field is `word` (case and '_' / '-' / ' ' ignored, as lookup does; "-1" exactly). */
static int field_is(const struct field *f, const char *word) {
  if (word[0] == '-') return f->len == strlen(word) && memcmp(f->start, word, f->len) == 0;
  char buf[32];
  return normalize(f->start, f->len, buf, sizeof(buf)) == 0 && strcmp(buf, word) == 0;
}

/* Show a field in a message, shortened if long. */
static const char *shown(const struct field *f, char *buf, size_t buflen) {
  size_t n = f->len < buflen - 4 ? f->len : buflen - 4;
  memcpy(buf, f->start, n);
  strcpy(buf + n, n < f->len ? "..." : "");
  return buf;
}

/* Decimal integer, -1 for "any", optional K/M/G/T suffix (x1024) when sizes is set. */
static ncclResult_t parse_number(struct parser *p, const struct field *f, enum column c, int64_t max, int64_t *out) {
  char shownbuf[48];
  int sizes = c == COL_MIN || c == COL_MAX;
  const char *what = sizes ? "a size in bytes (digits, optional K/M/G/T suffix) or -1 for any"
                           : "a whole number or -1 for any";
  if (f->len == 0) return fail(p, f->col, "empty %s: expected %s", column_names[c], what);
  if (f->len == 2 && f->start[0] == '-' && f->start[1] == '1') {
    *out = -1;
    return ncclSuccess;
  }
  uint64_t v = 0;
  size_t i = 0;
  for (; i < f->len && isdigit((unsigned char)f->start[i]); i++) {
    unsigned d = (unsigned)(f->start[i] - '0');
    if (v > (UINT64_MAX - d) / 10) return fail(p, f->col, "%s '%s' is too large", column_names[c], shown(f, shownbuf, sizeof(shownbuf)));
    v = v * 10 + d;
  }
  uint64_t mult = 1;
  if (i > 0 && sizes && i + 1 == f->len) {
    switch (f->start[i]) {
      case 'k': case 'K': mult = 1ULL << 10; i++; break;
      case 'm': case 'M': mult = 1ULL << 20; i++; break;
      case 'g': case 'G': mult = 1ULL << 30; i++; break;
      case 't': case 'T': mult = 1ULL << 40; i++; break;
      default: break;
    }
  }
  if (i == 0 || i != f->len) return fail(p, f->col, "%s '%s' is not a number: expected %s", column_names[c], shown(f, shownbuf, sizeof(shownbuf)), what);
  if (v > (uint64_t)max / mult) return fail(p, f->col, "%s '%s' is too large (at most %lld)", column_names[c], shown(f, shownbuf, sizeof(shownbuf)), (long long)max);
  *out = (int64_t)(v * mult);
  return ncclSuccess;
}

/* Split one line (no newline) on commas into fields, trimming blanks. Returns the count, or -1 if
 * there are more than maxf. */
static int split(const char *line, size_t len, struct field *f, int maxf) {
  int n = 0;
  size_t i = 0;
  for (;;) {
    size_t b = i;
    while (i < len && line[i] != ',') i++;
    size_t e = i;
    while (b < e && (line[b] == ' ' || line[b] == '\t')) b++;
    while (e > b && (line[e - 1] == ' ' || line[e - 1] == '\t')) e--;
    if (n == maxf) return -1;
    f[n].start = line + b;
    f[n].len = e - b;
    f[n].col = (int)b + 1;
    n++;
    if (i >= len) break;
    i++; /* past the comma */
  }
  return n;
}

static int ranges_overlap(uint64_t a0, uint64_t a1, uint64_t b0, uint64_t b1) { return a0 <= b1 && b0 <= a1; }
static int any_or_equal(int a, int b) { return a == MPLANE_TUNER_ANY || b == MPLANE_TUNER_ANY || a == b; }

static int rows_overlap(const struct mplane_tuner_row *a, const struct mplane_tuner_row *b) {
  return any_or_equal(a->coll, b->coll) && any_or_equal(a->nodes, b->nodes) && any_or_equal(a->ranks, b->ranks) &&
         ranges_overlap(a->min_bytes, a->max_bytes, b->min_bytes, b->max_bytes);
}

static ncclResult_t parse_header(struct parser *p, const char *line, size_t len, int colmap[NUM_COLS]) {
  struct field f[NUM_COLS + 1];
  char shownbuf[48];
  int n = split(line, len, f, NUM_COLS + 1);
  if (n < 0) n = NUM_COLS + 1;
  for (int c = 0; c < NUM_COLS; c++) colmap[c] = -1;
  for (int i = 0; i < n && i < NUM_COLS + 1; i++) {
    int found = -1;
    char buf[32], want[32];
    if (normalize(f[i].start, f[i].len, buf, sizeof(buf)) == 0) {
      for (int c = 0; c < NUM_COLS; c++) {
        normalize(column_names[c], strlen(column_names[c]), want, sizeof(want));
        if (strcmp(buf, want) == 0) found = c;
      }
    }
    if (found < 0)
      return fail(p, f[i].col,
                  "unknown column '%s' in the header: expected collective,min_bytes,max_bytes,algorithm,"
                  "protocol,channels,nodes,ranks",
                  shown(&f[i], shownbuf, sizeof(shownbuf)));
    if (colmap[found] >= 0) return fail(p, f[i].col, "column '%s' appears twice in the header", column_names[found]);
    colmap[found] = i;
  }
  for (int c = 0; c < NUM_COLS; c++)
    if (colmap[c] < 0)
      return fail(p, 0,
                  "the header lacks column '%s': expected collective,min_bytes,max_bytes,algorithm,protocol,"
                  "channels,nodes,ranks",
                  column_names[c]);
  return ncclSuccess;
}

static ncclResult_t parse_row(struct parser *p, const char *line, size_t len, const int colmap[NUM_COLS],
                              struct mplane_tuner_row *row) {
  struct field f[NUM_COLS + 1];
  char shownbuf[48];
  int n = split(line, len, f, NUM_COLS + 1);
  if (n != NUM_COLS) {
    if (n < 0 || n > NUM_COLS)
      return fail(p, f[NUM_COLS].col, "more than %d fields: expected the header's %d columns", NUM_COLS, NUM_COLS);
    return fail(p, (int)len + 1, "%d fields where the header has %d", n, NUM_COLS);
  }
  const struct field *fc = &f[colmap[COL_COLL]];
  char buf[32];
  if ((fc->len == 2 && fc->start[0] == '-' && fc->start[1] == '1') ||
      (normalize(fc->start, fc->len, buf, sizeof(buf)) == 0 && strcmp(buf, "any") == 0))
    row->coll = MPLANE_TUNER_ANY;
  else if ((row->coll = lookup(fc, coll_names, MPLANE_NCCL_NUM_COLL_FUNCS)) < 0)
    return fail(p, fc->col,
                "unknown collective '%s': expected allreduce, allgather, reducescatter, broadcast, reduce or any",
                shown(fc, shownbuf, sizeof(shownbuf)));

  int64_t v;
  TRY(parse_number(p, &f[colmap[COL_MIN]], COL_MIN, INT64_MAX, &v));
  row->min_bytes = v < 0 ? 0 : (uint64_t)v;
  TRY(parse_number(p, &f[colmap[COL_MAX]], COL_MAX, INT64_MAX, &v));
  row->max_bytes = v < 0 ? MPLANE_TUNER_NO_LIMIT : (uint64_t)v;
  if (row->min_bytes > row->max_bytes)
    return fail(p, f[colmap[COL_MIN]].col, "min_bytes %llu is greater than max_bytes %llu",
                (unsigned long long)row->min_bytes, (unsigned long long)row->max_bytes);

  /* algorithm and protocol -1 (or any): NCCL's choice stands, the row sets only the channel count */
  const struct field *fa = &f[colmap[COL_ALGO]];
  const struct field *fp = &f[colmap[COL_PROTO]];
  int algo_any = field_is(fa, "-1") || field_is(fa, "any"), proto_any = field_is(fp, "-1") || field_is(fp, "any");
  if (algo_any != proto_any)
    return fail(p, (algo_any ? fp : fa)->col, "algorithm and protocol are both given or both -1 (NCCL's choice, "
                "the row then sets channels only)");
  if (algo_any) {
    row->algo = row->proto = MPLANE_TUNER_NCCL_CHOICE;
  } else if ((row->algo = lookup(fa, algo_names, NUM_ALGOS)) < 0) {
    return fail(p, fa->col,
                "unknown algorithm '%s': expected tree, ring, collnet_direct, collnet_chain, nvls, nvls_tree, pat "
                "or -1 (NCCL's choice)", shown(fa, shownbuf, sizeof(shownbuf)));
  } else if ((row->proto = lookup(fp, proto_names, NUM_PROTOS)) < 0) {
    return fail(p, fp->col, "unknown protocol '%s': expected ll, ll128, simple or -1 (NCCL's choice)",
                shown(fp, shownbuf, sizeof(shownbuf)));
  }

  const struct field *fch = &f[colmap[COL_CHANNELS]];
  TRY(parse_number(p, fch, COL_CHANNELS, MPLANE_TUNER_MAX_CHANNELS, &v));
  if (v == 0) return fail(p, fch->col, "channels 0: expected 1 to %d, or -1 to let NCCL decide", MPLANE_TUNER_MAX_CHANNELS);
  if (v < 0 && algo_any)
    return fail(p, fch->col, "channels -1 with algorithm and protocol -1: the row would change nothing");
  row->channels = (int)v;
  const struct field *fn = &f[colmap[COL_NODES]];
  TRY(parse_number(p, fn, COL_NODES, 1 << 20, &v));
  if (v == 0) return fail(p, fn->col, "nodes 0: expected a node count from 1, or -1 for any");
  row->nodes = (int)v;
  const struct field *fr = &f[colmap[COL_RANKS]];
  TRY(parse_number(p, fr, COL_RANKS, 1 << 24, &v));
  if (v == 0) return fail(p, fr->col, "ranks 0: expected a rank count from 1, or -1 for any");
  row->ranks = (int)v;
  row->line = p->line;
  row->overlaps_line = 0;
  row->noted = 0;
  return ncclSuccess;
}

ncclResult_t mplane_tuner_table_parse(const char *name, const char *text, size_t len,
                                      struct mplane_tuner_table **out, char *err, size_t errlen) {
  struct parser p = {.name = name, .err = err, .errlen = errlen, .line = 0};
  ncclResult_t res = ncclSuccess;
  *out = NULL;
  struct mplane_tuner_table *t = calloc(1, sizeof(*t));
  if (!t) {
    snprintf(err, errlen, "%s: out of memory", name);
    return ncclSystemError;
  }
  snprintf(t->name, sizeof(t->name), "%s", name);
  int have_header = 0, cap = 0;
  int colmap[NUM_COLS];
  size_t pos = 0;
  /* A UTF-8 byte order mark (spreadsheet exports write one) is no part of the first column's name. */
  if (len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0) pos = 3;
  while (pos < len) {
    const char *line = text + pos;
    const char *nl = memchr(line, '\n', len - pos);
    size_t n = nl ? (size_t)(nl - line) : len - pos;
    pos += n + (nl ? 1 : 0);
    p.line++;
    if (n > 0 && line[n - 1] == '\r') n--;
    if (memchr(line, '\0', n)) {
      res = fail(&p, (int)((const char *)memchr(line, '\0', n) - line) + 1, "NUL byte: not a text file");
      goto out;
    }
    size_t b = 0;
    while (b < n && (line[b] == ' ' || line[b] == '\t')) b++;
    if (b == n || line[b] == '#') continue;
    if (!have_header) {
      if ((res = parse_header(&p, line, n, colmap)) != ncclSuccess) goto out;
      have_header = 1;
      continue;
    }
    if (t->nrows == MPLANE_TUNER_MAX_ROWS) {
      res = fail(&p, 0, "more than %d rows", MPLANE_TUNER_MAX_ROWS);
      goto out;
    }
    if (t->nrows == cap) {
      int ncap = cap ? cap * 2 : 32;
      struct mplane_tuner_row *r = realloc(t->rows, (size_t)ncap * sizeof(*r));
      if (!r) {
        fail(&p, 0, "out of memory");
        res = ncclSystemError;
        goto out;
      }
      t->rows = r;
      cap = ncap;
    }
    struct mplane_tuner_row *row = &t->rows[t->nrows];
    if ((res = parse_row(&p, line, n, colmap, row)) != ncclSuccess) goto out;
    t->nrows++;
  }
  if (!have_header) {
    p.line = p.line ? p.line : 1;
    res = fail(&p, 0, "no header line: expected collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks");
    goto out;
  }
  for (int j = 1; j < t->nrows; j++)
    for (int i = 0; i < j; i++)
      if (rows_overlap(&t->rows[i], &t->rows[j])) {
        t->rows[j].overlaps_line = t->rows[i].line;
        break;
      }
  *out = t;
  return ncclSuccess;
out:
  mplane_tuner_table_free(t);
  return res;
}

ncclResult_t mplane_tuner_table_load(const char *path, struct mplane_tuner_table **out, char *err, size_t errlen) {
  *out = NULL;
  /* A regular file only: a FIFO would block init forever, a device would be read for nothing. */
  int fd = mplane_open_regular_file("MPLANE_TUNER_CONFIG", path, "a CSV tuner table", err, errlen);
  if (fd == -1) snprintf(err, errlen, "MPLANE_TUNER_CONFIG='%s': cannot open: %s", path, strerror(errno));
  if (fd < 0) return ncclInvalidArgument;
  FILE *f = fdopen(fd, "rb");
  if (!f) {
    snprintf(err, errlen, "MPLANE_TUNER_CONFIG='%s': cannot open: %s", path, strerror(errno));
    close(fd);
    return ncclInvalidArgument;
  }
  char *buf = malloc((size_t)MPLANE_TUNER_MAX_FILE_BYTES + 1);
  if (!buf) {
    fclose(f);
    snprintf(err, errlen, "%s: out of memory", path);
    return ncclSystemError;
  }
  size_t n = fread(buf, 1, (size_t)MPLANE_TUNER_MAX_FILE_BYTES + 1, f);
  int rerr = ferror(f);
  fclose(f);
  ncclResult_t res;
  if (rerr) {
    snprintf(err, errlen, "MPLANE_TUNER_CONFIG='%s': read error", path);
    res = ncclSystemError;
  } else if (n > (size_t)MPLANE_TUNER_MAX_FILE_BYTES) {
    snprintf(err, errlen, "MPLANE_TUNER_CONFIG='%s': larger than %ld bytes, not a tuner table", path,
             (long)MPLANE_TUNER_MAX_FILE_BYTES);
    res = ncclInvalidArgument;
  } else {
    res = mplane_tuner_table_parse(path, buf, n, out, err, errlen);
  }
  free(buf);
  return res;
}

void mplane_tuner_table_free(struct mplane_tuner_table *table) {
  if (!table) return;
  free(table->rows);
  free(table);
}

static void describe_bytes(uint64_t lo, uint64_t hi, char *buf, size_t len) {
  if (hi == MPLANE_TUNER_NO_LIMIT)
    snprintf(buf, len, "%llu bytes and up", (unsigned long long)lo);
  else
    snprintf(buf, len, "%llu..%llu bytes", (unsigned long long)lo, (unsigned long long)hi);
}

int mplane_tuner_table_warn_overlaps(const struct mplane_tuner_table *table) {
  int count = 0;
  for (int j = 0; table && j < table->nrows; j++) {
    const struct mplane_tuner_row *b = &table->rows[j];
    if (!b->overlaps_line) continue;
    const struct mplane_tuner_row *a = NULL;
    for (int i = 0; i < j; i++)
      if (table->rows[i].line == b->overlaps_line) a = &table->rows[i];
    if (!a) continue;
    char range[96];
    uint64_t lo = a->min_bytes > b->min_bytes ? a->min_bytes : b->min_bytes;
    uint64_t hi = a->max_bytes < b->max_bytes ? a->max_bytes : b->max_bytes;
    describe_bytes(lo, hi, range, sizeof(range));
    MP_WARN("tuner: %s: line %d overlaps line %d (%s, %s); line %d wins where they overlap", table->name, b->line,
            a->line, mplane_tuner_coll_name(b->coll != MPLANE_TUNER_ANY ? b->coll : a->coll), range, a->line);
    count++;
  }
  return count;
}
