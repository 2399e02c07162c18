/* mplane: IB/RoCE device discovery, GID choice, properties, and the async-event threads. */
#include <arpa/inet.h>
#include <errno.h>
#include <ifaddrs.h>
#include <limits.h>
#include <net/if.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../../common/clock.h"
#include "../../common/log.h"
#include "ib.h"

static struct {
  const struct mplane_config *cfg;
  int nhca, ndev;
  struct mpib_hca hcas[MPIB_MAX_DEVS];
  struct mpib_dev devs[MPIB_MAX_DEVS];
  int stop;
  pthread_mutex_t reg_lock;
  struct mpib_comm_base *live;
} g = {.reg_lock = PTHREAD_MUTEX_INITIALIZER};

int mpib_dev_count(void) { return g.ndev; }
struct mpib_dev *mpib_dev_get(int dev) { return dev >= 0 && dev < g.ndev ? &g.devs[dev] : NULL; }
const struct mplane_config *mpib_config(void) { return g.cfg; }

/* ------------------------------------------------------------------ NCCL_IB_HCA grammar */
/* "[^][=]name[:port][,name[:port]...]": names are prefixes unless '=' asks for exact names; '^'
 * selects everything the list does not name. An empty spec selects everything. */
int mpib_hca_match(const char *spec, const char *name, int port) {
  if (!spec || !*spec) return 1;
  int exclude = 0, exact = 0;
  if (*spec == '^') {
    exclude = 1;
    spec++;
  }
  if (*spec == '=') {
    exact = 1;
    spec++;
  }
  int hit = 0;
  const char *p = spec;
  while (*p && !hit) {
    const char *end = strchr(p, ',');
    if (!end) end = p + strlen(p);
    const char *colon = memchr(p, ':', (size_t)(end - p));
    size_t nlen = (size_t)((colon ? colon : end) - p);
    int eport = -1;
    if (colon) eport = atoi(colon + 1);
    if (nlen > 0) {
      int name_ok = exact ? (strlen(name) == nlen && strncmp(name, p, nlen) == 0) : strncmp(name, p, nlen) == 0;
      if (name_ok && (eport < 0 || port < 0 || eport == port)) hit = 1;
    }
    p = *end ? end + 1 : end;
  }
  return exclude ? !hit : hit;
}

/* ------------------------------------------------------------------ GIDs */
static int gid_is_zero(const union ibv_gid *g) {
  for (int i = 0; i < 16; i++)
    if (g->raw[i]) return 0;
  return 1;
}
static int gid_is_v4mapped(const union ibv_gid *g) {
  for (int i = 0; i < 10; i++)
    if (g->raw[i]) return 0;
  return g->raw[10] == 0xff && g->raw[11] == 0xff;
}
static int gid_is_linklocal(const union ibv_gid *g) { return g->raw[0] == 0xfe && (g->raw[1] & 0xc0) == 0x80; }

int mpib_gid_wanted(const union ibv_gid *g, int v2, const struct mpib_gid_want *w) {
  if (!w) return 1;
  if (w->version && w->version != (v2 ? 2 : 1)) return 0;
  int v4 = gid_is_v4mapped(g);
  if ((w->family == MPLANE_IB_FAMILY_INET && !v4) || (w->family == MPLANE_IB_FAMILY_INET6 && v4)) return 0;
  if (!w->has_range) return 1;
  if (w->range.v6 == v4) return 0; /* the range is of the other family */
  const unsigned char *a = v4 ? g->raw + 12 : g->raw;
  for (int bit = 0; bit < w->range.bits; bit++) {
    int mask = 0x80 >> (bit % 8);
    if ((a[bit / 8] & mask) != (w->range.addr[bit / 8] & mask)) return 0;
  }
  return 1;
}

int mpib_pick_gid(int n, const union ibv_gid *gids, const int *types, const int *valid) {
  return mpib_pick_gid_want(n, gids, types, valid, NULL);
}

int mpib_pick_gid_want(int n, const union ibv_gid *gids, const int *types, const int *valid,
                       const struct mpib_gid_want *want) {
  int best = -1, best_score = -1;
  for (int i = 0; i < n; i++) {
    if (!valid[i] || gid_is_zero(&gids[i]) || !mpib_gid_wanted(&gids[i], types[i] == 1, want)) continue;
    int score = 0; /* RoCE v1 */
    if (types[i] == 1) score = gid_is_v4mapped(&gids[i]) ? 3 : gid_is_linklocal(&gids[i]) ? 1 : 2;
    if (score > best_score) {
      best = i;
      best_score = score;
    }
  }
  return best;
}

/* 1 = RoCE v2, 0 = v1/IB, -1 = empty entry. */
static int gid_type(struct mpib_hca *h, int port, int index, union ibv_gid *gid) {
  if (mpib_v.query_gid_ex) {
    struct ibv_gid_entry e;
    int rc = mpib_v.query_gid_ex(h->ctx, (uint32_t)port, (uint32_t)index, &e, 0, sizeof(e));
    if (rc == 0) {
      *gid = e.gid;
      return e.gid_type == IBV_GID_TYPE_ROCE_V2 ? 1 : 0;
    }
    if (rc == ENODATA) return -1;
  }
  if (mpib_v.query_gid(h->ctx, (uint8_t)port, index, gid) != 0) return -1;
  char path[PATH_MAX], buf[64] = "";
  snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gid_attrs/types/%d", h->name, port, index);
  FILE *f = fopen(path, "r");
  if (f) {
    if (!fgets(buf, sizeof(buf), f)) buf[0] = 0;
    fclose(f);
  }
  return strstr(buf, "v2") ? 1 : 0;
}

/* ------------------------------------------------------------------ GIDs */
/* What MPLANE_IB_ROCE_VERSION_NUM / _ADDR_FAMILY / _ADDR_RANGE ask of a RoCE GID; 0 when nothing. */
static int gid_want_of(const struct mplane_config *cfg, struct mpib_gid_want *w) {
  memset(w, 0, sizeof(*w));
  w->version = cfg->ib_roce_version;
  w->family = cfg->ib_addr_family;
  char why[160];
  /* the config checked the grammar at load */
  w->has_range = cfg->ib_addr_range[0] && mplane_cidr_parse(cfg->ib_addr_range, &w->range, why, sizeof(why)) == 0;
  return w->version || w->family || w->has_range;
}

/* The GID a connection of d uses, read from the port's table now: on RoCE the table follows the
 * interface's addresses, so an index chosen at init may name another address (or none) later, and
 * NCCL's net_ib looks it up at each connection too. IB: index 0. 0 on success, else why. */
