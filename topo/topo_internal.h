/* mplane: what the topo/ files share with each other and nobody else. */
#ifndef MPLANE_TOPO_INTERNAL_H
#define MPLANE_TOPO_INTERNAL_H

#include "topo.h"

/* The model's builders. Each fills an empty, zeroed topology (mplane_topo_init) and returns
 * ncclSuccess, or an error with err naming the input. */
ncclResult_t mplane_topo_from_hwloc(struct mplane_topo *t, const char *xml_path, const char *xml_input, char *err,
                                    size_t errlen);
ncclResult_t mplane_topo_from_sysfs(struct mplane_topo *t, const char *root);

/* An hwloc XML file (MPLANE_TOPO_FILE, mplane-topo --topo) is read whole (a regular file of at most
 * MPLANE_TOPO_XML_MAX_BYTES) and checked in a child process before this one loads it: hwloc must
 * load it there, and the model build from it, within MPLANE_TOPO_XML_CHECK_MS. */
#define MPLANE_TOPO_XML_MAX_BYTES (64 << 20)
#define MPLANE_TOPO_XML_CHECK_MS 10000
/* The model from an hwloc XML held in memory (buf[len] must be '\0'); name (the path) and what
 * (the variable, e.g. "MPLANE_TOPO_FILE") say how errors name it. check_timeout_ms > 0: run
 * mplane_topo_xml_check first and refuse the file (ncclInvalidArgument, naming it and why) unless
 * it passes; 0: load it here directly (a caller that checked already). */
ncclResult_t mplane_topo_from_hwloc_xml(struct mplane_topo *t, const char *buf, size_t len, const char *name,
                                        const char *what, int check_timeout_ms, char *err, size_t errlen);
/* Load buf with hwloc (with_build: and build the model from it) in a forked child with its own
 * crash handling and a deadline. 0: it loaded; 1: hwloc refused it as invalid; -1: the child
 * crashed, ran past timeout_ms (and was killed) or could not be started; why says which. */
int mplane_topo_xml_check(const char *buf, size_t len, int timeout_ms, int with_build, char *why, size_t whylen);

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

/* GPU-NIC pairing (model.c), which planes.c runs before it decides planes: each GPU's nearest NIC
 * among those MPLANE_PLANES did not leave out. */
void mplane_topo_pair_gpus(struct mplane_topo *t);
/* 1 when some NIC not left out has a PCI device (then GPUs pair only with such NICs). */
int mplane_topo_have_pci_candidates(const struct mplane_topo *t);

void mplane_topo_read_speeds(struct mplane_topo *t, const char *root);

/* The NCCL view of the PCI tree: PCI nodes NCCL keeps between a device and its CPU (every second
 * bridge going up, i.e. each switch's upstream port), nearest first. Returns how many. */
int mplane_topo_nccl_parents(const struct mplane_topo *t, int pci, int *out, int max);
/* 1 when making parent the parent of child would close a loop (parent is child, or below it). */
int mplane_topo_pci_would_cycle(const struct mplane_topo *t, int child, int parent);

/* Bounds on numbers read from sysfs and hwloc files: CPU (and NUMA node) numbers, link speeds. */
#define MPLANE_TOPO_MAX_CPU 65535
#define MPLANE_TOPO_MAX_SPEED_MBPS 10000000 /* 10 Tb/s */

/* A sysfs cpulist ("0-3,8,10-11") into cpus (at most max); returns how many. A malformed list, a
 * reversed range or a CPU number above MPLANE_TOPO_MAX_CPU gives 0: nothing of it is trusted. */
int mplane_topo_parse_cpulist(const char *s, int *cpus, int max);
/* An InfiniBand port rate as sysfs writes it ("400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)") in
 * Mb/s; 0 when it is not one, or above MPLANE_TOPO_MAX_SPEED_MBPS. */
int mplane_topo_parse_ib_rate(const char *s);

/* "ffffffff,0000ffff" (sysfs cpumap form) from a list of CPU numbers. */
void mplane_topo_cpumap(const int *cpus, int n, char *out, size_t len);


/* Natural order of names: "veth2" < "veth10". */
int mplane_topo_name_cmp(const char *a, const char *b);

uint64_t mplane_topo_hash(const char *s);

#endif
