/* mplane-doctor: is this node ready for NCCL jobs through mplane? One command that looks at what a
 * job would meet: the configuration, the RDMA ports (link state, speed), the devices and planes NCCL
 * will see through the plugin, the side channel each IB device uses, GPUs and GPUDirect (peermem or
 * dma-buf), the service level and traffic class of each class, and the NCCL settings. It ends with
 * a verdict: exit 0 ready, 1 problems found (each with what to do), 2 bad arguments. What it cannot
 * see here (no GPU, no RDMA library) is said, and is no problem by itself.
 *
 * It runs the plugin's own code (linked in): the transports' discovery, topo/'s planes, the class
 * map; and it dlopens the plugin library as NCCL would, to check that NCCL can load it. */
#include <ctype.h>
#include <dlfcn.h>
#include <getopt.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../common/config.h"
#include "../common/cuda.h"
#include "../common/log.h"
#include "../common/tc_map.h"
#include "../net/tc.h"
#include "../plugin/net_core.h"
#include "../topo/topo.h"
#ifdef MPLANE_DOCTOR_VERBS
#include "../net/ib/ib.h"
#endif

extern char **environ;

#define MAX_ITEMS 64
#define TEXT 512

struct item {
  char what[TEXT];
  char fix[TEXT];
};

struct port {
  char name[64];
  int port, active, ib; /* ib: link layer InfiniBand, else Ethernet (RoCE) */
  char state[16];
  int speed_mbps;
};

static struct {
  int json, verbose;
  const char *plugin;
  struct item problems[MAX_ITEMS];
  int nproblems;
  struct item unseen[MAX_ITEMS]; /* what: what was not seen; fix: why */
  int nunseen;
  char config_error[2048];
  /* RDMA ports as verbs list them */
  char verbs_lib[256];
  int verbs_loaded;
  struct port ports[MAX_ITEMS];
  int nports;
  /* the plugin's own view */
  ncclResult_t init_result;
  const char *transport;
  int ndev;
  const struct mplane_dev_props *props;
  char side[MAX_ITEMS][TEXT]; /* side-channel lines, one per IB device */
  int nside;
  char warns[8][TEXT];        /* the WARNs init logged */
  int nwarns;
  /* GPUs */
  int gpus_pci, gpus_cuda;
  char gpu_model[64], cuda_why[256];
  int peermem, dmabuf, cuda_ptr;
  /* NCCL */
  char nccl_set[16][TEXT]; /* NCCL_* the plugin set at init */
  int nnccl_set;
  char plugin_load[TEXT];
  int plugin_loads;
} r;

