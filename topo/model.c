/* mplane: the node model: GPU/NIC pairs and link classes (see topo.h); planes are topo/planes.c's. */
#include <ctype.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "../common/log.h"
#include "topo_internal.h"

void mplane_topo_init(struct mplane_topo *t) {
  memset(t, 0, sizeof(*t));
  t->cpu_family = t->cpu_model = -1;
}

uint64_t mplane_topo_hash(const char *s) {
  uint64_t h = 1469598103934665603ULL; /* FNV-1a */
  for (; *s; s++) {
    h ^= (unsigned char)*s;
    h *= 1099511628211ULL;
  }
  return h;
}

int mplane_topo_parse_busid(const char *s, char *out, size_t len) {
  unsigned dom, bus, dev, fn;
  char tail;
  if (!s || sscanf(s, "%x:%x:%x.%x%c", &dom, &bus, &dev, &fn, &tail) != 4) return -1;
  if (dom > 0xffff || bus > 0xff || dev > 0x1f || fn > 7) return -1;
  snprintf(out, len, "%04x:%02x:%02x.%x", dom, bus, dev, fn);
  return 0;
}

int mplane_topo_name_cmp(const char *a, const char *b) {
  while (*a && *b) {
    if (isdigit((unsigned char)*a) && isdigit((unsigned char)*b)) {
      char *ea, *eb;
      unsigned long long na = strtoull(a, &ea, 10), nb = strtoull(b, &eb, 10);
      if (na != nb) return na < nb ? -1 : 1;
      a = ea;
      b = eb;
      continue;
    }
    if (*a != *b) return (unsigned char)*a < (unsigned char)*b ? -1 : 1;
    a++;
    b++;
  }
  return *a ? 1 : (*b ? -1 : 0);
}

void mplane_topo_cpumap(const int *cpus, int n, char *out, size_t len) {
  int maxcpu = -1;
  for (int i = 0; i < n; i++)
    if (cpus[i] > maxcpu) maxcpu = cpus[i];
  int words = maxcpu < 0 ? 1 : maxcpu / 32 + 1;
  size_t o = 0;
  out[0] = '\0';
  for (int w = words - 1; w >= 0; w--) {
    uint32_t m = 0;
    for (int i = 0; i < n; i++)
      if (cpus[i] >= 0 && cpus[i] / 32 == w) m |= 1u << (cpus[i] % 32);
    int k = snprintf(out + o, o < len ? len - o : 0, "%s%08x", w == words - 1 ? "" : ",", m);
    if (k < 0 || o + (size_t)k >= len) break;
    o += (size_t)k;
  }
}

int mplane_topo_add_pci(struct mplane_topo *t, const char *busid) {
  if (t->npci >= MPLANE_TOPO_MAX_PCI) return -1;
  struct mplane_topo_pci *p = &t->pci[t->npci];
  memset(p, 0, sizeof(*p));
  snprintf(p->busid, sizeof(p->busid), "%s", busid);
  p->parent = -1;
  p->hostbridge = -1;
  p->numa = -1;
  return t->npci++;
}

int mplane_topo_find_pci(const struct mplane_topo *t, const char *busid) {
  for (int i = 0; i < t->npci; i++)
    if (strcmp(t->pci[i].busid, busid) == 0) return i;
  return -1;
}

int mplane_topo_hostbridge(struct mplane_topo *t, const char *name, int numa) {
  for (int i = 0; i < t->nhostbridges; i++)
    if (strcmp(t->hostbridge_name[i], name) == 0) return i;
  if (t->nhostbridges >= MPLANE_TOPO_MAX_HOSTBRIDGES) return -1;
  int h = t->nhostbridges++;
  snprintf(t->hostbridge_name[h], sizeof(t->hostbridge_name[h]), "%s", name);
  t->hostbridge_numa[h] = numa;
  return h;
}

