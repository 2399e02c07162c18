/* mplane tests: a harness that dlopens the plugin and is given a test hook (MPLANE_TEST_*,
 * MPLANE_CUDA_LIB; common/test_hooks.h) refuses a plugin that does not read them (the shipped build),
 * so that a scenario never passes because the hook it sets was ignored. */
#ifndef MPLANE_TESTS_TEST_HOOKS_CHECK_H
#define MPLANE_TESTS_TEST_HOOKS_CHECK_H

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

extern char **environ;

/* NULL when lib reads the hooks or none is set; else the first hook set (why it is refused). */
static inline const char *test_hooks_unread(void *lib) {
  if (dlsym(lib, "mplane_test_hooks")) return NULL;
  for (char **e = environ; *e; e++)
    if (!strncmp(*e, "MPLANE_TEST_", 12) || !strncmp(*e, "MPLANE_CUDA_LIB=", 16)) return *e;
  return NULL;
}

#endif
