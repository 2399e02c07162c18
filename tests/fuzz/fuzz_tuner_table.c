/* Fuzz target: the tuner CSV table parser (MPLANE_TUNER_CONFIG). A table either parses, with
 * every row within its documented ranges, or is refused with a message that says where. */
#include <stdlib.h>
#include <string.h>

#include "tuner/tuner_table.h"
#include "fuzz_util.h"

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct mplane_tuner_table *t = NULL;
  char err[1024] = "";
  ncclResult_t res = mplane_tuner_table_parse("fuzz.csv", (const char *)data, size, &t, err, sizeof(err));
  if (res != ncclSuccess) {
    FUZZ_REQUIRE(t == NULL, "table on failure");
    FUZZ_REQUIRE(strncmp(err, "fuzz.csv:", 9) == 0, "message does not say where: %s", err);
    return 0;
  }
  FUZZ_REQUIRE(t != NULL, "no table on success");
  for (int i = 0; i < t->nrows; i++) {
    const struct mplane_tuner_row *r = &t->rows[i];
    FUZZ_REQUIRE(r->min_bytes <= r->max_bytes, "row %d byte range", i);
    FUZZ_REQUIRE(r->channels == MPLANE_TUNER_ANY || (r->channels >= 1 && r->channels <= MPLANE_TUNER_MAX_CHANNELS),
                 "row %d channels %d", i, r->channels);
    FUZZ_REQUIRE(strcmp(mplane_tuner_algo_name(r->algo), "?") != 0, "row %d algo", i);
    FUZZ_REQUIRE(strcmp(mplane_tuner_proto_name(r->proto), "?") != 0, "row %d proto", i);
    FUZZ_REQUIRE(r->overlaps_line == 0 || r->overlaps_line < r->line, "row %d overlap", i);
  }
  mplane_tuner_table_warn_overlaps(t);
  mplane_tuner_table_free(t);
  return 0;
}
