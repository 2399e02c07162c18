/* mplane: which plane each NIC is on, decided in one place.
 *
 * Sources, strongest first (docs/topology.md, Planes, is the reference):
 *   1. MPLANE_PLANES ("mlx5_0=0,mlx5_1=1", interface names, plugin device names): the NICs it names
 *      and their planes; NICs given one plane are its rails; NICs it does not name are on no plane;
 *   2. the fabric: different planes are different subnets (an IB port's GID prefix, an IP subnet, or
 *      the subnet a transport found, e.g. the subnet probe). When every NIC's subnet is known,
 *      plane = rank of its named subnet among the distinct ones, then the found subnets at the
 *      numbers their transport gave them (numbered over every port present, a port down keeping
 *      its number, so every node numbers alike); NICs that share a subnet share a plane as rails
 *      0, 1, ...: one subnet is one plane. A NIC that is down and has no subnet known is left out
 *      of the rule (it carries nothing) rather than voiding it;
 *   3. PCI order (then name order for NICs without PCI).
 *
 * Transports and discovery only report facts (struct mplane_subnet: which subnet a NIC is on, if
 * any); this module turns them into planes. No address range means anything by itself. The
 * grammar of MPLANE_PLANES is parsed by mplane_planes_parse (common/config.h), where the config
 * table refuses a bad value at load; what its entries mean (which NIC a name is, rails, the NICs
 * left out) is decided here. */
#ifndef MPLANE_TOPO_PLANES_H
#define MPLANE_TOPO_PLANES_H

#include <stddef.h>
#include <stdint.h>

#include "../common/nccl/err.h"

/* What a subnet fact is; planes sort by kind, then key. */
enum mplane_subnet_kind {
  MPLANE_SUBNET_NONE = 0,   /* nothing known */
  MPLANE_SUBNET_IB = 1,     /* an IB port's GID subnet prefix (key: the prefix, host order) */
  MPLANE_SUBNET_IPV4 = 2,   /* key: (address & mask) << 8 | prefix length */
  MPLANE_SUBNET_IPV6 = 3,   /* key: the first 64 bits of address & mask */
  MPLANE_SUBNET_PROBED = 4, /* a subnet a transport found (the subnet probe); key: its plane number
                             * among the subnets it found, numbered over every port present, up or
                             * down (mplane_planes_number_groups) */
};

/* The subnet a NIC is on, as a transport or discovery found it. */
struct mplane_subnet {
  int kind; /* enum mplane_subnet_kind */
  uint64_t key;
};

/* Every subnet manager starts from this GID prefix, so it tells no subnet apart. */
#define MPLANE_IB_DEFAULT_GID_PREFIX 0xfe80000000000000ull

/* 1 when an IB port's GID prefix (host byte order) names its subnet (any but the default), else 0. */
int mplane_ib_prefix_names_subnet(uint64_t prefix);

struct sockaddr;
/* The subnet of an interface's address and netmask, the fact discovery reads from the interface:
 * IPv4 or IPv6 (the mask read as the address's family), with its text ("198.18.3.0/24"). 0 on
 * success, -1 for another family (out untouched). */
int mplane_subnet_of_ip(const struct sockaddr *addr, const struct sockaddr *mask, struct mplane_subnet *out,
                        char *text, size_t len);

/* The fabric rule. When every one of the n subnets is known (kind != NONE), writes each NIC's plane
 * (rank of its subnet among the distinct subnets, sorted by kind, then key) and rail (how many NICs
 * before it share its subnet) and returns how many distinct subnets there are. Returns 0 and writes
 * nothing when one is unknown, or n is 0: the fabric does not decide. */
int mplane_planes_by_subnet(int n, const struct mplane_subnet *subnets, int *plane, int *rail);

/* How a transport numbers the subnets it found so that every node of a uniform cluster numbers them
 * alike, a port down or not: n ports present in the node's order, group[i] the subnet port i is on
 * (ports with equal group share one), or -1 for a port whose subnet cannot be known (it is down),
 * which keeps a number of its own. Writes each port's number (groups numbered by their first port)
 * and returns how many numbers were given. */
int mplane_planes_number_groups(int n, const int *group, int *slot);

struct mplane_topo;

/* Record the subnet NIC nic of the model is on, for the fabric rule ("198.18.3.0/24",
 * "fec0:0000:0000:0001"; kind: enum mplane_subnet_kind). Call mplane_topo_assign_planes afterwards. */
void mplane_topo_set_subnet(struct mplane_topo *t, int nic, int kind, uint64_t key, const char *text);

/* Pair GPUs with NICs and assign planes again, e.g. after NICs were added or the fabric was read.
 * planes is the MPLANE_PLANES value ("" or NULL: none); a NIC it names that does not exist, or
 * two names for one NIC, is an error that names the variable and lists the node's NICs. */
ncclResult_t mplane_topo_assign_planes(struct mplane_topo *t, const char *planes, char *err, size_t errlen);

#endif
