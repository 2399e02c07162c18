/* mplane: NCCL's RMA plugin ABI, as the transports see it: the newest version's types. The exported
 * table itself lives in plugin/ (rma_plugin.c); like net.h for the net tables, this is what a layer
 * below includes. */
#ifndef MPLANE_NCCL_RMA_H
#define MPLANE_NCCL_RMA_H

#include "rma_v14.h"

#endif
