/* mplane: the node model from sysfs (when hwloc sees no PCI device), and the live details hwloc
 * does not give: link speeds and IP subnets. */
#include <arpa/inet.h>
#include <dirent.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/utsname.h>
#include <unistd.h>

#include "../common/config.h"
#include "../common/log.h"
#include "topo_internal.h"

static void join(char *out, size_t len, const char *root, const char *path) {
  size_t rl = strlen(root);
  while (rl > 0 && root[rl - 1] == '/') rl--;
  snprintf(out, len, "%.*s/%s", (int)rl, root, path[0] == '/' ? path + 1 : path);
}

static int read_line(const char *path, char *buf, size_t len) {
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  if (!fgets(buf, (int)len, f)) {
    fclose(f);
    return -1;
  }
  fclose(f);
  size_t n = strlen(buf);
  while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' ')) buf[--n] = '\0';
  return 0;
}

static long read_num(const char *path, long dflt) {
  char buf[64];
  if (read_line(path, buf, sizeof(buf)) != 0) return dflt;
  char *end;
  long v = strtol(buf, &end, 0);
  return end == buf ? dflt : v;
}

/* Add the PCI function at sysfs directory dir (real path, .../pci0000:00/0000:00:01.0/...) and
 * every bridge above it; returns its index. */
static int add_from_path(struct mplane_topo *t, const char *real) {
  char copy[PATH_MAX];
  snprintf(copy, sizeof(copy), "%s", real);
  const char *devices = strstr(copy, "/devices/");
  if (!devices) return -1;
  char hb[16] = "";
  int parent = -1, idx = -1;
  char walked[PATH_MAX];
  size_t wl = (size_t)(devices - copy) + strlen("/devices");
  memcpy(walked, copy, wl);
  walked[wl] = '\0';
  char *save = NULL;
  char rest[PATH_MAX];
  snprintf(rest, sizeof(rest), "%s", devices + strlen("/devices/"));
  for (char *comp = strtok_r(rest, "/", &save); comp; comp = strtok_r(NULL, "/", &save)) {
    size_t cl = strlen(comp);
    if (wl + 1 + cl + 1 > sizeof(walked)) break;
    walked[wl++] = '/';
    memcpy(walked + wl, comp, cl + 1);
    wl += cl;
    unsigned dom, bus;
    char busid[MPLANE_TOPO_BUSID_LEN];
    if (sscanf(comp, "pci%x:%x", &dom, &bus) == 2) {
      snprintf(hb, sizeof(hb), "%04x:%02x", dom, bus);
      continue;
    }
    if (mplane_topo_parse_busid(comp, busid, sizeof(busid)) != 0) break;
    int i = mplane_topo_find_pci(t, busid);
    if (i < 0) {
      i = mplane_topo_add_pci(t, busid);
      if (i < 0) return -1;
      struct mplane_topo_pci *p = &t->pci[i];
      char f[PATH_MAX + 32];
      snprintf(f, sizeof(f), "%s/class", walked);
      p->class_code = (uint32_t)read_num(f, 0);
      snprintf(f, sizeof(f), "%s/vendor", walked);
      p->vendor = (uint16_t)read_num(f, 0);
      snprintf(f, sizeof(f), "%s/device", walked);
      p->device = (uint16_t)read_num(f, 0);
      snprintf(f, sizeof(f), "%s/subsystem_vendor", walked);
      p->subvendor = (uint16_t)read_num(f, 0);
      snprintf(f, sizeof(f), "%s/subsystem_device", walked);
      p->subdevice = (uint16_t)read_num(f, 0);
      snprintf(f, sizeof(f), "%s/numa_node", walked);
      long numa = read_num(f, -1);
      p->numa = numa >= 0 && numa <= MPLANE_TOPO_MAX_CPU ? (int)numa : -1;
      p->is_bridge = (p->class_code >> 8) == 0x0604;
      p->parent = parent;
      if (parent < 0) p->hostbridge = mplane_topo_hostbridge(t, hb[0] ? hb : "????:??", p->numa);
      else p->hostbridge = t->pci[parent].hostbridge;
    }
    parent = i;
    idx = i;
  }
  return idx;
}

static void list_dir(const char *dir, void (*fn)(void *ctx, const char *name), void *ctx) {
  DIR *d = opendir(dir);
  if (!d) return;
  struct dirent *e;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] == '.') continue;
    fn(ctx, e->d_name);
  }
  closedir(d);
}

struct scan_ctx {
  struct mplane_topo *t;
  const char *root;
  const char *devdir;
  int pci;
};

