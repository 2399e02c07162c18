/* Unit tests: the listen handle NCCL carries between ranks (net/handle.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "net/handle.h"
#include "common/nccl/net.h"

static struct mplane_handle sample(uint8_t transport, uint8_t len) {
  struct mplane_handle h;
  memset(&h, 0, sizeof(h));
  h.version = MPLANE_PROTOCOL_VERSION;
  h.transport = transport;
  h.plane = -3;
  h.node_id = 0x0123456789abcdefull;
  h.payload_len = len;
  for (int i = 0; i < len; i++) h.payload[i] = (uint8_t)(i * 37 + 1);
  return h;
}

static void test_fits_nccl(void **state) {
  (void)state;
  assert_int_equal(MPLANE_HANDLE_SIZE, NCCL_NET_HANDLE_MAXSIZE);
  assert_int_equal(MPLANE_HANDLE_HEADER + MPLANE_HANDLE_PAYLOAD_MAX, MPLANE_HANDLE_SIZE);
}

static void test_round_trip(void **state) {
  (void)state;
  const uint8_t transports[] = {MPLANE_HANDLE_SOCKET, MPLANE_HANDLE_IB};
  const uint8_t lens[] = {0, 1, 16, 28, MPLANE_HANDLE_PAYLOAD_MAX};
  const int8_t planes[] = {-1, 0, 7, 127, -128};
  for (size_t t = 0; t < sizeof(transports); t++)
    for (size_t l = 0; l < sizeof(lens); l++)
      for (size_t p = 0; p < sizeof(planes); p++) {
        struct mplane_handle in = sample(transports[t], lens[l]), out;
        in.plane = planes[p];
        uint8_t buf[MPLANE_HANDLE_SIZE + 8];
        memset(buf, 0xcc, sizeof(buf));
        assert_int_equal(mplane_handle_encode(&in, buf), ncclSuccess);
        for (size_t i = MPLANE_HANDLE_SIZE; i < sizeof(buf); i++) assert_int_equal(buf[i], 0xcc); /* no overrun */
        /* Bytes after the payload are zero: NCCL copies all 128 bytes and connect keeps state there. */
        for (size_t i = MPLANE_HANDLE_HEADER + lens[l]; i < MPLANE_HANDLE_SIZE; i++) assert_int_equal(buf[i], 0);
        char why[256] = "";
        assert_int_equal(mplane_handle_decode(buf, &out, why, sizeof(why)), ncclSuccess);
        assert_int_equal(out.version, in.version);
        assert_int_equal(out.transport, in.transport);
        assert_int_equal(out.plane, in.plane);
        assert_true(out.node_id == in.node_id);
        assert_int_equal(out.payload_len, in.payload_len);
        assert_memory_equal(out.payload, in.payload, in.payload_len);
      }
}

/* The wire layout is fixed (little endian), whatever the host: check it byte by byte. */
static void test_layout(void **state) {
  (void)state;
  struct mplane_handle in = sample(MPLANE_HANDLE_IB, 3);
  uint8_t buf[MPLANE_HANDLE_SIZE];
  assert_int_equal(mplane_handle_encode(&in, buf), ncclSuccess);
  assert_memory_equal(buf, "MPLN", 4);
  assert_int_equal(buf[4], MPLANE_PROTOCOL_VERSION & 0xff);
  assert_int_equal(buf[5], MPLANE_PROTOCOL_VERSION >> 8);
  assert_int_equal(buf[6], MPLANE_HANDLE_IB);
  assert_int_equal((int8_t)buf[7], -3);
  const uint8_t node[8] = {0xef, 0xcd, 0xab, 0x89, 0x67, 0x45, 0x23, 0x01};
  assert_memory_equal(buf + 8, node, 8);
  assert_int_equal(buf[16], 3);
  assert_memory_equal(buf + 17, in.payload, 3);
}

static void encode(uint8_t *buf) {
  struct mplane_handle in = sample(MPLANE_HANDLE_SOCKET, 16);
  assert_int_equal(mplane_handle_encode(&in, buf), ncclSuccess);
}

static void test_bad_magic(void **state) {
  (void)state;
  for (int byte = 0; byte < 4; byte++) {
    uint8_t buf[MPLANE_HANDLE_SIZE];
    encode(buf);
    buf[byte] ^= 0x20;
    struct mplane_handle out;
    char why[256] = "";
    assert_int_equal(mplane_handle_decode(buf, &out, why, sizeof(why)), ncclInvalidUsage);
    assert_non_null(strstr(why, "not an mplane handle"));
    assert_non_null(strstr(why, "NCCL_NET_PLUGIN")); /* says what to do */
  }
  /* All zeros (NCCL's own socket handle starts with a sockaddr) and all ones. */
  uint8_t zeros[MPLANE_HANDLE_SIZE] = {0}, ones[MPLANE_HANDLE_SIZE];
  memset(ones, 0xff, sizeof(ones));
  struct mplane_handle out;
  char why[256];
  assert_int_equal(mplane_handle_decode(zeros, &out, why, sizeof(why)), ncclInvalidUsage);
  assert_int_equal(mplane_handle_decode(ones, &out, why, sizeof(why)), ncclInvalidUsage);
}

