/* mplane: the NCCL RMA plugin ABI, version 16 (NCCL 2.32), written by us from the documented layout.
 *
 * NCCL 2.32 looks up `ncclRmaPlugin_v16` first, then v15 and v14. The table is v15's with one new
 * function, getRmaProperties, in the fourth slot (after devices, before getProperties): what the
 * backend guarantees for one connected group. Field order and types are ABI facts; the asserts pin
 * them (LP64). */
#ifndef MPLANE_NCCL_RMA_V16_H
#define MPLANE_NCCL_RMA_V16_H

#include "rma_v15.h"

typedef ncclRmaConfig_v15_t ncclRmaConfig_v16_t;

typedef struct {
  /* True only if any signal this group receives, from any peer, makes every put received before it
   * (from any peer, on any context, on every device the group uses) visible. Then NCCL's device-side
   * barrier can skip its flush per peer; false keeps it. */
  bool flushesAllPutsOnAnySignal;
} ncclRmaProperties_v16_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int *ndev);
  /* Asked once per group (collComm from connect). */
  ncclResult_t (*getRmaProperties)(void *collComm, ncclRmaProperties_v16_t *rmaProps);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v12_t *props);
  ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm, void **collComm);
  ncclResult_t (*createContext)(void *collComm, ncclRmaConfig_v16_t *config, void **rmaCtx);
  ncclResult_t (*regMrSym)(void *collComm, void *data, size_t size, int type, uint64_t mrFlags, void **mhandle);
  ncclResult_t (*regMrSymDmaBuf)(void *collComm, void *data, size_t size, int type, uint64_t offset, int fd,
                                 uint64_t mrFlags, void **mhandle);
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *rmaCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  /* optFlags as in v15. */
  ncclResult_t (*iput)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle, size_t size, uint64_t dstOff,
                       void *dstMhandle, uint32_t rank, uint32_t optFlags, void **request);
  ncclResult_t (*iputSignal)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle, size_t size,
                             uint64_t dstOff, void *dstMhandle, uint32_t rank, uint64_t signalOff,
                             void *signalMhandle, uint64_t signalValue, uint32_t signalOp, bool isStrongSignal,
                             uint32_t optFlags, void **request);
  ncclResult_t (*iget)(void *rmaCtx, int context, uint64_t remoteOff, void *remoteMhandle, size_t size,
                       uint64_t localOff, void *localMhandle, uint32_t rank, uint32_t optFlags, void **request);
  ncclResult_t (*iflush)(void *rmaCtx, int context, void *mhandle, uint32_t rank, void **request);
  ncclResult_t (*test)(void *collComm, void *request, int *done);
  ncclResult_t (*rmaProgress)(void *rmaCtx); /* may be NULL */
  ncclResult_t (*queryLastError)(void *rmaCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclRma_v16_t;

_Static_assert(sizeof(ncclRmaProperties_v16_t) == 1, "ncclRmaProperties_v16_t is one bool");
_Static_assert(sizeof(ncclRma_v16_t) == 22 * sizeof(void *), "ncclRma_v16_t: a name and 21 functions");
_Static_assert(offsetof(ncclRma_v16_t, getRmaProperties) == MPLANE_RMA_FN_OFFSET(3), "ncclRma_v16_t.getRmaProperties");
_Static_assert(offsetof(ncclRma_v16_t, getProperties) == MPLANE_RMA_FN_OFFSET(4), "ncclRma_v16_t.getProperties");
_Static_assert(offsetof(ncclRma_v16_t, createContext) == MPLANE_RMA_FN_OFFSET(7), "ncclRma_v16_t.createContext");
_Static_assert(offsetof(ncclRma_v16_t, iput) == MPLANE_RMA_FN_OFFSET(14), "ncclRma_v16_t.iput");
_Static_assert(offsetof(ncclRma_v16_t, iflush) == MPLANE_RMA_FN_OFFSET(17), "ncclRma_v16_t.iflush");
_Static_assert(offsetof(ncclRma_v16_t, test) == MPLANE_RMA_FN_OFFSET(18), "ncclRma_v16_t.test");
_Static_assert(offsetof(ncclRma_v16_t, finalize) == MPLANE_RMA_FN_OFFSET(21), "ncclRma_v16_t.finalize");

#endif