static void add_netdev(void *vctx, const char *name) {
  struct scan_ctx *c = vctx;
  int n = mplane_topo_nic_for_pci(c->t, c->pci);
  if (n < 0 || c->t->nics[n].netdev[0]) return;
  struct mplane_topo_nic *nic = &c->t->nics[n];
  snprintf(nic->netdev, sizeof(nic->netdev), "%s", name);
  char p[PATH_MAX], rel[256], buf[128];
  snprintf(rel, sizeof(rel), "sys/class/net/%s/address", name);
  join(p, sizeof(p), c->root, rel);
  if (!nic->guid && read_line(p, buf, sizeof(buf)) == 0) {
    uint64_t m = 0;
    unsigned v;
    char *q = buf;
    while (q && sscanf(q, "%2x", &v) == 1) {
      m = (m << 8) | v; /* the last 8 bytes stay: an IPoIB address ends with the port GUID */
      q = strchr(q, ':');
      if (q) q++;
    }
    nic->guid = m;
  }
}

static void add_ibdev(void *vctx, const char *name) {
  struct scan_ctx *c = vctx;
  int n = mplane_topo_nic_for_pci(c->t, c->pci);
  if (n < 0 || c->t->nics[n].ibdev[0]) return;
  struct mplane_topo_nic *nic = &c->t->nics[n];
  snprintf(nic->ibdev, sizeof(nic->ibdev), "%s", name);
  char p[PATH_MAX], rel[256], buf[128];
  snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/node_guid", name);
  join(p, sizeof(p), c->root, rel);
  unsigned g[4];
  if (read_line(p, buf, sizeof(buf)) == 0 && sscanf(buf, "%4x:%4x:%4x:%4x", &g[0], &g[1], &g[2], &g[3]) == 4)
    nic->guid = ((uint64_t)g[0] << 48) | ((uint64_t)g[1] << 32) | ((uint64_t)g[2] << 16) | g[3];
  for (int port = 1; port <= 8; port++) {
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/%d/gids/0", name, port);
    join(p, sizeof(p), c->root, rel);
    if (read_line(p, buf, sizeof(buf)) != 0) continue;
    nic->port = port;
    char state[32];
    snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/%d/state", name, port);
    join(p, sizeof(p), c->root, rel);
    nic->down = read_line(p, state, sizeof(state)) == 0 && atoi(state) != 4; /* "4: ACTIVE" */
    if (sscanf(buf, "%4x:%4x:%4x:%4x", &g[0], &g[1], &g[2], &g[3]) == 4) {
      uint64_t prefix = ((uint64_t)g[0] << 48) | ((uint64_t)g[1] << 32) | ((uint64_t)g[2] << 16) | g[3];
      if (mplane_ib_prefix_names_subnet(prefix)) {
        char text[24];
        snprintf(text, sizeof(text), "%.19s", buf);
        mplane_topo_set_subnet(c->t, n, MPLANE_SUBNET_IB, prefix, text);
      }
    }
    break;
  }
}

static void scan_pci_device(void *vctx, const char *name) {
  struct scan_ctx *c = vctx;
  char link[PATH_MAX], real[PATH_MAX], rel[256];
  snprintf(rel, sizeof(rel), "sys/bus/pci/devices/%s", name);
  join(link, sizeof(link), c->root, rel);
  if (!realpath(link, real)) return;
  char f[PATH_MAX + 32];
  snprintf(f, sizeof(f), "%s/class", real);
  long cls = read_num(f, 0);
  snprintf(f, sizeof(f), "%s/vendor", real);
  long vendor = read_num(f, 0);
  int is_gpu = vendor == 0x10de && (cls >> 16) == 0x03;
  char netdir[PATH_MAX + 32], ibdir[PATH_MAX + 32];
  snprintf(netdir, sizeof(netdir), "%s/net", real);
  snprintf(ibdir, sizeof(ibdir), "%s/infiniband", real);
  int has_net = access(netdir, F_OK) == 0, has_ib = access(ibdir, F_OK) == 0;
  if (!is_gpu && !has_net && !has_ib) return; /* only what mplane cares about, and the bridges above it */
  int i = add_from_path(c->t, real);
  if (i < 0) return;
  struct scan_ctx sub = *c;
  sub.pci = i;
  if (has_net) list_dir(netdir, add_netdev, &sub);
  if (has_ib) list_dir(ibdir, add_ibdev, &sub);
}

