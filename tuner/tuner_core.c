/* mplane: tuner policy and process glue (see tuner.h). */
#include "tuner.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/config.h"
#include "common/log.h"

#define NCOLL MPLANE_NCCL_NUM_COLL_FUNCS

/* Once-per-process log flags kept in each row. */
#define NOTED_APPLIED 1
#define NOTED_UNAVAILABLE 2

struct mplane_tuner_ctx {
  uint64_t comm_id;
  size_t nranks, nnodes;
  int active;
  struct mplane_tuner_table *table;
  int count[NCOLL];
  struct mplane_tuner_row **rows[NCOLL]; /* into `storage`, file order */
  struct mplane_tuner_row **storage;
  uint64_t calls, applied, unavailable; /* relaxed atomics */
};

static int shape_matches(const struct mplane_tuner_row *r, size_t nranks, size_t nnodes) {
  return (r->nodes == MPLANE_TUNER_ANY || (size_t)r->nodes == nnodes) &&
         (r->ranks == MPLANE_TUNER_ANY || (size_t)r->ranks == nranks);
}

ncclResult_t mplane_tuner_ctx_create(struct mplane_tuner_table *table, int active, uint64_t comm_id, size_t nranks,
                                     size_t nnodes, struct mplane_tuner_ctx **out) {
  struct mplane_tuner_ctx *ctx = calloc(1, sizeof(*ctx));
  if (!ctx) return ncclSystemError;
  ctx->comm_id = comm_id;
  ctx->nranks = nranks;
  ctx->nnodes = nnodes;
  ctx->table = table;
  ctx->active = active && table != NULL;
  if (ctx->active && table->nrows > 0) {
    ctx->storage = calloc((size_t)table->nrows * NCOLL, sizeof(*ctx->storage));
    if (!ctx->storage) {
      free(ctx);
      return ncclSystemError;
    }
    for (int c = 0; c < NCOLL; c++) {
      ctx->rows[c] = ctx->storage + (size_t)c * table->nrows;
      for (int i = 0; i < table->nrows; i++) {
        struct mplane_tuner_row *r = &table->rows[i];
        if ((r->coll == MPLANE_TUNER_ANY || r->coll == c) && shape_matches(r, nranks, nnodes))
          ctx->rows[c][ctx->count[c]++] = r;
      }
    }
  }
  *out = ctx;
  return ncclSuccess;
}

int mplane_tuner_ctx_rows(const struct mplane_tuner_ctx *ctx, int coll) {
  if (!ctx || coll < 0 || coll >= NCOLL) return 0;
  return ctx->count[coll];
}

void mplane_tuner_ctx_destroy(struct mplane_tuner_ctx *ctx) {
  if (!ctx) return;
  free(ctx->storage);
  free(ctx);
}

/* First time (per process) a row does something, say so: these lines, next to NCCL's own
 * "<Coll>: N Bytes -> Algo X proto Y" TUNING lines, show NCCL taking the table's choice. */
static void note_once(struct mplane_tuner_row *r, int flag, int coll, size_t nbytes, const struct mplane_tuner_ctx *ctx) {
  if (__atomic_fetch_or(&r->noted, flag, __ATOMIC_RELAXED) & flag) return;
  const char *name = ctx->table ? ctx->table->name : "?";
  if (flag == NOTED_APPLIED) {
    char channels[32] = "NCCL's";
    if (r->channels > 0) snprintf(channels, sizeof(channels), "%d", r->channels);
    MP_INFO(NCCL_TUNING, "tuner: %s line %d: %s of %zu bytes (%zu ranks, %zu node%s) -> %s/%s, channels %s (first use of this row)",
            name, r->line, mplane_tuner_coll_name(coll), nbytes, ctx->nranks, ctx->nnodes, ctx->nnodes == 1 ? "" : "s",
            mplane_tuner_algo_name(r->algo), mplane_tuner_proto_name(r->proto), channels);
  } else
    MP_INFO(NCCL_TUNING,
            "tuner: %s line %d: %s/%s is not usable for %s of %zu bytes on this communicator (NCCL marked it "
            "ignored); NCCL decides where this row matches",
            name, r->line, mplane_tuner_algo_name(r->algo), mplane_tuner_proto_name(r->proto),
            mplane_tuner_coll_name(coll), nbytes);
}

