/* mplane: the tuner table (MPLANE_TUNER_CONFIG), a CSV file with a header line:
 *
 *   collective,min_bytes,max_bytes,algorithm,protocol,channels,nodes,ranks
 *   allreduce,0,65536,ring,ll,-1,1,8
 *
 * One row says: for this collective, at sizes min_bytes..max_bytes (inclusive, NCCL's nBytes), on a
 * communicator of this many nodes and ranks, use this algorithm and protocol (and this many channels).
 * -1 means "any" (for max_bytes: no upper bound; for channels: NCCL decides). Columns may come in any
 * order; blank lines and lines starting with '#' are ignored; sizes take K/M/G/T suffixes (x1024).
 * Rows are tried in file order and the first match wins. */
#ifndef MPLANE_TUNER_TABLE_H
#define MPLANE_TUNER_TABLE_H

#include <stddef.h>
#include <stdint.h>
#include "common/nccl/tuner.h"

#define MPLANE_TUNER_ANY (-1)
#define MPLANE_TUNER_NCCL_CHOICE (-1) /* algorithm/protocol: left to NCCL */
#define MPLANE_TUNER_NO_LIMIT UINT64_MAX
#define MPLANE_TUNER_MAX_ROWS 4096
#define MPLANE_TUNER_MAX_FILE_BYTES (4L << 20)
#define MPLANE_TUNER_MAX_CHANNELS 64 /* NCCL's MAXCHANNELS; NCCL caps at what the communicator has */

struct mplane_tuner_row {
  int coll;           /* ncclFunc_t (broadcast..allreduce) or MPLANE_TUNER_ANY */
  uint64_t min_bytes; /* inclusive */
  uint64_t max_bytes; /* inclusive; MPLANE_TUNER_NO_LIMIT for -1 */
  int algo;           /* NCCL_ALGO_*, or MPLANE_TUNER_NCCL_CHOICE (the row sets channels only) */
  int proto;          /* NCCL_PROTO_*, or MPLANE_TUNER_NCCL_CHOICE */
  int channels;       /* 1..MPLANE_TUNER_MAX_CHANNELS, or MPLANE_TUNER_ANY */
  int nodes;          /* exact node count, or MPLANE_TUNER_ANY */
  int ranks;          /* exact rank count, or MPLANE_TUNER_ANY */
  int line;           /* 1-based line in the file */
  int overlaps_line;  /* line of the first earlier row this one overlaps (that row wins there); 0: none */
  int noted;          /* once-per-process log flags, see tuner_core.c (atomic) */
};

struct mplane_tuner_table {
  char name[512]; /* the path, for messages */
  int nrows;
  struct mplane_tuner_row *rows;
};

/* Parse a table from text. name is used in messages. On a bad table returns ncclInvalidArgument and
 * writes "name:line:column: what is wrong (what is accepted)" into err. Overlaps are recorded in
 * rows[i].overlaps_line, not reported (see mplane_tuner_table_warn_overlaps). */
ncclResult_t mplane_tuner_table_parse(const char *name, const char *text, size_t len,
                                      struct mplane_tuner_table **out, char *err, size_t errlen);

/* Read and parse a file (at most MPLANE_TUNER_MAX_FILE_BYTES). */
ncclResult_t mplane_tuner_table_load(const char *path, struct mplane_tuner_table **out, char *err, size_t errlen);

void mplane_tuner_table_free(struct mplane_tuner_table *table);

/* One WARN for each row that overlaps an earlier one, naming both lines. Returns how many. */
int mplane_tuner_table_warn_overlaps(const struct mplane_tuner_table *table);

/* Names as the table and the logs write them ("allreduce", "ring", "ll128"); "?" when out of range. */
const char *mplane_tuner_coll_name(int coll);
const char *mplane_tuner_algo_name(int algo);
const char *mplane_tuner_proto_name(int proto);

#endif
