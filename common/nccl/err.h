/* mplane: NCCL plugin ABI, result codes (written from the documented ABI). */
#ifndef MPLANE_NCCL_ERR_H
#define MPLANE_NCCL_ERR_H

/* Result codes a plugin returns to NCCL. The numeric values are ABI. */
typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
} ncclResult_t;

#endif