int mpib_dev_resolve_gid(const struct mpib_dev *d, int *index, union ibv_gid *gid, char *why, size_t whylen) {
  struct mpib_hca *h = d->hca;
  if (d->link_layer != IBV_LINK_LAYER_ETHERNET) {
    *index = 0;
    if (mpib_v.query_gid(h->ctx, (uint8_t)d->port, 0, gid) == 0) return 0;
    snprintf(why, whylen, "cannot read GID 0");
    return -1;
  }
  struct mpib_port_attr pa;
  if (mpib_query_port(h->ctx, d->port, &pa) != 0) {
    snprintf(why, whylen, "cannot query the port");
    return -1;
  }
  int tbl = pa.a.gid_tbl_len > 256 ? 256 : pa.a.gid_tbl_len;
  union ibv_gid gids[256];
  int types[256], valid[256];
  for (int i = 0; i < tbl; i++) {
    types[i] = gid_type(h, d->port, i, &gids[i]);
    valid[i] = types[i] >= 0;
    if (types[i] < 0) types[i] = 0;
  }
  const struct mplane_config *cfg = mpib_config();
  int idx = cfg->ib_gid_index;
  struct mpib_gid_want want;
  int wanted = gid_want_of(cfg, &want);
  if (idx >= 0) {
    if (idx >= tbl || !valid[idx] || gid_is_zero(&gids[idx])) {
      snprintf(why, whylen, "MPLANE_IB_GID_INDEX=%d names no GID (table of %d); expected an index listed by "
               "'show_gids'", idx, tbl);
      return -1;
    }
  } else if ((idx = mpib_pick_gid_want(tbl, gids, types, valid, wanted ? &want : NULL)) < 0) {
    if (wanted)
      snprintf(why, whylen, "no RoCE GID matches MPLANE_IB_ROCE_VERSION_NUM=%d, MPLANE_IB_ADDR_FAMILY=%s, "
               "MPLANE_IB_ADDR_RANGE='%s' (or their NCCL_IB_* twins); 'show_gids' lists the port's GIDs",
               cfg->ib_roce_version, cfg->ib_addr_family == MPLANE_IB_FAMILY_INET ? "AF_INET"
                                     : cfg->ib_addr_family == MPLANE_IB_FAMILY_INET6 ? "AF_INET6" : "any",
               cfg->ib_addr_range);
    else snprintf(why, whylen, "no usable RoCE GID (is an IP address configured on its interface?)");
    return -1;
  }
  *index = idx;
  *gid = gids[idx];
  return 0;
}

/* ------------------------------------------------------------------ side-channel address */
int mpib_oob_rank(const char *ifname, int loopback) {
  if (loopback || !strncmp(ifname, "docker", 6)) return -1; /* as NCCL's default ^docker,lo */
  return !strncmp(ifname, "ib", 2) ? 0 : 1;              /* IPoIB first, as NCCL */
}

int mpib_oob_family_rank(const struct sockaddr *sa, int family) {
  if (family == MPLANE_IB_FAMILY_INET && sa->sa_family != AF_INET) return -1;
  if (family == MPLANE_IB_FAMILY_INET6 && sa->sa_family != AF_INET6) return -1;
  if (sa->sa_family == AF_INET) return 0;
  if (sa->sa_family != AF_INET6) return -1;
  /* a link-local address is reachable only with the scope (interface index) of the host that
   * dials, which the handle cannot carry: never */
  const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
  return IN6_IS_ADDR_LINKLOCAL(a) ? -1 : 1;
}

/* Which interfaces an address search takes: those MPLANE_SOCKET_IFNAME's grammar names, one by its
 * exact name, or every one by mpib_oob_rank. */
enum oob_scope { OOB_SPEC, OOB_EXACT, OOB_BEST };

/* The best address on the interfaces of scope (name: the spec or the exact name): interfaces by
 * their rank, then IPv4 before IPv6. 1 and the address and its interface, or 0. */
static int oob_find(enum oob_scope scope, const char *name, int family, struct mpib_dev *d, char *ifname,
                    size_t iflen) {
  struct ifaddrs *ifas = NULL;
  int best = -1;
  if (getifaddrs(&ifas) != 0) return 0;
  for (struct ifaddrs *ifa = ifas; ifa; ifa = ifa->ifa_next) {
    if (!ifa->ifa_addr || !(ifa->ifa_flags & IFF_UP)) continue;
    int fam = mpib_oob_family_rank(ifa->ifa_addr, family);
    int rank = scope == OOB_SPEC    ? (mpib_hca_match(name, ifa->ifa_name, -1) ? 0 : -1)
               : scope == OOB_EXACT ? (strcmp(ifa->ifa_name, name) == 0 ? 0 : -1)
                                    : mpib_oob_rank(ifa->ifa_name, (ifa->ifa_flags & IFF_LOOPBACK) != 0);
    if (fam < 0 || rank < 0) continue;
    int score = rank * 2 + fam;
    if (best >= 0 && score >= best) continue;
    socklen_t len = ifa->ifa_addr->sa_family == AF_INET ? sizeof(struct sockaddr_in) : sizeof(struct sockaddr_in6);
    memset(&d->oob, 0, sizeof(d->oob));
    memcpy(&d->oob, ifa->ifa_addr, len);
    d->ooblen = len;
    snprintf(ifname, iflen, "%s", ifa->ifa_name);
    best = score;
  }
  freeifaddrs(ifas);
  return best >= 0;
}

static const char *family_name(int family) {
  return family == MPLANE_IB_FAMILY_INET ? "AF_INET" : family == MPLANE_IB_FAMILY_INET6 ? "AF_INET6" : "any";
}

/* The loopback address of the family (IPv4 unless only IPv6 is allowed). */
static void oob_loopback(struct mpib_dev *d, int family) {
  memset(&d->oob, 0, sizeof(d->oob));
  if (family == MPLANE_IB_FAMILY_INET6) {
    struct sockaddr_in6 *sin6 = (struct sockaddr_in6 *)&d->oob;
    sin6->sin6_family = AF_INET6;
    sin6->sin6_addr = in6addr_loopback;
    d->ooblen = sizeof(*sin6);
  } else {
    struct sockaddr_in *sin = (struct sockaddr_in *)&d->oob;
    sin->sin_family = AF_INET;
    sin->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    d->ooblen = sizeof(*sin);
  }
}

/* The port's own netdev (IPoIB / RoCE), from sysfs; "" when unknown. */
static void port_netdev(const struct mpib_dev *d, char *ifname, size_t len) {
  char path[PATH_MAX];
  ifname[0] = 0;
  snprintf(path, sizeof(path), "/sys/class/infiniband/%s/ports/%d/gid_attrs/ndevs/%d", d->hca->name, d->port,
           d->gid_index);
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(ifname, (int)len, f)) ifname[strcspn(ifname, "\n")] = 0;
  else ifname[0] = 0;
  fclose(f);
}

