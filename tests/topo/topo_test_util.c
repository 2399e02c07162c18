/* mplane topo tests: shared helpers (see topo_test_util.h). */
#include "topo_test_util.h"

#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

struct xt_parser {
  const char *p;
  char *why;
  size_t whylen;
};

static int fail(struct xt_parser *ps, const char *msg) {
  snprintf(ps->why, ps->whylen, "%s at offset near '%.30s'", msg, ps->p);
  return -1;
}

/* name up to ' ', '>', '/' */
static int read_name(struct xt_parser *ps, char *out) {
  int n = 0;
  while (*ps->p && *ps->p != ' ' && *ps->p != '>' && *ps->p != '/' && *ps->p != '\n' && *ps->p != '=') {
    if (n >= 255) return fail(ps, "name too long");
    out[n++] = *ps->p++;
  }
  out[n] = '\0';
  return n ? 0 : fail(ps, "empty name");
}

static int parse_element(struct xt_parser *ps, struct xt_node *parent, struct xt_node **out);

static void skip_ws(struct xt_parser *ps) {
  while (*ps->p == ' ' || *ps->p == '\n') ps->p++;
}

static int parse_element(struct xt_parser *ps, struct xt_node *parent, struct xt_node **out) {
  skip_ws(ps);
  if (*ps->p != '<') return fail(ps, "expected '<'");
  ps->p++;
  if (*ps->p == '?' || *ps->p == '!') return fail(ps, "declaration or comment (NCCL's parser wants none)");
  struct xt_node *n = calloc(1, sizeof(*n));
  n->parent = parent;
  *out = n;
  if (read_name(ps, n->name)) return -1;
  while (*ps->p == ' ') {
    ps->p++;
    if (*ps->p == ' ') return fail(ps, "two spaces between attributes");
    if (n->nattrs >= XT_MAX_ATTRS) return fail(ps, "more than 16 attributes");
    if (read_name(ps, n->key[n->nattrs])) return -1;
    if (*ps->p != '=') return fail(ps, "attribute without '='");
    ps->p++;
    if (*ps->p != '"') return fail(ps, "attribute value without double quote");
    ps->p++;
    int k = 0;
    while (*ps->p && *ps->p != '"') {
      if (k >= 254) return fail(ps, "value too long");
      n->value[n->nattrs][k++] = *ps->p++;
    }
    if (*ps->p != '"') return fail(ps, "unterminated value");
    ps->p++;
    n->value[n->nattrs][k] = '\0';
    n->nattrs++;
  }
  if (ps->p[0] == '/' && ps->p[1] == '>') {
    ps->p += 2;
    return 0;
  }
  if (*ps->p != '>') return fail(ps, "expected '>'");
  ps->p++;
  for (;;) {
    skip_ws(ps);
    if (ps->p[0] == '<' && ps->p[1] == '/') {
      ps->p += 2;
      char close[256];
      if (read_name(ps, close)) return -1;
      if (strcmp(close, n->name) != 0) return fail(ps, "closing tag does not match");
      if (*ps->p != '>') return fail(ps, "expected '>' after closing tag");
      ps->p++;
      return 0;
    }
    if (n->nkids >= 640) return fail(ps, "more than 640 children");
    struct xt_node *kid;
    if (parse_element(ps, n, &kid)) {
      n->kids[n->nkids++] = kid;
      return -1;
    }
    n->kids[n->nkids++] = kid;
  }
}

struct xt_node *xt_parse(const char *text, char *why, size_t whylen) {
  struct xt_parser ps = {.p = text, .why = why, .whylen = whylen};
  struct xt_node *root = NULL;
  if (parse_element(&ps, NULL, &root)) {
    xt_free(root);
    return NULL;
  }
  skip_ws(&ps);
  if (*ps.p) {
    fail(&ps, "text after the root element");
    xt_free(root);
    return NULL;
  }
  return root;
}

