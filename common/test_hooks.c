/* mplane: the test hooks (test_hooks.h). Without MPLANE_TEST_HOOKS (what ships) every hook answers
 * "unset" and no hook's name is in the library; with it (the test build) each is read with getenv. */
#include "test_hooks.h"

#ifdef MPLANE_TEST_HOOKS

#include <stdlib.h>
#include <string.h>

/* Exported by the test build only: a harness that is given a hook checks that the plugin it loaded
 * reads them (tests/test_hooks_check.h), so a hook is never set on a library that ignores it. */
__attribute__((visibility("default"))) const int mplane_test_hooks = 1;

const char *mplane_test_cuda_lib(void) {
  const char *v = getenv("MPLANE_CUDA_LIB");
  return v && *v ? v : NULL;
}

int mplane_test_relay_host(void) {
  const char *v = getenv("MPLANE_TEST_RELAY_HOST");
  if (!v || !*v || strcmp(v, "0") == 0) return 0;
  return strcmp(v, "all") == 0 ? 2 : 1;
}

int mplane_test_relay_cpu_copier(void) {
  const char *v = getenv("MPLANE_TEST_RELAY_COPIER");
  return v && strcmp(v, "cpu") == 0;
}

size_t mplane_test_relay_slot_bytes(size_t dflt) {
  const char *v = getenv("MPLANE_TEST_RELAY_SLOT_BYTES");
  if (!v || !*v) return dflt;
  unsigned long long n = strtoull(v, NULL, 0);
  return n >= 4096 && n <= (1ull << 30) ? (size_t)(n & ~4095ull) : dflt;
}

int mplane_test_relay_fail_reg(void) {
  const char *v = getenv("MPLANE_TEST_RELAY_FAIL");
  return v && strcmp(v, "reg") == 0;
}

unsigned long long mplane_test_relay_fail_copy(void) {
  const char *v = getenv("MPLANE_TEST_RELAY_FAIL");
  return v && strncmp(v, "copy:", 5) == 0 ? strtoull(v + 5, NULL, 10) : 0;
}

int mplane_test_rma_progress_only(void) {
  const char *v = getenv("MPLANE_TEST_RMA_PROGRESS_ONLY");
  return v && !strcmp(v, "1");
}

#else

const char *mplane_test_cuda_lib(void) { return NULL; }
int mplane_test_relay_host(void) { return 0; }
int mplane_test_relay_cpu_copier(void) { return 0; }
size_t mplane_test_relay_slot_bytes(size_t dflt) { return dflt; }
int mplane_test_relay_fail_reg(void) { return 0; }
unsigned long long mplane_test_relay_fail_copy(void) { return 0; }
int mplane_test_rma_progress_only(void) { return 0; }

#endif
