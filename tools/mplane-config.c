/* mplane-config: print every MPLANE_* variable with its default, accepted form and meaning.
 *
 *   mplane-config              plain text
 *   mplane-config --markdown   the table the README carries (a test keeps the two equal)
 *   mplane-config --check      parse the current environment; exit 1 with the error if invalid */
#include <stdio.h>
#include <string.h>

#include "common/config.h"

int main(int argc, char **argv) {
  if (argc > 1 && strcmp(argv[1], "--check") == 0) {
    struct mplane_config cfg;
    char err[512];
    if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess) {
      fprintf(stderr, "mplane-config: %s\n", err);
      return 1;
    }
    printf("mplane-config: environment is valid\n");
    return 0;
  }
  mplane_config_describe(stdout, argc > 1 && strcmp(argv[1], "--markdown") == 0);
  return 0;
}
