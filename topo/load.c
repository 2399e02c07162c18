/* mplane: the node's topology in one call (mplane_topo_load, topo.h): the model from hwloc (an XML
 * file or the live machine) or, where hwloc sees no PCI device, from sysfs; the NICs' speeds and live
 * interfaces; CUDA_VISIBLE_DEVICES; then the planes (planes.c). */
#include <stdio.h>
#include <stdlib.h>

#include "../common/log.h"
#include "planes.h"
#include "topo_internal.h"

ncclResult_t mplane_topo_load(const struct mplane_topo_options *opts, struct mplane_topo **out, char *err,
                              size_t errlen) {
  static int sysfs_said;
  struct mplane_topo_options none = {0};
  if (!opts) opts = &none;
  *out = NULL;
  if (errlen) err[0] = '\0';
  struct mplane_topo *t = malloc(sizeof(*t));
  if (!t) {
    snprintf(err, errlen, "topo: out of memory");
    return ncclSystemError;
  }
  mplane_topo_init(t);
  int from_file = opts->xml_path && opts->xml_path[0];
  const char *root = opts->sysfs_root && opts->sysfs_root[0] ? opts->sysfs_root : "/";
  ncclResult_t res = ncclSuccess;
  if (!opts->force_sysfs) {
    res = mplane_topo_from_hwloc(t, from_file ? opts->xml_path : NULL, opts->xml_input, err, errlen);
    if (res != ncclSuccess && from_file) {
      free(t);
      return res;
    }
  }
  if (!from_file && (opts->force_sysfs || res != ncclSuccess || t->npci == 0)) {
    char why[256];
    snprintf(why, sizeof(why), "%s", res != ncclSuccess ? err : "hwloc saw no PCI device");
    if (opts->force_sysfs) snprintf(why, sizeof(why), "hwloc skipped (force_sysfs)");
    mplane_topo_init(t);
    mplane_topo_from_sysfs(t, root);
    if (!sysfs_said) {
      sysfs_said = 1;
      MP_INFO(NCCL_INIT | NCCL_NET, "topo: %s (a container?); read %d PCI functions from sysfs instead", why,
              t->npci);
    }
    if (errlen) err[0] = '\0';
  }
  mplane_topo_finish(t);
  if (!from_file) {
    mplane_topo_read_speeds(t, root);
    if (opts->live_interfaces) {
      mplane_topo_read_interfaces(t, 1);
      mplane_topo_sort_nics(t);
    }
  }
  mplane_topo_apply_cuda_visible(t, opts->cuda_visible);
  res = mplane_topo_assign_planes(t, opts->planes, err, errlen);
  if (res != ncclSuccess) {
    free(t);
    return res;
  }
  *out = t;
  return ncclSuccess;
}
