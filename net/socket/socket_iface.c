/* mplane: which interfaces the socket transport uses, and what they really are (sysfs). */
#include <arpa/inet.h>
#include <ifaddrs.h>
#include <limits.h>
#include <linux/ethtool.h>
#include <linux/sockios.h>
#include <sched.h>
#include <net/if.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "../../common/log.h"
#include "socket.h"

static struct mps_dev devs[MPS_MAX_DEVS];
static int ndevs;

int mps_dev_count(void) { return ndevs; }
const struct mps_dev *mps_dev_get(int dev) { return (dev >= 0 && dev < ndevs) ? &devs[dev] : NULL; }

void mps_addr_str(const struct sockaddr *sa, char *buf, size_t len) {
  char host[INET6_ADDRSTRLEN] = "?";
  int port = 0;
  if (sa->sa_family == AF_INET) {
    const struct sockaddr_in *s = (const struct sockaddr_in *)sa;
    inet_ntop(AF_INET, &s->sin_addr, host, sizeof(host));
    port = ntohs(s->sin_port);
    snprintf(buf, len, "%s:%d", host, port);
  } else if (sa->sa_family == AF_INET6) {
    const struct sockaddr_in6 *s = (const struct sockaddr_in6 *)sa;
    inet_ntop(AF_INET6, &s->sin6_addr, host, sizeof(host));
    port = ntohs(s->sin6_port);
    snprintf(buf, len, "[%s]:%d", host, port);
  } else {
    snprintf(buf, len, "(family %d)", sa->sa_family);
  }
}

/* One comma-separated token of NCCL_SOCKET_IFNAME: "=eth0" (or any token of an exact list) exact,
 * "eth" prefix. */
static int token_matches(const char *tok, size_t toklen, const char *ifname, int exact) {
  if (toklen > 0 && tok[0] == '=') {
    tok++;
    toklen--;
    exact = 1;
  }
  if (exact) return strlen(ifname) == toklen && strncmp(ifname, tok, toklen) == 0;
  return toklen > 0 && strncmp(ifname, tok, toklen) == 0;
}

/* As in NCCL, a leading '=' makes the whole list exact: "=eth0,eth1" selects eth0 and eth1 only. */
static int list_matches(const char *list, const char *ifname) {
  int exact = list[0] == '=';
  const char *p = list + exact;
  while (*p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    if (len > 0 && token_matches(p, len, ifname, exact)) return 1;
    if (!comma) break;
    p = comma + 1;
  }
  return 0;
}

int mps_iface_match(const char *spec, const char *ifname, int is_loopback) {
  if (spec == NULL || *spec == '\0') {
    /* Automatic: every real interface; never loopback or container bridges. */
    if (is_loopback) return 0;
    return strncmp(ifname, "docker", 6) != 0 && strncmp(ifname, "virbr", 5) != 0;
  }
  if (spec[0] == '^') {
    /* Exclusion list: everything else, loopback still only when named. */
    return !is_loopback && !list_matches(spec + 1, ifname);
  }
  return list_matches(spec, ifname);
}

static int read_sysfs_int(const char *ifname, const char *leaf, int dflt) {
  char path[256];
  snprintf(path, sizeof(path), "/sys/class/net/%s/%s", ifname, leaf);
  FILE *f = fopen(path, "r");
  if (!f) return dflt;
  int v = dflt;
  if (fscanf(f, "%d", &v) != 1) v = dflt;
  fclose(f);
  return v;
}

int mps_usable_cpus(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) != 0) return 1;
  return CPU_COUNT(&set);
}

int mps_host_link_mbps(int ncpus) {
  long r = (long)MPS_HOST_LINK_MBPS_PER_CPU * (ncpus > 0 ? ncpus : 1);
  return r > MPS_HOST_LINK_MBPS_MAX ? MPS_HOST_LINK_MBPS_MAX : (int)r;
}

/* veth (by its driver's name, ETHTOOL_GDRVINFO): a software link, bytes copied between two
 * namespaces by the host like loopback's; its reported 10000 Mb/s is a constant of the driver. */
static int is_veth(const char *ifname) {
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct ethtool_drvinfo info = {.cmd = ETHTOOL_GDRVINFO};
  struct ifreq ifr;
  memset(&ifr, 0, sizeof(ifr));
  snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
  ifr.ifr_data = (char *)&info;
  int veth = ioctl(fd, SIOCETHTOOL, &ifr) == 0 && strcmp(info.driver, "veth") == 0;
  close(fd);
  return veth;
}

/* The MTU by ioctl: sysfs shows the namespace it was mounted in, not necessarily this one. */
static int iface_mtu(const char *ifname) {
  int fd = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return 0;
  struct ifreq ifr;
  memset(&ifr, 0, sizeof(ifr));
  snprintf(ifr.ifr_name, sizeof(ifr.ifr_name), "%s", ifname);
  int mtu = ioctl(fd, SIOCGIFMTU, &ifr) == 0 ? ifr.ifr_mtu : 0;
  close(fd);
  return mtu;
}

static int all_fast; /* every device found is at MPS_FAST_LINK_MBPS or more */

int mps_fast_links(void) { return all_fast; }

