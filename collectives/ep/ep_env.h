/* libmplane-ep's MPLANE_EP_* variables, read through the config table (common/config.c), where every
 * MPLANE_* variable has its row, its default and its accepted form (mplane-config lists them).
 *
 * A plain-C face: ep_host.c includes NCCL's own nccl.h, which the table's header (it carries our
 * NCCL ABI types) must not meet. */
#ifndef MPLANE_EP_ENV_H
#define MPLANE_EP_ENV_H

#include <stddef.h>

/* The fused kernels' block split; -1 where the variable is unset (the automatic count). */
struct mplane_ep_env {
  int link_sms; /* MPLANE_EP_LINK_SMS */
  int recv_sms; /* MPLANE_EP_RECV_SMS */
  int send_sms; /* MPLANE_EP_SEND_SMS */
};

/* Read the environment now (every call: a process may change it between contexts). 0, or -1 with
 * "MPLANE_EP_X='value' is not valid: expected <form>" in err. The bounds that depend on the device
 * (how many blocks a kernel has) are the caller's to check. */
int mplane_ep_env_load(struct mplane_ep_env *env, char *err, size_t errlen);

#endif
