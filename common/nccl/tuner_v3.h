/* mplane: ncclTuner_v3 (NCCL 2.22 - 2.23): init per communicator with its size, no context
 * arguments; getCollInfo without the registered-buffer hint; "destroy" to end. */
#ifndef MPLANE_NCCL_TUNER_V3_H
#define MPLANE_NCCL_TUNER_V3_H

typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int *nChannels);
  ncclResult_t (*destroy)(void *context);
} ncclTuner_v3_t;

#endif
