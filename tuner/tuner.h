/* mplane: the tuner's version-independent core. The exported ncclTunerPlugin_v3..v6 tables
 * (plugin/tuner_v3.c .. tuner_v6.c) are thin adapters over mplane_tuner_init/get_coll_info/finalize.
 *
 * Policy: for a call that matches a row of the MPLANE_TUNER_CONFIG table (tuner_table.h), make that
 * row's algorithm/protocol the cheapest entry of NCCL's cost table (cost 0) and set the channel count
 * if the row gives one. Everything else is left to NCCL: no table, no matching row, a row whose
 * combination NCCL marked unusable for this call, or NCCL_ALGO / NCCL_PROTO set by the user. */
#ifndef MPLANE_TUNER_H
#define MPLANE_TUNER_H

#include <stdint.h>
#include "common/nccl/tuner.h"
#include "tuner_table.h"

struct mplane_tuner_ctx;

/* What one call did (for tests and logs). */
enum mplane_tuner_outcome {
  MPLANE_TUNER_PASS = 0,        /* nothing applies: table untouched */
  MPLANE_TUNER_APPLIED = 1,     /* a row set algorithm/protocol (and maybe channels) */
  MPLANE_TUNER_UNAVAILABLE = 2, /* a row matched but NCCL marked its combination unusable: untouched */
};

/* Policy, without process state: a context for one communicator over `table` (NULL or inactive:
 * pass-through). Only rows for this node/rank count are kept, per collective, in file order. The
 * table must outlive the context. */
ncclResult_t mplane_tuner_ctx_create(struct mplane_tuner_table *table, int active, uint64_t comm_id, size_t nranks,
                                     size_t nnodes, struct mplane_tuner_ctx **out);
/* Apply the first matching row to cost_table (float[num_algo][num_proto] behind a float**). No
 * allocation, no I/O; at most as many row checks as the table has rows for this collective. */
enum mplane_tuner_outcome mplane_tuner_ctx_apply(struct mplane_tuner_ctx *ctx, int coll, size_t nbytes,
                                                 float **cost_table, int num_algo, int num_proto, int *nchannels,
                                                 const struct mplane_tuner_row **row_out);
/* Rows kept for a collective (tests, logs). */
int mplane_tuner_ctx_rows(const struct mplane_tuner_ctx *ctx, int coll);
void mplane_tuner_ctx_destroy(struct mplane_tuner_ctx *ctx);

/* Process glue behind the exported tables. init loads MPLANE_TUNER_CONFIG once per process (a bad
 * table makes every init fail with the file, line and column in a WARN), checks NCCL_ALGO/NCCL_PROTO
 * and creates the communicator's context. */
ncclResult_t mplane_tuner_init(void **ctx, uint64_t comm_id, size_t nranks, size_t nnodes, ncclDebugLogger_t logger);
ncclResult_t mplane_tuner_get_coll_info(void *ctx, ncclFunc_t coll, size_t nbytes, int num_pipe_ops,
                                        float **cost_table, int num_algo, int num_proto, int reg_buff,
                                        int *nchannels);
ncclResult_t mplane_tuner_finalize(void *ctx);

/* Rows for where MPLANE_TUNER_CONFIG names no table: the active transport's defaults for its
 * devices (plugin/net_core.c), applied to communicators of 2 nodes or more. `name` says where they
 * come from in logs. Parsed here; a table that does not parse is an internal error (WARN), and no
 * rows apply. Set before the first tuner init; a second call is ignored. */
ncclResult_t mplane_tuner_set_builtin(const char *name, const char *csv);

#endif