/* A decimal number of at most max (no sign, no overflow): its value, the end in *end; -1 if none. */
static long bounded_num(const char *s, long max, const char **end) {
  long v = 0;
  const char *p = s;
  if (*p < '0' || *p > '9') return -1;
  for (; *p >= '0' && *p <= '9'; p++) {
    if (v > (max - (*p - '0')) / 10) return -1;
    v = v * 10 + (*p - '0');
  }
  *end = p;
  return v;
}

int mplane_topo_parse_cpulist(const char *s, int *cpus, int max) {
  int n = 0;
  if (!s || !*s) return 0;
  const char *p = s;
  for (;;) {
    const char *end;
    long a = bounded_num(p, MPLANE_TOPO_MAX_CPU, &end), b = a;
    if (a < 0) return 0;
    p = end;
    if (*p == '-') {
      b = bounded_num(p + 1, MPLANE_TOPO_MAX_CPU, &end);
      if (b < a) return 0; /* "3-1", "0-", or past the largest CPU number */
      p = end;
    }
    for (long c = a; c <= b && n < max; c++) cpus[n++] = (int)c;
    if (*p == '\0') return n;
    if (*p != ',') return 0;
    p++;
  }
}

int mplane_topo_parse_ib_rate(const char *s) {
  /* "400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)", "53.125 Gb/sec (1X HDR)": whole Gb/s, then at
   * most three digits of fraction count; anything else, or beyond MPLANE_TOPO_MAX_SPEED_MBPS, is
   * no rate this code trusts. */
  if (!s) return 0;
  const char *end;
  long whole = bounded_num(s, MPLANE_TOPO_MAX_SPEED_MBPS / 1000, &end);
  if (whole < 0) return 0;
  long mbps = whole * 1000;
  const char *p = end;
  if (*p == '.') {
    p++;
    if (*p < '0' || *p > '9') return 0;
    for (long scale = 100; *p >= '0' && *p <= '9'; p++, scale /= 10) mbps += (*p - '0') * scale;
  }
  if (*p != '\0' && *p != ' ') return 0;
  if (mbps <= 0 || mbps > MPLANE_TOPO_MAX_SPEED_MBPS) return 0;
  return (int)mbps;
}

static void scan_numa(void *vctx, const char *name) {
  struct scan_ctx *c = vctx;
  int id;
  char tail;
  if (sscanf(name, "node%d%c", &id, &tail) != 1 || c->t->nnuma >= MPLANE_TOPO_MAX_NUMA) return;
  char p[PATH_MAX], rel[128], buf[256];
  snprintf(rel, sizeof(rel), "sys/devices/system/node/%s/cpulist", name);
  join(p, sizeof(p), c->root, rel);
  struct mplane_topo_numa *d = &c->t->numa[c->t->nnuma++];
  d->os_index = id;
  if (read_line(p, buf, sizeof(buf)) == 0) {
    static int cpus[8192];
    int n = mplane_topo_parse_cpulist(buf, cpus, 8192);
    mplane_topo_cpumap(cpus, n, d->affinity, sizeof(d->affinity));
  }
}

static int cmp_numa(const void *a, const void *b) {
  return ((const struct mplane_topo_numa *)a)->os_index - ((const struct mplane_topo_numa *)b)->os_index;
}

ncclResult_t mplane_topo_from_sysfs(struct mplane_topo *t, const char *root) {
  struct scan_ctx c = {.t = t, .root = root, .pci = -1};
  char dir[PATH_MAX], buf[256];
  join(dir, sizeof(dir), root, "sys/bus/pci/devices");
  list_dir(dir, scan_pci_device, &c);
  join(dir, sizeof(dir), root, "sys/devices/system/node");
  list_dir(dir, scan_numa, &c);
  qsort(t->numa, (size_t)t->nnuma, sizeof(t->numa[0]), cmp_numa);
  join(dir, sizeof(dir), root, "sys/devices/system/cpu/online");
  if (read_line(dir, buf, sizeof(buf)) == 0) {
    static int cpus[8192];
    int n = mplane_topo_parse_cpulist(buf, cpus, 8192);
    mplane_topo_cpumap(cpus, n, t->all_cpus, sizeof(t->all_cpus));
  }
  join(dir, sizeof(dir), root, "proc/sys/kernel/hostname");
  if (read_line(dir, t->hostname, sizeof(t->hostname)) != 0) gethostname(t->hostname, sizeof(t->hostname) - 1);
  join(dir, sizeof(dir), root, "proc/cpuinfo");
  FILE *f = fopen(dir, "r");
  if (f) {
    char line[512];
    while (fgets(line, sizeof(line), f)) {
      char *colon = strchr(line, ':');
      if (!colon) continue;
      char *v = colon + 1;
      while (*v == ' ') v++;
      v[strcspn(v, "\n")] = '\0';
      if (!strncmp(line, "vendor_id", 9) && !t->cpu_vendor[0]) snprintf(t->cpu_vendor, sizeof(t->cpu_vendor), "%s", v);
      long num;
      if (!strncmp(line, "cpu family", 10) && t->cpu_family < 0 && mplane_parse_long(v, 0, 1 << 20, &num) == 0)
        t->cpu_family = (int)num;
      if (!strncmp(line, "model\t", 6) && t->cpu_model < 0 && mplane_parse_long(v, 0, 1 << 20, &num) == 0)
        t->cpu_model = (int)num;
      if (!strncmp(line, "processor", 9) && t->cpu_vendor[0] && t->cpu_family >= 0 && t->cpu_model >= 0) break;
    }
    fclose(f);
  }
  struct utsname u;
  if (uname(&u) == 0) {
    const char *a = u.machine;
    if (strcmp(a, "aarch64") == 0) a = "arm64";
    if (strncmp(a, "ppc64", 5) == 0) a = "ppc64";
    snprintf(t->cpu_arch, sizeof(t->cpu_arch), "%s", a);
  }
  int sysfs_root_is_real = strcmp(root, "/") == 0;
  snprintf(t->source, sizeof(t->source), "sysfs%s%s", sysfs_root_is_real ? "" : " under ",
           sysfs_root_is_real ? "" : root);
  return ncclSuccess;
}

