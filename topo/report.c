/* mplane: the node as text: table, picture of the planes, JSON, NCCL settings (mplane-topo). */
#include <string.h>

#include "topo_internal.h"

static const char *role(const struct mplane_topo_nic *n) {
  if (n->compute) return "compute";
  if (n->excluded) return "excluded";
  return "storage/front-end";
}

/* "0-3,6" from the GPUs paired with NIC n. */
static void gpus_of_nic(const struct mplane_topo *t, int n, char *buf, size_t len) {
  size_t o = 0;
  buf[0] = '\0';
  for (int g = 0; g < t->ngpus; g++) {
    if (t->gpus[g].nic != n) continue;
    int e = g;
    while (e + 1 < t->ngpus && t->gpus[e + 1].nic == n) e++;
    int k = e > g ? snprintf(buf + o, len - o, "%s%d-%d", o ? "," : "", g, e)
                  : snprintf(buf + o, len - o, "%s%d", o ? "," : "", g);
    if (k < 0 || o + (size_t)k >= len) break;
    o += (size_t)k;
    g = e;
  }
  if (!buf[0]) snprintf(buf, len, "-");
}

static void num_or_dash(char *buf, size_t len, int v) {
  if (v < 0) snprintf(buf, len, "-");
  else snprintf(buf, len, "%d", v);
}

static int count_rdma(const struct mplane_topo *t) {
  int k = 0;
  for (int i = 0; i < t->nnics; i++) k += t->nics[i].kind == MPLANE_TOPO_NIC_RDMA;
  return k;
}

static void print_summary(const struct mplane_topo *t, FILE *out) {
  int ncompute = 0;
  for (int i = 0; i < t->nnics; i++) ncompute += t->nics[i].compute;
  fprintf(out, "node %s, from %s\n", t->hostname[0] ? t->hostname : "(unnamed)", t->source);
  fprintf(out, "%d GPU%s, %d NIC%s (%d compute, %d other), %d NUMA node%s; ", t->ngpus, t->ngpus == 1 ? "" : "s",
          t->nnics, t->nnics == 1 ? "" : "s", ncompute, t->nnics - ncompute, t->nnuma, t->nnuma == 1 ? "" : "s");
  if (t->nplanes)
    fprintf(out, "%d plane%s from %s\n", t->nplanes, t->nplanes == 1 ? "" : "s",
            mplane_topo_plane_source_name(t->plane_source));
  else
    fprintf(out, "no plane\n");
  int rdma = count_rdma(t);
  if (rdma)
    fprintf(out, "RDMA NICs: %d (InfiniBand/RoCE verbs devices)\n", rdma);
  else
    fprintf(out, "RDMA NICs: none (no InfiniBand/RoCE verbs device): mplane will use TCP sockets\n");
  if (t->ngpus == 0) fprintf(out, "GPUs: none: every NIC counts as a compute NIC\n");
  if (t->cuda_visible_set) fprintf(out, "CUDA_VISIBLE_DEVICES=%s\n", t->cuda_visible);
}

