/* mplane: the node's NCCL topology XML (what NCCL_TOPO_FILE reads).
 *
 * The tree is the one NCCL itself builds from sysfs: under <system version="1">, one <cpu> per NUMA
 * node; under it a <pci> per PCIe switch (its upstream port: NCCL skips every second bridge going
 * up, the downstream and root ports), then the GPU and NIC functions. A NIC function holds
 * <nic><net name=... dev=... speed=... port=... guid=... plane=... rail=.../></nic>. NCCL keeps the
 * attributes it finds (it sets only the missing ones), so plane and rail reach its graph search,
 * and it trims what this process does not use (other GPUs, NICs of no plugin).
 *
 * NCCL's parser is strict: no XML declaration, no comments needed, double quotes, one space
 * between attributes, at most 16 attributes a node. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "../common/log.h"
#include "topo_internal.h"

struct writer {
  const struct mplane_topo *t;
  FILE *out;
  int in_xml[MPLANE_TOPO_MAX_PCI];
  int nparent[MPLANE_TOPO_MAX_PCI]; /* NCCL parent: a pci index, or -1 for the CPU */
  int nic_of_pci[MPLANE_TOPO_MAX_PCI];
  int devno[MPLANE_TOPO_MAX_NICS];
};

static void put_attr_str(FILE *out, const char *key, const char *v) {
  fprintf(out, " %s=\"", key);
  for (; *v; v++) {
    switch (*v) {
      case '"': fputs("&quot;", out); break;
      case '<': fputs("&lt;", out); break;
      case '>': fputs("&gt;", out); break;
      case '&': fputs("&amp;", out); break;
      default: fputc(*v, out);
    }
  }
  fputc('"', out);
}

static void indent(FILE *out, int n) {
  for (int i = 0; i < n; i++) fputc(' ', out);
}

static void write_net(struct writer *w, int n, int ind) {
  const struct mplane_topo_nic *nic = &w->t->nics[n];
  indent(w->out, ind);
  fprintf(w->out, "<net");
  put_attr_str(w->out, "name", nic->name);
  fprintf(w->out, " dev=\"%d\"", w->devno[n]);
  if (nic->speed_mbps > 0) fprintf(w->out, " speed=\"%d\"", nic->speed_mbps);
  fprintf(w->out, " port=\"%d\"", nic->port);
  fprintf(w->out, " guid=\"0x%llx\"", (unsigned long long)nic->guid);
  if (nic->plane >= 0) fprintf(w->out, " plane=\"%d\"", nic->plane);
  if (nic->rail >= 0) fprintf(w->out, " rail=\"%d\"", nic->rail);
  fprintf(w->out, "/>\n");
}

static int cmp_busid_idx(const void *a, const void *b, void *ctx) {
  const struct mplane_topo *t = ctx;
  return strcmp(t->pci[*(const int *)a].busid, t->pci[*(const int *)b].busid);
}

static void write_pci(struct writer *w, int i, int ind) {
  const struct mplane_topo *t = w->t;
  const struct mplane_topo_pci *p = &t->pci[i];
  int kids[MPLANE_TOPO_MAX_PCI], nk = 0;
  for (int j = 0; j < t->npci; j++)
    if (w->in_xml[j] && w->nparent[j] == i) kids[nk++] = j;
  qsort_r(kids, (size_t)nk, sizeof(int), cmp_busid_idx, (void *)t);
  int nic = w->nic_of_pci[i];
  indent(w->out, ind);
  fprintf(w->out, "<pci busid=\"%s\" class=\"0x%06x\" vendor=\"0x%04x\" device=\"0x%04x\" subsystem_vendor=\"0x%04x\" "
                  "subsystem_device=\"0x%04x\"",
          p->busid, p->class_code, p->vendor, p->device, p->subvendor, p->subdevice);
  if (nk == 0 && nic < 0) {
    fprintf(w->out, "/>\n");
    return;
  }
  fprintf(w->out, ">\n");
  for (int k = 0; k < nk; k++) write_pci(w, kids[k], ind + 2);
  if (nic >= 0) {
    indent(w->out, ind + 2);
    fprintf(w->out, "<nic>\n");
    write_net(w, nic, ind + 4);
    indent(w->out, ind + 2);
    fprintf(w->out, "</nic>\n");
  }
  indent(w->out, ind);
  fprintf(w->out, "</pci>\n");
}

static void mark(struct writer *w, int pci) {
  int chain[32];
  int n = mplane_topo_nccl_parents(w->t, pci, chain, 32);
  int prev = pci;
  w->in_xml[pci] = 1;
  for (int k = 0; k < n; k++) {
    w->nparent[prev] = chain[k];
    w->in_xml[chain[k]] = 1;
    prev = chain[k];
  }
  w->nparent[prev] = -1;
}

static const char *numa_affinity(const struct mplane_topo *t, int numa) {
  for (int i = 0; i < t->nnuma; i++)
    if (t->numa[i].os_index == numa && t->numa[i].affinity[0]) return t->numa[i].affinity;
  return t->all_cpus[0] ? t->all_cpus : NULL;
}

