/* libmplane-hfreduce: HFReduce, the host all-reduce of Fire-Flyer AI-HPC (docs/hfreduce.md).
 *
 * Each rank's data goes to host memory once, the local ranks of a node reduce it together on their
 * CPUs (each rank reduces its own slice: a reduce-scatter in shared memory), each slice is
 * all-reduced between nodes by the rank that owns it, over its own NIC, with a double binary tree
 * (mplane's socket or IB transport), and the result comes back once. Chunks are pipelined so that
 * the copies, the reduction and the network overlap.
 *
 * Every call returns 0 (ncclSuccess) or an ncclResult_t code; mplane_hfreduce_last_error() says
 * why, naming the rank or the argument at fault. */
#ifndef MPLANE_HFREDUCE_H
#define MPLANE_HFREDUCE_H

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MPLANE_HFREDUCE_ABI_VERSION 1
#define MPLANE_HFREDUCE_API __attribute__((visibility("default")))
#define MPLANE_HFREDUCE_UNIQUE_ID_BYTES 128

/* Made by one process (mplane_hfreduce_get_unique_id) and handed to every rank out of band, as
 * NCCL's ncclUniqueId is: it names the bootstrap root that process now runs. */
typedef struct {
  char internal[MPLANE_HFREDUCE_UNIQUE_ID_BYTES];
} mplane_hfreduce_unique_id;

typedef struct mplane_hfreduce_comm *mplane_hfreduce_comm_t;

enum mplane_hfreduce_dtype {
  MPLANE_HFREDUCE_FLOAT32 = 0,
  MPLANE_HFREDUCE_FLOAT16 = 1,
  MPLANE_HFREDUCE_BFLOAT16 = 2,
  MPLANE_HFREDUCE_FP8_E4M3 = 3, /* OCP e4m3fn: no infinity, overflow saturates to +-448 */
  MPLANE_HFREDUCE_FP8_E5M2 = 4, /* overflow gives +-inf */
  MPLANE_HFREDUCE_NDTYPES = 5
};

enum mplane_hfreduce_op {
  MPLANE_HFREDUCE_SUM = 0,
  MPLANE_HFREDUCE_MAX = 1,
  MPLANE_HFREDUCE_MIN = 2,
  MPLANE_HFREDUCE_NOPS = 3
};

MPLANE_HFREDUCE_API int mplane_hfreduce_abi_version(void);

/* Starts the bootstrap root in this process (a thread that lives until every rank of the
 * communicator has joined, or MPLANE_CONNECT_TIMEOUT). */
MPLANE_HFREDUCE_API int mplane_hfreduce_get_unique_id(mplane_hfreduce_unique_id *id);

/* Collective over nranks processes, each with its rank 0..nranks-1. Ranks on one host (hostname,
 * or NCCL_HOSTID where set) share memory; every host must hold the same number of ranks. */
MPLANE_HFREDUCE_API int mplane_hfreduce_comm_init(mplane_hfreduce_comm_t *comm, int nranks, const mplane_hfreduce_unique_id *id,
                              int rank);

/* recv[i] = op over every rank's send[i], i < count; send == recv is allowed. Host or GPU memory
 * (GPU buffers: copies on the copy engine; stream is a CUstream the call first waits for, or NULL).
 * Returns when recv holds the result. Every rank passes the same count, dtype and op; a rank that
 * passes others, dies or stalls makes the others fail within MPLANE_CONNECT_TIMEOUT, naming it.
 * After a failure the communicator only accepts mplane_hfreduce_comm_destroy. */
MPLANE_HFREDUCE_API int mplane_hfreduce_allreduce(mplane_hfreduce_comm_t comm, const void *send, void *recv, size_t count, int dtype,
                              int op, void *stream);

MPLANE_HFREDUCE_API int mplane_hfreduce_comm_destroy(mplane_hfreduce_comm_t comm);

/* Where this rank sits: any pointer may be NULL. */
MPLANE_HFREDUCE_API int mplane_hfreduce_comm_info(mplane_hfreduce_comm_t comm, int *rank, int *nranks, int *node, int *nnodes,
                              int *local_rank, int *local_ranks);

/* Why the last failing call of this thread failed ("" if none). */
MPLANE_HFREDUCE_API const char *mplane_hfreduce_last_error(void);

#ifdef __cplusplus
}
#endif
#endif
