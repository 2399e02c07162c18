/* mplane: ncclTunerPlugin_v3 (NCCL 2.22 - 2.23): v4 without the registered-buffer hint. */
#include "../tuner/tuner.h"

static ncclResult_t v3_init(size_t nranks, size_t nnodes, ncclDebugLogger_t logger, void **ctx) {
  return mplane_tuner_init(ctx, 0, nranks, nnodes, logger);
}

static ncclResult_t v3_get_coll_info(void *ctx, ncclFunc_t coll, size_t nbytes, int num_pipe_ops, float **cost_table,
                                     int num_algo, int num_proto, int *nchannels) {
  return mplane_tuner_get_coll_info(ctx, coll, nbytes, num_pipe_ops, cost_table, num_algo, num_proto, 0, nchannels);
}

__attribute__((visibility("default"))) const ncclTuner_v3_t ncclTunerPlugin_v3 = {
    .name = "mplane",
    .init = v3_init,
    .getCollInfo = v3_get_coll_info,
    .destroy = mplane_tuner_finalize,
};