int mplane_topo_nic_for_pci(struct mplane_topo *t, int pci) {
  for (int i = 0; i < t->nnics; i++)
    if (t->nics[i].pci == pci) return i;
  if (t->nnics >= MPLANE_TOPO_MAX_NICS) return -1;
  struct mplane_topo_nic *n = &t->nics[t->nnics];
  memset(n, 0, sizeof(*n));
  n->pci = pci;
  n->numa = t->pci[pci].numa;
  memcpy(n->busid, t->pci[pci].busid, sizeof(n->busid));
  n->kind = MPLANE_TOPO_NIC_ETHERNET;
  n->plane = n->rail = -1;
  n->dev = -1;
  return t->nnics++;
}

int mplane_topo_add_virtual_nic(struct mplane_topo *t, const char *name) {
  if (t->nnics >= MPLANE_TOPO_MAX_NICS) return -1;
  struct mplane_topo_nic *n = &t->nics[t->nnics];
  memset(n, 0, sizeof(*n));
  snprintf(n->name, sizeof(n->name), "%s", name);
  snprintf(n->netdev, sizeof(n->netdev), "%s", name);
  n->pci = -1;
  n->numa = -1;
  n->kind = MPLANE_TOPO_NIC_VIRTUAL;
  n->guid = mplane_topo_hash(name);
  n->plane = n->rail = -1;
  n->dev = -1;
  return t->nnics++;
}

static int cmp_gpu(const void *a, const void *b) {
  return strcmp(((const struct mplane_topo_gpu *)a)->busid, ((const struct mplane_topo_gpu *)b)->busid);
}

static int cmp_nic(const void *a, const void *b) {
  const struct mplane_topo_nic *x = a, *y = b;
  if ((x->pci < 0) != (y->pci < 0)) return x->pci < 0 ? 1 : -1; /* PCI NICs first */
  if (x->pci >= 0) return strcmp(x->busid, y->busid);
  return mplane_topo_name_cmp(x->name, y->name);
}

void mplane_topo_sort_nics(struct mplane_topo *t) { qsort(t->nics, (size_t)t->nnics, sizeof(t->nics[0]), cmp_nic); }

static int is_nvidia_gpu(const struct mplane_topo_pci *p) {
  /* Display (0x0300) or 3D controller (0x0302) from NVIDIA; NVSwitches are bridges (0x0680). */
  return p->vendor == 0x10de && (p->class_code >> 16) == 0x03;
}

void mplane_topo_finish(struct mplane_topo *t) {
  if (t->ngpus == 0) {
    for (int i = 0; i < t->npci && t->ngpus < MPLANE_TOPO_MAX_GPUS; i++) {
      if (!is_nvidia_gpu(&t->pci[i])) continue;
      struct mplane_topo_gpu *g = &t->gpus[t->ngpus++];
      memset(g, 0, sizeof(*g));
      g->pci = i;
      snprintf(g->busid, sizeof(g->busid), "%s", t->pci[i].busid);
      g->numa = t->pci[i].numa;
      snprintf(g->model, sizeof(g->model), "NVIDIA %04x:%04x", t->pci[i].vendor, t->pci[i].device);
    }
  }
  qsort(t->gpus, (size_t)t->ngpus, sizeof(t->gpus[0]), cmp_gpu);
  for (int i = 0; i < t->ngpus; i++) {
    t->gpus[i].index = i;
    t->gpus[i].cuda_dev = i;
    t->gpus[i].nic = -1;
    t->gpus[i].link = MPLANE_TOPO_LINK_SYS;
  }
  for (int i = 0; i < t->nnics; i++) {
    struct mplane_topo_nic *n = &t->nics[i];
    if (!n->name[0]) snprintf(n->name, sizeof(n->name), "%s", n->ibdev[0] ? n->ibdev : n->netdev);
    if (n->ibdev[0]) n->kind = MPLANE_TOPO_NIC_RDMA;
    if (n->ibdev[0] && n->port == 0) n->port = 1;
    if (n->guid == 0) n->guid = mplane_topo_hash(n->busid[0] ? n->busid : n->name);
    n->plane = n->rail = -1;
    n->dev = -1;
  }
  mplane_topo_sort_nics(t);
}

/* ------------------------------------------------------------------ link classes */