enum mplane_tuner_outcome mplane_tuner_ctx_apply(struct mplane_tuner_ctx *ctx, int coll, size_t nbytes,
                                                 float **cost_table, int num_algo, int num_proto, int *nchannels,
                                                 const struct mplane_tuner_row **row_out) {
  if (row_out) *row_out = NULL;
  if (!ctx) return MPLANE_TUNER_PASS;
  __atomic_fetch_add(&ctx->calls, 1, __ATOMIC_RELAXED);
  if (!ctx->active || coll < 0 || coll >= NCOLL || !cost_table || num_algo <= 0 || num_proto <= 0)
    return MPLANE_TUNER_PASS;
  struct mplane_tuner_row **rows = ctx->rows[coll];
  const int n = ctx->count[coll];
  for (int i = 0; i < n; i++) {
    struct mplane_tuner_row *r = rows[i];
    if ((uint64_t)nbytes < r->min_bytes || (uint64_t)nbytes > r->max_bytes) continue;
    /* First match decides. NCCL's table is contiguous float[num_algo][num_proto]. */
    if (row_out) *row_out = r;
    if (r->algo == MPLANE_TUNER_NCCL_CHOICE) { /* channels only: NCCL's algorithm and protocol stand */
      if (nchannels) *nchannels = r->channels;
      __atomic_fetch_add(&ctx->applied, 1, __ATOMIC_RELAXED);
      note_once(r, NOTED_APPLIED, coll, nbytes, ctx);
      return MPLANE_TUNER_APPLIED;
    }
    float *entry = NULL;
    if (r->algo < num_algo && r->proto < num_proto) entry = (float *)cost_table + (size_t)r->algo * num_proto + r->proto;
    if (!entry || *entry < 0.0f) { /* NCCL_ALGO_PROTO_IGNORE (or anything negative NCCL would skip) */
      __atomic_fetch_add(&ctx->unavailable, 1, __ATOMIC_RELAXED);
      note_once(r, NOTED_UNAVAILABLE, coll, nbytes, ctx);
      return MPLANE_TUNER_UNAVAILABLE;
    }
    *entry = 0.0f; /* NCCL takes the smallest non-negative time */
    if (r->channels > 0 && nchannels) *nchannels = r->channels;
    __atomic_fetch_add(&ctx->applied, 1, __ATOMIC_RELAXED);
    note_once(r, NOTED_APPLIED, coll, nbytes, ctx);
    return MPLANE_TUNER_APPLIED;
  }
  return MPLANE_TUNER_PASS;
}

/* ---- process glue ---------------------------------------------------------------------------- */

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static struct mplane_tuner_table *global_table;
static struct mplane_tuner_table *builtin_table; /* atomic: set once, by the net side's init */