/* The interfaces a site named for the side channel, as NCCL's out-of-band takes NCCL_SOCKET_IFNAME:
 * MPLANE_IB_SOCKET_IFNAME (NCCL_SOCKET_IFNAME its twin), else MPLANE_SOCKET_IFNAME; "" none. */
static const char *oob_spec(const struct mplane_config *cfg, const char **var) {
  if (cfg->ib_socket_ifname[0]) {
    const char *src = mplane_config_source("MPLANE_IB_SOCKET_IFNAME");
    *var = src ? src : "MPLANE_IB_SOCKET_IFNAME";
    return cfg->ib_socket_ifname;
  }
  *var = "MPLANE_SOCKET_IFNAME";
  return cfg->socket_ifname;
}

/* The interfaces MPLANE_IB_SOCKET_IFNAME / NCCL_SOCKET_IFNAME (else MPLANE_SOCKET_IFNAME) name when
 * set, as NCCL's out-of-band; else the port's own netdev (IPoIB / RoCE); else the first up ib*
 * interface, else any other but docker* and lo; else loopback (peers on this host only). IPv4 or
 * IPv6 (MPLANE_IB_SOCKET_FAMILY); INFO says which and why. */
static void pick_oob(const struct mplane_config *cfg, struct mpib_dev *d) {
  int family = cfg->ib_socket_family;
  char ifname[IF_NAMESIZE + 2] = "", netdev[IF_NAMESIZE + 2], named[96];
  const char *why, *var = NULL, *spec = oob_spec(cfg, &var);
  port_netdev(d, netdev, sizeof(netdev));
  snprintf(named, sizeof(named), "%s names it", var);
  int by_spec = spec[0] && oob_find(OOB_SPEC, spec, family, d, ifname, sizeof(ifname));
  if (spec[0] && !by_spec)
    MP_WARN("NET/IB: %s: %s='%s' names no up interface with an address (%s); the side channel chooses as if it "
            "were unset", d->props.name, var, spec, family_name(family));
  if (by_spec)
    why = named;
  else if (netdev[0] && oob_find(OOB_EXACT, netdev, family, d, ifname, sizeof(ifname)))
    why = "the port's own interface";
  else if (oob_find(OOB_BEST, NULL, family, d, ifname, sizeof(ifname)))
    why = "the first usable interface, IPoIB (ib*) first, docker* and lo never";
  else {
    oob_loopback(d, family);
    snprintf(ifname, sizeof(ifname), "lo");
    why = "no usable interface: loopback, so only peers on this host can connect";
  }
  char where[INET6_ADDRSTRLEN + 16];
  mpib_oob_str(d, where, sizeof(where));
  MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s side channel on %s %s (%s; MPLANE_IB_SOCKET_FAMILY=%s)", d->props.name,
          ifname, where, why, family_name(family));
}

void mpib_oob_str(const struct mpib_dev *d, char *buf, size_t len) {
  char ip[INET6_ADDRSTRLEN] = "?";
  if (d->oob.ss_family == AF_INET) inet_ntop(AF_INET, &((const struct sockaddr_in *)&d->oob)->sin_addr, ip, sizeof(ip));
  else if (d->oob.ss_family == AF_INET6)
    inet_ntop(AF_INET6, &((const struct sockaddr_in6 *)&d->oob)->sin6_addr, ip, sizeof(ip));
  snprintf(buf, len, "%s", ip);
}

/* ------------------------------------------------------------------ GPUDirect */
static int file_exists(const char *p) { return access(p, F_OK) == 0; }

/* GPU memory can be registered when the NVIDIA driver is there, through nvidia-peermem (plain
 * regMr) or dma-bufs (probed the usual way: a dma-buf registration of fd -1 fails with EBADF rather
 * than EOPNOTSUPP). */
static int ptr_support(struct mpib_hca *h, int *dmabuf_out) {
  int nvidia = file_exists("/proc/driver/nvidia/version");
  int peermem = file_exists("/sys/kernel/mm/memory_peers/nv_mem/version") ||
                file_exists("/sys/module/nvidia_peermem/version") || file_exists("/sys/module/nv_peer_mem/version");
  int dmabuf = 0;
  if (mpib_v.reg_dmabuf_mr) {
    errno = 0;
    struct ibv_mr *mr = mpib_v.reg_dmabuf_mr(h->pd, 0, 0, 0, -1, 0);
    if (mr) mpib_v.dereg_mr(mr);
    else dmabuf = errno != EOPNOTSUPP && errno != EPROTONOSUPPORT && errno != ENOSYS && errno != 0;
  }
  *dmabuf_out = dmabuf;
  return mpib_ptr_support(nvidia, peermem, dmabuf);
}

/* As NCCL's net_ib: NCCL_PTR_CUDA says plain regMr takes GPU memory, which needs nvidia-peermem;
 * NCCL_PTR_DMABUF says regMrDmaBuf does. Advertising CUDA on dma-buf alone makes NCCL call plain
 * regMr on GPU memory, which then fails. */
int mpib_ptr_support(int nvidia, int peermem, int dmabuf) {
  int p = NCCL_PTR_HOST;
  if (nvidia && peermem) p |= NCCL_PTR_CUDA;
  if (nvidia && dmabuf) p |= NCCL_PTR_DMABUF;
  return p;
}

/* Lane rate in Mb/s of the highest speed bit set; 0 unknown. */
static int lane_mbps(uint32_t speed) {
  static const struct {
    uint32_t bit;
    int mbps;
  } lanes[] = {{256, 200000} /* XDR */, {128, 100000} /* NDR */, {64, 50000} /* HDR */, {32, 25000} /* EDR */,
               {16, 14000} /* FDR */,   {8, 10000} /* FDR10 */,   {4, 10000} /* QDR */,  {2, 5000} /* DDR */,
               {1, 2500} /* SDR */};
  for (size_t i = 0; i < sizeof(lanes) / sizeof(lanes[0]); i++)
    if (speed & lanes[i].bit) return lanes[i].mbps;
  return 0;
}

int mpib_port_speed_mbps(unsigned active_speed, uint32_t active_speed_ex, unsigned active_width) {
  int lane = lane_mbps(active_speed_ex ? active_speed_ex : active_speed);
  /* An active port whose speed reads 0 (the kernel leaves active_speed 0 for XDR, and a library
   * before rdma-core 48 has no active_speed_ex) or names a rate beyond this table runs at least at
   * XDR's. */
  if (lane == 0) lane = 200000;
  int width;
  switch (active_width) {
    case 1: width = 1; break;
    case 2: width = 4; break;
    case 4: width = 8; break;
    case 8: width = 12; break;
    case 16: width = 2; break;
    default: width = 1; break;
  }
  return lane * width;
}

