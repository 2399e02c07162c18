/* mplane: the node's topology, the way a cluster engineer describes it.
 *
 * Discovery reads hwloc (the live machine, or an hwloc XML file named by MPLANE_TOPO_FILE) into a
 * small model: NVIDIA GPUs, NICs (one per PCI function: its InfiniBand device and its netdev are the
 * same NIC), the PCIe bridges between them, host bridges and NUMA nodes. When hwloc sees no PCI
 * device at all (some containers) the same model is read from sysfs instead.
 *
 * On that model:
 *   - every GPU is paired with its NIC: same PCIe switch first, then same host bridge, then same NUMA
 *     node; the pair's link class is the one nvidia-smi topo -m prints (PIX, PXB, PHB, NODE, SYS);
 *   - NICs paired with a GPU (all NICs on a node without GPU) are compute NICs; the others are
 *     storage / front-end NICs and sit on no plane;
 *   - every compute NIC gets a plane: MPLANE_PLANES first, then the fabric (InfiniBand subnet prefix,
 *     IP subnet: different planes are different subnets), then PCI order (planes.h, planes.c);
 *   - the NCCL topology XML of the node (with NIC planes) can be written for NCCL_TOPO_FILE.
 *
 * Planes never depend on CUDA_VISIBLE_DEVICES: every process on a node must agree on them, so they
 * are computed from all GPUs; visibility only says which GPUs this process drives. */
#ifndef MPLANE_TOPO_H
#define MPLANE_TOPO_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "../common/nccl/err.h"
#include "planes.h"


#define MPLANE_TOPO_MAX_GPUS 64
#define MPLANE_TOPO_MAX_NICS 64
#define MPLANE_TOPO_MAX_PCI 1024
#define MPLANE_TOPO_MAX_NUMA 64
#define MPLANE_TOPO_MAX_HOSTBRIDGES 256
#define MPLANE_TOPO_BUSID_LEN 16 /* "0000:18:00.0" */

/* Link class of a GPU/NIC pair, nearest first (nvidia-smi topo -m):
 * PIX  through one PCIe switch;          PXB  through several PCIe switches;
 * PHB  through a PCIe host bridge;       NODE across host bridges inside one NUMA node;
 * SYS  across NUMA nodes (or unknown: a NIC with no PCI device). NCCL calls NODE "PHB" too. */
enum mplane_topo_link {
  MPLANE_TOPO_LINK_PIX = 0,
  MPLANE_TOPO_LINK_PXB,
  MPLANE_TOPO_LINK_PHB,
  MPLANE_TOPO_LINK_NODE,
  MPLANE_TOPO_LINK_SYS,
};

/* Where a NIC's plane came from. */
enum mplane_topo_plane_source {
  MPLANE_TOPO_PLANE_NONE = 0, /* not a compute NIC: no plane */
  MPLANE_TOPO_PLANE_CONFIG,   /* MPLANE_PLANES */
  MPLANE_TOPO_PLANE_FABRIC,   /* IB subnet prefix / IP subnet */
  MPLANE_TOPO_PLANE_PCI,      /* PCI order (then name order for NICs without PCI) */
};

/* What a NIC is. */
enum mplane_topo_nic_kind {
  MPLANE_TOPO_NIC_RDMA = 0, /* has an InfiniBand verbs device (IB or RoCE) */
  MPLANE_TOPO_NIC_ETHERNET, /* a PCI netdev without verbs: TCP only */
  MPLANE_TOPO_NIC_VIRTUAL,  /* no PCI device (veth, bond, lo, ...) */
};

/* A PCI function or PCI-to-PCI bridge (switch port, root port). */
struct mplane_topo_pci {
  char busid[MPLANE_TOPO_BUSID_LEN]; /* lower case, as NCCL and sysfs write it */
  int parent;                        /* index of the PCI bridge above, -1 when on a host bridge */
  int hostbridge;                    /* host bridge id (0..nhostbridges-1), -1 unknown */
  int is_bridge;
  uint32_t class_code; /* 24 bits: 0x060400 bridge, 0x030200 3D controller, 0x020700 IB ... */
  uint16_t vendor, device, subvendor, subdevice;
  int numa; /* NUMA node os index, -1 unknown */
};

