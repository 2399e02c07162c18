/* mplane: traffic classes -> service levels (IB SL, IP DSCP and socket priority).
 *
 * The communicator's trafficClass (ncclConfig_t.trafficClass, net v10 connect config or v11+ init
 * config) means what it means to NCCL's net_ib unless MPLANE_TC_MAP is set: the SL on IB (a site's
 * MPLANE_IB_SL / NCCL_IB_SL wins), the GRH traffic class on RoCE (MPLANE_IB_TC / NCCL_IB_TC win),
 * so a job moved from net_ib keeps its SLs (mplane_tc_choose). Where MPLANE_TC_MAP is set, the
 * user chose mplane's classes, and a connection belongs to one of five. Its class comes from,
 * strongest first:
 *   1. the communicator's trafficClass, read as a class index (see mplane_tc_class_from_nccl);
 *   2. only where MPLANE_TC_MAP is set: the hints NCCL 2.28+ passes through setNetAttr (net v11+)
 *      before it connects: op, algo and proto bit masks (mplane_tc_class_from_attr). Without a map
 *      of the user's, one job is never spread over SLs by hint (NCCL's net_ib never is);
 *   3. otherwise `default`.
 * MPLANE_TC_MAP maps each class to a service level 0..15, with an optional adaptive-routing flag:
 *     default=0,collective=0,alltoall=3,lowlat=5:ar,storage=1
 * Classes the map does not name take the SL of `default` (MPLANE_IB_SL when `default` is absent).
 * Where MPLANE_TC_MAP is unset and a site set MPLANE_IB_SL or NCCL_IB_SL, every class takes that SL
 * (one INFO line says so). RoCE: MPLANE_IB_TC / NCCL_IB_TC (one-sided QPs: MPLANE_GIN_IB_TC /
 * NCCL_GIN_IB_TC first) fix every QP's traffic class; NCCL's twins give way to an explicit map.
 * Adaptive routing is on for `lowlat` and off for every other class unless the map says
 * otherwise (":ar" / ":noar").
 *
 * On IP (the socket transport, RoCE) an SL becomes a DSCP: SL 0..7 -> CS0..CS7 (DSCP 8*SL),
 * SL 8..15 -> DSCP 8*(SL-8)+4, so DSCP>>3 == (SL & 7) == the 802.1p priority switches derive;
 * the socket priority (SO_PRIORITY) is SL & 7. */
#ifndef MPLANE_NET_TC_H
#define MPLANE_NET_TC_H

#include <stddef.h>
#include "../common/nccl/net.h"
#include "../common/tc_map.h"

/* The process-wide map, parsed once from the configuration (the built-in default if none). */
const struct mplane_tc_map *mplane_tc_map_get(void);

/* ncclConfig_t.trafficClass -> class. Values 0..4 are class indices (0 default, 1 collective,
 * 2 alltoall, 3 lowlat, 4 storage); NCCL_NET_TRAFFIC_CLASS_UNDEF (-1) and NCCL_CONFIG_UNDEF_INT
 * (INT_MIN, what NCCL 2.30 passes when the user set none) mean "no class" and give -1;
 * any other value gives -1 and sets *invalid (callers WARN once). */
int mplane_tc_class_from_nccl(int traffic_class, int *invalid);

/* setNetAttr hints -> class, -1 when they say nothing. op/algo/proto are NCCL's bit masks
 * (BIT(ncclFunc_t), BIT(NCCL_ALGO_*), BIT(NCCL_PROTO_*)), all ones when undefined:
 *   proto exactly LL                                  -> lowlat
 *   op only point-to-point (Send, Recv, SendRecv, AlltoAll, Scatter, Gather, signals) -> alltoall
 *   op with any collective (Broadcast, Reduce, AllGather(V), ReduceScatter, AllReduce) -> collective */
int mplane_tc_class_from_attr(const ncclNetAttr_v11_t *attr);