/* ------------------------------------------------------------------ async events */
/* Fail the live connections of HCA h that own qp, or cq; with neither, all of them. */
static void fail_comms(struct mpib_hca *h, void *qp, void *cq, const char *what) {
  int n = 0;
  pthread_mutex_lock(&g.reg_lock);
  for (struct mpib_comm_base *c = g.live; c; c = c->next_live) {
    if (c->dev->hca != h) continue;
    int hit = 0;
    if (qp) {
      for (int i = 0; i < c->nqps; i++) hit |= (void *)c->qps[i] == qp;
      if (c->kind == MPIB_RECV_COMM) hit |= (void *)((struct mpib_recv_comm *)c)->flush_qp == qp;
    } else if (cq) hit = (void *)c->cq == cq;
    else hit = 1;
    if (!hit) continue;
    n++;
    MP_WARN("NET/IB: %s port %d: %s; the connection %s peer %s fails", h->name, c->dev->port, what,
            c->kind == MPIB_SEND_COMM ? "to" : "from", c->peer);
    mpib_error_set(&c->err, ncclRemoteError, "%s port %d: %s; connection %s peer %s failed", h->name, c->dev->port,
                   what, c->kind == MPIB_SEND_COMM ? "to" : "from", c->peer);
    __atomic_store_n(&c->err.warned, 1, __ATOMIC_RELEASE);
  }
  pthread_mutex_unlock(&g.reg_lock);
  if (n == 0) MP_WARN("NET/IB: %s: %s (no open connection affected)", h->name, what);
}

static void *async_thread(void *arg) {
  struct mpib_hca *h = arg;
  while (!__atomic_load_n(&g.stop, __ATOMIC_ACQUIRE)) {
    struct pollfd p = {.fd = h->ctx->async_fd, .events = POLLIN};
    int r = poll(&p, 1, 100);
    if (r <= 0) continue;
    struct ibv_async_event ev;
    if (mpib_v.get_async_event(h->ctx, &ev) != 0) {
      /* a readable channel that yields no event: the device is going away. Back off instead of
       * spinning a core; its connections fail by their completions. */
      if (!h->async_broken++)
        MP_WARN("NET/IB: %s: its async event channel yields no events (%s): device removed? Watching it every "
                "100 ms", h->name, strerror(errno));
      usleep(100000);
      continue;
    }
    char what[128];
    switch (ev.event_type) {
      case IBV_EVENT_PORT_ERR:
        /* QPs stay in RTS and retry: a flap shorter than timeout x retries loses nothing, and a port
         * that stays down ends each connection with its retry-exceeded completion (as net_ib) */
        MP_WARN("NET/IB: %s port %d went down (IBV_EVENT_PORT_ERR); its connections retry and fail if it "
                "stays down past MPLANE_IB_TIMEOUT/MPLANE_IB_RETRY_CNT's retry time", h->name, ev.element.port_num);
        break;
      case IBV_EVENT_PORT_ACTIVE:
        MP_INFO(NCCL_NET, "NET/IB: %s port %d is active again", h->name, ev.element.port_num);
        break;
      case IBV_EVENT_QP_FATAL:
      case IBV_EVENT_QP_REQ_ERR:
      case IBV_EVENT_QP_ACCESS_ERR:
        snprintf(what, sizeof(what), "%s on QP %u", mpib_event_str(ev.event_type), ev.element.qp->qp_num);
        fail_comms(h, ev.element.qp, NULL, what);
        break;
      case IBV_EVENT_CQ_ERR:
        snprintf(what, sizeof(what), "CQ error (overrun)");
        fail_comms(h, NULL, ev.element.cq, what);
        break;
      case IBV_EVENT_DEVICE_FATAL:
        fail_comms(h, NULL, NULL, "device fatal error (IBV_EVENT_DEVICE_FATAL)");
        break;
      default:
        MP_INFO(NCCL_NET, "NET/IB: %s: async event %s (%d)", h->name, mpib_event_str(ev.event_type),
                (int)ev.event_type);
        break;
    }
    mpib_v.ack_async_event(&ev);
  }
  return NULL;
}

void mpib_comm_register(struct mpib_comm_base *c) {
  pthread_mutex_lock(&g.reg_lock);
  c->next_live = g.live;
  g.live = c;
  pthread_mutex_unlock(&g.reg_lock);
}

void mpib_comm_unregister(struct mpib_comm_base *c) {
  pthread_mutex_lock(&g.reg_lock);
  for (struct mpib_comm_base **p = &g.live; *p; p = &(*p)->next_live)
    if (*p == c) {
      *p = c->next_live;
      break;
    }
  pthread_mutex_unlock(&g.reg_lock);
}

/* ---- which of this node's IB ports share a subnet, where their GID prefixes cannot say (ib.h).
 *
 * Every subnet manager starts with the default prefix fe80::, so eight planes that each run their own
 * SM and one fabric with one SM can look alike by prefix. What else the node can read:
 *   - the port's LID: LIDs are unique within a subnet, so two ports with the same LID are in
 *     different subnets;
 *   - the port's SM LID: every port of a subnet is managed by its master SM, so two ports with
 *     different SM LIDs are in different subnets (equal SM LIDs prove nothing: each plane's SM may
 *     well have LID 1);
 *   - reachability itself: an RC QP on one port connected to a QP on the other, by LID and with a
 *     GRH naming the other port's full GID (prefix and port GUID), and one 8-byte RDMA write. In one
 *     subnet it completes within microseconds. Across subnets the LID leads to some other port of the
 *     first subnet (or nowhere), whose HCA drops the packet because its GID is not the DGID: no other
 *     job's QP ever sees it, and the write ends in a retry-exceeded completion, after about
 *     4.096 us * 2^PROBE_TIMEOUT * (PROBE_RETRY + 1).
 * The first two decide a pair for free; the probe decides the rest, all pairs at once, within a
 * deadline. A pair the probe leaves open, or answers that contradict each other, leave the grouping
 * undecided: the caller keeps its old rule then. */
#define PROBE_TIMEOUT 12   /* ACK timeout exponent: 16.8 ms */
#define PROBE_RETRY 1
#define PROBE_DEADLINE_S 2.0

struct probe {
  int a, b;         /* the ports, a < b */
  int verdict;      /* 1 reach each other, 0 do not, -1 undecided */
  const char *why;  /* how it was decided */
  struct ibv_cq *cqa, *cqb;
  struct ibv_qp *qa, *qb;
  struct ibv_mr *ma, *mb;
  uint64_t bufa, bufb;
};

