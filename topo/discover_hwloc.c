/* mplane: the node model from hwloc, live or from an hwloc XML file. */
#include <errno.h>
#include <hwloc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../plugin/log.h"
#include "topo_internal.h"

/* NUMA node of an I/O object: the one NUMA node its locality covers, else -1 (the firmware gave
 * the root complex no affinity, and hwloc hung it off the whole machine). */
static int io_numa(hwloc_topology_t topo, hwloc_obj_t obj) {
  hwloc_obj_t anc = hwloc_get_non_io_ancestor_obj(topo, obj);
  if (!anc || !anc->nodeset) return -1;
  int total = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  if (hwloc_bitmap_weight(anc->nodeset) == 1 || total == 1) return hwloc_bitmap_first(anc->nodeset);
  return -1;
}

static void cpuset_to_cpumap(hwloc_const_bitmap_t set, char *out, size_t len) {
  int cpus[4096], n = 0;
  unsigned i;
  hwloc_bitmap_foreach_begin(i, set) {
    if (n < 4096) cpus[n++] = (int)i;
  }
  hwloc_bitmap_foreach_end();
  mplane_topo_cpumap(cpus, n, out, len);
}

static void busid_of(const struct hwloc_pcidev_attr_s *p, char *out, size_t len) {
  snprintf(out, len, "%04x:%02x:%02x.%x", p->domain, p->bus, p->dev, p->func);
}

/* "a088:c203:0012:3456" (hwloc's GUID form) or "fe80:0000:0000:0000" -> 64 bits. */
static int parse_groups64(const char *s, uint64_t *out) {
  unsigned g[4];
  if (!s || sscanf(s, "%4x:%4x:%4x:%4x", &g[0], &g[1], &g[2], &g[3]) != 4) return -1;
  *out = ((uint64_t)g[0] << 48) | ((uint64_t)g[1] << 32) | ((uint64_t)g[2] << 16) | g[3];
  return 0;
}

static uint64_t parse_mac(const char *s) {
  /* The last six bytes of the address (IPoIB addresses are 20 bytes; Ethernet 6). */
  unsigned b[20];
  int n = 0;
  const char *p = s;
  while (p && *p && n < 20) {
    unsigned v;
    if (sscanf(p, "%2x", &v) != 1) break;
    b[n++] = v;
    p = strchr(p, ':');
    if (p) p++;
  }
  uint64_t m = 0;
  for (int i = n > 6 ? n - 8 : 0; i < n; i++) m = (m << 8) | b[i];
  return m;
}

static void add_ib_details(struct mplane_topo_nic *nic, hwloc_obj_t os) {
  uint64_t guid;
  if (parse_groups64(hwloc_obj_get_info_by_name(os, "NodeGUID"), &guid) == 0 && guid) nic->guid = guid;
  /* The first port hwloc reports; its GID 0 carries the subnet prefix. */
  for (int port = 1; port <= 8; port++) {
    char key[32];
    snprintf(key, sizeof(key), "Port%dState", port);
    if (!hwloc_obj_get_info_by_name(os, key)) continue;
    nic->port = port;
    snprintf(key, sizeof(key), "Port%dGID0", port);
    uint64_t prefix;
    const char *gid = hwloc_obj_get_info_by_name(os, key);
    /* fe80:: is every subnet's default: it tells planes apart only when the SM sets others. */
    if (parse_groups64(gid, &prefix) == 0 && prefix != 0xfe80000000000000ULL) {
      nic->has_subnet = 1;
      nic->subnet_kind = 1;
      nic->subnet_key = prefix;
      snprintf(nic->subnet, sizeof(nic->subnet), "%.19s", gid);
    }
    break;
  }
}

