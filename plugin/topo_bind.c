/* mplane: what the plugin asks of topo/ at init (see topo_bind.h). */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "topo_bind.h"

#include "../common/log.h"

static struct mplane_topo *node_topo;

const struct mplane_topo *mplane_topo_node(void) { return node_topo; }

/* A /proc/self/fd/N value is ours when fd N is our memfd; a child that inherited the variable
 * after its fds were closed (or reused) must not hand NCCL whatever fd N is now. */
static int inherited_stale(const char *value) {
  int fd;
  char tail;
  if (sscanf(value, "/proc/self/fd/%d%c", &fd, &tail) != 1) return 0;
  char link[64], target[256];
  snprintf(link, sizeof(link), "/proc/self/fd/%d", fd);
  ssize_t k = readlink(link, target, sizeof(target) - 1);
  if (k < 0) return 1;
  target[k] = '\0';
  return strstr(target, "memfd:mplane-nccl-topo") == NULL;
}

static void hand_nccl_the_topology(const struct mplane_topo *t) {
  const char *cur = getenv("NCCL_TOPO_FILE");
  if (cur && *cur) {
    if (!inherited_stale(cur)) {
      MP_INFO(NCCL_INIT | NCCL_ENV, "topo: NCCL_TOPO_FILE=%s is set; mplane leaves it to NCCL", cur);
      return;
    }
    MP_INFO(NCCL_INIT | NCCL_ENV, "topo: NCCL_TOPO_FILE=%s was inherited and no longer names mplane's topology; "
            "writing a new one", cur);
  }
  if (t->ngpus == 0) {
    MP_INFO(NCCL_INIT, "topo: no GPU on this node; NCCL_TOPO_FILE not written");
    return;
  }
  char path[64];
  if (mplane_topo_nccl_xml_memfd(t, path, sizeof(path)) != ncclSuccess) return;
  if (setenv("NCCL_TOPO_FILE", path, 1) != 0) {
    MP_WARN("topo: setenv NCCL_TOPO_FILE failed; NCCL detects the topology itself");
    return;
  }
  MP_INFO(NCCL_INIT | NCCL_ENV, "topo: NCCL_TOPO_FILE=%s: this node's topology with NIC planes (MPLANE_NCCL_TOPO=0 "
          "turns this off)", path);
}

ncclResult_t mplane_topo_plugin_init(const struct mplane_config *cfg, struct mplane_dev_props *props, int n) {
  char err[1536];
  struct mplane_topo *t = NULL;
  ncclResult_t res = mplane_topo_resolve_planes(props, n, cfg, &t, err, sizeof(err));
  if (res != ncclSuccess) {
    MP_WARN("%s", err);
    return res;
  }
  for (int g = 0; g < t->ngpus; g++) {
    const struct mplane_topo_gpu *gpu = &t->gpus[g];
    if (gpu->cuda_dev == -1) continue;
    MP_INFO(NCCL_INIT, "topo: GPU%d %s NUMA %d -> %s (%s) plane %d", g, gpu->busid, gpu->numa,
            gpu->nic >= 0 ? t->nics[gpu->nic].name : "no NIC", mplane_topo_link_name(gpu->link),
            gpu->nic >= 0 ? t->nics[gpu->nic].plane : -1);
  }
  if (cfg->nccl_topo) hand_nccl_the_topology(t);
  if (node_topo) mplane_topo_free(node_topo);
  node_topo = t;
  return ncclSuccess;
}