struct mplane_topo_numa {
  int os_index;
  char affinity[256]; /* CPU mask as sysfs cpumap writes it ("ffffffff,00000000") */
};

struct mplane_topo_gpu {
  int index;    /* among the node's NVIDIA GPUs, in PCI order (as nvidia-smi and NVML count) */
  int cuda_dev; /* CUDA device index under CUDA_VISIBLE_DEVICES; -1 hidden; -2 unknown */
  char busid[MPLANE_TOPO_BUSID_LEN];
  int pci;  /* index into pci[] */
  int numa; /* -1 unknown */
  char model[64];
  char uuid[64]; /* "GPU-..." when hwloc had NVML, else "" */
  int nic;       /* paired NIC (index into nics[]), -1 none */
  enum mplane_topo_link link; /* link class of the pair */
};

struct mplane_topo_nic {
  char name[64];   /* what users and NCCL see: the plugin's device name once annotated, else the
                      verbs name (mlx5_0), else the netdev (eth0) */
  char ibdev[32];  /* verbs device, "" when none */
  char netdev[32]; /* network interface, "" when none */
  char busid[MPLANE_TOPO_BUSID_LEN]; /* "" for a virtual NIC */
  int pci;                           /* index into pci[], -1 virtual */
  int numa;
  enum mplane_topo_nic_kind kind;
  uint64_t guid;  /* node GUID, else MAC, else a hash of the name; distinct per physical NIC */
  int speed_mbps; /* 0 unknown */
  int port;       /* IB port, 0 for Ethernet */
  int down;       /* its port is not active (or the transport does not drive it): no subnet can be known */
  int has_subnet; /* the fabric says which subnet the NIC is on */
  uint64_t subnet_kind; /* enum mplane_subnet_kind (planes.h): planes sort by kind, key */
  uint64_t subnet_key;
  char subnet[64]; /* "fec0:0000:0000:0001" or "198.18.3.0/24" */
  int ngpus;       /* GPUs paired with it */
  int compute;     /* on a plane (carries GPU traffic) */
  int excluded;    /* left out by MPLANE_PLANES */
  int plane;       /* -1: none */
  int rail;        /* index among this node's NICs on the same plane; -1: none */
  enum mplane_topo_plane_source plane_source;
  int dev; /* plugin device index, -1 when the plugin does not drive it */
};

struct mplane_topo {
  char source[320];  /* "hwloc (live)", "hwloc XML <path>", "sysfs (hwloc saw no PCI device)" */
  char hostname[64];
  int from_file;     /* described by an XML file, not this machine */
  char cpu_arch[16]; /* "x86_64", "arm64", "ppc64", "" */
  char cpu_vendor[16];
  int cpu_family, cpu_model; /* -1 unknown */
  char all_cpus[256];        /* affinity of the whole machine */
  char cuda_visible[256];    /* CUDA_VISIBLE_DEVICES as applied ("" = unset: all visible) */
  int cuda_visible_set;
  int npci;
  struct mplane_topo_pci pci[MPLANE_TOPO_MAX_PCI];
  int nhostbridges;
  int hostbridge_numa[MPLANE_TOPO_MAX_HOSTBRIDGES];
  char hostbridge_name[MPLANE_TOPO_MAX_HOSTBRIDGES][16]; /* "0000:15" (domain:root bus) */
  int nnuma;
  struct mplane_topo_numa numa[MPLANE_TOPO_MAX_NUMA];
  int ngpus;
  struct mplane_topo_gpu gpus[MPLANE_TOPO_MAX_GPUS];
  int nnics;
  struct mplane_topo_nic nics[MPLANE_TOPO_MAX_NICS];
  int nplanes;                              /* distinct planes among compute NICs */
  enum mplane_topo_plane_source plane_source; /* how the planes were found */
};

