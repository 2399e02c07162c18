/* CPU emulator of NCCL for libmplane-ep's tests (tests/ep/emu): ranks are threads of one process;
 * ncclSend copies into a per-(sender, receiver) queue at once, ncclRecv takes the oldest message at
 * the end of its group and fails when the sizes differ (where NCCL would hang or truncate). Not
 * NVIDIA's header: only the calls libmplane-ep makes. */
#ifndef EMU_NCCL_H
#define EMU_NCCL_H

#include <stddef.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5
} ncclResult_t;
typedef struct emu_nccl_comm *ncclComm_t;
typedef struct {
  char internal[128];
} ncclUniqueId;
typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3 } ncclRedOp_t;
typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclDouble = 8
} ncclDataType_t;

ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int *device);
ncclResult_t ncclAllGather(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream);
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclSend(const void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclRecv(void *buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t s);
const char *ncclGetErrorString(ncclResult_t r);
ncclResult_t ncclGetVersion(int *version);
ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream);
const char *ncclGetLastError(ncclComm_t comm);

/* emulator only: a world of n ranks (comms[i] is rank i's), its byte counters, and its end */
void emu_nccl_world_create(int n, ncclComm_t *comms);
void emu_nccl_world_free(ncclComm_t *comms, int n);
/* bytes rank sent to peer so far */
long long emu_nccl_sent(ncclComm_t comm, int peer);

#ifdef __cplusplus
}
#endif

#endif
