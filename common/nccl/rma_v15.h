/* mplane: the NCCL RMA plugin ABI, version 15 (NCCL 2.31), written by us from the documented layout.
 *
 * NCCL 2.31 looks up `ncclRmaPlugin_v15` first, then v14. The table is v14's with one more argument,
 * optFlags, on the three ops the GIN proxy posts (iput, iputSignal, iget), just before the request.
 * The configuration is v14's. Field order and types are ABI facts; the asserts pin them (LP64). */
#ifndef MPLANE_NCCL_RMA_V15_H
#define MPLANE_NCCL_RMA_V15_H

#include "rma_v14.h"

typedef ncclRmaConfig_v14_t ncclRmaConfig_v15_t;

/* optFlags bits. Aggregate: NCCL has the next op of the same context to the same rank in hand and
 * posts it right after this one (in the same pass of its GIN proxy, followed by rmaProgress), so the
 * backend may hold this op back and submit the two together. A hint only: what an op does, and its
 * order with the others, do not change; NCCL still tests every request it is given. */
enum ncclRmaOptFlags {
  ncclRmaOptFlagsDefault = 0,
  ncclRmaOptFlagsAggregateRequests = 1 << 0,
};

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v12_t *props);
  ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm, void **collComm);
  ncclResult_t (*createContext)(void *collComm, ncclRmaConfig_v15_t *config, void **rmaCtx);
  ncclResult_t (*regMrSym)(void *collComm, void *data, size_t size, int type, uint64_t mrFlags, void **mhandle);
  ncclResult_t (*regMrSymDmaBuf)(void *collComm, void *data, size_t size, int type, uint64_t offset, int fd,
                                 uint64_t mrFlags, void **mhandle);
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *rmaCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  /* As v14, with optFlags (enum ncclRmaOptFlags bits) before the request. */
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
} ncclRma_v15_t;

_Static_assert(sizeof(ncclRma_v15_t) == 21 * sizeof(void *), "ncclRma_v15_t: a name and 20 functions");
_Static_assert(offsetof(ncclRma_v15_t, getProperties) == MPLANE_RMA_FN_OFFSET(3), "ncclRma_v15_t.getProperties");
_Static_assert(offsetof(ncclRma_v15_t, iput) == MPLANE_RMA_FN_OFFSET(13), "ncclRma_v15_t.iput");
_Static_assert(offsetof(ncclRma_v15_t, iget) == MPLANE_RMA_FN_OFFSET(15), "ncclRma_v15_t.iget");
_Static_assert(offsetof(ncclRma_v15_t, test) == MPLANE_RMA_FN_OFFSET(17), "ncclRma_v15_t.test");
_Static_assert(offsetof(ncclRma_v15_t, finalize) == MPLANE_RMA_FN_OFFSET(20), "ncclRma_v15_t.finalize");

#endif