static void problem(const char *fix, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void problem(const char *fix, const char *fmt, ...) {
  if (r.nproblems == MAX_ITEMS) return;
  struct item *it = &r.problems[r.nproblems++];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(it->what, sizeof(it->what), fmt, ap);
  va_end(ap);
  snprintf(it->fix, sizeof(it->fix), "%s", fix);
}

static void unseen(const char *what, const char *why) {
  if (r.nunseen == MAX_ITEMS) return;
  snprintf(r.unseen[r.nunseen].what, TEXT, "%s", what);
  snprintf(r.unseen[r.nunseen++].fix, TEXT, "%s", why);
}

/* The plugin's log: WARNs kept for the report, the IB side-channel lines kept as they say it best. */
static void doctor_logger(ncclDebugLogLevel level, unsigned long flags, const char *file, int line, const char *fmt,
                          ...) {
  (void)flags, (void)file, (void)line;
  char line_text[TEXT];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(line_text, sizeof(line_text), fmt, ap);
  va_end(ap);
  const char *msg = line_text;
  if (!strncmp(msg, "NET/mplane ", 11)) msg += 11; /* the prefix our log adds for NCCL's */
  if (r.verbose && level != NCCL_LOG_TRACE) fprintf(stderr, "  log: %s\n", msg);
  if (level == NCCL_LOG_WARN && r.nwarns < 8) snprintf(r.warns[r.nwarns++], TEXT, "%s", msg);
  if (level == NCCL_LOG_INFO && strstr(msg, " side channel on ") && !strncmp(msg, "NET/IB: ", 8) && r.nside < MAX_ITEMS)
    snprintf(r.side[r.nside++], TEXT, "%s", msg + 8);
}

/* ---------------------------------------------------------------- RDMA ports, every one */
#ifdef MPLANE_DOCTOR_VERBS
static const char *port_state_name(int s) {
  static const char *names[] = {"NOP", "DOWN", "INIT", "ARMED", "ACTIVE", "ACTIVE_DEFER"};
  return s >= 0 && s < 6 ? names[s] : "UNKNOWN";
}

static void look_at_ports(const struct mplane_config *cfg) {
  char why[512];
  snprintf(r.verbs_lib, sizeof(r.verbs_lib), "%s", cfg->ibverbs_lib);
  if (mpib_verbs_load(cfg->ibverbs_lib, why, sizeof(why)) != 0) {
    unseen("RDMA ports", why);
    return;
  }
  r.verbs_loaded = 1;
  int n = 0;
  struct ibv_device **list = mpib_v.get_device_list(&n);
  if (!list || n == 0) {
    unseen("RDMA ports", "the verbs library lists no RDMA device (no InfiniBand or RoCE NIC, or its driver is not loaded)");
    if (list) mpib_v.free_device_list(list);
    return;
  }
  for (int i = 0; i < n && r.nports < MAX_ITEMS; i++) {
    const char *name = mpib_v.get_device_name(list[i]);
    struct ibv_context *ctx = mpib_v.open_device(list[i]);
    struct ibv_device_attr attr;
    if (!ctx || mpib_v.query_device(ctx, &attr) != 0) {
      problem("check the NIC's driver (dmesg, ibv_devinfo) and that this user may open /dev/infiniband/*",
              "RDMA device %s cannot be opened or queried", name);
      if (ctx) mpib_v.close_device(ctx);
      continue;
    }
    for (int p = 1; p <= attr.phys_port_cnt && r.nports < MAX_ITEMS; p++) {
      struct mpib_port_attr pax;
      if (mpib_query_port(ctx, p, &pax) != 0) continue;
      struct port *pt = &r.ports[r.nports++];
      snprintf(pt->name, sizeof(pt->name), "%s", name);
      pt->port = p;
      pt->active = pax.a.state == IBV_PORT_ACTIVE;
      pt->ib = pax.a.link_layer == IBV_LINK_LAYER_INFINIBAND;
      snprintf(pt->state, sizeof(pt->state), "%s", port_state_name((int)pax.a.state));
      pt->speed_mbps = pt->active ? mpib_port_speed_mbps(pax.a.active_speed, mpib_port_speed_ex(&pax), pax.a.active_width) : 0;
      if (!mpib_hca_match(cfg->ib_hca, name, p)) continue; /* left out on purpose (MPLANE_IB_HCA) */
      if (!pt->active) {
        char fix[TEXT];
        snprintf(fix, sizeof(fix), "check the cable and the switch port (ibstat %s %d); %s", name, p,
                 pt->ib ? "an InfiniBand port becomes ACTIVE once its plane's subnet manager has swept it (INIT: no "
                          "subnet manager on that plane?)"
                        : "a RoCE port is ACTIVE once its Ethernet link is up");
        problem(fix, "%s port %d is %s: its plane has no NIC on this node until it is ACTIVE", name, p, pt->state);
      }
    }
    mpib_v.close_device(ctx);
  }
  mpib_v.free_device_list(list);
}
#else
static void look_at_ports(const struct mplane_config *cfg) {
  (void)cfg;
  unseen("RDMA ports", "this build has no verbs headers (libibverbs-dev): it cannot ask the NICs");
}
#endif

/* ---------------------------------------------------------------- the plugin's own view */
static int env_index(char **names, int n, const char *kv) {
  for (int i = 0; i < n; i++)
    if (!strcmp(names[i], kv)) return i;
  return -1;
}

/* A socket device is an interface: its link state and speed from sysfs. */
static char if_state[MAX_ITEMS][16];

static void look_at_interface(int d, const char *name) {
  char path[256], state[16] = "";
  snprintf(path, sizeof(path), "/sys/class/net/%s/operstate", name);
  FILE *f = fopen(path, "r");
  if (f) {
    if (fscanf(f, "%15s", state) != 1) state[0] = 0;
    fclose(f);
  }
  if (d < MAX_ITEMS) snprintf(if_state[d], sizeof(if_state[d]), "%s", state[0] ? state : "?");
  if (!strcmp(state, "down") || !strcmp(state, "lowerlayerdown"))
    problem("bring the link up (ip link set IF up; check the cable and the switch port)", "interface %s is %s", name,
            state);
}

static void look_at_plugin(const struct mplane_config *cfg) {
  /* the NCCL_* variables the plugin sets at init are what NCCL will run with */
  char *before[512];
  int nbefore = 0;
  for (char **e = environ; *e && nbefore < 512; e++)
    if (!strncmp(*e, "NCCL_", 5)) before[nbefore++] = strdup(*e);
  mplane_log_set_logger(doctor_logger);
  r.init_result = mplane_net_global_init(doctor_logger);
  for (char **e = environ; *e; e++)
    if (!strncmp(*e, "NCCL_", 5) && env_index(before, nbefore, *e) < 0 && r.nnccl_set < 16)
      snprintf(r.nccl_set[r.nnccl_set++], TEXT, "%s", *e);
  for (int i = 0; i < nbefore; i++) free(before[i]);
  if (r.init_result != ncclSuccess) {
    problem("read the WARN above: it names the variable or device; without a device NCCL uses its own transports",
            "the plugin's init fails (%d)%s%s", r.init_result, r.nwarns ? ": " : "", r.nwarns ? r.warns[0] : "");
    return;
  }
  r.transport = mplane_net_transport()->name;
  r.props = mplane_net_props(&r.ndev);
  if (cfg->transport == MPLANE_TRANSPORT_AUTO && strcmp(r.transport, "ib") != 0) {
    for (int i = 0; i < r.nports; i++)
      if (r.ports[i].active) {
        problem("run with MPLANE_DEBUG=1 to see why the IB transport refused the ports (or MPLANE_TRANSPORT=ib to "
                "make it an error)",
                "active RDMA ports exist (%s port %d) but the plugin chose the socket transport", r.ports[i].name,
                r.ports[i].port);
        break;
      }
  }
  for (int d = 0; d < r.ndev; d++) {
    const struct mplane_dev_props *p = &r.props[d];
    if (p->ptr_support & NCCL_PTR_DMABUF) r.dmabuf = 1;
    if (p->ptr_support & NCCL_PTR_CUDA) r.cuda_ptr = 1;
    if (r.ndev > 1 && p->plane < 0)
      problem("set MPLANE_PLANES (e.g. mlx5_0=0,mlx5_1=1) or check the ports' subnets (mplane-topo)",
              "device %d (%s) has no plane: peers cannot tell which of their NICs shares its fabric", d, p->name);
  }
  if (!strcmp(r.transport, "socket"))
    for (int d = 0; d < r.ndev; d++) look_at_interface(d, r.props[d].name);
  for (int i = 0; i < r.nside; i++)
    if (strstr(r.side[i], "no usable interface"))
      problem("give the node an interface its peers reach (IPoIB or Ethernet) and name it with MPLANE_SOCKET_IFNAME",
              "side channel on loopback: %s", r.side[i]);
}

/* ---------------------------------------------------------------- GPUs and GPUDirect */
static int file_exists(const char *p) { return access(p, F_OK) == 0; }

static void look_at_gpus(const struct mplane_config *cfg) {
  char err[1024];
  struct mplane_topo_options o = {.xml_path = cfg->topo_file, .xml_input = "MPLANE_TOPO_FILE", .planes = cfg->planes,
                                  .cuda_visible = getenv("CUDA_VISIBLE_DEVICES")};
  struct mplane_topo *t = NULL;
  if (mplane_topo_load(&o, &t, err, sizeof(err)) == ncclSuccess) {
    r.gpus_pci = t->ngpus;
    if (t->ngpus) snprintf(r.gpu_model, sizeof(r.gpu_model), "%s", t->gpus[0].model);
    mplane_topo_free(t);
  } else {
    unseen("GPUs on the PCI bus", err);
  }
  r.gpus_cuda = mplane_cuda_load(r.cuda_why, sizeof(r.cuda_why));
  r.peermem = file_exists("/sys/kernel/mm/memory_peers/nv_mem/version") || file_exists("/sys/module/nvidia_peermem") ||
              file_exists("/sys/module/nv_peer_mem");
  if (r.gpus_pci == 0 && r.gpus_cuda == 0) {
    unseen("GPUs", r.cuda_why[0] ? r.cuda_why : "none on this node");
    unseen("GPUDirect RDMA", "no GPU to check it with");
    return;
  }
  if (r.gpus_pci > 0 && r.gpus_cuda == 0)
    problem("install or load the NVIDIA driver (nvidia-smi must list the GPUs); CUDA_VISIBLE_DEVICES must not hide them",
            "%d GPU(s) on the PCI bus but the CUDA driver reports none: %s", r.gpus_pci, r.cuda_why);
  if (r.transport && !strcmp(r.transport, "ib") && !r.peermem && !r.dmabuf)
    problem("load nvidia-peermem (modprobe nvidia-peermem) or use the NVIDIA open kernel modules with a kernel of 5.12 "
            "or later for dma-buf; without either NCCL stages GPU data through host memory",
            "GPUDirect RDMA is unavailable: no peermem module and no dma-buf support on the RDMA devices");
}

/* ---------------------------------------------------------------- NCCL's side */
static void look_at_nccl(void) {
  const char *want = getenv("NCCL_NET_PLUGIN");
  if (want && *want && !strstr(want, "mplane"))
    problem("NCCL_NET_PLUGIN=mplane (or unset it where libnccl-net.so is mplane)",
            "NCCL_NET_PLUGIN=%s: NCCL loads that plugin, not mplane", want);
  const char *lib = r.plugin ? r.plugin : "libnccl-net-mplane.so";
  void *h = dlopen(lib, RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    snprintf(r.plugin_load, sizeof(r.plugin_load), "%s", dlerror());
    problem("put libnccl-net-mplane.so's folder on LD_LIBRARY_PATH (or run ldconfig after installing it)",
            "NCCL cannot load %s: %s", lib, r.plugin_load);
    return;
  }
  const char *tables[] = {"ncclNetPlugin_v12", "ncclNetPlugin_v11", "ncclTunerPlugin_v5"};
  char missing[128] = "";
  for (int i = 0; i < 3; i++)
    if (!dlsym(h, tables[i])) snprintf(missing + strlen(missing), sizeof(missing) - strlen(missing), " %s", tables[i]);
  if (missing[0]) problem("rebuild or reinstall mplane", "%s lacks%s: not an mplane plugin of this version", lib, missing);
  else {
    r.plugin_loads = 1;
    snprintf(r.plugin_load, sizeof(r.plugin_load), "%s loads, exports ncclNetPlugin_v12/v11 and ncclTunerPlugin_v5", lib);
  }
  /* no dlclose: the plugin library is never unmapped (-z nodelete), and its threads may run */
}

/* ---------------------------------------------------------------- output */
static void json_str(FILE *f, const char *s) {
  fputc('"', f);
  for (; *s; s++) {
    if (*s == '"' || *s == '\\') fprintf(f, "\\%c", *s);
    else if ((unsigned char)*s < 0x20) fprintf(f, "\\u%04x", *s);
    else fputc(*s, f);
  }
  fputc('"', f);
}

static void ptr_text(int ptr, char *out, size_t len) {
  snprintf(out, len, "%s%s%s", ptr & NCCL_PTR_HOST ? "host" : "", ptr & NCCL_PTR_CUDA ? ",cuda" : "",
           ptr & NCCL_PTR_DMABUF ? ",dmabuf" : "");
}

static void print_human(void) {
  char host[64] = "?";
  gethostname(host, sizeof(host));
  printf("mplane-doctor: node %s\n\n", host);
  printf("configuration   %s\n", r.config_error[0] ? r.config_error : "valid (every MPLANE_* variable read)");
  if (r.verbs_loaded) {
    printf("RDMA ports      %s(%s)\n", r.nports ? "" : "none ", r.verbs_lib);
    for (int i = 0; i < r.nports; i++) {
      const struct port *p = &r.ports[i];
      printf("  %-12s port %d  %-6s %-4s", p->name, p->port, p->state, p->ib ? "IB" : "RoCE");
      if (p->active) printf("  %d Gb/s", p->speed_mbps / 1000);
      printf("\n");
    }
  }
  if (r.init_result == ncclSuccess) {
    printf("NCCL will see   transport %s, %d device(s):\n", r.transport, r.ndev);
    for (int d = 0; d < r.ndev; d++) {
      const struct mplane_dev_props *p = &r.props[d];
      char ptr[32], plane[16] = "none", rail[16] = "none";
      ptr_text(p->ptr_support, ptr, sizeof(ptr));
      if (p->plane >= 0) snprintf(plane, sizeof(plane), "%d", p->plane);
      if (p->rail >= 0) snprintf(rail, sizeof(rail), "%d", p->rail);
      printf("  dev %d  %-12s plane %-4s rail %-4s %7d Mb/s  ptr %-16s%s%s pci %s\n", d, p->name, plane, rail,
             p->speed_mbps, ptr, d < MAX_ITEMS && if_state[d][0] ? "link " : "", d < MAX_ITEMS ? if_state[d] : "",
             p->pci_path[0] ? p->pci_path : "(none)");
    }
    if (!strcmp(r.transport, "ib")) {
      printf("side channel\n");
      for (int i = 0; i < r.nside; i++) printf("  %s\n", r.side[i]);
    } else {
      printf("side channel    none: the socket transport's control socket rides the device itself\n");
    }
  }
  if (r.gpus_pci || r.gpus_cuda)
    printf("GPUs            %d on PCI%s%s%s, %d through CUDA\n", r.gpus_pci, r.gpu_model[0] ? " (" : "", r.gpu_model,
           r.gpu_model[0] ? ")" : "", r.gpus_cuda);
  else
    printf("GPUs            none seen (below)\n");
  if (r.gpus_pci || r.gpus_cuda)
    printf("GPUDirect RDMA  peermem %s, dma-buf %s\n", r.peermem ? "loaded" : "not loaded",
           r.dmabuf ? "offered by the devices" : "not offered");
  /* Without MPLANE_TC_MAP a communicator's trafficClass is the SL itself, as in NCCL's net_ib (net/tc.c):
   * the class table below then only says what a map would start from. */
  if (mplane_tc_hints_choose_class())
    printf("traffic classes (MPLANE_TC_MAP: trafficClass 0..%d names a class; NCCL_IB_SL / NCCL_IB_TC where set)\n",
           MPLANE_TC_NCLASSES - 1);
  else
    printf("traffic classes MPLANE_TC_MAP unset: a communicator's trafficClass is its SL (IB) and traffic class "
           "(RoCE), as in NCCL's net_ib; without one, the default row; set MPLANE_TC_MAP to use these classes\n");
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++) {
    int sl = mplane_tc_sl(c);
    printf("  %-11s SL %-2d  RoCE traffic class %-3d  IP DSCP %-2d  adaptive routing %s\n", mplane_tc_class_name(c), sl,
           mplane_tc_roce_tclass(sl, 0), mplane_tc_dscp(sl), mplane_tc_adaptive_routing(c) ? "on" : "off");
  }
  printf("NCCL            %s\n", r.plugin_load);
  const char *np = getenv("NCCL_NET_PLUGIN");
  printf("  NCCL_NET_PLUGIN=%s\n", np ? np : "(unset: set NCCL_NET_PLUGIN=mplane in the job)");
  for (int i = 0; i < r.nnccl_set; i++) printf("  %s (set by mplane at init where unset)\n", r.nccl_set[i]);
  if (r.nunseen) {
    printf("could not see\n");
    for (int i = 0; i < r.nunseen; i++) printf("  %s: %s\n", r.unseen[i].what, r.unseen[i].fix);
  }
  printf("\n");
  if (!r.nproblems) {
    printf("verdict: READY%s\n", r.nunseen ? " (for what could be seen here)" : "");
    return;
  }
  printf("verdict: NOT READY, %d problem%s\n", r.nproblems, r.nproblems > 1 ? "s" : "");
  for (int i = 0; i < r.nproblems; i++) printf("  %d. %s\n     fix: %s\n", i + 1, r.problems[i].what, r.problems[i].fix);
}

