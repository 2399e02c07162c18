/* mplane: the node model from hwloc, live or from an hwloc XML file. */
#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <hwloc.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "../common/clock.h"
#include "../common/config.h"
#include "../common/log.h"
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
  /* Not hwloc_bitmap_foreach: an XML file may give an infinite set ("0xf...f"), which that macro
   * asserts against and would otherwise walk for minutes. The first 4096 CPUs are plenty. */
  int cpus[4096], n = 0;
  for (int i = hwloc_bitmap_first(set); i >= 0 && n < 4096; i = hwloc_bitmap_next(set, i)) cpus[n++] = i;
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
  /* At most the last eight bytes: an IPoIB address (20 bytes) ends in the port GUID, an Ethernet
   * MAC (6) is taken whole; any other length from a file is taken the same way. */
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
  for (int i = n > 8 ? n - 8 : 0; i < n; i++) m = (m << 8) | b[i];
  return m;
}

static void add_ib_details(struct mplane_topo_nic *nic, hwloc_obj_t os) {
  uint64_t guid;
  if (parse_groups64(hwloc_obj_get_info_by_name(os, "NodeGUID"), &guid) == 0 && guid) nic->guid = guid;
  /* The first port hwloc reports; its GID 0 carries the subnet prefix. */
  for (int port = 1; port <= 8; port++) {
    char key[32];
    snprintf(key, sizeof(key), "Port%dState", port);
    const char *state = hwloc_obj_get_info_by_name(os, key);
    if (!state) continue;
    nic->port = port;
    nic->down = atoi(state) != 4; /* IB_PORT_ACTIVE */
    snprintf(key, sizeof(key), "Port%dGID0", port);
    uint64_t prefix;
    const char *gid = hwloc_obj_get_info_by_name(os, key);
    /* fe80:: is every subnet's default: it tells planes apart only when the SM sets others. */
    if (parse_groups64(gid, &prefix) == 0 && mplane_ib_prefix_names_subnet(prefix)) {
      nic->has_subnet = 1;
      nic->subnet_kind = MPLANE_SUBNET_IB;
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
  /* Attributes and parents, for bridges and functions alike. A bus id an XML file lists twice
   * takes them from its first object only, and a parent that would close a loop is dropped: the
   * model's parent walks must end. */
  char seen[MPLANE_TOPO_MAX_PCI] = {0};
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
      if (i < 0 || seen[i]) continue;
      seen[i] = 1;
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
        int parent = mplane_topo_find_pci(t, pb);
        p->parent = parent >= 0 && !mplane_topo_pci_would_cycle(t, i, parent) ? parent : -1;
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

/* ------------------------------------------------------------------ hwloc XML from a file */

/* hwloc set up to read an XML buffer (buf[len] is '\0'), loaded. 0 on success; -1 when hwloc refuses
 * the buffer, with *topo destroyed. */
static int load_xml_buffer(hwloc_topology_t *topo, const char *buf, size_t len) {
  if (hwloc_topology_init(topo) != 0) return -1;
  if (hwloc_topology_set_xmlbuffer(*topo, buf, (int)len + 1) != 0) {
    hwloc_topology_destroy(*topo);
    return -1;
  }
  hwloc_topology_set_io_types_filter(*topo, HWLOC_TYPE_FILTER_KEEP_ALL);
  if (hwloc_topology_load(*topo) != 0) {
    hwloc_topology_destroy(*topo);
    return -1;
  }
  return 0;
}

/* What the check process writes back before it exits. */
#define CHECK_LOADED 'k'
#define CHECK_REFUSED 'r'

static __attribute__((noreturn)) void xml_check_child(int wfd, const char *buf, size_t len, int with_build,
                                                      int timeout_ms) {
  /* Die of whatever goes wrong, quietly: no crash handler of the host process (a sanitizer's, a
   * fuzzer's, a runtime's) may run here, and nothing is written to the host's stdout/stderr. */
  static const int fatal[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT, SIGSYS, SIGTRAP, SIGALRM};
  struct sigaction dfl;
  memset(&dfl, 0, sizeof(dfl));
  dfl.sa_handler = SIG_DFL;
  for (size_t i = 0; i < sizeof(fatal) / sizeof(fatal[0]); i++) sigaction(fatal[i], &dfl, NULL);
  sigset_t none;
  sigemptyset(&none);
  sigprocmask(SIG_SETMASK, &none, NULL);
  alarm((unsigned)(timeout_ms / 1000 + 2)); /* in case the parent is gone */
  int devnull = open("/dev/null", O_WRONLY | O_CLOEXEC);
  if (devnull >= 0) {
    dup2(devnull, 1);
    dup2(devnull, 2);
  }
  char verdict = CHECK_REFUSED;
  hwloc_topology_t topo;
  if (load_xml_buffer(&topo, buf, len) == 0) {
    if (with_build) {
      struct mplane_topo *scratch = malloc(sizeof(*scratch));
      if (scratch) {
        mplane_topo_init(scratch);
        build(scratch, topo);
      }
    }
    verdict = CHECK_LOADED;
  }
  ssize_t w = write(wfd, &verdict, 1);
  (void)w;
  _exit(0);
}

static int64_t now_ms(void) { return (int64_t)(mplane_now_ns() / 1000000u); }

int mplane_topo_xml_check(const char *buf, size_t len, int timeout_ms, int with_build, char *why, size_t whylen) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) {
    snprintf(why, whylen, "no check process could be started (pipe: %s)", strerror(errno));
    return -1;
  }
  pid_t pid = fork();
  if (pid < 0) {
    snprintf(why, whylen, "no check process could be started (fork: %s)", strerror(errno));
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    close(fds[0]);
    xml_check_child(fds[1], buf, len, with_build, timeout_ms);
  }
  close(fds[1]);
  char verdict = 0;
  int got = 0, timed_out = 0;
  int64_t deadline = now_ms() + timeout_ms;
  for (;;) {
    int64_t left = deadline - now_ms();
    if (left <= 0) {
      timed_out = 1;
      break;
    }
    struct pollfd pfd = {.fd = fds[0], .events = POLLIN};
    int r = poll(&pfd, 1, (int)left);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      timed_out = r == 0;
      break;
    }
    ssize_t k = read(fds[0], &verdict, 1);
    if (k < 0 && errno == EINTR) continue;
    got = k == 1;
    break;
  }
  close(fds[0]);
  if (timed_out) kill(pid, SIGKILL);
  /* Reap it. A host that ignores SIGCHLD has it reaped already (ECHILD): then no status. */
  int status = 0, have_status = 0;
  for (int64_t until = now_ms() + 2000; now_ms() < until;) {
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      have_status = 1;
      break;
    }
    if (r < 0 && errno != EINTR) break;
    struct timespec ms = {0, 1000000};
    nanosleep(&ms, NULL);
  }
  if (timed_out) {
    snprintf(why, whylen, "hwloc did not finish loading it within %d s (in a check process, since killed)",
             timeout_ms / 1000);
    return -1;
  }
  if (got && verdict == CHECK_LOADED) return 0;
  if (got && verdict == CHECK_REFUSED) return 1;
  if (have_status && WIFSIGNALED(status))
    snprintf(why, whylen, "loading it crashed hwloc (signal %d, %s) in a check process", WTERMSIG(status),
             strsignal(WTERMSIG(status)));
  else
    snprintf(why, whylen, "loading it ended a check process before hwloc finished (exit status %d)",
             have_status && WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  return -1;
}

