/* mplane: the plane and rail of each transport device, resolved once by topo/'s rules.
 *
 * A transport reports facts (name, PCI path, the subnet it found, a plane by discovery order);
 * topo/ owns what they mean: MPLANE_PLANES, the fabric rules, the node's topology (MPLANE_TOPO_FILE
 * or live). This is where the two meet, for every user of the transports alike: the plugin (the
 * roof) and libmplane-hfreduce (which must not link the roof) resolve planes through the same call,
 * so a rank's device is on the same plane whichever of them asks. It lives in net/ because it
 * writes net/'s struct mplane_dev_props; topo/ below knows nothing of transports. */
#ifndef MPLANE_NET_DEV_PLANES_H
#define MPLANE_NET_DEV_PLANES_H

#include <stddef.h>

#include "../common/config.h"
#include "../topo/topo.h"
#include "transport.h"

/* Match each transport device to its NIC by name (or PCI path), add the ones hwloc does not know as
 * virtual NICs, assign planes (planes as in mplane_topo_assign_planes: MPLANE_PLANES' grammar), and
 * write back plane, rail, near_gpu and (when the transport left them empty) pci_path, guid and speed. */
ncclResult_t mplane_topo_annotate_props(struct mplane_topo *t, struct mplane_dev_props *props, int n,
                                        const char *planes, char *err, size_t errlen);

/* Load the node's topology (cfg->topo_file as MPLANE_TOPO_FILE, else live discovery, the GPUs of
 * CUDA_VISIBLE_DEVICES), annotate props[0..n) with it and cfg->planes (MPLANE_PLANES), and say at
 * INFO how many planes came from what. *out (when out is not NULL) gets the topology, the caller's
 * to free; else it is freed. Fails only on bad input (MPLANE_PLANES, MPLANE_TOPO_FILE), with err
 * naming it; a node hwloc cannot read is no error. */
ncclResult_t mplane_topo_resolve_planes(struct mplane_dev_props *props, int n, const struct mplane_config *cfg,
                                        struct mplane_topo **out, char *err, size_t errlen);

#endif