void mplane_topo_print_table(const struct mplane_topo *t, FILE *out) {
  print_summary(t, out);
  int wmodel = 5, wname = 3, wnet = 6, wsub = 6;
  for (int g = 0; g < t->ngpus; g++)
    if ((int)strlen(t->gpus[g].model) > wmodel) wmodel = (int)strlen(t->gpus[g].model);
  for (int n = 0; n < t->nnics; n++) {
    if ((int)strlen(t->nics[n].name) > wname) wname = (int)strlen(t->nics[n].name);
    if ((int)strlen(t->nics[n].netdev) > wnet) wnet = (int)strlen(t->nics[n].netdev);
    if ((int)strlen(t->nics[n].subnet) > wsub) wsub = (int)strlen(t->nics[n].subnet);
  }
  if (t->ngpus) {
    fprintf(out, "\n%-4s %-4s %-12s %-4s %-*s %-*s %-4s %s\n", "GPU", "CUDA", "PCI bus id", "NUMA", wmodel, "model",
            wname, "NIC", "link", "plane");
    for (int g = 0; g < t->ngpus; g++) {
      const struct mplane_topo_gpu *gpu = &t->gpus[g];
      char cuda[8], numa[8], plane[8];
      if (gpu->cuda_dev == -2) snprintf(cuda, sizeof(cuda), "?");
      else num_or_dash(cuda, sizeof(cuda), gpu->cuda_dev);
      num_or_dash(numa, sizeof(numa), gpu->numa);
      num_or_dash(plane, sizeof(plane), gpu->nic >= 0 ? t->nics[gpu->nic].plane : -1);
      fprintf(out, "%-4d %-4s %-12s %-4s %-*s %-*s %-4s %s\n", g, cuda, gpu->busid, numa, wmodel, gpu->model, wname,
              gpu->nic >= 0 ? t->nics[gpu->nic].name : "-", gpu->nic >= 0 ? mplane_topo_link_name(gpu->link) : "-",
              plane);
    }
  }
  if (t->nnics) {
    fprintf(out, "\n%-*s %-8s %-*s %-12s %-4s %-17s %-5s %-5s %-4s %-13s %-*s %s\n", wname, "NIC", "kind", wnet,
            "netdev", "PCI bus id", "NUMA", "role", "GPUs", "plane", "rail", "plane from", wsub, "subnet", "speed");
    for (int n = 0; n < t->nnics; n++) {
      const struct mplane_topo_nic *nic = &t->nics[n];
      char numa[8], plane[8], rail[8], gpus[64], speed[24];
      num_or_dash(numa, sizeof(numa), nic->numa);
      num_or_dash(plane, sizeof(plane), nic->plane);
      num_or_dash(rail, sizeof(rail), nic->rail);
      gpus_of_nic(t, n, gpus, sizeof(gpus));
      if (nic->speed_mbps > 0) snprintf(speed, sizeof(speed), "%d Gb/s", nic->speed_mbps / 1000);
      else snprintf(speed, sizeof(speed), "?");
      fprintf(out, "%-*s %-8s %-*s %-12s %-4s %-17s %-5s %-5s %-4s %-13s %-*s %s\n", wname, nic->name,
              mplane_topo_nic_kind_name(nic->kind), wnet, nic->netdev[0] ? nic->netdev : "-",
              nic->busid[0] ? nic->busid : "-", numa, role(nic), gpus, plane, rail,
              nic->plane >= 0 ? mplane_topo_plane_source_name(nic->plane_source) : "-", wsub,
              nic->subnet[0] ? nic->subnet : "-", speed);
    }
  }
  if (!t->ngpus && !t->nnics) fprintf(out, "\nno GPU and no NIC found\n");
}

/* ------------------------------------------------------------------ picture */

/* Where a PCI function sits, at the top: its outermost switch, else its host bridge. */
static void location(const struct mplane_topo *t, int pci, char *buf, size_t len) {
  if (pci < 0) {
    snprintf(buf, len, "no PCI device");
    return;
  }
  int chain[32];
  int n = mplane_topo_nccl_parents(t, pci, chain, 32);
  if (n > 0) {
    snprintf(buf, len, "switch %s", t->pci[chain[n - 1]].busid);
    return;
  }
  int hb = t->pci[pci].hostbridge;
  if (hb >= 0) snprintf(buf, len, "host bridge %s", t->hostbridge_name[hb]);
  else snprintf(buf, len, "root complex");
}

static int numa_of_pci(const struct mplane_topo *t, int pci) { return pci >= 0 ? t->pci[pci].numa : -1; }

