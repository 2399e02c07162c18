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

#include "../common/config.h"
#include "../common/log.h"

static pthread_once_t map_once = PTHREAD_ONCE_INIT;
static struct mplane_tc_map global_map;
static int map_explicit; /* MPLANE_TC_MAP was set: the user asked for classes on SLs of their own */

/* Precedence, as sites configure NCCL (whose net_ib takes NCCL_IB_SL, else the communicator's class,
 * else 0, and never splits by hint): an explicit MPLANE_TC_MAP first (classes it leaves out take
 * MPLANE_IB_SL / NCCL_IB_SL); else a site's MPLANE_IB_SL / NCCL_IB_SL for every class; else the
 * built-in map for the communicator's class. */
static void load_map(void) {
  const struct mplane_config *cfg = mplane_config_get();
  char why[256];
  const char *s = cfg ? cfg->tc_map : "default=0,collective=0,alltoall=3,lowlat=5,storage=1";
  int dsl = cfg ? cfg->ib_sl : 0;
  map_explicit = cfg && mplane_config_source("MPLANE_TC_MAP") != NULL;
  const char *sl_from = cfg ? mplane_config_source("MPLANE_IB_SL") : NULL;
  if (!map_explicit && sl_from) {
    MP_INFO(NCCL_INIT | NCCL_NET, "%s=%d: every traffic class uses SL %d (MPLANE_TC_MAP is unset; set it to give "
            "classes service levels of their own)", sl_from, dsl, dsl);
    s = "";
  }
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
  /* NCCL 2.30 leaves ncclConfig_t's unset fields at NCCL_CONFIG_UNDEF_INT (INT_MIN) and passes that
   * on as the class: no class, like NCCL_NET_TRAFFIC_CLASS_UNDEF. */
  if (traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF || traffic_class == MPLANE_NCCL_CONFIG_UNDEF_INT) return -1;
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

int mplane_tc_hints_choose_class(void) {
  mplane_tc_map_get();
  return map_explicit;
}

int mplane_tc_resolve(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null) {
  return mplane_tc_resolve_hints(nccl_traffic_class, mplane_tc_hints_choose_class() ? attr_or_null : NULL);
}

int mplane_tc_resolve_hints(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null) {
  int invalid = 0;
  int cls = mplane_tc_class_from_nccl(nccl_traffic_class, &invalid);
  if (invalid) {
    static int warned;
    if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
      MP_WARN("communicator trafficClass %d is not an mplane class (0 default, 1 collective, 2 alltoall, "
              "3 lowlat, 4 storage, 5 hfreduce); using the setNetAttr hints or default", nccl_traffic_class);
  }
  if (cls >= 0) return cls;
  cls = mplane_tc_class_from_attr(attr_or_null);
  return cls >= 0 ? cls : MPLANE_TC_DEFAULT;
}

/* A value the communicator gave that is NCCL's (no explicit MPLANE_TC_MAP): -1 none. */
static int nccl_value(int traffic_class) {
  if (traffic_class == NCCL_NET_TRAFFIC_CLASS_UNDEF || traffic_class == MPLANE_NCCL_CONFIG_UNDEF_INT) return -1;
  if (traffic_class >= 0 && traffic_class <= 255) return traffic_class;
  static int warned;
  if (!__atomic_exchange_n(&warned, 1, __ATOMIC_RELAXED))
    MP_WARN("communicator trafficClass %d is neither an IB SL (0..15) nor a RoCE traffic class (0..255); ignored "
            "(the default SL and traffic class hold)", traffic_class);
  return -1;
}

void mplane_tc_choose(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null, struct mplane_tc_choice *out) {
  out->tclass = -1;
  if (mplane_tc_hints_choose_class()) { /* the user's map: trafficClass names one of its classes */
    out->cls = mplane_tc_resolve(nccl_traffic_class, attr_or_null);
    out->sl = mplane_tc_sl(out->cls);
    return;
  }
  /* NCCL's meaning, as its net_ib: the value is the SL on IB (NCCL_IB_SL wins) and the GRH traffic
   * class on RoCE (NCCL_IB_TC wins); a value above 15 is a traffic class only. */
  out->cls = MPLANE_TC_DEFAULT;
  out->sl = mplane_tc_sl(out->cls);
  int v = nccl_value(nccl_traffic_class);
  if (v < 0) return;
  out->tclass = v;
  const struct mplane_config *cfg = mplane_config_get();
  if (cfg && mplane_config_source("MPLANE_IB_SL")) return; /* the site's SL, as NCCL_IB_SL in net_ib */
  if (v <= MPLANE_TC_SL_MAX) {
    out->sl = v;
    return;
  }
  static int said;
  if (!__atomic_exchange_n(&said, 1, __ATOMIC_RELAXED))
    MP_INFO(NCCL_INIT | NCCL_NET, "communicator trafficClass %d: RoCE traffic class %d; above 15 it is no IB SL, so IB "
            "connections keep SL %d", v, v, out->sl);
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

/* The site's traffic class, if it set one that holds: MPLANE_GIN_IB_TC / NCCL_GIN_IB_TC for one-sided
 * QPs, then MPLANE_IB_TC / NCCL_IB_TC. A value from NCCL's twin gives way to an explicit MPLANE_TC_MAP
 * (the user's own map, per class); an MPLANE_* one never does. -1: none. */
static int site_tclass(int gin, const char **from) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg) return -1;
  int explicit_map = mplane_tc_hints_choose_class();
  const char *g = gin ? mplane_config_source("MPLANE_GIN_IB_TC") : NULL;
  if (g && (!explicit_map || !strcmp(g, "MPLANE_GIN_IB_TC"))) {
    *from = g;
    return cfg->gin_ib_tc;
  }
  const char *t = mplane_config_source("MPLANE_IB_TC");
  if (t && (!explicit_map || !strcmp(t, "MPLANE_IB_TC"))) {
    *from = t;
    return cfg->ib_tc;
  }
  return -1;
}

int mplane_tc_roce_tclass(int sl, int gin) { return mplane_tc_roce_tclass_of(sl, gin, -1); }

int mplane_tc_roce_tclass_of(int sl, int gin, int comm_tclass) {
  const char *from = NULL;
  int tc = site_tclass(gin, &from);
  if (tc < 0) return comm_tclass >= 0 ? comm_tclass : mplane_tc_dscp(sl) << 2;
  static int said[2];
  if (!__atomic_exchange_n(&said[gin != 0], 1, __ATOMIC_RELAXED))
    MP_INFO(NCCL_INIT | NCCL_NET, "%s=%d: every RoCE %sQP uses traffic class %d (DSCP %d), whatever its class", from,
            tc, gin ? "one-sided " : "", tc, tc >> 2);
  return tc;
}

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