void xt_free(struct xt_node *n) {
  if (!n) return;
  for (int i = 0; i < n->nkids; i++) xt_free(n->kids[i]);
  free(n);
}

const char *xt_attr(const struct xt_node *n, const char *key) {
  for (int i = 0; n && i < n->nattrs; i++)
    if (strcmp(n->key[i], key) == 0) return n->value[i];
  return NULL;
}

struct xt_node *xt_find(struct xt_node *root, const char *name, const char *key, const char *value) {
  if (!root) return NULL;
  if (strcmp(root->name, name) == 0) {
    const char *v = key ? xt_attr(root, key) : "";
    if (!key || (v && strcmp(v, value) == 0)) return root;
  }
  for (int i = 0; i < root->nkids; i++) {
    struct xt_node *f = xt_find(root->kids[i], name, key, value);
    if (f) return f;
  }
  return NULL;
}

int xt_count(struct xt_node *root, const char *name) {
  if (!root) return 0;
  int n = strcmp(root->name, name) == 0;
  for (int i = 0; i < root->nkids; i++) n += xt_count(root->kids[i], name);
  return n;
}

/* ------------------------------------------------------------------ JSON */

struct jp {
  const char *p;
  int depth;
};

static void jws(struct jp *j) {
  while (*j->p == ' ' || *j->p == '\n' || *j->p == '\t' || *j->p == '\r') j->p++;
}

static int jvalue(struct jp *j);

static int jstring(struct jp *j) {
  if (*j->p != '"') return -1;
  j->p++;
  while (*j->p && *j->p != '"') {
    if ((unsigned char)*j->p < 0x20) return -1;
    if (*j->p == '\\') {
      j->p++;
      if (*j->p == 'u') {
        for (int i = 1; i <= 4; i++)
          if (!isxdigit((unsigned char)j->p[i])) return -1;
        j->p += 4;
      } else if (!strchr("\"\\/bfnrt", *j->p)) {
        return -1;
      }
    }
    j->p++;
  }
  if (*j->p != '"') return -1;
  j->p++;
  return 0;
}

static int jvalue(struct jp *j) {
  jws(j);
  if (++j->depth > 64) return -1;
  int rc = 0;
  if (*j->p == '{') {
    j->p++;
    jws(j);
    if (*j->p == '}') {
      j->p++;
    } else {
      for (;;) {
        jws(j);
        if (jstring(j)) return -1;
        jws(j);
        if (*j->p != ':') return -1;
        j->p++;
        if (jvalue(j)) return -1;
        jws(j);
        if (*j->p == ',') {
          j->p++;
          continue;
        }
        if (*j->p != '}') return -1;
        j->p++;
        break;
      }
    }
  } else if (*j->p == '[') {
    j->p++;
    jws(j);
    if (*j->p == ']') {
      j->p++;
    } else {
      for (;;) {
        if (jvalue(j)) return -1;
        jws(j);
        if (*j->p == ',') {
          j->p++;
          continue;
        }
        if (*j->p != ']') return -1;
        j->p++;
        break;
      }
    }
  } else if (*j->p == '"') {
    rc = jstring(j);
  } else if (!strncmp(j->p, "true", 4) || !strncmp(j->p, "null", 4)) {
    j->p += 4;
  } else if (!strncmp(j->p, "false", 5)) {
    j->p += 5;
  } else if (*j->p == '-' || isdigit((unsigned char)*j->p)) {
    char *end;
    strtod(j->p, &end);
    if (end == j->p) return -1;
    j->p = end;
  } else {
    rc = -1;
  }
  j->depth--;
  return rc;
}

int json_check(const char *text, char *why, size_t whylen) {
  struct jp j = {.p = text};
  if (jvalue(&j) == 0) {
    jws(&j);
    if (*j.p == '\0') return 0;
  }
  snprintf(why, whylen, "JSON invalid at offset %ld near '%.30s'", (long)(j.p - text), j.p);
  return -1;
}