static ncclResult_t qp_init(struct mpib_dev *d, struct ibv_cq *cq, int access, struct ibv_qp **out) {
  struct ibv_qp_init_attr ia;
  memset(&ia, 0, sizeof(ia));
  ia.send_cq = cq;
  ia.recv_cq = cq;
  ia.qp_type = IBV_QPT_RC;
  ia.cap.max_send_wr = 1;
  ia.cap.max_send_sge = 1;
  struct ibv_qp *qp = mpib_v.create_qp(d->hca->pd, &ia);
  if (!qp) return ncclSystemError;
  *out = qp;
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_INIT;
  a.pkey_index = (uint16_t)mpib_config()->ib_pkey;
  a.port_num = (uint8_t)d->port;
  a.qp_access_flags = access;
  return mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS) == 0
             ? ncclSuccess
             : ncclSystemError;
}

/* qp on port d to port peer's QP rqpn: by LID, with a GRH naming peer's GID; short retries. */
static ncclResult_t qp_rts(struct mpib_dev *d, struct ibv_qp *qp, const struct mpib_dev *peer, uint32_t rqpn) {
  struct ibv_qp_attr a;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTR;
  a.path_mtu = d->mtu < peer->mtu ? d->mtu : peer->mtu;
  a.dest_qp_num = rqpn;
  a.max_dest_rd_atomic = 1;
  a.min_rnr_timer = 12;
  a.ah_attr.port_num = (uint8_t)d->port;
  a.ah_attr.dlid = peer->lid;
  a.ah_attr.is_global = 1;
  memcpy(a.ah_attr.grh.dgid.raw, peer->gid.raw, 16);
  a.ah_attr.grh.sgid_index = (uint8_t)d->gid_index;
  /* IB: this subnet only, a router between planes does not make them one. RoCE v2: routed within
   * its fabric (each NIC on a subnet of its own), and separate planes have no route between them. */
  a.ah_attr.grh.hop_limit = d->link_layer == IBV_LINK_LAYER_ETHERNET ? 64 : 1;
  if (mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN | IBV_QP_RQ_PSN |
                                   IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER) != 0)
    return ncclSystemError;
  memset(&a, 0, sizeof(a));
  a.qp_state = IBV_QPS_RTS;
  a.timeout = PROBE_TIMEOUT;
  a.retry_cnt = PROBE_RETRY;
  a.rnr_retry = 0;
  a.max_rd_atomic = 1;
  return mpib_v.modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
                                      IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC) == 0
             ? ncclSuccess
             : ncclSystemError;
}

static void probe_free(struct probe *p) {
  if (p->qa) mpib_v.destroy_qp(p->qa);
  if (p->qb) mpib_v.destroy_qp(p->qb);
  if (p->ma) mpib_v.dereg_mr(p->ma);
  if (p->mb) mpib_v.dereg_mr(p->mb);
  if (p->cqa) mpib_v.destroy_cq(p->cqa);
  if (p->cqb) mpib_v.destroy_cq(p->cqb);
}

/* Set up p and post its write; -1 where it could not (its verdict stays undecided). */
static int probe_start(struct probe *p, struct mpib_dev *da, struct mpib_dev *db) {
  p->cqa = mpib_v.create_cq(da->hca->ctx, 2, NULL, NULL, 0);
  p->cqb = mpib_v.create_cq(db->hca->ctx, 2, NULL, NULL, 0);
  if (!p->cqa || !p->cqb) return -1;
  p->ma = mpib_v.reg_mr(da->hca->pd, &p->bufa, sizeof(p->bufa), IBV_ACCESS_LOCAL_WRITE);
  p->mb = mpib_v.reg_mr(db->hca->pd, &p->bufb, sizeof(p->bufb), IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE);
  if (!p->ma || !p->mb) return -1;
  if (qp_init(da, p->cqa, 0, &p->qa) != ncclSuccess || qp_init(db, p->cqb, IBV_ACCESS_REMOTE_WRITE, &p->qb) != ncclSuccess)
    return -1;
  if (qp_rts(da, p->qa, db, p->qb->qp_num) != ncclSuccess || qp_rts(db, p->qb, da, p->qa->qp_num) != ncclSuccess)
    return -1;
  p->bufa = 0x6d706c616e65ull; /* "mplane" */
  struct ibv_sge sge = {.addr = (uint64_t)(uintptr_t)&p->bufa, .length = sizeof(p->bufa), .lkey = p->ma->lkey};
  struct ibv_send_wr wr, *bad = NULL;
  memset(&wr, 0, sizeof(wr));
  wr.sg_list = &sge;
  wr.num_sge = 1;
  wr.opcode = IBV_WR_RDMA_WRITE;
  wr.send_flags = IBV_SEND_SIGNALED;
  wr.wr.rdma.remote_addr = (uint64_t)(uintptr_t)&p->bufb;
  wr.wr.rdma.rkey = p->mb->rkey;
  return ibv_post_send(p->qa, &wr, &bad) == 0 ? 0 : -1;
}

static int find(int *up, int x) {
  while (up[x] != x) x = up[x] = up[up[x]];
  return x;
}