/* The class of a connection: the communicator's class when valid, else the hints (only where
 * MPLANE_TC_MAP is set), else default. */
int mplane_tc_resolve(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null);
/* The same, the hints always considered (the pure rule, for tests). */
int mplane_tc_resolve_hints(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null);
/* 1 where setNetAttr hints choose a connection's class (MPLANE_TC_MAP is set). */
int mplane_tc_hints_choose_class(void);
/* The GRH traffic class of a RoCE QP on SL sl (gin: a one-sided QP): the site's (see above), else
 * the SL's DSCP << 2. */
int mplane_tc_roce_tclass(int sl, int gin);
/* The same where the communicator gave a RoCE traffic class of NCCL's meaning (comm_tclass >= 0):
 * the site's value, else the communicator's, else the SL's DSCP << 2. */
int mplane_tc_roce_tclass_of(int sl, int gin, int comm_tclass);

/* What a connection of a communicator with trafficClass nccl_traffic_class gets. */
struct mplane_tc_choice {
  int cls;    /* mplane class (stats, adaptive routing) */
  int sl;     /* IB SL, the socket transport's DSCP class */
  int tclass; /* RoCE traffic class the communicator asked for (NCCL's meaning), -1 none */
};
/* With MPLANE_TC_MAP set: trafficClass is a class id (mplane_tc_resolve), its SL from the map.
 * Without: NCCL's meaning (see above); the class is default. */
void mplane_tc_choose(int nccl_traffic_class, const ncclNetAttr_v11_t *attr_or_null, struct mplane_tc_choice *out);

int mplane_tc_sl(int cls);
int mplane_tc_adaptive_routing(int cls);
/* IP DSCP (6 bits) and socket priority of an SL (see above). */
int mplane_tc_dscp(int sl);
int mplane_tc_priority(int sl);

/* Mark a TCP socket with the SL's DSCP (IP_TOS / IPV6_TCLASS) and SO_PRIORITY. 0 on success; -1
 * with errno and a reason in why if the kernel refused either. */
int mplane_tc_mark_socket(int fd, int sl, char *why, size_t whylen);

/* The same, for the socket transport: on failure logs one INFO per process (naming what) and goes on
 * unmarked; the connection still works. */
void mplane_tc_mark_socket_or_log(int fd, int sl, const char *what);

/* ncclFunc_t / NCCL_ALGO_* / NCCL_PROTO_* values as of NCCL 2.28 (facts of the ABI, for the masks). */
enum {
  MPLANE_NCCL_FUNC_BROADCAST = 0, MPLANE_NCCL_FUNC_REDUCE = 1, MPLANE_NCCL_FUNC_ALLGATHER = 2,
  MPLANE_NCCL_FUNC_REDUCESCATTER = 3, MPLANE_NCCL_FUNC_ALLREDUCE = 4, MPLANE_NCCL_FUNC_SENDRECV = 5,
  MPLANE_NCCL_FUNC_SEND = 6, MPLANE_NCCL_FUNC_RECV = 7, MPLANE_NCCL_FUNC_ALLTOALL = 8,
  MPLANE_NCCL_FUNC_SCATTER = 9, MPLANE_NCCL_FUNC_GATHER = 10, MPLANE_NCCL_FUNC_ALLGATHERV = 11,
  MPLANE_NCCL_FUNC_PUTSIGNAL = 12, MPLANE_NCCL_FUNC_SIGNAL = 13, MPLANE_NCCL_FUNC_WAITSIGNAL = 14,
};
enum { MPLANE_NCCL_PROTO_LL = 0, MPLANE_NCCL_PROTO_LL128 = 1, MPLANE_NCCL_PROTO_SIMPLE = 2 };
#define MPLANE_NCCL_ATTR_UNDEF 0xffffffffu
#define MPLANE_NCCL_CONFIG_UNDEF_INT (-2147483647 - 1) /* NCCL_CONFIG_UNDEF_INT: an unset ncclConfig_t field */

#endif
