/* libmplane-ep: its MPLANE_EP_* variables through the config table (see ep_env.h). */
#include "ep_env.h"

#include <stdlib.h>

#include "common/config.h"

int mplane_ep_env_load(struct mplane_ep_env *env, char *err, size_t errlen) {
  /* on the heap: the table's struct holds every variable's field (kilobytes of paths and grammars) */
  struct mplane_config *cfg = malloc(sizeof(*cfg));
  if (!cfg) {
    snprintf(err, errlen, "out of host memory reading the MPLANE_EP_* variables");
    return -1;
  }
  int rc = mplane_config_load_ep(cfg, err, errlen) == ncclSuccess ? 0 : -1;
  if (!rc) {
    env->link_sms = cfg->ep_link_sms;
    env->recv_sms = cfg->ep_recv_sms;
    env->send_sms = cfg->ep_send_sms;
  }
  free(cfg);
  return rc;
}