int mpib_subnet_groups(struct mpib_dev *devs, int n, int *group, char *why, size_t whylen) {
  if (n < 1 || n > MPIB_MAX_DEVS) {
    snprintf(why, whylen, "%d ports", n);
    return -1;
  }
  size_t npairs = (size_t)n * (size_t)(n - 1) / 2;
  struct probe *pr = calloc(npairs ? npairs : 1, sizeof(*pr));
  if (!pr) {
    snprintf(why, whylen, "out of memory");
    return -1;
  }
  size_t k = 0;
  int nprobed = 0;
  for (int a = 0; a < n; a++)
    for (int b = a + 1; b < n; b++, k++) {
      struct probe *p = &pr[k];
      p->a = a;
      p->b = b;
      p->verdict = -1;
      int ib = devs[a].link_layer == IBV_LINK_LAYER_INFINIBAND;
      if (devs[a].link_layer != devs[b].link_layer) {
        p->verdict = 0;
        p->why = "one is IB, the other RoCE";
      } else if (ib && devs[a].sm_lid != devs[b].sm_lid) {
        p->verdict = 0;
        p->why = "SM LIDs differ";
      } else if (ib && devs[a].lid == devs[b].lid) {
        p->verdict = 0;
        p->why = "the same LID";
      } else if (probe_start(p, &devs[a], &devs[b]) == 0) {
        nprobed++;
      } else {
        p->why = "the probe could not be set up";
      }
    }
  double t0 = mplane_now_s();
  int open = nprobed;
  while (open > 0 && mplane_now_s() - t0 < PROBE_DEADLINE_S) {
    for (k = 0; k < npairs; k++) {
      struct probe *p = &pr[k];
      if (p->verdict >= 0 || !p->qa) continue;
      struct ibv_wc wc;
      int got = ibv_poll_cq(p->cqa, 1, &wc);
      if (got <= 0) continue;
      p->verdict = wc.status == IBV_WC_SUCCESS && p->bufb == p->bufa;
      p->why = p->verdict ? "the probe write arrived" : "the probe write found no way there";
      open--;
    }
    if (open > 0) {
      struct timespec ts = {0, 200000};
      nanosleep(&ts, NULL);
    }
  }
  int *up = calloc((size_t)n, sizeof(int));
  int undecided = 0;
  int ok = up != NULL;
  for (int i = 0; ok && i < n; i++) up[i] = i;
  for (k = 0; ok && k < npairs; k++) {
    if (pr[k].verdict < 0) undecided++;
    if (pr[k].verdict == 1) up[find(up, pr[k].a)] = find(up, pr[k].b);
  }
  int contradiction = 0;
  for (k = 0; ok && k < npairs; k++)
    if (pr[k].verdict == 0 && find(up, pr[k].a) == find(up, pr[k].b)) contradiction = 1;
  int res = -1;
  if (!ok) snprintf(why, whylen, "out of memory");
  else if (undecided) snprintf(why, whylen, "%d of %zu pairs of ports undecided (no answer within %.0f s, or no probe)",
                               undecided, npairs, PROBE_DEADLINE_S);
  else if (contradiction) snprintf(why, whylen, "the answers contradict each other (A reaches B, B reaches C, A not C)");
  else {
    /* groups numbered by their first port, in discovery order */
    int ng = 0;
    int *id = malloc((size_t)n * sizeof(int));
    if (id) {
      for (int i = 0; i < n; i++) id[i] = -1;
      for (int i = 0; i < n; i++) {
        int r = find(up, i);
        if (id[r] < 0) id[r] = ng++;
        group[i] = id[r];
      }
      free(id);
      snprintf(why, whylen, "%d subnet(s) among %d ports: %d pair(s) probed, %zu decided by LID or SM LID", ng, n,
               nprobed, npairs - (size_t)nprobed);
      res = ng;
    } else {
      snprintf(why, whylen, "out of memory");
    }
  }
  for (k = 0; k < npairs; k++) {
    if (pr[k].why)
      MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s and %s: %s (%s)", devs[pr[k].a].props.name, devs[pr[k].b].props.name,
              pr[k].verdict == 1 ? "one subnet" : pr[k].verdict == 0 ? "different subnets" : "undecided", pr[k].why);
    probe_free(&pr[k]);
  }
  free(up);
  free(pr);
  return res;
}

/* ------------------------------------------------------------------ discovery */
/* The node's selected ports in discovery order, up or down: plane numbers count them all, so a
 * node with a port down numbers its planes as its peers do. */
static struct {
  int dev;        /* index in g.devs, -1 when the port is down */
  int link_layer; /* IBV_LINK_LAYER_* */
  char name[80];  /* "mlx5_3:1" */
  char pci[PATH_MAX]; /* the HCA's PCI path, "" unknown */
} present[MPIB_MAX_DEVS];
static int npresent;

static void note_present(int dev, int link_layer, const char *hca, int port) {
  if (npresent >= MPIB_MAX_DEVS) return;
  present[npresent].dev = dev;
  present[npresent].link_layer = link_layer;
  snprintf(present[npresent].name, sizeof(present[npresent].name), "%s:%d", hca, port);
  char link[PATH_MAX];
  snprintf(link, sizeof(link), "/sys/class/infiniband/%s/device", hca);
  if (!realpath(link, present[npresent].pci)) present[npresent].pci[0] = 0;
  npresent++;
}

/* The PCI function of a path's last component ("0000:3b:00.1") as one number, its hex digits. */
static uint64_t pci_number(const char *path) {
  const char *last = strrchr(path, '/');
  uint64_t v = 0;
  for (const char *c = last ? last + 1 : path; *c; c++) {
    if (*c >= '0' && *c <= '9') v = v * 16 + (uint64_t)(*c - '0');
    else if (*c >= 'a' && *c <= 'f') v = v * 16 + (uint64_t)(*c - 'a' + 10);
    else if (*c >= 'A' && *c <= 'F') v = v * 16 + (uint64_t)(*c - 'A' + 10);
  }
  return v;
}

int mpib_pci_order_cmp(const char *a, const char *b) {
  if (!*a || !*b) return !*a && !*b ? 0 : !*a ? 1 : -1; /* unknown paths last */
  uint64_t x = pci_number(a), y = pci_number(b);
  return x < y ? -1 : x > y;
}

/* MPLANE_IB_DEVICE_PCI_ORDER / NCCL_IB_DEVICE_PCI_ORDER: the ports in PCI order (stable: the ports
 * of one HCA keep theirs), as NCCL's net_ib orders its devices, so nodes whose verbs list their
 * HCAs in another order still number devices, and planes, alike. */
static void order_by_pci(void) {
  for (int i = 1; i < npresent; i++)
    for (int j = i; j > 0 && mpib_pci_order_cmp(present[j - 1].pci, present[j].pci) > 0; j--) {
      __typeof__(present[0]) t = present[j];
      present[j] = present[j - 1];
      present[j - 1] = t;
    }
  static struct mpib_dev sorted[MPIB_MAX_DEVS];
  int n = 0;
  for (int i = 0; i < npresent; i++) {
    if (present[i].dev < 0) continue;
    sorted[n] = g.devs[present[i].dev];
    present[i].dev = n++;
  }
  memcpy(g.devs, sorted, (size_t)n * sizeof(sorted[0]));
}

/* A port the probe decides: an IB port keeping the default GID prefix fe80:: (its prefix names no
 * subnet), or any RoCE port (its netdev's subnet only hints: routed RoCE gives every NIC its own). */
static int probe_candidate(const struct mpib_dev *d) {
  return d->link_layer == IBV_LINK_LAYER_ETHERNET || !mplane_ib_prefix_names_subnet(be64toh(d->gid.global.subnet_prefix));
}

/* Which probe candidates share a subnet (ib_dev.c's probe, every pair at once): group[d] for each
 * candidate d, -1 for the others. 1 decided (or nothing to decide), 0 undecided with why. */
static int probe_groups(const struct mplane_config *cfg, int *group, char *why, size_t whylen) {
  struct mpib_dev cand[MPIB_MAX_DEVS];
  int idx[MPIB_MAX_DEVS], n = 0, lg[MPIB_MAX_DEVS];
  for (int d = 0; d < g.ndev; d++) {
    group[d] = -1;
    if (probe_candidate(&g.devs[d])) {
      cand[n] = g.devs[d];
      idx[n++] = d;
    }
  }
  if (n == 0) return 1;
  if (n == 1) { /* alone of its kind: a subnet of its own (no named IB subnet has the default prefix) */
    group[idx[0]] = 0;
    return 1;
  }
  if (!cfg->ib_subnet_probe) {
    snprintf(why, whylen, "MPLANE_IB_SUBNET_PROBE=0");
    return 0;
  }
  if (mpib_subnet_groups(cand, n, lg, why, whylen) < 0) return 0;
  for (int i = 0; i < n; i++) group[idx[i]] = lg[i];
  return 1;
}

