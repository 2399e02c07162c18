/* mplane unit test: the NCCL variables the socket transport sets at init (MPLANE_NCCL_DEFAULTS).
 * NCCL reads NCCL_BUFFSIZE, NCCL_P2P_NET_CHUNKSIZE and NCCL_MIN_NCHANNELS after the net plugin's
 * init, so init's values decide a TCP job's step sizes and channels, by what the link is: 8 MiB
 * buffers and 512 KiB p2p chunks below 100 Gb/s, 4 MiB buffers and at least 8 channels at 100 Gb/s
 * and more, where loopback's rate is the host's (25 Gb/s per usable CPU, at most 400):
 * net/socket/socket_transport.c says why. A value the user set stays, and MPLANE_NCCL_DEFAULTS=0
 * sets nothing. Each case runs init in a child of its own (init runs once a process). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "plugin/net_core.h"

/* Exit codes of the child: 0 when every variable has its expected value (NULL: unset). */
static int check_var(const char *name, const char *want) {
  const char *got = getenv(name);
  if (want == NULL && got == NULL) return 0;
  if (want != NULL && got != NULL && strcmp(want, got) == 0) return 0;
  fprintf(stderr, "%s is '%s', expected '%s'\n", name, got ? got : "(unset)", want ? want : "(unset)");
  return 1;
}

/* Init the socket transport on loopback in a child with env applied; 0 when NCCL_BUFFSIZE,
 * NCCL_P2P_NET_CHUNKSIZE and NCCL_MIN_NCHANNELS then read buffsize, chunksize and channels. */
static int init_on_cpus(int ncpus, const char *const *env, const char *buffsize, const char *chunksize,
                        const char *channels) {
  fflush(stderr);
  pid_t pid = fork();
  assert_true(pid >= 0);
  if (pid == 0) {
    if (ncpus > 0) { /* the first ncpus CPUs this process may use */
      cpu_set_t have, want;
      CPU_ZERO(&want);
      if (sched_getaffinity(0, sizeof(have), &have)) _exit(3);
      for (int c = 0, n = 0; c < CPU_SETSIZE && n < ncpus; c++)
        if (CPU_ISSET(c, &have)) CPU_SET(c, &want), n++;
      if (CPU_COUNT(&want) != ncpus || sched_setaffinity(0, sizeof(want), &want)) _exit(3);
    }
    unsetenv("NCCL_BUFFSIZE");
    unsetenv("NCCL_P2P_NET_CHUNKSIZE");
    unsetenv("NCCL_MIN_NCHANNELS");
    unsetenv("MPLANE_SOCKET_SPEED");
    unsetenv("MPLANE_NCCL_DEFAULTS");
    setenv("MPLANE_TRANSPORT", "socket", 1);
    setenv("MPLANE_SOCKET_IFNAME", "lo", 1);
    for (const char *const *e = env; e && *e; e++) putenv((char *)*e);
    if (mplane_net_global_init(NULL) != ncclSuccess) _exit(2);
    _exit(check_var("NCCL_BUFFSIZE", buffsize) | check_var("NCCL_P2P_NET_CHUNKSIZE", chunksize) |
          check_var("NCCL_MIN_NCHANNELS", channels));
  }
  int st = 0;
  assert_int_equal(waitpid(pid, &st, 0), pid);
  return WIFEXITED(st) ? WEXITSTATUS(st) : 100 + WTERMSIG(st);
}

static int init_and_check(const char *const *env, const char *buffsize, const char *chunksize, const char *channels) {
  return init_on_cpus(0, env, buffsize, chunksize, channels);
}

static int cpus_usable(void) {
  cpu_set_t have;
  return sched_getaffinity(0, sizeof(have), &have) ? 1 : CPU_COUNT(&have);
}

static void test_slow_link_sets_step_sizes(void **state) {
  (void)state;
  const char *const env[] = {"MPLANE_SOCKET_SPEED=25000", NULL}; /* a 25 GbE NIC's rate */
  assert_int_equal(init_and_check(env, "8388608", "524288", NULL), 0);
}

static void test_fast_link_sets_buffers_and_channels(void **state) {
  (void)state;
  const char *const env[] = {"MPLANE_SOCKET_SPEED=100000", NULL}; /* a 100 GbE NIC's rate */
  assert_int_equal(init_and_check(env, "4194304", "524288", "8"), 0);
}

/* Loopback at the automatic rate: the host's, by its CPUs. One CPU (25 Gb/s) gets the step sizes
 * of a slow link, four (100 Gb/s) those of a fast one, where this machine has four. */
static void test_loopback_rate_by_cpus(void **state) {
  (void)state;
  assert_int_equal(init_on_cpus(1, NULL, "8388608", "524288", NULL), 0);
  if (cpus_usable() >= 4) assert_int_equal(init_on_cpus(4, NULL, "4194304", "524288", "8"), 0);
  else fprintf(stderr, "(fewer than 4 CPUs here: the 4-CPU loopback case is left out)\n");
}

static void test_user_value_stays(void **state) {
  (void)state;
  const char *const env[] = {"NCCL_BUFFSIZE=2097152", "NCCL_MIN_NCHANNELS=2", NULL};
  assert_int_equal(init_and_check(env, "2097152", "524288", "2"), 0);
}

static void test_defaults_off(void **state) {
  (void)state;
  const char *const env[] = {"MPLANE_NCCL_DEFAULTS=0", NULL};
  assert_int_equal(init_and_check(env, NULL, NULL, NULL), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_slow_link_sets_step_sizes),
      cmocka_unit_test(test_fast_link_sets_buffers_and_channels),
      cmocka_unit_test(test_loopback_rate_by_cpus),
      cmocka_unit_test(test_user_value_stays),
      cmocka_unit_test(test_defaults_off),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
