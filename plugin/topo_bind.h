/* mplane: what the plugin asks of topo/ at init: the transport's devices meet the node's topology
 * (plane, rail, PCI path, guid: net/dev_planes.h, shared with libmplane-hfreduce), and NCCL is
 * handed that topology (NCCL_TOPO_FILE), which is the roof's alone. */
#ifndef MPLANE_PLUGIN_TOPO_BIND_H
#define MPLANE_PLUGIN_TOPO_BIND_H

#include "../common/config.h"
#include "../net/dev_planes.h"
#include "../net/transport.h"
#include "../topo/topo.h"

/* Plugin init: resolve the transport's devices' planes (mplane_topo_resolve_planes), and unless
 * NCCL_TOPO_FILE is set or MPLANE_NCCL_TOPO=0, hand NCCL the node's topology through a memfd and
 * NCCL_TOPO_FILE. Fails only on bad input (the WARN names it); a node hwloc cannot read is no error. */
ncclResult_t mplane_topo_plugin_init(const struct mplane_config *cfg, struct mplane_dev_props *props, int n);
/* The node as the plugin saw it at init; NULL before, or when discovery found nothing. */
const struct mplane_topo *mplane_topo_node(void);

#endif
