/* mplane: InfiniBand transport (placeholder until net/ib lands: init is NULL, so auto picks sockets). */
#include "../transport.h"

const struct mplane_transport_ops mplane_ib_ops = {.name = "ib"};
