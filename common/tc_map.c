/* mplane: the MPLANE_TC_MAP grammar (see tc_map.h). */
#include "tc_map.h"

#include <stdio.h>
#include <string.h>
#include <strings.h>

#include "config.h"

static const char *const class_names[MPLANE_TC_NCLASSES] = {"default", "collective", "alltoall", "lowlat",
                                                             "storage", "hfreduce"};

const char *mplane_tc_class_name(int cls) {
  return (cls >= 0 && cls < MPLANE_TC_NCLASSES) ? class_names[cls] : "?";
}

int mplane_tc_class_by_name(const char *name, size_t len) {
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++)
    if (strlen(class_names[c]) == len && strncasecmp(class_names[c], name, len) == 0) return c;
  return -1;
}

static int is_space(char c) { return c == ' ' || c == '\t'; }

int mplane_tc_map_parse(const char *value, int default_sl, struct mplane_tc_map *out, char *why, size_t whylen) {
  struct mplane_tc_map m;
  memset(&m, 0, sizeof(m));
  const char *p = value ? value : "";
  while (*p) {
    const char *start = p;
    const char *end = strchr(p, ',');
    if (!end) end = p + strlen(p);
    int col = (int)(start - value) + 1;
    /* trim */
    const char *a = start, *b = end;
    while (a < b && is_space(*a)) a++;
    while (b > a && is_space(b[-1])) b--;
    if (a == b) {
      snprintf(why, whylen, "empty entry at column %d", col);
      return -1;
    }
    const char *eq = memchr(a, '=', (size_t)(b - a));
    if (!eq) {
      snprintf(why, whylen, "entry '%.*s' at column %d has no '=': write class=SL", (int)(b - a), a, col);
      return -1;
    }
    const char *ne = eq;
    while (ne > a && is_space(ne[-1])) ne--;
    int cls = mplane_tc_class_by_name(a, (size_t)(ne - a));
    if (cls < 0) {
      snprintf(why, whylen, "unknown class '%.*s' at column %d (classes: default, collective, alltoall, lowlat, "
               "storage, hfreduce)", (int)(ne - a), a, col);
      return -1;
    }
    if (m.named[cls]) {
      snprintf(why, whylen, "class '%s' given twice (second at column %d)", class_names[cls], col);
      return -1;
    }
    const char *v = eq + 1;
    while (v < b && is_space(*v)) v++;
    const char *colon = memchr(v, ':', (size_t)(b > v ? b - v : 0));
    const char *ve = colon ? colon : b;
    while (ve > v && is_space(ve[-1])) ve--;
    char num[16];
    size_t nlen = (size_t)(ve - v);
    long sl = -1;
    if (nlen == 0 || nlen >= sizeof(num)) {
      snprintf(why, whylen, "class '%s' at column %d has no service level: write %s=SL with SL 0..15",
               class_names[cls], col, class_names[cls]);
      return -1;
    }
    memcpy(num, v, nlen);
    num[nlen] = 0;
    if (mplane_parse_long(num, 0, MPLANE_TC_SL_MAX, &sl) != 0) {
      snprintf(why, whylen, "service level '%s' of class '%s' at column %d is not an integer from 0 to 15", num,
               class_names[cls], col);
      return -1;
    }
    int ar = cls == MPLANE_TC_LOWLAT;
    if (colon) {
      const char *f = colon + 1;
      while (f < b && is_space(*f)) f++;
      size_t flen = (size_t)(b - f);
      if (flen == 2 && strncasecmp(f, "ar", 2) == 0) ar = 1;
      else if (flen == 4 && strncasecmp(f, "noar", 4) == 0) ar = 0;
      else {
        snprintf(why, whylen, "flag '%.*s' of class '%s' at column %d is not 'ar' or 'noar'", (int)flen, f,
                 class_names[cls], (int)(colon - value) + 2);
        return -1;
      }
    }
    m.sl[cls] = (int)sl;
    m.ar[cls] = ar;
    m.named[cls] = 1;
    p = *end ? end + 1 : end;
    if (*end && !*p) {
      snprintf(why, whylen, "trailing ',' at column %d", (int)(end - value) + 1);
      return -1;
    }
  }
  int dsl = m.named[MPLANE_TC_DEFAULT] ? m.sl[MPLANE_TC_DEFAULT] : default_sl;
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++) {
    if (m.named[c]) continue;
    m.sl[c] = dsl;
    m.ar[c] = c == MPLANE_TC_LOWLAT;
  }
  *out = m;
  return 0;
}

int mplane_tc_validate(const char *value, char *why, size_t whylen) {
  struct mplane_tc_map m;
  return mplane_tc_map_parse(value, 0, &m, why, whylen);
}