static void test_other_version(void **state) {
  (void)state;
  const uint16_t versions[] = {0, MPLANE_PROTOCOL_VERSION + 1, 0x100 | MPLANE_PROTOCOL_VERSION, 0xffff};
  for (size_t i = 0; i < sizeof(versions) / sizeof(versions[0]); i++) {
    uint8_t buf[MPLANE_HANDLE_SIZE];
    encode(buf);
    buf[4] = (uint8_t)versions[i];
    buf[5] = (uint8_t)(versions[i] >> 8);
    struct mplane_handle out;
    char why[256] = "", num[16];
    assert_int_equal(mplane_handle_decode(buf, &out, why, sizeof(why)), ncclInvalidUsage);
    snprintf(num, sizeof(num), "%u", versions[i]);
    if (!strstr(why, "version") || !strstr(why, num)) fail_msg("version %u: message does not say so: %s", versions[i], why);
  }
}

static void test_bad_transport(void **state) {
  (void)state;
  const uint8_t bad[] = {0, 3, 0x81, 0xff};
  for (size_t i = 0; i < sizeof(bad); i++) {
    uint8_t buf[MPLANE_HANDLE_SIZE];
    encode(buf);
    buf[6] = bad[i];
    struct mplane_handle out;
    char why[256] = "";
    assert_int_equal(mplane_handle_decode(buf, &out, why, sizeof(why)), ncclInvalidUsage);
    assert_non_null(strstr(why, "transport"));
  }
}

static void test_payload_too_long(void **state) {
  (void)state;
  /* encode refuses to write past 128 bytes */
  struct mplane_handle in = sample(MPLANE_HANDLE_SOCKET, 0);
  in.payload_len = MPLANE_HANDLE_PAYLOAD_MAX + 1;
  uint8_t buf[MPLANE_HANDLE_SIZE + 64];
  memset(buf, 0xcc, sizeof(buf));
  assert_int_not_equal(mplane_handle_encode(&in, buf), ncclSuccess);
  for (size_t i = MPLANE_HANDLE_SIZE; i < sizeof(buf); i++) assert_int_equal(buf[i], 0xcc);
  in.payload_len = 255;
  assert_int_not_equal(mplane_handle_encode(&in, buf), ncclSuccess);
  /* decode refuses a length byte that points past the handle */
  const uint8_t lens[] = {MPLANE_HANDLE_PAYLOAD_MAX + 1, 200, 255};
  for (size_t i = 0; i < sizeof(lens); i++) {
    encode(buf);
    buf[16] = lens[i];
    struct mplane_handle out;
    char why[256] = "";
    assert_int_equal(mplane_handle_decode(buf, &out, why, sizeof(why)), ncclInvalidUsage);
    assert_non_null(strstr(why, "payload"));
  }
}

static void test_why_truncates(void **state) {
  (void)state;
  uint8_t buf[MPLANE_HANDLE_SIZE] = {0};
  struct mplane_handle out;
  char why[12];
  memset(why, 0x7f, sizeof(why));
  assert_int_equal(mplane_handle_decode(buf, &out, why, 8), ncclInvalidUsage);
  assert_int_equal(strlen(why), 7);
  for (size_t i = 8; i < sizeof(why); i++) assert_int_equal((unsigned char)why[i], 0x7f);
}

static void test_hash_and_node_id(void **state) {
  (void)state;
  assert_true(mplane_hash64("a", 1, 0) != mplane_hash64("b", 1, 0));
  assert_true(mplane_hash64("a", 1, 0) != mplane_hash64("a", 1, 1));
  assert_true(mplane_hash64("abc", 3, 5) == mplane_hash64("abc", 3, 5));
  /* NCCL_HOSTID decides the node id (tests emulate nodes with it); stable for the process. */
  setenv("NCCL_HOSTID", "node-a", 1);
  uint64_t id = mplane_node_id();
  assert_true(id == mplane_hash64("node-a", 6, 1));
  setenv("NCCL_HOSTID", "node-b", 1);
  assert_true(mplane_node_id() == id);
  unsetenv("NCCL_HOSTID");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fits_nccl),        cmocka_unit_test(test_round_trip),
      cmocka_unit_test(test_layout),           cmocka_unit_test(test_bad_magic),
      cmocka_unit_test(test_other_version),    cmocka_unit_test(test_bad_transport),
      cmocka_unit_test(test_payload_too_long), cmocka_unit_test(test_why_truncates),
      cmocka_unit_test(test_hash_and_node_id),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