ncclResult_t mplane_tuner_set_builtin(const char *name, const char *csv) {
  struct mplane_tuner_table *t = NULL;
  char err[512];
  if (mplane_tuner_table_parse(name, csv, strlen(csv), &t, err, sizeof(err)) != ncclSuccess) {
    MP_WARN("tuner: built-in rows do not parse: %s", err);
    return ncclInternalError;
  }
  struct mplane_tuner_table *none = NULL;
  if (!__atomic_compare_exchange_n(&builtin_table, &none, t, 0, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
    mplane_tuner_table_free(t);
    return ncclSuccess;
  }
  MP_INFO(NCCL_INIT | NCCL_TUNING, "tuner: %d row%s: %s, for communicators of 2 nodes or more where "
          "MPLANE_TUNER_CONFIG names no table", t->nrows, t->nrows == 1 ? "" : "s", name);
  return ncclSuccess;
}
static ncclResult_t global_load_res = ncclSuccess;
static char global_load_err[768];
static int said_forced;

static void load_table(void) {
  const struct mplane_config *cfg = mplane_config_get();
  if (!cfg) { /* load again, privately, for the message that names the variable */
    struct mplane_config *tmp = malloc(sizeof(*tmp));
    char why[512] = "the MPLANE_* environment is invalid";
    if (tmp) mplane_config_load(tmp, why, sizeof(why));
    free(tmp);
    global_load_res = ncclInvalidArgument;
    snprintf(global_load_err, sizeof(global_load_err), "%s (the tuner does not run on an invalid environment)", why);
    return;
  }
  if (!cfg->tuner_config[0]) {
    if (__atomic_load_n(&builtin_table, __ATOMIC_ACQUIRE))
      MP_INFO(NCCL_INIT | NCCL_TUNING, "tuner: MPLANE_TUNER_CONFIG is not set: only %s apply",
              __atomic_load_n(&builtin_table, __ATOMIC_ACQUIRE)->name);
    else
      MP_INFO(NCCL_INIT | NCCL_TUNING,
              "tuner: MPLANE_TUNER_CONFIG is not set: the tuner changes nothing, NCCL chooses algorithms and protocols");
    return;
  }
  char err[sizeof(global_load_err)];
  ncclResult_t res = mplane_tuner_table_load(cfg->tuner_config, &global_table, err, sizeof(err));
  if (res != ncclSuccess) {
    global_load_res = res;
    snprintf(global_load_err, sizeof(global_load_err), "%s", err);
    return;
  }
  MP_INFO(NCCL_INIT | NCCL_TUNING, "tuner: %d row%s from %s", global_table->nrows, global_table->nrows == 1 ? "" : "s",
          global_table->name);
  mplane_tuner_table_warn_overlaps(global_table);
}

/* The user forcing NCCL's choice wins over the table: returns the variable that is set, or NULL. */
static const char *user_forced(const char **value) {
  static const char *const vars[] = {"NCCL_ALGO", "NCCL_PROTO"};
  for (size_t i = 0; i < sizeof(vars) / sizeof(vars[0]); i++) {
    const char *v = getenv(vars[i]);
    if (v && *v) {
      *value = v;
      return vars[i];
    }
  }
  return NULL;
}

ncclResult_t mplane_tuner_init(void **ctx, uint64_t comm_id, size_t nranks, size_t nnodes, ncclDebugLogger_t logger) {
  if (!ctx) return ncclInvalidArgument;
  *ctx = NULL;
  mplane_log_set_logger(logger);
  pthread_once(&load_once, load_table);
  if (global_load_res != ncclSuccess) {
    MP_WARN("tuner: %s", global_load_err);
    return global_load_res;
  }
  /* The user's table, else the transport's built-in rows (several nodes only: they tune the network) */
  struct mplane_tuner_table *table = global_table;
  if (!table && nnodes >= 2) table = __atomic_load_n(&builtin_table, __ATOMIC_ACQUIRE);
  int active = table != NULL;
  const char *value = NULL, *var = active ? user_forced(&value) : NULL;
  if (var) {
    active = 0;
    if (!__atomic_exchange_n(&said_forced, 1, __ATOMIC_RELAXED))
      MP_INFO(NCCL_INIT | NCCL_TUNING | NCCL_ENV,
              "tuner: %s=%s is set by the user: the tuner steps aside and NCCL's choice stands (%s not applied)", var,
              value, table->name);
  }
  struct mplane_tuner_ctx *c;
  ncclResult_t res = mplane_tuner_ctx_create(table, active, comm_id, nranks, nnodes, &c);
  if (res != ncclSuccess) {
    MP_WARN("tuner: out of memory creating the context of comm 0x%" PRIx64, comm_id);
    return res;
  }
  if (active) {
    int kept = 0;
    for (int k = 0; k < NCOLL; k++) kept += c->count[k];
    MP_INFO(NCCL_INIT | NCCL_TUNING,
            "tuner: comm 0x%" PRIx64 " (%zu ranks, %zu node%s): %d row%s of %s apply (allreduce %d, allgather %d, "
            "reducescatter %d, broadcast %d, reduce %d)",
            comm_id, nranks, nnodes, nnodes == 1 ? "" : "s", kept, kept == 1 ? "" : "s", table->name, c->count[ncclFuncAllReduce],
            c->count[ncclFuncAllGather], c->count[ncclFuncReduceScatter], c->count[ncclFuncBroadcast],
            c->count[ncclFuncReduce]);
  }
  *ctx = c;
  return ncclSuccess;
}

ncclResult_t mplane_tuner_get_coll_info(void *ctx, ncclFunc_t coll, size_t nbytes, int num_pipe_ops,
                                        float **cost_table, int num_algo, int num_proto, int reg_buff,
                                        int *nchannels) {
  (void)num_pipe_ops;
  (void)reg_buff;
  mplane_tuner_ctx_apply(ctx, (int)coll, nbytes, cost_table, num_algo, num_proto, nchannels, NULL);
  return ncclSuccess;
}

ncclResult_t mplane_tuner_finalize(void *ctx) {
  struct mplane_tuner_ctx *c = ctx;
  if (!c) return ncclSuccess;
  if (c->active)
    MP_INFO(NCCL_TUNING, "tuner: comm 0x%" PRIx64 " done: %" PRIu64 " calls, %" PRIu64 " set from the table, %" PRIu64
            " where the row's choice was unusable (NCCL decided)",
            c->comm_id, c->calls, c->applied, c->unavailable);
  mplane_tuner_ctx_destroy(c);
  return ncclSuccess;
}