void mplane_topo_print_picture(const struct mplane_topo *t, FILE *out) {
  fprintf(out, "\nPlanes: one network each, sharing no switch; mplane never sends across them\n");
  if (!t->ngpus && !t->nnics) {
    fprintf(out, "  (nothing to draw: no GPU and no NIC)\n");
    return;
  }
  int wname = 3;
  for (int n = 0; n < t->nnics; n++)
    if ((int)strlen(t->nics[n].name) > wname) wname = (int)strlen(t->nics[n].name);
  /* NUMA nodes in order, unknown last. */
  int numas[MPLANE_TOPO_MAX_NUMA + 1], nn = 0;
  for (int pass = 0; pass < 2; pass++) {
    int items = pass == 0 ? t->ngpus : t->nnics;
    for (int i = 0; i < items; i++) {
      int numa = pass == 0 ? t->gpus[i].numa : numa_of_pci(t, t->nics[i].pci);
      int seen = 0;
      for (int k = 0; k < nn; k++) seen |= numas[k] == numa;
      if (!seen && nn <= MPLANE_TOPO_MAX_NUMA) numas[nn++] = numa;
    }
  }
  for (int a = 0; a < nn; a++)
    for (int b = a + 1; b < nn; b++)
      if ((numas[b] >= 0 && (numas[a] < 0 || numas[b] < numas[a]))) {
        int x = numas[a];
        numas[a] = numas[b];
        numas[b] = x;
      }
  for (int k = 0; k < nn; k++) {
    if (numas[k] >= 0) fprintf(out, "NUMA %d\n", numas[k]);
    else fprintf(out, "NUMA ? (no affinity)\n");
    /* Locations in PCI order of their first member. */
    char done[MPLANE_TOPO_MAX_GPUS + MPLANE_TOPO_MAX_NICS] = {0};
    for (;;) {
      /* the first member not drawn yet, by bus id (GPUs and NICs together) */
      int pick = -1;
      const char *pick_bus = NULL;
      for (int i = 0; i < t->ngpus + t->nnics; i++) {
        if (done[i]) continue;
        int is_gpu = i < t->ngpus;
        int pci = is_gpu ? t->gpus[i].pci : t->nics[i - t->ngpus].pci;
        if (numa_of_pci(t, pci) != numas[k]) continue;
        const char *bus = is_gpu ? t->gpus[i].busid : t->nics[i - t->ngpus].busid;
        if (pick < 0 || (bus[0] && (!pick_bus[0] || strcmp(bus, pick_bus) < 0))) {
          pick = i;
          pick_bus = bus;
        }
      }
      if (pick < 0) break;
      char loc[64];
      int pick_pci = pick < t->ngpus ? t->gpus[pick].pci : t->nics[pick - t->ngpus].pci;
      location(t, pick_pci, loc, sizeof(loc));
      fprintf(out, "  %s\n", loc);
      /* Everything at that location: GPUs with their NIC, then NICs no GPU here draws. */
      for (int g = 0; g < t->ngpus; g++) {
        char l2[64];
        if (done[g] || numa_of_pci(t, t->gpus[g].pci) != numas[k]) continue;
        location(t, t->gpus[g].pci, l2, sizeof(l2));
        if (strcmp(l2, loc) != 0) continue;
        done[g] = 1;
        const struct mplane_topo_gpu *gpu = &t->gpus[g];
        if (gpu->nic < 0) {
          fprintf(out, "    GPU%-2d %s  (no NIC)\n", g, gpu->busid);
          continue;
        }
        const struct mplane_topo_nic *nic = &t->nics[gpu->nic];
        char arrow[16];
        snprintf(arrow, sizeof(arrow), "--%s-->", mplane_topo_link_name(gpu->link));
        fprintf(out, "    GPU%-2d %s %-9s %-*s ==== plane %d\n", g, gpu->busid, arrow, wname, nic->name, nic->plane);
      }
      for (int n = 0; n < t->nnics; n++) {
        char l2[64];
        const struct mplane_topo_nic *nic = &t->nics[n];
        if (done[t->ngpus + n] || numa_of_pci(t, nic->pci) != numas[k]) continue;
        location(t, nic->pci, l2, sizeof(l2));
        if (strcmp(l2, loc) != 0) continue;
        done[t->ngpus + n] = 1;
        int drawn = 0;
        for (int g = 0; g < t->ngpus; g++) {
          char l3[64];
          location(t, t->gpus[g].pci, l3, sizeof(l3));
          drawn |= t->gpus[g].nic == n && strcmp(l3, loc) == 0;
        }
        if (drawn) continue;
        const char *bus = nic->busid[0] ? nic->busid : "(virtual)";
        if (nic->plane >= 0) {
          char gpus[64];
          gpus_of_nic(t, n, gpus, sizeof(gpus));
          fprintf(out, "    %-*s %-12s ==== plane %d%s%s%s\n", wname, nic->name, bus, nic->plane,
                  t->ngpus ? "  (GPUs " : "", t->ngpus ? gpus : "", t->ngpus ? ")" : "");
        } else {
          fprintf(out, "    %-*s %-12s      %s: on no plane\n", wname, nic->name, bus, role(nic));
        }
      }
    }
  }
}

/* ------------------------------------------------------------------ JSON */

static void json_str(FILE *out, const char *s) {
  fputc('"', out);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') fprintf(out, "\\%c", c);
    else if (c < 0x20) fprintf(out, "\\u%04x", c);
    else fputc(c, out);
  }
  fputc('"', out);
}

static void json_str_or_null(FILE *out, const char *s) {
  if (s && *s) json_str(out, s);
  else fputs("null", out);
}

