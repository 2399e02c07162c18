/* mplane: the plane and rail of each transport device, by topo/'s rules (see dev_planes.h). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "dev_planes.h"

#include "../common/log.h"

/* The NIC a transport device is: by name (mlx5_0:1, eth0), else by the PCI function of its path. */
static int match_device(const struct mplane_topo *t, const struct mplane_dev_props *p) {
  int n = mplane_topo_find_nic(t, p->name);
  if (n >= 0 || !p->pci_path[0]) return n;
  const char *base = strrchr(p->pci_path, '/');
  char busid[MPLANE_TOPO_BUSID_LEN];
  if (mplane_topo_parse_busid(base ? base + 1 : p->pci_path, busid, sizeof(busid)) != 0) return -1;
  for (int i = 0; i < t->nnics; i++)
    if (strcmp(t->nics[i].busid, busid) == 0) return i;
  return -1;
}

ncclResult_t mplane_topo_annotate_props(struct mplane_topo *t, struct mplane_dev_props *props, int n,
                                        const char *planes, char *err, size_t errlen) {
  int added = 0;
  for (int d = 0; d < n; d++) {
    if (match_device(t, &props[d]) >= 0) continue;
    if (mplane_topo_add_virtual_nic(t, props[d].name) < 0) {
      snprintf(err, errlen, "topo: more than %d NICs", MPLANE_TOPO_MAX_NICS);
      return ncclInternalError;
    }
    added = 1;
  }
  if (added) {
    if (!t->from_file) mplane_topo_read_interfaces(t, 0); /* IP subnets of the interfaces just added */
    mplane_topo_sort_nics(t);
  }
  int nic_of[64]; /* the plugin has at most 64 devices */
  int facts = 0;  /* the transport told some device's subnet */
  for (int d = 0; d < n && d < 64; d++) {
    int i = match_device(t, &props[d]);
    nic_of[d] = i;
    if (i < 0) continue;
    struct mplane_topo_nic *nic = &t->nics[i];
    if (nic->dev < 0) {
      nic->dev = d;
      snprintf(nic->name, sizeof(nic->name), "%s", props[d].name); /* the name NCCL will look up */
    }
    if (props[d].speed_mbps > 0) nic->speed_mbps = props[d].speed_mbps;
    if (props[d].port > 0) nic->port = props[d].port;
    /* What the transport found of its subnet, where the node's files show none (the default IB
     * prefix): without it every such NIC would be a plane of its own by PCI order, and every
     * connection between two NICs of one fabric relayed. */
    /* A subnet the transport proved (the probe's) also wins over an IP subnet, which only hints:
     * routed RoCE gives every NIC of one fabric a subnet of its own. */
    int hint_only = nic->has_subnet && (nic->subnet_kind == MPLANE_SUBNET_IPV4 || nic->subnet_kind == MPLANE_SUBNET_IPV6);
    if (props[d].subnet_kind && (!nic->has_subnet || (hint_only && props[d].subnet_kind == MPLANE_SUBNET_PROBED)))
      mplane_topo_set_subnet(t, i, props[d].subnet_kind, props[d].subnet_key, props[d].subnet);
    if (props[d].subnet_kind) facts = 1;
  }
  /* A NIC of the node the transport reports no port of (its port is down) while it tells the
   * others' subnets: it carries nothing, and must not void the planes of those that do. */
  for (int i = 0; facts && i < t->nnics; i++) {
    int seen = 0;
    for (int d = 0; d < n && d < 64; d++) seen |= nic_of[d] == i;
    if (!seen && !t->nics[i].has_subnet) t->nics[i].down = 1;
  }
  ncclResult_t res = mplane_topo_assign_planes(t, planes, err, errlen);
  if (res != ncclSuccess) return res;
  for (int d = 0; d < n && d < 64; d++) {
    struct mplane_dev_props *p = &props[d];
    if (nic_of[d] < 0) continue;
    const struct mplane_topo_nic *nic = &t->nics[nic_of[d]];
    p->plane = nic->plane;
    p->rail = nic->rail;
    if (!p->pci_path[0] && nic->busid[0] && !t->from_file) {
      char link[64], real[PATH_MAX];
      snprintf(link, sizeof(link), "/sys/bus/pci/devices/%s", nic->busid);
      if (realpath(link, real)) snprintf(p->pci_path, sizeof(p->pci_path), "%s", real);
    }
    if (p->speed_mbps <= 0 && nic->speed_mbps > 0) p->speed_mbps = nic->speed_mbps;
    p->near_gpu[0] = 0; /* the first GPU paired with this NIC: staging for connections it relays */
    for (int g = 0; g < t->ngpus && !p->near_gpu[0]; g++)
      if (t->gpus[g].nic == nic_of[d]) snprintf(p->near_gpu, sizeof(p->near_gpu), "%s", t->gpus[g].busid);
  }
  /* One guid per physical NIC: devices of different NICs must not share one. */
  for (int a = 0; a < n && a < 64; a++) {
    for (int b = 0; b < a; b++) {
      if (nic_of[a] < 0 || nic_of[b] < 0 || nic_of[a] == nic_of[b]) continue;
      if (props[a].guid == props[b].guid || props[a].guid == 0) {
        props[a].guid = t->nics[nic_of[a]].guid;
        props[b].guid = t->nics[nic_of[b]].guid;
      }
    }
    if (props[a].guid == 0 && nic_of[a] >= 0) props[a].guid = t->nics[nic_of[a]].guid;
  }
  /* The NCCL XML carries what getProperties reports. */
  for (int d = 0; d < n && d < 64; d++)
    if (nic_of[d] >= 0 && t->nics[nic_of[d]].dev == d) t->nics[nic_of[d]].guid = props[d].guid;
  return ncclSuccess;
}

ncclResult_t mplane_topo_resolve_planes(struct mplane_dev_props *props, int n, const struct mplane_config *cfg,
                                        struct mplane_topo **out, char *err, size_t errlen) {
  if (out) *out = NULL;
  struct mplane_topo_options o = {
      .xml_path = cfg->topo_file,
      .xml_input = "MPLANE_TOPO_FILE",
      .planes = NULL, /* after the transport's devices join the model */
      .cuda_visible = getenv("CUDA_VISIBLE_DEVICES"),
  };
  struct mplane_topo *t = NULL;
  ncclResult_t res = mplane_topo_load(&o, &t, err, errlen);
  if (res != ncclSuccess) return res;
  res = mplane_topo_annotate_props(t, props, n, cfg->planes, err, errlen);
  if (res != ncclSuccess) {
    mplane_topo_free(t);
    return res;
  }
  int ncompute = 0;
  for (int i = 0; i < t->nnics; i++) ncompute += t->nics[i].compute;
  MP_INFO(NCCL_INIT | NCCL_NET, "topo: %s: %d GPUs, %d NICs (%d compute), %d planes from %s%s", t->source, t->ngpus,
          t->nnics, ncompute, t->nplanes, mplane_topo_plane_source_name(t->plane_source),
          t->plane_source == MPLANE_TOPO_PLANE_PCI && ncompute > 1
              ? " (the fabric told no subnet of some compute NIC: a plane per NIC; where NICs share a fabric, "
                "say so with MPLANE_PLANES, e.g. mlx5_0=0,mlx5_1=0)"
              : "");
  if (out) *out = t;
  else mplane_topo_free(t);
  return ncclSuccess;
}
