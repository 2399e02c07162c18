/* mplane: ncclTuner_v4 (NCCL 2.24 - 2.27): v3 plus regBuff, which says whether the user's buffers
 * are registered (so registration-friendly algorithms are possible). */
#ifndef MPLANE_NCCL_TUNER_V4_H
#define MPLANE_NCCL_TUNER_V4_H

typedef struct {
  const char *name;
  ncclResult_t (*init)(size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction, void **context);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff, int *nChannels);
  ncclResult_t (*destroy)(void *context);
} ncclTuner_v4_t;

#endif
