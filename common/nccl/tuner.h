/* mplane: NCCL tuner plugin ABI, the parts every version shares (written from the documented ABI).
 *
 * NCCL hands a tuner its cost table as a float** that really points at a contiguous
 * float[numAlgo][numProto] array: row = algorithm, column = protocol, value = estimated time in
 * microseconds, or NCCL_ALGO_PROTO_IGNORE where the combination is unusable for this call. NCCL then
 * takes the cheapest entry that is not ignored. The enum values below are ABI. */
#ifndef MPLANE_NCCL_TUNER_H
#define MPLANE_NCCL_TUNER_H

#include <stddef.h>
#include <stdint.h>
#include "common.h"

/* Collective kinds (NCCL's ncclFunc_t). getCollInfo is only asked about the first five. */
typedef enum {
  ncclFuncBroadcast = 0,
  ncclFuncReduce = 1,
  ncclFuncAllGather = 2,
  ncclFuncReduceScatter = 3,
  ncclFuncAllReduce = 4,
  ncclFuncSendRecv = 5,
  ncclFuncSend = 6,
  ncclFuncRecv = 7,
  ncclFuncAlltoAll = 8,
  ncclFuncScatter = 9,
  ncclFuncGather = 10,
} ncclFunc_t;
#define MPLANE_NCCL_NUM_COLL_FUNCS 5 /* broadcast .. allreduce: the ones with a cost table */

/* Algorithm rows of the cost table. */
#define NCCL_ALGO_UNDEF -1
#define NCCL_ALGO_TREE 0
#define NCCL_ALGO_RING 1
#define NCCL_ALGO_COLLNET_DIRECT 2
#define NCCL_ALGO_COLLNET_CHAIN 3
#define NCCL_ALGO_NVLS 4
#define NCCL_ALGO_NVLS_TREE 5
#define NCCL_ALGO_PAT 6

/* Protocol columns of the cost table. */
#define NCCL_PROTO_UNDEF -1
#define NCCL_PROTO_LL 0
#define NCCL_PROTO_LL128 1
#define NCCL_PROTO_SIMPLE 2

/* Cost of a combination NCCL will not use for this call. */
#define NCCL_ALGO_PROTO_IGNORE -1.0

#include "tuner_v3.h"
#include "tuner_v4.h"
#include "tuner_v5.h"
#include "tuner_v6.h"

#endif