void mplane_topo_print_json(const struct mplane_topo *t, FILE *out) {
  fputs("{\n  \"hostname\": ", out);
  json_str(out, t->hostname);
  fputs(",\n  \"source\": ", out);
  json_str(out, t->source);
  fprintf(out, ",\n  \"numa_nodes\": [");
  for (int i = 0; i < t->nnuma; i++) fprintf(out, "%s%d", i ? ", " : "", t->numa[i].os_index);
  fprintf(out, "],\n  \"planes\": %d,\n  \"plane_source\": ", t->nplanes);
  json_str(out, mplane_topo_plane_source_name(t->plane_source));
  fprintf(out, ",\n  \"rdma_nics\": %d,\n  \"cuda_visible_devices\": ", count_rdma(t));
  if (t->cuda_visible_set) json_str(out, t->cuda_visible);
  else fputs("null", out);
  fputs(",\n  \"gpus\": [", out);
  for (int g = 0; g < t->ngpus; g++) {
    const struct mplane_topo_gpu *gpu = &t->gpus[g];
    fprintf(out, "%s\n    {\"index\": %d, \"cuda\": ", g ? "," : "", g);
    if (gpu->cuda_dev >= 0) fprintf(out, "%d", gpu->cuda_dev);
    else fputs(gpu->cuda_dev == -1 ? "\"hidden\"" : "\"unknown\"", out);
    fputs(", \"busid\": ", out);
    json_str(out, gpu->busid);
    fputs(", \"numa\": ", out);
    if (gpu->numa >= 0) fprintf(out, "%d", gpu->numa);
    else fputs("null", out);
    fputs(", \"model\": ", out);
    json_str(out, gpu->model);
    fputs(", \"uuid\": ", out);
    json_str_or_null(out, gpu->uuid);
    fputs(", \"nic\": ", out);
    json_str_or_null(out, gpu->nic >= 0 ? t->nics[gpu->nic].name : NULL);
    fputs(", \"link\": ", out);
    json_str_or_null(out, gpu->nic >= 0 ? mplane_topo_link_name(gpu->link) : NULL);
    fputs(", \"plane\": ", out);
    if (gpu->nic >= 0 && t->nics[gpu->nic].plane >= 0) fprintf(out, "%d}", t->nics[gpu->nic].plane);
    else fputs("null}", out);
  }
  fputs(t->ngpus ? "\n  ],\n  \"nics\": [" : "],\n  \"nics\": [", out);
  for (int n = 0; n < t->nnics; n++) {
    const struct mplane_topo_nic *nic = &t->nics[n];
    fprintf(out, "%s\n    {\"name\": ", n ? "," : "");
    json_str(out, nic->name);
    fputs(", \"ibdev\": ", out);
    json_str_or_null(out, nic->ibdev);
    fputs(", \"netdev\": ", out);
    json_str_or_null(out, nic->netdev);
    fputs(", \"kind\": ", out);
    json_str(out, mplane_topo_nic_kind_name(nic->kind));
    fputs(", \"busid\": ", out);
    json_str_or_null(out, nic->busid);
    fputs(", \"numa\": ", out);
    if (nic->numa >= 0) fprintf(out, "%d", nic->numa);
    else fputs("null", out);
    fputs(", \"role\": ", out);
    json_str(out, role(nic));
    fputs(", \"gpus\": [", out);
    int first = 1;
    for (int g = 0; g < t->ngpus; g++) {
      if (t->gpus[g].nic != n) continue;
      fprintf(out, "%s%d", first ? "" : ", ", g);
      first = 0;
    }
    fputs("], \"plane\": ", out);
    if (nic->plane >= 0) fprintf(out, "%d, \"rail\": %d, \"plane_source\": ", nic->plane, nic->rail);
    else fputs("null, \"rail\": null, \"plane_source\": ", out);
    json_str_or_null(out, nic->plane >= 0 ? mplane_topo_plane_source_name(nic->plane_source) : NULL);
    fputs(", \"subnet\": ", out);
    json_str_or_null(out, nic->subnet);
    fprintf(out, ", \"guid\": \"0x%016llx\", \"speed_mbps\": ", (unsigned long long)nic->guid);
    if (nic->speed_mbps > 0) fprintf(out, "%d}", nic->speed_mbps);
    else fputs("null}", out);
  }
  fputs(t->nnics ? "\n  ]\n}\n" : "]\n}\n", out);
}

/* ------------------------------------------------------------------ NCCL settings */

static void setting(FILE *out, const char *assign, const char *why) { fprintf(out, "export %-30s # %s\n", assign, why); }

