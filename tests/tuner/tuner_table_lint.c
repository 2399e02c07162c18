/* mplane tests: check a tuner table with the plugin's own parser and print it normalized.
 *
 *   tuner-table-lint TABLE.csv     exit 0 and one line per row; exit 1 with file:line:column: why
 *
 * The autotune test runs it on the table scripts/autotune writes, so the script and the parser
 * agree on the format. */
#include <stdio.h>

#include "tuner/tuner_table.h"

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s TABLE.csv\n", argv[0]);
    return 2;
  }
  struct mplane_tuner_table *t = NULL;
  char err[1024];
  if (mplane_tuner_table_load(argv[1], &t, err, sizeof(err)) != ncclSuccess) {
    fprintf(stderr, "%s\n", err);
    return 1;
  }
  int overlaps = mplane_tuner_table_warn_overlaps(t);
  printf("ok: %d rows, %d overlapping\n", t->nrows, overlaps);
  for (int i = 0; i < t->nrows; i++) {
    const struct mplane_tuner_row *r = &t->rows[i];
    printf("line %d: %s %llu..%lld %s/%s channels %d nodes %d ranks %d\n", r->line, mplane_tuner_coll_name(r->coll),
           (unsigned long long)r->min_bytes, r->max_bytes == MPLANE_TUNER_NO_LIMIT ? -1LL : (long long)r->max_bytes,
           mplane_tuner_algo_name(r->algo), mplane_tuner_proto_name(r->proto), r->channels, r->nodes, r->ranks);
  }
  mplane_tuner_table_free(t);
  return overlaps ? 1 : 0;
}