/* The rate of a link its driver does not measure: MPLANE_SOCKET_SPEED where set; a host-copied
 * link the host's (it has no wire: telling NCCL 10 Gb/s makes it build too few channels to keep a
 * 16-core host busy, where loopback TCP moved 290 Gb/s on 8 streams); any other 10000, NCCL's guess. */
static int unknown_speed(const struct mplane_config *cfg, int host_copied, int ncpus) {
  if (cfg->socket_speed_mbps > 0) return cfg->socket_speed_mbps;
  return host_copied ? mps_host_link_mbps(ncpus) : 10000;
}

static void fill_props(struct mps_dev *d, int index, int host_copied, int speed_if_unknown) {
  struct mplane_dev_props *p = &d->props;
  memset(p, 0, sizeof(*p));
  snprintf(p->name, sizeof(p->name), "%s", d->ifname);
  char link[256], real[PATH_MAX];
  snprintf(link, sizeof(link), "/sys/class/net/%s/device", d->ifname);
  if (realpath(link, real) != NULL) snprintf(p->pci_path, sizeof(p->pci_path), "%s", real);
  /* Virtual interfaces (virtio, lo) report -1 or nothing, veth a constant: speed_if_unknown. */
  int speed = host_copied ? -1 : read_sysfs_int(d->ifname, "speed", -1);
  p->speed_mbps = speed > 0 ? speed : speed_if_unknown;
  /* The guid tells NCCL which devices share a physical NIC: the PCI function's path, else the MAC. */
  char mac[64] = "";
  snprintf(link, sizeof(link), "/sys/class/net/%s/address", d->ifname);
  FILE *f = fopen(link, "r");
  if (f) {
    if (fgets(mac, sizeof(mac), f) == NULL) mac[0] = 0;
    fclose(f);
  }
  const char *key = p->pci_path[0] ? p->pci_path : (mac[0] ? mac : d->ifname);
  p->guid = mplane_hash64(key, strlen(key), 7);
  p->ptr_support = NCCL_PTR_HOST;
  p->reg_is_global = 0;
  p->force_flush = 0;
  p->port = 0;
  p->latency_us = 0;
  p->max_comms = 65536;
  p->max_recvs = MPS_MAX_RECVS;
  p->max_p2p_bytes = 1UL << 40; /* NCCL's own socket limit: 1 TB */
  p->max_coll_bytes = 1UL << 40;
  p->plane = index; /* discovery order; topo/ decides from the interfaces' subnets (topo/planes.c) */
  p->rail = 0;
}

ncclResult_t mps_iface_discover(const struct mplane_config *cfg) {
  struct ifaddrs *ifas = NULL;
  if (getifaddrs(&ifas) != 0) {
    MP_WARN("socket: getifaddrs failed: %m");
    return ncclSystemError;
  }
  ndevs = 0;
  all_fast = 1;
  int ncpus = mps_usable_cpus();
  /* IPv4 first, then IPv6, one device per interface: the order is stable across ranks. */
  for (int pass = 0; pass < 2; pass++) {
    int family = pass == 0 ? AF_INET : AF_INET6;
    for (struct ifaddrs *a = ifas; a && ndevs < MPS_MAX_DEVS; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != family) continue;
      if (!(a->ifa_flags & IFF_UP) || !(a->ifa_flags & IFF_RUNNING)) continue;
      int loop = (a->ifa_flags & IFF_LOOPBACK) != 0;
      if (!mps_iface_match(cfg->socket_ifname, a->ifa_name, loop)) continue;
      if (family == AF_INET6) {
        const struct sockaddr_in6 *s6 = (const struct sockaddr_in6 *)a->ifa_addr;
        if (IN6_IS_ADDR_LINKLOCAL(&s6->sin6_addr)) continue; /* needs a scope id peers cannot use */
      }
      int dup = 0;
      for (int i = 0; i < ndevs; i++) dup |= strcmp(devs[i].ifname, a->ifa_name) == 0;
      if (dup) continue;
      struct mps_dev *d = &devs[ndevs];
      memset(d, 0, sizeof(*d));
      snprintf(d->ifname, sizeof(d->ifname), "%s", a->ifa_name);
      d->addrlen = family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
      memcpy(&d->addr, a->ifa_addr, d->addrlen);
      int host = loop || is_veth(a->ifa_name);
      fill_props(d, ndevs, host, unknown_speed(cfg, host, ncpus));
      if (d->props.speed_mbps < MPS_FAST_LINK_MBPS) all_fast = 0;
      MP_INFO(NCCL_INIT | NCCL_NET, "socket: %s: %s link at %d Mb/s, MTU %d, %d CPUs usable", d->ifname,
              host ? "host-copied" : "NIC", d->props.speed_mbps,
              iface_mtu(d->ifname), ncpus);
      ndevs++;
    }
  }
  freeifaddrs(ifas);
  if (ndevs == 0) {
    all_fast = 0;
    MP_WARN("socket: no interface matches MPLANE_SOCKET_IFNAME='%s' (loopback is used only when named, "
            "e.g. MPLANE_SOCKET_IFNAME=lo)", cfg->socket_ifname);
    return ncclSystemError;
  }
  return ncclSuccess;
}
