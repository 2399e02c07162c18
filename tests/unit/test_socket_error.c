/* The socket transport's error slot (the transport base's, net/transport_base.h): a comm whose
 * error another thread is writing is never reported healthy. mps_error_set claims the slot (state -1) before it formats the message; a check
 * that lands in that window used to answer ncclSuccess, so a caller went on with a failed comm. */
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "net/socket/socket.h"

/* The writer's second half, slowed down: the message and the result arrive 50 ms after the claim. */
static void *finish_later(void *arg) {
  struct mplane_error *e = arg;
  usleep(50 * 1000);
  strcpy(e->msg, "peer 127.0.0.1:1 closed the connection");
  __atomic_store_n(&e->state, (int)ncclRemoteError, __ATOMIC_RELEASE);
  return NULL;
}

static void test_check_waits_for_the_writer(void **state) {
  (void)state;
  struct mplane_error e;
  memset(&e, 0, sizeof(e));
  __atomic_store_n(&e.state, -1, __ATOMIC_RELEASE); /* claimed, as mps_error_set does first */
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, finish_later, &e), 0);
  assert_int_equal(mps_error_check(&e), ncclRemoteError);
  pthread_join(t, NULL);
  assert_int_equal(mps_error_check(&e), ncclRemoteError); /* and it stays */
}

static void test_set_once(void **state) {
  (void)state;
  struct mplane_error e;
  memset(&e, 0, sizeof(e));
  assert_int_equal(mps_error_check(&e), ncclSuccess);
  mps_error_set(&e, ncclSystemError, "first %d", 1);
  mps_error_set(&e, ncclRemoteError, "second");
  assert_int_equal(mps_error_check(&e), ncclSystemError);
  assert_string_equal(e.msg, "first 1");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_check_waits_for_the_writer),
      cmocka_unit_test(test_set_once),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
