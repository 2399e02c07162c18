/* mplane: the NCCL RMA plugin ABI, version 14 (NCCL 2.30), written by us from the documented layout.
 *
 * NCCL 2.30 looks up the data symbol `ncclRmaPlugin_v14` in the net plugin's own library. Its GIN
 * proxy thread turns the GPU's put/get/signal descriptors into calls of this table; its RMA proxy
 * (host-initiated one-sided ops) uses it too. Field order and types are ABI facts; the static
 * asserts below pin the sizes and offsets the two sides must agree on (LP64). */
#ifndef MPLANE_NCCL_RMA_V14_H
#define MPLANE_NCCL_RMA_V14_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include "net.h"

/* Memory-registration flags (regMrSym mrFlags). */
#define NCCL_NET_MR_FLAG_FORCE_SO (1 << 0)           /* strong ordering: a signal never overtakes data */
#define NCCL_NET_MR_FLAG_SIGNAL_NEVER_RESET (1 << 1) /* the GPU never writes the signal words */

/* iputSignal signalOp: the only two NCCL defines. INC adds 1, ADD adds signalValue, to a 64-bit
 * word at signalOff of the signal window on the target rank. */
#define NCCL_NET_SIGNAL_OP_INC 0x1
#define NCCL_NET_SIGNAL_OP_ADD 0x2

typedef struct {
  int nContexts;    /* independent sets of connections; calls name one by index */
  int trafficClass; /* NCCL_NET_TRAFFIC_CLASS_UNDEF or the communicator's class */
  int rankStride;   /* connect only ranks rank +- k*rankStride; nranks is a multiple of it */
} ncclRmaConfig_v14_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, ncclDebugLogger_t logFunction);
  ncclResult_t (*devices)(int *ndev);
  ncclResult_t (*getProperties)(int dev, ncclNetProperties_v12_t *props);
  ncclResult_t (*listen)(void *ctx, int dev, void *handle, void **listenComm);
  /* Collective over the nranks handles (NCCL_NET_HANDLE_MAXSIZE bytes each); may block. */
  ncclResult_t (*connect)(void *ctx, void *handles[], int nranks, int rank, void *listenComm, void **collComm);
  /* Collective: the connections of config->nContexts contexts. */
  ncclResult_t (*createContext)(void *collComm, ncclRmaConfig_v14_t *config, void **rmaCtx);
  /* Collective (symmetric) registration: every rank registers its part in the same order. */
  ncclResult_t (*regMrSym)(void *collComm, void *data, size_t size, int type, uint64_t mrFlags, void **mhandle);
  ncclResult_t (*regMrSymDmaBuf)(void *collComm, void *data, size_t size, int type, uint64_t offset, int fd,
                                 uint64_t mrFlags, void **mhandle);
  ncclResult_t (*deregMrSym)(void *collComm, void *mhandle);
  ncclResult_t (*destroyContext)(void *rmaCtx);
  ncclResult_t (*closeColl)(void *collComm);
  ncclResult_t (*closeListen)(void *listenComm);
  /* One-sided ops. Handles are the caller's own (symmetric) handles; offsets are window offsets. */
  ncclResult_t (*iput)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle, size_t size, uint64_t dstOff,
                       void *dstMhandle, uint32_t rank, void **request);
  /* size 0 or NULL dstMhandle: the signal alone. */
  ncclResult_t (*iputSignal)(void *rmaCtx, int context, uint64_t srcOff, void *srcMhandle, size_t size,
                             uint64_t dstOff, void *dstMhandle, uint32_t rank, uint64_t signalOff,
                             void *signalMhandle, uint64_t signalValue, uint32_t signalOp, bool isStrongSignal,
                             void **request);
  ncclResult_t (*iget)(void *rmaCtx, int context, uint64_t remoteOff, void *remoteMhandle, size_t size,
                       uint64_t localOff, void *localMhandle, uint32_t rank, void **request);
  /* Makes completed gets' data visible to the GPU; a NULL request means "already done". */
  ncclResult_t (*iflush)(void *rmaCtx, int context, void *mhandle, uint32_t rank, void **request);
  /* Polls; a done request is released by the plugin. */
  ncclResult_t (*test)(void *collComm, void *request, int *done);
  ncclResult_t (*rmaProgress)(void *rmaCtx); /* may be NULL */
  ncclResult_t (*queryLastError)(void *rmaCtx, bool *hasError);
  ncclResult_t (*finalize)(void *ctx);
} ncclRma_v14_t;

#define MPLANE_RMA_FN_OFFSET(i) ((size_t)(i) * sizeof(void *))
_Static_assert(sizeof(ncclRmaConfig_v14_t) == 12, "ncclRmaConfig_v14_t is three ints");
_Static_assert(offsetof(ncclRmaConfig_v14_t, rankStride) == 8, "ncclRmaConfig_v14_t.rankStride");
_Static_assert(sizeof(ncclRma_v14_t) == 21 * sizeof(void *), "ncclRma_v14_t: a name and 20 functions");
_Static_assert(offsetof(ncclRma_v14_t, createContext) == MPLANE_RMA_FN_OFFSET(6), "ncclRma_v14_t.createContext");
_Static_assert(offsetof(ncclRma_v14_t, closeListen) == MPLANE_RMA_FN_OFFSET(12), "ncclRma_v14_t.closeListen");
_Static_assert(offsetof(ncclRma_v14_t, iput) == MPLANE_RMA_FN_OFFSET(13), "ncclRma_v14_t.iput");
_Static_assert(offsetof(ncclRma_v14_t, iflush) == MPLANE_RMA_FN_OFFSET(16), "ncclRma_v14_t.iflush");
_Static_assert(offsetof(ncclRma_v14_t, test) == MPLANE_RMA_FN_OFFSET(17), "ncclRma_v14_t.test");
_Static_assert(offsetof(ncclRma_v14_t, finalize) == MPLANE_RMA_FN_OFFSET(20), "ncclRma_v14_t.finalize");
_Static_assert(offsetof(ncclNetProperties_v12_t, netDeviceType) == 56, "ncclNetProperties_v12_t.netDeviceType");

#endif
