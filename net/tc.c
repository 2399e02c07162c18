/* mplane: traffic classes -> service levels (see tc.h). */
#include "tc.h"

#include <errno.h>
#include <netinet/in.h>
#include <netinet/ip.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>

#include "../plugin/config.h"
#include "../plugin/log.h"

static const char *const class_names[MPLANE_TC_NCLASSES] = {"default", "collective", "alltoall", "lowlat",
                                                             "storage"};

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
               "storage)", (int)(ne - a), a, col);
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

static pthread_once_t map_once = PTHREAD_ONCE_INIT;
static struct mplane_tc_map global_map;

static void load_map(void) {
  const struct mplane_config *cfg = mplane_config_get();
  char why[256];
  const char *s = cfg ? cfg->tc_map : "default=0,collective=0,alltoall=3,lowlat=5,storage=1";
  int dsl = cfg ? cfg->ib_sl : 0;
  if (mplane_tc_map_parse(s, dsl, &global_map, why, sizeof(why)) != 0) {
    /* Cannot happen after config validation; keep every class on SL dsl. */
    MP_WARN("MPLANE_TC_MAP='%s' is not valid: %s; every class uses SL %d", s, why, dsl);
    mplane_tc_map_parse("", dsl, &global_map, why, sizeof(why));
  }
}

const struct mplane_tc_map *mplane_tc_map_get(void) {
  pthread_once(&map_once, load_map);
  return &global_map;
}

int mplane_tc_class_from_nccl(int traffic_class, int *invalid) {
  if (invalid) *invalid = 0;
  if (traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF) return -1;
  if (traffic_class >= 0 && traffic_class < MPLANE_TC_NCLASSES) return traffic_class;
  if (invalid) *invalid = 1;
  return -1;
}

#define BIT(x) (1u << (x))
#define P2P_OPS                                                                                      \
  (BIT(MPLANE_NCCL_FUNC_SENDRECV) | BIT(MPLANE_NCCL_FUNC_SEND) | BIT(MPLANE_NCCL_FUNC_RECV) |        \
   BIT(MPLANE_NCCL_FUNC_ALLTOALL) | BIT(MPLANE_NCCL_FUNC_SCATTER) | BIT(MPLANE_NCCL_FUNC_GATHER) |   \
   BIT(MPLANE_NCCL_FUNC_PUTSIGNAL) | BIT(MPLANE_NCCL_FUNC_SIGNAL) | BIT(MPLANE_NCCL_FUNC_WAITSIGNAL))
#define COLL_OPS                                                                                     \
  (BIT(MPLANE_NCCL_FUNC_BROADCAST) | BIT(MPLANE_NCCL_FUNC_REDUCE) | BIT(MPLANE_NCCL_FUNC_ALLGATHER) | \
   BIT(MPLANE_NCCL_FUNC_REDUCESCATTER) | BIT(MPLANE_NCCL_FUNC_ALLREDUCE) | BIT(MPLANE_NCCL_FUNC_ALLGATHERV))

int mplane_tc_class_from_attr(const ncclNetAttr_v11_t *attr) {
  if (!attr) return -1;
  if (attr->proto != MPLANE_NCCL_ATTR_UNDEF && attr->proto == BIT(MPLANE_NCCL_PROTO_LL)) return MPLANE_TC_LOWLAT;
  if (attr->op == MPLANE_NCCL_ATTR_UNDEF || attr->op == 0) return -1;
  if (attr->op & COLL_OPS) return MPLANE_TC_COLLECTIVE;
  if (attr->op & P2P_OPS) return MPLANE_TC_ALLTOALL;
  return -1;
}

int mplane_tc_resolve(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null) {
  int invalid = 0;
  int cls = mplane_tc_class_from_nccl(nccl_traffic_class, &invalid);
  if (invalid) {
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
      MP_WARN("communicator trafficClass %d is not an mplane class (0 default, 1 collective, 2 alltoall, "
              "3 lowlat, 4 storage); using the setNetAttr hints or default", nccl_traffic_class);
  }
  if (cls >= 0) return cls;
  cls = mplane_tc_class_from_attr(attr_or_null);
  return cls >= 0 ? cls : MPLANE_TC_DEFAULT;
}

int mplane_tc_sl(int cls) {
  if (cls < 0 || cls >= MPLANE_TC_NCLASSES) cls = MPLANE_TC_DEFAULT;
  return mplane_tc_map_get()->sl[cls];
}

int mplane_tc_adaptive_routing(int cls) {
  if (cls < 0 || cls >= MPLANE_TC_NCLASSES) cls = MPLANE_TC_DEFAULT;
  return mplane_tc_map_get()->ar[cls];
}

int mplane_tc_dscp(int sl) {
  sl &= 15;
  return sl < 8 ? 8 * sl : 8 * (sl - 8) + 4;
}

int mplane_tc_priority(int sl) { return sl & 7; }

int mplane_tc_mark_socket(int fd, int sl, char *why, size_t whylen) {
  struct sockaddr_storage ss;
  socklen_t len = sizeof(ss);
  if (getsockname(fd, (struct sockaddr *)&ss, &len) != 0) {
    snprintf(why, whylen, "getsockname: %s", strerror(errno));
    return -1;
  }
  int tos = mplane_tc_dscp(sl) << 2; /* ECN bits stay 0: the kernel owns them */
  int r = ss.ss_family == AF_INET6 ? setsockopt(fd, IPPROTO_IPV6, IPV6_TCLASS, &tos, sizeof(tos))
                                   : setsockopt(fd, IPPROTO_IP, IP_TOS, &tos, sizeof(tos));
  if (r != 0) {
    snprintf(why, whylen, "setting DSCP %d (TOS 0x%02x) failed: %s", mplane_tc_dscp(sl), tos, strerror(errno));
    return -1;
  }
  /* After IP_TOS: older kernels derive the priority from the TOS. */
  int prio = mplane_tc_priority(sl);
  if (setsockopt(fd, SOL_SOCKET, SO_PRIORITY, &prio, sizeof(prio)) != 0) {
    snprintf(why, whylen, "SO_PRIORITY %d failed: %s%s", prio, strerror(errno),
             errno == EPERM ? " (priority 7 needs CAP_NET_ADMIN)" : "");
    return -1;
  }
  return 0;
}

void mplane_tc_mark_socket_or_log(int fd, int sl, const char *what) {
  char why[160];
  if (sl < 0 || sl > MPLANE_TC_SL_MAX) sl = 0;
  if (mplane_tc_mark_socket(fd, sl, why, sizeof(why)) == 0) return;
  static int logged;
  if (!__atomic_exchange_n(&logged, 1, __ATOMIC_RELAXED))
    MP_INFO(NCCL_NET, "socket: cannot mark %s with SL %d: %s; its traffic goes unmarked", what, sl, why);
}