/* Planes: this transport reports facts - an IB port's GID prefix where it names a subnet, else the
 * subnet the probe found it on (numbered over every port present, a port down keeping a number of
 * its own: mplane_planes_number_groups) - and takes topo/'s one rule for them (topo/planes.c).
 * Where the probe cannot decide, every port is a plane of its own by its place among the ports
 * present, and INFO says so once, with what to set. topo/ (the node's files, these facts) and
 * MPLANE_PLANES decide the planes the plugin reports (plugin/topo_bind.c). */
/* Ports whose IB GID prefix names their subnet get it as their fact; 1 if any did. */
static int name_by_prefix(void) {
  int any = 0;
  for (int d = 0; d < g.ndev; d++) {
    if (probe_candidate(&g.devs[d])) continue;
    struct mplane_dev_props *p = &g.devs[d].props;
    uint64_t prefix = be64toh(g.devs[d].gid.global.subnet_prefix);
    any = 1;
    p->subnet_kind = MPLANE_SUBNET_IB;
    p->subnet_key = prefix;
    snprintf(p->subnet, sizeof(p->subnet), "%04x:%04x:%04x:%04x", (unsigned)(prefix >> 48),
             (unsigned)(prefix >> 32) & 0xffff, (unsigned)(prefix >> 16) & 0xffff, (unsigned)prefix & 0xffff);
  }
  return any;
}

/* The probed subnets as facts, numbered over the ports present: a down port keeps a number of its
 * own where its kind of port is probed (RoCE; IB where no port names its subnet by prefix). */
static void number_probed(const int *group, int any_named_ib) {
  int pgroup[MPIB_MAX_DEVS], slot[MPIB_MAX_DEVS], np = 0, pos_of_dev[MPIB_MAX_DEVS];
  for (int i = 0; i < npresent; i++) {
    int d = present[i].dev;
    if (d >= 0 && group[d] >= 0) {
      pos_of_dev[d] = np;
      pgroup[np++] = group[d];
    } else if (d < 0 && (present[i].link_layer == IBV_LINK_LAYER_ETHERNET || !any_named_ib)) {
      pgroup[np++] = -1;
    }
  }
  mplane_planes_number_groups(np, pgroup, slot);
  for (int d = 0; d < g.ndev; d++) {
    if (group[d] < 0) continue;
    struct mplane_dev_props *p = &g.devs[d].props;
    p->subnet_kind = MPLANE_SUBNET_PROBED;
    p->subnet_key = (uint64_t)slot[pos_of_dev[d]];
    snprintf(p->subnet, sizeof(p->subnet), "%s subnet %d (probed)",
             g.devs[d].link_layer == IBV_LINK_LAYER_ETHERNET ? "RoCE" : "fe80::", slot[pos_of_dev[d]]);
  }
}

/* One INFO line: what decided the planes, the ports down, and what to set where nothing did. */
static void say_planes(int nplanes, int any_named_ib, const char *why) {
  char downs[256] = "";
  for (int i = 0; i < npresent; i++)
    if (present[i].dev < 0)
      snprintf(downs + strlen(downs), sizeof(downs) - strlen(downs), "%s%s", downs[0] ? ", " : "", present[i].name);
  if (nplanes > 0)
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %d plane(s) from the fabric (GID prefixes, the probe between this node's "
            "own ports)%s%s%s", nplanes, downs[0] ? "; down, keeping their plane numbers: " : "", downs,
            downs[0] && any_named_ib ? " (a down port's GID prefix is unknown: if planes are numbered by prefix and "
                                       "it named one of its own, set MPLANE_PLANES)" : "");
  else
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: which ports share a fabric is unknown (%s): a plane per port in discovery "
            "order, so connections between ports of one fabric are relayed; name the planes with MPLANE_PLANES "
            "(e.g. %s=0,...; ports of one fabric given one plane)", why[0] ? why : "no fact",
            g.ndev ? g.devs[0].props.name : "mlx5_0:1");
}

static void assign_planes(const struct mplane_config *cfg) {
  int group[MPIB_MAX_DEVS];
  char why[256] = "";
  int decided = probe_groups(cfg, group, why, sizeof(why));
  int any_named_ib = name_by_prefix();
  if (decided) number_probed(group, any_named_ib);
  struct mplane_subnet subnets[MPIB_MAX_DEVS];
  int plane[MPIB_MAX_DEVS], rail[MPIB_MAX_DEVS];
  for (int d = 0; d < g.ndev; d++)
    subnets[d] = (struct mplane_subnet){.kind = g.devs[d].props.subnet_kind, .key = g.devs[d].props.subnet_key};
  int nplanes = mplane_planes_by_subnet(g.ndev, subnets, plane, rail);
  for (int i = 0; i < npresent; i++) {
    int d = present[i].dev;
    if (d < 0) continue;
    /* without facts: a plane per port, by its place among the ports present (down ones too) */
    g.devs[d].props.plane = nplanes > 0 ? plane[d] : i;
    g.devs[d].props.rail = nplanes > 0 ? rail[d] : 0;
  }
  say_planes(nplanes, any_named_ib, why);
}

int mpib_max_comms(int max_qp, int max_cq, int nports, int nqps) {
  if (nports < 1) nports = 1;
  if (nqps < 1) nqps = 1;
  int by_qp = max_qp / nports / (nqps + 1), by_cq = max_cq / nports;
  int n = by_qp < by_cq ? by_qp : by_cq;
  return n > 0 ? n : 1;
}

static void fill_props(struct mpib_dev *d, const struct mpib_port_attr *pax, int ptr) {
  const struct ibv_port_attr *pa = &pax->a;
  struct mplane_dev_props *p = &d->props;
  memset(p, 0, sizeof(*p));
  snprintf(p->name, sizeof(p->name), "%s:%d", d->hca->name, d->port);
  char link[PATH_MAX], real[PATH_MAX];
  snprintf(link, sizeof(link), "/sys/class/infiniband/%s/device", d->hca->name);
  if (realpath(link, real)) snprintf(p->pci_path, sizeof(p->pci_path), "%s", real);
  p->guid = be64toh(d->hca->attr.node_guid);
  if (!p->guid) p->guid = mplane_hash64(d->hca->name, strlen(d->hca->name), 11);
  p->ptr_support = ptr;
  p->reg_is_global = 0;
  p->force_flush = 0;
  uint32_t speed_ex = mpib_port_speed_ex(pax);
  p->speed_mbps = mpib_port_speed_mbps(pa->active_speed, speed_ex, pa->active_width);
  if (pa->active_speed == 0 && speed_ex == 0)
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s: active_speed reads 0 and the verbs library reports no active_speed_ex "
            "(rdma-core < 48): a speed beyond the 8-bit field, taken as XDR (%d Mbps)", p->name, p->speed_mbps);
  p->port = d->port;
  p->latency_us = 0;
  p->max_comms = mpib_max_comms(d->hca->attr.max_qp, d->hca->attr.max_cq, d->hca->attr.phys_port_cnt,
                                 mpib_config()->ib_qps);
  p->max_recvs = MPIB_MAX_RECVS;
  p->max_p2p_bytes = MPIB_MAX_MSG;
  p->max_coll_bytes = MPIB_MAX_MSG;
}

