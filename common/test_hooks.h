/* mplane: the test hooks, switches that let the test suites reach states a real machine gives only on
 * demand (a CPU stand-in for CUDA, every connection relayed, a failing copy, reader threads that never
 * read). They are not settings: no config row, no README line, and the shipped library never reads
 * them. test_hooks.c is built twice: plainly, into the plugin and tools that ship (every hook answers
 * "unset"), and with -DMPLANE_TEST_HOOKS, into the test build of the plugin (libnccl-net-mplane-test.so)
 * and the core the tests link, where each one is read from the environment. */
#ifndef MPLANE_TEST_HOOKS_H
#define MPLANE_TEST_HOOKS_H

#include <stddef.h>

/* MPLANE_CUDA_LIB: the CUDA driver library to dlopen instead of libcuda.so.1 (tests/fakecuda's
 * stand-in); NULL unset. */
const char *mplane_test_cuda_lib(void);
/* MPLANE_TEST_RELAY_HOST: 0 unset; 1 host buffers on a relayed connection are staged as GPU buffers
 * are; 2 ("all") the same, and every connection counts as relayed. */
int mplane_test_relay_host(void);
/* MPLANE_TEST_RELAY_COPIER=cpu: 1, the relay's copies are done by the CPU stand-in (relay_copier.c). */
int mplane_test_relay_cpu_copier(void);
/* MPLANE_TEST_RELAY_SLOT_BYTES (4 KiB..1 GiB, whole pages): the staging slot size, else dflt. */
size_t mplane_test_relay_slot_bytes(size_t dflt);
/* MPLANE_TEST_RELAY_FAIL=reg: 1, registering a staging ring fails. */
int mplane_test_relay_fail_reg(void);
/* MPLANE_TEST_RELAY_FAIL=copy:N: N, the Nth relay copy (from 1) fails; 0 none. */
unsigned long long mplane_test_relay_fail_copy(void);
/* MPLANE_TEST_RMA_PROGRESS_ONLY=1: 1, the socket transport's one-sided reader threads never read,
 * so rmaProgress alone serves every op. */
int mplane_test_rma_progress_only(void);

#endif