/* hwloc reads the bitmap attributes (cpuset, nodeset and their complete_/allowed_ forms) with
 * hwloc_bitmap_sscanf, which reads past the end of an empty one and fails an assertion on others
 * (",1"). lstopo writes a bitmap as hex words, comma separated, each "0x" and 1..16 digits, the
 * first of an infinite set "0xf...f". 0 when every bitmap attribute of buf has that form; else -1
 * with the first offender in why. */
static int bitmap_text_ok(const char *v, size_t n) {
  size_t i = 0;
  if (n >= 7 && memcmp(v, "0xf...f", 7) == 0) {
    if (n == 7) return 1;
    if (v[7] != ',') return 0;
    i = 8;
  }
  for (;;) {
    if (i + 1 < n && v[i] == '0' && (v[i + 1] == 'x' || v[i + 1] == 'X')) i += 2;
    size_t digits = 0;
    while (i < n && isxdigit((unsigned char)v[i])) i++, digits++;
    if (digits == 0 || digits > 16) return 0;
    if (i == n) return 1;
    if (v[i] != ',') return 0;
    i++;
  }
}

static int check_bitmap_attrs(const char *buf, size_t len, char *why, size_t whylen) {
  static const char *const names[] = {"cpuset", "complete_cpuset", "allowed_cpuset",
                                      "nodeset", "complete_nodeset", "allowed_nodeset"};
  const char *end = buf + len;
  for (const char *p = buf; (p = memmem(p, (size_t)(end - p), "set=\"", 5)) != NULL; p += 5) {
    const char *nb = p + 3; /* one past "set" */
    while (nb > buf && (islower((unsigned char)nb[-1]) || nb[-1] == '_')) nb--;
    if (nb == buf || !isspace((unsigned char)nb[-1])) continue;
    size_t nlen = (size_t)(p + 3 - nb);
    int known = 0;
    for (size_t k = 0; k < sizeof(names) / sizeof(names[0]); k++)
      known |= strlen(names[k]) == nlen && memcmp(names[k], nb, nlen) == 0;
    if (!known) continue;
    const char *v = p + 5, *q = memchr(v, '"', (size_t)(end - v));
    if (!q) return 0; /* unterminated: hwloc's parser refuses it */
    if (!bitmap_text_ok(v, (size_t)(q - v))) {
      int line = 1;
      for (const char *c = buf; c < nb; c++) line += *c == '\n';
      snprintf(why, whylen, "%.*s=\"%.*s\" (line %d) is not a bitmap as lstopo writes one (hex words, "
               "comma separated, e.g. 0x000000ff,0xffffffff)", (int)nlen, nb, (int)((q - v) < 40 ? q - v : 40), v,
               line);
      return -1;
    }
  }
  return 0;
}