int mplane_topo_nccl_parents(const struct mplane_topo *t, int pci, int *out, int max) {
  int n = 0;
  if (pci < 0 || pci >= t->npci) return 0;
  int b = t->pci[pci].parent; /* the port the device hangs off: NCCL skips it */
  /* The builders keep parents acyclic; the walk is bounded all the same (a tree has no path
   * longer than npci), so a malformed model cannot turn it into an endless loop. */
  for (int steps = 0; b >= 0 && b < t->npci && steps < t->npci; steps += 2) {
    int up = t->pci[b].parent; /* the switch's upstream port: NCCL keeps it */
    if (up < 0 || up >= t->npci) break;
    if (n < max) out[n++] = up;
    b = t->pci[up].parent;
  }
  return n;
}

int mplane_topo_pci_would_cycle(const struct mplane_topo *t, int child, int parent) {
  for (int b = parent, steps = 0; b >= 0 && b < t->npci; b = t->pci[b].parent, steps++)
    if (b == child || steps > t->npci) return 1;
  return 0;
}

enum mplane_topo_link mplane_topo_pci_link(const struct mplane_topo *t, int a, int b) {
  if (a < 0 || b < 0 || a >= t->npci || b >= t->npci) return MPLANE_TOPO_LINK_SYS;
  int sa[32], sb[32];
  int na = mplane_topo_nccl_parents(t, a, sa, 32), nb = mplane_topo_nccl_parents(t, b, sb, 32);
  for (int i = 0; i < na; i++)
    for (int j = 0; j < nb; j++)
      if (sa[i] == sb[j]) return i + j == 0 ? MPLANE_TOPO_LINK_PIX : MPLANE_TOPO_LINK_PXB;
  const struct mplane_topo_pci *pa = &t->pci[a], *pb = &t->pci[b];
  if (pa->hostbridge >= 0 && pa->hostbridge == pb->hostbridge) return MPLANE_TOPO_LINK_PHB;
  if (pa->numa == pb->numa) return MPLANE_TOPO_LINK_NODE; /* both -1: one unknown domain */
  return MPLANE_TOPO_LINK_SYS;
}

enum mplane_topo_link mplane_topo_gpu_nic_link(const struct mplane_topo *t, int g, int n) {
  if (g < 0 || g >= t->ngpus || n < 0 || n >= t->nnics) return MPLANE_TOPO_LINK_SYS;
  return mplane_topo_pci_link(t, t->gpus[g].pci, t->nics[n].pci);
}

int mplane_topo_gpu_nic_pair(const struct mplane_topo *t, int g, enum mplane_topo_link *link) {
  if (g < 0 || g >= t->ngpus) return -1;
  if (link) *link = t->gpus[g].link;
  return t->gpus[g].nic;
}

const char *mplane_topo_link_name(enum mplane_topo_link link) {
  static const char *names[] = {"PIX", "PXB", "PHB", "NODE", "SYS"};
  return (unsigned)link < 5 ? names[link] : "?";
}

const char *mplane_topo_plane_source_name(enum mplane_topo_plane_source src) {
  switch (src) {
    case MPLANE_TOPO_PLANE_CONFIG: return "MPLANE_PLANES";
    case MPLANE_TOPO_PLANE_FABRIC: return "fabric";
    case MPLANE_TOPO_PLANE_PCI: return "PCI order";
    default: return "none";
  }
}

const char *mplane_topo_nic_kind_name(enum mplane_topo_nic_kind kind) {
  switch (kind) {
    case MPLANE_TOPO_NIC_RDMA: return "rdma";
    case MPLANE_TOPO_NIC_ETHERNET: return "ethernet";
    default: return "virtual";
  }
}

int mplane_topo_find_nic(const struct mplane_topo *t, const char *name) {
  if (!name || !*name) return -1;
  for (int pass = 0; pass < 2; pass++) {
    char key[96];
    snprintf(key, sizeof(key), "%s", name);
    if (pass == 1) {
      /* "mlx5_0:1" is port 1 of mlx5_0. */
      char *colon = strrchr(key, ':');
      if (!colon || colon[1] == '\0') break;
      for (char *c = colon + 1; *c; c++)
        if (!isdigit((unsigned char)*c)) return -1;
      *colon = '\0';
    }
    for (int i = 0; i < t->nnics; i++) {
      const struct mplane_topo_nic *n = &t->nics[i];
      if (strcmp(n->name, key) == 0 || (n->ibdev[0] && strcmp(n->ibdev, key) == 0) ||
          (n->netdev[0] && strcmp(n->netdev, key) == 0))
        return i;
    }
  }
  return -1;
}

