/* mplane: NCCL's RMA plugin ABI, as the transports see it: every version's types (v14 for NCCL 2.30,
 * v15 for 2.31, v16 for 2.32; each header includes the one before). The exported tables themselves
 * live in plugin/ (rma_plugin.c); like net.h for the net tables, this is what a layer below includes. */
#ifndef MPLANE_NCCL_RMA_H
#define MPLANE_NCCL_RMA_H

#include "rma_v16.h"

#endif
