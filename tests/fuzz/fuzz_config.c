/* Fuzz target: every MPLANE_* value parser and every NCCL_* twin, through the public config
 * functions. The first byte picks the variable (every row mplane_config_describe lists, then every
 * NCCL twin of the table), the rest is its value. An MPLANE_* load must either succeed or name the
 * variable; numbers the strict parser accepts must be written exactly as they print ("4", never
 * " 4", "+4", "04"). An NCCL_* twin never fails the load, whatever its value (NCCL's grammar: a
 * value mplane cannot use is ignored with a WARN), and a number NCCL's parser reads is read alike. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "common/config.h"

static char names[128][64];
static int nnames;
static const char *twins[64], *twin_rows[64];
static int ntwins;

int LLVMFuzzerInitialize(int *argc, char ***argv) {
  (void)argc, (void)argv;
  fuzz_quiet();
  char *text = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&text, &len);
  mplane_config_describe(f, 0);
  fclose(f);
  for (char *line = strtok(text, "\n"); line && nnames < 128; line = strtok(NULL, "\n")) {
    if (strncmp(line, "MPLANE_", 7) != 0) continue;
    size_t n = strcspn(line, " ");
    if (n >= sizeof(names[0])) continue;
    memcpy(names[nnames], line, n);
    names[nnames++][n] = '\0';
  }
  if (nnames < 20) abort();
  for (int i = 0; i < nnames; i++) unsetenv(names[i]);
  ntwins = mplane_config_nccl_twins(twin_rows, twins, 64);
  if (ntwins < 10 || ntwins > 64) abort();
  for (int i = 0; i < ntwins; i++) unsetenv(twins[i]);
  return 0;
}

/* An NCCL twin's value: the load never fails; the twin's number as NCCL's strtoll reads it. */
static int twin_input(const char *name, const char *value) {
  setenv(name, value, 1);
  struct mplane_config cfg;
  char err[2048];
  ncclResult_t res = mplane_config_load(&cfg, err, sizeof(err));
  unsetenv(name);
  FUZZ_REQUIRE(res == ncclSuccess, "%s='%s' (NCCL's own variable) failed the load: %s", name, value, err);
  long v;
  int trailing;
  if (mplane_nccl_parse_number(value, &v, &trailing) == 0) {
    char *end = NULL;
    long long x = strtoll(value, &end, 0);
    FUZZ_REQUIRE(x == v && trailing == (end == value || *end != 0), "'%s' read as %ld, NCCL reads %lld", value, v, x);
  }
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  if (data[0] & 0x80) { /* the NCCL twins */
    char *value = fuzz_cstr(data + 1, size - 1);
    twin_input(twins[(data[0] & 0x7f) % ntwins], value);
    free(value);
    return 0;
  }
  const char *name = names[data[0] % nnames];
  char *value = fuzz_cstr(data + 1, size - 1);
  setenv(name, value, 1);
  struct mplane_config cfg;
  char err[2048];
  ncclResult_t res = mplane_config_load(&cfg, err, sizeof(err));
  unsetenv(name);
  FUZZ_REQUIRE(res == ncclSuccess || res == ncclInvalidArgument, "%s: result %d", name, res);
  if (res != ncclSuccess) FUZZ_REQUIRE(strstr(err, name) != NULL, "message names no variable: %s", err);

  long v;
  if (mplane_parse_long(value, LONG_MIN, LONG_MAX, &v) == 0) {
    char back[32];
    snprintf(back, sizeof(back), "%ld", v);
    FUZZ_REQUIRE(strcmp(back, value) == 0, "'%s' accepted as %ld", value, v);
  }
  free(value);
  return 0;
}
