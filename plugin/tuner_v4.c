/* mplane: ncclTunerPlugin_v4 (NCCL 2.24 - 2.27): init has no communicator id (contexts report 0)
 * and puts the context last. */
#include "../tuner/tuner.h"

static ncclResult_t v4_init(size_t nranks, size_t nnodes, ncclDebugLogger_t logger, void **ctx) {
  return mplane_tuner_init(ctx, 0, nranks, nnodes, logger);
}

__attribute__((visibility("default"))) const ncclTuner_v4_t ncclTunerPlugin_v4 = {
    .name = "mplane",
    .init = v4_init,
    .getCollInfo = mplane_tuner_get_coll_info,
    .destroy = mplane_tuner_finalize,
};