/* ------------------------------------------------------------------ files and text */

char *slurp(const char *path) {
  FILE *f = fopen(path, "r");
  if (!f) return NULL;
  size_t cap = 4096, len = 0;
  char *buf = malloc(cap);
  size_t k;
  while ((k = fread(buf + len, 1, cap - len - 1, f)) > 0) {
    len += k;
    if (cap - len < 2) buf = realloc(buf, cap *= 2);
  }
  buf[len] = '\0';
  fclose(f);
  return buf;
}

const char *fixture(const char *name) {
  static char path[8][1024];
  static int next;
  const char *dir = getenv("TOPO_FIXTURES");
  char *out = path[next++ % 8];
  snprintf(out, 1024, "%s/%s", dir ? dir : "tests/fixtures", name);
  return out;
}

int line_with(const char *text, const char *a, const char *b, const char *c, char *line, size_t len) {
  const char *p = text;
  while (p && *p) {
    const char *nl = strchr(p, '\n');
    size_t n = nl ? (size_t)(nl - p) : strlen(p);
    char buf[2048];
    if (n >= sizeof(buf)) n = sizeof(buf) - 1;
    memcpy(buf, p, n);
    buf[n] = '\0';
    if ((!a || strstr(buf, a)) && (!b || strstr(buf, b)) && (!c || strstr(buf, c))) {
      if (line) snprintf(line, len, "%s", buf);
      return 1;
    }
    p = nl ? nl + 1 : NULL;
  }
  return 0;
}

int tokens(const char *line, char tok[][64], int max) {
  int n = 0;
  const char *p = line;
  while (*p && n < max) {
    while (*p == ' ') p++;
    if (!*p) break;
    int k = 0;
    while (*p && *p != ' ' && k < 63) tok[n][k++] = *p++;
    tok[n][k] = '\0';
    while (*p && *p != ' ') p++;
    n++;
  }
  return n;
}

int tmpdir_make(char *dir, size_t len, const char *prefix) {
  snprintf(dir, len, "/tmp/%s.XXXXXX", prefix);
  return mkdtemp(dir) ? 0 : -1;
}

int tmpdir_remove(const char *dir) {
  char cmd[512];
  snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
  return system(cmd) == 0 ? 0 : -1;
}

static void put_or_abort(const char *path, const char *text) {
  FILE *f = fopen(path, "w");
  if (!f || fputs(text, f) < 0 || fclose(f) != 0) {
    fprintf(stderr, "topo test: cannot write the fixture file %s\n", path);
    abort();
  }
}

void sysfs_mkfile(const char *root, const char *rel, const char *text) {
  char path[1024];
  snprintf(path, sizeof(path), "%s/%s", root, rel);
  for (char *p = path + strlen(root) + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    mkdir(path, 0755);
    *p = '/';
  }
  put_or_abort(path, text);
}

void sysfs_mkpci(const char *root, const char *devpath, const char *cls, const char *vendor, const char *numa) {
  static const char *const names[] = {"class", "vendor", "device", "numa_node"};
  const char *texts[] = {cls, vendor, "0x1234\n", numa};
  char rel[512];
  for (int i = 0; i < 4; i++) {
    snprintf(rel, sizeof(rel), "sys/devices/%s/%s", devpath, names[i]);
    sysfs_mkfile(root, rel, texts[i]);
  }
  char link[1024], target[1024];
  snprintf(link, sizeof(link), "%s/sys/bus/pci/devices", root);
  mkdir(link, 0755);
  snprintf(link, sizeof(link), "%s/sys/bus/pci/devices/%s", root, strrchr(devpath, '/') + 1);
  snprintf(target, sizeof(target), "../../../devices/%s", devpath);
  if (symlink(target, link) != 0) {
    fprintf(stderr, "topo test: cannot link %s\n", link);
    abort();
  }
}