ncclResult_t mplane_topo_from_hwloc_xml(struct mplane_topo *t, const char *buf, size_t len, const char *name,
                                        const char *what, int check_timeout_ms, char *err, size_t errlen) {
  if (!memmem(buf, len < 512 ? len : 512, "<topology", 9) && !memmem(buf, len < 512 ? len : 512, "<?xml", 5)) {
    snprintf(err, errlen, "%s='%s' is not an hwloc XML file (no <topology> element at its start); write one "
             "with: lstopo --of xml FILE", what, name);
    return ncclInvalidArgument;
  }
  char why[320];
  if (check_bitmap_attrs(buf, len, why, sizeof(why)) != 0) {
    snprintf(err, errlen, "%s='%s' is not a valid hwloc XML topology: %s", what, name, why);
    return ncclInvalidArgument;
  }
  if (check_timeout_ms > 0) {
    /* hwloc 2.9 reads some malformed attributes (cpusets above all) past their end or through a
     * NULL pointer: a broken file must cost NCCL this file, not the process. So hwloc (and the
     * model built from it) first load the file in a short-lived child. */
    int rc = mplane_topo_xml_check(buf, len, check_timeout_ms, 1, why, sizeof(why));
    if (rc < 0) {
      snprintf(err, errlen, "%s='%s' was refused: %s; mplane does not load it into this process. The file is "
               "not an hwloc XML topology as lstopo writes it: write a new one with lstopo --of xml FILE, or "
               "unset %s", what, name, why, what);
      return ncclInvalidArgument;
    }
    if (rc > 0) {
      snprintf(err, errlen, "%s='%s' is not a valid hwloc XML topology (hwloc could not load it; HWLOC_XML_VERBOSE=1 "
               "lstopo --input '%s' says where)", what, name, name);
      return ncclInvalidArgument;
    }
  }
  hwloc_topology_t topo;
  if (load_xml_buffer(&topo, buf, len) != 0) {
    snprintf(err, errlen, "%s='%s' is not a valid hwloc XML topology (hwloc could not load it; HWLOC_XML_VERBOSE=1 "
             "lstopo --input '%s' says where)", what, name, name);
    return ncclInvalidArgument;
  }
  ncclResult_t res = build(t, topo);
  hwloc_topology_destroy(topo);
  t->from_file = 1;
  snprintf(t->source, sizeof(t->source), "hwloc XML %s", name);
  return res;
}