static void json_items(FILE *f, const char *key, const struct item *it, int n, const char *k1, const char *k2) {
  fprintf(f, "  \"%s\": [", key);
  for (int i = 0; i < n; i++) {
    fprintf(f, "%s\n    {\"%s\": ", i ? "," : "", k1);
    json_str(f, it[i].what);
    fprintf(f, ", \"%s\": ", k2);
    json_str(f, it[i].fix);
    fprintf(f, "}");
  }
  fprintf(f, "%s]", n ? "\n  " : "");
}

static void print_json(void) {
  FILE *f = stdout;
  char host[64] = "?";
  gethostname(host, sizeof(host));
  fprintf(f, "{\n  \"host\": ");
  json_str(f, host);
  fprintf(f, ",\n  \"verdict\": \"%s\",\n  \"config_error\": ", r.nproblems ? "problems" : "ready");
  json_str(f, r.config_error);
  fprintf(f, ",\n  \"rdma_ports\": [");
  for (int i = 0; i < r.nports; i++) {
    const struct port *p = &r.ports[i];
    fprintf(f, "%s\n    {\"device\": ", i ? "," : "");
    json_str(f, p->name);
    fprintf(f, ", \"port\": %d, \"state\": \"%s\", \"link_layer\": \"%s\", \"speed_mbps\": %d}", p->port, p->state,
            p->ib ? "infiniband" : "ethernet", p->speed_mbps);
  }
  fprintf(f, "%s],\n  \"transport\": ", r.nports ? "\n  " : "");
  json_str(f, r.transport ? r.transport : "");
  fprintf(f, ",\n  \"devices\": [");
  for (int d = 0; r.init_result == ncclSuccess && d < r.ndev; d++) {
    const struct mplane_dev_props *p = &r.props[d];
    fprintf(f, "%s\n    {\"dev\": %d, \"name\": ", d ? "," : "", d);
    json_str(f, p->name);
    fprintf(f, ", \"plane\": %d, \"rail\": %d, \"speed_mbps\": %d, \"ptr_host\": %s, \"ptr_cuda\": %s, \"ptr_dmabuf\": %s, "
            "\"pci_path\": ", p->plane, p->rail, p->speed_mbps, p->ptr_support & NCCL_PTR_HOST ? "true" : "false",
            p->ptr_support & NCCL_PTR_CUDA ? "true" : "false", p->ptr_support & NCCL_PTR_DMABUF ? "true" : "false");
    json_str(f, p->pci_path);
    fprintf(f, "}");
  }
  fprintf(f, "%s],\n  \"side_channel\": [", r.ndev && r.init_result == ncclSuccess ? "\n  " : "");
  for (int i = 0; i < r.nside; i++) {
    fprintf(f, "%s", i ? ", " : "");
    json_str(f, r.side[i]);
  }
  fprintf(f, "],\n  \"gpus\": {\"pci\": %d, \"cuda\": %d, \"model\": ", r.gpus_pci, r.gpus_cuda);
  json_str(f, r.gpu_model);
  fprintf(f, ", \"cuda_why\": ");
  json_str(f, r.cuda_why);
  fprintf(f, "},\n  \"gpudirect\": {\"peermem\": %s, \"dmabuf\": %s},\n  \"classes\": [", r.peermem ? "true" : "false",
          r.dmabuf ? "true" : "false");
  for (int c = 0; c < MPLANE_TC_NCLASSES; c++) {
    int sl = mplane_tc_sl(c);
    fprintf(f, "%s\n    {\"class\": \"%s\", \"sl\": %d, \"roce_tclass\": %d, \"dscp\": %d, \"adaptive_routing\": %s}",
            c ? "," : "", mplane_tc_class_name(c), sl, mplane_tc_roce_tclass(sl, 0), mplane_tc_dscp(sl),
            mplane_tc_adaptive_routing(c) ? "true" : "false");
  }
  fprintf(f, "\n  ],\n  \"nccl\": {\"plugin_loads\": %s, \"plugin\": ", r.plugin_loads ? "true" : "false");
  json_str(f, r.plugin_load);
  fprintf(f, ", \"net_plugin\": ");
  json_str(f, getenv("NCCL_NET_PLUGIN") ? getenv("NCCL_NET_PLUGIN") : "");
  fprintf(f, ", \"set_by_mplane\": [");
  for (int i = 0; i < r.nnccl_set; i++) {
    fprintf(f, "%s", i ? ", " : "");
    json_str(f, r.nccl_set[i]);
  }
  fprintf(f, "]},\n");
  json_items(f, "could_not_see", r.unseen, r.nunseen, "what", "why");
  fprintf(f, ",\n");
  json_items(f, "problems", r.problems, r.nproblems, "problem", "fix");
  fprintf(f, "\n}\n");
}