/* ------------------------------------------------------------------ live details */

void mplane_topo_read_speeds(struct mplane_topo *t, const char *root) {
  for (int i = 0; i < t->nnics; i++) {
    struct mplane_topo_nic *n = &t->nics[i];
    if (n->speed_mbps > 0) continue;
    char p[PATH_MAX], rel[256], buf[128];
    if (n->ibdev[0]) {
      snprintf(rel, sizeof(rel), "sys/class/infiniband/%s/ports/%d/rate", n->ibdev, n->port > 0 ? n->port : 1);
      join(p, sizeof(p), root, rel);
      if (read_line(p, buf, sizeof(buf)) == 0) n->speed_mbps = mplane_topo_parse_ib_rate(buf);
    }
    if (n->speed_mbps <= 0 && n->netdev[0]) {
      snprintf(rel, sizeof(rel), "sys/class/net/%s/speed", n->netdev);
      join(p, sizeof(p), root, rel);
      long v = read_num(p, -1);
      if (v > 0 && v <= MPLANE_TOPO_MAX_SPEED_MBPS) n->speed_mbps = (int)v; /* -1: no link; else no speed */
    }
  }
}

void mplane_topo_read_interfaces(struct mplane_topo *t, int add_virtual) {
  struct ifaddrs *ifas = NULL;
  if (getifaddrs(&ifas) != 0) return;
  for (int family_pass = 0; family_pass < 2; family_pass++) {
    for (struct ifaddrs *a = ifas; a; a = a->ifa_next) {
      if (!a->ifa_addr || !a->ifa_netmask) continue;
      int fam = a->ifa_addr->sa_family;
      if (fam != (family_pass == 0 ? AF_INET : AF_INET6)) continue;
      if (!(a->ifa_flags & IFF_UP) || !(a->ifa_flags & IFF_RUNNING)) continue;
      int loop = (a->ifa_flags & IFF_LOOPBACK) != 0;
      int n = -1;
      for (int i = 0; i < t->nnics; i++)
        if (strcmp(t->nics[i].netdev, a->ifa_name) == 0 || strcmp(t->nics[i].name, a->ifa_name) == 0) n = i;
      if (n < 0) {
        if (!add_virtual || loop || !strncmp(a->ifa_name, "docker", 6) || !strncmp(a->ifa_name, "virbr", 5)) continue;
        n = mplane_topo_add_virtual_nic(t, a->ifa_name);
        if (n < 0) continue;
      }
      struct mplane_topo_nic *nic = &t->nics[n];
      if (nic->has_subnet) continue; /* an IB prefix, or the IPv4 subnet already */
      if (fam == AF_INET6 && IN6_IS_ADDR_LINKLOCAL(&((const struct sockaddr_in6 *)a->ifa_addr)->sin6_addr)) continue;
      struct mplane_subnet sn;
      char text[80];
      if (mplane_subnet_of_ip(a->ifa_addr, a->ifa_netmask, &sn, text, sizeof(text)) == 0)
        mplane_topo_set_subnet(t, n, sn.kind, sn.key, text);
    }
  }
  freeifaddrs(ifas);
}