void mplane_topo_print_nccl_env(const struct mplane_topo *t, FILE *out) {
  char buf[1024];
  fprintf(out, "# NCCL settings for this node (mplane-topo --nccl-env): %d GPU%s, %d plane%s from %s\n", t->ngpus,
          t->ngpus == 1 ? "" : "s", t->nplanes, t->nplanes == 1 ? "" : "s",
          mplane_topo_plane_source_name(t->plane_source));
  setting(out, "NCCL_NET_PLUGIN=mplane", "load mplane as NCCL's network: it knows the planes and relays across them");
  if (t->ngpus == 0) fprintf(out, "# no GPU here: NCCL does not run on this node\n");
  if (t->nplanes >= 2) {
    snprintf(buf, sizeof(buf), "the %d planes share no switch: a ring or tree must leave every node on the same plane",
             t->nplanes);
    setting(out, "NCCL_CROSS_NIC=0", buf);
    setting(out, "NCCL_PXN_DISABLE=0",
            "PXN: reach another plane's NIC over NVLink through its GPU, never across planes");
    setting(out, "NCCL_P2P_PXN_LEVEL=2", "send/recv and all-to-all always go out through the GPU beside the peer's "
                                         "plane NIC");
  } else if (t->nplanes == 1) {
    fprintf(out, "# one plane: NCCL_CROSS_NIC and PXN change nothing here\n");
  } else {
    fprintf(out, "# no NIC on a plane: NCCL keeps to NVLink/PCIe/shared memory inside the node\n");
  }
  /* GPUDirect RDMA: worth it only where each GPU's NIC sits behind its own PCIe switch. */
  int worst = -1, paired = 0;
  for (int g = 0; g < t->ngpus; g++) {
    if (t->gpus[g].nic < 0) continue;
    paired++;
    if ((int)t->gpus[g].link > worst) worst = (int)t->gpus[g].link;
  }
  if (paired && count_rdma(t)) {
    if (worst <= MPLANE_TOPO_LINK_PXB) {
      setting(out, "NCCL_NET_GDR_LEVEL=PXB",
              "every GPU's NIC is behind its PCIe switch: NICs read and write GPU memory directly");
    } else {
      fprintf(out, "# GPUDirect RDMA: pairs are as far as %s (the NIC is not behind the GPU's switch); NCCL's default "
                   "level keeps data staged in host memory there\n",
              mplane_topo_link_name((enum mplane_topo_link)worst));
    }
  }
  /* Pin the planes found here, so a node with a NIC down still numbers them the same. */
  size_t o = 0;
  buf[0] = '\0';
  for (int n = 0; n < t->nnics; n++) {
    const struct mplane_topo_nic *nic = &t->nics[n];
    if (nic->plane < 0) continue;
    int k = snprintf(buf + o, sizeof(buf) - o, "%s%s=%d", o ? "," : "",
                     nic->ibdev[0] ? nic->ibdev : (nic->netdev[0] ? nic->netdev : nic->name), nic->plane);
    if (k < 0 || o + (size_t)k >= sizeof(buf)) break;
    o += (size_t)k;
  }
  if (o && t->plane_source != MPLANE_TOPO_PLANE_CONFIG) {
    fprintf(out, "export MPLANE_PLANES=%s\n#   pins the planes found here (from %s) so every node numbers them alike\n",
            buf, mplane_topo_plane_source_name(t->plane_source));
  } else if (o) {
    fprintf(out, "# MPLANE_PLANES is set: planes %s\n", buf);
  }
  /* NCCL's own IB transport, for runs without mplane: its HCA list carries rail and plane too. */
  o = 0;
  buf[0] = '\0';
  for (int n = 0; n < t->nnics; n++) {
    const struct mplane_topo_nic *nic = &t->nics[n];
    if (nic->plane < 0 || !nic->ibdev[0]) continue;
    int k = snprintf(buf + o, sizeof(buf) - o, "%s%s:%d:%d:%d", o ? "," : "=", nic->ibdev, nic->port > 0 ? nic->port : 1,
                     nic->rail, nic->plane);
    if (k < 0 || o + (size_t)k >= sizeof(buf)) break;
    o += (size_t)k;
  }
  if (o)
    fprintf(out, "# without mplane, NCCL's own IB transport takes the same planes (NCCL_IB_HCA <hca>:<port>:<rail>:"
                 "<plane>):\n#   export NCCL_IB_HCA='%s'\n",
            buf);
  fprintf(out, "# NCCL_TOPO_FILE: leave unset; mplane hands NCCL this node's topology with the planes at init\n");
}