static void write_cpu_open(const struct mplane_topo *t, FILE *out, int numa) {
  fprintf(out, "  <cpu numaid=\"%d\"", numa);
  const char *aff = numa_affinity(t, numa);
  if (aff) put_attr_str(out, "affinity", aff);
  if (t->cpu_arch[0]) put_attr_str(out, "arch", t->cpu_arch);
  if (t->cpu_vendor[0]) put_attr_str(out, "vendor", t->cpu_vendor);
  if (t->cpu_family >= 0) fprintf(out, " familyid=\"%d\"", t->cpu_family);
  if (t->cpu_model >= 0) fprintf(out, " modelid=\"%d\"", t->cpu_model);
  fprintf(out, ">\n");
}

static int cmp_int(const void *a, const void *b) { return *(const int *)a - *(const int *)b; }

ncclResult_t mplane_topo_write_nccl_xml(const struct mplane_topo *t, FILE *out) {
  struct writer *w = calloc(1, sizeof(*w));
  if (!w) return ncclSystemError;
  w->t = t;
  w->out = out;
  for (int i = 0; i < t->npci; i++) w->nic_of_pci[i] = -1;
  /* dev numbers: the plugin's own; the NICs it does not drive after them (NCCL trims those). */
  int next_dev = 0;
  for (int n = 0; n < t->nnics; n++)
    if (t->nics[n].dev >= next_dev) next_dev = t->nics[n].dev + 1;
  for (int n = 0; n < t->nnics; n++) w->devno[n] = t->nics[n].dev >= 0 ? t->nics[n].dev : next_dev++;

  for (int g = 0; g < t->ngpus; g++) mark(w, t->gpus[g].pci);
  int nvirtual = 0;
  for (int n = 0; n < t->nnics; n++) {
    if (t->nics[n].pci < 0) {
      nvirtual++;
      continue;
    }
    mark(w, t->nics[n].pci);
    w->nic_of_pci[t->nics[n].pci] = n;
  }
  /* The CPUs (NUMA nodes) that hold something. */
  int cpus[MPLANE_TOPO_MAX_NUMA + 1], ncpus = 0;
  for (int i = 0; i < t->npci; i++) {
    if (!w->in_xml[i] || w->nparent[i] != -1) continue;
    int numa = t->pci[i].numa, seen = 0;
    for (int c = 0; c < ncpus; c++) seen |= cpus[c] == numa;
    if (!seen && ncpus <= MPLANE_TOPO_MAX_NUMA) cpus[ncpus++] = numa;
  }
  qsort(cpus, (size_t)ncpus, sizeof(int), cmp_int);
  /* NICs with no PCI device go under the first CPU, as NCCL attaches them. */
  int virt_cpu = -2;
  if (nvirtual) {
    for (int c = 0; c < ncpus && virt_cpu == -2; c++)
      if (cpus[c] >= 0) virt_cpu = cpus[c];
    if (virt_cpu == -2 && ncpus) virt_cpu = cpus[0];
    if (virt_cpu == -2) {
      virt_cpu = t->nnuma ? t->numa[0].os_index : -1;
      cpus[ncpus++] = virt_cpu;
      qsort(cpus, (size_t)ncpus, sizeof(int), cmp_int);
    }
  }

  fprintf(out, "<system version=\"1\">\n");
  for (int c = 0; c < ncpus; c++) {
    write_cpu_open(t, out, cpus[c]);
    int tops[MPLANE_TOPO_MAX_PCI], nt = 0;
    for (int i = 0; i < t->npci; i++)
      if (w->in_xml[i] && w->nparent[i] == -1 && t->pci[i].numa == cpus[c]) tops[nt++] = i;
    qsort_r(tops, (size_t)nt, sizeof(int), cmp_busid_idx, (void *)t);
    for (int k = 0; k < nt; k++) write_pci(w, tops[k], 4);
    if (nvirtual && cpus[c] == virt_cpu) {
      fprintf(out, "    <nic>\n");
      for (int n = 0; n < t->nnics; n++)
        if (t->nics[n].pci < 0) write_net(w, n, 6);
      fprintf(out, "    </nic>\n");
    }
    fprintf(out, "  </cpu>\n");
  }
  fprintf(out, "</system>\n");
  free(w);
  fflush(out);
  return ferror(out) ? ncclSystemError : ncclSuccess;
}

ncclResult_t mplane_topo_nccl_xml_memfd(const struct mplane_topo *t, char *path, size_t pathlen) {
  /* Not close-on-exec: a child that inherits NCCL_TOPO_FILE finds the same file at the same fd. */
  int fd = memfd_create("mplane-nccl-topo", MFD_ALLOW_SEALING);
  if (fd < 0) {
    MP_WARN("topo: memfd_create failed: %s; NCCL_TOPO_FILE not written", strerror(errno));
    return ncclSystemError;
  }
  char *buf = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  if (!mem) {
    close(fd);
    return ncclSystemError;
  }
  ncclResult_t res = mplane_topo_write_nccl_xml(t, mem);
  fclose(mem);
  size_t off = 0;
  while (res == ncclSuccess && off < len) {
    ssize_t k = write(fd, buf + off, len - off);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) {
      MP_WARN("topo: writing the NCCL topology to its memfd failed: %s", strerror(errno));
      res = ncclSystemError;
      break;
    }
    off += (size_t)k;
  }
  free(buf);
  if (res != ncclSuccess) {
    close(fd);
    return res;
  }
  (void)fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_WRITE | F_SEAL_SEAL);
  snprintf(path, pathlen, "/proc/self/fd/%d", fd);
  return ncclSuccess;
}
