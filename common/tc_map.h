/* mplane: the traffic classes and the grammar of MPLANE_TC_MAP, which the configuration checks
 * when it reads the variable (common/config.c) and net/tc.h applies to connections.
 *     default=0,collective=0,alltoall=3,lowlat=5:ar,storage=1,hfreduce=2
 * Each entry names a class and its service level 0..15, with an optional adaptive-routing flag
 * (":ar" / ":noar"; without one, adaptive routing is on for `lowlat` only). Classes the map does not
 * name take the SL of `default` (MPLANE_IB_SL when `default` is absent). */
#ifndef MPLANE_COMMON_TC_MAP_H
#define MPLANE_COMMON_TC_MAP_H

#include <stddef.h>

enum mplane_tc_class {
  MPLANE_TC_DEFAULT = 0,
  MPLANE_TC_COLLECTIVE = 1,
  MPLANE_TC_ALLTOALL = 2,
  MPLANE_TC_LOWLAT = 3,
  MPLANE_TC_STORAGE = 4,
  MPLANE_TC_HFREDUCE = 5, /* libmplane-hfreduce's tree links (collectives/hfreduce) */
  MPLANE_TC_NCLASSES = 6
};

#define MPLANE_TC_SL_MAX 15

struct mplane_tc_map {
  int sl[MPLANE_TC_NCLASSES];
  int ar[MPLANE_TC_NCLASSES]; /* adaptive routing on (1) / off (0) */
  int named[MPLANE_TC_NCLASSES];
};

/* "default", "collective", ... ; "?" for a value out of range. */
const char *mplane_tc_class_name(int cls);
/* Class index of a name (case-insensitive), -1 if unknown. */
int mplane_tc_class_by_name(const char *name, size_t len);

/* Parse a MPLANE_TC_MAP value. default_sl is the SL of classes the map leaves out when it leaves
 * out `default` too. 0 on success, else -1 with a reason in why (names the entry and column). */
int mplane_tc_map_parse(const char *value, int default_sl, struct mplane_tc_map *out, char *why, size_t whylen);

/* The validate callback of the MPLANE_TC_MAP row in the configuration table (config.c). */
int mplane_tc_validate(const char *value, char *why, size_t whylen);

#endif