static void usage(FILE *out) {
  fprintf(out,
          "usage: mplane-doctor [--json] [--verbose] [--plugin PATH]\n"
          "\n"
          "Check whether this node is ready for NCCL jobs through mplane: RDMA ports (state, speed), the\n"
          "devices and planes NCCL will see, each IB device's side channel, GPUs and GPUDirect (peermem or\n"
          "dma-buf), the SL and traffic class of each class, and whether NCCL can load the plugin. Reads\n"
          "the same MPLANE_* and NCCL_* variables as the plugin: run it with the job's environment.\n"
          "\n"
          "  --json         the report as JSON\n"
          "  --plugin PATH  the plugin library NCCL would load (default: libnccl-net-mplane.so on the\n"
          "                loader's path)\n"
          "  --verbose      the plugin's own log lines on stderr (why it chose what it chose)\n"
          "  -h, --help     this text\n"
          "\n"
          "Exit status: 0 ready, 1 problems found (each with what to do), 2 bad arguments.\n");
}

int main(int argc, char **argv) {
  static const struct option longopts[] = {
      {"json", no_argument, NULL, 'j'},    {"plugin", required_argument, NULL, 'p'},
      {"verbose", no_argument, NULL, 'v'}, {"help", no_argument, NULL, 'h'},
      {NULL, 0, NULL, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "h", longopts, NULL)) != -1) {
    switch (c) {
      case 'j': r.json = 1; break;
      case 'p': r.plugin = optarg; break;
      case 'v': r.verbose = 1; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "mplane-doctor: unexpected argument '%s'\n", argv[optind]);
    usage(stderr);
    return 2;
  }
  r.init_result = ncclInvalidUsage; /* until the plugin's init has run */
  struct mplane_config cfg;
  if (mplane_config_load(&cfg, r.config_error, sizeof(r.config_error)) != ncclSuccess) {
    problem("set the variable to the accepted form the message gives, or unset it", "configuration: %s",
            r.config_error);
  } else {
    look_at_ports(&cfg);
    look_at_plugin(&cfg);
    look_at_gpus(&cfg);
  }
  look_at_nccl();
  if (r.json) print_json();
  else print_human();
  fflush(stdout);
  _exit(r.nproblems ? 1 : 0); /* the transports' threads are not ours to join: leave at once */
}
