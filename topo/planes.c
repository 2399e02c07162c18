/* mplane: which plane each NIC is on, decided in one place (see planes.h). */
#include "planes.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "../common/config.h" /* mplane_planes_parse: the grammar's parser, the config table's check */
#include "topo_internal.h"

/* ------------------------------------------------------------------ the fabric rule */

int mplane_ib_prefix_names_subnet(uint64_t prefix) { return prefix != MPLANE_IB_DEFAULT_GID_PREFIX; }

int mplane_subnet_of_ip(const struct sockaddr *addr, const struct sockaddr *mask, struct mplane_subnet *out,
                        char *text, size_t len) {
  char host[INET6_ADDRSTRLEN];
  int bits = 0;
  if (!addr || !mask) return -1;
  if (addr->sa_family == AF_INET) {
    uint32_t a = ntohl(((const struct sockaddr_in *)addr)->sin_addr.s_addr);
    uint32_t m = ntohl(((const struct sockaddr_in *)mask)->sin_addr.s_addr);
    struct in_addr net = {.s_addr = htonl(a & m)};
    for (uint32_t k = m; k & 0x80000000u; k <<= 1) bits++;
    inet_ntop(AF_INET, &net, host, sizeof(host));
    out->kind = MPLANE_SUBNET_IPV4;
    out->key = ((uint64_t)(a & m) << 8) | (uint64_t)bits;
  } else if (addr->sa_family == AF_INET6) {
    const struct in6_addr *a = &((const struct sockaddr_in6 *)addr)->sin6_addr;
    const struct in6_addr *m = &((const struct sockaddr_in6 *)mask)->sin6_addr;
    struct in6_addr net;
    for (int b = 0; b < 16; b++) {
      net.s6_addr[b] = a->s6_addr[b] & m->s6_addr[b];
      for (int k = 7; k >= 0; k--) bits += (m->s6_addr[b] >> k) & 1;
    }
    uint64_t key = 0;
    for (int b = 0; b < 8; b++) key = (key << 8) | net.s6_addr[b];
    inet_ntop(AF_INET6, &net, host, sizeof(host));
    out->kind = MPLANE_SUBNET_IPV6;
    out->key = key;
  } else {
    return -1;
  }
  snprintf(text, len, "%s/%d", host, bits);
  return 0;
}

static int subnet_cmp(const struct mplane_subnet *a, const struct mplane_subnet *b) {
  if (a->kind != b->kind) return a->kind < b->kind ? -1 : 1;
  if (a->key != b->key) return a->key < b->key ? -1 : 1;
  return 0;
}

int mplane_planes_by_subnet(int n, const struct mplane_subnet *subnets, int *plane, int *rail) {
  if (n <= 0) return 0;
  for (int i = 0; i < n; i++)
    if (subnets[i].kind == MPLANE_SUBNET_NONE) return 0;
  /* Subnets with a name (an IB prefix, an IP subnet) come first, ranked by that name; a transport's
   * found subnets (PROBED) follow, each at the number the transport gave it, so that a slot it kept
   * for a port that is down stays empty instead of shifting the planes after it. */
  int named = 0, distinct = 0;
  for (int i = 0; i < n; i++) {
    int first = 1;
    for (int j = 0; j < i; j++) first &= subnet_cmp(&subnets[j], &subnets[i]) != 0;
    named += first && subnets[i].kind != MPLANE_SUBNET_PROBED;
  }
  for (int i = 0; i < n; i++) {
    int below = 0, before = 0, first = 1;
    /* plane = number of distinct named subnets sorting before this one */
    for (int j = 0; j < n; j++) {
      if (subnet_cmp(&subnets[j], &subnets[i]) >= 0 || subnets[j].kind == MPLANE_SUBNET_PROBED) continue;
      int first_of_its_subnet = 1;
      for (int k = 0; k < j; k++) first_of_its_subnet &= subnet_cmp(&subnets[k], &subnets[j]) != 0;
      below += first_of_its_subnet;
    }
    for (int j = 0; j < i; j++) {
      int same = subnet_cmp(&subnets[j], &subnets[i]) == 0;
      before += same;
      first &= !same;
    }
    plane[i] = subnets[i].kind == MPLANE_SUBNET_PROBED ? named + (int)subnets[i].key : below;
    rail[i] = before;
    distinct += first;
  }
  return distinct;
}

int mplane_planes_number_groups(int n, const int *group, int *slot) {
  int next = 0;
  for (int i = 0; i < n; i++) {
    slot[i] = -1;
    if (group[i] >= 0)
      for (int j = 0; j < i && slot[i] < 0; j++)
        if (group[j] == group[i]) slot[i] = slot[j];
    if (slot[i] < 0) slot[i] = next++;
  }
  return next;
}

/* ------------------------------------------------------------------ the model's NICs */

void mplane_topo_set_subnet(struct mplane_topo *t, int nic, int kind, uint64_t key, const char *text) {
  if (nic < 0 || nic >= t->nnics) return;
  struct mplane_topo_nic *n = &t->nics[nic];
  n->has_subnet = 1;
  n->subnet_kind = (uint64_t)kind;
  n->subnet_key = key;
  snprintf(n->subnet, sizeof(n->subnet), "%s", text ? text : "");
}

static void list_nic_names(const struct mplane_topo *t, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (int i = 0; i < t->nnics; i++) {
    const struct mplane_topo_nic *n = &t->nics[i];
    int k;
    if (n->ibdev[0] && n->netdev[0] && strcmp(n->name, n->netdev) != 0)
      k = snprintf(buf + o, len - o, "%s%s (%s)", i ? ", " : "", n->name, n->netdev);
    else
      k = snprintf(buf + o, len - o, "%s%s", i ? ", " : "", n->name);
    if (k < 0 || o + (size_t)k >= len) break;
    o += (size_t)k;
  }
  if (t->nnics == 0) snprintf(buf, len, "none");
}