/* Registered pages stay right in a child the application forks (a torch DataLoader) only if
 * libibverbs knows before anything is registered; a no-op where the kernel copies pinned pages on
 * fork itself. Before the device list, once per process, as NCCL's net_ib does. */
static void fork_init_once(void) {
  static int done;
  if (done || !mpib_v.fork_init) return;
  done = 1;
  int rc = mpib_v.fork_init();
  if (rc) MP_WARN("NET/IB: ibv_fork_init failed: %s; a fork after init may corrupt registered memory", strerror(rc));
}

ncclResult_t mpib_discover(const struct mplane_config *cfg) {
  g.cfg = cfg;
  if (g.ndev > 0) return ncclSuccess;
  char why[512];
  if (mpib_verbs_load(cfg->ibverbs_lib, why, sizeof(why)) != 0) {
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s (MPLANE_IBVERBS_LIB='%s'); no InfiniBand", why, cfg->ibverbs_lib);
    return ncclSystemError;
  }
  fork_init_once();
  npresent = 0; /* a discovery that failed may be tried again */
  int n = 0;
  struct ibv_device **list = mpib_v.get_device_list(&n);
  if (!list || n == 0) {
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: no RDMA device (%s)", list ? "empty list" : strerror(errno));
    if (list) mpib_v.free_device_list(list);
    return ncclSystemError;
  }
  for (int i = 0; i < n && g.ndev < MPIB_MAX_DEVS; i++) {
    const char *name = mpib_v.get_device_name(list[i]);
    if (!mpib_hca_match(cfg->ib_hca, name, -1) && cfg->ib_hca[0] != '^') continue;
    struct ibv_context *ctx = mpib_v.open_device(list[i]);
    if (!ctx) {
      MP_WARN("NET/IB: cannot open %s: %s", name, strerror(errno));
      continue;
    }
    struct mpib_hca *h = &g.hcas[g.nhca];
    memset(h, 0, sizeof(*h));
    snprintf(h->name, sizeof(h->name), "%s", name);
    h->ctx = ctx;
    if (mpib_v.query_device(ctx, &h->attr) != 0) {
      MP_WARN("NET/IB: ibv_query_device(%s) failed", name);
      mpib_v.close_device(ctx);
      continue;
    }
    int first = g.ndev;
    int dmabuf = 0, ptr = NCCL_PTR_HOST;
    for (int port = 1; port <= h->attr.phys_port_cnt && g.ndev < MPIB_MAX_DEVS; port++) {
      struct mpib_port_attr pax;
      if (mpib_query_port(ctx, port, &pax) != 0) continue;
      const struct ibv_port_attr pa = pax.a;
      if (!mpib_hca_match(cfg->ib_hca, name, port)) continue;
      if (pa.link_layer != IBV_LINK_LAYER_INFINIBAND && pa.link_layer != IBV_LINK_LAYER_ETHERNET) continue;
      if (pa.state != IBV_PORT_ACTIVE) {
        MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s port %d is not active (state %d); skipped, its plane number kept",
                name, port, pa.state);
        note_present(-1, pa.link_layer, name, port);
        continue;
      }
      if (!h->pd) {
        h->pd = mpib_v.alloc_pd(ctx);
        if (!h->pd) {
          MP_WARN("NET/IB: ibv_alloc_pd(%s) failed", name);
          break;
        }
        ptr = ptr_support(h, &dmabuf);
        h->dmabuf = dmabuf;
      }
      struct mpib_dev *d = &g.devs[g.ndev];
      memset(d, 0, sizeof(*d));
      d->hca = h;
      d->port = port;
      d->link_layer = pa.link_layer;
      d->lid = pa.lid;
      d->sm_lid = pa.sm_lid;
      d->mtu = pa.active_mtu;
      d->grh_required = (pa.flags & IBV_QPF_GRH_REQUIRED) != 0;
      char why[256];
      if (mpib_dev_resolve_gid(d, &d->gid_index, &d->gid, why, sizeof(why)) != 0) {
        MP_WARN("NET/IB: %s port %d: %s; skipped", name, port, why);
        continue;
      }
      fill_props(d, &pax, ptr);
      pick_oob(cfg, d);
      char gs[INET6_ADDRSTRLEN] = "", os[INET6_ADDRSTRLEN + 16] = "";
      inet_ntop(AF_INET6, d->gid.raw, gs, sizeof(gs));
      mpib_oob_str(d, os, sizeof(os));
      MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: %s %s lid %u gid[%d] %s speed %d Mbps ptrSupport 0x%x%s side channel %s",
              d->props.name, d->link_layer == IBV_LINK_LAYER_INFINIBAND ? "IB" : "RoCE", d->lid, d->gid_index, gs,
              d->props.speed_mbps, ptr, dmabuf ? " (dma-buf)" : "", os);
      note_present(g.ndev, d->link_layer, name, port);
      g.ndev++;
    }
    if (g.ndev == first) {
      if (h->pd) mpib_v.dealloc_pd(h->pd);
      mpib_v.close_device(ctx);
      continue;
    }
    g.nhca++;
  }
  mpib_v.free_device_list(list);
  if (g.ndev == 0) {
    MP_INFO(NCCL_INIT | NCCL_NET, "NET/IB: no active port selected (MPLANE_IB_HCA='%s')", cfg->ib_hca);
    return ncclSystemError;
  }
  if (cfg->ib_device_pci_order) order_by_pci();
  assign_planes(cfg);
  for (int i = 0; i < g.nhca; i++) {
    if (pthread_create(&g.hcas[i].async_thread, NULL, async_thread, &g.hcas[i]) == 0) g.hcas[i].async_started = 1;
    else MP_WARN("NET/IB: cannot start the async event thread of %s", g.hcas[i].name);
  }
  return ncclSuccess;
}

void mpib_shutdown(void) {
  __atomic_store_n(&g.stop, 1, __ATOMIC_RELEASE);
  for (int i = 0; i < g.nhca; i++)
    if (g.hcas[i].async_started) {
      pthread_join(g.hcas[i].async_thread, NULL);
      g.hcas[i].async_started = 0;
    }
}
