/* mplane: what the topo/ files share with each other and nobody else. */
#ifndef MPLANE_TOPO_INTERNAL_H
#define MPLANE_TOPO_INTERNAL_H

#include "topo.h"

/* The model's builders. Each fills an empty, zeroed topology (mplane_topo_init) and returns
 * ncclSuccess, or an error with err naming the input. */
ncclResult_t mplane_topo_from_hwloc(struct mplane_topo *t, const char *xml_path, const char *xml_input, char *err,
                                    size_t errlen);
ncclResult_t mplane_topo_from_sysfs(struct mplane_topo *t, const char *root);

void mplane_topo_init(struct mplane_topo *t);
/* Add a PCI function or bridge; returns its index or -1 when full. Parent/hostbridge set by caller. */
int mplane_topo_add_pci(struct mplane_topo *t, const char *busid);
int mplane_topo_find_pci(const struct mplane_topo *t, const char *busid);
/* The host bridge named "0000:15" (domain:root bus), created on first use. */
int mplane_topo_hostbridge(struct mplane_topo *t, const char *name, int numa);
/* The NIC on PCI function pci, created on first use; -1 when full. */
int mplane_topo_nic_for_pci(struct mplane_topo *t, int pci);
/* After a builder: GPUs from the PCI functions (NVIDIA display/3D class), sorted by bus id and
 * numbered; NICs sorted (PCI ones by bus id, then virtual ones by name); names and guids filled. */
void mplane_topo_finish(struct mplane_topo *t);
/* Sort NICs again (after virtual ones were added). */
void mplane_topo_sort_nics(struct mplane_topo *t);

/* Live details: read up interfaces (getifaddrs) for IP subnets; with add_virtual, interfaces that
 * are no NIC of the model yet (and no loopback / container bridge) are added as virtual NICs.
 * Link speeds from sysfs for NICs that have none. */
void mplane_topo_read_interfaces(struct mplane_topo *t, int add_virtual);
void mplane_topo_read_speeds(struct mplane_topo *t, const char *root);

/* The NCCL view of the PCI tree: PCI nodes NCCL keeps between a device and its CPU (every second
 * bridge going up, i.e. each switch's upstream port), nearest first. Returns how many. */
int mplane_topo_nccl_parents(const struct mplane_topo *t, int pci, int *out, int max);

/* "ffffffff,0000ffff" (sysfs cpumap form) from a list of CPU numbers. */
void mplane_topo_cpumap(const int *cpus, int n, char *out, size_t len);

/* Parse "0000:18:00.0"-like strings; 0 when it is a PCI bus id, and then writes it lower case. */
int mplane_topo_parse_busid(const char *s, char *out, size_t len);

/* Natural order of names: "veth2" < "veth10". */
int mplane_topo_name_cmp(const char *a, const char *b);

uint64_t mplane_topo_hash(const char *s);

#endif
