/* mplane: what the plugin asks of topo/ at init: the transport's devices meet the node's
 * topology (plane, rail, PCI path, guid), and NCCL is handed that topology. It lives in the roof
 * because it ties two layers below it together: net/ (struct mplane_dev_props) and topo/. */
#ifndef MPLANE_PLUGIN_TOPO_BIND_H
#define MPLANE_PLUGIN_TOPO_BIND_H

#include "../common/config.h"
#include "../net/transport.h"
#include "../topo/topo.h"

/* The plugin's part: match each transport device to its NIC by name (or PCI path), add the ones
 * hwloc does not know as virtual NICs, assign planes, and write back plane, rail, and (when the
 * transport left them empty) pci_path, guid and speed. planes as in assign_planes. */
ncclResult_t mplane_topo_annotate_props(struct mplane_topo *t, struct mplane_dev_props *props, int n,
                                        const char *planes, char *err, size_t errlen);

/* Plugin init: discover (MPLANE_TOPO_FILE or live), annotate the transport's devices, and unless
 * NCCL_TOPO_FILE is set or MPLANE_NCCL_TOPO=0, hand NCCL the node's topology through a memfd and
 * NCCL_TOPO_FILE. Fails only on bad input (the WARN names it); a node hwloc cannot read is no error. */
ncclResult_t mplane_topo_plugin_init(const struct mplane_config *cfg, struct mplane_dev_props *props, int n);
/* The node as the plugin saw it at init; NULL before, or when discovery found nothing. */
const struct mplane_topo *mplane_topo_node(void);

#endif