static ncclResult_t build(struct mplane_topo *t, hwloc_topology_t topo) {
  hwloc_obj_t root = hwloc_get_root_obj(topo);
  const char *host = hwloc_obj_get_info_by_name(root, "HostName");
  snprintf(t->hostname, sizeof(t->hostname), "%s", host ? host : "");
  const char *arch = hwloc_obj_get_info_by_name(root, "Architecture");
  if (arch) {
    if (strcmp(arch, "aarch64") == 0) arch = "arm64";
    if (strncmp(arch, "ppc64", 5) == 0) arch = "ppc64";
    snprintf(t->cpu_arch, sizeof(t->cpu_arch), "%s", arch);
  }
  hwloc_obj_t pkg = hwloc_get_obj_by_type(topo, HWLOC_OBJ_PACKAGE, 0);
  if (pkg) {
    const char *v = hwloc_obj_get_info_by_name(pkg, "CPUVendor");
    const char *f = hwloc_obj_get_info_by_name(pkg, "CPUFamilyNumber");
    const char *m = hwloc_obj_get_info_by_name(pkg, "CPUModelNumber");
    if (v) snprintf(t->cpu_vendor, sizeof(t->cpu_vendor), "%s", v);
    if (f) t->cpu_family = atoi(f);
    if (m) t->cpu_model = atoi(m);
  }
  if (root->cpuset) cpuset_to_cpumap(root->cpuset, t->all_cpus, sizeof(t->all_cpus));
  int nnuma = hwloc_get_nbobjs_by_type(topo, HWLOC_OBJ_NUMANODE);
  for (int i = 0; i < nnuma && t->nnuma < MPLANE_TOPO_MAX_NUMA; i++) {
    hwloc_obj_t nn = hwloc_get_obj_by_type(topo, HWLOC_OBJ_NUMANODE, (unsigned)i);
    struct mplane_topo_numa *d = &t->numa[t->nnuma++];
    d->os_index = (int)nn->os_index;
    if (nn->cpuset) cpuset_to_cpumap(nn->cpuset, d->affinity, sizeof(d->affinity));
  }

  /* PCI bridges and functions. hwloc lists parents before children, so parents resolve. */
  for (hwloc_obj_t o = hwloc_get_next_bridge(topo, NULL); o; o = hwloc_get_next_bridge(topo, o)) {
    if (o->attr->bridge.upstream_type != HWLOC_OBJ_BRIDGE_PCI) continue;
    char busid[MPLANE_TOPO_BUSID_LEN];
    busid_of(&o->attr->bridge.upstream.pci, busid, sizeof(busid));
    if (mplane_topo_find_pci(t, busid) >= 0) continue;
    int i = mplane_topo_add_pci(t, busid);
    if (i < 0) break;
    t->pci[i].is_bridge = 1;
  }
  for (hwloc_obj_t o = hwloc_get_next_pcidev(topo, NULL); o; o = hwloc_get_next_pcidev(topo, o)) {
    char busid[MPLANE_TOPO_BUSID_LEN];
    busid_of(&o->attr->pcidev, busid, sizeof(busid));
    if (mplane_topo_find_pci(t, busid) >= 0) continue;
    if (mplane_topo_add_pci(t, busid) < 0) break;
  }
  /* Attributes and parents, for bridges and functions alike. */
  for (int pass = 0; pass < 2; pass++) {
    hwloc_obj_t o = pass == 0 ? hwloc_get_next_bridge(topo, NULL) : hwloc_get_next_pcidev(topo, NULL);
    for (; o; o = pass == 0 ? hwloc_get_next_bridge(topo, o) : hwloc_get_next_pcidev(topo, o)) {
      const struct hwloc_pcidev_attr_s *pa;
      if (pass == 0) {
        if (o->attr->bridge.upstream_type != HWLOC_OBJ_BRIDGE_PCI) continue;
        pa = &o->attr->bridge.upstream.pci;
      } else {
        pa = &o->attr->pcidev;
      }
      char busid[MPLANE_TOPO_BUSID_LEN];
      busid_of(pa, busid, sizeof(busid));
      int i = mplane_topo_find_pci(t, busid);
      if (i < 0) continue;
      struct mplane_topo_pci *p = &t->pci[i];
      p->class_code = ((uint32_t)pa->class_id << 8);
      p->vendor = pa->vendor_id;
      p->device = pa->device_id;
      p->subvendor = pa->subvendor_id;
      p->subdevice = pa->subdevice_id;
      if (pass == 0) p->class_code = 0x060400;
      p->numa = io_numa(topo, o);
      /* Up to the nearest PCI bridge, or to the host bridge that ends the tree. */
      hwloc_obj_t up = o->parent;
      if (up && up->type == HWLOC_OBJ_BRIDGE && up->attr->bridge.upstream_type == HWLOC_OBJ_BRIDGE_PCI) {
        char pb[MPLANE_TOPO_BUSID_LEN];
        busid_of(&up->attr->bridge.upstream.pci, pb, sizeof(pb));
        p->parent = mplane_topo_find_pci(t, pb);
      } else {
        char hb[16];
        if (up && up->type == HWLOC_OBJ_BRIDGE)
          snprintf(hb, sizeof(hb), "%04x:%02x", up->attr->bridge.downstream.pci.domain,
                   up->attr->bridge.downstream.pci.secondary_bus);
        else /* no host bridge object: the root bus the function sits on stands for it */
          snprintf(hb, sizeof(hb), "%04x:%02x", pa->domain, pa->bus);
        p->hostbridge = mplane_topo_hostbridge(t, hb, p->numa);
      }
    }
  }
  /* Host bridges of functions below bridges. */
  for (int pass = 0; pass < 64; pass++) {
    int changed = 0;
    for (int i = 0; i < t->npci; i++) {
      struct mplane_topo_pci *p = &t->pci[i];
      if (p->hostbridge < 0 && p->parent >= 0 && t->pci[p->parent].hostbridge >= 0) {
        p->hostbridge = t->pci[p->parent].hostbridge;
        changed = 1;
      }
    }
    if (!changed) break;
  }

  /* GPUs (with their NVML identity when hwloc has it) and NICs, from the OS devices. */
  for (hwloc_obj_t o = hwloc_get_next_pcidev(topo, NULL); o; o = hwloc_get_next_pcidev(topo, o)) {
    char busid[MPLANE_TOPO_BUSID_LEN];
    busid_of(&o->attr->pcidev, busid, sizeof(busid));
    int i = mplane_topo_find_pci(t, busid);
    if (i < 0) continue;
    struct mplane_topo_pci *p = &t->pci[i];
    if (p->vendor == 0x10de && (p->class_code >> 16) == 0x03 && t->ngpus < MPLANE_TOPO_MAX_GPUS) {
      struct mplane_topo_gpu *g = &t->gpus[t->ngpus++];
      memset(g, 0, sizeof(*g));
      g->pci = i;
      snprintf(g->busid, sizeof(g->busid), "%s", busid);
      g->numa = p->numa;
      const char *model = hwloc_obj_get_info_by_name(o, "PCIDevice");
      for (hwloc_obj_t c = o->io_first_child; c; c = c->next_sibling) {
        if (c->type != HWLOC_OBJ_OS_DEVICE) continue;
        const char *m = hwloc_obj_get_info_by_name(c, "GPUModel");
        const char *u = hwloc_obj_get_info_by_name(c, "NVIDIAUUID");
        if (m) model = m;
        if (u) snprintf(g->uuid, sizeof(g->uuid), "%s", u);
      }
      if (model)
        snprintf(g->model, sizeof(g->model), "%s", model);
      else
        snprintf(g->model, sizeof(g->model), "NVIDIA %04x:%04x", p->vendor, p->device);
    }
    for (hwloc_obj_t c = o->io_first_child; c; c = c->next_sibling) {
      if (c->type != HWLOC_OBJ_OS_DEVICE || !c->name) continue;
      int type = c->attr->osdev.type;
      if (type != HWLOC_OBJ_OSDEV_NETWORK && type != HWLOC_OBJ_OSDEV_OPENFABRICS) continue;
      int n = mplane_topo_nic_for_pci(t, i);
      if (n < 0) break;
      struct mplane_topo_nic *nic = &t->nics[n];
      if (type == HWLOC_OBJ_OSDEV_OPENFABRICS) {
        snprintf(nic->ibdev, sizeof(nic->ibdev), "%s", c->name);
        add_ib_details(nic, c);
      } else {
        snprintf(nic->netdev, sizeof(nic->netdev), "%s", c->name);
        const char *addr = hwloc_obj_get_info_by_name(c, "Address");
        if (addr && !nic->guid) nic->guid = parse_mac(addr);
      }
    }
  }
  return ncclSuccess;
}