/* ------------------------------------------------------------------ pairing */

/* NICs without a PCI device (veth, bond, lo) have no locality: GPUs pair with them only on a node
 * whose every candidate NIC is one (the emulated fabric on a GPU machine). */
int mplane_topo_have_pci_candidates(const struct mplane_topo *t) {
  for (int n = 0; n < t->nnics; n++)
    if (!t->nics[n].excluded && t->nics[n].pci >= 0) return 1;
  return 0;
}

void mplane_topo_pair_gpus(struct mplane_topo *t) {
  int pci_only = mplane_topo_have_pci_candidates(t);
  for (int n = 0; n < t->nnics; n++) t->nics[n].ngpus = 0;
  for (int g = 0; g < t->ngpus; g++) {
    int best = -1;
    enum mplane_topo_link best_link = MPLANE_TOPO_LINK_SYS;
    for (int n = 0; n < t->nnics; n++) {
      if (t->nics[n].excluded || (pci_only && t->nics[n].pci < 0)) continue;
      enum mplane_topo_link l = mplane_topo_gpu_nic_link(t, g, n);
      /* Nearest first; among equals the NIC with fewer GPUs, then PCI order (the array order). */
      if (best < 0 || l < best_link || (l == best_link && t->nics[n].ngpus < t->nics[best].ngpus)) {
        best = n;
        best_link = l;
      }
    }
    t->gpus[g].nic = best;
    t->gpus[g].link = best < 0 ? MPLANE_TOPO_LINK_SYS : best_link;
    if (best >= 0) t->nics[best].ngpus++;
  }
}

/* ------------------------------------------------------------------ CUDA_VISIBLE_DEVICES */

void mplane_topo_apply_cuda_visible(struct mplane_topo *t, const char *spec) {
  t->cuda_visible_set = spec != NULL;
  snprintf(t->cuda_visible, sizeof(t->cuda_visible), "%s", spec ? spec : "");
  for (int g = 0; g < t->ngpus; g++) t->gpus[g].cuda_dev = spec ? -1 : g;
  if (!spec) return;
  int next = 0;
  const char *p = spec;
  while (*p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    char tok[128];
    if (len >= sizeof(tok)) break;
    memcpy(tok, p, len);
    tok[len] = '\0';
    char *s = tok;
    while (isspace((unsigned char)*s)) s++;
    char *e = s + strlen(s);
    while (e > s && isspace((unsigned char)e[-1])) *--e = '\0';
    int found = -1;
    if (isdigit((unsigned char)*s)) {
      char *end;
      long v = strtol(s, &end, 10);
      if (*end == '\0' && v >= 0 && v < t->ngpus) found = (int)v;
    } else if (strncmp(s, "GPU-", 4) == 0 || strncmp(s, "MIG-", 4) == 0) {
      int have_uuids = 0;
      for (int g = 0; g < t->ngpus; g++) have_uuids |= t->gpus[g].uuid[0] != '\0';
      if (!have_uuids || strncmp(s, "MIG-", 4) == 0) {
        /* Only NVML knows which GPU that is: say so rather than guess. */
        for (int g = 0; g < t->ngpus; g++) t->gpus[g].cuda_dev = -2;
        return;
      }
      for (int g = 0; g < t->ngpus; g++) {
        if (t->gpus[g].uuid[0] && strncmp(t->gpus[g].uuid, s, strlen(s)) == 0) {
          found = g;
          break;
        }
      }
    }
    if (found < 0 || t->gpus[found].cuda_dev >= 0) break; /* CUDA stops at the first bad entry */
    t->gpus[found].cuda_dev = next++;
    if (!comma) break;
    p = comma + 1;
  }
}

void mplane_topo_free(struct mplane_topo *t) { free(t); }