/* The whole file, NUL-terminated, into a malloc'ed buffer; a regular file only (a FIFO would block
 * init forever) of at most MPLANE_TOPO_XML_MAX_BYTES. */
static ncclResult_t read_xml_file(const char *path, const char *what, char **out, size_t *outlen, char *err,
                                  size_t errlen) {
  int fd = mplane_open_regular_file(what, path, "an hwloc XML file (lstopo --of xml)", err, errlen);
  if (fd == -1)
    snprintf(err, errlen, "%s='%s' cannot be read: %s; expected an hwloc XML file (lstopo --of xml)", what, path,
             strerror(errno));
  if (fd < 0) return ncclInvalidArgument;
  size_t cap = 64 << 10, len = 0;
  char *buf = malloc(cap + 1);
  ncclResult_t res = ncclSuccess;
  while (buf) {
    if (len == cap) {
      if (cap >= MPLANE_TOPO_XML_MAX_BYTES) {
        snprintf(err, errlen, "%s='%s' is larger than %d MiB: not an hwloc XML file of one node", what, path,
                 MPLANE_TOPO_XML_MAX_BYTES >> 20);
        res = ncclInvalidArgument;
        break;
      }
      size_t ncap = cap * 2 > MPLANE_TOPO_XML_MAX_BYTES ? MPLANE_TOPO_XML_MAX_BYTES : cap * 2;
      char *nb = realloc(buf, ncap + 1);
      if (!nb) break;
      buf = nb;
      cap = ncap;
    }
    ssize_t k = read(fd, buf + len, cap - len);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      snprintf(err, errlen, "%s='%s' cannot be read: %s; expected an hwloc XML file (lstopo --of xml)", what, path,
               strerror(errno));
      res = ncclInvalidArgument;
      break;
    }
    if (k == 0) break;
    len += (size_t)k;
  }
  close(fd);
  if (!buf) {
    snprintf(err, errlen, "%s='%s': out of memory", what, path);
    return ncclSystemError;
  }
  if (res != ncclSuccess) {
    free(buf);
    return res;
  }
  buf[len] = '\0';
  *out = buf;
  *outlen = len;
  return ncclSuccess;
}

ncclResult_t mplane_topo_from_hwloc(struct mplane_topo *t, const char *xml_path, const char *xml_input, char *err,
                                    size_t errlen) {
  if (xml_path) {
    const char *what = xml_input && *xml_input ? xml_input : "topology file";
    char *buf;
    size_t len;
    ncclResult_t res = read_xml_file(xml_path, what, &buf, &len, err, errlen);
    if (res != ncclSuccess) return res;
    res = mplane_topo_from_hwloc_xml(t, buf, len, xml_path, what, MPLANE_TOPO_XML_CHECK_MS, err, errlen);
    free(buf);
    return res;
  }
  hwloc_topology_t topo;
  if (hwloc_topology_init(&topo) != 0) {
    snprintf(err, errlen, "hwloc_topology_init failed: %s", strerror(errno));
    return ncclSystemError;
  }
  /* GPU components would initialize CUDA or OpenCL inside NCCL's process: leave them out. The
   * libpciaccess one ("pci") leaks and loads more libraries; hwloc's Linux backend reads the same
   * PCI tree from sysfs without it (as it does where libhwloc-plugins is not installed). */
  const char *skip[] = {"cuda", "opencl", "rsmi", "levelzero", "gl", "pci"};
  for (size_t i = 0; i < sizeof(skip) / sizeof(skip[0]); i++)
    hwloc_topology_set_components(topo, HWLOC_TOPOLOGY_COMPONENTS_FLAG_BLACKLIST, skip[i]);
  hwloc_topology_set_io_types_filter(topo, HWLOC_TYPE_FILTER_KEEP_IMPORTANT);
  if (hwloc_topology_load(topo) != 0) {
    snprintf(err, errlen, "hwloc could not read this machine: %s", strerror(errno));
    hwloc_topology_destroy(topo);
    return ncclSystemError;
  }
  ncclResult_t res = build(t, topo);
  hwloc_topology_destroy(topo);
  snprintf(t->source, sizeof(t->source), "hwloc (live)");
  return res;
}