ncclResult_t mplane_topo_from_hwloc(struct mplane_topo *t, const char *xml_path, const char *xml_input, char *err,
                                    size_t errlen) {
  const char *what = xml_input && *xml_input ? xml_input : "topology file";
  if (xml_path) {
    FILE *f = fopen(xml_path, "r");
    if (!f) {
      snprintf(err, errlen, "%s='%s' cannot be read: %s; expected an hwloc XML file (lstopo --of xml)", what,
               xml_path, strerror(errno));
      return ncclInvalidArgument;
    }
    char head[256] = "";
    size_t got = fread(head, 1, sizeof(head) - 1, f);
    head[got] = '\0';
    fclose(f);
    if (!strstr(head, "<topology") && !strstr(head, "<?xml")) {
      snprintf(err, errlen, "%s='%s' is not an hwloc XML file (no <topology> element at its start); write one "
               "with: lstopo --of xml FILE", what, xml_path);
      return ncclInvalidArgument;
    }
  }
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) {
    snprintf(err, errlen, "hwloc_topology_init failed: %s", strerror(errno));
    return ncclSystemError;
  }
  if (xml_path) {
    if (hwloc_topology_set_xml(topo, xml_path) != 0) {
      snprintf(err, errlen, "%s='%s' is not a valid hwloc XML topology (hwloc could not parse it; "
               "HWLOC_XML_VERBOSE=1 lstopo --input '%s' says where)", what, xml_path, xml_path);
      hwloc_topology_destroy(topo);
      return ncclInvalidArgument;
    }
    hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_ALL);
  } else {
    /* GPU components would initialize CUDA or OpenCL inside NCCL's process: leave them out. The
     * libpciaccess one ("pci") leaks and loads more libraries; hwloc's Linux backend reads the same
     * PCI tree from sysfs without it (as it does where libhwloc-plugins is not installed). */
    const char *skip[] = {"cuda", "opencl", "rsmi", "levelzero", "gl", "pci"};
    for (size_t i = 0; i < sizeof(skip) / sizeof(skip[0]); i++)
      hwloc_topology_set_components(topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, skip[i]);
    hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  }
  if (hwloc_topology_load(topo) != 0) {
    if (xml_path)
      snprintf(err, errlen, "%s='%s' is not a valid hwloc XML topology (hwloc could not load it; HWLOC_XML_VERBOSE=1 "
               "lstopo --input '%s' says where)", what, xml_path, xml_path);
    else
      snprintf(err, errlen, "hwloc could not read this machine: %s", strerror(errno));
    hwloc_topology_destroy(topo);
    return xml_path ? ncclInvalidArgument : ncclSystemError;
  }
  ncclResult_t res = build(t, topo);
  hwloc_topology_destroy(topo);
  if (xml_path) {
    t->from_file = 1;
    snprintf(t->source, sizeof(t->source), "hwloc XML %s", xml_path);
  } else {
    snprintf(t->source, sizeof(t->source), "hwloc (live)");
  }
  return res;
}
