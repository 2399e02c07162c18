/* mplane: ncclTuner_v6 (NCCL 2.30): v5 plus an optional getChunkSize hook that may change the chunk
 * size NCCL computed for the chosen algorithm/protocol (NULL: NCCL keeps its own). Constants and
 * NVLink domain info are v5's. */
#ifndef MPLANE_NCCL_TUNER_V6_H
#define MPLANE_NCCL_TUNER_V6_H

typedef ncclTunerConstants_v5_t ncclTunerConstants_v6_t;
typedef ncclNvlDomainInfo_v5_t ncclNvlDomainInfo_v6_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v6_t *nvlDomainInfo, ncclTunerConstants_v6_t *constants);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff, int *nChannels);
  ncclResult_t (*finalize)(void *context);
  ncclResult_t (*getChunkSize)(void *context, ncclFunc_t collType, size_t nBytes, int algo, int proto,
                               int nChannels, size_t *chunkSize);
} ncclTuner_v6_t;

#endif
