/* Fuzz target: every MPLANE_* value parser, through the public config functions. The first byte
 * picks the variable (every row mplane_config_describe lists), the rest is its value; the load must
 * either succeed or name the variable. Numbers the strict parser accepts must be written exactly as
 * they print ("4", never " 4", "+4", "04"). */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "fuzz_util.h"
#include "common/config.h"

static char names[128][64];
static int nnames;

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
  return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
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
