/* mplane: built where infiniband/verbs.h is not installed: no IB transport (init is NULL, so
 * MPLANE_TRANSPORT=auto picks sockets and =ib fails with a WARN). */
#include "../transport.h"

const struct mplane_transport_ops mplane_ib_ops = {.name = "ib"};
