/* mplane: ncclTunerPlugin_v5 (NCCL 2.28 - 2.29). The core's calls fit as they are; NCCL's tuning
 * constants are left as NCCL set them. */
#include "../tuner/tuner.h"

static ncclResult_t v5_init(void **ctx, uint64_t comm_id, size_t nranks, size_t nnodes, ncclDebugLogger_t logger,
                            ncclNvlDomainInfo_v5_t *nvl, ncclTunerConstants_v5_t *constants) {
  (void)nvl;
  (void)constants;
  return mplane_tuner_init(ctx, comm_id, nranks, nnodes, logger);
}

__attribute__((visibility("default"))) const ncclTuner_v5_t ncclTunerPlugin_v5 = {
    .name = "mplane",
    .init = v5_init,
    .getCollInfo = mplane_tuner_get_coll_info,
    .finalize = mplane_tuner_finalize,
};
