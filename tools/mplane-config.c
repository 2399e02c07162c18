/* mplane-config: print every MPLANE_* variable with its default, accepted form and meaning.
 *
 *   mplane-config              plain text
 *   mplane-config --markdown   the table the README carries (a test keeps the two equal)
 *   mplane-config --check      parse the current environment; exit 1 with the error if invalid
 *   mplane-config --help       this usage; exit 0
 * Anything else is refused with an error naming it, the usage, and exit 2. */
#include <stdio.h>
#include <string.h>

#include "common/config.h"

static void usage(FILE *out) {
  fprintf(out,
          "usage: mplane-config [--markdown | --check | --help]\n"
          "  (no option)  every MPLANE_* variable: default, accepted form, meaning\n"
          "  --markdown   the same as the README's Markdown table\n"
          "  --check      parse the current environment; exit 1 with the error if a value is invalid\n"
          "  --help       this text\n");
}

int main(int argc, char **argv) {
  const char *opt = argc > 1 ? argv[1] : NULL;
  if (argc > 2) {
    fprintf(stderr, "mplane-config: unexpected argument '%s' after %s\n", argv[2], argv[1]);
    usage(stderr);
    return 2;
  }
  if (opt && strcmp(opt, "--help") == 0) {
    usage(stdout);
    return 0;
  }
  if (opt && strcmp(opt, "--check") == 0) {
    struct mplane_config cfg;
    char err[512];
    /* the plugin's variables, then libmplane-ep's (MPLANE_EP_*) */
    if (mplane_config_load(&cfg, err, sizeof(err)) != ncclSuccess ||
        mplane_config_load_ep(&cfg, err, sizeof(err)) != ncclSuccess) {
      fprintf(stderr, "mplane-config: %s\n", err);
      return 1;
    }
    printf("mplane-config: environment is valid\n");
    return 0;
  }
  if (opt && strcmp(opt, "--markdown") != 0) {
    fprintf(stderr, "mplane-config: unknown option '%s'\n", opt);
    usage(stderr);
    return 2;
  }
  mplane_config_describe(stdout, opt != NULL);
  return 0;
}
