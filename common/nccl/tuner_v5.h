/* mplane: ncclTuner_v5 (NCCL 2.28 - 2.29, the one our machines run): init gets the communicator id,
 * the NVLink domain shape and NCCL's tuning constants (which a tuner may change before NCCL builds
 * its cost model); the end call is "finalize". */
#ifndef MPLANE_NCCL_TUNER_V5_H
#define MPLANE_NCCL_TUNER_V5_H

typedef struct {
  int nNvlDomains;          /* NVLink domains in the communicator */
  int minRanksPerNvlDomain; /* smallest domain, in ranks */
  int maxRanksPerNvlDomain; /* largest domain, in ranks */
} ncclNvlDomainInfo_v5_t;

/* Sizes of the constant tables (ABI: they fix the struct layout). */
#define NCCL_NUM_ALGORITHMS_V5 7
#define NCCL_NUM_PROTOCOLS_V5 3
#define NCCL_NUM_HW_LINKS_V5 3     /* NVLink, PCI, network */
#define NCCL_NUM_COMPCAPS_V5 4     /* Volta, Ampere, Hopper, Blackwell */
#define NCCL_NUM_TUNING_SCALES_V5 3 /* 1 node, 2 nodes, 4+ nodes */

typedef struct {
  double baseLatencies[NCCL_NUM_ALGORITHMS_V5][NCCL_NUM_PROTOCOLS_V5];
  double hwLatencies[NCCL_NUM_HW_LINKS_V5][NCCL_NUM_ALGORITHMS_V5][NCCL_NUM_PROTOCOLS_V5];
  double llMaxBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
  double perChMaxRingLL128Bws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
  double perChMaxTreeLL128Bws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
  double perChMaxTreeBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
  double perChMaxNVLSTreeBws[NCCL_NUM_COMPCAPS_V5][NCCL_NUM_TUNING_SCALES_V5];
} ncclTunerConstants_v5_t;

typedef struct {
  const char *name;
  ncclResult_t (*init)(void **ctx, uint64_t commId, size_t nRanks, size_t nNodes, ncclDebugLogger_t logFunction,
                       ncclNvlDomainInfo_v5_t *nvlDomainInfo, ncclTunerConstants_v5_t *constants);
  ncclResult_t (*getCollInfo)(void *context, ncclFunc_t collType, size_t nBytes, int numPipeOps,
                              float **collCostTable, int numAlgo, int numProto, int regBuff, int *nChannels);
  ncclResult_t (*finalize)(void *context);
} ncclTuner_v5_t;

#endif
