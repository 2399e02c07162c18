/* mplane: ncclTunerPlugin_v6 (NCCL 2.30): v5 plus getChunkSize, which we leave NULL so NCCL keeps
 * its own chunk sizes. */
#include "../tuner/tuner.h"

static ncclResult_t v6_init(void **ctx, uint64_t comm_id, size_t nranks, size_t nnodes, ncclDebugLogger_t logger,
                            ncclNvlDomainInfo_v6_t *nvl, ncclTunerConstants_v6_t *constants) {
  (void)nvl;
  (void)constants;
  return mplane_tuner_init(ctx, comm_id, nranks, nnodes, logger);
}

__attribute__((visibility("default"))) const ncclTuner_v6_t ncclTunerPlugin_v6 = {
    .name = "mplane",
    .init = v6_init,
    .getCollInfo = mplane_tuner_get_coll_info,
    .finalize = mplane_tuner_finalize,
    .getChunkSize = NULL,
};