/* How to discover. Every field may be left zero. */
struct mplane_topo_options {
  const char *xml_path;     /* hwloc XML instead of the live machine; NULL or "" = live */
  const char *xml_input;    /* how errors name that path, e.g. "MPLANE_TOPO_FILE" or "--topo" */
  const char *planes;       /* MPLANE_PLANES grammar; NULL or "" = none */
  const char *cuda_visible; /* CUDA_VISIBLE_DEVICES; NULL = unset (all GPUs visible) */
  const char *sysfs_root;   /* root of the sysfs fallback; NULL = "/" (tests point it elsewhere) */
  int force_sysfs;          /* skip hwloc: read sysfs directly (tests) */
  int live_interfaces;      /* live only: add up, non-loopback interfaces without PCI as virtual
                               NICs, and read IP subnets (mplane-topo does; the plugin adds its own
                               devices instead) */
};

/* Discover the node, pair GPUs with NICs and assign planes. On error returns ncclInvalidArgument
 * (bad input: the message names the file or variable) or ncclSystemError, writes why into err, and
 * sets *out to NULL. A node with no GPU or no NIC is no error. */
ncclResult_t mplane_topo_load(const struct mplane_topo_options *opts, struct mplane_topo **out, char *err,
                              size_t errlen);
void mplane_topo_free(struct mplane_topo *t);

/* The link class between two PCI functions of the model (indices into pci[]); SYS when either is
 * -1. */
enum mplane_topo_link mplane_topo_pci_link(const struct mplane_topo *t, int pci_a, int pci_b);
/* The link class between GPU g and NIC n. */
enum mplane_topo_link mplane_topo_gpu_nic_link(const struct mplane_topo *t, int g, int n);
/* GPU g's NIC (index into nics[], -1 none) and, when link is not NULL, the pair's link class. */
int mplane_topo_gpu_nic_pair(const struct mplane_topo *t, int g, enum mplane_topo_link *link);
const char *mplane_topo_link_name(enum mplane_topo_link link);
const char *mplane_topo_plane_source_name(enum mplane_topo_plane_source src);
const char *mplane_topo_nic_kind_name(enum mplane_topo_nic_kind kind);

/* The NIC a name stands for: its name, verbs device or netdev; "mlx5_0:1" (device:port) matches
 * mlx5_0. -1 when none. */
int mplane_topo_find_nic(const struct mplane_topo *t, const char *name);

/* Planes (MPLANE_PLANES, the fabric, PCI order): planes.h, included above. */

/* Apply CUDA_VISIBLE_DEVICES (NULL = unset): indices and GPU-UUID prefixes, as CUDA reads them
 * (an entry that names no GPU ends the list). Sets every GPU's cuda_dev. */
void mplane_topo_apply_cuda_visible(struct mplane_topo *t, const char *spec);

/* Sort NICs again (after virtual ones were added). */
void mplane_topo_sort_nics(struct mplane_topo *t);

/* Live details: read up interfaces (getifaddrs) for IP subnets; with add_virtual, interfaces that
 * are no NIC of the model yet (and no loopback / container bridge) are added as virtual NICs.
 * Link speeds from sysfs for NICs that have none. */
void mplane_topo_read_interfaces(struct mplane_topo *t, int add_virtual);

/* Parse "0000:18:00.0"-like strings; 0 when it is a PCI bus id, and then writes it lower case. */
int mplane_topo_parse_busid(const char *s, char *out, size_t len);

/* Add a NIC that has no PCI device (veth, lo). Returns its index, or -1 when full. */
int mplane_topo_add_virtual_nic(struct mplane_topo *t, const char *name);

/* NCCL topology XML of the node (the tree NCCL builds from sysfs: <system><cpu numaid><pci switch>
 * <pci gpu/nic>...), each NIC's <nic><net name dev speed port guid plane rail/></nic>. GPU <pci>
 * nodes carry no <gpu> child: NCCL fills it from NVML (its own device index). */
ncclResult_t mplane_topo_write_nccl_xml(const struct mplane_topo *t, FILE *out);

/* Write that XML into a memfd and return its path, /proc/self/fd/N, in path. */
ncclResult_t mplane_topo_nccl_xml_memfd(const struct mplane_topo *t, char *path, size_t pathlen);

/* Reports (mplane-topo). */
void mplane_topo_print_table(const struct mplane_topo *t, FILE *out);
void mplane_topo_print_picture(const struct mplane_topo *t, FILE *out);
void mplane_topo_print_json(const struct mplane_topo *t, FILE *out);
void mplane_topo_print_nccl_env(const struct mplane_topo *t, FILE *out);

#endif