/* ------------------------------------------------------------------ MPLANE_PLANES, the fabric, PCI order */

ncclResult_t mplane_topo_assign_planes(struct mplane_topo *t, const char *planes, char *err, size_t errlen) {
  struct mplane_planes_spec spec;
  char why[256];
  if (mplane_planes_parse(planes, &spec, why, sizeof(why)) != 0) {
    snprintf(err, errlen, "MPLANE_PLANES='%s' is not valid: %s; expected NIC=plane pairs, e.g. mlx5_0=0,mlx5_1=1",
             planes, why);
    return ncclInvalidArgument;
  }
  int named[MPLANE_TOPO_MAX_NICS];
  for (int n = 0; n < t->nnics; n++) {
    named[n] = -1;
    t->nics[n].excluded = 0;
    t->nics[n].compute = 0;
    t->nics[n].plane = t->nics[n].rail = -1;
    t->nics[n].plane_source = MPLANE_TOPO_PLANE_NONE;
  }
  for (int i = 0; i < spec.n; i++) {
    int n = mplane_topo_find_nic(t, spec.entry[i].nic);
    if (n < 0) {
      char names[1024];
      list_nic_names(t, names, sizeof(names));
      snprintf(err, errlen, "MPLANE_PLANES='%s' names NIC '%s', which this node does not have (its NICs: %s)",
               planes, spec.entry[i].nic, names);
      return ncclInvalidArgument;
    }
    if (named[n] >= 0) {
      snprintf(err, errlen, "MPLANE_PLANES='%s' names NIC %s twice ('%s' and '%s')", planes, t->nics[n].name,
               spec.entry[named[n]].nic, spec.entry[i].nic);
      return ncclInvalidArgument;
    }
    named[n] = i;
  }
  if (spec.n > 0)
    for (int n = 0; n < t->nnics; n++) t->nics[n].excluded = named[n] < 0;

  mplane_topo_pair_gpus(t);

  int ncompute = 0, compute[MPLANE_TOPO_MAX_NICS];
  int pci_only = mplane_topo_have_pci_candidates(t);
  for (int n = 0; n < t->nnics; n++) {
    struct mplane_topo_nic *nic = &t->nics[n];
    if (spec.n > 0)
      nic->compute = named[n] >= 0;
    else /* no GPU, or no PCI NIC: every NIC is the node's network */
      nic->compute = t->ngpus == 0 || nic->ngpus > 0 || (!pci_only && nic->pci < 0);
    if (nic->compute) compute[ncompute++] = n;
  }

  enum mplane_topo_plane_source src = MPLANE_TOPO_PLANE_NONE;
  if (spec.n > 0) {
    src = MPLANE_TOPO_PLANE_CONFIG;
    /* NICs given one plane are its rails, numbered in the node's NIC order (PCI, then name) */
    for (int n = 0; n < t->nnics; n++) {
      if (named[n] < 0) continue;
      int plane = spec.entry[named[n]].plane, rail = 0;
      for (int m = 0; m < n; m++) rail += named[m] >= 0 && spec.entry[named[m]].plane == plane;
      t->nics[n].plane = plane;
      t->nics[n].rail = rail;
    }
  } else if (ncompute > 0) {
    /* The fabric decides when it tells every compute NIC's subnet (one subnet: one plane, its NICs
     * rails of it, so no connection between them is relayed); else PCI order. */
    struct mplane_subnet subnets[MPLANE_TOPO_MAX_NICS];
    int plane[MPLANE_TOPO_MAX_NICS], rail[MPLANE_TOPO_MAX_NICS], known[MPLANE_TOPO_MAX_NICS], nknown = 0;
    /* a NIC that is down with no subnet known carries nothing: it neither takes a plane nor keeps
     * the others from theirs (the transport's numbers keep its slot) */
    for (int i = 0; i < ncompute; i++) {
      const struct mplane_topo_nic *nic = &t->nics[compute[i]];
      if (nic->down && !nic->has_subnet) continue;
      subnets[nknown].kind = nic->has_subnet ? (int)nic->subnet_kind : MPLANE_SUBNET_NONE;
      subnets[nknown].key = nic->subnet_key;
      known[nknown++] = compute[i];
    }
    if (mplane_planes_by_subnet(nknown, subnets, plane, rail) > 0) {
      src = MPLANE_TOPO_PLANE_FABRIC;
      for (int i = 0; i < nknown; i++) {
        t->nics[known[i]].plane = plane[i];
        t->nics[known[i]].rail = rail[i];
      }
    } else {
      /* PCI order over every compute NIC, down or not, so a port down shifts no number */
      src = MPLANE_TOPO_PLANE_PCI;
      for (int i = 0; i < ncompute; i++) {
        t->nics[compute[i]].plane = i;
        t->nics[compute[i]].rail = 0;
      }
    }
  }
  int distinct_planes = 0;
  for (int n = 0; n < t->nnics; n++) {
    if (t->nics[n].plane < 0) continue;
    t->nics[n].plane_source = src;
    int seen = 0;
    for (int m = 0; m < n; m++) seen |= t->nics[m].plane == t->nics[n].plane;
    distinct_planes += !seen;
  }
  t->nplanes = distinct_planes;
  t->plane_source = distinct_planes ? src : MPLANE_TOPO_PLANE_NONE;
  return ncclSuccess;
}
